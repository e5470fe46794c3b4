"""One planned output's pixels on the CPU, each source resampled once, straight from its decoded original.

Where a tile's whole matrix is a scale and a shift (ultralytics' default
recipe: no rotation, shear or perspective), the output pixels whose centres
fall in its window are one resize of a box of its original, which the
native resampler writes straight into that part of the output (flipped as
drawn). Any other matrix (a rotation, shear, perspective, vertical flip)
is sampled bilinearly through its inverse from the original reduced to
its mosaic size first (as ultralytics resizes before it warps).

Where the plan pasted mirrored instances (copy-paste: `Plan.pasted`), the
bounding rectangle of the pasted outlines is rendered a second time, the
same tiles through `warp @ mirror` (the canvas' mirror image), and
composited in under the outlines (`pipeline.polygons.fill_polygons`). A plan
that pastes nothing costs nothing more.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable

import numpy as np

from .. import native
from ..polygons import fill_polygons
from .copy_paste import polygons_rect
from .warp import is_axis_aligned, scaling, translation
from .yolo import Plan

TINY = 4  # a window this narrow or narrower is filled nearest (a planar view of 3 columns reads as HWC)


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
    if plan.pasted and lib is not None:  # both passes read the pictures: packed for the resampler once
        images = [_rgbx(image) for image in images]
    for index, tile in enumerate(plan.tiles):
        sx, sy = scales[index] if scales is not None else (1.0, 1.0)
        to_canvas = tile.matrix @ scaling(1 / sx, 1 / sy)  # the picture's pixels -> the canvas
        matrix = plan.warp @ to_canvas
        image = images[index]
        if lib is not None and is_axis_aligned(matrix) and matrix[1, 1] > 0:
            if _resize_into(lib, plan, index, matrix, image, out):
                continue
        _warp_into(plan, index, to_canvas, image, out)
    if plan.pasted:
        _paste(plan, out, lambda part, shown, into: render(part, [images[i] for i in shown], into,
                                                           [scales[i] for i in shown] if scales is not None else None))
    return out


def _paste(plan: Plan, out: np.ndarray, draw: Callable[[Plan, list[int], np.ndarray], object]) -> None:
    """The copy-paste's composite: under the pasted outlines, the output of the canvas' mirror image.

    Only the outlines' bounding rectangle is rendered again: `draw(part, shown, into)` renders `part` (the
    plan through `translation @ warp @ mirror`, its tiles those of `shown` that reach the rectangle) into
    `into`, the rectangle's [3, h, w].
    """
    assert plan.pasted is not None and plan.mirror is not None
    height, width = out.shape[1:]
    rect = polygons_rect(plan.pasted, width, height)
    if rect is None:
        return
    u0, v0, u1, v1 = rect
    mask = fill_polygons(plan.pasted, (u1 - u0, v1 - v0), (u0, v0))
    if not mask.any():
        return
    warp = translation(-u0, -v0) @ plan.warp @ plan.mirror
    shown = [index for index, tile in enumerate(plan.tiles) if _reaches(warp, tile.window, (u1 - u0, v1 - v0))]
    part = dataclasses.replace(plan, warp=warp, tiles=[plan.tiles[index] for index in shown], pasted=None, mirror=None)
    mirrored = np.empty((3, v1 - v0, u1 - u0), np.uint8)
    draw(part, shown, mirrored)
    np.copyto(out[:, v0:v1, u0:u1], mirrored, where=mask)


def _reaches(warp: np.ndarray, window: tuple[int, int, int, int], bounds: tuple[int, int]) -> bool:
    """Whether a window of the canvas, through `warp`, can show in an output `bounds` (width, height)."""
    x0, y0, x1, y1 = window
    corners = warp @ np.array([[x0, x1, x0, x1], [y0, y0, y1, y1], [1.0, 1.0, 1.0, 1.0]])
    us, vs = corners[0] / corners[2], corners[1] / corners[2]
    return bool(x1 > x0 and y1 > y0 and us.max() > 0 and us.min() < bounds[0] and vs.max() > 0 and vs.min() < bounds[1])


def _output_rect(plan: Plan, index: int, out: np.ndarray | None = None) -> tuple[int, int, int, int] | None:
    """The pixels (u0, v0, u1, v1) of `out` [3, H, W] (default the plan's S x S), end exclusive, whose centres lie
    in the tile's window (axis-aligned)."""
    height, width = out.shape[1:] if out is not None else (plan.size, plan.size)
    x0, y0, x1, y1 = plan.tiles[index].window
    (a, b, c), (d, e, f), _ = plan.warp.tolist()
    xs = sorted((a * x0 + b * y0 + c, a * x1 + b * y1 + c))
    ys = sorted((d * x0 + e * y0 + f, d * x1 + e * y1 + f))
    u0, u1 = max(0, math.ceil(xs[0] - 0.5)), min(width, math.ceil(xs[1] - 0.5))
    v0, v1 = max(0, math.ceil(ys[0] - 0.5)), min(height, math.ceil(ys[1] - 0.5))
    return (u0, v0, u1, v1) if u1 > u0 and v1 > v0 else None


def _source_box(rect: tuple[int, int, int, int], matrix: np.ndarray) -> tuple[float, float, float, float]:
    """The box of the picture (its pixels) an axis-aligned `matrix` sends onto the output `rect`.

    The rect is the pixels whose centres lie in the tile's window, so the box reaches past the picture's
    edges by under a pixel at most: the resampler weighs only the pixels within them there.
    """
    (sx, _, tx), (_, sy, ty), _ = matrix.tolist()
    u0, v0, u1, v1 = rect
    x_a, x_b = sorted(((u0 - tx) / sx, (u1 - tx) / sx))
    return x_a, (v0 - ty) / sy, x_b, (v1 - ty) / sy


def _nearest_into(rect: tuple[int, int, int, int], matrix: np.ndarray, picture: np.ndarray, out: np.ndarray,
                  first: tuple[float, float] = (0.0, 0.0), scale: float = 1.0) -> None:  # fmt: skip
    """A strip too narrow for the resampler's views (`TINY`): each output pixel the picture's pixel under its
    centre. `picture` holds the original's pixels scaled by `scale` from (`first` column, row) on."""
    (sx, _, tx), (_, sy, ty), _ = matrix.tolist()
    u0, v0, u1, v1 = rect
    height, width = picture.shape[:2]
    xs = np.clip(((np.arange(u0, u1) + 0.5 - tx) / sx * scale - first[0]).astype(np.int64), 0, width - 1)
    ys = np.clip(((np.arange(v0, v1) + 0.5 - ty) / sy * scale - first[1]).astype(np.int64), 0, height - 1)
    out[:, v0:v1, u0:u1] = picture[ys[:, None], xs[None, :], :3].transpose(2, 0, 1)


def _resize_into(lib: object, plan: Plan, index: int, matrix: np.ndarray, image: np.ndarray, out: np.ndarray) -> bool:
    """The tile's output pixels as one native resize of a box of its original."""
    rect = _output_rect(plan, index, out)
    if rect is None:
        return True
    height, width = image.shape[:2]
    if rect[2] - rect[0] <= TINY or rect[3] - rect[1] <= TINY:
        _nearest_into(rect, matrix, image, out)
        return True
    u0, v0, u1, v1 = rect
    pixels = _rgbx(image)
    decoder = native.RegionDecoder(lib)  # type: ignore[arg-type]
    decoder.resize_store(pixels.ctypes.data, (width, height), _source_box(rect, matrix), out[:, v0:v1, u0:u1],
                         native.PILLOW_SIMD, flip=matrix[0, 0] < 0)  # fmt: skip
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
    # the reduced image -> canvas: the tile's shift; then the canvas -> output
    shift = np.array([[1.0, 0, to_canvas[0, 2]], [0, 1.0, to_canvas[1, 2]], [0, 0, 1.0]])
    inverse = np.linalg.inv(plan.warp @ shift)
    back = np.linalg.inv(plan.warp)
    x0, y0, x1, y1 = tile.window
    # only the output pixels within the window's bounding box in the output can have their centres in it
    corners = plan.warp @ np.array([[x0, x1, x0, x1], [y0, y0, y1, y1], [1.0, 1.0, 1.0, 1.0]])
    us, vs = corners[0] / corners[2], corners[1] / corners[2]
    u_lo, u_hi = max(0, math.floor(us.min()) - 1), min(out.shape[2], math.ceil(us.max()) + 1)
    v_lo, v_hi = max(0, math.floor(vs.min()) - 1), min(out.shape[1], math.ceil(vs.max()) + 1)
    if u_hi <= u_lo or v_hi <= v_lo:
        return
    v, u = np.mgrid[v_lo:v_hi, u_lo:u_hi]
    centres = np.stack([u.ravel() + 0.5, v.ravel() + 0.5, np.ones(u.size)])
    canvas = back @ centres
    cx, cy = canvas[0] / canvas[2], canvas[1] / canvas[2]
    inside = (cx >= x0) & (cx < x1) & (cy >= y0) & (cy < y1)
    if not inside.any():
        return
    small = (max(1, round(width * sx)), max(1, round(height * sy)))
    source = np.asarray(Image.fromarray(np.ascontiguousarray(image[:, :, :3])).resize(small, Image.Resampling.BILINEAR))
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


def render_jpegs(
    plan: Plan,
    jpegs: list[bytes],
    out: np.ndarray | None = None,
    decoder: native.RegionDecoder | None = None,
    decoded: list[np.ndarray | None] | None = None,
) -> np.ndarray:
    """`render` straight from the tiles' JPEG files: each decodes only the part its tile shows, at the
    smallest DCT scale (M/8) that keeps that part at least as large as its place in the output.

    A mosaic shows about a quarter of each of its four pictures, and a picture reduced to its place
    needs few of its DCT coefficients: this decodes a fraction of what four whole pictures take. A tile
    whose matrix is not axis-aligned (rotation, shear, perspective, a vertical flip) is decoded whole
    and rendered the general way. Without the native library, `render` over Pillow's decodes.

    `decoded[i]`, where given, is tile i's JPEG already decoded whole (`decode_whole`: RGBX, full
    scale): it is read instead of decoding again (a picture that several outputs share, as a mosaic's
    partners do, is decoded once).

    Raises:
        native.RegionError: libjpeg refused a file (the caller's damage policy decides).
    """
    size = plan.size
    if out is None:
        out = np.empty((3, size, size), np.uint8)
    lib = native.library()
    if lib is None:
        from PIL import Image

        pictures = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) for data in jpegs]
        return render(plan, pictures, out)
    decoder = decoder or native.RegionDecoder(lib)
    out[...] = plan.fill
    for index, tile in enumerate(plan.tiles):
        matrix = plan.matrix(index)
        data = jpegs[index]
        whole = decoded[index] if decoded is not None else None
        width, height = (whole.shape[1], whole.shape[0]) if whole is not None else decoder.header(data)
        if is_axis_aligned(matrix) and matrix[1, 1] > 0 and _region_into(decoder, plan, index, matrix, data,
                                                                          (width, height), out, whole):  # fmt: skip
            continue
        if whole is not None:
            _warp_into(plan, index, plan.tiles[index].matrix, whole, out)
            continue
        zoom = math.sqrt(abs(matrix[0, 0] * matrix[1, 1] - matrix[0, 1] * matrix[1, 0]))  # output px per source px
        eighths = min(8, max(1, math.ceil(8 * zoom * 1.5 - 1e-9)))  # a margin for what a tilt enlarges
        rows, first, decoded_width, decoded_height = _decode(decoder, data, (width, height), eighths, None)
        picture = rows.reshape(decoded_height, decoded_width, 4)
        _warp_into(plan, index, plan.tiles[index].matrix @ scaling(8 / eighths, 8 / eighths), picture, out)
    if plan.pasted:
        _paste(plan, out, lambda part, shown, into: render_jpegs(part, [jpegs[i] for i in shown], into, decoder,
                                                                 [decoded[i] for i in shown] if decoded else None))
    return out


