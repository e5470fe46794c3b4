"""`make_loader`: its settings checked, the dataset resolved, and the `Loader` built over it.

    loader = make_loader("shards/manifest.json", batch_size=256, device="cuda")
    for epoch in range(90):
        loader.set_epoch(epoch)
        for images, labels in loader:   # on the GPU, normalised, ready
            ...
    print(loader.stats)

Every setting is validated (`LoaderSpec`, and here what the spec does not
hold: the device, the placement, the transforms, the store's options)
before anything is built; the Loader itself is `iteration.py`'s.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import torch

from ..errors import ConfigError
from ..io.cache.shards import ShardCache
from ..io.fs import is_url, storage_options_for
from ..specs import DTYPES, IMAGENET_MEAN, IMAGENET_STD, LoaderSpec, check_bool
from .dataset import DatasetInfo, resolve_dataset
from .iteration import Loader
from .ranks import check_epoch_size, distributed_placement, given_placement
from .ranks import merge_states as merge_states  # re-exported: pipeline.loader.loader.merge_states
from .stats import LoaderStats as LoaderStats  # re-exported: pipeline.loader.loader.LoaderStats
from .streaming import ShardOpener
from .tasks import TaskPlan, task_plan

log = logging.getLogger("gpufeed.loader")


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" (CUDA when available), "cpu", "cuda[:N]" or a torch.device; ConfigError when unusable."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but CUDA is not available here; use device='auto' or 'cpu'")
    return resolved


def warn_if_upsampling(dataset: DatasetInfo, spec: LoaderSpec) -> None:
    """Log once, when the loader is made, that a crop larger than the prepared images is upsampled."""
    size = dataset.prepared_size
    if size is not None and spec.crop > size:
        log.warning(
            "crop=%d is larger than the images of %s, prepared at %d px (--size %d in its manifest's params): "
            "every crop is upsampled to %d px; prepare it with --size %d or more, or use crop <= %d",
            spec.crop, dataset.root or ".", size, size, spec.crop, spec.crop, size,
        )  # fmt: skip


def dtype_name(dtype: str | torch.dtype) -> str:
    """The LoaderSpec name of an output dtype given as a torch.dtype (torch.float16 -> "float16") or a name."""
    if not isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        accepted = ", ".join(f"torch.{n}" for n in DTYPES)
        raise ConfigError(f"dtype must be one of {accepted} (or its name as a string), got {dtype}")
    return name


TORCH_DATALOADER_OPTIONS = {
    "shuffle": "use shuffle_buffer=N (a seeded shuffle buffer, on with train=True; train=False reads in a fixed order)",
    "sampler": "use rank= and world_size= (each rank reads disjoint samples; torch.distributed gives them when initialised)",
    "batch_sampler": "use batch_size= with rank= and world_size= (every rank gets the same number of batches)",
    "pin_memory": "not needed: batches are collated in pinned memory and copied to device= already",
    "pin_memory_device": "use device=",
    "persistent_workers": "not needed: the workers live as long as the loader (close() stops them)",
    "prefetch_factor": "use prefetch= (batches prepared ahead)",
    "collate_fn": "not needed: batches are (images, labels) tensors; change them in the training loop",
    "worker_init_fn": "use worker_type= and num_workers= (the workers run gpufeed's own decode)",
    "multiprocessing_context": "use worker_type='process'",
    "generator": "use seed=",
    "timeout": "not needed: a worker that fails raises in the training loop",
    "dataset": "use source (the first argument: a prepared dataset's folder or manifest.json)",
}
"""torch DataLoader arguments that make_loader does not take -> what to use instead."""


def unknown_options_message(unknown: Sequence[str]) -> str:
    """What `make_loader` says about options it does not take: the gpufeed equivalent of a torch
    DataLoader argument, or the close spelling of a misspelt setting."""
    import difflib

    known = [name for name in inspect.signature(make_loader).parameters if name not in ("source", "unknown")]
    hints = []
    for name in sorted(unknown):
        if name in TORCH_DATALOADER_OPTIONS:
            hints.append(f"{name} is a torch DataLoader argument: {TORCH_DATALOADER_OPTIONS[name]}")
            continue
        close = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
        hints.append(f"{name}: did you mean {' or '.join(close)}?" if close else f"{name} is not a make_loader setting")
    return f"make_loader got unknown option(s): {'; '.join(hints)}"


def make_loader(
    source: str | os.PathLike[str],
    batch_size: int,
    *,
    device: str | torch.device = "auto",
    train: bool = True,
    crop: int = 224,
    num_workers: int | str = "auto",
    worker_type: str = "thread",
    shuffle_buffer: int = 2048,
    interleave: int = 4,
    seed: int = 0,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: str | torch.dtype = "float32",
    channels_last: bool = False,
    drop_last: bool | None = None,
    prefetch: int = 2,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    flip: bool = True,
    eval_fraction: float = 0.875,
    decoder: str = "auto",
    on_error: str = "skip",
    verify: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    links_outside: bool = False,
    task: str | None = None,
    fields: Sequence[str] = (),
    min_visible: float = 0.25,
    recipe: str | None = None,
    jitter: Sequence[float] = (0.1, 2.0),
    fill: int = 114,
    epochs: int | None = None,
    close_mosaic: int = 0,
    hyp: Mapping[str, float] | None = None,
    color_jitter: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
    masks: bool = True,
    augment: Sequence[Any] | None = None,
    sample_transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    batch_transform: Callable[[Any], Any] | None = None,
    **unknown: NoReturn,
) -> Loader:
    """Build a loader over a prepared dataset.

    Every setting but `source`, `device`, `rank`, `world_size`,
    `storage_options`, `links_outside`, `sample_transform`,
    `batch_transform` and `augment` (which names `recipe` and its
    settings) is a `LoaderSpec` field of the same name and default (`hyp`:
    a mapping here, None for none; (name, value) pairs there); they are
    validated there before anything is built.

    Args:
        source: a manifest path/URL, a dataset directory, a shard brace
            pattern (`shards/shard-{000000..000099}.tar`) or one shard
            (`shards/00000.tar`); a str or a path.
        batch_size: samples per batch (per rank).
        device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1", or a torch.device.
        train: random-resized crops, flips and shuffling; False gives
            centre crops in a fixed order.
        crop: output side in pixels.
        num_workers: decode workers, or "auto" (the available cores); 0
            decodes in the calling thread, as each batch is asked for (no
            producer thread, no pool, nothing ahead: for debugging).
        worker_type: "thread" (the decoders release the GIL) or "process"
            (a fork pool decoding into shared memory; num_workers >= 1).
            Process workers ignore Ctrl-C: the training loop gets the
            KeyboardInterrupt and the loader stops them.
        shuffle_buffer: samples mixed by the seeded shuffle buffer (train).
        interleave: shards read at once, taken in turn (train).
        seed: seed of every random choice (order, crops, flips).
        mean: per-channel (R, G, B) mean to subtract, in 0-1 units.
        std: per-channel (R, G, B) standard deviation to divide by, in 0-1 units.
        dtype: float32, float16 or bfloat16 output, normalised; or uint8:
            pixels as decoded and flipped, not normalised (for augmentation
            on the GPU). A torch.dtype (torch.float16) or its name ("float16").
        channels_last: NCHW tensors in channels-last memory format.
        drop_last: drop the incomplete last batch and the uneven tail across
            ranks; None: True in train mode, False in eval mode.
        prefetch: batches prepared ahead (2 to 64).
        scale: random-resized-crop area range (low, high), 0 < low <= high <= 1.
        ratio: random-resized-crop aspect range (low, high).
        flip: random horizontal flips in train mode.
        eval_fraction: centre-crop fraction in eval mode (0.875: 224 from 256).
        decoder: "auto" (the fastest present), "region" (libjpeg-turbo
            decoding only the crop's region), "simplejpeg", "pil", or
            "nvjpeg" (on the GPU; needs a CUDA device and torchvision with CUDA;
            with recipe="yolo" in train mode the workers only plan each
            mosaic, and the device decodes each picture once and renders
            the batch: `gpu_mosaic.py`).
        on_error: what damage does: "skip" (warn once per shard or sample,
            count it in `stats.skipped`, and re-draw replacements, counted in
            `stats.replaced`, from this rank's own samples of the epoch, so
            every rank still yields `len(loader)` full batches) or "raise"
            (stop at the first damaged shard or sample with a SampleError
            naming it). Damage: a shard missing, unreadable or holding fewer
            samples than the manifest says; a sample without an image or
            whose bytes do not decode.
        verify: hash each shard with sha256 as it streams and compare with
            the manifest's at its end; a mismatch is a damaged shard (its
            samples, already read, stay delivered; under "raise" it raises).
            Needs a manifest: a brace pattern has no hashes.
        cache_dir: a local folder (ideally NVMe) for a remote dataset's
            shards (`pipeline.io.cache.shards.ShardCache`): the first epoch streams
            each shard into it as it reads it (its sha256 checked against the
            manifest), the next few shards of this rank's order are fetched
            into it while the current ones decode, and later epochs read it
            instead of the store, each cached shard checked before any of
            its samples is read (against what its fill recorded; with
            verify=True, its whole sha256): one that changed on disk is
            fetched again. The ranks and processes of a machine may
            share one folder (one download per shard). A cache that is full
            keeps what it holds and the rest is read from the store (logged
            once). Without a cache, a remote shard is still read ahead (the
            next one, into memory). Ignored for a local dataset; needs a
            manifest (a brace pattern has no hashes).
        cache_size: the most the cache may hold: bytes or a size such as
            "500GiB"; None: the dataset's size (all of its shards).
        rank: this process's rank; None (with world_size None): what
            torch.distributed reports when each epoch starts (else 0), so a
            loader made before init_process_group splits the data too.
        world_size: the number of ranks; None (with rank None): what
            torch.distributed reports when each epoch starts (else 1).
        storage_options: fsspec options for a remote dataset's store
            (endpoint_url, profile, anon, ...); credentials otherwise come
            from the usual places. Never stored in the loader's spec or state.
        links_outside: read a local dataset's shards that are links to files
            outside its folder; by default a manifest whose shards resolve
            outside the dataset (links included) is refused.
        task: what the samples hold: "classification", "multilabel",
            "detection", "segmentation" or "captions"; None: what the
            manifest says (shards without one: captions where a sample
            holds txt and no cls, as img2dataset's do, else
            classification). Any task but classification, or any
            `fields`, makes the loader yield a
            `Batch` (`pipeline.loader.tasks`), which unpacks as
            `images, targets`; classification without fields yields
            `(images, labels)` tuples as always.
        fields: members to deliver besides the task's targets, a list per
            batch in `batch.fields[name]` under the name asked for: "txt"
            or "caption" (also `batch.captions`), "json" (parsed), "key"
            (`batch.keys`), or any member the samples hold ("boxes.npy",
            "meta.cls", ...).
        min_visible: detection: a box keeps at least this fraction of its
            area after the crop, or it is dropped (`batch.boxes_dropped`).
        recipe: how each image becomes the `crop` x `crop` output: "crop"
            (random-resized crop in train mode, centre crop in eval), or a
            detection recipe (`pipeline.loader.placement`): "letterbox"
            (the whole image, its ratio kept, centred and padded with
            `fill`: YOLO's), "scale_jitter" (the letterboxed size times a
            random scale in `jitter`, then a random window or padding:
            large-scale jitter), "iou_crop" (SSD's random IoU crop around
            the boxes). In eval mode the detection recipes letterbox. Boxes
            and masks follow; the region decoder still decodes only what
            each placement reads. Default: "letterbox" for a detection
            dataset (a crop cuts boxes away and leaves images with none:
            `loader.stats.boxes_dropped`, `images_emptied` count them),
            "crop" for every other task.
        jitter: scale_jitter's range of scales (low, high).
        fill: the value (0-255) of output pixels the image does not cover
            (a mask's are the ignore index).
        epochs: how many epochs the training runs, where a setting counts
            back from the end (`close_mosaic`).
        close_mosaic: recipe="yolo": the last N of `epochs` train without the
            mosaic, as ultralytics' `close_mosaic` (its default is 10).
        augment: the augmentation as a list of `pipeline.augment.ops` ops
            (`[Mosaic(), RandomAffine(degrees=10), Flip(), HSV(), MixUp(0.1)]`,
            `[RandomResizedCrop(scale=(0.2, 1)), Flip()]`, ...): the same as the
            `recipe` and parameters it comes to (`ops.loader_settings`), which
            it replaces (giving both is refused).
        hyp: recipe="yolo"'s hyperparameters by ultralytics' names
            ({"degrees": 10, "mosaic": 0.5, "hsv_v": 0.3, ...}: mosaic,
            degrees, translate, scale, shear, perspective, flipud, fliplr,
            hsv_h, hsv_s, hsv_v, mixup, cutmix, copy_paste); the others keep
            ultralytics' defaults.
        color_jitter: (brightness, contrast, saturation, hue) as torchvision's
            ColorJitter: factors drawn per image in train mode (brightness,
            contrast, saturation in [max(0, 1 - x), 1 + x], hue in [-h, h],
            h <= 0.5; a random order), applied to each uint8 batch on the
            device; all 0 (the default): off. On a CPU device the decode
            workers apply it to each image as they write it (the same pixels).
        masks: detection: deliver the dataset's masks where it has them
            (`mask.png` as `batch.masks`, `instances.png` as each box's own
            masks in `batch.instance_masks`), sampled nearest through the
            same crop, flip or recipe="yolo" mosaic and warp as the pixels;
            False reads neither (boxes only, or masks drawn from polygons).
        sample_transform: a callable on each decoded sample, in the decode
            workers: it gets {"image": uint8 (H, W, 3) array, "key", and the
            sample's targets: "boxes", "box_labels", "mask", "labels",
            "caption"} after the crop and flip, and returns the dict with
            "image" (same shape, uint8) and the targets it changed. It costs
            its own time per sample on every decode worker, and turns off the
            CPU device's fused normalisation. With worker_type="process" it
            must pickle (a function at the top level of a module).
        batch_transform: a callable on each batch on the device (MixUp,
            CutMix, kornia or transforms.v2 on the GPU), returning the batch
            to deliver; on CUDA it runs in the prefetch stream, `prefetch`
            batches ahead, while the training stream works on earlier ones
            (on the CPU, in the training loop's thread as each batch is
            asked for: its time counts as waiting for data in `stats`).
        **unknown: refused: a misspelt setting is an error, never ignored.

    Returns:
        A Loader: iterate for (images, labels), one iteration at a time;
        `len()`, `batch_size`, `dataset`, `set_epoch`, `stats`,
        `state_dict`, `load_state_dict`, `close`. A crop larger than the
        dataset's prepared size logs one warning that it is upsampled.

    Raises:
        ConfigError: invalid settings (checked before anything is built),
            verify=True over a source without sha256s, or a batch_size
            larger than this rank's samples per epoch with drop_last (an
            empty epoch).
        ManifestError: the source is not a prepared dataset, or its manifest
            names a shard outside it.
    """
    if unknown:
        raise ConfigError(unknown_options_message(list(unknown)))
    if augment is not None:
        settings = _augment_settings(augment, recipe=recipe, hyp=hyp, scale=scale, ratio=ratio, flip=flip, jitter=jitter,
                                     color_jitter=color_jitter)  # fmt: skip
        recipe, hyp = settings.get("recipe"), settings.get("hyp")
        scale, ratio = settings.get("scale", scale), settings.get("ratio", ratio)
        flip, jitter = settings.get("flip", flip), settings.get("jitter", jitter)
        color_jitter = settings.get("color_jitter", color_jitter)
    spec = LoaderSpec(
        batch_size=batch_size,
        train=train,
        crop=crop,
        num_workers=num_workers,
        worker_type=worker_type,
        shuffle_buffer=shuffle_buffer,
        interleave=interleave,
        seed=seed,
        mean=_as_tuple(mean),
        std=_as_tuple(std),
        dtype=dtype_name(dtype),
        channels_last=channels_last,
        drop_last=drop_last,
        prefetch=prefetch,
        scale=_as_tuple(scale),
        ratio=_as_tuple(ratio),
        flip=flip,
        eval_fraction=eval_fraction,
        decoder=decoder,
        on_error=on_error,
        verify=verify,
        cache_dir=None if cache_dir is None else os.fspath(cache_dir),
        cache_size=cache_size,
        task=task,
        fields=_field_names(fields),
        min_visible=min_visible,
        recipe=recipe,
        jitter=_as_tuple(jitter),
        fill=fill,
        epochs=epochs,
        close_mosaic=close_mosaic,
        hyp=_hyp_pairs(hyp),
        color_jitter=_as_tuple(color_jitter),
        masks=masks,
    )
    resolved = resolve_device(device)
    if spec.decoder == "nvjpeg":
        from .gpu_decode import check_gpu_decode

        check_gpu_decode(resolved)
    placement = given_placement(rank, world_size)
    check_bool("links_outside", links_outside)
    with storage_options_for([os.fspath(source)], storage_options):
        dataset = resolve_dataset(source, links_outside=links_outside)
    if dataset.samples == 0:
        raise ConfigError(f"{os.fspath(source)} holds no samples")
    if spec.verify and not dataset.hashed:
        raise ConfigError(
            f"verify=True checks shards against their manifest's sha256, and {os.fspath(source)} has none "
            "(a brace pattern): give the dataset's folder or manifest.json"
        )
    if spec.recipe is None:  # a detector keeps its boxes: the letterbox, unless crops are asked for
        detection = (spec.task or dataset.task) == "detection" and spec.decoder != "nvjpeg"
        spec = dataclasses.replace(spec, recipe="letterbox" if detection else "crop")
    check_epoch_size(dataset, spec, (placement or distributed_placement())[1])
    warn_if_upsampling(dataset, spec)
    plan = _task_plan(spec, dataset, sample_transform, batch_transform)
    if plan is not None and spec.task is None:  # the records keep what the manifest's task needs
        spec = dataclasses.replace(spec, task=plan.task)
    opener = shard_opener(dataset, spec, storage_options)
    return Loader(dataset, spec, resolved, placement, opener, plan, batch_transform)


def _task_plan(
    spec: LoaderSpec, dataset: DatasetInfo, sample_transform: Any, batch_transform: Any
) -> TaskPlan | None:
    """The loader's task plan (None: the classification tuple path), its transforms checked."""
    if batch_transform is not None and not callable(batch_transform):
        raise ConfigError("batch_transform must be a callable taking a batch and returning the batch to deliver")
    if spec.recipe not in ("crop", "yolo") and spec.decoder == "nvjpeg":
        raise ConfigError(f"recipe={spec.recipe!r} places images on the CPU: decoder='nvjpeg' only crops; use a CPU decoder")
    if spec.recipe == "iou_crop" and (spec.task or dataset.task) != "detection":
        raise ConfigError("recipe='iou_crop' crops around each sample's boxes: it needs a detection dataset (task='detection')")
    if spec.recipe == "yolo" and (spec.task or dataset.task) != "detection":
        raise ConfigError("recipe='yolo' makes mosaics of boxes: it needs a detection dataset (task='detection')")
    if spec.recipe == "yolo" and "geometry" in spec.fields:
        raise ConfigError("recipe='yolo' makes each output of four images: fields=('geometry',) has no one source to give")
    if sample_transform is not None and spec.decoder == "nvjpeg":
        raise ConfigError(
            "sample_transform runs on each decoded sample in the decode workers, and decoder='nvjpeg' decodes "
            "on the GPU: use batch_transform there, or a CPU decoder"
        )
    classes = len(dataset.classes) or None
    plan = task_plan(
        spec.task, spec.fields, dataset.task, classes, dataset.ignore_index, spec.min_visible, sample_transform,
        spec.worker_type, dataset.fields,
    )  # fmt: skip
    if not spec.masks and plan is not None:
        plan = dataclasses.replace(plan, masks=False, instances=False)
    return plan


