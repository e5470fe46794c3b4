"""`gpufeed bench loader`: the loader's images/s and stall fraction against a simulated consumer."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from pipeline import PrepareSpec, ResizeSpec, prepare_dataset
from pipeline.errors import ConfigError
from pipeline.measure.loader import (
    LoaderPoint,
    benchmark_loader,
    best_window_rate,
    default_worker_counts,
    measure_loader,
)

FAST = dict(batch_size=8, crop=48, device="cpu")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    raw = tmp_path_factory.mktemp("raw")
    rng = np.random.default_rng(0)
    for index in range(48):
        folder = raw / f"c{index % 2}"
        folder.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (80, 96, 3), dtype=np.uint8)).save(folder / f"{index}.jpg")
    out = tmp_path_factory.mktemp("shards")
    prepare_dataset(PrepareSpec(source=str(raw), out=str(out), resize=ResizeSpec(size=64)), workers=0)
    return str(out)


def test_one_point_per_worker_count(dataset: str) -> None:
    result = benchmark_loader(dataset, workers=[1, 2], min_seconds=0.3, **FAST)
    assert [p.num_workers for p in result.points] == [1, 2]
    for point in result.points:
        assert point.images_per_s > 0 and point.images == 8 * point.batches
        assert point.batches >= 4 and point.seconds >= 0.3
        assert 0.0 <= point.stall_fraction <= 1.0
        assert point.best_images_per_s >= point.images_per_s * 0.9
    assert result.best in result.points
    data = result.to_dict()
    json.dumps(data)
    assert data["best_num_workers"] == result.best.num_workers
    assert "idle_images_per_s" in data["points"][0]


def test_a_slow_consumer_sets_the_pace_and_the_loader_does_not_stall_it(dataset: str) -> None:
    free = measure_loader(dataset, num_workers=2, min_seconds=0.4, **FAST)
    slow_rate = min(80.0, free.images_per_s / 4)
    paced = measure_loader(dataset, num_workers=2, consumer_images_per_s=slow_rate, min_seconds=0.6, **FAST)
    assert paced.images_per_s == pytest.approx(slow_rate, rel=0.25)
    # An infinitely fast consumer does nothing but wait; a slow one hardly waits at all.
    assert free.stall_fraction > 0.5
    assert paced.stall_fraction < 0.3


def test_bad_consumer_rate_is_refused(dataset: str) -> None:
    with pytest.raises(ConfigError):
        measure_loader(dataset, consumer_images_per_s=0, **FAST)
    with pytest.raises(ConfigError, match="fewer than one batch of batch_size=1000"):
        measure_loader(dataset, batch_size=1000, crop=48, device="cpu")


def test_best_window_rate_arithmetic() -> None:
    # 10 images per 0.1 s, except a slow stretch from 0.3 to 0.6 s.
    timeline = [(0.0, 0), (0.1, 10), (0.2, 20), (0.3, 30), (0.6, 40), (0.7, 50), (0.8, 60)]
    assert best_window_rate(timeline, 0.2) == pytest.approx(100.0)
    assert best_window_rate(timeline, 0.8) == pytest.approx(75.0)
    assert best_window_rate(timeline, 5.0) == pytest.approx(75.0)  # shorter than one window: the whole run
    assert best_window_rate([(0.0, 0)], 0.1) == 0.0


def test_idle_rate_scales_by_the_cpu_others_took() -> None:
    point = LoaderPoint(2, 100.0, 0.5, 10, 100, 1.0, others_cpu_share=0.5)
    assert point.idle_images_per_s == pytest.approx(200.0)
    assert LoaderPoint(2, 100.0, 0.5, 10, 100, 1.0, others_cpu_share=None).idle_images_per_s == 100.0
    assert LoaderPoint(2, 100.0, 0.5, 10, 100, 1.0, others_cpu_share=0.95).idle_images_per_s == pytest.approx(400.0)


def test_default_worker_counts() -> None:
    assert default_worker_counts(2) == [1, 2, 4]
    assert default_worker_counts(3) == [1, 2, 3, 4, 6]
    assert default_worker_counts(1) == [1, 2]


def _bench_loader(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "bench", "loader", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_cli_json(dataset: str) -> None:
    result = _bench_loader(
        dataset, "--num-workers", "1,2", "--batch-size", "8", "--duration", "0.2", "--device", "cpu",
        "--gpu-images-per-s", "5000", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [p["num_workers"] for p in data["points"]] == [1, 2]
    assert data["consumer_images_per_s"] == 5000
    bad = _bench_loader(dataset, "--num-workers", "0")
    assert bad.returncode == 2 and "--num-workers" in bad.stderr


def test_cli_table_has_a_stall_column_only_against_a_consumer_and_says_what_it_means(dataset: str) -> None:
    common = (dataset, "--num-workers", "1", "--batch-size", "8", "--duration", "0.2", "--device", "cpu")
    free = _bench_loader(*common)
    assert free.returncode == 0, free.stderr
    assert "against an infinitely fast consumer" in free.stdout
    assert "stall" not in free.stdout  # the loop waits for data all the time: no figure to show
    paced = _bench_loader(*common, "--gpu-images-per-s", "500")
    assert paced.returncode == 0, paced.stderr
    header = paced.stdout.splitlines()[1]
    assert header.split()[:3] == ["num_workers", "images/s", "stall"]
    assert "(stall: the share of the training loop's time spent waiting for data)" in paced.stdout


def test_a_dataset_smaller_than_one_batch_is_refused_at_once_naming_the_batch_size(dataset: str) -> None:
    with pytest.raises(ConfigError, match=r"48 samples, fewer than one batch of batch_size=64.*give batch_size=48 or less"):
        measure_loader(dataset, batch_size=64, device="cpu")
    result = _bench_loader(dataset, "--num-workers", "1", "--device", "cpu")  # --batch-size 64 by default
    assert result.returncode == 1 and "drop_last" not in result.stderr
    assert "fewer than one batch of --batch-size 64" in result.stderr and "give --batch-size 48 or less" in result.stderr


def test_estimate_memory_checks_its_dataset_before_tracing_or_measures_it_at_a_batch_that_fits(dataset: str) -> None:
    # torch.nn:Flatten has no parameters, so tracing its training step would fail: the dataset is checked first.
    base = [sys.executable, "-m", "pipeline", "estimate-memory", "--model", "torch.nn:Flatten", "--input", "3,8,8",
            "--dataset", dataset, "--device", "cpu", "--device-flops", "1T"]  # fmt: skip
    given = subprocess.run([*base, "--batch-size", "64"], capture_output=True, text=True, timeout=120, check=False)
    assert given.returncode == 1 and "drop_last" not in given.stderr
    assert "fewer than one batch of --batch-size 64" in given.stderr and "give --batch-size 48 or less" in given.stderr
    default = subprocess.run(base, capture_output=True, text=True, timeout=120, check=False)
    assert f"gpufeed: note: the loader is measured at batch 48: {dataset} holds only 48 samples" in default.stderr
    assert "drop_last" not in default.stderr and "tracing a step" in default.stderr  # on to the (failing) trace
