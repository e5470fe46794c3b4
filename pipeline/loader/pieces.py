"""A decode worker's piece of a batch: its pixels into a ring slot (or the CPU device's output), a task's targets.

The decode pool (`workers.py`) hands each batch to its workers in pieces, one
per worker; a piece is `decode_chunk` (the pixels), or `decode_task_chunk`
(the pixels, then each sample's targets) for a task. Process workers find
the ring in `_SHARED_RING`, set before the fork (`share_ring`), so no pixels
go through pipes. On a CPU device a piece also runs each image's
ColorJitter (`jitter`: the batch's draws by position, `device.py`) as soon
as its uint8 pixels are in place: after its flip and the user's
sample_transform, before the CPU finish normalises it into the output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..augment.color import Draw, jitter_image
from ..errors import DecodeError
from ..targets import TargetError
from .cpu_decode import decode_many
from .crops import Affine, CropSpec
from .damage import Extras, Item
from .hooks import run_sample_transform
from .mosaic_piece import MOSAIC_PLAN, PieceMemo, mosaic_decoder, mosaic_into, write_slot, yolo_recipe, yolo_sample
from .placement import Placement
from .tasks import TaskPlan, placement_of, sample_targets

_SHARED_RING: np.ndarray | None = None  # set before forking process workers

Jitter = tuple[Draw, ...]  # a batch's ColorJitter draws by position, run by the workers on a CPU device


def share_ring(ring: np.ndarray) -> None:
    """The ring process workers decode into: forked workers inherit it, pieces name only the slot."""
    global _SHARED_RING
    _SHARED_RING = ring


@dataclasses.dataclass
class CpuFinish:
    """The device side, done by the decode threads as they write each image.

    On a CPU device there is no device to overlap with: the decoder writes
    each image straight into the batch's output tensor, mirrored when its
    flip says so, converted and normalised in the same write (or as uint8).
    """

    out: np.ndarray  # view of the batch's NCHW (or channels-last) output, float32 or uint8
    flips: np.ndarray | None
    affine: Affine | None  # (1/std, -mean/std) per channel in 0-255 units; None for uint8

    def flip(self, position: int) -> bool:
        return self.flips is not None and bool(self.flips[position])


def jitter_pixels(pixels: np.ndarray, position: int, jitter: Jitter, finish: CpuFinish | None = None) -> None:
    """Position `position`'s ColorJitter on its uint8 [3, S, S] pixels, in place; with `finish`, then stored
    into the CPU device's output (normalised there)."""
    image = torch.from_numpy(pixels)
    image.copy_(jitter_image(image, jitter[position]))
    if finish is not None:
        write_slot(pixels, finish.out[position], finish.affine)


def decode_chunk(
    ring: np.ndarray | None,
    slot: int,
    start: int,
    items: list[tuple[str, bytes, int]],
    crop: CropSpec,
    finish: CpuFinish | None = None,
    placements: list[Placement | None] | None = None,
    jitter: Jitter | None = None,
) -> list[tuple[int, str]]:
    """Decode items into ring[slot, start:...] (or the finished output); returns (position, reason) of failures.

    With `jitter`, each image that decoded is jittered (`jitter_pixels`): in its ring slot, or first
    decoded as uint8 (mirrored where its flip says), jittered, then stored into the finished output.
    """
    target = ring if ring is not None else _SHARED_RING
    assert target is not None
    positions = range(start, start + len(items))
    if jitter is not None:
        failures = decode_jittered(target[slot], positions, items, crop, finish, placements, jitter)
    elif finish is None:
        failures = decode_many([target[slot, p] for p in positions], items, crop, placements=placements)
    else:
        slots = [finish.out[p] for p in positions]
        flips = [finish.flip(p) for p in positions]
        failures = decode_many(slots, items, crop, flips=flips, affine=finish.affine, placements=placements)
    return [(start + index, reason) for index, reason in failures]


def decode_jittered(
    batch: np.ndarray,
    positions: range,
    items: list[tuple[str, bytes, int]],
    crop: CropSpec,
    finish: CpuFinish | None,
    placements: list[Placement | None] | None,
    jitter: Jitter,
) -> list[tuple[int, str]]:
    """`decode_chunk` with ColorJitter: each image's uint8 pixels (in its ring slot of `batch`, or in a
    scratch slot, mirrored where its flip says), jittered, and stored into the finished output if any."""
    if finish is None:
        slots = [batch[position] for position in positions]
        failures = decode_many(slots, items, crop, placements=placements)
    else:
        slots = list(np.empty((len(items), 3, crop.size, crop.size), np.uint8))
        flips = [finish.flip(position) for position in positions]
        failures = decode_many(slots, items, crop, flips=flips, placements=placements)
    failed = {index for index, _ in failures}
    for index, position in enumerate(positions):
        if index not in failed:
            jitter_pixels(slots[index], position, jitter, finish)
    return failures


@dataclasses.dataclass(frozen=True)
class TaskWork:
    """What a decode piece of a task's batch needs besides its pixels: each sample's kept members, key and flip.

    `pixels` False: the pixels are decoded elsewhere (on the GPU), the piece works out the targets only.
    """

    plan: TaskPlan
    extras: list[Extras]
    keys: list[str]
    flips: list[bool]
    pixels: bool = True


