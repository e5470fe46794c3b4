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
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, cast

from ..errors import ConfigError, GpufeedError, ManifestError, SourceError, StorageError
from ..units import format_bytes, parse_bytes
from .fs import local_path, open_fs, redact_url
from .transports import transport_for

log = logging.getLogger("gpufeed.cache")

STORE_CHUNK = 8 << 20  # the most bytes a fill asks the store for at once: few requests, bytes arrive often enough
FIRST_PIECE = 1 << 20  # a fill's first request: its readers start after one MiB, not a whole shard; then x2 a request
STORE_BLOCK = 8 << 20  # the store file's own read-ahead block
VERIFY_TAIL = 4 << 20  # close() reads at most this much more to check a shard (a tar's end padding is 10 KiB)
PREFETCH_THREADS = 6  # downloads in flight: sized for the store's latency, not for the cores
CHECK_BLOCKS, CHECK_BLOCK = 8, 16 << 10  # the blocks of a cached shard hashed at every open (first, last, evenly between)
# How often a reader that caught up with a fill looks again (a fill of this process wakes it at once).
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.01

_DIGEST = re.compile(r"[0-9a-f]{64}")
_PARTIAL = re.compile(r"(?P<digest>[0-9a-f]{64})-(?P<size>\d+)\.(?:part|done)")
_COMPLETE, _FULL = "complete", "full"

ShardAddress = tuple[str, str, int]
"""(url, sha256, size) of one shard: its address and its manifest entry's `sha256` and `bytes`."""


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


