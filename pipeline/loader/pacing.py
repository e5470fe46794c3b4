"""What paces a run: the ring's free slots it holds (`RunSlots`) and the decode pieces not yet started (`Backlog`)."""

from __future__ import annotations

import queue
import threading


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
        slot = _take_unless_stopped(self._pool, stop)
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


def _take_unless_stopped(source: queue.Queue[int], stop: threading.Event) -> int | None:
    while not stop.is_set():
        try:
            return source.get(timeout=0.1)
        except queue.Empty:
            continue
    return None
