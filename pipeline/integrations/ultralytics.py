"""Ultralytics' own detection and segmentation trainers, fed by gpufeed's loaders.

    from ultralytics import YOLO
    from pipeline.integrations.ultralytics import DetectionTrainer, SegmentationTrainer

    YOLO("yolov8n.yaml").train(data="data.yaml", trainer=DetectionTrainer, epochs=100, imgsz=640, batch=16)
    YOLO("yolov8n-seg.yaml").train(data="seg.yaml", trainer=SegmentationTrainer, epochs=100, imgsz=640)

`DetectionTrainer` is ultralytics' `DetectionTrainer` with one change: its
`get_dataloader` returns gpufeed loaders (`yolo_batches.YoloLoader`) over
the data.yaml's splits, prepared once into gpufeed's cache
(`yolo_batches.split_shards`) and found there on later runs. Training
batches are `make_loader(recipe="yolo")`'s: ultralytics' default
augmentation (mosaic, random affine, flips, HSV), each output rendered once
per source image, `close_mosaic` honoured; validation batches are
letterboxed to `imgsz` with each image's exact `ratio_pad`, and the final
validation of best.pt reads them too. The model, loss, optimiser,
validator, metrics, checkpoints and callbacks are ultralytics' own.

`SegmentationTrainer` is the same change to ultralytics' segmentation
trainer, for a YOLO-seg (or COCO polygon) dataset: the instance polygons go
through the recipe with their boxes (`batch.polygons`), and each batch's
masks are drawn from them as ultralytics' own `Format` draws them
(`polygon2mask` at 1/`mask_ratio` of the image; with `overlap_mask`, one
mask per image whose values are the instances in area-descending order,
the instances put in that order).

The recipe draws with the run's hyperparameters (mosaic, degrees,
translate, scale, shear, perspective, flipud, fliplr, hsv_h/s/v, mixup,
cutmix, copy_paste in its default mode "flip": each image's own instances
mirrored onto it where they fit, which needs polygons, so it does nothing
for detection, as ultralytics'); the ones it does not draw yet (bgr,
copy_paste_mode="mixup") are refused with a message when on, never
ignored; `batch=-1` (ultralytics' auto batch, which builds its own
dataset) likewise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .yolo_batches import MaskMaker, YoloLoader, recipe_hyp, resolved_yaml, split_shards, yolo_loader

try:
    from ultralytics.data.utils import polygon2mask
    from ultralytics.models.yolo.detect import DetectionTrainer as _UltralyticsTrainer
    from ultralytics.models.yolo.segment import SegmentationTrainer as _UltralyticsSegmentationTrainer
except ImportError as exc:  # pragma: no cover - the [yolo] extra is not installed
    raise ImportError(
        "pipeline.integrations.ultralytics subclasses ultralytics' trainer: pip install 'gpufeed[yolo]'"
    ) from exc


class _GpufeedLoaders:
    """The trainers' one change: `get_dataloader` gives gpufeed loaders over the prepared splits."""

    args: Any
    data: dict[str, Any]
    device: Any

    def _masks(self) -> MaskMaker | None:
        return None

    def get_dataloader(self, dataset_path: str, batch_size: int = 16, rank: int = 0, mode: str = "train") -> YoloLoader:
        train = mode == "train"
        imgsz = int(self.args.imgsz)
        source = resolved_yaml(self.data)  # the folders ultralytics resolved, whatever the yaml's relative `path`
        shards = split_shards(source, _split_of(self.data, dataset_path, mode), imgsz, self.data["path"])
        hyp = recipe_hyp(vars(self.args)) if train else None
        epochs = int(self.args.epochs)
        return yolo_loader(
            shards, batch_size, train, imgsz, device=self.device, workers=int(self.args.workers) or "auto",
            seed=int(self.args.seed), epochs=epochs, close_mosaic=min(int(self.args.close_mosaic or 0), epochs), hyp=hyp,
            epoch_of=(lambda: int(getattr(self, "epoch", 0))) if train else None, single_class=bool(self.args.single_cls),
            rect=not train, stride=max(int(getattr(self, "stride", 32) or 32), 32), masks=self._masks(),
        )  # fmt: skip

    def build_dataset(self, img_path: str, mode: str = "train", batch: int | None = None) -> Any:
        raise ConfigError(
            f"gpufeed's {type(self).__name__} reads prepared shards, not ultralytics' dataset: batch=-1 (auto batch) "
            "measures with ultralytics' own; give batch= a number"
        )


class DetectionTrainer(_GpufeedLoaders, _UltralyticsTrainer):
    """Ultralytics' detection trainer whose train and val loaders are gpufeed's (see the module's docstring)."""


class SegmentationTrainer(_GpufeedLoaders, _UltralyticsSegmentationTrainer):
    """Ultralytics' segmentation trainer whose train and val loaders are gpufeed's, masks drawn from the polygons."""

    def _masks(self) -> MaskMaker:
        ratio, overlap = int(self.args.mask_ratio), bool(self.args.overlap_mask)

        def draw(size: tuple[int, int], instances: list[list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
            return instance_masks(size, instances, ratio, overlap)

        return draw


def instance_masks(size: tuple[int, int], instances: list[list[np.ndarray]], ratio: int,
                   overlap: bool) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """One image's masks as ultralytics' `Format` draws them from its segments, and the instances' order.

    Each instance's polygons filled (`polygon2mask`) at (height, width) and reduced by `ratio`. With
    `overlap`: one (1, h, w) mask whose value i + 1 is the i-th instance by area, largest first (a smaller
    one drawn over a larger), and that order; else (N, h, w), in the given order.
    """
    height, width = size
    shape = (height // ratio, width // ratio)
    drawn = []
    for parts in instances:
        mask = np.zeros(shape, np.uint8)
        for points in parts:  # a COCO object may have several parts: their union
            np.maximum(mask, polygon2mask(size, [points.reshape(-1)], color=1, downsample_ratio=ratio), out=mask)
        drawn.append(mask)
    if not overlap:
        stacked = np.stack(drawn) if drawn else np.zeros((0, *shape), np.uint8)
        return stacked, np.arange(len(drawn))
    order = np.argsort(-np.array([mask.sum() for mask in drawn], np.int64), kind="stable")
    out = np.zeros(shape, np.int32 if len(drawn) > 255 else np.uint8)
    for rank, k in enumerate(order):
        np.maximum(out, drawn[k].astype(out.dtype) * (rank + 1), out=out)
    return out[None], order


def _split_of(data: dict[str, Any], dataset_path: str, mode: str) -> str:
    """Which split of the data.yaml `dataset_path` is (ultralytics passes the split's resolved path)."""
    for name in ("train", "val", "test", "minival"):
        if name in data and str(data[name]) == str(dataset_path):
            return name
    return "train" if mode == "train" else "val"
