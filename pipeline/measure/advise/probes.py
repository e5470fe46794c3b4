"""The probes of `gpufeed advise`: each stage's ceiling measured on the user's sample and machine.

- `model_consumption` / `model_rate`: the model's steps on synthetic batches, at the largest batch
  that fits its memory where that is known;
- `cold_read_rate`: the raw sample files read cold (evicted from the page cache), no decoding;
- `pack_raw_sample` + `loader_point`: the loader over the page-cached raw sample (CPU decode);
- `host_to_device_rate`: uint8 batch copies to the GPU (CUDA only);
- `target_disk_figures`: the target disk's sequential reads and kind (a short `bench disk`);
- `source_task`: what the source holds (prepare's listing, or a prepared dataset's manifest);
- `write_sample_source` / `prepare_sample`: the sample, its targets kept,
  prepared one way, and the loader over it.

Everything is written into a `scratch_folder` on the target, removed afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from ...errors import ConfigError, write_failure
from ...units import format_bytes
from .plan import MiB


@contextlib.contextmanager
def scratch_folder(target: str) -> Iterator[str]:
    """A temp folder on the target disk, removed afterwards (Ctrl-C included).

    Raises:
        StorageError: nothing can be written there.
    """
    try:
        folder = tempfile.mkdtemp(prefix=".gpufeed-advise-", dir=target)
    except OSError as exc:
        raise write_failure(target, exc) from exc
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class ModelConsumption:
    """The model as the loader's consumer: from the memory a batch needs to the images/s the loader must deliver.

    Attributes:
        batch_size: the batch it trains at: the largest that fits `vram_bytes`, else the one asked for.
        step_seconds: one training step at that batch.
        images_per_s: what the loader must deliver to keep it busy.
        device: where the steps were timed.
        vram_bytes: the memory limit (None: not known, so the batch asked for).
        rows: (batch, memory bytes, fits, step seconds, images/s) from batch 1 up to `batch_size`.
    """

    batch_size: int
    step_seconds: float
    images_per_s: float
    device: str
    vram_bytes: int | None = None
    rows: tuple[tuple[int, int, bool, float, float], ...] = ()


def model_consumption(
    model: Any, input_shape: Any, *, batch_size: int, vram: int | str | None = None, optimizer: str = "sgd",
    device: str = "auto", seconds: float = 2.0,
) -> ModelConsumption:
    """Time the model's steps; with a memory limit, at the largest batch that fits it (`estimate_memory`).

    Without `vram` (and with no CUDA device to read it from) the step is timed
    at `batch_size`, as before the memory was known.

    Raises:
        ConfigError: a bad model, or one that does not fit at batch 1.
    """
    from ..memory.estimate import estimate_memory
    from ..memory.model import check_model_input, load_model, parse_shape
    from ..memory.timing import measure_step_times

    module = load_model(model) if isinstance(model, str) else model
    shape = parse_shape(input_shape)
    check_model_input(module, shape, model if isinstance(model, str) else type(model).__name__)
    cuda = _device_is_cuda(device)
    if vram is None and cuda:
        vram = "device"
    if vram is None:
        timing = measure_step_times(module, shape, [batch_size], optimizer=optimizer, device=device, min_seconds=seconds)
        step = timing.points[0][1]
        return ModelConsumption(batch_size, step, batch_size / step, timing.device)
    estimate = estimate_memory(
        module, shape, optimizer=optimizer, vram=vram, measure=True, device=device, measure_seconds=seconds,
        for_device="cuda" if cuda else "cpu",  # the memory of the device the steps run on
    )
    if not estimate.max_batch_size or estimate.throughput is None:
        raise ConfigError(f"the model does not fit in {format_bytes(estimate.vram_bytes)} at batch 1")
    timing = estimate.throughput
    rows = tuple(
        (r.batch_size, r.memory_bytes, r.fits, r.batch_size / (r.images_per_s or 1.0), r.images_per_s or 0.0)
        for r in estimate.rows
    )
    batch = estimate.max_batch_size
    rate = timing.images_per_s(batch)
    return ModelConsumption(batch, batch / rate, rate, timing.device, estimate.vram_bytes, rows)


def _device_is_cuda(device: str) -> bool:
    from ...loader.loader import resolve_device

    return resolve_device(device).type == "cuda"


def model_rate(
    model: Any, input_shape: Any, batch_size: int, device: str, seconds: float, details: dict[str, Any],
    vram: int | str | None = None, optimizer: str = "sgd",
) -> float:
    consumption = model_consumption(
        model, input_shape, batch_size=batch_size, vram=vram, optimizer=optimizer, device=device, seconds=seconds
    )
    details["gpu_device"] = consumption.device
    details["gpu_step_seconds"] = consumption.step_seconds
    details["gpu_batch_size"] = consumption.batch_size
    if consumption.vram_bytes is not None:
        details["gpu_vram_bytes"] = consumption.vram_bytes
        details["gpu_memory_rows"] = [
            {"batch_size": b, "memory_bytes": m, "fits": f, "step_seconds": t, "images_per_s": r}
            for b, m, f, t, r in consumption.rows
        ]
    return consumption.images_per_s


def cold_read_rate(items: list[Any], readers: int, details: dict[str, Any]) -> float:
    """Files/s reading the sample's files with `readers` threads after evicting them from the page cache."""
    from concurrent.futures import ThreadPoolExecutor

    from ...io.fs import local_path

    paths = list(dict.fromkeys(local_path(item.url) for item in items))  # a shard's images share its tar
    evictable = all(path is not None for path in paths)
    details["storage_cache_evicted"] = evictable
    total_bytes = done = 0
    started = time.perf_counter()
    with ThreadPoolExecutor(max(1, readers), thread_name_prefix="gpufeed-cold-read") as pool:
        while True:
            if evictable:
                for path in paths:
                    _evict_from_page_cache(path)  # type: ignore[arg-type]
            total_bytes += sum(pool.map(read_size, items))
            done += len(items)
            elapsed = time.perf_counter() - started
            if elapsed >= 0.5 or not evictable:  # remote files cannot be evicted: one pass
                details["storage_mb_s"] = total_bytes / elapsed / 1e6
                return done / elapsed


