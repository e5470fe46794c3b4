"""The sampling of `gpufeed watch`: a process tree, the recorder's files and the GPUs, every interval.

Each interval `Sampler.sample()` reads the process tree's CPU (time on a core, and time waiting for
one, from /proc/PID/schedstat), its storage reads (/proc/PID/io), the machine's cores, the totals the
recorder in `hook/` wrote for each watched process (checked as untrusted input: `records`)
and, where nvidia-ml-py and a GPU are present, each GPU's utilisation and memory. `Sampler.report()`
adds them up into the WatchReport and has `verdict.judge` reason its verdict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

from .records import RecorderFiles
from .report import GpuFigures, LoopFigures, Verdict, WatchReport, WatchSample
from .verdict import judge

_IO_FIELDS = ("read_bytes", "read_chars", "read_count")


@dataclasses.dataclass
class _ProcessCounters:
    """One process's counters; its reads are its own (what it absorbed from reaped children taken out)."""

    pid: int
    ppid: int
    cpu_s: float = 0.0
    runq_s: float = 0.0
    read_bytes: int = 0
    read_chars: int = 0
    read_count: int = 0
    raw: tuple[int, int, int] = (0, 0, 0)  # /proc/PID/io as last read (children it reaped included)
    pending: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0])  # ended children's, not absorbed yet
    gone: bool = False


class _ProcessTree:
    """CPU, run-queue and read counters of a process tree, kept for processes that have exited.

    Linux adds a reaped child's I/O to its parent's /proc/PID/io: when a child ends, its last figures
    (already counted) wait in its parent's `pending` and are taken out of the parent's next increments,
    so each byte counts once whatever the sampling interval.
    """

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
            members = []
        readings = {}
        for process in members:
            handle = self.handles.setdefault(process.pid, process)
            try:
                with handle.oneshot():
                    times, ppid = handle.cpu_times(), handle.ppid()
                    try:
                        io = handle.io_counters()
                    except (psutil.AccessDenied, AttributeError):
                        io = None
            except psutil.Error:  # ended (a zombie, or gone)
                continue
            readings[process.pid] = (handle, times, ppid, io)
        self._end_gone(readings)  # first: a parent's counter may hold a child reaped since the last sample
        for pid, (handle, times, ppid, io) in readings.items():
            proc = self.procs.setdefault(pid, _ProcessCounters(pid, ppid))
            proc.cpu_s = times.user + times.system
            if io is not None:
                _count_reads(proc, (io.read_bytes, getattr(io, "read_chars", io.read_bytes), io.read_count))
            proc.runq_s = max(proc.runq_s, _runq_s(pid))
            self._count_open_files(handle)

    def _end_gone(self, alive: Mapping[int, Any]) -> None:
        """Processes no longer there: their counted reads wait in their parent's `pending`."""
        for proc in self.procs.values():
            if proc.gone or proc.pid in alive:
                continue
            proc.gone = True
            parent = self.procs.get(proc.ppid)
            if parent is not None:
                parent.pending = [p + r for p, r in zip(parent.pending, proc.raw)]

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

    def totals(self) -> tuple[float, int, int]:
        procs = self.procs.values()
        return sum(p.cpu_s for p in procs), sum(p.read_bytes for p in procs), sum(p.read_count for p in procs)

    def read_chars(self) -> int:
        return sum(p.read_chars for p in self.procs.values())


def _count_reads(proc: _ProcessCounters, raw: tuple[int, int, int]) -> None:
    """Add a process's new reads, less what it absorbed from children whose reads were counted already."""
    for index, name in enumerate(_IO_FIELDS):
        grown = max(0, raw[index] - proc.raw[index])
        absorbed = min(grown, proc.pending[index])
        proc.pending[index] -= absorbed
        setattr(proc, name, getattr(proc, name) + grown - absorbed)
    proc.raw = raw


