"""Frozen, validated settings objects.

A spec is everything needed to reproduce a piece of work. Specs round-trip
through plain JSON (`to_dict` / `from_dict`) so the same object drives a local
`gpufeed prepare`, a Celery task message and the `params` of a manifest.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, TypeVar

from .errors import ConfigError
from .units import parse_bytes

RECIPES = ("crop", "letterbox", "scale_jitter", "iou_crop", "yolo")  # how the loader makes each image its output
YOLO_HYP = {  # recipe="yolo"'s hyperparameters by ultralytics' names (and mosaic_n, 4 or 9): (default, largest)
    "mosaic": (1.0, 1.0), "mosaic_n": (4, 9), "degrees": (0.0, 180.0), "translate": (0.1, 0.9), "scale": (0.5, 0.95), "shear": (0.0, 90.0),
    "perspective": (0.0, 0.001), "flipud": (0.0, 1.0), "fliplr": (0.5, 1.0), "hsv_h": (0.015, 1.0),
    "hsv_s": (0.7, 1.0), "hsv_v": (0.4, 1.0), "mixup": (0.0, 1.0), "cutmix": (0.0, 1.0), "copy_paste": (0.0, 1.0),
}  # fmt: skip

RESIZE_MODES = ("shorter", "longer", "center-crop", "pad", "none")
ORDERS = ("shuffle", "aspect")  # how prepare orders a dataset's samples across its shards (PrepareSpec.order)
FORMATS = ("jpeg", "webp", "png", "npy")
FORMAT_EXTENSIONS = {"jpeg": "jpg", "webp": "webp", "png": "png", "npy": "npy"}
DEFAULT_SHARD_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_PIXELS = 89_478_485  # PIL's own bomb threshold: 0.25 GiB of RGBA
ON_ERROR = ("skip", "raise")  # the loader's error policies

_SpecT = TypeVar("_SpecT", bound="Spec")


class Spec:
    """to_dict/from_dict for the flat frozen dataclasses below."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[_SpecT], data: Any) -> _SpecT:
        """The spec from a JSON object (validated: unknown keys and bad values raise ConfigError)."""
        if not isinstance(data, dict):
            raise ConfigError(f"{cls.__name__} must be a JSON object, not {type(data).__name__}")
        names = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"{cls.__name__}: unknown setting(s) {', '.join(unknown)}")
        values = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            if field.name in data:
                value = data[field.name]
                values[field.name] = tuple(value) if isinstance(value, list) else value
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"{cls.__name__}: {exc}") from exc


MAX_SHARDS = 1 << 16  # the most shards per variant set a reshard makes (`--shards`, `--multiple-of`)


def check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):  # NaN compares false with every bound, so it would pass them
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ConfigError(f"{name} must be {bound}, got {value}")


def _is_number_pair(pair: Any) -> bool:
    return (
        isinstance(pair, (tuple, list))
        and len(pair) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair)
    )


