"""The verdict of `gpufeed watch`: data-bound or compute-bound, what limits the data, and the next step.

`judge(report)` reasons only from the figures of a `WatchReport`, about the training loop (the
evaluation loaders' share of the time is reported apart); every figure it rests on goes into the
verdict's evidence (in words, and as numbers in `figures`), and what the figures cannot tell apart
into `undetermined`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .report import LoopFigures, Verdict, WatchReport

DATA_BOUND = 0.25  # stall fraction from which the data is the limit
COMPUTE_BOUND = 0.10  # below it, faster data would change little
BUSY = 0.7  # a Dataset on a core (or waiting for one) this much of its time is CPU-bound
DISK_NEAR = 0.7  # reads at this share of the measured ceiling are the limit
DISK_BUSY = 0.5  # a device with a request in flight this share of the time the loop waited for data is the limit
QUIET_READS_MB_S = 1.0  # below it the disk plays no part
OWN_TRAFFIC = 0.9  # the run's reads under this share of the device's bytes: the evidence says so
OWN_MAJORITY = 0.5  # the run's reads at least this share of the device's bytes: its busy time is the run's
MANY_TENSORS = 1000  # tensors per batch from which handing them over costs more than their bytes


def judge(report: WatchReport) -> Verdict:
    """Data-bound or compute-bound, and what limits the data: reasoned only from the report's figures."""
    if not report.loops:
        return Verdict(
            "unknown", None,
            [f"CPU {report.cores} cores, reads {report.read_mb_s:.1f} MB/s"],
            "watch saw no torch DataLoader or gpufeed Loader being iterated; it times those two "
            "(a loop over another iterable is not seen), in Python processes that read PYTHONPATH "
            "(not under python -I, -E or -S)",
            None,
            ["whether the run waits for data: no loader iteration was seen"],
            {"cores": report.cores, "read_mb_s": report.read_mb_s},
        )
    loops = report.training_loops
    wait = sum(loop.wait_s + loop.first_s for loop in loops)
    step = sum(loop.step_s for loop in loops)
    stall = report.stall_fraction
    ranks = ", ".join(f"rank {loop.rank}: {loop.stall_fraction:.0%}" for loop in loops if loop.rank is not None)
    evidence = [
        f"stall {stall:.1%}: {wait:.2f} s waiting for training batches (first ones included) against "
        f"{step:.2f} s of steps" + (f" ({ranks})" if ranks else "") + f", {sum(loop.batches for loop in loops)} batches"
    ]
    figures: dict[str, float | int | str | None] = {
        "stall_fraction": stall, "wait_s": wait, "step_s": step, "batches": sum(loop.batches for loop in loops),
        "cores": report.cores, "validation_share": report.validation_share,
    }  # fmt: skip
    evaluation = [loop for loop in report.loops if loop.role == "evaluation"]
    if evaluation and len(evaluation) < len(report.loops):
        evidence.append(
            f"evaluation ({len(evaluation)} loader(s), {sum(loop.batches for loop in evaluation)} batches) took "
            f"{report.validation_share:.0%} of the wall time, apart from the training figures"
        )
    undetermined: list[str] = []
    gpu = _gpu_evidence(report, evidence, figures, undetermined)
    outside = _outside_share(loops, wait + step, evidence, figures)
    if outside >= max(stall, COMPUTE_BOUND) and outside + stall >= COMPUTE_BOUND:
        bound = "data-bound" if outside + stall >= DATA_BOUND else "partly data-bound"
        return Verdict(bound, "loop-cpu", evidence, (
            "CPU work in the training loop outside the model step (augmentation, collate, host copies between "
            "next() and the step) holds it up: move it into the Dataset (run by the DataLoader's workers) or "
            "onto the device (batch transforms on the GPU after .to(device))"
        ), 1 / (1 - outside), undetermined, figures)  # fmt: skip
    if stall < COMPUTE_BOUND:
        return _compute_bound(stall, gpu, evidence, undetermined, figures)
    bound = "data-bound" if stall >= DATA_BOUND else "partly data-bound"
    fed = (wait + step) / step if step > 0 else math.inf
    cause, next_step, predicted = _data_cause(report, loops, fed, evidence, undetermined, figures)
    return Verdict(bound, cause, evidence, next_step, predicted, undetermined, figures)


