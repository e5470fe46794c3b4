"""PNG charts for the bench and advise commands (`--plot FILE.png`).

matplotlib is imported inside each function and drawn with the Agg canvas
directly (no pyplot, no display, no global state), so importing gpufeed
never loads it and plots work on headless machines.

Every chart is drawn at its default size so that no two labels overlap:
legends sit outside the data (below the plot), twin axes are used only
where one panel must compare two units, and axis ticks are thinned to what
fits. tests/measure/test_plots.py checks the text boxes of every chart.
"""

from __future__ import annotations

import os
from typing import Any

from ..units import format_bytes, format_rate

GOOD, BAD, NEUTRAL, ACCENT = "#2b8a3e", "#c92a2a", "#868e96", "#1c7ed6"


def _figure(width: float = 10.0, height: float = 4.5, rows: int = 1, columns: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False, **kwargs)
    return figure, [axis for row in axes for axis in row]


def _legend_below(figure: Any, *axes: Any) -> None:
    """One legend for these axes (twins included), under the plot, where it covers no data."""
    handles, labels = [], []
    for axis in axes:
        more_handles, more_labels = axis.get_legend_handles_labels()
        handles += more_handles
        labels += more_labels
    if labels:
        figure.legend(handles, labels, loc="outside lower center", ncols=min(3, len(labels)))


def _power_of_two_axis(axis: Any, values: list[int], most: int = 8) -> None:
    """A log2 x axis with at most `most` tick labels, the largest value always among them, none crowded."""
    import math

    axis.set_xscale("log", base=2)
    ordered = sorted(set(values))
    span = math.log2(ordered[-1] / ordered[0]) if len(ordered) > 1 else 1.0
    gap = span / max(1, most - 1) * 0.9  # the least log2 distance between two labels
    shown = [ordered[0]]
    for value in ordered[1:-1]:
        if math.log2(value / shown[-1]) >= gap and math.log2(ordered[-1] / value) >= gap:
            shown.append(value)
    if len(ordered) > 1:
        shown.append(ordered[-1])
    axis.set_xticks(shown, [str(v) for v in shown])
    axis.minorticks_off()


def _thousands(axis: Any) -> None:
    """Tick labels like 60,000 on the y axis."""
    from matplotlib.ticker import StrMethodFormatter

    axis.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))


def _save(figure: Any, path: str | os.PathLike[str]) -> str:
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    figure.savefig(target, format="png")
    return target


def plot_disk(result: Any, path: str | os.PathLike[str]) -> str:
    """Write `disk_figure` as a PNG; returns the path."""
    return _save(disk_figure(result), path)


def disk_figure(result: Any) -> Any:
    """What a DiskBenchResult measured, one panel per kind of test that ran.

    Random 4 KiB IOPS and p99 latency vs threads; sequential MB/s vs block
    size; small-file reads/s when neither of the others ran.
    """
    panels = [name for name, ran in (("random", result.randread_sweep), ("sequential", _sequential(result))) if ran]
    if not panels:
        panels = ["small files"]
    figure, axes = _figure(columns=len(panels), width=10.0 if len(panels) > 1 else 8.0)
    drawn = []
    for name, axis in zip(panels, axes):
        drawn += {"random": _random_panel, "sequential": _sequential_panel, "small files": _small_files_panel}[name](axis, result)
    _legend_below(figure, *drawn)
    kind = result.device_kind if result.device_kind == result.kernel_kind or not result.kernel_kind else (
        f"{result.device_kind} as measured (the kernel says {result.kernel_kind})"
    )
    bypass = "O_DIRECT" if result.direct_io else result.cache_bypass
    figure.suptitle(f"{result.path}: {kind}, {result.fstype}; page cache bypass: {bypass}")
    return figure


def _sequential(result: Any) -> bool:
    return bool(result.seq_read_by_block) or result.seq_write_mb_s is not None


def _random_panel(axis: Any, result: Any) -> list[Any]:
    sweep = result.randread_sweep
    threads = [p.threads for p in sweep]
    axis.plot(threads, [p.iops for p in sweep], marker="o", color=ACCENT, label="random 4 KiB reads (IOPS, left)")
    _power_of_two_axis(axis, threads)
    axis.set_xlabel("threads (reads in flight)")
    axis.set_ylabel("random 4 KiB reads per second (IOPS)")
    _thousands(axis)
    axis.set_ylim(0, 1.1 * max(p.iops for p in sweep))
    latency = axis.twinx()
    latency.plot(threads, [p.p99_ms for p in sweep], marker="s", linestyle="--", color=BAD, label="p99 latency (ms, right)")
    latency.set_ylabel("p99 latency (ms)")
    latency.set_ylim(0, 1.1 * max(p.p99_ms for p in sweep) or 1.0)
    axis.set_title("random 4 KiB reads")
    return [axis, latency]


