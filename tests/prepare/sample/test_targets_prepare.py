"""prepare keeps a sample's targets (boxes, masks, labels, captions, columns) in step with its pixels.

Every test draws its own scene: filled rectangles in distinct colours, the
same rectangles (class k + 1) in a mask, boxes around them. After prepare,
the stored boxes must equal the source's through the recorded geometry
(within 0.5 px), the stored mask must equal the source mask through it
exactly (nearest-neighbour), and the stored image must show each box's
colour under that box's mask.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds
from PIL import Image, ImageDraw

from pipeline import AugmentSpec, ConfigError, EncodeSpec, PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset
from pipeline.manifest import read_manifest
from pipeline.prepare import opening as opening_module
from pipeline.prepare.job import finish_prepare, plan_prepare, write_prepare_shard
from pipeline.prepare.sample.make import process_item
from pipeline.prepare.sources import ListingInfo, SourceItem
from pipeline.targets import orient_mask

SIZE = (160, 120)  # stored width, height
COLOURS = [(230, 30, 30), (30, 230, 30), (30, 30, 230)]
BOXES = [[10, 12, 50, 60], [70, 40, 130, 100], [140, 0, 160, 30]]  # the third sits at the right edge
NAMES = ["cat", "dog", "cat"]
CLASSES = {"cat": 0, "dog": 1}


# -- scenes --------------------------------------------------------------------


def draw(size: tuple[int, int] = SIZE, boxes: list[list[int]] = BOXES) -> tuple[Image.Image, np.ndarray]:
    """An image with a filled rectangle per box (its colour), and the mask of the same rectangles (box i -> i + 1)."""
    img = Image.new("RGB", size, (0, 0, 0))
    mask = Image.new("L", size, 0)
    for i, (x0, y0, x1, y1) in enumerate(boxes):
        ImageDraw.Draw(img).rectangle([x0, y0, x1 - 1, y1 - 1], fill=COLOURS[i % len(COLOURS)])
        ImageDraw.Draw(mask).rectangle([x0, y0, x1 - 1, y1 - 1], fill=i + 1)
    return img, np.asarray(mask)


def write_scene(folder: Path, name: str = "a", orientation: int = 1, fmt: str = "JPEG") -> tuple[Path, Path, np.ndarray]:
    """The scene's image file (with an EXIF orientation tag) and mask PNG, stored as drawn."""
    folder.mkdir(parents=True, exist_ok=True)
    img, mask = draw()
    image_path = folder / f"{name}.{'jpg' if fmt == 'JPEG' else 'png'}"
    exif = Image.Exif()
    exif[0x0112] = orientation
    if fmt == "JPEG":
        img.save(image_path, "JPEG", quality=95, subsampling=0, exif=exif)
    else:
        img.save(image_path, "PNG", exif=exif)
    mask_path = folder / f"{name}_mask.png"
    Image.fromarray(mask, "L").save(mask_path)
    return image_path, mask_path, mask


def scene_item(image: Path, mask: Path | None = None, **targets: Any) -> SourceItem:
    values: dict[str, Any] = {"boxes": BOXES, "box_labels": NAMES}
    if mask is not None:
        values["mask"] = str(mask)
    values.update(targets)
    return SourceItem(str(image), image.name, None, targets=values)


def job_spec(**changes: Any) -> PrepareSpec:
    values: dict[str, Any] = {"resize": ResizeSpec(size=64), "shards": ShardSpec(max_bytes=None, max_samples=16)}
    values.update(changes)
    return PrepareSpec(source="src", out="out", **values)


