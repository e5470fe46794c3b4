"""COCO's instance shapes (polygons, RLE) made into one class-index mask per image.

A COCO source whose annotations carry a `segmentation` gets a `mask.png`
beside its `boxes.npy` / `box_labels.npy`, rasterised here in the pixels
of the image as stored (its EXIF orientation and the resize or variant
geometry follow, as for a mask file: `targets.place_targets`).
The values:

    0                background: a pixel of no annotation
    c + 1            an instance of box class c (the index `box_labels.npy` holds)
    ignore index     a crowd annotation (iscrowd = 1), 255 by default: left out of the loss

so the mask's classes are ["background", *classes] (the manifest records
them as `mask_classes`). Annotations are painted in the JSON's order: where
instances overlap, the later one wins. An annotation without a
segmentation paints nothing.

The shapes:

- polygons: a list of [x0, y0, x1, y1, ...] in pixels; a pixel is inside
  when its centre (x + 0.5, y + 0.5) is (even-odd rule), so the polygon
  of a box's four corners covers exactly the pixels the box covers (PIL's
  `ImageDraw.polygon` would add a row and a column). An annotation's
  polygons add up; one of fewer than three points covers nothing.
- uncompressed RLE: {"counts": [n0, n1, ...], "size": [h, w]}, runs over
  the pixels in column-major order, starting with a run of zeros.
- compressed RLE: {"counts": "string", "size": [h, w]}, COCO's ASCII form
  (5 bits a character, continuation bit 0x20, sign bit 0x10 on the last;
  from the fourth count on, each is stored as its difference from the
  count two before).

Every shape is checked before a pixel is painted: an RLE's size must be
the image's stored size and its counts must cover h * w pixels exactly;
polygon coordinates must be finite, at most `MAX_POLYGON_POINTS` points
each. A malformed one is a `TargetError` naming the annotation, which
rejects the sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...polygons import fill_region
from ...targets import TargetError
from ..formats.common import finite_number

MAX_POLYGON_POINTS = 1 << 16
"""Points one polygon may have (COCO's largest have a few hundred)."""
MAX_POLYGONS = 1 << 12
"""Polygons one annotation may have."""
MAX_RLE_COUNTS = 1 << 24
"""Runs one RLE may have (an image of 16 M pixels alternating would need that many)."""
_MAX_COORDINATE = float(1 << 20)  # pixels: far past any image a prepare job accepts


def check_segmentation(raw: Any, count: int) -> list[Any]:
    """The sample's `segmentation` list checked for shape (one entry per box), without the image's size.

    Args:
        raw: `SourceItem.targets["segmentation"]`.
        count: how many boxes the sample has.

    Returns:
        One entry per box: None, a list of polygons (float64 arrays of
        (x, y) rows), or an RLE {"counts": list[int] | str, "size": (h, w)}.

    Raises:
        TargetError: not a list of `count` entries, or an entry that is
            neither polygons nor RLE (the message names it).
    """
    if not isinstance(raw, list) or len(raw) != count:
        raise TargetError(f"bad annotation: segmentation must be a list of {count} entries, one per box")
    return [_check_entry(entry, number) for number, entry in enumerate(raw)]


def _check_entry(entry: Any, number: int) -> Any:
    if entry is None or entry == []:
        return None
    if isinstance(entry, list):
        return _polygons(entry, number)
    if isinstance(entry, dict):
        return _rle_entry(entry, number)
    raise TargetError(f"bad annotation: segmentation {number} is neither polygons (a list) nor RLE (an object)")


def _polygons(entry: list[Any], number: int) -> list[np.ndarray]:
    if len(entry) > MAX_POLYGONS:
        raise TargetError(f"bad annotation: segmentation {number} has {len(entry)} polygons, over {MAX_POLYGONS}")
    polygons = []
    for polygon in entry:
        if not isinstance(polygon, list) or len(polygon) % 2:
            raise TargetError(f"bad annotation: segmentation {number}: a polygon is a list of x, y pairs")
        if len(polygon) > 2 * MAX_POLYGON_POINTS:
            raise TargetError(
                f"bad annotation: segmentation {number}: a polygon of {len(polygon) // 2} points, over {MAX_POLYGON_POINTS}"
            )
        if not all(finite_number(v) for v in polygon):  # an integer of 400 digits is no float
            raise TargetError(f"bad annotation: segmentation {number}: a polygon coordinate is not a finite number")
        points = np.asarray(polygon, np.float64).reshape(-1, 2)
        if len(points) and np.abs(points).max() > _MAX_COORDINATE:
            raise TargetError(f"bad annotation: segmentation {number}: a polygon coordinate is out of range")
        if len(points) >= 3:  # fewer cover nothing (COCO has a few such)
            polygons.append(points)
    return polygons


def _rle_entry(entry: dict[str, Any], number: int) -> dict[str, Any]:
    size, counts = entry.get("size"), entry.get("counts")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in size)):
        raise TargetError(f"bad annotation: segmentation {number}: an RLE's size must be [height, width]")
    if isinstance(counts, str):
        if len(counts) > 13 * MAX_RLE_COUNTS:
            raise TargetError(f"bad annotation: segmentation {number}: an RLE of over {MAX_RLE_COUNTS} runs")
        return {"counts": counts, "size": (size[0], size[1])}
    if not isinstance(counts, list) or len(counts) > MAX_RLE_COUNTS:
        raise TargetError(f"bad annotation: segmentation {number}: an RLE's counts must be a list of run lengths or a string")
    pixels = size[0] * size[1]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= pixels for v in counts):
        raise TargetError(
            f"bad annotation: segmentation {number}: an RLE count is not a non-negative whole number up to the {pixels} "
            "pixels of its size"
        )
    return {"counts": counts, "size": (size[0], size[1])}


