"""How fast is `make_loader` next to the loaders a user would otherwise pick?

One epoch of training batches (batch 64, RandomResizedCrop to 224 in every
row, 2 workers, CPU device) over the same demo images, measured in one run:

  gpufeed (thread)   make_loader(worker_type="thread") over the prepared shards
  gpufeed (process)  make_loader(worker_type="process"); the faster one is the headline
  webdataset         plain wds.WebDataset(...).decode("pil") + torchvision-style
                     RandomResizedCrop + ToTensor + torch DataLoader, same shards
  imagefolder-raw    an ImageFolder-style Dataset over the raw (~1 MP) JPEGs: PIL
                     decode + RandomResizedCrop + ToTensor, torch DataLoader
  ffcv               FFCV's Loader with RandomResizedCropRGBImageDecoder over a
                     .beton holding the same 256 px JPEG bytes; run as a subprocess
                     by .venv-ffcv's python (benchmarks/setup_ffcv.sh)
  ceiling            no I/O, no loader: the fastest decode + RandomResizedCrop
                     (pipeline.crops.decode_into into a preallocated batch) on the
                     same JPEG bytes in memory, in as many threads as workers
  simplejpeg decode  informational: a plain full decode alone, same threads

Every row warms up first (page cache warm; a partial epoch, which also starts
the workers; a full epoch for FFCV, whose first one JIT-compiles), then one full
epoch is timed and each batch is touched once, so the figure is the loader's.
Each row runs --rounds times (>= 2), alternating order; the best run counts:
the machine is shared and noise only ever slows a run down. Then a stall run:
a consumer at 80 % of the headline loader's measured rate must find data ready
(loader.stats.stall_fraction).

Data, cached under --data (default benchmarks/results/loader-data):
    gpufeed demo-data DATA/raw --n 2000 --min-side 800 --max-side 1250
    gpufeed prepare DATA/raw DATA/prepared --size 256 --shard-count 250
(--shard-count gives 8 shards, so each of WebDataset's 2 workers gets some;
gpufeed's loader does not need it.)

Usage:
    python benchmarks/loader.py [--data DIR] [--rounds 2] [--json FILE]
    bash benchmarks/setup_ffcv.sh      # once, for the FFCV row
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

try:
    from . import common
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import common  # type: ignore[no-redef]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(REPO, "benchmarks", "results", "loader-data")
DEFAULT_FFCV_VENV = os.path.join(REPO, ".venv-ffcv")
DATA_MARKER = ".benchmark-data.json"  # dot-name: gpufeed's listing skips it

BATCH = 64
CROP = 224
SIZE = 256  # prepared shorter side
SHARD_COUNT = 250  # samples per shard
DEMO_SIDES = (800, 1250)
SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop defaults, in every row
RATIO = (3 / 4, 4 / 3)
WARMUP_BATCHES = 6  # partial warm-up epoch: starts the workers, touches every code path
STALL_CONSUMER = 0.8  # the simulated consumer's rate, as a share of the loader's
TARGETS = {"vs_webdataset": 2.3, "vs_imagefolder": 9.0, "vs_ffcv": 1.2, "of_ceiling": 0.75}
STALL_TARGET = 0.05
FFCV_SKIPPED = "skipped (no .venv-ffcv: run benchmarks/setup_ffcv.sh)"

ROW_TITLES = {
    "gpufeed-thread": "gpufeed make_loader (2 threads)",
    "gpufeed-process": "gpufeed make_loader (2 processes)",
    "webdataset": "plain WebDataset + DataLoader",
    "imagefolder": "ImageFolder over raw JPEGs + DataLoader",
    "ffcv": "FFCV Loader (.beton, 256 px JPEG)",
    "ceiling": "decode ceiling: decode_into in threads",
    "simplejpeg": "simplejpeg full decode alone, threads",
}


@dataclasses.dataclass
class Run:
    """One timed epoch of one row."""

    images: int
    seconds: float
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)
    noise: float | None = None  # share of the CPUs other processes used meanwhile

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class Row:
    """Every run of a row; the best one is the row's figure."""

    name: str
    runs: list[Run] = dataclasses.field(default_factory=list)
    skipped: str = ""

    @property
    def best(self) -> Run | None:
        return max(self.runs, key=lambda run: run.images_per_s) if self.runs else None

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        data: dict[str, Any] = {"title": ROW_TITLES[self.name]}
        if self.skipped:
            data["skipped"] = self.skipped
        if best is not None:
            data.update(
                images_per_s=round(best.images_per_s, 2),
                seconds=round(best.seconds, 4),
                images=best.images,
                runs_images_per_s=[round(run.images_per_s, 2) for run in self.runs],
                runs_noise=[None if run.noise is None else round(run.noise, 3) for run in self.runs],
                detail=best.detail,
            )
        return data


