"""Instance polygons (YOLO-seg's, COCO's): kept in the shard, moved with their image, clipped to its window.

A detection sample whose source has polygon shapes keeps them beside its
boxes, one entry per box, in box order:

    <key>.polygons.json    [[[x0, y0, x1, y1, ...], ...], ...]: each box's polygons in pixels of
                           the stored image, COCO's flat form; [] for a box without one (an RLE
                           shape). A YOLO-seg line is one polygon; a COCO object may have several.

Polygons move as the boxes do, point by point (EXIF orientation, prepare's
affine, a flip, an offset), and a window (the output, a crop) clips them:
each edge of the window cuts the polygon (Sutherland-Hodgman), so a convex
polygon stays exact and a concave one keeps its area inside the window (a
part cut in two stays one outline, joined along the window's edge). A
polygon left with under three points or no area is gone; the box keeps an
empty list. `fill_polygons` gives the pixels whose centres polygons cover
(even-odd, scanlines through the pixel centres): COCO's shapes painted at
prepare, copy-paste's pasted outlines in the recipe's outputs.

Everything here is geometry on NumPy arrays and the member's codec; a
member that is not what the format says is a `ValueError` with the reason
(the loader makes it sample damage).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np

POLYGONS_MEMBER = "polygons.json"
MAX_SAMPLE_POINTS = 1 << 20
"""Points one sample's polygons may hold in all: a hostile member cannot ask for gigabytes."""
MAX_POLYGONS_BYTES = MAX_SAMPLE_POINTS * 32
"""The member's bytes at most: MAX_SAMPLE_POINTS points as written (two numbers of up to 15 characters each)."""

Polygons = list[list[np.ndarray]]
"""Per box, its polygons: float64 (K, 2) arrays of (x, y) points."""


def encode(polygons: Polygons) -> bytes:
    """The member's bytes: per box, its polygons as flat [x0, y0, ...] lists, to 1/1000 of a pixel."""
    rows = [[[round(float(v), 3) for v in points.reshape(-1)] for points in parts] for parts in polygons]
    return json.dumps(rows, separators=(",", ":")).encode("ascii")


def decode(data: bytes, boxes: int) -> Polygons:
    """A member's polygons, checked: one entry per box, each a list of polygons of finite points.

    Raises:
        ValueError: not JSON, nested too deep, not that shape, not one entry per box, or over
            MAX_SAMPLE_POINTS points (or MAX_POLYGONS_BYTES bytes).
    """
    if len(data) > MAX_POLYGONS_BYTES:
        raise ValueError(f"{POLYGONS_MEMBER} is {len(data)} bytes, over the {MAX_POLYGONS_BYTES} bytes it may have")
    try:
        rows = json.loads(data)
    except RecursionError:
        raise ValueError(f"{POLYGONS_MEMBER} is not JSON that can be read: it nests too deep") from None
    except ValueError as exc:
        raise ValueError(f"{POLYGONS_MEMBER} is not JSON ({str(exc)[:100]})") from None
    if not isinstance(rows, list) or len(rows) != boxes:
        count = len(rows) if isinstance(rows, list) else "not a list of"
        raise ValueError(f"{POLYGONS_MEMBER} holds {count} entries for {boxes} boxes (one list of polygons per box)")
    out: Polygons = []
    total = 0
    for parts in rows:
        if not isinstance(parts, list):
            raise ValueError(f"{POLYGONS_MEMBER}: a box's entry is a list of polygons")
        kept = []
        for flat in parts:
            if not isinstance(flat, list) or len(flat) % 2 or len(flat) < 6:
                raise ValueError(f"{POLYGONS_MEMBER}: a polygon is a flat list of at least three x, y pairs")
            total += len(flat) // 2
            if total > MAX_SAMPLE_POINTS:
                raise ValueError(f"{POLYGONS_MEMBER} holds over {MAX_SAMPLE_POINTS} points")
            if not all(type(v) in (int, float) for v in flat):
                raise ValueError(f"{POLYGONS_MEMBER}: a polygon coordinate is not a number")
            try:
                points = np.asarray(flat, np.float64).reshape(-1, 2)
            except OverflowError:  # an integer past float64's range
                raise ValueError(f"{POLYGONS_MEMBER}: a polygon coordinate is not finite") from None
            if not np.isfinite(points).all():
                raise ValueError(f"{POLYGONS_MEMBER}: a polygon coordinate is not finite")
            kept.append(points)
        out.append(kept)
    return out


