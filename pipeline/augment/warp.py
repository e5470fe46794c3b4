"""3x3 matrices of points, boxes sent through them, and ultralytics' filter of boxes an augmentation spoiled.

A matrix maps a point (x, y) of its source, in continuous pixel coordinates
(pixel k spans [k, k + 1], as boxes are given), to (u / w, v / w) of
(u, v, w) = M (x, y, 1); an affine matrix has a last row (0, 0, 1).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Uniform(Protocol):
    """What draws an op's random parameters: `random.Random` and the loader's per-sample generator both do."""

    def uniform(self, a: float, b: float) -> float: ...

    def random(self) -> float: ...


def translation(dx: float, dy: float) -> np.ndarray:
    return np.array([[1.0, 0.0, dx], [0.0, 1.0, dy], [0.0, 0.0, 1.0]])


def scaling(sx: float, sy: float) -> np.ndarray:
    return np.array([[sx, 0.0, 0.0], [0.0, sy, 0.0], [0.0, 0.0, 1.0]])


def hflip(width: float) -> np.ndarray:
    """The mirror of a picture `width` wide: x -> width - x."""
    return np.array([[-1.0, 0.0, width], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])


def is_axis_aligned(matrix: np.ndarray) -> bool:
    """A scale (either sign) and a shift only: what a resize of a box into a rectangle does."""
    return bool(matrix[0, 1] == 0 and matrix[1, 0] == 0 and matrix[2, 0] == 0 and matrix[2, 1] == 0 and matrix[2, 2] == 1)


def points_through(points: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """(N, 2) points mapped by `matrix` (with the perspective divide)."""
    out = np.asarray(points, np.float64) @ matrix[:, :2].T + matrix[:, 2]
    return out[:, :2] / out[:, 2:3]


def boxes_through(boxes: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """XYXY boxes mapped by `matrix`: the box around each one's four mapped corners (ultralytics' `apply_bboxes`)."""
    boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
    if not len(boxes):
        return boxes.copy()
    corners = boxes[:, [0, 1, 2, 3, 0, 3, 2, 1]].reshape(-1, 2)
    mapped = points_through(corners, matrix).reshape(-1, 4, 2)
    return np.concatenate([mapped.min(axis=1), mapped.max(axis=1)], axis=1)


def clip_boxes(boxes: np.ndarray, width: float, height: float) -> np.ndarray:
    out = np.array(boxes, np.float64).reshape(-1, 4)
    out[:, 0::2] = out[:, 0::2].clip(0, width)
    out[:, 1::2] = out[:, 1::2].clip(0, height)
    return out


def box_candidates(
    before: np.ndarray, after: np.ndarray, wh_thr: float = 2, ar_thr: float = 100, area_thr: float = 0.1, eps: float = 1e-16
) -> np.ndarray:
    """Which boxes survive an augmentation, as ultralytics decides (`RandomPerspective.box_candidates`).

    Args:
        before: (N, 4) XYXY boxes before the warp, scaled by the warp's scale.
        after: (N, 4) XYXY boxes after it, clipped to the output.
        wh_thr: a side must be over this many pixels.
        ar_thr: the aspect ratio must be under this.
        area_thr: the area must keep over this fraction (0.1; 0.01 where boxes come from polygons).
    """
    w1, h1 = before[:, 2] - before[:, 0], before[:, 3] - before[:, 1]
    w2, h2 = after[:, 2] - after[:, 0], after[:, 3] - after[:, 1]
    ratio = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (ratio < ar_thr)


def ioa(boxes: np.ndarray, others: np.ndarray, eps: float = 1e-7) -> np.ndarray:
    """(N, M): the intersection of each of `boxes` with each of `others` over the latter's area (ultralytics'
    `bbox_ioa`; CutMix's and copy-paste's cover)."""
    width = (
        np.minimum(boxes[:, None, 2], others[None, :, 2]) - np.maximum(boxes[:, None, 0], others[None, :, 0])
    ).clip(0)
    height = (
        np.minimum(boxes[:, None, 3], others[None, :, 3]) - np.maximum(boxes[:, None, 1], others[None, :, 1])
    ).clip(0)
    area = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    return width * height / (area + eps)