@dataclasses.dataclass(frozen=True)
class _Shard:
    url: str
    digest: str
    size: int


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

    # What belongs to one process (made again after a fork): see _runtime.
    _pid: int
    _state: threading.Lock
    _progress: threading.Condition
    _generation: int
    _pool: ThreadPoolExecutor | None
    _threads: list[threading.Thread]
    _pending: set[str]
    _stats: CacheStats
    _said_full: bool
    _unusable: bool

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
        self._shards = os.path.join(self.directory, "shards")
        self._partial = os.path.join(self.directory, "partial")
        self._locks = os.path.join(self.directory, "locks")
        self._checks = os.path.join(self.directory, "checks")  # <sha256>.json: what a cached shard was when filled
        try:
            for folder in (self._shards, self._partial, self._locks, self._checks):
                os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot use {self.directory} as a shard cache: {exc.strerror or exc}") from exc
        self._pid = -1
        self._runtime()

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
        self._runtime()
        shard = _shard(url, sha256, size)
        poll = _POLL_MIN_S
        while True:
            seen = self._generation
            try:
                reader = self._open_from_cache(shard)
            except OSError as exc:  # the cache folder itself fails (permissions, no inodes left, …)
                self._cache_unwritable(exc)
                reader = None
            if reader is not None:
                return reader
            if self._unusable:
                return self._from_store(shard)
            self._wait_for_progress(seen, poll)  # its lock is taken but no fill is there yet (or it was just published)
            poll = min(poll * 2, _POLL_MAX_S)

    def _open_from_cache(self, shard: _Shard) -> BinaryIO | None:
        """One try: the cached shard, a new fill, a fill in progress, or the store; None to try again shortly."""
        cached = self._open_complete(shard)
        if cached is not None or self._unusable:
            return cached
        lock = _try_lock(self._lock_path(shard))
        if lock is not None:
            return self._start_fill(shard, lock)
        return self._follow(shard)

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
        self._runtime()
        queued = 0
        for url, sha256, size in shards:
            shard = _shard(url, sha256, size)
            if self._unusable or os.path.exists(self.path_for(shard.digest)):
                continue
            with self._state:
                if shard.digest in self._pending:
                    continue
                self._pending.add(shard.digest)
            self._executor().submit(self._prefetch_one, shard)
            queued += 1
        return queued

    def wait(self) -> None:
        """Wait until the fills this process started (queued prefetches included) are done."""
        self._finish(cancel=False)

    def close(self) -> None:
        """Drop the prefetches not started yet and wait for the fills in flight in this process."""
        self._finish(cancel=True)

    def _finish(self, cancel: bool) -> None:
        if self._pid != os.getpid():
            return
        with self._state:
            executor, self._pool = self._pool, None
            threads = list(self._threads)
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=cancel)
        with self._state:
            self._pending.clear()  # what is left was cancelled: a later prefetch may queue it again
        for thread in threads:
            thread.join()

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inspecting and tidying

    def path_for(self, sha256: str) -> str:
        """Where the complete shard with this sha256 is (or would be) cached."""
        return os.path.join(self._shards, f"{_check_digest(sha256)}.tar")

    def contains(self, sha256: str, size: int) -> bool:
        """Whether the shard is cached complete (its size checked, not its bytes)."""
        try:
            return os.path.getsize(self.path_for(sha256)) == size
        except OSError:
            return False

    def usage(self) -> CacheUsage:
        """What the cache holds now, counted under its lock (removing what dead fillers left)."""
        with self._space_lock():
            used, shards, filling = self._count_space(exclude="")
        return CacheUsage(self.directory, self.max_bytes, used, shards, filling)

    def stats(self) -> CacheStats:
        """A copy of what this `ShardCache` did in this process."""
        self._runtime()
        with self._state:
            return dataclasses.replace(self._stats)

    def prune(self, keep: Iterable[str]) -> int:
        """Remove the cached shards whose sha256 is not in `keep` (e.g. the current manifest's).

        A shard being filled right now is left alone; a reader that has a removed shard
        open keeps reading it.

        Args:
            keep: the sha256 of every shard to keep.

        Returns:
            The bytes freed.
        """
        kept = {_check_digest(digest) for digest in keep}
        freed = 0
        with self._space_lock():
            for entry in _scandir(self._shards):
                digest = entry.name[: -len(".tar")]
                if not entry.name.endswith(".tar") or digest in kept or not _DIGEST.fullmatch(digest):
                    continue
                lock = _try_lock(self._lock_path_of(digest))
                if lock is None:
                    continue
                try:
                    size = entry.stat().st_size
                    os.unlink(entry.path)
                    freed += size
                except FileNotFoundError:
                    pass
                finally:
                    _remove(self._check_path(digest))
                    _unlock(lock)
        return freed

    # -- filling

    def _start_fill(self, shard: _Shard, lock: int) -> BinaryIO | None:
        """With the shard's lock held: start its fill and return a reader, or read the store; None if it is complete now."""
        try:
            admitted = self._admit(shard)
        except OSError as exc:
            _unlock(lock)
            self._cache_unwritable(exc)
            return self._from_store(shard)
        if admitted == _COMPLETE:
            _unlock(lock)
            return None
        if admitted == _FULL:
            _unlock(lock)
            return self._from_store(shard)
        assert isinstance(admitted, int)
        part = self._partial_path(shard, "part")
        try:
            reader = open(part, "rb", buffering=0)  # noqa: SIM115 - the reader owns it
        except OSError as exc:
            os.close(admitted)
            _remove(part)
            _unlock(lock)
            self._cache_unwritable(exc)
            return self._from_store(shard)
        thread = threading.Thread(target=self._fill, args=(shard, lock, admitted), name="gpufeed-cache-fill", daemon=True)
        with self._state:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            self._stats.followed += 1
        thread.start()
        return cast(BinaryIO, _ShardReader(self, shard, reader))

    def _admit(self, shard: _Shard) -> int | str:
        """Under the space lock: a new partial file for the shard (its descriptor), or _COMPLETE, or _FULL."""
        with self._space_lock():
            if self.contains(shard.digest, shard.size):
                return _COMPLETE
            for kind in ("part", "done"):  # a dead filler's leftovers: we hold the lock now
                _remove(self._partial_path(shard, kind))
            used, shards, _ = self._count_space(exclude=shard.digest)
            if used + shard.size > self.max_bytes:
                self._say_full(used, shards)
                return _FULL
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            return os.open(self._partial_path(shard, "part"), flags, 0o644)

    def _fill(self, shard: _Shard, lock: int, fd: int) -> None:
        """Download a shard into its partial file and publish it if it matches the manifest; owns `lock` and `fd`."""
        part, done = self._partial_path(shard, "part"), self._partial_path(shard, "done")
        published = False
        try:
            digest, count = copy_from_store(
                shard.url, fd, shard.size, storage_options=self.storage_options, on_chunk=lambda _: self._notify()
            )
            if count == shard.size and digest == shard.digest:
                os.replace(part, done)  # the bytes are right: readers may stop waiting
                self._notify()
                os.fsync(fd)
                os.replace(done, self.path_for(shard.digest))
                published = True
                self._count("fills")
                self._record(shard)
            else:
                self._count("rejected")
                log.warning(
                    "shard %s does not match its manifest entry (%d bytes, sha256 %s…; the manifest says %d bytes, %s…): not cached",
                    redact_url(shard.url), count, digest[:12], shard.size, shard.digest[:12],
                )
        except GpufeedError as exc:  # the store failed: its readers go on from the store and see the error there
            log.debug("filling %s stopped: %s", redact_url(shard.url), exc)
        except OSError as exc:
            self._cache_unwritable(exc)
        finally:
            os.close(fd)
            if not published:
                _remove(part)
                _remove(done)
            _unlock(lock)
            self._notify()

    def _prefetch_one(self, shard: _Shard) -> None:
        try:
            if self._unusable or os.path.exists(self.path_for(shard.digest)):
                return
            try:
                lock = _try_lock(self._lock_path(shard))
            except OSError as exc:
                self._cache_unwritable(exc)
                return
            if lock is None:
                return  # being filled (or checked) by someone else
            try:
                admitted = self._admit(shard)
            except OSError as exc:
                _unlock(lock)
                self._cache_unwritable(exc)
                return
            if not isinstance(admitted, int):
                _unlock(lock)
                return
            self._count("prefetched")
            self._fill(shard, lock, admitted)
        finally:
            with self._state:
                self._pending.discard(shard.digest)

    # -- reading

    def _open_complete(self, shard: _Shard) -> BinaryIO | None:
        """The cached shard once it is checked (see the module), a fill replacing it if it is bad, or None."""
        try:
            handle = open(self.path_for(shard.digest), "rb", buffering=1 << 20)  # noqa: SIM115 - the caller owns it
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(handle.fileno())
            if st.st_size != shard.size:  # not ours: a fill replaces it
                handle.close()
                return None
            if self._as_recorded(shard, handle.fileno(), st) and (
                not self.verify or _sha256_of(handle.fileno(), shard.size) == shard.digest
            ):
                self._count("hits")
                return handle
        except BaseException:
            handle.close()
            raise
        handle.close()
        return self._check_whole(shard)

    def _check_whole(self, shard: _Shard) -> BinaryIO | None:
        """Under the shard's lock: the cached shard if its sha256 matches (recorded again), else a fill of it; None to look again."""
        lock = _try_lock(self._lock_path(shard))
        if lock is None:
            return None  # being filled or checked by another opener: its outcome is there shortly
        handle: BinaryIO | None = None
        try:
            try:
                handle = open(self.path_for(shard.digest), "rb", buffering=1 << 20)  # noqa: SIM115 - the caller owns it
            except FileNotFoundError:
                return None
            st = os.fstat(handle.fileno())
            if st.st_size != shard.size:
                return None
            if _sha256_of(handle.fileno(), shard.size) == shard.digest:
                self._record(shard)
                self._count("hits")
                served, handle = handle, None
                return served
            self._count("dropped")
            log.warning(
                "cached shard %s (%s) no longer matches its manifest entry (changed on disk since it was cached): "
                "removed, fetched again from the store",
                redact_url(shard.url), self.path_for(shard.digest),
            )
            _remove(self.path_for(shard.digest))
            _remove(self._check_path(shard.digest))
            held, lock = lock, None
            return self._start_fill(shard, held)  # owns the lock from here
        finally:
            if handle is not None:
                handle.close()
            if lock is not None:
                _unlock(lock)

    def _record(self, shard: _Shard) -> None:
        """With the shard's lock held: write what its cached file is now (atomically), for later opens to compare with."""
        path = self._check_path(shard.digest)
        try:
            with open(self.path_for(shard.digest), "rb", buffering=0) as handle:
                st = os.fstat(handle.fileno())
                record = {
                    "size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                    "sample": _sample_digest(handle.fileno(), st.st_size),
                }  # fmt: skip
            with open(f"{path}.tmp", "w") as out:
                json.dump(record, out)
            os.replace(f"{path}.tmp", path)
        except OSError as exc:  # the shard itself is good: its next open hashes it whole again
            _remove(path)
            log.debug("cannot record the check of %s: %s", self.path_for(shard.digest), exc)

    def _as_recorded(self, shard: _Shard, fd: int, st: os.stat_result) -> bool:
        """Whether an open cached file is the one its fill recorded: size, inode, mtime, ctime and sampled blocks."""
        try:
            with open(self._check_path(shard.digest), "rb") as handle:
                record = json.loads(handle.read(4096))
        except (OSError, ValueError):
            return False
        expected = {"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
        if not isinstance(record, dict) or any(record.get(key) != value for key, value in expected.items()):
            return False
        return bool(record.get("sample") == _sample_digest(fd, st.st_size))

    def _follow(self, shard: _Shard) -> BinaryIO | None:
        """A reader of the fill in progress, if there is one."""
        for kind in ("part", "done"):
            try:
                handle = open(self._partial_path(shard, kind), "rb", buffering=0)  # noqa: SIM115 - the reader owns it
            except FileNotFoundError:
                continue
            self._count("followed")
            return cast(BinaryIO, _ShardReader(self, shard, handle))
        return None

    def _from_store(self, shard: _Shard) -> BinaryIO:
        self._count("bypassed")
        return cast(BinaryIO, _ShardReader(self, shard, None))

    # -- space and state

    def _count_space(self, exclude: str) -> tuple[int, int, int]:
        """(bytes used, complete shards, fills) with the space lock held; removes partial files of dead fills."""
        used = filling = 0
        reserved: set[str] = set()
        # The partial files before the shards: a fill published meanwhile is seen in both, and counted once.
        for entry in _scandir(self._partial):
            match = _PARTIAL.fullmatch(entry.name)
            if match is None or match["digest"] == exclude:
                continue
            lock = _try_lock(self._lock_path_of(match["digest"]))
            if lock is None:
                used += int(match["size"])  # a live fill's reservation
                filling += 1
                reserved.add(match["digest"])
                continue
            try:
                _remove(entry.path)
            finally:
                _unlock(lock)
        shards = 0
        for entry in _scandir(self._shards):
            if entry.name.endswith(".tar") and entry.name[: -len(".tar")] not in reserved:
                with contextlib.suppress(FileNotFoundError):
                    used += entry.stat().st_size
                    shards += 1
        return used, shards, filling

    @contextlib.contextmanager
    def _space_lock(self) -> Iterator[None]:
        fd = _lock(os.path.join(self.directory, "cache.lock"))
        try:
            yield
        finally:
            _unlock(fd)

    def _say_full(self, used: int, shards: int) -> None:
        with self._state:
            said, self._said_full = self._said_full, True
        if not said:
            log.warning(
                "shard cache %s is full (%s in %d shards, the bound is %s): it keeps those and the other shards "
                "are read from the store, without evicting anything",
                self.directory, format_bytes(used), shards, format_bytes(self.max_bytes),
            )

    def _cache_unwritable(self, exc: OSError) -> None:
        with self._state:
            said, self._unusable = self._unusable, True
        if said:
            return
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            reason = f"no space left on its device ({exc.strerror})"
        else:
            reason = f"it cannot be written ({exc.strerror or exc})"
        log.warning(
            "shard cache %s: %s; the shards it does not hold are read from the store from now on", self.directory, reason
        )

    def _notify(self) -> None:
        """Wake this process's readers waiting for a fill: it wrote more, or it ended."""
        with self._progress:
            self._generation += 1
            self._progress.notify_all()

    def _wait_for_progress(self, seen: int, timeout: float) -> None:
        """Sleep until a fill of this process moves on from generation `seen`, or `timeout` (for other processes' fills)."""
        with self._progress:
            if self._generation == seen:
                self._progress.wait(timeout)

    def _count(self, name: str) -> None:
        with self._state:
            setattr(self._stats, name, getattr(self._stats, name) + 1)

    def _runtime(self) -> None:
        """Threads, locks and counters of this process (fresh after a fork)."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._state = threading.Lock()
        self._progress = threading.Condition()
        self._generation = 0
        self._pool = None
        self._threads = []
        self._pending = set()
        self._stats = CacheStats()
        self._said_full = False
        self._unusable = False

    def _executor(self) -> ThreadPoolExecutor:
        with self._state:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.prefetch_threads, thread_name_prefix="gpufeed-cache-prefetch")
            return self._pool

    def _lock_path(self, shard: _Shard) -> str:
        return self._lock_path_of(shard.digest)

    def _lock_path_of(self, digest: str) -> str:
        return os.path.join(self._locks, f"{digest}.lock")

    def _check_path(self, digest: str) -> str:
        return os.path.join(self._checks, f"{digest}.json")

    def _partial_path(self, shard: _Shard, kind: str) -> str:
        return os.path.join(self._partial, f"{shard.digest}-{shard.size}.{kind}")

    def _identity(self, path: str) -> tuple[int, int] | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino


class _ShardReader(io.RawIOBase):
    """One shard, read from its fill in progress (taking over from the store if the fill stops) or from the store.

    Reads return as many bytes as asked for unless the shard ends. The bytes are
    checked once the end is reached: from the fill's verdict while following it,
    from a sha256 of what was read when they came from the store.
    """

    def __init__(self, cache: ShardCache, shard: _Shard, part: io.FileIO | None) -> None:
        super().__init__()
        self._cache = cache
        self._shard = shard
        self._part = part
        self._store: Any = None
        self._hasher: Any = None
        self._pos = 0
        self._abandoned = False
        self.verified: bool | None = None
        """True once the bytes read matched the manifest, False when they did not, None until the end is read."""
        if part is None:
            self._switch_to_store()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        total = 0
        while total < len(view) and self._pos < self._shard.size:
            want = min(len(view) - total, self._shard.size - self._pos)
            got = self._read_some(view[total : total + want])
            if not got:
                break  # the store ended before the manifest's size
            total += got
            self._pos += got
        if total < len(view) and self.verified is None:
            self._check()
        return total

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._abandoned and self.verified is None and self._shard.size - self._pos <= VERIFY_TAIL:
                while self.read(1 << 20):
                    pass
        finally:
            for handle in (self._part, self._store):
                if handle is not None:
                    with contextlib.suppress(Exception):
                        handle.close()
            super().close()

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self._abandoned = True  # the caller's error comes first; do not read on to check the shard
        self.close()

    def __del__(self) -> None:
        self._abandoned = True
        super().__del__()

    def _read_some(self, view: memoryview) -> int:
        if self._part is None:
            return self._read_store(view)
        poll = _POLL_MIN_S
        while True:
            seen = self._cache._generation
            got = self._part.readinto(view)
            if got:
                return got
            if not self._fill_alive():
                self._switch_to_store()
                return self._read_store(view)
            self._cache._wait_for_progress(seen, poll)
            poll = min(poll * 2, _POLL_MAX_S)

    def _read_store(self, view: memoryview) -> int:
        try:
            data = self._store.read(len(view))
        except GpufeedError:
            raise
        except Exception as exc:
            raise SourceError(f"cannot read shard {redact_url(self._shard.url)}: {exc}") from exc
        view[: len(data)] = data
        self._hasher.update(data)
        return len(data)

    def _fill_alive(self) -> bool:
        """Whether the fill this reader follows may still write more (else it stopped: failed, rejected or killed)."""
        assert self._part is not None
        st = os.fstat(self._part.fileno())
        if st.st_size > self._pos:
            return True
        mine = (st.st_dev, st.st_ino)
        cache, shard = self._cache, self._shard
        # The file only ever moves forward (part, then done, then the final name), so it is looked for in that
        # order: looked for the other way round, a rename between two looks lost it, and the reader took the
        # fill for dead and downloaded the rest of the shard a second time.
        still_partial = cache._identity(cache._partial_path(shard, "part")) == mine
        if still_partial:
            lock = _try_lock(cache._lock_path(shard))
            if lock is None:
                return True  # being filled
            _unlock(lock)
        if mine in (cache._identity(cache._partial_path(shard, "done")), cache._identity(cache.path_for(shard.digest))):
            return True  # checked and published (just now, perhaps): read on
        if not still_partial:
            return False  # rejected, or its filler went away and another removed the file
        return os.fstat(self._part.fileno()).st_size > self._pos  # its filler died: what it wrote is all there is

    def _switch_to_store(self) -> None:
        """Go on from the store at the current position (hashing what the fill had already given)."""
        fs, path = open_fs(self._shard.url, self._cache.storage_options)
        try:
            store = fs.open(path, "rb", block_size=STORE_BLOCK)
            if self._pos:
                store.seek(self._pos)
        except Exception as exc:
            raise SourceError(f"cannot read shard {redact_url(self._shard.url)}: {exc}") from exc
        self._hasher = hashlib.sha256()
        if self._part is not None:
            _hash_prefix(self._part.fileno(), self._pos, self._hasher)
            self._part.close()
            self._part = None
            log.debug("the fill of %s stopped; reading on from the store at byte %d", redact_url(self._shard.url), self._pos)
        self._store = store

    def _check(self) -> None:
        if self._hasher is not None:
            ok = self._pos == self._shard.size and self._hasher.hexdigest() == self._shard.digest
        else:
            ok = self._pos == self._shard.size and self._fill_verified()
        self.verified = ok
        if not ok:
            raise ManifestError(
                f"shard {redact_url(self._shard.url)} does not match its manifest entry (sha256 or size differ: "
                "the store's copy changed or is damaged); it was not cached"
            )

    def _fill_verified(self) -> bool:
        """The fill's verdict on the bytes this reader took from it (judged here if the filler is gone)."""
        assert self._part is not None
        cache, shard = self._cache, self._shard
        st = os.fstat(self._part.fileno())
        mine = (st.st_dev, st.st_ino)
        poll = _POLL_MIN_S
        while True:
            seen = cache._generation
            if mine in (cache._identity(cache.path_for(shard.digest)), cache._identity(cache._partial_path(shard, "done"))):
                return True
            if cache._identity(cache._partial_path(shard, "part")) != mine:
                break  # rejected, or its filler went away
            lock = _try_lock(cache._lock_path(shard))
            if lock is not None:
                _unlock(lock)
                break
            cache._wait_for_progress(seen, poll)  # the filler is checking the last bytes
            poll = min(poll * 2, _POLL_MAX_S)
        hasher = hashlib.sha256()
        _hash_prefix(self._part.fileno(), shard.size, hasher)
        return hasher.hexdigest() == shard.digest


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


def _shard(url: str, sha256: str, size: int) -> _Shard:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"a shard's size must be a whole number of bytes, got {size!r}")
    return _Shard(url, _check_digest(sha256), size)