# ---------------------------------------------------------------------------
# Timing an epoch


def touch(images: Any) -> float:
    """Read one element: the consumer does the least a training step could do."""
    return float(images[(0,) * images.ndim])


def time_epoch(batches: Iterable[Any]) -> tuple[int, float, float]:
    """(images, seconds, seconds to the first batch) of one pass over `batches` of (images, labels)."""
    images = 0
    first = None
    start = time.perf_counter()
    for batch in batches:
        touch(batch[0])
        images += len(batch[1])
        if first is None:
            first = time.perf_counter() - start
    return images, time.perf_counter() - start, first or 0.0


def warm_up(batches: Iterable[Any], count: int) -> None:
    """A partial epoch: `count` batches, then the iterator is closed."""
    iterator = iter(batches)
    for _, batch in zip(range(count), iterator):
        touch(batch[0])
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
    del iterator


# ---------------------------------------------------------------------------
# gpufeed


def make_gpufeed_loader(prepared: str, worker_type: str, workers: int) -> Any:
    from pipeline.loader import make_loader

    return make_loader(
        prepared, BATCH, device="cpu", crop=CROP, num_workers=workers, worker_type=worker_type, scale=SCALE, ratio=RATIO
    )


def run_gpufeed(prepared: str, worker_type: str, workers: int) -> Run:
    from pipeline.loader import LoaderStats

    loader = make_gpufeed_loader(prepared, worker_type, workers)
    try:
        warm_up(loader, WARMUP_BATCHES)
        loader.set_epoch(1)
        loader.stats = LoaderStats()
        images, seconds, first = time_epoch(loader)
        detail = {"first_batch_s": round(first, 4), "decoder": loader._crop.decoder, "stats": loader.stats.to_dict()}
    finally:
        loader.close()
    return Run(images, seconds, detail)


@dataclasses.dataclass
class StallResult:
    consumer_images_per_s: float
    sleep_per_batch_s: float
    stats: dict[str, float]
    first_batch_wait_s: float
    steady_stall_fraction: float


def run_stall(prepared: str, worker_type: str, workers: int, loader_rate: float) -> StallResult:
    """A consumer at STALL_CONSUMER x the loader's rate: how much of its time does it wait?"""
    from pipeline.loader import LoaderStats

    rate = STALL_CONSUMER * loader_rate
    sleep_per_batch = BATCH / rate
    loader = make_gpufeed_loader(prepared, worker_type, workers)
    try:
        warm_up(loader, WARMUP_BATCHES)
        loader.set_epoch(2)
        loader.stats = LoaderStats()
        first_wait = None
        start = time.perf_counter()
        for images, labels in loader:
            if first_wait is None:
                first_wait = time.perf_counter() - start
            touch(images)
            time.sleep(sleep_per_batch * len(labels) / BATCH)  # the "training step"
        stats = loader.stats
    finally:
        loader.close()
    first_wait = first_wait or 0.0
    total = stats.wait_s + stats.step_s
    steady = (stats.wait_s - first_wait) / (total - first_wait) if total > first_wait else 0.0
    return StallResult(rate, sleep_per_batch, stats.to_dict(), first_wait, max(0.0, steady))


# ---------------------------------------------------------------------------
# Baselines in gpufeed's venv: torch DataLoader rows


class RandomResizedCropToTensor:
    """torchvision's RandomResizedCrop(size) + ToTensor() for PIL images, without torchvision.

    The same steps torchvision runs: get_params (10 tries, then a centre crop
    clamped to the ratio range), PIL crop, PIL resize (bilinear), then the
    uint8 HWC array -> float CHW / 255.
    """

    def __init__(self, size: int = CROP, scale: tuple[float, float] = SCALE, ratio: tuple[float, float] = RATIO) -> None:
        self.size, self.scale, self.ratio = size, scale, ratio

    def get_params(self, width: int, height: int) -> tuple[int, int, int, int]:
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target_area = area * random.uniform(*self.scale)
            aspect = math.exp(random.uniform(*log_ratio))
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return random.randint(0, height - h), random.randint(0, width - w), h, w
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img: Any) -> Any:
        import numpy as np
        import torch
        from PIL import Image

        top, left, h, w = self.get_params(*img.size)
        img = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.BILINEAR)
        array = torch.from_numpy(np.array(img, np.uint8, copy=True)).view(self.size, self.size, 3)
        return array.permute(2, 0, 1).contiguous().float().div(255)


