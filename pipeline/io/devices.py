"""What kind of device a path lives on, and how much room it has.

From /proc/self/mountinfo and /sys/block: nvme, ssd, rotational, network or tmpfs.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from .fs import local_path

NETWORK_FS = frozenset(
    "nfs nfs4 cifs smb3 smbfs afs ceph glusterfs fuse.sshfs fuse.s3fs fuse.gcsfuse fuse.rclone "
    "fuse.juicefs lustre 9p virtiofs fuse.goofys fuse.mountpoint-s3 beegfs gpfs".split()
)


MEMORY_FS = frozenset({"tmpfs", "ramfs"})


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
