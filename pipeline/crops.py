"""Decode one shard sample straight into its slot of a batch buffer, cropping on the way.

The crop is chosen from the image header before decoding so that JPEGs are
decoded already scaled down in the DCT domain (libjpeg-turbo M/8 scaling) to
just what the crop needs; the crop box is then resized once into the
preallocated uint8 HxWx3 slot. No per-image tensors, no ToTensor.
libjpeg-turbo and Pillow release the GIL, so threads scale across cores.
"""

from __future__ import annotations

import dataclasses
import io
import math
import random
import threading
from typing import Any

import numpy as np

from .decode import _pil, open_image, to_rgb
from .errors import DecodeError

try:
    import simplejpeg
except ImportError:  # pragma: no cover - depends on the install
    simplejpeg = None


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
        decoder: "simplejpeg" or "pil" for JPEGs.
    """

    size: int = 224
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    eval_fraction: float = 0.875
    decoder: str = "simplejpeg"
    max_pixels: int = 89_478_485


def default_decoder() -> str:
    return "simplejpeg" if simplejpeg is not None else "pil"


def random_resized_crop_box(rng: random.Random, width: int, height: int, spec: CropSpec) -> tuple[float, float, float, float]:
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
    """The box that 'resize shorter side to size/eval_fraction, centre-crop size' reads."""
    resized_short = round(spec.size / spec.eval_fraction)
    side = spec.size * min(width, height) / resized_short
    if min(width, height) == resized_short:
        # Already prepared at the eval size: an exact, integer crop (no resampling).
        return float(round((width - spec.size) / 2)), float(round((height - spec.size) / 2)), float(spec.size), float(spec.size)
    return (width - side) / 2, (height - side) / 2, side, side


def crop_box(rng: random.Random | None, width: int, height: int, spec: CropSpec) -> tuple[float, float, float, float]:
    if spec.train:
        assert rng is not None
        return random_resized_crop_box(rng, width, height, spec)
    return centre_crop_box(width, height, spec)


def decode_into(slot: np.ndarray, extension: str, data: bytes, spec: CropSpec, seed: int) -> None:
    """Decode one sample into `slot` (size x size x 3 uint8, written in place).

    Raises:
        DecodeError: the sample is corrupt or not an image.
    """
    rng = random.Random(seed) if spec.train else None
    try:
        if extension == "npy":
            array = np.load(io.BytesIO(data), allow_pickle=False)
            _check_pixels(array.shape[1] if array.ndim > 1 else 0, array.shape[0], spec)
            _crop_array_into(slot, _as_rgb_array(array), rng, spec)
        elif extension in ("jpg", "jpeg") and spec.decoder == "simplejpeg" and simplejpeg is not None:
            _jpeg_into(slot, data, rng, spec)
        else:
            _pil_into(slot, data, rng, spec)
    except DecodeError:
        raise
    except Exception as exc:  # any decoder failure is one bad sample, not a crashed epoch
        raise DecodeError(f"cannot decode .{extension} sample: {str(exc)[:160] or type(exc).__name__}") from None


def _check_pixels(width: int, height: int, spec: CropSpec) -> None:
    if width * height > spec.max_pixels:
        raise DecodeError(f"decompression bomb refused: {width}x{height} is over the {spec.max_pixels:,}-pixel limit")
    if width < 1 or height < 1:
        raise DecodeError(f"image has no pixels ({width}x{height})")


def _as_rgb_array(array: np.ndarray) -> np.ndarray:
    if array.dtype != np.uint8 or array.ndim not in (2, 3):
        raise DecodeError(f".npy sample must be uint8 HxW or HxWx3, got {array.dtype} {array.shape}")
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    if array.shape[2] != 3:
        raise DecodeError(f".npy sample must have 3 channels, got {array.shape}")
    return array


def _jpeg_into(slot: np.ndarray, data: bytes, rng: random.Random | None, spec: CropSpec) -> None:
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    _check_pixels(width, height, spec)
    left, top, cw, ch = crop_box(rng, width, height, spec)
    scale = min(1.0, max(spec.size / cw, spec.size / ch))
    kwargs = {}
    if scale < 1.0:
        kwargs = {"min_width": math.ceil(width * scale), "min_height": math.ceil(height * scale)}
    array = simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=_decode_buffer(width, height), **kwargs)
    sx, sy = array.shape[1] / width, array.shape[0] / height
    _resize_box_into(slot, array, (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy))


_LOCAL = threading.local()


def _decode_buffer(width: int, height: int) -> np.ndarray:
    """A per-thread output buffer for simplejpeg: no fresh 200 KB allocation per image."""
    needed = width * height * 3
    buffer = getattr(_LOCAL, "buffer", None)
    if buffer is None or buffer.size < needed:
        buffer = np.empty(max(needed, 1 << 20), np.uint8)
        _LOCAL.buffer = buffer
    return buffer


def _pil_into(slot: np.ndarray, data: bytes, rng: random.Random | None, spec: CropSpec) -> None:
    Image = _pil()
    img = open_image(data, max_pixels=spec.max_pixels)
    width, height = img.size
    left, top, cw, ch = crop_box(rng, width, height, spec)
    if img.format == "JPEG":
        scale = min(1.0, max(spec.size / cw, spec.size / ch))
        if scale < 1.0:
            img.draft("RGB", (math.ceil(width * scale), math.ceil(height * scale)))
    img.load()
    img = to_rgb(img, (255, 255, 255), Image)
    sx, sy = img.width / width, img.height / height
    box = (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)
    _resize_box_into(slot, img, box)


def _crop_array_into(slot: np.ndarray, array: np.ndarray, rng: random.Random | None, spec: CropSpec) -> None:
    height, width = array.shape[:2]
    left, top, cw, ch = crop_box(rng, width, height, spec)
    _resize_box_into(slot, array, (left, top, left + cw, top + ch))


def _resize_box_into(slot: np.ndarray, image: Any, box: tuple[float, float, float, float]) -> None:
    Image = _pil()
    size = slot.shape[1], slot.shape[0]
    left, top, right, bottom = box
    integral = all(float(v).is_integer() for v in box) and (right - left, bottom - top) == size
    if isinstance(image, np.ndarray):
        if integral:  # an exact crop: copy, no resampling
            slot[...] = image[int(top) : int(bottom), int(left) : int(right)]
            return
        image = Image.fromarray(image)
    elif integral:
        slot[...] = np.asarray(image.crop((int(left), int(top), int(right), int(bottom))))
        return
    slot[...] = np.asarray(image.resize(size, Image.Resampling.BILINEAR, box=box))
