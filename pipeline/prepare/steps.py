"""The same job in steps, for a distributed runner (the Celery service): plan once, write each shard
anywhere that sees OUT, finish once; and the clean-up of a job that stopped.

Each step derives everything from the spec (and the shard's index), so a
re-run writes the same bytes and a finished shard is skipped.
"""

from __future__ import annotations

import contextlib
import json

from ..errors import StorageError
from ..io.fs import at_once
from ..io.output import Output
from ..manifest import MANIFEST_NAME
from ..specs import PrepareSpec
from .finishing import clean_up, finish, lost, written_and_present
from .lock import OutLock, remove_lock
from .opening import as_recorded, find_out, load_planned_job, open_planned, planned_spec, start_job
from .options import ProgressCallback, RunOptions, SourceCheck, checked_listing
from .repair import is_repair_plan, load_repair, open_repair, write_repaired_shard
from .results import PreparePlanInfo, PrepareResult, ShardRecord, result_of
from .resume import WORK_DIR, OutRecords, WorkFolder
from .writing import write_shard_here

__all__ = [
    "PreparePlanInfo",
    "ShardRecord",
    "discard_partial_shards",
    "discard_prepare",
    "finish_prepare",
    "local_copies_folder",
    "plan_prepare",
    "write_prepare_shard",
]


def plan_prepare(
    spec: PrepareSpec,
    *,
    force: bool = False,
    overwrite: bool = False,
    verify: bool = False,
    check_source: SourceCheck | None = None,
    job: str | None = None,
) -> PreparePlanInfo:
    """List SRC and plan the shards (kept in OUT/.gpufeed); resumable like `prepare_dataset`.

    When OUT holds the finished dataset with damaged shard files, this plans
    their repair: `pending` are the planned shards holding them, and
    `write_prepare_shard` writes those files again.

    Args:
        spec: the job.
        force: plan even when the free-space check says it will not fit.
        overwrite: replace an OUT prepared (or being prepared) with different settings.
        verify: check a finished dataset's shards by sha256, not only by size.
        check_source: called with the URL of each file SRC lists, as it is listed (the service
            refuses files outside its allowed roots this way); what it raises stops the plan
            before anything is planned, and a work folder this call made goes.
        job: the service job this plan is for: OUT's lock (`OutLock`) is taken for it and kept once
            the plan is made, until `finish_prepare` or `discard_prepare` of the same job removes it;
            without, the lock is held while this call runs.

    Returns:
        The plan: shards per variant set, and which of them still need writing.

    Raises:
        The same errors as `prepare_dataset`.
    """
    lock = OutLock(Output(spec.out), job).acquire()
    try:
        info = _plan_locked(spec, RunOptions(force=force, overwrite=overwrite, verify=verify, check_source=check_source))
    except BaseException:
        lock.release()
        raise
    lock.release(keep=job is not None and not info.already_complete)
    return info


def _plan_locked(spec: PrepareSpec, options: RunOptions) -> PreparePlanInfo:
    found = find_out(spec, options)
    done = found.finished
    if done is not None and not found.damaged:
        shards = len(done.shards) // max(1, done.variants)
        return PreparePlanInfo(shards, done.samples + done.rejected, 0, done.classes, [], True)
    if found.damaged:
        opened = open_repair(found, options)
        job, pending_of = opened.job, lambda: sorted(opened.rewrites())
    else:
        job = start_job(found, options)
        pending_of = job.unwritten
    try:
        job.folder.remove_stale_temp_files(job.spec.augment.variants)
        pending = pending_of()
    finally:
        job.listing.close()
    return PreparePlanInfo(job.plan.shards, job.listed, job.ignored, job.classes, pending, False, job.warnings)


def write_prepare_shard(
    spec: PrepareSpec, shard: int, *, progress: ProgressCallback | None = None, check_source: SourceCheck | None = None
) -> ShardRecord:
    """Write one planned shard in this process; a complete and valid shard is left as it is.

    In a planned repair (see `plan_prepare`), only the shard's damaged files
    are written, each published only if it is the file the manifest records.

    Idempotent: the bytes depend only on (spec, shard), temp files are
    per host and process, and the final rename is atomic, so a duplicate or
    re-delivered run is harmless. `progress` is called after every chunk of
    images; an exception it raises abandons the shard (its temp files are
    removed), which is how a runner cancels one.

    Args:
        spec: the planned job.
        shard: the shard's index in the plan.
        progress: called with a PrepareProgress after every chunk.
        check_source: called with every file (and mask) the shard would read, before it reads it; a
            file it refuses (ConfigError) is rejected with its message, never opened (the service's
            allowed roots: the listing in OUT may have changed since the plan).

    Returns:
        Its sample and reject counts, and whether it was complete already (skipped).

    Raises:
        ConfigError: the job was not planned (run `plan_prepare` first) or the index is out of range.
        JobConflictError: OUT holds a planned prepare of different settings.
        SourceError: in a repair, the file made again is not the one the manifest records.
        StorageError: OUT cannot be written.
    """
    records = OutRecords(Output(spec.out))
    folder = WorkFolder(records.output)
    # the shard's record is read beside the plan: on a store, one round trip, not two
    _, recorded = at_once(lambda: records.plan, lambda: folder.shard_record_text(shard))
    if is_repair_plan(records.plan):
        return write_repaired_shard(spec, shard, records, progress, check_source)
    job = load_planned_job(spec, records)
    job.listing = checked_listing(job.listing, check_source)
    try:
        job.check_in_plan(shard)
        skipped = folder.recorded_files_intact(recorded)
        if skipped:
            assert recorded is not None  # intact files are recorded ones
            record = json.loads(recorded)
        else:
            record = write_shard_here(job, shard, progress)
    finally:
        job.listing.close()
    return ShardRecord.of(shard, record, skipped)