def make_transform() -> tuple[Callable[[Any], Any], str]:
    """torchvision's RandomResizedCrop + ToTensor when importable, else the same steps here."""
    try:
        from torchvision import transforms
    except ImportError:
        return RandomResizedCropToTensor(), "torchvision-style (torchvision absent)"
    compose = transforms.Compose([transforms.RandomResizedCrop(CROP, scale=SCALE, ratio=RATIO), transforms.ToTensor()])
    return compose, f"torchvision {common.dist_version('torchvision')}"


def shard_paths(prepared: str) -> list[str]:
    with open(os.path.join(prepared, "manifest.json")) as handle:
        manifest = json.load(handle)
    return [os.path.join(prepared, shard["path"]) for shard in manifest["shards"]]


def make_webdataset_loader(prepared: str, workers: int) -> Any:
    """What the WebDataset README shows: shard shuffle, sample shuffle, decode("pil"), map, DataLoader."""
    import torch
    import webdataset as wds

    transform, _ = make_transform()
    urls = shard_paths(prepared)
    dataset = (
        wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(transform, int)
    )
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers, persistent_workers=True)


class RawImageFolder:
    """torchvision.datasets.ImageFolder's loading: open the file, convert("RGB"), transform."""

    def __init__(self, items: list[tuple[str, str]], transform: Callable[[Any], Any]) -> None:
        classes = sorted({label for _, label in items})
        index = {name: i for i, name in enumerate(classes)}
        self.samples = [(path, index[label]) for path, label in items]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, position: int) -> tuple[Any, int]:
        from PIL import Image

        path, label = self.samples[position]
        with open(path, "rb") as handle:
            img = Image.open(handle).convert("RGB")
        return self.transform(img), label


def make_imagefolder_loader(raw: str, workers: int) -> Any:
    import torch

    transform, _ = make_transform()
    dataset = RawImageFolder(common.list_jpegs(raw), transform)
    return torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, num_workers=workers, persistent_workers=True
    )


def run_dataloader(loader: Any) -> Run:
    warm_up(loader, WARMUP_BATCHES)
    images, seconds, first = time_epoch(loader)
    return Run(images, seconds, {"first_batch_s": round(first, 4)})


# ---------------------------------------------------------------------------
# The decode ceiling: bytes in memory, no loader


def read_prepared_jpegs(prepared: str) -> list[bytes]:
    """The .jpg bytes of every prepared sample, in shard order (stdlib only)."""
    return [data for data, _ in read_prepared_samples(prepared)]


def read_prepared_samples(prepared: str) -> list[tuple[bytes, int]]:
    import tarfile

    samples = []
    for path in shard_paths(prepared):
        members: dict[str, dict[str, bytes]] = {}
        with tarfile.open(path) as tar:
            for info in tar:
                if not info.isfile():
                    continue
                key, _, extension = os.path.basename(info.name).partition(".")
                handle = tar.extractfile(info)
                assert handle is not None
                members.setdefault(key, {})[extension] = handle.read()
        for parts in members.values():
            if "jpg" in parts:
                samples.append((parts["jpg"], int(parts.get("cls", b"-1"))))
    return samples


