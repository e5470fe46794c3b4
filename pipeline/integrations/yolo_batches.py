"""A YOLO data.yaml's splits as prepared shards, and gpufeed's batches in ultralytics' batch contract.

`split_shards` prepares one split of a data.yaml (`gpufeed prepare
data.yaml OUT --split NAME`, each image resized so its longer side is
`imgsz`, as ultralytics' `load_image` does) into gpufeed's cache once, and
finds it there afterwards; a change to the dataset's files (names, sizes,
times) or to `imgsz` prepares anew. A split other than train is prepared
in aspect-ratio order (`--order aspect`), as ultralytics sorts its
`rect=True` validation set, so that consecutive images, and so each eval
batch, are of like shape and `rect_batch` cuts each batch tight.
`YoloLoader` wraps a gpufeed loader over those shards so that
ultralytics' trainer and validator take it for their own: each batch a dict with `img` (uint8 B x 3 x S x S), `cls`
(float32 [N, 1]), `bboxes` (float32 [N, 4], normalised XYWH of the output),
`batch_idx` (float32 [N], ascending), `im_file`, `ori_shape`,
`resized_shape` and `ratio_pad` (((gain, gain), (pad_x, pad_y)): the
output's pixels from the original's, exact, from each sample's geometry);
`len()`, `batch_size`, `num_workers`, `drop_last`, `dataset` (with
`labels`, read from the shards' box members without decoding an image),
`sampler.set_epoch`, `reset()` and `close()`. `resolved_yaml` writes the yaml as
ultralytics resolved it (what prepare reads). `recipe_hyp` takes
ultralytics' hyperparameters that `recipe="yolo"` draws with.

Nothing here imports ultralytics.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..io.tar import iter_tar_samples
from ..loader import Loader, make_loader
from ..loader.tasks import Batch
from ..native.build import cache_root
from ..prepare import prepare_dataset
from ..specs import YOLO_HYP, PrepareSpec, ResizeSpec
from ..targets import GEOMETRY_FIELD, boxes_to_source, read_boxes

log = logging.getLogger(__name__)

CACHE_ENV = "GPUFEED_YOLO_SHARDS"
"""Where `split_shards` keeps prepared splits (default: gpufeed's user cache, under yolo/)."""


def cache_folder(cache: str | os.PathLike[str] | None = None) -> Path:
    """Where prepared splits and resolved data.yaml files are kept: `cache`, else $GPUFEED_YOLO_SHARDS, else
    gpufeed's user cache, under yolo/."""
    return Path(cache or os.environ.get(CACHE_ENV) or cache_root() / "yolo")


def split_shards(data_yaml: str | os.PathLike[str], split: str, imgsz: int, root: str | os.PathLike[str],
                 cache: str | os.PathLike[str] | None = None, *, order: str | None = None) -> Path:  # fmt: skip
    """The prepared shards of split `split` of `data_yaml` at `imgsz`: prepared now when absent or out of date.

    Args:
        data_yaml: the dataset's data.yaml (ultralytics' layout).
        split: "train", "val" or "test" (a key of the yaml).
        imgsz: the training size: each image's longer side becomes it.
        root: the dataset's folder (the yaml's `path`): its files' names,
            sizes and times say whether the shards are out of date.
        cache: where prepared splits are kept (default $GPUFEED_YOLO_SHARDS,
            else gpufeed's user cache).
        order: how the samples are laid out (`PrepareSpec.order`); None:
            "shuffle" for the train split, "aspect" for every other (its
            eval batches rectangular and tight, as ultralytics' `rect=True`).

    Returns:
        The folder holding the split's manifest.json and shards: `<split>`
        when shuffled, `<split>.<order>` otherwise (a split prepared in
        another order is never taken for this one).
    """
    order = order or ("shuffle" if split == "train" else "aspect")
    base = cache_folder(cache)
    digest = hashlib.sha256()
    digest.update(f"{os.path.abspath(data_yaml)}\n{Path(data_yaml).read_bytes().hex()}\n{imgsz}\n".encode())
    own = os.path.realpath(base)
    for folder, folders, files in os.walk(root):
        folders[:] = sorted(f for f in folders if os.path.realpath(os.path.join(folder, f)) != own)  # not the cache
        for name in sorted(files):
            if name.endswith(".cache"):  # ultralytics' own label caches
                continue
            status = os.stat(os.path.join(folder, name))
            digest.update(f"{os.path.relpath(os.path.join(folder, name), root)}\0{status.st_size}\0{status.st_mtime_ns}\n".encode())
    # the order in the folder's name: a "val" an earlier gpufeed prepared is shuffled, never read as "val.aspect"
    folder = split if order == "shuffle" else f"{split}.{order}"
    out = base / f"{Path(data_yaml).stem}-{imgsz}-{digest.hexdigest()[:16]}" / folder
    if (out / "manifest.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{split}-", dir=out.parent))
    log.warning("gpufeed: preparing split %r of %s at %d px into %s (once; later runs reuse it)",
                split, data_yaml, imgsz, out)  # fmt: skip
    try:
        shutil.rmtree(partial)
        result = prepare_dataset(PrepareSpec(
            source=os.fspath(data_yaml), out=os.fspath(partial), split=split,
            resize=ResizeSpec(size=imgsz, mode="longer", upscale=True), order=order,
        ))  # fmt: skip
        try:
            os.replace(partial, out)
        except OSError:  # another process (a DDP rank) finished the same split first
            if not (out / "manifest.json").exists():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    if result.rejected:
        log.warning("gpufeed: %d images of split %r were rejected (%s)", result.rejected, split, out / "rejected.jsonl")
    return out


