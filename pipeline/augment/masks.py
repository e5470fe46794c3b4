"""A planned output's masks: each source's mask sampled nearest through the same matrix as its pixels.

`render_mask` gives one mask the size of the output from its sources'
masks (class indices, or instance maps), each sampled nearest-neighbour
through its tile's whole matrix (`Plan.matrix`: its resize, its place in
the mosaic, the affine, the flips): output pixel (u, v) takes the value of
the source pixel its centre (u + 1/2, v + 1/2) falls in, where the centre
lies in the tile's window of the canvas; elsewhere (the mosaic's border,
the warp's fill) it is `fill`. The image's pixels are resampled through the
same matrices, so a mask stays on its object.

`instance_masks` makes each kept box's own mask (Mask R-CNN's form,
[K, S, S] uint8) from the sources' instance maps (box n's pixels are n + 1,
0 none): the maps' numbers are made distinct across the tiles before they
are sampled, and each kept box finds its own by its tile and its index
there (`Plan.source_of`, `Plan.box_index`).

Where the plan pastes mirrored instances (ultralytics' copy-paste:
`Plan.pasted`, `Plan.mirror`), the masks are composited as the pixels are:
under the pasted outlines the output shows the canvas' mirror image, and a
pasted box (`Plan.copied`) owns the mirrored pixels of its original there.
"""

from __future__ import annotations

import numpy as np

from ..polygons import fill_polygons
from .warp import is_axis_aligned
from .yolo import Plan


def render_mask(plan: Plan, maps: list[np.ndarray | None], fill: int, warp: np.ndarray | None = None) -> np.ndarray:
    """The (S, S) mask of `plan` from its tiles' masks (H, W, in tile order; None: that source's pixels are all `fill`).

    `warp` (canvas -> output) replaces the plan's, for the copy-paste's mirrored pass. The result's dtype is the
    maps' (uint8 or wider: the widest of them), uint16 where `fill` needs it.
    """
    size = plan.size
    dtype = np.result_type(np.uint8, *(m.dtype for m in maps if m is not None))
    if fill > np.iinfo(dtype).max:
        dtype = np.result_type(dtype, np.min_scalar_type(fill))
    out = np.full((size, size), fill, dtype)
    to_output = plan.warp if warp is None else warp
    canvas: np.ndarray | None = None  # every output centre on the canvas, computed once where a tile needs it
    for index, tile in enumerate(plan.tiles):
        picture = maps[index]
        if picture is None:
            continue
        matrix = to_output @ tile.matrix
        if is_axis_aligned(matrix):
            _axis_aligned_into(out, picture, to_output, tile.matrix, tile.window)
            continue
        if canvas is None:
            canvas = _centres_on_canvas(to_output, size)
        _warped_into(out, picture, canvas, tile.matrix, tile.window)
    return out


def _axis_aligned_into(
    out: np.ndarray, picture: np.ndarray, warp: np.ndarray, tile: np.ndarray, window: tuple[float, float, float, float]
) -> None:
    """Nearest through a scale-and-shift (flips included): the rows and columns are found apart."""
    size = out.shape[0]
    centres = np.arange(size, dtype=np.float64) + 0.5
    x0, y0, x1, y1 = window
    xs = (centres - warp[0, 2]) / warp[0, 0]  # the columns' centres on the canvas
    ys = (centres - warp[1, 2]) / warp[1, 1]
    us = np.flatnonzero((xs >= x0) & (xs < x1))
    vs = np.flatnonzero((ys >= y0) & (ys < y1))
    if not len(us) or not len(vs):
        return
    cols = np.clip(np.floor((xs[us] - tile[0, 2]) / tile[0, 0]).astype(np.int64), 0, picture.shape[1] - 1)
    rows = np.clip(np.floor((ys[vs] - tile[1, 2]) / tile[1, 1]).astype(np.int64), 0, picture.shape[0] - 1)
    out[np.ix_(vs, us)] = picture[np.ix_(rows, cols)]


def _centres_on_canvas(warp: np.ndarray, size: int) -> np.ndarray:
    """(2, S, S): where each output pixel's centre comes from on the canvas (through the warp's inverse)."""
    centres = np.arange(size, dtype=np.float64) + 0.5
    u, v = np.meshgrid(centres, centres)
    inverse = np.linalg.inv(warp)
    x = inverse[0, 0] * u + inverse[0, 1] * v + inverse[0, 2]
    y = inverse[1, 0] * u + inverse[1, 1] * v + inverse[1, 2]
    w = inverse[2, 0] * u + inverse[2, 1] * v + inverse[2, 2]
    return np.stack((x / w, y / w))


def _warped_into(
    out: np.ndarray,
    picture: np.ndarray,
    canvas: np.ndarray,
    tile: np.ndarray,
    window: tuple[float, float, float, float],
) -> None:
    """Nearest through a general warp: each output centre inside the tile's window reads its source pixel."""
    x0, y0, x1, y1 = window
    x, y = canvas
    inside = (x >= x0) & (x < x1) & (y >= y0) & (y < y1)
    if not inside.any():
        return
    cols = np.clip(np.floor((x[inside] - tile[0, 2]) / tile[0, 0]).astype(np.int64), 0, picture.shape[1] - 1)
    rows = np.clip(np.floor((y[inside] - tile[1, 2]) / tile[1, 1]).astype(np.int64), 0, picture.shape[0] - 1)
    out[inside] = picture[rows, cols]


def numbered_instances(maps: list[np.ndarray | None], counts: list[int]) -> tuple[list[np.ndarray | None], np.ndarray]:
    """The tiles' instance maps renumbered apart (tile t's box n is offsets[t] + n + 1), as int32, and the offsets."""
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    numbered: list[np.ndarray | None] = []
    for found, offset in zip(maps, offsets):
        if found is None:
            numbered.append(None)
            continue
        wide = found.astype(np.int32)
        wide[wide > 0] += int(offset)
        numbered.append(wide)
    return numbered, offsets


def instance_masks(plan: Plan, maps: list[np.ndarray | None], counts: list[int]) -> np.ndarray:
    """Each kept box's own mask, [K, S, S] uint8 in the plan's box order, from its tiles' instance maps
    (box n's pixels n + 1, 0 none; None: a source without a map, whose boxes get empty masks) and each
    tile's box count."""
    numbered, offsets = numbered_instances(maps, counts)
    ids = offsets[plan.source_of] + plan.box_index + 1 if len(plan.boxes) else np.zeros(0, np.int64)
    own = render_mask(plan, numbered, 0)
    if plan.pasted and plan.mirror is not None:
        region = fill_polygons(plan.pasted, (plan.size, plan.size))
        mirrored = render_mask(plan, numbered, 0, plan.warp @ plan.mirror)
        masks = np.empty((len(ids), plan.size, plan.size), np.uint8)
        for k, (number, copy) in enumerate(zip(ids, plan.copied)):
            masks[k] = ((mirrored == number) & region) if copy else ((own == number) & ~region)
        return masks
    return (own[None, :, :] == ids[:, None, None].astype(own.dtype)).astype(np.uint8)


def class_mask(plan: Plan, maps: list[np.ndarray | None], fill: int) -> np.ndarray:
    """The output's class mask from its tiles' (`render_mask`), the copy-paste's mirrored region composited in."""
    out = render_mask(plan, maps, fill)
    if plan.pasted and plan.mirror is not None:
        region = fill_polygons(plan.pasted, (plan.size, plan.size))
        mirrored = render_mask(plan, maps, fill, plan.warp @ plan.mirror)
        out[region] = mirrored[region]
    return out
