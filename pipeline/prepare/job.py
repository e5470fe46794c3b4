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
sha256) and writes the damaged ones again: the plan is made again from the
same listing, and a shard is rebuilt byte for byte (it depends only on the
spec and its index), so the manifest stays as it is. A rebuilt file that is
not the one the manifest records (the source changed since) is refused.

A file is accepted exactly when Pillow can read it (`sample.py`); a strict
prepare (`strict=True`, `gpufeed prepare --strict`) instead stops at the
first rejected file and leaves OUT as it found it: no manifest, none of the
shards it wrote, no temp files, so the same command without strict still
runs (and resumes what an earlier run left).

`prepare_dataset` runs all of it in this process and its pool; a distributed
runner (the service) runs the same job in steps: `plan_prepare` once,
`write_prepare_shard` per shard anywhere that sees OUT, `finish_prepare` once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from ..errors import ConfigError, ManifestError, NoImagesError, SampleError, SourceError, StorageError
from ..io.devices import device_info, faster_local_disk, free_bytes
from ..io.fs import at_once, redact_location, redact_urls, resolve_location, same_location, storage_options_for
from ..io.output import Output
from ..io.tar import ShardInfo, TarShardWriter
from ..manifest import MANIFEST_NAME, REJECTED_NAME, Manifest, write_manifest
from ..specs import PrepareSpec
from ..targets import (
    BOX_LABELS_MEMBER,
    BOXES_MEMBER,
    DEFAULT_IGNORE_INDEX,
    ISCROWD_MEMBER,
    LABELS_MEMBER,
    MASK_MEMBER,
    TASKS,
    TEXT_MEMBER,
)
from ..units import format_bytes, format_count
from .listing import Listing, class_names, fetch_listing, share_listing
from .lock import OutLock, remove_lock
from .plan import ShardPlan, plan_shards, planned_shard_of, shard_name
from .pool import IO_THREADS, Chunk, PendingChunk, SamplePool, available_cores, chunk_sizes
from .resume import WORK_DIR, OutRecords, WorkFolder, planned_conflict, set_prefixes
from .sample import SampleOutcome
from .sources import ListingInfo, SourceItem, list_images

ESTIMATE_SAMPLES = 16
SHARD_FILL = 0.92  # plan shards to 92 % of --shard-size: the estimate is an estimate

ProgressCallback = Callable[["PrepareProgress"], None]
SourceCheck = Callable[[str], None]
"""Called with the URL of every file SRC lists, as it is listed; what it raises stops the plan."""


@dataclasses.dataclass
class PrepareProgress:
    """Handed to the progress callback after every chunk of images."""

    done: int
    total: int
    rejected: int
    seconds: float
    stage: str = "prepare"
    warned: int = 0  # samples decoded with warnings
    boxes_dropped: int = 0  # boxes that fell (mostly) out of their pictures


@dataclasses.dataclass
class PrepareResult:
    """Summary of a finished prepare.

    The dataset's counts (`listed` .. `variants`, `decoded_with_warnings`)
    are those of its manifest; the rest describes the run that ended with it.
    `decoded_with_warnings` counts the samples whose decoders warned about
    damage they read past (each sample's json lists the messages under
    `decode_warnings`). `repaired` maps each shard file this run wrote again
    to what was wrong with it (`"was missing"`), and `verified` says whether
    the finished dataset's shards were hashed against the manifest before
    they were kept. `boxes_dropped` counts the boxes left out because less
    than `spec.min_visible` of their area stayed in their picture (over
    every variant set); `task` is what the samples hold (`targets.TASKS`).
    """

    out: str
    listed: int
    samples: int
    rejected: int
    ignored: int
    shards: int
    bytes: int
    classes: list[str]
    variants: int
    seconds: float
    processed: int
    resumed_shards: int
    workers: int
    already_complete: bool = False
    warnings: list[str] = dataclasses.field(default_factory=list)
    decoded_with_warnings: int = 0
    repaired: dict[str, str] = dataclasses.field(default_factory=dict)
    verified: bool = False
    boxes_dropped: int = 0
    task: str = "classification"

    @property
    def images_per_s(self) -> float:
        """Images processed per second of this run (0 when it processed none)."""
        return self.processed / self.seconds if self.seconds > 0 else 0.0

    @property
    def manifest(self) -> str:
        """Where the dataset's manifest is."""
        return f"{self.out.rstrip('/')}/{MANIFEST_NAME}"

    def to_dict(self) -> dict[str, Any]:
        """The summary as JSON-ready values (what `gpufeed prepare --json` prints)."""
        data = dataclasses.asdict(self)
        data["images_per_s"] = round(self.images_per_s, 2)
        data["seconds"] = round(self.seconds, 3)
        data["manifest"] = self.manifest
        return data


