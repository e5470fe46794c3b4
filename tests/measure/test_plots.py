"""`--plot FILE.png`: real PNG charts with labelled axes and units."""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from pipeline.measure import plots
from pipeline.measure.advise.diagnosis import AdviseInputs, AdviseResult, ApplyResult, Candidate, Ceilings, plan_advice
from pipeline.measure.decode import DecodeBenchResult, DecoderRow
from pipeline.measure.disk.bench import DiskBenchResult, RandomReadPoint
from pipeline.measure.loader import LoaderBenchResult, LoaderPoint
from pipeline.measure.memory.estimate import estimate_memory
from pipeline.measure.watching.run import Verdict, WatchReport, WatchSample

MiB = 1 << 20


def disk_result() -> DiskBenchResult:
    sweep = [RandomReadPoint(t, 15000.0 * t**0.6, 60.0 * t**0.6, 0.05 * t**0.3, 0.2 * t**0.4, 0.06, 1000) for t in (1, 4, 16)]
    return DiskBenchResult(
        path="/data", device_kind="nvme", fstype="ext4", device="nvme0n1", free_bytes=10**12, direct_io=True,
        cache_bypass="O_DIRECT", file_bytes=1 << 30, threads=16, seq_write_mb_s=1500.0, seq_read_mb_s=2600.0,
        seq_read_by_block={MiB: 2100.0, 2 * MiB: 2400.0, 4 * MiB: 2600.0}, randread_sweep=sweep,
    )


def decode_result() -> DecodeBenchResult:
    rows = [
        DecoderRow("PIL", 120.0, 1500.0),
        DecoderRow("PIL + draft", 380.0, 1800.0),
        DecoderRow("simplejpeg", 420.0, 1700.0, "JPEG files only"),
        DecoderRow("npy (no decode)", None, 4500.0, "prepared --format npy"),
    ]
    return DecodeBenchResult("raw", 32, 224, 256, 90, 170e3, 1.1e6, 19e3, 87e3, 262e3, rows, 3.0)


def loader_result() -> LoaderBenchResult:
    points = [LoaderPoint(w, 400.0 * min(w, 2), 0.9 / w, 10, 640, 2.0) for w in (1, 2, 4)]
    return LoaderBenchResult("shards", 64, 1000.0, "cpu", "thread", points)


def advise_result() -> tuple[AdviseResult, ApplyResult]:
    inputs = AdviseInputs(
        ceilings=Ceilings(gpu=3000.0, cpu_decode=300.0, storage=4000.0),
        candidates=(Candidate("jpeg", 1500.0, 20e3), Candidate("npy", 1600.0, 200e3)),
        samples=200, cores=2, prepared_size=256, raw_shorter_side=920.0, raw_bytes_per_sample=170e3,
        target_read_mb_s=2000.0, target_free_bytes=10**11,
    )
    result = AdviseResult("raw", "/fast", "/fast/raw-256-jpeg", 200, 128, 64, 224, "cpu", inputs, plan_advice(inputs), {}, 9.0)
    applied = ApplyResult("/fast/raw-256-jpeg", 200, 1.0, 200.0, 1500.0, 1450.0, 1400.0, 1100.0, 0.9, 0.2)
    return result, applied


def watch_report(gpu: bool = True) -> WatchReport:
    samples = [
        WatchSample(5.0 * i, None if i == 1 else 0.6, 3.0, 96.0, 30.0 if gpu else None, 3 << 30 if gpu else None,
                    2.0, 0.2, 1.7, 40.0, 300.0)
        for i in range(1, 9)
    ]  # fmt: skip
    verdict = Verdict("data-bound", "cpu", ["stall 60 %"], "more workers", 1.5, [])
    return WatchReport(["python", "train.py"], 0, 40.0, 2, [], [], "", 0, 40.0, None, "", samples, verdict)


def _labels(figure: object) -> str:
    parts = []
    for axis in figure.axes:  # type: ignore[attr-defined]
        parts += [axis.get_xlabel(), axis.get_ylabel(), axis.get_title()]
    return " | ".join(parts)


