"""What `gpufeed bench disk` found: the result, how far it can be trusted, and the ceilings kept for `watch`.

`DiskBenchResult` is what `disk.benchmark_disk` returns; every read figure in it is the median of
`repeats` runs, each run's figure kept in `figures` (a `Spread`). `classify_measured` corrects a
kernel's "rotational" that the random reads contradict (virtual disks: see `disk`'s docstring).
`check_trust` adds the warnings (and their fields): repeats that disagree by more than
`SPREAD_MARGIN`, and random reads faster than the device kind can answer (a cache in between).
`remember_result` keeps a result's read ceilings in the user cache, by filesystem, and
`remembered_results` reads them back for `gpufeed watch` to compare a run's reads against.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...native.build import cache_root

# A spinning disk's random read waits for the platter: milliseconds, a few hundred IOPS at best.
FLASH_P50_MS = 1.0
ROTATIONAL_MAX_IOPS = 500.0
# Repeats of one figure further apart than this share of their median make the figure unsteady.
SPREAD_MARGIN = 0.25
# The fastest median random 4 KiB read (ms, queue depth 1) each kind of device gives on its own:
# flash answers in tens of microseconds at best (Optane-class NVMe ~10 us, SATA or virtual disks
# ~50-100 us), a network round trip adds its own; anything faster is a cache answering.
LATENCY_FLOOR_MS = {"nvme": 0.005, "ssd": 0.030, "rotational": 0.030, "network": 0.030, "unknown": 0.030}
# A test file smaller than this may sit whole in a device's or a virtual disk host's cache.
SMALL_TEST_FILE = 256 << 20


@dataclasses.dataclass
class Spread:
    """One figure measured `len(runs)` times: the runs in order, their median, lowest and highest.

    `spread` is (high - low) / median: 0.25 means the runs span a quarter of the median.
    """

    runs: list[float]
    median: float
    low: float
    high: float
    spread: float

    @classmethod
    def of(cls, runs: Sequence[float]) -> Spread:
        median = statistics.median(runs)
        low, high = min(runs), max(runs)
        return cls(list(runs), median, low, high, (high - low) / median if median else 0.0)


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
        seq_read_mb_s: the headline sequential read: the median of the block size whose median is
            highest (`seq_read_block`), never a single run's best.
        seq_read_block: the block size of `seq_read_mb_s`.
        seq_read_by_block: block size in bytes -> median sequential read MB/s.
        randread_4k_*_qd1 / _qdn: random 4 KiB reads at one and `threads` reads in flight
            (each the median over the repeats).
        randread_sweep: every thread count measured, medians over the repeats (for the plot).
        small_file_bytes: size of each small file (the dataset's mean file size when given).
        small_file_reads_per_s: open + read + close per second with `threads` threads.
        small_file_reads_per_s_qd1: the same with one thread.
        seconds: wall time of the whole benchmark.
        warnings: things that make a figure less trustworthy, in words.
        repeats: runs behind each read figure (the write runs once: it lays out the test file).
        figures: every repeated figure's runs and spread, by name ("seq_read_mb_s:1048576",
            "randread_4k_iops:1", "randread_4k_p50_ms:1", "small_file_reads_per_s:16" …).
        spread_margin: the spread above which a figure counts as unsteady.
        unsteady: the names in `figures` whose runs disagree by more than `spread_margin`.
        cache_suspected: True when the reads were served from memory rather than the device
            (page cache kept, tmpfs, or latencies below `latency_floor_ms`).
        latency_floor_ms: the fastest median 4 KiB read the device kind gives on its own.
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
    seq_read_block: int | None = None
    repeats: int = 1
    figures: dict[str, Spread] = dataclasses.field(default_factory=dict)
    spread_margin: float = SPREAD_MARGIN
    unsteady: list[str] = dataclasses.field(default_factory=list)
    cache_suspected: bool = False
    latency_floor_ms: float | None = None

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


def check_trust(result: DiskBenchResult, memory: bool, kept_cache: bool) -> None:
    """Add the warnings, and their fields, that say how far `result`'s figures can be trusted (in place).

    Args:
        result: a finished measurement.
        memory: the folder is on a filesystem in memory (tmpfs, ramfs).
        kept_cache: the reads went through the page cache on purpose (no O_DIRECT, no eviction).
    """
    result.unsteady = [name for name, figure in result.figures.items() if _is_rate(name) and figure.spread > result.spread_margin]
    if result.unsteady:
        shown = "; ".join(_spread_text(name, result.figures[name]) for name in result.unsteady[:4])
        result.warnings.append(
            f"repeats disagree by more than {result.spread_margin * 100:.0f} % ({shown}): the disk is not steady "
            "(a burst allowance, other load on it); the medians are shown, rerun with a longer --duration"
        )
    if result.file_bytes < SMALL_TEST_FILE:
        result.warnings.append(
            f"the test file ({result.file_bytes / 2**20:.0f} MiB) is small enough for a device's or a virtual "
            "disk host's cache to hold whole: use --file-size 1GiB or more for figures of the device itself"
        )
    if memory:
        result.cache_suspected = True
        return  # the memory warning says it all
    if kept_cache:
        result.cache_suspected = True
        result.warnings.append("the page cache was kept (--keep-cache): these figures are the cache's, not the device's")
    floor = LATENCY_FLOOR_MS.get(result.device_kind)
    result.latency_floor_ms = floor
    p50 = result.randread_4k_p50_ms_qd1
    if floor is None or p50 is None or p50 >= floor:
        return
    result.cache_suspected = True
    if result.direct_io:
        bypass = "although O_DIRECT was in effect"
    else:
        bypass = "with O_DIRECT not in effect (" + ("page cache kept)" if kept_cache else "files evicted with posix_fadvise)")
    result.warnings.append(
        f"random 4 KiB reads took {p50 * 1000:.0f} us (median, queue depth 1), faster than a {result.device_kind} device "
        f"answers ({floor * 1000:.0f} us or more) {bypass}: a cache in between (the page cache, a virtual disk "
        "host's, a controller's) served them, so the figures are above what the device sustains"
    )


def _is_rate(name: str) -> bool:
    return "_ms:" not in name  # latencies vary more from run to run than rates and say less about the ceiling


def _spread_text(name: str, figure: Spread) -> str:
    kind, _, setting = name.partition(":")
    count = int(setting)
    label, unit = {
        "seq_read_mb_s": (f"sequential read {count / 2**20:g} MiB", "MB/s"),
        "randread_4k_iops": (f"random 4 KiB read x{count}", "IOPS"),
        "small_file_reads_per_s": (f"small files x{count}", "files/s"),
    }.get(kind, (name, ""))
    runs = "/".join(f"{run:,.0f}" for run in figure.runs)
    return f"{label}: {runs} {unit}".rstrip()


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
            "direct_io": result.direct_io, "repeats": result.repeats, "unsteady": result.unsteady,
            "cache_suspected": result.cache_suspected,
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


__all__ = [
    "FLASH_P50_MS", "LATENCY_FLOOR_MS", "ROTATIONAL_MAX_IOPS", "SMALL_TEST_FILE", "SPREAD_MARGIN", "DiskBenchResult",
    "RandomReadPoint", "Spread", "check_trust", "classify_measured", "remember_result", "remembered_results",
]
