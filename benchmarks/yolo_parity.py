"""Does a model trained on gpufeed's batches do as well as one trained on ultralytics' own? Final mAP50-95, both.

yolov8n from its yaml (no weights), the same generated YOLO dataset
(--images scenes of --min-side to --max-side px with 3 classes of objects,
half train, half val), the same epochs, imgsz, batch and seed, trained
twice on the CPU with ultralytics 8.4 (by default in the test suite's cached
"vision" venv, offline): once with its own dataloaders, once with
`pipeline.integrations.ultralytics.DetectionTrainer` (gpufeed's). Each run
ends with ultralytics' validation of its best.pt on the val split (its own
validator and metrics in both runs; the loader of the val images is the
run's). Printed: each run's final mAP50 and mAP50-95, its wall time, and
the gap (target: mAP50-95 within 10 % of each other).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

TRAIN = r"""
import json, os, shutil, sys, time
from pathlib import Path
import matplotlib
fonts = Path(os.environ["YOLO_CONFIG_DIR"]) / "Ultralytics"
fonts.mkdir(parents=True, exist_ok=True)
shutil.copy(Path(matplotlib.get_data_path()) / "fonts/ttf/DejaVuSans.ttf", fonts / "Arial.ttf")
from ultralytics import YOLO, settings
settings.update({"sync": False})
job = json.loads(sys.argv[1])
trainer = None
if job["side"] == "gpufeed":
    from pipeline.integrations.ultralytics import DetectionTrainer as trainer
start = time.perf_counter()
model = YOLO("yolov8n.yaml")
model.train(data=job["data"], trainer=trainer, epochs=job["epochs"], imgsz=job["imgsz"], batch=job["batch"],
            workers=job["workers"], seed=job["seed"], device="cpu", amp=False, plots=False, project=job["project"],
            name=job["side"], exist_ok=True, verbose=False, close_mosaic=job["close_mosaic"])
metrics = model.trainer.metrics
print(json.dumps({"map50": float(metrics["metrics/mAP50(B)"]), "map": float(metrics["metrics/mAP50-95(B)"]),
                  "seconds": time.perf_counter() - start}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400, help="generated scenes, half train, half val (default 400)")
    parser.add_argument("--min-side", type=int, default=160)
    parser.add_argument("--max-side", type=int, default=320)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--close-mosaic", type=int, default=5)
    parser.add_argument("--imgsz", type=int, default=192)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--python", help="a python with ultralytics 8.4 (default: the tests' vision venv)")
    args = parser.parse_args()
    from yolo import vision_python

    from pipeline.demo import make_yolo_dataset

    python = vision_python(args.python)
    if python is None:
        return 1
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(make_yolo_dataset(Path(folder) / "data", args.images, min_side=args.min_side,
                                      max_side=args.max_side))  # fmt: skip
        (root / "data.yaml").write_text((root / "data.yaml").read_text().replace("path: .", f"path: {root}"))
        env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(Path(folder) / "config"),
               "PYTHONPATH": str(ROOT), "GPUFEED_YOLO_SHARDS": str(Path(folder) / "shards")}  # fmt: skip
        for side in ("ultralytics", "gpufeed"):
            job = {"side": side, "data": str(root / "data.yaml"), "project": str(Path(folder) / "runs"),
                   "epochs": args.epochs, "imgsz": args.imgsz, "batch": args.batch, "workers": args.workers,
                   "seed": args.seed, "close_mosaic": args.close_mosaic}  # fmt: skip
            done = subprocess.run([python, "-c", TRAIN, json.dumps(job)], capture_output=True, text=True, env=env,
                                  cwd=folder, check=False)  # fmt: skip
            if done.returncode != 0:
                print(f"{side} failed:\n{done.stderr[-3000:]}")
                return 1
            results[side] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"yolov8n from its yaml, {args.images // 2} train / {args.images // 2} val generated scenes "
          f"({args.min_side}-{args.max_side} px), {args.epochs} epochs (close_mosaic {args.close_mosaic}), "
          f"imgsz {args.imgsz}, batch {args.batch}, CPU")  # fmt: skip
    print(f"{'':14}{'mAP50':>8}{'mAP50-95':>10}{'minutes':>9}")
    for side, found in results.items():
        print(f"{side:14}{found['map50']:>8.3f}{found['map']:>10.3f}{found['seconds'] / 60:>9.1f}")
    ours, theirs = results["gpufeed"]["map"], results["ultralytics"]["map"]
    gap = abs(ours - theirs) / max(ours, theirs, 1e-9)
    print(f"mAP50-95: gpufeed {ours:.3f} vs ultralytics {theirs:.3f}: {gap:.1%} apart (target: within 10 %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
