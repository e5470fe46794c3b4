"""One source in, the tar members of its sample(s) out: read -> decode -> transform -> encode.

A JPEG that only needs a resize takes the YCbCr path (`transcode.py`: no RGB
in between, about twice as fast); everything else is decoded to RGB, resized
or augmented into its variant sets, and encoded. A file the YCbCr path
refuses (libjpeg warned or failed) is decoded by Pillow, whose verdict
decides: the rule is that a file is accepted exactly when Pillow can read it.
What the decoders warned about is kept in the sample's json
(`decode_warnings`). A bad image never raises: its outcome carries the
reason, and the job writes it to `rejected.jsonl`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import re
from typing import Any

from ..decode import DecodedImage, decode_image, pil_image
from ..errors import DecodeError
from ..io.fs import read_source_bytes, redact_location
from ..io.tar import sample_tar_bytes
from ..specs import PrepareSpec
from .encode import encode_image
from .sources import SourceItem
from .transcode import TranscodeRefused, transcode_jpeg
from .transcode import applies as transcode_applies
from .transforms import augment_image, required_scale, resize_image, resize_op, variant_rng

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
    in its samples' json as `decode_warnings`).
    """

    index: int
    key: str
    source: str
    tars: list[bytes] | None = None
    reason: str = ""
    warnings: list[str] = dataclasses.field(default_factory=list)


def read_item(item: SourceItem, spec: PrepareSpec) -> bytes | str:
    """The source's bytes, or the reason they cannot be read (a reject reason)."""
    try:
        return read_source_bytes(item.url, spec.max_file_bytes)
    except (OSError, ValueError) as exc:
        return f"cannot read file: {getattr(exc, 'strerror', None) or exc}"


def process_item(
    item: SourceItem, index: int, spec: PrepareSpec, classes: dict[str, int], fetched: bytes | str | None = None
) -> SampleOutcome:
    """Turn one source file into the tar members of its sample(s).

    Args:
        item: the source.
        index: its listing index (carried to the outcome, for the shard writer).
        spec: the job's settings.
        classes: class name -> label index.
        fetched: what `read_item` gave for it already (read ahead on an I/O thread); None reads it now.

    Returns:
        The outcome: one tar blob per variant set, or the reason the file was rejected.
        Never raises for a bad image.
    """
    key = sample_key(item.rel)
    outcome = SampleOutcome(index, key, item.url)
    data = read_item(item, spec) if fetched is None else fetched
    if isinstance(data, str):
        outcome.reason = data
        return outcome
    label = classes.get(item.label) if item.label is not None else None
    try:
        outcome.tars, outcome.warnings = _render(data, key, item, spec, label)
    except DecodeError as exc:
        outcome.reason = exc.reason
    except (OSError, ValueError, MemoryError) as exc:
        outcome.reason = f"cannot process image: {exc}"
    return outcome


def _render(
    data: bytes, key: str, item: SourceItem, spec: PrepareSpec, label: int | None
) -> tuple[list[bytes], list[str]]:
    """The tar blobs of the file's sample(s) and the decoders' warnings."""
    refused = None
    if transcode_applies(spec):
        try:  # None for what the YCbCr path does not handle (not a JPEG, CMYK, ...): RGB then
            fast = transcode_jpeg(data, spec)
        except TranscodeRefused as exc:  # Pillow decides, and the message is a warning if it reads the file
            fast, refused = None, exc.message
        if fast is not None:
            warned = list(fast.warnings)
            meta = _meta(key, item, spec, fast.original_size, fast.size, None, [resize_op(spec.resize)], warned)
            return [sample_tar_bytes(key, _members(spec, label, meta, fast.payload))], warned
    decoded = decode_image(
        data,
        scale_for=lambda w, h: required_scale(spec.resize, spec.augment, w, h),
        max_pixels=spec.max_pixels,
        background=spec.background,
        padded=True,
        refused=refused,
    )
    blobs = [sample_tar_bytes(key, members) for members in _render_variants(decoded, key, item, spec, label)]
    return blobs, decoded.warnings


def _render_variants(
    decoded: DecodedImage, key: str, item: SourceItem, spec: PrepareSpec, label: int | None
) -> list[dict[str, bytes]]:
    if spec.augment.variants and decoded.image.mode != "RGB":
        decoded.image = decoded.image.convert("RGB")  # the augmentations work on RGB
    members_per_set = []
    variants = range(spec.augment.variants) if spec.augment.variants else [None]
    for variant in variants:
        if variant is None:
            image, op = resize_image(decoded.image, decoded.original_size, spec.resize)
            ops: list[dict[str, Any]] = [op]
        else:
            rng = variant_rng(spec.seed, key, variant)
            image, ops = augment_image(decoded.image, decoded.original_size, spec.resize, spec.augment, rng)
        meta = _meta(key, item, spec, decoded.original_size, image.size, variant, ops, decoded.warnings)
        members_per_set.append(_members(spec, label, meta, encode_image(image, spec.encode)))
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
