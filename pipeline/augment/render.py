"""One planned output's pixels on the CPU, each source resampled once, straight from its decoded original.

Where a tile's whole matrix is a scale and a shift (ultralytics' default
recipe: no rotation, shear or perspective), the output pixels whose centres
fall in its window are one resize of a box of its original, which the
native resampler writes straight into that part of the output (flipped as
drawn). Any other matrix (a rotation, shear, perspective, vertical flip)
is sampled bilinearly through its inverse from the original reduced to
its mosaic size first (as ultralytics resizes before it warps).
"""

from __future__ import annotations

import math

import numpy as np

from .. import native
from .warp import is_axis_aligned, scaling
from .yolo import Plan

TINY = 4  # a window this narrow or narrower goes the general way (a planar view of 3 columns reads as HWC)


def render(
    plan: Plan, images: list[np.ndarray], out: np.ndarray | None = None, scales: list[tuple[float, float]] | None = None
) -> np.ndarray:
    """The output [3, S, S] uint8 of `plan` from its tiles' pictures (H, W, 3 or 4 uint8 RGB[X], in tile order).

    `scales`: each picture's pixels per pixel of its original (a DCT-scaled
    decode's M/8), default 1. `out`, if given, is written in place (a
    loader's slot) and returned.
    """
    size = plan.size
    if out is None:
        out = np.empty((3, size, size), np.uint8)
    out[...] = plan.fill
    lib = native.library()
    for index, tile in enumerate(plan.tiles):
        sx, sy = scales[index] if scales is not None else (1.0, 1.0)
        to_canvas = tile.matrix @ scaling(1 / sx, 1 / sy)  # the picture's pixels -> the canvas
        matrix = plan.warp @ to_canvas
        image = images[index]
        if lib is not None and is_axis_aligned(matrix) and matrix[1, 1] > 0:
            if _resize_into(lib, plan, index, matrix, image, out):
                continue
        _warp_into(plan, index, to_canvas, image, out)
    return out


def _output_rect(plan: Plan, index: int) -> tuple[int, int, int, int] | None:
    """The output pixels (u0, v0, u1, v1), end exclusive, whose centres lie in the tile's window (axis-aligned)."""
    x0, y0, x1, y1 = plan.tiles[index].window
    corners = np.array([[x0, y0, 1.0], [x1, y1, 1.0]]) @ plan.warp.T
    xs, ys = sorted(corners[:, 0]), sorted(corners[:, 1])
    u0, u1 = max(0, math.ceil(xs[0] - 0.5)), min(plan.size, math.ceil(xs[1] - 0.5))
    v0, v1 = max(0, math.ceil(ys[0] - 0.5)), min(plan.size, math.ceil(ys[1] - 0.5))
    return (u0, v0, u1, v1) if u1 > u0 and v1 > v0 else None


def _resize_into(lib: object, plan: Plan, index: int, matrix: np.ndarray, image: np.ndarray, out: np.ndarray) -> bool:
    """The tile's output pixels as one native resize of a box of its original (the pixels whose whole
    footprint lies in the original), and the one-pixel rim the window may add around them, nearest."""
    rect = _output_rect(plan, index)
    if rect is None:
        return True
    height, width = image.shape[:2]
    sx, tx, sy, ty = matrix[0, 0], matrix[0, 2], matrix[1, 1], matrix[1, 2]
    # the original's extent in the output: the pixels wholly inside it resize exactly, with no edge to clamp
    left_edge, right_edge = sorted((tx, sx * width + tx))
    top_edge, bottom_edge = ty, sy * height + ty
    u0, v0, u1, v1 = rect
    i0, i1 = max(u0, math.ceil(left_edge - 1e-9)), min(u1, math.floor(right_edge + 1e-9))
    j0, j1 = max(v0, math.ceil(top_edge - 1e-9)), min(v1, math.floor(bottom_edge + 1e-9))
    if i1 - i0 <= TINY or j1 - j0 <= TINY:
        return False
    x_a, x_b = sorted(((i0 - tx) / sx, (i1 - tx) / sx))
    box = (max(0.0, x_a), max(0.0, (j0 - ty) / sy), min(float(width), x_b), min(float(height), (j1 - ty) / sy))
    pixels = _rgbx(image)
    decoder = native.RegionDecoder(lib)  # type: ignore[arg-type]
    decoder.resize_store(pixels.ctypes.data, (width, height), box, out[:, j0:j1, i0:i1], native.PILLOW_SIMD, flip=sx < 0)
    if (i0, j0, i1, j1) != (u0, v0, u1, v1):  # the rim: pixels whose centre is in the window, part of them past the edge
        v, u = np.mgrid[v0:v1, u0:u1]
        rim = ~((u >= i0) & (u < i1) & (v >= j0) & (v < j1))
        xs = np.clip(((u[rim] + 0.5 - tx) / sx).astype(np.int64), 0, width - 1)
        ys = np.clip(((v[rim] + 0.5 - ty) / sy).astype(np.int64), 0, height - 1)
        out[:, v[rim], u[rim]] = image[ys, xs, :3].T
    return True


