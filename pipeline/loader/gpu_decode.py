"""JPEG decode on the GPU (nvjpeg through torchvision) for CPUs too small to keep up.

The crop of every sample is drawn exactly as on the CPU path (same seeds,
same boxes from the same header sizes); cropping and resizing happen on the
device with antialiased bilinear interpolation. Samples that are not JPEG, or
that nvjpeg refuses, are decoded on the CPU and uploaded.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, DecodeError
from .cpu_decode import decode_into
from .crops import CropRandom, CropSpec, crop_box


def check_gpu_decode(device: torch.device) -> None:
    """Raise ConfigError unless nvjpeg decoding can run on `device`."""
    if device.type != "cuda":
        raise ConfigError("decoder='nvjpeg' decodes on the GPU: it needs device='cuda'")
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "decoder='nvjpeg' needs torchvision built with CUDA (pip install torchvision matching your torch)"
        ) from exc


def decode_batch_on_gpu(
    items: list[tuple[str, bytes, int]], crop: CropSpec, device: torch.device
) -> tuple[torch.Tensor, list[tuple[int, str]]]:
    """Decode and crop a batch on `device`.

    Args:
        items: (extension, bytes, seed) per sample, as the CPU path gets them.
        crop: the crop settings.
        device: a CUDA device.

    Returns:
        (float NCHW tensor in 0-255 on the device, [(position, reason)] of failures).
    """
    import torch.nn.functional as F
    from torchvision.io import ImageReadMode, decode_jpeg

    size = crop.size
    out = torch.zeros((len(items), 3, size, size), dtype=torch.float32, device=device)
    failures: list[tuple[int, str]] = []
    jpegs = [i for i, (extension, _, _) in enumerate(items) if extension in ("jpg", "jpeg")]
    decoded: list[Any] = []
    if jpegs:
        encoded = [torch.frombuffer(bytearray(items[i][1]), dtype=torch.uint8) for i in jpegs]
        try:
            decoded = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            decoded = [None] * len(jpegs)  # one bad file fails the batch call: retry one by one
    cpu_side = [i for i in range(len(items)) if i not in set(jpegs)]
    for position, image in zip(jpegs, decoded):
        if image is None:
            cpu_side.append(position)
            continue
        _, height, width = image.shape
        rng = CropRandom(items[position][2]) if crop.train else None
        left, top, cw, ch = crop_box(rng, width, height, crop)
        region = image[:, round(top) : round(top + ch), round(left) : round(left + cw)]
        out[position] = F.interpolate(
            region[None].float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False
        )[0]
    slot = np.empty((size, size, 3), np.uint8)
    for position in cpu_side:
        extension, data, seed = items[position]
        try:
            decode_into(slot, extension, data, crop, seed)
        except DecodeError as exc:
            failures.append((position, exc.reason))
            continue
        out[position] = torch.from_numpy(slot).to(device).permute(2, 0, 1).float()
    return out, sorted(failures)
