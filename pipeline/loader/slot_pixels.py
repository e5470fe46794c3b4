"""Decoded pixels into a batch slot: the crop box resized (Pillow, or gpufeed's C resampler), flipped, normalised.

The decoders (`cpu_decode.py`, `region_decode.py`) end here: RGBX rows from
libjpeg-turbo or simplejpeg, a Pillow image, or an HxWx3 array become the
slot's pixels, planar 3xHxW or interleaved HxWx3, uint8 or float32 through
an `Affine`. `resample_mode` is the C resampler's arithmetic, the fastest
whichever PIL is installed, within a stated tolerance of PIL's pixels.
Each thread keeps its own region decoder and buffers (`_PER_THREAD`).
"""

from __future__ import annotations

import math
import struct
import threading
import zlib
from typing import Any

import numpy as np

from .. import native
from ..decode import decoded_scale, open_image, pil_image, to_rgb
from .crops import (
    Affine,
    CropRandom,
    CropSpec,
    FixedBox,
    crop_box,
    is_planar,
    slot_size,
)

# Bad bytes surface as these from Pillow (UnidentifiedImageError is an OSError;
# DecompressionBombError, zlib and struct errors), simplejpeg, NumPy and the
# region decoder; anything else is a bug and is not hidden as a bad sample.
DATA_ERRORS: tuple[type[BaseException], ...] = (
    OSError, ValueError, EOFError, SyntaxError, IndexError, KeyError, MemoryError, zlib.error, struct.error,
    native.RegionError,
)  # fmt: skip


def crop_randomness(
    seed: int, spec: CropSpec, box: tuple[float, float, float, float] | None
) -> CropRandom | FixedBox | None:
    """What chooses a sample's crop: its given box, else a fresh generator from its seed (train), else none."""
    if box is not None:
        return FixedBox(box)
    return CropRandom(seed) if spec.train else None


def resample_mode() -> int | None:
    """The C resampler's arithmetic: native.PILLOW_SIMD's 16-bit weights, or None without the native library.

    The same whichever PIL is installed: plain Pillow, which torchvision,
    ultralytics and timm install over Pillow-SIMD, must not make the loader
    slower. Its agreement with the active PIL is stated in
    `native.bindings` (MIN_PSNR_DB, BILINEAR_MAX_LEVELS); None means Pillow
    resizes (no native library here).
    """
    return native.PILLOW_SIMD if region_decoder() is not None else None


def rgbx_into(
    slot: np.ndarray,
    pixels: np.ndarray,
    width: int,
    height: int,
    box: tuple[float, float, float, float],
    flip: bool,
    affine: Affine | None,
) -> None:
    """Decoded RGBX pixels -> the slot: `box` resized, flipped and stored in the slot's layout.

    One C call (no Python lock held) where the native library is here; else
    Pillow resizes and NumPy stores.
    """
    decoder = region_decoder()
    if decoder is not None:
        pixels = np.ascontiguousarray(pixels)
        addresses = affine.addresses if affine is not None else None
        decoder.resize_store(
            pixels.ctypes.data, (width, height), box, slot, native.PILLOW_SIMD, flip=flip, affine=addresses
        )
        return
    Image = pil_image()
    image = Image.frombuffer("RGBX", (width, height), pixels, "raw", "RGBX", 0, 1)
    _resize_box_into(slot, image, box, flip, affine)


_PER_THREAD = threading.local()


def region_decoder() -> native.RegionDecoder | None:
    decoder = getattr(_PER_THREAD, "region", None)
    if decoder is None:
        lib = native.library()
        if lib is None:
            return None
        decoder = _PER_THREAD.region = native.RegionDecoder(lib)
    return decoder


def decode_buffer(needed: int) -> np.ndarray:
    """A per-thread output buffer for simplejpeg: no fresh 200 KB allocation per image."""
    buffer = getattr(_PER_THREAD, "buffer", None)
    if buffer is None or buffer.size < needed:
        buffer = np.empty(max(needed, 1 << 20), np.uint8)
        _PER_THREAD.buffer = buffer
    return buffer