def _rgbx(image: np.ndarray) -> np.ndarray:
    if image.ndim == 3 and image.shape[2] == 4 and image.flags.c_contiguous:
        return image
    packed = np.empty(image.shape[:2] + (4,), np.uint8)
    packed[:, :, :3] = image[:, :, :3]
    packed[:, :, 3] = 255
    return packed


def _warp_into(plan: Plan, index: int, to_canvas: np.ndarray, image: np.ndarray, out: np.ndarray) -> None:
    """The general way: the original reduced to its mosaic size, then each output pixel's centre sampled
    bilinearly through the inverse map, where it falls in the tile's window."""
    from PIL import Image

    tile = plan.tiles[index]
    height, width = image.shape[:2]
    sx, sy = to_canvas[0, 0], to_canvas[1, 1]
    small = (max(1, round(width * sx)), max(1, round(height * sy)))
    source = np.asarray(Image.fromarray(np.ascontiguousarray(image[:, :, :3])).resize(small, Image.Resampling.BILINEAR))
    # the reduced image -> canvas: the tile's shift; then the canvas -> output
    shift = np.array([[1.0, 0, to_canvas[0, 2]], [0, 1.0, to_canvas[1, 2]], [0, 0, 1.0]])
    inverse = np.linalg.inv(plan.warp @ shift)
    back = np.linalg.inv(plan.warp)
    v, u = np.mgrid[0 : plan.size, 0 : plan.size]
    centres = np.stack([u.ravel() + 0.5, v.ravel() + 0.5, np.ones(u.size)])
    canvas = back @ centres
    cx, cy = canvas[0] / canvas[2], canvas[1] / canvas[2]
    x0, y0, x1, y1 = tile.window
    inside = (cx >= x0) & (cx < x1) & (cy >= y0) & (cy < y1)
    if not inside.any():
        return
    points = inverse @ centres[:, inside]
    px, py = points[0] / points[2] - 0.5, points[1] / points[2] - 0.5  # pixel-centre coordinates of the source
    sh, sw = source.shape[:2]
    px, py = px.clip(0, sw - 1), py.clip(0, sh - 1)
    ix, iy = np.minimum(np.floor(px).astype(np.int64), sw - 2).clip(0), np.minimum(np.floor(py).astype(np.int64), sh - 2).clip(0)
    fx, fy = (px - ix)[:, None], (py - iy)[:, None]
    jx, jy = np.minimum(ix + 1, sw - 1), np.minimum(iy + 1, sh - 1)
    top = source[iy, ix] * (1 - fx) + source[iy, jx] * fx
    bottom = source[jy, ix] * (1 - fx) + source[jy, jx] * fx
    values = np.round(top * (1 - fy) + bottom * fy).clip(0, 255).astype(np.uint8)
    out[:, v.ravel()[inside], u.ravel()[inside]] = values.T
