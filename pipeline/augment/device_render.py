"""Planned outputs' pixels in torch, on the pictures' device: ultralytics' own algorithm, a batch at a time.

`render` (render.py) resamples each source once on the CPU; here the
outputs are made as ultralytics makes them, in torch ops that run on any
device (the GPU path, where nvjpeg decodes the pictures whole): each
picture resized to its load size (`F.interpolate`, bilinear, what
`cv2.resize` INTER_LINEAR does, rounded to whole levels as it rounds) and
pasted into its window of a canvas of the plan's fill (a mosaic's 2S x 2S,
or the one picture resized where the mosaic is off), then the canvases of
a chunk of outputs warped at once by one `F.grid_sample` (bilinear)
through each plan's inverse warp, flips included, with a perspective
divide. Output pixel u's centre u + 1/2 goes through the inverse warp to
the canvas' continuous pixels (pixel k spans [k, k + 1]), as `render`
takes it; samples past the canvas weigh the fill, as OpenCV's constant
border does (the canvas holds each pixel less the fill, and grid_sample's
zeros padding is then the fill).

Copy-paste (`Plan.pasted`): the same canvases sampled a second time
through `inverse(warp @ mirror)` (the canvas' mirror image), shown under
the pasted outlines (`pipeline.polygons.fill_polygons`, on the CPU).

Memory: a float canvas per output (2S x 2S x 3 x 4 bytes: 20 MB at S = 640),
so outputs are made `chunk` at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..polygons import fill_polygons
from .mosaic import Rect, Tile
from .warp import translation
from .yolo import Plan

CHUNK = 8
"""Outputs warped together: their canvases are the peak memory (8 x 20 MB at S = 640)."""


def render_batch(
    plans: Sequence[Plan], pictures: Sequence[Sequence[torch.Tensor]], out: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> torch.Tensor:  # fmt: skip
    """The outputs [B, 3, S, S] uint8 of `plans`, on the pictures' device.

    Args:
        plans: one plan per output, all of the same size S.
        pictures: per output, its tiles' decoded pictures in tile order: uint8 [3, H, W] RGB at the original's
            full size (as nvjpeg decodes a JPEG), all on one device.
        out: where given, uint8 [B, 3, S, S] on that device, written in place and returned.
        chunk: how many outputs' canvases are held at once.

    Returns:
        The outputs, uint8 [B, 3, S, S].

    Raises:
        ValueError: the pictures, or `out`, do not fit the plans.
    """
    device = _check(plans, pictures, out)
    if not plans:
        return out if out is not None else torch.empty((0, 3, 0, 0), dtype=torch.uint8)
    size = plans[0].size
    if out is None:
        out = torch.empty((len(plans), 3, size, size), dtype=torch.uint8, device=device)
    centres = _centres(size, device)
    for start in range(0, len(plans), max(1, chunk)):
        end = start + max(1, chunk)
        _render_chunk(plans[start:end], pictures[start:end], out[start:end], centres)
    return out


def _check(plans: Sequence[Plan], pictures: Sequence[Sequence[torch.Tensor]], out: torch.Tensor | None) -> torch.device:
    """The pictures' device, once the batch is checked to be one."""
    if len(plans) != len(pictures):
        raise ValueError(f"render_batch: {len(plans)} plans but {len(pictures)} lists of pictures")
    devices = {picture.device for group in pictures for picture in group}
    if len(devices) > 1:
        raise ValueError(f"render_batch: the pictures are on several devices ({sorted(map(str, devices))})")
    device = devices.pop() if devices else (out.device if out is not None else torch.device("cpu"))
    sizes = {plan.size for plan in plans}
    if len(sizes) > 1:
        raise ValueError(f"render_batch: one batch is of one output size, not {sorted(sizes)}")
    for index, (plan, group) in enumerate(zip(plans, pictures)):
        if len(group) != len(plan.tiles):
            raise ValueError(f"render_batch: output {index} has {len(plan.tiles)} tiles but {len(group)} pictures")
        for picture in group:
            if picture.dtype != torch.uint8 or picture.ndim != 3 or picture.shape[0] < 3:
                raise ValueError(
                    f"render_batch: a picture is uint8 [3, H, W], not {picture.dtype} {list(picture.shape)}"
                )
    if out is not None:
        size = plans[0].size if plans else None
        wanted = (len(plans), 3, size, size) if size is not None else None
        if out.dtype != torch.uint8 or out.device != device or (wanted is not None and tuple(out.shape) != wanted):
            raise ValueError(f"render_batch: out must be uint8 {list(wanted or ())} on {device}, "
                             f"not {out.dtype} {list(out.shape)} on {out.device}")  # fmt: skip
    return device


def _centres(size: int, device: torch.device) -> torch.Tensor:
    """[S * S, 3] float32: each output pixel's centre (u + 1/2, v + 1/2, 1), row by row."""
    steps = torch.arange(size, dtype=torch.float32, device=device) + 0.5
    v, u = torch.meshgrid(steps, steps, indexing="ij")
    return torch.stack([u.reshape(-1), v.reshape(-1), torch.ones(size * size, device=device)], dim=1)


