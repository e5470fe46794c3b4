"""Cached shards checked before they are served: the record each fill writes, a whole sha256 where it differs.

A fill that publishes a shard writes ``DIR/checks/<sha256>.json`` (atomically,
before its lock is let go): the file's size, inode, mtime and ctime and a hash
of CHECK_BLOCKS sampled blocks. Every open compares the cached file with it
before handing out a byte (with ``verify=True`` it hashes the whole file with
sha256 as well). A file that differs from its record (another file put in its
place, bytes written into it, no record: a cache from an older version) is
hashed whole under the shard's lock: when it still matches the manifest its
record is written again, else it is removed with a warning and the caller,
holding the lock, fetches it once again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import BinaryIO

from ..fs import redact_url
from .files import CacheFolder, ShardEntry, hash_prefix, remove_file, sha256_of, try_lock, unlock

log = logging.getLogger("gpufeed.cache")

CHECK_BLOCKS, CHECK_BLOCK = 8, 16 << 10  # the blocks of a cached shard hashed at every open (first, last, evenly between)


def open_cached(folder: CacheFolder, shard: ShardEntry, verify: bool) -> tuple[BinaryIO | None, int | None]:
    """The cached shard, once it is checked against its record (and its sha256 with `verify`).

    Returns:
        (handle, None): the cached shard, checked, open for the caller.
        (None, lock): it no longer matched the manifest and was removed; the
            caller holds the shard's lock (the descriptor) to fetch it again.
        (None, None): no such cached shard (missing, another size, or being
            checked by another opener): the caller fills it, follows a fill, or looks again.
    """
    try:
        handle = open(folder.shard_path(shard.digest), "rb", buffering=1 << 20)  # noqa: SIM115 - the caller owns it
    except FileNotFoundError:
        return None, None
    try:
        st = os.fstat(handle.fileno())
        if st.st_size != shard.size:  # not ours: a fill replaces it
            handle.close()
            return None, None
        if matches_record(folder, shard.digest, handle.fileno(), st) and (
            not verify or sha256_of(handle.fileno(), shard.size) == shard.digest
        ):
            return handle, None
    except BaseException:
        handle.close()
        raise
    handle.close()
    return _check_whole(folder, shard)


def _check_whole(folder: CacheFolder, shard: ShardEntry) -> tuple[BinaryIO | None, int | None]:
    """Under the shard's lock: the cached shard if its sha256 matches (recorded again), else dropped (see `open_cached`)."""
    shard_lock = try_lock(folder.lock_path(shard.digest))
    if shard_lock is None:
        return None, None  # being filled or checked by another opener: its outcome is there shortly
    path = folder.shard_path(shard.digest)
    handle: BinaryIO | None = None
    try:
        try:
            handle = open(path, "rb", buffering=1 << 20)  # noqa: SIM115 - the caller owns it
        except FileNotFoundError:
            return None, None
        st = os.fstat(handle.fileno())
        if st.st_size != shard.size:
            return None, None
        if sha256_of(handle.fileno(), shard.size) == shard.digest:
            record_check(folder, shard.digest)
            served, handle = handle, None
            return served, None
        log.warning(
            "cached shard %s (%s) no longer matches its manifest entry (changed on disk since it was cached): "
            "removed, fetched again from the store",
            redact_url(shard.url), path,
        )
        remove_file(path)
        remove_file(folder.check_path(shard.digest))
        held, shard_lock = shard_lock, None
        return None, held
    finally:
        if handle is not None:
            handle.close()
        if shard_lock is not None:
            unlock(shard_lock)


def record_check(folder: CacheFolder, digest: str) -> None:
    """With the shard's lock held: write what its cached file is now (atomically), for later opens to compare with."""
    path = folder.check_path(digest)
    try:
        with open(folder.shard_path(digest), "rb", buffering=0) as handle:
            st = os.fstat(handle.fileno())
            record = {
                "size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                "sample": sample_digest(handle.fileno(), st.st_size),
            }  # fmt: skip
        with open(f"{path}.tmp", "w") as out:
            json.dump(record, out)
        os.replace(f"{path}.tmp", path)
    except OSError as exc:  # the shard itself is good: its next open hashes it whole again
        remove_file(path)
        log.debug("cannot record the check of %s: %s", folder.shard_path(digest), exc)


def matches_record(folder: CacheFolder, digest: str, fd: int, st: os.stat_result) -> bool:
    """Whether an open cached file is the one its fill recorded: size, inode, mtime, ctime and sampled blocks."""
    try:
        with open(folder.check_path(digest), "rb") as handle:
            record = json.loads(handle.read(4096))
    except (OSError, ValueError):
        return False
    expected = {"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
    if not isinstance(record, dict) or any(record.get(key) != value for key, value in expected.items()):
        return False
    return bool(record.get("sample") == sample_digest(fd, st.st_size))


def sample_digest(fd: int, size: int) -> str:
    """A hash of CHECK_BLOCKS blocks of an open file of `size` bytes (all of it when it is small), and of the size."""
    hasher = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
    if size <= CHECK_BLOCKS * CHECK_BLOCK:
        hash_prefix(fd, size, hasher)
        return hasher.hexdigest()
    for number in range(CHECK_BLOCKS):
        hasher.update(os.pread(fd, CHECK_BLOCK, number * (size - CHECK_BLOCK) // (CHECK_BLOCKS - 1)))
    return hasher.hexdigest()
