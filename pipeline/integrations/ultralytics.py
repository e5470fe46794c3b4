"""Ultralytics' own detection trainer, fed by gpufeed's loaders.

    from ultralytics import YOLO
    from pipeline.integrations.ultralytics import DetectionTrainer

    YOLO("yolov8n.yaml").train(data="data.yaml", trainer=DetectionTrainer, epochs=100, imgsz=640, batch=16)

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

The recipe draws with the run's hyperparameters (mosaic, degrees,
translate, scale, shear, perspective, flipud, fliplr, hsv_h/s/v, mixup,
cutmix); the ones it does not draw yet (copy_paste, bgr) are refused
with a message when on, never ignored; `batch=-1` (ultralytics' auto
batch, which builds its own dataset) likewise.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .yolo_batches import YoloLoader, recipe_hyp, resolved_yaml, split_shards, yolo_loader

try:
    from ultralytics.models.yolo.detect import DetectionTrainer as _UltralyticsTrainer
except ImportError as exc:  # pragma: no cover - the [yolo] extra is not installed
    raise ImportError(
        "pipeline.integrations.ultralytics subclasses ultralytics' trainer: pip install 'gpufeed[yolo]'"
    ) from exc


class DetectionTrainer(_UltralyticsTrainer):
    """Ultralytics' detection trainer whose train and val loaders are gpufeed's (see the module's docstring)."""

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
            rect=not train, stride=max(int(getattr(self, "stride", 32) or 32), 32),
        )  # fmt: skip

    def build_dataset(self, img_path: str, mode: str = "train", batch: int | None = None) -> Any:
        raise ConfigError(
            "gpufeed's DetectionTrainer reads prepared shards, not ultralytics' dataset: batch=-1 (auto batch) "
            "measures with ultralytics' own; give batch= a number"
        )


def _split_of(data: dict[str, Any], dataset_path: str, mode: str) -> str:
    """Which split of the data.yaml `dataset_path` is (ultralytics passes the split's resolved path)."""
    for name in ("train", "val", "test", "minival"):
        if name in data and str(data[name]) == str(dataset_path):
            return name
    return "train" if mode == "train" else "val"
