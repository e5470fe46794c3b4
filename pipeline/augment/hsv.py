"""HSV: ultralytics' hue, saturation and value gains, applied to a batch at once.

Ultralytics draws gains r = U(-1, 1) * (hgain, sgain, vgain) per image,
converts the image to OpenCV's 8-bit HSV (hue in degrees / 2, 0..179;
saturation and value 0..255), moves hue by r_h * 180 (mod 180) and scales
saturation by 1 + r_s and value by 1 + r_v through 8-bit lookup tables
(truncated, clipped), and converts back. The same arithmetic runs here in
torch on a whole uint8 batch on a GPU (`apply_hsv`), and in native code on
one image in a worker (`hsv_in_place`, `colour.c`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .. import native
from .warp import Uniform


@dataclasses.dataclass(frozen=True)
class HSV:
    """Hue, saturation and value gains (ultralytics' hsv_h, hsv_s, hsv_v)."""

    hue: float = 0.015
    saturation: float = 0.7
    value: float = 0.4

    def __post_init__(self) -> None:
        for name in ("hue", "saturation", "value"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1):
                raise ValueError(f"HSV({name}={value!r}): a gain is 0 to 1")

    def draw(self, rng: Uniform) -> tuple[float, float, float]:
        """One image's gains (r_h, r_s, r_v), drawn as ultralytics draws them."""
        return (rng.uniform(-1, 1) * self.hue, rng.uniform(-1, 1) * self.saturation, rng.uniform(-1, 1) * self.value)


def hsv_in_place(image: np.ndarray, gains: tuple[float, float, float], *, simd: int = 2) -> None:
    """One planar uint8 RGB image [3, H, W] (a loader's slot) with its gains applied, in place, in native code.

    The arithmetic of `apply_hsv` (OpenCV's 8-bit HSV and ultralytics' tables; the way back divides by
    multiplying with reciprocals, a level from OpenCV's on a few colours), for the CPU: a pass over the
    pixels instead of a few dozen tensor passes: sixteen at once with AVX-512, eight with AVX2. `simd`
    picks the widest loop allowed (2: AVX-512 where the CPU has it, 1: AVX2, 0 or False: the scalar
    one); every loop gives the same output. Without the native library, `apply_hsv` does it.
    """
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[0] != 3 or not image.flags.c_contiguous:
        raise ValueError(f"hsv_in_place takes a C-contiguous uint8 [3, H, W] image, not {image.dtype} {image.shape}")
    lib = native.library()
    if lib is None:
        image[...] = apply_hsv(torch.from_numpy(image[None]), torch.tensor([gains]))[0].numpy()
        return
    lut_h, lut_s, lut_v = (np.ascontiguousarray(table, np.uint8).tobytes() for table in lookup_tables(gains))
    multipliers = np.array([gains[1] + 1, gains[2] + 1], np.float64).tobytes()  # as `lookup_tables` multiplies
    plane = image.shape[1] * image.shape[2]
    lib.gf_hsv(image.ctypes.data, plane, plane, lut_h, lut_s, lut_v, multipliers, int(simd))


def lookup_tables(gains: tuple[float, float, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ultralytics' three 8-bit tables for gains (r_h, r_s, r_v): built in float64, truncated to 8 bits."""
    x = np.arange(256, dtype=np.float64)
    lut_h = ((x + gains[0] * 180) % 180).astype(np.uint8)
    lut_s = np.clip(x * (gains[1] + 1), 0, 255).astype(np.uint8)
    lut_s[0] = 0
    lut_v = np.clip(x * (gains[2] + 1), 0, 255).astype(np.uint8)
    return lut_h, lut_s, lut_v


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenCV's tables: round((255 << 12) / v) and round((180 << 12) / (6 diff)), 0 at 0 (rounded half to even)."""
    steps = torch.arange(256, dtype=torch.float64)
    safe = steps.clamp(min=1)
    sdiv = torch.where(steps > 0, torch.round((255 << 12) / safe), torch.zeros_like(steps))
    hdiv = torch.where(steps > 0, torch.round((180 << 12) / (6 * safe)), torch.zeros_like(steps))
    return sdiv.to(device=device, dtype=torch.int32), hdiv.to(device=device, dtype=torch.int32)


def apply_hsv(images: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
    """RGB uint8 images [B, 3, H, W] with each one's gains [B, 3] (r_h, r_s, r_v) applied: a new uint8 tensor."""
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"apply_hsv takes uint8 [B, 3, H, W] RGB images, not {images.dtype} {tuple(images.shape)}")
    x = images.int()
    r, g, b = x[:, 0], x[:, 1], x[:, 2]
    v = torch.maximum(torch.maximum(r, g), b)
    diff = v - torch.minimum(torch.minimum(r, g), b)
    # OpenCV's 8-bit RGB -> HSV, in its fixed point: 12-bit reciprocal tables, rounded
    sdiv, hdiv = _tables(images.device)
    s = (diff * sdiv[v] + 2048) >> 12
    raw = torch.where(v == r, g - b, torch.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    h = (raw * hdiv[diff] + 2048) >> 12
    h = torch.where(h < 0, h + 180, h)
    # the lookup tables, per image, in float64 and truncated to 8 bits as ultralytics builds them
    gain = gains.to(device=images.device, dtype=torch.float64)
    steps = torch.arange(256, dtype=torch.float64, device=images.device)[None, :]
    lut_h = torch.floor(torch.remainder(steps + gain[:, 0:1] * 180, 180))
    lut_s = torch.floor((steps * (gain[:, 1:2] + 1)).clamp(0, 255))
    lut_s[:, 0] = 0
    lut_v = torch.floor((steps * (gain[:, 2:3] + 1)).clamp(0, 255))
    batch = images.shape[0]
    h = torch.gather(lut_h.float(), 1, h.long().reshape(batch, -1)).reshape(h.shape)
    s = torch.gather(lut_s.float(), 1, s.long().reshape(batch, -1)).reshape(s.shape)
    v = torch.gather(lut_v.float(), 1, v.long().reshape(batch, -1)).reshape(v.shape)
    # OpenCV's HSV -> RGB for 8 bits: in floats, truncated back (its vector path, which images take)
    hue = h * 2 / 60
    sector = torch.floor(hue)
    frac = hue - sector
    sv, vv = s / 255, v / 255
    p, q, t = vv * (1 - sv), vv * (1 - sv * frac), vv * (1 - sv * (1 - frac))
    sector = torch.remainder(sector, 6)
    choose = [(vv, t, p), (q, vv, p), (p, vv, t), (p, q, vv), (t, p, vv), (vv, p, q)]
    out = torch.zeros(images.shape, dtype=torch.float32, device=images.device)
    for k, (cr, cg, cb) in enumerate(choose):
        where = sector == k
        out[:, 0] = torch.where(where, cr, out[:, 0])
        out[:, 1] = torch.where(where, cg, out[:, 1])
        out[:, 2] = torch.where(where, cb, out[:, 2])
    return torch.floor(out * 255 + 1e-4).clamp(0, 255).to(torch.uint8)  # OpenCV truncates (its vector path)
