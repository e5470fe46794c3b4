"""Ultralytics' training recipe as one plan per output image: which sources, by which matrix, which boxes survive.

`plan` draws, in ultralytics' order and by its formulas, what its
`v8_transforms` draws for one training image: whether to mosaic (and the
mosaic's centre), the random affine, the vertical and horizontal flips.
Each source image gets one matrix from its original pixels to the output
(its resize to S, its place in the mosaic, the affine, the flips) and a
window of the mosaic canvas it shows; the boxes go through the same
matrices, are clipped to the canvas and to the output, and filtered as
ultralytics filters them (`warp.box_candidates`). HSV gains are drawn too;
they are applied per batch (`hsv.py`).

Instance polygons (YOLO-seg's, COCO's), where given, go through the same
matrices point by point: clamped to the canvas as ultralytics' `Instances.clip`
clamps its outlines' points (a part past the canvas lies along its edge),
then through the warp and cut to the output (`pipeline.polygons.clip_polygon`,
exact, as its `segment2box` is); a box with polygons then becomes the box
around what is left of them (ultralytics' `segment2box`: the rotated or
sheared outline, not its rotated box), and the area filter keeps 1 % of a
box's area instead of 10 %, as ultralytics does when an image has segments.

With `copy_paste` (ultralytics' `CopyPaste`, mode "flip", between the mosaic
and the affine: `copy_paste.py`), instances with polygons are mirrored about
the canvas' vertical centre line where they land on no other box; each copy
joins the boxes and polygons (its original's label, tile and index;
`Plan.copied`) and goes through the affine, the filter and the flips as
they do. Its pixels are the canvas' mirror image under its outline:
`Plan.pasted` holds the outlines in output pixels, `Plan.mirror` the
canvas' mirror, and `render` composites the output through `warp @ mirror`
there.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..polygons import Polygons, clip_polygon
from .affine import RandomAffine
from .copy_paste import choose, mirrored_boxes
from .hsv import HSV
from .mosaic import Mosaic, Tile, load_size
from .warp import Uniform, box_candidates, boxes_through, clip_boxes, hflip, points_through, scaling

SEGMENTS_AREA_THR = 0.01
"""The share of its area a box must keep where the image's boxes come from polygons (ultralytics' rule)."""


@dataclasses.dataclass(frozen=True)
class YoloRecipe:
    """Ultralytics' default detection hyperparameters (mosaic 1.0, translate 0.1, scale 0.5, fliplr 0.5,
    HSV 0.015/0.7/0.4, degrees/shear/perspective 0, flipud 0, copy_paste 0) at output size `size`; `mosaic=None`
    is mosaic off (ultralytics' `close_mosaic` epochs). `copy_paste` is the share of the polygons ultralytics'
    `CopyPaste` (mode "flip") mirrors onto the canvas where they fit (nothing without polygons)."""

    size: int = 640
    mosaic: Mosaic | None = Mosaic()
    affine: RandomAffine = RandomAffine()
    fliplr: float = 0.5
    flipud: float = 0.0
    hsv: HSV | None = HSV()
    fill: int = 114
    area_thr: float = 0.1
    copy_paste: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.copy_paste, (int, float)) and 0.0 <= self.copy_paste <= 1.0):
            raise ValueError(f"YoloRecipe(copy_paste={self.copy_paste!r}): a probability is 0 to 1")

    @property
    def sources(self) -> int:
        """How many images one output is made of when the mosaic draws in: 4, or 1 without a mosaic."""
        return 1 if self.mosaic is None else self.mosaic.n


@dataclasses.dataclass
class Plan:
    """One output image: its sources' tiles and the canvas-to-output warp, and the boxes that survive.

    Attributes:
        size: the output is size x size.
        canvas: (width, height) of the canvas the tiles lie on (2S x 2S with a mosaic).
        tiles: per source used, its matrix (original pixels -> canvas) and window of the canvas.
        warp: 3x3, canvas -> output (the affine, then the flips).
        boxes: (K, 4) float32 XYXY in output pixels.
        labels: (K,) int64 class indices.
        source_of: (K,) which tile each box came from.
        box_index: (K,) each box's index among its tile's own boxes (what its instance map calls it, less 1).
        hsv_gains: the (hue, saturation, value) gains drawn, or None.
        fill: the value of output pixels no source covers.
        polygons: per box, its polygons as float32 (P, 2) output pixels (None where none were given).
        copied: (K,) which boxes are copy-paste's mirrored copies (their `source_of`, `box_index` and label
            are their original's).
        pasted: the outlines the copy-paste pasted, as float32 (P, 2) output pixels (every copy's, kept
            box or not: its pixels were pasted on the canvas), or None where nothing was pasted.
        mirror: 3x3, canvas -> canvas: the canvas' mirror image, which shows under `pasted` (None likewise).
    """

    size: int
    canvas: tuple[int, int]
    tiles: list[Tile]
    warp: np.ndarray
    boxes: np.ndarray
    labels: np.ndarray
    source_of: np.ndarray
    hsv_gains: tuple[float, float, float] | None = None
    fill: int = 114
    polygons: list[list[np.ndarray]] | None = None
    box_index: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    copied: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
    pasted: list[np.ndarray] | None = None
    mirror: np.ndarray | None = None

    def matrix(self, tile: int) -> np.ndarray:
        """Source `tile`'s whole map: its original pixels -> the output."""
        return self.warp @ self.tiles[tile].matrix


def plan(
    recipe: YoloRecipe,
    rng: Uniform,
    originals: list[tuple[int, int]],
    boxes: list[np.ndarray],
    labels: list[np.ndarray],
    hsv_rng: Uniform | None = None,
    polygons: list[Polygons] | None = None,
) -> Plan:
    """The plan of one output from `originals` (width, height; the sample's own first, then its mosaic
    partners) and their boxes (XYXY, original pixels) and labels.

    `rng` draws the geometry in ultralytics' order (`random`); `hsv_rng` the HSV gains (ultralytics
    draws those from NumPy's generator), default `rng`. `polygons`, where given, holds each source's
    polygons per box (original pixels; a box without one has an empty list): they follow the boxes
    and shape them (see the module's docstring).
    """
    size = recipe.size
    use_mosaic = recipe.mosaic is not None and not rng.uniform(0, 1) > recipe.mosaic.p
    if use_mosaic:
        assert recipe.mosaic is not None
        if len(originals) < recipe.mosaic.n:
            raise ValueError(f"a mosaic takes {recipe.mosaic.n} images, {len(originals)} given")
        tiles = recipe.mosaic.tiles(rng, size, originals[: recipe.mosaic.n])
        canvas = (2 * size, 2 * size)
    else:
        w, h = load_size(*originals[0], size)
        tiles = [Tile(scaling(w / originals[0][0], h / originals[0][1]), (0, 0, w, h))]
        canvas = (w, h)
    on_canvas, kept_labels, source_of = _placed(tiles, boxes, labels, canvas)
    box_index = _own_index(source_of)
    shapes = _shapes_on_canvas(tiles, polygons, canvas) if polygons is not None else None
    nonzero = (on_canvas[:, 2] > on_canvas[:, 0]) & (on_canvas[:, 3] > on_canvas[:, 1])  # ultralytics' zero-area removal
    on_canvas, kept_labels, source_of, box_index = on_canvas[nonzero], kept_labels[nonzero], source_of[nonzero], box_index[nonzero]
    if shapes is not None:
        shapes = [shapes[k] for k in np.flatnonzero(nonzero)]
    picked = _copies(recipe.copy_paste, on_canvas, shapes, canvas[0])
    copied = np.arange(len(on_canvas) + len(picked)) >= len(on_canvas)
    mirror = hflip(canvas[0]) if len(picked) else None
    pasted: list[np.ndarray] | None = None
    if mirror is not None and shapes is not None:  # the copies join the boxes, mirrored
        copies = [(True, [points_through(points, mirror) for points in shapes[k][1]]) for k in picked]
        shapes, pasted = shapes + copies, [points for _, parts in copies for points in parts]
        on_canvas = np.concatenate([on_canvas, mirrored_boxes(on_canvas[picked], canvas[0])])
        kept_labels, source_of, box_index = (np.r_[a, a[picked]] for a in (kept_labels, source_of, box_index))
    warp, scale = recipe.affine.matrix(rng, canvas, (size, size))
    out = clip_boxes(boxes_through(on_canvas, warp), size, size)
    area_thr = recipe.area_thr
    if shapes is not None and any(had for had, _ in shapes):
        shapes, out = _shapes_through(shapes, warp, size, out)
        area_thr = SEGMENTS_AREA_THR
    keep = box_candidates(on_canvas * scale, out, area_thr=area_thr)
    out, kept_labels, source_of, box_index, copied = out[keep], kept_labels[keep], source_of[keep], box_index[keep], copied[keep]
    if pasted is not None:
        pasted = _outlines_through(pasted, warp, size)
    kept_shapes = [shapes[k][1] for k in np.flatnonzero(keep)] if shapes is not None else None
    if rng.random() < recipe.flipud:
        warp = np.array([[1.0, 0, 0], [0, -1.0, size], [0, 0, 1.0]]) @ warp
        out[:, [1, 3]] = size - out[:, [3, 1]]
        kept_shapes = _mirrored(kept_shapes, 1, size)
        pasted = _mirrored_outlines(pasted, 1, size)
    if rng.random() < recipe.fliplr:
        warp = hflip(size) @ warp
        out[:, [0, 2]] = size - out[:, [2, 0]]
        kept_shapes = _mirrored(kept_shapes, 0, size)
        pasted = _mirrored_outlines(pasted, 0, size)
    gains = recipe.hsv.draw(hsv_rng or rng) if recipe.hsv is not None else None
    placed = [[points.astype(np.float32) for points in parts] for parts in kept_shapes] if kept_shapes is not None else None
    return Plan(size, canvas, tiles, warp, out.astype(np.float32), kept_labels, source_of, gains, recipe.fill, placed,
                box_index, copied, [points.astype(np.float32) for points in pasted] if pasted is not None else None,
                mirror)  # fmt: skip


def _copies(p: float, on_canvas: np.ndarray, shapes: list[Shape] | None, width: int) -> np.ndarray:
    """The boxes ultralytics' copy-paste mirrors (`copy_paste.choose`), in its order: none where `p` is 0 or no
    box has polygons."""
    if p <= 0 or shapes is None:
        return np.zeros(0, np.int64)
    return choose(p, on_canvas, [k for k, (had, _) in enumerate(shapes) if had], width)


def _own_index(source_of: np.ndarray) -> np.ndarray:
    """Each box's index among its own tile's boxes (`source_of` runs tile by tile, as `_placed` lays them)."""
    if not len(source_of):
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, source_of[1:] != source_of[:-1]])
    return np.arange(len(source_of), dtype=np.int64) - np.repeat(starts, np.diff(np.r_[starts, len(source_of)]))


