"""`manifest.json`: the contract between prepare, the loader and the service.

A manifest lists every shard with its sample count, byte size and sha256, so
a reader can check a dataset without trusting file names, and the service can
refuse to publish a dataset with a missing or corrupt shard.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from typing import Any

from .errors import ManifestError
from .io.output import Output
from .io.tar import DigestReader, ShardInfo, TarFormatError, iter_tar_samples
from .targets import TASKS

MANIFEST_FORMAT = "gpufeed-manifest/1"
MANIFEST_NAME = "manifest.json"
REJECTED_NAME = "rejected.jsonl"

DatasetLocation = str | os.PathLike[str] | Output
"""Where a prepared dataset is: a local path, a URL (`file://`, `s3://`, …) or an `Output`."""


def _as_output(where: DatasetLocation) -> Output:
    return where if isinstance(where, Output) else Output(os.fspath(where))


MAX_SHARD_PATH = 1024  # characters; prepare writes `v12/shard-000000.tar`-sized names
_UNSAFE_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


def shard_path_problem(rel: object) -> str | None:
    """Why `rel` is not a shard path a manifest may name (None when it is).

    A shard path is relative to the dataset and stays inside it: plain
    `/`-separated names, none of them empty, `.` or `..`, no scheme, no
    leading `/`, no backslash or control character. Joined to the dataset's
    folder or URL it can name nothing in another folder, bucket or scheme.
    """
    if not isinstance(rel, str) or not rel:
        return "is not a non-empty string"
    if len(rel) > MAX_SHARD_PATH:
        return f"is longer than {MAX_SHARD_PATH} characters"
    if _UNSAFE_CHARS.search(rel):
        return "holds a backslash or a control character"
    if rel.startswith("/"):
        return "is an absolute path"
    if "://" in rel:
        return "is a URL (another scheme or bucket)"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "has an empty, '.' or '..' part (it would climb out of the dataset)"
    return None


def shard_location(output: Output, rel: str, *, links_outside: bool = False) -> str:
    """Where the manifest's shard `rel` of the dataset at `output` is: a local path or a URL, checked.

    Args:
        output: the dataset's folder or URL.
        rel: a shard path of its manifest (already checked by `shard_path_problem`).
        links_outside: follow a local shard that is a symlink (or under one)
            to a file outside the dataset's folder; by default that is refused.

    Raises:
        ManifestError: the shard resolves outside the dataset's folder.
    """
    if not output.is_local:
        return f"{output.url}/{rel}"
    path = output.local(rel)
    if not links_outside:
        root = os.path.realpath(output.root)
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise ManifestError(
                f"{output.url}/{MANIFEST_NAME} names shard {rel!r}, which is a link to {real}, outside the dataset "
                f"folder {root}; move the shard into the folder, or allow it explicitly (make_loader(..., "
                "links_outside=True), gpufeed inspect --links-outside)"
            )
    return path


@dataclasses.dataclass
class Manifest:
    """A prepared dataset.

    `decoded_with_warnings` counts the samples whose decoders warned about
    damage they read past (each one's json lists the messages); 0 in
    manifests written before it was counted.

    `task` is what the samples hold (`pipeline.targets.TASKS`), `fields`
    the members they may hold besides their image and json (`cls`,
    `boxes.npy`, `mask.png`, `txt`, ...), `ignore_index` a segmentation
    mask's value of no class. Manifests written before tasks were recorded
    are classification. `boxes_dropped` counts the boxes prepare left out
    because too little of them stayed in their picture after a crop (0, and
    not written, when none were). `mask_classes` names a mask's values
    where they are not `classes` indices: a detection dataset painted from
    COCO's shapes holds box class c as c + 1 and 0 as background, so its
    `mask_classes` is ["background", *classes] (None, and not written,
    elsewhere). `frames_unclear` counts the samples whose annotation
    (COCO, VOC) declared an image size that was neither the stored nor the
    upright one, so `params.label_frame` (default upright) decided.
    """

    samples: int
    classes: list[str]
    shards: list[ShardInfo]
    params: dict[str, Any]
    source: str
    rejected: int
    created: str = ""
    variants: int = 0
    format: str = MANIFEST_FORMAT
    decoded_with_warnings: int = 0
    task: str = "classification"
    fields: list[str] = dataclasses.field(default_factory=list)
    ignore_index: int | None = None
    boxes_dropped: int = 0
    mask_classes: list[str] | None = None
    frames_unclear: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "samples": self.samples,
            "classes": self.classes,
            "variants": self.variants,
            "shards": [shard.to_dict() for shard in self.shards],
            "params": self.params,
            "source": self.source,
            "rejected": self.rejected,
            "decoded_with_warnings": self.decoded_with_warnings,
            "created": self.created,
            "task": self.task,
            "fields": self.fields,
            **({"ignore_index": self.ignore_index} if self.ignore_index is not None else {}),
            **({"boxes_dropped": self.boxes_dropped} if self.boxes_dropped else {}),
            **({"frames_unclear": self.frames_unclear} if self.frames_unclear else {}),
            **({"mask_classes": self.mask_classes} if self.mask_classes is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "manifest") -> Manifest:
        """The manifest a parsed manifest.json holds, every field checked (type, range, format).

        Raises:
            ManifestError: not a gpufeed manifest, or a field that is missing,
                of the wrong type or out of range; counts no shard's bytes could hold.
        """
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ManifestError(f"{where} is not a gpufeed manifest (format {found!r}, expected {MANIFEST_FORMAT!r})")
        try:
            variants = _count(data.get("variants", 0), "variants", MAX_VARIANTS)
            entries = data["shards"]
            if not isinstance(entries, list) or len(entries) > MAX_MANIFEST_SHARDS:
                raise ValueError(f"shards must be a list of at most {MAX_MANIFEST_SHARDS} entries")
            shards = [_shard_info(entry, variants) for entry in entries]
            _check_shard_paths(shards, where)
            classes = data["classes"]
            if not isinstance(classes, list) or not all(isinstance(name, str) for name in classes):
                raise ValueError("classes must be a list of names (strings)")
            params = data["params"]
            if not isinstance(params, dict) or nested_deeper(params, MAX_PARAMS_DEPTH):
                raise ValueError(f"params must be an object nested at most {MAX_PARAMS_DEPTH} deep")
            manifest = cls(
                samples=_count(data["samples"], "samples", sum(_capacity(shard.bytes) for shard in shards)),
                classes=list(classes),
                shards=shards,
                params=dict(params),
                source=_text_field(data["source"], "source"),
                rejected=_count(data["rejected"], "rejected"),
                created=_text_field(data.get("created", ""), "created"),
                variants=variants,
                decoded_with_warnings=_count(data.get("decoded_with_warnings", 0), "decoded_with_warnings"),
                task=_task(data.get("task", "classification")),
                fields=_fields(data.get("fields", [])),
                ignore_index=None if data.get("ignore_index") is None else _count(data["ignore_index"], "ignore_index", 65535),
                boxes_dropped=_count(data.get("boxes_dropped", 0), "boxes_dropped"),
                frames_unclear=_count(data.get("frames_unclear", 0), "frames_unclear"),
                mask_classes=_mask_classes(data.get("mask_classes")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where} is malformed: {exc!r}") from exc
        return manifest


MAX_MANIFEST_BYTES = 256 << 20  # of JSON: a million shards take about 200 MB
MAX_MANIFEST_SHARDS = 1 << 20
MAX_VARIANTS = 1 << 16
MAX_PARAMS_DEPTH = 32
MAX_SHARD_BYTES = 1 << 50  # 1 PiB
MAX_COUNT = 2**63 - 1
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _mask_classes(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise ValueError("mask_classes must be a list of names (strings)")
    return list(value)


def _capacity(size: int) -> int:
    """The most samples `size` bytes of tar can hold: each sample takes at least one 512-byte member header."""
    return size // 512


def _count(value: Any, name: str, high: int = MAX_COUNT) -> int:
    """A count field: an integer (not a bool, not a string), 0 <= value <= high."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, not {type(value).__name__}")
    if not 0 <= value <= high:
        raise ValueError(f"{name} = {value} is out of range (0 to {high})")
    return value