def run_in_threads(blobs: list[bytes], threads: int, work: Callable[[int, list[bytes]], None]) -> float:
    """Seconds for `threads` threads to run work(part, blobs[part::threads]) at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(abs, range(threads)))  # the threads exist before the clock starts
        start = time.perf_counter()
        list(pool.map(lambda part: work(part, blobs[part::threads]), range(threads)))
        return time.perf_counter() - start


def ceiling_candidates() -> dict[str, Callable[[int, list[bytes]], None]]:
    """decode_into with each JPEG decoder present, like the loader's workers run it."""
    import numpy as np

    from pipeline.crops import CropSpec, decode_into, simplejpeg

    decoders = (["simplejpeg"] if simplejpeg is not None else []) + ["pil"]
    candidates = {}
    for decoder in decoders:
        spec = CropSpec(CROP, True, SCALE, RATIO, decoder=decoder)

        def work(part: int, blobs: list[bytes], spec: CropSpec = spec) -> None:
            batch = np.empty((BATCH, CROP, CROP, 3), np.uint8)
            for index, data in enumerate(blobs):
                decode_into(batch[index % BATCH], "jpg", data, spec, seed=(part << 32) | index)

        candidates[f"decode_into ({decoder})"] = work
    return candidates


def run_ceiling(blobs: list[bytes], threads: int) -> Run:
    """The fastest decode_into path in `threads` threads; also each path in one thread."""
    rates, single = {}, {}
    for name, work in ceiling_candidates().items():
        work(0, blobs[:BATCH])  # warm the code path
        rates[name] = len(blobs) / run_in_threads(blobs, threads, work)
        single[name] = len(blobs) / run_in_threads(blobs, 1, work)
    fastest = max(rates, key=rates.__getitem__)
    detail = {
        "fastest": fastest,
        "images_per_s": {k: round(v, 1) for k, v in rates.items()},
        "one_thread_images_per_s": {k: round(v, 1) for k, v in single.items()},
    }
    return Run(len(blobs), len(blobs) / rates[fastest], detail)


def run_simplejpeg(blobs: list[bytes], threads: int) -> Run:
    import simplejpeg

    def work(part: int, chunk: list[bytes]) -> None:
        for data in chunk:
            simplejpeg.decode_jpeg(data, colorspace="RGB")

    work(0, blobs[:BATCH])
    return Run(len(blobs), run_in_threads(blobs, threads, work))


# ---------------------------------------------------------------------------
# FFCV (runs in .venv-ffcv: stdlib + common + ffcv only, no gpufeed)


def beton_path(data: str, prepared: str) -> str:
    """A .beton per prepared dataset: named after its shards' sha256."""
    with open(os.path.join(prepared, "manifest.json")) as handle:
        shards = json.load(handle)["shards"]
    digest = hashlib.sha256("".join(shard["sha256"] for shard in shards).encode()).hexdigest()[:12]
    return os.path.join(data, "ffcv", f"prepared-{digest}.beton")


def write_beton(prepared: str, path: str, workers: int) -> dict[str, Any]:
    """The prepared samples into a .beton: RGBImageField holding the same JPEG bytes, IntField labels.

    RGBImageField.encode re-encodes pixels with OpenCV; this field's encode
    stores the shard's JPEG bytes as they are (mode 'jpg'), so FFCV decodes
    exactly what gpufeed and WebDataset decode.
    """
    import types

    import numpy as np
    from ffcv.fields import IntField, RGBImageField
    from ffcv.fields.rgb_image import IMAGE_MODES
    from ffcv.writer import DatasetWriter
    from PIL import Image

    def encode_jpeg_bytes(self: Any, destination: Any, data: bytes, malloc: Any) -> None:
        with Image.open(io.BytesIO(data)) as img:
            if img.format != "JPEG" or img.mode != "RGB":
                raise ValueError(f"expected an RGB JPEG, got {img.format} {img.mode}")
            width, height = img.size
        destination["mode"] = IMAGE_MODES["jpg"]
        destination["height"], destination["width"] = height, width
        destination["data_ptr"], storage = malloc(len(data))
        storage[:] = np.frombuffer(data, np.uint8)

    samples = read_prepared_samples(prepared)
    image_field = RGBImageField(write_mode="jpg")
    image_field.encode = types.MethodType(encode_jpeg_bytes, image_field)  # type: ignore[method-assign]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path + ".partial"
    start = time.perf_counter()
    writer = DatasetWriter(partial, {"image": image_field, "label": IntField()}, num_workers=workers)
    writer.from_indexed_dataset(samples, chunksize=100)
    os.replace(partial, path)
    return {"samples": len(samples), "write_s": round(time.perf_counter() - start, 2), "bytes": os.path.getsize(path)}