def check_bool(name: str, value: Any) -> None:
    """Refuse anything but True or False: `"no"` or `1` would pass a truthiness test for what they do not say."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    check_number(name, value, low, high)


@dataclasses.dataclass(frozen=True)
class ResizeSpec(Spec):
    """How each image is resized.

    Attributes:
        size: target S in pixels.
        mode: shorter (shorter side S), longer (fit inside SxS), center-crop
            (SxS), pad (fit and pad to SxS), none.
        upscale: enlarge images smaller than the target (off by default).
        resample: lanczos, bicubic or bilinear.
    """

    size: int = 256
    mode: str = "shorter"
    upscale: bool = False
    resample: str = "lanczos"

    def __post_init__(self) -> None:
        check_int("size", self.size, 8, 16384)
        check_bool("upscale", self.upscale)
        if self.mode not in RESIZE_MODES:
            raise ConfigError(f"mode must be one of {', '.join(RESIZE_MODES)}, got {self.mode!r}")
        if self.resample not in ("lanczos", "bicubic", "bilinear"):
            raise ConfigError(f"resample must be lanczos, bicubic or bilinear, got {self.resample!r}")


@dataclasses.dataclass(frozen=True)
class AugmentSpec(Spec):
    """Pre-augmentation into `variants` complete copies of the dataset.

    Attributes:
        variants: K; 0 writes the resized originals only.
        scale: random-resized-crop area range (fraction of the image).
        ratio: random-resized-crop aspect-ratio range.
        flip: horizontal flip with probability 0.5.
        jitter: colour jitter strength for brightness, contrast, saturation.
        rotate: maximum absolute rotation in degrees.
    """

    variants: int = 0
    scale: tuple[float, float] = (0.35, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    jitter: float = 0.2
    rotate: float = 10.0

    def __post_init__(self) -> None:
        check_int("variants", self.variants, 0, 1000)
        for name, pair, low, high in (("scale", self.scale, 0.01, 1.0), ("ratio", self.ratio, 0.1, 10.0)):
            if not _is_number_pair(pair) or not pair[0] <= pair[1]:
                raise ConfigError(f"{name} must be two numbers (low, high) with low <= high")
            for value in pair:
                check_number(name, value, low, high)
        check_bool("flip", self.flip)
        check_number("jitter", self.jitter, 0.0, 0.9)
        check_number("rotate", self.rotate, 0.0, 45.0)


@dataclasses.dataclass(frozen=True)
class EncodeSpec(Spec):
    """Output encoding: jpeg (default, quality 90), webp, png, or raw uint8 npy.

    `restart`: for JPEG, a restart marker every `restart` MCUs (0: none).
    With 1, the default, each 16x16 block group is coded on its own, and the
    loader decodes only the blocks a random crop covers instead of every row
    down to its bottom edge (about 6 % larger files).
    """

    format: str = "jpeg"
    quality: int = 90
    restart: int = 1

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        check_int("quality", self.quality, 1, 100)
        check_int("restart", self.restart, 0, 65535)

    @property
    def extension(self) -> str:
        return FORMAT_EXTENSIONS[self.format]


@dataclasses.dataclass(frozen=True)
class ShardSpec(Spec):
    """Shard bounds: at most `max_bytes` bytes (planned from a measured
    estimate) and at most `max_samples` samples (exact), whichever is smaller."""

    max_bytes: int | None = DEFAULT_SHARD_BYTES
    max_samples: int | None = None

    def __post_init__(self) -> None:
        if self.max_bytes is None and self.max_samples is None:
            raise ConfigError("give max_bytes, max_samples or both")
        if self.max_bytes is not None:
            check_int("max_bytes", self.max_bytes, 64 * 1024)
        if self.max_samples is not None:
            check_int("max_samples", self.max_samples, 1)


_DEFAULT_MIN_VISIBLE = 0.25  # pipeline.targets.DEFAULT_MIN_VISIBLE (specs imports only errors and units)


@dataclasses.dataclass(frozen=True)
class PrepareSpec(Spec):
    """One prepare job: SRC in, OUT out, and every setting in between.

    `min_visible` is the fraction of a box's area that must stay in the
    picture after a crop (center-crop, a variant's random crop), or the box
    is dropped (and counted); it changes nothing for samples without boxes.

    `label_frame` is the frame of a COCO or VOC annotation whose declared
    size cannot tell (no size, a square image, an EXIF orientation that keeps
    the size): "upright" (the image after its EXIF rotation: ultralytics,
    Detectron2 and EXIF-aware annotation tools) or "stored" (the raster as
    stored). Where the declared size is the stored or the upright one, it
    decides; YOLO labels are always upright.

    `split` picks one split of a YOLO dataset given by its data.yaml or its
    folder (`train`, `val`, `test`, or an `images/<split>` folder's name);
    splits are separate datasets, never merged, so a source with several
    needs it (`gpufeed prepare` runs each into OUT/<split>).

    `order` is how the samples are laid out across the shards: "shuffle"
    (a seeded permutation, `seed`) or "aspect" (by the aspect ratio,
    height / width, of each picture as stored: upright, resized, padding
    not counted; ties in listing order), so that shard after shard, and an
    eval loader's batch after batch, holds pictures of like shape (what
    rectangular validation batches need). "aspect" reads each image's
    header once as the job is planned.

    The whole spec is recorded as the manifest's `params`; two runs with equal
    specs over the same source produce byte-identical shards.
    """

    source: str
    out: str
    resize: ResizeSpec = ResizeSpec()
    augment: AugmentSpec = AugmentSpec()
    encode: EncodeSpec = EncodeSpec()
    shards: ShardSpec = ShardSpec()
    seed: int = 0
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = 512 * 1024 * 1024
    background: tuple[int, int, int] = (255, 255, 255)
    min_visible: float = 0.25
    split: str | None = None
    label_frame: str = "upright"
    order: str = "shuffle"

    def __post_init__(self) -> None:
        if self.split is not None and (not isinstance(self.split, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.split)):
            raise ConfigError(f"split must be a split's name (letters, digits, - and _), got {self.split!r}")
        for name in ("source", "out"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{name} must be a non-empty path or URL")
        check_int("seed", self.seed, 0, 2**63 - 1)
        check_int("max_pixels", self.max_pixels, 64)
        check_int("max_file_bytes", self.max_file_bytes, 1)
        if (
            not isinstance(self.background, (tuple, list))
            or len(self.background) != 3
            or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= 255 for c in self.background)
        ):
            raise ConfigError("background must be three integers 0-255")
        check_number("min_visible", self.min_visible, 0.0, 1.0)
        if self.label_frame not in ("upright", "stored"):
            raise ConfigError(f"label_frame must be upright or stored, got {self.label_frame!r}")
        if self.order not in ORDERS:
            raise ConfigError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["background"] = list(self.background)
        data["augment"]["scale"] = list(self.augment.scale)
        data["augment"]["ratio"] = list(self.augment.ratio)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> PrepareSpec:
        if not isinstance(data, dict):
            raise ConfigError("a prepare spec must be a JSON object")
        nested: dict[str, type[Spec]] = {"resize": ResizeSpec, "augment": AugmentSpec, "encode": EncodeSpec, "shards": ShardSpec}
        values = dict(data)
        for name, spec_type in nested.items():
            if name in values and not isinstance(values[name], spec_type):
                values[name] = spec_type.from_dict(values[name])
        return super().from_dict.__func__(cls, values)  # type: ignore[attr-defined]

    def output_identity(self) -> dict[str, Any]:
        """The settings that decide the bytes of the output (OUT excluded; a source URL's secrets redacted).

        It is what the plan and the manifest record and what a re-run is
        compared with, so a URL's credentials (user information, a presigned
        query's signature) are never stored, and a fresh signature of the same
        URL is the same job.
        """
        from .io.fs import redact_location

        data = self.to_dict()
        data.pop("out")
        data["source"] = redact_location(data["source"])
        if data["min_visible"] == _DEFAULT_MIN_VISIBLE:
            # Only boxes feel it: at its default, a dataset prepared before it existed is the same job.
            data.pop("min_visible")
        if data["split"] is None:  # likewise: a source without splits is the job it was before splits existed
            data.pop("split")
        if data["label_frame"] == "upright":
            data.pop("label_frame")
        if data["order"] == "shuffle":  # a dataset prepared before orders existed was shuffled: the same job
            data.pop("order")
        return data


PREPARE_OPTION_NAMES = {
    "source": "SRC",
    "out": "OUT",
    "resize.size": "--size",
    "resize.mode": "--mode",
    "resize.upscale": "--upscale",
    "resize.resample": "--resample",
    "augment.variants": "--variants",
    "augment.scale": "--crop-scale",
    "augment.ratio": "--crop-ratio",
    "augment.flip": "--no-flip",
    "augment.jitter": "--jitter",
    "augment.rotate": "--rotate",
    "encode.format": "--format",
    "encode.quality": "--quality",
    "encode.restart": "--jpeg-restart",
    "shards.max_bytes": "--shard-size",
    "shards.max_samples": "--shard-samples",
    "seed": "--seed",
    "max_pixels": "--max-pixels",
    "min_visible": "--min-visible",
    "split": "--split",
    "label_frame": "--label-frame",
    "order": "--order",
}
"""How `gpufeed prepare` spells each PrepareSpec setting (dotted path -> SRC or option), for the CLI's messages.

Settings without an option (`max_file_bytes`, `background`) keep their dotted path.
"""

PREPARE_FLAG_VALUES = {"resize.upscale": True, "augment.flip": False}
"""The value a setting takes when its flag option (`--upscale`, `--no-flip`) is given."""


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DTYPES = ("float32", "float16", "bfloat16", "uint8")


@dataclasses.dataclass(frozen=True)
class LoaderSpec(Spec):
    """Settings of `make_loader`, validated before anything is built.

    Attributes:
        batch_size: samples per batch.
        train: random-resized crop, flips, shuffling (else centre crop, fixed order).
        crop: output side in pixels.
        num_workers: decode workers, or "auto" (available cores); 0 decodes in
            the calling thread (no producer thread, no pool: for debugging).
        worker_type: "thread" (libjpeg-turbo releases the GIL) or "process"
            (needs num_workers >= 1).
        shuffle_buffer: samples mixed by the seeded shuffle buffer (train).
        interleave: shards read at once, taken in turn.
        seed: seed of every random choice (order, crops, flips).
        mean, std: per-channel normalisation, in 0-1 units.
        dtype: float32, float16 or bfloat16 output, normalised; or uint8 (pixels
            as decoded and flipped, not normalised: for GPU-side augmentation).
        channels_last: return NCHW tensors in channels-last memory format.
        drop_last: drop the incomplete last batch and the uneven tail across ranks.
        prefetch: batches prepared ahead (>= 2).
        scale, ratio: random-resized-crop ranges.
        flip: random horizontal flips in train mode (on the device; on a CPU
            device the decode threads write the pixels already mirrored).
        eval_fraction: centre-crop fraction in eval mode.
        decoder: "auto" (the fastest present), "region" (libjpeg-turbo decoding
            only the crop's region, compiled on first use), "simplejpeg", "pil",
            or "nvjpeg" (GPU, needs torchvision with CUDA).
        on_error: what a damaged shard or an undecodable sample does: "skip"
            (warn, count, and re-draw replacements so every batch stays full)
            or "raise" (stop with a SampleError naming it).
        verify: hash each shard as it streams and compare with the manifest's
            sha256 (needs a manifest); a mismatch is damage under `on_error`.
        cache_dir: a local folder (ideally NVMe) that remote shards stream
            into and later epochs read from; None: no cache. Local datasets
            are read as they are.
        cache_size: the most the cache holds (`"500GiB"` or bytes); None: the
            dataset's size. Needs `cache_dir`.
        task: what the samples hold (`pipeline.targets.TASKS`); None: what the
            dataset's manifest says (shards without one: captions where a
            sample holds txt and no cls, as img2dataset's do, else
            classification).
        fields: members to deliver besides the task's targets ("txt" or
            "caption", "json", "key", any member a sample holds).
        min_visible: a box keeps at least this fraction of its area after the
            crop, or it is dropped (detection).
        masks: detection: deliver the masks the dataset has (`mask.png` as
            `batch.masks`, `instances.png` as each box's own masks), placed
            with the pixels; False reads neither (a trainer that draws its
            masks from the polygons, or wants boxes only).
        recipe: how each image becomes the output: "crop" (random-resized
            crop in train, centre crop in eval) or a detection recipe:
            "letterbox" (the whole image, ratio kept, padded), "scale_jitter"
            (letterbox times a random scale in `jitter`, cropped or padded),
            "iou_crop" (SSD's random IoU crop; needs boxes), "yolo"
            (ultralytics' default training recipe: a mosaic of four images,
            random scale and shift, flips, HSV gains; `pipeline.augment`).
            In eval mode the detection recipes letterbox. None: "letterbox" for a detection
            dataset (no box is cut away), "crop" for every other task.
        jitter: scale_jitter's range of scales.
        fill: the value (0-255) of output pixels the image does not cover.
        epochs: how many epochs the training runs (None: not said); with
            `close_mosaic`, when the mosaic stops.
        close_mosaic: recipe="yolo": the last N of `epochs` train without
            the mosaic (ultralytics' `close_mosaic`; `Loader.close_mosaic()`
            turns it off from the current epoch on).
        hyp: recipe="yolo"'s hyperparameters, by ultralytics' names, as
            (name, value) pairs (`YOLO_HYP` holds each one's default and
            largest value); the ones not given keep ultralytics' defaults.
        color_jitter: (brightness, contrast, saturation, hue) of
            torchvision's ColorJitter, drawn per image in train mode and
            applied to each batch on the device, by the decode workers on a
            CPU device (`pipeline.augment.color`); all 0: off.
    """

    batch_size: int
    train: bool = True
    crop: int = 224
    num_workers: int | str = "auto"
    worker_type: str = "thread"
    shuffle_buffer: int = 2048
    interleave: int = 4
    seed: int = 0
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    dtype: str = "float32"
    channels_last: bool = False
    drop_last: bool | None = None
    prefetch: int = 2
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    eval_fraction: float = 0.875
    decoder: str = "auto"
    on_error: str = "skip"
    verify: bool = False
    cache_dir: str | None = None
    cache_size: int | str | None = None
    task: str | None = None
    fields: tuple[str, ...] = ()
    min_visible: float = 0.25
    recipe: str | None = None
    jitter: tuple[float, float] = (0.1, 2.0)
    fill: int = 114
    epochs: int | None = None
    close_mosaic: int = 0
    hyp: tuple[tuple[str, float], ...] = ()
    color_jitter: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    masks: bool = True

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1, 1 << 16)
        for name in ("train", "channels_last", "flip", "verify", "masks"):
            check_bool(name, getattr(self, name))
        if self.drop_last is not None:
            check_bool("drop_last", self.drop_last)
        check_int("crop", self.crop, 8, 8192)
        if self.num_workers != "auto":
            check_int("num_workers", self.num_workers, 0, 256)
        if self.worker_type not in ("thread", "process"):
            raise ConfigError(f"worker_type must be 'thread' or 'process', got {self.worker_type!r}")
        if self.num_workers == 0 and self.worker_type == "process":
            raise ConfigError(
                "num_workers=0 decodes in the calling thread, so there are no worker processes for "
                "worker_type='process': give num_workers >= 1, or leave worker_type as 'thread'"
            )
        check_int("shuffle_buffer", self.shuffle_buffer, 0)
        check_int("interleave", self.interleave, 1, 64)
        check_int("seed", self.seed, 0, 2**63 - 1)
        check_int("prefetch", self.prefetch, 2, 64)
        for name in ("mean", "std"):
            values = getattr(self, name)
            if not isinstance(values, (tuple, list)) or len(values) != 3:
                raise ConfigError(f"{name} must have three values (R, G, B)")
            for value in values:
                check_number(name, value, 0.0 if name == "mean" else 1e-6, 1e6)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not _is_number_pair(self.scale) or not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ConfigError("scale must be (low, high) with 0 < low <= high <= 1")
        if not _is_number_pair(self.ratio) or not 0 < self.ratio[0] <= self.ratio[1]:
            raise ConfigError("ratio must be (low, high) with 0 < low <= high")
        check_number("eval_fraction", self.eval_fraction, 0.1, 1.0)
        if self.decoder not in ("auto", "region", "simplejpeg", "pil", "nvjpeg"):
            raise ConfigError(f"decoder must be auto, region, simplejpeg, pil or nvjpeg, got {self.decoder!r}")
        if self.on_error not in ON_ERROR:
            raise ConfigError(
                f"on_error must be 'skip' (warn, count, replace) or 'raise' (stop at the first damage), "
                f"got {self.on_error!r}"
            )
        self._check_cache()
        self._check_task()

    def _check_task(self) -> None:
        from .targets import TASKS  # NumPy's module: loaded where a task is checked, not by `import pipeline`

        if self.task is not None and self.task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)} (or None: the manifest's), got {self.task!r}")
        if not isinstance(self.fields, tuple) or not all(
            isinstance(name, str) and name and "/" not in name and not name.startswith(".") for name in self.fields
        ):
            raise ConfigError(
                f"fields must be member names such as ('txt', 'json', 'key', 'boxes.npy'), got {self.fields!r}"
            )
        check_number("min_visible", self.min_visible, 0.0, 1.0)
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ConfigError(f"recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if self.recipe == "yolo" and not self.train and self.decoder == "nvjpeg":
            raise ConfigError("recipe='yolo' letterboxes in eval mode, on the CPU: decoder='nvjpeg' renders its "
                              "training mosaics only; use a CPU decoder for validation")  # fmt: skip
        if not _is_number_pair(self.jitter) or not 0 < self.jitter[0] <= self.jitter[1] <= 16:
            raise ConfigError(f"jitter must be (low, high) scales with 0 < low <= high <= 16, got {self.jitter!r}")
        check_int("fill", self.fill, 0, 255)
        if self.epochs is not None:
            check_int("epochs", self.epochs, 1)
        check_int("close_mosaic", self.close_mosaic, 0)
        if self.close_mosaic and self.recipe != "yolo":
            raise ConfigError(f"close_mosaic turns off recipe='yolo''s mosaic: it has none with recipe={self.recipe!r}")
        if self.close_mosaic and self.epochs is None:
            raise ConfigError("close_mosaic=N turns the mosaic off for the last N epochs: give epochs= as well")
        self._check_hyp()
        self._check_color_jitter()

    def _check_hyp(self) -> None:
        if not isinstance(self.hyp, tuple) or not all(isinstance(pair, (tuple, list)) and len(pair) == 2
                                                      for pair in self.hyp):  # fmt: skip
            raise ConfigError(f"hyp must be a mapping of hyperparameter names to numbers, got {self.hyp!r}")
        if self.hyp and self.recipe != "yolo":
            raise ConfigError(f"hyp= sets recipe='yolo''s hyperparameters: recipe={self.recipe!r} has none")
        for name, value in self.hyp:
            if name not in YOLO_HYP:
                known = ", ".join(YOLO_HYP)
                raise ConfigError(f"hyp: {name!r} is not a hyperparameter of recipe='yolo' (it has {known})")
            check_number(f"hyp[{name!r}]", value, 0.0, YOLO_HYP[name][1])
            if name == "mosaic_n" and value not in (4, 9):
                raise ConfigError(f"hyp['mosaic_n'] is the images of a mosaic, 4 or 9, not {value!r}")

    def _check_color_jitter(self) -> None:
        names = ("brightness", "contrast", "saturation", "hue")
        if not isinstance(self.color_jitter, tuple) or len(self.color_jitter) != 4:
            raise ConfigError(f"color_jitter must be ({', '.join(names)}), got {self.color_jitter!r}")
        for name, value in zip(names, self.color_jitter):
            check_number(f"color_jitter's {name}", value, 0.0, 0.5 if name == "hue" else 1e6)

    def _check_cache(self) -> None:
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise ConfigError(f"cache_dir must be a local folder's path, got {self.cache_dir!r}")
        if self.cache_size is None:
            return
        if self.cache_dir is None:
            raise ConfigError("cache_size bounds the shard cache: give cache_dir too (a local folder, ideally NVMe)")
        if isinstance(self.cache_size, bool) or parse_bytes(self.cache_size) <= 0:
            raise ConfigError(f"cache_size must be a size above 0 (e.g. '500GiB'), got {self.cache_size!r}")

    @property
    def effective_drop_last(self) -> bool:
        return self.train if self.drop_last is None else self.drop_last