def _sequential_panel(axis: Any, result: Any) -> list[Any]:
    blocks = sorted(result.seq_read_by_block)
    reads = [result.seq_read_by_block[b] for b in blocks]
    if blocks:
        bars = axis.bar([format_bytes(b) for b in blocks], reads, color=ACCENT, label="read")
        axis.bar_label(bars, labels=[f"{v:,.0f}" for v in reads])
        axis.set_xlabel("block size")
    if result.seq_write_mb_s is not None:
        axis.axhline(
            result.seq_write_mb_s, color=NEUTRAL, linestyle="--",
            label=f"write, fsync included ({format_rate(result.seq_write_mb_s, 'MB/s')})",
        )  # fmt: skip
    axis.set_ylim(0, 1.15 * max([*reads, result.seq_write_mb_s or 0.0, 1.0]))
    axis.set_ylabel("sequential throughput (MB/s)")
    _thousands(axis)
    axis.set_title("sequential reads" if blocks else "sequential write")
    return [axis]


def _small_files_panel(axis: Any, result: Any) -> list[Any]:
    names, values = [], []
    for label, value in (("1 thread", result.small_file_reads_per_s_qd1), (f"{result.threads} threads", result.small_file_reads_per_s)):
        if value is not None:
            names.append(label)
            values.append(value)
    bars = axis.bar(names, values, color=ACCENT)
    axis.bar_label(bars, labels=[f"{v:,.0f}" for v in values])
    axis.set_ylim(0, 1.15 * max([*values, 1.0]))
    axis.set_ylabel("small files read per second")
    _thousands(axis)
    axis.set_title(f"small files ({format_bytes(result.small_file_bytes)}): open, read, close")
    return [axis]


def plot_decode(result: Any, path: str | os.PathLike[str]) -> str:
    """Write `decode_figure` as a PNG; returns the path."""
    return _save(decode_figure(result), path)


def decode_figure(result: Any) -> Any:
    """Images/s per core for each decoder, raw vs prepared (a DecodeBenchResult)."""
    import numpy as np

    figure, (axis,) = _figure(height=0.6 * len(result.rows) + 2.2)
    names = [f"{row.decoder}\n(the loader's crop)" if row.decoder == "region" else row.decoder for row in result.rows]
    positions = np.arange(len(names))
    raw = [row.raw_images_per_s or 0.0 for row in result.rows]
    prepared = [row.prepared_images_per_s or 0.0 for row in result.rows]
    raw_bars = axis.barh(
        positions - 0.2, raw, height=0.4, color=BAD,
        label=f"raw ({result.raw_mean_pixels / 1e6:.1f} MP, {result.raw_mean_bytes / 1e3:.0f} kB)",
    )  # fmt: skip
    prepared_bars = axis.barh(
        positions + 0.2,
        prepared,
        height=0.4,
        color=GOOD,
        label=f"prepared (shorter side {result.prepared_size}, {result.prepared_mean_bytes / 1e3:.0f} kB JPEG)",
    )
    for bars, values in ((raw_bars, raw), (prepared_bars, prepared)):
        axis.bar_label(bars, labels=[f"{v:,.0f}" if v else "n/a" for v in values], padding=3)
    axis.set_xlim(0, 1.15 * max([*raw, *prepared, 1.0]))
    axis.xaxis.set_major_formatter("{x:,.0f}")
    axis.set_yticks(positions, names)
    axis.invert_yaxis()
    axis.set_xlabel(f"images/s per core (decode + resize to shorter side {result.target} px)")
    axis.set_title(f"decode speed on {result.samples} images of {result.source}")
    _legend_below(figure, axis)
    return figure


def plot_loader(result: Any, path: str | os.PathLike[str]) -> str:
    """Write `loader_figure` as a PNG; returns the path."""
    return _save(loader_figure(result), path)


