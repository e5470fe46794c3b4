"""`gpufeed advise`: the arithmetic with fixed inputs, and one short real run with --apply."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from pipeline.errors import ConfigError
from pipeline.measure.advise.diagnosis import (
    AdviseInputs,
    Candidate,
    Ceilings,
    Recommendation,
    advise,
    find_bottleneck,
    plan_advice,
    shard_bytes_for,
)

MiB = 1 << 20
JPEG = Candidate("jpeg", loader_images_per_s=1200.0, bytes_per_sample=20_000.0)
NPY = Candidate("npy", loader_images_per_s=1300.0, bytes_per_sample=200_000.0)


def inputs(**changes: object) -> AdviseInputs:
    """A 2-core machine whose raw ~1 MP JPEGs decode at 300 images/s for a GPU that takes 2000."""
    base = AdviseInputs(
        ceilings=Ceilings(gpu=2000.0, cpu_decode=300.0, storage=5000.0, host_to_device=None),
        candidates=(JPEG, NPY),
        samples=200,
        cores=2,
        prepared_size=256,
        raw_shorter_side=920.0,
        raw_bytes_per_sample=170_000.0,
        target_read_mb_s=2000.0,
        target_free_bytes=50 * 10**9,
        storage_kind="ssd (ext4)",
        target_kind="nvme",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_cpu_decode_bottleneck_recommends_pre_resizing() -> None:
    advice = plan_advice(inputs())
    assert advice.bottleneck == "cpu_decode"
    assert advice.sentence.startswith("CPU decode is the bottleneck")
    assert "300 images/s" in advice.sentence and "2000 images/s" in advice.sentence and "85%" in advice.sentence
    assert advice.predicted_before == 300.0
    rec = advice.recommendation
    assert (rec.size, rec.mode, rec.format, rec.quality, rec.variants, rec.num_workers) == (256, "shorter", "jpeg", 90, 0, 2)
    assert advice.predicted_loader == 1200.0  # .npy is not 25 % faster: JPEG, at a tenth of the bytes
    assert advice.predicted_after == 1200.0
    assert any("pre-resize the 920 px raw images" in reason for reason in advice.reasons)
    assert advice.reasons[1] == (
        "--format jpeg --quality 90: .npy would give 1300 images/s against JPEG's 1200, not worth 10x the bytes"
    )


def test_npy_when_the_cpu_still_limits_and_the_disk_does_not() -> None:
    slow_jpeg = dataclasses.replace(JPEG, loader_images_per_s=800.0)
    fast_npy = dataclasses.replace(NPY, loader_images_per_s=1800.0)
    advice = plan_advice(inputs(candidates=(slow_jpeg, fast_npy)))
    assert advice.recommendation.format == "npy"
    assert advice.predicted_loader == 1800.0 and advice.predicted_after == 1800.0
    assert "--format npy" in advice.reasons[1] and "the disk is not" in advice.reasons[1]
    command = advice.recommendation.command("raw", "out")
    assert "--quality" not in command and command[command.index("--format") + 1] == "npy"


def test_npy_not_when_the_disk_would_limit_it() -> None:
    slow_jpeg = dataclasses.replace(JPEG, loader_images_per_s=800.0)
    fast_npy = dataclasses.replace(NPY, loader_images_per_s=1800.0)
    # 100 MB/s / 200 kB per sample = 500 images/s: worse than JPEG's 800.
    advice = plan_advice(inputs(candidates=(slow_jpeg, fast_npy), target_read_mb_s=100.0))
    assert advice.recommendation.format == "jpeg"
    assert advice.predicted_loader == 800.0


def test_npy_not_when_it_does_not_fit() -> None:
    slow_jpeg = dataclasses.replace(JPEG, loader_images_per_s=800.0)
    fast_npy = dataclasses.replace(NPY, loader_images_per_s=1800.0)
    advice = plan_advice(inputs(candidates=(slow_jpeg, fast_npy), samples=1_000_000, target_free_bytes=100 * 10**9))
    assert advice.recommendation.format == "jpeg"
    assert "more than the target can spare" in advice.reasons[1]


def test_prediction_is_capped_by_the_target_disk() -> None:
    # 10 MB/s / 20 kB = 500 images/s, below the CPU's 1200.
    advice = plan_advice(inputs(candidates=(JPEG,), target_read_mb_s=10.0))
    assert advice.predicted_loader == pytest.approx(500.0)
    assert advice.reasons[1] == "--format jpeg: the only format measured"


def test_storage_bottleneck() -> None:
    advice = plan_advice(inputs(ceilings=Ceilings(gpu=2000.0, cpu_decode=900.0, storage=150.0)))
    assert advice.bottleneck == "storage"
    assert advice.sentence.startswith("Storage is the bottleneck")
    assert "ssd (ext4)" in advice.sentence and "26 MB/s" in advice.sentence  # 150 x 170 kB
    assert advice.predicted_before == 150.0 and advice.predicted_after == 1200.0


def test_gpu_bottleneck_says_loading_faster_will_not_help() -> None:
    advice = plan_advice(inputs(ceilings=Ceilings(gpu=100.0, cpu_decode=300.0, storage=5000.0)))
    assert advice.bottleneck == "gpu"
    assert "will not speed up training" in advice.sentence
    assert advice.predicted_before == 100.0 and advice.predicted_after == 100.0
    assert advice.recommendation.format == "jpeg"
    assert "already feeds the GPU" in advice.reasons[1]


def test_preparing_helps_only_when_the_data_pipeline_is_the_bottleneck() -> None:
    assert plan_advice(inputs()).prepare_helps
    assert not plan_advice(inputs(ceilings=Ceilings(gpu=100.0, cpu_decode=300.0, storage=5000.0))).prepare_helps
    # The data pipeline limits, but the prepared data would be no faster (a slow target disk): nothing to gain either.
    slow_target = plan_advice(inputs(target_read_mb_s=1.0))
    assert slow_target.bottleneck == "cpu_decode" and not slow_target.prepare_helps


def test_a_model_timed_on_the_cpu_is_named_as_such() -> None:
    advice = plan_advice(inputs(ceilings=Ceilings(gpu=100.0, cpu_decode=300.0), consumer="model on the CPU"))
    assert advice.sentence.startswith("The model on the CPU is the bottleneck")
    assert "already feeds the model on the CPU" in advice.reasons[1]


def test_host_to_device_bottleneck() -> None:
    advice = plan_advice(inputs(ceilings=Ceilings(gpu=2000.0, cpu_decode=900.0, storage=5000.0, host_to_device=600.0)))
    assert advice.bottleneck == "host_to_device"
    assert advice.sentence.startswith("The host-to-device copy is the bottleneck")
    assert advice.after_ceilings["host_to_device"] == 600.0 and advice.predicted_after == 600.0


def test_raw_images_already_small() -> None:
    advice = plan_advice(inputs(raw_shorter_side=200.0))
    assert "already this small" in advice.reasons[0]


def test_find_bottleneck_prefers_the_gpu_on_a_tie() -> None:
    assert find_bottleneck(Ceilings(gpu=100.0, cpu_decode=100.0)) == ("gpu", 100.0)
    assert find_bottleneck(Ceilings(gpu=100.0, cpu_decode=99.0, storage=None)) == ("cpu_decode", 99.0)


def test_shard_size_rule() -> None:
    assert shard_bytes_for(5e6) == 16 * MiB
    assert shard_bytes_for(64 * 40 * MiB) == 64 * MiB
    assert shard_bytes_for(64 * 33 * MiB) == 64 * MiB
    assert shard_bytes_for(40e12) == 256 * MiB
    shard = plan_advice(inputs(samples=1_000_000)).recommendation.shard_bytes
    assert shard == 256 * MiB  # 20 GB of JPEG


def test_command_line() -> None:
    rec = Recommendation(256, "shorter", "jpeg", 90, 16 * MiB, 0, 2)
    assert rec.command("raw", "out") == [
        "gpufeed", "prepare", "raw", "out", "--size", "256", "--mode", "shorter", "--format", "jpeg",
        "--quality", "90", "--shard-size", "16MiB", "--variants", "0", "--workers", "2",
    ]


def test_needs_candidates_and_exactly_one_gpu_figure(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        plan_advice(inputs(candidates=()))
    with pytest.raises(ConfigError, match="exactly one"):
        advise(str(tmp_path), str(tmp_path / "t"))
    with pytest.raises(ConfigError, match="exactly one"):
        advise(str(tmp_path), str(tmp_path / "t"), gpu_images_per_s=100.0, model="m:f")
    with pytest.raises(ConfigError, match="local folder"):
        advise(str(tmp_path), "s3://bucket/x", gpu_images_per_s=100.0)


@pytest.fixture(scope="module")
def raw_photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.demo import make_demo_dataset

    root = tmp_path_factory.mktemp("photos")
    make_demo_dataset(root, 48, classes=2, min_side=560, max_side=720, workers=2)
    return root


def test_real_run_names_cpu_decode_and_its_prediction_holds(raw_photos: Path, tmp_path: Path) -> None:
    target = tmp_path / "fast-disk"
    out = target / "prepared"
    plot = tmp_path / "advise.png"
    source = os.path.relpath(raw_photos, tmp_path)  # relative paths, as a user types them
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "advise", source, "--target", "fast-disk",
         "--gpu-images-per-s", "20000", "--batch-size", "16", "--sample", "32", "--duration", "1", "--repeats", "2",
         "--apply", "fast-disk/prepared", "--json", "--plot", "advise.png"],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["bottleneck"] == "cpu_decode", data["advice"]["sentence"]
    assert data["listed"] == 48 and data["sample"] == 32
    command = data["command"]
    assert command[:4] == ["gpufeed", "prepare", source, "fast-disk/prepared"]
    assert command[command.index("--size") + 1] == "256" and command[command.index("--mode") + 1] == "shorter"
    assert data["loader_line"].startswith("make_loader('fast-disk/prepared', batch_size=16, crop=224, num_workers=")
    assert "recipe=" not in data["loader_line"]  # classification: the loader's default crop
    assert data["confidence"]["repeats"] == 2 and len(data["details"]["repeats"]) == 2
    ceilings = data["inputs"]["ceilings"]
    assert data["predicted_loader_images_per_s"] > 1.5 * ceilings["cpu_decode"]  # pre-resizing pays
    applied = data["applied"]
    assert applied["samples"] == 48
    assert abs(applied["error"]) <= 0.20, applied
    assert (out / "manifest.json").is_file()
    assert [p.name for p in target.iterdir()] == ["prepared"]  # no temp folders left
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.size[0] > 400


def test_gpu_rate_from_a_model_on_synthetic_batches(raw_photos: Path, tmp_path: Path) -> None:
    import torch

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10))
    result = advise(
        str(raw_photos), str(tmp_path / "t"), model=model, input_shape="3,8,8", batch_size=8, sample=16,
        measure_seconds=0.3, device="cpu", repeats=1,
    )
    assert result.details["gpu_source"] == "measured" and result.details["gpu_device"] == "cpu"
    assert result.inputs.consumer == "model on the CPU"
    step = result.details["gpu_step_seconds"]
    assert result.inputs.ceilings.gpu == pytest.approx(8 / step)
    if result.advice.bottleneck == "gpu":
        assert result.advice.sentence.startswith("The model on the CPU is the bottleneck")
    assert list((tmp_path / "t").iterdir()) == []


def _advise_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "advise", *args], capture_output=True, text=True, timeout=300, check=False, cwd=cwd
    )


def test_cli_gpu_bottleneck_recommends_nothing_and_a_raised_sample_says_so(raw_photos: Path, tmp_path: Path) -> None:
    result = _advise_cli(
        str(raw_photos), "--target", "t", "--gpu-images-per-s", "5", "--batch-size", "8", "--sample", "4",
        "--duration", "0.3", "--device", "cpu", "--repeats", "1", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "note: --sample 4 was raised to 16: each loader measurement needs two batches of --batch-size 8" in out
    assert "(sample of 16)" in out
    assert "The GPU is the bottleneck" in out
    assert "recommended: nothing to prepare for speed: training stays at the GPU's 5 images/s" in out
    assert "gpufeed prepare" not in out and "predicted:" not in out
    assert "verdict measured once: no spread to judge the verdict by" in out


def test_cli_target_that_is_a_file_is_refused_before_measuring(raw_photos: Path, tmp_path: Path) -> None:
    (tmp_path / "target.txt").write_text("a file")
    result = _advise_cli(str(raw_photos), "--target", "target.txt", "--gpu-images-per-s", "100", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr == (
        f"gpufeed: error: --target target.txt is a file; give the folder the shards would go to, e.g. {tmp_path}\n"
    )
    as_json = _advise_cli(str(raw_photos), "--target", "target.txt", "--gpu-images-per-s", "100", "--json", cwd=tmp_path)
    assert as_json.returncode == 1 and json.loads(as_json.stdout)["error"].startswith("--target target.txt is a file")


def test_cli_repeats_out_of_range_is_refused_by_its_option_name(raw_photos: Path, tmp_path: Path) -> None:
    result = _advise_cli(str(raw_photos), "--target", "t", "--gpu-images-per-s", "100", "--repeats", "0", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr == "gpufeed: error: --repeats 0: give 1 to 9 (rounds of measurements at most)\n"
    assert not (tmp_path / "t").exists()


def test_a_source_smaller_than_two_batches_is_refused_before_measuring(raw_photos: Path, tmp_path: Path) -> None:
    # 48 images, batch 64: refused at once, naming the setting (the CLI: its option) and what fits.
    with pytest.raises(ConfigError, match=r"48 images that prepare accepts, fewer than the two batches of batch_size=64.*batch_size=24 or less"):
        advise(str(raw_photos), str(tmp_path / "t"), model="no_such_module:never_loaded", batch_size=64)
    assert not (tmp_path / "t").exists()  # nothing was measured, not even the target
    result = _advise_cli(str(raw_photos), "--target", "t", "--gpu-images-per-s", "100", cwd=tmp_path)
    assert result.returncode == 1 and "drop_last" not in result.stderr
    assert result.stderr.endswith("fewer than the two batches of --batch-size 64 each loader measurement needs: give --batch-size 24 or less\n")


def test_only_what_prepare_accepts_is_sampled(raw_photos: Path, tmp_path: Path) -> None:
    import shutil

    source = tmp_path / "src"
    shutil.copytree(raw_photos, source)
    Image.new("RGB", (600, 600)).save(source / "beside-the-classes.jpg")  # prepare: "not in a class folder"
    first_class = sorted(p for p in source.iterdir() if p.is_dir())[0]
    (first_class / "broken.jpg").write_bytes(b"not a jpeg")  # prepare: not an image
    result = _advise_cli(
        "src", "--target", "t", "--gpu-images-per-s", "5", "--batch-size", "8", "--sample", "64",
        "--duration", "0.3", "--device", "cpu", "--repeats", "1", "--json", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["listed"] == 49 and data["sample"] == 48  # the top-level image is not listed, the broken one not sampled
    assert "replaced" not in result.stderr and "not an image" not in result.stderr, result.stderr


def test_apply_says_what_each_prediction_is_and_why_they_differ(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli.advise import _print_applied
    from pipeline.measure.advise.diagnosis import AdviseResult, ApplyResult

    measured_at_advise = dataclasses.replace(JPEG, loader_images_per_s=747.0, others_cpu_share=0.41)
    advised = inputs(candidates=(measured_at_advise,), target_read_mb_s=None)
    advice = plan_advice(advised)
    result = AdviseResult("raw", "t", "t/out", 200, 128, 64, 224, "cpu", advised, advice, {}, 1.0)
    applied = ApplyResult(
        out="t/out", samples=200, prepare_seconds=1.0, prepare_images_per_s=200.0,
        predicted_loader_images_per_s=advice.predicted_loader, predicted_now_images_per_s=1878.0,
        measured_loader_images_per_s=2209.0, measured_wall_images_per_s=2100.0, measured_stall_fraction=0.0,
        others_cpu_share=0.05,
    )  # fmt: skip
    _print_applied(applied, result)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3].startswith("loader on t/out: measured 2209 images/s; other processes used 5% of the CPU")
    assert lines[-2] == (
        "  predicted 1878 (-15%): the prediction (the loader over the prepared sample) re-run alternately with "
        "that measurement, so both saw the same machine"
    )
    assert lines[-1] == (
        "  advise printed 747 (-66%): the same prediction, measured earlier while other processes used 41% of the CPU "
        "(during the check: 5%); the figure above is the fair comparison"
    )