def run_ffcv_row(prepared: str, beton: str, workers: int) -> dict[str, Any]:
    """Warm-up epoch (JIT), then one timed epoch; returns what the parent needs."""
    written = None
    if not os.path.exists(beton):
        written = write_beton(prepared, beton, workers)
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import Squeeze, ToTensor

    common.warm_page_cache([beton])
    loader = Loader(
        beton,
        batch_size=BATCH,
        num_workers=workers,
        order=OrderOption.RANDOM,
        os_cache=True,
        drop_last=False,
        pipelines={
            "image": [RandomResizedCropRGBImageDecoder((CROP, CROP), scale=SCALE, ratio=RATIO), ToTensor()],
            "label": [IntDecoder(), ToTensor(), Squeeze()],
        },
    )
    start = time.perf_counter()
    warm_images, _, _ = time_epoch(loader)
    warmup_s = time.perf_counter() - start
    with common.NoiseMeter() as noise:
        images, seconds, first = time_epoch(loader)
    if images != warm_images:
        raise RuntimeError(f"FFCV delivered {images} images, then {warm_images}")
    return {
        "images": images,
        "seconds": seconds,
        "noise": noise.share,
        "detail": {"first_batch_s": round(first, 4), "warmup_epoch_s": round(warmup_s, 2), "beton": os.path.basename(beton)}
        | ({"written": written} if written else {}),
    }


def ffcv_versions() -> dict[str, Any]:
    import numba
    import numpy

    return {
        "python": sys.version.split()[0],
        "ffcv": common.dist_version("ffcv"),
        "numba": numba.__version__,
        "numpy": numpy.__version__,
        "opencv": common.dist_version("opencv-python", "opencv-python-headless"),
        "torch": common.dist_version("torch"),
    }


def run_ffcv_subprocess(python: str, data: str, prepared: str, workers: int) -> Run:
    command = [python, os.path.abspath(__file__), "--row", "ffcv", "--data", data, "--workers", str(workers)]
    answer = _run_json(command)
    return Run(answer["images"], answer["seconds"], answer["detail"], answer["noise"])


def _run_json(command: list[str]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH="")
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{os.path.basename(command[0])} {' '.join(command[2:4])} failed: {tail}")
    data: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return data


def ffcv_status(python: str) -> dict[str, Any] | None:
    if not os.path.exists(python):
        return None
    try:
        return _run_json([python, os.path.abspath(__file__), "--row", "versions"])
    except (RuntimeError, ValueError, IndexError) as exc:
        return {"error": str(exc)}


# ---------------------------------------------------------------------------
# Data


def ensure_data(data: str, n: int) -> tuple[str, str]:
    """DATA/raw (n demo JPEGs) and DATA/prepared (256 px shards), made with the CLI once and cached."""
    raw, prepared = os.path.join(data, "raw"), os.path.join(data, "prepared")
    marker = os.path.join(raw, DATA_MARKER)
    found = len(common.list_jpegs(raw)) if os.path.isdir(raw) else 0
    if found < n:
        if found and not os.path.exists(marker):
            raise SystemExit(f"{raw} holds {found} JPEGs (fewer than --n {n}) that this benchmark did not generate")
        _gpufeed_cli("demo-data", raw, "--n", str(n), "--min-side", str(DEMO_SIDES[0]), "--max-side", str(DEMO_SIDES[1]))
        with open(marker, "w") as handle:
            json.dump({"n": n, "min_side": DEMO_SIDES[0], "max_side": DEMO_SIDES[1]}, handle)
        common.fresh_dir(prepared)
    found = len(common.list_jpegs(raw))
    if _prepared_samples(prepared) != found:
        common.fresh_dir(prepared)
        _gpufeed_cli("prepare", raw, prepared, "--size", str(SIZE), "--shard-count", str(SHARD_COUNT), "--quiet")
    return raw, prepared


def _prepared_samples(prepared: str) -> int | None:
    try:
        with open(os.path.join(prepared, "manifest.json")) as handle:
            manifest = json.load(handle)
    except (OSError, ValueError):
        return None
    params = manifest.get("params", {})
    if params.get("resize", {}).get("size") != SIZE or params.get("encode", {}).get("format") != "jpeg":
        return None
    return int(manifest["samples"])


def _gpufeed_cli(*args: str) -> None:
    print(f"$ gpufeed {' '.join(args)}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pipeline", *args], check=True)