def loader_figure(result: Any) -> Any:
    """Loader images/s vs num_workers, and against a consumer rate its stall fraction (a LoaderBenchResult).

    Without a consumer rate the training loop takes no time, so it always
    waits for data: the stall fraction says nothing then and is not drawn.
    """
    figure, (axis,) = _figure()
    workers = [p.num_workers for p in result.points]
    axis.plot(workers, [p.images_per_s for p in result.points], marker="o", color=ACCENT, label="loader images/s (left)")
    if result.consumer_images_per_s:
        axis.axhline(result.consumer_images_per_s, color=NEUTRAL, linestyle="--", label="simulated consumer (images/s)")
    _power_of_two_axis(axis, workers)
    axis.set_xlabel("num_workers (decode threads)" if result.worker_type == "thread" else "num_workers (processes)")
    axis.set_ylabel("images/s")
    _thousands(axis)
    top = max([p.images_per_s for p in result.points] + [result.consumer_images_per_s or 0.0])
    axis.set_ylim(0, 1.15 * top)
    drawn = [axis]
    if result.consumer_images_per_s:
        stall = axis.twinx()
        stall.plot(
            workers, [100 * p.stall_fraction for p in result.points], marker="s", linestyle=":", color=BAD,
            label="stall fraction (%, right)",
        )  # fmt: skip
        stall.set_ylabel("stall fraction (% of the loop's time\nspent waiting for data)")
        stall.set_ylim(0, 100)
        drawn.append(stall)
    _legend_below(figure, *drawn)
    consumer = f"a consumer of {result.consumer_images_per_s:,.0f} images/s" if result.consumer_images_per_s else "an infinitely fast consumer"
    axis.set_title(f"loader over {result.dataset}, batch {result.batch_size}, against {consumer}")
    return figure


def plot_advise(result: Any, path: str | os.PathLike[str], applied: Any = None) -> str:
    """Write `advise_figure` as a PNG; returns the path."""
    return _save(advise_figure(result, applied), path)


def advise_figure(result: Any, applied: Any = None) -> Any:
    """The ceilings before, and the predicted (and measured) loader after preparing (an AdviseResult).

    A linear axis, so that bar heights compare as the numbers do; each bar carries its value.
    """
    figure, (axis,) = _figure(height=4.0)
    names, values, colours = [], [], []
    advice = result.advice
    labels = {
        "gpu": "GPU",
        "cpu_decode": "CPU decode\n(raw, cached)",
        "storage": "storage\n(raw, cold)",
        "host_to_device": "host-to-device\ncopy",
    }
    for stage, value in result.inputs.ceilings.as_dict().items():
        if value is None:
            continue
        names.append(labels[stage])
        values.append(value)
        colours.append(BAD if stage == advice.bottleneck else NEUTRAL)
    names.append("loader after\nprepare (predicted)")
    values.append(advice.predicted_loader)
    colours.append(GOOD)
    if applied is not None:
        names.append("loader after\nprepare (measured)")
        values.append(applied.measured_loader_images_per_s)
        colours.append(ACCENT)
    bars = axis.bar(names, values, color=colours)
    axis.bar_label(bars, labels=[f"{v:,.0f}" for v in values], padding=2)
    axis.set_ylim(0, 1.12 * max(values))
    axis.set_ylabel("images/s")
    _thousands(axis)
    axis.set_title(f"bottleneck: {labels.get(advice.bottleneck, advice.bottleneck).replace(chr(10), ' ')}")
    return figure


def plot_memory(estimate: Any, path: str | os.PathLike[str]) -> str:
    """Write `memory_figure` as a PNG; returns the path."""
    return _save(memory_figure(estimate), path)


