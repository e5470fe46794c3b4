"""Finishing a job: rejected.jsonl, then the manifest (the switch), then the work folder goes."""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import NoImagesError, StorageError
from ..io.fs import at_once, redact_location
from ..io.tar import ShardInfo
from ..manifest import REJECTED_NAME, Manifest, write_manifest
from ..units import format_count
from .opening import Job
from .options import RunOptions
from .results import PrepareResult, result_of
from .resume import WorkFolder


def finish(
    job: Job, written: list[dict[str, Any] | None] | None = None, present: dict[str, int] | None = None
) -> Manifest:
    """Write rejected.jsonl and the manifest of every shard recorded, once OUT holds each at its size.

    `written`, `present`: the shard records and OUT's file sizes, when the caller read them.
    """
    shards: list[ShardInfo] = []
    rejected_lines: list[bytes] = []
    warned = dropped = unclear = 0
    if written is None or present is None:
        written, present = written_and_present(job)
    lost_shards: list[int] = []
    for shard, record in enumerate(written):
        if lost(record, present):
            lost_shards.append(shard)
        if record is None:
            continue
        for info in record["shards"]:
            shards.append(ShardInfo(info["path"], info["samples"], info["bytes"], info["sha256"], info.get("variant")))
        rejected_lines += [json.dumps(entry).encode("ascii") + b"\n" for entry in record["rejected"]]
        warned += record.get("warned", 0)
        dropped += record.get("boxes_dropped", 0)
        unclear += record.get("frames_unclear", 0)
    if lost_shards:
        numbers = sorted(set(lost_shards))
        raise StorageError(
            f"cannot finish {job.spec.out}: shard(s) {numbers[:10]} written by this job are missing from it now "
            "or have another size (was the store emptied or changed meanwhile?); nothing was published: "
            "run the same command again to write them"
        )
    rejected = len(rejected_lines)
    samples = sum(s.samples for s in shards) // max(1, job.spec.augment.variants)
    if samples + rejected != job.listed:
        raise StorageError(
            f"internal check failed: {samples} samples + {rejected} rejects != {job.listed} listed; "
            f"remove {job.spec.out} and run again"
        )
    job.output.write_bytes_atomic(REJECTED_NAME, b"".join(rejected_lines))
    if samples == 0:  # a manifest of no samples is no dataset: keep the reasons, write nothing else
        job.listing.close()
        job.folder.remove_work()
        raise NoImagesError(
            f"no usable images in {job.spec.source}: {format_count(job.listed, 'file')} listed, {rejected} rejected "
            f"(see {job.spec.out.rstrip('/')}/{REJECTED_NAME})"
        )
    manifest = Manifest(
        samples=samples,
        classes=job.classes,
        shards=shards,
        params=job.spec.output_identity(),
        source=redact_location(job.spec.source),
        rejected=rejected,
        variants=job.spec.augment.variants,
        decoded_with_warnings=warned,
        task=job.task.task,
        fields=list(job.task.fields),
        ignore_index=job.task.ignore_index,
        boxes_dropped=dropped,
        frames_unclear=unclear,
        mask_classes=job.task.mask_classes(job.classes),
    )
    write_manifest(job.output, manifest)
    job.listing.close()
    clean_up(job.folder, manifest)
    return manifest


def clean_up(folder: WorkFolder, manifest: Manifest) -> None:
    """Once the manifest is written: the temp objects crashed writers left and the work folder go (at once)."""
    at_once(lambda: folder.remove_stale_temp_objects(manifest), folder.remove_work)


def written_and_present(job: Job) -> tuple[list[dict[str, Any] | None], dict[str, int]]:
    """Every planned shard's record (None: not written) and the size of every file under OUT now (one
    listing, paged on a store: the manifest lists only what OUT holds, and a store may have lost files)."""
    written, present = at_once(lambda: job.folder.for_each_shard(job.plan.shards, job.folder.shard_record_or_none), job.output.file_sizes)
    return written, present


def lost(record: dict[str, Any] | None, present: dict[str, int]) -> bool:
    """Whether a shard is unwritten, or a file of its record is missing from OUT or of another size."""
    return record is None or any(present.get(info["path"]) != info["bytes"] for info in record["shards"])


def run_result(
    job: Job, manifest: Manifest, options: RunOptions, started: float, processed: int, resumed: int, **repair: Any
) -> PrepareResult:
    """The summary of a run that wrote `job`'s shards (`repair`: `repaired` and `verified`, for a repair)."""
    return result_of(
        job.spec.out,
        manifest,
        ignored=job.ignored,
        seconds=time.perf_counter() - started,
        processed=processed,
        resumed=resumed,
        workers=options.workers or 0,
        warnings=job.warnings,
        **repair,
    )