def _runq_s(pid: int) -> float:
    """Seconds the process's threads waited for a core (0 where the kernel keeps no schedstat)."""
    total = 0.0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    for task in tasks[:4096]:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as file:
                total += int(file.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue
    return total


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


def loader_role(loader: Mapping[str, Any], updates: int) -> str:
    """"training" or "evaluation": whether backward passes or optimizer steps follow its batches, or (in a
    process with none at all) whether its batches come with grad enabled and the model in train mode."""
    if updates:
        return "training" if loader.get("updated", 0) else "evaluation"
    batches = max(loader.get("batches", 0), 1)
    if 2 * loader.get("nograd", 0) >= batches or 2 * loader.get("eval_mode", 0) >= batches:
        return "evaluation"
    return "training"


def _training_totals(records: Mapping[int, Mapping[str, Any]]) -> tuple[int, int, float, float]:
    """Batches, samples, waits (first batches included) and steps of the training loaders of all records."""
    batches, samples, wait, step = 0, 0, 0.0, 0.0
    for record in records.values():
        for loader in record.get("loaders", []):
            if loader_role(loader, record.get("updates", 0)) == "training":
                batches, samples = batches + loader["batches"], samples + loader["samples"]
                wait, step = wait + loader["wait_s"] + loader["first_s"], step + loader["step_s"]
    return batches, samples, wait, step


class Sampler:
    """Samples a process tree and the recorder's files every interval; `report()` makes the WatchReport."""

    def __init__(
        self, root: int, directory: str, command: Sequence[str], disk_ceiling_mb_s: float | None = None,
        startup_s: float | None = None,
    ) -> None:  # fmt: skip
        """Start sampling the tree under `root`; `disk_ceiling_mb_s` None: a cached `bench disk` of its files' disk."""
        cpu = time.thread_time()
        self.tree = _ProcessTree(root)
        self.records = RecorderFiles(directory)
        self.gpus = _NvmlGpus()
        self.command = list(command)
        self.disk_ceiling_mb_s = disk_ceiling_mb_s
        self.startup_s = startup_s
        self.started = time.monotonic()
        self.samples: list[WatchSample] = []
        self.cores = _usable_cores()
        self._disks_at_start = _disk_counters()
        self._cpu_at_start = psutil.cpu_times()
        self._previous = (self.started, self._disks_at_start, self._cpu_at_start)
        psutil.cpu_percent(percpu=True)
        self.tree.sample()
        self._previous_totals = self._totals_now()
        self.cpu_s = time.thread_time() - cpu

    def _totals_now(self) -> tuple[float, int, int, float, float, dict[int, float], int, int]:
        batches, samples, wait, step = _training_totals(self.records.read())
        cpu = {pid: proc.cpu_s for pid, proc in self.tree.procs.items()}
        _, read_bytes, reads = self.tree.totals()
        return time.monotonic(), batches, samples, wait, step, cpu, read_bytes, reads

    def sample(self) -> WatchSample:
        """One interval's figures (also kept for the report)."""
        cpu_before = time.thread_time()
        self.tree.sample()
        point = self._totals_now()
        then, batches0, samples0, wait0, step0, cpu0, bytes0, reads0 = self._previous_totals
        now, batches, samples, wait, step, cpu, read_bytes, reads = point
        self._previous_totals = point
        span = max(now - then, 1e-6)
        loops = {pid for pid, record in self.records.last.items() if record.get("loaders")}
        used = {pid: cpu[pid] - cpu0.get(pid, 0.0) for pid in cpu}
        loop_cpu = sum(seconds for pid, seconds in used.items() if pid in loops)
        loop_time = (wait - wait0) + (step - step0)
        gpu_util, gpu_memory = self.gpus.sample()
        busy = psutil.cpu_percent(percpu=True)
        disks, machine = _disk_counters(), psutil.cpu_times()
        device = self._device(self._previous[1], disks)
        device_iops, device_busy = _device_rates(device, self._previous[1], disks, span)
        iowait = _iowait_share(self._previous[2], machine)
        self._previous = (now, disks, machine)
        sample = WatchSample(
            elapsed_s=now - self.started,
            stall_fraction=(wait - wait0) / loop_time if loop_time > 0 else None,
            batches_per_s=(batches - batches0) / span,
            images_per_s=(samples - samples0) / span,
            gpu_util=gpu_util,
            gpu_memory=gpu_memory,
            cores_busy=sum(busy) / 100.0,
            loop_cores=loop_cpu / span,
            worker_cores=(sum(used.values()) - loop_cpu) / span,
            read_mb_s=(read_bytes - bytes0) / span / 1e6,
            reads_per_s=(reads - reads0) / span,
            per_core_busy=list(busy),
            device=device,
            device_iops=device_iops,
            device_busy=device_busy,
            iowait=iowait,
        )
        self.samples.append(sample)
        self.cpu_s += time.thread_time() - cpu_before
        return sample

    def _device(self, before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
        """The block device of the files the run has open most; else the one that read the most meanwhile."""
        name = _device_of(self.tree.devices)
        if name in after:
            return name
        grown = {disk: after[disk].read_bytes - before[disk].read_bytes for disk in after if disk in before}
        busiest = max(grown, key=grown.__getitem__, default="")
        return busiest if grown.get(busiest, 0) > 0 else ""

    def report(self, exit_code: int | None) -> WatchReport:
        """The totals over the whole run, and the verdict."""
        cpu_before = time.thread_time()
        self.tree.sample()
        records = self.records.read()
        seconds = time.monotonic() - self.started
        loops = [loop for pid, record in sorted(records.items()) for loop in _loop_figures(pid, record, records, self.tree)]
        loops = [loop for loop in loops if loop.batches > 0]
        _, read_bytes, _ = self.tree.totals()
        looped = max((loop.loop_s for loop in loops), default=0.0) or seconds  # reads come while the loop runs
        gpus = self.gpus.figures()
        self.gpus.close()
        ceiling, disk = self.disk_ceiling_mb_s, ""
        if ceiling is None:
            ceiling, disk = _remembered_ceiling(self.tree.devices)
        disks = _disk_counters()
        device = self._device(self._disks_at_start, disks)
        iops, busy = _device_rates(device, self._disks_at_start, disks, looped)  # over the loop's time
        own = _own_share(device, self._disks_at_start, disks, read_bytes)
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
            disk_device=device,
            disk_iops=iops,
            read_chars=self.tree.read_chars(),
            disk_busy=busy,
            disk_own_share=own,
            iowait=_iowait_share(self._cpu_at_start, psutil.cpu_times()),
        )
        if self.samples:
            cores = [sample.per_core_busy for sample in self.samples if sample.per_core_busy]
            report.per_core_busy = [sum(column) / len(column) for column in zip(*cores)] if cores else []
        self.cpu_s += time.thread_time() - cpu_before
        report.cost = {"cpu_s": self.cpu_s, "hook_cpu_s": sum(r.get("sampler_cpu_s", 0.0) for r in records.values())}
        if self.startup_s is not None:
            report.cost["startup_s"] = self.startup_s
        report.verdict = judge(report)
        return report


def _disk_counters() -> dict[str, Any]:
    try:
        return dict(psutil.disk_io_counters(perdisk=True) or {})
    except (OSError, RuntimeError):
        return {}


def _device_rates(device: str, before: Mapping[str, Any], after: Mapping[str, Any], span: float) -> tuple[float | None, float | None]:
    """Reads completed per second and the share of `span` the device was busy (None where it is unknown)."""
    if not device or device not in before or device not in after:
        return None, None
    iops = (after[device].read_count - before[device].read_count) / max(span, 1e-6)
    busy_ms = getattr(after[device], "busy_time", None)
    if busy_ms is None:
        return iops, None
    return iops, min(1.0, max(0.0, (busy_ms - before[device].busy_time) / 1e3 / max(span, 1e-6)))


def _own_share(device: str, before: Mapping[str, Any], after: Mapping[str, Any], read_bytes: int) -> float | None:
    """The share of the bytes `device` moved over the run (reads and writes, every process's) that were the
    process tree's own reads: how much of its busy time is the run's (None where it moved nothing or is unknown)."""
    if not device or device not in before or device not in after:
        return None
    moved = sum(getattr(after[device], name) - getattr(before[device], name) for name in ("read_bytes", "write_bytes"))
    return min(1.0, max(0.0, read_bytes / moved)) if moved > 0 else None


def _iowait_share(before: Any, after: Any) -> float | None:
    total = sum(after) - sum(before)
    if not hasattr(after, "iowait") or total <= 0:
        return None
    return max(0.0, (after.iowait - before.iowait) / total)


def _device_of(devices: Mapping[int, int]) -> str:
    """The name of the block device the run has most files open on ("" when none is known)."""
    if not devices:
        return ""
    device = max(devices, key=devices.__getitem__)
    try:
        return os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"))
    except OSError:
        return ""


def _remembered_ceiling(devices: Mapping[int, int]) -> tuple[float | None, str]:
    """The sequential read rate a cached `gpufeed bench disk` measured on the disk the run read most from.

    A result whose reads were served by a cache (`cache_suspected`) is not the
    device's ceiling, and is left out: the disk is then named from its counters alone.
    """
    from ..disk.result import remembered_results

    results = remembered_results()
    for device in sorted(devices, key=devices.__getitem__, reverse=True):
        entry = results.get(device)
        if entry and entry.get("seq_read_mb_s") and not entry.get("cache_suspected"):
            return float(entry["seq_read_mb_s"]), str(entry.get("path", ""))
    return None, ""


def _loop_figures(
    pid: int, record: Mapping[str, Any], records: Mapping[int, Mapping[str, Any]], tree: _ProcessTree
) -> list[LoopFigures]:
    """One LoopFigures per loader of the process `pid`, with the figures of its own workers."""
    own = tree.procs.get(pid)
    workers = [r for r in records.values() if r.get("ppid") == pid and r.get("worker")]
    loaders = record.get("loaders", [])
    sites = {loader["site"] for loader in loaders}
    figures = []
    for loader in loaders:
        loop = LoopFigures(
            pid=pid, rank=record.get("rank"), kind=loader["kind"], site=loader["site"],
            role=loader_role(loader, record.get("updates", 0)),
            batches=loader["batches"], samples=loader["samples"], wait_s=loader["wait_s"], step_s=loader["step_s"],
            first_s=loader["first_s"], iterations=loader["iterations"], num_workers=loader["num_workers"],
            tensors=loader["tensors"], model_s=loader["model_s"], outside_s=loader["outside_s"],
            outside_cpu_s=loader["outside_cpu_s"],
            cpu_s=own.cpu_s if own else 0.0, runq_s=own.runq_s if own else 0.0,
        )  # fmt: skip
        # The Dataset's time: in this loader's workers (their records name this process and the loader), or here.
        mine = [r for r in workers if r.get("site") == loader["site"] or (r.get("site") not in sites and len(loaders) == 1)]
        fetches = [r.get("fetch", {}) for r in mine] if loader["num_workers"] else [loader["fetch"]]
        for fetch in fetches:
            loop.fetch_s += fetch.get("seconds", 0.0)
            loop.fetch_cpu_s += fetch.get("cpu_s", 0.0)
            loop.fetch_runq_s += fetch.get("runq_s", 0.0)
            loop.fetch_batches += fetch.get("batches", 0)
        counters = [tree.procs[r["pid"]] for r in mine if r["pid"] in tree.procs]
        loop.workers = len(mine)
        loop.workers_cpu_s = sum(child.cpu_s for child in counters)
        loop.workers_runq_s = sum(child.runq_s for child in counters)
        figures.append(loop)
    return figures


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


__all__ = ["Sampler"]
