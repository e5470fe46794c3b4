"""`gpufeed watch`: is a training run waiting for data, and on what (SPEC §3).

The watched command runs unchanged. The recorder in `watch_hook/` (put first on its PYTHONPATH)
times every DataLoader and gpufeed Loader it iterates and each DataLoader fetch in the workers;
this module samples, every interval, the process tree's CPU (time on a core, and time waiting for
one, from /proc/PID/schedstat), its storage reads (/proc/PID/io), the machine's cores and, where
nvidia-ml-py and a GPU are present, each GPU's utilisation and memory. At the end `judge` reasons
the verdict from those figures: data-bound or compute-bound, the resource that limits the data,
the next step and the speed-up the figures predict.

    run_watched(command) -> WatchReport   run a command under watch (signals and exit code pass through)
    watch()                               the same for code in this process: `with watch() as w: ...`
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import psutil

from ..errors import ConfigError
from ..units import wait_share
from .watch_hook import ENV_DIR, HOOK_DIR

DATA_BOUND = 0.25  # stall fraction from which the data is the limit
COMPUTE_BOUND = 0.10  # below it, faster data would change little
BUSY = 0.7  # a Dataset on a core (or waiting for one) this much of its time is CPU-bound
DISK_NEAR = 0.7  # reads at this share of the measured ceiling are the limit
QUIET_READS_MB_S = 1.0  # below it the disk plays no part
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


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
    tree's storage reads (page-cache hits excluded) per second of the training loop.
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


# ---------------------------------------------------------------------------
# sampling


class _Records:
    """The last totals each watched process wrote (one JSON line per flush, one file per process)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.offsets: dict[str, int] = {}
        self.last: dict[int, dict[str, Any]] = {}

    def read(self) -> dict[int, dict[str, Any]]:
        try:
            names = os.listdir(self.directory)
        except OSError:
            return self.last
        for name in names:
            if not name.endswith(".jsonl"):
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as file:
                    file.seek(self.offsets.get(name, 0))
                    chunk = file.read()
            except OSError:
                continue
            complete = chunk.rfind(b"\n") + 1
            if not complete:
                continue
            self.offsets[name] = self.offsets.get(name, 0) + complete
            for line in reversed(chunk[:complete].splitlines()):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                self.last[int(record["pid"])] = record
                break
        return self.last


@dataclasses.dataclass
class _Proc:
    pid: int
    ppid: int
    cpu_s: float = 0.0
    runq_s: float = 0.0
    read_bytes: int = 0
    read_count: int = 0


