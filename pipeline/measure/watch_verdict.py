"""The verdict of `gpufeed watch`: data-bound or compute-bound, what limits the data, and the next step.

`judge(report)` reasons only from the figures of a `WatchReport`; every figure it rests on goes
into the verdict's evidence, and what the figures cannot tell apart into `undetermined`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .watch_report import LoopFigures, Verdict, WatchReport

DATA_BOUND = 0.25  # stall fraction from which the data is the limit
COMPUTE_BOUND = 0.10  # below it, faster data would change little
BUSY = 0.7  # a Dataset on a core (or waiting for one) this much of its time is CPU-bound
DISK_NEAR = 0.7  # reads at this share of the measured ceiling are the limit
QUIET_READS_MB_S = 1.0  # below it the disk plays no part


def judge(report: WatchReport) -> Verdict:
    """Data-bound or compute-bound, and what limits the data: reasoned only from the report's figures."""
    loops = report.loops
    if not loops:
        return Verdict(
            "unknown", None,
            [f"CPU {report.cores} cores, reads {report.read_mb_s:.1f} MB/s"],
            "watch saw no torch DataLoader or gpufeed Loader being iterated; it times those two "
            "(a loop over another iterable is not seen), in Python processes that read PYTHONPATH "
            "(not under python -I, -E or -S)",
            None,
            ["whether the run waits for data: no loader iteration was seen"],
        )
    wait = sum(loop.wait_s for loop in loops)
    step = sum(loop.step_s for loop in loops)
    stall = report.stall_fraction
    ranks = ", ".join(f"rank {loop.rank}: {loop.stall_fraction:.0%}" for loop in loops if loop.rank is not None)
    evidence = [
        f"stall {stall:.1%}: {wait:.2f} s waiting for batches against {step:.2f} s of steps"
        + (f" ({ranks})" if ranks else "")
        + f", {sum(loop.batches for loop in loops)} batches"
    ]
    undetermined: list[str] = []
    gpu = _gpu_evidence(report, evidence, undetermined)
    if stall < COMPUTE_BOUND:
        return _compute_bound(stall, gpu, evidence, undetermined)
    bound = "data-bound" if stall >= DATA_BOUND else "partly data-bound"
    fed = (wait + step) / step if step > 0 else math.inf
    cause, next_step, predicted = _data_cause(report, fed, evidence, undetermined)
    return Verdict(bound, cause, evidence, next_step, predicted, undetermined)


def _gpu_evidence(report: WatchReport, evidence: list[str], undetermined: list[str]) -> float | None:
    if not report.gpus:
        undetermined.append(
            f"{report.gpu_note}; so GPU compute cannot be told apart from host-to-device copies or the step's own Python"
        )
        return None
    util = sum(g.util_mean for g in report.gpus) / len(report.gpus)
    for g in report.gpus:
        evidence.append(
            f"GPU {g.index} ({g.name}): {g.util_mean:.0f} % busy on average (peak {g.util_max:.0f} %), "
            f"memory {g.memory_used_max / 2**30:.1f} of {g.memory_total / 2**30:.1f} GiB"
        )
    return util


def _compute_bound(stall: float, gpu: float | None, evidence: list[str], undetermined: list[str]) -> Verdict:
    bound = 1 / (1 - stall)
    if gpu is not None and gpu < 50:
        next_step = (
            "the loop is not waiting for data, yet the GPU is idle half the time or more: the time goes to the step's "
            "own Python, host-to-device copies or synchronisation, which watch cannot tell apart; profile one step "
            "(torch.profiler); make_loader copies batches on a side stream, pinned"
        )
        undetermined.append("whether the step's idle GPU time is Python in the main process or host-to-device copies")
    elif gpu is not None:
        next_step = (
            "the GPU is the limit: a faster loader would not help; see `gpufeed estimate-memory --model module:factory` "
            "for the batch size past which the GPU is saturated"
        )
    else:
        next_step = "faster data would not speed this up; the step itself (model, optimizer, copies) is the time"
    return Verdict("compute-bound", None, evidence, next_step, bound, undetermined)


