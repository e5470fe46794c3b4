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
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .affine import RandomAffine
from .hsv import HSV
from .mosaic import Mosaic, Tile, load_size
from .warp import Uniform, box_candidates, boxes_through, clip_boxes, hflip, scaling


@dataclasses.dataclass(frozen=True)
class YoloRecipe:
    """Ultralytics' default detection hyperparameters (mosaic 1.0, translate 0.1, scale 0.5, fliplr 0.5,
    HSV 0.015/0.7/0.4, degrees/shear/perspective 0, flipud 0) at output size `size`; `mosaic=None` is
    mosaic off (ultralytics' `close_mosaic` epochs)."""

    size: int = 640
    mosaic: Mosaic | None = Mosaic()
    affine: RandomAffine = RandomAffine()
    fliplr: float = 0.5
    flipud: float = 0.0
    hsv: HSV | None = HSV()
    fill: int = 114
    area_thr: float = 0.1

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
        hsv_gains: the (hue, saturation, value) gains drawn, or None.
        fill: the value of output pixels no source covers.
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
) -> Plan:
    """The plan of one output from `originals` (width, height; the sample's own first, then its mosaic
    partners) and their boxes (XYXY, original pixels) and labels.

    `rng` draws the geometry in ultralytics' order (`random`); `hsv_rng` the HSV gains (ultralytics
    draws those from NumPy's generator), default `rng`.
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
    nonzero = (on_canvas[:, 2] > on_canvas[:, 0]) & (on_canvas[:, 3] > on_canvas[:, 1])  # ultralytics' zero-area removal
    on_canvas, kept_labels, source_of = on_canvas[nonzero], kept_labels[nonzero], source_of[nonzero]
    warp, scale = recipe.affine.matrix(rng, canvas, (size, size))
    out = clip_boxes(boxes_through(on_canvas, warp), size, size)
    keep = box_candidates(on_canvas * scale, out, area_thr=recipe.area_thr)
    out, kept_labels, source_of = out[keep], kept_labels[keep], source_of[keep]
    if rng.random() < recipe.flipud:
        warp = np.array([[1.0, 0, 0], [0, -1.0, size], [0, 0, 1.0]]) @ warp
        out[:, [1, 3]] = size - out[:, [3, 1]]
    if rng.random() < recipe.fliplr:
        warp = hflip(size) @ warp
        out[:, [0, 2]] = size - out[:, [2, 0]]
    gains = recipe.hsv.draw(hsv_rng or rng) if recipe.hsv is not None else None
    return Plan(size, canvas, tiles, warp, out.astype(np.float32), kept_labels, source_of, gains, recipe.fill)


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
