"""Filling the shard cache: a shard fetched from the store into its partial file under its lock, checked, published.

A fill holds ``flock`` on ``DIR/locks/<sha256>.lock`` from start to end, with
the shard's whole size reserved (`space`). A thread downloads the shard
into ``DIR/partial/`` (`copy_from_store`, the one place that reads a remote
shard for the cache); its readers, and any other opener of the same shard,
follow it as it lands (`follow`). When the download ends its size and
sha256 are checked against the manifest's; only then is the file fsynced,
renamed to its final name and recorded (`verify`). A mismatch or a
failed download leaves no file. When writing the cache fails (no space left,
quota, read-only) the fill is dropped with its partial file, its readers go
on from the store, and the cache serves every shard it does not hold from the
store until it is made again.

`ShardFills` is what one process of a `ShardCache` does: its fills,
prefetches and counters, made again after a fork.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, cast

from ...errors import GpufeedError, SourceError
from ..fs import open_fs, redact_url
from ..transports import transport_for
from .files import CacheFolder, ShardEntry, remove_file, try_lock, unlock
from .follow import FillProgress, ShardReader
from .space import COMPLETE, FULL, CacheSpace, unwritable_warning
from .verify import record_check

log = logging.getLogger("gpufeed.cache")

STORE_CHUNK = 8 << 20  # the most bytes a fill asks the store for at once: few requests, bytes arrive often enough
FIRST_PIECE = 1 << 20  # a fill's first request: its readers start after one MiB, not a whole shard; then x2 a request


@dataclasses.dataclass
class CacheStats:
    """What one `ShardCache` did in this process.

    Attributes:
        hits: opens served by a complete cached shard.
        fills: shards this process downloaded, checked and published.
        followed: opens that read a fill in progress (this process's or another's).
        bypassed: opens read straight from the store (cache or disk full).
        rejected: downloads whose bytes did not match the manifest (not cached).
        prefetched: fills started by `prefetch` (counted in `fills` as well once published).
        dropped: cached shards that no longer matched the manifest when opened (removed and fetched again).
    """

    hits: int = 0
    fills: int = 0
    followed: int = 0
    bypassed: int = 0
    rejected: int = 0
    prefetched: int = 0
    dropped: int = 0


class ShardFills:
    """The fills, prefetches and counters of one shard cache in one process (see the module).

    Args:
        folder: the cache folder.
        space: its space, where a fill reserves room.
        storage_options: fsspec options for the store.
        prefetch_threads: downloads `prefetch` runs at once.
        identity: (device, inode) of a path, or None: how readers tell which name a fill's file has now.
    """

    def __init__(
        self,
        folder: CacheFolder,
        space: CacheSpace,
        storage_options: Mapping[str, Any],
        prefetch_threads: int,
        identity: Callable[[str], tuple[int, int] | None],
    ) -> None:
        self.folder = folder
        self.space = space
        self.storage_options = storage_options
        self.prefetch_threads = prefetch_threads
        self.identity = identity
        self.progress = FillProgress()
        self.unusable = False  # writing the cache failed: every shard it does not hold is read from the store
        self._state_lock = threading.Lock()
        self._prefetch_pool: ThreadPoolExecutor | None = None
        self._fill_threads: list[threading.Thread] = []
        self._queued_prefetches: set[str] = set()
        self._stats = CacheStats()
        self._said_full = False

    def start(self, shard: ShardEntry, lock: int) -> BinaryIO | None:
        """With the shard's lock held: start its fill and return a reader, or read the store; None if it is complete now."""
        try:
            admitted = self.space.reserve(shard, self._say_full)
        except OSError as exc:
            unlock(lock)
            self.cache_unwritable(exc)
            return self.from_store(shard)
        if admitted == COMPLETE:
            unlock(lock)
            return None
        if admitted == FULL:
            unlock(lock)
            return self.from_store(shard)
        assert isinstance(admitted, int)
        part = self.folder.partial_path(shard, "part")
        try:
            fill_file = open(part, "rb", buffering=0)  # noqa: SIM115 - the reader owns it
        except OSError as exc:
            os.close(admitted)
            remove_file(part)
            unlock(lock)
            self.cache_unwritable(exc)
            return self.from_store(shard)
        thread = threading.Thread(target=self._fill, args=(shard, lock, admitted), name="gpufeed-cache-fill", daemon=True)
        with self._state_lock:
            self._fill_threads = [t for t in self._fill_threads if t.is_alive()] + [thread]
            self._stats.followed += 1
        thread.start()
        return cast(BinaryIO, ShardReader(self, shard, fill_file))

    def follow(self, shard: ShardEntry) -> BinaryIO | None:
        """A reader of the fill in progress, if there is one."""
        for kind in ("part", "done"):
            try:
                fill_file = open(self.folder.partial_path(shard, kind), "rb", buffering=0)  # noqa: SIM115 - the reader owns it
            except FileNotFoundError:
                continue
            self.count("followed")
            return cast(BinaryIO, ShardReader(self, shard, fill_file))
        return None

    def from_store(self, shard: ShardEntry) -> BinaryIO:
        """A reader of the shard straight from the store."""
        self.count("bypassed")
        return cast(BinaryIO, ShardReader(self, shard, None))

    def prefetch(self, shards: Iterable[ShardEntry]) -> int:
        """Queue fills of the shards not cached, queued or being filled; how many were queued (see `ShardCache.prefetch`)."""
        queued = 0
        for shard in shards:
            if self.unusable or os.path.exists(self.folder.shard_path(shard.digest)):
                continue
            with self._state_lock:
                if shard.digest in self._queued_prefetches:
                    continue
                self._queued_prefetches.add(shard.digest)
            self._executor().submit(self._prefetch_one, shard)
            queued += 1
        return queued

    def finish(self, cancel: bool) -> None:
        """Wait for the fills in flight, the queued prefetches first dropped (`cancel`) or run."""
        with self._state_lock:
            executor, self._prefetch_pool = self._prefetch_pool, None
            threads = list(self._fill_threads)
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=cancel)
        with self._state_lock:
            self._queued_prefetches.clear()  # what is left was cancelled: a later prefetch may queue it again
        for thread in threads:
            thread.join()

    def stats(self) -> CacheStats:
        """A copy of the counters."""
        with self._state_lock:
            return dataclasses.replace(self._stats)

    def count(self, name: str) -> None:
        """Add one to the counter `name` of `CacheStats`."""
        with self._state_lock:
            setattr(self._stats, name, getattr(self._stats, name) + 1)

    def cache_unwritable(self, exc: OSError) -> None:
        """Writing the cache failed: read from the store from now on (said once)."""
        with self._state_lock:
            said, self.unusable = self.unusable, True
        if not said:
            log.warning("%s", unwritable_warning(self.folder.directory, exc))

    def _say_full(self, used: int, shards: int) -> None:
        with self._state_lock:
            said, self._said_full = self._said_full, True
        if not said:
            log.warning("%s", self.space.full_warning(used, shards))

    def _fill(self, shard: ShardEntry, lock: int, fd: int) -> None:
        """Download a shard into its partial file and publish it if it matches the manifest; owns `lock` and `fd`."""
        part, done = self.folder.partial_path(shard, "part"), self.folder.partial_path(shard, "done")
        published = False
        try:
            digest, count = copy_from_store(
                shard.url, fd, shard.size, storage_options=self.storage_options, on_chunk=lambda _: self.progress.notify()
            )
            if count == shard.size and digest == shard.digest:
                os.replace(part, done)  # the bytes are right: readers may stop waiting
                self.progress.notify()
                os.fsync(fd)
                os.replace(done, self.folder.shard_path(shard.digest))
                published = True
                self.count("fills")
                record_check(self.folder, shard.digest)
            else:
                self.count("rejected")
                log.warning(
                    "shard %s does not match its manifest entry (%d bytes, sha256 %s…; the manifest says %d bytes, %s…): not cached",
                    redact_url(shard.url), count, digest[:12], shard.size, shard.digest[:12],
                )
        except GpufeedError as exc:  # the store failed: its readers go on from the store and see the error there
            log.debug("filling %s stopped: %s", redact_url(shard.url), exc)
        except OSError as exc:
            self.cache_unwritable(exc)
        finally:
            os.close(fd)
            if not published:
                remove_file(part)
                remove_file(done)
            unlock(lock)
            self.progress.notify()

    def _prefetch_one(self, shard: ShardEntry) -> None:
        try:
            if self.unusable or os.path.exists(self.folder.shard_path(shard.digest)):
                return
            try:
                lock = try_lock(self.folder.lock_path(shard.digest))
            except OSError as exc:
                self.cache_unwritable(exc)
                return
            if lock is None:
                return  # being filled (or checked) by someone else
            try:
                admitted = self.space.reserve(shard, self._say_full)
            except OSError as exc:
                unlock(lock)
                self.cache_unwritable(exc)
                return
            if not isinstance(admitted, int):
                unlock(lock)
                return
            self.count("prefetched")
            self._fill(shard, lock, admitted)
        finally:
            with self._state_lock:
                self._queued_prefetches.discard(shard.digest)

    def _executor(self) -> ThreadPoolExecutor:
        with self._state_lock:
            if self._prefetch_pool is None:
                self._prefetch_pool = ThreadPoolExecutor(self.prefetch_threads, thread_name_prefix="gpufeed-cache-prefetch")
            return self._prefetch_pool


