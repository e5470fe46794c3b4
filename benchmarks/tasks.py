"""How fast is `make_loader` for detection, captions and segmentation next to what a user writes instead?

One epoch of training batches (RandomResizedCrop to --crop, scale 0.08-1,
ratio 3/4-4/3, or a letterbox to --crop, then a random horizontal flip,
float32 normalised NCHW, the same --workers in every row, CPU device) over
the same generated raw files, in one run:

  detection   gpufeed: the COCO source prepared once (`prepare_dataset`,
              shorter side --size, outside the timed region), then
              make_loader(task="detection"): boxes moved, scaled, clipped and
              dropped with the crop and flip each image got.
              baseline: a map-style Dataset over the raw COCO files (PIL
              decode) with torchvision.transforms.v2 (tv_tensors.BoundingBoxes,
              RandomResizedCrop, RandomHorizontalFlip, SanitizeBoundingBoxes,
              ToDtype, Normalize) in a torch DataLoader; where torchvision
              does not import, the same steps written with PIL and torch (the
              crop drawn by torchvision's algorithm, PIL crop + bilinear resize,
              v2's box arithmetic, flip), labelled so in the output.
  letterbox   gpufeed: the same prepared COCO, make_loader(task="detection",
              recipe="letterbox"): the whole image, its longer side --crop,
              centred on 114 grey (YOLO's letterbox), boxes scaled and
              shifted with it, then the flip.
              baseline: the same Dataset with transforms.v2's letterbox
              (v2.Resize(size=None, max_size=--crop), v2.Pad centring it in
              fill 114, RandomHorizontalFlip, SanitizeBoundingBoxes, ToImage,
              ToDtype, Normalize) or, without torchvision, the same in PIL +
              torch (bilinear resize pasted on a grey canvas, the boxes scaled
              and shifted, flip). No box leaves a letterboxed image, so both
              sides deliver every box.
  recipes     informational rows: gpufeed with recipe="scale_jitter" (on the
              letterbox copy) and recipe="iou_crop" (on the detection copy).
  installed   every detection recipe's gpufeed row again as a user installs
              gpufeed: the wheel built now (scripts/build_wheel.sh), torch 2.13
              and plain Pillow (what torchvision, ultralytics and timm install)
              in a venv of their own (--installed-venv, made on first use), run
              as a subprocess; each must reach >= 90 % of its development row.
  captions    gpufeed: make_loader(task="captions") straight over the
              img2dataset-style shards (jpg + txt + json) by brace pattern;
              informational: the same after `prepare_dataset` from them.
              baseline: plain wds.WebDataset(...).shuffle().decode("pil")
              .to_tuple("jpg", "txt") with the same crop, flip and
              normalisation, in a torch DataLoader.
  segmentation gpufeed: the image + mask folder prepared once, then
              make_loader(task="segmentation"): each mask cropped and flipped
              with its image, nearest-neighbour.
              baseline: transforms.v2 with tv_tensors.Mask (or the same steps
              in PIL: the mask cropped and resized NEAREST) over the raw files.

The raw files are made once by pipeline.demo's generators
(`make_coco_dataset`, `make_segmentation_dataset`, `make_caption_shards`,
sides --min-side to --max-side) and cached under --data. Every row warms up
(the page cache, then --warmup batches, which also start the workers) and
then times one full epoch, touching each batch's images and counting its
targets (a detection row that delivers no box is flagged and its target
not met). Rows run --rounds times, alternating order, and the best run counts;
each run's noise (the share of the CPUs other processes took meanwhile) is
printed beside it, and a row whose best run was noisier than --noise-limit is
run again (--retries).

Usage:
    python benchmarks/tasks.py [--data DIR] [--n 600] [--rounds 2] [--json FILE] [--check]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

try:
    from . import common
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import common  # type: ignore[no-redef]

Run, Row = common.Run, common.Row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(REPO, "benchmarks", "results", "tasks-data")  # not under prepare.py's ImageFolder root
DATA_MARKER = ".benchmark-data.json"

SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop defaults, in every row
RATIO = (3 / 4, 4 / 3)
MEAN = (0.485, 0.456, 0.406)  # gpufeed's defaults, and what the baselines normalise with
STD = (0.229, 0.224, 0.225)
CLASSES = 6
LETTERBOX_FILL = 114  # YOLO's grey, gpufeed's default fill
TARGETS = {"detection": 3.0, "detection_letterbox": 3.0, "captions": 2.5, "segmentation": 3.0}
INSTALLED_TARGET = 0.9  # each detection recipe installed (wheel + plain Pillow) against the development row
DEFAULT_INSTALLED_VENV = os.path.join(REPO, ".venv-installed")
# The detection recipes, each run in this venv and in the installed one: row stem -> (prepared copy, recipe).
RECIPES = {"detection": ("coco-prepared", "crop"), "letterbox": ("coco-letterbox-prepared", "letterbox"),
           "scale-jitter": ("coco-letterbox-prepared", "scale_jitter"), "iou-crop": ("coco-prepared", "iou_crop")}  # fmt: skip

ROWS = {  # name: (task, title); the baselines' titles say which transforms ran (set_baseline_titles)
    "detection-gpufeed": ("detection", "gpufeed make_loader, task=detection"),
    "detection-baseline": ("detection", "transforms.v2 + DataLoader, raw COCO"),
    "letterbox-gpufeed": ("detection", "gpufeed make_loader, detection, letterbox"),
    "letterbox-baseline": ("detection", "transforms.v2 letterbox + DataLoader, raw COCO"),
    "scale-jitter-gpufeed": ("detection", "gpufeed make_loader, detection, scale_jitter"),
    "iou-crop-gpufeed": ("detection", "gpufeed make_loader, detection, iou_crop"),
    "detection-installed": ("detection", "installed (wheel + plain Pillow), task=detection"),
    "letterbox-installed": ("detection", "installed (wheel + plain Pillow), letterbox"),
    "scale-jitter-installed": ("detection", "installed (wheel + plain Pillow), scale_jitter"),
    "iou-crop-installed": ("detection", "installed (wheel + plain Pillow), iou_crop"),
    "captions-gpufeed": ("captions", "gpufeed make_loader on the shards"),
    "captions-gpufeed-prepared": ("captions", "gpufeed make_loader after prepare"),
    "captions-webdataset": ("captions", "plain webdataset + DataLoader"),
    "segmentation-gpufeed": ("segmentation", "gpufeed make_loader, task=segmentation"),
    "segmentation-baseline": ("segmentation", "transforms.v2 + DataLoader, raw files"),
}
HEADLINE = {"detection": ("detection-gpufeed", "detection-baseline"),
            "detection_letterbox": ("letterbox-gpufeed", "letterbox-baseline"),
            "captions": ("captions-gpufeed", "captions-webdataset"),
            "segmentation": ("segmentation-gpufeed", "segmentation-baseline")}  # fmt: skip
EQUIVALENT = "transforms.v2-equivalent (torchvision not importable)"


# ---------------------------------------------------------------------------
# Data: generated once, prepared once, both outside every timed region


def ensure_data(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """The raw files (pipeline.demo's generators) and gpufeed's prepared copies, made when missing; and what failed."""
    from pipeline import PrepareSpec, ResizeSpec, prepare_dataset
    from pipeline.demo import make_caption_shards, make_coco_dataset, make_segmentation_dataset
    from pipeline.errors import GpufeedError

    params = {"n": args.n, "min_side": args.min_side, "max_side": args.max_side, "classes": CLASSES,
              "per_shard": args.per_shard, "seed": 0, "coco": "boxes"}  # fmt: skip
    root = os.path.join(os.path.abspath(args.data), f"tasks-{args.n}-{args.min_side}-{args.max_side}")
    marker = os.path.join(root, DATA_MARKER)
    sides = {"min_side": args.min_side, "max_side": args.max_side, "classes": CLASSES}
    if not os.path.exists(marker) or json.load(open(marker)) != params:
        common.fresh_dir(root)
        print(f"generating {args.n} images x 3 datasets under {root} (once) ...", file=sys.stderr)
        make_coco_dataset(os.path.join(root, "coco"), args.n, segmentation=None, **sides)  # boxes only
        make_segmentation_dataset(os.path.join(root, "segmentation"), args.n, **sides)
        make_caption_shards(os.path.join(root, "captions"), args.n, per_shard=args.per_shard, **sides)
        with open(marker, "w") as handle:
            json.dump(params, handle)
    shards = -(-args.n // args.per_shard)
    paths = {
        "coco": os.path.join(root, "coco", "annotations", "instances_train.json"),
        "segmentation": os.path.join(root, "segmentation"),
        "captions": os.path.join(root, "captions", f"{{00000..{shards - 1:05d}}}.tar"),
    }
    failed: dict[str, str] = {}
    # What each loader row reads: prepared at --size (shorter side) for the crops; for the letterbox,
    # at the letterbox's own size (longer side = --crop), as a YOLO user prepares for it.
    jobs = [(name, source, ResizeSpec(size=args.size), f"{name}-prepared") for name, source in paths.items()]
    jobs.append(("coco", paths["coco"], ResizeSpec(size=args.crop, mode="longer"), "coco-letterbox-prepared"))
    for name, source, resize, key in jobs:
        out = os.path.join(root, f"{key}-{resize.mode}-{resize.size}")
        spec = PrepareSpec(source=source, out=out, resize=resize)
        try:
            result = prepare_dataset(spec, workers=args.workers)  # a finished one is only checked
        except GpufeedError as exc:  # its rows say so; the others still run
            failed[name] = f"prepare failed: {exc}"
            print(f"{name}: {failed[name]}", file=sys.stderr)
            continue
        if not result.already_complete:
            print(f"prepared {key}: {result.samples} samples in {result.seconds:.1f} s", file=sys.stderr)
        paths[key] = out
    return paths, failed


def raw_files(paths: dict[str, str]) -> list[str]:
    """Every raw and prepared file, for warming the page cache before each run."""
    found = []
    tops = {os.path.dirname(os.path.dirname(paths["coco"])), os.path.dirname(paths["captions"]), paths["segmentation"]}
    prepared = ("coco-prepared", "coco-letterbox-prepared", "segmentation-prepared", "captions-prepared")
    tops |= {paths[name] for name in prepared if name in paths}
    for top in sorted(tops):
        for dirpath, _, names in os.walk(top):
            found += [os.path.join(dirpath, name) for name in names]
    return found


def describe_data(paths: dict[str, str]) -> dict[str, Any]:
    coco = json.load(open(paths["coco"]))
    sizes = [(image["width"], image["height"]) for image in coco["images"]]
    folder = os.path.join(os.path.dirname(os.path.dirname(paths["coco"])), "train")
    jpeg_bytes = common.directory_bytes(folder)
    prepared = [os.path.join(paths["coco-prepared"], shard["path"]) for shard in _manifest(paths["coco-prepared"])["shards"]]
    return {
        "images": len(sizes),
        "mean_size": [round(sum(s[0] for s in sizes) / len(sizes)), round(sum(s[1] for s in sizes) / len(sizes))],
        "raw_mean_kb": round(jpeg_bytes / len(sizes) / 1024, 1),
        "boxes": len(coco["annotations"]),
        "prepared_mean_kb": round(sum(os.path.getsize(p) for p in prepared) / len(sizes) / 1024, 1),
        "path": os.path.dirname(os.path.dirname(os.path.dirname(paths["coco"]))),
    }


def _manifest(prepared: str) -> dict[str, Any]:
    with open(os.path.join(prepared, "manifest.json")) as handle:
        return json.load(handle)


# ---------------------------------------------------------------------------
# Timing an epoch


def count_targets(targets: Any) -> int:
    """What the consumer reads of the targets: boxes (detection), mask pixels of a class, non-empty captions."""
    if isinstance(targets, list) and targets and isinstance(targets[0], dict):
        return sum(len(t["boxes"]) for t in targets)
    if isinstance(targets, (list, tuple)):
        return sum(1 for text in targets if text)
    return int((targets[:, ::8, ::8] > 0).sum())  # masks: a sparse look, as cheap as a touch


def time_epoch(batches: Iterable[Any]) -> tuple[int, float, float, int]:
    """(images, seconds, seconds to the first batch, targets counted) of one pass over (images, targets) batches."""
    images = found = 0
    first = None
    start = time.perf_counter()
    for batch in batches:
        pictures, targets = batch[0], batch[1]
        float(pictures[(0,) * pictures.ndim])
        found += count_targets(targets)
        images += len(pictures)
        if first is None:
            first = time.perf_counter() - start
    return images, time.perf_counter() - start, first or 0.0, found


def warm_up(batches: Iterable[Any], count: int) -> None:
    iterator = iter(batches)
    for _, batch in zip(range(count), iterator):
        float(batch[0].flatten()[0])
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
    del iterator


def epoch_run(loader: Any, warmup: int, set_epoch: bool) -> Run:
    warm_up(loader, warmup)
    if set_epoch:
        loader.set_epoch(1)
    images, seconds, first, found = time_epoch(loader)
    return Run(images, seconds, {"first_batch_s": round(first, 4), "targets_counted": found})


# ---------------------------------------------------------------------------
# gpufeed


def run_gpufeed(source: str, args: argparse.Namespace, task: str, recipe: str = "crop") -> Run:
    from pipeline import make_loader

    loader = make_loader(
        source, args.batch, device="cpu", crop=args.crop, num_workers=args.workers, scale=SCALE, ratio=RATIO, task=task,
        recipe=recipe, fill=LETTERBOX_FILL,
    )  # fmt: skip
    try:
        run = epoch_run(loader, args.warmup, True)
        run.detail["decoder"] = loader._crop.decoder
        run.detail["stats"] = loader.stats.to_dict()
    finally:
        loader.close()
    return run


def run_installed(installed: common.Installed, args: argparse.Namespace, stem: str) -> Run:
    """A detection recipe's gpufeed row in the installed venv: this script, with that venv's python and gpufeed."""
    import subprocess

    command = [installed.python, os.path.abspath(__file__), "--installed-row", stem]
    for option in ("data", "n", "min_side", "max_side", "per_shard", "size", "crop", "batch", "workers", "warmup"):
        command += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=""), check=False)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return Run(answer["images"], answer["seconds"], answer["detail"])


def run_installed_row(args: argparse.Namespace) -> int:
    """`--installed-row STEM`: what the installed venv's python runs; one JSON line on stdout."""
    import pipeline

    if os.path.dirname(os.path.dirname(os.path.abspath(pipeline.__file__))) == REPO:
        raise SystemExit(f"the installed row imported the checkout's gpufeed ({pipeline.__file__})")
    paths, failed = ensure_data(args)
    source, recipe = RECIPES[args.installed_row]
    if source.split("-prepared")[0] in failed:
        raise SystemExit(failed[source.split("-prepared")[0]])
    run = run_gpufeed(paths[source], args, "detection", recipe=recipe)
    common.print_json_line({"images": run.images, "seconds": run.seconds, "detail": run.detail})
    return 0


# ---------------------------------------------------------------------------
# Baselines: what a user writes with torchvision.transforms.v2, or its equivalent


def torchvision_v2() -> Any:
    """torchvision.transforms.v2 and tv_tensors, or None where torchvision does not import."""
    try:
        from torchvision import tv_tensors
        from torchvision.transforms import v2
    except Exception:  # ImportError, or a torchvision built for another torch failing at import
        return None
    return v2, tv_tensors


def rrc_params(width: int, height: int, rng: Any) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: (top, left, h, w); 10 tries, then a centre crop clamped to the ratio."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(RATIO):
        w, h = width, round(width / min(RATIO))
    elif in_ratio > max(RATIO):
        h, w = height, round(height * max(RATIO))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class EquivalentTransform:
    """transforms.v2's RandomResizedCrop + RandomHorizontalFlip + SanitizeBoundingBoxes + ToDtype + Normalize, in PIL + torch.

    The steps v2 runs on a PIL image and its targets: the crop drawn by
    get_params, PIL crop then resize (bilinear for the image, nearest for a
    mask), boxes shifted, scaled and clamped to the output (v2's
    resized_crop on BoundingBoxes), the flip (x -> W - x), boxes under one
    pixel wide or high removed with their labels (SanitizeBoundingBoxes),
    then uint8 -> float32 / 255 and the per-channel normalisation.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.mean: Any = None

    def image(self, img: Any, box: tuple[int, int, int, int], flip: bool) -> Any:
        from PIL import Image

        top, left, h, w = box
        img = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.Resampling.BILINEAR)
        return self.tensor(img, flip)

    def tensor(self, img: Any, flip: bool) -> Any:
        """The flip, then ToImage + ToDtype(float32, scale=True) + Normalize."""
        import numpy as np
        import torch
        from PIL import Image

        if flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if self.mean is None:
            self.mean = torch.tensor(MEAN).view(3, 1, 1)
            self.std = torch.tensor(STD).view(3, 1, 1)
        tensor = torch.from_numpy(np.asarray(img, np.uint8).copy()).permute(2, 0, 1).float().div_(255)
        return tensor.sub_(self.mean).div_(self.std)

    def letterbox_image(self, img: Any, flip: bool) -> Any:
        """v2.Resize(size=None, max_size=size) (PIL bilinear), the centred pad to size x size in 114 grey, the flip."""
        from PIL import Image

        new_w, new_h = letterbox_size(img.size[0], img.size[1], self.size)
        canvas = Image.new("RGB", (self.size, self.size), (LETTERBOX_FILL,) * 3)
        canvas.paste(img.resize((new_w, new_h), Image.Resampling.BILINEAR), ((self.size - new_w) // 2, (self.size - new_h) // 2))
        return self.tensor(canvas, flip)

    def letterbox_boxes(self, boxes: Any, labels: Any, width: int, height: int, flip: bool) -> tuple[Any, Any]:
        """v2's resize then pad on BoundingBoxes (scaled by the resize, shifted by the pad), the flip, SanitizeBoundingBoxes."""
        import torch

        new_w, new_h = letterbox_size(width, height, self.size)
        left, top = (self.size - new_w) // 2, (self.size - new_h) // 2
        moved = boxes * torch.tensor([new_w / width, new_h / height] * 2) + torch.tensor(
            [left, top, left, top], dtype=torch.float32
        )
        return self.finish_boxes(moved, labels, flip)

    def mask(self, mask: Any, box: tuple[int, int, int, int], flip: bool) -> Any:
        import numpy as np
        import torch
        from PIL import Image

        top, left, h, w = box
        mask = mask.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.Resampling.NEAREST)
        if flip:
            mask = mask.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(mask).astype(np.int64))

    def boxes(self, boxes: Any, labels: Any, box: tuple[int, int, int, int], flip: bool) -> tuple[Any, Any]:
        import torch

        top, left, h, w = box
        moved = (boxes - torch.tensor([left, top, left, top], dtype=torch.float32)) * torch.tensor(
            [self.size / w, self.size / h] * 2
        )
        return self.finish_boxes(moved.clamp(0, self.size), labels, flip)

    def finish_boxes(self, moved: Any, labels: Any, flip: bool) -> tuple[Any, Any]:
        """The flip (x -> size - x), then boxes under one pixel wide or high removed with their labels."""
        import torch

        if flip:
            moved = torch.stack([self.size - moved[:, 2], moved[:, 1], self.size - moved[:, 0], moved[:, 3]], dim=1)
        keep = ((moved[:, 2] - moved[:, 0]) >= 1) & ((moved[:, 3] - moved[:, 1]) >= 1)
        return moved[keep], labels[keep]

    def draw(self, img: Any) -> tuple[tuple[int, int, int, int], bool]:
        # the module's generator: torch's DataLoader seeds it in each worker, as it seeds torch's for v2
        return rrc_params(img.size[0], img.size[1], random), random.random() < 0.5


