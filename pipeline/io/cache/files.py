"""The shard cache's folder: where each file of a shard lives, the flocks that guard them, the helpers every part uses.

    DIR/shards/<sha256>.tar             a complete, checked shard
    DIR/partial/<sha256>-<size>.part    a fill in progress (…`.done` once its bytes matched the manifest)
    DIR/locks/<sha256>.lock             held by whoever fills (or checks) that shard
    DIR/checks/<sha256>.json            what the cached file was when it was filled (`verify`)
    DIR/cache.lock                      held while the space is counted (`space`)

A flock belongs to the open file, so a forked child would keep locked what its
parent lets go: every lock descriptor is registered here, and a child closes
its copies at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import re
import threading
from typing import Any

from ...errors import ConfigError, StorageError

HASH_BLOCK = 8 << 20  # the most bytes read at once to hash a file

DIGEST = re.compile(r"[0-9a-f]{64}")

ShardAddress = tuple[str, str, int]
"""(url, sha256, size) of one shard: its address and its manifest entry's `sha256` and `bytes`."""


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One shard to cache: where it is, and its manifest entry's sha256 (lower-case hex) and size."""

    url: str
    digest: str
    size: int


def shard_entry(url: str, sha256: str, size: int) -> ShardEntry:
    """A `ShardEntry`, its sha256 and size checked.

    Raises:
        ConfigError: `sha256` is not a hex sha256, or `size` is not a whole number of bytes.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"a shard's size must be a whole number of bytes, got {size!r}")
    return ShardEntry(url, checked_digest(sha256), size)


def checked_digest(sha256: str) -> str:
    """`sha256` in lower case, once it is a hex sha256 (else ConfigError)."""
    digest = str(sha256).lower()
    if not DIGEST.fullmatch(digest):
        raise ConfigError(f"not a sha256 in hex: {sha256!r}")
    return digest


class CacheFolder:
    """The paths of one shard cache folder (see the module)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.shards = os.path.join(directory, "shards")
        self.partial = os.path.join(directory, "partial")
        self.locks = os.path.join(directory, "locks")
        self.checks = os.path.join(directory, "checks")
        self.space_lock = os.path.join(directory, "cache.lock")

    def make(self) -> None:
        """Create the folders.

        Raises:
            StorageError: one cannot be created.
        """
        try:
            for folder in (self.shards, self.partial, self.locks, self.checks):
                os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot use {self.directory} as a shard cache: {exc.strerror or exc}") from exc

    def shard_path(self, digest: str) -> str:
        return os.path.join(self.shards, f"{digest}.tar")

    def lock_path(self, digest: str) -> str:
        return os.path.join(self.locks, f"{digest}.lock")

    def check_path(self, digest: str) -> str:
        return os.path.join(self.checks, f"{digest}.json")

    def partial_path(self, shard: ShardEntry, kind: str) -> str:
        """The fill's file: `kind` "part" while it downloads, "done" once its bytes matched."""
        return os.path.join(self.partial, f"{shard.digest}-{shard.size}.{kind}")


def file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of a path, or None when there is nothing there."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


# ---------------------------------------------------------------------------
# Locks

# Every descriptor that holds (or is about to take) a flock, so that a forked child can close its copies:
# a flock belongs to the open file, which a child's copy would keep locked after the parent let go.
_lock_files: set[int] = set()
_lock_files_guard = threading.Lock()


def _open_lock_file(path: str) -> int:
    with _lock_files_guard:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        _lock_files.add(fd)
    return fd


def unlock(fd: int) -> None:
    """Release a flock taken by `try_lock` or `lock` (closing its descriptor)."""
    with _lock_files_guard:
        _lock_files.discard(fd)
        os.close(fd)


def try_lock(path: str) -> int | None:
    """An exclusive flock on `path` (created if missing) as a descriptor, or None when another holder has it."""
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        unlock(fd)
        return None
    except BaseException:
        unlock(fd)
        raise
    return fd


def lock(path: str) -> int:
    """An exclusive flock on `path`, waiting for it."""
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        unlock(fd)
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


# ---------------------------------------------------------------------------
# Files


def remove_file(path: str) -> None:
    """Remove a file if it is there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def list_folder(path: str) -> list[os.DirEntry[str]]:
    """The entries of a folder (none when it is gone)."""
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except FileNotFoundError:
        return []


def sha256_of(fd: int, size: int) -> str:
    """The sha256 (hex) of the first `size` bytes of an open file."""
    hasher = hashlib.sha256()
    hash_prefix(fd, size, hasher)
    return hasher.hexdigest()


def hash_prefix(fd: int, size: int, hasher: Any) -> None:
    """Feed the first `size` bytes of an open file (fewer if it is shorter) to `hasher`."""
    offset = 0
    while offset < size:
        block = os.pread(fd, min(HASH_BLOCK, size - offset), offset)
        if not block:
            break
        hasher.update(block)
        offset += len(block)
