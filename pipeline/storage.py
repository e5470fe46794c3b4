"""Where prepared data lands: local directories or any fsspec URL, written atomically.

`Output` hides the difference: shards are always written to a local file
first (a staging folder for remote targets), then published under their final
name in one step (`os.replace` locally, upload-to-temp + move remotely), so a
reader never sees a partial shard or manifest. The module also tells what kind
of device a path lives on, from /proc/self/mountinfo and /sys/block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from typing import Any

from .errors import StorageError, write_failure
from .shards import temp_suffix
from .sources import local_path, open_fs

NETWORK_FS = frozenset(
    "nfs nfs4 cifs smb3 smbfs afs ceph glusterfs fuse.sshfs fuse.s3fs fuse.gcsfuse fuse.rclone "
    "fuse.juicefs lustre 9p virtiofs fuse.goofys fuse.mountpoint-s3 beegfs gpfs".split()
)
MEMORY_FS = frozenset({"tmpfs", "ramfs"})


class Output:
    """An output directory, local or fsspec, with atomic publishing."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") or "/"
        local = local_path(url)
        self.is_local = local is not None
        if local is not None:
            self.root = os.path.abspath(local)
            self.fs: Any = None
            self.remote_root = ""
            self.staging = self.root
        else:
            self.fs, self.remote_root = open_fs(url)
            self.remote_root = self.remote_root.rstrip("/")
            digest = hashlib.sha1(url.encode()).hexdigest()[:16]
            self.staging = os.path.join(tempfile.gettempdir(), f"gpufeed-staging-{digest}")
            self.root = self.staging

    def local(self, rel: str) -> str:
        """The local file a member is written to before `publish`."""
        return os.path.join(self.staging, rel)

    def _remote(self, rel: str) -> str:
        return f"{self.remote_root}/{rel}"

    def makedirs(self) -> None:
        try:
            os.makedirs(self.staging, exist_ok=True)
            if not self.is_local:
                self.fs.makedirs(self.remote_root, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create output folder {self.url}: {exc.strerror or exc}") from exc

    def publish(self, rel: str) -> None:
        """Move a finished local file to its final place (no-op for local outputs)."""
        if self.is_local:
            return
        source = self.local(rel)
        final = self._remote(rel)
        temp = f"{final}{temp_suffix()}"
        try:
            self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(source, temp)
            self.fs.mv(temp, final)
        except OSError as exc:
            raise StorageError(f"cannot upload {rel} to {self.url}: {exc}") from exc
        os.unlink(source)

    def exists(self, rel: str) -> bool:
        if self.is_local:
            return os.path.exists(self.local(rel))
        return bool(self.fs.exists(self._remote(rel)))

    def size(self, rel: str) -> int | None:
        try:
            if self.is_local:
                return os.path.getsize(self.local(rel))
            return int(self.fs.size(self._remote(rel)))
        except (OSError, FileNotFoundError):
            return None

    def read_bytes(self, rel: str) -> bytes:
        if self.is_local:
            with open(self.local(rel), "rb") as handle:
                return handle.read()
        data: bytes = self.fs.cat_file(self._remote(rel))
        return data

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
        try:
            if self.is_local:
                path = self.local(rel)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.unlink(path)
            elif self.fs.exists(self._remote(rel)):
                self.fs.rm(self._remote(rel), recursive=True)
        except OSError as exc:
            raise StorageError(f"cannot remove {rel} from {self.url}: {exc}") from exc

    def listdir(self, rel: str = "") -> list[str]:
        try:
            if self.is_local:
                path = self.local(rel) if rel else self.root
                return sorted(os.listdir(path)) if os.path.isdir(path) else []
            base = self._remote(rel) if rel else self.remote_root
            if not self.fs.isdir(base):
                return []
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False))
        except OSError:
            return []


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """The storage behind a path.

    Attributes:
        kind: nvme, ssd, rotational, network, memory, or unknown.
        fstype: filesystem type from the mount table.
        device: block device name (e.g. nvme0n1), if any.
        mount_point: where that filesystem is mounted.
    """

    kind: str
    fstype: str
    device: str
    mount_point: str


def _mount_for(path: str) -> tuple[str, str, str]:
    """(mount point, fstype, source device) of the mount holding `path`."""
    path = os.path.realpath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    best = ("/", "unknown", "")
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as handle:
            for line in handle:
                fields = line.split()
                dash = fields.index("-")
                mount_point = fields[4].replace("\\040", " ")
                fstype, source = fields[dash + 1], fields[dash + 2]
                inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best[0]):
                    best = (mount_point, fstype, source)
    except (OSError, ValueError):
        pass
    return best


def _block_device_kind(source: str) -> tuple[str, str]:
    if source.startswith("/dev/"):
        source = os.path.realpath(source)  # /dev/mapper/x and /dev/root are links to dm-N / sdaN
    name = os.path.basename(source)
    slaves = f"/sys/block/{name}/slaves"
    if os.path.isdir(slaves) and os.listdir(slaves):
        # LVM/LUKS: judge by the first underlying disk.
        return _block_device_kind("/dev/" + sorted(os.listdir(slaves))[0])
    if not source.startswith("/dev/") or not name:
        return "unknown", name
    sys_block = "/sys/class/block"
    base = name
    if os.path.exists(f"{sys_block}/{name}/partition"):
        parent = os.path.basename(os.path.dirname(os.path.realpath(f"{sys_block}/{name}")))
        base = parent or name
    if base.startswith("nvme"):
        return "nvme", base
    try:
        with open(f"/sys/block/{base}/queue/rotational", encoding="ascii") as handle:
            rotational = handle.read().strip() == "1"
    except OSError:
        return "unknown", base
    return ("rotational" if rotational else "ssd"), base


def device_info(path: str) -> DeviceInfo:
    """Describe the device behind a local path (network for remote URLs)."""
    local = local_path(path)
    if local is None:
        return DeviceInfo("network", path.split("://", 1)[0], "", "")
    mount_point, fstype, source = _mount_for(local)
    if fstype in NETWORK_FS or fstype.startswith("fuse.") and fstype not in ("fuse.overlayfs",):
        return DeviceInfo("network", fstype, source, mount_point)
    if fstype in MEMORY_FS:
        return DeviceInfo("memory", fstype, source, mount_point)
    kind, device = _block_device_kind(source)
    return DeviceInfo(kind, fstype, device, mount_point)


def faster_local_disk() -> str | None:
    """The name of a local NVMe device, if this machine has one."""
    try:
        names = sorted(os.listdir("/sys/block"))
    except OSError:
        return None
    for name in names:
        if name.startswith("nvme"):
            return name
    return None


def free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem holding a local path (None for remote URLs)."""
    local = local_path(path)
    if local is None:
        return None
    probe = os.path.abspath(local)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free
