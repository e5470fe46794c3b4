"""Decode one shard sample on the CPU straight into its slot of a batch buffer, cropping on the way.

The crop is chosen from the image header before decoding (`crops.py`) so that
JPEGs are decoded already scaled down in the DCT domain (libjpeg-turbo M/8
scaling) to just what the crop needs; the crop box is then resized once into
the preallocated uint8 slot, planar 3xHxW (the loader's batch layout: the
device-side conversion reads it without a transpose) or interleaved HxWx3.
No per-image tensors, no ToTensor.
libjpeg-turbo and Pillow release the GIL, so threads scale across cores.

Three JPEG paths, fastest first (`default_decoder`): "region" (gpufeed's
libjpeg-turbo decoder in `pipeline.native`, decoding only the crop's rows and
iMCU columns; `decode_many` does a whole batch piece in one C call),
"simplejpeg" (whole image, DCT-scaled) and "pil"; other formats and .npy
arrays go through Pillow or NumPy. The two fast paths refuse a JPEG on any
libjpeg warning (damage libjpeg would paper over with grey) as on an error;
Pillow then decodes that sample, and only Pillow's verdict rejects it, the
same rule as prepare's (`pipeline.decode`).
"""

from __future__ import annotations

import contextlib
import io
import math
import struct
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import native
from ..decode import open_image, pil_image, to_rgb
from ..errors import DecodeError
from .crops import (
    SEED_MASK,
    Affine,
    CropRandom,
    CropSpec,
    FixedBox,
    check_pixels,
    crop_box,
    is_planar,
    plan_numbers,
    region_plan,
    slot_size,
)
from .placement import Placement, place

try:
    import simplejpeg
except ImportError:  # pragma: no cover - depends on the install
    simplejpeg = None


def default_decoder() -> str:
    """The fastest JPEG decoder present: region, else simplejpeg, else Pillow."""
    if native.library() is not None:
        return "region"
    return "simplejpeg" if simplejpeg is not None else "pil"


def decode_into(
    slot: np.ndarray,
    extension: str,
    data: bytes,
    spec: CropSpec,
    seed: int,
    *,
    flip: bool = False,
    affine: Affine | tuple[Any, Any] | None = None,
    box: tuple[float, float, float, float] | None = None,
) -> None:
    """Decode one sample into `slot`, written in place.

    `slot` is planar (3, size, size) or interleaved (size, size, 3), its
    shape says which, and any strides. It is uint8, or float32 with
    `affine` = (scale, shift), three values each, or an `Affine`: slot =
    pixel * scale + shift per channel (conversion and normalisation in the
    same write).
    `flip` mirrors the result left-right. `box` (left, top, width, height),
    when given, is the part of the image read instead of the seed's crop.

    Raises:
        DecodeError: the sample is corrupt or not an image.
    """
    rng: CropRandom | FixedBox | None = FixedBox(box) if box is not None else CropRandom(seed) if spec.train else None
    if slot.dtype != np.uint8 and (slot.dtype != np.float32 or affine is None):
        raise ValueError("decode_into writes uint8 slots, or float32 slots with an affine")
    if affine is not None and not isinstance(affine, Affine):
        affine = Affine.of(*affine)
    try:
        if extension == "npy":
            array = np.load(io.BytesIO(data), allow_pickle=False)
            check_pixels(array.shape[1] if array.ndim > 1 else 0, array.shape[0], spec)
            _crop_array_into(slot, _as_rgb_array(array), rng, spec, flip, affine)
        elif extension in ("jpg", "jpeg") and spec.decoder == "region" and (decoder := _region_decoder()) is not None:
            boxes = None if box is None else [box]
            failures = _region_many(decoder, [slot], [(extension, data, seed)], [0], spec, [flip], affine, boxes)
            if failures:
                raise DecodeError(failures[0][1])
        elif extension in ("jpg", "jpeg") and spec.decoder == "simplejpeg" and simplejpeg is not None:
            if not _jpeg_into(slot, data, rng, spec, flip, affine):  # refused: Pillow's verdict stands
                _pil_into(slot, data, _randomness(seed, spec, box), spec, flip, affine)
        else:
            _pil_into(slot, data, rng, spec, flip, affine)
    except DecodeError:
        raise
    except _DATA_ERRORS as exc:  # what bad bytes make decoders raise: one bad sample, not a crashed epoch
        raise DecodeError(f"cannot decode .{extension} sample: {str(exc)[:160] or type(exc).__name__}") from None


