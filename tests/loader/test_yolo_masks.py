"""make_loader(recipe="yolo") on a dataset with masks: the class mask and each box's own mask follow the mosaic.

The pictures hold red shapes on grey, labelled by YOLO-seg outlines, which
prepare paints into `mask.png` (box class c as c + 1) and `instances.png`
(box n as n + 1). Through the recipe (mosaic, scale and shift, flips, and
with rotation and shear, or copy-paste's mirrored copies; HSV off so that red stays red and the fill stays
114), each delivered box mask must lie on red pixels and within its box,
the class mask must hold the box's class under it and the ignore index
exactly where the output shows the fill; threads give what processes give;
MixUp and CutMix keep one mask per box; masks=False reads none.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import red_shapes
import torch
from red_shapes import write_source

from pipeline import make_loader

CROP = 160
NO_HSV = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0}
IGNORE = 255


def diamonds(rng: np.random.Generator, width: int, height: int) -> list[np.ndarray]:
    """A diamond in each half of the picture."""
    found = []
    for label in range(2):
        x0 = (0.05 + 0.5 * label + rng.uniform(0, 0.1)) * width
        y0 = rng.uniform(0.1, 0.4) * height
        w, h = rng.uniform(0.2, 0.3) * width, rng.uniform(0.3, 0.5) * height
        found.append(np.array([(x0 + w / 2, y0), (x0 + w, y0 + h / 2), (x0 + w / 2, y0 + h), (x0, y0 + h / 2)]))
    return found


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("masks")
    source = write_source(base / "source", diamonds, count=12, seed=11, names=("left", "right"))
    return red_shapes.prepared(source, base / "out", 256)


def batches(prepared: Path, hyp: dict[str, float], worker_type: str = "thread", **settings: object) -> list:
    loader = make_loader(str(prepared), 4, device="cpu", crop=CROP, num_workers=2, dtype="uint8", recipe="yolo", seed=3,
                         hyp={**NO_HSV, **hyp}, worker_type=worker_type, **settings)  # fmt: skip
    return [batch for _ in range(2) for batch in loader]


@pytest.mark.parametrize(
    "hyp", [{}, {"degrees": 25.0, "shear": 5.0, "flipud": 0.5}, {"copy_paste": 1.0}], ids=["defaults", "rotated", "copy_paste"]
)
def test_each_boxs_mask_and_the_class_mask_follow_the_pixels(prepared: Path, hyp: dict[str, float]) -> None:
    checked = filled = 0
    for batch in batches(prepared, hyp):
        assert batch.masks is not None and batch.masks.shape == (len(batch.images), CROP, CROP)
        assert batch.instance_masks is not None
        for image, own, classes, boxes, labels in zip(batch.images.numpy(), batch.instance_masks, batch.masks.numpy(),
                                                      batch.boxes, batch.box_labels):  # fmt: skip
            assert own.shape == (len(boxes), CROP, CROP)
            red = (image[0] > 180) & (image[1] < 90)
            fill = (image == 114).all(axis=0)
            inner = np.zeros_like(fill)
            inner[2:-2, 2:-2] = True  # the output's edge rows may be either
            grown = fill | np.roll(fill, 1, 0) | np.roll(fill, -1, 0) | np.roll(fill, 1, 1) | np.roll(fill, -1, 1)
            if (fill & inner).sum() > 20:
                assert (classes[fill & inner] == IGNORE).mean() > 0.97  # the fill: no class
                filled += 1
            assert (classes[~grown & inner] != IGNORE).all()  # a source everywhere else
            for mask, box, label in zip(own.numpy().astype(bool), boxes.numpy(), labels.numpy()):
                if mask.sum() < 80:  # the blended rim of a small shape is most of it
                    continue
                ys, xs = np.nonzero(mask)
                assert xs.min() >= box[0] - 1.5 and xs.max() + 1 <= box[2] + 1.5, (xs.min(), xs.max(), box)
                assert ys.min() >= box[1] - 1.5 and ys.max() + 1 <= box[3] + 1.5, (ys.min(), ys.max(), box)
                assert red[mask].mean() > 0.85, red[mask].mean()
                assert (classes[mask] == label + 1).mean() > 0.99
                checked += 1
    assert checked >= 30 and filled >= 3


def test_threads_and_processes_deliver_the_same_masks(prepared: Path) -> None:
    hyp = {"degrees": 10.0}
    for ours, theirs in zip(batches(prepared, hyp), batches(prepared, hyp, "process")):
        assert torch.equal(ours.masks, theirs.masks)
        assert all(torch.equal(a, b) for a, b in zip(ours.instance_masks, theirs.instance_masks))


def test_mixup_and_cutmix_keep_a_mask_for_each_box(prepared: Path) -> None:
    plain = sum(len(b) for batch in batches(prepared, {}) for b in batch.boxes)
    mixed = 0
    for batch in batches(prepared, {"mixup": 1.0, "cutmix": 1.0}):
        for own, boxes in zip(batch.instance_masks, batch.boxes):
            assert len(own) == len(boxes)
            mixed += len(boxes)
            for mask, box in zip(own.numpy().astype(bool), boxes.numpy()):
                if mask.any():  # a pasted box's mask is cut to its rectangle with it
                    ys, xs = np.nonzero(mask)
                    assert xs.min() >= box[0] - 1.5 and xs.max() + 1 <= box[2] + 1.5
                    assert ys.min() >= box[1] - 1.5 and ys.max() + 1 <= box[3] + 1.5
        assert batch.masks is not None and (batch.masks == IGNORE).any()  # blended images' disagreements
    assert mixed > plain


def test_masks_false_reads_no_masks(prepared: Path) -> None:
    for batch in batches(prepared, {}, masks=False):
        assert batch.masks is None and batch.instance_masks is None
        assert batch.polygons is not None and batch.boxes is not None