def _text_field(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, not {type(value).__name__}")
    return value


def _task(value: Any) -> str:
    if value not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, not {value!r}")
    return str(value)


MAX_FIELDS = 256
_FIELD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def _fields(value: Any) -> list[str]:
    """The `fields` entry: the member names a sample may hold besides its image and json."""
    if not isinstance(value, list) or len(value) > MAX_FIELDS or not all(
        isinstance(name, str) and _FIELD_NAME.fullmatch(name) for name in value
    ):
        raise ValueError(f"fields must be a list of at most {MAX_FIELDS} member names")
    return list(value)


def _shard_info(entry: Any, variants: int) -> ShardInfo:
    """One `shards` entry, checked: its counts, its sha256, its variant within the manifest's."""
    if not isinstance(entry, dict):
        raise ValueError(f"a shard entry must be an object, not {type(entry).__name__}")
    path = _text_field(entry["path"], "a shard's path")
    size = _count(entry["bytes"], f"{path}: bytes", MAX_SHARD_BYTES)
    samples = _count(entry["samples"], f"{path}: samples", _capacity(size))  # no count its bytes could not hold
    sha256 = entry["sha256"]
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise ValueError(f"{path}: sha256 must be 64 lower-case hex digits")
    variant = entry.get("variant")
    if variant is not None or variants:
        variant = _count(variant, f"{path}: variant", variants - 1)
    return ShardInfo(path, samples, size, sha256, variant)


def nested_deeper(value: Any, depth: int) -> bool:
    """Whether a JSON value nests lists and objects over `depth` levels deep (looked at without recursion)."""
    pending = [(value, 1)]
    while pending:
        current, level = pending.pop()
        children = current.values() if isinstance(current, dict) else current if isinstance(current, list) else None
        if children is None:
            continue
        if level > depth:
            return True
        pending.extend((child, level + 1) for child in children if isinstance(child, (list, dict)))
    return False


def _check_shard_paths(shards: list[ShardInfo], where: str) -> None:
    seen: set[str] = set()
    for shard in shards:
        problem = shard_path_problem(shard.path)
        if problem is not None:
            raise ManifestError(f"{where} names a shard outside the dataset: {shard.path!r} {problem}")
        if shard.path in seen:
            raise ManifestError(f"{where} lists shard {shard.path!r} more than once")
        seen.add(shard.path)


def write_manifest(output: Output, manifest: Manifest) -> None:
    """Write OUT/manifest.json atomically (the last step of a job)."""
    if not manifest.created:
        manifest.created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    text = json.dumps(manifest.to_dict(), indent=2) + "\n"
    output.write_bytes_atomic(MANIFEST_NAME, text.encode("utf-8"))


def read_manifest(where: DatasetLocation) -> Manifest:
    """Read and validate a dataset's manifest.json.

    Args:
        where: the dataset folder: a path (`"demo/shards"`), a URL or an `Output`.

    Returns:
        The manifest, validated.

    Raises:
        ManifestError: missing, not JSON, or not a gpufeed manifest.
    """
    output = _as_output(where)
    try:
        if output.is_local:  # over the bound: refused before a byte is read
            size = output.size(MANIFEST_NAME)
            if size is not None and size > MAX_MANIFEST_BYTES:
                raise ManifestError(_too_large(output.url, size))
        text = output.read_if_exists(MANIFEST_NAME)
    except OSError as exc:
        raise ManifestError(f"cannot read {output.url}/{MANIFEST_NAME}: {exc}") from exc
    if text is None and output.is_local and not os.path.exists(output.local("")):
        raise ManifestError(f"{output.url} does not exist: give a prepared dataset's folder or its manifest.json")
    return parse_manifest(text, output.url)


def _too_large(url: str, size: int) -> str:
    return f"{url}/{MANIFEST_NAME} is {size} bytes, over the bound of {MAX_MANIFEST_BYTES} on a manifest: not a gpufeed manifest"


def parse_manifest(text: bytes | None, url: str) -> Manifest:
    """The manifest from the bytes of the dataset folder `url`'s manifest.json (None: it has none).

    Raises:
        ManifestError: missing, not JSON, over `MAX_MANIFEST_BYTES` or nested
            too deep, or not a gpufeed manifest (see `Manifest.from_dict`).
    """
    if text is None:
        raise ManifestError(f"no {MANIFEST_NAME} in {url}: not a prepared dataset (or its prepare did not finish)")
    where = f"{url}/{MANIFEST_NAME}"
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(_too_large(url, len(text)))
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ManifestError(f"cannot read {where}: {exc}") from exc
    except RecursionError:
        raise ManifestError(f"cannot read {where}: its JSON nests too deep to be a manifest") from None
    return Manifest.from_dict(data, where)


@dataclasses.dataclass
class VerifyResult:
    """What `verify_dataset` found: `ok` is False when any problem was seen."""

    shards_checked: int = 0
    samples_checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_dataset(
    where: DatasetLocation, manifest: Manifest | None = None, *, links_outside: bool = False
) -> VerifyResult:
    """Re-read every shard: size, sha256, and sample count must match the manifest.

    Args:
        where: the dataset folder: a path, a URL or an `Output`.
        manifest: the manifest to check the shards against (default: the
            dataset's own manifest.json; pass another, e.g. an older version,
            to check that its shards are still intact).
        links_outside: read local shards that are links to files outside
            the dataset's folder (refused by default).

    Returns:
        What was checked, and every problem seen (`ok` is True when none).

    Raises:
        ManifestError: when no manifest is given and the dataset's cannot be
            read, or a shard resolves outside the dataset (before any is read).
    """
    output = _as_output(where)
    if manifest is None:
        manifest = read_manifest(output)
    for shard in manifest.shards:
        shard_location(output, shard.path, links_outside=links_outside)
    result = VerifyResult()
    per_variant: dict[Any, int] = {}
    for shard in manifest.shards:
        result.shards_checked += 1
        per_variant[shard.variant] = per_variant.get(shard.variant, 0) + shard.samples
        if not output.exists(shard.path):
            result.problems.append(f"{shard.path}: missing")
            continue
        digest, size, samples, error = _scan_shard(output, shard.path, shard.bytes)
        result.bytes_checked += size
        result.samples_checked += samples
        if size != shard.bytes:
            result.problems.append(f"{shard.path}: {size} bytes, manifest says {shard.bytes}")
        if digest != shard.sha256:
            result.problems.append(f"{shard.path}: sha256 mismatch (file changed or corrupted)")
        if error:
            result.problems.append(f"{shard.path}: unreadable tar: {error}")
        elif samples != shard.samples:
            result.problems.append(f"{shard.path}: {samples} samples, manifest says {shard.samples}")
    expected: list[int | None] = list(range(manifest.variants)) if manifest.variants else [None]
    for variant in per_variant:
        if variant not in expected:
            result.problems.append(f"shards of variant {variant!r}, which the manifest does not declare")
    for variant in expected:
        count = per_variant.get(variant, 0)
        if count != manifest.samples:
            label = "dataset" if variant is None else f"variant set v{variant}"
            result.problems.append(f"{label}: shards hold {count} samples, manifest says {manifest.samples}")
    return result


def _scan_shard(output: Output, rel: str, expected: int) -> tuple[str, int, int, str]:
    """(sha256, bytes, samples, error) of one shard, hashing the bytes as the tar reader streams them.

    It reads at most one byte more than the manifest's `expected` size: a
    shard larger than that is damaged whatever it holds (its size comes from
    the file system then), so verify's time is bounded by what the manifest says.
    """
    error = ""
    samples = 0
    with output.open_read(rel) as raw:
        reader = DigestReader(_Capped(raw, expected + 1))
        try:
            for _ in iter_tar_samples(reader, rel):
                samples += 1
        except TarFormatError as exc:
            error = exc.reason
        except OSError as exc:
            error = str(exc) or type(exc).__name__
        reader.drain()  # hash what lies after the end of the archive
    size = reader.bytes
    if size > expected:  # the size problem says it; what the cut made of the tar does not matter
        size, error = output.size(rel) or size, ""
    return reader.hexdigest(), size, samples, error


class _Capped:
    """A binary file that ends after `limit` bytes."""

    def __init__(self, raw: Any, limit: int) -> None:
        self.raw = raw
        self.left = limit

    def readinto(self, buffer: memoryview) -> int:
        view = memoryview(buffer)[: self.left]
        got = (self.raw.readinto(view) if hasattr(self.raw, "readinto") else _read_into(self.raw, view)) or 0
        self.left -= got
        return got

    def read(self, size: int = -1) -> bytes:
        data: bytes = self.raw.read(self.left if size < 0 else min(size, self.left))
        self.left -= len(data)
        return data


def _read_into(raw: Any, view: memoryview) -> int:
    data = raw.read(len(view))
    view[: len(data)] = data
    return len(data)
