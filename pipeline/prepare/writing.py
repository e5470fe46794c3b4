"""Writing a job's shards: chunks to the pool, samples into one temp tar per variant set, commit, record.

What a written file becomes is the `commit`'s to say: a prepare commits
every file that got samples (`commit_new_files`); a repair (`repair.py`)
publishes only the files it rewrites, each checked against the manifest.
A strict job stops at the first reject (`StrictStop`, turned into a
SampleError by `strictly`, once the caller's abandon has undone the run).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ..errors import SampleError
from ..io.fs import at_once, redact_location, redact_urls
from ..io.tar import ShardInfo, TarShardWriter
from .opening import Job
from .options import PrepareProgress, ProgressCallback, RunOptions
from .plan import shard_name
from .pool import Chunk, PendingChunk, SamplePool, chunk_sizes
from .resume import set_prefixes
from .sample.make import SampleOutcome

T = TypeVar("T")

SetFile = tuple[TarShardWriter, "int | None", str]
"""One variant set's file of a shard being written: its writer, the variant (None: no sets), its path in OUT."""
Commit = Callable[[Job, int, list[SetFile]], tuple[list[ShardInfo], list[Callable[[], object]]]]
"""Ends a shard's files (its writers still open): returns what the shard's record lists, and the uploads to run."""


def commit_new_files(job: Job, shard: int, files: list[SetFile]) -> tuple[list[ShardInfo], list[Callable[[], object]]]:
    """A prepare's commit: every file that got samples is renamed into place (on a store, then uploaded)."""
    infos = [writer.commit(rel, variant) for writer, variant, rel in files if writer.samples]
    uploads: list[Callable[[], object]] = []
    if not job.output.is_local:
        uploads = [functools.partial(job.output.publish, info.path) for info in infos]
    return infos, uploads


def write_shards(job: Job, pending: list[int], options: RunOptions, started: float, commit: Commit = commit_new_files) -> int:
    """Write the `pending` shards on the job's pool (or one started now); returns the images processed."""
    total = sum(len(job.plan.positions(s)) for s in pending)
    state = PrepareProgress(0, total, 0, 0.0)
    pool = job.pool or SamplePool(options.workers or 0, job.spec, job.classes, options.io_threads, job.task.mask_fill)
    try:
        for shard in pending:
            write_shard(job, shard, pool, state, options.progress, started, commit)
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    return total


def write_shard_here(
    job: Job, shard: int, progress: ProgressCallback | None, commit: Commit = commit_new_files
) -> dict[str, Any]:
    """Write one shard in this process (a shard step); returns its record."""
    state = PrepareProgress(0, len(job.plan.positions(shard)), 0, 0.0)
    pool = SamplePool(0, job.spec, job.classes, ignore_index=job.task.mask_fill)
    return write_shard(job, shard, pool, state, progress, time.perf_counter(), commit)


def write_shard(
    job: Job,
    shard: int,
    pool: SamplePool,
    state: PrepareProgress,
    progress: ProgressCallback | None,
    started: float,
    commit: Commit = commit_new_files,
) -> dict[str, Any]:
    """Write a planned shard's files (one per variant set), `commit` them, and record the shard.

    Returns:
        The shard's record (`WorkFolder.write_shard_record`).
    """
    sets = set_prefixes(job.spec.augment.variants)
    writers = [TarShardWriter(job.output.local(prefix + shard_name(shard))) for _, prefix in sets]
    rejected: list[dict[str, str]] = []
    warned_before, dropped_before, unclear_before = state.warned, state.boxes_dropped, state.frames_unclear
    window = max(2, pool.workers * 3)  # chunks in flight: keeps every worker busy, bounds memory
    with _AllWritersOpen(writers):
        in_flight: deque[tuple[PendingChunk, Chunk]] = deque()
        for chunk in _chunks(job, shard, pool.workers):
            in_flight.append((pool.submit(chunk, job.cache), chunk))
            if len(in_flight) >= window:
                _drain(pool.result(*in_flight.popleft()), writers, rejected, state, job.strict)
                _report(state, progress, started)
        while in_flight:
            _drain(pool.result(*in_flight.popleft()), writers, rejected, state, job.strict)
            _report(state, progress, started)
        files = [(writer, variant, prefix + shard_name(shard)) for writer, (variant, prefix) in zip(writers, sets)]
        infos, uploads = commit(job, shard, files)
    # On a store the record goes up beside its files, not after them (a round trip less per shard):
    # a record whose file is missing or of another size counts as unwritten (recorded_files_intact),
    # so a record that lands before its file, or without it, only makes a re-run write the shard again.
    recording = functools.partial(
        job.folder.write_shard_record, shard, infos, rejected, state.warned - warned_before,
        state.boxes_dropped - dropped_before, state.frames_unclear - unclear_before,
    )  # fmt: skip
    record: dict[str, Any] = at_once(*uploads, recording)[-1]
    job.written.append(shard)
    return record


