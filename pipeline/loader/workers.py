"""The host side of a run: the ring of batch slots, the producer thread and the decode pool.

A loader owns a ring of preallocated uint8 NCHW batch buffers (pinned on
CUDA with thread workers, in shared memory with process workers) and a pool
of decode workers. Each run (one pass over an epoch) has a producer thread:
it reads the epoch's records (`epoch.py`), cuts them into batches, takes a
free ring slot for each and hands the batch to the workers in pieces, one
per worker; its queue carries the batches, in order, to the device side
(`device.py`), which gives each slot back once the batch is on the device.
A sample that did not decode is replaced in its slot when the batch is
collected (`damage.py`), so every batch leaves here full.
Thread workers (the default: the decoders release the GIL) are paced by a
backlog; process workers are a fork pool writing into the shared ring, so
no pixels go through pipes. They ignore Ctrl-C: it is the training loop's
to handle, and the loader stops them when it stops. With num_workers=0
there is neither a producer thread nor a pool: the calling thread reads
and decodes each batch when the training loop asks for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import queue
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..errors import DecodeError
from ..specs import LoaderSpec
from ..targets import TargetError
from .cpu_decode import decode_many
from .crops import Affine, CropSpec, flip_mask
from .damage import Damage, DamageLog, Donor, Extras, Item, Report, replace_failures
from .epoch import Record
from .placement import Placement
from .tasks import TaskPlan, placement_of, run_sample_transform, sample_targets

END = object()  # the last item of a run's queue
_SHARED_RING: np.ndarray | None = None  # set before forking process workers

# The hook a producer calls, once its epoch is queued, to start the next one:
# a weak reference (weakref.WeakMethod) to it, so a run never keeps its loader alive.
Prestart = Callable[[], "Callable[[int], None] | None"]


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


def decode_chunk(
    ring: np.ndarray | None,
    slot: int,
    start: int,
    items: list[tuple[str, bytes, int]],
    crop: CropSpec,
    finish: CpuFinish | None = None,
    placements: list[Placement | None] | None = None,
) -> list[tuple[int, str]]:
    """Decode items into ring[slot, start:...] (or the finished output); returns (position, reason) of failures."""
    target = ring if ring is not None else _SHARED_RING
    assert target is not None
    positions = range(start, start + len(items))
    if finish is None:
        failures = decode_many([target[slot, p] for p in positions], items, crop, placements=placements)
    else:
        slots = [finish.out[p] for p in positions]
        flips = [finish.flip(p) for p in positions]
        failures = decode_many(slots, items, crop, flips=flips, affine=finish.affine, placements=placements)
    return [(start + index, reason) for index, reason in failures]


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
) -> PieceResult:
    """`decode_chunk`, then each decoded sample's targets (`sample_task`): a sample whose targets are damaged fails.

    With a detection recipe each sample's placement is worked out once, for its pixels and its targets.
    """
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
    failures = decode_chunk(ring, slot, start, items, crop, finish, placements) if work.pixels else []
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
    return PieceResult(sorted(failures), done)


class InlineExecutor:
    """num_workers=0: each piece is decoded at once, in the thread that hands it out."""

    def submit(self, func: Any, *args: Any) -> Future[Any]:
        done: Future[Any] = Future()
        try:
            done.set_result(func(*args))
        except Exception as exc:  # raised where the batch is collected, as a worker thread's would be
            done.set_exception(exc)
        return done

    def shutdown(self) -> None:
        pass


def _ignore_interrupts() -> None:
    """In each process worker: Ctrl-C is for the training loop, which stops the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class ProcessExecutor:
    """A fork pool whose workers decode into the shared ring (no pixels through pipes).

    A terminal's Ctrl-C signals every process of the foreground group. The
    workers ignore it, so they finish the piece in hand instead of dying
    with a traceback each (and with the results the loader waits for);
    SIGINT stays blocked from the fork until each has said so, and in the
    pool's own threads, which fork the replacements.
    """

    def __init__(self, workers: int, ring: np.ndarray) -> None:
        import multiprocessing

        global _SHARED_RING
        _SHARED_RING = ring
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._pool = multiprocessing.get_context("fork").Pool(workers, initializer=_ignore_interrupts)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def submit(self, func: Any, ring: Any, slot: int, start: int, items: Any, crop: CropSpec, finish: Any) -> Any:
        return self._pool.apply_async(func, (None, slot, start, items, crop))

    def shutdown(self) -> None:
        self._pool.terminate()
        self._pool.join()


