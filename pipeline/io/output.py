"""Where prepared data lands: local directories or any fsspec URL, written atomically.

`Output` hides the difference: shards are always written to a local file
first (a staging folder for remote targets), then published under their final
name in one step, so a reader never sees a partial shard or manifest:
`os.replace` locally; on S3 one upload under the final name, since an object
appears only once its upload completes (one request for a small file, where
upload-to-temp + move was about eight); on other stores upload-to-temp + move.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..errors import StorageError, write_failure
from .fs import abort_uploads, forget_listings, lean_puts, local_path, open_fs, store_errors, store_failure, temp_suffix
from .transports import transport_for

# Stores on which an object appears only when its upload completes, whole (a single PUT, or a
# multipart upload once it is completed): a file is published by uploading it under its final name.
WHOLE_UPLOAD_PROTOCOLS = frozenset({"s3", "s3a"})

# Objects of this process whose failed upload could not be cleaned up (the store refused or was
# away), each with whether the object itself goes too (a temp object) or only its unfinished
# uploads (a final name, which may hold a complete earlier copy): each later publish to the store
# tries again, so a retried job leaves no parts behind.
_LEFT_BEHIND: dict[str, bool] = {}
_LEFT_BEHIND_LOCK = threading.Lock()


class Output:
    """An output directory, local or fsspec, with atomic publishing.

    Args:
        url: a local folder or an fsspec URL.
        part_bytes: the part size of a multipart upload to a store: a file of at least
            two parts goes up in parts (None: the store client's own, 50 MiB for s3fs).
    """

    def __init__(self, url: str, *, part_bytes: int | None = None) -> None:
        self.url = url.rstrip("/") or "/"
        self.part_bytes = part_bytes
        local = local_path(url)
        self.is_local = local is not None
        if local is not None:
            self.root = os.path.abspath(local)
            self.fs: Any = None
            self.remote_root = ""
            self.staging = self.root
            self.whole_uploads = False
        else:
            self.fs, self.remote_root = open_fs(url)
            self.remote_root = self.remote_root.rstrip("/")
            protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
            self.whole_uploads = bool(WHOLE_UPLOAD_PROTOCOLS.intersection(protocols))
            digest = hashlib.sha1(url.encode()).hexdigest()[:16]
            self.staging = os.path.join(tempfile.gettempdir(), f"gpufeed-staging-{digest}")
            self.root = self.staging

    def local(self, rel: str) -> str:
        """The local file a member is written to before `publish`."""
        return os.path.join(self.staging, rel)

    def _remote(self, rel: str) -> str:
        return f"{self.remote_root}/{rel}"

    def _fresh(self, rel: str) -> str:
        """`rel`'s path on the store (OUT itself for ""), with what this process listed of it forgotten.

        The filesystem is shared in the process and s3fs answers exists, size and
        ls from any listing it made before: a long-lived worker would see the
        shards of its last job on OUT, not what the store holds now.
        """
        path = self._remote(rel) if rel else self.remote_root
        forget_listings(self.fs, path)
        return path

    def makedirs(self) -> None:
        try:
            os.makedirs(self.staging, exist_ok=True)
            if not self.is_local:
                self.fs.makedirs(self.remote_root, exist_ok=True)
        except store_errors() as exc:
            raise StorageError(f"cannot create output folder {self.url}: {getattr(exc, 'strerror', None) or exc}") from exc

    def publish(self, rel: str, *, keep_local: bool = False) -> None:
        """Move a finished local file to its final place (no-op for local outputs).

        On S3 the file is uploaded under its final name: the object appears
        when the upload completes, whole, so a reader never sees a partial
        one. On other stores it is uploaded under a temp name, then moved. An
        upload that fails is aborted (no multipart upload is left in progress
        on the store) and what is left under a temp name is removed, never
        what is under the final name; when the store refuses or is away for
        that too, the next publish of this process cleans up again.

        Args:
            rel: the member, relative to OUT.
            keep_local: keep the local copy after the upload (files this machine reads again).

        Raises:
            StorageError: the upload failed (retryable); the local file is kept.
        """
        if self.is_local:
            return
        source = self.local(rel)
        final = self._remote(rel)
        target = final if self.whole_uploads else f"{final}{temp_suffix()}"
        lean_puts(self.fs)
        try:
            if target != final:
                self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
            transport_for(self.fs).upload(source, target, part_bytes=self.part_bytes)
            if target != final:
                self.fs.mv(target, final)
        except Exception as exc:
            self._forget(target, remove=target != final)
            if isinstance(exc, store_errors()):
                raise store_failure(f"upload {rel} to", self.url, exc) from exc
            raise
        self._forget_left_behind()
        if not keep_local:
            os.unlink(source)

    def _forget(self, remote: str, *, remove: bool) -> None:
        """Abort an object's uploads in progress, and with `remove` remove the object (a temp one);
        remember it when the store will not."""
        try:
            if remove:
                transport_for(self.fs).remove([remote])
            abort_uploads(self.fs, remote)
        except store_errors():
            with _LEFT_BEHIND_LOCK:
                _LEFT_BEHIND[remote] = remove
        else:
            with _LEFT_BEHIND_LOCK:
                _LEFT_BEHIND.pop(remote, None)

    def _forget_left_behind(self) -> None:
        with _LEFT_BEHIND_LOCK:
            mine = sorted((remote, remove) for remote, remove in _LEFT_BEHIND.items() if remote.startswith(f"{self.remote_root}/"))
        for remote, remove in mine:
            self._forget(remote, remove=remove)

    def abort_uploads(self) -> int:
        """Abort every multipart upload in progress under OUT (none locally): what failed uploads left.

        Call it once nothing else writes to OUT (a job's last step), since it also
        aborts uploads still running.

        Returns:
            How many were aborted.

        Raises:
            StorageError: the store refused or cannot be reached (retryable).
        """
        if self.is_local:
            return 0
        try:
            return abort_uploads(self.fs, f"{self.remote_root}/", under=True)
        except store_errors() as exc:
            raise store_failure("abort the unfinished uploads to", self.url, exc) from exc

    def fetch(self, rel: str) -> str:
        """Download a member of a remote OUT to its local staging file (under a temp name, then renamed).

        Returns:
            The local path (`local(rel)`); for a local OUT the file is already there.

        Raises:
            StorageError: the member cannot be read from the store (retryable).
        """
        path = self.local(rel)
        if self.is_local:
            return path
        temp = f"{path}{temp_suffix()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.fs.get_file(self._remote(rel), temp)
            os.replace(temp, path)
        except store_errors() as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise store_failure(f"download {rel} from", self.url, exc) from exc
        return path

    def exists(self, rel: str) -> bool:
        if self.is_local:
            return os.path.exists(self.local(rel))
        try:
            return bool(self.fs.exists(self._fresh(rel)))
        except store_errors() as exc:
            raise store_failure(f"look for {rel} in", self.url, exc) from exc

    def size(self, rel: str) -> int | None:
        try:
            if self.is_local:
                return os.path.getsize(self.local(rel))
            return int(self.fs.size(self._fresh(rel)))
        except (OSError, FileNotFoundError):
            return None

    def read_bytes(self, rel: str) -> bytes:
        """A member's bytes: one GET on S3 (see `transports`).

        Raises:
            FileNotFoundError: there is no such member.
            StorageError: the store cannot be read (retryable).
        """
        if self.is_local:
            with open(self.local(rel), "rb") as handle:
                return handle.read()
        remote = self._remote(rel)
        try:
            data: bytes = transport_for(self.fs).read_range(remote)
        except FileNotFoundError:
            raise
        except store_errors() as exc:
            raise store_failure(f"read {rel} from", self.url, exc) from exc
        return data

    def read_if_exists(self, rel: str) -> bytes | None:
        """A member's bytes, or None when there is no such member: one request where `exists` and
        `read_bytes` make three on S3 (a HEAD, a LIST when it is missing, a GET).

        Raises:
            StorageError: the store cannot be read (retryable).
        """
        try:
            return self.read_bytes(rel)
        except FileNotFoundError:
            return None

    def open_read(self, rel: str) -> Any:
        if self.is_local:
            return open(self.local(rel), "rb")
        return self.fs.open(self._remote(rel), "rb")

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Write a small file under its final name in one step."""
        path = self.local(rel)
        temp = f"{path}{temp_suffix()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(temp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path)
        except OSError as exc:
            if os.path.exists(temp):
                os.unlink(temp)
            raise write_failure(path, exc) from exc
        self.publish(rel)

    def remove(self, rel: str) -> None:
        """Remove a member, file or folder (nothing when there is none).

        On a store the removal is asked for at once, without looking first: a
        folder goes in one listing and one batch delete, where looking first
        costs two more round trips.

        Raises:
            StorageError: the store refuses or cannot be reached (retryable).
        """
        try:
            if self.is_local:
                path = self.local(rel)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.unlink(path)
                return
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self._fresh(rel), recursive=True)
        except store_errors() as exc:
            raise store_failure(f"remove {rel} from", self.url, exc) from exc

    def file_sizes(self) -> dict[str, int]:
        """Every file under OUT with its size, by path relative to OUT: one listing (paged on a store).

        Raises:
            StorageError: the store cannot be listed (retryable).
        """
        if self.is_local:
            sizes: dict[str, int] = {}
            for folder, _, names in os.walk(self.root):
                for name in names:
                    path = os.path.join(folder, name)
                    with contextlib.suppress(OSError):
                        sizes[os.path.relpath(path, self.root).replace(os.sep, "/")] = os.path.getsize(path)
            return sizes
        prefix = f"{self.remote_root}/"
        try:
            found = self.fs.find(self._fresh(""), detail=True)
        except FileNotFoundError:
            return {}
        except store_errors() as exc:
            raise store_failure("list", self.url, exc) from exc
        return {
            path[len(prefix) :]: int(entry.get("size") or 0)
            for path, entry in found.items()
            if path.startswith(prefix) and entry.get("type") != "directory"
        }

    def listdir(self, rel: str = "") -> list[str]:
        try:
            if self.is_local:
                path = self.local(rel) if rel else self.root
                return sorted(os.listdir(path)) if os.path.isdir(path) else []
            base = self._fresh(rel)
            if not self.fs.isdir(base):
                return []
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False))
        except OSError:
            return []


