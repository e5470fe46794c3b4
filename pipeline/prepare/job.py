"""`gpufeed prepare`: list -> plan -> per shard: decode -> transform -> encode -> write -> manifest.

The listing is spilled to a file in OUT/.gpufeed (one JSON line per source plus
an offset index) so memory stays flat however many files there are. A
deterministic plan assigns listing indices to shards through a seeded
permutation; each shard is written under a temporary name and renamed when
complete, and a small record of it (counts, hashes, rejects) is saved next to
the plan. A re-run of the same job lists again, checks that the source did not
change, keeps every complete and valid shard and writes only the rest. The
manifest is written last: its presence means the dataset is complete.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import multiprocessing
import os
import re
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..decode import pil_image, decode_image
from .encode import encode_image
from ..errors import (
    ConfigError,
    DecodeError,
    JobConflictError,
    ManifestError,
    SourceError,
    StorageError,
    write_failure,
)
from ..manifest import MANIFEST_NAME, REJECTED_NAME, Manifest, read_manifest, write_manifest
from ..manifest import ShardInfo
from .plan import ShardPlan, plan_shards, shard_name
from ..io.tar import TarShardWriter, sample_tar_bytes
from ..io.fs import file_sha256
from .sources import ListingInfo, SourceItem, list_images
from ..io.fs import read_source_bytes
from ..specs import PrepareSpec
from ..io.output import Output
from ..io.devices import device_info, faster_local_disk, free_bytes
from .transcode import applies as transcode_applies
from .transcode import transcode_jpeg
from .transforms import augment_image, required_scale, resize_image, resize_op, variant_rng

WORK_DIR = ".gpufeed"
CHUNK_ITEMS = 64  # images per pool task while many remain: few round trips through the pool
TAIL_CHUNK_ITEMS = 4  # near the end of a shard: small tasks, so no worker waits on another's last one
ESTIMATE_SAMPLES = 16
TERMINATE_GRACE_S = 10.0  # after an error, how long workers may take to finish the chunk in hand
SHARD_FILL = 0.92  # plan shards to 92 % of --shard-size: the estimate is an estimate

ProgressCallback = Callable[["PrepareProgress"], None]


@dataclasses.dataclass
class PrepareProgress:
    """Handed to the progress callback after every chunk of images."""

    done: int
    total: int
    rejected: int
    seconds: float
    stage: str = "prepare"


@dataclasses.dataclass
class PrepareResult:
    """Summary of a finished prepare."""

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

    @property
    def images_per_s(self) -> float:
        return self.processed / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["images_per_s"] = round(self.images_per_s, 2)
        data["seconds"] = round(self.seconds, 3)
        data["manifest"] = f"{self.out.rstrip('/')}/{MANIFEST_NAME}"
        return data


# ---------------------------------------------------------------------------
# One sample: read -> decode -> transform -> encode


_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def sample_key(rel: str) -> str:
    """A WebDataset key for a source path: readable, unique, no dots or slashes.

    The readable part is the path with every other character replaced; a
    64-bit hash of the exact path keeps `a.b.jpg`, `a_b.jpg` and `été.jpg`
    apart.
    """
    slug = _KEY_UNSAFE.sub("_", rel).strip("_")[:48] or "image"
    # surrogateescape: file names that are not valid UTF-8 still get a stable key.
    digest = hashlib.blake2b(rel.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()
    return f"{slug}-{digest}"


@dataclasses.dataclass
class SampleOutcome:
    """What became of one source: its tar bytes per variant set, or a reject reason."""

    index: int
    key: str
    source: str
    tars: list[bytes] | None = None
    reason: str = ""


def process_item(item: SourceItem, index: int, spec: PrepareSpec, classes: dict[str, int]) -> SampleOutcome:
    """Turn one source file into the tar members of its sample(s).

    Never raises for a bad image: the outcome carries the reason instead.
    """
    key = sample_key(item.rel)
    outcome = SampleOutcome(index, key, item.url)
    try:
        data = read_source_bytes(item.url, spec.max_file_bytes)
    except (OSError, ValueError) as exc:
        outcome.reason = f"cannot read file: {getattr(exc, 'strerror', None) or exc}"
        return outcome
    label = classes.get(item.label) if item.label is not None else None
    try:
        fast = transcode_jpeg(data, spec) if transcode_applies(spec) else None
        if fast is not None:
            payload, original_size, size = fast
            members = _members(key, item, spec, label, original_size, size, None, [resize_op(spec.resize)], payload)
            outcome.tars = [sample_tar_bytes(key, members)]
        else:
            decoded = decode_image(
                data,
                scale_for=lambda w, h: required_scale(spec.resize, spec.augment, w, h),
                max_pixels=spec.max_pixels,
                background=spec.background,
                padded=True,
            )
            outcome.tars = [sample_tar_bytes(key, m) for m in _render_variants(decoded, key, item, spec, label)]
    except DecodeError as exc:
        outcome.reason = exc.reason
    except (OSError, ValueError, MemoryError) as exc:
        outcome.reason = f"cannot process image: {exc}"
    return outcome


def _render_variants(
    decoded: Any, key: str, item: SourceItem, spec: PrepareSpec, label: int | None
) -> list[dict[str, bytes]]:
    if spec.augment.variants and decoded.image.mode != "RGB":
        decoded.image = decoded.image.convert("RGB")  # the augmentations work on RGB
    members_per_set = []
    variants = range(spec.augment.variants) if spec.augment.variants else [None]
    for variant in variants:
        if variant is None:
            image, op = resize_image(decoded.image, decoded.original_size, spec.resize)
            ops: list[dict[str, Any]] = [op]
        else:
            rng = variant_rng(spec.seed, key, variant)
            image, ops = augment_image(decoded.image, decoded.original_size, spec.resize, spec.augment, rng)
        payload = encode_image(image, spec.encode)
        members_per_set.append(
            _members(key, item, spec, label, decoded.original_size, image.size, variant, ops, payload)
        )
    return members_per_set


def _members(
    key: str,
    item: SourceItem,
    spec: PrepareSpec,
    label: int | None,
    original_size: tuple[int, int],
    size: tuple[int, int],
    variant: int | None,
    ops: list[dict[str, Any]],
    payload: bytes,
) -> dict[str, bytes]:
    meta = {
        "key": key,
        "source": item.url,
        "label": item.label,
        "original_size": list(original_size),
        "size": list(size),
        "variant": variant,
        "seed": spec.seed,
        "ops": ops,
    }
    members = {
        spec.encode.extension: payload,
        "json": json.dumps(meta, sort_keys=True, separators=(",", ":")).encode("ascii"),
    }
    if label is not None:
        members["cls"] = str(label).encode("ascii")
    return members


# ---------------------------------------------------------------------------
# The listing spill: one line per source plus a uint64 offset index


class Listing:
    """The job's sources on disk: random access by index without holding them in memory."""

    def __init__(self, directory: str) -> None:
        self.lines_path = os.path.join(directory, "listing.jsonl")
        self.index_path = os.path.join(directory, "listing.idx")
        self._fd: int | None = None
        self._offsets: np.ndarray | None = None

    def write(self, items: Iterator[SourceItem]) -> tuple[int, str, set[str]]:
        """Spill `items`; returns (count, sha256 of the listing, label names seen)."""
        try:
            with open(self.lines_path, "wb") as lines, open(self.index_path, "wb") as index:
                return self._spill(items, lines, index)
        except OSError as exc:
            raise write_failure(self.lines_path, exc) from exc

    def _spill(self, items: Iterator[SourceItem], lines: Any, index: Any) -> tuple[int, str, set[str]]:
        digest = hashlib.sha256()
        labels: set[str] = set()
        offsets = array.array("Q", [0])
        count = position = 0
        for item in items:
            line = item.to_json().encode("utf-8") + b"\n"
            lines.write(line)
            digest.update(line)
            position += len(line)
            offsets.append(position)
            count += 1
            if item.label is not None:
                labels.add(item.label)
            if len(offsets) >= 65536:  # flush the index in blocks: memory stays flat
                offsets.tofile(index)
                offsets = array.array("Q")
        offsets.tofile(index)
        return count, digest.hexdigest(), labels

    def __len__(self) -> int:
        return max(0, os.path.getsize(self.index_path) // 8 - 1)

    def get(self, index: int) -> SourceItem:
        if self._fd is None:
            self._fd = os.open(self.lines_path, os.O_RDONLY)
            self._offsets = np.memmap(self.index_path, dtype=np.uint64, mode="r")
        assert self._offsets is not None
        start, stop = int(self._offsets[index]), int(self._offsets[index + 1])
        return SourceItem.from_json(os.pread(self._fd, stop - start, start))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._offsets = None


# ---------------------------------------------------------------------------
# Worker processes


_WORKER: dict[str, Any] = {}


def _init_child(spec_dict: dict[str, Any], classes: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cleans up
    _init_worker(spec_dict, classes)


def _init_worker(spec_dict: dict[str, Any], classes: list[str]) -> None:
    _WORKER["spec"] = PrepareSpec.from_dict(spec_dict)
    _WORKER["classes"] = {name: i for i, name in enumerate(classes)}


def _process_chunk(chunk: list[tuple[int, SourceItem]]) -> list[SampleOutcome]:
    spec, classes = _WORKER["spec"], _WORKER["classes"]
    return [process_item(item, index, spec, classes) for index, item in chunk]


def _warm_codecs(spec: PrepareSpec) -> None:
    """Run the job's image path once, on a tiny image, before the workers fork.

    Pillow imports its plugins and sets up its codecs on first use, and the
    native library loads on first use; done here, every forked worker
    inherits them. Measured: the first image in a fresh worker took 35 ms
    instead of 5. A job on the YCbCr path warms only that path (about 20 ms
    less in front of the pool); a file that falls back warms the other one
    in its worker.
    """
    Image = pil_image()
    sample = io.BytesIO()
    Image.new("RGB", (48, 32), (90, 120, 150)).save(sample, "JPEG", quality=90)
    # A warm-up only: a codec that fails here fails with its reason on the first real image.
    with contextlib.suppress(Exception):
        if transcode_applies(spec) and transcode_jpeg(sample.getvalue(), spec) is not None:
            return
        decoded = decode_image(sample.getvalue(), scale_for=lambda width, height: 1.0, padded=True)
        image, _ = resize_image(decoded.image, decoded.original_size, spec.resize)
        encode_image(image, spec.encode)


class _Workers:
    """The process pool of a prepare, robust to a worker that dies.

    A C decoder can crash (or be killed for memory) on a hostile file. The
    pool then breaks; the chunks it held are re-run one file per fresh
    process, so only the file that crashes again is rejected, and the job
    goes on with a new pool. `workers=0` runs chunks in this process.
    """

    def __init__(self, workers: int, spec: PrepareSpec, classes: list[str]) -> None:
        self.workers = workers
        self._initargs = (spec.to_dict(), classes)
        self._executor: Any = None
        if workers == 0:
            _init_worker(*self._initargs)
        else:
            _warm_codecs(spec)  # forked workers inherit it: their first image starts sooner
            self._executor = self._new_executor(workers)

    def _new_executor(self, workers: int) -> Any:
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("fork")
        return ProcessPoolExecutor(workers, mp_context=context, initializer=_init_child, initargs=self._initargs)

    def submit(self, chunk: list[tuple[int, SourceItem]], cache: dict[int, SampleOutcome] | None = None) -> Any:
        if cache:
            known = {index: cache.pop(index) for index, _ in chunk if index in cache}
            if known:
                rest = [(index, item) for index, item in chunk if index not in known]
                return _WithKnown(known, chunk, self.submit(rest) if rest else None)
        if self._executor is None:
            from concurrent.futures import Future

            done: Future[list[SampleOutcome]] = Future()
            done.set_result(_process_chunk(chunk))
            return done
        return self._executor.submit(_process_chunk, chunk)

    def result(self, pending: Any, chunk: list[tuple[int, SourceItem]]) -> list[SampleOutcome]:
        from concurrent.futures.process import BrokenProcessPool

        try:
            outcomes: list[SampleOutcome] = pending.result()
            return outcomes
        except BrokenProcessPool:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = self._new_executor(self.workers)
            return [self._isolated(index, item) for index, item in chunk]

    def _isolated(self, index: int, item: SourceItem) -> SampleOutcome:
        from concurrent.futures.process import BrokenProcessPool

        single = self._new_executor(1)
        try:
            return single.submit(_process_chunk, [(index, item)]).result()[0]  # type: ignore[no-any-return]
        except BrokenProcessPool:
            return SampleOutcome(index, sample_key(item.rel), item.url, reason="the decoder process crashed on this file")
        finally:
            single.shutdown(wait=True)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def terminate(self) -> None:
        """Stop the pool after an error: queued chunks are dropped, running ones may finish.

        A worker killed while it sends its results leaves half a message in
        the result pipe, and the executor's thread then waits forever for the
        rest (so does interpreter exit, which joins that thread). So workers
        get TERMINATE_GRACE_S to finish the chunk in hand and exit on their
        own; only one still busy after that (stuck on a file) is killed.
        """
        if self._executor is None:
            return
        executor, self._executor = self._executor, None
        processes = list(getattr(executor, "_processes", {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join()
        thread = getattr(executor, "_executor_manager_thread", None)
        if thread is not None:
            thread.join(TERMINATE_GRACE_S)


class _WithKnown:
    """A chunk's outcomes: some measured earlier (the size estimate), the rest still running."""

    def __init__(self, known: dict[int, SampleOutcome], chunk: list[tuple[int, SourceItem]], pending: Any) -> None:
        self.known, self.chunk, self.pending = known, chunk, pending

    def result(self) -> list[SampleOutcome]:
        fresh = {outcome.index: outcome for outcome in (self.pending.result() if self.pending else [])}
        return [self.known.get(index) or fresh[index] for index, _ in self.chunk]


def available_cores() -> int:
    """Cores this process may run on (cgroup/affinity aware), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------
# The job


@dataclasses.dataclass
class _Job:
    spec: PrepareSpec
    output: Output
    work: str
    listing: Listing
    plan: ShardPlan
    classes: list[str]
    listed: int
    ignored: int
    warnings: list[str]
    pool: _Workers | None = None
    cache: dict[int, SampleOutcome] = dataclasses.field(default_factory=dict)


def prepare_dataset(
    spec: PrepareSpec,
    *,
    workers: int | None = None,
    force: bool = False,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
) -> PrepareResult:
    """Prepare SRC into verified WebDataset shards at OUT.

    Args:
        spec: the job (source, out and every setting).
        workers: processes; None uses every available core, 0 runs in-process.
        force: write even when the free-space check says it will not fit.
        overwrite: replace an OUT prepared with different settings.
        progress: called with a PrepareProgress after every chunk.

    Returns:
        A PrepareResult summary.

    Raises:
        ConfigError: bad settings, or no images in SRC.
        SourceError: SRC cannot be listed or has changed since an interrupted run.
        JobConflictError: OUT holds a different job.
        StorageError: OUT cannot be written (e.g. full disk); complete shards are kept.
    """
    started = time.perf_counter()
    workers = available_cores() if workers is None else workers
    if workers < 0:
        raise ConfigError("--workers must be 0 or more")
    job_or_done = _open_or_plan(spec, force=force, overwrite=overwrite, workers=workers)
    if isinstance(job_or_done, Manifest):
        return _already_complete(job_or_done, spec, workers, started)
    job = job_or_done
    try:
        processed, resumed = _write_pending_shards(job, workers, progress, started)
        manifest = _finish(job)
    finally:
        job.listing.close()
    return _result(job, manifest, time.perf_counter() - started, processed, resumed, workers)


def _result(job: _Job, manifest: Manifest, seconds: float, processed: int, resumed: int, workers: int) -> PrepareResult:
    return PrepareResult(
        out=job.spec.out,
        listed=job.listed,
        samples=manifest.samples,
        rejected=manifest.rejected,
        ignored=job.ignored,
        shards=len(manifest.shards),
        bytes=sum(s.bytes for s in manifest.shards),
        classes=manifest.classes,
        variants=manifest.variants,
        seconds=seconds,
        processed=processed,
        resumed_shards=resumed,
        workers=workers,
        warnings=job.warnings,
    )


def _open_or_plan(spec: PrepareSpec, *, force: bool, overwrite: bool, workers: int | None = None) -> _Job | Manifest:
    _refuse_out_inside_source(spec)
    output = Output(spec.out)
    finished = _check_existing(output, spec, overwrite)
    if finished is not None:
        return finished
    output.makedirs()
    return _start_job(spec, output, force, overwrite, workers)


# ---------------------------------------------------------------------------
# The same job in steps, for a distributed runner (the Celery service):
# plan once, write each shard anywhere that sees OUT, finish once.


@dataclasses.dataclass(frozen=True)
class PreparePlanInfo:
    """What `plan_prepare` decided: how many shards to write, or that OUT is already complete."""

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


def plan_prepare(spec: PrepareSpec, *, force: bool = False, overwrite: bool = False) -> PreparePlanInfo:
    """List SRC and plan the shards (kept in OUT/.gpufeed); resumable like `prepare_dataset`.

    Raises:
        The same errors as `prepare_dataset`.
    """
    job_or_done = _open_or_plan(spec, force=force, overwrite=overwrite)
    if isinstance(job_or_done, Manifest):
        count = len(job_or_done.shards)
        return PreparePlanInfo(count, job_or_done.samples + job_or_done.rejected, 0, job_or_done.classes, [], True)
    job = job_or_done
    try:
        _remove_stale_temp_files(job)
        pending = [s for s in range(job.plan.shards) if not _shard_is_complete(job, s)]
    finally:
        job.listing.close()
    return PreparePlanInfo(job.plan.shards, job.listed, job.ignored, job.classes, pending, False, job.warnings)


def write_prepare_shard(spec: PrepareSpec, shard: int, *, progress: ProgressCallback | None = None) -> ShardRecord:
    """Write one planned shard in this process; a complete and valid shard is left as it is.

    Idempotent: the bytes depend only on (spec, shard), temp files are
    per host and process, and the final rename is atomic, so a duplicate or
    re-delivered run is harmless. `progress` is called after every chunk of
    images; an exception it raises abandons the shard (its temp files are
    removed), which is how a runner cancels one.

    Raises:
        ConfigError: the job was not planned (run `plan_prepare` first) or the index is out of range.
        StorageError: OUT cannot be written.
    """
    job = _load_planned_job(spec)
    try:
        if not 0 <= shard < job.plan.shards:
            raise ConfigError(f"shard {shard} is outside the plan (0..{job.plan.shards - 1})")
        if _shard_is_complete(job, shard):
            record = _read_shard_record(job, shard)
            return ShardRecord(shard, _record_samples(record), len(record["rejected"]), True)
        state = PrepareProgress(0, len(job.plan.positions(shard)), 0, 0.0)
        _write_one_shard(job, shard, _Workers(0, job.spec, job.classes), state, progress, time.perf_counter())
        record = _read_shard_record(job, shard)
        return ShardRecord(shard, _record_samples(record), len(record["rejected"]), False)
    finally:
        job.listing.close()


def finish_prepare(spec: PrepareSpec) -> Manifest:
    """Write rejected.jsonl and the manifest once every planned shard is complete and valid.

    Raises:
        StorageError: a shard is missing or does not match its record (nothing is published).
    """
    job = _load_planned_job(spec)
    try:
        missing = [s for s in range(job.plan.shards) if not _shard_is_complete(job, s)]
        if missing:
            raise StorageError(f"cannot finish {spec.out}: shard(s) {missing[:10]} are missing or invalid")
        return _finish(job)
    finally:
        job.listing.close()


def discard_prepare(spec: PrepareSpec) -> None:
    """Remove what an unfinished prepare wrote to OUT: shards, rejects, the work folder, temp files.

    A finished dataset (OUT/manifest.json present) keeps its shards; only
    leftover temp files and work files go.
    """
    output = Output(spec.out)
    if not output.exists(MANIFEST_NAME):
        _clear_output(output)
    else:
        output.remove(WORK_DIR)
    if not output.is_local:
        return
    set_dirs = [""] + [name for name in output.listdir() if re.fullmatch(r"v\d+", name)]
    for prefix in set_dirs:
        for name in output.listdir(prefix):
            if name.startswith(".shard-") and ".tmp-" in name:
                output.remove(f"{prefix}/{name}" if prefix else name)


def _load_planned_job(spec: PrepareSpec) -> _Job:
    output = Output(spec.out)
    plan_rel = f"{WORK_DIR}/plan.json"
    if not output.exists(plan_rel):
        raise ConfigError(f"{spec.out} has no planned prepare; run plan_prepare first")
    saved = json.loads(output.read_bytes(plan_rel))
    if saved.get("identity") != spec.output_identity():
        raise JobConflictError(f"{spec.out} holds a planned prepare with different settings")
    listing = Listing(output.local(WORK_DIR))
    plan = ShardPlan(**saved["plan"])
    return _Job(spec, output, output.local(WORK_DIR), listing, plan, saved["classes"], saved["listed"], saved.get("ignored", 0), [])


def _read_shard_record(job: _Job, shard: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(job.output.read_bytes(_shard_record_rel(shard)))
    return data


def _record_samples(record: dict[str, Any]) -> int:
    return max((info["samples"] for info in record["shards"]), default=0)


def _refuse_out_inside_source(spec: PrepareSpec) -> None:
    from ..io.fs import local_path

    source, out = local_path(spec.source), local_path(spec.out)
    if source is None or out is None or not os.path.isdir(source):
        return
    source_real, out_real = os.path.realpath(source), os.path.realpath(out)
    if out_real == source_real or out_real.startswith(source_real.rstrip("/") + "/"):
        raise ConfigError(f"OUT ({spec.out}) is inside SRC ({spec.source}): its shards would be listed as a class; put OUT elsewhere")


def _check_existing(output: Output, spec: PrepareSpec, overwrite: bool) -> Manifest | None:
    """The existing manifest when OUT already holds this exact job, else None."""
    plan_rel = f"{WORK_DIR}/plan.json"
    if output.exists(MANIFEST_NAME):
        try:
            manifest = read_manifest(output)
        except ManifestError:
            manifest = None
        if manifest is not None and manifest.params == spec.output_identity() and not overwrite:
            return manifest
        if not overwrite:
            raise JobConflictError(
                f"{spec.out} already holds a dataset prepared with different settings; "
                "choose another OUT or pass --overwrite to replace it"
            )
        _clear_output(output)
    elif output.exists(plan_rel):
        plan = json.loads(output.read_bytes(plan_rel))
        if plan.get("identity") != spec.output_identity():
            if not overwrite:
                raise JobConflictError(
                    f"{spec.out} holds an unfinished prepare with different settings; "
                    "re-run that command to finish it, choose another OUT, or pass --overwrite"
                )
            _clear_output(output)
    return None


def _clear_output(output: Output) -> None:
    for name in output.listdir():
        if name in (MANIFEST_NAME, REJECTED_NAME, WORK_DIR) or re.fullmatch(r"shard-\d{6}\.tar|v\d+", name):
            output.remove(name)


def _already_complete(manifest: Manifest, spec: PrepareSpec, workers: int, started: float) -> PrepareResult:
    return PrepareResult(
        out=spec.out,
        listed=manifest.samples + manifest.rejected,
        samples=manifest.samples,
        rejected=manifest.rejected,
        ignored=0,
        shards=len(manifest.shards),
        bytes=sum(s.bytes for s in manifest.shards),
        classes=manifest.classes,
        variants=manifest.variants,
        seconds=time.perf_counter() - started,
        processed=0,
        resumed_shards=len(manifest.shards),
        workers=workers,
        already_complete=True,
    )


def _start_job(spec: PrepareSpec, output: Output, force: bool, overwrite: bool, workers: int | None = None) -> _Job:
    work = output.local(WORK_DIR)
    os.makedirs(os.path.join(work, "shards"), exist_ok=True)
    listing = Listing(work)
    info = ListingInfo()
    listed, digest, labels = listing.write(list_images(spec.source, info))
    if listed == 0:
        listing.close()
        raise ConfigError(
            f"no images found in {spec.source}"
            + (f" ({info.ignored} files without an image extension were ignored)" if info.ignored else "")
        )
    classes = _class_names(info, labels)
    warnings: list[str] = []
    plan_rel = f"{WORK_DIR}/plan.json"
    saved = json.loads(output.read_bytes(plan_rel)) if output.exists(plan_rel) else None
    if saved is not None and saved.get("listing_sha256") != digest:
        if not overwrite:
            raise SourceError(
                f"{spec.source} changed since the interrupted prepare into {spec.out} "
                f"({saved.get('listed')} files then, {listed} now); pass --overwrite to start over"
            )
        saved = None
        output.remove(f"{WORK_DIR}/shards")
        os.makedirs(os.path.join(work, "shards"), exist_ok=True)
    pool: _Workers | None = None
    cache: dict[int, SampleOutcome] = {}
    if saved is not None:
        plan = ShardPlan(**saved["plan"])
        return _Job(spec, output, work, listing, plan, classes, listed, info.ignored, warnings)
    # The worker pool starts now: it measures the size estimate in parallel,
    # and the samples it measured are kept for their shards, not redone.
    pool = _Workers(workers, spec, classes) if workers is not None else None
    try:
        per_sample, cache = _estimate_sample_bytes(listing, listed, spec, classes, pool)
        plan = plan_shards(listed, _samples_per_shard(spec, per_sample), spec.seed)
        warnings += _check_placement(spec, per_sample * listed * max(1, spec.augment.variants), force)
        record = {
            "identity": spec.output_identity(),
            "listing_sha256": digest,
            "listed": listed,
            "classes": classes,
            "plan": plan.to_dict(),
            "estimated_sample_bytes": per_sample,
            "ignored": info.ignored,
        }
        output.write_bytes_atomic(plan_rel, json.dumps(record, indent=1).encode("utf-8"))
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    return _Job(spec, output, work, listing, plan, classes, listed, info.ignored, warnings, pool, cache)


def _class_names(info: ListingInfo, labels: set[str]) -> list[str]:
    if info.kind == "imagefolder":
        return info.classes
    if labels and all(label.isdigit() for label in labels):
        # Integer labels in a list are class indices already.
        return [str(i) for i in range(max(int(label) for label in labels) + 1)]
    return sorted(labels)


def _estimate_sample_bytes(
    listing: Listing, listed: int, spec: PrepareSpec, classes: list[str], pool: _Workers | None
) -> tuple[int, dict[int, SampleOutcome]]:
    """Mean bytes one sample adds to a shard, measured on a few evenly spread sources.

    Returns the estimate and the measured outcomes (index -> outcome) for reuse.
    """
    step = max(1, listed // ESTIMATE_SAMPLES)
    chunk = [(index, listing.get(index)) for index in range(0, listed, step)[:ESTIMATE_SAMPLES]]
    if pool is None:
        class_index = {name: i for i, name in enumerate(classes)}
        outcomes = [process_item(item, index, spec, class_index) for index, item in chunk]
    else:
        per_worker = max(1, -(-len(chunk) // max(1, pool.workers)))
        pieces = [chunk[i : i + per_worker] for i in range(0, len(chunk), per_worker)]
        pending = [(pool.submit(piece), piece) for piece in pieces]
        outcomes = [outcome for future, piece in pending for outcome in pool.result(future, piece)]
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
            f"{spec.out} has {free / 1e9:.2f} GB free but the shards need about "
            f"{estimated_bytes / 1e9:.2f} GB (+10 % margin)"
        )
        if not force:
            raise StorageError(message + "; free some space, pick another OUT, or pass --force")
        warnings.append(message + "; writing anyway (--force)")
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


def _set_dirs(job: _Job) -> list[tuple[int | None, str]]:
    if job.spec.augment.variants:
        return [(v, f"v{v}/") for v in range(job.spec.augment.variants)]
    return [(None, "")]


def _shard_record_rel(shard: int) -> str:
    return f"{WORK_DIR}/shards/{shard:06d}.json"


def _shard_is_complete(job: _Job, shard: int) -> bool:
    rel = _shard_record_rel(shard)
    if not job.output.exists(rel):
        return False
    record = json.loads(job.output.read_bytes(rel))
    for info in record["shards"]:
        if job.output.size(info["path"]) != info["bytes"]:
            return False
        if job.output.is_local and file_sha256(job.output.local(info["path"]))[0] != info["sha256"]:
            return False
    return True


def _remove_stale_temp_files(job: _Job) -> None:
    for _, prefix in _set_dirs(job):
        directory = job.output.local(prefix) if prefix else job.output.staging
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            if name.startswith(".shard-") and ".tmp-" in name:
                os.unlink(os.path.join(directory, name))


def chunk_sizes(total: int, workers: int) -> list[int]:
    """How a shard's `total` images are cut into pool tasks: large while plenty remain, small at the end.

    Every task costs a round trip through the pool (pickling, a wake-up, the
    results back), so most are CHUNK_ITEMS long; but a worker handed one of
    those last would leave the others idle, so each task is at most a
    quarter of what remains per worker, down to TAIL_CHUNK_ITEMS.
    """
    sizes, remaining, workers = [], total, max(1, workers)
    while remaining > 0:
        size = min(remaining, max(TAIL_CHUNK_ITEMS, min(CHUNK_ITEMS, remaining // (workers * 4))))
        sizes.append(size)
        remaining -= size
    return sizes


def _chunks(job: _Job, shard: int, workers: int) -> Iterator[list[tuple[int, SourceItem]]]:
    indices = job.plan.indices(shard)
    start = 0
    for size in chunk_sizes(len(indices), workers):
        yield [(int(i), job.listing.get(int(i))) for i in indices[start : start + size]]
        start += size


def _write_pending_shards(
    job: _Job, workers: int, progress: ProgressCallback | None, started: float
) -> tuple[int, int]:
    _remove_stale_temp_files(job)
    pending = [s for s in range(job.plan.shards) if not _shard_is_complete(job, s)]
    resumed = job.plan.shards - len(pending)
    total = sum(len(job.plan.positions(s)) for s in pending)
    state = PrepareProgress(0, total, 0, 0.0)
    pool = job.pool or _Workers(workers, job.spec, job.classes)
    try:
        for shard in pending:
            _write_one_shard(job, shard, pool, state, progress, started)
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    return total, resumed


def _write_one_shard(
    job: _Job,
    shard: int,
    pool: _Workers,
    state: PrepareProgress,
    progress: ProgressCallback | None,
    started: float,
) -> None:
    sets = _set_dirs(job)
    writers = [TarShardWriter(job.output.local(prefix + shard_name(shard))) for _, prefix in sets]
    rejected: list[dict[str, str]] = []
    window = max(2, pool.workers * 3)  # chunks in flight: keeps every worker busy, bounds memory
    with _ExitAll(writers):
        in_flight: deque[tuple[Any, list[tuple[int, SourceItem]]]] = deque()
        for chunk in _chunks(job, shard, pool.workers):
            in_flight.append((pool.submit(chunk, job.cache), chunk))
            if len(in_flight) >= window:
                _drain(pool.result(*in_flight.popleft()), writers, rejected, state)
                _report(state, progress, started)
        while in_flight:
            _drain(pool.result(*in_flight.popleft()), writers, rejected, state)
            _report(state, progress, started)
        infos = []
        for writer, (variant, prefix) in zip(writers, sets):
            if writer.samples:
                info = writer.commit(prefix + shard_name(shard), variant)
                job.output.publish(info.path)
                infos.append(info)
    record = {"shard": shard, "shards": [i.to_dict() for i in infos], "rejected": rejected}
    job.output.write_bytes_atomic(_shard_record_rel(shard), json.dumps(record).encode("utf-8"))


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
    outcomes: list[SampleOutcome], writers: list[TarShardWriter], rejected: list[dict[str, str]], state: PrepareProgress
) -> None:
    for outcome in outcomes:
        state.done += 1
        if outcome.tars is None:
            rejected.append({"source": outcome.source, "reason": outcome.reason})
            state.rejected += 1
            continue
        for writer, blob in zip(writers, outcome.tars):
            writer.write_sample_bytes(blob)


def _report(state: PrepareProgress, progress: ProgressCallback | None, started: float) -> None:
    if progress is not None:
        state.seconds = time.perf_counter() - started
        progress(state)


def _finish(job: _Job) -> Manifest:
    shards: list[ShardInfo] = []
    rejected_lines: list[bytes] = []
    rejected = 0
    for shard in range(job.plan.shards):
        record = json.loads(job.output.read_bytes(_shard_record_rel(shard)))
        for info in record["shards"]:
            shards.append(ShardInfo(info["path"], info["samples"], info["bytes"], info["sha256"], info.get("variant")))
        for entry in record["rejected"]:
            rejected_lines.append(json.dumps(entry).encode("ascii") + b"\n")
            rejected += 1
    sets = max(1, job.spec.augment.variants)
    samples = sum(s.samples for s in shards) // sets
    if samples + rejected != job.listed:
        raise StorageError(
            f"internal check failed: {samples} samples + {rejected} rejects != {job.listed} listed; "
            f"remove {job.spec.out} and run again"
        )
    job.output.write_bytes_atomic(REJECTED_NAME, b"".join(rejected_lines))
    manifest = Manifest(
        samples=samples,
        classes=job.classes,
        shards=shards,
        params=job.spec.output_identity(),
        source=job.spec.source,
        rejected=rejected,
        variants=job.spec.augment.variants,
    )
    write_manifest(job.output, manifest)
    job.listing.close()
    job.output.remove(WORK_DIR)
    if not job.output.is_local:
        import shutil

        shutil.rmtree(job.output.staging, ignore_errors=True)
    return manifest
