"""Repair: a finished dataset's missing or damaged shard files written again, byte for byte.

A re-run of a finished job checks its shard files (sizes; with `verify`,
sha256); when some are damaged, the plan is made again from a fresh listing
of the same SRC, and each planned shard holding a damaged file is rebuilt (a
shard depends only on the spec and its index). Only the damaged files are
published, each only when it is the very file the manifest records, so the
manifest and rejected.jsonl stay as they are. A rebuilt file that is not the
one recorded (the source changed since) is refused, and so is a damaged file
where prepare does not write (the dataset was re-packed since).

A repair starts from a fresh listing every time: when it stops, its work
folder goes, and nothing of it is resumed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, ManifestError, SourceError
from ..io.tar import ShardInfo, TarShardWriter
from ..manifest import Manifest
from ..specs import PrepareSpec
from ..units import format_count
from .finishing import run_result
from .opening import FoundOut, Job, Listed, list_source, open_planned, plan_job, planned_spec
from .options import ProgressCallback, RunOptions, SourceCheck, checked_listing
from .plan import ShardPlan, planned_shard_of
from .results import PrepareResult, ShardRecord
from .resume import WORK_DIR, OutRecords, WorkFolder
from .writing import SetFile, strictly, write_shard_here, write_shards


@dataclasses.dataclass
class Repair:
    """A finished dataset whose damaged files a job writes again: its manifest, and path -> what was wrong."""

    manifest: Manifest
    damaged: dict[str, str]
    _by_path: dict[str, ShardInfo] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_path = {info.path: info for info in self.manifest.shards}

    def recorded(self, rel: str) -> ShardInfo | None:
        """The manifest's entry of a shard file, None when the manifest has no such file."""
        return self._by_path.get(rel)


@dataclasses.dataclass
class RepairJob:
    """A repair, opened: the job that rebuilds the shards, and what it repairs."""

    job: Job
    repair: Repair

    def rewrites(self, only: int | None = None) -> dict[int, set[str]]:
        """The files still damaged (an earlier delivery may have repaired some), by planned shard."""
        rewrites: dict[int, set[str]] = {}
        for rel in self.repair.damaged:
            shard, recorded = planned_shard_of(rel), self.repair.recorded(rel)
            if shard is None or (only is not None and shard != only):
                continue
            if recorded is None or self.job.folder.shard_file_problem(recorded, verify=True):
                rewrites.setdefault(shard, set()).add(rel)
        return rewrites


def is_repair_plan(saved: dict[str, Any] | None) -> bool:
    """Whether a saved plan record is a repair's."""
    return bool((saved or {}).get("repair"))


def repair_dataset(found: FoundOut, options: RunOptions, started: float) -> PrepareResult:
    """Write the damaged shard files of the finished dataset `found` holds again (`options.workers` decided).

    Returns:
        The dataset's summary; `repaired` says what was wrong with each file written again.

    Raises:
        ManifestError: a damaged file lies where prepare does not write (the dataset was re-packed).
        SourceError: SRC changed since the dataset was prepared (it lists other files, or a file made
            again is not the one the manifest records).
        SampleError: with `options.strict`, a file was rejected.
    """
    opened = open_repair(found, options)
    job = opened.job

    def write() -> tuple[int, int]:
        job.folder.remove_stale_temp_files(job.spec.augment.variants)
        rewrites = opened.rewrites()
        processed = write_shards(job, sorted(rewrites), options, started, _RepairedFiles(opened.repair, rewrites))
        _finish_repair(opened)
        return processed, job.plan.shards - len(rewrites)

    try:
        processed, resumed = strictly(job, write, _abandon_repair)
    except BaseException:  # nothing to resume: the work folder goes
        job.listing.close()
        job.output.remove(WORK_DIR)
        raise
    manifest, damaged = opened.repair.manifest, opened.repair.damaged
    return run_result(job, manifest, options, started, processed, resumed, repaired=damaged, verified=options.verify)


def open_repair(found: FoundOut, options: RunOptions) -> RepairJob:
    """Open the job that writes the damaged files of `found`'s finished dataset again, from a fresh listing and plan."""
    assert found.finished is not None
    spec, folder, repair = found.spec, found.folder, Repair(found.finished, found.damaged)
    foreign = [path for path in repair.damaged if planned_shard_of(path) is None]
    if foreign:
        raise ManifestError(
            f"cannot repair {spec.out}: {foreign[0]} {repair.damaged[foreign[0]]}, and it is not where prepare writes "
            "its shards (the dataset was re-packed since); prepare it again with overwrite=True"
        )
    folder.output.remove(WORK_DIR)  # what an earlier repair or finish left: the plan is made again from the listing
    try:
        check_listed = functools.partial(_check_repairable, spec, repair)
        listed = list_source(spec, folder, options.check_source, keep_work=False, check_listed=check_listed)

        def check_planned(plan: ShardPlan, _: int) -> list[str]:
            _check_planned(spec, repair, plan)
            return []  # a repair writes a few shards, not the dataset: no free-space check, no warnings

        job = plan_job(spec, folder, listed, options, check_planned, repair=repair.damaged)
    except BaseException:
        folder.output.remove(WORK_DIR)
        raise
    return RepairJob(job, repair)


