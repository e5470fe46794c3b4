"""PNG charts for the bench and advise commands (`--plot FILE.png`).

matplotlib is imported inside each function and drawn with the Agg canvas
directly (no pyplot, no display, no global state), so importing gpufeed
never loads it and plots work on headless machines.
"""

from __future__ import annotations

import os
from typing import Any

from ..units import format_bytes, format_rate

GOOD, BAD, NEUTRAL, ACCENT = "#2b8a3e", "#c92a2a", "#868e96", "#1c7ed6"


def _figure(width: float = 10.0, height: float = 4.5, columns: int = 1) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, columns)
    return figure, axes


def _legend_below(figure: Any, *axes: Any) -> None:
    """One legend for twin axes, under the plot, where it covers no data."""
    handles, labels = [], []
    for axis in axes:
        more_handles, more_labels = axis.get_legend_handles_labels()
        handles += more_handles
        labels += more_labels
    figure.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)))


def _power_of_two_axis(axis: Any, values: list[int]) -> None:
    axis.set_xscale("log", base=2)
    shown = values if len(values) <= 12 else values[:: -(-len(values) // 12)]
    axis.set_xticks(shown, [str(v) for v in shown])
    axis.minorticks_off()


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
    """Random 4 KiB IOPS and p99 latency vs threads; sequential MB/s vs block size (a DiskBenchResult)."""
    figure, (left, right) = _figure(columns=2)
    sweep = result.randread_sweep
    if sweep:
        threads = [p.threads for p in sweep]
        left.plot(threads, [p.iops for p in sweep], marker="o", color=ACCENT, label="random 4 KiB IOPS")
        _power_of_two_axis(left, threads)
        left.set_xlabel("threads (reads in flight)")
        left.set_ylabel("random 4 KiB reads per second (IOPS)")
        left.set_ylim(bottom=0)
        latency = left.twinx()
        latency.plot(threads, [p.p99_ms for p in sweep], marker="s", linestyle="--", color=BAD, label="p99 latency (ms)")
        latency.set_ylabel("p99 latency (ms)")
        latency.set_ylim(bottom=0)
        left.legend(handles=left.get_lines() + latency.get_lines(), loc="upper left")
    left.set_title("random 4 KiB reads")
    blocks = sorted(result.seq_read_by_block)
    labels = [format_bytes(b) for b in blocks]
    reads = [result.seq_read_by_block[b] for b in blocks]
    bars = right.bar(labels, reads, color=ACCENT, label="read")
    right.bar_label(bars, fmt="%.0f")
    if result.seq_write_mb_s is not None:
        right.axhline(result.seq_write_mb_s, color=NEUTRAL, linestyle="--", label=f"write ({format_rate(result.seq_write_mb_s, 'MB/s')})")
    right.set_ylim(0, 1.3 * max([*reads, result.seq_write_mb_s or 0.0, 1.0]))
    right.set_xlabel("block size")
    right.set_ylabel("sequential throughput (MB/s)")
    right.set_title("sequential reads")
    right.legend(loc="upper left", ncols=2)
    bypass = "O_DIRECT" if result.direct_io else result.cache_bypass
    figure.suptitle(f"{result.path}: {result.device_kind} ({result.fstype}), page cache bypass: {bypass}")
    return figure


def plot_decode(result: Any, path: str | os.PathLike[str]) -> str:
    """Write `decode_figure` as a PNG; returns the path."""
    return _save(decode_figure(result), path)


def decode_figure(result: Any) -> Any:
    """Images/s per core for each decoder, raw vs prepared (a DecodeBenchResult)."""
    import numpy as np

    figure, axis = _figure(height=0.6 * len(result.rows) + 2.2)
    names = [row.decoder for row in result.rows]
    positions = np.arange(len(names))
    raw = [row.raw_images_per_s or 0.0 for row in result.rows]
    prepared = [row.prepared_images_per_s or 0.0 for row in result.rows]
    raw_bars = axis.barh(
        positions - 0.2, raw, height=0.4, color=BAD,
        label=f"raw ({result.raw_mean_pixels / 1e6:.1f} MP, {result.raw_mean_bytes / 1e3:.0f} kB)",
    )
    prepared_bars = axis.barh(
        positions + 0.2,
        prepared,
        height=0.4,
        color=GOOD,
        label=f"prepared (shorter side {result.prepared_size}, {result.prepared_mean_bytes / 1e3:.0f} kB JPEG)",
    )
    for bars, values in ((raw_bars, raw), (prepared_bars, prepared)):
        axis.bar_label(bars, labels=[f"{v:.0f}" if v else "n/a" for v in values], padding=3)
    axis.set_xlim(0, 1.15 * max([*raw, *prepared, 1.0]))
    axis.set_yticks(positions, names)
    axis.invert_yaxis()
    axis.set_xlabel(f"images/s per core (decode + resize to shorter side {result.target} px)")
    axis.set_title(f"decode speed on {result.samples} images of {result.source}")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=2)
    return figure


def plot_loader(result: Any, path: str | os.PathLike[str]) -> str:
    """Write `loader_figure` as a PNG; returns the path."""
    return _save(loader_figure(result), path)


def loader_figure(result: Any) -> Any:
    """Loader images/s and stall fraction vs num_workers (a LoaderBenchResult)."""
    figure, axis = _figure()
    workers = [p.num_workers for p in result.points]
    axis.plot(workers, [p.images_per_s for p in result.points], marker="o", color=ACCENT, label="loader images/s")
    if result.consumer_images_per_s:
        axis.axhline(result.consumer_images_per_s, color=NEUTRAL, linestyle="--", label="simulated consumer (images/s)")
    _power_of_two_axis(axis, workers)
    axis.set_xlabel("num_workers (decode threads)" if result.worker_type == "thread" else "num_workers (processes)")
    axis.set_ylabel("images/s")
    top = max([p.images_per_s for p in result.points] + [result.consumer_images_per_s or 0.0])
    axis.set_ylim(0, 1.15 * top)
    stall = axis.twinx()
    stall.plot(
        workers, [100 * p.stall_fraction for p in result.points], marker="s", linestyle=":", color=BAD,
        label="stall fraction (%)",
    )
    stall.set_ylabel("stall fraction (% of the step spent waiting)")
    stall.set_ylim(0, 100)
    _legend_below(figure, axis, stall)
    axis.set_title(f"loader over {result.dataset}, batch {result.batch_size}")
    return figure


def plot_advise(result: Any, path: str | os.PathLike[str], applied: Any = None) -> str:
    """Write `advise_figure` as a PNG; returns the path."""
    return _save(advise_figure(result, applied), path)


def advise_figure(result: Any, applied: Any = None) -> Any:
    """The ceilings before, and the predicted (and measured) loader after preparing (an AdviseResult)."""
    figure, axis = _figure(height=4.0)
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
    axis.bar_label(bars, fmt="%.0f")
    axis.set_yscale("log")
    axis.set_ylabel("images/s (log scale)")
    axis.set_title(f"bottleneck: {labels.get(advice.bottleneck, advice.bottleneck).replace(chr(10), ' ')}")
    return figure


def plot_memory(estimate: Any, path: str | os.PathLike[str]) -> str:
    """Write `memory_figure` as a PNG; returns the path."""
    return _save(memory_figure(estimate), path)


def memory_figure(estimate: Any) -> Any:
    """Device memory (traced, and the rule of thumb) and images/s vs batch size, the device's limit marked (a MemoryEstimate).

    The x ticks are powers of two, at most ten of them; the largest batch
    that fits is a marked line with its value in the legend, never a tick
    beside a nearby power of two.
    """
    figure, axis = _figure()
    rows = estimate.rows
    batches = [row.batch_size for row in rows]
    gib = 2**30
    axis.plot(batches, [row.memory_bytes / gib for row in rows], marker="o", color=ACCENT, label="memory (traced step)")
    rule = [row.rule_memory_bytes for row in rows]
    if all(value is not None for value in rule):
        axis.plot(batches, [value / gib for value in rule], linestyle=":", color=NEUTRAL, label="rule of thumb")
    if estimate.vram_bytes:
        axis.axhline(estimate.vram_bytes / gib, color=BAD, linestyle="--", label=f"VRAM ({format_bytes(estimate.vram_bytes)})")
        usable = estimate.vram_bytes * (1 - estimate.safety_margin) / gib
        axis.axhline(usable, color=NEUTRAL, linestyle="-.", label=f"usable ({estimate.safety_margin:.0%} margin)")
    if estimate.max_batch_size:
        axis.axvline(estimate.max_batch_size, color=BAD, linestyle=(0, (1, 3)),
                     label=f"largest batch that fits: {estimate.max_batch_size:,}")
    axis.set_xscale("log", base=2)
    low, high = max(1, min(batches)).bit_length() - 1, max(batches).bit_length()
    ticks = [2**k for k in range(low, high)]
    ticks = ticks[:: -(-len(ticks) // 10)]
    axis.set_xticks(ticks, [f"{tick:,}" for tick in ticks])
    axis.minorticks_off()
    axis.set_xlabel("batch size")
    axis.set_ylabel("device memory (GiB)")
    axis.set_ylim(bottom=0)
    twins = [axis]
    if estimate.throughput is not None:
        speed = axis.twinx()
        speed.plot(batches, [row.images_per_s for row in rows], marker="s", color=GOOD, label="images/s")
        if estimate.loader_images_per_s:
            speed.axhline(estimate.loader_images_per_s, color=GOOD, linestyle="--", label="loader images/s")
        saturation = estimate.throughput.saturation_batch()
        if saturation <= max(batches):
            speed.axvline(saturation, color=NEUTRAL, linestyle="-.", label=f"90 % of peak (batch {saturation})")
        speed.set_ylabel("images/s (training)" if estimate.training else "images/s (inference)")
        speed.set_ylim(bottom=0)
        twins.append(speed)
    _legend_below(figure, *twins)
    where = "CUDA, allocator and context included" if estimate.memory_device == "cuda" else "tensor bytes"
    mode = estimate.optimizer if estimate.training else "inference"
    axis.set_title(f"{estimate.model}: {mode}, {estimate.autocast or estimate.dtype} ({where})")
    return figure
