"""recipe="yolo" with decoder="nvjpeg": the workers plan each mosaic, the device decodes and renders it.

On a CPU device the decode workers decode and render every mosaic
(`mosaic_piece.py`): per output, a JPEG decode's worth of CPU and the
resample of four tiles. With decoder="nvjpeg" the workers only plan
(`yolo_sample(out=None)`: partners, matrices, boxes, polygons, masks, HSV
gains; no pixel), and here the batch's pictures are decoded on the device
once each, however many of its mosaics show them (nvjpeg, one batched call;
a picture it refuses, or that is not a JPEG, by PIL on the CPU and
uploaded), and every output is rendered by torch ops
(`pipeline.augment.device_render`: each tile resized and pasted on its
canvas, one warp of the batch's canvases). The HSV gains, MixUp and CutMix
then run on the batch as on any device batch.

A picture that decodes nowhere fails each output that shows it; the error
policy replaces it (a stand-in's mosaic, rendered on the CPU and uploaded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..augment.device_render import render_batch
from ..errors import DecodeError
from .mosaic_piece import MOSAIC_PLAN, rgb_picture

Decode = Callable[[list[bytes], torch.device], list[torch.Tensor | None]]
"""JPEGs' bytes -> each one's uint8 [3, H, W] RGB on the device, None where it did not decode."""


def nvjpeg_decode(datas: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
    """The JPEGs decoded by nvjpeg on `device` in one call (torchvision's `decode_jpeg`); None where it fails."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if not datas:
        return []
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in datas]
    try:
        return list(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:  # one refused picture fails the call: each on its own, to find which
        out: list[torch.Tensor | None] = []
        for one in encoded:
            try:
                out.append(decode_jpeg(one, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                out.append(None)
        return out


def cpu_decode(data: bytes, device: torch.device, extension: str = "jpg") -> torch.Tensor:
    """A picture decoded by PIL (`rgb_picture`: upright RGB), uploaded: uint8 [3, H, W].

    Raises:
        DecodeError: it does not decode.
    """
    picture = np.asarray(rgb_picture(extension, data))
    return torch.from_numpy(np.ascontiguousarray(picture.transpose(2, 0, 1))).to(device)


def decode_pictures(
    items: Sequence[tuple[str, bytes, int]], positions: Sequence[int], device: torch.device, decode: Decode
) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
    """Each position's picture as uint8 [3, H, W] on `device`, and the reason of each that decodes nowhere.

    JPEGs go to `decode` in one call; the others, and those it gives None for, are decoded by PIL and uploaded.
    """
    jpegs = [position for position in positions if items[position][0] in ("jpg", "jpeg")]
    found: dict[int, torch.Tensor] = {}
    for position, picture in zip(jpegs, decode([items[position][1] for position in jpegs], device)):
        if picture is not None:
            found[position] = picture
    failed: dict[int, str] = {}
    for position in positions:
        if position not in found:
            try:
                found[position] = cpu_decode(items[position][1], device, items[position][0])
            except DecodeError as exc:
                failed[position] = str(exc)
    return found, failed


def render_mosaics(
    items: Sequence[tuple[str, bytes, int]],
    targets: dict[int, dict[str, Any]],
    out: torch.Tensor,
    decode: Decode | None = None,
) -> list[tuple[int, str]]:
    """Each planned position's mosaic rendered into `out` [B, 3, S, S] uint8 on the device; the failures.

    `targets` are the workers' (position -> targets, each with its `MOSAIC_PLAN`, taken off here); a position
    without one failed in the workers and is left as it is. A position fails where a picture it shows decodes
    nowhere. `decode` decodes the JPEGs (default `nvjpeg_decode`).
    """
    planned = sorted(position for position, found in targets.items() if MOSAIC_PLAN in found)
    plans = {position: targets[position].pop(MOSAIC_PLAN) for position in planned}
    needed = sorted({shown for position in planned for shown in plans[position][1]})
    pictures, bad = decode_pictures(items, needed, out.device, decode or nvjpeg_decode)
    failures: list[tuple[int, str]] = []
    good: list[int] = []
    for position in planned:
        broken = [shown for shown in plans[position][1] if shown in bad]
        if broken:
            failures.append((position, bad[broken[0]]))
        else:
            good.append(position)
    if good:
        rendered = render_batch([plans[position][0] for position in good],
                                [[pictures[shown] for shown in plans[position][1]] for position in good])  # fmt: skip
        out[torch.tensor(good, device=out.device)] = rendered
    return failures