NOT_DRAWN = {"bgr": 0.0}
"""Ultralytics' hyperparameters that `recipe="yolo"` does not draw yet, with the value it takes (theirs: off)."""


def recipe_hyp(hyperparameters: Mapping[str, Any]) -> dict[str, float]:
    """The hyperparameters of ultralytics' (its `args`) that `recipe="yolo"` draws with (`LoaderSpec.hyp`).

    Raises:
        ConfigError: one it does not draw yet is on (named; copy_paste's mode "mixup" too), or one is out of its
            range.
    """
    on = [f"{name}={hyperparameters[name]}" for name, off in NOT_DRAWN.items()
          if float(hyperparameters.get(name) or 0.0) != off]  # fmt: skip
    mode = hyperparameters.get("copy_paste_mode") or "flip"
    if float(hyperparameters.get("copy_paste") or 0.0) and mode != "flip":
        on.append(f"copy_paste_mode={mode!r} (copy_paste's mode 'flip' only: pasting another image's objects)")
    if hyperparameters.get("fraction") not in (None, 1, 1.0):
        on.append(f"fraction={hyperparameters['fraction']} (prepare the part to train on as its own split)")
    if hyperparameters.get("classes") is not None:
        on.append(f"classes={hyperparameters['classes']} (a class filter)")
    if hyperparameters.get("rect"):
        on.append("rect=True (rectangular training batches)")
    if on:
        raise ConfigError(
            f"gpufeed's recipe='yolo' does not draw {', '.join(on)} yet: set them to 0, or train with ultralytics' "
            "own trainer"
        )
    return {name: float(hyperparameters[name]) for name in YOLO_HYP if hyperparameters.get(name) is not None}


def resolved_yaml(data: Mapping[str, Any], cache: str | os.PathLike[str] | None = None) -> Path:
    """A data.yaml as ultralytics resolved it (`check_det_dataset`'s dict): every split an absolute path, the names
    its dict, written into the cache: prepare reads the folders ultralytics would, whatever the yaml's relative
    `path` meant to it (its datasets folder, the working directory)."""
    lines = [f"path: {json.dumps(str(data['path']))}"]
    for split in ("train", "val", "test", "minival"):
        value = data.get(split)
        if isinstance(value, (list, tuple)):
            lines += [f"{split}:"] + [f"  - {json.dumps(str(item))}" for item in value]
        elif value:
            lines.append(f"{split}: {json.dumps(str(value))}")
    names = data.get("names") or {}
    items = names.items() if isinstance(names, Mapping) else enumerate(names)
    lines += ["names:"] + [f"  {int(key)}: {json.dumps(str(name))}" for key, name in items]
    text = "\n".join(lines) + "\n"
    base = cache_folder(cache) / "yaml"
    base.mkdir(parents=True, exist_ok=True)
    stem = Path(str(data.get("yaml_file") or "data")).stem
    target = base / f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.yaml"
    if not target.exists():
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, target)
    return target


