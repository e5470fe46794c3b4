"""`gpufeed bench disk PATH`: what the storage under a path really delivers.

Measured with the page cache out of the way, since a training run reads far
more than fits in memory: files are opened with O_DIRECT and read into
page-aligned (mmap-allocated) buffers where the filesystem allows it, and
otherwise read normally after `posix_fadvise(DONTNEED)` has dropped them
from the cache. The result says which (`direct_io`, `cache_bypass`).

The tests, in order, all on files in a private folder under PATH that is
removed afterwards, also on Ctrl-C or SIGTERM:

- sequential write (large blocks, fsync included) of the test file;
- sequential read of it for each block size (1-4 MiB by default);
- random 4 KiB reads at queue depth 1 and with N threads (one synchronous
  read in flight per thread, as `fio --ioengine=psync --numjobs=N` does),
  with p50/p99 latency, swept over thread counts for the plot;
- reads of many small files of the dataset's mean file size
  (open + read + close), the access pattern of an ImageFolder loader.

The device's kind comes from the kernel (/sys/block, the mount table), unless
the random reads contradict it: virtual disks (virtio, many cloud volumes)
are often marked rotational while they answer like flash, and no spinning
disk serves a random 4 KiB read in under a millisecond. Then the kind is the
measured one and the result says both (`kernel_kind`, `kind_note`).

MB/s are 10^6 bytes per second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import mmap
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError, StorageError
from ..io.devices import MEMORY_FS, device_info, free_bytes
from ..native.build import cache_root

PAGE = 4096
RANDOM_BLOCK = 4096
DEFAULT_FILE_BYTES = 1 << 30
DEFAULT_BLOCKS = (1 << 20, 4 << 20)
DEFAULT_SMALL_FILE_BYTES = 110_000  # ImageNet's mean JPEG size, when no dataset is given
DEFAULT_SMALL_FILES = 512
DEFAULT_THREADS = 16
WORK_PREFIX = ".gpufeed-bench-"
# A spinning disk's random read waits for the platter: milliseconds, a few hundred IOPS at best.
FLASH_P50_MS = 1.0
ROTATIONAL_MAX_IOPS = 500.0
ALL_TESTS = ("seq_write", "seq_read", "randread", "small_files")
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclasses.dataclass
class RandomReadPoint:
    """Random 4 KiB reads with `threads` synchronous reads in flight."""

    threads: int
    iops: float
    mb_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    reads: int


@dataclasses.dataclass
class DiskBenchResult:
    """What `benchmark_disk` measured.

    Attributes:
        path: the folder measured.
        device_kind: nvme, ssd, rotational, network, tmpfs or unknown: the kernel's word,
            unless the random reads showed otherwise (see `kind_note`).
        kernel_kind: what the kernel says the device is.
        kind_note: why `device_kind` differs from `kernel_kind` ("" when it does not).
        fstype, device: the filesystem and block device behind `path`.
        free_bytes: free space on that filesystem before the test.
        direct_io: True when O_DIRECT bypassed the page cache.
        cache_bypass: how the page cache was kept out ("O_DIRECT", "fadvise DONTNEED", or "none: …").
        file_bytes: size of the sequential / random test file.
        seq_write_mb_s: sequential write, fsync included, at the largest block size.
        seq_read_mb_s: best sequential read over the block sizes.
        seq_read_by_block: block size in bytes -> sequential read MB/s.
        randread_4k_*_qd1 / _qdn: random 4 KiB reads at one and `threads` reads in flight.
        randread_sweep: every thread count measured (for the plot).
        small_file_bytes: size of each small file (the dataset's mean file size when given).
        small_file_reads_per_s: open + read + close per second with `threads` threads.
        small_file_reads_per_s_qd1: the same with one thread.
        seconds: wall time of the whole benchmark.
        warnings: things that make a figure less trustworthy.
    """

    path: str
    device_kind: str
    fstype: str
    device: str
    free_bytes: int | None
    direct_io: bool
    cache_bypass: str
    file_bytes: int
    threads: int
    seq_write_mb_s: float | None = None
    seq_read_mb_s: float | None = None
    seq_read_by_block: dict[int, float] = dataclasses.field(default_factory=dict)
    randread_4k_iops_qd1: float | None = None
    randread_4k_p50_ms_qd1: float | None = None
    randread_4k_p99_ms_qd1: float | None = None
    randread_4k_iops_qdn: float | None = None
    randread_4k_p50_ms_qdn: float | None = None
    randread_4k_p99_ms_qdn: float | None = None
    randread_sweep: list[RandomReadPoint] = dataclasses.field(default_factory=list)
    small_file_bytes: int = 0
    small_files: int = 0
    small_file_reads_per_s: float | None = None
    small_file_reads_per_s_qd1: float | None = None
    small_file_mb_s: float | None = None
    seconds: float = 0.0
    warnings: list[str] = dataclasses.field(default_factory=list)
    kernel_kind: str = ""
    kind_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["seq_read_by_block"] = {str(k): v for k, v in self.seq_read_by_block.items()}
        return data


def classify_measured(result: DiskBenchResult) -> None:
    """Correct a `rotational` kind that the random reads contradict (see the module docstring), in place."""
    iops, p50 = result.randread_4k_iops_qd1, result.randread_4k_p50_ms_qd1
    if result.kernel_kind != "rotational" or iops is None or p50 is None:
        return
    if p50 < FLASH_P50_MS and iops > ROTATIONAL_MAX_IOPS:
        result.device_kind = "ssd"
        device = result.device or "the device"
        result.kind_note = (
            f"the kernel marks {device} as rotational, as it often does for virtual disks, but random 4 KiB reads "
            f"took {p50:.2f} ms at queue depth 1 ({iops:,.0f} IOPS), which no spinning disk does: counted as ssd"
        )


def benchmark_disk(
    path: str,
    *,
    file_bytes: int = DEFAULT_FILE_BYTES,
    block_sizes: Sequence[int] = DEFAULT_BLOCKS,
    duration_s: float = 2.0,
    threads: int = DEFAULT_THREADS,
    small_file_bytes: int | None = None,
    small_files: int = DEFAULT_SMALL_FILES,
    tests: Sequence[str] = ALL_TESTS,
    direct: bool | None = None,
    seed: int = 0,
) -> DiskBenchResult:
    """Measure the storage behind `path` with the page cache bypassed.

    Args:
        path: a local folder on the storage to measure (created if missing).
        file_bytes: size of the test file (rounded up to the largest block).
            Make it larger than any cache in front of the device.
        block_sizes: sequential block sizes in bytes (multiples of 4 KiB).
        duration_s: seconds each read test runs (time-based, like fio --time_based).
        threads: reads in flight for the "queue depth N" figures.
        small_file_bytes: size of each small file; default 110 kB. Use
            `mean_file_bytes(dataset)` for the dataset's own mean.
        small_files: how many small files to write.
        tests: which of "seq_write", "seq_read", "randread", "small_files" to run
            (the read tests need the test file, so it is always written).
        direct: force O_DIRECT on (True) or off (False); None tries it.
        seed: seed of the random offsets.

    Returns:
        A DiskBenchResult.

    Raises:
        ConfigError: bad sizes, an unknown test, or a path that is not a local folder.
        StorageError: not enough free space, or the folder cannot be written.
    """
    blocks = _check_settings(path, file_bytes, block_sizes, duration_s, threads, small_files, tests)
    if os.path.exists(path) and not os.path.isdir(path):
        folder = os.path.dirname(os.path.abspath(path))
        raise ConfigError(f"{path} is a file; bench disk measures a folder on the disk: give one, e.g. {folder}")
    started = time.perf_counter()
    file_bytes = -(-file_bytes // max(blocks)) * max(blocks)
    small_size = small_file_bytes or DEFAULT_SMALL_FILE_BYTES
    os.makedirs(path, exist_ok=True)
    info = device_info(path)
    memory = info.fstype in MEMORY_FS
    free = free_bytes(path)
    needed = file_bytes + (small_files * (small_size + PAGE) if "small_files" in tests else 0)
    if free is not None and needed > free * 0.9:
        raise StorageError(
            f"{path} has {free / 1e9:.2f} GB free; the benchmark needs {needed / 1e9:.2f} GB: use a smaller --file-size"
        )
    use_direct = bool(_O_DIRECT) and not memory and direct is not False
    result = DiskBenchResult(
        path=os.path.abspath(path),
        device_kind=info.fstype if memory else info.kind,
        kernel_kind=info.fstype if memory else info.kind,
        fstype=info.fstype,
        device=info.device,
        free_bytes=free,
        direct_io=use_direct,
        cache_bypass="O_DIRECT",
        file_bytes=file_bytes,
        threads=threads,
        small_file_bytes=small_size,
    )
    with _work_dir(path) as work:
        bench = _Bench(work, use_direct, duration_s, seed)
        write_mb_s = bench.write_file(file_bytes, max(blocks))
        if use_direct and not bench.direct:
            result.warnings.append(f"{info.fstype} refused O_DIRECT; files were evicted with posix_fadvise instead")
        result.direct_io = bench.direct
        result.cache_bypass = _bypass_text(bench.direct, memory, info.fstype)
        if "seq_write" in tests:
            result.seq_write_mb_s = write_mb_s
        if "seq_read" in tests:
            for block in blocks:
                result.seq_read_by_block[block] = bench.sequential_read(block)
            result.seq_read_mb_s = max(result.seq_read_by_block.values())
        if "randread" in tests:
            _random_reads(bench, result, threads)
            classify_measured(result)
        if "small_files" in tests:
            bench.write_small_files(small_files, small_size)
            result.small_files = small_files
            result.small_file_reads_per_s_qd1 = bench.small_file_reads(1)
            result.small_file_reads_per_s = bench.small_file_reads(threads)
            result.small_file_mb_s = result.small_file_reads_per_s * small_size / 1e6
    if memory:
        result.warnings.append(f"{path} is on {info.fstype}: the files live in memory, so no cache can be bypassed")
    result.seconds = time.perf_counter() - started
    return result


def _check_settings(
    path: str,
    file_bytes: int,
    block_sizes: Sequence[int],
    duration_s: float,
    threads: int,
    small_files: int,
    tests: Sequence[str],
) -> list[int]:
    if "://" in path and not path.startswith("file://"):
        raise ConfigError(f"bench disk measures a local folder, not {path}: mount it and give the mount point")
    unknown = sorted(set(tests) - set(ALL_TESTS))
    if unknown:
        raise ConfigError(f"unknown disk test(s) {', '.join(unknown)}; choose from {', '.join(ALL_TESTS)}")
    blocks = sorted(set(block_sizes))
    if not blocks or any(b < PAGE or b % PAGE for b in blocks):
        raise ConfigError("block sizes must be multiples of 4 KiB")
    if file_bytes < max(blocks) or file_bytes < 16 * RANDOM_BLOCK:
        raise ConfigError(f"the test file ({file_bytes} bytes) must hold at least one {max(blocks)}-byte block")
    if duration_s <= 0 or threads < 1 or small_files < 1:
        raise ConfigError("duration, threads and the number of small files must be positive")
    return blocks


def _bypass_text(direct: bool, memory: bool, fstype: str) -> str:
    if memory:
        return f"none: {fstype} keeps files in memory"
    return "O_DIRECT" if direct else "posix_fadvise(DONTNEED) before reading"


def mean_file_bytes(source: str, limit: int = 1000) -> int:
    """Mean size of the first `limit` images of a dataset (folder, list, WebDataset shards or URL).

    Raises:
        SourceError: the source cannot be listed.
        ConfigError: it holds no images.
    """
    from ..io.fs import local_path
    from ..prepare.sources import list_images
    from .decode import item_size

    sizes = []
    for item in itertools.islice(list_images(source), limit):
        if local_path(item.url) is not None:
            with contextlib.suppress(OSError):
                sizes.append(item_size(item))
        else:
            sizes.append(item_size(item))  # an image inside a tar: its member's size, not the tar's
    if not sizes:
        raise ConfigError(f"{source} holds no images to take a mean file size from")
    return max(1, round(sum(sizes) / len(sizes)))


# ---------------------------------------------------------------------------
# The private folder: removed afterwards whatever happens


@contextlib.contextmanager
def _work_dir(path: str) -> Iterator[str]:
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


class _Bench:
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
        return os.open(path, os.O_RDONLY | (_O_DIRECT if self.direct else 0))

    def write_file(self, size: int, block: int) -> float:
        """Write the test file sequentially (fsync included); returns MB/s."""
        buffer = _aligned(block, fill=True)
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
                fd = os.open(path, flags | _O_DIRECT, 0o600)
                probe = _aligned(PAGE)
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
        buffer = _aligned(block)
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
        return _summarise(threads, latencies, seconds)

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
            buffer = _aligned(length)
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
    buffer = _aligned(RANDOM_BLOCK)
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


def _random_reads(bench: _Bench, result: DiskBenchResult, threads: int) -> None:
    counts = sorted({1, threads, *(n for n in (4, 16, 64) if n < threads)})
    for count in counts:
        result.randread_sweep.append(bench.random_reads(count))
    qd1 = result.randread_sweep[0]
    qdn = next(p for p in result.randread_sweep if p.threads == threads)
    result.randread_4k_iops_qd1, result.randread_4k_p50_ms_qd1, result.randread_4k_p99_ms_qd1 = (
        qd1.iops, qd1.p50_ms, qd1.p99_ms
    )
    result.randread_4k_iops_qdn, result.randread_4k_p50_ms_qdn, result.randread_4k_p99_ms_qdn = (
        qdn.iops, qdn.p50_ms, qdn.p99_ms
    )


def _summarise(threads: int, latencies: array, seconds: float) -> RandomReadPoint:
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


def _aligned(size: int, fill: bool = False) -> mmap.mmap:
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


def remember_result(result: DiskBenchResult) -> Path | None:
    """Keep `result`'s read ceilings in the user cache for its filesystem, for `gpufeed watch` to compare against.

    Returns:
        the file written, or None where the cache cannot be written (nothing else depends on it).
    """
    try:
        device = os.stat(result.path).st_dev
        folder = cache_root() / "disk"
        folder.mkdir(parents=True, exist_ok=True)
        entry = {
            "path": os.path.abspath(result.path), "device": result.device, "device_kind": result.device_kind,
            "st_dev": device, "seq_read_mb_s": result.seq_read_mb_s,
            "randread_4k_iops_qdn": result.randread_4k_iops_qdn, "created": time.time(),
        }  # fmt: skip
        target = folder / f"{device}.json"
        temporary = target.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(entry))
        os.replace(temporary, target)
        return target
    except OSError:
        return None


def remembered_results() -> dict[int, dict[str, Any]]:
    """The read ceilings `remember_result` kept, by filesystem (st_dev)."""
    folder = cache_root() / "disk"
    found: dict[int, dict[str, Any]] = {}
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return found
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            entry = json.loads((folder / name).read_text())
            found[int(entry["st_dev"])] = entry
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found
