"""COCO's polygons and RLE become each image's class-index mask.png, in step with its boxes and pixels.

The truth is independent of the code under test: the demo's rectangles
(`demo_mask`: class c -> c + 1, crowds -> 255), a brute-force pixel-centre
test for polygons, and RLE strings made by a reference encoder written here
from COCO's description. After prepare, plain webdataset reads the masks
back and they must equal the truth sent through the recorded geometry
(torch's nearest resize, numpy's rotations), exactly.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from pipeline import PrepareSpec, ResizeSpec, demo, prepare_dataset
from pipeline.manifest import read_manifest
from pipeline.polygons import fill_polygons
from pipeline.prepare.sample.coco_masks import (
    check_segmentation,
    decode_rle,
    rasterise,
    rle_string_counts,
)

# -- reference encoders and rasteriser -------------------------------------------


def ref_counts(mask: np.ndarray) -> list[int]:
    """Run lengths of a bool mask, column-major, the first run of zeros (0 when the first pixel is set)."""
    counts, current, run = [], False, 0
    for value in np.asarray(mask, bool).T.reshape(-1):
        if bool(value) != current:
            counts.append(run)
            current, run = bool(value), 0
        run += 1
    counts.append(run)
    return counts


def ref_string(counts: list[int]) -> str:
    """COCO's compressed form: differences from two counts back (from the fourth on), 5-bit groups, sign on the last."""
    text = ""
    for i, count in enumerate(counts):
        x = count - counts[i - 2] if i > 2 else count
        while True:
            group = x & 0x1F
            x >>= 5
            last = x == -1 if group & 0x10 else x == 0
            text += chr(48 + (group if last else group | 0x20))
            if last:
                break
    return text


def ref_polygon(points: list[float], width: int, height: int) -> np.ndarray:
    """Pixels whose centre is inside the polygon, by the crossing number of each centre (slow, obviously right)."""
    xs, ys = points[0::2], points[1::2]
    out = np.zeros((height, width), bool)
    n = len(xs)
    for row in range(height):
        for col in range(width):
            px, py, inside = col + 0.5, row + 0.5, False
            for i in range(n):
                x0, y0, x1, y1 = xs[i], ys[i], xs[(i + 1) % n], ys[(i + 1) % n]
                if (y0 <= py) != (y1 <= py) and px < x0 + (py - y0) * (x1 - x0) / (y1 - y0):
                    inside = not inside
            out[row, col] = inside
    return out


def nearest(mask: np.ndarray, out: tuple[int, int]) -> np.ndarray:
    """torch.nn.functional.interpolate(mode="nearest") of a whole mask: source floor(u * in / out)."""
    rows = [math.floor(v * mask.shape[0] / out[1]) for v in range(out[1])]
    cols = [math.floor(u * mask.shape[1] / out[0]) for u in range(out[0])]
    return mask[np.ix_(rows, cols)]


def scene_truth(scene: demo.DemoScene) -> np.ndarray:
    """The demo's mask with its crowds as the ignore index (the demo draws rectangles in order, later on top)."""
    mask = demo.demo_mask(scene)
    for (x0, y0, x1, y1), label, crowd in zip(scene.boxes, scene.labels, scene.crowd):
        mask[y0:y1, x0:x1] = 255 if crowd else label + 1
    return mask


def read_samples(out: Path) -> dict[str, dict[str, Any]]:
    urls = sorted(str(p) for p in out.rglob("*.tar") if ".gpufeed" not in p.parts)
    samples = {}
    for sample in wds.WebDataset(urls, shardshuffle=False).decode():
        if "mask.png" in sample:  # webdataset's image decoder would make it RGB: read the indices
            sample["mask.png"] = np.asarray(Image.open(io.BytesIO(sample["mask.png"])))
        samples[sample["json"]["source"].rsplit("/", 1)[-1]] = sample
    return samples


def rejects(out: Path) -> dict[str, str]:
    lines = (out / "rejected.jsonl").read_text().splitlines()
    return {json.loads(line)["source"].rsplit("/", 1)[-1]: json.loads(line)["reason"] for line in lines}


# -- the decoders on their own ---------------------------------------------------


def test_rle_both_forms_decode_to_the_mask_they_were_made_of() -> None:
    rng = np.random.default_rng(5)
    for _ in range(60):
        height, width = (int(v) for v in rng.integers(1, 40, 2))
        mask = rng.random((height, width)) < rng.random()
        if rng.random() < 0.3:  # long runs too: counts of several 5-bit groups, and big negative differences
            mask = np.zeros((height, width), bool)
            mask[rng.integers(0, height) :, rng.integers(0, width) :] = True
        counts = ref_counts(mask)
        np.testing.assert_array_equal(decode_rle(counts, (height, width)), mask)
        assert rle_string_counts(ref_string(counts)) == counts
        np.testing.assert_array_equal(decode_rle(ref_string(counts), (height, width)), mask)
    big = np.zeros((300, 400), bool)
    big[10:290, 123:377] = True
    assert rle_string_counts(ref_string(ref_counts(big))) == ref_counts(big)


