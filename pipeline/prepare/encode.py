"""Encode a prepared RGB image into the bytes stored in a shard."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from ..specs import EncodeSpec


def encode_image(img: Any, spec: EncodeSpec) -> bytes:
    """JPEG / WebP / PNG bytes, or a uint8 HxWx3 `.npy` array (no decode at load time).

    Deterministic: the same pixels and spec always give the same bytes.
    An RGBX image (see `decode_image(padded=True)`) is converted to RGB first.
    """
    if img.mode != "RGB":
        img = img.convert("RGB")
    if spec.format == "npy":
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(img, dtype=np.uint8), allow_pickle=False)
        return buffer.getvalue()
    buffer = io.BytesIO()
    if spec.format == "jpeg":
        # Restart markers let the loader decode just a crop's blocks (see jpegregion.c).
        extra = {"restart_marker_blocks": spec.restart} if spec.restart else {}
        img.save(buffer, format="JPEG", quality=spec.quality, **extra)
    elif spec.format == "webp":
        img.save(buffer, format="WEBP", quality=spec.quality, method=4)
    else:
        # PNG is lossless at any level; 3 is several times faster than 6 and ~5 % larger.
        img.save(buffer, format="PNG", compress_level=3)
    return buffer.getvalue()
