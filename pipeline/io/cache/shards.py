"""A local cache of remote shards: filled as they stream, checked against the manifest, shared by a machine.

A loader reading ``s3://…`` shards needs two calls, and a third for read-ahead::

    cache = ShardCache("/nvme/gpufeed-cache", "500GiB", storage_options={...})
    cache.prefetch([(url, sha256, size), ...])      # optional: the next few shards
    with cache.open(url, sha256, size) as handle:   # a binary file object the tar reader takes
        for key, sample in iter_tar_samples(handle, url):
            ...
    cache.close()

`url`, `sha256` and `size` are a shard's address and its manifest entry's `sha256` and
`bytes`. `open` returns one of three things:

- **the cached shard**, a plain local file, when ``DIR/shards/<sha256>.tar`` exists;
- **the shard as it is being filled**: when it is missing and there is room, a thread
  downloads it into ``DIR/partial/`` and the handle reads the bytes as they land there
  (a tee through the page cache: the first epoch waits for the store, never for a whole
  shard). Any other opener of the same shard (another rank, another worker, a
  `prefetch`) follows that one fill instead of starting a second download. When the
  download ends, its size and sha256 are checked against the manifest's; only then is
  the file fsynced and renamed to its final name;
- **the store itself**, when the cache is full or its disk is.

What it guarantees:

- *Keyed by content*: a cached shard's name is its sha256, so a reshard that changes a
  shard changes the name, and stale bytes are never served. `prune` removes the shards
  a dataset no longer lists.
- *One download per shard on a machine*: a fill holds ``flock`` on
  ``DIR/locks/<sha256>.lock`` from start to end; a second process or thread that wants
  the same shard reads the fill in progress (it waits only where it catches up with the
  download). The fill does not depend on its readers' pace, so a rank blocked in a
  collective never stalls another rank reading the same shard.
- *Nothing partial looks complete*: a shard gets its final name only after its bytes
  matched the manifest. A mismatch or a failed download leaves no file; a filler killed
  mid-way leaves a partial file that the next fill of that shard, or the next count of
  the cache's space, removes (a live fill's lock tells them apart).
- *Bounded, without thrashing*: complete shards plus the fills in flight never exceed
  `max_bytes` (counted under ``DIR/cache.lock`` across processes). When the next shard
  does not fit, the cache keeps what it holds and that shard is read from the store;
  nothing is ever evicted, so a dataset larger than the cache keeps a stable subset
  cached instead of re-fetching every shard every epoch (what an LRU cache does when
  the dataset is slightly larger than it). This is logged once.
- *A full disk*: when writing the cache fails (no space left, quota, read-only), the
  fill is dropped with its partial file, its readers go on from the store where they
  are, the shard cache logs one warning, and it serves every shard it does not hold
  from the store until it is made again.
- *Checked bytes*: a handle that reads a shard to its end (or is closed within 4 MiB
  of the end, the tar's end padding) raises `ManifestError` there when the bytes do not
  match the manifest, and nothing is cached.
- *Cached shards checked before they are served*: a fill that publishes a shard writes
  ``DIR/checks/<sha256>.json`` (atomically, before its lock is let go): the file's size,
  inode, mtime and ctime and a hash of a few sampled blocks. Every open
  compares the cached file with it before handing out a byte (with ``verify=True`` it
  hashes the whole file with sha256 as well). A file that differs from its record (another
  file put in its place, bytes written into it, no record: a cache from an older version)
  is hashed whole under the shard's lock: when it still matches the manifest its record is
  written again, else it is removed with a warning and fetched again from the store, once,
  by whoever holds the lock, the other openers following that fill. So no opener, in any
  process, is served a cached byte that does not match the manifest; a re-fetch that does
  not match either is the store's damage (`ManifestError` at its end, as for any fill).
- *Processes*: a `ShardCache` may be made before the loader's worker processes fork;
  each process starts its own threads and store connections on first use, and a forked
  child lets go of its copies of the parent's locks at once.

Warnings go to the ``gpufeed.cache`` logger; `stats` counts what this process did.

Its parts, each a module of its own:

- `files`: the folder's layout, a shard's entry, the flocks, file helpers;
- `fill`: a fill under the shard's lock, prefetches, the download from the store;
- `follow`: a reader of a fill in progress, going on from the store where it stops;
- `verify`: the record of a cached shard, checked at every open;
- `space`: the space counted across processes, room reserved or refused, `prune`.

`ShardCache` ties them together.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, BinaryIO

from ...errors import ConfigError
from ...units import parse_bytes
from ..fs import local_path, redact_url
from .files import (
    CacheFolder,
    ShardAddress,
    ShardEntry,
    checked_digest,
    file_identity,
    lock,
    shard_entry,
    try_lock,
    unlock,
)
from .fill import CacheStats, ShardFills, copy_from_store
from .follow import POLL_MAX_S, POLL_MIN_S
from .space import CacheSpace, CacheUsage
from .verify import open_cached

__all__ = ["CacheStats", "CacheUsage", "ShardAddress", "ShardCache", "copy_from_store"]

PREFETCH_THREADS = 6  # downloads in flight: sized for the store's latency, not for the cores

# The flocks under the names this module has always given them: a shard's lock held here reads as a live fill.
_lock, _unlock = lock, unlock


class ShardCache:
    """A size-bounded local cache of remote shards, shared by the processes of one machine (see the module).

    Args:
        directory: a local folder for the cache (created if missing), ideally on NVMe.
        max_bytes: the most it may hold: bytes, or a size such as ``"500GiB"``.
        storage_options: fsspec options for the store (endpoint, profile, anonymous
            access); credentials otherwise come from the usual places.
        prefetch_threads: downloads `prefetch` runs at once.
        verify: hash every cached shard whole with sha256 against the manifest before serving
            it (without it, its size, file identity and sampled blocks are checked).

    Raises:
        ConfigError: `directory` is a URL, or `max_bytes` is not a size.
        StorageError: the folder cannot be created.
    """

    _pid: int  # the process `_fills` belongs to
    _fills: ShardFills  # made again after a fork: see _process_fills

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int | str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        prefetch_threads: int = PREFETCH_THREADS,
        verify: bool = False,
    ) -> None:
        local = local_path(os.fspath(directory))
        if local is None:
            raise ConfigError(f"the shard cache must be a local folder, not {redact_url(os.fspath(directory))}")
        if prefetch_threads < 1:
            raise ConfigError(f"prefetch_threads must be at least 1, got {prefetch_threads}")
        self.directory = os.path.abspath(local)
        self.max_bytes = parse_bytes(max_bytes)
        self.storage_options = dict(storage_options or {})
        self.prefetch_threads = prefetch_threads
        self.verify = verify
        self._folder = CacheFolder(self.directory)
        self._folder.make()
        self._space = CacheSpace(self._folder, self.max_bytes)
        self._pid = -1
        self._process_fills()

    # -- the loader's API

    def open(self, url: str, sha256: str, size: int) -> BinaryIO:
        """A binary file object reading one shard: from the cache, from a fill in progress, or from the store.

        Args:
            url: where the shard is (an fsspec URL or a local path).
            sha256: the manifest's sha256 of the shard (hex).
            size: the manifest's size of the shard in bytes.

        Returns:
            A readable, sequential binary file object; close it when done.

        Raises:
            ConfigError: `sha256` is not a hex sha256, or `size` is negative.
            SourceError: the store cannot be read.
            ManifestError: from `read` or `close`, when the shard's bytes do not match the manifest.
        """
        fills = self._process_fills()
        shard = shard_entry(url, sha256, size)
        poll = POLL_MIN_S
        while True:
            seen = fills.progress.generation
            try:
                reader = self._open_once(fills, shard)
            except OSError as exc:  # the cache folder itself fails (permissions, no inodes left, …)
                fills.cache_unwritable(exc)
                reader = None
            if reader is not None:
                return reader
            if fills.unusable:
                return fills.from_store(shard)
            fills.progress.wait(seen, poll)  # its lock is taken but no fill is there yet (or it was just published)
            poll = min(poll * 2, POLL_MAX_S)

    def _open_once(self, fills: ShardFills, shard: ShardEntry) -> BinaryIO | None:
        """One try: the cached shard, a new fill, a fill in progress, or the store; None to try again shortly."""
        cached, dropped_lock = open_cached(self._folder, shard, self.verify)
        if cached is not None:
            fills.count("hits")
            return cached
        if dropped_lock is not None:  # it changed on disk: fetched once again, under the lock the check took
            fills.count("dropped")
            return fills.start(shard, dropped_lock)
        if fills.unusable:
            return None
        fill_lock = try_lock(self._folder.lock_path(shard.digest))
        if fill_lock is not None:
            return fills.start(shard, fill_lock)
        return fills.follow(shard)

    def prefetch(self, shards: Iterable[ShardAddress]) -> int:
        """Start filling shards that are not cached yet, in the background, so `open` finds them local or in flight.

        Shards already cached, queued or being filled (by any process) are skipped;
        so is everything once the cache is full or its disk is.

        Args:
            shards: (url, sha256, size) of the next shards to be read.

        Returns:
            How many fills were queued.

        Raises:
            ConfigError: a sha256 or size is invalid.
        """
        return self._process_fills().prefetch(shard_entry(url, sha256, size) for url, sha256, size in shards)

    def wait(self) -> None:
        """Wait until the fills this process started (queued prefetches included) are done."""
        if self._pid == os.getpid():
            self._fills.finish(cancel=False)

    def close(self) -> None:
        """Drop the prefetches not started yet and wait for the fills in flight in this process."""
        if self._pid == os.getpid():
            self._fills.finish(cancel=True)

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inspecting and tidying

    def path_for(self, sha256: str) -> str:
        """Where the complete shard with this sha256 is (or would be) cached."""
        return self._folder.shard_path(checked_digest(sha256))

    def contains(self, sha256: str, size: int) -> bool:
        """Whether the shard is cached complete (its size checked, not its bytes)."""
        return self._space.holds(checked_digest(sha256), size)

    def usage(self) -> CacheUsage:
        """What the cache holds now, counted under its lock (removing what dead fillers left)."""
        return self._space.usage()

    def stats(self) -> CacheStats:
        """A copy of what this `ShardCache` did in this process."""
        return self._process_fills().stats()

    def prune(self, keep: Iterable[str]) -> int:
        """Remove the cached shards whose sha256 is not in `keep` (e.g. the current manifest's).

        A shard being filled right now is left alone; a reader that has a removed shard
        open keeps reading it.

        Args:
            keep: the sha256 of every shard to keep.

        Returns:
            The bytes freed.
        """
        return self._space.prune(keep)

    # -- this process

    def _process_fills(self) -> ShardFills:
        """The fills, threads, locks and counters of this process (fresh after a fork)."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._fills = ShardFills(self._folder, self._space, self.storage_options, self.prefetch_threads, self._identity)
        return self._fills

    def _identity(self, path: str) -> tuple[int, int] | None:
        """(device, inode) of a path, or None: how this cache's readers tell which name a fill's file has now."""
        return file_identity(path)