def read_size(item: Any) -> int:
    """Bytes read of one image: its file, or its byte range where it sits in a tar (never the whole tar)."""
    from ..decode import item_bytes

    try:
        return len(item_bytes(item, 1 << 30))
    except (OSError, ValueError):
        return 0


def _evict_from_page_cache(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _member_extension(rel: str) -> str:
    extension = rel.rsplit(".", 1)[-1].lower() if "." in rel else ""
    if extension in ("jpg", "jpeg", "jpe", "jfif"):
        return "jpg"
    # The loader picks members by these names; any other format goes through PIL, which reads the content.
    return extension if extension in ("png", "webp", "bmp", "tif", "tiff", "ppm") else "ppm"


def pack_raw_sample(items: list[Any], blobs: list[bytes], scratch: str) -> str:
    """The raw sample bytes, unchanged, in one tar; returns a brace pattern the loader reads."""
    from ...io.tar import sample_tar_bytes

    folder = os.path.join(scratch, "raw")
    os.makedirs(folder)
    with open(os.path.join(folder, "shard-000000.tar"), "wb") as handle:
        handle.writelines(sample_tar_bytes(f"s{index:06d}", {_member_extension(item.rel): data, "cls": b"0"}) for index, (item, data) in enumerate(zip(items, blobs)))
        handle.write(bytes(1024))
    return os.path.join(folder, "shard-{000000..000000}.tar")


def loader_point(dataset: str, batch_size: int, workers: int, device: str, seconds: float, **options: Any) -> Any:
    """The loader over `dataset` with make_loader's `options` (crop, recipe, decoder), timed for `seconds`."""
    from ..loader import measure_loader

    return measure_loader(dataset, batch_size=batch_size, num_workers=workers, device=device, min_seconds=seconds, **options)


def host_to_device_rate(batch_size: int, crop: int, device: str) -> float | None:
    import torch

    if device == "cpu" or not torch.cuda.is_available() or (device != "auto" and not device.startswith("cuda")):
        return None
    target = torch.device("cuda" if device == "auto" else device)
    host = torch.empty((batch_size, crop, crop, 3), dtype=torch.uint8, pin_memory=True)
    host.to(target, non_blocking=True)
    torch.cuda.synchronize(target)
    copies, started = 0, time.perf_counter()
    while time.perf_counter() - started < 0.5 or copies < 5:
        host.to(target, non_blocking=True)
        torch.cuda.synchronize(target)
        copies += 1
    return copies * batch_size / (time.perf_counter() - started)


def target_disk_figures(target: str, details: dict[str, Any]) -> tuple[float | None, int | None]:
    from ...io.devices import free_bytes
    from ..disk.bench import benchmark_disk

    free = free_bytes(target)
    try:
        disk = benchmark_disk(
            target, file_bytes=64 * MiB, block_sizes=(MiB,), duration_s=0.5, threads=1, tests=("seq_read", "randread")
        )  # the random reads tell flash from a spinning disk where the kernel cannot (virtual disks)
    except Exception as exc:  # a full or odd disk must not stop the diagnosis
        details["target_disk_error"] = str(exc)
        return None, free
    details["target_device_kind"] = disk.device_kind
    details["target_device"] = disk.device
    details["target_seq_read_mb_s"] = disk.seq_read_mb_s
    details["target_direct_io"] = disk.direct_io
    return disk.seq_read_mb_s, free


def source_task(source: str, split: str | None = None) -> tuple[str, list[str]]:
    """What SOURCE holds and its class names, as prepare's listing tells them (`ListingInfo.task`).

    A prepared dataset (a folder with a manifest.json, or the manifest) gives its manifest's task.
    Each layout's listing sets the task before its first item, so one item is listed
    (of `split`, a YOLO dataset's split, where given).

    Raises:
        SourceError, ConfigError, ManifestError: as listing SOURCE.
    """
    from ...io.fs import local_path
    from ...prepare.sources import ListingInfo, list_images

    local = local_path(source)
    if local is not None:
        from ...manifest import MANIFEST_NAME, read_manifest

        folder = local if os.path.isdir(local) else os.path.dirname(local)
        if (local == folder or os.path.basename(local) == MANIFEST_NAME) and os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
            found = read_manifest(folder)
            return found.task, list(found.classes)
    info = ListingInfo()
    for _ in list_images(source, info, split=split):
        break
    return info.task, list(info.classes)


def write_sample_source(items: list[Any], scratch: str, task: str, classes: list[str]) -> str:
    """The sample as a source prepare lists with its targets; returns its path.

    Classification (and the tasks a list carries): a JSONL list of the files.
    Detection: a COCO JSON over copies of the images, the boxes in their pixels
    (YOLO's fractions times the stored size). Segmentation: images/ and masks/
    folders of copies. The copies stay inside the scratch folder, as prepare wants.
    """
    if task == "detection":
        return _write_coco_sample(items, os.path.join(scratch, "sample-coco"))
    if task == "segmentation":
        return _write_segmentation_sample(items, os.path.join(scratch, "sample-segmentation"), classes)
    listing = os.path.join(scratch, "sample.jsonl")
    with open(listing, "w", encoding="utf-8") as handle:
        for number, item in enumerate(items):
            handle.write(json.dumps({"path": _sample_path(item, scratch, number), **_list_targets(item)}) + "\n")
    return listing


def _sample_path(item: Any, scratch: str, number: int) -> str:
    from ...io.fs import local_path

    local = local_path(item.url)
    if isinstance(item.targets, dict) and item.targets.get("tar") is not None:
        return _extracted_member(item, scratch, number)  # a list row names a file: the member, not its tar
    # A list's relative paths are relative to the list's own folder: write absolute ones.
    return os.path.abspath(local) if local is not None else item.url


def _list_targets(item: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"label": item.label} if item.label is not None else {}
    targets = item.targets if isinstance(item.targets, dict) else {}
    if "labels" in targets:
        row["labels"] = targets["labels"]
    if "caption" in targets:
        row["caption"] = targets["caption"]
    return row


def _copy_image(item: Any, folder: str, number: int) -> tuple[str, tuple[int, int]]:
    """The item's bytes written as folder/NNNNNN.<ext>; returns (file name, stored size; (0, 0) if it does not open)."""
    from ...decode import open_image
    from ...errors import DecodeError
    from ..decode import item_bytes

    try:
        data = item_bytes(item)
    except (OSError, ValueError):
        data = b""  # prepare rejects it, as it would the original
    name = f"{number:06d}.{_member_extension(item.rel)}"
    with open(os.path.join(folder, name), "wb") as handle:
        handle.write(data)
    try:
        return name, open_image(data).size
    except DecodeError:
        return name, (0, 0)


def _write_coco_sample(items: list[Any], folder: str) -> str:
    os.makedirs(folder)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    categories: dict[str, int] = {}
    for number, item in enumerate(items):
        name, (width, height) = _copy_image(item, folder, number)
        images.append({"id": number, "file_name": name, "width": width, "height": height})
        targets = item.targets if isinstance(item.targets, dict) else {}
        # YOLO's fractions are of the upright image; for the timing, the stored size places them closely enough.
        scale = (width, height, width, height) if targets.get("normalized") else (1, 1, 1, 1)
        crowds = targets.get("iscrowd") or []
        for index, (box, label) in enumerate(zip(targets.get("boxes") or [], targets.get("box_labels") or [])):
            x0, y0, x1, y1 = (float(v) * s for v, s in zip(box, scale))
            annotations.append({
                "id": len(annotations) + 1, "image_id": number, "category_id": categories.setdefault(str(label), len(categories) + 1),
                "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0),
                "iscrowd": int(bool(crowds[index])) if index < len(crowds) else 0,
            })
    coco = {"images": images, "annotations": annotations, "categories": [{"id": i, "name": n} for n, i in categories.items()]}
    path = os.path.join(folder, "instances.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(coco, handle)
    return path


def _write_segmentation_sample(items: list[Any], folder: str, classes: list[str]) -> str:
    from ...io.fs import read_source_bytes
    from ..decode import MAX_FILE_BYTES

    images, masks = os.path.join(folder, "images"), os.path.join(folder, "masks")
    os.makedirs(images)
    os.makedirs(masks)
    for number, item in enumerate(items):
        name, _ = _copy_image(item, images, number)
        mask = item.targets.get("mask") if isinstance(item.targets, dict) else None
        if not isinstance(mask, str):
            continue  # prepare rejects the image without its mask, as it would the original
        try:
            data = read_source_bytes(mask, MAX_FILE_BYTES)
        except (OSError, ValueError):
            continue
        extension = os.path.splitext(mask)[1].lower() or ".png"
        with open(os.path.join(masks, os.path.splitext(name)[0] + extension), "wb") as handle:
            handle.write(data)
    if classes:
        with open(os.path.join(folder, "classes.txt"), "w", encoding="utf-8") as handle:
            handle.write("".join(f"{name}\n" for name in classes))
    return folder


def prepare_sample(
    source: str | list[Any], scratch: str, fmt: str, size: int, workers: int, *, mode: str = "shorter"
) -> tuple[str, float]:
    """`gpufeed prepare` of the sample into scratch/<fmt>; returns (folder, mean bytes per sample).

    `source` is the sample source `write_sample_source` wrote, or the sampled items (listed as a JSONL list).
    """
    from ...io.output import Output
    from ...manifest import read_manifest
    from ...prepare.job import prepare_dataset
    from ...specs import EncodeSpec, PrepareSpec, ResizeSpec

    if not isinstance(source, str):
        source = write_sample_source(source, scratch, "classification", [])
    out = os.path.join(scratch, fmt)
    spec = PrepareSpec(source=source, out=out, resize=ResizeSpec(size=size, mode=mode), encode=EncodeSpec(format=fmt))
    prepare_dataset(spec, workers=workers, force=True)
    manifest = read_manifest(Output(out))
    return out, sum(s.bytes for s in manifest.shards) / max(1, manifest.samples)


def _extracted_member(item: Any, scratch: str, number: int) -> str:
    """An image inside a tar (WebDataset shards as the source) written out as a file of the scratch folder."""
    from ..decode import item_bytes

    folder = os.path.join(scratch, "sample-members")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, str(number))
    if not os.path.exists(path):  # written once, for every candidate format
        try:
            data = item_bytes(item)
        except (OSError, ValueError):
            data = b""  # prepare rejects it, as it would the member
        with open(path, "wb") as handle:
            handle.write(data)
    return path


def median_shorter_side(blobs: list[bytes]) -> float:
    from ...decode import open_image
    from ...errors import DecodeError

    sides = []
    for data in blobs:
        with contextlib.suppress(DecodeError):
            sides.append(min(open_image(data).size))
    return float(statistics.median(sides)) if sides else 0.0


def describe_storage(source: str, device_info: Any, details: dict[str, Any]) -> str:
    from ...io.fs import local_path

    if local_path(source) is None:
        return "network"
    info = device_info(source)
    kind = info.kind
    if info.device and info.device == details.get("target_device"):  # the target's random reads classified it
        kind = details.get("target_device_kind") or kind
    return f"{kind} ({info.fstype})"


__all__ = [
    "ModelConsumption", "cold_read_rate", "describe_storage", "host_to_device_rate", "loader_point",
    "median_shorter_side", "model_consumption", "model_rate", "pack_raw_sample",
    "prepare_sample", "read_size", "scratch_folder", "source_task", "target_disk_figures", "write_sample_source",
]