def _result(
    out: str,
    manifest: Manifest,
    *,
    ignored: int = 0,
    seconds: float = 0.0,
    processed: int = 0,
    resumed: int = 0,
    workers: int = 0,
    already_complete: bool = False,
    warnings: Sequence[str] = (),
    repaired: dict[str, str] | None = None,
    verified: bool = False,
) -> PrepareResult:
    return PrepareResult(
        out=out,
        listed=manifest.samples + manifest.rejected,  # every listed source is a sample or a reject
        samples=manifest.samples,
        rejected=manifest.rejected,
        ignored=ignored,
        shards=len(manifest.shards),
        bytes=sum(s.bytes for s in manifest.shards),
        classes=manifest.classes,
        variants=manifest.variants,
        seconds=seconds,
        processed=processed,
        resumed_shards=resumed,
        workers=workers,
        already_complete=already_complete,
        warnings=list(warnings),
        decoded_with_warnings=manifest.decoded_with_warnings,
        repaired=dict(repaired or {}),
        verified=verified,
        boxes_dropped=manifest.boxes_dropped,
        task=manifest.task,
    )


@dataclasses.dataclass
class _Repair:
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
class _TaskInfo:
    """What a job's samples hold, as the manifest records it: the task, the members besides image and json,
    a mask's value of no class. Decided from the listing, kept in the plan (the shard steps and the finish
    of a distributed job read it there)."""

    task: str = "classification"
    fields: list[str] = dataclasses.field(default_factory=list)
    ignore_index: int | None = None
    painted: bool = False  # the masks are painted from COCO's shapes: box class c is c + 1, 0 background

    def to_record(self) -> dict[str, Any]:
        record = {"task": self.task, "fields": list(self.fields), "ignore_index": self.ignore_index}
        return {**record, "painted_masks": True} if self.painted else record

    @classmethod
    def from_record(cls, saved: Mapping[str, Any]) -> _TaskInfo:
        """From a saved plan; one saved before tasks were recorded is a classification (with labels if it has classes)."""
        if "task" not in saved:
            return cls("classification", ["cls"] if saved.get("classes") else [])
        return cls(saved["task"], list(saved.get("fields") or []), saved.get("ignore_index"), bool(saved.get("painted_masks")))

    def mask_classes(self, classes: list[str]) -> list[str] | None:
        """What the values of masks painted from COCO's shapes mean (None for any other dataset)."""
        return ["background", *classes] if self.painted else None

    @property
    def mask_fill(self) -> int:
        """What padding and the outside of a rotated crop become in a mask."""
        return DEFAULT_IGNORE_INDEX if self.ignore_index is None else self.ignore_index


# The members a listed target becomes (`pipeline.targets`), in the manifest's order.
_TARGET_FIELDS = (
    ("labels", (LABELS_MEMBER,)),
    ("boxes", (BOXES_MEMBER, BOX_LABELS_MEMBER)),
    ("iscrowd", (ISCROWD_MEMBER,)),
    ("mask", (MASK_MEMBER,)),
    ("segmentation", (MASK_MEMBER,)),  # COCO's shapes, painted into a mask (`coco_masks.py`)
    ("caption", (TEXT_MEMBER,)),
)
# A listing that does not say its task: the first target it has decides.
_TASK_OF_FIELD = ((MASK_MEMBER, "segmentation"), (BOXES_MEMBER, "detection"), (LABELS_MEMBER, "multilabel"), (TEXT_MEMBER, "captions"))