def _chunks(job: Job, shard: int, workers: int) -> Iterator[Chunk]:
    indices = job.plan.indices(shard)
    start = 0
    for size in chunk_sizes(len(indices), workers):
        yield [(int(i), job.listing.get(int(i))) for i in indices[start : start + size]]
        start += size


class _AllWritersOpen:
    """Enter several writers; leaving removes every uncommitted temp file."""

    def __init__(self, writers: Sequence[TarShardWriter]) -> None:
        self.writers = writers

    def __enter__(self) -> None:
        for writer in self.writers:
            writer.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        for writer in self.writers:
            writer.__exit__(*exc_info)


def _drain(
    outcomes: list[SampleOutcome],
    writers: list[TarShardWriter],
    rejected: list[dict[str, str]],
    state: PrepareProgress,
    strict: bool = False,
) -> None:
    for outcome in outcomes:
        state.done += 1
        if outcome.tars is None:
            if strict:
                raise StrictStop(outcome.source, outcome.reason)
            rejected.append({"source": redact_location(outcome.source), "reason": redact_urls(outcome.reason)})
            state.rejected += 1
            continue
        state.warned += bool(outcome.warnings)
        state.boxes_dropped += outcome.boxes_dropped
        state.frames_unclear += outcome.frames_unclear
        for writer, blob in zip(writers, outcome.tars):
            writer.write_sample_bytes(blob)


def _report(state: PrepareProgress, progress: ProgressCallback | None, started: float) -> None:
    if progress is not None:
        state.seconds = time.perf_counter() - started
        progress(state)


# ---------------------------------------------------------------------------
# A strict prepare: the first reject stops it, and OUT is left as this run found it


class StrictStop(Exception):
    """A strict prepare met a rejected file: unwinds the writing, then becomes a SampleError."""

    def __init__(self, source: str, reason: str, earlier: bool = False) -> None:
        by = " (rejected by an earlier run of this job)" if earlier else ""
        self.message = (
            f"strict prepare stopped at a rejected file: {source}: {reason}{by}; nothing was published "
            "(fix or remove that file, or prepare without strict=True to leave it out)"
        )
        super().__init__(self.message)


def strictly(job: Job, write: Callable[[], T], abandon: Callable[[Job], None]) -> T:
    """Run `write`; in a strict job the first reject (known already, or met) has `abandon` undo the run.

    The job's listing is closed either way.

    Raises:
        SampleError: a strict job met a rejected file (the message names it and the reason).
    """
    try:
        if job.strict:
            _check_known_rejects(job)
        return write()
    except StrictStop as stop:
        abandon(job)
        raise SampleError(stop.message) from None
    finally:
        job.listing.close()


def _check_known_rejects(job: Job) -> None:
    """Stop now for a reject already known: among the samples the size estimate made, or in a kept shard."""
    for index in sorted(job.cache):
        outcome = job.cache[index]
        if outcome.tars is None:
            raise StrictStop(outcome.source, outcome.reason)
    for shard in range(job.plan.shards):  # a recorded reject stands even if its shard must be written again
        if job.folder.has_shard_record(shard):
            for entry in job.folder.read_shard_record(shard)["rejected"][:1]:
                raise StrictStop(entry["source"], entry["reason"], earlier=True)