def _check_digest(sha256: str) -> str:
    digest = str(sha256).lower()
    if not _DIGEST.fullmatch(digest):
        raise ConfigError(f"not a sha256 in hex: {sha256!r}")
    return digest


# Every descriptor that holds (or is about to take) a flock, so that a forked child can close its copies:
# a flock belongs to the open file, which a child's copy would keep locked after the parent let go.
_lock_files: set[int] = set()
_lock_files_guard = threading.Lock()


def _open_lock_file(path: str) -> int:
    with _lock_files_guard:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        _lock_files.add(fd)
    return fd


def _unlock(fd: int) -> None:
    """Release a flock taken by `_try_lock` or `_lock` (closing its descriptor)."""
    with _lock_files_guard:
        _lock_files.discard(fd)
        os.close(fd)


def _try_lock(path: str) -> int | None:
    """An exclusive flock on `path` (created if missing) as a descriptor, or None when another holder has it."""
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _unlock(fd)
        return None
    except BaseException:
        _unlock(fd)
        raise
    return fd


def _lock(path: str) -> int:
    """An exclusive flock on `path`, waiting for it."""
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        _unlock(fd)
        raise
    return fd


def _close_inherited_locks() -> None:
    for fd in _lock_files:
        with contextlib.suppress(OSError):
            os.close(fd)
    _lock_files.clear()
    _lock_files_guard.release()


