"""The one tar reader and writer for WebDataset shards, with one key rule.

A shard is a tar whose members are grouped into samples by `split_key`:
`dir/cat-1f2e.jpg` and `dir/cat-1f2e.cls` are the `jpg` and `cls` of sample
`dir/cat-1f2e`. The writer builds member names with the same rule (and
refuses a key the reader would split differently); the reader groups by it.

Writing: POSIX (ustar) members built by hand with fixed metadata, to a hidden
temporary name, fsynced and renamed, so identical jobs give identical bytes
and a partial shard never has a shard's name.

Reading: one sequential pass through a reused 1 MB buffer (the loader's hot
path), understanding ustar, GNU long names and PAX path records, and
refusing a damaged header instead of yielding garbage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import zlib
from collections.abc import Generator, Iterable, Iterator
from typing import Any, BinaryIO

from ..errors import StorageError, write_failure
from .fs import temp_suffix

TAR_MTIME = 946684800  # 2000-01-01: fixed so equal jobs give equal tars
TAR_BLOCK = 512
TAR_RECORD = 10240  # tar's default record: archives are padded to a multiple of it

# ---------------------------------------------------------------------------
# The key rule


def split_key(name: str) -> tuple[str, str]:
    """Split a member name into (sample key, extension), the WebDataset way.

    The key is the member path up to the first dot of its base name, folders
    included; the extension is the rest, lower-cased: `a/b.seg.PNG` is
    (`a/b`, `seg.png`). A name without a dot in its base name is all key,
    with the extension "".
    """
    dot = name.find(".", name.rfind("/") + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :].lower()


def member_name(key: str, extension: str) -> str:
    """The tar member name of one field of a sample: `key.extension`.

    Raises:
        ValueError: when the key is empty, has an empty base name or contains a
            dot, or when `split_key` would not give back (key, extension), e.g.
            for an upper-case extension or one with a slash.
    """
    name = f"{key}.{extension}"
    if "." in key or not key or key.endswith("/") or split_key(name) != (key, extension):
        raise ValueError(
            f"cannot store sample {key!r} field {extension!r}: a key needs a base name and no dots, "
            "an extension no slashes or upper-case letters"
        )
    return name


# ---------------------------------------------------------------------------
# Writing


def tar_member(name: str, data: bytes) -> bytes:
    """One POSIX ustar member (header + data + padding) with fixed metadata.

    Built by hand instead of through `tarfile`: this runs once per member in
    the writing process and `tarfile.addfile` costs ~0.08 ms each.

    Raises:
        ValueError: when the name is over ustar's 100 bytes.
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
    """All members of one sample, ready to append to a shard (extensions in sorted order).

    Raises:
        ValueError: for a key or extension `member_name` refuses.
    """
    return b"".join(tar_member(member_name(key, extension), members[extension]) for extension in sorted(members))


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
        info = self._seal(relative_path, variant)
        self._rename()
        return info

    def commit_if_same(self, expected: ShardInfo) -> bool:
        """Finish the tar and give it its final name only if it is exactly `expected` (size and sha256).

        For a shard written again to repair a dataset: the file the manifest
        records, or nothing. A tar that differs is left to be removed when the
        writer's block ends.

        Returns:
            Whether the tar was `expected` and now has its final name.
        """
        info = self._seal(expected.path, expected.variant)
        if (info.bytes, info.sha256) != (expected.bytes, expected.sha256):
            return False
        self._rename()
        return True

    def _seal(self, relative_path: str, variant: int | None) -> ShardInfo:
        """End the archive and make the temp file durable."""
        assert self._raw is not None
        end = 2 * TAR_BLOCK
        end += -(self.bytes + end) % TAR_RECORD
        self._write(b"\0" * end)
        try:
            self._raw.flush()
            os.fsync(self._raw.fileno())
            self._raw.close()
        except OSError as exc:
            raise write_failure(self.final_path, exc) from exc
        return ShardInfo(relative_path, self.samples, self.bytes, self._sha256.hexdigest(), variant)

    def _rename(self) -> None:
        try:
            os.replace(self.temp_path, self.final_path)
        except OSError as exc:
            raise write_failure(self.final_path, exc) from exc

    def __exit__(self, *exc_info: object) -> None:
        if self._raw is not None and not self._raw.closed:
            try:
                self._raw.close()
            except OSError:
                pass  # the temp file is being discarded; a full disk may refuse the final flush
        if os.path.exists(self.temp_path):
            os.unlink(self.temp_path)


