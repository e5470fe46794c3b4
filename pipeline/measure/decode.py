"""`gpufeed bench decode SRC`: how fast one core decodes (and resizes) the images, raw vs prepared.

A sample of SRC is read into memory; a prepared copy of it is made in memory
the way `gpufeed prepare` would (shorter side `size`, JPEG at `quality`, and
raw uint8 `.npy`). Each decoder present then decodes every image and resizes
it to the training input (`target`, shorter side), in one thread, looping
over the sample for at least `min_seconds`: images/s per core, the rate of
the fastest pass over the sample (another process taking the core for a
moment only ever slows a pass down). Multiply by the cores a loader gets
for its decode ceiling.

Decoders (`DECODERS` names them as `--decoder` takes them): the loader's own
region decoder (gpufeed's libjpeg-turbo decoder: only the blocks of a
random-resized crop, DCT-scaled, resized straight to target x target, which
is what the loader does for every training sample), PIL (full decode), PIL
with draft mode (DCT-domain downscale), simplejpeg (libjpeg-turbo,
DCT-scaled), PyTurboJPEG and OpenCV (reduced decode) when installed, and
`.npy` (no decode) for the prepared copy.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..decode import decode_image, open_image, pil_image
from ..errors import ConfigError, DecodeError
from ..io.fs import local_path, open_fs, read_source_bytes
from ..prepare.encode import encode_image
from ..prepare.sample.targets import read_tar_member, tar_range
from ..prepare.sources import SourceItem, list_images
from ..prepare.transforms import required_scale, resize_image
from ..specs import AugmentSpec, EncodeSpec, ResizeSpec
from ..targets import TargetError
from ..units import format_count

MAX_FILE_BYTES = 512 * 1024 * 1024


@dataclasses.dataclass
class DecoderRow:
    """One decoder on the raw and the prepared sample (None: not applicable).

    Both figures cover the same `images` of the sample: the raw files this
    decoder reads, and the prepared copies of just those.
    """

    decoder: str
    raw_images_per_s: float | None
    prepared_images_per_s: float | None
    note: str = ""
    images: int = 0

    @property
    def speedup(self) -> float | None:
        if self.raw_images_per_s and self.prepared_images_per_s:
            return self.prepared_images_per_s / self.raw_images_per_s
        return None


@dataclasses.dataclass
class DecodeBenchResult:
    """Per-core decode (+ resize to `target`) speed, raw vs prepared, for each decoder.

    Attributes:
        source: the dataset sampled.
        samples: images in the sample (that decoded).
        target: shorter side every decode is resized to (the training input).
        prepared_size: the prepared copy's shorter side.
        quality: JPEG quality of the prepared copy.
        raw_mean_bytes, raw_mean_pixels: the raw sample's means.
        prepared_mean_bytes: mean bytes of the prepared JPEG copy.
        npy_mean_bytes: mean bytes of the prepared `.npy` copy.
        rows: one per decoder.
    """

    source: str
    samples: int
    target: int
    prepared_size: int
    quality: int
    raw_mean_bytes: float
    raw_mean_pixels: float
    prepared_mean_bytes: float
    prepared_mean_pixels: float
    npy_mean_bytes: float
    rows: list[DecoderRow]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for row, out in zip(self.rows, data["rows"]):
            out["speedup"] = row.speedup
        return data


# ---------------------------------------------------------------------------
# Samples


def sample_sources(source: str, count: int, seed: int = 0, split: str | None = None) -> tuple[list[SourceItem], int]:
    """An even random sample of `count` images of `source` (reservoir: one pass, flat memory).

    Only what prepare would take is sampled: an image the listing already
    rejects (beside class folders) is left out, and not counted. `split`: a
    YOLO dataset's split, as prepare's.

    Returns:
        (sampled items in listing order, number of images listed that prepare would take).

    Raises:
        SourceError: the source cannot be listed.
        ConfigError: it holds no images.
    """
    rng = random.Random(seed)
    chosen: list[tuple[int, SourceItem]] = []
    listed = 0
    for index, item in enumerate(item for item in list_images(source, split=split) if not item.rejected):
        listed += 1
        if len(chosen) < count:
            chosen.append((index, item))
        else:
            slot = rng.randrange(index + 1)
            if slot < count:
                chosen[slot] = (index, item)
    if not chosen:
        raise ConfigError(f"{source} holds no images")
    return [item for _, item in sorted(chosen, key=lambda pair: pair[0])], listed


def item_bytes(item: SourceItem, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The image bytes of a listed item: its file, or its member's byte range where it sits in a tar
    (a WebDataset shard as the source: `targets["tar"]`), never the whole tar.

    Raises:
        OSError: it cannot be read.
        ValueError: it is over `max_bytes`, or its tar range is malformed.
    """
    tar = item.targets.get("tar") if isinstance(item.targets, dict) else None
    if tar is None:
        return read_source_bytes(item.url, max_bytes)
    try:
        offset, size = tar_range(tar, max_bytes)
    except TargetError as exc:
        raise ValueError(str(exc)) from None
    return read_tar_member(item.url, offset, size)


