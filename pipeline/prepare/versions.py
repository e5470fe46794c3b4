"""A dataset's versions in place (`DATASET/rNNNN/`) and the atomic swap that makes one current.

The manifest is the switch: `manifest.json` is replaced in one atomic rename
once the new version is complete. A swap records what it does in its version
folder (`.gpufeed-swap.json`) before the switch, so a run that stops right
after it is completed, not repeated (`swapped_in`); `.gpufeed-versions.json`
lists the versions kept for readers that still use them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

from ..errors import JobConflictError
from ..io.output import Output
from ..manifest import Manifest, read_manifest, write_manifest

VERSIONS_NAME = ".gpufeed-versions.json"
SWAP_NAME = ".gpufeed-swap.json"
VERSION_DIR = re.compile(r"r\d{4,}")
ROOT_SHARD = re.compile(r"shard-\d{6}\.tar|v\d+")


def claim_version(output: Output) -> str:
    """Create and return the next free version folder name (r0001, r0002, ...)."""
    existing = [int(name[1:]) for name in output.listdir() if VERSION_DIR.fullmatch(name)]
    number = max(existing, default=0) + 1
    while True:
        name = f"r{number:04d}"
        try:
            os.makedirs(output.local(name))
            return name
        except FileExistsError:
            number += 1


def version_of(manifest: Manifest) -> str:
    """The version folder a manifest's shards live in ("" for the original, top-level shards)."""
    first = manifest.shards[0].path.split("/", 1)[0] if manifest.shards else ""
    return first if VERSION_DIR.fullmatch(first) else ""


def swap_version(output: Output, old: Manifest, new: Manifest, version: str, keep: int) -> list[str]:
    """Make `new` (whose shards are in `version`) the dataset's manifest; returns the versions removed.

    Raises:
        JobConflictError: the manifest changed since `old` was read (nothing is swapped).
    """
    current = read_manifest(output)
    if current.to_dict() != old.to_dict():
        raise JobConflictError(f"{output.url} changed while it was being resharded; nothing was swapped, run it again")
    history = _read_history(output, old) + [version]
    kept = history[-(keep + 1) :]
    removed = history[: -(keep + 1)]
    removed += [  # folders of earlier reshards that died before their swap
        name
        for name in output.listdir()
        if VERSION_DIR.fullmatch(name) and name not in kept and name not in removed and int(name[1:]) < int(version[1:] or 0)
    ]
    record = {"version": version, "shards_before": shards_per_set(old), "kept": kept, "removed": removed}
    # Written before the switch, so a run that stops right after it can be completed from it.
    output.write_bytes_atomic(f"{version}/{SWAP_NAME}", json.dumps(record).encode("utf-8"))
    write_manifest(output, new)  # the switch: one atomic rename
    _complete_swap(output, record)
    return removed


@dataclasses.dataclass(frozen=True)
class SwapInfo:
    """A swap that happened: the version it made current, the shards per set it replaced, the versions it removed."""

    version: str
    shards_before: int
    removed: list[str]


def swapped_in(output: Output, version: str) -> SwapInfo | None:
    """What the swap that made `version` current did, or None when no swap made it current yet.

    Whatever that swap left undone (the versions list, removing old
    versions) is done now, so a swap that stopped right after its switch ends
    as if it had not stopped.

    Args:
        output: the dataset.
        version: a version folder name (`rNNNN`).

    Returns:
        The swap, as its first run reported it. A swap that left no record
        (an older gpufeed made it) reports no removals and the current layout
        as the one before.

    Raises:
        JobConflictError: `version` was made current and a later swap has replaced it since.
    """
    current = read_manifest(output)
    if version_of(current) != version:
        if version in _read_history(output, current):
            raise JobConflictError(
                f"{version} was swapped into {output.url} and a later reshard has replaced it since; nothing to publish"
            )
        return None
    record = _read_swap(output, version)
    if record is None:
        return SwapInfo(version, shards_per_set(current), [])
    _complete_swap(output, record)
    return SwapInfo(version, int(record["shards_before"]), [str(v) for v in record["removed"]])


def _read_swap(output: Output, version: str) -> dict[str, Any] | None:
    rel = f"{version}/{SWAP_NAME}"
    try:
        text = output.read_if_exists(rel)
        record = json.loads(text) if text is not None else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("version") == version else None


def _complete_swap(output: Output, record: dict[str, Any]) -> None:
    """The steps after the switch; each is safe to repeat."""
    output.write_bytes_atomic(VERSIONS_NAME, json.dumps({"versions": record["kept"]}).encode("utf-8"))
    for name in record["removed"]:
        _remove_version(output, name)


def shards_per_set(manifest: Manifest) -> int:
    """The shards of one variant set of a dataset."""
    return len(manifest.shards) // max(1, manifest.variants)


def _read_history(output: Output, current: Manifest) -> list[str]:
    try:
        versions = json.loads(output.read_bytes(VERSIONS_NAME))["versions"]
    except (OSError, ValueError, KeyError, TypeError):
        versions = []
    if not isinstance(versions, list) or not versions or versions[-1] != version_of(current):
        versions = [version_of(current)]
    return [str(v) for v in versions]


def _remove_version(output: Output, version: str) -> None:
    if version:
        output.remove(version)
        return
    for name in output.listdir():
        if ROOT_SHARD.fullmatch(name):
            output.remove(name)
