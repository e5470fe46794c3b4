"""The loader's input side: which samples an epoch reads, in which order, from which bytes.

An epoch's order is a pure function of (seed, epoch, rank, world size) and the
dataset: shards are shuffled, concatenated and cut into one contiguous range
per rank (whole shards read sequentially, at most one partial shard at each
end), a few shards are interleaved, then a seeded shuffle buffer mixes
samples. Because the order is deterministic, resuming mid-epoch is just
replaying the order and skipping what was already delivered.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .errors import ConfigError, ManifestError
from .manifest import MANIFEST_NAME, read_manifest
from .storage import Output

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "npy", "ppm", "bmp", "tif", "tiff")


@dataclasses.dataclass(frozen=True)
class ShardRef:
    """One shard the loader can read."""

    url: str
    samples: int


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """A resolved loader source: shards per variant set, class names, sample count."""

    sets: list[list[ShardRef]]
    classes: list[str]
    samples: int
    root: str

    @property
    def variants(self) -> int:
        return len(self.sets)


def resolve_dataset(source: str) -> DatasetInfo:
    """Resolve a manifest path/URL, a dataset directory, or a shard brace pattern.

    Raises:
        ConfigError: the source is none of those.
        ManifestError: the manifest is missing or malformed.
    """
    if "{" in source and ".." in source:
        return _from_pattern(source)
    root = source[: -len(MANIFEST_NAME)].rstrip("/") if source.endswith(MANIFEST_NAME) else source.rstrip("/")
    output = Output(root or ".")
    manifest = read_manifest(output)
    sets: dict[int | None, list[ShardRef]] = {}
    for shard in manifest.shards:
        url = output.local(shard.path) if output.is_local else f"{output.url}/{shard.path}"
        sets.setdefault(shard.variant, []).append(ShardRef(url, shard.samples))
    ordered = [sets[key] for key in sorted(sets, key=lambda v: -1 if v is None else v)]
    return DatasetInfo(ordered, manifest.classes, manifest.samples, root)


_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def expand_braces(pattern: str) -> list[str]:
    """`shard-{000000..000003}.tar` -> the four names (zero padding kept)."""
    match = _BRACE.search(pattern)
    if not match:
        return [pattern]
    low, high = match.group(1), match.group(2)
    width = len(low) if low.startswith("0") else 0
    names = []
    for number in range(int(low), int(high) + 1):
        names.extend(expand_braces(pattern[: match.start()] + str(number).zfill(width) + pattern[match.end() :]))
    return names


def _from_pattern(pattern: str) -> DatasetInfo:
    urls = expand_braces(pattern)
    refs = []
    for url in urls:
        with open_shard(url) as handle:
            refs.append(ShardRef(url, sum(1 for _ in iter_tar_samples(handle, url))))
    if not refs:
        raise ConfigError(f"{pattern} matches no shards")
    return DatasetInfo([refs], [], sum(r.samples for r in refs), os.path.dirname(urls[0]))


def open_shard(url: str) -> Any:
    from .sources import local_path, open_fs

    local = local_path(url)
    if local is not None:
        try:
            return open(local, "rb", buffering=1 << 20)
        except OSError as exc:
            raise ManifestError(f"cannot open shard {url}: {exc.strerror or exc}") from exc
    fs, path = open_fs(url)
    return fs.open(path, "rb", block_size=1 << 22)


# ---------------------------------------------------------------------------
# Tar reading: a small streaming parser, a few microseconds per member


class TarFormatError(ValueError):
    """A tar header is corrupt: the rest of that shard cannot be trusted."""


def _octal(field: bytes) -> int:
    text = field.rstrip(b"\0 ").strip()
    if not text:
        return 0
    if field[0] & 0x80:  # GNU base-256 for very large sizes
        return int.from_bytes(field[1:], "big")
    return int(text, 8)


_CHUNK = 1 << 20  # read shards 1 MB at a time into one reused buffer: no fresh pages per read


def _header_checksum_ok(header: bytes, stored: int) -> bool:
    """The tar checksum (byte sum with the checksum field as spaces), compared modulo 65521.

    zlib's Adler-32 sums the bytes in C (its low half is 1 + the byte sum mod
    65521), where a Python sum over the 512 bytes costs microseconds per member.
    """
    byte_sum = (zlib.adler32(header) & 0xFFFF) - 1
    return (byte_sum - sum(header[148:156]) + 256 - stored) % 65521 == 0


def _refill(handle: Any, buffer: bytearray, start: int, end: int, need: int) -> tuple[int, int]:
    """Move buffer[start:end] to the front and read until `need` bytes are there (or the file ends)."""
    kept = end - start
    view = memoryview(buffer)
    if start:
        view[:kept] = view[start:end]
    while kept < need:
        got = handle.readinto(view[kept:]) if hasattr(handle, "readinto") else None
        if got is None:  # no readinto: read() into the buffer
            chunk = handle.read(len(buffer) - kept)
            got = len(chunk)
            view[kept : kept + got] = chunk
        if not got:
            break
        kept += got
    return 0, kept


def iter_tar_members(handle: Any, url: str = "") -> Iterator[tuple[str, bytes]]:
    """Yield (member name, data) of regular files, reading sequentially.

    Understands ustar, GNU long names and PAX path records.

    Raises:
        TarFormatError: on a header with a bad checksum or a truncated member.
    """
    buffer = _take_buffer()
    try:
        yield from _members(handle, url, buffer)
    finally:
        _give_back(buffer)


_spare_buffers: list[bytearray] = []
_spare_lock = threading.Lock()


def _take_buffer() -> bytearray:
    """A read buffer: a spare one, whose pages are already mapped, else a new one."""
    with _spare_lock:
        if _spare_buffers and len(_spare_buffers[-1]) == _CHUNK:
            return _spare_buffers.pop()
    return bytearray(_CHUNK)


def _give_back(buffer: bytearray) -> None:
    with _spare_lock:
        if len(_spare_buffers) < 8:
            _spare_buffers.append(buffer)


def _members(handle: Any, url: str, buffer: bytearray) -> Iterator[tuple[str, bytes]]:
    long_name: str | None = None
    view = memoryview(buffer)
    start = end = 0  # buffer[start:end] is read and not yet parsed
    while True:
        if end - start < 512:
            start, end = _refill(handle, buffer, start, end, 512)
        header = bytes(view[start : start + 512])
        if len(header) < 512 or header == _ZERO_BLOCK:
            return
        stored = _octal(header[148:156])
        if not _header_checksum_ok(header, stored):
            raise TarFormatError(f"{url}: corrupt tar header (checksum mismatch)")
        size = _octal(header[124:136])
        kind = header[156:157]
        padded = size + (-size % 512)
        if end - start < 512 + padded and 512 + padded <= len(buffer):
            start, end = _refill(handle, buffer, start, end, 512 + padded)
        if end - start >= 512 + size:
            data = bytes(view[start + 512 : start + 512 + size])
            start = min(end, start + 512 + padded)
        else:  # larger than the buffer: what is here, then the rest straight from the file
            data = bytes(view[start + 512 : end]) + handle.read(size - (end - start - 512))
            handle.read(padded - size)
            start = end = 0
        if len(data) < size:
            raise TarFormatError(f"{url}: truncated tar member")
        if kind == b"L":
            long_name = data.rstrip(b"\0").decode("utf-8", "replace")
            continue
        if kind in (b"x", b"g"):
            for record in data.decode("utf-8", "replace").split("\n"):
                if " path=" in record:
                    long_name = record.split(" path=", 1)[1]
            continue
        if kind not in (b"0", b"\0", b"7"):
            long_name = None
            continue
        if long_name is not None:
            name, long_name = long_name, None
        else:
            prefix = header[345:500].rstrip(b"\0")
            name = header[:100].rstrip(b"\0").decode("utf-8", "replace")
            if prefix and header[257:262] == b"ustar":
                name = prefix.decode("utf-8", "replace") + "/" + name
        yield name, data


_ZERO_BLOCK = bytes(512)


def iter_tar_samples(handle: Any, url: str = "") -> Iterator[tuple[str, dict[str, bytes]]]:
    """Group consecutive members by key (text before the first dot of the base name)."""
    key: str | None = None
    members: dict[str, bytes] = {}
    for name, data in iter_tar_members(handle, url):
        directory, _, base = name.rpartition("/")
        stem, _, extension = base.partition(".")
        this_key = f"{directory}/{stem}" if directory else stem
        if this_key != key and key is not None:
            yield key, members
            members = {}
        key = this_key
        members[extension.lower()] = data
    if key is not None:
        yield key, members


# ---------------------------------------------------------------------------
# Epoch planning


@dataclasses.dataclass(frozen=True)
class Segment:
    """Members [start, stop) of one shard."""

    shard: int
    start: int
    stop: int


def plan_epoch(
    shards: list[ShardRef], *, seed: int, epoch: int, rank: int, world: int, shuffle: bool, drop_last: bool
) -> tuple[list[Segment], int]:
    """This rank's segments for an epoch and its sample count.

    Every rank gets the same count: with `drop_last` the global tail that
    does not divide evenly is dropped (a different tail each epoch), else
    ranks that come up short wrap around to the start (padding, as
    torch's DistributedSampler does).
    """
    order = list(range(len(shards)))
    if shuffle:
        np.random.default_rng([seed, epoch, 0x5A4D]).shuffle(order)
    total = sum(s.samples for s in shards)
    per_rank = total // world if drop_last else -(-total // world)
    start = rank * per_rank
    stop = start + per_rank
    segments: list[Segment] = []
    for lo, hi in ((start, min(stop, total)), (0, max(0, stop - total))):
        if hi > lo:
            segments.extend(_cut(shards, order, lo, hi))
    return segments, per_rank


def _cut(shards: list[ShardRef], order: list[int], lo: int, hi: int) -> list[Segment]:
    segments = []
    offset = 0
    for index in order:
        count = shards[index].samples
        begin, end = max(lo, offset), min(hi, offset + count)
        if end > begin:
            segments.append(Segment(index, begin - offset, end - offset))
        offset += count
        if offset >= hi:
            break
    return segments


@dataclasses.dataclass
class Record:
    """One sample on its way to a batch: compressed bytes, label, and a stable id for seeding."""

    key: str
    data: bytes
    extension: str
    label: int
    ordinal: int


def pick_image(members: dict[str, bytes]) -> tuple[str, bytes] | None:
    for extension in IMAGE_EXTENSIONS:
        if extension in members:
            return extension, members[extension]
    return None


def read_segments(
    shards: list[ShardRef], segments: list[Segment], interleave: int, on_error: Any
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Samples of the segments, `interleave` shards open at once, taken in turn.

    A corrupt shard part is reported through `on_error(message)` and the
    rest of that shard is skipped; the epoch goes on.
    """
    pending = list(segments)
    active: list[Iterator[tuple[str, dict[str, bytes]]]] = []
    while pending or active:
        while pending and len(active) < interleave:
            active.append(_segment_samples(shards, pending.pop(0), on_error))
        for stream in list(active):
            item = next(stream, None)
            if item is None:
                active.remove(stream)
            else:
                yield item


def _segment_samples(shards: list[ShardRef], segment: Segment, on_error: Any) -> Iterator[tuple[str, dict[str, bytes]]]:
    url = shards[segment.shard].url
    try:
        with open_shard(url) as handle:
            for position, sample in enumerate(iter_tar_samples(handle, url)):
                if position >= segment.stop:
                    return
                if position >= segment.start:
                    yield sample
    except (TarFormatError, OSError, ManifestError) as exc:
        on_error(f"{url}: {exc}; skipping the rest of this shard")


def shuffle_buffer(items: Iterator[Any], size: int, rng: np.random.Generator, initial: int = 64) -> Iterator[Any]:
    """Seeded shuffle buffer: deterministic for a given input order and rng.

    It starts yielding once `initial` items are in (so the first batch of an
    epoch does not wait for the whole buffer to fill) and reads two items per
    yield until it holds `size`.
    """
    if size <= 1:
        yield from items
        return
    buffer: list[Any] = []
    initial = min(initial, size)
    for item in items:
        buffer.append(item)
        if len(buffer) < size:
            extra = next(items, None)
            if extra is not None:
                buffer.append(extra)
        if len(buffer) >= initial:
            slot = int(rng.integers(len(buffer)))
            buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
            yield buffer.pop()
    rng.shuffle(buffer)  # type: ignore[arg-type]
    yield from buffer
