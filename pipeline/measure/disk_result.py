"""What `gpufeed bench disk` found: the result, the device kind the reads show, and the ceilings kept for `watch`.

`DiskBenchResult` is what `disk.benchmark_disk` returns. `classify_measured` corrects a kernel's
"rotational" that the random reads contradict (virtual disks: see `disk`'s docstring).
`remember_result` keeps a result's read ceilings in the user cache, by filesystem, and
`remembered_results` reads them back for `gpufeed watch` to compare a run's reads against.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from ..native.build import cache_root

# A spinning disk's random read waits for the platter: milliseconds, a few hundred IOPS at best.
FLASH_P50_MS = 1.0
ROTATIONAL_MAX_IOPS = 500.0


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


__all__ = [
    "FLASH_P50_MS", "ROTATIONAL_MAX_IOPS", "DiskBenchResult", "RandomReadPoint", "classify_measured",
    "remember_result", "remembered_results",
]