@pytest.mark.parametrize(
    "points",
    [
        [2, 1, 9, 1, 9, 7, 2, 7],  # a box's corners: exactly the box's pixels
        [0.3, 0.2, 11.7, 3.1, 4.4, 9.6],  # a triangle at fractional corners
        [1, 1, 11, 1, 11, 9, 6, 3.5, 1, 9],  # concave
        [1, 1, 11, 9, 11, 1, 1, 9],  # self-crossing (a bow tie: even-odd)
        [-5, -5, 20, 2, 6, 30],  # past the edges: clipped
    ],
)
def test_a_polygon_covers_the_pixels_whose_centre_is_inside(points: list[float]) -> None:
    got = fill_polygons([np.asarray(points, float).reshape(-1, 2)], (12, 10))
    np.testing.assert_array_equal(got, ref_polygon(points, 12, 10))
    if len(points) == 8 and points[0] == 2:
        assert got.sum() == (9 - 2) * (7 - 1)


def test_an_annotations_polygons_add_up_and_later_annotations_win() -> None:
    square_a, square_b = [1, 1, 7, 1, 7, 7, 1, 7], [4, 4, 10, 4, 10, 9, 4, 9]
    shapes = check_segmentation([[square_a, square_b], [[6, 0, 12, 0, 12, 3, 6, 3]], [[0, 8, 3, 8, 3, 10, 0, 10]]], 3)
    mask = rasterise(shapes, np.array([0, 1, 1]), np.array([0, 0, 1], np.uint8), (12, 10), 255)
    want = np.zeros((10, 12), np.uint8)
    want[ref_polygon(square_a, 12, 10) | ref_polygon(square_b, 12, 10)] = 1  # a union, not an even-odd of the parts
    want[0:3, 6:12] = 2
    want[8:10, 0:3] = 255  # the crowd
    np.testing.assert_array_equal(mask, want)