# ---------------------------------------------------------------------------
# Reading


class TarFormatError(ValueError):
    """A tar header is corrupt or a member is cut short: the rest of that shard cannot be trusted.

    Attributes:
        url: the shard, as the caller named it ("" when not given).
        reason: what is wrong, without the shard's name.
    """

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.url = url
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.url}: {self.reason}" if self.url else self.reason


class DigestReader:
    """A binary file wrapper that hashes what is read through it, so one pass reads and checks a shard.

    Give it to `iter_tar_samples` in place of the file: every byte the tar
    reader takes (through `readinto` or `read`) goes through sha256 on the
    way; `drain` reads and hashes whatever the reader left behind (the end
    of the archive, or the rest of a shard read only in part).

    Attributes:
        sha256: the running hash of the bytes read so far.
        bytes: how many bytes were read so far.
    """

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def readinto(self, buffer: memoryview) -> int:
        """Read into `buffer` (a memoryview) and hash what came; returns how many bytes."""
        if hasattr(self.raw, "readinto"):
            got = self.raw.readinto(buffer) or 0
            self.sha256.update(buffer[:got])
            self.bytes += got
            return got
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def read(self, size: int = -1) -> bytes:
        """Read up to `size` bytes (all with -1) and hash them."""
        data: bytes = self.raw.read(size)
        self.sha256.update(data)
        self.bytes += len(data)
        return data

    def drain(self) -> None:
        """Read (and hash) to the end of the file."""
        buffer = _take_buffer()
        try:
            view = memoryview(buffer)
            while self.readinto(view):
                pass
        finally:
            _give_back(buffer)

    def hexdigest(self) -> str:
        """The sha256 of everything read so far, in hex."""
        return self.sha256.hexdigest()


def iter_tar_samples(source: Any, url: str = "") -> Generator[tuple[str, dict[str, bytes]], None, None]:
    """Yield (key, {extension: data}), grouping consecutive members by `split_key`.

    Args:
        source: a local path, or a binary file object open at the start of the tar.
        url: the name errors give the shard (default: the path).

    Raises:
        TarFormatError: on a header with a bad checksum or a truncated member.
    """
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as handle:
            yield from iter_tar_samples(handle, url or os.fspath(source))
        return
    yield from group_samples(iter_tar_members(source, url))


def group_samples(members: Iterable[tuple[str, bytes]]) -> Generator[tuple[str, dict[str, bytes]], None, None]:
    """Yield (key, {extension: data}) from (member name, data) pairs, consecutive names of one key as one sample."""
    key: str | None = None
    sample: dict[str, bytes] = {}
    for name, data in members:
        this_key, extension = split_key(name)
        if this_key != key:
            if key is not None:
                yield key, sample
                sample = {}
            key = this_key
        sample[extension] = data
    if key is not None:
        yield key, sample


def iter_tar_members(handle: Any, url: str = "") -> Iterator[tuple[str, bytes]]:
    """Yield (member name, data) of regular files, reading sequentially.

    Understands ustar, GNU long names and PAX path records. Reads through
    `handle.readinto` when it has one (else `read`), ahead of what it yields.

    Raises:
        TarFormatError: on a header with a bad checksum or a truncated member.
    """
    buffer = _take_buffer()
    try:
        yield from _members(handle, url, buffer)
    finally:
        _give_back(buffer)