class ShardLabels:
    """The `dataset` ultralytics reads beside a loader: its length, and each sample's labels from the shards."""

    def __init__(self, loader: Loader, single_class: bool = False) -> None:
        self._loader = loader
        self._single_class = single_class
        self._labels: list[dict[str, Any]] | None = None

    def __len__(self) -> int:
        return self._loader.dataset.samples

    @property
    def labels(self) -> list[dict[str, Any]]:
        """Per sample, as ultralytics' dataset: `cls` float32 [n, 1], `bboxes` normalised XYWH [n, 4], `im_file`.

        Read once, from the box members and json of the shards; no image is decoded."""
        if self._labels is None:
            classes = len(self._loader.dataset.classes) or None
            found: list[dict[str, Any]] = []
            for shard in self._loader.dataset.sets[0]:
                for key, members in iter_tar_samples(shard.url):
                    boxes, labels, _ = read_boxes(members, classes)
                    info = json.loads(members["json"]) if "json" in members else {}
                    width, height = info.get("size") or (1, 1)
                    found.append({
                        "im_file": info.get("source", key), "shape": (height, width),
                        "cls": (labels * (not self._single_class)).astype(np.float32).reshape(-1, 1),
                        "bboxes": _xywh(boxes, width, height), "normalized": True, "bbox_format": "xywh",
                    })  # fmt: skip
            self._labels = found
        return self._labels

    @property
    def im_files(self) -> list[str]:
        return [label["im_file"] for label in self.labels]


class _Sampler:
    """What ultralytics asks of a loader's sampler: its length and `set_epoch` (DDP)."""

    def __init__(self, loader: YoloLoader) -> None:
        self._loader = loader

    def __len__(self) -> int:
        return len(self._loader.dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self)))

    def set_epoch(self, epoch: int) -> None:
        self._loader.loader.set_epoch(epoch)


MaskMaker = Callable[[tuple[int, int], list[list[np.ndarray]]], tuple[np.ndarray, np.ndarray]]
"""(image (height, width), each instance's polygons in its pixels) -> (its masks as ultralytics' segmentation
batches hold them, the order of the instances they follow): what a segmentation trainer draws masks with."""


class YoloLoader:
    """A gpufeed loader that ultralytics' trainer and validator take for their own (see the module's docstring).

    Args:
        loader: a loader over a detection dataset, uint8, with fields=("geometry", "json") in eval mode.
        epoch_of: the trainer's current epoch, read as each epoch starts (a resumed training's too).
        single_class: every box of class 0 (ultralytics' `single_cls`).
        rect: eval batches cut to the rectangle their images need, sides multiples of `stride` (`rect_batch`).
        masks: for a segmentation trainer, how each image's masks are drawn from its instances' polygons
            (`batch.polygons`): each batch then has "masks", its instances in the order they give.
    """

    def __init__(self, loader: Loader, epoch_of: Callable[[], int] | None = None, single_class: bool = False,
                 rect: bool = False, stride: int = 32, masks: MaskMaker | None = None) -> None:  # fmt: skip
        self.single_class = single_class
        self.masks = masks
        self.rect, self.stride = rect and not loader.spec.train, stride
        self.loader = loader
        self.dataset = ShardLabels(loader, single_class)
        self.sampler = _Sampler(self)
        self.batch_size = loader.batch_size
        self.num_workers = loader.spec.num_workers
        self.drop_last = bool(loader.spec.drop_last)
        self._epoch_of = epoch_of

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._epoch_of is not None and self.loader.spec.train and self._epoch_of() != self.loader.epoch:
            self.loader.set_epoch(self._epoch_of())
        size = self.loader.spec.crop
        for batch in self.loader:
            assert isinstance(batch, Batch)  # a detection dataset's
            made = to_ultralytics(batch, size)
            geometries = batch.fields.get(GEOMETRY_FIELD)
            if self.rect and geometries is not None and all(isinstance(g, dict) for g in geometries):
                made = rect_batch(made, geometries, size, self.stride)
            if self.masks is not None:
                made = with_masks(made, batch.polygons, size, self.masks)
            if self.single_class:
                made["cls"] = torch.zeros_like(made["cls"])
            yield made

    def reset(self) -> None:
        """Ultralytics' call as its close_mosaic epochs start: the loader turned the mosaic off on time already."""

    def close(self) -> None:
        self.loader.close()


