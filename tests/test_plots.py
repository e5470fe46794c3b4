"""`--plot FILE.png`: real PNG charts with labelled axes and units."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from pipeline.measure import plots
from pipeline.measure.advise import AdviseInputs, AdviseResult, ApplyResult, Candidate, Ceilings, plan_advice
from pipeline.measure.decode import DecodeBenchResult, DecoderRow
from pipeline.measure.disk import DiskBenchResult, RandomReadPoint
from pipeline.measure.loader import LoaderBenchResult, LoaderPoint
from pipeline.measure.memory import estimate_memory

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
    assert axis.get_ylabel() == "images/s (log scale)"
    assert "CPU decode" in axis.get_title()
    names = [tick.get_text() for tick in axis.get_xticklabels()]
    assert len(names) == 5 and "measured" in names[-1] and "predicted" in names[-2]
    _check_png(Path(plots.plot_advise(result, tmp_path / "advise.png", applied)))


def test_importing_the_plots_module_does_not_import_matplotlib() -> None:
    code = "import sys, pipeline.measure.plots, pipeline.cli; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_cli_plot_option_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "disk.png"
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "bench", "disk", str(tmp_path / "d"), "--size", "8MiB", "--block-sizes",
         "1MiB,2MiB", "--duration", "0.05", "--threads", "4", "--small-files", "4", "--plot", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"plot: {path}" in result.stderr
    _check_png(path)
