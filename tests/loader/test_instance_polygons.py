"""YOLO-seg and COCO polygons kept per instance through prepare and delivered moved with their boxes.

The scene is the EXIF-rotated photo of `test_label_frames` (a red object,
stored turned a quarter): its YOLO-seg polygon, upright fractions, must come
out of the loader on the object's pixels, cropped, flipped and letterboxed
as the boxes and pixels are.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from pipeline import PrepareSpec, ResizeSpec, make_loader, prepare_dataset
from pipeline.demo import make_coco_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "prepare"))
from test_label_frames import OBJECT, UPRIGHT, write_photo  # noqa: E402


def inside(points: np.ndarray, size: int) -> np.ndarray:
    """Pixels whose centre lies inside the polygon (even-odd), an `size` x `size` picture."""
    canvas = Image.new("L", (size * 4, size * 4))
    ImageDraw.Draw(canvas).polygon([(float(x) * 4, float(y) * 4) for x, y in points], fill=255)
    return np.asarray(canvas.resize((size, size), Image.Resampling.BOX)) >= 128


def yolo_seg(root: Path) -> Path:
    write_photo(root / "images" / "a.jpg")
    (root / "labels").mkdir()
    x0, y0, x1, y1 = (v / s for v, s in zip(OBJECT, UPRIGHT * 2))
    # The object's square as a polygon, and a triangle in the picture's top-left corner.
    (root / "labels" / "a.txt").write_text(
        f"0 {x0} {y0} {x1} {y0} {x1} {y1} {x0} {y1}\n1 0.0 0.0 0.3 0.0 0.0 0.45\n"
    )
    (root / "data.yaml").write_text("names: [object, corner]\n")
    return root


def test_yolo_seg_polygons_are_delivered_on_their_pixels_under_every_recipe(tmp_path: Path) -> None:
    root = yolo_seg(tmp_path / "yolo")
    out = tmp_path / "out"
    prepare_dataset(PrepareSpec(str(root), str(out), resize=ResizeSpec(size=200, mode="shorter")), workers=0)
    assert "polygons.json" in json.loads((out / "manifest.json").read_text())["fields"]
    checked = 0
    for recipe, train, seed in [("letterbox", False, 0), ("crop", True, 1), ("crop", True, 2), ("scale_jitter", True, 3),
                                ("crop", False, 0)]:  # fmt: skip
        loader = make_loader(str(out), 1, device="cpu", crop=128, num_workers=1, train=train, recipe=recipe, seed=seed,
                             dtype="uint8", min_visible=0.0)  # fmt: skip
        for batch in loader:
            target = batch.targets[0]
            red = (batch.images[0, 0].numpy() > 180) & (batch.images[0, 1].numpy() < 80)
            assert len(target["polygons"]) == len(target["boxes"]) == len(target["masks"])
            for label, box, parts, own in zip(target["labels"], target["boxes"], target["polygons"], target["masks"]):
                [points] = parts  # one polygon per YOLO-seg line
                assert points.dtype.is_floating_point and points.shape[1] == 2
                if label == 0:  # the square: its polygon's bounds are its box, exactly
                    lo, hi = points.min(0).values, points.max(0).values
                    assert [*lo.tolist(), *hi.tolist()] == pytest.approx(box.tolist(), abs=1e-3), recipe
                else:  # the triangle: inside its box
                    assert (points.min(0).values >= box[:2] - 1e-3).all() and (points.max(0).values <= box[2:] + 1e-3).all()
                drawn = inside(points.numpy(), 128)
                mask = own.numpy().astype(bool)
                # the rasterised instance (nearest-sampled from prepare's size): they differ along the outline only
                outline = float(np.linalg.norm(np.diff(points.numpy(), axis=0, append=points.numpy()[:1]), axis=1).sum())
                assert (drawn ^ mask).sum() <= outline + 4, (recipe, label, int((drawn ^ mask).sum()), outline)
                if label == 0 and drawn.sum() > 100:  # and on the object's pixels
                    assert red[drawn].mean() > 0.9, recipe
                checked += 1
    assert checked >= 6


def test_coco_polygons_are_kept_per_object_and_rle_objects_have_none(tmp_path: Path) -> None:
    polygons = make_coco_dataset(tmp_path / "coco", images=6, segmentation="polygon")
    prepare_dataset(PrepareSpec(polygons, str(tmp_path / "out")), workers=0)
    loader = make_loader(str(tmp_path / "out"), 6, device="cpu", crop=96, num_workers=1, train=False)
    batch = next(iter(loader))
    assert batch.polygons is not None
    for boxes, parts in zip(batch.boxes, batch.polygons):
        assert len(parts) == len(boxes) and all(len(p) >= 1 for p in parts)
    rle = make_coco_dataset(tmp_path / "rle", images=6, segmentation="rle")
    prepare_dataset(PrepareSpec(rle, str(tmp_path / "rle-out")), workers=0)
    batch = next(iter(make_loader(str(tmp_path / "rle-out"), 6, device="cpu", crop=96, num_workers=1, train=False)))
    assert batch.polygons is not None and all(parts == [] for image in batch.polygons for parts in image)
    assert all(len(masks) == len(boxes) for masks, boxes in zip(batch.instance_masks or [], batch.boxes or []))


def test_a_damaged_polygons_member_is_sample_damage(tmp_path: Path) -> None:
    import io
    import tarfile

    root = yolo_seg(tmp_path / "yolo")
    out = tmp_path / "out"
    prepare_dataset(PrepareSpec(str(root), str(out), resize=ResizeSpec(size=100, mode="shorter")), workers=0)
    [shard] = sorted(out.glob("shard-*.tar"))
    members = []
    with tarfile.open(shard) as tar:
        for member in tar:
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            members.append((member.name, b"[[[1,2,3]],[]]" if member.name.endswith("polygons.json") else data))
    with tarfile.open(shard, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    loader = make_loader(str(out), 1, device="cpu", crop=64, num_workers=1, train=False, on_error="raise")
    with pytest.raises(Exception, match="polygons.json.*at least three"):
        list(loader)