def pil_into(
    slot: np.ndarray, data: bytes, rng: CropRandom | FixedBox | None, spec: CropSpec, flip: bool, affine: Any
) -> None:
    Image = pil_image()
    img = open_image(data, max_pixels=spec.max_pixels)
    width, height = img.size
    left, top, cw, ch = crop_box(rng, width, height, spec)
    if img.format == "JPEG":
        scale = min(1.0, max(spec.size / cw, spec.size / ch))
        if scale < 1.0:
            img.draft("RGB", (math.ceil(width * scale), math.ceil(height * scale)))
    img.load()
    img = to_rgb(img, (255, 255, 255), Image)
    sx, sy = decoded_scale(width, height, img.width, img.height)  # a draft maps by M/8 exactly
    box = (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)
    _resize_box_into(slot, img, box, flip, affine)


def crop_array_into(
    slot: np.ndarray, array: np.ndarray, rng: CropRandom | FixedBox | None, spec: CropSpec, flip: bool, affine: Any
) -> None:
    height, width = array.shape[:2]
    left, top, cw, ch = crop_box(rng, width, height, spec)
    _resize_box_into(slot, array, (left, top, left + cw, top + ch), flip, affine)


def _exact_crop(box: tuple[float, float, float, float], size: tuple[int, int]) -> bool:
    left, top, right, bottom = box
    return all(float(v).is_integer() for v in box) and (right - left, bottom - top) == size


def _resize_box_into(
    slot: np.ndarray, image: Any, box: tuple[float, float, float, float], flip: bool, affine: Any
) -> None:
    """Crop `box` out of `image` (PIL image or HxWx3 array), resized bilinearly to fill `slot`."""
    Image = pil_image()
    size = slot_size(slot)
    exact = _exact_crop(box, size)
    if isinstance(image, np.ndarray):
        if exact:  # no resampling: copy the pixels
            left, top, right, bottom = (int(v) for v in box)
            region = image[top:bottom, left:right]
            if flip:
                region = region[:, ::-1]
            _finish_into(slot, region.transpose(2, 0, 1) if is_planar(slot) else region, affine)
            return
        if region_decoder() is not None:  # the C resampler, as for decoded JPEGs (rgbx_into)
            height, width = image.shape[:2]
            rgbx = np.empty((height, width, 4), np.uint8)
            rgbx[:, :, :3] = image
            rgbx_into(slot, rgbx, width, height, box, flip, affine)
            return
        image = Image.fromarray(image)
    if not exact and region_decoder() is not None:
        rgbx = np.frombuffer(image.tobytes("raw", "RGBX"), np.uint8)
        rgbx_into(slot, rgbx, image.width, image.height, box, flip, affine)
        return
    if exact:
        image = image.crop(tuple(int(v) for v in box))
    else:
        image = image.resize(size, Image.Resampling.BILINEAR, box=box)
    _write_pixels(slot, image, flip, affine)


def _write_pixels(slot: np.ndarray, image: Any, flip: bool, affine: Any) -> None:
    """An RGB/RGBX PIL image of the slot's size -> the slot, mirrored when `flip`."""
    decoder = region_decoder()
    if decoder is not None:  # one C pass: unpack, flip, convert, any layout
        rgbx = np.frombuffer(image.tobytes("raw", "RGBX"), np.uint8)
        addresses = affine.addresses if affine is not None else None
        decoder.store(rgbx.ctypes.data, image.width, image.height, flip, slot, addresses)
        return
    if flip:
        image = image.transpose(pil_image().Transpose.FLIP_LEFT_RIGHT)
    pixels = slot if slot.dtype == np.uint8 else np.empty(slot.shape, np.uint8)
    if is_planar(slot):
        plane = slot.shape[1:]
        for channel, band in enumerate("RGB"):
            pixels[channel] = np.frombuffer(image.tobytes("raw", band), np.uint8).reshape(plane)
    else:
        pixels[...] = np.frombuffer(image.tobytes("raw", "RGB"), np.uint8).reshape(slot.shape)
    if pixels is not slot:
        _finish_into(slot, pixels, affine)


def _finish_into(slot: np.ndarray, pixels: np.ndarray, affine: Any) -> None:
    """uint8 pixels in the slot's layout -> the slot (copied, or scaled and shifted to float32)."""
    if slot.dtype == np.uint8:
        np.copyto(slot, pixels)
        return
    shape = (3, 1, 1) if is_planar(slot) else (3,)
    scale, shift = affine.scale.reshape(shape), affine.shift.reshape(shape)
    np.multiply(pixels, scale, out=slot)
    np.add(slot, shift, out=slot)