def decode_whole(decoder: native.RegionDecoder, data: bytes) -> np.ndarray:
    """A JPEG decoded whole at full scale: (H, W, 4) uint8 RGBX, as `render_jpegs(decoded=...)` reads it.

    Raises:
        native.RegionError: libjpeg refused the file.
    """
    width, height = decoder.header(data)
    rows, _, decoded_width, decoded_height = _decode(decoder, data, (width, height), 8, None)
    return rows.reshape(decoded_height, decoded_width, 4)


def _decode(
    decoder: native.RegionDecoder,
    data: bytes,
    size: tuple[int, int],
    eighths: int,
    rows: tuple[int, int] | None,
    columns: tuple[int, int] | None = None,
) -> tuple[np.ndarray, int, int, int]:
    """RGBX rows of the image scaled by eighths/8: (pixels, first column, decoded width, rows decoded)."""
    scaled_width, scaled_height = -(-size[0] * eighths // 8), -(-size[1] * eighths // 8)
    y0, y1 = rows if rows is not None else (0, scaled_height)
    x0, x1 = columns if columns is not None else (0, scaled_width)
    buffer = np.empty(scaled_width * (y1 - y0) * 4 + 64, np.uint8)
    first, decoded_width = decoder.decode(data, eighths, (x0, y0, x1 - x0, y1 - y0), buffer.ctypes.data, buffer.size)
    return buffer[: decoded_width * (y1 - y0) * 4], first, decoded_width, y1 - y0


def _region_into(
    decoder: native.RegionDecoder,
    plan: Plan,
    index: int,
    matrix: np.ndarray,
    data: bytes,
    size: tuple[int, int],
    out: np.ndarray,
    whole: np.ndarray | None = None,
) -> bool:
    """The tile's pixels from a region decode: the rows and iMCU columns its output part reads (from `whole`,
    the picture decoded already, where given)."""
    rect = _output_rect(plan, index, out)
    if rect is None:
        return True
    width, height = size
    u0, v0, u1, v1 = rect
    box = _source_box(rect, matrix)
    # the smallest M/8 that keeps the box at least as large as its output part, as the loader's crops choose
    # (a picture decoded whole already is at full scale)
    needed = max((u1 - u0) / (box[2] - box[0]), (v1 - v0) / (box[3] - box[1]))
    eighths = 8 if whole is not None else min(8, max(1, math.ceil(8 * needed - 1e-9)))
    scale = eighths / 8
    scaled_width, scaled_height = -(-width * eighths // 8), -(-height * eighths // 8)
    scaled = (box[0] * scale, box[1] * scale, box[2] * scale, box[3] * scale)
    margin = 3 + math.ceil(max((scaled[2] - scaled[0]) / (u1 - u0), (scaled[3] - scaled[1]) / (v1 - v0)))
    x0, y0 = max(0, math.floor(scaled[0]) - margin), max(0, math.floor(scaled[1]) - margin)
    x1, y1 = min(scaled_width, math.ceil(scaled[2]) + margin), min(scaled_height, math.ceil(scaled[3]) + margin)
    if whole is not None:  # its rows y0..y1, whole: contiguous, as the resampler reads them
        rows, first, decoded_width, count = whole[y0:y1].reshape(-1), 0, width, y1 - y0
    else:
        rows, first, decoded_width, count = _decode(decoder, data, size, eighths, (y0, y1), (x0, x1))
    if u1 - u0 <= TINY or v1 - v0 <= TINY:
        _nearest_into(rect, matrix, rows.reshape(count, decoded_width, 4), out, (first, y0), scale)
        return True
    relative = (scaled[0] - first, scaled[1] - y0, scaled[2] - first, scaled[3] - y0)
    decoder.resize_store(rows.ctypes.data, (decoded_width, count), relative, out[:, v0:v1, u0:u1], native.PILLOW_SIMD,
                         flip=matrix[0, 0] < 0)  # fmt: skip
    return True