Shape = tuple[bool, list[np.ndarray]]
"""A box's polygons on their way: whether it had any to begin with, and what is left of them."""


def _shapes_on_canvas(tiles: list[Tile], polygons: list[Polygons], canvas: tuple[int, int]) -> list[Shape]:
    """Each box's polygons (in `_placed`'s order: tile by tile) through its tile's matrix, their points clamped to
    the canvas as ultralytics' `Instances.clip` clamps them (a part outside lies along the edge it crossed)."""
    shapes: list[Shape] = []
    for index, tile in enumerate(tiles):
        for parts in polygons[index]:
            shapes.append((bool(parts), [_clamped(points_through(points, tile.matrix), canvas) for points in parts]))
    return shapes


def _clamped(points: np.ndarray, canvas: tuple[int, int]) -> np.ndarray:
    """A closed outline's every point clamped to the canvas: its vertices, and where an edge crosses one of the
    canvas' lines a vertex there, so that the clamped outline is the clamped path of every point of it (ultralytics
    clamps its outlines resampled to 1000 points)."""
    following = np.roll(points, -1, axis=0)
    step = following - points
    edges, ts = [np.arange(len(points))], [np.zeros(len(points))]
    for axis, bound in ((0, 0.0), (0, float(canvas[0])), (1, 0.0), (1, float(canvas[1]))):
        moving = step[:, axis] != 0
        t = np.full(len(points), -1.0)
        t[moving] = (bound - points[moving, axis]) / step[moving, axis]
        crossing = np.flatnonzero((t > 0) & (t < 1))
        edges.append(crossing)
        ts.append(t[crossing])
    edge, t = np.concatenate(edges), np.concatenate(ts)
    if len(edge) == len(points):
        return np.clip(points, 0.0, canvas)
    order = np.lexsort((t, edge))
    edge, t = edge[order], t[order]
    return np.clip(points[edge] + t[:, None] * step[edge], 0.0, canvas)


