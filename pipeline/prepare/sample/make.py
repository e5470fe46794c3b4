"""One source in, the tar members of its sample(s) out: read -> decode -> transform -> encode.

A JPEG that only needs a resize takes the YCbCr path (`transcode.py`: no RGB
in between, about twice as fast); everything else is decoded to RGB, resized
or augmented into its variant sets, and encoded. A file the YCbCr path
refuses (libjpeg warned or failed) is decoded by Pillow, whose verdict
decides: the rule is that a file is accepted exactly when Pillow can read it.
What the decoders warned about is kept in the sample's json
(`decode_warnings`). A bad image never raises: its outcome carries the
reason, and the job writes it to `rejected.jsonl`.

A source with targets (boxes, a mask, several labels, a caption, columns:
`SourceItem.targets`) has them checked first and sent through the image's
own geometry (`targets.py`), on either path: the YCbCr path turns
the picture upright by the header's EXIF orientation, and its resize is
`resize_geometry`'s. They become the sample's target members
(`pipeline.targets`); the sample's json then also records the geometry
and how many boxes fell out of the picture. A malformed target rejects
its sample like a bad image. COCO's polygons and RLE are painted into a
class-index mask of the stored size first (`coco_masks.py`) and then go
the way of a mask file. A sample without targets is written exactly as
before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import re
from typing import Any

import numpy as np

from ...decode import DecodedImage, decode_image, exif_orientation, open_image, pil_image
from ...errors import DecodeError, SourceError
from ...io.fs import read_source_bytes, redact_location
from ...io.tar import sample_tar_bytes
from ...specs import PrepareSpec
from ...targets import DEFAULT_IGNORE_INDEX, SampleTargets, TargetError, target_members
from ..encode import encode_image
from ..sources import SourceItem
from ..transcode import Transcoded, TranscodeRefused, transcode_jpeg
from ..transcode import applies as transcode_applies
from ..transforms import Geometry, augment_sample, required_scale, resize_geometry, resize_image, resize_op, variant_rng
from .coco_masks import instance_map, rasterise
from .targets import (
    SourceTargets,
    label_frame,
    parse_targets,
    place_targets,
    read_mask,
    read_tar_member,
    stored_size,
    tar_range,
)

_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def sample_key(rel: str) -> str:
    """A WebDataset key for a source path: readable, unique, no dots or slashes.

    The readable part is the path with every other character replaced; a
    64-bit hash of the exact path keeps `a.b.jpg`, `a_b.jpg` and `été.jpg`
    apart.

    Args:
        rel: the source's path relative to SRC (or its URL for a list).

    Returns:
        The key, at most 65 characters.
    """
    slug = _KEY_UNSAFE.sub("_", rel).strip("_")[:48] or "image"
    # surrogateescape: file names that are not valid UTF-8 still get a stable key.
    digest = hashlib.blake2b(rel.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()
    return f"{slug}-{digest}"


@dataclasses.dataclass
class SampleOutcome:
    """What became of one source: its tar bytes per variant set, or a reject reason.

    `warnings` lists what the decoders warned about in an accepted file (also
    in its samples' json as `decode_warnings`). `boxes_dropped` counts the
    boxes that fell (mostly) out of its pictures, over every variant set;
    `frames_unclear` is 1 where its annotation's declared size matched
    neither the stored nor the upright image (`targets.label_frame`).
    """

    index: int
    key: str
    source: str
    tars: list[bytes] | None = None
    reason: str = ""
    warnings: list[str] = dataclasses.field(default_factory=list)
    boxes_dropped: int = 0
    frames_unclear: int = 0


def read_item(item: SourceItem, spec: PrepareSpec) -> bytes | str:
    """The source's bytes, or the reason they cannot be read (a reject reason): missing, unreadable, over the
    input limit, not a regular file (a FIFO, a device), a URL of a scheme no filesystem serves.

    An image inside a tar (`targets["tar"]`, a WebDataset shard as SRC) is
    read as its byte range only.
    """
    try:
        tar = item.targets.get("tar") if isinstance(item.targets, dict) else None
        if tar is not None:
            return read_tar_member(item.url, *tar_range(tar, spec.max_file_bytes))
        return read_source_bytes(item.url, spec.max_file_bytes)
    except (TargetError, SourceError) as exc:  # SourceError: a URL of a scheme no filesystem serves
        return str(exc)
    except (OSError, ValueError) as exc:
        return f"cannot read file: {getattr(exc, 'strerror', None) or exc}"


def process_item(
    item: SourceItem,
    index: int,
    spec: PrepareSpec,
    classes: dict[str, int],
    fetched: bytes | str | None = None,
    ignore_index: int = DEFAULT_IGNORE_INDEX,
) -> SampleOutcome:
    """Turn one source file into the tar members of its sample(s).

    Args:
        item: the source.
        index: its listing index (carried to the outcome, for the shard writer).
        spec: the job's settings.
        classes: class name -> label index.
        fetched: what `read_item` gave for it already (read ahead on an I/O thread); None reads it now.
        ignore_index: a mask's value of no class: what padding and the outside
            of a rotated crop become (the listing's `ignore_index`).

    Returns:
        The outcome: one tar blob per variant set, or the reason the file was rejected.
        Never raises for a bad image or a bad annotation.
    """
    key = sample_key(item.rel)
    outcome = SampleOutcome(index, key, item.url)
    targets = None
    if item.targets is not None:
        try:  # before the read: a malformed annotation costs no download
            targets = parse_targets(item.targets, classes)
        except TargetError as exc:
            outcome.reason = str(exc)
            return outcome
    data = read_item(item, spec) if fetched is None else fetched
    if isinstance(data, str):
        outcome.reason = data
        return outcome
    label = classes.get(item.label) if item.label is not None else None
    placing = _Targets(targets, ignore_index) if targets is not None else None
    try:
        outcome.tars, outcome.warnings = _render(data, key, item, spec, label, placing)
        outcome.boxes_dropped = placing.dropped if placing is not None else 0
        outcome.frames_unclear = int(placing.frame_unclear) if placing is not None else 0
    except TargetError as exc:
        outcome.reason = str(exc)
    except DecodeError as exc:
        outcome.reason = exc.reason
    except (OSError, ValueError, MemoryError) as exc:
        outcome.reason = f"cannot process image: {exc}"
    return outcome


def _render(
    data: bytes, key: str, item: SourceItem, spec: PrepareSpec, label: int | None, targets: _Targets | None = None
) -> tuple[list[bytes], list[str]]:
    """The tar blobs of the file's sample(s) and the decoders' warnings; `targets` are placed with its pixels."""
    refused = None
    if transcode_applies(spec):
        try:  # None for what the YCbCr path does not handle (not a JPEG, CMYK, ...): RGB then
            fast = transcode_jpeg(data, spec)
        except TranscodeRefused as exc:  # Pillow decides, and the message is a warning if it reads the file
            fast, refused = None, exc.message
        if fast is not None and targets is None:
            warned = list(fast.warnings)
            meta = _meta(key, item, spec, fast.original_size, fast.size, None, [resize_op(spec.resize)], warned)
            return [sample_tar_bytes(key, _members(spec, label, meta, fast.payload))], warned
        if fast is not None and targets is not None and resize_geometry(fast.original_size, spec.resize).canvas == fast.size:
            return [_fast_blob(data, fast, key, item, spec, label, targets)], list(fast.warnings)
    decoded = decode_image(
        data,
        scale_for=lambda w, h: required_scale(spec.resize, spec.augment, w, h),
        max_pixels=spec.max_pixels,
        background=spec.background,
        padded=True,
        refused=refused,
    )
    if targets is not None:
        targets.take_image(spec, decoded.original_size, decoded.orientation)
    blobs = [sample_tar_bytes(key, members) for members in _render_variants(decoded, key, item, spec, label, targets)]
    return blobs, decoded.warnings


@dataclasses.dataclass
class _Targets:
    """A sample's targets on their way into its pictures: as listed, and its mask once read."""

    source: SourceTargets
    ignore_index: int
    mask: Any = None  # np.ndarray, of `stored` size
    stored: tuple[int, int] = (0, 0)  # the size of the frame the targets are in
    orientation: int = 1  # what turns that frame upright: the file's EXIF orientation, or 1 (upright already)
    dropped: int = 0
    frame: str = "stored"
    frame_unclear: bool = False  # the annotation's declared size matched neither frame
    instances: Any = None  # np.ndarray, of `stored` size: box n's own pixels as n + 1 (shapes only)
    polygons: Any = None  # per box, its polygons ((K, 2) arrays in `stored` pixels; [] for an RLE shape)

    def take_image(self, spec: PrepareSpec, original_size: tuple[int, int], orientation: int) -> None:
        """Note what the decoder made of the image, decide the targets' frame, and read the mask (of that frame)."""
        stored = stored_size(original_size, orientation)
        self.frame, self.frame_unclear = label_frame(self.source, stored, orientation, spec.label_frame)
        upright = (original_size[0], original_size[1])
        self.orientation, self.stored = (1, upright) if self.frame == "upright" else (orientation, stored)
        if self.source.mask is not None and self.mask is None:
            self.mask = read_mask(self.source.mask, spec, self.stored)
        elif self.source.segmentation is not None and self.mask is None:
            assert self.source.box_labels is not None  # parse_targets requires boxes with segmentation
            shapes = self.source.segmentation
            if self.source.normalized:  # YOLO-seg: polygons in fractions of the picture
                scale = np.array(self.stored, np.float64)
                shapes = [s if not isinstance(s, list) else [polygon * scale for polygon in s] for s in shapes]
            self.mask = rasterise(shapes, self.source.box_labels, self.source.iscrowd, self.stored, self.ignore_index)
            self.instances = instance_map(shapes, self.stored)
            self.polygons = [list(shape) if isinstance(shape, list) else [] for shape in shapes]

    def members(self, spec: PrepareSpec, geometry: Geometry, size: tuple[int, int], meta: dict[str, Any]) -> dict[str, bytes]:
        """The target members of one picture (of `size`, made through `geometry`); what they did goes in its `meta`."""
        source = self.source
        dropped = 0
        if source.geometric:
            if geometry.canvas != tuple(size):  # the image and its targets must have gone the same way
                raise ValueError(f"the picture is {size}, its geometry says {geometry.canvas}")
            placed, dropped = place_targets(
                source, self.mask, self.stored, self.orientation, geometry, spec.min_visible, self.ignore_index,
                self.instances, self.polygons,
            )  # fmt: skip
            meta["geometry"] = {"orientation": self.orientation, "stored_size": list(self.stored), **geometry.to_dict()}
            meta["label_frame"] = self.frame + (" (the declared size matched neither frame)" if self.frame_unclear else "")
        else:
            placed = SampleTargets(labels=source.labels, caption=source.caption)
        if source.boxes is not None:
            meta["boxes_dropped"] = dropped
        if source.columns is not None:
            meta["columns"] = source.columns
        self.dropped += dropped
        return target_members(placed)


def _fast_blob(
    data: bytes, fast: Transcoded, key: str, item: SourceItem, spec: PrepareSpec, label: int | None, targets: _Targets
) -> bytes:
    """The sample's tar blob from the YCbCr path's output, its targets placed by the same resize."""
    # The orientation the YCbCr path turned the output by: read again from the header (it parsed the file
    # already, so this is a few microseconds, paid by samples with targets only).
    targets.take_image(spec, fast.original_size, exif_orientation(open_image(data, max_pixels=spec.max_pixels, formats=("JPEG",))))
    warned = list(fast.warnings)
    meta = _meta(key, item, spec, fast.original_size, fast.size, None, [resize_op(spec.resize)], warned)
    extra = targets.members(spec, resize_geometry(fast.original_size, spec.resize), fast.size, meta)
    return sample_tar_bytes(key, {**_members(spec, label, meta, fast.payload), **extra})


def _render_variants(
    decoded: DecodedImage, key: str, item: SourceItem, spec: PrepareSpec, label: int | None, targets: _Targets | None = None
) -> list[dict[str, bytes]]:
    if spec.augment.variants and decoded.image.mode != "RGB":
        decoded.image = decoded.image.convert("RGB")  # the augmentations work on RGB
    members_per_set = []
    variants = range(spec.augment.variants) if spec.augment.variants else [None]
    for variant in variants:
        if variant is None:
            image, op = resize_image(decoded.image, decoded.original_size, spec.resize, decoded.pixels, decoded.orientation)
            ops: list[dict[str, Any]] = [op]
            geometry = resize_geometry(decoded.original_size, spec.resize)
        else:
            rng = variant_rng(spec.seed, key, variant)
            image, ops, geometry = augment_sample(
                decoded.image, decoded.original_size, spec.resize, spec.augment, rng, decoded.orientation
            )
        meta = _meta(key, item, spec, decoded.original_size, image.size, variant, ops, decoded.warnings)
        extra = targets.members(spec, geometry, image.size, meta) if targets is not None else {}
        members_per_set.append({**_members(spec, label, meta, encode_image(image, spec.encode)), **extra})
    return members_per_set


def _meta(
    key: str,
    item: SourceItem,
    spec: PrepareSpec,
    original_size: tuple[int, int],
    size: tuple[int, int],
    variant: int | None,
    ops: list[dict[str, Any]],
    warnings: list[str],
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "key": key,
        "source": redact_location(item.url),
        "label": item.label,
        "original_size": list(original_size),
        "size": list(size),
        "variant": variant,
        "seed": spec.seed,
        "ops": ops,
    }
    if warnings:  # only then: a clean file's json (and so its shard's bytes) is as before
        meta["decode_warnings"] = warnings
    return meta


def _members(spec: PrepareSpec, label: int | None, meta: dict[str, Any], payload: bytes) -> dict[str, bytes]:
    members = {
        spec.encode.extension: payload,
        "json": json.dumps(meta, sort_keys=True, separators=(",", ":")).encode("ascii"),
    }
    if label is not None:
        members["cls"] = str(label).encode("ascii")
    return members


def warm_up(spec: PrepareSpec) -> None:
    """Run the job's image path once, on a tiny image, before the workers fork.

    Pillow imports its plugins and sets up its codecs on first use, and the
    native library loads on first use; done here, every forked worker
    inherits them. Measured: the first image in a fresh worker took 35 ms
    instead of 5. A job on the YCbCr path warms only that path (about 20 ms
    less in front of the pool); a file that falls back warms the other one
    in its worker.

    Args:
        spec: the job's settings (which path, which resize and encoding).
    """
    Image = pil_image()
    sample = io.BytesIO()
    Image.new("RGB", (48, 32), (90, 120, 150)).save(sample, "JPEG", quality=90)
    # A warm-up only: a codec that fails here fails with its reason on the first real image.
    with contextlib.suppress(Exception):
        if transcode_applies(spec) and transcode_jpeg(sample.getvalue(), spec) is not None:
            return
        decoded = decode_image(sample.getvalue(), scale_for=lambda width, height: 1.0, padded=True)
        image, _ = resize_image(decoded.image, decoded.original_size, spec.resize)
        encode_image(image, spec.encode)
