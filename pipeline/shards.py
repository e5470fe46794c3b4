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
import io
import os
import tarfile
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from .errors import StorageError

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


class _HashingFile:
    """Counts and hashes every byte on its way to the real file."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes) -> int:
        self.raw.write(data)
        self.sha256.update(data)
        self.bytes += len(data)
        return len(data)

    def tell(self) -> int:
        return self.bytes


class TarShardWriter:
    """Write one shard: members go to a hidden temp file; `commit` renames it into place.

    Use as a context manager: leaving the block without `commit` (an
    exception, a cancelled job) removes the temp file, so a partial shard
    never has a shard's name.
    """

    def __init__(self, final_path: str, opener: Any = None) -> None:
        self.final_path = final_path
        directory, name = os.path.split(final_path)
        self.temp_path = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
        self.samples = 0
        self._raw: BinaryIO | None = None
        self._hashing: _HashingFile | None = None
        self._tar: tarfile.TarFile | None = None

    def __enter__(self) -> TarShardWriter:
        try:
            os.makedirs(os.path.dirname(self.final_path) or ".", exist_ok=True)
            self._raw = open(self.temp_path, "wb")
        except OSError as exc:
            raise StorageError(f"cannot create {self.temp_path}: {exc.strerror or exc}") from exc
        self._hashing = _HashingFile(self._raw)
        self._tar = tarfile.TarFile(fileobj=self._hashing, mode="w", format=tarfile.USTAR_FORMAT)  # type: ignore[arg-type]
        return self

    def write_sample(self, key: str, members: dict[str, bytes]) -> None:
        """Add one sample: `members` maps extension (e.g. "jpg") to bytes."""
        assert self._tar is not None
        try:
            for extension in sorted(members):
                data = members[extension]
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size = len(data)
                info.mtime = TAR_MTIME
                info.mode = 0o644
                info.uname = info.gname = ""
                self._tar.addfile(info, io.BytesIO(data))
        except OSError as exc:
            raise StorageError(_write_failure(self.final_path, exc)) from exc
        self.samples += 1

    def commit(self, relative_path: str, variant: int | None = None) -> ShardInfo:
        """Finish the tar, make it durable, rename it to its final name."""
        assert self._tar is not None and self._raw is not None and self._hashing is not None
        try:
            self._tar.close()
            self._raw.flush()
            os.fsync(self._raw.fileno())
            self._raw.close()
            os.replace(self.temp_path, self.final_path)
        except OSError as exc:
            raise StorageError(_write_failure(self.final_path, exc)) from exc
        self._tar = None
        return ShardInfo(relative_path, self.samples, self._hashing.bytes, self._hashing.sha256.hexdigest(), variant)

    def __exit__(self, *exc_info: object) -> None:
        if self._raw is not None and not self._raw.closed:
            self._raw.close()
        if os.path.exists(self.temp_path):
            os.unlink(self.temp_path)


def _write_failure(path: str, exc: OSError) -> str:
    import errno

    if exc.errno == errno.ENOSPC:
        return f"no space left on the device while writing {path}; free some space and run the same command again to resume"
    return f"cannot write {path}: {exc.strerror or exc}"


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