def _render_chunk(
    plans: Sequence[Plan], pictures: Sequence[Sequence[torch.Tensor]], out: torch.Tensor, centres: torch.Tensor
) -> None:
    """Outputs `out` [n, 3, S, S] of `plans`: their canvases pasted, then sampled by one grid_sample.

    Each canvas holds only the part of it the output samples (`_region`): at scale 1.5 a third of a mosaic's.
    """
    size = plans[0].size
    regions = [_region(plan) for plan in plans]
    width, height = max(x1 - x0 for x0, _, x1, _ in regions), max(y1 - y0 for _, y0, _, y1 in regions)
    device = out.device
    # each pixel less its plan's fill: zero is the fill (past the canvas too, as grid_sample pads with zeros)
    canvas = torch.zeros((len(plans), 3, height, width), dtype=torch.float32, device=device)
    for index, (plan, group, region) in enumerate(zip(plans, pictures, regions)):
        for tile, picture in zip(plan.tiles, group):
            _paste_tile(canvas[index], tile, picture, plan.fill, region)
    normalise = np.array([[2.0 / width, 0.0, -1.0], [0.0, 2.0 / height, -1.0], [0.0, 0.0, 1.0]])
    inverses = [normalise @ translation(-region[0], -region[1]) @ np.linalg.inv(plan.warp)
                for plan, region in zip(plans, regions)]  # fmt: skip
    sampled = _sample(canvas, inverses, centres, size)
    for index, (plan, region) in enumerate(zip(plans, regions)):
        if plan.pasted and plan.mirror is not None:  # one at a time: a view of its canvas, not a copy of several
            mask = fill_polygons(plan.pasted, (size, size))
            if mask.any():
                mirror = normalise @ translation(-region[0], -region[1]) @ np.linalg.inv(plan.warp @ plan.mirror)
                mirrored = _sample(canvas[index : index + 1], [mirror], centres, size)[0]
                under = torch.from_numpy(mask).to(device)
                sampled[index] = torch.where(under, mirrored, sampled[index])
    fills = torch.tensor([float(plan.fill) for plan in plans], dtype=torch.float32, device=device)
    # OpenCV rounds its fixed-point bilinear half up: floor(x + 1/2)
    sampled.add_(fills.view(-1, 1, 1, 1) + 0.5).floor_().clamp_(0, 255)
    out.copy_(sampled)


def _sample(canvas: torch.Tensor, inverses: list[np.ndarray], centres: torch.Tensor, size: int) -> torch.Tensor:
    """[n, 3, S, S]: the canvases sampled bilinearly at the output centres through `inverses` (output pixels ->
    grid_sample's normalised canvas coordinates, homogeneous: the perspective divide after)."""
    matrices = torch.from_numpy(np.stack(inverses).astype(np.float32)).to(canvas.device)
    points = centres @ matrices.transpose(1, 2)  # [n, S * S, 3]
    grid = (points[..., :2] / points[..., 2:]).view(len(inverses), size, size, 2)
    return F.grid_sample(canvas, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _region(plan: Plan) -> Rect:
    """The canvas pixels (x0, y0, x1, y1), end exclusive, the output's samples can weigh: the bounds of the output
    square through the inverse warp (and the mirror's, where copy-paste shows it), two pixels wider for the
    bilinear's neighbours, cut to the canvas (at least one pixel). Past the horizon (a corner's w <= 0): the
    whole canvas."""
    width, height = plan.canvas
    size = plan.size
    views = [plan.warp] + ([plan.warp @ plan.mirror] if plan.pasted and plan.mirror is not None else [])
    square = np.array([[0.0, size, 0.0, size], [0.0, 0.0, size, size], [1.0, 1.0, 1.0, 1.0]])
    corners = np.concatenate([np.linalg.inv(view) @ square for view in views], axis=1)
    if (corners[2] <= 0).any():
        return 0, 0, width, height
    xs, ys = corners[0] / corners[2], corners[1] / corners[2]
    x0, y0 = min(max(0, math.floor(xs.min()) - 2), width - 1), min(max(0, math.floor(ys.min()) - 2), height - 1)
    x1, y1 = max(min(width, math.ceil(xs.max()) + 2), x0 + 1), max(min(height, math.ceil(ys.max()) + 2), y0 + 1)
    return x0, y0, x1, y1


def _paste_tile(canvas: torch.Tensor, tile: Tile, picture: torch.Tensor, fill: int, region: Rect) -> None:
    """The tile's picture resized to its load size (ultralytics' `load_image`) and what of its window lies in
    `region` pasted into `canvas` [3, h, w] (the region's pixels, each less `fill`).

    Mosaic places each resized picture at whole canvas pixels (mosaic.py: the matrix is the resize, then a shift
    by whole pixels), so its window is a plain slice of the resized picture.
    """
    (sx, _, shift_x), (_, sy, shift_y), _ = tile.matrix.tolist()
    ox, oy = round(shift_x), round(shift_y)
    if abs(shift_x - ox) > 1e-6 or abs(shift_y - oy) > 1e-6:
        raise ValueError(f"render_batch: a tile placed at {shift_x, shift_y}, not at whole canvas pixels")
    original_height, original_width = picture.shape[1:]
    width, height = round(sx * original_width), round(sy * original_height)
    x0, y0 = max(tile.window[0], ox, region[0]), max(tile.window[1], oy, region[1])
    x1, y1 = min(tile.window[2], ox + width, region[2]), min(tile.window[3], oy + height, region[3])
    if x1 <= x0 or y1 <= y0:
        return
    if (width, height) == (original_width, original_height):  # the identity: no resize
        shown = picture[:3, y0 - oy : y1 - oy, x0 - ox : x1 - ox].float()
    else:
        resized = F.interpolate(picture[None, :3].float(), size=(height, width), mode="bilinear", align_corners=False,
                                antialias=False)[0]  # fmt: skip
        shown = resized[:, y0 - oy : y1 - oy, x0 - ox : x1 - ox].add_(0.5).floor_()  # cv2's uint8: half up
    canvas[:, y0 - region[1] : y1 - region[1], x0 - region[0] : x1 - region[0]] = shown.sub_(fill)