def _batch_ticks(axis: Any, batches: list[int]) -> None:
    """A log2 batch axis ticked at powers of two only, at most ten: a batch like 567 is a marked line, not a tick."""
    axis.set_xscale("log", base=2)
    low, high = max(1, min(batches)).bit_length() - 1, max(batches).bit_length()
    ticks = [2**k for k in range(low, high)]
    ticks = ticks[:: -(-len(ticks) // 10)]
    axis.set_xticks(ticks, [f"{tick:,}" for tick in ticks])
    axis.minorticks_off()


def memory_figure(estimate: Any) -> Any:
    """Device memory vs batch size (traced, and the rule of thumb) and, when known, images/s below it (a MemoryEstimate).

    Two panels on one batch axis instead of twin y axes: a line of one unit
    never hides behind a line of the other. The device's limit and the
    largest batch that fits are marked lines, with their values in the legend.
    """
    speed_known = estimate.throughput is not None
    figure, axes = _figure(height=6.0 if speed_known else 4.5, rows=2 if speed_known else 1, sharex=True)
    rows = estimate.rows
    batches = [row.batch_size for row in rows]
    gib = 2**30
    memory = axes[0]
    memory.plot(batches, [row.memory_bytes / gib for row in rows], marker="o", color=ACCENT, label="memory (traced step)")
    rule = [row.rule_memory_bytes for row in rows]
    if all(value is not None for value in rule):
        memory.plot(batches, [value / gib for value in rule], linestyle=":", color=NEUTRAL, label="rule of thumb")
    if estimate.vram_bytes:
        memory.axhline(estimate.vram_bytes / gib, color=BAD, linestyle="--", label=f"VRAM ({format_bytes(estimate.vram_bytes)})")
        usable = estimate.vram_bytes * (1 - estimate.safety_margin) / gib
        memory.axhline(usable, color=NEUTRAL, linestyle="-.", label=f"usable ({estimate.safety_margin:.0%} margin)")
    if estimate.max_batch_size and min(batches) <= estimate.max_batch_size <= max(batches):
        memory.axvline(
            estimate.max_batch_size, color=BAD, linestyle=(0, (1, 3)), label=f"largest batch that fits: {estimate.max_batch_size:,}"
        )
    memory.set_ylabel("device memory (GiB)")
    memory.set_ylim(bottom=0)
    memory.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _batch_ticks(memory, batches)
    where = "CUDA, allocator and context included" if estimate.memory_device == "cuda" else "tensor bytes"
    mode = estimate.optimizer if estimate.training else "inference"
    memory.set_title(f"{estimate.model}: {mode}, {estimate.autocast or estimate.dtype} ({where})")
    if speed_known:
        speed = axes[1]
        speed.plot(batches, [row.images_per_s for row in rows], marker="s", color=GOOD, label="device images/s")
        if estimate.loader_images_per_s:
            speed.axhline(estimate.loader_images_per_s, color=ACCENT, linestyle="--", label="loader images/s")
        saturation = estimate.throughput.saturation_batch()
        if min(batches) < saturation <= max(batches):
            speed.axvline(saturation, color=NEUTRAL, linestyle="-.", label=f"90 % of peak (batch {saturation})")
        speed.set_ylabel("images/s (training)" if estimate.training else "images/s (inference)")
        top = max([row.images_per_s or 0.0 for row in rows] + [estimate.loader_images_per_s or 0.0, 1.0])
        speed.set_ylim(0, 1.1 * top)
        _thousands(speed)
        speed.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        _batch_ticks(speed, batches)
    axes[-1].set_xlabel("batch size")
    return figure


def plot_watch(report: Any, path: str | os.PathLike[str]) -> str:
    """Write `watch_figure` as a PNG; returns the path."""
    return _save(watch_figure(report), path)


def watch_figure(report: Any) -> Any:
    """A watched run over time (a WatchReport): stall and GPU busy share, the CPU cores busy (the process tree's
    and the whole machine's), and the disk (the tree's storage reads and the device's busy share)."""
    figure, (shares, cores, disk) = _figure(height=7.0, rows=3, sharex=True)
    times = [s.elapsed_s for s in report.samples]
    stalls = [100 * s.stall_fraction if s.stall_fraction is not None else float("nan") for s in report.samples]
    shares.plot(times, stalls, marker="o", color=BAD, label="stall (% of the loop waiting for data)")
    if any(s.gpu_util is not None for s in report.samples):
        gpu = [s.gpu_util if s.gpu_util is not None else float("nan") for s in report.samples]
        shares.plot(times, gpu, marker="s", color=GOOD, label="GPU busy (%)")
    shares.set_ylim(0, 105)
    shares.set_ylabel("stall, GPU busy (%)")
    cores.plot(times, [s.loop_cores for s in report.samples], color=ACCENT, label="training processes (cores)")
    cores.plot(times, [s.worker_cores for s in report.samples], color=NEUTRAL, label="their workers (cores)")
    cores.plot(times, [s.cores_busy for s in report.samples], color=BAD, linestyle=":", label="whole machine (cores)")
    cores.axhline(report.cores, color=NEUTRAL, linestyle="--", label=f"cores available ({report.cores})")
    cores.set_ylim(0, 1.15 * report.cores)
    cores.set_ylabel("CPU cores busy")
    reads = [s.read_mb_s for s in report.samples]
    disk.plot(times, reads, color=ACCENT, marker=".", label="storage reads (MB/s)")
    disk.set_ylim(0, 1.15 * max(reads, default=0.0) or 1.0)
    disk.set_ylabel("reads (MB/s)")
    disk.set_xlabel("seconds since start")
    busy_axis = []
    if any(s.device_busy is not None for s in report.samples):
        device = next((s.device for s in report.samples if s.device), "") or "device"
        busy = disk.twinx()
        busy.plot(times, [100 * s.device_busy if s.device_busy is not None else float("nan") for s in report.samples],
                  color=NEUTRAL, linestyle="--", label=f"{device} busy (%)")  # fmt: skip
        busy.set_ylim(0, 105)
        busy.set_ylabel("disk busy (%)")
        busy_axis.append(busy)
    _legend_below(figure, shares, cores, disk, *busy_axis)
    cause = f" ({report.verdict.cause})" if report.verdict.cause else ""
    shares.set_title(f"gpufeed watch: {report.verdict.bound}{cause}")
    return figure
