"""The tar writer for WebDataset shards: members built by hand, a hidden temporary file, fsync and rename.

POSIX (ustar) members with fixed metadata, named by the key rule
(`member_name`), so identical jobs give identical bytes; a shard is written
to a hidden temporary name, fsynced and renamed, so a partial shard never
has a shard's name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any, BinaryIO

from ..errors import StorageError, write_failure
from .fs import temp_suffix
from .tar_format import TAR_BLOCK, member_name

TAR_MTIME = 946684800  # 2000-01-01: fixed so equal jobs give equal tars
TAR_RECORD = 10240  # tar's default record: archives are padded to a multiple of it


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
        self._temp_file: BinaryIO | None = None

    def __enter__(self) -> TarShardWriter:
        try:
            os.makedirs(os.path.dirname(self.final_path) or ".", exist_ok=True)
            self._temp_file = open(self.temp_path, "wb")
        except OSError as exc:
            raise StorageError(f"cannot create {self.temp_path}: {exc.strerror or exc}") from exc
        return self

    def _write(self, data: bytes) -> None:
        assert self._temp_file is not None
        try:
            self._temp_file.write(data)
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
        assert self._temp_file is not None
        end = 2 * TAR_BLOCK
        end += -(self.bytes + end) % TAR_RECORD
        self._write(b"\0" * end)
        try:
            self._temp_file.flush()
            os.fsync(self._temp_file.fileno())
            self._temp_file.close()
        except OSError as exc:
            raise write_failure(self.final_path, exc) from exc
        return ShardInfo(relative_path, self.samples, self.bytes, self._sha256.hexdigest(), variant)

    def _rename(self) -> None:
        try:
            os.replace(self.temp_path, self.final_path)
        except OSError as exc:
            raise write_failure(self.final_path, exc) from exc

    def __exit__(self, *exc_info: object) -> None:
        if self._temp_file is not None and not self._temp_file.closed:
            try:
                self._temp_file.close()
            except OSError:
                pass  # the temp file is being discarded; a full disk may refuse the final flush
        if os.path.exists(self.temp_path):
            os.unlink(self.temp_path)
