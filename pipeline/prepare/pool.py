"""The process pool a prepare runs its samples on, and how a shard is cut into pool tasks.

Workers are forked (after `sample.warm_up`, so each inherits warm codecs,
and with the parent's objects frozen out of the garbage collector's reach,
`_freeze_heap`) and get the job's spec once, at start; a task is a chunk of (index, source)
pairs and comes back as their `SampleOutcome`s. A C decoder can crash (or be
killed for memory) on a hostile file: the broken pool is replaced, and the
chunk it held is re-run one file per fresh process, so only the file that
crashes again is rejected.

When SRC is remote, `io_threads` of its files are read at once, a number
sized for the store's latency, not for cores (`reads.py`: GETs on one
thread's event loop where the S3 fast path serves the store, else a thread
pool): a store that answers in 20 ms would otherwise leave the CPUs idle
between files. With worker processes the reads run in the parent: a chunk's
files are fetched as soon as the chunk is submitted, and the chunk goes to a
worker once they are all in, its bytes left in memory the workers share
(`handoff.py`, the GETs' answers read straight into it), not pickled through
the pool's pipe. The parent keeps several chunks in flight, so while the
workers decode one, the next ones download, with no stall between chunks (a
worker reading its own chunk would wait one round trip at the start of
each). In-process (`workers=0`) a chunk's reads run on that pool while its
first files decode. Local sources are read in line, as before.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from ..io.fs import is_url
from ..specs import PrepareSpec
from ..targets import DEFAULT_IGNORE_INDEX
from .handoff import Arena, Handoff
from .reads import Fetched, SourceReads
from .sample.make import SampleOutcome, process_item, sample_key, warm_up
from .sources import SourceItem

if TYPE_CHECKING:  # concurrent.futures is imported on first use: `import pipeline` stays light
    from concurrent.futures import Future, ProcessPoolExecutor

CHUNK_ITEMS = 64  # images per pool task while many remain: few round trips through the pool
TAIL_CHUNK_ITEMS = 4  # near the end of a shard: small tasks, so no worker waits on another's last one
TERMINATE_GRACE_S = 10.0  # after an error, how long workers may take to finish the chunk in hand
IO_THREADS = 32  # reads of a remote SRC in flight per reading process: enough to hide tens of ms per request
ARENA_PER_WORKER = 64 << 20  # shared memory for the bytes read for one worker's chunks in flight (`handoff.py`)
ARENA_MAX = 2 << 30  # and no more than this, however many workers

Chunk = list[tuple[int, SourceItem]]
"""A pool task: (listing index, source) pairs."""


class PendingChunk(Protocol):
    """A submitted chunk: `result()` waits for its outcomes, in chunk order."""

    def result(self) -> list[SampleOutcome]: ...


def available_cores() -> int:
    """Cores this process may run on (cgroup/affinity aware), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def chunk_sizes(total: int, workers: int) -> list[int]:
    """How a shard's `total` images are cut into pool tasks: large while plenty remain, small at the end.

    Every task costs a round trip through the pool (pickling, a wake-up, the
    results back), so most are CHUNK_ITEMS long; but a worker handed one of
    those last would leave the others idle, so each task is at most a
    quarter of what remains per worker, down to TAIL_CHUNK_ITEMS. Without a
    pool (0 workers) nobody waits on a last task, and each task of a remote
    SRC waits for the store once where the next one's reads did not start
    early enough, so every task is CHUNK_ITEMS long (the last one what is left).

    Args:
        total: images in the shard.
        workers: pool processes (0: none, the chunks run in this process).

    Returns:
        The task sizes, in order; they add up to `total`.
    """
    if workers == 0:
        return [min(CHUNK_ITEMS, total - start) for start in range(0, total, CHUNK_ITEMS)]
    sizes, remaining = [], total
    while remaining > 0:
        size = min(remaining, max(TAIL_CHUNK_ITEMS, min(CHUNK_ITEMS, remaining // (workers * 4))))
        sizes.append(size)
        remaining -= size
    return sizes


# What a worker process knows: set once per process by the pool's initializer.
_WORKER: dict[str, Any] = {}


def _init_child(*initargs: Any) -> None:
    """A forked pool worker's start: `_init_worker`'s arguments."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cleans up
    _init_worker(*initargs)


def _init_worker(
    spec_dict: dict[str, Any],
    classes: list[str],
    io_threads: int,
    arena: Arena | None = None,
    ignore_index: int = DEFAULT_IGNORE_INDEX,
) -> None:
    _WORKER["spec"] = PrepareSpec.from_dict(spec_dict)
    _WORKER["classes"] = {name: i for i, name in enumerate(classes)}
    _WORKER["io_threads"] = io_threads
    _WORKER["arena"] = arena  # forked: the parent's shared mapping, inherited, not pickled
    _WORKER["ignore_index"] = ignore_index  # the listing's: a mask's value of no class


def _read_ahead(item: SourceItem) -> bool:
    """Whether a source is read ahead: a remote file, not rejected unread, and whole (an image
    inside a tar is a range of it, which its worker reads: a read ahead would fetch the whole tar)."""
    return is_url(item.url) and not item.rejected and not (isinstance(item.targets, dict) and "tar" in item.targets)


def _shared_arena(workers: int) -> Arena | None:
    """The arena the workers take a remote SRC's bytes from; None (the pool's pipe) where the system refuses one."""
    try:
        return Arena(min(ARENA_MAX, workers * ARENA_PER_WORKER))
    except OSError:
        return None


def _freeze_heap() -> bool:
    """Put what this process holds now out of the garbage collector's reach, before the workers fork; True if done.

    A forked worker shares the parent's memory until either side writes to
    it, and a collection writes to every object it visits: with tens of
    thousands of objects from the imports alone (more with torch loaded),
    each collection in the parent, and in each worker, copies pages the two
    shared, and the parent's collections walk objects that live as long as
    the process. Frozen (`gc.freeze`), they are neither walked nor written;
    the pool thaws them when it closes. A caller that froze objects itself
    keeps its own freeze, and nothing is thawed.
    """
    if gc.get_freeze_count():
        return False
    gc.freeze()
    return True


def make_outcome(
    item: SourceItem, index: int, spec: PrepareSpec, classes: dict[str, int], ignore_index: int = DEFAULT_IGNORE_INDEX
) -> SampleOutcome:
    """What becomes of one listed source: rejected unread when its listing already says why, else `process_item`."""
    if item.rejected:
        return SampleOutcome(index, sample_key(item.rel), item.url, reason=item.rejected)
    return process_item(item, index, spec, classes, ignore_index=ignore_index)


def _process_chunk(chunk: Chunk) -> list[SampleOutcome]:
    spec, classes, ignore = _WORKER["spec"], _WORKER["classes"], _WORKER["ignore_index"]
    if _WORKER["io_threads"] and len(chunk) > 1 and any(_read_ahead(item) for _, item in chunk):
        return _process_read_ahead(chunk, spec, classes)
    return [make_outcome(item, index, spec, classes, ignore) for index, item in chunk]


def _process_fetched(chunk: list[tuple[int, SourceItem, bytes | str | Handoff | None]]) -> list[SampleOutcome]:
    """A chunk whose sources the parent read already: (index, source, its bytes or why not; None if rejected unread).

    Bytes the parent left in the shared arena come as a `Handoff`.
    """
    spec, classes, ignore = _WORKER["spec"], _WORKER["classes"], _WORKER["ignore_index"]
    outcomes = []
    for index, item, data in chunk:
        if data is None:
            outcomes.append(make_outcome(item, index, spec, classes, ignore))
        else:
            taken = _WORKER["arena"].take(data) if isinstance(data, Handoff) else data
            outcomes.append(process_item(item, index, spec, classes, taken, ignore))
    return outcomes


def _process_read_ahead(chunk: Chunk, spec: PrepareSpec, classes: dict[str, int]) -> list[SampleOutcome]:
    """The chunk's outcomes, its sources read ahead (`reads.py`): file i decodes while i+1... download."""
    return _outcomes_of_reads(chunk, _start_reads(chunk), spec, classes)


def _start_reads(chunk: Chunk) -> list[Future[Fetched] | None]:
    """Reads of the chunk's remote sources started in this process (`reads.py`); None: rejected unread, or local."""
    reads = _source_reads()
    return [reads.submit(item) if _read_ahead(item) else None for _, item in chunk]


def _outcomes_of_reads(
    chunk: Chunk, reads: list[Future[Fetched] | None], spec: PrepareSpec, classes: dict[str, int]
) -> list[SampleOutcome]:
    ignore = _WORKER["ignore_index"]
    try:
        return [
            make_outcome(item, index, spec, classes, ignore)
            if read is None
            else process_item(item, index, spec, classes, _in_hand(read), ignore)
            for (index, item), read in zip(chunk, reads, strict=True)
        ]
    finally:
        for read in reads:  # after an error: no read left running for a chunk nobody waits for
            if read is not None:
                read.cancel()


def _in_hand(read: Future[Fetched]) -> bytes | str:
    """What an in-process read gave (no arena there: never a `Handoff`)."""
    fetched = read.result()
    assert not isinstance(fetched, Handoff)
    return fetched


def _source_reads() -> SourceReads:
    """This process's reads of remote sources, made on first use (a forked child makes its own: threads do not survive fork)."""
    owner = (os.getpid(), _WORKER["io_threads"], id(_WORKER["spec"]))
    held = _WORKER.get("source_reads")
    if held is None or held[0] != owner:
        if held is not None and held[0][0] == owner[0]:
            held[1].close()  # the last job's: its reads are all in
        held = (owner, SourceReads(_WORKER["spec"], _WORKER["io_threads"]))
        _WORKER["source_reads"] = held
    reads: SourceReads = held[1]
    return reads


class SamplePool:
    """The process pool of a prepare, robust to a worker that dies.

    `workers=0` runs chunks in this process (no fork, no warm-up). `io_threads`
    is how many reads of a remote SRC each worker keeps in flight (0: one at a
    time, in line); it does nothing for a local SRC.
    """

    def __init__(
        self,
        workers: int,
        spec: PrepareSpec,
        classes: list[str],
        io_threads: int = IO_THREADS,
        ignore_index: int = DEFAULT_IGNORE_INDEX,
    ) -> None:
        self.workers = workers
        self._spec = spec
        self._io_threads = io_threads
        self._initargs = (spec.to_dict(), classes, io_threads)
        self._ignore_index = ignore_index
        self._executor: ProcessPoolExecutor | None = None
        self._reads: SourceReads | None = None
        self._froze = False
        # made before the workers fork, so that they share it; memory is taken only for what a remote SRC puts there
        self._arena = _shared_arena(workers) if workers and io_threads else None
        if workers == 0:
            _init_worker(*self._initargs, None, ignore_index)
        else:
            warm_up(spec)  # forked workers inherit it: their first image starts sooner
            self._froze = _freeze_heap()
            self._executor = self._new_executor(workers)

    def _new_executor(self, workers: int) -> ProcessPoolExecutor:
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("fork")
        initargs = (*self._initargs, self._arena, self._ignore_index)
        return ProcessPoolExecutor(workers, mp_context=context, initializer=_init_child, initargs=initargs)

    def submit(self, chunk: Chunk, cache: dict[int, SampleOutcome] | None = None) -> PendingChunk:
        """Start a chunk; outcomes already in `cache` (taken out of it) are not redone."""
        if cache:
            measured = {index: cache.pop(index) for index, _ in chunk if index in cache}
            if measured:
                rest = [(index, item) for index, item in chunk if index not in measured]
                return _MeasuredAndPending(measured, chunk, self.submit(rest) if rest else None)
        if self._executor is None:
            from concurrent.futures import Future

            if self._io_threads and any(_read_ahead(item) for _, item in chunk):
                return _ReadAheadInProcess(chunk)
            done: Future[list[SampleOutcome]] = Future()
            done.set_result(_process_chunk(chunk))
            return done
        if self._io_threads and any(_read_ahead(item) for _, item in chunk):
            return _ReadInParentThenPooled(self, chunk)
        return self._executor.submit(_process_chunk, chunk)

    def _read(self, item: SourceItem) -> Future[Fetched]:
        """Start reading one remote source in the parent, its bytes left in the shared arena where they fit."""
        if self._reads is None:
            self._reads = SourceReads(self._spec, self._io_threads, self._arena)
        return self._reads.submit(item)

    def _release(self, data: object) -> None:
        """A handed-off range back to the arena, once the worker that took it has answered."""
        if isinstance(data, Handoff) and self._arena is not None:
            self._arena.free(data)

    def _submit_fetched(
        self, fetched: list[tuple[int, SourceItem, bytes | str | Handoff | None]]
    ) -> Future[list[SampleOutcome]]:
        assert self._executor is not None  # only a process pool fetches in the parent
        return self._executor.submit(_process_fetched, fetched)

    def result(self, pending: PendingChunk, chunk: Chunk) -> list[SampleOutcome]:
        """The outcomes of a submitted chunk; a crashed pool is replaced and the chunk re-run file by file."""
        from concurrent.futures.process import BrokenProcessPool

        try:
            return pending.result()
        except BrokenProcessPool:
            assert self._executor is not None  # only a process pool breaks
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = self._new_executor(self.workers)
            return [self._isolated(index, item) for index, item in chunk]

    def _isolated(self, index: int, item: SourceItem) -> SampleOutcome:
        from concurrent.futures.process import BrokenProcessPool

        single = self._new_executor(1)
        try:
            return single.submit(_process_chunk, [(index, item)]).result()[0]
        except BrokenProcessPool:
            return SampleOutcome(index, sample_key(item.rel), item.url, reason="the decoder process crashed on this file")
        finally:
            single.shutdown(wait=True)

    def close(self) -> None:
        """Wait for the workers to finish and exit (after the last shard)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._stop_reader()
        self._thaw()
        self._close_arena()

    def _close_arena(self) -> None:
        arena, self._arena = self._arena, None
        if arena is not None:
            arena.close()

    def _thaw(self) -> None:
        froze, self._froze = self._froze, False
        if froze:
            gc.unfreeze()

    def _stop_reader(self) -> None:
        reads, self._reads = self._reads, None
        if reads is not None:
            reads.close()

    def terminate(self) -> None:
        """Stop the pool after an error: queued chunks are dropped, running ones may finish.

        A worker killed while it sends its results leaves half a message in
        the result pipe, and the executor's thread then waits forever for the
        rest (so does interpreter exit, which joins that thread). So workers
        get TERMINATE_GRACE_S to finish the chunk in hand and exit on their
        own; only one still busy after that (stuck on a file) is killed.
        """
        self._stop_reader()
        self._thaw()
        try:
            self._stop_workers()
        finally:
            self._close_arena()  # after the workers: none reads it any more

    def _stop_workers(self) -> None:
        if self._executor is None:
            return
        executor, self._executor = self._executor, None
        processes = list(getattr(executor, "_processes", {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join()
        thread = getattr(executor, "_executor_manager_thread", None)
        if thread is not None:
            thread.join(TERMINATE_GRACE_S)


class _ReadInParentThenPooled:
    """A chunk of remote sources being read in the parent; it goes to a worker once every read is in.

    The reads' last completion (on an I/O thread) submits the chunk to the
    process pool; `result()` waits for that, then for the worker. A pool that
    is shut down meanwhile (after an error) raises as its `submit` does.
    """

    def __init__(self, pool: SamplePool, chunk: Chunk) -> None:
        self._pool = pool
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._pending: Future[list[SampleOutcome]] | None = None
        self._error: BaseException | None = None
        self._reads: list[Future[bytes | str | Handoff] | None] = [
            pool._read(item) if _read_ahead(item) else None for _, item in chunk
        ]
        self._chunk = chunk
        self._left = sum(read is not None for read in self._reads)
        for read in self._reads:
            if read is not None:
                read.add_done_callback(self._one_done)

    def _one_done(self, _: Future[bytes | str | Handoff]) -> None:
        with self._lock:
            self._left -= 1
            if self._left:
                return
        try:
            failed = next((read.exception() for read in self._reads if read is not None and read.exception()), None)
            if failed is not None:  # what read_item does not turn into a reject: the job's error, as in a worker
                raise failed
            fetched = [
                (index, item, None if read is None else read.result())
                for (index, item), read in zip(self._chunk, self._reads, strict=True)
            ]
            self._pending = self._pool._submit_fetched(fetched)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of result()
            self._error = exc
        finally:
            self._ready.set()

    def result(self) -> list[SampleOutcome]:
        self._ready.wait()
        try:
            if self._error is not None:
                raise self._error
            assert self._pending is not None
            return self._pending.result()
        finally:  # the worker has answered (or never will): the bytes it was handed are no longer needed
            for read in self._reads:
                if read is not None and read.done() and not read.cancelled() and read.exception() is None:
                    self._pool._release(read.result())


class _ReadAheadInProcess:
    """A chunk that runs in this process (no pool), its remote sources downloading from the moment it is submitted.

    The caller submits the next chunk before it takes this one's outcomes, so
    the next chunk's reads are in flight while this one decodes: a store's
    latency is paid once per shard, not once per chunk.
    """

    def __init__(self, chunk: Chunk) -> None:
        self._chunk = chunk
        self._reads = _start_reads(chunk)

    def result(self) -> list[SampleOutcome]:
        return _outcomes_of_reads(self._chunk, self._reads, _WORKER["spec"], _WORKER["classes"])


class _MeasuredAndPending:
    """A chunk's outcomes: some measured earlier (the size estimate), the rest still running."""

    def __init__(self, measured: dict[int, SampleOutcome], chunk: Chunk, pending: PendingChunk | None) -> None:
        self.measured, self.chunk, self.pending = measured, chunk, pending

    def result(self) -> list[SampleOutcome]:
        fresh = {outcome.index: outcome for outcome in (self.pending.result() if self.pending else [])}
        return [self.measured.get(index) or fresh[index] for index, _ in self.chunk]