@pytest.mark.parametrize(("text", "reason"), [("0a~", "alphabet"), ("0a", "ends inside"), ("0O", "negative")])
def test_a_broken_rle_string_is_refused(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        rle_string_counts(text)


# -- prepare: the demo's COCO datasets -------------------------------------------


@pytest.mark.parametrize("segmentation", ["polygon", "rle", "compressed"])
def test_prepare_paints_each_images_mask_after_its_resize(tmp_path: Path, segmentation: str) -> None:
    source = demo.make_coco_dataset(tmp_path / "coco", 12, classes=3, segmentation=segmentation)
    out = tmp_path / "out"
    prepare_dataset(PrepareSpec(source, str(out), resize=ResizeSpec(size=40, mode="shorter")), workers=0)
    manifest = read_manifest(out)
    assert manifest.task == "detection"
    assert manifest.fields == ["boxes.npy", "box_labels.npy", "iscrowd.npy", "mask.png", "instances.png", "polygons.json"]
    assert manifest.ignore_index == 255
    assert manifest.mask_classes == ["background", *manifest.classes]
    samples = read_samples(out)
    assert len(samples) == 12
    crowds = 0
    for index in range(12):
        scene = demo.demo_scene(index, classes=3)
        sample = samples[f"{index:06d}.jpg"]
        size = tuple(sample["json"]["size"])
        mask = sample["mask.png"]
        assert mask.dtype == np.uint8 and mask.shape == (size[1], size[0])
        np.testing.assert_array_equal(mask, nearest(scene_truth(scene), size), err_msg=f"image {index}")
        crowds += int(255 in mask)
        # every stored box lies on painted pixels (a rectangle is its own box: masks and boxes went the same way)
        for box in sample["boxes.npy"]:
            x0, y0, x1, y1 = math.ceil(box[0]), math.ceil(box[1]), math.floor(box[2]), math.floor(box[3])
            assert (mask[y0:y1, x0:x1] != 0).all()
    assert crowds > 0  # the demo's seed has crowds: they are the ignore index


def test_a_coco_source_without_shapes_stays_boxes_only(tmp_path: Path) -> None:
    source = demo.make_coco_dataset(tmp_path / "coco", 6, segmentation=None)
    out = tmp_path / "out"
    prepare_dataset(PrepareSpec(source, str(out), resize=ResizeSpec(size=40)), workers=0)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["fields"] == ["boxes.npy", "box_labels.npy", "iscrowd.npy"]
    assert "mask_classes" not in manifest and "ignore_index" not in manifest
    assert all("mask.png" not in sample for sample in read_samples(out).values())


# -- prepare: a hand-built COCO file ---------------------------------------------

STORED = (48, 32)  # width, height of the stored file
TRIANGLE = [4.0, 3.0, 40.5, 6.0, 10.0, 29.0]
RECT = (30, 10, 44, 28)  # x0, y0, x1, y1


def write_coco(folder: Path, annotations: list[dict[str, Any]], orientation: int = 1, images: int = 1) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    exif = Image.Exif()
    exif[0x0112] = orientation
    for number in range(images):
        Image.new("RGB", STORED, (90, 100, 110)).save(folder / f"{number}.jpg", "JPEG", exif=exif)
    coco = {
        "images": [{"id": n + 1, "file_name": f"{n}.jpg", "width": STORED[0], "height": STORED[1]} for n in range(images)],
        "annotations": [{"id": n + 1, "iscrowd": 0, **a} for n, a in enumerate(annotations)],
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
    }
    path = folder / "instances.json"
    path.write_text(json.dumps(coco))
    return str(path)


def hand_annotations() -> list[dict[str, Any]]:
    x0, y0, x1, y1 = RECT
    region = np.zeros((STORED[1], STORED[0]), bool)
    region[y0:y1, x0:x1] = True
    return [
        {"image_id": 1, "category_id": 1, "bbox": [4, 3, 36.5, 26], "segmentation": [TRIANGLE]},
        # later, on top of the triangle where they overlap
        {"image_id": 1, "category_id": 2, "bbox": [x0, y0, x1 - x0, y1 - y0],
         "segmentation": {"counts": ref_string(ref_counts(region)), "size": [STORED[1], STORED[0]]}},
        {"image_id": 1, "category_id": 1, "bbox": [0, 0, 3, 2], "iscrowd": 1,
         "segmentation": {"counts": ref_counts(np.pad(np.ones((2, 3), bool), ((0, 30), (0, 45)))), "size": [32, 48]}},
    ]  # fmt: skip


def hand_truth() -> np.ndarray:
    truth = np.where(ref_polygon(TRIANGLE, *STORED), 1, 0).astype(np.uint8)
    x0, y0, x1, y1 = RECT
    truth[y0:y1, x0:x1] = 2
    truth[0:2, 0:3] = 255
    return truth


@pytest.mark.parametrize("orientation", [1, 6, 3])
@pytest.mark.parametrize("mode", ["none", "shorter"])
def test_shapes_follow_the_exif_orientation_and_resize(tmp_path: Path, orientation: int, mode: str) -> None:
    source = write_coco(tmp_path / "src", hand_annotations(), orientation)
    out = tmp_path / "out"
    # The JSON declares the stored size; a half turn keeps the size, so only label_frame can say it is the stored one.
    frame = "stored" if orientation == 3 else "upright"
    prepare_dataset(PrepareSpec(source, str(out), resize=ResizeSpec(size=16, mode=mode), label_frame=frame), workers=0)
    [sample] = read_samples(out).values()
    upright = {1: lambda m: m, 6: lambda m: np.rot90(m, -1), 3: lambda m: m[::-1, ::-1]}[orientation](hand_truth())
    size = tuple(sample["json"]["size"])
    assert sample["json"]["geometry"]["orientation"] == orientation
    width, height = upright.shape[1], upright.shape[0]
    scale = 1.0 if mode == "none" else 16 / min(width, height)
    assert size == (round(width * scale), round(height * scale))
    np.testing.assert_array_equal(sample["mask.png"], nearest(np.ascontiguousarray(upright), size))
    assert read_manifest(out).mask_classes == ["background", "cat", "dog"]


def _rle(counts: Any, size: list[int] = [32, 48]) -> dict[str, Any]:  # noqa: B006 - read only
    return {"counts": counts, "size": size}


@pytest.mark.parametrize(
    ("segmentation", "reason"),
    [
        (_rle([10, 5]), "cover 15 pixels, not the 32x48 = 1536"),
        (_rle([1000, 1000]), "cover 2000 pixels"),
        (_rle([1536], [48, 32]), "an RLE of 32x48, not the image's 48x32"),
        (_rle("0a~"), "a malformed RLE"),
        (_rle([3, -1, 1534]), "not a non-negative whole number"),
        (_rle([1536], [32]), "size must be [height, width]"),
        ([[1, 2, 3, 4, 5]], "a list of x, y pairs"),
        ([[1, 2, 3, "4", 5, 6]], "not a finite number"),
        ([[1, 2, 3, 4, 5, float("nan")]], "not a finite number"),
        ([[1.0, 2.0] * ((1 << 16) + 1)], "over 65536"),
        ([[1, 2, 3, 4, 1e300, 6]], "out of range"),
    ],
)
def test_a_malformed_shape_rejects_its_image_with_the_reason(tmp_path: Path, segmentation: Any, reason: str) -> None:
    annotations = [
        {"image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5], "segmentation": segmentation},
        {"image_id": 2, "category_id": 2, "bbox": [1, 1, 5, 5], "segmentation": [[1, 1, 6, 1, 6, 6]]},
    ]
    source = write_coco(tmp_path / "src", annotations, images=2)
    out = tmp_path / "out"
    result = prepare_dataset(PrepareSpec(source, str(out), resize=ResizeSpec(size=16)), workers=0)
    assert (result.samples, result.rejected) == (1, 1)
    [(name, why)] = rejects(out).items()
    assert name == "0.jpg" and reason in why and "segmentation 0" in why, why
    [sample] = read_samples(out).values()
    assert sample["mask.png"].max() == 2  # the good image still has its triangle