def _outside_share(loops: Sequence[LoopFigures], loop_s: float, evidence: list[str], figures: dict) -> float:
    """The loop's share of CPU work outside the model step (0 when no model step was seen to compare with)."""
    model = sum(loop.model_s for loop in loops)
    outside_cpu = sum(loop.outside_cpu_s for loop in loops)
    figures.update(model_s=model, outside_s=sum(loop.outside_s for loop in loops), outside_cpu_s=outside_cpu)
    if model <= 0 or loop_s <= 0:
        return 0.0
    share = outside_cpu / loop_s
    evidence.append(
        f"the steps' sampled time: {model:.2f} s in the model, {figures['outside_s']:.2f} s outside it "
        f"({outside_cpu:.2f} s on a core: {share:.0%} of the loop)"
    )
    figures["outside_share"] = share
    return share


def _gpu_evidence(report: WatchReport, evidence: list[str], figures: dict, undetermined: list[str]) -> float | None:
    if not report.gpus:
        undetermined.append(
            f"{report.gpu_note}; so GPU compute cannot be told apart from host-to-device copies or the step's own Python"
        )
        return None
    util = sum(g.util_mean for g in report.gpus) / len(report.gpus)
    figures["gpu_util"] = util
    for g in report.gpus:
        evidence.append(
            f"GPU {g.index} ({g.name}): {g.util_mean:.0f} % busy on average (peak {g.util_max:.0f} %), "
            f"memory {g.memory_used_max / 2**30:.1f} of {g.memory_total / 2**30:.1f} GiB"
        )
    return util


def _compute_bound(stall: float, gpu: float | None, evidence: list[str], undetermined: list[str], figures: dict) -> Verdict:
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
    return Verdict("compute-bound", None, evidence, next_step, bound, undetermined, figures)


def _disk_cause(report: WatchReport, evidence: list[str], undetermined: list[str], figures: dict) -> str | None:
    """The next step when the process's and the device's own counters show the disk as the limit, else None."""
    ceiling, busy = report.disk_ceiling_mb_s, report.disk_busy
    cached = 1 - report.read_bytes / report.read_chars if report.read_chars > report.read_bytes else 0.0
    figures.update(read_mb_s=report.read_mb_s, page_cache_share=cached, disk_busy=busy, iowait=report.iowait,
                   disk_ceiling_mb_s=ceiling)  # fmt: skip
    if report.read_mb_s < QUIET_READS_MB_S:
        evidence.append(
            f"storage reads {report.read_mb_s:.1f} MB/s: the data comes from the page cache or memory, not the disk"
        )
        return None
    device = report.disk_device or "the device"
    own = report.disk_own_share
    busy_text = f", {device} busy {busy:.0%} of the time" if busy is not None else ""
    if busy is not None and own is not None and own < OWN_TRAFFIC:
        busy_text += f" (the run's reads {own:.0%} of its traffic)"
    iowait = f", CPU in I/O wait {report.iowait:.0%}" if report.iowait is not None else ""
    evidence.append(
        f"storage reads {report.read_mb_s:.1f} MB/s ({cached:.0%} of the bytes read came from the page cache)"
        f"{busy_text}{iowait}"
    )
    near = bool(ceiling) and report.read_mb_s >= DISK_NEAR * (ceiling or 0)
    if ceiling:
        where = f" at {report.disk_measured}" if report.disk_measured else ""
        evidence.append(f"reads against {ceiling:.0f} MB/s measured by `gpufeed bench disk`{where}")
    # Busy over the time the loop waited, not the whole loop: a disk at work while the loop waits is what holds it up,
    # however much of that waiting CPU contention stretches. Where the run's reads are under half the device's traffic,
    # only their share of its busy time counts: another process's writes (or reads) keep it busy without the loop.
    ours = busy * (own if own is not None and own < OWN_MAJORITY else 1.0) if busy is not None else None
    figures["disk_busy_own"] = ours
    busy_while_waiting = ours / report.stall_fraction if ours is not None and report.stall_fraction > 0 else None
    figures["disk_busy_while_waiting"] = busy_while_waiting
    if near or (busy_while_waiting is not None and busy_while_waiting >= DISK_BUSY):
        undetermined.append("how much faster fewer bytes per sample would be: it depends on the data's sizes")
        return (
            "the disk is the limit (more workers would queue on it): read fewer bytes per sample (pre-resized "
            "shards) or from a faster disk; `gpufeed advise SRC --target /fast/disk` measures that on your images"
        )
    if busy is None and not ceiling:
        undetermined.append(f"whether the disk is the limit: reads {report.read_mb_s:.1f} MB/s, its busy share unknown")
    return None


