"""Copy a prepared dataset to a local folder: in parallel, every shard verified, resumable, the manifest last.

``stage_dataset("s3://bucket/shards", "/nvme/shards")`` copies the manifest, every
shard it lists (variant sets and version folders included, at the same relative
paths) and ``rejected.jsonl`` from a local folder or any fsspec URL. Shards are
copied by a pool of I/O threads (sized for the store's latency, not for the cores),
each to a temporary name, checked against the manifest's size and sha256 and only
then renamed. A shard already at DEST with the right size and sha256 is kept, so
running the same command again after an interruption copies only what is missing.
The manifest is written last: DEST is a dataset only once every shard is there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from .errors import ConfigError, GpufeedError, ManifestError, SourceError, StorageError, write_failure
from .io.cache.shards import copy_from_store
from .io.devices import free_bytes
from .io.fs import file_sha256, forget_listings, local_path, open_fs, process_alive, redact_url, temp_suffix
from .io.output import Output
from .manifest import MANIFEST_NAME, REJECTED_NAME, Manifest
from .units import format_bytes

STAGE_WORKERS = 8


@dataclasses.dataclass(frozen=True)
class StageProgress:
    """How far a stage is: passed to `stage_dataset`'s `progress` after every chunk copied.

    Attributes:
        shards_done: shards at DEST and correct (those already there included).
        shards: shards in the manifest.
        bytes_copied: bytes copied so far by this run.
        bytes_to_copy: bytes this run has to copy in all.
        seconds: since the copying started.
    """

    shards_done: int
    shards: int
    bytes_copied: int
    bytes_to_copy: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class StageResult:
    """What `stage_dataset` did.

    Attributes:
        source: the dataset copied (a URL fit to print).
        dest: the local folder that now holds it.
        shards: shards in the manifest.
        copied: shards this run copied.
        already: shards that were at DEST already, correct, and were kept.
        bytes: bytes of every shard of the dataset.
        bytes_copied: bytes this run copied.
        seconds: the whole run, checks included.
        verified: whether the shards already there were re-hashed (else trusted by size).
    """

    source: str
    dest: str
    shards: int
    copied: int
    already: int
    bytes: int
    bytes_copied: int
    seconds: float
    verified: bool

    @property
    def mb_per_s(self) -> float:
        """Copy speed in MB/s (10**6 bytes per second) over the whole run."""
        return self.bytes_copied / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mb_per_s": round(self.mb_per_s, 2)}


StageCallback = Callable[[StageProgress], None]


@dataclasses.dataclass(frozen=True)
class _File:
    rel: str
    sha256: str
    size: int


class _Stopped(Exception):
    """Another copy failed or the run was interrupted: stop this one."""


def stage_dataset(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    workers: int = STAGE_WORKERS,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    progress: StageCallback | None = None,
) -> StageResult:
    """Copy a prepared dataset to a local folder, verified and resumable (see the module).

    Args:
        source: the dataset: a local folder or an fsspec URL holding manifest.json
            (or the manifest.json itself).
        dest: a local folder (created if missing).
        workers: shards copied at once.
        verify: re-hash the shards already at DEST before keeping them (False: keep
            those of the right size). Copied shards are always checked.
        storage_options: fsspec options for the source's store (endpoint, profile,
            anonymous access).
        progress: called with a `StageProgress` after every chunk copied.

    Returns:
        What was copied and kept, and how fast.

    Raises:
        ConfigError: `dest` is a URL or a file, or `workers` is below 1.
        SourceError: the source cannot be reached or read.
        ManifestError: no manifest at the source, or a source shard does not match it
            (DEST then has no manifest; the shards copied so far are kept).
        StorageError: DEST lacks the free space for what is missing, or cannot be written.
    """
    started = time.monotonic()
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    root = os.fspath(source).rstrip("/")
    if root.endswith("/" + MANIFEST_NAME) or root == MANIFEST_NAME:
        root = root[: -len(MANIFEST_NAME)].rstrip("/") or "."
    target = _dest_folder(os.fspath(dest))
    text = _read_manifest_bytes(root, storage_options)
    try:
        manifest = Manifest.from_dict(json.loads(text), f"{redact_url(root)}/{MANIFEST_NAME}")
    except ValueError as exc:
        raise ManifestError(f"{redact_url(root)}/{MANIFEST_NAME} is not JSON: {exc}") from exc
    files = [_File(_safe_rel(shard.path), shard.sha256, shard.bytes) for shard in manifest.shards]
    output = Output(target)
    output.makedirs()
    if output.exists(MANIFEST_NAME) and output.read_bytes(MANIFEST_NAME) != text:
        output.remove(MANIFEST_NAME)  # DEST held another dataset (or version): not a dataset until this one is complete
    _remove_dead_temps(target, files)

    with ThreadPoolExecutor(workers, thread_name_prefix="gpufeed-stage") as pool:
        present = list(pool.map(lambda file: _already_there(target, file, verify), files))
        missing = [file for file, ok in zip(files, present) if not ok]
        _check_room(target, missing)
        copier = _Copier(root, target, storage_options, len(files) - len(missing), len(files), missing, progress)
        copier.run(pool)

    if not output.exists(MANIFEST_NAME):
        rejected = _read_optional(root, REJECTED_NAME, storage_options)
        if rejected is not None:
            output.write_bytes_atomic(REJECTED_NAME, rejected)
        output.write_bytes_atomic(MANIFEST_NAME, text)
    return StageResult(
        source=redact_url(root),
        dest=target,
        shards=len(files),
        copied=len(missing),
        already=len(files) - len(missing),
        bytes=sum(file.size for file in files),
        bytes_copied=sum(file.size for file in missing),
        seconds=time.monotonic() - started,
        verified=verify,
    )


class _Copier:
    """Copies the missing shards on a thread pool; the first failure stops the others."""

    def __init__(
        self,
        root: str,
        target: str,
        storage_options: Mapping[str, Any] | None,
        done: int,
        total: int,
        missing: list[_File],
        progress: StageCallback | None,
    ) -> None:
        self.root = root
        self.target = target
        self.storage_options = storage_options
        self.missing = missing
        self.progress = progress
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.done = done
        self.total = total
        self.copied = 0
        self.to_copy = sum(file.size for file in missing)
        self.started = time.monotonic()

    def run(self, pool: ThreadPoolExecutor) -> None:
        futures: list[Future[None]] = [pool.submit(self.copy, file) for file in self.missing]
        try:
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
            errors: list[BaseException] = []
            for future in finished:
                error = None if future.cancelled() else future.exception()
                if error is not None:
                    errors.append(error)
            if errors:
                errors.sort(key=lambda e: isinstance(e, _Stopped))  # the cause before the stops it caused
                raise errors[0]
        finally:
            self.stop.set()
            for future in futures:
                future.cancel()

    def copy(self, file: _File) -> None:
        if self.stop.is_set():
            raise _Stopped()
        final = os.path.join(self.target, file.rel)
        temp = final + temp_suffix()
        url = f"{self.root}/{file.rel}"
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise write_failure(final, exc) from exc
        kept = False
        try:
            digest, count = copy_from_store(url, fd, file.size, storage_options=self.storage_options, on_chunk=self.advance)
            if count != file.size or digest != file.sha256:
                found = f"{count} bytes" if count != file.size else "its sha256 differs"
                raise ManifestError(
                    f"{redact_url(url)} does not match the manifest ({found}; the manifest says {file.size} bytes): "
                    f"the source is damaged, check it with gpufeed inspect --verify; {self.target} has no manifest"
                )
            os.fsync(fd)
            os.replace(temp, final)
            kept = True
        except OSError as exc:
            raise write_failure(final, exc) from exc
        finally:
            os.close(fd)
            if not kept:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
        with self.lock:
            self.done += 1
        self.report()

    def advance(self, size: int) -> None:
        if self.stop.is_set():
            raise _Stopped()
        with self.lock:
            self.copied += size
        self.report()

    def report(self) -> None:
        if self.progress is None:
            return
        with self.lock:
            state = StageProgress(self.done, self.total, self.copied, self.to_copy, time.monotonic() - self.started)
            self.progress(state)


def _dest_folder(dest: str) -> str:
    local = local_path(dest)
    if local is None:
        raise ConfigError(f"DEST must be a local folder (staging copies a dataset to this machine), not {redact_url(dest)}")
    target = os.path.abspath(local)
    if os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(f"{target} is a file, not a folder")
    return target


def _read_manifest_bytes(root: str, storage_options: Mapping[str, Any] | None) -> bytes:
    data = _read_optional(root, MANIFEST_NAME, storage_options)
    if data is None:
        raise ManifestError(
            f"no {MANIFEST_NAME} in {redact_url(root)}: not a prepared dataset (or its prepare did not finish)"
        )
    return data


def _read_optional(root: str, name: str, storage_options: Mapping[str, Any] | None) -> bytes | None:
    """A small file of the source dataset, or None when it has none."""
    fs, path = open_fs(f"{root}/{name}", storage_options)
    forget_listings(fs, path)  # the store's answer now, not a listing this process made before
    try:
        if not fs.exists(path):
            return None
        data: bytes = fs.cat_file(path)
    except GpufeedError:
        raise
    except Exception as exc:  # the store's own errors (connection refused, access denied, …)
        raise SourceError(f"cannot read {redact_url(root)}/{name}: {exc}") from exc
    return data


def _safe_rel(rel: str) -> str:
    """A shard path of the manifest, refused when it would land outside DEST."""
    norm = os.path.normpath(rel)
    if os.path.isabs(rel) or norm in (".", "") or norm == ".." or norm.startswith(".." + os.sep):
        raise ManifestError(f"the manifest names a shard outside the dataset folder: {rel!r}")
    return norm


def _already_there(target: str, file: _File, verify: bool) -> bool:
    path = os.path.join(target, file.rel)
    try:
        if os.path.getsize(path) != file.size:
            return False
        return not verify or file_sha256(path)[0] == file.sha256
    except OSError:
        return False


def _check_room(target: str, missing: list[_File]) -> None:
    need = sum(file.size for file in missing)
    free = free_bytes(target)
    if free is not None and need > free:
        raise StorageError(
            f"not enough free space in {target}: the {len(missing)} shards still to copy need {format_bytes(need)}, "
            f"the disk has {format_bytes(free)} free"
        )


def _remove_dead_temps(target: str, files: list[_File]) -> None:
    """Remove the temporary files a killed stage on this machine left next to the shards."""
    prefix = f".tmp-{socket.gethostname()}-"
    for folder in sorted({os.path.dirname(os.path.join(target, file.rel)) for file in files}):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            _, tag, pid = name.rpartition(prefix)
            if tag and pid.isdigit() and not process_alive(int(pid)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))