# Bad bytes surface as these from Pillow (UnidentifiedImageError is an OSError;
# DecompressionBombError, zlib and struct errors), simplejpeg, NumPy and the
# region decoder; anything else is a bug and is not hidden as a bad sample.
_DATA_ERRORS: tuple[type[BaseException], ...] = (
    OSError, ValueError, EOFError, SyntaxError, IndexError, KeyError, MemoryError, zlib.error, struct.error,
    native.RegionError,
)  # fmt: skip


def _randomness(seed: int, spec: CropSpec, box: tuple[float, float, float, float] | None) -> CropRandom | FixedBox | None:
    """What chooses a sample's crop: its given box, else a fresh generator from its seed (train), else none."""
    if box is not None:
        return FixedBox(box)
    return CropRandom(seed) if spec.train else None


def _as_rgb_array(array: np.ndarray) -> np.ndarray:
    if array.dtype != np.uint8 or array.ndim not in (2, 3):
        raise DecodeError(f".npy sample must be uint8 HxW or HxWx3, got {array.dtype} {array.shape}")
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    if array.shape[2] != 3:
        raise DecodeError(f".npy sample must have 3 channels, got {array.shape}")
    return array


def _jpeg_into(
    slot: np.ndarray, data: bytes, rng: CropRandom | FixedBox | None, spec: CropSpec, flip: bool, affine: Any
) -> bool:
    """simplejpeg decodes the sample into `slot`; False when it refuses the data (then Pillow decides)."""
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return False
    check_pixels(width, height, spec)
    left, top, cw, ch = crop_box(rng, width, height, spec)
    scale = min(1.0, max(spec.size / cw, spec.size / ch))
    kwargs = {}
    if scale < 1.0:
        kwargs = {"min_width": math.ceil(width * scale), "min_height": math.ceil(height * scale)}
    # RGBX is PIL's own pixel layout, so the decoded buffer becomes an image
    # without a copy; the resize result is unpacked straight into the slot.
    try:
        array = simplejpeg.decode_jpeg(data, colorspace="RGBX", buffer=_decode_buffer(width * height * 4), **kwargs)
    except ValueError:  # corrupt data, or only a warning
        return False
    sx, sy = array.shape[1] / width, array.shape[0] / height
    box = (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)
    _rgbx_into(slot, array, array.shape[1], array.shape[0], box, flip, affine)
    return True


def decode_many(
    slots: list[np.ndarray],
    items: list[tuple[str, bytes, int]],
    spec: CropSpec,
    *,
    flips: list[bool] | None = None,
    affine: Affine | None = None,
    placements: list[Placement | None] | None = None,
) -> list[tuple[int, str]]:
    """`decode_into` for several samples (extension, data, seed) into their slots.

    Returns (index, reason) for each sample that could not be decoded. The
    same pixels as one `decode_into` per sample; with the region decoder
    and slots of one layout, one C call reads the JPEGs' headers, plans
    their crops, decodes the regions and resizes them into the slots, so
    the thread lets go of Python's lock once for the lot.

    A detection recipe (`spec.recipe` other than "crop") places each image
    in part of its slot (`placement.py`): `placements` gives each sample's
    where known (iou_crop chooses it from the sample's boxes), else it is
    worked out here from its seed and header.
    """
    flips = flips if flips is not None else [False] * len(items)
    if spec.recipe != "crop":
        return _placed_many(slots, items, spec, flips, affine, placements)
    decoder = _region_decoder() if spec.decoder == "region" else None
    failures: list[tuple[int, str]] = []
    batch = [i for i, item in enumerate(items) if decoder is not None and item[0] in ("jpg", "jpeg")]
    chosen = set(batch)
    for index, (extension, data, seed) in enumerate(items):
        if index not in chosen:
            try:
                decode_into(slots[index], extension, data, spec, seed, flip=flips[index], affine=affine)
            except DecodeError as exc:
                failures.append((index, exc.reason))
    if batch:
        assert decoder is not None
        failures += _region_many(decoder, slots, items, batch, spec, flips, affine)
    return sorted(failures)


