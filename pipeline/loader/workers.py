"""The host side of a run: the ring of batch slots, the producer thread and the decode pool.

A loader owns a ring of preallocated uint8 NCHW batch buffers (pinned on
CUDA with thread workers, in shared memory with process workers) and a pool
of decode workers. Each run (one pass over an epoch) has a producer thread:
it reads the epoch's records (`epoch.py`), cuts them into batches, takes a
free ring slot for each and hands the batch to the workers in pieces, one
per worker; its queue carries the batches, in order, to the device side
(`device.py`), which gives each slot back once the batch is on the device.
Thread workers (the default: the decoders release the GIL) are paced by a
backlog; process workers are a fork pool writing into the shared ring, so
no pixels go through pipes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..specs import LoaderSpec
from .cpu_decode import decode_many
from .crops import Affine, CropSpec
from .epoch import Record

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
) -> list[tuple[int, str]]:
    """Decode items into ring[slot, start:...] (or the finished output); returns (position, reason) of failures."""
    target = ring if ring is not None else _SHARED_RING
    assert target is not None
    positions = range(start, start + len(items))
    if finish is None:
        failures = decode_many([target[slot, p] for p in positions], items, crop)
    else:
        slots = [finish.out[p] for p in positions]
        failures = decode_many(slots, items, crop, flips=[finish.flip(p) for p in positions], affine=finish.affine)
    return [(start + index, reason) for index, reason in failures]


class ProcessExecutor:
    """A fork pool whose workers decode into the shared ring (no pixels through pipes)."""

    def __init__(self, workers: int, ring: np.ndarray) -> None:
        import multiprocessing

        global _SHARED_RING
        _SHARED_RING = ring
        self._pool = multiprocessing.get_context("fork").Pool(workers)

    def submit(self, func: Any, ring: Any, slot: int, start: int, items: Any, crop: CropSpec, finish: Any) -> Any:
        return self._pool.apply_async(func, (None, slot, start, items, crop))

    def shutdown(self) -> None:
        self._pool.terminate()
        self._pool.join()


def piece_result(pending: Any) -> Any:
    """Wait for a batch piece handed to the workers (a thread's Future or a process's AsyncResult)."""
    return pending.result() if isinstance(pending, Future) else pending.get()


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


def _run_piece(backlog: Backlog, *args: Any) -> list[tuple[int, str]]:
    backlog.started()
    return decode_chunk(*args)


@dataclasses.dataclass
class HostBatch:
    """A batch handed to the decode workers: where its pixels go and what is known of its samples."""

    index: int
    slot: int
    count: int
    labels: np.ndarray
    pending: list[Any]
    keys: list[str]
    items: list[tuple[str, bytes, int]]
    finished: torch.Tensor | None = None  # the CPU device's output, written by the decode threads


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
    ) -> None:
        self.workers = workers
        self._seed, self._rank = spec.seed, rank
        self._crop = crop
        self._threads = spec.worker_type == "thread"
        self._gpu_decode = spec.decoder == "nvjpeg"
        self._cpu_finish = cpu_finish
        shape = (slots, spec.batch_size, 3, spec.crop, spec.crop)
        ring = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
        self._executor: Any
        if spec.worker_type == "process":
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
        per_worker = max(1, math.ceil(len(items) / self.workers))
        finished, finish = self._cpu_finish(epoch, index, len(items))
        pending = []
        decode = decode_chunk if backlog is None else functools.partial(_run_piece, backlog)
        for start in range(0, 0 if self._gpu_decode else len(items), per_worker):
            if backlog is not None:
                backlog.add(1)
            piece = items[start : start + per_worker]
            pending.append(self._executor.submit(decode, ring, slot, start, piece, self._crop, finish))
        labels = np.array([r.label for r in chunk], dtype=np.int64)
        keys = [r.key for r in chunk]
        return HostBatch(index, slot, len(chunk), labels, pending, keys, items, finished)

    def collect(
        self, batch: HostBatch, warn: Callable[[str], None]
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None]:
        """Wait for the batch's pieces: its pixels in the ring, its labels, and which positions to keep.

        Each sample that could not be decoded is reported through `warn` and
        left out; `keep` is None when every sample decoded.
        """
        failures = [failure for pending in batch.pending for failure in piece_result(pending)]
        images = self.ring[batch.slot, : batch.count]
        labels = torch.from_numpy(batch.labels)
        keep = None
        if failures:
            bad = {position for position, _ in failures}
            for position, reason in failures:
                warn(f"skipping sample {batch.keys[position]}: {reason}")
            keep = np.array([i for i in range(batch.count) if i not in bad], dtype=np.int64)
            images = images[torch.from_numpy(keep)]
            labels = labels[torch.from_numpy(keep)]
        return images, labels, keep

    def shutdown(self) -> None:
        self._executor.shutdown()


@dataclasses.dataclass(eq=False)
class Run:
    """One pass over an epoch: its producer thread, queues and in-flight decodes."""

    epoch: int
    skip: int
    records: Iterator[Record]
    errors: list[str]  # what `records` skipped, not yet reported
    out: queue.Queue[Any]
    free: RunSlots
    stop: threading.Event
    inflight: list[Any]
    producer: threading.Thread | None = None
    backlog: Backlog | None = None  # thread workers only

    def matches(self, epoch: int, skip: int) -> bool:
        return self.epoch == epoch and self.skip == skip


def new_run(
    epoch: int,
    skip: int,
    records: Iterator[Record],
    errors: list[str],
    pool: DecodePool,
    spec: LoaderSpec,
    prestart: Prestart,
) -> Run:
    """A run over `records` (skipping `skip` batches) and its producer thread, not yet started.

    Args:
        epoch: the epoch the records belong to.
        skip: batches already delivered (resume): replayed, not decoded.
        records: the epoch's records in order; `errors` receives what they skip.
        errors: the list `records` appends its messages to.
        pool: the decode pool and ring the run uses.
        spec: the loader's settings (batch size, drop_last, queue depth, worker type).
        prestart: a weak reference to the hook that starts the next epoch.
    """
    out: queue.Queue[Any] = queue.Queue(maxsize=spec.prefetch)
    run = Run(epoch, skip, records, errors, out, pool.run_slots(), threading.Event(), [])
    run.backlog = Backlog() if spec.worker_type == "thread" else None
    arguments = (run, pool, spec.batch_size, spec.effective_drop_last, prestart)
    run.producer = threading.Thread(target=_produce, args=arguments, daemon=True)
    return run


def _produce(run: Run, pool: DecodePool, batch_size: int, drop_last: bool, prestart: Prestart) -> None:
    """The producer thread: records -> batches submitted to the decode workers -> run.out.

    It holds the Loader only while starting the next epoch, never while it
    waits, so a loader the program drops is collected (and its workers
    stopped) even with a pre-started epoch waiting in its queue.
    """
    errors = run.errors
    try:
        records = run.records
        for _ in range(run.skip * batch_size):  # resume: replay the order without decoding
            if next(records, None) is None:
                break
        index = run.skip
        while not run.stop.is_set():
            if run.backlog is not None:
                run.backlog.wait_below(pool.workers, run.stop)
            chunk = [r for _, r in zip(range(batch_size), records)]
            _flush_errors(errors, run)
            if not chunk or (len(chunk) < batch_size and drop_last):
                break
            slot = run.free.get(run.stop)
            if slot is None:
                return
            batch = pool.submit(index, slot, chunk, run.epoch, run.backlog)
            run.inflight.extend(batch.pending)
            _put(run.out, batch, run.stop)
            time.sleep(0)  # let go of the GIL: the decode threads start on this batch now, not at the next switch
            index += 1
        _flush_errors(errors, run)
        _put(run.out, END, run.stop)
        start_next = prestart()
        if start_next is not None and not run.stop.is_set():
            start_next(run.epoch + 1)
        del start_next
    except BaseException as exc:  # surfaced in the training loop, never lost in a thread
        _put(run.out, exc, run.stop)


def _flush_errors(errors: list[str], run: Run) -> None:
    while errors:
        _put(run.out, ("error", errors.pop(0)), run.stop)


def next_batch(out: queue.Queue[Any], warn: Callable[[str], None]) -> HostBatch | None:
    """The run's next batch from its producer, None at the end; a producer's error is raised here.

    Messages about skipped shard parts and samples on the way go to `warn`.
    """
    while True:
        item = out.get()
        if item is END:
            return None
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, tuple):
            warn(item[1])
            continue
        return item


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


def _put(target: queue.Queue[Any], item: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            target.put(item, timeout=0.1)
            return
        except queue.Full:
            continue
