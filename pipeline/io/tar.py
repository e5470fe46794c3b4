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
import re
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, BinaryIO
from zlib import adler32

from ..errors import GpufeedError, StorageError, write_failure
from .fs import byte_bound, temp_suffix

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


class TarFormatError(GpufeedError, ValueError):
    """A shard is not a well-formed tar (a corrupt header, a member cut short): the rest of it cannot be trusted.

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
        yield from _members(handle, url, buffer, limit)
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
        if header == _ZERO_BLOCK:
            return
        size = _parse_header(header, url)
        kind = header[156:157]
        start = position + TAR_BLOCK
        data: bytes | None = None
        if kind in _META:
            if size > MAX_META_BYTES:
                raise _over_bound(url, "a PAX or long-name header", size, MAX_META_BYTES, settable=False)
            data = _read_exact(handle, size)
            if len(data) < size:
                raise TarFormatError(url, "truncated tar member")
            long_name = _take_meta(kind, data, pax, global_pax, url, long_name)
        elif kind in _KEPT:
            size = _pax_size(pax, global_pax, url, size)
            name = _member_path(header, pax, global_pax, long_name)
            long_name, pax = None, {}
            if read is not None and read(name, size):
                data = _read_exact(handle, size)
                if len(data) < size:
                    raise TarFormatError(url, "truncated tar member")
            yield name, start, size, data
        else:
            size = _pax_size(pax, global_pax, url, size)
            long_name, pax = None, {}
        position = start + size + (-size % TAR_BLOCK)


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




_KEPT = (b"0", b"\0", b"7")  # regular files: the members yielded
_META = (b"x", b"g", b"L", b"K")  # PAX headers and GNU long names: read, applied to what follows
# mode, uid, gid (8 bytes each), size, mtime (12 each); devmajor, devminor (8 each): octal text
# ended by NUL or space, or GNU base-256 (first byte 0x80, or 0xff for a negative number).
_NUMBER8 = rb"(?:[0-7 \0]{8}|[\x80\xff].{7})"
_NUMBERS = re.compile(rb"%s{3}(?:[0-7 \0]{12}|[\x80\xff].{11}){2}.{181}%s{2}" % (_NUMBER8, _NUMBER8), re.DOTALL)
_OCTAL_TEXT = b"01234567 \0"
_HIGH_BYTES = bytes(range(128, 256))
_DECIMAL = re.compile(r"[0-9]{1,20}")


def _members(handle: Any, url: str, buffer: bytearray, limit: int) -> Iterator[tuple[str, bytes]]:
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
        if header == _ZERO_BLOCK:
            return  # the end of the archive
        try:  # the usual header, inline: octal text in every number field, the unsigned checksum right
            if header[100:156].translate(None, _OCTAL_TEXT) or header[329:345].translate(None, _OCTAL_TEXT):
                raise ValueError("not octal")
            size = int(header[124:136].partition(b"\0")[0], 8)
            # ASCII only: the byte sum is under 65521, so Adler-32's low half is 1 + the exact sum.
            field = header[148:156]
            if not header.isascii() or int(field.partition(b"\0")[0], 8) != (adler32(header) & 0xFFFF) - (
                adler32(field) & 0xFFFF
            ) + 256:
                raise ValueError("checksum")
        except ValueError:  # a closer look: base-256, a signed checksum, an empty field; or the error
            size = _parse_header(header, url)
        kind = header[156:157]
        keep = regular = kind in _KEPT
        if regular:
            if pax or global_pax or long_name is not None:
                size = _pax_size(pax, global_pax, url, size)
                name = _member_path(header, pax, global_pax, long_name)
            else:  # _header_name, inline
                name = header[:100].partition(b"\0")[0].decode("utf-8", "replace")
                if header[345] and header[257:262] == b"ustar":
                    name = _header_name(header)
            if size > limit:
                raise _over_bound(url, f"tar member {name!r}", size, limit)
        elif kind in _META:
            keep = True
            if size > MAX_META_BYTES:
                raise _over_bound(url, "a PAX or long-name header", size, MAX_META_BYTES, settable=False)
        else:  # read past: a folder, a link, a device
            size = _pax_size(pax, global_pax, url, size)
            if size > limit:
                raise _over_bound(url, "a tar member", size, limit)
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
        if kind in _META:
            long_name = _take_meta(kind, data, pax, global_pax, url, long_name)
            continue
        long_name = None
        pax = {}


def _over_bound(url: str, what: str, size: int, bound: int, *, settable: bool = True) -> TarFormatError:
    hint = f" (set {MAX_MEMBER_ENV} to read larger ones)" if settable else ""
    return TarFormatError(url, f"{what} holds {size} bytes, over the bound of {bound} bytes on one member{hint}")


def _parse_header(header: bytes, url: str) -> int:
    """The size field of a header whose numbers and checksum are exactly right.

    Three parts of the header (148, 248 and 108 bytes around the checksum
    field) each sum to under 65521, so zlib's Adler-32, whose low half is
    1 + the byte sum mod 65521, gives each part's exact sum in C: the
    checksum is their sum plus the field as 8 spaces (256), -3 for the three
    ones. `_members` checks the usual header inline: octal text in every
    number field, ASCII only (so one Adler-32 over the whole header is exact).
    """
    try:
        checksum_ok = _header_checksum_ok(header, _octal(header[148:156]))
    except ValueError:
        checksum_ok = False
    if not checksum_ok:
        raise TarFormatError(url, "corrupt tar header (checksum mismatch)")
    try:
        if _NUMBERS.fullmatch(header, 100, 345) is None:
            raise ValueError("not a number")
        size = _number(header[124:136])
    except ValueError:
        raise TarFormatError(url, "corrupt tar header (a number field is not a number)") from None
    if size < 0:
        raise TarFormatError(url, "corrupt tar header (negative size)")
    return size


def _member_path(header: bytes, pax: dict[str, str], global_pax: dict[str, str], long_name: str | None) -> str:
    """A member's name: its PAX path, else its GNU long name, else a global PAX path, else the header's."""
    path = pax.get("path")
    if path is None:
        path = long_name if long_name is not None else global_pax.get("path")
    if path:  # an empty PAX path deletes it: the header's name holds
        return path.rstrip("/")  # as tarfile reads it
    return _header_name(header)


def _header_name(header: bytes) -> str:
    """The name a ustar header holds: its prefix field, a slash and its name field (or the name alone)."""
    name = _text(header[:100])
    if header[345] and header[257:262] == b"ustar":
        name = _text(header[345:500]) + "/" + name
    return name


def _pax_size(pax: dict[str, str], global_pax: dict[str, str], url: str, size: int) -> int:
    """A member's size: its PAX `size` record (or a global one) where there is one, else its header's."""
    value = pax.get("size", global_pax.get("size"))
    if not value:
        return size
    if not _DECIMAL.fullmatch(value):
        raise TarFormatError(url, f"corrupt PAX header (size {value[:40]!r} is not a number)")
    return int(value)


def _take_meta(
    kind: bytes, data: bytes, pax: dict[str, str], global_pax: dict[str, str], url: str, long_name: str | None
) -> str | None:
    """A metadata member read: a GNU long name (returned), PAX records for the next member, or global ones."""
    if kind == b"L":
        return _text(data)
    if kind == b"x":
        pax.update(_pax_records(data, url))
    elif kind == b"g":
        for keyword, value in _pax_records(data, url).items():
            if value:
                global_pax[keyword] = value
            else:  # POSIX: an empty value deletes the keyword
                global_pax.pop(keyword, None)
    return long_name


def _pax_records(data: bytes, url: str) -> dict[str, str]:
    """The records of a PAX header: `LENGTH KEYWORD=VALUE\\n`, LENGTH counting the whole record.

    Raises:
        TarFormatError: a record that is not one (NUL padding after the last is allowed).
    """
    records: dict[str, str] = {}
    position = 0
    while position < len(data):
        if data[position] == 0 and not data[position:].strip(b"\0"):
            break
        space = data.find(b" ", position, position + 21)
        digits = data[position:space] if space > position else b""
        length = int(digits) if digits.isdigit() else 0
        stop = position + length
        keyword, equals, value = data[space + 1 : stop - 1].partition(b"=")
        if not length or stop > len(data) or data[stop - 1] != 0x0A or not equals or not keyword:
            raise TarFormatError(url, "corrupt PAX header (a record is not LENGTH KEYWORD=VALUE)")
        records[keyword.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        position = stop
    return records


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


def _number(field: bytes) -> int:
    """A numeric header field: octal text, or GNU base-256 (0x80: positive, 0xff: negative, two's complement).

    Raises:
        ValueError: when the field is neither.
    """
    if not field[0] & 0x80:
        return _octal(field)
    if field[0] not in (0x80, 0xFF):
        raise ValueError("not base-256")
    value = int.from_bytes(field[1:], "big")
    return value - (1 << (8 * (len(field) - 1))) if field[0] == 0xFF else value


def _octal(field: bytes) -> int:
    """Octal text up to the first NUL, spaces around it (as tar writes it); empty is 0.

    Raises:
        ValueError: anything else (a sign, an underscore, a non-octal digit).
    """
    text = field.partition(b"\0")[0]
    if text.translate(None, _OCTAL_TEXT):  # a sign, an underscore: what int() would take, tar not
        raise ValueError("not octal")
    return int(text, 8) if text.strip(b" ") else 0  # int() refuses a space between digits


def _header_checksum_ok(header: bytes, stored: int) -> bool:
    """The tar checksum, exactly: the header's byte sum with the checksum field as spaces, unsigned or signed.

    POSIX sums the bytes unsigned; some old tars summed them signed, and tar
    accepts either (see `_parse_header` for the sum).
    """
    unsigned = (adler32(header[:148]) & 0xFFFF) + (adler32(header[156:404]) & 0xFFFF) + (adler32(header[404:]) & 0xFFFF) + 253
    if stored == unsigned:
        return True
    field = header[148:156]
    high = len(header) - len(header.translate(None, _HIGH_BYTES)) - (len(field) - len(field.translate(None, _HIGH_BYTES)))
    return stored == unsigned - 256 * high


def _text(field: bytes) -> str:
    """A NUL-terminated name field, as tarfile reads it (up to the first NUL)."""
    return field.partition(b"\0")[0].decode("utf-8", "replace")