def letterbox_size(width: int, height: int, size: int) -> tuple[int, int]:
    """(width, height) after v2.Resize(size=None, max_size=size): the longer side `size`, the shorter one floored."""
    if width <= height:
        return max(1, int(size * width / height)), size
    return size, max(1, int(size * height / width))


def v2_letterbox(size: int) -> tuple[Any, Any]:
    """The transforms.v2 letterbox a user writes: (the resize, what follows the centred 114 pad: flip ... Normalize).

    v2.Resize(size=None, max_size=size) brings the longer side to `size`;
    a torchvision without size=None gets v2.Resize(size - 1, max_size=size),
    the same but for square images (a side of size - 1, padded). The pad
    depends on each image's resized size, so it is a v2.Pad made per image
    (RawCoco): v2.CenterCrop pads with 0, not YOLO's grey.
    """
    import torch

    v2, _ = torchvision_v2()
    try:
        resize = v2.Resize(size=None, max_size=size, antialias=True)
    except (TypeError, ValueError):
        resize = v2.Resize(size - 1, max_size=size, antialias=True)
    rest = v2.Compose([
        v2.RandomHorizontalFlip(), v2.SanitizeBoundingBoxes(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])  # fmt: skip
    return resize, rest


def centred_pad(width: int, height: int, size: int) -> list[int]:
    """[left, top, right, bottom] padding that centres a width x height image in size x size (v2.CenterCrop's split)."""
    return [(size - width) // 2, (size - height) // 2, (size - width + 1) // 2, (size - height + 1) // 2]


def v2_pipeline(size: int, task: str) -> Any:
    """The transforms.v2 pipeline a user writes for `task` (torchvision importable)."""
    import torch

    v2, _ = torchvision_v2()
    steps = [v2.RandomResizedCrop(size, scale=SCALE, ratio=RATIO, antialias=True), v2.RandomHorizontalFlip()]
    if task == "detection":
        steps.append(v2.SanitizeBoundingBoxes())
    steps += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    return v2.Compose(steps)


class RawCoco:
    """A map-style Dataset over the raw COCO files: PIL decode, then the detection transforms (RRC, or letterbox)."""

    def __init__(self, instances: str, size: int, use_v2: bool, letterbox: bool = False) -> None:
        import numpy as np

        with open(instances) as handle:
            coco = json.load(handle)
        split = os.path.basename(instances)[len("instances_") : -len(".json")]
        folder = os.path.join(os.path.dirname(os.path.dirname(instances)), split)
        index = {cid: i for i, cid in enumerate(sorted(c["id"] for c in coco["categories"]))}
        boxes: dict[int, list[tuple[list[float], int]]] = {}
        for ann in coco["annotations"]:
            x, y, w, h = ann["bbox"]
            boxes.setdefault(ann["image_id"], []).append(([x, y, x + w, y + h], index[ann["category_id"]]))
        self.items = []
        for image in coco["images"]:
            entries = boxes.get(image["id"], [])
            xyxy = np.array([b for b, _ in entries], np.float32).reshape(-1, 4)
            labels = np.array([c for _, c in entries], np.int64)
            self.items.append((os.path.join(folder, image["file_name"]), xyxy, labels))
        self.size = size
        self.letterbox = letterbox
        self.v2 = v2_pipeline(size, "detection") if use_v2 and not letterbox else None
        self.v2_letterbox = v2_letterbox(size) if use_v2 and letterbox else None
        self.equivalent = EquivalentTransform(size)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, position: int) -> tuple[Any, dict[str, Any]]:
        import torch
        from PIL import Image

        path, xyxy, labels = self.items[position]
        with open(path, "rb") as handle:
            img = Image.open(handle).convert("RGB")
        boxes, classes = torch.from_numpy(xyxy), torch.from_numpy(labels)
        if self.v2 is not None or self.v2_letterbox is not None:
            v2, tv_tensors = torchvision_v2()
            target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(img.size[1], img.size[0])),
                      "labels": classes}  # fmt: skip
            if self.v2_letterbox is not None:
                resize, rest = self.v2_letterbox
                img, target = resize(img, target)
                pad = v2.Pad(centred_pad(img.size[0], img.size[1], self.size), fill=LETTERBOX_FILL)
                image, target = rest(*pad(img, target))
            else:
                image, target = self.v2(img, target)
            return image, {"boxes": target["boxes"].as_subclass(torch.Tensor), "labels": target["labels"]}
        if self.letterbox:
            flip = random.random() < 0.5  # the module's generator, as draw() uses
            kept, kept_labels = self.equivalent.letterbox_boxes(boxes, classes, img.size[0], img.size[1], flip)
            return self.equivalent.letterbox_image(img, flip), {"boxes": kept, "labels": kept_labels}
        box, flip = self.equivalent.draw(img)
        kept, kept_labels = self.equivalent.boxes(boxes, classes, box, flip)
        return self.equivalent.image(img, box, flip), {"boxes": kept, "labels": kept_labels}