def item_size(item: SourceItem) -> int:
    """The image bytes of a listed item without reading them: its file's size, or its tar member's.

    Raises:
        OSError: the file's size cannot be read.
    """
    tar = item.targets.get("tar") if isinstance(item.targets, dict) else None
    if isinstance(tar, dict) and isinstance(tar.get("size"), int):
        return int(tar["size"])
    local = local_path(item.url)
    if local is not None:
        return os.path.getsize(local)
    fs, inner = open_fs(item.url)
    return int(fs.size(inner))


def read_sample(items: list[SourceItem]) -> list[bytes]:
    """The bytes of each item that can be read (unreadable files are left out)."""
    blobs = []
    for item in items:
        try:
            blobs.append(item_bytes(item))
        except (OSError, ValueError):
            continue
    return blobs


def usable_sample(
    source: str, count: int, seed: int = 0, split: str | None = None
) -> tuple[list[SourceItem], list[bytes], int]:
    """`sample_sources`, then only the images prepare accepts: readable, and decoding in full.

    Returns:
        (items, their bytes, number of images listed that prepare would take); a
        sampled file prepare would reject is left out, so fewer than `count` may come back.
    """
    items, listed = sample_sources(source, count, seed, split)
    kept, blobs = [], []
    for item in items:
        try:
            data = item_bytes(item)
            decode_image(data, scale_for=lambda w, h: 0.125)  # every byte decoded, DCT-scaled: cheap
        except (OSError, ValueError, DecodeError):
            continue
        kept.append(item)
        blobs.append(data)
    return kept, blobs, listed


def prepare_in_memory(blobs: list[bytes], size: int, encode: EncodeSpec) -> list[bytes]:
    """What `gpufeed prepare --size SIZE` stores for each decodable blob (shorter side, no variants)."""
    resize = ResizeSpec(size=size)
    out = []
    for data in blobs:
        try:
            decoded = decode_image(data, scale_for=lambda w, h: required_scale(resize, AugmentSpec(), w, h))
        except DecodeError:
            continue
        image, _ = resize_image(decoded.image, decoded.original_size, resize, orientation=decoded.orientation)
        out.append(encode_image(image, encode))
    return out


# ---------------------------------------------------------------------------
# Decoders: bytes -> RGB array (or PIL image) already resized to `target`

Decoder = Callable[[bytes, int], Any]


def _target_size(width: int, height: int, target: int) -> tuple[int, int]:
    scale = target / min(width, height)
    if scale >= 1:
        return width, height
    return max(1, round(width * scale)), max(1, round(height * scale))


def _pil_resize(img: Any, full: tuple[int, int], target: int) -> Any:
    Image = pil_image()
    size = _target_size(*full, target)
    if img.mode != "RGB":
        img = img.convert("RGB")
    return img if img.size == size else img.resize(size, Image.Resampling.BILINEAR)


def decode_pil(data: bytes, target: int) -> Any:
    img = open_image(data)
    img.load()
    return _pil_resize(img, img.size, target)


def decode_pil_draft(data: bytes, target: int) -> Any:
    img = open_image(data)
    full = img.size
    if img.format == "JPEG":
        out = _target_size(full[0], full[1], target)
        img.draft("RGB", out)
    img.load()
    return _pil_resize(img, full, target)


def _decode_simplejpeg(data: bytes, target: int) -> Any:
    import simplejpeg

    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    out_w, out_h = _target_size(width, height, target)
    array = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=out_w, min_height=out_h)
    return _pil_resize(pil_image().fromarray(array), (width, height), target)