# -- geometry --------------------------------------------------------------------


def orient_points(points: np.ndarray, orientation: int, width: int, height: int) -> np.ndarray:
    """Points of a stored (width x height) image after its EXIF `orientation` is made upright (as `targets.orient_boxes`)."""
    x, y = points[:, 0], points[:, 1]
    w, h = float(width), float(height)
    turned = {
        2: (w - x, y),
        3: (w - x, h - y),
        4: (x, h - y),
        5: (y, x),
        6: (h - y, x),
        7: (h - y, w - x),
        8: (y, w - x),
    }.get(orientation)
    return points.copy() if turned is None else np.stack(turned, axis=1)


def affine_points(points: np.ndarray, matrix: tuple[float, ...]) -> np.ndarray:
    """Points of the source in the output of an affine resampling whose `matrix` maps output to source
    (as `targets.affine_boxes` takes it).

    Raises:
        ValueError: the matrix cannot be inverted.
    """
    a, b, c, d, e, f = (float(v) for v in matrix)
    det = a * e - b * d
    if not math.isfinite(det) or abs(det) < 1e-12:
        raise ValueError(f"the affine matrix {matrix} cannot be inverted")
    x, y = points[:, 0] - c, points[:, 1] - f
    return np.stack([(e * x - b * y) / det, (a * y - d * x) / det], axis=1)


def clip_polygon(points: np.ndarray, window: tuple[float, float, float, float]) -> np.ndarray | None:
    """The polygon cut to `window` (x0, y0, x1, y1), edge by edge; None where under three points or no area is left."""
    x0, y0, x1, y1 = window
    if len(points) and x0 <= points[:, 0].min() and points[:, 0].max() <= x1 and y0 <= points[:, 1].min() and points[:, 1].max() <= y1:
        out = points  # inside already: most polygons of most samples
    else:
        out = points
        for axis, bound, keep_above in ((0, x0, True), (0, x1, False), (1, y0, True), (1, y1, False)):
            out = _cut(out, axis, bound, keep_above)
            if len(out) < 3:
                return None
    if len(out) < 3 or _area(out) <= 0.0:
        return None
    return out


def _cut(points: np.ndarray, axis: int, bound: float, keep_above: bool) -> np.ndarray:
    """One Sutherland-Hodgman pass: the polygon on the kept side of the line `axis` = `bound`."""
    value = points[:, axis] - bound
    inside = value >= 0 if keep_above else value <= 0
    if inside.all():
        return points
    if not inside.any():
        return points[:0]
    following = np.roll(points, -1, axis=0)
    next_value = np.roll(value, -1)
    next_inside = np.roll(inside, -1)
    out: list[np.ndarray] = []
    for k in range(len(points)):
        if inside[k]:
            out.append(points[k])
        if inside[k] != next_inside[k]:  # the edge crosses the line: where
            t = value[k] / (value[k] - next_value[k])
            point = points[k] + t * (following[k] - points[k])
            point[axis] = bound
            out.append(point)
    return np.array(out, np.float64).reshape(-1, 2)


def _area(points: np.ndarray) -> float:
    x, y = points[:, 0], points[:, 1]
    return abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1)))) / 2


def fill_polygons(
    polygons: Sequence[np.ndarray], size: tuple[int, int], origin: tuple[float, float] = (0, 0)
) -> np.ndarray:
    """The (h, w) bool mask of pixels whose centre lies inside any of the polygons (each by the even-odd rule).

    A COCO annotation's polygons are its parts: they add up, as pycocotools merges them; so do the outlines
    copy-paste pastes (`pipeline.augment.copy_paste`).

    Args:
        polygons: (n, 2) arrays of (x, y) points, in pixels (pixel k spans [k, k + 1]).
        size: (width, height).
        origin: the picture's pixel that is the mask's (0, 0) (a part of a larger picture).
    """
    width, height = size
    inside = np.zeros((height, width), np.bool_)
    for points in polygons:
        placed = fill_region(np.asarray(points, np.float64) - np.asarray(origin, np.float64), width, height)
        if placed is not None:
            top, left, region = placed
            inside[top : top + region.shape[0], left : left + region.shape[1]] |= region
    return inside