class RawSegmentation:
    """A map-style Dataset over `images/*.jpg` + `masks/*.png`: PIL decode, the image and its mask cropped together."""

    def __init__(self, root: str, size: int, use_v2: bool) -> None:
        names = sorted(name for name in os.listdir(os.path.join(root, "images")) if name.endswith(".jpg"))
        self.items = [(os.path.join(root, "images", n), os.path.join(root, "masks", n[:-4] + ".png")) for n in names]
        self.v2 = v2_pipeline(size, "segmentation") if use_v2 else None
        self.equivalent = EquivalentTransform(size)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, position: int) -> tuple[Any, Any]:
        import numpy as np
        import torch
        from PIL import Image

        image_path, mask_path = self.items[position]
        with open(image_path, "rb") as handle:
            img = Image.open(handle).convert("RGB")
        with open(mask_path, "rb") as handle:
            mask = Image.open(handle)
            mask.load()
        if self.v2 is not None:
            _, tv_tensors = torchvision_v2()
            image, target = self.v2(img, tv_tensors.Mask(torch.from_numpy(np.asarray(mask).astype(np.int64))))
            return image, target.as_subclass(torch.Tensor)
        box, flip = self.equivalent.draw(img)
        return self.equivalent.image(img, box, flip), self.equivalent.mask(mask, box, flip)


