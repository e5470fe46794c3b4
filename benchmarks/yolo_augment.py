"""What ultralytics' training augmentation costs per image on the CPU, beside gpufeed's plan-and-render of it.

The same generated photos (--images JPEGs of 640 to 1280 px), decoded once
each and kept (as ultralytics keeps its recent images in a buffer), then
--outputs training images at --imgsz with the default recipe (mosaic 1.0,
translate 0.1, scale 0.5, fliplr 0.5, HSV 0.015/0.7/0.4), in one thread per
side. As in ultralytics' dataset, each output reads its own photo, and its
mosaic's three partners come from a buffer of the 64 photos read last
(filled before the timing):

  ultralytics  its own classes in the venv that has it (--ultralytics-python;
               by default the test suite's cached "vision" venv): cv2.imread,
               `load_image`'s resize (longer side imgsz), Mosaic,
               RandomPerspective (cv2.warpAffine of the 2S x 2S canvas),
               RandomHSV, RandomFlip, then to a CHW tensor as its Format does.
  gpufeed      `pipeline.augment` on the photos as prepare stores them (longer
               side imgsz, prepared untimed): per output `plan` (one matrix
               per source) and `render_jpegs` (each tile's part of its JPEG
               decoded at its DCT scale, one native resize per source,
               straight into the CHW output), and the HSV gains in native code
               (`hsv_in_place`, as a CPU device's worker does it).
               --no-mosaic compares the recipe with mosaic off on both sides.

Printed: images/s and CPU ms per image of each side, and gpufeed's ratios
(the target: >= 3x the images/s, <= 1/3 the CPU ms).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ULTRALYTICS_SIDE = r"""
import json, math, random, sys, time
import cv2
import numpy as np
cv2.setNumThreads(1)
from ultralytics.data.augment import Format, Mosaic, RandomFlip, RandomHSV, RandomPerspective
from ultralytics.utils.instance import Instances

job = json.load(sys.stdin)
size, outputs = job["imgsz"], job["outputs"]
random.seed(0); np.random.seed(0)
def load(i):
    path, boxes = job["images"][i], job["boxes"][i]
    im = cv2.imread(path)
    h0, w0 = im.shape[:2]
    r = size / max(h0, w0)
    if r != 1:
        im = cv2.resize(im, (min(math.ceil(w0 * r), size), min(math.ceil(h0 * r), size)), interpolation=cv2.INTER_LINEAR)
    b = np.array(boxes, np.float32).reshape(-1, 4) / np.array([w0, h0, w0, h0], np.float32)
    return im, b, (h0, w0), path

def sample(entry):
    im, b, shape, path = entry
    return {"img": im, "resized_shape": im.shape[:2], "ori_shape": shape, "im_file": path,
            "cls": np.zeros((len(b), 1), np.float32),
            "instances": Instances(b.copy(), np.zeros((0, 1000, 2), np.float32), None, bbox_format="xyxy", normalized=True)}

buffer = [load(i) for i in range(min(64, len(job["images"])))]  # the buffer of recent images, filled before timing
dataset = type("Dataset", (), {"cache": None, "buffer": list(range(len(buffer))),
                               "get_image_and_label": lambda self, i: sample(buffer[i])})()
mosaic = Mosaic(dataset, imgsz=size, p=0.0 if job["no_mosaic"] else 1.0)
steps = [mosaic, RandomPerspective(degrees=0.0, translate=0.1, scale=0.5, shear=0.0, perspective=0.0, size=(size, size)),
         RandomHSV(0.015, 0.7, 0.4), RandomFlip(direction="vertical", p=0.0), RandomFlip(direction="horizontal", p=0.5),
         Format(bbox_format="xywh", normalize=True, return_mask=False, return_keypoint=False, batch_idx=True)]
start_cpu, start = time.process_time(), time.perf_counter()
boxes = 0
for n in range(outputs):
    own = load(n % len(job["images"]))  # the sample's own image, read and resized (load_image)
    buffer[n % len(buffer)] = own
    labels = sample(own)
    for step in steps:
        labels = step(labels)
    boxes += len(labels["cls"])
cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
print(json.dumps({"cpu": cpu, "wall": wall, "boxes": boxes, "shape": list(labels["img"].shape)}))
"""


def gpufeed_side(images: list[str], boxes: list[list[list[float]]], size: int, outputs: int, no_mosaic: bool) -> dict:
    import torch

    from pipeline.augment.hsv import hsv_in_place
    from pipeline.augment.render import render, render_jpegs
    from pipeline.augment.yolo import YoloRecipe, plan

    torch.set_num_threads(1)
    render(plan(YoloRecipe(size=32, mosaic=None), random.Random(1), [(8, 8)], [np.zeros((0, 4))],
                [np.zeros(0, np.int64)]), [np.zeros((8, 8, 3), np.uint8)])  # imports and the native library, untimed
    recipe = YoloRecipe(size=size, mosaic=None) if no_mosaic else YoloRecipe(size=size)
    rng = random.Random(0)

    from pipeline import native

    decoder = native.RegionDecoder(native.library())  # type: ignore[arg-type]

    def load(i: int) -> tuple[bytes, tuple[int, int], int]:
        data = Path(images[i]).read_bytes()  # the file only: each output decodes the parts it shows
        return data, decoder.header(data), i

    buffer = [load(i) for i in range(min(64, len(images)))]  # recent images, as ultralytics keeps them
    start_cpu, start = time.process_time(), time.perf_counter()
    batch = np.empty((16, 3, size, size), np.uint8)
    count = 0
    hsv_cpu = 0.0
    for n in range(outputs):
        own = load(n % len(images))
        buffer[n % len(buffer)] = own
        chosen = [own] + [buffer[rng.randrange(len(buffer))] for _ in range(recipe.sources - 1)]
        index = [c[2] for c in chosen]
        made = plan(recipe, rng, [c[1] for c in chosen], [np.array(boxes[i]).reshape(-1, 4) for i in index],
                    [np.zeros(len(boxes[i]), np.int64) for i in index])  # fmt: skip
        slot = batch[n % 16]
        render_jpegs(made, [c[0] for c in chosen], out=slot, decoder=decoder)
        if made.hsv_gains is not None:
            before = time.process_time()
            hsv_in_place(slot, made.hsv_gains)  # a CPU device's worker; on a GPU `apply_hsv` takes the batch
            hsv_cpu += time.process_time() - before
        count += len(made.boxes)
    return {"cpu": time.process_time() - start_cpu, "wall": time.perf_counter() - start, "boxes": count, "hsv_cpu": hsv_cpu}


def photos(folder: str, count: int) -> tuple[list[str], list[list[list[float]]]]:
    from pipeline.demo import make_coco_dataset

    source = make_coco_dataset(folder, images=count, min_side=640, max_side=1280, segmentation=None)
    coco = json.loads(Path(source).read_text())
    root = Path(folder) / "train"  # make_coco_dataset's image folder
    by_image: dict[int, list[list[float]]] = {}
    for entry in coco["annotations"]:
        x, y, w, h = entry["bbox"]
        by_image.setdefault(entry["image_id"], []).append([x, y, x + w, y + h])
    images = [str(root / image["file_name"]) for image in coco["images"]]
    return images, [by_image.get(image["id"], []) for image in coco["images"]]


def prepared_photos(folder: str, size: int) -> tuple[list[str], list[list[list[float]]]]:
    """The photos as `gpufeed prepare --mode longer --size S` stores them (offline, untimed): JPEGs whose
    longer side is S, and their boxes in those pixels; written out as files for the timed loop to read."""
    import io
    import tarfile

    from pipeline import PrepareSpec, ResizeSpec, prepare_dataset

    source = str(Path(folder) / "annotations" / "instances_train.json")
    out = Path(folder) / "prepared"
    prepare_dataset(PrepareSpec(source, str(out), resize=ResizeSpec(size=size, mode="longer")), workers=1)
    images, boxes = [], []
    for shard in sorted(out.glob("shard-*.tar")):
        members: dict[str, dict[str, bytes]] = {}
        with tarfile.open(shard) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                members.setdefault(key, {})[ext] = tar.extractfile(member).read()  # type: ignore[union-attr]
        for key, parts in sorted(members.items()):
            path = out / f"{key}.jpg"
            path.write_bytes(parts["jpg"])
            images.append(str(path))
            found = np.load(io.BytesIO(parts["boxes.npy"])) if "boxes.npy" in parts else np.zeros((0, 4))
            boxes.append(found.astype(float).tolist())
    return images, boxes


def ultralytics_python(given: str | None) -> str | None:
    if given:
        return given
    found = sorted(glob.glob(os.path.expanduser("~/.cache/gpufeed/test-venvs/vision-*/bin/python")))
    return found[-1] if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64, help="generated photos (default 64)")
    parser.add_argument("--outputs", type=int, default=256, help="training images made per side (default 256)")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--no-mosaic", action="store_true", help="the recipe with mosaic off (close_mosaic epochs)")
    parser.add_argument("--ultralytics-python", help="a python with ultralytics 8.4 (default: the tests' vision venv)")
    args = parser.parse_args()
    python = ultralytics_python(args.ultralytics_python)
    with tempfile.TemporaryDirectory() as folder:
        images, boxes = photos(folder, args.images)
        prepared, prepared_boxes = prepared_photos(folder, args.imgsz)
        ours = gpufeed_side(prepared, prepared_boxes, args.imgsz, args.outputs, args.no_mosaic)
        theirs = None
        if python is None:
            print("ultralytics: no venv with it (run the test suite once, or give --ultralytics-python)")
        else:
            job = {"images": images, "boxes": boxes, "imgsz": args.imgsz, "outputs": args.outputs,
                   "no_mosaic": args.no_mosaic}  # fmt: skip
            env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": os.path.join(folder, "yolo-config")}
            done = subprocess.run([python, "-c", ULTRALYTICS_SIDE], input=json.dumps(job), capture_output=True,
                                  text=True, env=env, check=False)  # fmt: skip
            if done.returncode != 0:
                print("ultralytics failed:", done.stderr[-2000:])
            else:
                theirs = json.loads(done.stdout.strip().splitlines()[-1])
    mode = "mosaic off" if args.no_mosaic else "mosaic 1.0"
    print(f"YOLO training augmentation, one thread each: {args.outputs} images at {args.imgsz} from {args.images} "
          f"photos (640-1280 px), default recipe, {mode}")  # fmt: skip
    print(f"{'':14}{'images/s':>10}{'CPU ms/image':>14}{'boxes':>8}")
    rows = [("ultralytics", theirs), ("gpufeed", ours)]
    for name, row in rows:
        if row is not None:
            print(f"{name:14}{args.outputs / row['wall']:>10.1f}{row['cpu'] * 1000 / args.outputs:>14.2f}{row['boxes']:>8}")
    worker = (ours["cpu"] - ours["hsv_cpu"]) * 1000 / args.outputs
    print(f"gpufeed, of which HSV in the worker (a CPU device): {ours['hsv_cpu'] * 1000 / args.outputs:.2f} ms/image; "
          f"without it (a GPU device applies it to the batch): {worker:.2f} ms/image")  # fmt: skip
    if theirs is not None:
        print(f"gpufeed's workers with a GPU device vs ultralytics: {worker / (theirs['cpu'] * 1000 / args.outputs):.2f}x the CPU")
        speed = (args.outputs / ours["wall"]) / (args.outputs / theirs["wall"])
        cpu = ours["cpu"] / theirs["cpu"]
        print(f"gpufeed vs ultralytics: {speed:.2f}x the images/s, {cpu:.2f}x the CPU per image "
              f"(targets: >= 3x, <= 0.33x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