class _SeenTargets:
    """What a listing's items hold, gathered as they stream into the listing file: target keys, class names."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.names: set[str] = set()
        self.labelled = False

    def watch(self, items: Iterable[SourceItem]) -> Iterator[SourceItem]:
        for item in items:
            self.labelled = self.labelled or item.label is not None
            targets = item.targets
            if isinstance(targets, dict) and not item.rejected:
                self.keys.update(key for key, value in targets.items() if value is not None)
                for key in ("labels", "box_labels"):
                    values = targets.get(key)
                    if isinstance(values, list):  # a malformed entry rejects its sample later, with the reason
                        self.names.update(str(v) for v in values if isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)))
            yield item

    def classes(self, info: ListingInfo, labels: set[str]) -> list[str]:
        """The job's class names: those the source declares (COCO's categories, YOLO's names), else
        those its items name, as `class_names` orders them."""
        if info.classes and info.kind != "imagefolder":
            return list(info.classes)
        if self.names and info.kind != "imagefolder":
            return class_names(ListingInfo(kind=info.kind), labels | self.names)
        return class_names(info, labels)

    def task_info(self, info: ListingInfo) -> _TaskInfo:
        fields = (["cls"] if self.labelled else []) + list(dict.fromkeys(
            member for key, members in _TARGET_FIELDS if key in self.keys for member in members
        ))  # fmt: skip
        task = info.task if info.task in TASKS else "classification"
        if task == "classification" and not self.labelled:
            task = next((name for member, name in _TASK_OF_FIELD if member in fields), task)
        ignore = info.ignore_index
        if ignore is not None and (isinstance(ignore, bool) or not isinstance(ignore, int) or not 0 <= ignore <= 65535):
            raise SourceError(f"the ignore index of {info.kind or 'the source'} must be a whole number 0 to 65535, not {ignore!r}")
        if ignore is None and MASK_MEMBER in fields:
            ignore = DEFAULT_IGNORE_INDEX
        painted = "segmentation" in self.keys and "mask" not in self.keys
        return _TaskInfo(task, fields, ignore, painted)


@dataclasses.dataclass
class _Job:
    """A planned job, opened: what every step needs to write shards and finish."""

    spec: PrepareSpec
    output: Output
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
    repair: _Repair | None = None  # set when the job writes a finished dataset's damaged files again
    task: _TaskInfo = dataclasses.field(default_factory=_TaskInfo)

    @property
    def folder(self) -> WorkFolder:
        return WorkFolder(self.output)


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
    with storage_options_for((spec.source, spec.out), storage_options), OutLock(Output(spec.out)):
        return _prepare_here(spec, workers, force, overwrite, strict, verify, progress, io_threads)


def _prepare_here(
    spec: PrepareSpec,
    workers: int | None,
    force: bool,
    overwrite: bool,
    strict: bool,
    verify: bool,
    progress: ProgressCallback | None,
    io_threads: int,
) -> PrepareResult:
    started = time.perf_counter()
    workers = available_cores() if workers is None else workers
    if workers < 0:
        raise ConfigError("--workers must be 0 or more")
    if io_threads < 0:
        raise ConfigError("io_threads must be 0 or more")
    job_or_done = _open_or_plan(spec, force=force, overwrite=overwrite, workers=workers, verify=verify, io_threads=io_threads)
    if isinstance(job_or_done, Manifest):
        if strict and job_or_done.rejected:
            _refuse_finished_with_rejects(spec, Output(spec.out), job_or_done)
        seconds = time.perf_counter() - started
        shards = len(job_or_done.shards)
        return _result(
            spec.out, job_or_done, seconds=seconds, resumed=shards, workers=workers, already_complete=True, verified=verify
        )
    job = job_or_done
    job.strict = strict
    try:
        if strict:
            _check_known_rejects(job)
        processed, resumed = _write_pending_shards(job, workers, progress, started, io_threads)
        manifest = _finish(job) if job.repair is None else _finish_repair(job)
    except _StrictStop as stop:
        _abandon(job)
        raise SampleError(stop.message) from None
    except BaseException:
        if job.repair is not None:  # a repair starts from a fresh listing every time: nothing to resume
            job.listing.close()
            job.output.remove(WORK_DIR)
        raise
    finally:
        job.listing.close()
    seconds = time.perf_counter() - started
    return _result(
        spec.out,
        manifest,
        ignored=job.ignored,
        seconds=seconds,
        processed=processed,
        resumed=resumed,
        workers=workers,
        warnings=job.warnings,
        repaired=job.repair.damaged if job.repair is not None else None,
        verified=verify and job.repair is not None,
    )


# ---------------------------------------------------------------------------
# Opening a job: what OUT holds, the listing, the plan


def _open_or_plan(
    spec: PrepareSpec,
    *,
    force: bool,
    overwrite: bool,
    workers: int | None = None,
    verify: bool = False,
    io_threads: int = IO_THREADS,
    check_source: SourceCheck | None = None,
) -> _Job | Manifest:
    """The finished dataset's manifest when OUT holds it intact, else the job opened (planned now, resumed, or a repair).

    With `workers`, the job's pool starts here (the size estimate runs on it);
    without, the estimate runs in this process.
    """
    output = Output(spec.out)
    if output.is_local:
        records = OutRecords(output).read_both()
    else:  # the bucket is looked for (made if missing) beside the reads of what OUT holds: one round trip, not two
        records, _ = at_once(OutRecords(output).read_both, output.makedirs)
    spec = _as_recorded(spec, records)
    _refuse_out_inside_source(spec)
    finished = WorkFolder(output).check_existing(spec, overwrite, records)
    if finished is not None:
        damaged = WorkFolder(output).damaged_shards(finished, verify=verify)
        if not damaged:
            WorkFolder(output).remove_stale_temp_objects(finished)
            return finished
        return _start_repair(spec, output, _Repair(finished, damaged), workers, io_threads, check_source)
    if output.is_local:
        output.makedirs()
    if overwrite:
        records = OutRecords(output)  # check_existing may have cleared OUT: what it read is stale
    return _start_job(spec, output, force, overwrite, workers, io_threads=io_threads, records=records, check_source=check_source)


def _as_recorded(spec: PrepareSpec, records: OutRecords) -> PrepareSpec:
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
    from ..io.fs import local_path

    source, out = local_path(spec.source), local_path(spec.out)
    if source is None or out is None or not os.path.isdir(source):
        return
    source_real, out_real = os.path.realpath(source), os.path.realpath(out)
    if out_real == source_real or out_real.startswith(source_real.rstrip("/") + "/"):
        raise ConfigError(f"OUT ({spec.out}) is inside SRC ({spec.source}): its shards would be listed as a class; put OUT elsewhere")


def _start_job(
    spec: PrepareSpec,
    output: Output,
    force: bool,
    overwrite: bool,
    workers: int | None,
    repair: _Repair | None = None,
    io_threads: int = IO_THREADS,
    records: OutRecords | None = None,
    check_source: SourceCheck | None = None,
) -> _Job:
    work = output.local(WORK_DIR)
    old_plan = (records or OutRecords(output)).plan
    os.makedirs(os.path.join(work, "shards"), exist_ok=True)
    listing = Listing(work)
    info = ListingInfo()
    seen = _SeenTargets()
    try:
        items = list_images(spec.source, info)
        listed, digest, labels = listing.write(seen.watch(items if check_source is None else _checked(items, check_source)))
        classes = seen.classes(info, labels)
        task = seen.task_info(info)
        if repair is not None:
            _check_repairable(spec, repair, listed, classes)
        if listed == 0:
            raise NoImagesError(
                f"no images found in {spec.source}"
                + (f" ({format_count(info.ignored, 'file')} without an image extension ignored)" if info.ignored else "")
            )
    except BaseException:
        listing.close()
        if old_plan is None:  # this run made the work folder, and nothing of it is on a store yet: it goes
            shutil.rmtree(work, ignore_errors=True)
        raise
    saved = _saved_plan_of(spec, old_plan, output, digest, listed, overwrite) if repair is None else None
    # the shard tasks of other machines read the listing from OUT
    share = functools.partial(share_listing, output, WORK_DIR, digest)
    if saved is not None:
        share()
        saved_task = _TaskInfo.from_record(saved) if "task" in saved else task
        return _Job(spec, output, listing, ShardPlan(**saved["plan"]), classes, listed, info.ignored, [], task=saved_task)
    # The worker pool starts now: it measures the size estimate in parallel,
    # and the samples it measured are kept for their shards, not redone.
    pool = SamplePool(workers, spec, classes, io_threads, task.mask_fill) if workers is not None else None
    try:
        # the upload and the estimate's reads are round trips to stores: side by side, not one after the other
        estimate = functools.partial(_estimate_sample_bytes, listing, listed, spec, classes, pool, task.mask_fill)
        _, (per_sample, cache) = at_once(share, estimate)
        plan = plan_shards(listed, _samples_per_shard(spec, per_sample), spec.seed)
        if repair is None:
            try:
                warnings = _check_placement(spec, per_sample * listed * max(1, spec.augment.variants), force)
            except StorageError:
                if old_plan is None:  # refused before anything was written: the work folder this run made goes
                    listing.close()
                    output.remove(WORK_DIR)
                raise
        else:
            warnings = []  # a repair writes a few shards, not the dataset
            _check_planned(spec, repair, plan)
        record = {
            "identity": spec.output_identity(),
            "listing_sha256": digest,
            "listed": listed,
            "classes": classes,
            "plan": plan.to_dict(),
            "estimated_sample_bytes": per_sample,
            "ignored": info.ignored,
            **task.to_record(),
        }
        if repair is not None:
            record["repair"] = repair.damaged
        WorkFolder(output).write_plan(record)
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    return _Job(
        spec, output, listing, plan, classes, listed, info.ignored, warnings, pool, cache, planned_here=True, repair=repair, task=task
    )


def _checked(items: Iterable[SourceItem], check: SourceCheck) -> Iterator[SourceItem]:
    for item in items:
        check(item.url)
        yield item


def _start_repair(
    spec: PrepareSpec, output: Output, repair: _Repair, workers: int | None, io_threads: int, check_source: SourceCheck | None
) -> _Job:
    """Open the job that writes a finished dataset's damaged files again, from a fresh listing and plan."""
    foreign = [path for path in repair.damaged if planned_shard_of(path) is None]
    if foreign:
        raise ManifestError(
            f"cannot repair {spec.out}: {foreign[0]} {repair.damaged[foreign[0]]}, and it is not where prepare writes "
            "its shards (the dataset was re-packed since); prepare it again with overwrite=True"
        )
    output.remove(WORK_DIR)  # what an earlier repair or finish left: the plan is made again from the listing
    try:
        return _start_job(spec, output, True, False, workers, repair, io_threads, check_source=check_source)
    except BaseException:
        output.remove(WORK_DIR)
        raise