def remove_temp_objects(output: Output, finals: Iterable[str], *, older_than_s: float) -> list[str]:
    """Remove what crashed writers left on a remote OUT under temp names of `finals`; returns the members removed.

    A publish to a store other than S3 uploads to ``<final>.tmp-HOST-PID`` and moves it
    in one step, so a temp object outlives its publish only when its writer died in
    between (and S3 OUTs written by earlier versions, which published that way too). Only
    temp names of the given finals go, never a final name, and only objects the
    store dates more than `older_than_s` back: a live writer's upload in the
    middle of its move is younger. An object the store gives no date is kept.
    A no-op for a local OUT.

    Args:
        output: the OUT.
        finals: members relative to OUT (``shard-000000.tar``, ``v1/shard-000003.tar``, ``manifest.json``).
        older_than_s: the age a temp object must have to be removed.

    Raises:
        StorageError: the store cannot be listed or refuses a removal (retryable).
    """
    if output.is_local:
        return []
    by_folder: dict[str, set[str]] = {}
    for rel in finals:
        folder, _, name = rel.rpartition("/")
        by_folder.setdefault(folder, set()).add(name)
    cutoff = time.time() - older_than_s
    removed = []
    for folder, names in sorted(by_folder.items()):
        for name in _old_temp_names(output, folder, names, cutoff):
            rel = f"{folder}/{name}" if folder else name
            try:
                output.fs.rm(output._remote(rel))
            except FileNotFoundError:
                continue  # another sweep took it first
            except store_errors() as exc:
                raise store_failure(f"remove {rel} from", output.url, exc) from exc
            removed.append(rel)
    return removed


def _old_temp_names(output: Output, folder: str, finals: set[str], cutoff: float) -> list[str]:
    base = output._fresh(folder)
    try:
        entries = output.fs.ls(base, detail=True)
    except FileNotFoundError:
        return []
    except store_errors() as exc:
        raise store_failure(f"list {folder or '.'} in", output.url, exc) from exc
    names = []
    for entry in entries:
        name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
        final, marker, _ = name.partition(".tmp-")
        written = _modified(entry)
        if marker and final in finals and written is not None and written < cutoff:
            names.append(name)
    return sorted(names)


def _modified(entry: dict[str, Any]) -> float | None:
    """When the store last wrote an object (seconds since the epoch), from s3fs', gcsfs' or the local listing."""
    for field in ("LastModified", "mtime", "updated", "created"):
        value = entry.get(field)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None
