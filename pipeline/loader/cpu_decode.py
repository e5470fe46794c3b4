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
import math
from typing import Any

import numpy as np

from .. import native
from ..decode import decoded_scale, open_image
from ..errors import DecodeError
from ..targets import TargetError, read_npy
from .crops import (
    Affine,
    CropRandom,
    CropSpec,
    FixedBox,
    check_pixels,
    crop_box,
    is_planar,
)
from .placement import Placement, place
from .region_decode import region_many
from .slot_pixels import (
    DATA_ERRORS,
    crop_array_into,
    crop_randomness,
    decode_buffer,
    pil_into,
    region_decoder,
    rgbx_into,
)
from .slot_pixels import resample_mode as resample_mode  # re-exported: pipeline.loader.cpu_decode.resample_mode

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
            array = npy_pixels(data)
            check_pixels(array.shape[1], array.shape[0], spec)
            crop_array_into(slot, _as_rgb_array(array), rng, spec, flip, affine)
        elif extension in ("jpg", "jpeg") and spec.decoder == "region" and (decoder := region_decoder()) is not None:
            boxes = None if box is None else [box]
            failures = region_many(decoder, [slot], [(extension, data, seed)], [0], spec, [flip], affine, boxes)
            if failures:
                raise DecodeError(failures[0][1])
        elif extension in ("jpg", "jpeg") and spec.decoder == "simplejpeg" and simplejpeg is not None:
            if not _jpeg_into(slot, data, rng, spec, flip, affine):  # refused: Pillow's verdict stands
                pil_into(slot, data, crop_randomness(seed, spec, box), spec, flip, affine)
        else:
            pil_into(slot, data, rng, spec, flip, affine)
    except DecodeError:
        raise
    except DATA_ERRORS as exc:  # what bad bytes make decoders raise: one bad sample, not a crashed epoch
        raise DecodeError(f"cannot decode .{extension} sample: {str(exc)[:160] or type(exc).__name__}") from None


def npy_pixels(data: bytes) -> np.ndarray:
    """A `.npy` sample's uint8 HxW or HxWx3 pixels, a view of its bytes: its header's shape is checked against
    the bytes there are before anything is made of it (`targets.read_npy`), so a lying one asks for no memory.

    Raises:
        DecodeError: not a plain .npy array, or not such pixels.
    """
    try:
        array = read_npy(data, ".npy sample")
    except TargetError as exc:
        raise DecodeError(str(exc)) from None
    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] != 3):
        raise DecodeError(f".npy sample must be uint8 HxW or HxWx3, got {array.dtype} {array.shape}")
    return array


def _as_rgb_array(array: np.ndarray) -> np.ndarray:
    return np.repeat(array[:, :, None], 3, axis=2) if array.ndim == 2 else array


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
        array = simplejpeg.decode_jpeg(data, colorspace="RGBX", buffer=decode_buffer(width * height * 4), **kwargs)
    except ValueError:  # corrupt data, or only a warning
        return False
    sx, sy = decoded_scale(width, height, array.shape[1], array.shape[0])  # M/8 exactly, not the sizes' ratio
    box = (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)
    rgbx_into(slot, array, array.shape[1], array.shape[0], box, flip, affine)
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
    decoder = region_decoder() if spec.decoder == "region" else None
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
        failures += region_many(decoder, slots, items, batch, spec, flips, affine)
    return sorted(failures)


def image_size(extension: str, data: bytes) -> tuple[int, int]:
    """(width, height) of a sample's image from its header, as the decoders plan its crop (no EXIF turn).

    Raises:
        DecodeError: the header does not read.
    """
    try:
        if extension == "npy":
            array = npy_pixels(data)
            return array.shape[1], array.shape[0]
        if extension in ("jpg", "jpeg") and simplejpeg is not None:
            with contextlib.suppress(ValueError):
                height, width, _, _ = simplejpeg.decode_jpeg_header(data)
                return width, height
        return open_image(data).size
    except DecodeError:
        raise
    except DATA_ERRORS as exc:
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
                placement = place(crop_randomness(seed, spec, None), *image_size(extension, data), spec)
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
    decoder = region_decoder() if spec.decoder == "region" else None
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
        failures += region_many(decoder, views, items, batch, spec, flips, affine, [boxes[i] for i in batch])
    return sorted(failures)


def _fill(slot: np.ndarray, value: int, affine: Affine | None) -> None:
    """Every pixel of the slot at `value` (0-255), normalised like the pixels when the slot is float."""
    if slot.dtype == np.uint8:
        slot[...] = value
        return
    assert affine is not None
    shape = (3, 1, 1) if is_planar(slot) else (3,)
    slot[...] = value * affine.scale.reshape(shape) + affine.shift.reshape(shape)
