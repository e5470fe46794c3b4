"""`gpufeed prepare`: list -> plan -> per shard: decode -> transform -> encode -> write -> manifest.

The listing is spilled to a file in OUT/.gpufeed (`listing.py`) so memory
stays flat however many files there are. A deterministic plan (`plan.py`)
assigns listing indices to shards through a seeded permutation; each shard's
samples are made on a process pool (`pool.py`, one source -> one sample in
`sample.py`), written under a temporary name and renamed when complete, and a
small record of it (counts, hashes, rejects) is saved next to the plan
(`resume.py`). A re-run of the same job lists again, checks that the source
did not change, keeps every complete and valid shard and writes only the
rest. The manifest is written last: its presence means the dataset is
complete. A source that gives no usable image gets no manifest at all.

A job's SRC is recorded resolved (`io.fs.resolve_location`), so `raw`,
`./raw/` and `/data/raw` are the same job, and shards record their sources
the same way whatever the folder a prepare ran from.

A re-run of a finished job checks its shard files (sizes; with `verify`,
sha256) and writes the damaged ones again (`repair.py`): the plan is made
again from the same listing, and a shard is rebuilt byte for byte (it depends
only on the spec and its index), so the manifest stays as it is. A rebuilt
file that is not the one the manifest records (the source changed since) is
refused.

A file is accepted exactly when Pillow can read it (`sample.py`); a strict
prepare (`strict=True`, `gpufeed prepare --strict`) instead stops at the
first rejected file and leaves OUT as it found it: no manifest, none of the
shards it wrote, no temp files, so the same command without strict still
runs (and resumes what an earlier run left).

`prepare_dataset` runs all of it in this process and its pool: it opens the
job (`opening.py`), writes its shards (`writing.py`) and finishes it
(`finishing.py`), or hands a damaged finished dataset to `repair.py`. A
distributed runner (the service) runs the same job in steps (below):
`plan_prepare` once, `write_prepare_shard` per shard anywhere that sees OUT,
`finish_prepare` once.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

from ..errors import SampleError, StorageError
from ..io.fs import at_once, storage_options_for
from ..io.output import Output
from ..manifest import MANIFEST_NAME, Manifest
from ..specs import PrepareSpec
from ..units import format_count
from .finishing import clean_up, finish, lost, run_result, written_and_present
from .lock import OutLock, remove_lock
from .opening import FoundOut, Job, as_recorded, find_out, load_planned_job, open_planned, planned_spec, start_job
from .options import PrepareProgress, ProgressCallback, RunOptions, SourceCheck
from .pool import IO_THREADS
from .repair import is_repair_plan, load_repair, open_repair, repair_dataset, write_repaired_shard
from .results import PreparePlanInfo, PrepareResult, ShardRecord, result_of
from .resume import WORK_DIR, OutRecords, WorkFolder
from .writing import strictly, write_shard_here, write_shards

__all__ = [
    "PreparePlanInfo",
    "PrepareProgress",
    "PrepareResult",
    "ProgressCallback",
    "RunOptions",
    "ShardRecord",
    "SourceCheck",
    "discard_partial_shards",
    "discard_prepare",
    "finish_prepare",
    "local_copies_folder",
    "plan_prepare",
    "prepare_dataset",
    "write_prepare_shard",
]


def prepare_dataset(
    spec: PrepareSpec,
    *,
    workers: int | None = None,
    force: bool = False,
    overwrite: bool = False,
    strict: bool = False,
    verify: bool = False,
    progress: ProgressCallback | None = None,
    storage_options: Mapping[str, Any] | None = None,
    io_threads: int = IO_THREADS,
) -> PrepareResult:
    """Prepare SRC into verified WebDataset shards at OUT.

    A file is accepted exactly when Pillow can open, fully load and convert
    it (within `spec.max_pixels`); every other file is rejected with a reason
    in OUT/rejected.jsonl, and the job goes on without it, unless `strict`.

    Run again, it does only what is left: an interrupted job resumes, and a
    finished one has its shard files checked (sizes; sha256 with `verify`)
    and the missing or damaged ones written again.

    Args:
        spec: the job (source, out and every setting); SRC may be relative, it is recorded resolved.
        workers: processes; None uses every available core, 0 runs in-process.
        force: write even when the free-space check says it will not fit.
        overwrite: replace an OUT prepared with different settings.
        strict: stop at the first rejected file and publish nothing: OUT is
            left as it was before this run (no manifest, none of this run's
            shards), so the same job without strict can run after it.
        verify: when OUT holds the finished dataset, hash every shard against
            the manifest (not only its size) and write again those that differ.
        progress: called with a PrepareProgress after every chunk.
        storage_options: fsspec options for the stores of SRC and OUT (``endpoint_url``,
            ``profile``, ``anon``, credentials); used in this process and its pool only,
            never written anywhere. Credentials otherwise come from the usual places
            (``AWS_*`` variables, ``~/.aws``).
        io_threads: for a remote SRC, reads kept in flight while the workers decode
            (sized for the store's latency, not for cores): with a pool they run in
            this process, read ahead across chunks; 0 has each worker read one file at
            a time. A local SRC is read in line whatever this is.

    Returns:
        A PrepareResult summary.

    Raises:
        ConfigError: bad settings.
        NoImagesError: SRC gave no usable image (none listed, or every one rejected); no manifest is written.
        SourceError: SRC cannot be listed or has changed since an interrupted run (or, for a
            repair, since the dataset was prepared).
        JobConflictError: OUT holds a different job (the message names the settings that differ), holds
            files but no gpufeed dataset, or another prepare is writing it (the message names its process).
        ManifestError: a damaged shard lies where prepare does not write (the dataset was re-packed).
        StorageError: OUT cannot be written (e.g. full disk); complete shards are kept.
        SampleError: with `strict`, a file was rejected (the message names it
            and the reason), or OUT already holds this dataset with rejects.
    """
    options = RunOptions(
        workers=workers, force=force, overwrite=overwrite, strict=strict, verify=verify, io_threads=io_threads, progress=progress
    )
    with storage_options_for((spec.source, spec.out), storage_options), OutLock(Output(spec.out)):
        return _prepare_here(spec, options)


def _prepare_here(spec: PrepareSpec, options: RunOptions) -> PrepareResult:
    started = time.perf_counter()
    options = options.with_workers()
    found = find_out(spec, options)
    if found.damaged:
        return repair_dataset(found, options, started)
    if found.finished is not None:
        return _already_complete(spec, found, options, started)
    job = start_job(found, options)

    def write() -> tuple[int, int, Manifest]:
        job.folder.remove_stale_temp_files(job.spec.augment.variants)
        pending = job.unwritten()
        processed = write_shards(job, pending, options, started)
        return processed, job.plan.shards - len(pending), finish(job)

    processed, resumed, manifest = strictly(job, write, _abandon)
    return run_result(job, manifest, options, started, processed, resumed)


def _already_complete(spec: PrepareSpec, found: FoundOut, options: RunOptions, started: float) -> PrepareResult:
    """OUT holds this dataset, intact: nothing to write (a strict run refuses one prepared with rejects)."""
    manifest = found.finished
    assert manifest is not None
    if options.strict and manifest.rejected:
        first = next(iter(found.folder.read_rejects()), {"source": "?", "reason": "see rejected.jsonl"})
        raise SampleError(
            f"{spec.out} already holds this dataset, prepared without strict=True: it left out "
            f"{format_count(manifest.rejected, 'rejected file')}, the first {first['source']}: {first['reason']}; "
            "pass overwrite=True to prepare it again"
        )
    seconds = time.perf_counter() - started
    return result_of(
        spec.out, manifest, seconds=seconds, resumed=len(manifest.shards), workers=options.workers or 0,
        already_complete=True, verified=options.verify,
    )  # fmt: skip


def _abandon(job: Job) -> None:
    """Take back what a stopped strict run wrote: everything when it planned the job, else its own shards."""
    if job.pool is not None:
        job.pool.terminate()  # the estimate's pool, when no shard was started yet
    job.listing.close()
    if job.planned_here:
        job.folder.clear_output()
        job.folder.remove_temp_files()
        job.folder.remove_work()
    else:
        job.folder.remove_shards(sorted(set(job.written)))


# ---------------------------------------------------------------------------
# The same job in steps, for a distributed runner (the Celery service):
# plan once, write each shard anywhere that sees OUT, finish once.


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


def write_prepare_shard(spec: PrepareSpec, shard: int, *, progress: ProgressCallback | None = None) -> ShardRecord:
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
        return write_repaired_shard(spec, shard, records, progress)
    job = load_planned_job(spec, records)
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
