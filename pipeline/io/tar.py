"""The one tar reader and writer for WebDataset shards, with one key rule.

A shard is a tar whose members are grouped into samples by `split_key`:
`dir/cat-1f2e.jpg` and `dir/cat-1f2e.cls` are the `jpg` and `cls` of sample
`dir/cat-1f2e`. The writer builds member names with the same rule (and
refuses a key the reader would split differently); the reader groups by it.

This module is the reader, and the one place both sides are imported from:

- reading (here): one sequential pass through a reused 1 MB buffer (the
  loader's hot path), understanding ustar, GNU long names and PAX path
  records, and refusing a damaged header instead of yielding garbage; and
  an index of a shard that reads its headers only;
- writing (`tar_write`): POSIX (ustar) members built by hand with fixed
  metadata, to a hidden temporary name, fsynced and renamed, so identical
  jobs give identical bytes and a partial shard never has a shard's name;
- the format both share (`tar_format`): the key rule, the block size, the
  header parser and `TarFormatError`.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any
from zlib import adler32

from .fs import byte_bound
from .tar_format import (
    META_KINDS,
    OCTAL_TEXT,
    REGULAR_KINDS,
    TAR_BLOCK,
    ZERO_BLOCK,
    TarFormatError,
    header_name,
    member_name,
    member_path,
    parse_header,
    pax_size,
    split_key,
    take_meta,
)
from .tar_write import TAR_MTIME, TAR_RECORD, ShardInfo, TarShardWriter, sample_tar_bytes, tar_member

__all__ = [
    "MAX_MEMBER_BYTES", "MAX_MEMBER_ENV", "MAX_META_BYTES", "TAR_BLOCK", "TAR_MTIME", "TAR_RECORD",
    "DigestReader", "ShardInfo", "TarFormatError", "TarShardWriter",
    "group_samples", "iter_tar_index", "iter_tar_members", "iter_tar_samples", "max_member_bytes",
    "member_name", "sample_tar_bytes", "split_key", "tar_member",
]  # fmt: skip

MAX_MEMBER_BYTES = 256 << 20
"""The default bound on one member read into memory: far above any image a dataset holds."""
MAX_META_BYTES = 1 << 20  # a PAX header or GNU long name: a path and a few numbers
MAX_MEMBER_ENV = "GPUFEED_MAX_MEMBER_BYTES"


def max_member_bytes() -> int:
    """The bound on one tar member read into memory: $GPUFEED_MAX_MEMBER_BYTES, else `MAX_MEMBER_BYTES`.

    Raises:
        ConfigError: the variable is set to something that is not a positive integer.
    """
    return byte_bound(MAX_MEMBER_ENV, MAX_MEMBER_BYTES, "tar member")


_CHUNK = 1 << 20  # read shards 1 MB at a time into one reused buffer: no fresh pages per read
_spare_buffers: list[bytearray] = []
_spare_buffers_lock = threading.Lock()


def _take_buffer() -> bytearray:
    """A read buffer: a spare one, whose pages are already mapped, else a new one."""
    with _spare_buffers_lock:
        if _spare_buffers and len(_spare_buffers[-1]) == _CHUNK:
            return _spare_buffers.pop()
    return bytearray(_CHUNK)


def _give_back(buffer: bytearray) -> None:
    with _spare_buffers_lock:
        if len(_spare_buffers) < 8:
            _spare_buffers.append(buffer)



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


def iter_tar_samples(
    source: Any, url: str = "", *, max_member: int | None = None
) -> Generator[tuple[str, dict[str, bytes]], None, None]:
    """Yield (key, {extension: data}), grouping consecutive members by `split_key`.

    Args:
        source: a local path, or a binary file object open at the start of the tar.
        url: the name errors give the shard (default: the path).
        max_member: the largest member (bytes) read into memory; default
            `max_member_bytes()`.

    Raises:
        TarFormatError: on anything but a well-formed tar (see `iter_tar_members`).
    """
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as handle:
            yield from iter_tar_samples(handle, url or os.fspath(source), max_member=max_member)
        return
    limit = max_member_bytes() if max_member is None else max_member
    yield from group_samples(iter_tar_members(source, url, max_member=limit), url, limit)


def group_samples(
    members: Iterable[tuple[str, bytes]], url: str = "", max_bytes: int | None = None
) -> Generator[tuple[str, dict[str, bytes]], None, None]:
    """Yield (key, {extension: data}) from (member name, data) pairs, consecutive names of one key as one sample.

    Args:
        members: (member name, data) pairs in archive order.
        url: the name errors give the shard.
        max_bytes: the most bytes one sample may hold, all its members
            together (None: no bound), so a shard of one key's thousand
            members is not one sample held in memory whole.

    Raises:
        TarFormatError: a sample over `max_bytes`.
    """
    key: str | None = None
    sample: dict[str, bytes] = {}
    held = 0
    bound = (1 << 62) if max_bytes is None else max_bytes
    for name, data in members:
        this_key, extension = split_key(name)
        if this_key != key:
            if key is not None:
                yield key, sample
                sample = {}
                held = 0
            key = this_key
        sample[extension] = data
        held += len(data)
        if held > bound:
            raise TarFormatError(url, f"sample {this_key!r} holds over {max_bytes} bytes, the bound on one member")
    if key is not None:
        yield key, sample


def iter_tar_members(handle: Any, url: str = "", *, max_member: int | None = None) -> Iterator[tuple[str, bytes]]:
    """Yield (member name, data) of regular files, reading sequentially.

    Understands ustar, GNU long names and base-256 numbers, and PAX `path`
    and `size` records, per member (`x`) and global (`g`: for every member
    after it until another says otherwise, as POSIX has it). Reads through
    `handle.readinto` when it has one (else `read`), ahead of what it yields.

    Args:
        handle: a binary file object open at the start of the tar.
        url: the name errors give the shard.
        max_member: the largest member (bytes) read into memory; default
            `max_member_bytes()`. A PAX or long-name header holds at most
            `MAX_META_BYTES`.

    Raises:
        TarFormatError: an empty file, a header that is not a tar header (a
            number field that is no number, or out of range; a checksum that
            is not exact), a member over the bound, a malformed PAX record, a
            member cut short, or an archive that ends without its end blocks.
    """
    limit = max_member_bytes() if max_member is None else max_member
    buffer = _take_buffer()
    try:
        yield from _read_members(handle, url, buffer, limit)
    finally:
        _give_back(buffer)


def iter_tar_index(
    handle: Any, url: str = "", *, read: Callable[[str, int], bool] | None = None
) -> Iterator[tuple[str, int, int, bytes | None]]:
    """Yield (member name, data offset, size, data or None) of regular files, seeking past the data.

    For listing a shard without reading it: only headers are read (and the
    members `read` asks for), so a shard of large images costs a few
    kilobytes of reads. Every header is checked as `iter_tar_members`
    checks it; PAX and GNU long-name headers are applied the same way.

    Args:
        handle: a seekable binary file object open at the start of the tar.
        url: the name errors give the shard.
        read: called with (member name, size); where it returns True the
            member's data is read and yielded (keep it to small members),
            else the data is None.

    Raises:
        TarFormatError: an empty file, a corrupt header, a malformed PAX
            record, a member or archive cut short, or a PAX/long-name header
            over `MAX_META_BYTES`.
    """
    long_name: str | None = None
    pax: dict[str, str] = {}
    global_pax: dict[str, str] = {}
    position = 0
    first = True
    while True:
        handle.seek(position)
        header = _read_exact(handle, TAR_BLOCK)
        if len(header) < TAR_BLOCK:
            if first and not header:
                raise TarFormatError(url, "empty file (not a tar archive)")
            cut = "in a header" if header else "without the end-of-archive blocks"
            raise TarFormatError(url, f"truncated tar archive (it ends {cut})")
        first = False
        if header == ZERO_BLOCK:
            return
        size = parse_header(header, url)
        kind = header[156:157]
        start = position + TAR_BLOCK
        data: bytes | None = None
        if kind in META_KINDS:
            if size > MAX_META_BYTES:
                raise _over_bound_error(url, "a PAX or long-name header", size, MAX_META_BYTES, settable=False)
            data = _read_exact(handle, size)
            if len(data) < size:
                raise TarFormatError(url, "truncated tar member")
            long_name = take_meta(kind, data, pax, global_pax, url, long_name)
        elif kind in REGULAR_KINDS:
            size = pax_size(pax, global_pax, url, size)
            name = member_path(header, pax, global_pax, long_name)
            long_name, pax = None, {}
            if read is not None and read(name, size):
                data = _read_exact(handle, size)
                if len(data) < size:
                    raise TarFormatError(url, "truncated tar member")
            yield name, start, size, data
        else:
            size = pax_size(pax, global_pax, url, size)
            long_name, pax = None, {}
        position = start + size + (-size % TAR_BLOCK)


def _read_members(handle: Any, url: str, buffer: bytearray, limit: int) -> Iterator[tuple[str, bytes]]:
    view = memoryview(buffer)
    long_name: str | None = None  # a GNU long name, for the next member
    pax: dict[str, str] = {}  # the next member's PAX records (x)
    global_pax: dict[str, str] = {}  # every later member's (g), until a g says otherwise
    start, end = _refill(handle, buffer, 0, 0, TAR_BLOCK)  # buffer[start:end] is read and not yet parsed
    if end == 0:
        raise TarFormatError(url, "empty file (not a tar archive)")
    while True:
        if end - start < TAR_BLOCK:
            start, end = _refill(handle, buffer, start, end, TAR_BLOCK)
            if end - start < TAR_BLOCK:  # what lies beyond `end` in the reused buffer is an earlier read's
                cut = "in a header" if end > start else "without the end-of-archive blocks"
                raise TarFormatError(url, f"truncated tar archive (it ends {cut})")
        header = bytes(view[start : start + TAR_BLOCK])
        if header == ZERO_BLOCK:
            return  # the end of the archive
        try:  # the usual header, inline: octal text in every number field, the unsigned checksum right
            if header[100:156].translate(None, OCTAL_TEXT) or header[329:345].translate(None, OCTAL_TEXT):
                raise ValueError("not octal")
            size = int(header[124:136].partition(b"\0")[0], 8)
            # ASCII only: the byte sum is under 65521, so Adler-32's low half is 1 + the exact sum.
            field = header[148:156]
            if not header.isascii() or int(field.partition(b"\0")[0], 8) != (adler32(header) & 0xFFFF) - (
                adler32(field) & 0xFFFF
            ) + 256:
                raise ValueError("checksum")
        except ValueError:  # a closer look: base-256, a signed checksum, an empty field; or the error
            size = parse_header(header, url)
        kind = header[156:157]
        keep = regular = kind in REGULAR_KINDS
        if regular:
            if pax or global_pax or long_name is not None:
                size = pax_size(pax, global_pax, url, size)
                name = member_path(header, pax, global_pax, long_name)
            else:  # header_name, inline
                name = header[:100].partition(b"\0")[0].decode("utf-8", "replace")
                if header[345] and header[257:262] == b"ustar":
                    name = header_name(header)
            if size > limit:
                raise _over_bound_error(url, f"tar member {name!r}", size, limit)
        elif kind in META_KINDS:
            keep = True
            if size > MAX_META_BYTES:
                raise _over_bound_error(url, "a PAX or long-name header", size, MAX_META_BYTES, settable=False)
        else:  # read past: a folder, a link, a device
            size = pax_size(pax, global_pax, url, size)
            if size > limit:
                raise _over_bound_error(url, "a tar member", size, limit)
        padded = size + (-size % TAR_BLOCK)
        whole = TAR_BLOCK + padded
        if end - start < whole and whole <= len(buffer):
            start, end = _refill(handle, buffer, start, end, whole)
        if end - start >= TAR_BLOCK + size:
            data = bytes(view[start + TAR_BLOCK : start + TAR_BLOCK + size]) if keep else b""
            start = min(end, start + whole)
        else:  # larger than the buffer, or cut short: what is here, then the rest straight from the file
            here = end - start - TAR_BLOCK
            if keep:
                data = bytes(view[start + TAR_BLOCK : end]) + _read_exact(handle, size - here)
                got = len(data)
            else:
                data, got = b"", here + _skip(handle, buffer, size - here)
            start = end = 0
            if got < size:
                raise TarFormatError(url, "truncated tar member")
            _skip(handle, buffer, padded - size)  # a cut here shows as a truncated archive at the next header
        if regular:
            long_name = None
            if pax:
                pax = {}
            yield name, data
            continue
        if kind in META_KINDS:
            long_name = take_meta(kind, data, pax, global_pax, url, long_name)
            continue
        long_name = None
        pax = {}


def _over_bound_error(url: str, what: str, size: int, bound: int, *, settable: bool = True) -> TarFormatError:
    hint = f" (set {MAX_MEMBER_ENV} to read larger ones)" if settable else ""
    return TarFormatError(url, f"{what} holds {size} bytes, over the bound of {bound} bytes on one member{hint}")


def _read_into(handle: Any, view: memoryview) -> int:
    """Read into `view` through `readinto` where the file has one, else `read`; bytes read (0 at the end)."""
    if hasattr(handle, "readinto"):
        return handle.readinto(view) or 0
    chunk = handle.read(len(view))
    view[: len(chunk)] = chunk
    return len(chunk)


def _refill(handle: Any, buffer: bytearray, start: int, end: int, need: int) -> tuple[int, int]:
    """Move buffer[start:end] to the front and read until `need` bytes are there (or the file ends)."""
    kept = end - start
    view = memoryview(buffer)
    if start:
        view[:kept] = view[start:end]
    while kept < need:
        got = _read_into(handle, view[kept:])
        if not got:
            break
        kept += got
    return 0, kept


def _read_exact(handle: Any, count: int) -> bytes:
    """`count` bytes from the file, fewer only where it ends."""
    data: bytes = handle.read(count)
    if len(data) == count or not data:
        return data
    parts = [data]
    got = len(data)
    while got < count:
        more = handle.read(count - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _skip(handle: Any, buffer: bytearray, count: int) -> int:
    """Read and drop `count` bytes through `buffer` (memory stays flat); how many there were."""
    view = memoryview(buffer)
    left = count
    while left > 0:
        got = _read_into(handle, view[: min(left, len(buffer))])
        if not got:
            break
        left -= got
    return count - left