def _check_png(path: Path) -> None:
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size[0] >= 800 and image.size[1] >= 300
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 20  # lines, bars and text, not a blank canvas


@pytest.mark.parametrize(
    ("name", "make", "units"),
    [
        ("disk", disk_result, ("IOPS", "MB/s", "ms", "threads", "block size")),
        ("decode", decode_result, ("images/s per core", "224 px")),
        ("loader", loader_result, ("images/s", "num_workers", "stall fraction (%")),
        ("memory", None, ("batch size", "GiB", "images/s")),
        ("watch", watch_report, ("stall, GPU busy (%)", "CPU cores busy", "seconds", "data-bound (cpu)")),
    ],
)
def test_figures_have_labelled_axes_with_units_and_save_as_png(
    name: str, make: object, units: tuple[str, ...], tmp_path: Path
) -> None:
    if make is None:
        import torch

        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 30 * 30, 10))
        result = estimate_memory(model, (3, 32, 32), vram="64MiB", device_flops=1e9, loader_images_per_s=100.0)
    else:
        result = make()  # type: ignore[operator]
    figure = getattr(plots, f"{name}_figure")(result)
    text = _labels(figure)
    for unit in units:
        assert unit in text, (unit, text)
    path = getattr(plots, f"plot_{name}")(result, tmp_path / "sub" / f"{name}.png")
    assert path == str(tmp_path / "sub" / f"{name}.png")
    _check_png(Path(path))


def test_advise_chart_shows_the_ceilings_prediction_and_measurement(tmp_path: Path) -> None:
    result, applied = advise_result()
    figure = plots.advise_figure(result, applied)
    axis = figure.axes[0]
    assert axis.get_ylabel() == "images/s" and axis.get_yscale() == "linear"  # 829 looks as far below 3,000 as it is
    assert "CPU decode" in axis.get_title()
    names = [tick.get_text() for tick in axis.get_xticklabels()]
    assert len(names) == 5 and "measured" in names[-1] and "predicted" in names[-2]
    values = [text.get_text() for text in axis.texts]
    assert values == ["3,000", "300", "4,000", "1,500", "1,400"]  # every bar carries its value
    _check_png(Path(plots.plot_advise(result, tmp_path / "advise.png", applied)))


# ---------------------------------------------------------------------------
# Every chart at its default size: no two labels overlap, no empty panel


def _drawn_texts(figure: Any) -> list[Any]:
    """The non-empty text artists the canvas drew (tick labels outside the view limits are not drawn)."""
    from matplotlib.text import Text

    figure.canvas.draw()
    undrawn = set()
    for axes in figure.axes:
        for axis in (axes.xaxis, axes.yaxis):
            low, high = sorted(axis.get_view_interval())
            slack = 1e-9 * (high - low)
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not low - slack <= tick.get_loc() <= high + slack:
                    undrawn |= {id(tick.label1), id(tick.label2)}
    return [t for t in figure.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in undrawn]


def _overlapping_labels(figure: Any) -> list[tuple[str, str]]:
    renderer = figure.canvas.get_renderer()
    boxes = [(text.get_text(), text.get_window_extent(renderer)) for text in _drawn_texts(figure)]
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]


def _memory(vram: str, flops: float, loader: float) -> Any:
    import torch

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 30 * 30, 10))
    return estimate_memory(model, (3, 32, 32), vram=vram, device_flops=flops, loader_images_per_s=loader)