def _region_many(
    decoder: native.RegionDecoder,
    slots: list[np.ndarray],
    items: list[tuple[str, bytes, int]],
    batch: list[int],
    spec: CropSpec,
    flips: list[bool],
    affine: Affine | None,
    boxes: list[tuple[float, float, float, float]] | None = None,
) -> list[tuple[int, str]]:
    """The region decoder over items[batch]: one C call for everything (`_crop_many`) when the slots
    share one layout and C resizes like this PIL; else headers and regions in C, crops planned and
    resized in Python. `boxes`, one per batch entry, are crops already chosen (C plans its own)."""
    targets = [slots[i] for i in batch]
    mode = resample_mode()
    given: list[tuple[float, float, float, float] | None] = list(boxes) if boxes is not None else [None] * len(batch)
    if boxes is None and mode is not None and _same_layout(targets):
        return _crop_many(decoder, mode, targets, items, batch, spec, flips, affine)
    # The fallback: C decodes the regions, Pillow resizes them.
    info, status, pointers = decoder.header_many([items[i][1] for i in batch])
    count = len(batch)
    usable = status == 0
    pixels = info[:, 0].astype(np.int64) * info[:, 1]
    usable &= (pixels <= spec.max_pixels) & (info[:, 0] > 0) & (info[:, 1] > 0)
    params, planned, sizes = np.zeros((count, 5), np.int32), np.zeros((count, 4)), np.zeros(count, np.uint64)
    for k in np.flatnonzero(usable):
        rng = _randomness(items[batch[k]][2], spec, given[k])
        box, eighths, region = region_plan(targets[k], int(info[k, 0]), int(info[k, 1]), rng, spec)
        planned[k], params[k], sizes[k] = box, (eighths, *region[:4]), region[4]
    failures: list[tuple[int, str]] = []
    for k in np.flatnonzero(~usable):  # libjpeg refused the header (Pillow decides), or the pixel checks say why
        index = batch[k]
        with _reason_into(failures, index):
            if status[k] != 0:
                _pil_fallback(slots[index], items[index], spec, flips[index], affine, given[k])
            else:
                check_pixels(int(info[k, 0]), int(info[k, 1]), spec)
    buffer = _decode_buffer(int(sizes.sum()) + 64 * count)
    offsets = np.zeros(count, np.uint64)
    offsets[1:] = np.cumsum(sizes + 64)[:-1]  # 64-byte aligned starts for each image's rows
    outs = np.where(usable, buffer.ctypes.data + offsets, 0).astype(np.uint64)
    decoded, done, _ = decoder.decode_many(pointers, params, outs, sizes)
    for k in np.flatnonzero(usable):
        index = batch[k]
        with _reason_into(failures, index):
            if done[k] != 0:
                _handed_back(decoder, int(done[k]), slots[index], items[index], spec, flips[index], affine, given[k])
                continue
            first, y = int(decoded[k, 0]), int(params[k, 2])
            box = planned[k]
            rows = buffer[int(offsets[k]) : int(offsets[k]) + int(sizes[k])]
            relative = (box[0] - first, box[1] - y, box[2] - first, box[3] - y)
            _rgbx_into(slots[index], rows, int(decoded[k, 1]), int(params[k, 4]), relative, flips[index], affine)
    return failures