def piece_result(pending: Any) -> Any:
    """Wait for a batch piece handed to the workers (a thread's Future or a process's AsyncResult)."""
    return pending.result() if isinstance(pending, Future) else pending.get()


def failed_samples(batch: Any) -> list[tuple[int, str]]:
    """Wait for the batch's pieces: (position, reason) of each sample that did not decode.

    A task's pieces also bring each decoded sample's targets: they go into `batch.targets`.
    """
    failures: list[tuple[int, str]] = []
    for pending in batch.pending:
        result = piece_result(pending)
        if isinstance(result, PieceResult):
            batch.targets.update(result.targets)
            failures.extend(result.failures)
        else:
            failures.extend(result)
    return sorted(failures)


class RunSlots:
    """A run's view of the loader's ring slots.

    The slots are shared by every run of a loader, so the next epoch can
    start decoding into slots the current one has given back while its last
    batches are still being used. A run remembers the slots it holds and
    returns them all when it is stopped.
    """

    def __init__(self, pool: queue.Queue[int]) -> None:
        self._pool = pool
        self._held: set[int] = set()

    def get(self, stop: threading.Event) -> int | None:
        slot = _get(self._pool, stop)
        if slot is not None:
            self._held.add(slot)
        return slot

    def put(self, slot: int) -> None:
        """A batch was delivered: its slot may be refilled."""
        self._held.discard(slot)
        self._pool.put(slot)

    def release_all(self) -> None:
        while self._held:
            self._pool.put(self._held.pop())


class Backlog:
    """Batch pieces handed to the decode threads that none has started yet.

    The producer reads the next batch only while fewer than a batch's worth
    of pieces wait. Otherwise, at the start of an epoch, it reads several
    batches ahead on the same cores while the first batch is still being
    decoded, and the first batch arrives late; in steady state the decode
    threads still always find a piece waiting.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting = 0

    def add(self, count: int) -> None:
        with self._cond:
            self._waiting += count

    def started(self) -> None:
        with self._cond:
            self._waiting -= 1
            self._cond.notify_all()

    def wait_below(self, limit: int, stop: threading.Event) -> None:
        with self._cond:
            while self._waiting >= limit and not stop.is_set():
                self._cond.wait(0.1)


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
    ) -> None:
        self.workers = workers
        self.plan = plan
        self._flips_on = spec.train and spec.flip
        self.inline = workers == 0  # decode in the thread that asks for the batch
        self.strict = spec.on_error == "raise"
        self._seed, self._rank = spec.seed, rank
        self._crop = crop
        self._threads = spec.worker_type == "thread"
        self._gpu_decode = spec.decoder == "nvjpeg"
        self._cpu_finish = cpu_finish
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
        pending = []
        pixels = not self._gpu_decode
        for start in range(0, len(items) if pixels or self.plan is not None else 0, per_worker):
            stop = start + per_worker
            decode: Callable[..., Any] = decode_chunk
            if self.plan is not None:
                assert extras is not None and flips is not None
                work = TaskWork(self.plan, extras[start:stop], keys[start:stop], flips[start:stop], pixels)
                decode = functools.partial(decode_task_chunk, work)
            if backlog is not None:
                backlog.add(1)
                decode = functools.partial(_run_piece, backlog, decode)
            pending.append(self._executor.submit(decode, ring, slot, start, items[start:stop], self._crop, finish))
        labels = np.array([r.label for r in chunk], dtype=np.int64)
        batch = HostBatch(epoch, index, slot, len(chunk), labels, pending, keys, items, finished, finish)
        batch.extras, batch.flips = extras, flips
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
            key = batch.keys[position]
            raise Damage(f"sample {key}: {reason}", lost=1, sample=key, reason=reason).error()
        rng = np.random.default_rng([self._seed, batch.epoch, self._rank, batch.index, 0xD0])
        decode_at = self._with_targets(batch, decode_at)
        replaced = replace_failures(failures, batch.items, batch.labels, batch.keys, decode_at, rng, later, batch.extras)
        for damage in replaced:
            report(damage)

    def _with_targets(
        self, batch: HostBatch, decode_at: Callable[[int, Item, Extras], bool]
    ) -> Callable[[int, Item, Extras], bool]:
        """For a task: a stand-in decodes only when its targets do too, and they take the position's."""
        plan = self.plan
        if plan is None:
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

    def _redecode(self, batch: HostBatch) -> Callable[[int, Item, Extras], bool]:
        """Decode one item into a position of the batch, where the workers would have: True when it decoded."""
        finish = batch.finish
        ring = self.ring.numpy()

        def decode_at(position: int, item: Item, extras: Extras = None) -> bool:
            placements: list[Placement | None] | None = None
            if self._crop.recipe == "iou_crop":  # its crop depends on the stand-in's boxes
                try:
                    placements = [placement_of(self.plan, item[0], item[1], item[2], extras or {}, self._crop)]
                except (TargetError, DecodeError):
                    return False
            if finish is None:
                return not decode_many([ring[batch.slot, position]], [item], self._crop, placements=placements)
            slot, flip = finish.out[position], finish.flip(position)
            return not decode_many([slot], [item], self._crop, flips=[flip], affine=finish.affine, placements=placements)

        return decode_at

    def shutdown(self) -> None:
        self._executor.shutdown()


