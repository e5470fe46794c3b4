"""Source bytes handed from the parent to its forked workers through shared memory, not the pool's pipe.

With a remote SRC the parent downloads a chunk's files and a worker decodes
them. Sent through the process pool, every file is copied into a pickle,
written through a pipe 64 KiB at a time, read back and unpickled: four
copies and hundreds of system calls per chunk, on the parent's one
process. An `Arena` is one shared anonymous mapping made before the workers
fork, so they all see it: the parent copies a file's bytes into it once
(`put` gives a `Handoff`, a few bytes to pickle), the worker copies them out
once (`take`), and the parent frees the range when the chunk's outcomes are
back (`free`).

The arena is a fixed size; a file that does not fit (the arena full, or the
file bigger than it) goes through the pipe as before. Nothing is lost either
way: the arena only changes how the bytes travel.
"""

from __future__ import annotations

import bisect
import dataclasses
import mmap
import threading

ALIGN = 64  # ranges start on cache lines


@dataclasses.dataclass(frozen=True)
class Handoff:
    """Where one file's bytes wait in the arena: what a task carries instead of them."""

    offset: int
    size: int


class Arena:
    """A shared mapping of `size` bytes and a first-fit allocator of its ranges (the parent's side).

    Args:
        size: bytes of the mapping; memory is taken only as ranges are first written.

    Raises:
        OSError: the system refuses the mapping (strict overcommit, a limit on address space).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        # no swap reserved up front: pages are taken as ranges are written, as many as are in flight
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_NORESERVE", 0))
        self._lock = threading.Lock()
        self._starts = [0]  # free ranges, sorted by start, never touching one another
        self._ends = [size]

    def put(self, data: bytes) -> Handoff | None:
        """Copy `data` into a free range; None when none is large enough (send the bytes themselves)."""
        handoff = self.reserve(len(data))
        if handoff is not None:
            self._map[handoff.offset : handoff.offset + handoff.size] = data
        return handoff

    def reserve(self, size: int) -> Handoff | None:
        """A free range of `size` bytes, to be written through `view`; None when none is large enough."""
        want = _span(size)
        with self._lock:
            found = next((i for i, (a, b) in enumerate(zip(self._starts, self._ends)) if b - a >= want), None)
            if found is None:
                return None
            start = self._starts[found]
            if self._ends[found] - start == want:
                del self._starts[found], self._ends[found]
            else:
                self._starts[found] = start + want
        return Handoff(start, size)

    def view(self, handoff: Handoff) -> memoryview:
        """A writable view of a reserved range (released by its user before the arena closes)."""
        return memoryview(self._map)[handoff.offset : handoff.offset + handoff.size]

    def take(self, handoff: Handoff) -> bytes:
        """The bytes of a range (in a worker); the parent frees it later."""
        return self._map[handoff.offset : handoff.offset + handoff.size]

    def free(self, handoff: Handoff) -> None:
        """Give a range back (the parent, once the worker that took it has answered)."""
        start = handoff.offset
        end = start + _span(handoff.size)
        with self._lock:
            at = bisect.bisect(self._starts, start)
            if at and self._ends[at - 1] > start or at < len(self._starts) and self._starts[at] < end:
                raise ValueError(f"range {start}..{end} of the arena is free already")
            joins_before = at > 0 and self._ends[at - 1] == start
            joins_after = at < len(self._starts) and self._starts[at] == end
            if joins_before and joins_after:
                self._ends[at - 1] = self._ends[at]
                del self._starts[at], self._ends[at]
            elif joins_before:
                self._ends[at - 1] = end
            elif joins_after:
                self._starts[at] = start
            else:
                self._starts.insert(at, start)
                self._ends.insert(at, end)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(b - a for a, b in zip(self._starts, self._ends))

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view still held (a read abandoned mid-answer): the mapping goes with the last one
            pass


def _span(size: int) -> int:
    """The bytes of the arena a range of `size` bytes takes: whole cache lines, at least one."""
    return max(ALIGN, -(-size // ALIGN) * ALIGN)