def _data_cause(
    report: WatchReport, loops: Sequence[LoopFigures], fed: float, evidence: list[str], undetermined: list[str],
    figures: dict,
) -> tuple[str, str, float | None]:  # fmt: skip
    """The limiting resource, the next step and its predicted speed-up (`fed`: the speed-up if data came free)."""
    processes = len({loop.pid for loop in loops})
    seconds = max(sum(loop.loop_s for loop in loops) / processes, 1e-6)  # each training process's loop, on average
    evidence.append(f"if batches came at once, the loop would run {fed:.1f}x faster")
    figures["fed_speedup"] = fed
    disk = _disk_cause(report, evidence, undetermined, figures)
    if disk is not None:
        return "disk", disk, None
    cores_free = max(0.0, report.cores - _mean_cores_busy(report))
    figures["cores_free"] = cores_free
    torch_loops = [loop for loop in loops if loop.kind == "torch"]
    if not torch_loops:
        return _gpufeed_cause(report, loops, fed, seconds, cores_free, evidence, undetermined, figures)
    return _torch_cause(report, torch_loops, fed, seconds, cores_free, evidence, undetermined, figures)


def _torch_cause(
    report: WatchReport, loops: Sequence[LoopFigures], fed: float, seconds: float, cores_free: float,
    evidence: list[str], undetermined: list[str], figures: dict,
) -> tuple[str, str, float | None]:  # fmt: skip
    fetch_s = sum(loop.fetch_s for loop in loops)
    fetch_cpu = sum(loop.fetch_cpu_s for loop in loops)
    fetch_runq = sum(loop.fetch_runq_s for loop in loops)
    in_workers = sum(loop.num_workers for loop in loops)
    places = max(in_workers, len(loops))
    # The workers' time per batch against the loop's (both after the first batch, whose wait holds the start):
    # at 1 the Dataset alone explains the pace; well under it the batches are ready and something else waits.
    fetched = sum(loop.fetch_batches for loop in loops)
    steady = sum(loop.batches - loop.iterations for loop in loops)
    loop_per_batch = sum(loop.wait_s + loop.step_s for loop in loops) / max(steady, 1)
    dataset_per_batch = fetch_s / max(fetched, 1) / places * len(loops)
    dataset_busy = dataset_per_batch / loop_per_batch if loop_per_batch > 0 else 1.0
    where = f"{in_workers} DataLoader workers" if in_workers else "the training process (num_workers=0)"
    cpu_share = fetch_cpu / fetch_s if fetch_s > 0 else 0.0
    if not in_workers:  # read per batch in workers only; here, the main thread's wait, shared out by time
        fetch_runq = sum(loop.runq_s * loop.fetch_s / max(loop.loop_s, 1e-6) for loop in _per_process(loops))
    runq_share = min(1.0 - cpu_share, fetch_runq / fetch_s) if fetch_s > 0 else 0.0
    figures.update(dataset_s=fetch_s, dataset_per_batch_s=dataset_per_batch, loop_per_batch_s=loop_per_batch,
                   dataset_cpu_share=cpu_share, dataset_runq_share=runq_share, num_workers=in_workers)  # fmt: skip
    evidence.append(
        f"the Dataset + collate took {fetch_s:.2f} s in {where}, {1e3 * dataset_per_batch:.1f} ms per batch "
        f"against the loop's {1e3 * loop_per_batch:.1f} ms ({dataset_busy:.0%}); "
        f"{cpu_share:.0%} of it on a core and {runq_share:.0%} waiting for one"
    )
    if in_workers:
        _worker_cores_evidence(loops, seconds, evidence)
    tensors = max(loop.tensors for loop in loops)
    figures["tensors_per_batch"] = tensors
    if dataset_busy < 0.5 and in_workers:
        stacked = ""
        if tensors >= MANY_TENSORS:
            evidence.append(f"each batch holds {tensors} tensors: each one is handed over from the workers on its own")
            stacked = (
                f"; with {tensors} tensors per batch, return fewer, stacked tensors per sample "
                "(one array per field instead of one tensor per item)"
            )
        return "main-process", (
            "the workers are idle much of the time, yet the loop waits: the training process's own handling of "
            "batches (receiving them from the workers, pin_memory, collation of large batches) limits" + stacked
            + ("" if stacked else "; make_loader hands uint8 batches over without that copy (`gpufeed advise SRC`)")
        ), None
    if cpu_share + runq_share >= BUSY:
        return _more_workers(report, in_workers, fed, cores_free, "decode/dataset CPU", evidence)
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


