"""Ultralytics' CopyPaste in its "flip" mode: instances mirrored across the canvas, where they land on nothing.

On the mosaic canvas (after `Mosaic`, before `RandomPerspective`, as
ultralytics' `v8_transforms` composes them), every instance with a polygon
is mirrored about the canvas' vertical centre line (x -> W - x); those
whose mirrored box covers under 30 % of every existing box (`IOA_THR`,
intersection over the existing box's area; its own included) are ordered
by their largest such cover, and the first round(p * n) of them are
pasted: each joins the labels (its class, its mirrored box and polygon),
and under its mirrored polygon the canvas shows its own mirror image.
Ultralytics 8.4 draws nothing for it (`copy_paste` is the share pasted,
not a probability), does nothing where the image has no polygons (a
detection dataset) or p is 0, and turns it off with the mosaic in its
`close_mosaic` epochs.

`choose` makes that choice; `pipeline.polygons.fill_polygons` (the
scanline fill COCO's shapes are painted with) finds the output pixels a
pasted outline covers (OpenCV's
`drawContours(..., FILLED)` on the canvas, here on the output: the same
pixels to within the outline's edge), where `render` composites the
mirrored canvas in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .warp import ioa

IOA_THR = 0.30
"""A mirrored copy joins only where it covers less than this share of every existing box (ultralytics' rule)."""


def mirrored_boxes(boxes: np.ndarray, width: float) -> np.ndarray:
    """XYXY boxes mirrored in a canvas `width` wide (x -> width - x; the corners swap)."""
    out = np.array(boxes, np.float64).reshape(-1, 4)
    out[:, [0, 2]] = width - out[:, [2, 0]]
    return out


def choose(p: float, boxes: np.ndarray, candidates: Sequence[int], width: float) -> np.ndarray:
    """Which of `boxes` (XYXY, on a canvas `width` wide) are copied, in the order they are pasted.

    `candidates`: the boxes that have polygons (only those can be pasted). Each candidate's mirrored box
    must cover under `IOA_THR` of every box, itself included; those that pass, ordered by their largest
    cover (NumPy's `argsort`, as ultralytics), give their first round(p * n).
    """
    among = np.asarray(candidates, np.int64)
    if not len(among) or p <= 0:
        return np.zeros(0, np.int64)
    boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
    cover = ioa(mirrored_boxes(boxes[among], width), boxes)
    passing = np.nonzero((cover < IOA_THR).all(1))[0]
    passing = passing[np.argsort(cover.max(1)[passing])]
    return among[passing[: round(p * len(passing))]]


def polygons_rect(polygons: Sequence[np.ndarray], width: int, height: int) -> tuple[int, int, int, int] | None:
    """The pixels (u0, v0, u1, v1), end exclusive, of a `width` x `height` picture whose centres the polygons'
    bounds can hold (None: none)."""
    stacked = [points for points in polygons if len(points) >= 3]
    if not stacked:
        return None
    every = np.concatenate(stacked)
    (x0, y0), (x1, y1) = every.min(0), every.max(0)
    u0, v0 = max(0, math.floor(x0)), max(0, math.floor(y0))
    u1, v1 = min(width, math.ceil(x1)), min(height, math.ceil(y1))
    return (u0, v0, u1, v1) if u1 > u0 and v1 > v0 else None
