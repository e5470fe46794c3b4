"""What `gpufeed watch` reports: each training loop's figures, each GPU's, each interval's, and the verdict.

Plain dataclasses with `to_dict()`: `sampler` fills them, `verdict` reasons from them,
`pipeline.cli.watch` and `plots` show them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...units import wait_share

REPORT_VERSION = 2
"""The version of the JSON report's shape (`WatchReport.to_dict`), raised when a field changes meaning."""


@dataclasses.dataclass
class LoopFigures:
    """One loader of one process: what the loop waited for its batches against the steps that followed them.

    Attributes:
        pid: the process.
        rank: its RANK (torchrun, accelerate), None when not distributed.
        kind: "torch" (DataLoader) or "gpufeed" (Loader).
        site: where the loader was made ("Dataset at file.py:line").
        role: "training" (optimizer steps or backward passes follow its batches, or, in a process
            without any, its batches come with grad enabled and the model in train mode) or "evaluation".
        batches, samples: delivered (samples from the loader's batch size).
        wait_s: seconds inside `next()` after each iteration's first batch.
        step_s: seconds from each of its batches to the process's next batch from any loader (the
            loop's own work with that batch: forward, backward, step).
        first_s: seconds the first batch of each iteration took, the iterator's start (forking its
            workers) and its end (their shut-down) included.
        iterations: passes over a loader (epochs) begun.
        num_workers: the loader's workers (the largest seen).
        fetch_s, fetch_cpu_s, fetch_runq_s, fetch_batches: Dataset + collate seconds: wall, on a
            core, and waiting for one; in the workers (or this process with num_workers=0).
        cpu_s: CPU seconds of this process (all threads).
        runq_s: seconds its main thread waited for a free core.
        workers_cpu_s: CPU seconds of its child processes (the DataLoader workers).
        workers_runq_s: seconds those children waited for a free core.
        workers: child processes seen (per-epoch workers count once each).
        tensors: tensors in one batch (its first).
        model_s, outside_s, outside_cpu_s: its steps' time sampled inside the model (module calls,
            backward, optimizer) and outside it (augmentation, collate, copies: Python in the loop),
            and the training thread's CPU seconds while outside.
    """

    pid: int
    rank: int | None
    kind: str
    site: str = ""
    role: str = "training"
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
    tensors: int = 0
    model_s: float = 0.0
    outside_s: float = 0.0
    outside_cpu_s: float = 0.0

    @property
    def stall_fraction(self) -> float:
        """Share of the loop's time spent waiting for data (first batches included)."""
        return wait_share(self.wait_s + self.first_s, self.step_s)

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
    device_busy: float | None = None  # share of the interval that device had a request in flight
    iowait: float | None = None  # share of the machine's CPU time idle waiting for I/O


@dataclasses.dataclass
class Verdict:
    """What limits the run, reasoned from the figures in `evidence`.

    Attributes:
        bound: "data-bound", "compute-bound", "partly data-bound" or "unknown".
        cause: for data stalls, the limiting resource: "cpu" (decode/dataset CPU in the workers),
            "dataset" (the Dataset's own time, not spent on a CPU: sleeps, network, locks, reads),
            "disk", "main-process" (the training process's own handling of batches), "loop-cpu"
            (CPU work in the training loop outside the model step: augmentation, collate, copies)
            or "undetermined"; None when not data-bound.
        evidence: the measured figures the verdict rests on, in words.
        figures: the same evidence as numbers, by name (documented in docs/measure.md).
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
    figures: dict[str, float | int | str | None] = dataclasses.field(default_factory=dict)


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
    read_chars: int = 0  # bytes the process tree read through read calls, page-cache hits included
    disk_busy: float | None = None  # share of the run `disk_device` had a request in flight (/proc/diskstats)
    disk_own_share: float | None = None  # share of the bytes `disk_device` moved (read or written) that were the run's reads
    iowait: float | None = None  # share of the machine's CPU time idle waiting for I/O over the run
    cost: dict[str, float] = dataclasses.field(default_factory=dict)  # watch's own: startup_s, cpu_s, hook_cpu_s

    @property
    def training_loops(self) -> list[LoopFigures]:
        """The loaders the verdict is about: the training ones (all, when none trains: an inference run)."""
        return [loop for loop in self.loops if loop.role == "training"] or list(self.loops)

    @property
    def stall_fraction(self) -> float:
        """The training loop's share of time waiting for batches (first batches included)."""
        loops = self.training_loops
        wait = sum(loop.wait_s + loop.first_s for loop in loops)
        return wait_share(wait, sum(loop.step_s for loop in loops))

    @property
    def validation_share(self) -> float:
        """The evaluation loaders' share of the run's wall time (their waits and steps)."""
        evaluation = sum(loop.loop_s for loop in self.loops if loop.role == "evaluation")
        return evaluation / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = {"version": REPORT_VERSION, **dataclasses.asdict(self)}
        data["loops"] = [loop.to_dict() for loop in self.loops]
        data["stall_fraction"] = self.stall_fraction
        data["validation_share"] = self.validation_share
        return data


__all__ = ["REPORT_VERSION", "GpuFigures", "LoopFigures", "Verdict", "WatchReport", "WatchSample"]