def fill_region(points: np.ndarray, width: int, height: int) -> tuple[int, int, np.ndarray] | None:
    """One polygon's pixels within its bounds, by scanlines through the pixel centres, all edges at once.

    Returns:
        (top, left, bool region) or None where it covers no pixel.
    """
    xa, ya = points[:, 0], points[:, 1]
    xb, yb = np.roll(xa, -1), np.roll(ya, -1)
    low, high = np.minimum(ya, yb), np.maximum(ya, yb)
    # Rows j whose centre y = j + 0.5 an edge crosses, half-open [low, high): each vertex counted once.
    first = np.clip(np.ceil(low - 0.5), 0, height).astype(np.int64)
    last = np.clip(np.ceil(high - 0.5), 0, height).astype(np.int64)
    spans = last - first
    total = int(spans.sum())
    if not total:
        return None
    edge = np.repeat(np.arange(len(points)), spans)
    rows = np.arange(total) - np.repeat(np.cumsum(spans) - spans, spans) + first[edge]
    centre = rows + 0.5
    xs = xa[edge] + (centre - ya[edge]) * (xb[edge] - xa[edge]) / (yb[edge] - ya[edge])
    order = np.lexsort((xs, rows))
    rows, xs = rows[order], xs[order]
    # Even-odd: crossings pair up within each row (each row has an even number of them).
    starts = np.clip(np.ceil(xs[0::2] - 0.5), 0, width).astype(np.int64)
    stops = np.clip(np.ceil(xs[1::2] - 0.5), 0, width).astype(np.int64)
    top, bottom = int(rows[0]), int(rows[-1]) + 1
    left, right = int(starts.min()), int(stops.max())
    if right <= left:
        return None
    span = right - left + 1
    at = (rows[0::2] - top) * span
    cells = (bottom - top) * span
    steps = np.bincount(at + starts - left, minlength=cells) - np.bincount(at + stops - left, minlength=cells)
    region = np.cumsum(steps.reshape(bottom - top, span), axis=1)[:, : span - 1] > 0
    return top, left, region


def place_polygons(
    polygons: Polygons,
    box: tuple[float, float, float, float],
    dest: tuple[int, int, int, int],
    size: int,
    flip: bool,
) -> list[list[np.ndarray]]:
    """Polygons after the part `box` (left, top, width, height) of their image is resized into `dest`
    (x, y, width, height) of a `size` x `size` output, clipped to `dest`, then flipped (as
    `targets.place_boxes` moves boxes). Per box, its polygons as float32 (K, 2) arrays.
    """
    left, top, width, height = box
    x, y, dest_w, dest_h = dest
    scale = np.array([dest_w / width, dest_h / height])
    shift = np.array([x - left * scale[0], y - top * scale[1]])
    window = (float(x), float(y), float(x + dest_w), float(y + dest_h))
    out = []
    for parts in polygons:
        placed = []
        for points in parts:
            clipped = clip_polygon(points * scale + shift, window)
            if clipped is None:
                continue
            if flip:
                clipped = clipped * np.array([-1.0, 1.0]) + np.array([float(size), 0.0])
            placed.append(clipped.astype(np.float32))
        out.append(placed)
    return out


def transform_polygons(
    polygons: Polygons,
    stored: tuple[int, int],
    orientation: int,
    matrix: tuple[float, ...],
    flip_width: int | None,
    offset: tuple[int, int],
    window: tuple[float, float, float, float],
) -> Polygons:
    """Prepare's geometry on polygons in the stored frame: upright, the affine, a flip in a picture
    `flip_width` wide (None: none), the offset on the output, clipped to `window` (x0, y0, x1, y1)."""
    out = []
    for parts in polygons:
        placed = []
        for points in parts:
            moved = affine_points(orient_points(points, orientation, *stored), matrix)
            if flip_width is not None:
                moved[:, 0] = flip_width - moved[:, 0]
            moved = moved + np.array(offset, np.float64)
            clipped = clip_polygon(moved, window)
            if clipped is not None:
                placed.append(clipped)
        out.append(placed)
    return out