def describe_data(raw: str, blobs: list[bytes]) -> dict[str, Any]:
    from PIL import Image

    paths = [path for path, _ in common.list_jpegs(raw)]
    pixels = 0
    for path in paths:
        with Image.open(path) as opened:
            pixels += opened.width * opened.height
    sizes = []
    for data in blobs[:200]:
        with Image.open(io.BytesIO(data)) as opened:
            sizes.append(opened.size)
    return {
        "raw_images": len(paths),
        "raw_mean_megapixels": round(pixels / len(paths) / 1e6, 3),
        "raw_mean_kb": round(sum(os.path.getsize(p) for p in paths) / len(paths) / 1e3, 1),
        "prepared_images": len(blobs),
        "prepared_mean_kb": round(sum(map(len, blobs)) / len(blobs) / 1e3, 1),
        "prepared_mean_size": [round(sum(s[i] for s in sizes) / len(sizes)) for i in (0, 1)],
    }


def local_versions() -> dict[str, Any]:
    import PIL
    import torch
    from PIL import features

    simd = common.dist_version("Pillow-SIMD", "pillow-simd")
    return {
        "python": sys.version.split()[0],
        "pil": f"Pillow-SIMD {simd}" if simd else f"Pillow {PIL.__version__}",
        "libjpeg_turbo": features.version("libjpeg_turbo") if features.check_feature("libjpeg_turbo") else None,
        "simplejpeg": common.dist_version("simplejpeg"),
        "webdataset": common.dist_version("webdataset"),
        "torch": torch.__version__,
        "transform": make_transform()[1],
        "gpufeed": common.dist_version("gpufeed"),
    }


# ---------------------------------------------------------------------------
# Report


def headline(rows: dict[str, Row]) -> str:
    """The faster of gpufeed's two worker designs."""
    rates = {name: rows[name].best.images_per_s for name in ("gpufeed-thread", "gpufeed-process") if rows[name].best}
    return max(rates, key=rates.__getitem__)


def speedups(rows: dict[str, Row], best: str) -> dict[str, float | None]:
    def rate(name: str) -> float | None:
        run = rows[name].best
        return run.images_per_s if run is not None else None

    gpufeed = rate(best)

    def ratio(name: str) -> float | None:
        other = rate(name)
        return gpufeed / other if gpufeed and other else None

    return {
        "vs_webdataset": ratio("webdataset"),
        "vs_imagefolder": ratio("imagefolder"),
        "vs_ffcv": ratio("ffcv"),
        "of_ceiling": ratio("ceiling"),
    }


def _run_text(run: Run) -> str:
    noise = "" if run.noise is None else f" ({run.noise:.0%})"
    return f"{run.images_per_s:.1f}{noise}"