class InlineQueue:
    """A run's queue without a producer thread (num_workers=0): `get` produces the next item then and there.

    Args:
        items: the run's items in order (`produce`).
    """

    def __init__(self, items: Generator[Any, None, None]) -> None:
        self._items = items
        self._ended = False

    def get(self) -> Any:
        """The run's next item (its batch read and decoded now), END once there is none."""
        if self._ended:
            return END
        item = next(self._items, END)
        self._ended = item is END
        return item

    def get_nowait(self) -> Any:
        raise queue.Empty  # nothing is ever made ahead

    def put_nowait(self, item: Any) -> None:
        """END: the run was stopped; it reads nothing more."""
        self._ended = True
        self._items.close()


@dataclasses.dataclass(eq=False)
class Run:
    """One pass over an epoch: its producer thread (none with num_workers=0), queues and in-flight decodes."""

    epoch: int
    skip: int
    records: Iterator[Record]
    damage: DamageLog  # what `records` met, not yet passed on
    out: queue.Queue[Any] | InlineQueue
    free: RunSlots
    stop: threading.Event
    inflight: list[Any]
    producer: threading.Thread | None = None
    backlog: Backlog | None = None  # thread workers only
    unqueued: list[HostBatch] = dataclasses.field(default_factory=list)  # submitted, then stopped before queued

    def matches(self, epoch: int, skip: int) -> bool:
        return self.epoch == epoch and self.skip == skip


def new_run(
    epoch: int,
    skip: int,
    records: Iterator[Record],
    damage: DamageLog,
    pool: DecodePool,
    spec: LoaderSpec,
    prestart: Prestart,
) -> Run:
    """A run over `records` (skipping `skip` batches) and its producer thread, not yet started.

    With num_workers=0 the run has no producer thread: its queue produces
    each batch in the calling thread when asked for it.

    Args:
        epoch: the epoch the records belong to.
        skip: batches already delivered (resume): replayed, not decoded.
        records: the epoch's records in order; `damage` receives what they met.
        damage: the log `records` reports to.
        pool: the decode pool and ring the run uses.
        spec: the loader's settings (batch size, drop_last, queue depth, worker type).
        prestart: a weak reference to the hook that starts the next epoch.
    """
    out: queue.Queue[Any] = queue.Queue(maxsize=spec.prefetch)
    run = Run(epoch, skip, records, damage, out, pool.run_slots(), threading.Event(), [])
    if pool.inline:
        run.out = InlineQueue(produce(run, pool, spec.batch_size, spec.effective_drop_last))
        return run
    run.backlog = Backlog() if spec.worker_type == "thread" else None
    arguments = (run, pool, spec.batch_size, spec.effective_drop_last, prestart)
    run.producer = threading.Thread(target=_produce, args=arguments, daemon=True)
    return run


def produce(run: Run, pool: DecodePool, batch_size: int, drop_last: bool) -> Generator[Any, None, None]:
    """The run's items in order: each batch as it is handed to the decode workers, and the damage met on the way."""
    damage = run.damage.pending
    records = run.records
    for _ in range(run.skip * batch_size):  # resume: replay the order without decoding
        if next(records, None) is None:
            break
    index = run.skip
    while not run.stop.is_set():
        if run.backlog is not None:
            run.backlog.wait_below(pool.workers, run.stop)
        chunk = [r for _, r in zip(range(batch_size), records)]
        yield from _passed_on(damage)
        if not chunk or (len(chunk) < batch_size and drop_last):
            break
        slot = run.free.get(run.stop)
        if slot is None:
            return
        batch = pool.submit(index, slot, chunk, run.epoch, run.backlog)
        run.inflight.extend(batch.pending)
        yield batch
        index += 1
    yield from _passed_on(damage)


