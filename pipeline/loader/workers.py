"""The decode pool: the ring of uint8 batch slots and the workers that decode into it.

A loader owns a ring of preallocated uint8 NCHW batch buffers (pinned on
CUDA with thread workers, in shared memory with process workers) and a pool
of decode workers (`executors.py`). A run's producer (`runs.py`) takes a
free ring slot for each batch and hands the batch to the workers here in
pieces, one per worker (`pieces.py`). A sample that did not decode is
replaced in its slot when the batch is collected (`damage.py`), so every
batch leaves here full; on a CPU device its stand-in gets its position's
ColorJitter here, as the workers gave the others.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..errors import DecodeError
from ..specs import LoaderSpec
from ..targets import TargetError
from .cpu_decode import decode_many
from .crops import CropSpec, flip_mask
from .damage import Damage, Donor, Extras, Item, Report, replace_failures
from .epoch import Record
from .executors import InlineExecutor, ProcessExecutor, failed_samples
from .mosaic_piece import stand_in_mosaic
from .pacing import Backlog, RunSlots
from .pieces import (
    CpuFinish,
    Jitter,
    TaskWork,
    decode_chunk,
    decode_jittered,
    decode_task_chunk,
    jitter_pixels,
    sample_task,
)
from .placement import Placement
from .tasks import TaskPlan, placement_of


def _run_piece(backlog: Backlog, decode: Callable[..., Any], *args: Any) -> Any:
    backlog.started()
    return decode(*args)


@dataclasses.dataclass
class HostBatch:
    """A batch handed to the decode workers: where its pixels go and what is known of its samples."""

    epoch: int
    index: int
    slot: int
    count: int
    labels: np.ndarray
    pending: list[Any]
    keys: list[str]
    items: list[Item]
    finished: torch.Tensor | None = None  # the CPU device's output, written by the decode threads
    finish: CpuFinish | None = None  # how the decode threads write into `finished`
    extras: list[Extras] | None = None  # a task's kept members per position (its targets' bytes)
    targets: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # a task's targets by position
    flips: list[bool] | None = None  # a task's flip per position (what its targets follow)
    shards: list[str] | None = None  # the shard each position's sample was read from
    jitter: Jitter | None = None  # the ColorJitter draws the workers run (a CPU device), by position

    def donors(self, failures: list[tuple[int, str]]) -> Iterator[Donor]:
        """The batch's samples that decoded, as stand-ins for a batch behind it with none of its own."""
        bad = {position for position, _ in failures}
        for position in range(self.count):
            if position not in bad:
                extras = self.extras[position] if self.extras is not None else None
                yield self.items[position], int(self.labels[position]), self.keys[position], extras


