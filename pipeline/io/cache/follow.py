"""Reading a shard from its fill in progress, going on from the store where the fill stops, checked at its end.

A reader of a fill (this process's or another's) reads the bytes as they land
in the partial file and waits only where it catches up with the download: a
fill of this process wakes it at once (`FillProgress`), another process's is
looked at again every few milliseconds. The fill's file only moves forward
(part, then done, then the final name); a reader whose fill stopped (failed,
rejected, its filler killed) hashes what it already has and reads the rest
from the store. Either way the bytes are checked against the manifest once
the end is read: `ManifestError` there when they do not match.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ...errors import GpufeedError, ManifestError, SourceError
from ..fs import open_fs, redact_url
from .files import CacheFolder, ShardEntry, hash_prefix, sha256_of, try_lock, unlock

log = logging.getLogger("gpufeed.cache")

STORE_BLOCK = 8 << 20  # the store file's own read-ahead block
VERIFY_TAIL = 4 << 20  # close() reads at most this much more to check a shard (a tar's end padding is 10 KiB)
# How often a reader that caught up with a fill looks again (a fill of this process wakes it at once).
POLL_MIN_S, POLL_MAX_S = 0.001, 0.01


class FillProgress:
    """How the fills of one process wake its readers: a generation number, moved on whenever a fill wrote more or ended."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self.generation = 0

    def notify(self) -> None:
        """Wake this process's readers waiting for a fill: it wrote more, or it ended."""
        with self._condition:
            self.generation += 1
            self._condition.notify_all()

    def wait(self, seen: int, timeout: float) -> None:
        """Sleep until a fill of this process moves on from generation `seen`, or `timeout` (for other processes' fills)."""
        with self._condition:
            if self.generation == seen:
                self._condition.wait(timeout)


class FollowedFills(Protocol):
    """What a reader asks of its process's fills: where a shard's files are, whether a fill moved on, the store."""

    folder: CacheFolder
    storage_options: Mapping[str, Any]
    progress: FillProgress
    identity: Callable[[str], tuple[int, int] | None]
    """(device, inode) of a path, or None: which of a fill's names the reader's file has now."""


