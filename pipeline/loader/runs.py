"""A run, one pass over an epoch: its producer thread, its queue of batches, and stopping it.

Each run has a producer thread: it reads the epoch's records (`epoch.py`),
cuts them into batches, takes a free ring slot for each (`pacing.py`) and
hands the batch to the decode pool (`workers.py`); its queue carries the
batches, in order, to the device side (`device.py`), which gives each slot
back once the batch is on the device. Thread workers are paced by a
backlog, so the producer reads only a batch ahead of what they decode.
With num_workers=0 there is neither a producer thread nor a pool: the
calling thread reads and decodes each batch when the training loop asks
for it (`InlineQueue`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch

from ..specs import LoaderSpec
from .damage import Damage, DamageLog, Donor, Report
from .epoch import Record
from .executors import failed_samples, piece_result
from .pacing import Backlog, RunSlots
from .workers import DecodePool, HostBatch

END = object()  # the last item of a run's queue

# The hook a producer calls, once its epoch is queued, to start the next one:
# a weak reference (weakref.WeakMethod) to it, so a run never keeps its loader alive.
NextEpochStarterRef = Callable[[], "Callable[[int], None] | None"]


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
    start_next_ref: NextEpochStarterRef,
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
        start_next_ref: a weak reference to the hook that starts the next epoch.
    """
    out: queue.Queue[Any] = queue.Queue(maxsize=spec.prefetch)
    run = Run(epoch, skip, records, damage, out, pool.run_slots(), threading.Event(), [])
    if pool.inline:
        run.out = InlineQueue(produce(run, pool, spec.batch_size, spec.effective_drop_last))
        return run
    run.backlog = Backlog() if spec.worker_type == "thread" else None
    arguments = (run, pool, spec.batch_size, spec.effective_drop_last, start_next_ref)
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


def _produce(run: Run, pool: DecodePool, batch_size: int, drop_last: bool, start_next_ref: NextEpochStarterRef) -> None:
    """The producer thread: records -> batches submitted to the decode workers -> run.out.

    It holds the Loader only while starting the next epoch, never while it
    waits, so a loader the program drops is collected (and its workers
    stopped) even with a pre-started epoch waiting in its queue.
    """
    assert isinstance(run.out, queue.Queue)
    try:
        for item in produce(run, pool, batch_size, drop_last):
            if not _put_unless_stopped(run.out, item, run.stop):
                if isinstance(item, HostBatch):
                    run.unqueued.append(item)
                return
            if isinstance(item, HostBatch):
                time.sleep(0)  # let go of the GIL: the decode threads start on this batch now, not at the next switch
        if not _put_unless_stopped(run.out, END, run.stop):
            return
        start_next = start_next_ref()
        if start_next is not None and not run.stop.is_set():
            start_next(run.epoch + 1)
        del start_next
    except BaseException as exc:  # surfaced in the training loop, never lost in a thread
        _put_unless_stopped(run.out, exc, run.stop)


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


def _put_unless_stopped(target: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put `item` into `target`, waiting as long as it is full and `stop` is not set; whether it went in."""
    while not stop.is_set():
        try:
            target.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
