"""The runs behind `gpufeed bench disk`: the test files, the timed read loops, and their private folder.

`work_folder(path)` makes the private folder under PATH and removes it afterwards, on Ctrl-C and
SIGTERM too. `DiskRunner` writes the test files there and times one run of each read over them:
sequential, random 4 KiB from N threads and small files. `record_sequential`, `record_random_reads`
and `record_small_files` repeat those runs (the settings' order rotated each round, so a drift in
the disk's speed hits every setting alike) and put the medians and their spread into the result.
Reads use O_DIRECT into page-aligned buffers (`aligned_buffer`) where the filesystem allows it, else
`posix_fadvise(DONTNEED)` evicts the files first.

As fio does (`scramble_buffers`, its random map), every 4 KiB page written carries its own number,
so a deduplicating or compressing layer cannot serve many pages from one, and the random reads
visit the file's blocks in a random order, each once per pass, so repeats do not hit a cache.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import random
import shutil
import signal
import statistics
import struct
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ...errors import StorageError
from .result import DiskBenchResult, RandomReadPoint, Spread

T = TypeVar("T")
PAGE = 4096
RANDOM_BLOCK = 4096
WORK_PREFIX = ".gpufeed-bench-"
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none


# ---------------------------------------------------------------------------
# The private folder: removed afterwards whatever happens


@contextlib.contextmanager
def work_folder(path: str) -> Iterator[str]:
    """A private folder under `path`, removed on exit, Ctrl-C and SIGTERM included."""
    try:
        work = tempfile.mkdtemp(prefix=WORK_PREFIX, dir=path)
    except OSError as exc:
        raise StorageError(f"cannot write a test folder in {path}: {exc.strerror or exc}") from exc
    previous = _sigterm_as_interrupt()
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _sigterm_as_interrupt() -> Any:
    """Make SIGTERM unwind like Ctrl-C (so `finally` cleans up); returns the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


# ---------------------------------------------------------------------------
# The measurements


