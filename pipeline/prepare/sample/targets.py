"""A listed sample's targets, kept in step with its pixels: parsed, checked, and sent through its geometry.

A source gives a sample's targets (`SourceItem.targets`) in the pixels of
its image file as stored, before the EXIF transposition the decoder applies,
or after it (`label_frame`: YOLO's are upright; COCO's and VOC's are
decided per image from the size the annotation declares).
Here they are checked (`parse_targets`: finite boxes, names of the job's
classes, a mask of the image's stored size), then sent through exactly what
the image went through (`place_targets`): the EXIF orientation
(`targets.orient_boxes` / `orient_mask`), then the transform's `Geometry`
(a resize, a centre crop, a variant's rotated random crop, a flip, padding).
Boxes are then clipped to the output and those that keep less than
`min_visible` of their area are dropped (and counted); masks are sampled
nearest-neighbour only, padding and the outside of a rotated crop filled
with the ignore index.

Whatever is wrong with one sample's targets is a `TargetError` whose
message is its reject reason: the sample goes to rejected.jsonl, the job
goes on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ...decode import open_image, pillow_warnings
from ...errors import DecodeError, SourceError
from ...io.fs import local_path, open_fs, open_regular_stat, read_source_bytes, redact_location
from ...polygons import Polygons, transform_polygons
from ...specs import PrepareSpec
from ...targets import (
    DEFAULT_IGNORE_INDEX,
    MAX_BOXES,
    MAX_CAPTION_BYTES,
    SampleTargets,
    TargetError,
    affine_boxes,
    affine_mask,
    box_areas,
    clip_boxes,
    crop_mask,
    flip_boxes,
    flip_mask,
    orient_boxes,
    orient_mask,
    pad_mask,
    scale_boxes,
)
from ..formats.common import brief, finite_number
from ..transforms import Geometry
from .coco_masks import check_segmentation

MASK_MODES = ("P", "L", "1", "I;16", "I;16L", "I;16B", "I;16N", "I")
"""PIL modes a mask may have: one class index per pixel (a palette PNG's pixels are its indices)."""


@dataclasses.dataclass
class SourceTargets:
    """A sample's targets as its source gives them, checked, class names resolved to indices.

    Boxes are float64 (N, 4) XYXY in the stored file's pixels, or fractions
    of its width and height when `normalized`.
    """

    labels: list[int] | None = None
    boxes: np.ndarray | None = None
    normalized: bool = False
    box_labels: np.ndarray | None = None
    iscrowd: np.ndarray | None = None
    mask: str | None = None
    segmentation: list[Any] | None = None  # COCO's shapes, one per box (`coco_masks.check_segmentation`)
    caption: str | None = None
    columns: dict[str, Any] | None = None
    frame: str | None = None  # "upright", "stored", or "declared": decided per image by `declared_size`
    declared_size: tuple[int, int] | None = None  # the (width, height) the annotation says its image has

    @property
    def geometric(self) -> bool:
        """Whether any target lives in the image's pixels (boxes, a mask): then the geometry is recorded."""
        return self.boxes is not None or self.mask is not None


def parse_targets(raw: Any, classes: dict[str, int]) -> SourceTargets:
    """A listed sample's `targets` checked, its class names (or indices) resolved with the job's classes.

    Args:
        raw: `SourceItem.targets`: a JSON object (see `SourceItem`).
        classes: class name -> index, the job's.

    Raises:
        TargetError: a target that is not what the contract says; the message is the reject reason.
    """
    if not isinstance(raw, dict):
        raise TargetError(f"bad annotation: targets must be an object, not {type(raw).__name__}")
    parsed = SourceTargets()
    if raw.get("labels") is not None:
        parsed.labels = [int(i) for i in _class_indices(raw["labels"], classes, "labels")]
    if raw.get("boxes") is not None:
        parsed.boxes = _boxes(raw["boxes"])
        parsed.normalized = _flag(raw.get("normalized", False), "normalized")
        if raw.get("box_labels") is None:
            raise TargetError("bad annotation: boxes without box_labels (a class per box)")
        parsed.box_labels = _class_indices(raw["box_labels"], classes, "box_labels")
        if len(parsed.box_labels) != len(parsed.boxes):
            raise TargetError(f"bad annotation: {len(parsed.boxes)} boxes but {len(parsed.box_labels)} box_labels")
        if raw.get("iscrowd") is not None:
            parsed.iscrowd = _crowd(raw["iscrowd"], len(parsed.boxes))
        if raw.get("segmentation") is not None:
            parsed.segmentation = check_segmentation(raw["segmentation"], len(parsed.boxes))
    elif raw.get("box_labels") is not None:
        raise TargetError("bad annotation: box_labels without boxes")
    elif raw.get("segmentation") is not None:
        raise TargetError("bad annotation: segmentation without boxes (one shape per box)")
    if raw.get("mask") is not None:
        if not isinstance(raw["mask"], str) or not raw["mask"]:
            raise TargetError("bad annotation: mask must be the path or URL of a mask image")
        if parsed.segmentation is not None:
            raise TargetError("bad annotation: both a mask file and segmentation shapes: give one")
        parsed.mask = raw["mask"]
    if raw.get("frame") is not None:
        if raw["frame"] not in (*LABEL_FRAMES, "declared"):
            raise TargetError(f"bad annotation: frame must be upright, stored or declared, not {brief(raw['frame'])}")
        parsed.frame = raw["frame"]
    if raw.get("declared_size") is not None:
        size = raw["declared_size"]
        if not (isinstance(size, list) and len(size) == 2 and all(_is_count(v) and v > 0 for v in size)):
            raise TargetError(f"bad annotation: declared_size must be [width, height] in pixels, not {brief(size)}")
        parsed.declared_size = (size[0], size[1])
    if raw.get("caption") is not None:
        parsed.caption = _caption(raw["caption"])
    if raw.get("columns") is not None:
        if not isinstance(raw["columns"], dict):
            raise TargetError("bad annotation: columns must be an object (column name -> value)")
        parsed.columns = raw["columns"]
    return parsed


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


LABEL_FRAMES = ("upright", "stored")
"""The pixels an annotation is in: the image after its EXIF rotation (what ultralytics, Detectron2 and
EXIF-aware annotation tools use), or the file's stored raster (what a reader that ignores EXIF sees)."""


def label_frame(source: SourceTargets, stored: tuple[int, int], orientation: int, default: str) -> tuple[str, bool]:
    """The frame a sample's targets are in, and whether its annotation's declared size matched neither frame.

    A frame the source states wins (YOLO: upright); a source that states
    none gives stored pixels (the `SourceItem` contract). A "declared" frame
    (COCO, VOC) is decided by the size the annotation declares (COCO's
    width/height, VOC's <size>): the stored size, or the upright one (they
    differ only for orientations 5 to 8). Where it cannot tell (no size, a
    square image, an orientation that keeps the size) or matches neither
    (counted), `default` (PrepareSpec.label_frame).
    """
    if source.frame != "declared":
        return source.frame or "stored", False
    if orientation == 1:
        return "stored", False  # the two are the same pixels
    upright = (stored[1], stored[0]) if orientation in (5, 6, 7, 8) else stored
    declared = source.declared_size
    if declared is None or (declared == stored and declared == upright):
        return default, False
    if declared == upright:
        return "upright", False
    if declared == stored:
        return "stored", False
    return default, True


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TargetError(f"bad annotation: {name} must be true or false, not {brief(value)}")
    return value


def _boxes(value: Any) -> np.ndarray:
    if not isinstance(value, list):
        raise TargetError("bad annotation: boxes must be a list of [x0, y0, x1, y1]")
    if len(value) > MAX_BOXES:
        raise TargetError(f"bad annotation: {len(value)} boxes, over the {MAX_BOXES} a sample may have")
    for number, box in enumerate(value):
        if not isinstance(box, (list, tuple)) or len(box) != 4 or not all(finite_number(v) for v in box):
            raise TargetError(f"bad annotation: box {number} is not four finite numbers: {brief(box)}")
        if box[2] < box[0] or box[3] < box[1]:
            raise TargetError(f"bad annotation: box {number} {box} has x1 < x0 or y1 < y0")
    return np.asarray(value, np.float64).reshape(-1, 4)


def _class_indices(value: Any, classes: dict[str, int], name: str) -> np.ndarray:
    """Class names (or indices into the job's classes) as int64 indices."""
    if not isinstance(value, list):
        raise TargetError(f"bad annotation: {name} must be a list of class names")
    if len(value) > MAX_BOXES:
        raise TargetError(f"bad annotation: {len(value)} {name}, over the {MAX_BOXES} a sample may have")
    count = len(classes)
    indices = []
    for entry in value:
        if isinstance(entry, str):
            index = classes.get(entry)
            if index is None:
                raise TargetError(f"bad annotation: {name} names {entry[:80]!r}, which is not one of the dataset's classes")
        elif isinstance(entry, int) and not isinstance(entry, bool):
            if not 0 <= entry < count:
                raise TargetError(f"bad annotation: {name} holds the class index {entry}, outside 0 to {count - 1}")
            index = entry
        else:
            raise TargetError(f"bad annotation: {name} holds {brief(entry)}, not a class name")
        indices.append(index)
    return np.asarray(indices, np.int64)


def _crowd(value: Any, count: int) -> np.ndarray:
    flags = isinstance(value, list) and all(isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)) for v in value)
    if not flags or len(value) != count:
        raise TargetError(f"bad annotation: iscrowd must be a list of {count} flags (0 or 1), one per box")
    return np.asarray(value, np.uint8)