def _shapes_through(shapes: list[Shape], warp: np.ndarray, size: int, boxes: np.ndarray) -> tuple[list[Shape], np.ndarray]:
    """The polygons through the canvas-to-output warp, cut to the output; each box that had polygons becomes
    the box around what is left of them (none left: an empty box, which the filter drops)."""
    window = (0.0, 0.0, float(size), float(size))
    out = boxes.copy()
    moved: list[Shape] = []
    for k, (had, parts) in enumerate(shapes):
        left = [clipped for points in parts if (clipped := clip_polygon(points_through(points, warp), window)) is not None]
        if had:
            if left:
                stacked = np.concatenate(left)
                out[k] = (*stacked.min(axis=0), *stacked.max(axis=0))
            else:
                out[k] = 0.0
        moved.append((had, left))
    return moved, out


def _mirrored(shapes: list[list[np.ndarray]] | None, axis: int, size: int) -> list[list[np.ndarray]] | None:
    if shapes is None:
        return None
    return [_mirrored_outlines(parts, axis, size) or [] for parts in shapes]


def _mirrored_outlines(outlines: list[np.ndarray] | None, axis: int, size: int) -> list[np.ndarray] | None:
    if outlines is None:
        return None
    out = []
    for points in outlines:
        points = points.copy()
        points[:, axis] = size - points[:, axis]
        out.append(points)
    return out