def load_repair(spec: PrepareSpec, records: OutRecords, saved: dict[str, Any], *, with_listing: bool = True) -> RepairJob:
    """The planned repair in OUT (`planned_spec`'s spec and plan record).

    Raises:
        ConfigError: the finished dataset the repair was planned for is gone.
    """
    manifest = WorkFolder(records.output).finished_manifest(spec, records)
    if manifest is None:
        raise ConfigError(f"{spec.out} has no planned prepare (its planned repair lost its manifest); run plan_prepare first")
    return RepairJob(open_planned(spec, records, saved, with_listing=with_listing), Repair(manifest, dict(saved["repair"])))


def write_repaired_shard(
    spec: PrepareSpec, shard: int, records: OutRecords, progress: ProgressCallback | None, check_source: SourceCheck | None = None
) -> ShardRecord:
    """A shard step of a planned repair: the shard's damaged files written again, each checked (`write_prepare_shard`)."""
    spec, saved = planned_spec(spec, records)
    opened = load_repair(spec, records, saved)
    job = opened.job
    job.listing = checked_listing(job.listing, check_source)
    try:
        job.check_in_plan(shard)
        rewrite = opened.rewrites(shard).get(shard, set())
        if not rewrite:  # an intact shard of a repaired dataset has no record
            files = [info for info in opened.repair.manifest.shards if planned_shard_of(info.path) == shard]
            return ShardRecord(shard, max((info.samples for info in files), default=0), 0, True)
        record = write_shard_here(job, shard, progress, _RepairedFiles(opened.repair, {shard: rewrite}))
    finally:
        job.listing.close()
    return ShardRecord.of(shard, record, False)


def _check_repairable(spec: PrepareSpec, repair: Repair, listed: Listed) -> None:
    """Refuse a repair when SRC no longer lists what the dataset was made from."""
    then = repair.manifest.samples + repair.manifest.rejected
    if listed.count != then or listed.classes != repair.manifest.classes:
        counts = f"lists {format_count(listed.count, 'file')}, {then} when it was prepared" if listed.count != then else "has other classes"
        raise SourceError(
            f"cannot repair {spec.out}: {spec.source} {counts}, so its shards cannot be made again; "
            "prepare it again with overwrite=True"
        )


def _check_planned(spec: PrepareSpec, repair: Repair, plan: ShardPlan) -> None:
    for path in repair.damaged:
        shard = planned_shard_of(path)
        if shard is None or shard >= plan.shards:
            raise _not_the_recorded_file(spec, path)


def _not_the_recorded_file(spec: PrepareSpec, rel: str) -> SourceError:
    return SourceError(
        f"cannot repair {spec.out}: {rel} made again from {spec.source} is not the file the manifest records, "
        "so the source changed since the dataset was prepared; prepare it again with overwrite=True"
    )


class _RepairedFiles:
    """A repair's commit (`writing.Commit`): a rebuilt file is published when it is to be rewritten and is
    the one the manifest records; the shard's record lists the manifest's entries."""

    def __init__(self, repair: Repair, rewrites: dict[int, set[str]]) -> None:
        self.repair, self.rewrites = repair, rewrites

    def __call__(self, job: Job, shard: int, files: list[SetFile]) -> tuple[list[ShardInfo], list[Callable[[], object]]]:
        rewrite = self.rewrites.get(shard, set())
        infos: list[ShardInfo] = []
        for writer, _, rel in files:
            infos += self._commit(job, writer, rel, rel in rewrite)
        return infos, []

    def _commit(self, job: Job, writer: TarShardWriter, rel: str, rewrite: bool) -> list[ShardInfo]:
        recorded = self.repair.recorded(rel)
        if (recorded is None) != (writer.samples == 0):
            raise _not_the_recorded_file(job.spec, rel)
        if recorded is None:
            return []  # every sample of this set was rejected, then as now
        if rewrite:
            if not writer.commit_if_same(recorded):
                raise _not_the_recorded_file(job.spec, rel)
            job.output.publish(rel)
        return [recorded]


def _finish_repair(opened: RepairJob) -> None:
    """A repair rewrote files exactly as recorded: the manifest and rejected.jsonl stay; the work folder goes."""
    job = opened.job
    job.folder.remove_stale_temp_objects(opened.repair.manifest)
    job.listing.close()
    job.folder.remove_work()


def _abandon_repair(job: Job) -> None:
    """A strict repair stopped: the finished dataset stays (the files it rewrote are byte for byte the manifest's);
    its temp files go (its listing and work folder go as any failed repair's do)."""
    if job.pool is not None:
        job.pool.terminate()  # the estimate's pool, when no shard was started yet
    job.folder.remove_temp_files()