def _caption(value: Any) -> str:
    if not isinstance(value, str):
        raise TargetError(f"bad annotation: caption must be text, not {type(value).__name__}")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_CAPTION_BYTES:
        raise TargetError(f"bad annotation: the caption is over the {MAX_CAPTION_BYTES} bytes a text may have")
    return value.encode("utf-8", "replace").decode("utf-8")  # lone surrogates become '?': the member is UTF-8


# -- reading: a mask file, an image inside a tar -----------------------------------


def read_mask(url: str, spec: PrepareSpec, stored_size: tuple[int, int]) -> np.ndarray:
    """A sample's class-index mask, read and decoded with the image's checks; it must have the image's stored size.

    Args:
        url: where the mask image is.
        spec: the job's settings (the input limit, the pixel limit).
        stored_size: (width, height) of the image file as stored (before EXIF).

    Returns:
        (H, W) uint8, or uint16 when an index is over 255.

    Raises:
        TargetError: the mask cannot be read or decoded, is not one index per pixel, or has another size.
    """
    where = redact_location(url)
    try:
        data = read_source_bytes(url, spec.max_file_bytes)
    except (OSError, ValueError, SourceError) as exc:  # OSError: also a FIFO or a device, never opened to be read
        raise TargetError(f"cannot read mask {where}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        with pillow_warnings([]):
            img = open_image(data, max_pixels=spec.max_pixels)
            if img.size != stored_size:
                raise TargetError(
                    f"mask {where} is {img.size[0]}x{img.size[1]}, not the image's {stored_size[0]}x{stored_size[1]}"
                )
            if img.mode not in MASK_MODES:
                raise TargetError(
                    f"mask {where} is a {img.mode} image: a mask holds one class index per pixel "
                    "(a grey, 16-bit or palette PNG)"
                )
            if getattr(img, "n_frames", 1) > 1:
                img.seek(0)
            img.load()
            array = np.asarray(img)
    except DecodeError as exc:
        raise TargetError(f"mask {where}: {exc.reason}") from None
    except TargetError:
        raise
    except Exception as exc:  # PIL raises many types for broken data
        raise TargetError(f"mask {where}: corrupt or truncated data: {str(exc)[:200] or type(exc).__name__}") from None
    if array.dtype == np.bool_ or array.dtype == np.uint8:
        return np.ascontiguousarray(array, dtype=np.uint8)
    if int(array.min(initial=0)) < 0 or int(array.max(initial=0)) > 65535:
        raise TargetError(f"mask {where} holds a class index outside 0 to 65535")
    return np.ascontiguousarray(array, dtype=np.uint8 if int(array.max(initial=0)) <= 255 else np.uint16)


def tar_range(raw: Any, max_bytes: int) -> tuple[int, int]:
    """(offset, size) of an image inside a tar (`targets["tar"]`), checked.

    Raises:
        TargetError: not two non-negative whole numbers, or over the input limit.
    """
    ok = isinstance(raw, dict) and all(
        isinstance(raw.get(name), int) and not isinstance(raw.get(name), bool) and raw[name] >= 0 for name in ("offset", "size")
    )
    if not ok:
        raise TargetError("bad annotation: tar must be {\"offset\": o, \"size\": n}, two whole numbers of bytes")
    if raw["size"] > max_bytes:
        raise TargetError(f"file is {raw['size']} bytes, over the {max_bytes}-byte input limit")
    return raw["offset"], raw["size"]


def read_tar_member(url: str, offset: int, size: int) -> bytes:
    """The `size` bytes at `offset` of the tar at `url` (a WebDataset shard): one member, not the whole tar.

    Raises:
        OSError: the tar cannot be read, or ends before the member does.
    """
    local = local_path(url)
    if local is not None:
        handle, status = open_regular_stat(local)
        with handle:
            if offset + size > status.st_size:
                raise OSError(f"the tar ends before its member's {size} bytes at offset {offset}")
            handle.seek(offset)
            data = handle.read(size)
    else:
        fs, path = open_fs(url)
        data = fs.cat_file(path, start=offset, end=offset + size)
    if len(data) != size:
        raise OSError(f"the tar ends before its member's {size} bytes at offset {offset}")
    return bytes(data)


# -- geometry ----------------------------------------------------------------------


def stored_size(upright: tuple[int, int], orientation: int) -> tuple[int, int]:
    """The stored file's (width, height) from its upright size and EXIF orientation."""
    return (upright[1], upright[0]) if orientation in (5, 6, 7, 8) else upright


def place_targets(
    source: SourceTargets,
    mask: np.ndarray | None,
    stored: tuple[int, int],
    orientation: int,
    geometry: Geometry,
    min_visible: float,
    ignore_index: int = DEFAULT_IGNORE_INDEX,
    instances: np.ndarray | None = None,
    polygons: Polygons | None = None,
) -> tuple[SampleTargets, int]:
    """A sample's targets in the pixels of one output picture, and how many boxes were dropped.

    Args:
        source: the sample's targets, in the stored file's pixels.
        mask: its mask, decoded (`read_mask`), of the stored size; None without one.
        stored: the stored (width, height).
        orientation: the EXIF orientation the decoder applied (1..8).
        geometry: what the output picture is of the upright original.
        min_visible: a box keeping less than this fraction of its area is dropped.
        ignore_index: the mask value of padding and of what lies outside a rotated crop.
        instances: its instance map (`coco_masks.instance_map`), of the stored size, or None:
            placed as the mask is (nearest), padding 0, renumbered for the boxes kept.
        polygons: per box, its polygons in the stored frame's pixels, or None: moved point
            by point as the boxes, clipped to the output (`pipeline.polygons`), kept boxes' only.

    Returns:
        (targets, boxes dropped).
    """
    placed = SampleTargets(labels=source.labels, caption=source.caption, columns=source.columns)
    dropped = 0
    if source.boxes is not None:
        placed.boxes, keep = _place_boxes(source, stored, orientation, geometry, min_visible)
        dropped = int(len(keep) - keep.sum())
        assert source.box_labels is not None  # parse_targets requires them with boxes
        placed.box_labels = source.box_labels[keep]
        placed.iscrowd = source.iscrowd[keep] if source.iscrowd is not None else None
        if instances is not None:  # box n of the kept ones is n + 1 again
            renumber = np.zeros(len(keep) + 1, np.uint16 if len(keep) >= 255 else np.uint8)
            renumber[np.flatnonzero(keep) + 1] = np.arange(1, int(keep.sum()) + 1)
            placed.instances = renumber[_place_mask(instances.astype(np.uint16), orientation, geometry, 0)]
        if polygons is not None:
            kept = [parts for parts, kept in zip(polygons, keep) if kept]
            flip = geometry.size[0] if geometry.flip else None
            (x, y), (width, height) = geometry.offset, geometry.size
            window = (float(x), float(y), float(x + width), float(y + height))  # the sampled picture on the output
            placed.polygons = transform_polygons(kept, stored, orientation, geometry.matrix, flip, geometry.offset, window)
    if mask is not None:
        placed.mask = _place_mask(mask, orientation, geometry, ignore_index)
    return placed, dropped


def _place_boxes(
    source: SourceTargets, stored: tuple[int, int], orientation: int, geometry: Geometry, min_visible: float
) -> tuple[np.ndarray, np.ndarray]:
    assert source.boxes is not None
    boxes = source.boxes * np.array([*stored, *stored], np.float64) if source.normalized else source.boxes
    upright = orient_boxes(boxes.astype(np.float64), orientation, *stored).astype(np.float64)
    moved = affine_boxes(upright, geometry.matrix)
    if geometry.flip:
        moved = flip_boxes(moved, geometry.size[0])
    moved = scale_boxes(moved, 1.0, 1.0, *geometry.offset)
    clipped, keep = clip_boxes(moved, geometry.canvas, box_areas(moved), min_visible)
    return clipped[keep].astype(np.float32), keep


def _place_mask(mask: np.ndarray, orientation: int, geometry: Geometry, ignore_index: int) -> np.ndarray:
    if ignore_index > 255 and mask.dtype == np.uint8:
        mask = mask.astype(np.uint16)  # the fill must fit
    upright = orient_mask(mask, orientation)
    a, _, c, _, e, f = geometry.matrix
    if geometry.axis_aligned:  # a crop and resize: torchvision's nearest resize (floor(u * in / out))
        width, height = geometry.size
        out = crop_mask(upright, (c, f, a * width, e * height), geometry.size, ignore_index)
    else:  # rotated: each output pixel's centre, mapped back (as the image's affine resampling)
        out = affine_mask(upright, geometry.matrix, geometry.size, ignore_index)
    if geometry.flip:
        out = flip_mask(out)
    if geometry.canvas != geometry.size or geometry.offset != (0, 0):
        out = pad_mask(out, geometry.offset, geometry.canvas, ignore_index)
    return np.ascontiguousarray(out)