def yolo_loader(shards: str | os.PathLike[str], batch_size: int, train: bool, imgsz: int, *, device: Any = "cpu",
                workers: int | str = "auto", seed: int = 0, epochs: int | None = None, close_mosaic: int = 0,
                hyp: Mapping[str, float] | None = None, epoch_of: Callable[[], int] | None = None,
                single_class: bool = False, rect: bool = False, stride: int = 32,
                masks: MaskMaker | None = None) -> YoloLoader:  # fmt: skip
    """A `YoloLoader` over prepared shards: ultralytics' training recipe (`recipe="yolo"`) or letterboxed validation.

    Args:
        shards: a prepared detection dataset (`split_shards`).
        batch_size: images per batch.
        train: the training recipe (mosaic, affine, flips, HSV), shuffled; False: letterboxed, in order, every sample.
        imgsz: the output side.
        device: where batches are delivered.
        workers: decode workers.
        seed: every random choice.
        epochs: the training's epochs (with `close_mosaic`).
        close_mosaic: the last N epochs train without the mosaic.
        hyp: the recipe's hyperparameters by ultralytics' names (`make_loader(hyp=)`).
        epoch_of: the trainer's epoch, read as each epoch starts.
        single_class: every box of class 0 (ultralytics' `single_cls`).
        rect: validation batches cut to the rectangle their images need (ultralytics' `rect=True`).
        stride: the model's largest stride: a rect batch's sides are its multiples.
        masks: a segmentation trainer's masks from the instance polygons (`YoloLoader`).
    """
    if imgsz % 32:
        raise ConfigError(f"imgsz must be a multiple of 32 (the model's stride), got {imgsz}")
    if train:
        loader = make_loader(shards, batch_size, device=device, crop=imgsz, num_workers=workers, dtype="uint8",
                             recipe="yolo", seed=seed, epochs=epochs, close_mosaic=close_mosaic if epochs else 0,
                             hyp=hyp, drop_last=False, masks=False)  # as ultralytics' loader: a set smaller than a batch trains  # fmt: skip
    else:
        loader = make_loader(shards, batch_size, device=device, crop=imgsz, num_workers=workers, dtype="uint8",
                             recipe="letterbox", train=False, drop_last=False, fields=(GEOMETRY_FIELD, "json"), masks=False)  # fmt: skip
    return YoloLoader(loader, epoch_of, single_class, rect, stride, masks)


def to_ultralytics(batch: Batch, size: int) -> dict[str, Any]:
    """A gpufeed detection batch as ultralytics' collate gives one (its keys and dtypes; see the module's docstring)."""
    assert batch.boxes is not None and batch.box_labels is not None
    counts = [len(boxes) for boxes in batch.boxes]
    boxes = torch.cat([b.to("cpu", torch.float32) for b in batch.boxes]) if counts else torch.zeros((0, 4))
    labels = torch.cat([b.to("cpu") for b in batch.box_labels]) if counts else torch.zeros((0,))
    xywh = torch.stack([(boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2,
                        boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]], 1) / size  # fmt: skip
    images = len(batch.keys)
    geometries, infos = batch.fields.get(GEOMETRY_FIELD), batch.fields.get("json")
    shapes, pads, files = [], [], []
    for index in range(images):
        geometry = geometries[index] if geometries is not None else None
        info = infos[index] if infos is not None and isinstance(infos[index], dict) else {}
        shape, ratio_pad, source = _original(geometry, info, size)
        shapes.append(shape)
        pads.append(ratio_pad)
        files.append(source or f"{batch.keys[index]}.jpg")
    return {
        "img": batch.images,
        "cls": labels.to(torch.float32).reshape(-1, 1),
        "bboxes": xywh.reshape(-1, 4),
        "batch_idx": torch.repeat_interleave(torch.arange(images, dtype=torch.float32), torch.tensor(counts, dtype=torch.long)),
        "im_file": tuple(files),
        "ori_shape": tuple(shapes),
        "resized_shape": tuple((size, size) for _ in range(images)),
        "ratio_pad": tuple(pads),
    }