def _data_cause(
    report: WatchReport, fed: float, evidence: list[str], undetermined: list[str]
) -> tuple[str, str, float | None]:
    """The limiting resource, the next step and its predicted speed-up (`fed`: the speed-up if data came free)."""
    loops = report.loops
    seconds = max(sum(loop.loop_s for loop in loops) / len(loops), 1e-6)  # each training process's loop, on average
    torch_loops = [loop for loop in loops if "torch" in loop.kind]
    evidence.append(f"if batches came at once, the loop would run {fed:.1f}x faster")
    ceiling = report.disk_ceiling_mb_s
    if report.read_mb_s < QUIET_READS_MB_S:
        evidence.append(
            f"storage reads {report.read_mb_s:.1f} MB/s: the data comes from the page cache or memory, not the disk"
        )
    elif ceiling:
        where = f" at {report.disk_measured}" if report.disk_measured else ""
        iops = f"; {report.disk_device} completed {report.disk_iops:.0f} reads/s" if report.disk_iops is not None else ""
        evidence.append(
            f"reads {report.read_mb_s:.1f} MB/s against {ceiling:.0f} MB/s measured by `gpufeed bench disk`{where}{iops}"
        )
        if report.read_mb_s >= DISK_NEAR * ceiling:
            undetermined.append("how much faster fewer bytes per sample would be: it depends on the data's sizes")
            return "disk", (
                "the disk is the limit: read fewer bytes per sample (pre-resized shards) from a faster disk; "
                "`gpufeed advise SRC --target /fast/disk` measures that on your images and predicts the speed-up"
            ), None
    else:
        undetermined.append(
            f"whether the disk is the limit: reads {report.read_mb_s:.1f} MB/s, but no `gpufeed bench disk` result "
            "is cached for the device (run `gpufeed bench disk PATH` on the dataset's folder once)"
        )
    if not torch_loops:
        return _gpufeed_cause(report, fed, seconds, evidence, undetermined)
    fetch_s = sum(loop.fetch_s for loop in torch_loops)
    fetch_cpu = sum(loop.fetch_cpu_s for loop in torch_loops)
    fetch_runq = sum(loop.fetch_runq_s for loop in torch_loops)
    in_workers = sum(loop.num_workers for loop in torch_loops)
    places = max(in_workers, len(torch_loops))
    # The workers' time per batch against the loop's (both after the first batch, whose wait holds the start):
    # at 1 the Dataset alone explains the pace; well under it the batches are ready and something else waits.
    fetched = sum(loop.fetch_batches for loop in torch_loops)
    steady = sum(loop.batches - loop.iterations for loop in torch_loops)
    loop_per_batch = sum(loop.wait_s + loop.step_s for loop in torch_loops) / max(steady, 1)
    dataset_per_batch = fetch_s / max(fetched, 1) / places * len(torch_loops)
    dataset_busy = dataset_per_batch / loop_per_batch if loop_per_batch > 0 else 1.0
    where = f"{in_workers} DataLoader workers" if in_workers else "the training process (num_workers=0)"
    cpu_share = fetch_cpu / fetch_s if fetch_s > 0 else 0.0
    if not in_workers:  # read per batch in workers only; here, the main thread's wait, shared out by time
        fetch_runq = sum(loop.runq_s * loop.fetch_s / max(loop.loop_s, 1e-6) for loop in torch_loops)
    runq_share = min(1.0 - cpu_share, fetch_runq / fetch_s) if fetch_s > 0 else 0.0
    evidence.append(
        f"the Dataset + collate took {fetch_s:.2f} s in {where}, {1e3 * dataset_per_batch:.1f} ms per batch "
        f"against the loop's {1e3 * loop_per_batch:.1f} ms ({dataset_busy:.0%}); "
        f"{cpu_share:.0%} of it on a core and {runq_share:.0%} waiting for one"
    )
    if in_workers:
        _worker_cores_evidence(torch_loops, seconds, evidence)
    cores_free = max(0.0, report.cores - _mean_cores_busy(report))
    if dataset_busy < 0.5 and in_workers:
        return "main-process", (
            "the workers are idle much of the time, yet the loop waits: the training process's own handling of "
            "batches (receiving them from the workers, pin_memory, collation of large batches) limits; "
            "make_loader hands uint8 batches over without that copy (`gpufeed advise SRC --target DIR`)"
        ), None
    cpu_bound = cpu_share + runq_share >= BUSY
    if cpu_bound:
        evidence.append(f"the machine has {report.cores} cores, about {cores_free:.1f} free on average")
        more = min(math.ceil(max(1, in_workers) * fed), max(1, in_workers) + int(cores_free))
        if more > max(1, in_workers) and in_workers < report.cores:
            predicted = min(fed, more / max(1, in_workers))
            return "cpu", (
                f"decode/dataset CPU is the limit and cores are free: DataLoader(num_workers={more}) "
                f"or `make_loader(..., num_workers={more})`; to take the decode off the CPU for good, "
                "`gpufeed advise SRC --target DIR`"
            ), predicted
        return "cpu", (
            "decode/dataset CPU is the limit and no core is free: move the decode and resize offline "
            "(`gpufeed advise SRC --target DIR` measures it and prints the `gpufeed prepare` to run; "
            "`--format npy` takes decode out entirely)"
        ), None
    now = max(1, in_workers)
    more = min(math.ceil(now * fed), max(now + 1, 4 * report.cores))  # waits overlap, but each worker costs memory
    undetermined.append(
        "what the Dataset waits on (sleep, network, locks or reads): it is not CPU, and watch does not look inside"
    )
    return "dataset", (
        f"the Dataset's __getitem__ dominates while it is mostly off the CPU (it waits on I/O, the network, "
        f"locks or sleeps): more workers overlap those waits: DataLoader(num_workers={more}); for images on disk, "
        "`gpufeed advise SRC --target DIR` measures the prepared alternative"
    ), min(fed, more / now)