def _passed_on(damage: list[Damage]) -> Generator[Damage, None, None]:
    while damage:
        yield damage.pop(0)


def _produce(run: Run, pool: DecodePool, batch_size: int, drop_last: bool, prestart: Prestart) -> None:
    """The producer thread: records -> batches submitted to the decode workers -> run.out.

    It holds the Loader only while starting the next epoch, never while it
    waits, so a loader the program drops is collected (and its workers
    stopped) even with a pre-started epoch waiting in its queue.
    """
    assert isinstance(run.out, queue.Queue)
    try:
        for item in produce(run, pool, batch_size, drop_last):
            if not _put(run.out, item, run.stop):
                if isinstance(item, HostBatch):
                    run.unqueued.append(item)
                return
            if isinstance(item, HostBatch):
                time.sleep(0)  # let go of the GIL: the decode threads start on this batch now, not at the next switch
        if not _put(run.out, END, run.stop):
            return
        start_next = prestart()
        if start_next is not None and not run.stop.is_set():
            start_next(run.epoch + 1)
        del start_next
    except BaseException as exc:  # surfaced in the training loop, never lost in a thread
        _put(run.out, exc, run.stop)


def next_batch(out: queue.Queue[Any] | InlineQueue, report: Report) -> HostBatch | None:
    """The run's next batch from its producer, None at the end; a producer's error is raised here.

    Damage the producer met on the way goes to `report`.
    """
    while True:
        item = out.get()
        if item is END:
            return None
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Damage):
            report(item)
            continue
        return item


class Upcoming:
    """A run's decoded batches in order, able to look at those behind the next one for stand-in samples.

    Looking ahead holds those batches' ring slots, so it stops one short of
    the ring's size: the producer always has the slot it needs.

    Args:
        out: the run's queue.
        report: receives the damage the producer passes on.
        depth: batches it may look ahead at most.
    """

    def __init__(self, out: queue.Queue[Any] | InlineQueue, report: Report, depth: int) -> None:
        self._out = out
        self._report = report
        self._depth = depth
        self._ahead: list[HostBatch] = []
        self._ended = False

    def next(self) -> HostBatch | None:
        """The next batch, None at the end of the run."""
        if self._ahead:
            return self._ahead.pop(0)
        if self._ended:
            return None
        return next_batch(self._out, self._report)

    def later(self) -> Iterator[Donor]:
        """The samples that decoded in the batches behind the one being collected, in order."""
        for depth in range(self._depth):
            if depth == len(self._ahead):
                if self._ended:
                    return
                batch = next_batch(self._out, self._report)
                if batch is None:
                    self._ended = True
                    return
                self._ahead.append(batch)
            yield from self._ahead[depth].donors(failed_samples(self._ahead[depth]))

    def close(self, release: Callable[[torch.Tensor], None]) -> None:
        """The run ends here: batches looked at and never delivered give their CPU output buffers back."""
        while self._ahead:
            batch = self._ahead.pop()
            if batch.finished is not None:
                release(batch.finished)


def stop_run(run: Run, release: Callable[[torch.Tensor], None]) -> None:
    """Stop the run's producer and wait for its decodes; give back its slots and undelivered output buffers.

    Args:
        run: the run to stop.
        release: gives back a CPU output buffer of a batch never delivered.
    """
    run.stop.set()
    if run.producer is not None and run.producer is not threading.current_thread():
        run.producer.join(timeout=30)
    for pending in run.inflight:  # no decode may still write into a slot another run reuses
        with contextlib.suppress(Exception):
            piece_result(pending)
    while True:  # batches never delivered give their output buffers back
        try:
            item = run.out.get_nowait()
        except queue.Empty:
            break
        if isinstance(item, HostBatch) and item.finished is not None:
            release(item.finished)
    for batch in run.unqueued:
        if batch.finished is not None:
            release(batch.finished)
    run.free.release_all()
    with contextlib.suppress(queue.Full):  # an iterator still holding this run ends instead of waiting
        run.out.put_nowait(END)


def _get(source: queue.Queue[int], stop: threading.Event) -> int | None:
    while not stop.is_set():
        try:
            return source.get(timeout=0.1)
        except queue.Empty:
            continue
    return None


def _put(target: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put `item` into `target`, waiting as long as it is full and `stop` is not set; whether it went in."""
    while not stop.is_set():
        try:
            target.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