class _Tree:
    """CPU, run-queue and read counters of a process tree, kept for processes that have exited."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.procs: dict[int, _Proc] = {}
        self.handles: dict[int, psutil.Process] = {}
        self.devices: dict[int, int] = {}  # st_dev -> files seen open on it (the dataset's filesystem)

    def sample(self) -> None:
        try:
            root = self.handles.get(self.root) or psutil.Process(self.root)
            self.handles[self.root] = root
            members = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for process in members:
            handle = self.handles.setdefault(process.pid, process)
            try:
                with handle.oneshot():
                    times = handle.cpu_times()
                    ppid = handle.ppid()
                    try:
                        io = handle.io_counters()
                    except (psutil.Error, AttributeError):
                        io = None
            except psutil.Error:
                continue
            proc = self.procs.setdefault(process.pid, _Proc(process.pid, ppid))
            proc.cpu_s = times.user + times.system
            if io is not None:
                proc.read_bytes, proc.read_count = io.read_bytes, io.read_count
            proc.runq_s = max(proc.runq_s, _runq_s(process.pid))
            self._count_open_files(handle)

    def _count_open_files(self, handle: psutil.Process) -> None:
        try:
            files = handle.open_files()
        except psutil.Error:
            return
        for file in files:
            try:
                device = os.stat(file.path).st_dev
            except OSError:
                continue
            self.devices[device] = self.devices.get(device, 0) + 1

    def children_of(self, pid: int) -> list[_Proc]:
        return [proc for proc in self.procs.values() if proc.ppid == pid]

    def totals(self) -> tuple[float, int, int]:
        procs = self.procs.values()
        return sum(p.cpu_s for p in procs), sum(p.read_bytes for p in procs), sum(p.read_count for p in procs)


def _runq_s(pid: int) -> float:
    """Seconds the process's main thread waited for a core (0 where the kernel keeps no schedstat)."""
    try:
        with open(f"/proc/{pid}/schedstat") as file:
            return int(file.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class _Gpus:
    """Utilisation and memory of each GPU through NVML, where nvidia-ml-py and a driver are present."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.names: list[str] = []
        self.util: list[list[float]] = []
        self.memory: list[int] = []
        self.total: list[int] = []
        self.note = ""
        try:
            import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
        except ImportError:
            self.note = "no NVML (nvidia-ml-py is not installed: pip install 'gpufeed[gpu]'): GPU utilisation unknown"
            return
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            for index in range(count):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                name = pynvml.nvmlDeviceGetName(handle)
                self.handles.append(handle)
                self.names.append(name.decode() if isinstance(name, bytes) else str(name))
                self.util.append([])
                self.memory.append(0)
                self.total.append(0)
        except Exception as exc:  # NVMLError and its many subclasses: no driver, no device
            self.note = f"NVML did not start ({exc}): GPU utilisation unknown"
            self.handles = []
            return
        if not self.handles:
            self.note = "NVML sees no GPU: GPU utilisation unknown"

    def sample(self) -> tuple[float | None, int | None]:
        if not self.handles:
            return None, None
        utils, used = [], 0
        for index, handle in enumerate(self.handles):
            try:
                util = float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception:
                continue
            self.util[index].append(util)
            self.memory[index] = max(self.memory[index], int(memory.used))
            self.total[index] = int(memory.total)
            utils.append(util)
            used += int(memory.used)
        return (sum(utils) / len(utils) if utils else None), used

    def figures(self) -> list[GpuFigures]:
        return [
            GpuFigures(i, self.names[i], sum(u) / len(u), max(u), self.memory[i], self.total[i])
            for i, u in enumerate(self.util)
            if u
        ]

    def close(self) -> None:
        if self.handles:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()


def _loop_totals(record: Mapping[str, Any]) -> tuple[int, int, float, float]:
    parts = [record.get("torch", {}), record.get("gpufeed", {})]
    return (
        sum(p.get("batches", 0) for p in parts),
        sum(p.get("samples", 0) for p in parts),
        sum(p.get("wait_s", 0.0) for p in parts),
        sum(p.get("step_s", 0.0) for p in parts),
    )


class Sampler:
    """Samples a process tree and the recorder's files every interval; `report()` makes the WatchReport."""

    def __init__(self, root: int, directory: str, command: Sequence[str], disk_ceiling_mb_s: float | None = None) -> None:
        """Start sampling the tree under `root`; `disk_ceiling_mb_s` None: a cached `bench disk` of its files' disk."""
        self.tree = _Tree(root)
        self.records = _Records(directory)
        self.gpus = _Gpus()
        self.command = list(command)
        self.disk_ceiling_mb_s = disk_ceiling_mb_s
        self.started = time.monotonic()
        self.samples: list[WatchSample] = []
        self.cores = _cores()
        self._last: tuple[float, int, float, float, dict[int, float], int, int] | None = None
        self._device_reads: tuple[str, int | None] = ("", None)
        psutil.cpu_percent(percpu=True)
        self.tree.sample()
        self._last = self._point()

    def _point(self) -> tuple[float, int, float, float, dict[int, float], int, int]:
        batches, wait, step = 0, 0.0, 0.0
        for record in self.records.read().values():
            b, _, w, st = _loop_totals(record)
            batches, wait, step = batches + b, wait + w, step + st
        cpu = {pid: proc.cpu_s for pid, proc in self.tree.procs.items()}
        _, read_bytes, reads = self.tree.totals()
        return time.monotonic(), batches, wait, step, cpu, read_bytes, reads

    def _samples_total(self) -> int:
        return sum(_loop_totals(r)[1] for r in self.records.last.values())

    def _loop_pids(self) -> list[int]:
        return [pid for pid, record in self.records.last.items() if _loop_totals(record)[0] > 0]

    def sample(self) -> WatchSample:
        """One interval's figures (also kept for the report)."""
        samples_before = self._samples_total()
        self.tree.sample()
        point = self._point()
        assert self._last is not None
        then, batches0, wait0, step0, cpu0, bytes0, reads0 = self._last
        now, batches, wait, step, cpu, read_bytes, reads = point
        self._last = point
        span = max(now - then, 1e-6)
        loops = set(self._loop_pids())
        used = {pid: cpu[pid] - cpu0.get(pid, 0.0) for pid in cpu}
        loop_cpu = sum(seconds for pid, seconds in used.items() if pid in loops)
        loop_time = (wait - wait0) + (step - step0)
        gpu_util, gpu_memory = self.gpus.sample()
        busy = psutil.cpu_percent(percpu=True)
        device, completed = _device_reads(self.tree.devices)
        before = self._device_reads if self._device_reads[0] == device else (device, None)
        self._device_reads = (device, completed)
        sample = WatchSample(
            elapsed_s=now - self.started,
            stall_fraction=(wait - wait0) / loop_time if loop_time > 0 else None,
            batches_per_s=(batches - batches0) / span,
            images_per_s=(self._samples_total() - samples_before) / span,
            gpu_util=gpu_util,
            gpu_memory=gpu_memory,
            cores_busy=sum(busy) / 100.0,
            loop_cores=loop_cpu / span,
            worker_cores=(sum(used.values()) - loop_cpu) / span,
            read_mb_s=(read_bytes - bytes0) / span / 1e6,
            reads_per_s=(reads - reads0) / span,
            per_core_busy=list(busy),
            device=device,
            device_iops=(completed - before[1]) / span if completed is not None and before[1] is not None else None,
        )
        self.samples.append(sample)
        return sample

    def report(self, exit_code: int | None) -> WatchReport:
        """The totals over the whole run, and the verdict."""
        self.tree.sample()
        records = self.records.read()
        seconds = time.monotonic() - self.started
        loops = [_loop_figures(pid, record, records, self.tree) for pid, record in sorted(records.items())]
        loops = [loop for loop in loops if loop.batches > 0]
        _, read_bytes, _ = self.tree.totals()
        looped = max((loop.loop_s for loop in loops), default=0.0) or seconds  # reads come while the loop runs
        gpus = self.gpus.figures()
        self.gpus.close()
        ceiling, disk = self.disk_ceiling_mb_s, ""
        if ceiling is None:
            ceiling, disk = _remembered_ceiling(self.tree.devices)
        report = WatchReport(
            command=self.command,
            exit_code=exit_code,
            seconds=seconds,
            cores=self.cores,
            loops=loops,
            gpus=gpus,
            gpu_note=self.gpus.note,
            read_bytes=read_bytes,
            read_mb_s=read_bytes / max(looped, 1e-6) / 1e6,
            disk_ceiling_mb_s=ceiling,
            disk_measured=disk,
            samples=self.samples,
            verdict=Verdict("unknown", None, [], "", None, []),
        )
        iops = [sample.device_iops for sample in self.samples if sample.device_iops is not None]
        report.disk_device = next((sample.device for sample in reversed(self.samples) if sample.device), "")
        report.disk_iops = sum(iops) / len(iops) if iops else None
        if self.samples:
            cores = [sample.per_core_busy for sample in self.samples if sample.per_core_busy]
            report.per_core_busy = [sum(column) / len(column) for column in zip(*cores)] if cores else []
        report.verdict = judge(report)
        return report


def _device_reads(devices: Mapping[int, int]) -> tuple[str, int | None]:
    """The block device the run has most files open on, and the reads it has completed (/proc/diskstats)."""
    if not devices:
        return "", None
    device = max(devices, key=devices.__getitem__)
    try:
        name = os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"))
        counters = psutil.disk_io_counters(perdisk=True) or {}
    except (OSError, RuntimeError):
        return "", None
    found = counters.get(name)
    return (name, int(found.read_count)) if found is not None else ("", None)


def _remembered_ceiling(devices: Mapping[int, int]) -> tuple[float | None, str]:
    from .disk import remembered_results

    results = remembered_results()
    for device in sorted(devices, key=devices.__getitem__, reverse=True):
        entry = results.get(device)
        if entry and entry.get("seq_read_mb_s"):
            return float(entry["seq_read_mb_s"]), str(entry.get("path", ""))
    return None, ""


def _loop_figures(pid: int, record: Mapping[str, Any], records: Mapping[int, Mapping[str, Any]], tree: _Tree) -> LoopFigures:
    torch_loop, gpufeed_loop = record.get("torch", {}), record.get("gpufeed", {})
    kinds = [name for name, part in (("torch", torch_loop), ("gpufeed", gpufeed_loop)) if part.get("batches")]
    batches, samples, wait, step = _loop_totals(record)
    loop = LoopFigures(
        pid=pid,
        rank=record.get("rank"),
        kind="+".join(kinds) or "none",
        batches=batches,
        samples=samples,
        wait_s=wait,
        step_s=step,
        first_s=torch_loop.get("first_s", 0.0) + gpufeed_loop.get("first_s", 0.0),
        iterations=torch_loop.get("iterations", 0) + gpufeed_loop.get("iterations", 0),
        num_workers=max(torch_loop.get("num_workers", 0), gpufeed_loop.get("num_workers", 0)),
    )
    # The Dataset's time: in this process's workers (their records name this process as parent), or here.
    fetchers = [r for r in records.values() if r.get("ppid") == pid and r.get("worker")] or [record]
    for fetcher in fetchers:
        fetch = fetcher.get("fetch", {})
        loop.fetch_s += fetch.get("seconds", 0.0)
        loop.fetch_cpu_s += fetch.get("cpu_s", 0.0)
        loop.fetch_runq_s += fetch.get("runq_s", 0.0)
        loop.fetch_batches += fetch.get("batches", 0)
    own = tree.procs.get(pid)
    loop.cpu_s = own.cpu_s if own else 0.0
    loop.runq_s = own.runq_s if own else 0.0
    children = tree.children_of(pid)
    loop.workers = len(children)
    loop.workers_cpu_s = sum(child.cpu_s for child in children)
    loop.workers_runq_s = sum(child.runq_s for child in children)
    return loop


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------
# the verdict


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
        _worker_cores(torch_loops, seconds, evidence)
    cores_free = max(0.0, report.cores - _cores_busy(report))
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


def _worker_cores(loops: Sequence[LoopFigures], seconds: float, evidence: list[str]) -> None:
    workers = sum(loop.workers for loop in loops)
    if workers:
        cpu = sum(loop.workers_cpu_s for loop in loops)
        runq = sum(loop.workers_runq_s for loop in loops)
        evidence.append(
            f"the {workers} child processes (workers) kept {cpu / seconds:.2f} cores busy and waited {runq / seconds:.2f} "
            "core-seconds per second for a free core"
        )


def _cores_busy(report: WatchReport) -> float:
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


# ---------------------------------------------------------------------------
# running


def hook_environment(directory: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a watched command: the hook first on PYTHONPATH, the records' folder named."""
    env = dict(os.environ if base is None else base)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = HOOK_DIR + (os.pathsep + rest if rest else "")
    env[ENV_DIR] = directory
    return env


def run_watched(
    command: Sequence[str],
    *,
    interval_s: float = 5.0,
    on_sample: Callable[[WatchSample], None] | None = None,
    disk_ceiling_mb_s: float | None = None,
) -> WatchReport:
    """Run `command` under watch until it exits; signals sent to this process are passed to it.

    Args:
        command: the program and its arguments, run unchanged (own process group).
        interval_s: seconds between samples.
        on_sample: called with each interval's figures (the live line).
        disk_ceiling_mb_s: the read ceiling of the dataset's disk, if measured.

    Returns:
        the report; its `exit_code` is the command's (128 + N when a signal N ended it).

    Raises:
        ConfigError: the command is empty or cannot be started.
    """
    if not command:
        raise ConfigError("give the command to watch after --, e.g. gpufeed watch -- python train.py")
    if interval_s <= 0:
        raise ConfigError(f"the interval must be positive, got {interval_s}")
    with tempfile.TemporaryDirectory(prefix="gpufeed-watch-") as directory:
        try:
            child = subprocess.Popen(list(command), env=hook_environment(directory), **_own_group())
        except OSError as exc:
            raise ConfigError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from exc
        with _forward_signals(child), _terminal_to(child):
            sampler = Sampler(child.pid, directory, command, disk_ceiling_mb_s)
            while True:
                try:
                    code = child.wait(timeout=interval_s)
                    break
                except subprocess.TimeoutExpired:
                    sample = sampler.sample()
                    if on_sample is not None:
                        on_sample(sample)
        return sampler.report(128 - code if code < 0 else code)


def _own_group() -> dict[str, Any]:
    # Its own process group, so a signal reaches it once: from us, to the whole group, as a terminal sends it.
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.10


@contextlib.contextmanager
def _terminal_to(child: subprocess.Popen[bytes]) -> Iterator[None]:
    """On a terminal, the command's group takes the foreground (it reads stdin, a debugger works, Ctrl-C goes to it
    straight), and it comes back to ours at the end, as a shell does for a job."""
    try:
        ours = os.getpgrp()
        handed = os.isatty(0) and os.tcgetpgrp(0) == ours
    except OSError:
        handed = False
    if handed:
        with _ttou_ignored(), contextlib.suppress(OSError):
            os.tcsetpgrp(0, child.pid)
    try:
        yield
    finally:
        if handed:
            with _ttou_ignored(), contextlib.suppress(OSError):
                os.tcsetpgrp(0, ours)


@contextlib.contextmanager
def _ttou_ignored() -> Iterator[None]:
    # A process not in the foreground group that sets the foreground group gets SIGTTOU, which would stop it.
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTTOU, previous)


@contextlib.contextmanager
def _forward_signals(child: subprocess.Popen[bytes]) -> Iterator[None]:
    """Ctrl-C and kill go to the watched command's process group (as the terminal would send them)."""

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _FORWARDED:
            previous[signum] = signal.signal(signum, forward)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class Watch:
    """`with watch() as w:` — the loaders iterated inside are timed; `w.report()` after the block."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._report: WatchReport | None = None
        self._stop = threading.Event()

    def __enter__(self) -> Watch:
        from .watch_hook import gpufeed_watch_hook as hook

        self._hook = hook
        self._dir = tempfile.TemporaryDirectory(prefix="gpufeed-watch-")
        hook.start(self._dir.name)
        self._sampler = Sampler(os.getpid(), self._dir.name, sys.argv)
        self._thread = threading.Thread(target=self._sample, name="gpufeed-watch", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            recorder = self._hook.active()
            if recorder is not None:
                recorder.flush()
            self._sampler.sample()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._hook.stop()
        self._report = self._sampler.report(None)
        self._dir.cleanup()

    def report(self) -> WatchReport:
        """The figures and the verdict of the block (after it ended)."""
        if self._report is None:
            raise RuntimeError("the report is ready once the `with watch()` block has ended")
        return self._report


def watch(interval_s: float = 1.0) -> Watch:
    """Watch the loaders this process iterates inside a `with` block.

    Example:
        with pipeline.measure.watch() as w:
            for images, labels in loader:
                ...
        print(w.report().verdict.bound)
    """
    return Watch(interval_s)


__all__ = [
    "GpuFigures", "LoopFigures", "Verdict", "Watch", "WatchReport", "WatchSample", "hook_environment",
    "judge", "run_watched", "watch",
]