@contextlib.contextmanager
def _reason_into(failures: list[tuple[int, str]], index: int) -> Iterator[None]:
    """Bad data in the block becomes (index, reason) in `failures`; anything else propagates."""
    try:
        yield
    except DecodeError as exc:
        failures.append((index, exc.reason))
    except MemoryError:
        raise
    except _DATA_ERRORS as exc:
        failures.append((index, f"cannot decode .jpg sample: {str(exc)[:160] or type(exc).__name__}"))


def _handed_back(
    decoder: native.RegionDecoder,
    status: int,
    slot: np.ndarray,
    item: tuple[str, bytes, int],
    spec: CropSpec,
    flip: bool,
    affine: Affine | None,
    box: tuple[float, float, float, float] | None = None,
) -> None:
    """A sample the C call did not finish (its non-zero status).

    Pillow decodes a CMYK one, and one libjpeg refused (an error, or only a
    warning: damage it would paper over with grey), whose verdict then
    stands; the pixel checks say why one over the limits is refused.
    """
    _, data, _ = item
    if status == native.OUT_OF_MEMORY:
        raise MemoryError("cannot allocate the decode and resize buffers")
    if status == native.OVER_LIMITS:
        check_pixels(*decoder.header(data), spec)
    else:  # UNSUPPORTED (CMYK) or -1 (libjpeg's message)
        _pil_fallback(slot, item, spec, flip, affine, box)


def _pil_fallback(
    slot: np.ndarray,
    item: tuple[str, bytes, int],
    spec: CropSpec,
    flip: bool,
    affine: Affine | None,
    box: tuple[float, float, float, float] | None = None,
) -> None:
    """Pillow decodes a sample a fast path handed back: the same crop (from its seed), Pillow's pixels and verdict."""
    _, data, seed = item
    _pil_into(slot, data, _randomness(seed, spec, box), spec, flip, affine)


def _crop_many(
    decoder: native.RegionDecoder,
    mode: int,
    targets: list[np.ndarray],
    items: list[tuple[str, bytes, int]],
    batch: list[int],
    spec: CropSpec,
    flips: list[bool],
    affine: Affine | None,
) -> list[tuple[int, str]]:
    """Every step for items[batch] in one C call; Python only for the samples it hands back."""
    count = len(batch)
    width, height = slot_size(targets[0])
    done, _ = decoder.crop_many(
        [items[i][1] for i in batch], np.fromiter((items[i][2] & SEED_MASK for i in batch), np.uint64, count),
        (spec.train, width, height, spec.size), plan_numbers(spec), spec.max_pixels, targets,
        np.fromiter((flips[i] for i in batch), np.uint8, count), mode, affine.addresses if affine is not None else None,
    )  # fmt: skip
    failures: list[tuple[int, str]] = []
    for k in np.flatnonzero(done):
        index = batch[k]
        with _reason_into(failures, index):
            _handed_back(decoder, int(done[k]), targets[k], items[index], spec, flips[index], affine)
    return failures




def image_size(extension: str, data: bytes) -> tuple[int, int]:
    """(width, height) of a sample's image from its header, as the decoders plan its crop (no EXIF turn).

    Raises:
        DecodeError: the header does not read.
    """
    try:
        if extension == "npy":
            array = np.load(io.BytesIO(data), allow_pickle=False, mmap_mode=None)
            return (array.shape[1], array.shape[0]) if array.ndim >= 2 else (0, 0)
        if extension in ("jpg", "jpeg") and simplejpeg is not None:
            with contextlib.suppress(ValueError):
                height, width, _, _ = simplejpeg.decode_jpeg_header(data)
                return width, height
        return open_image(data).size
    except DecodeError:
        raise
    except _DATA_ERRORS as exc:
        raise DecodeError(f"cannot read the .{extension} sample's header: {str(exc)[:160] or type(exc).__name__}") from None