def _check_repairable(spec: PrepareSpec, repair: _Repair, listed: int, classes: list[str]) -> None:
    """Refuse a repair when SRC no longer lists what the dataset was made from."""
    then = repair.manifest.samples + repair.manifest.rejected
    if listed != then or classes != repair.manifest.classes:
        counts = f"lists {format_count(listed, 'file')}, {then} when it was prepared" if listed != then else "has other classes"
        raise SourceError(
            f"cannot repair {spec.out}: {spec.source} {counts}, so its shards cannot be made again; "
            "prepare it again with overwrite=True"
        )


def _check_planned(spec: PrepareSpec, repair: _Repair, plan: ShardPlan) -> None:
    for path in repair.damaged:
        shard = planned_shard_of(path)
        if shard is None or shard >= plan.shards:
            raise _not_the_recorded_file(spec, path)


def _not_the_recorded_file(spec: PrepareSpec, rel: str) -> SourceError:
    return SourceError(
        f"cannot repair {spec.out}: {rel} made again from {spec.source} is not the file the manifest records, "
        "so the source changed since the dataset was prepared; prepare it again with overwrite=True"
    )


def _saved_plan_of(
    spec: PrepareSpec, saved: dict[str, Any] | None, output: Output, digest: str, listed: int, overwrite: bool
) -> dict[str, Any] | None:
    """The plan an interrupted run of this job saved (`saved`, as read from OUT), if the source is still what it listed."""
    if saved is None or saved.get("listing_sha256") == digest:
        return saved
    if not overwrite:
        raise SourceError(
            f"{spec.source} changed since the interrupted prepare into {spec.out} "
            f"({saved.get('listed')} files then, {listed} now); pass overwrite=True to start over"
        )
    # Start over: the shards written from the old listing hold other samples.
    output.remove(f"{WORK_DIR}/shards")
    os.makedirs(output.local(f"{WORK_DIR}/shards"), exist_ok=True)
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
# Writing shards