def print_report(
    header: dict[str, Any], rows: dict[str, Row], best: str, ratios: dict[str, float | None], stall: StallResult | None
) -> None:
    data, local, ffcv = header["data"], header["versions"], header["ffcv"]
    print(
        f"gpufeed loader benchmark: one epoch of {data['prepared_images']} images "
        f"({data['prepared_mean_size'][0]}x{data['prepared_mean_size'][1]} px mean, {data['prepared_mean_kb']:.0f} KB JPEG; "
        f"raw {data['raw_mean_megapixels']:.2f} MP, {data['raw_mean_kb']:.0f} KB), batch {BATCH}, "
        f"RandomResizedCrop {CROP}, {header['workers']} workers, CPU"
    )
    print(
        f"page cache warm, warm-up before every timed epoch, best of {header['rounds']} alternating rounds; "
        f"{header['cpus']} CPUs"
    )
    print(
        f"PIL: {local['pil']}, libjpeg-turbo {local['libjpeg_turbo']} | simplejpeg {local['simplejpeg']} | "
        f"webdataset {local['webdataset']} | torch {local['torch']} | transforms: {local['transform']}"
    )
    if ffcv is None:
        print("ffcv: not installed (no .venv-ffcv; run benchmarks/setup_ffcv.sh)")
    elif "error" in ffcv:
        print(f"ffcv: .venv-ffcv unusable: {ffcv['error']}")
    else:
        print(
            f"ffcv {ffcv['ffcv']}, numba {ffcv['numba']}, numpy {ffcv['numpy']}, opencv {ffcv['opencv']}, "
            f"torch {ffcv['torch']} (.venv-ffcv, Python {ffcv['python']})"
        )
    print(f"{'':42} {'images/s':>9} {'seconds':>8}  runs: images/s (CPU share other processes took)")
    for name, row in rows.items():
        title = ROW_TITLES[name] + (" *" if name == best else "")
        run = row.best
        if run is None:
            print(f"{title:42} {row.skipped or 'no run'}")
            continue
        runs = ", ".join(_run_text(r) for r in row.runs)
        print(f"{title:42} {run.images_per_s:9.1f} {run.seconds:8.2f}  {runs}")
        if name.startswith("gpufeed"):
            stats = run.detail["stats"]
            print(
                f"{'':4}first batch after {run.detail['first_batch_s']:.2f} s; loader.stats: "
                f"waited {stats['wait_s']:.2f} s, stall fraction {stats['stall_fraction']:.1%} (consumer does nothing)"
            )
        if name == "ceiling":
            d = run.detail
            paths = "; ".join(f"{k} {v:.0f}" for k, v in d["images_per_s"].items())
            one = "; ".join(f"{k} {v:.0f}" for k, v in d["one_thread_images_per_s"].items())
            print(f"{'':4}fastest: {d['fastest']}; {header['workers']} threads: {paths}; 1 thread: {one}")
        if name == "ffcv":
            d = run.detail
            print(f"{'':4}JIT warm-up epoch {d['warmup_epoch_s']:.1f} s (not timed)")
    print(f"(* = headline gpufeed row, the faster worker design)")
    if stall is not None:
        s = stall.stats
        print(
            f"stall run ({best}): consumer at {STALL_CONSUMER:.0%} of {stall.consumer_images_per_s / STALL_CONSUMER:.0f} "
            f"= {stall.consumer_images_per_s:.0f} images/s (sleep {stall.sleep_per_batch_s * 1e3:.1f} ms per batch): "
            f"loader.stats.stall_fraction = {s['stall_fraction']:.2%} "
            f"(waited {s['wait_s']:.2f} s of {s['wait_s'] + s['step_s']:.2f} s; {stall.first_batch_wait_s:.2f} s of it "
            f"for the first batch; after it {stall.steady_stall_fraction:.2%})"
        )
    marks = []
    for key, goal in TARGETS.items():
        value = ratios[key]
        shown = f">= {goal:.0%} of ceiling" if key == "of_ceiling" else f">= {goal}x {key[3:]}"
        state = "n/a" if value is None else ("met" if value >= goal else "MISSED")
        marks.append(f"{shown}: {state}")
    if stall is not None:
        met = stall.stats["stall_fraction"] < STALL_TARGET
        marks.append(f"stall < {STALL_TARGET:.0%}: {'met' if met else 'MISSED'}")
    print("targets: " + "; ".join(marks))

    def times(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}x"

    ceiling = "n/a" if ratios["of_ceiling"] is None else f"{ratios['of_ceiling']:.0%}"
    print(
        f"loader speedup: {times(ratios['vs_webdataset'])} vs webdataset, {times(ratios['vs_imagefolder'])} vs "
        f"imagefolder-raw, {times(ratios['vs_ffcv'])} vs ffcv, {ceiling} of decode ceiling"
    )


# ---------------------------------------------------------------------------
# Entry points


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=DEFAULT_DATA, help="cache folder for the demo JPEGs, the shards and the .beton")
    parser.add_argument("--n", type=int, default=2000, help="demo images (default 2000)")
    parser.add_argument("--workers", type=int, default=2, help="workers (threads/processes) in every row (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per row, alternating; the best counts (default 2)")
    parser.add_argument("--ffcv-venv", default=DEFAULT_FFCV_VENV, help="venv made by benchmarks/setup_ffcv.sh")
    parser.add_argument("--rows", default=",".join(ROW_TITLES), help="comma-separated subset of: " + ", ".join(ROW_TITLES))
    parser.add_argument("--no-stall", action="store_true", help="skip the stall run")
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--row", choices=["ffcv", "versions"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.workers < 1 or args.n < 1:
        parser.error("--rounds, --workers and --n must be at least 1")
    unknown = set(args.rows.split(",")) - set(ROW_TITLES)
    if unknown:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
    return args