@dataclasses.dataclass
class PieceResult:
    """A task's decode piece: (position, reason) of the samples that failed, the targets of the others by position."""

    failures: list[tuple[int, str]]
    targets: dict[int, dict[str, Any]]


def sample_task(
    plan: TaskPlan,
    pixels: np.ndarray | None,
    item: Item,
    extras: Extras,
    key: str,
    flip: bool,
    crop: CropSpec,
    placement: Placement | None = None,
) -> dict[str, Any]:
    """One decoded sample's targets; with a sample_transform, the sample (flipped here) through it, in place.

    Raises:
        TargetError, DecodeError: its targets are damaged (sample damage).
    """
    targets = sample_targets(plan, item[0], item[1], item[2], extras or {}, crop, flip, placement)
    if plan.sample_transform is not None and pixels is not None:
        if flip:  # the device does not flip a batch whose samples went through the user's transform
            pixels[...] = pixels[:, :, ::-1].copy()
        run_sample_transform(plan, pixels, key, targets)
    return targets


def decode_task_chunk(
    work: TaskWork,
    ring: np.ndarray | None,
    slot: int,
    start: int,
    items: list[tuple[str, bytes, int]],
    crop: CropSpec,
    finish: CpuFinish | None = None,
    jitter: Jitter | None = None,
) -> PieceResult:
    """`decode_chunk`, then each decoded sample's targets (`sample_task`): a sample whose targets are damaged fails.

    With a detection recipe each sample's placement is worked out once, for its pixels and its targets;
    the YOLO recipe's mosaics go their own way (`mosaic_piece.py`). With `jitter`, pixels in the ring are
    jittered after their sample's sample_transform, as the device would.
    """
    if crop.mosaics:
        return _yolo_chunk(work, ring, slot, start, items, crop, finish, jitter)
    placements: list[Placement | None] | None = None
    unplaced: list[tuple[int, str]] = []
    if crop.recipe != "crop":
        placements = []
        for offset, (extension, data, seed) in enumerate(items):
            try:
                placements.append(placement_of(work.plan, extension, data, seed, work.extras[offset] or {}, crop))
            except (TargetError, DecodeError) as exc:
                placements.append(None)
                unplaced.append((start + offset, str(exc)))
    finished_jitter = jitter if finish is not None else None  # else in the ring, after each sample's targets
    failures = decode_chunk(ring, slot, start, items, crop, finish, placements, finished_jitter) if work.pixels else []
    failed = {position for position, _ in failures}
    failures += [failure for failure in unplaced if failure[0] not in failed]
    bad = {position for position, _ in failures}
    target = ring if ring is not None else _SHARED_RING
    done: dict[int, dict[str, Any]] = {}
    for offset, item in enumerate(items):
        position = start + offset
        if position in bad:
            continue
        pixels = target[slot, position] if work.pixels and finish is None and target is not None else None
        placement = placements[offset] if placements is not None else None
        try:
            extras, key, flip = work.extras[offset], work.keys[offset], work.flips[offset]
            done[position] = sample_task(work.plan, pixels, item, extras, key, flip, crop, placement)
        except (TargetError, DecodeError) as exc:
            failures.append((position, str(exc)))
            continue
        if jitter is not None and pixels is not None:
            jitter_pixels(pixels, position, jitter)
    return PieceResult(sorted(failures), done)


def _yolo_chunk(
    work: TaskWork,
    ring: np.ndarray | None,
    slot: int,
    start: int,
    items: list[tuple[str, bytes, int]],
    crop: CropSpec,
    finish: CpuFinish | None,
    jitter: Jitter | None = None,
) -> PieceResult:
    """The YOLO recipe's piece: each position's mosaic of the piece's samples, rendered into its slot
    (with `jitter`: rendered as uint8, jittered, then stored)."""
    target = ring if ring is not None else _SHARED_RING
    recipe, decoder = yolo_recipe(crop), mosaic_decoder(crop)
    failures: list[tuple[int, str]] = []
    done: dict[int, dict[str, Any]] = {}
    extras = [extra or {} for extra in work.extras]
    memo = PieceMemo()  # the piece's pictures and boxes, each read once for all the mosaics showing them
    if not work.pixels:  # decoder="nvjpeg": plans only; the device decodes and renders (`gpu_mosaic.py`)
        for offset in range(len(items)):
            try:
                found = yolo_sample(work.plan, recipe, items, extras, offset, work.keys[offset], None, None, memo)
            except (TargetError, DecodeError) as exc:
                failures.append((start + offset, str(exc)))
                continue
            made, shown = found[MOSAIC_PLAN]
            found[MOSAIC_PLAN] = (made, [start + index for index in shown])  # the batch's positions
            done[start + offset] = found
        return PieceResult(sorted(failures), done)
    for offset in range(len(items)):
        position = start + offset
        if finish is not None:
            into, affine = finish.out[position], finish.affine
        else:
            assert target is not None
            into, affine = target[slot, position], None
        if jitter is not None and finish is not None:
            into, affine = np.empty((3, crop.size, crop.size), np.uint8), None
        try:
            done[position] = mosaic_into(work.plan, crop, recipe, items, extras, offset, work.keys[offset], into, affine,
                                         decoder, memo)  # fmt: skip
        except (TargetError, DecodeError) as exc:
            failures.append((position, str(exc)))
            continue
        if jitter is not None:
            jitter_pixels(into, position, jitter, finish)
    return PieceResult(sorted(failures), done)