# -- RLE -------------------------------------------------------------------------


def rle_string_counts(text: str) -> list[int]:
    """The run lengths of a compressed COCO RLE string (as pycocotools' `rleFrString` reads it).

    Raises:
        ValueError: a character outside COCO's alphabet ('0' .. 'o'), a count
            cut off, or a count that is negative or absurdly large.
    """
    counts: list[int] = []
    value = shift = 0
    for char in text:
        code = ord(char) - 48
        if not 0 <= code < 64:
            raise ValueError(f"the character {char!r} is not part of COCO's RLE alphabet")
        value |= (code & 0x1F) << shift
        shift += 5
        if code & 0x20:  # more characters of this count follow
            if shift > 60:
                raise ValueError("a run length of over 60 bits")
            continue
        if code & 0x10:  # the sign of the last group: extend it
            value -= 1 << shift
        if len(counts) > 2:
            value += counts[-2]
        if value < 0:
            raise ValueError("a negative run length")
        counts.append(value)
        if len(counts) > MAX_RLE_COUNTS:
            raise ValueError(f"over {MAX_RLE_COUNTS} runs")
        value = shift = 0
    if shift:
        raise ValueError("the string ends inside a run length")
    return counts


def decode_rle(counts: list[int] | str, size: tuple[int, int]) -> np.ndarray:
    """The (h, w) bool mask of an RLE: runs in column-major order, zeros first.

    Raises:
        ValueError: the counts do not cover h * w pixels exactly (or do not decode).
    """
    height, width = size
    runs = rle_string_counts(counts) if isinstance(counts, str) else counts
    total = height * width
    # Summed as Python ints, before numpy sees a count: int64 sums wrap (two counts of 2**63 - 1 and a
    # few more "cover" a small image), and np.repeat would then write far past what it allocated
    # (numpy refuses a negative count itself).
    covered = sum(runs)
    if covered != total:
        raise ValueError(f"its counts cover {covered} pixels, not the {height}x{width} = {total} of its size")
    lengths = np.asarray(runs, np.int64)
    values = (np.arange(len(lengths)) % 2).astype(np.bool_)  # zeros, ones, zeros, ...
    flat = np.repeat(values, lengths)
    return np.ascontiguousarray(flat.reshape(width, height).T)


# -- one image -------------------------------------------------------------------


def rasterise(
    shapes: list[Any], box_labels: np.ndarray, crowd: np.ndarray | None, stored: tuple[int, int], ignore_index: int
) -> np.ndarray:
    """The class-index mask of an image's annotations, the image's stored size (see the module's table).

    Args:
        shapes: `check_segmentation`'s entries, one per box, in the JSON's order.
        box_labels: int64 class index of each box.
        crowd: COCO's crowd flag of each box (None: no crowds).
        stored: the image file's (width, height) as stored.
        ignore_index: what a crowd annotation paints.

    Returns:
        (H, W) uint8, or uint16 when a value is over 255.

    Raises:
        TargetError: an RLE of another size than the image's, or whose counts do not cover it.
    """
    width, height = stored
    painted = [int(box_labels[n]) + 1 for n, shape in enumerate(shapes) if shape is not None and not (crowd is not None and crowd[n])]
    if ignore_index in painted:
        raise TargetError(f"bad annotation: class {ignore_index - 1} would paint the mask's ignore index {ignore_index}")
    highest = max(int(box_labels.max(initial=-1)) + 1, ignore_index if crowd is not None and crowd.any() else 0)
    mask = np.zeros((height, width), np.uint8 if highest <= 255 else np.uint16)
    return _paint(mask, shapes, lambda number: _value(number, box_labels, crowd, ignore_index))


def instance_map(shapes: list[Any], stored: tuple[int, int]) -> np.ndarray:
    """Each annotation's own pixels, the image's stored size: box n's shape painted as n + 1, 0 elsewhere.

    Where two shapes overlap the later one wins, as in `rasterise`; the
    loader turns the map into one mask per kept box (Mask R-CNN's form).

    Raises:
        TargetError: as `rasterise`.
    """
    width, height = stored
    mask = np.zeros((height, width), np.uint8 if len(shapes) < 255 else np.uint16)
    return _paint(mask, shapes, lambda number: number + 1)


def _paint(mask: np.ndarray, shapes: list[Any], value_of: Callable[[int], int]) -> np.ndarray:
    height, width = mask.shape
    for number, shape in enumerate(shapes):
        if shape is None:
            continue
        if isinstance(shape, dict):
            if tuple(shape["size"]) != (height, width):
                h, w = shape["size"]
                raise TargetError(f"bad annotation: segmentation {number}: an RLE of {w}x{h}, not the image's {width}x{height}")
            try:
                region = decode_rle(shape["counts"], shape["size"])
            except ValueError as exc:
                raise TargetError(f"bad annotation: segmentation {number}: a malformed RLE ({exc})") from None
            mask[region] = value_of(number)
            continue
        for points in shape:  # an annotation's polygons add up: each painted in turn, within its bounds
            placed = fill_region(points, width, height)
            if placed is not None:
                top, left, part = placed
                mask[top : top + part.shape[0], left : left + part.shape[1]][part] = value_of(number)
    return mask


def _value(number: int, box_labels: np.ndarray, crowd: np.ndarray | None, ignore_index: int) -> int:
    return ignore_index if crowd is not None and bool(crowd[number]) else int(box_labels[number]) + 1
