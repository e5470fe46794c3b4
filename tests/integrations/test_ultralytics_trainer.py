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
not draw yet (bgr) stops the run with a message.
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
from pipeline.integrations import ultralytics as integration

data, project, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
trainer_name, model_yaml = extra.pop("trainer", "DetectionTrainer"), extra.pop("model", "yolov8n.yaml")
model = YOLO(model_yaml)
model.train(data=data, trainer=getattr(integration, trainer_name), epochs=2, close_mosaic=1, imgsz=96, batch=8,
            workers=2, device="cpu", amp=False, plots=False, project=project, name="run", exist_ok=True,
            verbose=False, **extra)
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


def assert_trained(result: dict, metric: str, losses: tuple[str, ...]) -> None:
    """Two epochs ran: `metric` among the final metrics, best.pt saved, each epoch's `losses` finite and positive."""
    assert metric in result["metrics"] and Path(result["best"]).exists()
    with open(Path(result["save_dir"]) / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2
    for row in rows:
        for name in losses:
            value = float(next(v for k, v in row.items() if k.strip() == name))
            assert math.isfinite(value) and value > 0, (name, value)


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
    assert_trained(result, "metrics/mAP50-95(B)", ("train/box_loss", "train/cls_loss", "val/box_loss"))
    assert done.stderr.count("gpufeed: preparing split") == 2  # train and val, once each
    prepared = sorted(path.parent.name for path in shards.rglob("manifest.json"))
    assert prepared == ["train", "val.aspect"]  # val in aspect-ratio order: tight rect batches; train shuffled
    again = train(data, project, shards, degrees=10.0, mosaic=0.5, mixup=0.3, cutmix=0.3)  # the recipe takes the run's
    assert again.returncode == 0, again.stderr[-4000:]
    assert "gpufeed: preparing split" not in again.stderr  # found in the cache


def test_a_hyperparameter_the_recipe_does_not_draw_stops_the_run(data: Path, tmp_path: Path) -> None:
    project = tmp_path / "runs"
    project.mkdir()
    done = train(data, project, tmp_path / "shards", bgr=0.2)
    assert done.returncode != 0
    assert "does not draw bgr=0.2" in done.stderr, done.stderr[-3000:]


@pytest.fixture(scope="module")
def seg_data(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same images, each box's object outlined as YOLO-seg does: a hexagon inside its box."""
    root = tmp_path_factory.mktemp("seg") / "data"
    shutil.copytree(data.parent, root)
    for label in (root / "labels").rglob("*.txt"):
        lines = []
        for line in label.read_text().splitlines():
            cls, cx, cy, w, h = line.split()
            x0, y0, x1, y1 = float(cx) - float(w) / 2, float(cy) - float(h) / 2, float(cx) + float(w) / 2, float(cy) + float(h) / 2
            points = [(x0 + (x1 - x0) / 4, y0), (x1 - (x1 - x0) / 4, y0), (x1, (y0 + y1) / 2),
                      (x1 - (x1 - x0) / 4, y1), (x0 + (x1 - x0) / 4, y1), (x0, (y0 + y1) / 2)]  # fmt: skip
            lines.append(cls + " " + " ".join(f"{x:.6f} {y:.6f}" for x, y in points))
        label.write_text("\n".join(lines) + "\n")
    yaml = root / "data.yaml"
    yaml.write_text(yaml.read_text().replace(str(data.parent), str(root)))
    return yaml


def test_ultralytics_trains_a_segmentation_model_on_gpufeeds_loaders_offline(seg_data: Path, tmp_path: Path) -> None:
    """YOLO-seg: the polygons go through the recipe (copy-paste's mirrored copies too), the masks are drawn from
    them; training and validation run."""
    project, shards = tmp_path / "runs", tmp_path / "shards"
    project.mkdir()
    done = train(seg_data, project, shards, trainer="SegmentationTrainer", model="yolov8n-seg.yaml", copy_paste=0.5)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["train_loader"] == "pipeline.integrations.yolo_batches.YoloLoader"
    assert result["final_val_loader"] == "YoloLoader"
    assert_trained(result, "metrics/mAP50-95(M)", ("train/seg_loss", "train/box_loss", "val/seg_loss"))


MASKS_SCRIPT = r"""
import json, sys
import numpy as np
from ultralytics.data.utils import polygons2masks_overlap
from pipeline.integrations.ultralytics import instance_masks
from pipeline.integrations.yolo_batches import split_shards, yolo_loader

data, root, shards = sys.argv[1], sys.argv[2], sys.argv[3]
rng = np.random.default_rng(0)
same = 0
for _ in range(20):  # single-part polygons: ultralytics' own overlap masks and order
    polygons = [rng.uniform(0, 96, (int(rng.integers(3, 9)), 2)) for _ in range(int(rng.integers(0, 6)))]
    theirs, their_order = polygons2masks_overlap((96, 128), [p.astype(np.float32) for p in polygons], downsample_ratio=4)
    ours, our_order = instance_masks((96, 128), [[p.astype(np.float32)] for p in polygons], 4, True)
    same += int(np.array_equal(ours[0], theirs) and list(our_order) == list(their_order))
errors = []
for split, train in (("train", True), ("val", False)):
    loader = yolo_loader(split_shards(data, split, 96, root, cache=shards), 8, train, 96, workers=2, rect=True,
                         masks=lambda size, shapes: instance_masks(size, shapes, 4, True),
                         hyp={"copy_paste": 0.5} if train else None)
    for batch in loader:
        height, width = batch["img"].shape[2:]
        assert batch["masks"].shape == (len(batch["img"]), height // 4, width // 4), batch["masks"].shape
        for image in range(len(batch["img"])):
            own = (batch["batch_idx"] == image).nonzero().flatten()
            for k, row in enumerate(own.tolist()):  # value k + 1 is the image's k-th instance: its box
                ys, xs = (batch["masks"][image] == k + 1).nonzero(as_tuple=True)
                if len(xs) < 4:
                    continue  # covered by smaller ones, or too small at 1/4
                cx, cy, w, h = (batch["bboxes"][row] * np.array([width, height, width, height])).tolist()
                box = np.array([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2])
                found = np.array([xs.min() * 4, ys.min() * 4, (xs.max() + 1) * 4, (ys.max() + 1) * 4], float)
                outside = max(box[0] - found[0], box[1] - found[1], found[2] - box[2], found[3] - box[3])
                errors.append((float(outside), float(np.abs(found - box).max())))
print(json.dumps({"same": same, "errors": errors}))
"""


def test_segmentation_masks_are_ultralytics_own_and_follow_their_instances(seg_data: Path, tmp_path: Path) -> None:
    """instance_masks equals ultralytics' polygons2masks_overlap; in every batch (train with copy-paste, rect val),
    mask value k + 1 lies on the image's k-th box: the instances are in the masks' order."""
    python = venv_python("vision", VISION)
    env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(tmp_path / "config"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(python), "-c", MASKS_SCRIPT, str(seg_data), str(seg_data.parent), str(tmp_path / "shards")],
                          capture_output=True, text=True, env=env, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"] == 20
    errors = result["errors"]
    # a 1/4 mask is a few px coarse; an instance partly covered by a smaller one shows less than its box
    assert len(errors) > 50 and max(outside for outside, _ in errors) <= 4.0, errors
    assert sum(error <= 4.0 for _, error in errors) >= 0.8 * len(errors), errors

