"""Mosaic: four images around a random centre of a 2S x 2S canvas, or nine in a grid (ultralytics' `Mosaic`).

Each image is first resized so its longer side is S (ultralytics'
`load_image`: the other side rounded up). With four (n = 4), each is placed
in one quadrant around the centre (xc, yc), drawn in [S/2, 3S/2): top-left
ending at the centre, top-right starting at it in x, and so on; what falls
past the canvas is cut. With nine (n = 9, no draw), the first is placed at
(S, S) of a 3S x 3S canvas and the others around it clockwise from the top
(each beside the one before, as ultralytics' `_mosaic9`), and the canvas's
middle 2S x 2S is kept. An image's matrix is its resize and the shift to its
place; its window the part of the canvas it shows.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .warp import Uniform

Rect = tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True)
class Tile:
    """One image of a mosaic: its matrix (original pixels -> canvas) and its window (x0, y0, x1, y1) of the canvas."""

    matrix: np.ndarray
    window: Rect


@dataclasses.dataclass(frozen=True)
class Mosaic:
    """Four images in a 2S x 2S canvas, with probability `p` (else the one image, resized).

    Boxes: moved with their image, then clipped to the canvas (an image's
    edges meet its neighbours' at the centre, so nothing else cuts them).
    """

    p: float = 1.0
    n: int = 4

    def __post_init__(self) -> None:
        if self.n not in (4, 9):
            raise ValueError(f"Mosaic(n={self.n!r}): a mosaic is of 4 images or of 9")
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"Mosaic(p={self.p}): a probability is 0 to 1")

    def tiles(self, rng: Uniform, size: int, originals: list[tuple[int, int]]) -> list[Tile]:
        """The n tiles of one mosaic of `originals` (width, height), the first the sample's own."""
        if len(originals) != self.n:
            raise ValueError(f"a mosaic takes {self.n} images, not {len(originals)}")
        if self.n == 9:
            return _grid_of_nine(size, originals)
        border = -size // 2
        yc, xc = (int(rng.uniform(-border, 2 * size + border)) for _ in range(2))
        out = []
        for i, (w0, h0) in enumerate(originals):
            w, h = load_size(w0, h0, size)
            if i == 0:  # top left
                x1a, y1a, x2a, y2a = max(xc - w, 0), max(yc - h, 0), xc, yc
                x1b, y1b = w - (x2a - x1a), h - (y2a - y1a)
            elif i == 1:  # top right
                x1a, y1a, x2a, y2a = xc, max(yc - h, 0), min(xc + w, size * 2), yc
                x1b, y1b = 0, h - (y2a - y1a)
            elif i == 2:  # bottom left
                x1a, y1a, x2a, y2a = max(xc - w, 0), yc, xc, min(size * 2, yc + h)
                x1b, y1b = w - (x2a - x1a), 0
            else:  # bottom right
                x1a, y1a, x2a, y2a = xc, yc, min(xc + w, size * 2), min(size * 2, yc + h)
                x1b, y1b = 0, 0
            matrix = np.array([[w / w0, 0.0, x1a - x1b], [0.0, h / h0, y1a - y1b], [0.0, 0.0, 1.0]])  # shift @ resize
            out.append(Tile(matrix, (x1a, y1a, x2a, y2a)))
        return out


def load_size(width: int, height: int, size: int) -> tuple[int, int]:
    """The size ultralytics' `load_image` resizes an image to: its longer side `size`, the other rounded up."""
    ratio = size / max(width, height)
    if ratio == 1:
        return width, height
    return min(math.ceil(width * ratio), size), min(math.ceil(height * ratio), size)


def _grid_of_nine(size: int, originals: list[tuple[int, int]]) -> list[Tile]:
    """Ultralytics' `_mosaic9`: the centre image at (S, S) of a 3S x 3S canvas, the others around it, then the
    canvas's middle 2S x 2S (from S // 2 on)."""
    cut, side = size // 2, 2 * size
    out = []
    h0 = w0 = hp = wp = 0
    for i, (width, height) in enumerate(originals):
        w, h = load_size(width, height, size)
        if i == 0:  # centre
            h0, w0 = h, w
        x, y = (  # the image's top left in the 3S canvas: centre, top, top right, right, bottom right, bottom,
            (size, size), (size, size - h), (size + wp, size - h), (size + w0, size), (size + w0, size + hp),
            (size + w0 - w, size + h0), (size + w0 - wp - w, size + h0), (size - w, size + h0 - h),
            (size - w, size + h0 - hp - h),  # bottom left, left, top left
        )[i]  # fmt: skip
        x0, y0, x1, y1 = (min(max(edge - cut, 0), side) for edge in (max(x, 0), max(y, 0), x + w, y + h))
        window = (x0, y0, x1, y1)
        matrix = np.array([[w / width, 0.0, x - cut], [0.0, h / height, y - cut], [0.0, 0.0, 1.0]])
        out.append(Tile(matrix, window))
        hp, wp = h, w
    return out
