"""Ultralytics' own train and val dataloaders beside gpufeed's, on the same YOLO dataset: images/s and CPU ms per image.

One generated YOLO dataset (--images photo-like JPEGs of 640 to 1280 px,
half train, half val, with data.yaml), imgsz 640, batch 16, --workers
workers on each side, both in the venv that has ultralytics (by default the
test suite's cached "vision" venv: torch 2.14.1, plain Pillow, OpenCV; gpufeed
from this checkout on PYTHONPATH), so both sides run with what a user of
ultralytics installs:

  ultralytics  `build_yolo_dataset` + `build_dataloader`, as its trainer
               builds them: train with its default hyperparameters (mosaic
               1.0, translate 0.1, scale 0.5, fliplr 0.5, HSV 0.015/0.7/0.4),
               val letterboxed in rectangular batches (rect=True, as its
               trainer's validator).
  gpufeed      `pipeline.integrations.yolo_batches.yolo_loader` over the
               splits prepared once beforehand (`split_shards`, untimed: that
               is the point), thread workers, batches as ultralytics' dicts:
               train `recipe="yolo"` (HSV in the workers: a CPU device), val
               (prepared in aspect-ratio order, as ultralytics sorts it)
               letterboxed, each batch cut to the rectangle its images need.

Each row runs in its own process: one warm-up epoch (workers started, page
cache warm), then --epochs timed epochs; CPU time is the whole process
tree's (psutil). Rows alternate over --rounds rounds; the best counts.
--no-mosaic compares the recipe with mosaic off (close_mosaic epochs) on
both sides. Targets: >= 3x ultralytics' images/s and <= 1/3 its CPU ms per
image, train and val.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MEASURE = r"""
import json, os, sys, time
import psutil

def tree_cpu():
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total

def timed(loader, epochs):
    images = 0
    for batch in loader:  # the warm-up epoch
        pass
    cpu, start = tree_cpu(), time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            images += batch["img"].shape[0]
    return {"images": images, "wall": time.perf_counter() - start, "cpu": tree_cpu() - cpu}
"""

ULTRALYTICS = MEASURE + r"""
job = json.loads(sys.argv[1])
from ultralytics.cfg import get_cfg
from ultralytics.data import build_dataloader, build_yolo_dataset
from ultralytics.data.utils import check_det_dataset
data = check_det_dataset(job["data"])
cfg = get_cfg(overrides={"data": job["data"], "imgsz": job["imgsz"], "mosaic": 0.0 if job["no_mosaic"] else 1.0})
train = job["split"] == "train"
dataset = build_yolo_dataset(cfg, data[job["split"]], job["batch"], data, mode="train" if train else "val",
                             rect=not train, stride=32)
loader = build_dataloader(dataset, job["batch"], job["workers"], shuffle=train, rank=-1)
print(json.dumps(timed(loader, job["epochs"])))
"""

GPUFEED = MEASURE + r"""
job = json.loads(sys.argv[1])
from pipeline.integrations.yolo_batches import split_shards, yolo_loader
train = job["split"] == "train"
shards = split_shards(job["data"], job["split"], job["imgsz"], job["root"], cache=job["cache"])
loader = yolo_loader(shards, job["batch"], train, job["imgsz"], workers=job["workers"], epochs=job["epochs"] + 1,
                     close_mosaic=job["epochs"] + 1 if job["no_mosaic"] else 0, rect=True)
print(json.dumps(timed(loader, job["epochs"])))
"""


def vision_python(given: str | None) -> str | None:
    """The given python, else the test suite's "vision" venv (built now, once, when absent)."""
    if given:
        return given
    sys.path.insert(0, str(ROOT / "tests"))
    import pytest
    from extra_venvs import VISION, venv_python

    try:
        return str(venv_python("vision", VISION))
    except pytest.skip.Exception as exc:
        print(f"the vision venv cannot be built here: {exc}")
        return None


