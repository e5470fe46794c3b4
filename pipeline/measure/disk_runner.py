"""The runs behind `gpufeed bench disk`: the test files, the timed read loops, and their private folder.

`work_folder(path)` makes the private folder under PATH and removes it afterwards, on Ctrl-C and
SIGTERM too. `DiskRunner` writes the test files there and times the reads over them: sequential,
random 4 KiB from N threads (`record_random_reads` sweeps the thread counts into the result) and
small files. Reads use O_DIRECT into page-aligned buffers (`aligned_buffer`) where the filesystem
allows it, else `posix_fadvise(DONTNEED)` evicts the files first.
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
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import StorageError
from .disk_result import DiskBenchResult, RandomReadPoint

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

    def __init__(self, work: str, direct: bool, duration_s: float, seed: int) -> None:
        self.work = work
        self.direct = direct
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
                    written += _write_all(fd, buffer)
                os.fsync(fd)
                seconds = time.perf_counter() - started
                if not self.direct:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
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

    def _evict(self, fd: int) -> None:
        if not self.direct:
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
            evict = not self.direct

            def work(index: int, stop: threading.Event, deadline_ns: int) -> array:
                return _random_read_loop(fd, blocks, random.Random(self.seed * 1000 + index), stop, deadline_ns, evict)

            latencies, seconds = _run_threads(threads, work, self.duration_s)
        finally:
            os.close(fd)
        return _random_read_point(threads, latencies, seconds)

    def write_small_files(self, count: int, size: int) -> None:
        folder = os.path.join(self.work, "small")
        os.makedirs(folder)
        data = os.urandom(size)
        try:
            for index in range(count):
                path = os.path.join(folder, f"{index:06d}.bin")
                with open(path, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
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
                        if not self.direct:
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
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


def _random_read_loop(
    fd: int, blocks: int, rng: random.Random, stop: threading.Event, deadline_ns: int, evict: bool
) -> array:
    """Timed 4 KiB reads at random aligned offsets until the deadline.

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
            offsets = [rng.randrange(blocks) * RANDOM_BLOCK for _ in range(256)]
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


def record_random_reads(runner: DiskRunner, result: DiskBenchResult, threads: int) -> None:
    """Random reads at 1, 4, 16, 64 … `threads` threads into `result`: the sweep and the QD1 / QDN figures."""
    counts = sorted({1, threads, *(n for n in (4, 16, 64) if n < threads)})
    for count in counts:
        result.randread_sweep.append(runner.random_reads(count))
    qd1 = result.randread_sweep[0]
    qdn = next(p for p in result.randread_sweep if p.threads == threads)
    result.randread_4k_iops_qd1, result.randread_4k_p50_ms_qd1, result.randread_4k_p99_ms_qd1 = (
        qd1.iops, qd1.p50_ms, qd1.p99_ms
    )
    result.randread_4k_iops_qdn, result.randread_4k_p50_ms_qdn, result.randread_4k_p99_ms_qdn = (
        qdn.iops, qdn.p50_ms, qdn.p99_ms
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
    from ..errors import write_failure

    return write_failure(path, exc)


__all__ = ["O_DIRECT", "PAGE", "RANDOM_BLOCK", "WORK_PREFIX", "DiskRunner", "aligned_buffer", "record_random_reads", "work_folder"]