def _outlines_through(outlines: list[np.ndarray], warp: np.ndarray, size: int) -> list[np.ndarray]:
    """Pasted outlines from the canvas to the output, cut to it."""
    window = (0.0, 0.0, float(size), float(size))
    return [clipped for points in outlines if (clipped := clip_polygon(points_through(points, warp), window)) is not None]


def _placed(
    tiles: list[Tile], boxes: list[np.ndarray], labels: list[np.ndarray], canvas: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tiles' boxes on the canvas, clipped to it (each tile's matrix a scale and a shift), their labels and
    tiles: all tiles at once, as `clip_boxes(boxes_through(...))` of each."""
    counts = [len(boxes[i]) for i in range(len(tiles))]
    source_of = np.repeat(np.arange(len(tiles), dtype=np.int64), counts)
    kept_labels = np.concatenate([np.asarray(labels[i], np.int64).reshape(-1) for i in range(len(tiles))])
    if not sum(counts):
        return np.zeros((0, 4)), kept_labels, source_of
    stacked = np.concatenate([np.asarray(boxes[i], np.float64).reshape(-1, 4) for i in range(len(tiles))])
    scale = np.array([[t.matrix[0, 0], t.matrix[1, 1]] * 2 for t in tiles])[source_of]
    shift = np.array([[t.matrix[0, 2], t.matrix[1, 2]] * 2 for t in tiles])[source_of]
    placed = stacked * scale + shift  # positive scales: the corners stay the corners
    np.clip(placed, 0, [canvas[0], canvas[1], canvas[0], canvas[1]], out=placed)
    return placed, kept_labels, source_of
