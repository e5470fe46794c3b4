"""The region decoder (gpufeed's libjpeg-turbo in `pipeline.native`) over the JPEGs of a batch piece.

One C call reads their headers, plans their crops, decodes only the crops'
rows and iMCU columns and resizes them into the slots (`_crop_many`), when
the slots share one layout and C resizes like the PIL in use; else C
decodes the regions and Pillow resizes them. A sample the C call hands back
(CMYK, or any libjpeg warning or error) goes to Pillow, whose verdict
stands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from .. import native
from ..errors import DecodeError
from .crops import (
    SEED_MASK,
    Affine,
    CropSpec,
    check_pixels,
    plan_numbers,
    region_plan,
    slot_size,
)
from .slot_pixels import DATA_ERRORS, crop_randomness, decode_buffer, pil_into, resample_mode, rgbx_into


def region_many(
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
        rng = crop_randomness(items[batch[k]][2], spec, given[k])
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
    buffer = decode_buffer(int(sizes.sum()) + 64 * count)
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
            rgbx_into(slots[index], rows, int(decoded[k, 1]), int(params[k, 4]), relative, flips[index], affine)
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
    except DATA_ERRORS as exc:
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
    pil_into(slot, data, crop_randomness(seed, spec, box), spec, flip, affine)


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


def _same_layout(slots: list[np.ndarray]) -> bool:
    first = slots[0]
    return all(s.shape == first.shape and s.strides == first.strides and s.dtype == first.dtype for s in slots)
