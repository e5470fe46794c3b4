"""PNG charts for the bench and advise commands (`--plot FILE.png`).

matplotlib is imported inside each function and drawn with the Agg canvas
directly (no pyplot, no display, no global state), so importing gpufeed
never loads it and plots work on headless machines.
"""

from __future__ import annotations

import os
from typing import Any

GOOD, BAD, NEUTRAL, ACCENT = "#2b8a3e", "#c92a2a", "#868e96", "#1c7ed6"


def _figure(width: float = 10.0, height: float = 4.5, columns: int = 1) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, columns)
    return figure, axes


def _save(figure: Any, path: str | os.PathLike[str]) -> str:
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    figure.savefig(target, format="png")
    return target


def plot_disk(result: Any, path: str | os.PathLike[str]) -> str:
    """Random 4 KiB IOPS and p99 latency vs threads; sequential MB/s vs block size. Returns the path."""
    figure, (left, right) = _figure(columns=2)
    sweep = result.randread_sweep
    if sweep:
        threads = [p.threads for p in sweep]
        left.plot(threads, [p.iops for p in sweep], marker="o", color=ACCENT, label="IOPS")
        left.set_xscale("log", base=2)
        left.set_xticks(threads, [str(t) for t in threads])
        left.set_xlabel("threads (reads in flight)")
        left.set_ylabel("random 4 KiB reads per second (IOPS)")
        latency = left.twinx()
        latency.plot(threads, [p.p99_ms for p in sweep], marker="s", linestyle="--", color=BAD, label="p99 latency")
        latency.set_ylabel("p99 latency (ms)")
        left.legend(loc="upper left")
        latency.legend(loc="lower right")
    left.set_title("random 4 KiB reads")
    blocks = sorted(result.seq_read_by_block)
    labels = [f"{b // (1 << 20)} MiB" if b >= 1 << 20 else f"{b // 1024} KiB" for b in blocks]
    reads = [result.seq_read_by_block[b] for b in blocks]
    bars = right.bar(labels, reads, color=ACCENT, label="read")
    right.bar_label(bars, fmt="%.0f")
    if result.seq_write_mb_s is not None:
        right.axhline(result.seq_write_mb_s, color=NEUTRAL, linestyle="--", label=f"write ({result.seq_write_mb_s:.0f} MB/s)")
    right.set_ylim(0, 1.3 * max([*reads, result.seq_write_mb_s or 0.0, 1.0]))
    right.set_xlabel("block size")
    right.set_ylabel("sequential throughput (MB/s)")
    right.set_title("sequential reads")
    right.legend(loc="upper left", ncols=2)
    bypass = "O_DIRECT" if result.direct_io else result.cache_bypass
    figure.suptitle(f"{result.path}: {result.device_kind} ({result.fstype}), page cache bypass: {bypass}")
    return _save(figure, path)


def plot_decode(result: Any, path: str | os.PathLike[str]) -> str:
    """Images/s per core for each decoder, raw vs prepared. Returns the path."""
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
    return _save(figure, path)


def plot_loader(result: Any, path: str | os.PathLike[str]) -> str:
    """Loader images/s and stall fraction vs num_workers. Returns the path."""
    figure, axis = _figure()
    workers = [p.num_workers for p in result.points]
    axis.plot(workers, [p.images_per_s for p in result.points], marker="o", color=ACCENT, label="loader images/s")
    if result.consumer_images_per_s:
        axis.axhline(result.consumer_images_per_s, color=NEUTRAL, linestyle="--", label="simulated consumer (images/s)")
    axis.set_xticks(workers, [str(w) for w in workers])
    axis.set_xlabel("num_workers (decode threads)" if result.worker_type == "thread" else "num_workers (processes)")
    axis.set_ylabel("images/s")
    axis.set_ylim(bottom=0)
    stall = axis.twinx()
    stall.plot(workers, [100 * p.stall_fraction for p in result.points], marker="s", linestyle=":", color=BAD, label="stall")
    stall.set_ylabel("stall fraction (% of the step spent waiting)")
    stall.set_ylim(0, 100)
    axis.legend(loc="upper left")
    stall.legend(loc="upper right")
    axis.set_title(f"loader over {result.dataset}, batch {result.batch_size}")
    return _save(figure, path)


def plot_advise(result: Any, path: str | os.PathLike[str], applied: Any = None) -> str:
    """The ceilings before, and the predicted (and measured) loader after preparing. Returns the path."""
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
    names.append(f"loader after\nprepare (predicted)")
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
    return _save(figure, path)


def plot_memory(estimate: Any, path: str | os.PathLike[str]) -> str:
    """Device memory and images/s vs batch size. Returns the path."""
    figure, axis = _figure()
    rows = estimate.rows
    batches = [row.batch_size for row in rows]
    axis.plot(batches, [row.memory_bytes / 2**30 for row in rows], marker="o", color=ACCENT, label="memory")
    if estimate.vram_bytes:
        axis.axhline(estimate.vram_bytes / 2**30, color=BAD, linestyle="--", label=f"VRAM ({estimate.vram_bytes / 2**30:.0f} GiB)")
        usable = estimate.vram_bytes * (1 - estimate.safety_margin) / 2**30
        axis.axhline(usable, color=NEUTRAL, linestyle=":", label=f"usable ({estimate.safety_margin:.0%} margin)")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("batch size")
    axis.set_ylabel("device memory (GiB)")
    axis.legend(loc="upper left")
    if estimate.throughput is not None:
        speed = axis.twinx()
        speed.plot(batches, [row.images_per_s for row in rows], marker="s", color=GOOD, label="images/s")
        if estimate.loader_images_per_s:
            speed.axhline(estimate.loader_images_per_s, color=GOOD, linestyle="--", label="loader images/s")
        speed.axvline(estimate.throughput.saturation_batch(), color=NEUTRAL, linestyle="-.", label="90 % of peak")
        speed.set_ylabel("images/s (training)" if estimate.training else "images/s (inference)")
        speed.set_ylim(bottom=0)
        speed.legend(loc="lower right")
    axis.set_title(f"{estimate.model}: {estimate.optimizer if estimate.training else 'inference'}, {estimate.dtype}")
    return _save(figure, path)