def detection_collate(samples: list[tuple[Any, dict[str, Any]]]) -> tuple[Any, list[dict[str, Any]]]:
    """Images stacked, targets a list of dicts: what torchvision's detection references collate."""
    import torch

    return torch.stack([image for image, _ in samples]), [target for _, target in samples]


def caption_transform(size: int, use_v2: bool) -> Callable[[Any], Any]:
    if use_v2:
        return v2_pipeline(size, "captions")  # type: ignore[no-any-return]
    equivalent = EquivalentTransform(size)

    def transform(img: Any) -> Any:
        box, flip = equivalent.draw(img)
        return equivalent.image(img, box, flip)

    return transform


def dataloader(dataset: Any, args: argparse.Namespace, **options: Any) -> Any:
    import torch

    return torch.utils.data.DataLoader(
        dataset, batch_size=args.batch, num_workers=args.workers, persistent_workers=True, drop_last=True, **options
    )


def run_detection_baseline(paths: dict[str, str], args: argparse.Namespace, use_v2: bool, letterbox: bool = False) -> Run:
    dataset = RawCoco(paths["coco"], args.crop, use_v2, letterbox)
    return epoch_run(dataloader(dataset, args, shuffle=True, collate_fn=detection_collate), args.warmup, False)


def run_segmentation_baseline(paths: dict[str, str], args: argparse.Namespace, use_v2: bool) -> Run:
    dataset = RawSegmentation(paths["segmentation"], args.crop, use_v2)
    return epoch_run(dataloader(dataset, args, shuffle=True), args.warmup, False)


