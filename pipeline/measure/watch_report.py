"""What `gpufeed watch` reports: each training loop's figures, each GPU's, each interval's, and the verdict.

Plain dataclasses with `to_dict()`: `watch_sampler` fills them, `watch_verdict` reasons from them,
`pipeline.cli.watch` and `plots` show them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..units import wait_share


@dataclasses.dataclass
class LoopFigures:
    """One training process's loop: what it waited for data against its own steps.

    Attributes:
        pid: the process.
        rank: its RANK (torchrun, accelerate), None when not distributed.
        kind: "torch" (DataLoader) or "gpufeed" (Loader); "torch+gpufeed" when both ran.
        batches, samples: delivered (samples from the loader's batch size).
        wait_s: seconds inside `next()` after each iteration's first batch.
        step_s: seconds between batches (the loop's own work: forward, backward, step).
        first_s: seconds the first batch of each iteration took (worker start-up included).
        iterations: passes over a loader (epochs) begun.
        num_workers: the loader's workers (the largest seen).
        fetch_s, fetch_cpu_s, fetch_runq_s, fetch_batches: Dataset + collate seconds: wall, on a
            core, and waiting for one; in the workers (or this process with num_workers=0).
        cpu_s: CPU seconds of this process (all threads).
        runq_s: seconds its main thread waited for a free core.
        workers_cpu_s: CPU seconds of its child processes (the DataLoader workers).
        workers_runq_s: seconds those children waited for a free core.
        workers: child processes seen.
    """

    pid: int
    rank: int | None
    kind: str
    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    step_s: float = 0.0
    first_s: float = 0.0
    iterations: int = 0
    num_workers: int = 0
    fetch_s: float = 0.0
    fetch_cpu_s: float = 0.0
    fetch_runq_s: float = 0.0
    fetch_batches: int = 0
    cpu_s: float = 0.0
    runq_s: float = 0.0
    workers_cpu_s: float = 0.0
    workers_runq_s: float = 0.0
    workers: int = 0

    @property
    def stall_fraction(self) -> float:
        """Share of the loop's time (after the first batch) spent waiting for data."""
        return wait_share(self.wait_s, self.step_s)

    @property
    def loop_s(self) -> float:
        return self.first_s + self.wait_s + self.step_s

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["stall_fraction"] = self.stall_fraction
        return data


@dataclasses.dataclass
class GpuFigures:
    """One GPU through NVML: utilisation (mean and peak of the samples) and memory."""

    index: int
    name: str
    util_mean: float
    util_max: float
    memory_used_max: int
    memory_total: int


@dataclasses.dataclass
class WatchSample:
    """One interval: what the live line shows.

    `read_mb_s` and `reads_per_s` are the process tree's storage reads and read calls (/proc/PID/io);
    `device_iops` is what the device under its files completed meanwhile, whoever asked.
    """

    elapsed_s: float
    stall_fraction: float | None
    batches_per_s: float
    images_per_s: float
    gpu_util: float | None
    gpu_memory: int | None
    cores_busy: float
    loop_cores: float
    worker_cores: float
    read_mb_s: float
    reads_per_s: float
    per_core_busy: list[float] = dataclasses.field(default_factory=list)  # % of each of the machine's cores
    device: str = ""  # the block device of the files the run has open most
    device_iops: float | None = None  # reads completed per second by that device (all processes)


@dataclasses.dataclass
class Verdict:
    """What limits the run, reasoned from the figures in `evidence`.

    Attributes:
        bound: "data-bound", "compute-bound", "partly data-bound" or "unknown".
        cause: for data stalls, the limiting resource: "cpu" (decode/dataset CPU in the workers),
            "dataset" (the Dataset's own time, not spent on a CPU: sleeps, network, locks, reads),
            "disk", "main-process" (the training process's own handling of batches) or
            "undetermined"; None when not data-bound.
        evidence: the measured figures the verdict rests on.
        next_step: what to do about it.
        predicted_speedup: the loop's speed-up the figures predict from `next_step` (None: unknown).
        undetermined: what the figures cannot tell apart here.
    """

    bound: str
    cause: str | None
    evidence: list[str]
    next_step: str
    predicted_speedup: float | None
    undetermined: list[str]


@dataclasses.dataclass
class WatchReport:
    """Everything `gpufeed watch` measured, and its verdict.

    `disk_ceiling_mb_s` is the sequential read rate `gpufeed bench disk` measured (at `disk_measured`) on the
    filesystem the run had most files open on; None when none was measured there. `disk_device` is that
    filesystem's block device and `disk_iops` the reads per second it completed (mean of the intervals);
    `per_core_busy` the machine's cores, % busy on average. `read_mb_s` is the process
    tree's storage reads (page-cache hits excluded) per second of the training loop. `records_dropped`
    counts the lines of the recorder's files that were not records (malformed, of another shape, out
    of range): the figures come from the valid ones.
    """

    command: list[str]
    exit_code: int | None  # the command's (128 + N when signal N ended it); None for `watch()` in this process
    seconds: float
    cores: int
    loops: list[LoopFigures]
    gpus: list[GpuFigures]
    gpu_note: str
    read_bytes: int
    read_mb_s: float
    disk_ceiling_mb_s: float | None
    disk_measured: str
    samples: list[WatchSample]
    verdict: Verdict
    disk_device: str = ""
    disk_iops: float | None = None
    per_core_busy: list[float] = dataclasses.field(default_factory=list)
    records_dropped: int = 0

    @property
    def stall_fraction(self) -> float:
        wait = sum(loop.wait_s for loop in self.loops)
        total = wait + sum(loop.step_s for loop in self.loops)
        return wait / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["loops"] = [loop.to_dict() for loop in self.loops]
        data["stall_fraction"] = self.stall_fraction
        return data


__all__ = ["GpuFigures", "LoopFigures", "Verdict", "WatchReport", "WatchSample"]
