"""`gpufeed bench disk PATH`: what the storage under a path really delivers.

Measured with the page cache out of the way, since a training run reads far
more than fits in memory: files are opened with O_DIRECT and read into
page-aligned (mmap-allocated) buffers where the filesystem allows it, and
otherwise read normally after `posix_fadvise(DONTNEED)` has dropped them
from the cache. The result says which (`direct_io`, `cache_bypass`).

Every read figure is measured `repeats` times (3), the runs of the settings
interleaved, and reported as the median of its runs with their spread (lowest,
highest); `duration_s` is the time of each test in all, split between its
runs, so repeating costs no extra time. The result warns, in words
(`warnings`) and in fields (`unsteady`, `cache_suspected`), when runs of a
figure disagree by more than 25 %, when random reads answer faster than the
device kind can (a cache in between), and when the test file is small enough
for a cache to hold.

The tests, in order, all on files in a private folder under PATH that is
removed afterwards, also on Ctrl-C or SIGTERM:

- sequential write (large blocks, fsync included) of the test file;
- sequential read of it for each block size (1-4 MiB by default), one
  synchronous reader (as `fio --rw=read --ioengine=psync --iodepth=1`);
- random 4 KiB reads at queue depth 1 and with N threads (one synchronous
  read in flight per thread, as `fio --rw=randread --ioengine=psync --numjobs=N`
  does), over the whole file in a random order that repeats no block within a
  pass (fio's random map), with p50/p99 latency, swept over thread counts for
  the plot;
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
import itertools
import os
import time
from collections.abc import Sequence

from ...errors import ConfigError, StorageError
from ...io.devices import MEMORY_FS, device_info, free_bytes
from .result import (
    FLASH_P50_MS,
    ROTATIONAL_MAX_IOPS,
    SPREAD_MARGIN,
    DiskBenchResult,
    RandomReadPoint,
    Spread,
    check_trust,
    classify_measured,
    remember_result,
    remembered_results,
)
from .runner import (
    O_DIRECT,
    PAGE,
    RANDOM_BLOCK,
    WORK_PREFIX,
    DiskRunner,
    record_random_reads,
    record_sequential,
    record_small_files,
    work_folder,
)

DEFAULT_FILE_BYTES = 1 << 30
DEFAULT_BLOCKS = (1 << 20, 4 << 20)
DEFAULT_SMALL_FILE_BYTES = 110_000  # ImageNet's mean JPEG size, when no dataset is given
DEFAULT_SMALL_FILES = 512
DEFAULT_THREADS = 16
DEFAULT_REPEATS = 3
ALL_TESTS = ("seq_write", "seq_read", "randread", "small_files")


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
    repeats: int = DEFAULT_REPEATS,
    keep_cache: bool = False,
) -> DiskBenchResult:
    """Measure the storage behind `path` with the page cache bypassed.

    Args:
        path: a local folder on the storage to measure (created if missing).
        file_bytes: size of the test file (rounded up to the largest block).
            Make it larger than any cache in front of the device.
        block_sizes: sequential block sizes in bytes (multiples of 4 KiB).
        duration_s: seconds each read test runs in all (time-based, like fio --time_based),
            split evenly between its `repeats` runs.
        threads: reads in flight for the "queue depth N" figures.
        small_file_bytes: size of each small file; default 110 kB. Use
            `mean_file_bytes(dataset)` for the dataset's own mean.
        small_files: how many small files to write.
        tests: which of "seq_write", "seq_read", "randread", "small_files" to run
            (the read tests need the test file, so it is always written).
        direct: force O_DIRECT on (True) or off (False); None tries it.
        seed: seed of the random offsets.
        repeats: runs of each read figure; the figure is their median, their spread is kept.
        keep_cache: read through the page cache (no O_DIRECT, no eviction), to see what the
            cache gives: the result is marked `cache_suspected` and says so.

    Returns:
        A DiskBenchResult.

    Raises:
        ConfigError: bad sizes, an unknown test, or a path that is not a local folder.
        StorageError: not enough free space, or the folder cannot be written.
    """
    blocks = _check_settings(path, file_bytes, block_sizes, duration_s, threads, small_files, tests, repeats)
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
    use_direct = bool(O_DIRECT) and not memory and direct is not False and not keep_cache
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
        repeats=repeats,
    )
    with work_folder(path) as work:
        runner = DiskRunner(work, use_direct, duration_s / repeats, seed, evict=not keep_cache)
        write_mb_s = runner.write_file(file_bytes, max(blocks))
        if use_direct and not runner.direct:
            result.warnings.append(f"{info.fstype} refused O_DIRECT; files were evicted with posix_fadvise instead")
        result.direct_io = runner.direct
        result.cache_bypass = _bypass_text(runner.direct, memory, info.fstype, keep_cache)
        if "seq_write" in tests:
            result.seq_write_mb_s = write_mb_s
        if "seq_read" in tests:
            record_sequential(runner, result, blocks, repeats)
        if "randread" in tests:
            record_random_reads(runner, result, threads, repeats)
            classify_measured(result)
        if "small_files" in tests:
            runner.write_small_files(small_files, small_size)
            result.small_files = small_files
            record_small_files(runner, result, threads, repeats)
    if memory:
        result.warnings.append(f"{path} is on {info.fstype}: the files live in memory, so no cache can be bypassed")
    check_trust(result, memory, keep_cache)
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
    repeats: int,
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
    if duration_s <= 0 or threads < 1 or small_files < 1 or repeats < 1:
        raise ConfigError("duration, threads, repeats and the number of small files must be positive")
    return blocks


def _bypass_text(direct: bool, memory: bool, fstype: str, keep_cache: bool) -> str:
    if memory:
        return f"none: {fstype} keeps files in memory"
    if keep_cache:
        return "none: the page cache was kept (keep_cache)"
    return "O_DIRECT" if direct else "posix_fadvise(DONTNEED) before reading"


def mean_file_bytes(source: str, limit: int = 1000) -> int:
    """Mean size of the first `limit` images of a dataset (folder, list, WebDataset shards or URL).

    Raises:
        SourceError: the source cannot be listed.
        ConfigError: it holds no images.
    """
    from ...io.fs import local_path
    from ...prepare.sources import list_images
    from ..decode import item_size

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


__all__ = [
    "ALL_TESTS", "DEFAULT_BLOCKS", "DEFAULT_FILE_BYTES", "DEFAULT_REPEATS", "DEFAULT_SMALL_FILES",
    "DEFAULT_SMALL_FILE_BYTES", "DEFAULT_THREADS", "FLASH_P50_MS", "PAGE", "RANDOM_BLOCK", "ROTATIONAL_MAX_IOPS",
    "SPREAD_MARGIN", "WORK_PREFIX", "DiskBenchResult", "RandomReadPoint", "Spread", "benchmark_disk",
    "classify_measured", "mean_file_bytes", "remember_result", "remembered_results",
]