def _charts() -> dict[str, tuple[str, tuple[Any, ...]]]:
    disk = disk_result()
    loader = loader_result()
    advice, applied = advise_result()
    return {
        "disk": ("disk", (disk,)),
        "disk-randread-only": ("disk", (dataclasses.replace(disk, seq_read_by_block={}, seq_write_mb_s=None),)),
        "disk-sequential-only": ("disk", (dataclasses.replace(disk, randread_sweep=[]),)),
        "disk-small-files-only": (
            "disk",
            (dataclasses.replace(
                disk, randread_sweep=[], seq_read_by_block={}, seq_write_mb_s=None, small_file_bytes=110_000,
                small_file_reads_per_s=9000.0, small_file_reads_per_s_qd1=2500.0,
            ),),
        ),  # fmt: skip
        "disk-measured-kind": ("disk", (dataclasses.replace(disk, device_kind="ssd", kernel_kind="rotational"),)),
        "decode": ("decode", (decode_result(),)),
        "loader": ("loader", (loader,)),
        "loader-no-consumer": ("loader", (dataclasses.replace(loader, consumer_images_per_s=None),)),
        "loader-many-workers": (
            "loader",
            (LoaderBenchResult("shards", 64, 900.0, "cpu", "process", [
                LoaderPoint(w, 300.0 * min(w, 3), 0.5 / w, 10, 640, 2.0) for w in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
            ]),),
        ),  # fmt: skip
        "advise": ("advise", (advice,)),
        "advise-applied": ("advise", (advice, applied)),
        "memory-small-vram": ("memory", (_memory("64MiB", 1e9, 100.0),)),
        "memory-thousands-of-batches": ("memory", (_memory("3GiB", 1e11, 5000.0),)),
        "memory-batch-3000": ("memory", (_memory("230MiB", 1e11, 60000.0),)),
        "memory-batch-just-above-1024": ("memory", (_memory("83MiB", 1e11, 60000.0),)),
        "watch": ("watch", (watch_report(),)),
        "watch-no-gpu": ("watch", (watch_report(gpu=False),)),
    }


@pytest.mark.parametrize("chart", sorted(_charts()))
def test_no_two_labels_of_a_chart_overlap_at_its_default_size(chart: str, tmp_path: Path) -> None:
    kind, args = _charts()[chart]
    figure = getattr(plots, f"{kind}_figure")(*args)
    assert _overlapping_labels(figure) == []
    for axes in figure.axes:  # no panel without data
        assert axes.lines or axes.patches, f"{chart}: an empty panel titled {axes.get_title()!r}"
    _check_png(Path(getattr(plots, f"plot_{kind}")(*args[:1], tmp_path / f"{chart}.png", *args[1:])))


def test_the_disk_chart_has_a_panel_only_for_the_tests_that_ran() -> None:
    disk = disk_result()
    only_random = plots.disk_figure(dataclasses.replace(disk, seq_read_by_block={}, seq_write_mb_s=None))
    assert [axes.get_title() for axes in only_random.axes if axes.get_title()] == ["random 4 KiB reads"]
    measured = plots.disk_figure(dataclasses.replace(disk, device_kind="ssd", kernel_kind="rotational"))
    assert "ssd as measured (the kernel says rotational)" in measured.get_suptitle()


def test_without_a_consumer_the_loader_chart_draws_no_stall_fraction() -> None:
    loader = loader_result()
    with_consumer = plots.loader_figure(loader)
    without = plots.loader_figure(dataclasses.replace(loader, consumer_images_per_s=None))
    assert "stall" in _labels(with_consumer) and "stall" not in _labels(without)
    assert len(without.axes) == 1


def test_the_memory_chart_puts_memory_and_images_per_s_in_panels_of_their_own() -> None:
    figure = plots.memory_figure(_memory("3GiB", 1e11, 5000.0))
    memory, speed = figure.axes
    assert memory.get_ylabel() == "device memory (GiB)" and speed.get_ylabel() == "images/s (training)"
    assert {line.get_label() for line in memory.lines} >= {"VRAM (3 GiB)", "usable (10% margin)"}
    assert "loader images/s" in {line.get_label() for line in speed.lines}


def test_importing_the_plots_module_does_not_import_matplotlib() -> None:
    code = "import sys, pipeline.measure.plots, pipeline.cli; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_cli_plot_option_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "disk.png"
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "bench", "disk", str(tmp_path / "d"), "--file-size", "8MiB", "--block-sizes",
         "1MiB,2MiB", "--duration", "0.05", "--threads", "4", "--small-files", "4", "--plot", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "GPUFEED_CACHE": str(tmp_path / "cache")},  # its remembered ceiling stays here
    )
    assert result.returncode == 0, result.stderr
    assert f"plot: {path}" in result.stderr
    _check_png(path)
