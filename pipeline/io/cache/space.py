"""The shard cache's space: counted across processes, room for a fill reserved or refused, nothing evicted.

Complete shards plus the fills in flight never exceed the bound: the space is
counted under ``DIR/cache.lock`` (every process of the machine takes it), and
a fill is admitted only with its whole size reserved, as its partial file
named with that size. When the next shard does not fit, the cache keeps what
it holds and that shard is read from the store: nothing is evicted, so a
dataset larger than the cache keeps a stable subset cached. `prune` is the
one way shards leave: those a dataset no longer lists.

A count removes the partial files of dead fills: a live fill holds its
shard's lock, a dead one's lock is free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
from collections.abc import Callable, Iterable, Iterator

from ...units import format_bytes
from .files import DIGEST, CacheFolder, ShardEntry, checked_digest, list_folder, lock, remove_file, try_lock, unlock

COMPLETE, FULL = "complete", "full"  # what `CacheSpace.reserve` says instead of giving room

_PARTIAL_NAME = re.compile(r"(?P<digest>[0-9a-f]{64})-(?P<size>\d+)\.(?:part|done)")


@dataclasses.dataclass(frozen=True)
class CacheUsage:
    """What a shard cache holds now (all processes together).

    Attributes:
        directory: the cache folder.
        max_bytes: its bound.
        used_bytes: bytes of complete shards plus those reserved by the fills in flight.
        shards: complete shards.
        filling: fills in flight.
    """

    directory: str
    max_bytes: int
    used_bytes: int
    shards: int
    filling: int


class CacheSpace:
    """The space of one cache folder under its bound (see the module)."""

    def __init__(self, folder: CacheFolder, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes

    def holds(self, digest: str, size: int) -> bool:
        """Whether the shard is cached complete (its size checked, not its bytes)."""
        try:
            return os.path.getsize(self.folder.shard_path(digest)) == size
        except OSError:
            return False

    def reserve(self, shard: ShardEntry, on_full: Callable[[int, int], None]) -> int | str:
        """With the shard's lock held: a new partial file for its fill (a descriptor), or COMPLETE, or FULL.

        Args:
            shard: the shard to fill.
            on_full: called with (bytes used, complete shards) when it does not fit.
        """
        with self.locked():
            if self.holds(shard.digest, shard.size):
                return COMPLETE
            for kind in ("part", "done"):  # a dead filler's leftovers: we hold the lock now
                remove_file(self.folder.partial_path(shard, kind))
            used, shards, _ = self.count(exclude=shard.digest)
            if used + shard.size > self.max_bytes:
                on_full(used, shards)
                return FULL
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            return os.open(self.folder.partial_path(shard, "part"), flags, 0o644)

    def usage(self) -> CacheUsage:
        """What the cache holds now, counted under its lock (removing what dead fillers left)."""
        with self.locked():
            used, shards, filling = self.count(exclude="")
        return CacheUsage(self.folder.directory, self.max_bytes, used, shards, filling)

    def prune(self, keep: Iterable[str]) -> int:
        """Remove the cached shards whose sha256 is not in `keep`; the bytes freed (see `ShardCache.prune`)."""
        kept = {checked_digest(digest) for digest in keep}
        freed = 0
        with self.locked():
            for entry in list_folder(self.folder.shards):
                digest = entry.name[: -len(".tar")]
                if not entry.name.endswith(".tar") or digest in kept or not DIGEST.fullmatch(digest):
                    continue
                shard_lock = try_lock(self.folder.lock_path(digest))
                if shard_lock is None:
                    continue
                try:
                    size = entry.stat().st_size
                    os.unlink(entry.path)
                    freed += size
                except FileNotFoundError:
                    pass
                finally:
                    remove_file(self.folder.check_path(digest))
                    unlock(shard_lock)
        return freed

    def count(self, exclude: str) -> tuple[int, int, int]:
        """(bytes used, complete shards, fills) with the space lock held; removes partial files of dead fills."""
        used = filling = 0
        reserved: set[str] = set()
        # The partial files before the shards: a fill published meanwhile is seen in both, and counted once.
        for entry in list_folder(self.folder.partial):
            match = _PARTIAL_NAME.fullmatch(entry.name)
            if match is None or match["digest"] == exclude:
                continue
            fill_lock = try_lock(self.folder.lock_path(match["digest"]))
            if fill_lock is None:
                used += int(match["size"])  # a live fill's reservation
                filling += 1
                reserved.add(match["digest"])
                continue
            try:
                remove_file(entry.path)
            finally:
                unlock(fill_lock)
        shards = 0
        for entry in list_folder(self.folder.shards):
            if entry.name.endswith(".tar") and entry.name[: -len(".tar")] not in reserved:
                with contextlib.suppress(FileNotFoundError):
                    used += entry.stat().st_size
                    shards += 1
        return used, shards, filling

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold ``DIR/cache.lock``: the space is counted and reserved by one process at a time."""
        fd = lock(self.folder.space_lock)
        try:
            yield
        finally:
            unlock(fd)

    def full_warning(self, used: int, shards: int) -> str:
        """What the cache says, once, when a shard does not fit."""
        return (
            f"shard cache {self.folder.directory} is full ({format_bytes(used)} in {shards} shards, the bound is "
            f"{format_bytes(self.max_bytes)}): it keeps those and the other shards are read from the store, "
            "without evicting anything"
        )


def unwritable_warning(directory: str, exc: OSError) -> str:
    """What the cache says, once, when writing it failed: a full disk or quota, or a folder it cannot write."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = f"no space left on its device ({exc.strerror})"
    else:
        reason = f"it cannot be written ({exc.strerror or exc})"
    return f"shard cache {directory}: {reason}; the shards it does not hold are read from the store from now on"