def members_of(blob: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        return {m.name.split(".", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def decoded(members: dict[str, bytes]) -> dict[str, Any]:
    """A sample's members as plain values: the image and mask as arrays, the .npy arrays, the json."""
    image_ext = next(ext for ext in ("jpg", "png", "webp") if ext in members)
    out: dict[str, Any] = {
        "image": np.asarray(Image.open(io.BytesIO(members[image_ext])).convert("RGB")),
        "json": json.loads(members["json"]),
    }
    for name in ("boxes.npy", "box_labels.npy", "iscrowd.npy"):
        if name in members:
            out[name] = np.load(io.BytesIO(members[name]), allow_pickle=False)
    if "mask.png" in members:
        out["mask"] = np.asarray(Image.open(io.BytesIO(members["mask.png"])))
    return out


def run_one(item: SourceItem, spec: PrepareSpec, ignore_index: int = 255) -> list[dict[str, Any]]:
    outcome = process_item(item, 0, spec, CLASSES, ignore_index=ignore_index)
    assert outcome.tars is not None, outcome.reason
    return [decoded(members_of(blob)) for blob in outcome.tars]


# -- independent expectations ----------------------------------------------------


def region_boxes(mask: np.ndarray, count: int = len(BOXES)) -> dict[int, list[float]]:
    """The pixel extent of each class region of a mask: the box a drawn rectangle has."""
    found = {}
    for k in range(1, count + 1):
        ys, xs = np.nonzero(mask == k)
        if len(xs):
            found[k] = [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]
    return found


def resize_plan(mode: str, size: int, width: int, height: int) -> tuple[tuple[float, float, float, float], tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(crop box in the upright original (left, top, w, h), resized size, pad offset, canvas) of a resize mode."""
    if mode == "none":
        return (0, 0, width, height), (width, height), (0, 0), (width, height)
    # transforms.v2's integer rules: the side asked for is exactly `size`, the other truncated
    short, long = min(width, height), max(width, height)
    by_shorter = mode in ("shorter", "center-crop")
    if size >= (short if by_shorter else long):
        tw, th = width, height
    else:
        new_short, new_long = (size, int(size * long / short)) if by_shorter else (int(size * short / long), size)
        tw, th = (new_short, new_long) if width <= height else (new_long, new_short)
    if mode == "center-crop":  # v2's Resize then CenterCrop: the anchor rounded, mapped back by each axis's scale
        side = min(tw, th)
        sx, sy = width / tw, height / th
        left, top = round((tw - side) / 2) * sx, round((th - side) / 2) * sy
        return (left, top, side * sx, side * sy), (side, side), (0, 0), (side, side)
    if mode == "pad":
        return (0, 0, width, height), (tw, th), ((size - tw) // 2, (size - th) // 2), (size, size)
    return (0, 0, width, height), (tw, th), (0, 0), (tw, th)


def nearest_crop(mask: np.ndarray, box: tuple[float, float, float, float], out: tuple[int, int]) -> np.ndarray:
    """torch-style nearest resize of a crop: output pixel u takes source floor(left + u * w / out_w)."""
    left, top, w, h = box
    rows = [math.floor(top + v * h / out[1] + 1e-9) for v in range(out[1])]
    cols = [math.floor(left + u * w / out[0] + 1e-9) for u in range(out[0])]
    return mask[np.ix_(rows, cols)]


def expected_boxes(boxes: np.ndarray, box: tuple[float, ...], resized: tuple[int, int], offset: tuple[int, int], canvas: tuple[int, int], min_visible: float = 0.25) -> tuple[np.ndarray, int]:
    left, top, w, h = box
    sx, sy = resized[0] / w, resized[1] / h
    moved = np.array([[(x0 - left) * sx + offset[0], (y0 - top) * sy + offset[1], (x1 - left) * sx + offset[0], (y1 - top) * sy + offset[1]] for x0, y0, x1, y1 in boxes])
    return clip_and_keep(moved, canvas, min_visible)


def clip_and_keep(moved: np.ndarray, canvas: tuple[int, int], min_visible: float) -> tuple[np.ndarray, int]:
    before = (moved[:, 2] - moved[:, 0]) * (moved[:, 3] - moved[:, 1])
    clipped = moved.copy()
    clipped[:, 0::2] = clipped[:, 0::2].clip(0, canvas[0])
    clipped[:, 1::2] = clipped[:, 1::2].clip(0, canvas[1])
    after = (clipped[:, 2] - clipped[:, 0]) * (clipped[:, 3] - clipped[:, 1])
    keep = (after > 0) & (after >= min_visible * before - 1e-6)
    return clipped[keep], int((~keep).sum())


def assert_colours_under_mask(image: np.ndarray, mask: np.ndarray, classes: int = len(BOXES)) -> None:
    """The image shows box k's colour where the mask says k (inside, away from the region's edge)."""
    for k in range(1, classes + 1):
        region = mask == k
        inner = region.copy()
        inner[1:-1, 1:-1] &= region[:-2, 1:-1] & region[2:, 1:-1] & region[1:-1, :-2] & region[1:-1, 2:]
        inner[[0, -1], :] = False
        inner[:, [0, -1]] = False
        if inner.sum() < 4:
            continue
        mean = image[inner].mean(axis=0)
        assert np.abs(mean - np.array(COLOURS[k - 1])).max() < 40, (k, mean)


# -- resize modes and EXIF -------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jpeg", "png"])  # jpeg: the YCbCr path where it applies; png: the RGB path
@pytest.mark.parametrize("mode", ["shorter", "longer", "pad", "center-crop", "none"])
def test_every_resize_mode_keeps_boxes_and_mask_on_the_picture(tmp_path: Path, mode: str, fmt: str) -> None:
    image, mask_path, mask = write_scene(tmp_path)
    spec = job_spec(resize=ResizeSpec(size=64, mode=mode), encode=EncodeSpec(format=fmt))
    [sample] = run_one(scene_item(image, mask_path), spec)
    box, resized, offset, canvas = resize_plan(mode, 64, *SIZE)
    assert sample["image"].shape[:2] == (canvas[1], canvas[0])
    want, dropped = expected_boxes(np.array(BOXES, float), box, resized, offset, canvas)
    assert sample["boxes.npy"].dtype == np.float32 and sample["boxes.npy"].shape == want.shape
    np.testing.assert_allclose(sample["boxes.npy"], want, atol=0.5)
    assert sample["json"]["boxes_dropped"] == dropped
    assert (mode == "center-crop") == (dropped == 1)  # the right-edge box falls out of the centre square
    kept_labels = [CLASSES[n] for n, b in zip(NAMES, BOXES) if mode != "center-crop" or b[0] < 140]
    assert sample["box_labels.npy"].dtype == np.int64 and sample["box_labels.npy"].tolist() == kept_labels
    expected_mask = np.full((canvas[1], canvas[0]), 255, np.uint8)
    expected_mask[offset[1] : offset[1] + resized[1], offset[0] : offset[0] + resized[0]] = nearest_crop(mask, box, resized)
    np.testing.assert_array_equal(sample["mask"], expected_mask)
    assert_colours_under_mask(sample["image"], sample["mask"])


@pytest.mark.parametrize("fmt", ["jpeg", "png"])  # jpeg: the YCbCr path turns the picture; png: the decoder does
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_turns_boxes_and_mask_with_the_pixels(tmp_path: Path, orientation: int, fmt: str) -> None:
    image, mask_path, mask = write_scene(tmp_path, orientation=orientation)
    upright_mask = orient_mask(mask, orientation)
    for mode in ("none", "shorter", "pad", "center-crop"):  # center-crop: v2's rounded anchor, on the upright picture
        spec = job_spec(resize=ResizeSpec(size=64, mode=mode), encode=EncodeSpec(format=fmt))
        [sample] = run_one(scene_item(image, mask_path), spec)
        height, width = upright_mask.shape
        box, resized, offset, canvas = resize_plan(mode, 64, width, height)
        assert sample["image"].shape[:2] == (canvas[1], canvas[0])
        assert sample["json"]["geometry"]["orientation"] == orientation
        expected_mask = np.full((canvas[1], canvas[0]), 255, np.uint8)
        expected_mask[offset[1] : offset[1] + resized[1], offset[0] : offset[0] + resized[0]] = nearest_crop(upright_mask, box, resized)
        np.testing.assert_array_equal(sample["mask"], expected_mask)
        # the boxes the upright drawing has, independently of how the boxes were turned
        upright = np.array(list(region_boxes(upright_mask).values()))
        want, _ = expected_boxes(upright, box, resized, offset, canvas)
        np.testing.assert_allclose(sample["boxes.npy"], want, atol=0.5)
        assert_colours_under_mask(sample["image"], sample["mask"])


def test_normalized_boxes_are_fractions_of_the_stored_size(tmp_path: Path) -> None:
    image, _, _ = write_scene(tmp_path, orientation=6)
    fractions = [[x0 / SIZE[0], y0 / SIZE[1], x1 / SIZE[0], y1 / SIZE[1]] for x0, y0, x1, y1 in BOXES]
    spec = job_spec(resize=ResizeSpec(size=64, mode="none"))
    [plain] = run_one(scene_item(image), spec)
    [normal] = run_one(scene_item(image, boxes=fractions, normalized=True), spec)
    np.testing.assert_allclose(normal["boxes.npy"], plain["boxes.npy"], atol=1e-3)


# -- variants --------------------------------------------------------------------


def affine_expected(boxes: np.ndarray, geometry: dict[str, Any], min_visible: float) -> tuple[np.ndarray, int]:
    a, b, c, d, e, f = geometry["matrix"]
    inverse = np.linalg.inv(np.array([[a, b, c], [d, e, f], [0, 0, 1]]))
    out = []
    for x0, y0, x1, y1 in boxes:
        corners = inverse @ np.array([[x0, x1, x1, x0], [y0, y0, y1, y1], [1, 1, 1, 1]])
        out.append([corners[0].min(), corners[1].min(), corners[0].max(), corners[1].max()])
    moved = np.array(out)
    if geometry["flip"]:
        width = geometry["size"][0]
        moved[:, [0, 2]] = width - moved[:, [2, 0]]
    moved[:, 0::2] += geometry["offset"][0]
    moved[:, 1::2] += geometry["offset"][1]
    return clip_and_keep(moved, tuple(geometry["canvas"]), min_visible)


def centre_sampled(mask: np.ndarray, geometry: dict[str, Any], fill: int) -> np.ndarray:
    """The mask through the recorded matrix, each output pixel taking the source pixel under its centre."""
    a, b, c, d, e, f = geometry["matrix"]
    width, height = geometry["size"]
    out = np.full((height, width), fill, mask.dtype)
    for v in range(height):
        for u in range(width):
            x = math.floor(a * (u + 0.5) + b * (v + 0.5) + c)
            y = math.floor(d * (u + 0.5) + e * (v + 0.5) + f)
            if 0 <= x < mask.shape[1] and 0 <= y < mask.shape[0]:
                out[v, u] = mask[y, x]
    return out


def placed(mask: np.ndarray, geometry: dict[str, Any], fill: int) -> np.ndarray:
    if geometry["flip"]:
        mask = mask[:, ::-1]
    canvas = np.full((geometry["canvas"][1], geometry["canvas"][0]), fill, mask.dtype)
    left, top = geometry["offset"]
    canvas[top : top + mask.shape[0], left : left + mask.shape[1]] = mask
    return canvas


@pytest.mark.parametrize("mode", ["shorter", "pad"])
def test_rotated_variants_carry_boxes_and_mask_through_the_same_affine(tmp_path: Path, mode: str) -> None:
    image, mask_path, mask = write_scene(tmp_path, fmt="PNG")
    augment = AugmentSpec(variants=6, rotate=30.0, scale=(0.5, 1.0), jitter=0.0)
    spec = job_spec(resize=ResizeSpec(size=64, mode=mode), augment=augment, min_visible=0.3)
    samples = run_one(scene_item(image, mask_path), spec, ignore_index=200)
    assert len(samples) == 6
    flips = set()
    for sample in samples:
        geometry = sample["json"]["geometry"]
        flips.add(geometry["flip"])
        assert geometry["matrix"][1] != 0  # rotated
        want, dropped = affine_expected(np.array(BOXES, float), geometry, 0.3)
        np.testing.assert_allclose(sample["boxes.npy"], want, atol=0.5)
        assert sample["json"]["boxes_dropped"] == dropped
        np.testing.assert_array_equal(sample["mask"], placed(centre_sampled(mask, geometry, 200), geometry, 200))
        assert sample["mask"].shape == sample["image"].shape[:2]
        assert_colours_under_mask(sample["image"], sample["mask"])
    assert flips == {True, False}  # six draws: both ways (seeded, so always the same six)


def test_unrotated_variants_sample_the_mask_as_a_crop_and_resize(tmp_path: Path) -> None:
    image, mask_path, mask = write_scene(tmp_path, fmt="PNG")
    spec = job_spec(augment=AugmentSpec(variants=4, rotate=0.0, jitter=0.0))
    for sample in run_one(scene_item(image, mask_path), spec):
        geometry = sample["json"]["geometry"]
        a, b, c, d, e, f = geometry["matrix"]
        assert b == 0 and d == 0
        width, height = geometry["size"]
        expected = nearest_crop(mask, (c, f, a * width, e * height), (width, height))
        np.testing.assert_array_equal(sample["mask"], placed(expected, geometry, 255))
        want, _ = affine_expected(np.array(BOXES, float), geometry, 0.25)
        np.testing.assert_allclose(sample["boxes.npy"], want, atol=0.5)


# -- what a sample's targets may be ----------------------------------------------


def test_palette_and_16_bit_masks_keep_their_indices(tmp_path: Path) -> None:
    image, _, mask = write_scene(tmp_path)
    palette = Image.fromarray(mask * 3, "L").convert("P")  # indices 0, 3, 6, 9
    palette.putpalette([255, 0, 0] * 256)  # every index shows red: converting to RGB would lose the classes
    palette.save(tmp_path / "p.png")
    spec = job_spec(resize=ResizeSpec(size=64, mode="none"))
    [sample] = run_one(scene_item(image, tmp_path / "p.png"), spec)
    np.testing.assert_array_equal(sample["mask"], mask * 3)
    Image.fromarray(mask.astype(np.uint16) * 1000).save(tmp_path / "wide.png")
    [wide] = run_one(scene_item(image, tmp_path / "wide.png"), spec)
    assert wide["mask"].dtype == np.uint16
    np.testing.assert_array_equal(wide["mask"], mask.astype(np.uint16) * 1000)


@pytest.mark.parametrize(
    ("targets", "reason"),
    [
        ({"boxes": [[0, 0, float("nan"), 4]], "box_labels": ["cat"]}, "box 0 is not four finite numbers"),
        ({"boxes": [[5, 5, 1, 9]], "box_labels": ["cat"]}, "x1 < x0"),
        ({"boxes": [[0, 0, 4, 4]], "box_labels": ["horse"]}, "'horse', which is not one of the dataset's classes"),
        ({"boxes": [[0, 0, 4, 4]], "box_labels": [7]}, "class index 7, outside 0 to 1"),
        ({"boxes": [[0, 0, 4, 4]]}, "boxes without box_labels"),
        ({"boxes": [[0, 0, 4, 4]], "box_labels": ["cat", "dog"]}, "1 boxes but 2 box_labels"),
        ({"boxes": [[0, 0, 4, 4]], "box_labels": ["cat"], "iscrowd": [2]}, "iscrowd must be a list of 1 flags"),
        ({"labels": "cat"}, "labels must be a list of class names"),
        ({"caption": 3}, "caption must be text"),
        ({"columns": [1]}, "columns must be an object"),
        ({"mask": "MISSING"}, "cannot read mask"),
        ({"mask": "GARBAGE"}, "not an image"),
        ({"mask": "SMALL"}, "is 80x60, not the image's 160x120"),
        ({"mask": "RGB"}, "is a RGB image"),
        ({"tar": {"offset": -1, "size": 3}}, "tar must be"),
        ("boxes", "targets must be an object"),
    ],
)
def test_a_malformed_target_rejects_its_sample_with_the_reason(tmp_path: Path, targets: Any, reason: str) -> None:
    image, _, _ = write_scene(tmp_path)
    (tmp_path / "garbage.png").write_bytes(b"not a png at all")
    Image.new("L", (80, 60)).save(tmp_path / "small.png")
    Image.new("RGB", SIZE).save(tmp_path / "rgb.png")
    names = {"MISSING": tmp_path / "none.png", "GARBAGE": tmp_path / "garbage.png", "SMALL": tmp_path / "small.png", "RGB": tmp_path / "rgb.png"}
    if isinstance(targets, dict) and targets.get("mask") in names:
        targets = {"mask": str(names[targets["mask"]])}
    outcome = process_item(SourceItem(str(image), image.name, None, targets=targets), 0, job_spec(), CLASSES)
    assert outcome.tars is None
    assert reason in outcome.reason


def test_labels_caption_and_columns(tmp_path: Path) -> None:
    image, _, _ = write_scene(tmp_path)
    item = SourceItem(str(image), image.name, "dog", targets={"labels": ["dog", "cat", 1], "caption": "a cat, a dog – été", "columns": {"id": 7, "split": "train"}})
    outcome = process_item(item, 0, job_spec(), CLASSES)
    assert outcome.tars is not None, outcome.reason
    members = members_of(outcome.tars[0])
    assert sorted(members) == ["cls", "jpg", "json", "labels.json", "txt"]
    assert json.loads(members["labels.json"]) == [0, 1]
    assert members["txt"].decode("utf-8") == "a cat, a dog – été"
    assert members["cls"] == b"1"
    meta = json.loads(members["json"])
    assert meta["columns"] == {"id": 7, "split": "train"}
    assert "geometry" not in meta and "boxes_dropped" not in meta  # nothing in the pixels: nothing to record


def test_an_image_inside_a_tar_is_read_as_its_byte_range(tmp_path: Path) -> None:
    image, _, _ = write_scene(tmp_path)
    data = image.read_bytes()
    shard = tmp_path / "shard.tar"
    with tarfile.open(shard, "w") as tar:
        for name, payload in (("x.txt", b"padding before"), ("a.jpg", data), ("a.txt", b"the caption")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    with tarfile.open(shard) as tar:
        member = tar.getmember("a.jpg")
        offset = member.offset_data
    item = SourceItem(str(shard), "shard.tar/a", None, targets={"tar": {"offset": offset, "size": len(data)}, "caption": "the caption"})
    outcome = process_item(item, 0, job_spec(resize=ResizeSpec(size=64, mode="none"), encode=EncodeSpec(format="png")), CLASSES)
    assert outcome.tars is not None, outcome.reason
    members = members_of(outcome.tars[0])
    assert members["txt"] == b"the caption"
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(members["png"]))), np.asarray(Image.open(image).convert("RGB")))
    beyond = SourceItem(str(shard), "shard.tar/b", None, targets={"tar": {"offset": shard.stat().st_size - 10, "size": 100}})
    rejected = process_item(beyond, 1, job_spec(), CLASSES)
    assert rejected.tars is None and "the tar ends before" in rejected.reason
    huge = SourceItem(str(shard), "shard.tar/c", None, targets={"tar": {"offset": 0, "size": 10_000}})
    assert "over the 1000-byte input limit" in process_item(huge, 2, job_spec(max_file_bytes=1000), CLASSES).reason


# -- whole jobs ------------------------------------------------------------------


def fake_listing(monkeypatch: pytest.MonkeyPatch, items: list[SourceItem], **info: Any) -> None:
    """The job lists `items` (the source readers set `info` as a COCO or segmentation reader would)."""

    def listed(source: str, into: ListingInfo | None = None, **_: Any) -> Iterator[SourceItem]:
        if into is not None:
            into.kind = info.get("kind", "list")
            into.classes = list(info.get("classes", []))
            into.task = info.get("task", "classification")
            into.ignore_index = info.get("ignore_index")
        yield from items

    monkeypatch.setattr(opening_module, "list_images", listed)


def detection_items(folder: Path, count: int = 6) -> list[SourceItem]:
    items = []
    for i in range(count):
        image, mask, _ = write_scene(folder, f"img{i}", orientation=1 + i % 8)
        items.append(scene_item(image, mask, iscrowd=[0, 1, 0]))
    bad_mask = folder / "bad_mask.png"
    Image.new("L", (10, 10)).save(bad_mask)
    items.append(scene_item(folder / "img0.jpg", bad_mask))  # rejected: its mask has another size
    return items


def read_shards(out: Path, pattern: str = "*.tar") -> list[dict[str, Any]]:
    """Every sample, read by plain webdataset (its own decoders for .npy, .json, .txt); images as arrays, as stored."""
    urls = sorted(str(p) for p in out.rglob(pattern) if ".gpufeed" not in p.parts)
    samples = list(wds.WebDataset(urls, shardshuffle=False).decode())
    for sample in samples:  # webdataset's image decoders convert to RGB: a mask is read as its indices
        for key in ("jpg", "mask.png"):
            if key in sample:
                sample[key] = np.asarray(Image.open(io.BytesIO(sample[key])))
    return samples


@pytest.mark.parametrize(("workers", "mode"), [(0, "center-crop"), (1, "pad")])  # 1: forked workers
def test_a_detection_job_writes_targets_and_records_the_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int, mode: str
) -> None:
    (tmp_path / "src").mkdir()
    items = detection_items(tmp_path / "files")
    fake_listing(monkeypatch, items, kind="coco", classes=["cat", "dog"], task="detection", ignore_index=250)
    spec = PrepareSpec(str(tmp_path / "src"), str(tmp_path / "out"), resize=ResizeSpec(size=64, mode=mode))
    result = prepare_dataset(spec, workers=workers)
    assert (result.samples, result.rejected) == (6, 1)
    assert result.task == "detection"
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert "is 10x10, not the image's 160x120" in rejects[0]["reason"]
    manifest = read_manifest(tmp_path / "out")
    assert manifest.task == "detection" and manifest.classes == ["cat", "dog"]
    assert manifest.fields == ["boxes.npy", "box_labels.npy", "iscrowd.npy", "mask.png"]
    assert manifest.ignore_index == 250
    samples = read_shards(tmp_path / "out")
    assert len(samples) == 6
    dropped = 0
    for sample in samples:
        boxes, labels, crowd = sample["boxes.npy"], sample["box_labels.npy"], sample["iscrowd.npy"]
        assert boxes.shape == (len(labels), 4) and len(crowd) == len(labels)
        mask = sample["mask.png"]
        assert mask.shape == (64, 64)
        dropped += sample["json"]["boxes_dropped"]
        assert_colours_under_mask(sample["jpg"], mask)
        found = region_boxes(mask)
        for box in boxes:  # each stored box is around a region of the stored mask
            assert any(np.abs(np.array(region) - box).max() <= 1.0 for region in found.values()), (box, found)
        # padding is the listing's ignore index, in the workers too
        assert (250 in mask) == (mode == "pad" and sample["json"]["geometry"]["offset"] != [0, 0])
    assert manifest.boxes_dropped == dropped == result.boxes_dropped
    assert (dropped > 0) == (mode == "center-crop")
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()).get("boxes_dropped", 0) == dropped


def test_min_visible_decides_which_boxes_a_crop_drops(tmp_path: Path) -> None:
    image, _, _ = write_scene(tmp_path)
    # centre square of 120 x 120 starts at x = 20: box 0 keeps 30 of its 40 columns (75 %)
    item = scene_item(image)
    for min_visible, kept in ((0.25, 2), (0.8, 1), (0.0, 2)):
        spec = job_spec(resize=ResizeSpec(size=120, mode="center-crop"), min_visible=min_visible)
        [sample] = run_one(item, spec)
        assert len(sample["boxes.npy"]) == kept, min_visible
        assert sample["json"]["boxes_dropped"] == 3 - kept


def test_the_service_steps_carry_the_task_and_ignore_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "src").mkdir()
    image, mask, _ = write_scene(tmp_path / "files")
    items = [SourceItem(str(image), f"{i}.jpg", None, targets={"mask": str(mask)}) for i in range(3)]
    fake_listing(monkeypatch, items, task="segmentation", ignore_index=99)
    spec = PrepareSpec(str(tmp_path / "src"), str(tmp_path / "out"), resize=ResizeSpec(size=64, mode="pad"))
    plan = plan_prepare(spec)
    monkeypatch.setattr(opening_module, "list_images", None)  # the shard steps and the finish never list
    for shard in plan.pending:
        write_prepare_shard(spec, shard)
    result = finish_prepare(spec)
    manifest = read_manifest(tmp_path / "out")
    assert (result.task, manifest.task, manifest.ignore_index, manifest.fields) == ("segmentation", "segmentation", 99, ["mask.png"])
    for sample in read_shards(tmp_path / "out"):
        mask_values = np.unique(sample["mask.png"])
        assert 99 in mask_values  # the letterbox padding is the listing's ignore index


def test_a_listing_that_names_its_classes_in_targets_gets_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "src").mkdir()
    image, _, _ = write_scene(tmp_path / "files")
    items = [SourceItem(str(image), f"{i}.jpg", None, targets={"labels": labels}) for i, labels in enumerate([["b", "a"], ["c"]])]
    fake_listing(monkeypatch, items)
    result = prepare_dataset(PrepareSpec(str(tmp_path / "src"), str(tmp_path / "out"), resize=ResizeSpec(size=32)), workers=0)
    manifest = read_manifest(tmp_path / "out")
    assert (result.classes, manifest.task, manifest.fields) == (["a", "b", "c"], "multilabel", ["labels.json"])
    assert sorted(sample["labels.json"] for sample in read_shards(tmp_path / "out")) == [[0, 1], [2]]


# -- classification stays as it was ----------------------------------------------


MAIN = Path(os.environ.get("GPUFEED_MAIN", "/work/main"))


@pytest.mark.skipif(not (MAIN / "pipeline" / "prepare" / "job.py").exists(), reason="the main branch's code is not here")
def test_classification_shards_are_byte_identical_to_before(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i in range(6):
        image, _, _ = write_scene(src / f"class{i % 2}", f"img{i}", orientation=1 + i)
        (src / f"class{i % 2}" / f"img{i}_mask.png").unlink()  # not an image of the dataset's
    Image.new("RGB", (90, 70), (10, 200, 90)).save(src / "class0" / "flat.png")
    script = (
        "import sys\n"
        "from pipeline import AugmentSpec, PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset\n"
        "for mode, variants in (('shorter', 0), ('pad', 0), ('center-crop', 2)):\n"
        "    spec = PrepareSpec(sys.argv[1], f'{sys.argv[2]}/{mode}', resize=ResizeSpec(size=48, mode=mode),\n"
        "                       augment=AugmentSpec(variants=variants), shards=ShardSpec(max_bytes=None, max_samples=4))\n"
        "    prepare_dataset(spec, workers=0)\n"
    )
    outs = {}
    for name, code in (("before", MAIN), ("now", Path(__file__).resolve().parents[3])):
        env = {**os.environ, "PYTHONPATH": str(code)}
        subprocess.run([sys.executable, "-c", script, str(src), str(tmp_path / name)], check=True, env=env, cwd=tmp_path, timeout=300)
        outs[name] = {
            p.relative_to(tmp_path / name).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((tmp_path / name).rglob("*.tar"))
        }
    assert outs["now"] and outs["now"] == outs["before"]
    # and a dataset the earlier version prepared is the same job now: complete, nothing rewritten
    again = prepare_dataset(
        PrepareSpec(str(src), str(tmp_path / "before" / "shorter"), resize=ResizeSpec(size=48), shards=ShardSpec(max_bytes=None, max_samples=4)),
        workers=0,
    )
    assert again.already_complete
    manifest = read_manifest(tmp_path / "before" / "shorter")
    assert manifest.task == "classification" and manifest.boxes_dropped == 0


# -- settings --------------------------------------------------------------------


def test_min_visible_is_a_checked_setting_and_a_command_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="min_visible must be between 0.0 and 1.0"):
        job_spec(min_visible=1.5)
    assert "min_visible" not in job_spec().output_identity()  # at its default: the same job as before it existed
    assert job_spec(min_visible=0.5).output_identity()["min_visible"] == 0.5
    assert PrepareSpec.from_dict(job_spec(min_visible=0.5).to_dict()).min_visible == 0.5
    from click.testing import CliRunner

    from pipeline.cli import main

    run = CliRunner().invoke(main, ["prepare", str(tmp_path / "nowhere"), str(tmp_path / "out"), "--min-visible", "2"])
    assert run.exit_code != 0 and "--min-visible must be between 0.0 and 1.0" in run.output