os.register_at_fork(
    before=_lock_files_guard.acquire,
    after_in_parent=_lock_files_guard.release,
    after_in_child=_close_inherited_locks,
)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _scandir(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except FileNotFoundError:
        return []


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _sha256_of(fd: int, size: int) -> str:
    hasher = hashlib.sha256()
    _hash_prefix(fd, size, hasher)
    return hasher.hexdigest()


def _sample_digest(fd: int, size: int) -> str:
    """A hash of CHECK_BLOCKS blocks of an open file of `size` bytes (all of it when it is small), and of the size."""
    hasher = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
    if size <= CHECK_BLOCKS * CHECK_BLOCK:
        _hash_prefix(fd, size, hasher)
        return hasher.hexdigest()
    for number in range(CHECK_BLOCKS):
        hasher.update(os.pread(fd, CHECK_BLOCK, number * (size - CHECK_BLOCK) // (CHECK_BLOCKS - 1)))
    return hasher.hexdigest()


def _hash_prefix(fd: int, size: int, hasher: Any) -> None:
    """Feed the first `size` bytes of an open file (fewer if it is shorter) to `hasher`."""
    offset = 0
    while offset < size:
        block = os.pread(fd, min(STORE_CHUNK, size - offset), offset)
        if not block:
            break
        hasher.update(block)
        offset += len(block)