def run_webdataset(paths: dict[str, str], args: argparse.Namespace, use_v2: bool) -> Run:
    """What the WebDataset README shows: shard shuffle, sample shuffle, decode("pil"), to_tuple, map_tuple, DataLoader."""
    import webdataset as wds

    from pipeline.prepare.formats.tar import expand_braces

    urls = expand_braces(paths["captions"])
    dataset = (
        wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "txt")
        .map_tuple(caption_transform(args.crop, use_v2), str)
    )
    return epoch_run(dataloader(dataset, args), args.warmup, False)


# ---------------------------------------------------------------------------
# Measuring


def measure_once(name: str, runner: Callable[[], Run], row: Row, files: list[str], label: str) -> None:
    common.warm_page_cache(files)
    try:
        with common.NoiseMeter() as noise:
            run = runner()
    except Exception as exc:  # a row that cannot run is reported, the others still run
        row.skipped = f"failed: {type(exc).__name__}: {exc}"
        print(f"{label}: {ROWS[name][1]}: {row.skipped}", file=sys.stderr)
        return
    run.noise = noise.share
    row.runs.append(run)
    print(f"{label}: {ROWS[name][1]:{_title_width()}} {_run_text(run)}", file=sys.stderr)


def measure_rows(rows: dict[str, Row], runners: dict[str, Callable[[], Run]], files: list[str], args: argparse.Namespace) -> None:
    """--rounds alternating rounds (order reversed every other one), then retries of rows whose best run was noisy."""
    for round_index in range(args.rounds):
        order = list(rows) if round_index % 2 == 0 else list(rows)[::-1]
        for name in order:
            if not rows[name].skipped:
                measure_once(name, runners[name], rows[name], files, f"round {round_index + 1}")
    for attempt in range(args.retries):
        noisy = [name for name, row in rows.items() if not row.skipped and _noisy(row.best, args.noise_limit)]
        for name in noisy:
            measure_once(name, runners[name], rows[name], files, f"retry {attempt + 1} (noisy)")


