"""Opening a job: what OUT holds read once, SRC listed, the shards planned (or an interrupted run's plan kept).

`find_out` reads OUT (its plan and manifest) and says whether it holds the
finished dataset, and which of its files are damaged; `start_job` lists SRC
into the work folder and plans the shards, or keeps the plan an interrupted
run saved when SRC still lists the same; `load_planned_job` opens the job a
plan step saved, for a shard step or the finish.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..errors import ConfigError, NoImagesError, SourceError, StorageError
from ..io.devices import device_info, faster_local_disk, free_bytes
from ..io.fs import at_once, local_path, resolve_location, same_location
from ..io.output import Output
from ..manifest import Manifest
from ..specs import PrepareSpec
from ..targets import DEFAULT_IGNORE_INDEX
from ..units import format_bytes, format_count
from .aspect import sort_listing
from .listing import Listing, fetch_listing, share_listing
from .options import RunOptions, SourceCheck
from .plan import ShardPlan, plan_shards
from .pool import SamplePool
from .resume import WORK_DIR, OutRecords, WorkFolder, planned_conflict
from .sample.make import SampleOutcome
from .sources import ListingInfo, SourceItem, list_images
from .task_info import SeenTargets, TaskInfo

ESTIMATE_SAMPLES = 16
SHARD_FILL = 0.92  # plan shards to 92 % of --shard-size: the estimate is an estimate

PlanCheck = Callable[[ShardPlan, int], list[str]]
"""Called with a fresh plan and the estimated bytes per sample before the plan is saved; returns warnings."""


@dataclasses.dataclass
class Job:
    """A planned job, opened: what every step needs to write shards and finish."""

    spec: PrepareSpec
    folder: WorkFolder
    listing: Listing
    plan: ShardPlan
    classes: list[str]
    listed: int
    ignored: int
    warnings: list[str]
    pool: SamplePool | None = None  # started while planning (the size estimate ran on it)
    cache: dict[int, SampleOutcome] = dataclasses.field(default_factory=dict)  # samples the estimate made
    planned_here: bool = False  # this run made the plan (else it resumes an earlier run's)
    written: list[int] = dataclasses.field(default_factory=list)  # shards this run wrote
    strict: bool = False  # stop at the first rejected file
    task: TaskInfo = dataclasses.field(default_factory=TaskInfo)

    @property
    def output(self) -> Output:
        return self.folder.output

    def unwritten(self) -> list[int]:
        """The planned shards without a complete record. A plan made just now has none written (a plan is made
        only where none is, or where its old records went with it), so its records are not read: on a store,
        a round trip less before the first shard."""
        return list(range(self.plan.shards)) if self.planned_here else self.folder.pending_shards(self.plan.shards)

    def check_in_plan(self, shard: int) -> None:
        """Raises ConfigError when `shard` is no index of the plan."""
        if not 0 <= shard < self.plan.shards:
            raise ConfigError(f"shard {shard} is outside the plan (0..{self.plan.shards - 1})")


@dataclasses.dataclass
class FoundOut:
    """What OUT holds as a run starts: the finished dataset of these settings (and its damaged files), or not."""

    spec: PrepareSpec  # SRC as OUT records it (`as_recorded`)
    folder: WorkFolder
    records: OutRecords
    finished: Manifest | None = None
    damaged: dict[str, str] = dataclasses.field(default_factory=dict)  # the finished dataset's: path -> what is wrong


def find_out(spec: PrepareSpec, options: RunOptions) -> FoundOut:
    """Read what OUT holds; when it is the intact finished dataset, sweep the temp objects crashed writers left.

    Raises:
        ConfigError: OUT is inside SRC.
        JobConflictError: OUT holds another job, or files that no prepare wrote (see `WorkFolder.check_existing`).
    """
    output = Output(spec.out)
    if output.is_local:
        records = OutRecords(output).read_both()
    else:  # the bucket is looked for (made if missing) beside the reads of what OUT holds: one round trip, not two
        records, _ = at_once(OutRecords(output).read_both, output.makedirs)
    spec = as_recorded(spec, records)
    _refuse_out_inside_source(spec)
    folder = WorkFolder(output)
    finished = folder.check_existing(spec, options.overwrite, records)
    if finished is not None:
        damaged = folder.damaged_shards(finished, verify=options.verify)
        if not damaged:
            folder.remove_stale_temp_objects(finished)
        return FoundOut(spec, folder, records, finished, damaged)
    if output.is_local:
        output.makedirs()
    if options.overwrite:
        records = OutRecords(output)  # check_existing may have cleared OUT: what it read is stale
    return FoundOut(spec, folder, records)


def as_recorded(spec: PrepareSpec, records: OutRecords) -> PrepareSpec:
    """`spec` with SRC resolved, or spelled as OUT records it when that names the same place (through symlinks).

    Samples record their source path, so a job resumed or repaired through
    another spelling of the same folder still writes the bytes it first wrote.
    """
    source = resolve_location(spec.source)
    recorded = records.recorded_source()
    if recorded is not None and recorded != source and same_location(recorded, source):
        source = recorded
    return spec if source == spec.source else dataclasses.replace(spec, source=source)


def _refuse_out_inside_source(spec: PrepareSpec) -> None:
    source, out = local_path(spec.source), local_path(spec.out)
    if source is None or out is None or not os.path.isdir(source):
        return
    source_real, out_real = os.path.realpath(source), os.path.realpath(out)
    if out_real == source_real or out_real.startswith(source_real.rstrip("/") + "/"):
        raise ConfigError(f"OUT ({spec.out}) is inside SRC ({spec.source}): its shards would be listed as a class; put OUT elsewhere")


# ---------------------------------------------------------------------------
# Listing SRC and planning


@dataclasses.dataclass
class Listed:
    """SRC listed into the work folder: the listing, its count and hash, the classes and task it shows."""

    listing: Listing
    count: int
    digest: str
    classes: list[str]
    task: TaskInfo
    ignored: int  # files without an image extension

    def share(self, folder: WorkFolder) -> None:
        """Put the listing in OUT, where the shard tasks of other machines read it."""
        share_listing(folder.output, WORK_DIR, self.digest)


def list_source(
    spec: PrepareSpec,
    folder: WorkFolder,
    check_source: SourceCheck | None,
    *,
    keep_work: bool,
    check_listed: Callable[[Listed], None] | None = None,
) -> Listed:
    """List SRC into the work folder; `check_listed` may refuse what was listed.

    With `spec.order` "aspect" the listing is then sorted by each image's stored aspect ratio
    (`aspect.sort_listing`), and `Listed.digest` is the sorted listing's.

    On failure the work folder goes unless `keep_work` (an earlier run's plan is in it).
    """
    work = folder.output.local(WORK_DIR)
    os.makedirs(os.path.join(work, "shards"), exist_ok=True)
    listing = Listing(work)
    info = ListingInfo()
    seen = SeenTargets()
    try:
        items = list_images(spec.source, info, split=spec.split)
        count, digest, labels = listing.write(seen.watch(items if check_source is None else _checked(items, check_source)))
        listed = Listed(listing, count, digest, seen.classes(info, labels), seen.task_info(info), info.ignored)
        if check_listed is not None:
            check_listed(listed)
        if count == 0:
            raise NoImagesError(
                f"no images found in {spec.source}"
                + (f" ({format_count(info.ignored, 'file')} without an image extension ignored)" if info.ignored else "")
            )
        if spec.order == "aspect":  # the listing the plan takes as it is (`aspect.py`)
            listed.digest = sort_listing(listing, count, spec)
    except BaseException:
        listing.close()
        if not keep_work:  # this run made the work folder, and nothing of it is on a store yet: it goes
            shutil.rmtree(work, ignore_errors=True)
        raise
    return listed


def _checked(items: Iterable[SourceItem], check: SourceCheck) -> Iterator[SourceItem]:
    for item in items:
        check(item.url)
        yield item


def start_job(found: FoundOut, options: RunOptions) -> Job:
    """List SRC, then keep the plan an interrupted run of this job saved, or plan the shards now."""
    spec, folder = found.spec, found.folder
    old_plan = found.records.plan
    listed = list_source(spec, folder, options.check_source, keep_work=old_plan is not None)
    saved = _saved_plan_of(spec, old_plan, folder, listed, options.overwrite)
    if saved is not None:
        listed.share(folder)
        task = TaskInfo.from_record(saved) if "task" in saved else listed.task
        plan = ShardPlan(**saved["plan"])
        return Job(spec, folder, listed.listing, plan, listed.classes, listed.count, listed.ignored, [], strict=options.strict, task=task)

    def check_placement(plan: ShardPlan, per_sample: int) -> list[str]:
        try:
            return _check_placement(spec, per_sample * listed.count * max(1, spec.augment.variants), options.force)
        except StorageError:
            if old_plan is None:  # refused before anything was written: the work folder this run made goes
                listed.listing.close()
                folder.output.remove(WORK_DIR)
            raise

    return plan_job(spec, folder, listed, options, check_placement)


def plan_job(
    spec: PrepareSpec, folder: WorkFolder, listed: Listed, options: RunOptions, check: PlanCheck, **record_extra: Any
) -> Job:
    """Plan the shards of what was listed, `check` the plan, save it (with `record_extra`), and open the job.

    With `options.workers` the job's pool starts here (the size estimate runs
    on it); without, the estimate runs in this process.
    """
    task = listed.task
    # The worker pool starts now: it measures the size estimate in parallel,
    # and the samples it measured are kept for their shards, not redone.
    pool = None
    if options.workers is not None:
        pool = SamplePool(options.workers, spec, listed.classes, options.io_threads, task.mask_fill)
    try:
        # the upload and the estimate's reads are round trips to stores: side by side, not one after the other
        estimate = functools.partial(_estimate_sample_bytes, listed.listing, listed.count, spec, listed.classes, pool, task.mask_fill)
        _, (per_sample, cache) = at_once(functools.partial(listed.share, folder), estimate)
        plan = plan_shards(listed.count, _samples_per_shard(spec, per_sample), spec.seed, shuffle=spec.order == "shuffle")
        warnings = check(plan, per_sample)
        record = {
            "identity": spec.output_identity(),
            "listing_sha256": listed.digest,
            "listed": listed.count,
            "classes": listed.classes,
            "plan": plan.to_dict(),
            "estimated_sample_bytes": per_sample,
            "ignored": listed.ignored,
            **task.to_record(),
            **record_extra,
        }
        folder.write_plan(record)
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    return Job(
        spec, folder, listed.listing, plan, listed.classes, listed.count, listed.ignored, warnings, pool, cache,
        planned_here=True, strict=options.strict, task=task,
    )  # fmt: skip


def _saved_plan_of(
    spec: PrepareSpec, saved: dict[str, Any] | None, folder: WorkFolder, listed: Listed, overwrite: bool
) -> dict[str, Any] | None:
    """The plan an interrupted run of this job saved (`saved`, as read from OUT), if the source is still what it listed."""
    if saved is None or saved.get("listing_sha256") == listed.digest:
        return saved
    if not overwrite:
        raise SourceError(
            f"{spec.source} changed since the interrupted prepare into {spec.out} "
            f"({saved.get('listed')} files then, {listed.count} now); pass overwrite=True to start over"
        )
    # Start over: the shards written from the old listing hold other samples.
    folder.output.remove(f"{WORK_DIR}/shards")
    os.makedirs(folder.output.local(f"{WORK_DIR}/shards"), exist_ok=True)
    return None


def _estimate_sample_bytes(
    listing: Listing,
    listed: int,
    spec: PrepareSpec,
    classes: list[str],
    pool: SamplePool | None,
    ignore_index: int = DEFAULT_IGNORE_INDEX,
) -> tuple[int, dict[int, SampleOutcome]]:
    """Mean bytes one sample adds to a shard, measured on a few evenly spread sources.

    Returns the estimate and the measured outcomes (index -> outcome) for reuse.
    """
    step = max(1, listed // ESTIMATE_SAMPLES)
    chunk = [(index, listing.get(index)) for index in range(0, listed, step)[:ESTIMATE_SAMPLES]]
    here = pool is None  # in this process, its remote sources read at once on the I/O threads
    if pool is None:
        pool = SamplePool(0, spec, classes, ignore_index=ignore_index)
    try:
        per_worker = max(1, -(-len(chunk) // max(1, pool.workers)))
        pieces = [chunk[i : i + per_worker] for i in range(0, len(chunk), per_worker)]
        pending = [(pool.submit(piece), piece) for piece in pieces]
        outcomes = [outcome for future, piece in pending for outcome in pool.result(future, piece)]
    finally:
        if here:
            pool.close()
    sizes = [len(outcome.tars[0]) for outcome in outcomes if outcome.tars]
    cache = {outcome.index: outcome for outcome in outcomes}
    if not sizes:
        return 64 * 1024, cache  # nothing decodable in the sample: plan for typical JPEGs
    return int(math.ceil(sum(sizes) / len(sizes))), cache


def _samples_per_shard(spec: PrepareSpec, per_sample: int) -> int:
    limits = []
    if spec.shards.max_bytes is not None:
        limits.append(max(1, int(spec.shards.max_bytes * SHARD_FILL) // per_sample))
    if spec.shards.max_samples is not None:
        limits.append(spec.shards.max_samples)
    return min(limits)


def _check_placement(spec: PrepareSpec, estimated_bytes: int, force: bool) -> list[str]:
    warnings = []
    free = free_bytes(spec.out)
    if free is not None and estimated_bytes * 1.1 > free:
        message = (
            f"{spec.out} has {format_bytes(free)} free but the shards need about "
            f"{format_bytes(estimated_bytes)} (+10 % margin)"
        )
        if not force:
            raise StorageError(message + "; free some space, pick another OUT, or pass force=True")
        warnings.append(message + "; writing anyway (force=True)")
    device = device_info(spec.out)
    if device.kind in ("rotational", "network"):
        nvme = faster_local_disk()
        if nvme:
            warnings.append(
                f"{spec.out} is on {device.kind} storage ({device.fstype}) while this machine has a "
                f"local NVMe disk ({nvme}); shards read fastest from NVMe"
            )
    return warnings


# ---------------------------------------------------------------------------
# A job a plan step saved, opened by a shard step or the finish


def planned_spec(spec: PrepareSpec, records: OutRecords) -> tuple[PrepareSpec, dict[str, Any]]:
    """`spec` as OUT's plan records it, and the plan record; refused when OUT has no plan of these settings.

    Raises:
        ConfigError: OUT has no planned prepare.
        JobConflictError: OUT holds a planned prepare of other settings.
    """
    saved = records.plan
    if saved is None:
        raise ConfigError(
            f"{spec.out} has no planned prepare; run plan_prepare first (a job planned there has lost "
            "its work folder: was OUT emptied or removed meanwhile? then start the job again)"
        )
    spec = as_recorded(spec, records)
    if saved.get("identity") != spec.output_identity():
        raise planned_conflict(spec, saved.get("identity") or {})
    return spec, saved


def open_planned(spec: PrepareSpec, records: OutRecords, saved: dict[str, Any], *, with_listing: bool = True) -> Job:
    """The job `saved` plans (`planned_spec`'s spec and record).

    `with_listing` False: the job's listing is not downloaded to this machine
    (the finish reads no source; on a store the listing of a million images is
    a download of 100 MB and more).
    """
    output = records.output
    if with_listing:
        listing = fetch_listing(output, WORK_DIR, saved["listing_sha256"])
    else:
        listing = Listing(output.local(WORK_DIR))  # never read: opening it reads nothing
    plan = ShardPlan(**saved["plan"])
    classes, task = saved["classes"], TaskInfo.from_record(saved)
    return Job(spec, WorkFolder(output), listing, plan, classes, saved["listed"], saved.get("ignored", 0), [], task=task)


def load_planned_job(spec: PrepareSpec, records: OutRecords, *, with_listing: bool = True) -> Job:
    """The planned job in OUT (`records`: what the caller read of OUT already); see `planned_spec`, `open_planned`."""
    spec, saved = planned_spec(spec, records)
    return open_planned(spec, records, saved, with_listing=with_listing)
