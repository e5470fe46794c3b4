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
distributed runner (the service) runs the same job in steps (`steps.py`,
re-exported here): `plan_prepare` once, `write_prepare_shard` per shard
anywhere that sees OUT, `finish_prepare` once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ..errors import SampleError
from ..io.fs import storage_options_for
from ..io.output import Output
from ..manifest import Manifest
from ..specs import PrepareSpec
from ..units import format_count
from .finishing import finish, run_result
from .lock import OutLock
from .opening import FoundOut, Job, find_out, start_job
from .options import PrepareProgress, ProgressCallback, RunOptions, SourceCheck
from .pool import IO_THREADS
from .repair import repair_dataset
from .results import PrepareResult, result_of
from .steps import (
    PreparePlanInfo,
    ShardRecord,
    discard_partial_shards,
    discard_prepare,
    finish_prepare,
    local_copies_folder,
    plan_prepare,
    write_prepare_shard,
)
from .writing import strictly, write_shards

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