def finish_prepare(spec: PrepareSpec, *, job: str | None = None) -> PrepareResult:
    """Write rejected.jsonl and the manifest once every planned shard is complete and valid.

    Idempotent: when OUT already holds the finished dataset of these settings
    (an earlier call wrote it, perhaps stopping before it removed the work
    folder), nothing is written again, what is left of the work folder goes,
    and the result is equal to the first call's. So a runner calls it again
    after a crash without checking anything first.

    Args:
        spec: the planned job.
        job: the service job whose plan took OUT's lock: its lock goes once the dataset is finished.

    Returns:
        The dataset's counts, from its manifest. A finish does no image work:
        `processed`, `seconds` and `workers` are 0, and `ignored` is what
        `plan_prepare` reported (0 here).

    Raises:
        ConfigError: OUT holds neither a planned prepare nor the finished dataset (run `plan_prepare` first).
        JobConflictError: OUT holds a planned prepare of different settings.
        NoImagesError: every listed file was rejected (rejected.jsonl is written, no manifest).
        StorageError: a shard is missing or does not match its record (nothing is published),
            or a finished dataset's shard file is still missing or damaged.
    """
    job_id, output = job, Output(spec.out)
    folder, records = WorkFolder(output), OutRecords(output).read_both()
    spec = as_recorded(spec, records)
    manifest = folder.finished_manifest(spec, records)
    if manifest is not None:
        damaged = folder.damaged_shards(manifest)
        if damaged:
            listed = ", ".join(f"{path} {problem}" for path, problem in list(damaged.items())[:10])
            raise StorageError(f"cannot finish {spec.out}: {listed}; write those shards first (plan_prepare plans them)")
        clean_up(folder, manifest)  # the leftovers of a finish that stopped right after its manifest (or of a repair)
        _release_job_lock(output, job_id)
        return result_of(spec.out, manifest)
    spec, saved = planned_spec(spec, records)
    if is_repair_plan(saved):
        load_repair(spec, records, saved, with_listing=False)  # raises: the dataset it repairs is gone
    planned = open_planned(spec, records, saved, with_listing=False)
    try:
        if output.is_local:  # sizes and sha256, file by file
            written, present = None, None
            missing = folder.pending_shards(planned.plan.shards)
        else:  # the records and one listing of OUT, at once: the sizes they record are checked against it
            written, present = written_and_present(planned)
            missing = [shard for shard, record in enumerate(written) if lost(record, present)]
        if missing:
            listed = ", ".join(str(shard) for shard in missing[:10]) + (" ..." if len(missing) > 10 else "")
            missing_shards = f"shard {listed} is" if len(missing) == 1 else f"shards {listed} are"
            raise StorageError(f"cannot finish {spec.out}: {missing_shards} missing or invalid")
        result = result_of(spec.out, finish(planned, written, present))
    finally:
        planned.listing.close()
    _release_job_lock(output, job_id)
    return result


def _release_job_lock(output: Output, job: str | None) -> None:
    if job is not None:
        remove_lock(output, job=job)


def discard_prepare(spec: PrepareSpec, *, job: str | None = None) -> None:
    """Remove what an unfinished prepare wrote to OUT: shards, rejects, the work folder, temp files, its lock.

    A finished dataset (OUT/manifest.json present) keeps its shards; only
    leftover temp files and work files go.

    Args:
        spec: the job whose output goes.
        job: the service job whose plan took OUT's lock (else a lock no live process holds goes).
    """
    output = Output(spec.out)
    folder = WorkFolder(output)
    if not output.exists(MANIFEST_NAME):
        folder.clear_output()
    else:
        output.remove(WORK_DIR)
    folder.remove_temp_files()
    remove_lock(output, job=job)


def discard_partial_shards(spec: PrepareSpec, *, job: str | None = None) -> None:
    """Remove the partial shards a stopped prepare left in OUT, and its lock, and nothing it finished.

    Shard temp files go (and, on a store, the multipart uploads left in
    progress); finished shards, the plan and the listing stay, so the same job
    run again resumes, writing only the shards that are missing, as after a
    Ctrl-C. Call it once no writer of the job is left.

    Args:
        spec: the stopped job.
        job: the service job whose plan took OUT's lock (else a lock no live process holds goes).
    """
    output = Output(spec.out)
    WorkFolder(output).remove_temp_files()
    if not output.is_local:
        with contextlib.suppress(StorageError):  # invisible leftovers: a failure here must not fail the cancel
            output.abort_uploads()
    remove_lock(output, job=job)


def local_copies_folder(spec: PrepareSpec) -> str | None:
    """The folder where the steps of a job on a remote OUT keep this machine's copies; None for a local OUT.

    Each machine that plans or writes shards keeps the job's listing there
    (downloaded once, see `listing.fetch_listing`) and each shard file until
    it is uploaded. `finish_prepare` removes the copies of the machine it runs
    on; a runner removes the other machines' once the job is over (no step of
    it may still be running there).

    Args:
        spec: the job.
    """
    output = Output(spec.out)
    return None if output.is_local else output.staging