def make_dataset(folder: Path, images: int) -> Path:
    from pipeline.demo import make_yolo_dataset

    yaml = folder / "data" / "data.yaml"
    if not yaml.exists():
        root = Path(make_yolo_dataset(folder / "data", images, min_side=640, max_side=1280))
        yaml.write_text(yaml.read_text().replace("path: .", f"path: {root}"))
    return yaml


def run(python: str, script: str, job: dict[str, object], folder: Path) -> dict[str, float] | None:
    env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(folder / "yolo-config"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([python, "-c", script, json.dumps(job)], capture_output=True, text=True, env=env,
                          timeout=1800, check=False)  # fmt: skip
    if done.returncode != 0:
        print(f"  failed: {done.stderr[-1500:]}")
        return None
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.expanduser("~/.cache/gpufeed/bench-yolo"),
                        help="folder for the generated dataset and its prepared splits (kept between runs)")  # fmt: skip
    parser.add_argument("--images", type=int, default=400, help="generated photos, half train, half val (default 400)")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per run (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per row, alternating; the best counts")
    parser.add_argument("--no-mosaic", action="store_true", help="the recipe with mosaic off (close_mosaic epochs)")
    parser.add_argument("--splits", default="train,val", help="which loaders: train, val or both (default)")
    parser.add_argument("--python", help="a python with ultralytics 8.4 (default: the tests' vision venv)")
    args = parser.parse_args()
    python = vision_python(args.python)
    if python is None:
        print("no venv with ultralytics: run the test suite once (it builds the vision venv), or give --python")
        return 1
    folder = Path(args.data)
    folder.mkdir(parents=True, exist_ok=True)
    yaml = make_dataset(folder, args.images)
    best: dict[tuple[str, str], dict[str, float]] = {}
    for _ in range(args.rounds):
        for split in args.splits.split(","):
            for side, script in (("ultralytics", ULTRALYTICS), ("gpufeed", GPUFEED)):
                job = {"data": str(yaml), "root": str(yaml.parent), "cache": str(folder / "shards"), "split": split,
                       "imgsz": args.imgsz, "batch": args.batch, "workers": args.workers, "epochs": args.epochs,
                       "no_mosaic": args.no_mosaic}  # fmt: skip
                found = run(python, script, job, folder)
                if found is None:
                    continue
                rate = found["images"] / found["wall"]
                print(f"  {split:5} {side:12} {rate:8.1f} images/s {found['cpu'] * 1000 / found['images']:7.2f} CPU ms/image")
                if (split, side) not in best or rate > best[(split, side)]["images"] / best[(split, side)]["wall"]:
                    best[(split, side)] = found
    mode = "mosaic off" if args.no_mosaic else "mosaic 1.0"
    print(f"YOLO dataloaders, {args.images // 2} images per split (640-1280 px), imgsz {args.imgsz}, batch {args.batch}, "
          f"{args.workers} workers, {mode}; best of {args.rounds} (Python {python})")  # fmt: skip
    print(f"{'':20}{'images/s':>10}{'CPU ms/image':>14}")
    for (split, side), found in sorted(best.items()):
        print(f"{split + ' ' + side:20}{found['images'] / found['wall']:>10.1f}{found['cpu'] * 1000 / found['images']:>14.2f}")
    for split in args.splits.split(","):
        if (split, "ultralytics") in best and (split, "gpufeed") in best:
            ours, theirs = best[(split, "gpufeed")], best[(split, "ultralytics")]
            speed = (ours["images"] / ours["wall"]) / (theirs["images"] / theirs["wall"])
            cpu = (ours["cpu"] / ours["images"]) / (theirs["cpu"] / theirs["images"])
            print(f"{split}: gpufeed vs ultralytics: {speed:.2f}x the images/s, {cpu:.2f}x the CPU per image "
                  f"(targets: >= 3x, <= 0.33x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