def _placed_many(
    slots: list[np.ndarray],
    items: list[tuple[str, bytes, int]],
    spec: CropSpec,
    flips: list[bool],
    affine: Affine | None,
    placements: list[Placement | None] | None,
) -> list[tuple[int, str]]:
    """A detection recipe: each image decoded into the part of its slot its placement says, the rest filled.

    The JPEGs go to the region decoder together (one C call for their
    headers, one for their regions), the others one by one.
    """
    failures: list[tuple[int, str]] = []
    views: list[np.ndarray] = list(slots)
    boxes: dict[int, tuple[float, float, float, float]] = {}
    for index, (extension, data, seed) in enumerate(items):
        try:
            placement = placements[index] if placements is not None else None
            if placement is None:
                placement = place(_randomness(seed, spec, None), *image_size(extension, data), spec)
        except DecodeError as exc:
            failures.append((index, exc.reason))
            continue
        box, (x, y, width, height) = placement
        slot = slots[index]
        _fill(slot, spec.fill, affine)
        if flips[index]:  # the whole slot mirrored: the image's part sits mirrored too
            x = spec.size - x - width
        views[index] = slot[:, y : y + height, x : x + width] if is_planar(slot) else slot[y : y + height, x : x + width]
        boxes[index] = box
    decoder = _region_decoder() if spec.decoder == "region" else None
    batch = [i for i in boxes if decoder is not None and items[i][0] in ("jpg", "jpeg")]
    chosen = set(batch)
    for index in (i for i in boxes if i not in chosen):
        extension, data, seed = items[index]
        try:
            decode_into(views[index], extension, data, spec, seed, flip=flips[index], affine=affine, box=boxes[index])
        except DecodeError as exc:
            failures.append((index, exc.reason))
    if batch:
        assert decoder is not None
        failures += _region_many(decoder, views, items, batch, spec, flips, affine, [boxes[i] for i in batch])
    return sorted(failures)


def _fill(slot: np.ndarray, value: int, affine: Affine | None) -> None:
    """Every pixel of the slot at `value` (0-255), normalised like the pixels when the slot is float."""
    if slot.dtype == np.uint8:
        slot[...] = value
        return
    assert affine is not None
    shape = (3, 1, 1) if is_planar(slot) else (3,)
    slot[...] = value * affine.scale.reshape(shape) + affine.shift.reshape(shape)


def _same_layout(slots: list[np.ndarray]) -> bool:
    first = slots[0]
    return all(s.shape == first.shape and s.strides == first.strides and s.dtype == first.dtype for s in slots)


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
    decoder = _region_decoder()
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


def _rgbx_into(
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
    decoder = _region_decoder()
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


_LOCAL = threading.local()


def _rgbx_target(size: tuple[int, int]) -> tuple[int, Any]:
    """This thread's RGBX buffer of `size` and a Pillow core mapped onto it (made once per size)."""
    targets = getattr(_LOCAL, "targets", None)
    if targets is None:
        targets = _LOCAL.targets = {}
    found = targets.get(size)
    if found is None:
        if len(targets) >= 32:  # placed images (letterbox) come in many sizes: keep a few buffers, not one per size
            targets.clear()
        array = np.empty((size[1], size[0], 4), np.uint8)
        core = pil_image().core.map_buffer(array, size, "raw", 0, ("RGBX", 0, 1))
        found = targets[size] = (array.ctypes.data, core, array)
    return found[0], found[1]


def _region_decoder() -> native.RegionDecoder | None:
    decoder = getattr(_LOCAL, "region", None)
    if decoder is None:
        lib = native.library()
        if lib is None:
            return None
        decoder = _LOCAL.region = native.RegionDecoder(lib)
    return decoder


def _decode_buffer(needed: int) -> np.ndarray:
    """A per-thread output buffer for simplejpeg: no fresh 200 KB allocation per image."""
    buffer = getattr(_LOCAL, "buffer", None)
    if buffer is None or buffer.size < needed:
        buffer = np.empty(max(needed, 1 << 20), np.uint8)
        _LOCAL.buffer = buffer
    return buffer


def _pil_into(
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


def _crop_array_into(
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
    decoder = _region_decoder()
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