def _more_workers(
    report: WatchReport, workers: int, fed: float, cores_free: float, what: str, evidence: list[str],
    gpufeed: bool = False,
) -> tuple[str, str, float | None]:  # fmt: skip
    """CPU-bound data: more workers where cores are free (a free share of half a core or more counts), else offline."""
    evidence.append(f"the machine has {report.cores} cores, about {cores_free:.1f} free on average")
    now = max(1, workers)
    more = min(math.ceil(now * fed), now + round(cores_free))
    setting = f"`make_loader(..., num_workers={more})`" if gpufeed else (
        f"DataLoader(num_workers={more}) or `make_loader(..., num_workers={more})`"
    )  # fmt: skip
    if more > now:
        return "cpu", (
            f"{what} is the limit and about {cores_free:.1f} cores are free: {setting}; to take the decode off "
            "the CPU for good, `gpufeed advise SRC --target DIR`"
        ), min(fed, more / now)
    return "cpu", (
        f"{what} is the limit and less than half a core is free (about {cores_free:.1f}): move the decode and "
        "resize offline (`gpufeed advise SRC --target DIR` measures it and prints the `gpufeed prepare` to run; "
        "`--format npy` takes decode out entirely)"
    ), None


def _per_process(loops: Sequence[LoopFigures]) -> list[LoopFigures]:
    """One loader per process (process-wide figures such as cpu_s are on each of its loaders)."""
    return list({loop.pid: loop for loop in loops}.values())


def _worker_cores_evidence(loops: Sequence[LoopFigures], seconds: float, evidence: list[str]) -> None:
    """The workers' cores: the larger of their processes' last sampled counters (stale for a worker that
    ended between samples) and what their own records timed of the Dataset (exact, but only the Dataset)."""
    workers = sum(loop.workers for loop in loops)
    if workers:
        cpu = max(sum(loop.workers_cpu_s for loop in loops), sum(loop.fetch_cpu_s for loop in loops))
        runq = max(sum(loop.workers_runq_s for loop in loops), sum(loop.fetch_runq_s for loop in loops))
        evidence.append(
            f"the {workers} worker processes kept {cpu / seconds:.2f} cores busy and waited "
            f"{runq / seconds:.2f} core-seconds per second for a free core"
        )


def _mean_cores_busy(report: WatchReport) -> float:
    """The machine's busy cores while the loop ran (the intervals with batches; all of them if none had any):
    the free cores a worker more would find, not those of the command's imports."""
    looping = [s for s in report.samples if s.batches_per_s > 0] or report.samples
    if not looping:
        return 0.0
    return sum(s.cores_busy for s in looping) / len(looping)


def _gpufeed_cause(
    report: WatchReport, loops: Sequence[LoopFigures], fed: float, seconds: float, cores_free: float,
    evidence: list[str], undetermined: list[str], figures: dict,
) -> tuple[str, str, float | None]:  # fmt: skip
    processes = _per_process(loops)
    cpu = sum(loop.cpu_s + loop.workers_cpu_s for loop in processes)
    runq = sum(loop.runq_s + loop.workers_runq_s for loop in processes)
    # Process-wide counters cover each process's whole life (its imports too): shared over the run's wall time.
    lifetime = max(report.seconds, seconds)
    busy, waiting = cpu / lifetime, runq / lifetime
    figures.update(loader_cores=busy, loader_runq_cores=waiting)
    evidence.append(
        f"the training processes and their decode threads kept {busy:.2f} of {report.cores} cores busy and "
        f"waited {waiting:.2f} core-seconds per second for a free core"
    )
    workers = max(loop.num_workers for loop in loops)
    if busy >= BUSY * report.cores or cores_free < 0.5 or waiting >= 0.25 * max(busy, 1e-6):
        return _more_workers(report, workers, fed, cores_free, "the loader's decode CPU", evidence, gpufeed=True)
    undetermined.append("why the gpufeed Loader falls behind: its CPU is not saturated and no disk ceiling shows it")
    return "undetermined", (
        "the loader falls behind without saturating the CPU: `gpufeed bench loader DATASET` and "
        "`gpufeed bench disk PATH` tell its decode from its reads"
    ), None


__all__ = ["BUSY", "COMPUTE_BOUND", "DATA_BOUND", "DISK_BUSY", "DISK_NEAR", "QUIET_READS_MB_S", "judge"]
