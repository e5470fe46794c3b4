"""A detection dataset painted from COCO's shapes delivers its masks, cropped and flipped with its boxes.

COCO (polygons, RLE, a crowd) -> prepare -> make_loader: every delivered box
sits on its class (c + 1) in the batch's mask, nothing outside the boxes is
painted, and the picture shows each box's colour under its mask, for train
crops and flips as for the centre crop.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import PrepareSpec, ResizeSpec, demo, make_loader, prepare_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from task_data import PALETTE, box_picture  # noqa: E402

CROP = 40


def write_coco(root: Path, images: int = 16) -> str:
    """Images of non-overlapping rectangles; each is one annotation whose shape is its polygon (or, every
    third, its uncompressed RLE); the first image's first rectangle is a crowd."""
    rng = np.random.default_rng(11)
    coco: dict[str, list] = {"images": [], "annotations": [], "categories": []}
    coco["categories"] = [{"id": 10 + k, "name": f"c{k}"} for k in range(len(PALETTE))]
    root.mkdir(parents=True)
    for number in range(images):
        width, height = int(rng.integers(64, 97)), int(rng.integers(64, 97))
        pixels, boxes, labels, _ = box_picture(rng, width, height, 3)
        Image.fromarray(pixels).save(root / f"{number}.png")
        coco["images"].append({"id": number, "file_name": f"{number}.png", "width": width, "height": height})
        for at, ((x0, y0, x1, y1), label) in enumerate(zip(boxes.astype(int).tolist(), labels.tolist())):
            if at % 3 == 2:
                region = np.zeros((height, width), bool)
                region[y0:y1, x0:x1] = True
                shape: object = {"counts": demo.rle_counts(region), "size": [height, width]}
            else:
                shape = [[x0, y0, x1, y0, x1, y1, x0, y1]]
            coco["annotations"].append({
                "id": len(coco["annotations"]) + 1, "image_id": number, "category_id": 10 + label,
                "bbox": [x0, y0, x1 - x0, y1 - y0], "iscrowd": int(number == 0 and at == 0), "segmentation": shape,
            })  # fmt: skip
    path = root / "instances.json"
    path.write_text(json.dumps(coco))
    return str(path)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("coco")
    out = base / "out"
    prepare_dataset(PrepareSpec(write_coco(base / "src"), str(out), resize=ResizeSpec(size=56)), workers=0)
    return out


def check_batch(batch) -> int:
    """Masks and boxes agree; returns how many boxes were checked."""
    assert batch.masks is not None and batch.masks.shape == (len(batch.keys), CROP, CROP)
    assert batch.masks.dtype == torch.int64
    checked = 0
    for image, mask, boxes, labels, crowd in zip(batch.images, batch.masks, batch.boxes, batch.box_labels, batch.iscrowd):
        m = mask.numpy()
        covered = np.zeros_like(m, bool)
        for (x0, y0, x1, y1), label, is_crowd in zip(boxes.tolist(), labels.tolist(), crowd.tolist()):
            # 1 px in from each edge: the nearest-sampled mask may sit a fraction of a pixel off a scaled box
            inner = m[int(np.ceil(y0)) + 1 : int(np.floor(y1)) - 1, int(np.ceil(x0)) + 1 : int(np.floor(x1)) - 1]
            if inner.size:
                assert (inner == (255 if is_crowd else label + 1)).all(), (label, np.unique(inner))
                if not is_crowd and min(inner.shape) > 2:
                    pixels = image.numpy()[:, int(np.ceil(y0)) + 1 : int(np.floor(y1)) - 1, int(np.ceil(x0)) + 1 : int(np.floor(x1)) - 1]
                    assert np.abs(pixels.reshape(3, -1).mean(axis=1) - PALETTE[label]).max() < 40
                checked += 1
            covered[max(0, int(np.floor(y0)) - 1) : int(np.ceil(y1)) + 1, max(0, int(np.floor(x0)) - 1) : int(np.ceil(x1)) + 1] = True
        # outside every box (and its pixel of slack), nothing is painted: background, or a box dropped by the crop
        outside = m[~covered]
        assert np.isin(outside, [0, *range(1, len(PALETTE) + 1), 255]).all()
        assert (outside == 0).mean() > 0.5 or not outside.size
    return checked


@pytest.mark.parametrize("train", [True, False])
def test_detection_batches_carry_masks_that_agree_with_their_boxes(prepared: Path, train: bool) -> None:
    checked = 0
    loader = make_loader(prepared, 4, device="cpu", crop=CROP, num_workers=2, dtype="uint8", seed=5, train=train)
    for batch in loader:
        images, targets = batch
        # the class mask stays out of the dicts; each box's own mask is in, as torchvision's Mask R-CNN reads it,
        # and its polygons (which the model leaves alone)
        assert [set(t) for t in targets] == [{"boxes", "labels", "iscrowd", "masks", "polygons"}] * len(targets)
        checked += check_batch(batch)
        for target, mask in zip(targets, batch.masks.numpy()):
            own = target["masks"].numpy()
            assert own.dtype == np.uint8 and own.shape == (len(target["boxes"]), CROP, CROP)
            for (x0, y0, x1, y1), label, is_crowd, pixels in zip(target["boxes"].tolist(), target["labels"].tolist(),
                                                                target["iscrowd"].tolist(), own):  # fmt: skip
                rows, cols = np.nonzero(pixels)
                if rows.size:  # within its box (a pixel of slack), and painted with its class in the class mask
                    assert rows.min() >= np.floor(y0) - 1 and rows.max() <= np.ceil(y1) and cols.min() >= np.floor(x0) - 1
                    assert cols.max() <= np.ceil(x1)
                    assert (mask[pixels == 1] == (255 if is_crowd else label + 1)).all()
                elif (x1 - x0) * (y1 - y0) > 16:
                    raise AssertionError(f"box {(x0, y0, x1, y1)} has no pixels of its own")
    assert checked >= 20


def test_masks_follow_the_flip_exactly(prepared: Path) -> None:
    """The same samples with and without flips: the train masks are the mirror of each other where flipped."""
    one = make_loader(prepared, 16, device="cpu", crop=CROP, num_workers=1, dtype="uint8", seed=9, train=True)
    two = make_loader(prepared, 16, device="cpu", crop=CROP, num_workers=1, dtype="uint8", seed=9, train=True, flip=False)
    [a], [b] = list(one), list(two)
    assert a.keys == b.keys
    mirrored = 0
    for image_a, image_b, mask_a, mask_b in zip(a.images, b.images, a.masks, b.masks):
        if torch.equal(image_a, image_b):
            assert torch.equal(mask_a, mask_b)
        else:
            assert torch.equal(image_a.flip(-1), image_b) and torch.equal(mask_a.flip(-1), mask_b)
            mirrored += 1
    assert 0 < mirrored < 16


def test_a_detection_dataset_without_masks_has_none(tmp_path: Path) -> None:
    source = demo.make_coco_dataset(tmp_path / "coco", 8, segmentation=None)
    prepare_dataset(PrepareSpec(source, str(tmp_path / "out"), resize=ResizeSpec(size=48)), workers=0)
    for batch in make_loader(tmp_path / "out", 4, device="cpu", crop=32, num_workers=1, train=False):
        assert batch.masks is None and len(batch.boxes) == 4