def _write_pending_shards(
    job: _Job, workers: int, progress: ProgressCallback | None, started: float, io_threads: int
) -> tuple[int, int]:
    job.folder.remove_stale_temp_files(job.spec.augment.variants)
    rewrites = _rewrites(job) if job.repair is not None else {}
    pending = sorted(rewrites) if job.repair is not None else _unwritten(job)
    resumed = job.plan.shards - len(pending)
    total = sum(len(job.plan.positions(s)) for s in pending)
    state = PrepareProgress(0, total, 0, 0.0)
    pool = job.pool or SamplePool(workers, job.spec, job.classes, io_threads, job.task.mask_fill)
    try:
        for shard in pending:
            _write_one_shard(job, shard, pool, state, progress, started, rewrites.get(shard, set()))
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    return total, resumed


def _unwritten(job: _Job) -> list[int]:
    """The planned shards without a complete record. A plan made just now has none written (a plan is made
    only where none is, or where its old records went with it), so its records are not read: on a store,
    a round trip less before the first shard."""
    return list(range(job.plan.shards)) if job.planned_here else job.folder.pending_shards(job.plan.shards)


def _rewrites(job: _Job, only: int | None = None) -> dict[int, set[str]]:
    """A repair's files still damaged (an earlier delivery may have repaired some), by planned shard."""
    assert job.repair is not None
    rewrites: dict[int, set[str]] = {}
    for rel in job.repair.damaged:
        shard, recorded = planned_shard_of(rel), job.repair.recorded(rel)
        if shard is None or (only is not None and shard != only):
            continue
        if recorded is None or job.folder.shard_file_problem(recorded, verify=True):
            rewrites.setdefault(shard, set()).add(rel)
    return rewrites


