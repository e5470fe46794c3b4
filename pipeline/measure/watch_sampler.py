"""The sampling of `gpufeed watch`: a process tree, the recorder's files and the GPUs, every interval.

Each interval `Sampler.sample()` reads the process tree's CPU (time on a core, and time waiting for
one, from /proc/PID/schedstat), its storage reads (/proc/PID/io), the machine's cores, the totals the
recorder in `watch_hook/` wrote for each watched process (checked as untrusted input: `watch_records`)
and, where nvidia-ml-py and a GPU are present, each GPU's utilisation and memory. `Sampler.report()`
adds them up into the WatchReport and has `watch_verdict.judge` reason its verdict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

from .watch_records import RecorderFiles
from .watch_report import GpuFigures, LoopFigures, Verdict, WatchReport, WatchSample
from .watch_verdict import judge


@dataclasses.dataclass
class _ProcessCounters:
    pid: int
    ppid: int
    cpu_s: float = 0.0
    runq_s: float = 0.0
    read_bytes: int = 0
    read_count: int = 0


class _ProcessTree:
    """CPU, run-queue and read counters of a process tree, kept for processes that have exited."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.procs: dict[int, _ProcessCounters] = {}
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
            proc = self.procs.setdefault(process.pid, _ProcessCounters(process.pid, ppid))
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

    def children_of(self, pid: int) -> list[_ProcessCounters]:
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


class _NvmlGpus:
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
        self.tree = _ProcessTree(root)
        self.records = RecorderFiles(directory)
        self.gpus = _NvmlGpus()
        self.command = list(command)
        self.disk_ceiling_mb_s = disk_ceiling_mb_s
        self.started = time.monotonic()
        self.samples: list[WatchSample] = []
        self.cores = _usable_cores()
        self._previous_totals: tuple[float, int, float, float, dict[int, float], int, int] | None = None
        self._last_device_reads: tuple[str, int | None] = ("", None)
        psutil.cpu_percent(percpu=True)
        self.tree.sample()
        self._previous_totals = self._totals_now()

    def _totals_now(self) -> tuple[float, int, float, float, dict[int, float], int, int]:
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
        point = self._totals_now()
        assert self._previous_totals is not None
        then, batches0, wait0, step0, cpu0, bytes0, reads0 = self._previous_totals
        now, batches, wait, step, cpu, read_bytes, reads = point
        self._previous_totals = point
        span = max(now - then, 1e-6)
        loops = set(self._loop_pids())
        used = {pid: cpu[pid] - cpu0.get(pid, 0.0) for pid in cpu}
        loop_cpu = sum(seconds for pid, seconds in used.items() if pid in loops)
        loop_time = (wait - wait0) + (step - step0)
        gpu_util, gpu_memory = self.gpus.sample()
        busy = psutil.cpu_percent(percpu=True)
        device, completed = _busiest_device_reads(self.tree.devices)
        before = self._last_device_reads if self._last_device_reads[0] == device else (device, None)
        self._last_device_reads = (device, completed)
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
            records_dropped=self.records.dropped,
        )
        iops = [sample.device_iops for sample in self.samples if sample.device_iops is not None]
        report.disk_device = next((sample.device for sample in reversed(self.samples) if sample.device), "")
        report.disk_iops = sum(iops) / len(iops) if iops else None
        if self.samples:
            cores = [sample.per_core_busy for sample in self.samples if sample.per_core_busy]
            report.per_core_busy = [sum(column) / len(column) for column in zip(*cores)] if cores else []
        report.verdict = judge(report)
        return report


def _busiest_device_reads(devices: Mapping[int, int]) -> tuple[str, int | None]:
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
    from .disk_result import remembered_results

    results = remembered_results()
    for device in sorted(devices, key=devices.__getitem__, reverse=True):
        entry = results.get(device)
        if entry and entry.get("seq_read_mb_s"):
            return float(entry["seq_read_mb_s"]), str(entry.get("path", ""))
    return None, ""


def _loop_figures(pid: int, record: Mapping[str, Any], records: Mapping[int, Mapping[str, Any]], tree: _ProcessTree) -> LoopFigures:
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


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


__all__ = ["Sampler"]