def _turbojpeg_decoder() -> Decoder:
    import turbojpeg

    jpeg = turbojpeg.TurboJPEG()
    factors = sorted(jpeg.scaling_factors, key=lambda f: f[0] / f[1])

    def decode(data: bytes, target: int) -> Any:
        width, height, _, _ = jpeg.decode_header(data)
        out_w, out_h = _target_size(width, height, target)
        factor = next(
            (f for f in factors if math.ceil(width * f[0] / f[1]) >= out_w and math.ceil(height * f[0] / f[1]) >= out_h),
            (1, 1),
        )
        array = jpeg.decode(data, pixel_format=turbojpeg.TJPF_RGB, scaling_factor=factor)
        return _pil_resize(pil_image().fromarray(array), (width, height), target)

    return decode


def _opencv_decoder() -> Decoder:
    import cv2

    reduced = ((8, cv2.IMREAD_REDUCED_COLOR_8), (4, cv2.IMREAD_REDUCED_COLOR_4), (2, cv2.IMREAD_REDUCED_COLOR_2))

    def decode(data: bytes, target: int) -> Any:
        header = open_image(data)  # sizes from the header; OpenCV has no header-only call
        width, height = header.size
        out_w, out_h = _target_size(width, height, target)
        flag = next((f for d, f in reduced if width // d >= out_w and height // d >= out_h), cv2.IMREAD_COLOR)
        array = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
        if array is None:
            raise DecodeError("OpenCV cannot decode this file")
        array = cv2.cvtColor(array, cv2.COLOR_BGR2RGB)
        if (array.shape[1], array.shape[0]) != (out_w, out_h):
            array = cv2.resize(array, (out_w, out_h), interpolation=cv2.INTER_AREA)
        return array

    return decode


def decode_npy(data: bytes, target: int) -> Any:
    array = np.load(io.BytesIO(data), allow_pickle=False)
    height, width = array.shape[:2]
    return _pil_resize(pil_image().fromarray(array), (width, height), target)


def _region_decoder() -> Decoder:
    """The loader's JPEG path: a random-resized crop decoded block by block, into a target x target slot."""
    from .. import native
    from ..loader.cpu_decode import decode_into
    from ..loader.crops import CropSpec

    if native.library(warn=False) is None:
        raise ImportError(native.problem() or "gpufeed's native library is missing")
    specs: dict[int, CropSpec] = {}
    draws = iter(range(1 << 62))  # a new crop each call, as in training

    def decode(data: bytes, target: int) -> Any:
        spec = specs.setdefault(target, CropSpec(size=target, train=True, decoder="region"))
        slot = np.empty((3, target, target), np.uint8)
        decode_into(slot, "jpg", data, spec, next(draws))
        return slot

    return decode


# `--decoder NAME` -> the name rows carry; the order of the table.
DECODERS = {
    "region": "region",
    "pil": "PIL",
    "pil-draft": "PIL + draft",
    "simplejpeg": "simplejpeg",
    "pyturbojpeg": "PyTurboJPEG",
    "opencv": "OpenCV",
}
_FACTORIES: dict[str, Callable[[], Decoder]] = {"region": _region_decoder, "PyTurboJPEG": _turbojpeg_decoder, "OpenCV": _opencv_decoder}


def decoder_name(text: str) -> str:
    """The row name of a decoder given as `--decoder` takes it (`pil-draft`) or as rows name it (`PIL + draft`).

    Raises:
        ConfigError: no such decoder.
    """
    wanted = text.strip().lower()
    for option, name in DECODERS.items():
        if wanted in (option, name.lower()):
            return name
    raise ConfigError(f"unknown decoder {text!r}; choose from {', '.join(DECODERS)}")


def available_decoders() -> dict[str, Decoder]:
    """The JPEG-capable decoders that work here, by row name, in `DECODERS` order (PIL always)."""
    decoders: dict[str, Decoder] = {}
    for name in DECODERS.values():
        if name == "PIL":
            decoders[name] = decode_pil
        elif name == "PIL + draft":
            decoders[name] = decode_pil_draft
        elif name == "simplejpeg":
            try:
                import simplejpeg  # noqa: F401
            except ImportError:
                continue
            decoders[name] = _decode_simplejpeg
        else:
            try:
                decoders[name] = _FACTORIES[name]()
            except Exception:  # not installed, or its native library is missing
                continue
    return decoders


JPEG_ONLY = frozenset({"region", "simplejpeg", "PyTurboJPEG"})
NOTES = {"region": "the loader's: random-resized crop, only its blocks decoded"}


# ---------------------------------------------------------------------------
# The benchmark


def time_per_core(decoder: Decoder, blobs: list[bytes], target: int, min_seconds: float) -> float | None:
    """Images/s of `decoder` over `blobs` in this one thread: its fastest pass over them, passes repeated
    for at least `min_seconds`."""
    usable = []
    for data in blobs:  # one untimed pass: drops files this decoder cannot read, warms caches
        try:
            decoder(data, target)
            usable.append(data)
        except Exception:
            continue
    if not usable:
        return None
    started = time.perf_counter()
    fastest = 0.0
    while True:
        begun = time.perf_counter()
        for data in usable:
            decoder(data, target)
        now = time.perf_counter()
        fastest = max(fastest, len(usable) / max(now - begun, 1e-9))
        if now - started >= min_seconds:
            return fastest


def benchmark_decode(
    source: str,
    *,
    sample: int = 32,
    target: int = 224,
    size: int = 256,
    quality: int = 90,
    min_seconds: float = 0.5,
    decoders: list[str] | None = None,
    seed: int = 0,
) -> DecodeBenchResult:
    """Measure per-core decode + resize speed on a sample of `source`, raw and prepared.

    Args:
        source: a folder, CSV/JSONL list or URL of raw images.
        sample: images to sample.
        target: shorter side each decoded image is resized to (the region decoder: the crop's side).
        size: shorter side of the prepared copy (what `gpufeed prepare --size` writes).
        quality: JPEG quality of the prepared copy.
        min_seconds: minimum timed seconds per decoder and sample.
        decoders: names to run, as `DECODERS` or the rows name them (default: every one available).
        seed: seed of the sample.

    Returns:
        A DecodeBenchResult with one row per decoder.

    Raises:
        ConfigError: no decodable images, or an unknown decoder name.
        SourceError: the source cannot be listed.
    """
    started = time.perf_counter()
    if sample < 1 or target < 8 or size < 8:
        raise ConfigError("sample must be at least 1 and sizes at least 8 pixels")
    _, raw, _ = usable_sample(source, sample, seed)
    if not raw:
        raise ConfigError(f"no decodable images in the sample of {source}")
    prepared = prepare_in_memory(raw, size, EncodeSpec(format="jpeg", quality=quality))
    npy = prepare_in_memory(raw, size, EncodeSpec(format="npy"))
    if not len(raw) == len(prepared) == len(npy):  # usable_sample kept what decodes, so each has its copy
        raise ConfigError(f"the sample of {source} did not prepare as it decoded")
    available = available_decoders()
    chosen = [decoder_name(name) for name in decoders] if decoders else list(available)
    missing = [name for name in chosen if name not in available]
    if missing:
        have = ", ".join(option for option, name in DECODERS.items() if name in available)
        raise ConfigError(f"decoder(s) not available here: {', '.join(missing)} (have: {have})")
    rows = []
    for name in chosen:
        # Raw and prepared over the same images: a decoder that reads only the JPEGs of a mixed sample is
        # timed on the prepared copies of those JPEGs, not on every prepared image against some raw ones.
        readable = _readable(available[name], raw, target)
        only = f"JPEG files only: {len(readable)} of {format_count(len(raw), 'image')}" if len(readable) < len(raw) else ""
        note = "; ".join(part for part in (NOTES.get(name, ""), only) if part)
        rows.append(
            DecoderRow(
                name,
                time_per_core(available[name], [raw[i] for i in readable], target, min_seconds),
                time_per_core(available[name], [prepared[i] for i in readable], target, min_seconds),
                note,
                len(readable),
            )
        )
    rows.append(
        DecoderRow("npy (no decode)", None, time_per_core(decode_npy, npy, target, min_seconds), "prepared --format npy", len(npy))
    )
    return DecodeBenchResult(
        source=source,
        samples=len(raw),
        target=target,
        prepared_size=size,
        quality=quality,
        raw_mean_bytes=float(np.mean([len(b) for b in raw])),
        raw_mean_pixels=float(np.mean([_pixels(b) for b in raw])),
        prepared_mean_bytes=float(np.mean([len(b) for b in prepared])) if prepared else 0.0,
        prepared_mean_pixels=float(np.mean([_pixels(b) for b in prepared])) if prepared else 0.0,
        npy_mean_bytes=float(np.mean([len(b) for b in npy])) if npy else 0.0,
        rows=rows,
        seconds=time.perf_counter() - started,
    )


def _readable(decoder: Decoder, blobs: list[bytes], target: int) -> list[int]:
    """The indices of the blobs `decoder` decodes (a JPEG-only decoder refuses the others)."""
    readable = []
    for index, data in enumerate(blobs):
        try:
            decoder(data, target)
        except Exception:
            continue
        readable.append(index)
    return readable


def _pixels(data: bytes) -> int:
    width, height = open_image(data).size
    return width * height
