"""Shard planning and crash-safe, reproducible tar writing.

The plan maps output positions to listing indices through a seeded
pseudo-random permutation (a small Feistel network with cycle walking), so a
shard's members are computed on demand: shuffling millions of samples across
shards needs no in-memory list. Shards are tar files written to a hidden
temporary name, fsynced and renamed, with fixed metadata so identical jobs
give identical bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tarfile
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from .errors import StorageError, write_failure

TAR_MTIME = 946684800  # 2000-01-01: fixed so equal jobs give equal tars
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Which listing indices go into which shard.

    Attributes:
        items: number of listed sources.
        samples_per_shard: planned positions per shard (rejects leave gaps).
        seed: permutation seed.
    """

    items: int
    samples_per_shard: int
    seed: int

    @property
    def shards(self) -> int:
        return max(1, -(-self.items // self.samples_per_shard)) if self.items else 0

    def positions(self, shard: int) -> range:
        start = shard * self.samples_per_shard
        return range(start, min(self.items, start + self.samples_per_shard))

    def indices(self, shard: int) -> np.ndarray:
        """Listing indices of the shard's members, in write order."""
        span = self.positions(shard)
        return permute(np.arange(span.start, span.stop, dtype=np.uint64), self.items, self.seed)

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    # splitmix64 finaliser: a good 64-bit mixing function, vectorised.
    with np.errstate(over="ignore"):
        z = (values + key) & _MASK64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return z ^ (z >> np.uint64(31))


def permute(positions: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A seeded bijection of range(n) applied to `positions` (uint64 array).

    A balanced Feistel network permutes [0, 4^k) with 4^k >= n; values that
    land outside [0, n) are walked again until they fall inside (cycle walking
    keeps it a bijection of [0, n)).
    """
    if n <= 1:
        return positions.astype(np.int64)
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half_bits) - 1)
    keys = [np.uint64((seed * 0x9E3779B97F4A7C15 + round_ * 0xD1B54A32D192ED03) & 0xFFFFFFFFFFFFFFFF) for round_ in range(4)]

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half_bits), x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & mask)
        return (left << np.uint64(half_bits)) | right

    out = encrypt(positions.astype(np.uint64))
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = encrypt(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


def temp_suffix() -> str:
    """`.tmp-HOST-PID`: unique among writers on every machine that shares OUT."""
    import socket

    return f".tmp-{socket.gethostname()}-{os.getpid()}"


def plan_shards(items: int, samples_per_shard: int, seed: int) -> ShardPlan:
    """A ShardPlan of `items` sources with at most `samples_per_shard` per shard."""
    return ShardPlan(items=items, samples_per_shard=max(1, samples_per_shard), seed=seed)


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


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


def file_sha256(path: str, chunk: int = 4 * 1024 * 1024) -> tuple[str, int]:
    """(sha256 hex, size) of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def iter_tar_samples(path: str) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Yield (key, {extension: bytes}) from a shard, grouping members like WebDataset."""
    current: str | None = None
    members: dict[str, bytes] = {}
    with tarfile.open(path, "r:") as tar:
        for info in tar:
            if not info.isfile():
                continue
            name = info.name.rsplit("/", 1)[-1]
            key, _, extension = name.partition(".")
            if key != current and current is not None:
                yield current, members
                members = {}
            current = key
            handle = tar.extractfile(info)
            members[extension] = handle.read() if handle else b""
    if current is not None:
        yield current, members
