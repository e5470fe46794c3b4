"""The one tar reader and writer: WebDataset shards, written reproducibly, read as a stream.

Shards are POSIX (ustar) tar files written to a hidden temporary name, fsynced
and renamed, with fixed metadata so identical jobs give identical bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO

from ..errors import StorageError, write_failure
from .fs import temp_suffix

TAR_MTIME = 946684800  # 2000-01-01: fixed so equal jobs give equal tars


TAR_BLOCK = 512


TAR_RECORD = 10240  # tar's default record: archives are padded to a multiple of it


def tar_member(name: str, data: bytes) -> bytes:
    """One POSIX ustar member (header + data + padding) with fixed metadata.

    Built by hand instead of through `tarfile`: this runs once per member in
    the writing process and `tarfile.addfile` costs ~0.08 ms each.
    """
    encoded = name.encode("utf-8")
    if len(encoded) > 100:
        raise ValueError(f"tar member name over 100 bytes: {name!r}")
    header = bytearray(TAR_BLOCK)
    header[0 : len(encoded)] = encoded
    header[100:108] = b"0000644\0"
    header[108:116] = b"0000000\0"
    header[116:124] = b"0000000\0"
    header[124:136] = b"%011o\0" % len(data)
    header[136:148] = b"%011o\0" % TAR_MTIME
    header[148:156] = b"        "
    header[156:157] = b"0"
    header[257:265] = b"ustar\x0000"
    header[148:156] = b"%06o\0 " % sum(header)
    padding = -len(data) % TAR_BLOCK
    return bytes(header) + data + b"\0" * padding


def sample_tar_bytes(key: str, members: dict[str, bytes]) -> bytes:
    """All members of one sample, ready to append to a shard (extensions in sorted order)."""
    return b"".join(tar_member(f"{key}.{extension}", members[extension]) for extension in sorted(members))


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """A finished shard, as listed in the manifest."""

    path: str
    samples: int
    bytes: int
    sha256: str
    variant: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.variant is None:
            data.pop("variant")
        return data


class TarShardWriter:
    """Write one shard: members go to a hidden temp file; `commit` renames it into place.

    Use as a context manager: leaving the block without `commit` (an
    exception, a cancelled job) removes the temp file, so a partial shard
    never has a shard's name.
    """

    def __init__(self, final_path: str) -> None:
        self.final_path = final_path
        directory, name = os.path.split(final_path)
        self.temp_path = os.path.join(directory, f".{name}{temp_suffix()}")
        self.samples = 0
        self.bytes = 0
        self._sha256 = hashlib.sha256()
        self._raw: BinaryIO | None = None

    def __enter__(self) -> TarShardWriter:
        try:
            os.makedirs(os.path.dirname(self.final_path) or ".", exist_ok=True)
            self._raw = open(self.temp_path, "wb")
        except OSError as exc:
            raise StorageError(f"cannot create {self.temp_path}: {exc.strerror or exc}") from exc
        return self

    def _write(self, data: bytes) -> None:
        assert self._raw is not None
        try:
            self._raw.write(data)
        except OSError as exc:
            raise write_failure(self.final_path, exc) from exc
        self._sha256.update(data)
        self.bytes += len(data)

    def write_sample(self, key: str, members: dict[str, bytes]) -> None:
        """Add one sample: `members` maps extension (e.g. "jpg") to bytes."""
        self.write_sample_bytes(sample_tar_bytes(key, members))

    def write_sample_bytes(self, blob: bytes) -> None:
        """Add one sample already encoded by `sample_tar_bytes` (e.g. in a worker process)."""
        self._write(blob)
        self.samples += 1

    def commit(self, relative_path: str, variant: int | None = None) -> ShardInfo:
        """Finish the tar, make it durable, rename it to its final name."""
        assert self._raw is not None
        end = 2 * TAR_BLOCK
        end += -(self.bytes + end) % TAR_RECORD
        self._write(b"\0" * end)
        try:
            self._raw.flush()
            os.fsync(self._raw.fileno())
            self._raw.close()
            os.replace(self.temp_path, self.final_path)
        except OSError as exc:
            raise write_failure(self.final_path, exc) from exc
        return ShardInfo(relative_path, self.samples, self.bytes, self._sha256.hexdigest(), variant)

    def __exit__(self, *exc_info: object) -> None:
        if self._raw is not None and not self._raw.closed:
            try:
                self._raw.close()
            except OSError:
                pass  # the temp file is being discarded; a full disk may refuse the final flush
        if os.path.exists(self.temp_path):
            os.unlink(self.temp_path)


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


def iter_tar_samples(source: Any, url: str = "") -> Iterator[tuple[str, dict[str, bytes]]]:
    """Group consecutive members by key (text before the first dot of the base name).

    Args:
        source: a local path, or a binary file object open at the start of the tar.
        url: the name errors give the shard (default: the path).
    """
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as handle:
            yield from iter_tar_samples(handle, url or os.fspath(source))
        return
    handle = source
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
