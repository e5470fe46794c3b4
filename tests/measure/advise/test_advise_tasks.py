"""`gpufeed advise` knows the task, hands over the loader it measured, and says how sure its verdict is."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.measure.advise.diagnosis import (
    AdviseInputs,
    Candidate,
    Ceilings,
    advise,
    apply_advice,
    judge_rounds,
    plan_advice,
)

pytestmark = pytest.mark.timeout(120)


def rounds_of(*figures: tuple[float, float, float]) -> list[AdviseInputs]:
    """One round per (CPU decode, JPEG loader, .npy loader) images/s, for a GPU that takes 5000."""
    return [
        AdviseInputs(
            ceilings=Ceilings(gpu=5000.0, cpu_decode=decode, storage=9000.0),
            candidates=(Candidate("jpeg", jpeg, 20_000.0), Candidate("npy", npy, 200_000.0)),
            samples=200, cores=2, prepared_size=256, raw_shorter_side=900.0, raw_bytes_per_sample=170_000.0,
        )  # fmt: skip
        for decode, jpeg, npy in figures
    ]


def test_separated_figures_give_a_stable_verdict() -> None:
    confidence = judge_rounds(rounds_of((300, 1200, 900), (320, 1150, 950)))
    assert confidence.stable and confidence.repeats == 2 and confidence.close is None
    assert confidence.statement.startswith("stable: the same verdict in all 2 repeats")
    assert confidence.spread["cpu_decode"] == pytest.approx(20 / 310)


def test_figures_within_noise_are_said_to_be_so() -> None:
    # JPEG 1000-1300 against .npy 1250-1700: .npy must beat JPEG by 1.25x, and the ranges straddle that line.
    confidence = judge_rounds(rounds_of((300, 1000, 1700), (310, 1300, 1250), (305, 1100, 1500)))
    assert not confidence.stable and confidence.repeats == 3
    assert confidence.close is not None and {name for name, _ in confidence.close} == {"npy", "jpeg"}
    assert confidence.statement.startswith("not stable: the top two are within noise: npy 1500 vs jpeg 1375 images/s")
    assert "of 3 repeats alone gave another verdict" in confidence.statement


def test_one_round_is_never_called_stable() -> None:
    confidence = judge_rounds(rounds_of((300, 1200, 900)))
    assert not confidence.stable and confidence.statement.startswith("measured once")


def test_a_bottleneck_within_noise_of_the_runner_up() -> None:
    rounds = rounds_of((300, 1200, 900), (340, 1200, 900))
    rounds[1] = dataclasses.replace(rounds[1], ceilings=Ceilings(gpu=5000.0, cpu_decode=340.0, storage=320.0))
    rounds[0] = dataclasses.replace(rounds[0], ceilings=Ceilings(gpu=5000.0, cpu_decode=300.0, storage=330.0))
    confidence = judge_rounds(rounds)
    assert not confidence.stable
    assert {name for name, _ in confidence.close or ()} == {"cpu_decode", "storage"}


def test_classification_keeps_the_crop_rule() -> None:
    advice = plan_advice(rounds_of((300, 1200, 900))[0])
    assert (advice.recommendation.size, advice.recommendation.mode) == (256, "shorter")


@pytest.fixture(scope="module")
def yolo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.demo import make_yolo_dataset

    # As users' datasets come: a train and a val split (18 images each), which prepare never merges.
    return Path(make_yolo_dataset(tmp_path_factory.mktemp("yolo") / "yolo", 36, min_side=500, max_side=760))


def test_yolo_gets_the_letterbox_preparation_and_a_loader_line_that_reproduces_it(yolo: Path, tmp_path: Path) -> None:
    from pipeline.loader.loader import make_loader

    result = advise(
        str(yolo), str(tmp_path / "t"), gpu_images_per_s=20_000.0, batch_size=8, sample=16, crop=640,
        measure_seconds=0.3, device="cpu", repeats=2,
    )  # fmt: skip
    assert result.details["task"] == "detection"
    assert result.split == "train" and result.listed == 18  # the training split, sampled alone
    assert any("holds the splits train, val: advised on 'train'" in note for note in result.notes)
    command = result.command
    assert command[command.index("--split") :][:2] == ["--split", "train"]
    assert command[command.index("--size") + 1 : command.index("--mode") + 2] == ["640", "--mode", "longer"]
    assert "letterboxed to 640 px" in result.advice.reasons[0]
    assert result.loader_settings["recipe"] == "letterbox" and result.loader_settings["crop"] == 640
    line = result.loader_line
    for setting in ("batch_size=8", "crop=640", "num_workers=", "decoder=", "device='cpu'", "recipe='letterbox'"):
        assert setting in line, line
    assert result.confidence is not None and result.confidence.repeats in (1, 2)
    data = result.to_dict()
    assert data["confidence"]["repeats"] == result.confidence.repeats and "spread" in data["confidence"]
    assert data["loader_line"] == line and len(data["details"]["repeats"]) == result.confidence.repeats

    applied = apply_advice(result, measure_seconds=0.3)  # the recommended prepare, run
    from pipeline.manifest import read_manifest

    assert read_manifest(applied.out).task == "detection" and applied.samples == 18  # the train split, as advised
    loader = eval(line, {"make_loader": make_loader})  # what the user pastes
    try:
        images, targets = next(iter(loader))
    finally:
        loader.close()
    assert tuple(images.shape) == (8, 3, 640, 640)  # what advise measured, not 224-px crops
    assert loader.spec.recipe == "letterbox" and len(targets) == 8


def test_coco_and_segmentation_sources_get_the_detection_rule(tmp_path: Path) -> None:
    from pipeline.demo import make_coco_dataset, make_segmentation_dataset

    coco = make_coco_dataset(tmp_path / "coco", 16, min_side=300, max_side=420)
    segmentation = make_segmentation_dataset(tmp_path / "seg", 16, min_side=300, max_side=420)
    for source, task in ((coco, "detection"), (segmentation, "segmentation")):
        result = advise(
            str(source), str(tmp_path / "t"), gpu_images_per_s=20_000.0, batch_size=4, sample=8, crop=320,
            measure_seconds=0.2, device="cpu", repeats=1,
        )  # fmt: skip
        assert result.details["task"] == task
        rec = result.advice.recommendation
        assert (rec.size, rec.mode) == (320, "longer"), task
        assert "crop=320" in result.loader_line and "recipe='letterbox'" in result.loader_line
        assert result.confidence is not None and result.confidence.statement.startswith("measured once")


BURNER = "import time\nend = time.time() + 60\nwhile time.time() < end:\n    pass\n"


def test_a_busy_machine_gives_the_same_verdict_or_says_it_is_not_stable(tmp_path: Path) -> None:
    from pipeline.demo import make_demo_dataset

    make_demo_dataset(tmp_path / "raw", 32, classes=2, min_side=480, max_side=640, workers=2)

    def run() -> tuple[bool, tuple[str, bool, str], str]:
        result = advise(
            str(tmp_path / "raw"), str(tmp_path / "t"), gpu_images_per_s=20_000.0, batch_size=8, sample=16,
            measure_seconds=0.2, device="cpu", repeats=3,
        )  # fmt: skip
        assert result.confidence is not None
        advice = result.advice
        return result.confidence.stable, (advice.bottleneck, advice.prepare_helps, advice.recommendation.format), (
            result.confidence.statement
        )

    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(max(2, len(os.sched_getaffinity(0))))]
    try:
        time.sleep(0.2)
        first, second = run(), run()  # two runs on the same busy machine
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(timeout=10)
    for stable, _, statement in (first, second):
        assert stable == statement.startswith("stable:")
        if not stable:
            assert statement.startswith("not stable: the top two are within noise: "), statement
    if first[0] and second[0]:
        assert second[1] == first[1], (first, second)  # never a confident verdict that contradicts another