_CHUNK = 1 << 20  # read shards 1 MB at a time into one reused buffer: no fresh pages per read
_ZERO_BLOCK = bytes(TAR_BLOCK)
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
        if end - start < TAR_BLOCK:
            start, end = _refill(handle, buffer, start, end, TAR_BLOCK)
        if end - start < TAR_BLOCK:  # what lies beyond `end` in the reused buffer is an earlier read's
            return  # a file cut at a header: what tarfile also accepts
        header = bytes(view[start : start + TAR_BLOCK])
        if header == _ZERO_BLOCK:
            return  # the end of the archive
        try:
            stored, size = _octal(header[148:156]), _octal(header[124:136])
        except ValueError:
            raise TarFormatError(url, "corrupt tar header (a number field is not a number)") from None
        if not _header_checksum_ok(header, stored):
            raise TarFormatError(url, "corrupt tar header (checksum mismatch)")
        if size < 0:
            raise TarFormatError(url, "corrupt tar header (negative size)")
        kind = header[156:157]
        padded = size + (-size % TAR_BLOCK)
        if end - start < TAR_BLOCK + padded and TAR_BLOCK + padded <= len(buffer):
            start, end = _refill(handle, buffer, start, end, TAR_BLOCK + padded)
        if end - start >= TAR_BLOCK + size:
            data = bytes(view[start + TAR_BLOCK : start + TAR_BLOCK + size])
            start = min(end, start + TAR_BLOCK + padded)
        else:  # larger than the buffer: what is here, then the rest straight from the file
            data = bytes(view[start + TAR_BLOCK : end]) + handle.read(size - (end - start - TAR_BLOCK))
            handle.read(padded - size)
            start = end = 0
        if len(data) < size:
            raise TarFormatError(url, "truncated tar member")
        if kind == b"L":
            long_name = _text(data)
            continue
        if kind in (b"x", b"g"):
            long_name = _pax_path(data) or long_name
            continue
        if kind not in (b"0", b"\0", b"7"):
            long_name = None
            continue
        if long_name is not None:
            name, long_name = long_name, None
        else:
            name = _text(header[:100])
            if header[345] and header[257:262] == b"ustar":
                name = _text(header[345:500]) + "/" + name
        yield name, data


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


def _octal(field: bytes) -> int:
    """A numeric header field: octal text, or GNU base-256 for very large sizes.

    Raises:
        ValueError: when the field is neither.
    """
    if field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    text = field.rstrip(b"\0 ").strip()
    return int(text, 8) if text else 0


def _header_checksum_ok(header: bytes, stored: int) -> bool:
    """The tar checksum (byte sum with the checksum field as spaces), compared modulo 65521.

    zlib's Adler-32 sums the bytes in C (its low half is 1 + the byte sum mod
    65521), where a Python sum over the 512 bytes costs microseconds per member.
    """
    byte_sum = (zlib.adler32(header) & 0xFFFF) - 1
    return (byte_sum - sum(header[148:156]) + 256 - stored) % 65521 == 0


def _text(field: bytes) -> str:
    """A NUL-terminated name field, as tarfile reads it (up to the first NUL)."""
    return field.partition(b"\0")[0].decode("utf-8", "replace")


def _pax_path(data: bytes) -> str | None:
    """The `path` of a PAX header: records are `LENGTH KEY=VALUE\\n`, LENGTH counting the whole record."""
    path = None
    position = 0
    while position < len(data):
        space = data.find(b" ", position)
        if space < 0:
            break
        try:
            length = int(data[position:space])
        except ValueError:
            break
        if length <= space - position:
            break
        key, _, value = data[space + 1 : position + length - 1].partition(b"=")
        if key == b"path":
            path = value.decode("utf-8", "replace").rstrip("/")  # as tarfile reads it
        position += length
    return path