def run_single_row(args: argparse.Namespace) -> int:
    """`--row NAME`: what .venv-ffcv's python runs; one JSON line on stdout."""
    if args.row == "versions":
        common.print_json_line(ffcv_versions())
        return 0
    data = os.path.abspath(args.data)
    prepared = os.path.join(data, "prepared")
    common.print_json_line(run_ffcv_row(prepared, beton_path(data, prepared), args.workers))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.row:
        return run_single_row(args)
    data = os.path.abspath(args.data)
    raw, prepared = ensure_data(data, args.n)
    blobs = read_prepared_jpegs(prepared)
    if len(blobs) < 2000:
        print(f"warning: {len(blobs)} images; the issue asks for at least 2,000", file=sys.stderr)
    if args.rounds < 2:
        print("warning: --rounds 1 gives no protection against noise", file=sys.stderr)
    python = os.path.join(os.path.abspath(args.ffcv_venv), "bin", "python")
    header = {
        "data": describe_data(raw, blobs) | {"path": data},
        "workers": args.workers,
        "cpus": common.available_processes(),
        "rounds": args.rounds,
        "batch": BATCH,
        "crop": CROP,
        "versions": local_versions(),
        "ffcv": ffcv_status(python),
    }
    selected = args.rows.split(",")
    rows = {name: Row(name) for name in ROW_TITLES if name in selected}
    if "ffcv" in rows and (header["ffcv"] is None or "error" in header["ffcv"]):
        rows["ffcv"].skipped = FFCV_SKIPPED if header["ffcv"] is None else f"skipped ({header['ffcv']['error']})"
    workers = args.workers
    runners: dict[str, Callable[[], Run]] = {
        "gpufeed-thread": lambda: run_gpufeed(prepared, "thread", workers),
        "gpufeed-process": lambda: run_gpufeed(prepared, "process", workers),
        "webdataset": lambda: run_dataloader(make_webdataset_loader(prepared, workers)),
        "imagefolder": lambda: run_dataloader(make_imagefolder_loader(raw, workers)),
        "ffcv": lambda: run_ffcv_subprocess(python, data, prepared, workers),
        "ceiling": lambda: run_ceiling(blobs, workers),
        "simplejpeg": lambda: run_simplejpeg(blobs, workers),
    }
    files = shard_paths(prepared) + [path for path, _ in common.list_jpegs(raw)]
    for round_index in range(args.rounds):
        order = list(rows) if round_index % 2 == 0 else list(rows)[::-1]
        for name in order:
            if rows[name].skipped:
                continue
            common.warm_page_cache(files)
            try:
                with common.NoiseMeter() as noise:
                    run = runners[name]()
            except RuntimeError as exc:
                rows[name].skipped = f"failed: {exc}"
                print(f"round {round_index + 1}: {ROW_TITLES[name]}: {rows[name].skipped}", file=sys.stderr)
                continue
            if run.noise is None:  # the FFCV row measures its own timed epoch
                run.noise = noise.share
            rows[name].runs.append(run)
            print(f"round {round_index + 1}: {ROW_TITLES[name]:42} {_run_text(run)}", file=sys.stderr)
    gpufeed_rows = [name for name in ("gpufeed-thread", "gpufeed-process") if name in rows and rows[name].best]
    if not gpufeed_rows:
        raise SystemExit("no gpufeed row ran")
    for name in ("gpufeed-thread", "gpufeed-process", "webdataset", "imagefolder", "ffcv", "ceiling"):
        rows.setdefault(name, Row(name, skipped="not selected (--rows)"))
    best = headline(rows)
    ratios = speedups(rows, best)
    stall = None
    if not args.no_stall:
        rate = rows[best].best.images_per_s  # type: ignore[union-attr]
        stall = run_stall(prepared, best.split("-")[1], workers, rate)
    print_report(header, rows, best, ratios, stall)
    if args.json:
        report = {
            **header,
            "rows": {name: row.to_dict() for name, row in rows.items()},
            "headline": best,
            "speedup": {k: (round(v, 4) if v is not None else None) for k, v in ratios.items()},
            "stall": dataclasses.asdict(stall) if stall else None,
            "targets": TARGETS | {"stall_fraction_below": STALL_TARGET},
            "targets_met": {k: (v is not None and v >= TARGETS[k]) for k, v in ratios.items()}
            | ({"stall": stall.stats["stall_fraction"] < STALL_TARGET} if stall else {}),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")
    missed = any(v is None or v < TARGETS[k] for k, v in ratios.items())
    missed = missed or (stall is not None and stall.stats["stall_fraction"] >= STALL_TARGET)
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