def copy_from_store(
    url: str,
    fd: int,
    limit: int,
    *,
    storage_options: Mapping[str, Any] | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> tuple[str, int]:
    """Stream an object from the store into an open file, hashing it on the way.

    Args:
        url: the object (an fsspec URL or a local path).
        fd: a file descriptor open for writing at the place the bytes go.
        limit: the size expected; reading stops once the object proves longer.
        storage_options: fsspec options for the store.
        on_chunk: called with the size of every chunk written (progress).

    Returns:
        (sha256 hex, bytes seen): the sha256 of what was written, and how many
        bytes the object had (more than `limit` when it is longer: only `limit`
        are written then, and the sha256 is not the object's).

    Raises:
        SourceError: the store cannot be read.
        OSError: writing the file failed (e.g. ENOSPC).
    """
    fs, path = open_fs(url, storage_options)
    transport = transport_for(fs)  # one signed GET per piece on S3, a fraction of the client CPU of s3fs's
    hasher = hashlib.sha256()
    count, piece = 0, FIRST_PIECE
    while count <= limit:
        # the last piece asks for one byte past `limit`: an object longer than the manifest says shows
        end = count + piece if count + piece < limit else limit + 1
        try:
            chunk = transport.read_range(path, count, end)
        except OSError as exc:
            if count and exc.errno == errno.EINVAL:  # 416: the object ended where the last piece did
                break
            raise SourceError(f"cannot read {redact_url(url)}: {exc}") from exc
        except GpufeedError as exc:  # the S3 client's own error names the object and the cause already
            raise SourceError(str(exc)) from exc
        except Exception as exc:
            raise SourceError(f"cannot read {redact_url(url)}: {exc}") from exc
        if not chunk:
            break
        count += len(chunk)
        if count > limit:
            break
        hasher.update(chunk)
        _write_all(fd, chunk)
        if on_chunk is not None:
            on_chunk(len(chunk))
        if len(chunk) < end - (count - len(chunk)):
            break  # the object ended
        piece = min(piece * 2, STORE_CHUNK)
    return hasher.hexdigest(), count


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