def _worker_cores_evidence(loops: Sequence[LoopFigures], seconds: float, evidence: list[str]) -> None:
    workers = sum(loop.workers for loop in loops)
    if workers:
        cpu = sum(loop.workers_cpu_s for loop in loops)
        runq = sum(loop.workers_runq_s for loop in loops)
        evidence.append(
            f"the {workers} child processes (workers) kept {cpu / seconds:.2f} cores busy and waited {runq / seconds:.2f} "
            "core-seconds per second for a free core"
        )


def _mean_cores_busy(report: WatchReport) -> float:
    if not report.samples:
        return 0.0
    return sum(s.cores_busy for s in report.samples) / len(report.samples)


def _gpufeed_cause(
    report: WatchReport, fed: float, seconds: float, evidence: list[str], undetermined: list[str]
) -> tuple[str, str, float | None]:
    cpu = sum(loop.cpu_s + loop.workers_cpu_s for loop in report.loops)
    busy = cpu / seconds
    evidence.append(f"the training processes and their workers kept {busy:.2f} of {report.cores} cores busy")
    if busy >= BUSY * report.cores:
        return "cpu", (
            "the loader's decode CPU is the limit: prepare smaller shards (`gpufeed advise SRC --target DIR`), "
            "or `--format npy` to take decode out"
        ), None
    undetermined.append("why the gpufeed Loader falls behind: its CPU is not saturated and no disk ceiling shows it")
    return "undetermined", (
        "the loader falls behind without saturating the CPU: `gpufeed bench loader DATASET` and "
        "`gpufeed bench disk PATH` tell its decode from its reads"
    ), None


__all__ = ["BUSY", "COMPUTE_BOUND", "DATA_BOUND", "DISK_NEAR", "QUIET_READS_MB_S", "judge"]