def _noisy(run: Run | None, limit: float) -> bool:
    return run is not None and run.noise is not None and run.noise > limit


def speedups(rows: dict[str, Row]) -> dict[str, float | None]:
    def rate(name: str) -> float | None:
        best = rows[name].best if name in rows else None
        return best.images_per_s if best is not None else None

    ratios: dict[str, float | None] = {}
    for task, (ours, theirs) in HEADLINE.items():
        a, b = rate(ours), rate(theirs)
        ratios[task] = a / b if a and b else None
    a, b = rate("captions-gpufeed-prepared"), rate("captions-webdataset")
    ratios["captions_prepared"] = a / b if a and b else None
    for stem in RECIPES:
        a, b = rate(f"{stem}-installed"), rate(f"{stem}-gpufeed")
        ratios[f"installed_{stem}"] = a / b if a and b else None
    return ratios


def missing_boxes(rows: dict[str, Row]) -> dict[str, list[str]]:
    """For each detection pair, its rows whose best run delivered no box: a ratio that means nothing."""
    missing: dict[str, list[str]] = {}
    for task, pair in HEADLINE.items():
        if ROWS[pair[0]][0] != "detection":
            continue
        bests = [(name, rows[name].best) for name in pair if name in rows]
        missing[task] = [name for name, best in bests if best is not None and not best.detail.get("targets_counted")]
    return missing