def _write_one_shard(
    job: _Job,
    shard: int,
    pool: SamplePool,
    state: PrepareProgress,
    progress: ProgressCallback | None,
    started: float,
    rewrite: AbstractSet[str] = frozenset(),
) -> dict[str, Any]:
    """Write a planned shard's files (one per variant set); in a repair, only those in `rewrite`, each checked.

    Returns:
        The shard's record (`write_shard_record`).
    """
    sets = set_prefixes(job.spec.augment.variants)
    writers = [TarShardWriter(job.output.local(prefix + shard_name(shard))) for _, prefix in sets]
    rejected: list[dict[str, str]] = []
    warned_before, dropped_before = state.warned, state.boxes_dropped
    window = max(2, pool.workers * 3)  # chunks in flight: keeps every worker busy, bounds memory
    with _ExitAll(writers):
        in_flight: deque[tuple[PendingChunk, Chunk]] = deque()
        for chunk in _chunks(job, shard, pool.workers):
            in_flight.append((pool.submit(chunk, job.cache), chunk))
            if len(in_flight) >= window:
                _drain(pool.result(*in_flight.popleft()), writers, rejected, state, job.strict)
                _report(state, progress, started)
        while in_flight:
            _drain(pool.result(*in_flight.popleft()), writers, rejected, state, job.strict)
            _report(state, progress, started)
        infos = []
        for writer, (variant, prefix) in zip(writers, sets):
            rel = prefix + shard_name(shard)
            if job.repair is not None:
                infos += _commit_repaired(job, writer, rel, rel in rewrite)
            elif writer.samples:
                infos.append(writer.commit(rel, variant))
    uploads = [] if job.output.is_local or job.repair is not None else [functools.partial(job.output.publish, info.path) for info in infos]
    # On a store the record goes up beside its files, not after them (a round trip less per shard):
    # a record whose file is missing or of another size counts as unwritten (recorded_files_intact),
    # so a record that lands before its file, or without it, only makes a re-run write the shard again.
    recording = functools.partial(
        job.folder.write_shard_record, shard, infos, rejected, state.warned - warned_before, state.boxes_dropped - dropped_before
    )
    record: dict[str, Any] = at_once(*uploads, recording)[-1]
    job.written.append(shard)
    return record


def _commit_repaired(job: _Job, writer: TarShardWriter, rel: str, rewrite: bool) -> list[ShardInfo]:
    """In a repair: publish the rebuilt file when it is to be rewritten and is the one the manifest records."""
    assert job.repair is not None
    recorded = job.repair.recorded(rel)
    if (recorded is None) != (writer.samples == 0):
        raise _not_the_recorded_file(job.spec, rel)
    if recorded is None:
        return []  # every sample of this set was rejected, then as now
    if rewrite:
        if not writer.commit_if_same(recorded):
            raise _not_the_recorded_file(job.spec, rel)
        job.output.publish(rel)
    return [recorded]


def _chunks(job: _Job, shard: int, workers: int) -> Iterator[Chunk]:
    indices = job.plan.indices(shard)
    start = 0
    for size in chunk_sizes(len(indices), workers):
        yield [(int(i), job.listing.get(int(i))) for i in indices[start : start + size]]
        start += size


class _ExitAll:
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
                raise _StrictStop(outcome.source, outcome.reason)
            rejected.append({"source": redact_location(outcome.source), "reason": redact_urls(outcome.reason)})
            state.rejected += 1
            continue
        state.warned += bool(outcome.warnings)
        state.boxes_dropped += outcome.boxes_dropped
        for writer, blob in zip(writers, outcome.tars):
            writer.write_sample_bytes(blob)


def _report(state: PrepareProgress, progress: ProgressCallback | None, started: float) -> None:
    if progress is not None:
        state.seconds = time.perf_counter() - started
        progress(state)


# ---------------------------------------------------------------------------
# A strict prepare: the first reject stops it, and OUT is left as this run found it


class _StrictStop(Exception):
    """A strict prepare met a rejected file: unwinds the writing, then becomes a SampleError."""

    def __init__(self, source: str, reason: str, earlier: bool = False) -> None:
        by = " (rejected by an earlier run of this job)" if earlier else ""
        self.message = (
            f"strict prepare stopped at a rejected file: {source}: {reason}{by}; nothing was published "
            "(fix or remove that file, or prepare without strict=True to leave it out)"
        )
        super().__init__(self.message)


def _check_known_rejects(job: _Job) -> None:
    """Stop now for a reject already known: among the samples the size estimate made, or in a kept shard."""
    for index in sorted(job.cache):
        outcome = job.cache[index]
        if outcome.tars is None:
            raise _StrictStop(outcome.source, outcome.reason)
    for shard in range(job.plan.shards):  # a recorded reject stands even if its shard must be written again
        if job.folder.has_shard_record(shard):
            for entry in job.folder.read_shard_record(shard)["rejected"][:1]:
                raise _StrictStop(entry["source"], entry["reason"], earlier=True)


def _abandon(job: _Job) -> None:
    """Take back what a stopped strict run wrote: everything when it planned the job, else its own shards.

    A repair leaves the finished dataset as it is: the files it rewrote are byte for byte the ones the
    manifest records.
    """
    if job.pool is not None:
        job.pool.terminate()  # the estimate's pool, when no shard was started yet
    job.listing.close()
    if job.repair is not None:  # the finished dataset stays: a repair only rewrites files equal to the manifest's
        job.folder.remove_temp_files()
        job.output.remove(WORK_DIR)
    elif job.planned_here:
        job.folder.clear_output()
        job.folder.remove_temp_files()
        job.folder.remove_work()
    else:
        job.folder.remove_shards(sorted(set(job.written)))


