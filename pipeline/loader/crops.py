"""Which part of each image a batch slot gets: the crop plan, before any pixel is decoded.

A sample's crop is a pure function of its seed and its image's header size:
a random-resized crop in train mode (torchvision's RandomResizedCrop
parameters), a centre crop of the shorter side in eval mode. The C planner
(resample.c, gf_plan) draws the same numbers from the same generator, so a
sample gets the same crop whichever decoder reads it (`cpu_decode.py`,
`gpu_decode.py`). `region_plan` goes one step further for the region
decoder: the DCT scaling and the rectangle of the JPEG to decode.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..errors import DecodeError


@dataclasses.dataclass(frozen=True)
class CropSpec:
    """What each sample becomes: `size` x `size` RGB.

    Attributes:
        size: output side in pixels.
        train: random-resized crop (else resize shorter side to
            size / eval_fraction and centre-crop).
        scale: random crop area range.
        ratio: random crop aspect range.
        eval_fraction: centre crop fraction in eval mode (0.875: 224 from 256).
        max_pixels: larger images are refused as decompression bombs.
        decoder: for JPEGs, "region" (only the crop's rows and iMCU columns,
            DCT-scaled, see cpu_decode.py), "simplejpeg" (whole image, DCT-scaled)
            or "pil".
        recipe: "crop" (the above), or a detection recipe placing a part of
            the image in part of the output (`placement.py`): "letterbox",
            "scale_jitter", "iou_crop".
        jitter: scale_jitter's range of scales (of the letterboxed size).
        fill: the value of the output's pixels the image does not cover.
        flip: random horizontal flips (the "yolo" recipe draws its own in its plan).
        mosaic: the "yolo" recipe's mosaic (off in its `close_mosaic` epochs).
        hyp: the "yolo" recipe's hyperparameters (`LoaderSpec.hyp`).
        hsv_in_workers: the "yolo" recipe's HSV gains applied by the decode
            workers (native code); False: drawn there, applied to the batch
            on the device (a GPU's, where the workers' CPU time is scarcer).
    """

    size: int = 224
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    eval_fraction: float = 0.875
    decoder: str = "simplejpeg"
    max_pixels: int = 89_478_485
    recipe: str = "crop"
    jitter: tuple[float, float] = (0.1, 2.0)
    fill: int = 114
    flip: bool = True
    mosaic: bool = True
    hyp: tuple[tuple[str, float], ...] = ()
    hsv_in_workers: bool = True

    @property
    def mosaics(self) -> bool:
        """Each output a mosaic of several samples (the "yolo" recipe in train mode; `mosaic_piece.py`)."""
        return self.recipe == "yolo" and self.train


class Affine:
    """Per-channel scale and shift to float32 (normalisation), kept ready for the C writer."""

    __slots__ = ("addresses", "scale", "shift")

    def __init__(self, scale: np.ndarray, shift: np.ndarray) -> None:
        self.scale, self.shift = scale, shift
        self.addresses = (scale.ctypes.data, shift.ctypes.data)

    @classmethod
    def of(cls, scale: Any, shift: Any) -> Affine:
        def values(v: Any) -> np.ndarray:
            array = np.ascontiguousarray(np.asarray(v, np.float32).reshape(-1))
            if array.shape != (3,):
                raise ValueError("an affine needs 3 scales and 3 shifts")
            return array

        return cls(values(scale), values(shift))


SEED_MASK = (1 << 64) - 1  # sample seeds are 64-bit, as the C planner reads them


class CropRandom:
    """A sample's crop randomness: splitmix64 from its seed.

    The C planner (resample.c, gf_plan) runs the same generator, so a
    crop is the same whether C or Python plans it, for any decoder.
    """

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = seed & SEED_MASK

    def _next(self) -> int:
        self._state = z = (self._state + 0x9E3779B97F4A7C15) & SEED_MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & SEED_MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & SEED_MASK
        return z ^ (z >> 31)

    def random(self) -> float:
        return (self._next() >> 11) * (1.0 / 9007199254740992.0)

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.random()

    def randint(self, a: int, b: int) -> int:
        """a..b inclusive."""
        return a + self._next() % (b - a + 1)


def random_resized_crop_box(
    rng: CropRandom, width: int, height: int, spec: CropSpec
) -> tuple[float, float, float, float]:
    """(left, top, width, height) like torchvision's RandomResizedCrop.get_params."""
    area = width * height
    log_low, log_high = math.log(spec.ratio[0]), math.log(spec.ratio[1])
    for _ in range(10):
        target = area * rng.uniform(*spec.scale)
        aspect = math.exp(rng.uniform(log_low, log_high))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return float(rng.randint(0, width - w)), float(rng.randint(0, height - h)), float(w), float(h)
    in_ratio = width / height
    if in_ratio < spec.ratio[0]:
        w, h = width, round(width / spec.ratio[0])
    elif in_ratio > spec.ratio[1]:
        h, w = height, round(height * spec.ratio[1])
    else:
        w, h = width, height
    return float((width - w) // 2), float((height - h) // 2), float(w), float(h)


def centre_crop_box(width: int, height: int, spec: CropSpec) -> tuple[float, float, float, float]:
    """The box that transforms.v2's `Resize(size / eval_fraction)` then `CenterCrop(size)` reads.

    v2's integer rules: the resized shorter side is exactly size /
    eval_fraction (rounded), the longer one truncated; the crop's anchor is
    rounded (`int(round((W' - size) / 2))`). The box is that crop mapped back
    by each axis's own scale, so one resampling gives v2's geometry; an image
    prepared at the eval size gets an exact, integer crop (no resampling).
    C plans the same box (resample.c, gf_centre_crop).
    """
    resized_short = round(spec.size / spec.eval_fraction)
    if width <= height:
        new_w, new_h = resized_short, int(resized_short * height / width)
    else:
        new_w, new_h = int(resized_short * width / height), resized_short
    sx, sy = width / new_w, height / new_h
    return round((new_w - spec.size) / 2) * sx, round((new_h - spec.size) / 2) * sy, spec.size * sx, spec.size * sy


def flip_mask(seed: int, epoch: int, rank: int, index: int, count: int) -> np.ndarray:
    """Which samples of batch `index` of an epoch are mirrored (train mode with flips): one draw per position."""
    rng = np.random.default_rng([seed, epoch, rank, index, 0xF1])
    return rng.random(count) < 0.5


class FixedBox:
    """Stands in for a sample's crop randomness where its box is already chosen (a placement, `placement.py`)."""

    __slots__ = ("box",)

    def __init__(self, box: tuple[float, float, float, float]) -> None:
        self.box = box


def crop_box(
    rng: CropRandom | FixedBox | None, width: int, height: int, spec: CropSpec
) -> tuple[float, float, float, float]:
    """(left, top, width, height) of the crop: random-resized in train mode (`rng` needed), else centred.

    A `FixedBox` gives its box: every decoder then reads that part of the image.
    """
    if isinstance(rng, FixedBox):
        return rng.box
    if spec.train:
        assert isinstance(rng, CropRandom)
        return random_resized_crop_box(rng, width, height, spec)
    return centre_crop_box(width, height, spec)


def is_planar(slot: np.ndarray) -> bool:
    """True for a planar (3, H, W) slot, False for an interleaved (H, W, 3) one."""
    return slot.shape[0] == 3 and slot.shape[2] != 3


def slot_size(slot: np.ndarray) -> tuple[int, int]:
    """(width, height) of the image a slot holds."""
    return (slot.shape[2], slot.shape[1]) if is_planar(slot) else (slot.shape[1], slot.shape[0])


def check_pixels(width: int, height: int, spec: CropSpec) -> None:
    """Refuse an image over `spec.max_pixels` (a decompression bomb) or without pixels.

    Raises:
        DecodeError: the image's size says why it cannot be used.
    """
    if width * height > spec.max_pixels:
        raise DecodeError(f"decompression bomb refused: {width}x{height} is over the {spec.max_pixels:,}-pixel limit")
    if width < 1 or height < 1:
        raise DecodeError(f"image has no pixels ({width}x{height})")


def region_plan(
    slot: np.ndarray, width: int, height: int, rng: CropRandom | FixedBox | None, spec: CropSpec
) -> tuple[tuple[float, float, float, float], int, tuple[int, int, int, int, int]]:
    """(crop box in the scaled image, M of the M/8 scaling, region x, y, w, h to decode + its RGBX bytes)."""
    check_pixels(width, height, spec)
    left, top, cw, ch = crop_box(rng, width, height, spec)
    out_width, out_height = slot_size(slot)
    # The smallest M/8 DCT scaling that keeps the crop at least as large as the output.
    eighths = min(8, max(1, math.ceil(8 * max(out_width / cw, out_height / ch) - 1e-9)))
    scaled_width, scaled_height = -(-width * eighths // 8), -(-height * eighths // 8)
    scale = eighths / 8  # libjpeg's scaled IDCT maps x to x * M/8 exactly; only the size is rounded up
    box = (left * scale, top * scale, (left + cw) * scale, (top + ch) * scale)
    # Decode a margin around the box: the resampling filter reads past its edge.
    margin = 3 + math.ceil(max((box[2] - box[0]) / out_width, (box[3] - box[1]) / out_height))
    x0, y0 = max(0, math.floor(box[0]) - margin), max(0, math.floor(box[1]) - margin)
    x1, y1 = min(scaled_width, math.ceil(box[2]) + margin), min(scaled_height, math.ceil(box[3]) + margin)
    return box, eighths, (x0, y0, x1 - x0, y1 - y0, scaled_width * (y1 - y0) * 4)


def plan_numbers(spec: CropSpec) -> tuple[float, ...]:
    """The crop spec's numbers as the C planner reads them."""
    return (
        spec.scale[0], spec.scale[1], math.log(spec.ratio[0]), math.log(spec.ratio[1]), spec.ratio[0], spec.ratio[1],
        spec.eval_fraction,
    )  # fmt: skip
