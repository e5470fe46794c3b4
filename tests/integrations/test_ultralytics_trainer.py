"""Ultralytics' own trainer fed by gpufeed: `YOLO("yolov8n.yaml").train(trainer=DetectionTrainer)`, for real, offline.

In the cached "vision" venv (ultralytics 8.4.190, torch 2.14.1; gpufeed from
this checkout on PYTHONPATH), without a network (`unshare -n` where the
machine has it) and with what an offline cluster sets (YOLO_OFFLINE=1, a
font in YOLO_CONFIG_DIR, settings sync off): two short epochs at imgsz 96
on a generated YOLO dataset, the second without the mosaic (close_mosaic=1),
validation each epoch and the final validation of best.pt. Its train and
val loaders must be gpufeed's, the splits prepared once into the cache (val
in aspect-ratio order, train shuffled; a second run, with rotation and a mosaic half the time, prepares nothing),
the losses finite, results.csv two rows; a hyperparameter the recipe does
not draw yet (copy_paste) stops the run with a message.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from extra_venvs import VISION, venv_python

from pipeline.demo import make_yolo_dataset

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, shutil, sys
from pathlib import Path
import matplotlib
fonts = Path(os.environ["YOLO_CONFIG_DIR"]) / "Ultralytics"
fonts.mkdir(parents=True, exist_ok=True)
shutil.copy(Path(matplotlib.get_data_path()) / "fonts/ttf/DejaVuSans.ttf", fonts / "Arial.ttf")
from ultralytics import YOLO, settings
settings.update({"sync": False})
from pipeline.integrations.ultralytics import DetectionTrainer

data, project, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = YOLO("yolov8n.yaml")
model.train(data=data, trainer=DetectionTrainer, epochs=2, close_mosaic=1, imgsz=96, batch=8, workers=2,
            device="cpu", amp=False, plots=False, project=project, name="run", exist_ok=True, verbose=False, **extra)
trainer = model.trainer
print(json.dumps({
    "train_loader": type(trainer.train_loader).__module__ + "." + type(trainer.train_loader).__name__,
    "final_val_loader": type(trainer.validator.dataloader).__name__,
    "metrics": {k: float(v) for k, v in trainer.metrics.items()},
    "best": str(trainer.best), "save_dir": str(trainer.save_dir),
}))
"""


def train(data: Path, project: Path, shards: Path, **extra: object) -> subprocess.CompletedProcess[str]:
    python = venv_python("vision", VISION)
    env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(project / "config"), "PYTHONPATH": str(ROOT),
           "GPUFEED_YOLO_SHARDS": str(shards)}  # fmt: skip
    command = [str(python), "-c", SCRIPT, str(data), str(project), json.dumps(extra)]
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False).returncode == 0:
        command = ["unshare", "-n", *command]  # no network: nothing may be fetched
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=project, timeout=600, check=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(make_yolo_dataset(tmp_path_factory.mktemp("yolo") / "data", 32, min_side=80, max_side=200))
    (root / "data.yaml").write_text((root / "data.yaml").read_text().replace("path: .", f"path: {root}"))
    return root / "data.yaml"


def test_ultralytics_trains_and_validates_on_gpufeeds_loaders_offline(data: Path, tmp_path: Path) -> None:
    project, shards = tmp_path / "runs", tmp_path / "shards"
    project.mkdir()
    done = train(data, project, shards)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["train_loader"] == "pipeline.integrations.yolo_batches.YoloLoader"
    assert result["final_val_loader"] == "YoloLoader"  # best.pt's validation read gpufeed's batches too
    assert "metrics/mAP50-95(B)" in result["metrics"] and Path(result["best"]).exists()
    with open(Path(result["save_dir"]) / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2
    for row in rows:
        for name in ("train/box_loss", "train/cls_loss", "val/box_loss"):
            value = float(next(v for k, v in row.items() if k.strip() == name))
            assert math.isfinite(value) and value > 0, (name, value)
    assert done.stderr.count("gpufeed: preparing split") == 2  # train and val, once each
    prepared = sorted(path.parent.name for path in shards.rglob("manifest.json"))
    assert prepared == ["train", "val.aspect"]  # val in aspect-ratio order: tight rect batches; train shuffled
    again = train(data, project, shards, degrees=10.0, mosaic=0.5, mixup=0.3, cutmix=0.3)  # the recipe takes the run's
    assert again.returncode == 0, again.stderr[-4000:]
    assert "gpufeed: preparing split" not in again.stderr  # found in the cache


def test_a_hyperparameter_the_recipe_does_not_draw_stops_the_run(data: Path, tmp_path: Path) -> None:
    project = tmp_path / "runs"
    project.mkdir()
    done = train(data, project, tmp_path / "shards", copy_paste=0.2)
    assert done.returncode != 0
    assert "does not draw copy_paste=0.2" in done.stderr, done.stderr[-3000:]