def _refuse_finished_with_rejects(spec: PrepareSpec, output: Output, manifest: Manifest) -> None:
    first = next(iter(WorkFolder(output).read_rejects()), {"source": "?", "reason": "see rejected.jsonl"})
    raise SampleError(
        f"{spec.out} already holds this dataset, prepared without strict=True: it left out {format_count(manifest.rejected, 'rejected file')}, "
        f"the first {first['source']}: {first['reason']}; pass overwrite=True to prepare it again"
    )


# ---------------------------------------------------------------------------
# Finishing: rejected.jsonl, then the manifest (the switch), then the work folder goes


def _finish(
    job: _Job, written: list[dict[str, Any] | None] | None = None, present: dict[str, int] | None = None
) -> Manifest:
    """Write rejected.jsonl and the manifest of every shard recorded, once OUT holds each at its size.

    `written`, `present`: the shard records and OUT's file sizes, when the caller read them.
    """
    shards: list[ShardInfo] = []
    rejected_lines: list[bytes] = []
    warned = dropped = 0
    if written is None or present is None:
        written, present = _written_and_present(job)
    lost: list[int] = []
    for shard, record in enumerate(written):
        if _lost(record, present):
            lost.append(shard)
        if record is None:
            continue
        for info in record["shards"]:
            shards.append(ShardInfo(info["path"], info["samples"], info["bytes"], info["sha256"], info.get("variant")))
        rejected_lines += [json.dumps(entry).encode("ascii") + b"\n" for entry in record["rejected"]]
        warned += record.get("warned", 0)
        dropped += record.get("boxes_dropped", 0)
    if lost:
        numbers = sorted(set(lost))
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
        mask_classes=job.task.mask_classes(job.classes),
    )
    write_manifest(job.output, manifest)
    job.listing.close()
    _clean_up(job.output, manifest)
    return manifest


def _clean_up(output: Output, manifest: Manifest) -> None:
    """Once the manifest is written: the temp objects crashed writers left and the work folder go (at once)."""
    at_once(lambda: WorkFolder(output).remove_stale_temp_objects(manifest), lambda: WorkFolder(output).remove_work())


def _written_and_present(job: _Job) -> tuple[list[dict[str, Any] | None], dict[str, int]]:
    """Every planned shard's record (None: not written) and the size of every file under OUT now (one
    listing, paged on a store: the manifest lists only what OUT holds, and a store may have lost files)."""
    written, present = at_once(lambda: job.folder.for_each_shard(job.plan.shards, job.folder.shard_record_or_none), job.output.file_sizes)
    return written, present


def _lost(record: dict[str, Any] | None, present: dict[str, int]) -> bool:
    """Whether a shard is unwritten, or a file of its record is missing from OUT or of another size."""
    return record is None or any(present.get(info["path"]) != info["bytes"] for info in record["shards"])


def _finish_repair(job: _Job) -> Manifest:
    """A repair rewrote files exactly as recorded: the manifest and rejected.jsonl stay; the work folder goes."""
    assert job.repair is not None
    job.folder.remove_stale_temp_objects(job.repair.manifest)
    job.listing.close()
    job.folder.remove_work()
    return job.repair.manifest


# ---------------------------------------------------------------------------
# The same job in steps, for a distributed runner (the Celery service):
# plan once, write each shard anywhere that sees OUT, finish once.


@dataclasses.dataclass(frozen=True)
class PreparePlanInfo:
    """What `plan_prepare` decided: how many shards to write, or that OUT is already complete.

    `shards` counts the planned shards of one variant set (each variant set
    gets a file per planned shard).
    """

    shards: int
    listed: int
    ignored: int
    classes: list[str]
    pending: list[int]
    already_complete: bool = False
    warnings: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """One planned shard once written: its files (one per variant set) and its rejects."""

    shard: int
    samples: int
    rejected: int
    skipped: bool


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
        info = _plan_locked(spec, force, overwrite, verify, check_source)
    except BaseException:
        lock.release()
        raise
    lock.release(keep=job is not None and not info.already_complete)
    return info