class ShardReader(io.RawIOBase):
    """One shard, read from its fill in progress (taking over from the store if the fill stops) or from the store.

    Reads return as many bytes as asked for unless the shard ends. The bytes are
    checked once the end is reached: from the fill's verdict while following it,
    from a sha256 of what was read when they came from the store.
    """

    def __init__(self, fills: FollowedFills, shard: ShardEntry, fill_file: io.FileIO | None) -> None:
        super().__init__()
        self._fills = fills
        self._shard = shard
        self._fill_file = fill_file
        self._store_file: Any = None
        self._read_sha256: Any = None  # of every byte read, once they come from the store
        self._position = 0
        self._abandoned = False
        self.verified: bool | None = None
        """True once the bytes read matched the manifest, False when they did not, None until the end is read."""
        if fill_file is None:
            self._switch_to_store()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        total = 0
        while total < len(view) and self._position < self._shard.size:
            want = min(len(view) - total, self._shard.size - self._position)
            got = self._read_some(view[total : total + want])
            if not got:
                break  # the store ended before the manifest's size
            total += got
            self._position += got
        if total < len(view) and self.verified is None:
            self._check_at_end()
        return total

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._abandoned and self.verified is None and self._shard.size - self._position <= VERIFY_TAIL:
                while self.read(1 << 20):
                    pass
        finally:
            for handle in (self._fill_file, self._store_file):
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
        if self._fill_file is None:
            return self._read_store(view)
        poll = POLL_MIN_S
        while True:
            seen = self._fills.progress.generation
            got = self._fill_file.readinto(view)
            if got:
                return got
            if not self._fill_alive():
                self._switch_to_store()
                return self._read_store(view)
            self._fills.progress.wait(seen, poll)
            poll = min(poll * 2, POLL_MAX_S)

    def _read_store(self, view: memoryview) -> int:
        try:
            data = self._store_file.read(len(view))
        except GpufeedError:
            raise
        except Exception as exc:
            raise SourceError(f"cannot read shard {redact_url(self._shard.url)}: {exc}") from exc
        view[: len(data)] = data
        self._read_sha256.update(data)
        return len(data)

    def _fill_alive(self) -> bool:
        """Whether the fill this reader follows may still write more (else it stopped: failed, rejected or killed)."""
        assert self._fill_file is not None
        st = os.fstat(self._fill_file.fileno())
        if st.st_size > self._position:
            return True
        mine = (st.st_dev, st.st_ino)
        fills, folder, shard = self._fills, self._fills.folder, self._shard
        # The file only ever moves forward (part, then done, then the final name), so it is looked for in that
        # order: looked for the other way round, a rename between two looks lost it, and the reader took the
        # fill for dead and downloaded the rest of the shard a second time.
        still_partial = fills.identity(folder.partial_path(shard, "part")) == mine
        if still_partial:
            fill_lock = try_lock(folder.lock_path(shard.digest))
            if fill_lock is None:
                return True  # being filled
            unlock(fill_lock)
        if mine in (fills.identity(folder.partial_path(shard, "done")), fills.identity(folder.shard_path(shard.digest))):
            return True  # checked and published (just now, perhaps): read on
        if not still_partial:
            return False  # rejected, or its filler went away and another removed the file
        return os.fstat(self._fill_file.fileno()).st_size > self._position  # its filler died: what it wrote is all there is

    def _switch_to_store(self) -> None:
        """Go on from the store at the current position (hashing what the fill had already given)."""
        fs, path = open_fs(self._shard.url, self._fills.storage_options)
        try:
            store = fs.open(path, "rb", block_size=STORE_BLOCK)
            if self._position:
                store.seek(self._position)
        except Exception as exc:
            raise SourceError(f"cannot read shard {redact_url(self._shard.url)}: {exc}") from exc
        self._read_sha256 = hashlib.sha256()
        if self._fill_file is not None:
            hash_prefix(self._fill_file.fileno(), self._position, self._read_sha256)
            self._fill_file.close()
            self._fill_file = None
            log.debug("the fill of %s stopped; reading on from the store at byte %d", redact_url(self._shard.url), self._position)
        self._store_file = store

    def _check_at_end(self) -> None:
        if self._read_sha256 is not None:
            ok = self._position == self._shard.size and self._read_sha256.hexdigest() == self._shard.digest
        else:
            ok = self._position == self._shard.size and self._fill_verified()
        self.verified = ok
        if not ok:
            raise ManifestError(
                f"shard {redact_url(self._shard.url)} does not match its manifest entry (sha256 or size differ: "
                "the store's copy changed or is damaged); it was not cached"
            )

    def _fill_verified(self) -> bool:
        """The fill's verdict on the bytes this reader took from it (judged here if the filler is gone)."""
        assert self._fill_file is not None
        fills, folder, shard = self._fills, self._fills.folder, self._shard
        st = os.fstat(self._fill_file.fileno())
        mine = (st.st_dev, st.st_ino)
        poll = POLL_MIN_S
        while True:
            seen = fills.progress.generation
            if mine in (fills.identity(folder.shard_path(shard.digest)), fills.identity(folder.partial_path(shard, "done"))):
                return True
            if fills.identity(folder.partial_path(shard, "part")) != mine:
                break  # rejected, or its filler went away
            fill_lock = try_lock(folder.lock_path(shard.digest))
            if fill_lock is not None:
                unlock(fill_lock)
                break
            fills.progress.wait(seen, poll)  # the filler is checking the last bytes
            poll = min(poll * 2, POLL_MAX_S)
        return sha256_of(self._fill_file.fileno(), shard.size) == shard.digest