def targets_met(ratios: dict[str, float | None], rows: dict[str, Row]) -> dict[str, bool]:
    """Each target: its ratio reached, and (detection) boxes delivered on both sides."""
    boxless = missing_boxes(rows)
    return {task: ratios[task] is not None and ratios[task] >= goal and not boxless.get(task)  # type: ignore[operator]
            for task, goal in TARGETS.items()}  # fmt: skip


# ---------------------------------------------------------------------------
# Report


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def versions(use_v2: bool) -> dict[str, Any]:
    import PIL
    import torch

    simd = common.dist_version("Pillow-SIMD", "pillow-simd")
    return {
        "python": sys.version.split()[0],
        "pil": f"Pillow-SIMD {simd}" if simd else f"Pillow {PIL.__version__}",
        "torch": torch.__version__,
        "torchvision": common.dist_version("torchvision") if use_v2 else None,
        "webdataset": common.dist_version("webdataset"),
        "gpufeed": common.dist_version("gpufeed"),
        "baseline_transforms": f"torchvision.transforms.v2 {common.dist_version('torchvision')}" if use_v2 else EQUIVALENT,
    }


def _title_width() -> int:
    return max(54, *(len(title) for _, title in ROWS.values()))


def _run_text(run: Run) -> str:
    noise = "" if run.noise is None else f" ({run.noise:.0%})"
    return f"{run.images_per_s:.1f}{noise}"


def print_report(header: dict[str, Any], rows: dict[str, Row], ratios: dict[str, float | None]) -> None:
    data, local = header["data"], header["versions"]
    print(
        f"gpufeed tasks benchmark: one epoch of {data['images']} images ({data['mean_size'][0]}x{data['mean_size'][1]} px "
        f"mean, {data['raw_mean_kb']:.0f} KB JPEG raw; prepared shorter side {header['size']}: {data['prepared_mean_kb']:.0f} KB "
        f"a sample), batch {header['batch']}, RandomResizedCrop or letterbox {header['crop']} + flip, float32 normalised, "
        f"{header['workers']} workers, CPU"
    )
    print(
        f"{header['cpu']}, {header['cpus']} CPUs; page cache warm, {header['warmup']} warm-up batches, best of "
        f"{header['rounds']} alternating rounds (+ retries of rows whose best run had > {header['noise_limit']:.0%} noise)"
    )
    print(
        f"{local['pil']} | torch {local['torch']} | webdataset {local['webdataset']} | baselines: {local['baseline_transforms']}"
    )
    width = _title_width()
    print(f"{'':{width}} {'images/s':>9} {'seconds':>8}  runs: images/s (CPU share other processes took)")
    for name, row in rows.items():
        title = ROWS[name][1]
        run = row.best
        if run is None:
            print(f"{title:{width}} {row.skipped or 'no run'}")
            continue
        runs = ", ".join(_run_text(r) for r in row.runs)
        flag = "  NOISY: a lower bound" if _noisy(run, header["noise_limit"]) else ""
        print(f"{title:{width}} {run.images_per_s:9.1f} {run.seconds:8.2f}  {runs}{flag}")
        what = {"detection": "boxes", "captions": "captions", "segmentation": "mask samples of a class"}[ROWS[name][0]]
        print(f"{'':4}{run.detail['targets_counted']} {what} delivered, first batch after {run.detail['first_batch_s']:.2f} s"
              + (f", decoder {run.detail['decoder']}" if "decoder" in run.detail else ""))  # fmt: skip
    marks = []
    met, boxless = targets_met(ratios, rows), missing_boxes(rows)
    for task, goal in TARGETS.items():
        value = ratios[task]
        state = "n/a" if value is None else ("met" if met[task] else "MISSED")
        if boxless.get(task):
            state += " (NO BOXES from " + ", ".join(ROWS[name][1] for name in boxless[task]) + ")"
        marks.append(f"{task} >= {goal}x: {state}")
    print("targets: " + "; ".join(marks))
    installed = [f"{stem} {ratios[f'installed_{stem}']:.0%}" for stem in RECIPES if ratios[f"installed_{stem}"] is not None]
    if installed:
        worst = min(ratios[f"installed_{stem}"] or 0.0 for stem in RECIPES if ratios[f"installed_{stem}"] is not None)
        state = "met" if worst >= INSTALLED_TARGET else "MISSED"
        print(f"installed (wheel + plain Pillow) of the development row, each detection recipe: {', '.join(installed)} "
              f"(>= {INSTALLED_TARGET:.0%}: {state})")  # fmt: skip
    if header.get("installed"):
        print(f"installed rows: {header['installed']}")
    times = common.ratio_text
    print(f"(captions after prepare, informational: {times(ratios['captions_prepared'])} vs webdataset)")
    print(
        f"tasks speedup: detection {times(ratios['detection'])} vs {local['baseline_transforms']}, detection letterbox "
        f"{times(ratios['detection_letterbox'])}, captions "
        f"{times(ratios['captions'])} vs webdataset, segmentation {times(ratios['segmentation'])}"
    )