class DecodePool:
    """The ring of uint8 batch slots and the workers that decode into it: threads, or forked processes.

    Args:
        spec: the loader's settings.
        workers: decode workers.
        slots: ring slots (batches being decoded, queued or being copied).
        crop: what each sample becomes.
        rank: this process's rank (it seeds each sample's crop).
        pin: pin the ring in page-locked memory (CUDA with thread workers).
        cpu_finish: (epoch, batch index, count) -> the batch's output tensor
            and what the decode threads write into it, or (None, None) when
            the device finishes the batch.
        plan: a task's targets (`tasks.py`): each piece works them out
            beside the pixels; None for plain classification.
        worker_jitter: (epoch, batch index, count) -> the batch's ColorJitter
            draws for the workers to run, or None (none, or on the device).
    """

    def __init__(
        self,
        spec: LoaderSpec,
        workers: int,
        slots: int,
        crop: CropSpec,
        rank: int,
        pin: bool,
        cpu_finish: Callable[[int, int, int], tuple[torch.Tensor | None, CpuFinish | None]],
        plan: TaskPlan | None = None,
        worker_jitter: Callable[[int, int, int], Jitter | None] | None = None,
    ) -> None:
        self.workers = workers
        self.plan = plan
        self._flips_on = spec.train and spec.flip and spec.recipe != "yolo"  # the yolo recipe flips in its plan
        self.inline = workers == 0  # decode in the thread that asks for the batch
        self.strict = spec.on_error == "raise"
        self._seed, self._rank = spec.seed, rank
        self._crop = crop
        self.mosaic_off_from: int | None = None  # recipe="yolo": the first epoch without the mosaic
        if spec.close_mosaic and spec.epochs is not None:
            self.mosaic_off_from = max(0, spec.epochs - spec.close_mosaic)
        self._threads = spec.worker_type == "thread"
        self._gpu_decode = spec.decoder == "nvjpeg"
        self._cpu_finish = cpu_finish
        self._worker_jitter = worker_jitter
        shape = (slots, spec.batch_size, 3, spec.crop, spec.crop)
        ring = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
        self._executor: Any
        if self.inline:
            self._executor = InlineExecutor()
        elif spec.worker_type == "process":
            ring.share_memory_()
            self._executor = ProcessExecutor(workers, ring.numpy())
        else:
            self._executor = ThreadPoolExecutor(workers, thread_name_prefix="gpufeed-decode")
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(slots):
            self._free.put(slot)
        self.ring = ring

    def run_slots(self) -> RunSlots:
        """A new run's view of the ring's free slots."""
        return RunSlots(self._free)

    def crop_for(self, epoch: int) -> CropSpec:
        """What each sample of `epoch` becomes: the crop, less the mosaic from `mosaic_off_from` on."""
        if self.mosaic_off_from is not None and epoch >= self.mosaic_off_from:
            return dataclasses.replace(self._crop, mosaic=False)
        return self._crop

    def _sample_seed(self, epoch: int, ordinal: int) -> int:
        return (self._seed * 0x9E3779B97F4A7C15 ^ (epoch << 40) ^ (self._rank << 32) ^ ordinal) & (2**64 - 1)

    def submit(
        self, index: int, slot: int, chunk: list[Record], epoch: int, backlog: Backlog | None = None
    ) -> HostBatch:
        """Hand batch `index` of `epoch` to the workers, one piece per worker, decoding into ring slot `slot`."""
        ring = self.ring.numpy() if self._threads else None
        items = [(r.extension, r.data, self._sample_seed(epoch, r.ordinal)) for r in chunk]
        per_worker = max(1, math.ceil(len(items) / max(1, self.workers)))
        finished, finish = self._cpu_finish(epoch, index, len(items))
        keys = [r.key for r in chunk]
        extras = [r.extras for r in chunk] if self.plan is not None else None
        flips = self._task_flips(epoch, index, len(items)) if self.plan is not None else None
        jitter = self._worker_jitter(epoch, index, len(items)) if self._worker_jitter is not None else None
        pending = []
        pixels = not self._gpu_decode
        crop = self.crop_for(epoch)
        for start in range(0, len(items) if pixels or self.plan is not None else 0, per_worker):
            stop = start + per_worker
            decode: Callable[..., Any] = decode_chunk
            if self.plan is not None:
                assert extras is not None and flips is not None
                work = TaskWork(self.plan, extras[start:stop], keys[start:stop], flips[start:stop], pixels)
                decode = functools.partial(decode_task_chunk, work)
            if jitter is not None:
                decode = functools.partial(decode, jitter=jitter)
            if backlog is not None:
                backlog.add(1)
                decode = functools.partial(_run_piece, backlog, decode)
            pending.append(self._executor.submit(decode, ring, slot, start, items[start:stop], crop, finish))
        labels = np.array([r.label for r in chunk], dtype=np.int64)
        batch = HostBatch(epoch, index, slot, len(chunk), labels, pending, keys, items, finished, finish)
        batch.extras, batch.flips, batch.shards = extras, flips, [r.shard for r in chunk]
        batch.jitter = jitter
        return batch

    def _task_flips(self, epoch: int, index: int, count: int) -> list[bool]:
        """Each position's flip, as the device (or the CPU finish) mirrors its pixels: what its targets follow."""
        if not self._flips_on:
            return [False] * count
        return [bool(flip) for flip in flip_mask(self._seed, epoch, self._rank, index, count)]

    def collect(self, batch: HostBatch, report: Report, later: Iterable[Donor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the batch's pieces: its pixels in the ring (or its finished output) and its labels.

        A sample that could not be decoded is replaced in place by another
        (`damage.py`) and reported through `report`; with on_error="raise"
        the first one raises instead.

        Args:
            batch: the batch handed to the workers.
            report: receives a Damage per replaced sample.
            later: samples of the batches behind this one (for a batch none of whose samples decodes).

        Raises:
            SampleError: on_error="raise" and a sample did not decode, or nothing could replace it.
        """
        failures = failed_samples(batch)
        if failures:
            self.replace(batch, failures, report, later, self._redecode(batch))
        return self.ring[batch.slot, : batch.count], torch.from_numpy(batch.labels)

    def replace(
        self,
        batch: HostBatch,
        failures: list[tuple[int, str]],
        report: Report,
        later: Iterable[Donor],
        decode_at: Callable[[int, Item, Extras], bool],
    ) -> None:
        """The error policy for samples of `batch` that did not decode: raise, or fill their positions."""
        if self.strict:
            position, reason = failures[0]
            key, shard = batch.keys[position], batch.shards[position] if batch.shards else ""
            where = f" of {shard}" if shard else ""
            raise Damage(f"sample {key}{where}: {reason}", lost=1, sample=key, reason=reason, source=shard).error()
        rng = np.random.default_rng([self._seed, batch.epoch, self._rank, batch.index, 0xD0])
        decode_at = self._jittered(batch, self._with_targets(batch, decode_at))
        replaced = replace_failures(failures, batch.items, batch.labels, batch.keys, decode_at, rng, later, batch.extras)
        for damage in replaced:
            report(damage)

    def _with_targets(
        self, batch: HostBatch, decode_at: Callable[[int, Item, Extras], bool]
    ) -> Callable[[int, Item, Extras], bool]:
        """For a task: a stand-in decodes only when its targets do too, and they take the position's."""
        plan = self.plan
        if plan is None or self._crop.mosaics:  # the mosaic's decode sets its targets
            return decode_at
        ring = self.ring.numpy()

        def with_targets(position: int, item: Item, extras: Extras) -> bool:
            if not decode_at(position, item, extras):
                return False
            flip = batch.flips[position] if batch.flips is not None else False
            pixels = ring[batch.slot, position] if batch.finish is None and not self._gpu_decode else None
            try:
                batch.targets[position] = sample_task(plan, pixels, item, extras, batch.keys[position], flip, self._crop)
            except (TargetError, DecodeError):
                return False
            return True

        return with_targets

    def _jittered(
        self, batch: HostBatch, decode_at: Callable[[int, Item, Extras], bool]
    ) -> Callable[[int, Item, Extras], bool]:
        """A stand-in in the ring gets its position's ColorJitter once it decoded (and its targets did).

        Into the finished output, `decode_at` jitters before it normalises (`_redecode`, `_mosaic_stand_in`).
        """
        jitter = batch.jitter
        if jitter is None or batch.finish is not None:
            return decode_at
        ring = self.ring.numpy()

        def jittered(position: int, item: Item, extras: Extras) -> bool:
            if not decode_at(position, item, extras):
                return False
            jitter_pixels(ring[batch.slot, position], position, jitter)
            return True

        return jittered

    def _redecode(self, batch: HostBatch) -> Callable[[int, Item, Extras], bool]:
        """Decode one item into a position of the batch, where the workers would have: True when it decoded."""
        finish = batch.finish
        ring = self.ring.numpy()
        if self._crop.mosaics and self.plan is not None:
            return self._mosaic_stand_in(batch)

        def decode_at(position: int, item: Item, extras: Extras = None) -> bool:
            placements: list[Placement | None] | None = None
            if self._crop.recipe == "iou_crop":  # its crop depends on the stand-in's boxes
                try:
                    placements = [placement_of(self.plan, item[0], item[1], item[2], extras or {}, self._crop)]
                except (TargetError, DecodeError):
                    return False
            if finish is None:
                return not decode_many([ring[batch.slot, position]], [item], self._crop, placements=placements)
            if batch.jitter is not None:
                at = range(position, position + 1)
                return not decode_jittered(ring[batch.slot], at, [item], self._crop, finish, placements, batch.jitter)
            slot, flip = finish.out[position], finish.flip(position)
            return not decode_many([slot], [item], self._crop, flips=[flip], affine=finish.affine, placements=placements)

        return decode_at

    def _mosaic_stand_in(self, batch: HostBatch) -> Callable[[int, Item, Extras], bool]:
        """The YOLO recipe's stand-in: a mosaic of the stand-in alone (its own partners), pixels and targets."""
        assert self.plan is not None
        plan, crop, finish, ring = self.plan, self.crop_for(batch.epoch), batch.finish, self.ring.numpy()

        def decode_at(position: int, item: Item, extras: Extras = None) -> bool:
            into = finish.out[position] if finish is not None else ring[batch.slot, position]
            affine = finish.affine if finish is not None else None
            jitter = batch.jitter if finish is not None else None  # in the ring: `_jittered`
            if jitter is not None:
                into, affine = np.empty((3, crop.size, crop.size), np.uint8), None
            targets = stand_in_mosaic(plan, crop, item, extras, batch.keys[position], into, affine)
            if targets is None:
                return False
            batch.targets[position] = targets
            if jitter is not None:
                jitter_pixels(into, position, jitter, finish)
            return True

        return decode_at

    def shutdown(self) -> None:
        self._executor.shutdown()
