"""Labels read in the frame their own tools use: YOLO's upright, COCO's and VOC's decided by their declared size.

The scene: a 300x200 upright photo with a red object at x 200-259, y 40-99,
stored rotated (EXIF orientation 6: the raster is 200x300 and turns a
quarter clockwise to stand upright). Wherever its labels come from, the
prepared box must sit on the red pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline import PrepareSpec, ResizeSpec, make_loader, prepare_dataset

UPRIGHT = (300, 200)
OBJECT = (200, 40, 260, 100)  # x0, y0, x1, y1 in the upright picture
STORED_OBJECT = (40, 40, 100, 100)  # the same pixels in the stored (turned back) raster: x = y, y = 300 - x


def write_photo(path: Path, orientation: int = 6) -> None:
    upright = Image.new("RGB", UPRIGHT, (30, 60, 90))
    upright.paste((230, 20, 20), OBJECT)
    stored = upright.transpose(Image.Transpose.ROTATE_90) if orientation == 6 else upright
    exif = Image.Exif()
    exif[0x0112] = orientation
    path.parent.mkdir(parents=True, exist_ok=True)
    stored.save(path, "JPEG", quality=95, exif=exif)


def prepared_box(source: str, out: Path, **spec: object) -> tuple[list[float], np.ndarray, dict]:
    result = prepare_dataset(PrepareSpec(source, str(out), resize=ResizeSpec(size=300, mode="none"), **spec), workers=0)
    loader = make_loader(str(out), 1, device="cpu", crop=300, num_workers=1, train=False, dtype="uint8")
    batch = next(iter(loader))
    assert loader.spec.recipe == "letterbox"
    [box] = batch.boxes[0].tolist()
    return box, batch.images[0].numpy(), {"result": result, "manifest": json.loads((out / "manifest.json").read_text())}


def assert_on_the_object(box: list[float], image: np.ndarray) -> None:
    # Letterboxed to 300: the 300x200 picture at scale 1, 50 px of padding above it.
    assert box == pytest.approx([200, 90, 260, 150], abs=1.0)
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    inside = image[:, y0 + 3 : y1 - 3, x0 + 3 : x1 - 3].reshape(3, -1).mean(axis=1)
    assert inside[0] > 180 and inside[1] < 80, inside


def test_yolo_labels_are_read_against_the_upright_image(tmp_path: Path) -> None:
    # ultralytics' frame: fractions of the EXIF-rotated picture (the issue's label, to 4 places)
    root = tmp_path / "yolo"
    write_photo(root / "images" / "a.jpg")
    (root / "labels").mkdir()
    (root / "labels" / "a.txt").write_text("0 0.7667 0.35 0.2 0.3\n")
    (root / "data.yaml").write_text("names: [object]\n")
    box, image, _ = prepared_box(str(root), tmp_path / "out")
    assert_on_the_object(box, image)


def write_coco(folder: Path, width: int, height: int, bbox: list[float]) -> str:
    write_photo(folder / "a.jpg")
    coco = {
        "images": [{"id": 1, "file_name": "a.jpg", "width": width, "height": height}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": bbox, "iscrowd": 0}],
        "categories": [{"id": 1, "name": "object"}],
    }
    (folder / "instances.json").write_text(json.dumps(coco))
    return str(folder / "instances.json")


def xywh(box: tuple[int, int, int, int]) -> list[float]:
    return [box[0], box[1], box[2] - box[0], box[3] - box[1]]


def test_coco_declaring_the_upright_size_is_read_upright(tmp_path: Path) -> None:
    # What EXIF-aware annotation tools write: the size the annotator saw, and boxes on that picture.
    box, image, found = prepared_box(write_coco(tmp_path / "src", 300, 200, xywh(OBJECT)), tmp_path / "out")
    assert_on_the_object(box, image)
    assert found["manifest"].get("frames_unclear", 0) == 0 and found["result"].boxes_dropped == 0


def test_coco_declaring_the_stored_size_is_read_stored(tmp_path: Path) -> None:
    box, image, _ = prepared_box(write_coco(tmp_path / "src", 200, 300, xywh(STORED_OBJECT)), tmp_path / "out")
    assert_on_the_object(box, image)


def test_coco_declaring_neither_size_is_counted_and_the_option_decides(tmp_path: Path) -> None:
    source = write_coco(tmp_path / "src", 640, 480, xywh(STORED_OBJECT))
    box, image, found = prepared_box(source, tmp_path / "out", label_frame="stored")
    assert_on_the_object(box, image)
    assert found["manifest"]["frames_unclear"] == 1 and found["manifest"]["params"]["label_frame"] == "stored"
    assert any("neither the stored nor the upright" in warning for warning in found["result"].warnings)


def test_voc_declaring_the_upright_size_is_read_upright(tmp_path: Path) -> None:
    root = tmp_path / "voc"
    write_photo(root / "JPEGImages" / "a.jpg")
    (root / "Annotations").mkdir()
    x0, y0, x1, y1 = OBJECT  # VOC: 1-based, inclusive
    (root / "Annotations" / "a.xml").write_text(
        f"<annotation><size><width>300</width><height>200</height></size><object><name>object</name>"
        f"<bndbox><xmin>{x0 + 1}</xmin><ymin>{y0 + 1}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox>"
        "</object></annotation>"
    )
    box, image, _ = prepared_box(str(root), tmp_path / "out")
    assert_on_the_object(box, image)


def test_yolo_seg_polygons_are_painted_upright_like_cocos(tmp_path: Path) -> None:
    # A YOLO-seg line (class x1 y1 x2 y2 ...) keeps its polygon: painted into the sample's mask as COCO's shapes
    # are (class + 1, 0 background), in the upright frame, on the red pixels.
    root = tmp_path / "yolo"
    write_photo(root / "images" / "a.jpg")
    (root / "labels").mkdir()
    x0, y0, x1, y1 = (v / s for v, s in zip(OBJECT, UPRIGHT * 2))
    (root / "labels" / "a.txt").write_text(f"0 {x0} {y0} {x1} {y0} {x1} {y1} {x0} {y1}\n")
    (root / "data.yaml").write_text("names: [object]\n")
    box, image, found = prepared_box(str(root), tmp_path / "out")
    assert_on_the_object(box, image)
    assert found["manifest"]["mask_classes"] == ["background", "object"] and "mask.png" in found["manifest"]["fields"]
    loader = make_loader(str(tmp_path / "out"), 1, device="cpu", crop=300, num_workers=1, train=False)
    batch = next(iter(loader))
    mask = batch.masks[0].numpy()
    red = image[0] > 180  # the object's pixels in the letterboxed output
    assert (mask[red] == 1).mean() > 0.97 and (mask[~red] != 1).mean() > 0.97
    # and per instance, in torchvision's Mask R-CNN form: one [H, W] uint8 mask per box
    [own] = batch.targets[0]["masks"].numpy()
    assert own.dtype == np.uint8 and own.shape == (300, 300)
    assert (own[red] == 1).mean() > 0.97 and (own[~red] == 0).mean() > 0.97