def _plan_locked(
    spec: PrepareSpec, force: bool, overwrite: bool, verify: bool, check_source: SourceCheck | None
) -> PreparePlanInfo:
    job_or_done = _open_or_plan(spec, force=force, overwrite=overwrite, verify=verify, check_source=check_source)
    if isinstance(job_or_done, Manifest):
        done = job_or_done
        shards = len(done.shards) // max(1, done.variants)
        return PreparePlanInfo(shards, done.samples + done.rejected, 0, done.classes, [], True)
    job = job_or_done
    try:
        job.folder.remove_stale_temp_files(spec.augment.variants)
        pending = sorted(_rewrites(job)) if job.repair is not None else _unwritten(job)
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
    # the shard's record is read beside the plan: on a store, one round trip, not two
    _, recorded = at_once(lambda: records.plan, lambda: WorkFolder(records.output).shard_record_text(shard))
    job = _load_planned_job(spec, records)
    try:
        if not 0 <= shard < job.plan.shards:
            raise ConfigError(f"shard {shard} is outside the plan (0..{job.plan.shards - 1})")
        rewrite = _rewrites(job, shard).get(shard, set()) if job.repair is not None else set()
        skipped = not rewrite if job.repair is not None else job.folder.recorded_files_intact(recorded)
        if not skipped:
            state = PrepareProgress(0, len(job.plan.positions(shard)), 0, 0.0)
            pool = SamplePool(0, job.spec, job.classes, ignore_index=job.task.mask_fill)
            record = _write_one_shard(job, shard, pool, state, progress, time.perf_counter(), rewrite)
        if job.repair is not None and skipped:  # an intact shard of a repaired dataset has no record
            files = [info for info in job.repair.manifest.shards if planned_shard_of(info.path) == shard]
            return ShardRecord(shard, max((info.samples for info in files), default=0), 0, True)
        if skipped:
            assert recorded is not None  # intact files are recorded ones
            record = json.loads(recorded)
    finally:
        job.listing.close()
    samples = max((info["samples"] for info in record["shards"]), default=0)
    return ShardRecord(shard, samples, len(record["rejected"]), skipped)


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
    records = OutRecords(output).read_both()
    spec = _as_recorded(spec, records)
    manifest = WorkFolder(output).finished_manifest(spec, records)
    if manifest is not None:
        damaged = WorkFolder(output).damaged_shards(manifest)
        if damaged:
            listed = ", ".join(f"{path} {problem}" for path, problem in list(damaged.items())[:10])
            raise StorageError(f"cannot finish {spec.out}: {listed}; write those shards first (plan_prepare plans them)")
        _clean_up(output, manifest)  # the leftovers of a finish that stopped right after its manifest (or of a repair)
        _release_job_lock(output, job_id)
        return _result(spec.out, manifest)
    planned = _load_planned_job(spec, records, with_listing=False)
    try:
        if planned.output.is_local:  # sizes and sha256, file by file
            written, present = None, None
            missing = planned.folder.pending_shards(planned.plan.shards)
        else:  # the records and one listing of OUT, at once: the sizes they record are checked against it
            written, present = _written_and_present(planned)
            missing = [shard for shard, record in enumerate(written) if _lost(record, present)]
        if missing:
            listed = ", ".join(str(shard) for shard in missing[:10]) + (" ..." if len(missing) > 10 else "")
            missing_shards = f"shard {listed} is" if len(missing) == 1 else f"shards {listed} are"
            raise StorageError(f"cannot finish {spec.out}: {missing_shards} missing or invalid")
        result = _result(spec.out, _finish(planned, written, present))
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
    if not output.exists(MANIFEST_NAME):
        WorkFolder(output).clear_output()
    else:
        output.remove(WORK_DIR)
    WorkFolder(output).remove_temp_files()
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


def _load_planned_job(spec: PrepareSpec, records: OutRecords | None = None, *, with_listing: bool = True) -> _Job:
    """The planned job in OUT (`records`: what the caller read of OUT already).

    `with_listing` False: the job's listing is not downloaded to this machine
    (the finish reads no source; on a store the listing of a million images is
    a download of 100 MB and more).
    """
    records = records or OutRecords(Output(spec.out))
    output, saved = records.output, records.plan
    if saved is None:
        raise ConfigError(
            f"{spec.out} has no planned prepare; run plan_prepare first (a job planned there has lost "
            "its work folder: was OUT emptied or removed meanwhile? then start the job again)"
        )
    spec = _as_recorded(spec, records)
    if saved.get("identity") != spec.output_identity():
        raise planned_conflict(spec, saved.get("identity") or {})
    repair = None
    if saved.get("repair"):
        manifest = WorkFolder(output).finished_manifest(spec, records)
        if manifest is None:
            raise ConfigError(f"{spec.out} has no planned prepare (its planned repair lost its manifest); run plan_prepare first")
        repair = _Repair(manifest, dict(saved["repair"]))
    if with_listing:
        listing = fetch_listing(output, WORK_DIR, saved["listing_sha256"])
    else:
        listing = Listing(output.local(WORK_DIR))  # never read: opening it reads nothing
    plan = ShardPlan(**saved["plan"])
    classes, task = saved["classes"], _TaskInfo.from_record(saved)
    return _Job(spec, output, listing, plan, classes, saved["listed"], saved.get("ignored", 0), [], repair=repair, task=task)
