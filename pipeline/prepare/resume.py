"""What OUT already holds, so an interrupted or repeated prepare does only what is left.

A job's work lives in OUT/.gpufeed: the listing spill, `plan.json` (the
settings' identity, the listing's hash, the shard plan) and one small record
per written shard (the sizes and hashes of its files, its rejects). A shard is
complete when its record exists and every file it names still has the
recorded size (and, locally, sha256). The manifest is written last: once OUT
holds a manifest of the same settings the dataset is complete, and whatever
is left of the work folder is a leftover of a run that stopped just after.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

from ..errors import JobConflictError, ManifestError
from ..io.fs import file_sha256
from ..io.output import Output
from ..io.tar import ShardInfo
from ..manifest import MANIFEST_NAME, REJECTED_NAME, Manifest, read_manifest
from ..specs import PrepareSpec

WORK_DIR = ".gpufeed"
PLAN_REL = f"{WORK_DIR}/plan.json"
_OUTPUT_NAME = re.compile(r"shard-\d{6}\.tar|v\d+")  # what a prepare writes at the top of OUT
_VARIANT_DIR = re.compile(r"v\d+")


def read_plan(output: Output) -> dict[str, Any] | None:
    """The saved plan record of an unfinished job in OUT, or None when there is none."""
    if not output.exists(PLAN_REL):
        return None
    record: dict[str, Any] = json.loads(output.read_bytes(PLAN_REL))
    return record


def write_plan(output: Output, record: dict[str, Any]) -> None:
    """Save the plan record (atomically: a reader sees the old one or the new one)."""
    output.write_bytes_atomic(PLAN_REL, json.dumps(record, indent=1).encode("utf-8"))


def set_prefixes(variants: int) -> list[tuple[int | None, str]]:
    """(variant, folder prefix) of every variant set: `v0/`, `v1/` ..., or one set at the top of OUT."""
    if variants:
        return [(v, f"v{v}/") for v in range(variants)]
    return [(None, "")]


def _shard_record_rel(shard: int) -> str:
    return f"{WORK_DIR}/shards/{shard:06d}.json"


def write_shard_record(
    output: Output, shard: int, infos: list[ShardInfo], rejected: list[dict[str, str]], warned: int = 0
) -> None:
    """Record a written shard: its files (one per variant set that got samples), its rejects, and how
    many of its samples were decoded with warnings."""
    record = {"shard": shard, "shards": [info.to_dict() for info in infos], "rejected": rejected, "warned": warned}
    output.write_bytes_atomic(_shard_record_rel(shard), json.dumps(record).encode("utf-8"))


def read_shard_record(output: Output, shard: int) -> dict[str, Any]:
    """A written shard's record: `shards` (file dicts), `rejected` (source, reason) entries, `warned`
    (0 in records of older versions, which did not count)."""
    record: dict[str, Any] = json.loads(output.read_bytes(_shard_record_rel(shard)))
    return record


def remove_shards(output: Output, shards: list[int]) -> None:
    """Remove written shards: their files and their records (the plan stays, so they are pending again)."""
    for shard in shards:
        if has_shard_record(output, shard):
            for info in read_shard_record(output, shard)["shards"]:
                output.remove(info["path"])
            output.remove(_shard_record_rel(shard))


def read_rejects(output: Output) -> list[dict[str, str]]:
    """The entries of a finished dataset's rejected.jsonl ([] when it has none)."""
    if not output.exists(REJECTED_NAME):
        return []
    return [json.loads(line) for line in output.read_bytes(REJECTED_NAME).splitlines() if line.strip()]


def has_shard_record(output: Output, shard: int) -> bool:
    """Whether a run wrote and recorded the shard (its files are not checked: see `shard_is_complete`)."""
    return output.exists(_shard_record_rel(shard))


def shard_is_complete(output: Output, shard: int) -> bool:
    """Whether the shard was recorded and its files are still exactly what was recorded."""
    rel = _shard_record_rel(shard)
    if not output.exists(rel):
        return False
    for info in read_shard_record(output, shard)["shards"]:
        if output.size(info["path"]) != info["bytes"]:
            return False
        # Locally a hash is cheap next to rewriting; remotely the size has to do.
        if output.is_local and file_sha256(output.local(info["path"]))[0] != info["sha256"]:
            return False
    return True


def pending_shards(output: Output, shards: int) -> list[int]:
    """The planned shards (0 .. shards-1) that are not complete yet."""
    return [shard for shard in range(shards) if not shard_is_complete(output, shard)]


def remove_stale_temp_files(output: Output, variants: int) -> None:
    """Remove the temp files of shards an earlier run was writing when it stopped."""
    for _, prefix in set_prefixes(variants):
        directory = output.local(prefix) if prefix else output.staging
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            if _is_temp_shard(name):
                os.unlink(os.path.join(directory, name))


def remove_temp_files(output: Output) -> None:
    """Remove every shard temp file in a local OUT, whatever the variant sets of the job that left it."""
    if not output.is_local:
        return
    for prefix in [""] + [name for name in output.listdir() if _VARIANT_DIR.fullmatch(name)]:
        for name in output.listdir(prefix):
            if _is_temp_shard(name):
                output.remove(f"{prefix}/{name}" if prefix else name)


def _is_temp_shard(name: str) -> bool:
    return name.startswith(".shard-") and ".tmp-" in name


def finished_manifest(output: Output, spec: PrepareSpec) -> Manifest | None:
    """OUT's manifest when OUT holds the finished dataset of exactly these settings, else None."""
    if not output.exists(MANIFEST_NAME):
        return None
    try:
        manifest = read_manifest(output)
    except ManifestError:
        return None
    return manifest if manifest.params == spec.output_identity() else None


def check_existing(output: Output, spec: PrepareSpec, overwrite: bool) -> Manifest | None:
    """The existing manifest when OUT already holds this exact job, else None (OUT cleared when asked).

    Raises:
        JobConflictError: OUT holds another job's dataset or unfinished work and `overwrite` is False.
    """
    if output.exists(MANIFEST_NAME):
        finished = finished_manifest(output, spec)
        if finished is not None and not overwrite:
            return finished
        if not overwrite:
            raise JobConflictError(
                f"{spec.out} already holds a dataset prepared with different settings; "
                "choose another OUT or pass --overwrite to replace it"
            )
        clear_output(output)
        return None
    plan = read_plan(output)
    if plan is not None and plan.get("identity") != spec.output_identity():
        if not overwrite:
            raise JobConflictError(
                f"{spec.out} holds an unfinished prepare with different settings; "
                "re-run that command to finish it, choose another OUT, or pass --overwrite"
            )
        clear_output(output)
    return None


def clear_output(output: Output) -> None:
    """Remove everything a prepare writes to OUT (and nothing else that lives there)."""
    for name in output.listdir():
        if name in (MANIFEST_NAME, REJECTED_NAME, WORK_DIR) or _OUTPUT_NAME.fullmatch(name):
            output.remove(name)


def remove_work(output: Output) -> None:
    """Remove the work folder (and a remote OUT's local staging copy) once the manifest is written."""
    output.remove(WORK_DIR)
    if not output.is_local:
        shutil.rmtree(output.staging, ignore_errors=True)
