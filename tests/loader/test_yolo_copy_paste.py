"""make_loader(recipe="yolo", hyp={"copy_paste": ...}) on a YOLO-seg dataset: ultralytics' CopyPaste (mode "flip").

The pictures of `test_yolo_polygons` (red convex shapes on grey, labelled
by their outlines), once with their outlines and once with boxes only.
Copy-paste draws nothing, so with it each output keeps the same mosaic,
warp and flips: its boxes are the plain output's, then the copies', each
copy's outline on red pixels (its object's mirror image), and the pixels
differ from the plain output's only where something was pasted. Without
polygons, and in the `close_mosaic` epochs, it does nothing, as
ultralytics'.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import red_shapes
from red_shapes import write_source
from test_yolo_polygons import CROP, NO_HSV, inside, shapes

from pipeline import make_loader


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same pictures prepared twice: with their outlines (YOLO-seg) and with their boxes only (detection)."""
    base = tmp_path_factory.mktemp("copy-paste")
    outs = []
    for kind in ("seg", "boxes"):
        source = write_source(base / kind, shapes, count=16, seed=11, names=("hexagon", "triangle"),
                              boxes_only=kind == "boxes")  # fmt: skip
        outs.append(red_shapes.prepared(source, base / f"{kind}-out", 256))
    return outs[0], outs[1]


def delivered(shards: Path, copy_paste: float, **settings: object) -> list:
    loader = make_loader(str(shards), 4, device="cpu", crop=CROP, num_workers=2, dtype="uint8", recipe="yolo", seed=5,
                         hyp={**NO_HSV, "copy_paste": copy_paste}, **settings)  # fmt: skip
    out = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        out += [(batch.images.numpy(), [b.numpy() for b in batch.boxes], batch.polygons) for batch in loader]
    return out


def test_copies_join_the_boxes_and_show_their_objects_mirrored(prepared: tuple[Path, Path]) -> None:
    seg, _ = prepared
    plain, pasted = delivered(seg, 0.0), delivered(seg, 1.0)
    copies = changed = 0
    for (images, boxes, _), (pasted_images, pasted_boxes, polygons) in zip(plain, pasted):
        assert polygons is not None
        for image, own, shown, with_copies, outlines in zip(images, boxes, pasted_images, pasted_boxes, polygons):
            # the same mosaic, warp and flips: the plain boxes first, then the copies
            assert np.array_equal(with_copies[: len(own)], own)
            assert len(outlines) == len(with_copies)
            red = (shown[0] > 180) & (shown[1] < 90)
            for box, parts in zip(with_copies[len(own) :], outlines[len(own) :]):
                stacked = np.concatenate([p.numpy() for p in parts])
                assert np.allclose([*stacked.min(0), *stacked.max(0)], box, atol=1e-3)
                for points in parts:
                    drawn = inside(points.numpy(), CROP)
                    if drawn.sum() >= 30:  # a pasted object is its mirrored original: red under its outline
                        assert red[drawn].mean() > 0.85, red[drawn].mean()
                        copies += 1
            changed += int(not np.array_equal(image, shown))
    assert copies >= 10 and changed >= 10, (copies, changed)


def test_without_polygons_or_in_the_close_mosaic_epochs_it_does_nothing(prepared: tuple[Path, Path]) -> None:
    seg, boxes_only = prepared
    for (a, a_boxes, _), (b, b_boxes, _) in zip(delivered(boxes_only, 0.0), delivered(boxes_only, 1.0)):
        assert np.array_equal(a, b) and all(np.array_equal(x, y) for x, y in zip(a_boxes, b_boxes))
    closing = {"epochs": 2, "close_mosaic": 1}
    plain, pasted = delivered(seg, 0.0, **closing), delivered(seg, 1.0, **closing)
    half = len(plain) // 2
    assert any(len(x) != len(y) for p, q in zip(plain[:half], pasted[:half]) for x, y in zip(p[1], q[1]))
    for (a, a_boxes, _), (b, b_boxes, _) in zip(plain[half:], pasted[half:]):  # the last epoch: no mosaic, no copies
        assert np.array_equal(a, b) and all(np.array_equal(x, y) for x, y in zip(a_boxes, b_boxes))