def rect_batch(made: dict[str, Any], geometries: list[dict[str, Any]], size: int, stride: int = 32) -> dict[str, Any]:
    """A letterboxed batch cut to the rectangle its images need (ultralytics' rect validation batches).

    Each image is centred in the S x S output (`recipe="letterbox"`); the batch keeps the smallest
    centred rectangle, sides multiples of `stride`, that holds every image's pixels (a batch of 4:3
    photos at 640: 640 x 480), and its boxes, `ratio_pad` and `resized_shape` follow the cut.

    Over a split in aspect order (`split_shards`) that is ultralytics' `set_rectangle` rule with
    no extra padding: a batch of aspect ratios (h / w) all under 1 is S wide and ceil(max * S /
    stride) strides high (all over 1: the other way round; mixed: S x S). Ultralytics' validation
    adds half a stride (`pad=0.5`), so its batches are up to a stride larger on each side (672 for
    a 640 batch of squares); a cut of the S x S letterbox is never larger than S.
    """
    x0 = min(float(g["output_box"][0]) for g in geometries)
    y0 = min(float(g["output_box"][1]) for g in geometries)
    x1 = max(float(g["output_box"][2]) for g in geometries)
    y1 = max(float(g["output_box"][3]) for g in geometries)
    half = size / 2
    width = min(size, stride * math.ceil(2 * max(half - x0, x1 - half) / stride - 1e-9))
    height = min(size, stride * math.ceil(2 * max(half - y0, y1 - half) / stride - 1e-9))
    left, top = (size - width) // 2, (size - height) // 2
    if (width, height) == (size, size):
        return made
    boxes = made["bboxes"] * size
    boxes[:, 0] = (boxes[:, 0] - left) / width
    boxes[:, 1] = (boxes[:, 1] - top) / height
    boxes[:, 2] /= width
    boxes[:, 3] /= height
    pads = tuple((gain, (pad_x - left, pad_y - top)) for gain, (pad_x, pad_y) in made["ratio_pad"])
    return {**made, "img": made["img"][:, :, top : top + height, left : left + width], "bboxes": boxes,
            "ratio_pad": pads, "resized_shape": tuple((height, width) for _ in pads)}  # fmt: skip


def with_masks(made: dict[str, Any], polygons: list[list[list[torch.Tensor]]] | None, size: int,
               draw: MaskMaker) -> dict[str, Any]:  # fmt: skip
    """An ultralytics batch with "masks" drawn (`draw`) from each image's instance polygons, its instances (cls,
    bboxes) put in the order the masks follow. A batch cut to a rectangle (`rect_batch`) has its polygons
    moved with the cut; a box without polygons gets an empty mask.

    Raises:
        ConfigError: the dataset has no polygons (a segmentation trainer needs YOLO-seg or COCO polygons).
    """
    if polygons is None:
        raise ConfigError("a segmentation trainer needs instance polygons: prepare a YOLO-seg or COCO polygon dataset")
    height, width = made["img"].shape[2:]
    shift = np.array([(size - width) // 2, (size - height) // 2], np.float32)  # rect_batch's centred cut
    counts = np.bincount(made["batch_idx"].long().numpy(), minlength=len(polygons))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    order, masks = [], []
    for image, parts in enumerate(polygons):
        shapes = [[points.numpy() - shift for points in box] for box in parts]
        drawn, sorted_index = draw((int(height), int(width)), shapes)
        masks.append(torch.from_numpy(np.ascontiguousarray(drawn)))
        order.append(starts[image] + np.asarray(sorted_index, np.int64))
    index = torch.from_numpy(np.concatenate(order)) if order else torch.zeros(0, dtype=torch.long)
    return {**made, "cls": made["cls"][index], "bboxes": made["bboxes"][index], "masks": torch.cat(masks, 0)}


def _original(geometry: dict[str, Any] | None, info: dict[str, Any], size: int) -> tuple[tuple[int, int], Any, str | None]:
    """(ori_shape (h, w), ratio_pad, the source file) of one output; without a geometry, the output itself."""
    if geometry is None or not geometry.get("prepare"):
        return (size, size), ((1.0, 1.0), (0.0, 0.0)), None
    # the output's corners in the upright original's pixels: original = (output - pad) / gain on each axis
    x0, y0, x1, y1 = boxes_to_source(np.array([[0.0, 0.0, size, size]]), geometry)[0]
    gain_x, gain_y = size / (x1 - x0), size / (y1 - y0)
    width, height = info.get("original_size") or (x1 - x0, y1 - y0)
    ratio_pad = ((float(gain_y), float(gain_x)), (float(-x0 * gain_x) + 0.0, float(-y0 * gain_y) + 0.0))
    return (int(height), int(width)), ratio_pad, info.get("source")


def _xywh(boxes: np.ndarray, width: float, height: float) -> np.ndarray:
    out = np.empty((len(boxes), 4), np.float32)
    out[:, 0] = (boxes[:, 0] + boxes[:, 2]) / 2 / width
    out[:, 1] = (boxes[:, 1] + boxes[:, 3]) / 2 / height
    out[:, 2] = (boxes[:, 2] - boxes[:, 0]) / width
    out[:, 3] = (boxes[:, 3] - boxes[:, 1]) / height
    return out