# ---------------------------------------------------------------------------
# Entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default=DEFAULT_DATA, help="cache folder for the generated raw files and shards")
    parser.add_argument("--n", type=int, default=600, help="images per dataset (default 600)")
    parser.add_argument("--min-side", type=int, default=480, help="smallest generated width/height (default 480)")
    parser.add_argument("--max-side", type=int, default=640, help="largest generated width/height (default 640)")
    parser.add_argument("--per-shard", type=int, default=50, help="samples per caption shard (default 50)")
    parser.add_argument("--size", type=int, default=256, help="prepare's shorter side for gpufeed's rows (default 256)")
    parser.add_argument("--crop", type=int, default=224, help="output side in every row (default 224)")
    parser.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--workers", type=int, default=common.available_processes(),
                        help="workers in every row (default: the available cores)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2, help="batches before each timed epoch (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per row, alternating; the best counts (default 2)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ", ".join(ROWS))
    parser.add_argument("--noise-limit", type=float, default=0.10,
                        help="a row whose best run had more noise than this is run again (default 0.10)")  # fmt: skip
    parser.add_argument("--retries", type=int, default=2, help="extra runs at most for a noisy row (default 2)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    common.add_installed_arguments(parser, DEFAULT_INSTALLED_VENV)
    parser.add_argument("--installed-row", choices=list(RECIPES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.n, args.rounds, args.workers, args.batch, args.crop, args.size, args.per_shard) < 1 or args.retries < 0:
        parser.error("--n, --rounds, --workers, --batch, --crop, --size and --per-shard must be at least 1")
    if not 8 <= args.min_side <= args.max_side:
        parser.error("--min-side must be at least 8 and at most --max-side")
    if args.n < args.batch * (args.warmup + 2):
        parser.error("--n must give at least --warmup + 2 batches")
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.installed_row:
        return run_installed_row(args)
    paths, failed = ensure_data(args)
    use_v2 = torchvision_v2() is not None
    if not use_v2:
        for name in ("detection-baseline", "letterbox-baseline", "segmentation-baseline"):
            ROWS[name] = (ROWS[name][0], ROWS[name][1].replace("transforms.v2", "v2-equivalent (no torchvision)"))
    header = {
        "data": describe_data(paths), "cpu": cpu_model(), "cpus": common.available_processes(), "workers": args.workers,
        "rounds": args.rounds, "noise_limit": args.noise_limit, "batch": args.batch, "crop": args.crop, "size": args.size,
        "warmup": args.warmup, "versions": versions(use_v2),
    }  # fmt: skip
    runners: dict[str, Callable[[], Run]] = {
        "detection-baseline": lambda: run_detection_baseline(paths, args, use_v2),
        "letterbox-baseline": lambda: run_detection_baseline(paths, args, use_v2, letterbox=True),
        "captions-gpufeed": lambda: run_gpufeed(paths["captions"], args, "captions"),
        "captions-gpufeed-prepared": lambda: run_gpufeed(paths["captions-prepared"], args, "captions"),
        "captions-webdataset": lambda: run_webdataset(paths, args, use_v2),
        "segmentation-gpufeed": lambda: run_gpufeed(paths["segmentation-prepared"], args, "segmentation"),
        "segmentation-baseline": lambda: run_segmentation_baseline(paths, args, use_v2),
    }
    selected = args.rows.split(",")
    rows = {name: Row(name) for name in ROWS if name in selected}
    installed = common.installed_for(args, REPO, rows, [name for name in rows if name.endswith("-installed")])
    header["installed"] = installed.describe() if installed is not None else None
    for stem, (source, recipe) in RECIPES.items():
        runners[f"{stem}-gpufeed"] = functools.partial(run_gpufeed, paths[source], args, "detection", recipe=recipe)
        runners[f"{stem}-installed"] = functools.partial(run_installed, installed, args, stem)  # type: ignore[arg-type]
    needs = {"captions-gpufeed-prepared": "captions", "segmentation-gpufeed": "segmentation"}
    needs |= {f"{stem}-{kind}": "coco" for stem in RECIPES for kind in ("gpufeed", "installed")}
    for name, source in needs.items():
        if name in rows and source in failed:
            rows[name].skipped = failed[source]
    measure_rows(rows, runners, raw_files(paths), args)
    ratios = speedups(rows)
    print_report(header, rows, ratios)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump({
                **header,
                "rows": {name: row.to_dict(ROWS[name][1]) for name, row in rows.items()},
                "speedup": {k: (round(v, 4) if v is not None else None) for k, v in ratios.items()},
                "targets": TARGETS,
                "targets_met": targets_met(ratios, rows),
                "rows_without_boxes": missing_boxes(rows),
            }, handle, indent=2)  # fmt: skip
            handle.write("\n")
    missed = not all(targets_met(ratios, rows).values())
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