def _augment_settings(augment: Sequence[Any], **given: Any) -> dict[str, Any]:
    """`augment=`'s settings; refused beside a setting it replaces that was given too."""
    from ..augment.ops import loader_settings

    if isinstance(augment, (str, bytes)) or not isinstance(augment, Sequence):
        raise ConfigError(f"augment must be a list of pipeline.augment ops, not {type(augment).__name__}")
    defaults = {field.name: field.default for field in dataclasses.fields(LoaderSpec)} | {"hyp": None}  # make_loader's
    both = [name for name, value in given.items()
            if (tuple(value) if isinstance(value, (list, tuple)) else value) != defaults[name]]  # fmt: skip
    if both:
        raise ConfigError(f"augment= sets the recipe and its parameters: give it or {', '.join(both)}, not both")
    return loader_settings(augment)


def _hyp_pairs(hyp: Mapping[str, float] | None) -> tuple[tuple[str, float], ...]:
    if hyp is None:
        return ()
    if not isinstance(hyp, Mapping):
        raise ConfigError(f"hyp must be a mapping of hyperparameter names to numbers, got {type(hyp).__name__}")
    return tuple(sorted((str(name), value) for name, value in hyp.items()))


def _field_names(fields: Sequence[str]) -> tuple[str, ...]:
    """fields= as the spec holds it: a tuple of names (a lone string is one name, not its letters)."""
    if isinstance(fields, str):
        return (fields,)
    try:
        return tuple(fields)
    except TypeError:
        raise ConfigError(f"fields must be a sequence of member names, got {fields!r}") from None


def shard_opener(dataset: DatasetInfo, spec: LoaderSpec, storage_options: Mapping[str, Any] | None) -> ShardOpener:
    """How the loader opens the dataset's shards: through a ShardCache when `cache_dir` is given and they are remote."""
    if spec.cache_dir is None or not is_url(dataset.root):
        return ShardOpener(storage_options)
    if not dataset.hashed:
        raise ConfigError(
            f"cache_dir keys cached shards by their manifest's sha256, and {dataset.root} has none "
            "(a brace pattern): give the dataset's folder or manifest.json"
        )
    size = spec.cache_size
    if size is None:
        size = sum(shard.bytes or 0 for shards in dataset.sets for shard in shards)
    cache = ShardCache(spec.cache_dir, size, storage_options=storage_options, verify=spec.verify)
    return ShardOpener(storage_options, cache)


def _as_tuple(values: Sequence[float]) -> Any:
    """A list or tuple of numbers as the tuple LoaderSpec holds (LoaderSpec checks how many and which)."""
    return tuple(values)
