"""How the loader opens shards: local files as they are, remote shards read ahead, through a local cache if given.

An epoch reads its rank's shards in a known order (`epoch.py`), so when one
shard is opened the next ones are known too. `ShardOpener.open` gets them:

- a **local** shard is opened as a plain file; nothing else happens (the
  local read path is the same with or without this module);
- a **remote** shard with a cache folder goes through `ShardCache`: opening
  it streams it into the cache (or reads the cached copy), and the next
  `CACHE_AHEAD` shards of the order are prefetched into the cache while the
  current ones decode. Later epochs read the cached copies; a cache too small
  keeps what it holds and the rest comes from the store;
- a **remote** shard without a cache is read from the store, and the next
  `MEMORY_AHEAD` shard is downloaded into memory by a background thread
  meanwhile, so the next open does not wait for the store's latency. At most
  `MEMORY_AHEAD` shards are held in memory (plus the ones open).

Failures surface where a shard is opened or read (an `OSError` or a gpufeed
error), which the reading side turns into damage (`damage.py`).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

from ..io.cache.shards import ShardCache
from ..io.fs import local_path, open_fs, store_errors
from .dataset import ShardRef, open_shard

CACHE_AHEAD = 4  # shards of the order prefetched into the cache past the one being opened
MEMORY_AHEAD = 1  # remote shards read ahead into memory without a cache
STORE_BLOCK = 1 << 22  # the store file's read-ahead block while streaming a shard


class ShardOpener:
    """Opens an epoch's shards in order, reading remote ones ahead (see the module).

    Args:
        storage_options: fsspec options for the store (endpoint, profile, anonymous access).
        cache: the local shard cache remote shards stream into; None reads them from the store.
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None, cache: ShardCache | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.cache = cache
        self.ahead = CACHE_AHEAD if cache is not None else MEMORY_AHEAD
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._in_memory: dict[str, Future[bytes]] = {}

    def open(self, shard: ShardRef, upcoming: Sequence[ShardRef] = ()) -> BinaryIO:
        """A binary file object over `shard`; `upcoming` are the shards the epoch opens after it, in order.

        Raises:
            ManifestError: a local shard that cannot be opened.
            OSError: a remote shard that cannot be opened or read.
            SourceError: the cache's store cannot be read.
        """
        if local_path(shard.url) is not None:
            return open_shard(shard.url)
        remote = [s for s in upcoming[: self.ahead] if local_path(s.url) is None]
        if self.cache is not None and shard.sha256 and shard.bytes is not None:
            # the next shards' fills start first: at an epoch's start the interleaved shards are opened
            # one after another, and each would otherwise wait for its own download in turn
            self.cache.prefetch((s.url, s.sha256, s.bytes) for s in remote if s.sha256 and s.bytes is not None)
            return self.cache.open(shard.url, shard.sha256, shard.bytes)
        ready = self._read_ahead(shard, remote)
        if ready is not None:
            return io.BytesIO(_downloaded(ready, shard.url))
        fs, path = open_fs(shard.url, self.storage_options)
        return fs.open(path, "rb", block_size=STORE_BLOCK)

    def _read_ahead(self, shard: ShardRef, upcoming: Sequence[ShardRef]) -> Future[bytes] | None:
        """The download of `shard` already under way (None if not), and downloads started for `upcoming`."""
        with self._lock:
            ready = self._in_memory.pop(shard.url, None)
            wanted = {s.url for s in upcoming}
            for url in [u for u in self._in_memory if u not in wanted]:  # out of the window: no longer needed
                self._in_memory.pop(url).cancel()
            for upcoming_shard in upcoming:
                if upcoming_shard.url not in self._in_memory:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(MEMORY_AHEAD, thread_name_prefix="gpufeed-read-ahead")
                    self._in_memory[upcoming_shard.url] = self._pool.submit(self._download, upcoming_shard.url)
        return ready

    def _download(self, url: str) -> bytes:
        fs, path = open_fs(url, self.storage_options)
        return fs.cat_file(path)

    def close(self) -> None:
        """Drop the read-ahead in memory and wait for the cache's fills in flight in this process."""
        with self._lock:
            pool, self._pool = self._pool, None
            for future in self._in_memory.values():
                future.cancel()
            self._in_memory.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if self.cache is not None:
            self.cache.close()


def _downloaded(future: Future[bytes], url: str) -> bytes:
    """The bytes a read-ahead fetched; its failure as an OSError naming the shard."""
    try:
        return future.result()
    except OSError:
        raise
    except store_errors() as exc:
        raise OSError(f"cannot read shard {url}: {exc}") from exc