class DiskRunner:
    """The test files of one run and the read loops over them."""

    def __init__(self, work: str, direct: bool, duration_s: float, seed: int, evict: bool = True) -> None:
        self.work = work
        self.direct = direct
        self.evict = evict
        self.duration_s = duration_s
        self.seed = seed
        self.data_path = os.path.join(work, "data")
        self.file_bytes = 0
        self.small_paths: list[str] = []
        self.small_bytes = 0

    def _open_read(self, path: str) -> int:
        return os.open(path, os.O_RDONLY | (O_DIRECT if self.direct else 0))

    def write_file(self, size: int, block: int) -> float:
        """Write the test file sequentially (fsync included); returns MB/s."""
        buffer = aligned_buffer(block, fill=True)
        try:
            fd = self._open_write(self.data_path)
            started = time.perf_counter()
            try:
                written = 0
                while written < size:
                    _number_pages(buffer, written // PAGE)
                    written += _write_all(fd, buffer)
                os.fsync(fd)
                seconds = time.perf_counter() - started
                self._evict(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _storage_error(self.data_path, exc) from exc
        finally:
            buffer.close()
        self.file_bytes = size
        return size / seconds / 1e6

    def _open_write(self, path: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if self.direct:
            try:
                fd = os.open(path, flags | O_DIRECT, 0o600)
                probe = aligned_buffer(PAGE)
                try:
                    os.write(fd, probe)  # some filesystems accept the flag but fail the first write
                    os.ftruncate(fd, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                finally:
                    probe.close()
                return fd
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                with contextlib.suppress(OSError, UnboundLocalError):
                    os.close(fd)
                self.direct = False
        return os.open(path, flags, 0o600)

    @property
    def evicting(self) -> bool:
        """Whether reads drop their pages from the cache (no O_DIRECT, and the cache not kept on purpose)."""
        return self.evict and not self.direct

    def _evict(self, fd: int) -> None:
        if self.evicting:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def sequential_read(self, block: int) -> float:
        """Read the test file front to back (wrapping) for `duration_s`; returns MB/s."""
        buffer = aligned_buffer(block)
        buffers = [buffer]
        try:
            fd = self._open_read(self.data_path)
            try:
                self._evict(fd)
                if not self.direct:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                offset = total = 0
                started = time.perf_counter()
                deadline = started + self.duration_s
                while True:
                    got = os.preadv(fd, buffers, offset)
                    total += got
                    offset += got
                    if offset >= self.file_bytes or got == 0:
                        offset = 0
                        self._evict(fd)
                    if time.perf_counter() >= deadline:
                        break
                return total / (time.perf_counter() - started) / 1e6
            finally:
                os.close(fd)
        finally:
            buffer.close()

    def random_reads(self, threads: int) -> RandomReadPoint:
        """Random aligned 4 KiB reads over the test file from `threads` threads for `duration_s`."""
        fd = self._open_read(self.data_path)
        try:
            self._evict(fd)
            if not self.direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            blocks = self.file_bytes // RANDOM_BLOCK
            evict = self.evicting
            self.seed += 1  # each run (and thread) walks the file in its own order

            def work(index: int, stop: threading.Event, deadline_ns: int) -> array:
                walk = block_walk(blocks, random.Random(self.seed * 1000 + index))
                return _random_read_loop(fd, walk, stop, deadline_ns, evict)

            latencies, seconds = _run_threads(threads, work, self.duration_s)
        finally:
            os.close(fd)
        return _random_read_point(threads, latencies, seconds)

    def write_small_files(self, count: int, size: int) -> None:
        folder = os.path.join(self.work, "small")
        os.makedirs(folder)
        data = bytearray(os.urandom(size))
        pages = -(-size // PAGE)
        try:
            for index in range(count):
                path = os.path.join(folder, f"{index:06d}.bin")
                _number_pages(data, index * pages)
                with open(path, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                    if self.evict:
                        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                self.small_paths.append(path)
        except OSError as exc:
            raise _storage_error(folder, exc) from exc
        self.small_bytes = size

    def small_file_reads(self, threads: int) -> float:
        """open + read whole file + close, files taken in turn, for `duration_s`; returns files/s."""
        paths = self.small_paths
        counter = itertools.count()
        length = -(-self.small_bytes // PAGE) * PAGE

        def work(index: int, stop: threading.Event, deadline_ns: int) -> array:
            buffer = aligned_buffer(length)
            done = array("q")
            try:
                while not stop.is_set():
                    fd = self._open_read(paths[next(counter) % len(paths)])
                    try:
                        os.preadv(fd, [buffer], 0)  # the buffer holds the whole file
                        self._evict(fd)
                    finally:
                        os.close(fd)
                    done.append(1)
                    if time.perf_counter_ns() >= deadline_ns:
                        break
            finally:
                buffer.close()
            return done

        reads, seconds = _run_threads(threads, work, self.duration_s)
        return len(reads) / seconds


def block_walk(blocks: int, rng: random.Random) -> Iterator[int]:
    """The block numbers 0 … blocks-1 in a random order, each once per pass, then again (endlessly).

    A full-period linear congruential sequence over the next power of two (a = 1 mod 4 and c odd
    visit every value once per period), passed through an invertible mix (xor-shift, multiply by an
    odd number) that hides the sequence's regular steps, skipping the values past the end: no
    memory per block, so it serves a file of any size, and the offsets jump across the whole file.
    """
    bits = max(2, (blocks - 1).bit_length())
    mask, shift = (1 << bits) - 1, max(1, bits // 2)
    multiplier = (rng.randrange(1, max(2, 1 << (bits - 2))) << 2) | 1
    increment, mix = rng.randrange(mask + 1) | 1, rng.randrange(mask + 1) | 1
    value = rng.randrange(mask + 1)
    while True:
        value = (multiplier * value + increment) & mask
        mixed = value ^ (value >> shift)
        mixed = (mixed * mix) & mask
        mixed ^= mixed >> shift
        if mixed < blocks:
            yield mixed


def _random_read_loop(fd: int, walk: Iterator[int], stop: threading.Event, deadline_ns: int, evict: bool) -> array:
    """Timed 4 KiB reads at the walk's aligned offsets until the deadline.

    Kept lean because at queue depth 1 every microsecond of Python per read
    shows in the IOPS of a fast disk: offsets are drawn in blocks, the
    buffer list is built once.
    """
    buffer = aligned_buffer(RANDOM_BLOCK)
    buffers = [buffer]
    latencies = array("q")
    clock, pread, record = time.perf_counter_ns, os.preadv, latencies.append
    try:
        while not stop.is_set():
            offsets = [block * RANDOM_BLOCK for block in itertools.islice(walk, 256)]
            for offset in offsets:
                before = clock()
                pread(fd, buffers, offset)
                after = clock()
                record(after - before)
                if evict:
                    os.posix_fadvise(fd, offset, RANDOM_BLOCK, os.POSIX_FADV_DONTNEED)
                if after >= deadline_ns:
                    return latencies
    finally:
        buffer.close()
    return latencies


def _run_threads(
    threads: int, work: Callable[[int, threading.Event, int], array], duration_s: float
) -> tuple[array, float]:
    """Run `work` in `threads` threads for `duration_s`; returns their joined results and the wall time.

    The main thread only waits (in short joins, so Ctrl-C gets through), and
    on any exception stops the others before the test files are removed.
    """
    stop = threading.Event()
    results: list[array | BaseException] = [array("q") for _ in range(threads)]
    start = threading.Barrier(threads + 1)

    def run(index: int) -> None:
        try:
            start.wait()
            results[index] = work(index, stop, deadline_ns)
        except BaseException as exc:  # re-raised in the main thread
            results[index] = exc
            stop.set()

    deadline_ns = time.perf_counter_ns() + int((duration_s + 60) * 1e9)  # replaced once all threads are ready
    pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    try:
        started = time.perf_counter()
        deadline_ns = time.perf_counter_ns() + int(duration_s * 1e9)
        start.wait()
        for thread in pool:
            while thread.is_alive():
                thread.join(0.05)
        seconds = time.perf_counter() - started
    finally:
        stop.set()
        with contextlib.suppress(threading.BrokenBarrierError):
            start.abort()
        for thread in pool:
            thread.join(5)
    merged = array("q")
    for part in results:
        if isinstance(part, BaseException):
            raise part
        merged.extend(part)
    return merged, seconds


def _rotated(settings: Sequence[int], turn: int) -> list[int]:
    """`settings` starting at a different one each round, so no setting always runs first."""
    shift = turn % len(settings)
    return [*settings[shift:], *settings[:shift]]


def _repeated(settings: Sequence[int], repeats: int, measure: Callable[[int], T]) -> dict[int, list[T]]:
    """`repeats` runs of `measure` per setting, the settings taking turns in a rotating order (`_rotated`)."""
    runs: dict[int, list[T]] = {setting: [] for setting in settings}
    for turn in range(repeats):
        for setting in _rotated(settings, turn):
            runs[setting].append(measure(setting))
    return runs


def record_sequential(runner: DiskRunner, result: DiskBenchResult, blocks: Sequence[int], repeats: int) -> None:
    """Sequential reads, `repeats` runs per block size, into `result`: the medians, their spread, the headline.

    The headline (`seq_read_mb_s`) is the median of the block size whose median is highest.
    """
    runs = _repeated(blocks, repeats, runner.sequential_read)
    for block in blocks:
        result.seq_read_by_block[block] = _record(result, f"seq_read_mb_s:{block}", runs[block])
    result.seq_read_block = max(blocks, key=result.seq_read_by_block.__getitem__)
    result.seq_read_mb_s = result.seq_read_by_block[result.seq_read_block]


def record_small_files(runner: DiskRunner, result: DiskBenchResult, threads: int, repeats: int) -> None:
    """Small-file reads with one and `threads` threads, `repeats` runs each, into `result`."""
    counts = sorted({1, threads})
    runs = _repeated(counts, repeats, runner.small_file_reads)
    medians = {count: _record(result, f"small_file_reads_per_s:{count}", runs[count]) for count in counts}
    result.small_file_reads_per_s_qd1 = medians[1]
    result.small_file_reads_per_s = medians[threads]
    result.small_file_mb_s = medians[threads] * result.small_file_bytes / 1e6


def _record(result: DiskBenchResult, name: str, runs: list[float]) -> float:
    figure = result.figures[name] = Spread.of(runs)
    return figure.median


def record_random_reads(runner: DiskRunner, result: DiskBenchResult, threads: int, repeats: int = 1) -> None:
    """Random reads at 1, 4, 16, 64 … `threads` threads, `repeats` runs each, into `result`.

    Each point of the sweep holds the medians over its runs; the QD1 / QDN figures are its ends.
    """
    counts = sorted({1, threads, *(n for n in (4, 16, 64) if n < threads)})
    runs = _repeated(counts, repeats, runner.random_reads)
    result.randread_sweep = [_median_point(result, count, runs[count]) for count in counts]
    qd1 = result.randread_sweep[0]
    qdn = next(p for p in result.randread_sweep if p.threads == threads)
    result.randread_4k_iops_qd1, result.randread_4k_p50_ms_qd1, result.randread_4k_p99_ms_qd1 = (
        qd1.iops, qd1.p50_ms, qd1.p99_ms
    )
    result.randread_4k_iops_qdn, result.randread_4k_p50_ms_qdn, result.randread_4k_p99_ms_qdn = (
        qdn.iops, qdn.p50_ms, qdn.p99_ms
    )


def _median_point(result: DiskBenchResult, threads: int, runs: list[RandomReadPoint]) -> RandomReadPoint:
    """One point of the sweep: each figure the median of its runs (kept with their spread in `result`)."""
    iops = _record(result, f"randread_4k_iops:{threads}", [run.iops for run in runs])
    return RandomReadPoint(
        threads=threads,
        iops=iops,
        mb_s=iops * RANDOM_BLOCK / 1e6,
        p50_ms=_record(result, f"randread_4k_p50_ms:{threads}", [run.p50_ms for run in runs]),
        p99_ms=_record(result, f"randread_4k_p99_ms:{threads}", [run.p99_ms for run in runs]),
        mean_ms=statistics.median(run.mean_ms for run in runs),
        reads=sum(run.reads for run in runs),
    )


def _random_read_point(threads: int, latencies: array, seconds: float) -> RandomReadPoint:
    ordered = sorted(latencies)
    count = len(ordered)
    if count == 0:
        return RandomReadPoint(threads, 0.0, 0.0, 0.0, 0.0, 0.0, 0)

    def percentile(q: float) -> float:
        return ordered[min(count - 1, int(q * count))] / 1e6

    iops = count / seconds
    return RandomReadPoint(
        threads=threads,
        iops=iops,
        mb_s=iops * RANDOM_BLOCK / 1e6,
        p50_ms=percentile(0.50),
        p99_ms=percentile(0.99),
        mean_ms=sum(ordered) / count / 1e6,
        reads=count,
    )


def aligned_buffer(size: int, fill: bool = False) -> mmap.mmap:
    """A page-aligned buffer (mmap memory), as O_DIRECT needs."""
    buffer = mmap.mmap(-1, size)
    if fill:  # incompressible, so no layer can cheat by compressing zeros
        buffer[:] = os.urandom(size)
    return buffer


def _number_pages(buffer: mmap.mmap | bytearray, first: int) -> None:
    """Write each 4 KiB page's number into its first 8 bytes, so that no two pages of the test files are alike."""
    for index in range((len(buffer) + PAGE - 8) // PAGE):
        struct.pack_into("<Q", buffer, index * PAGE, first + index)


def _write_all(fd: int, buffer: mmap.mmap) -> int:
    view = memoryview(buffer)
    try:
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
        return written
    finally:
        view.release()


def _storage_error(path: str, exc: OSError) -> StorageError:
    from ...errors import write_failure

    return write_failure(path, exc)


__all__ = [
    "O_DIRECT", "PAGE", "RANDOM_BLOCK", "WORK_PREFIX", "DiskRunner", "aligned_buffer", "block_walk", "record_random_reads",
    "record_sequential", "record_small_files", "work_folder",
]
