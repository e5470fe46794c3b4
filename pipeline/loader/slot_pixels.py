"""Decoded pixels into a batch slot: the crop box resized (Pillow, or gpufeed's C resampler), flipped, normalised.

The decoders (`cpu_decode.py`, `region_decode.py`) end here: RGBX rows from
libjpeg-turbo or simplejpeg, a Pillow image, or an HxWx3 array become the
slot's pixels, planar 3xHxW or interleaved HxWx3, uint8 or float32 through
an `Affine`. `resample_mode` finds, once per process, which of the C
resampler's roundings equals the PIL in use; the C path is used only then.
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
from ..decode import open_image, pil_image, to_rgb
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


_MODE_UNKNOWN = -1
_resample_mode: int | None = _MODE_UNKNOWN


def resample_mode() -> int | None:
    """How the PIL in use rounds a bilinear resize: native.PILLOW or PILLOW_SIMD, or None.

    Found once per process by resizing a few random images with PIL and with
    each of the C resampler's modes; the C path is used only where its pixels
    equal PIL's exactly. None when the region library is missing or no mode
    matches (then Pillow resizes).
    """
    global _resample_mode
    if _resample_mode == _MODE_UNKNOWN:
        with _MODE_LOCK:
            if _resample_mode == _MODE_UNKNOWN:
                _resample_mode = _find_resample_mode()
    return None if _resample_mode is None else int(_resample_mode)


_MODE_LOCK = threading.Lock()


def _find_resample_mode() -> int | None:
    decoder = region_decoder()
    if decoder is None:
        return None
    Image = pil_image()
    rs = np.random.RandomState(7)
    # (source size, box, output size): up, down, and a height shrinking much more than the width
    cases = [((37, 29), (0.6, 1.3, 30.2, 27.9), (50, 41)), ((64, 90), (2.5, 3.1, 60.7, 88.2), (23, 19)),
             ((40, 200), (0.0, 0.0, 40.0, 200.0), (40, 31))]  # fmt: skip
    sources = [rs.randint(0, 256, (h, w, 4)).astype(np.uint8) for (w, h), _, _ in cases]
    wanted = [
        np.asarray(Image.frombuffer("RGBX", size, src, "raw", "RGBX", 0, 1).resize(out, Image.Resampling.BILINEAR, box))
        for src, (size, box, out) in zip(sources, cases)
    ]  # fmt: skip
    for mode in (native.PILLOW_SIMD, native.PILLOW):
        matches = True
        for src, want, (size, box, out) in zip(sources, wanted, cases):
            ours = np.zeros((out[1], out[0], 3), np.uint8)
            decoder.resize_store(src.ctypes.data, size, box, ours, mode)
            matches = matches and np.array_equal(ours, want[:, :, :3])
        if matches:
            return mode
    return None


def rgbx_into(
    slot: np.ndarray,
    pixels: np.ndarray,
    width: int,
    height: int,
    box: tuple[float, float, float, float],
    flip: bool,
    affine: Affine | None,
) -> None:
    """Decoded RGBX pixels -> the slot: crop/resize `box` in Pillow's core, then one C pass to the slot's layout.

    Works on Pillow's image cores directly: the decoded buffer is mapped, not
    copied, and the resized image is pasted into a per-thread buffer that C
    reads, so the GIL is held only for the calls themselves.
    """
    Image = pil_image()
    decoder = region_decoder()
    mode = resample_mode()
    if decoder is not None and mode is not None and pixels.flags.c_contiguous:  # resize and store in one C call
        addresses = affine.addresses if affine is not None else None
        decoder.resize_store(pixels.ctypes.data, (width, height), box, slot, mode, flip=flip, affine=addresses)
        return
    if decoder is None or not hasattr(Image.core, "map_buffer"):
        image = Image.frombuffer("RGBX", (width, height), pixels, "raw", "RGBX", 0, 1)
        _resize_box_into(slot, image, box, flip, affine)
        return
    source = Image.core.map_buffer(pixels, (width, height), "raw", 0, ("RGBX", 0, 1))
    size = slot_size(slot)
    if _exact_crop(box, size):
        resized = source.crop(tuple(int(v) for v in box))
    else:
        resized = source.resize(size, Image.Resampling.BILINEAR, box)
    address, target = _rgbx_target(size)
    target.paste(resized, (0, 0, *size))
    decoder.store(address, size[0], size[1], flip, slot, affine.addresses if affine is not None else None)


_PER_THREAD = threading.local()


def _rgbx_target(size: tuple[int, int]) -> tuple[int, Any]:
    """This thread's RGBX buffer of `size` and a Pillow core mapped onto it (made once per size)."""
    targets = getattr(_PER_THREAD, "targets", None)
    if targets is None:
        targets = _PER_THREAD.targets = {}
    found = targets.get(size)
    if found is None:
        if len(targets) >= 32:  # placed images (letterbox) come in many sizes: keep a few buffers, not one per size
            targets.clear()
        array = np.empty((size[1], size[0], 4), np.uint8)
        core = pil_image().core.map_buffer(array, size, "raw", 0, ("RGBX", 0, 1))
        found = targets[size] = (array.ctypes.data, core, array)
    return found[0], found[1]


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
    sx, sy = img.width / width, img.height / height
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
        image = Image.fromarray(image)
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
