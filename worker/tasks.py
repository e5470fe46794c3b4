"""Celery tasks: thin shells named after the library steps they call.

Each task takes small JSON arguments (a job id, a spec dict, a shard index),
registers itself in the job record with a heartbeat (`UnitRun`), re-checks
the job's paths against this worker's GPUFEED_ALLOWED_ROOTS (a shard task
each file it reads, too), calls
`pipeline`, and records the outcome. Errors become the job's `error`, except
a retryable one (a StorageError: full disk, network store away), which sends
the task again after a pause, up to GPUFEED_MAX_ATTEMPTS runs in all; a
cancelled job's tasks stop at the next chunk of images, and its queued ones
do not start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

from celery import chord, current_task
from celery.exceptions import Reject, SoftTimeLimitExceeded
from celery.utils.log import get_task_logger

from pipeline.errors import GpufeedError
from pipeline.specs import PrepareSpec
from worker import security

from .app import app
from .client import submit_job
from .jobs import ACTIVE, JobRecord, JobStopped, JobStore
from .settings import get_settings
from .staging import mark_copies
from .units import UnitRun

logger = get_task_logger(__name__)
_STORE: JobStore | None = None


def store() -> JobStore:
    """This process's job store (created after the pool forked, with patient retries)."""
    global _STORE
    if _STORE is None:
        _STORE = JobStore(get_settings(), patient=True)
    return _STORE


@contextlib.contextmanager
def job_errors(job_id: str, what: str) -> Iterator[None]:
    """Record why a task failed in its job, instead of a traceback in a log nobody reads."""
    import redis

    try:
        yield
    except JobStopped as exc:
        logger.info("job %s: %s stopped (job %s)", job_id, what, exc)
    except SoftTimeLimitExceeded:
        limit = get_settings().shard_time_limit_s
        if store().fail(
            job_id, f"{what} ran past the time limit ({limit:.0f} s): use smaller shards (--shard-samples) or raise GPUFEED_SHARD_TIME_LIMIT"
        ):
            _free_out_lock(job_id)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        logger.warning("job %s: %s lost Redis (%s); requeueing", job_id, what, exc)
        raise Reject(str(exc), requeue=True) from exc
    except GpufeedError as exc:
        tries = _retry_if_retryable(job_id, what, exc)
        if store().fail(job_id, f"{what}: {exc}" + (f" (tried {tries} times)" if tries > 1 else "")):
            _free_out_lock(job_id)
    except Exception as exc:
        logger.exception("job %s: %s failed", job_id, what)
        if store().fail(job_id, f"{what}: internal error {type(exc).__name__}: {exc}"):
            _free_out_lock(job_id)


def _free_out_lock(job_id: str) -> None:
    """A failed prepare job lets go of its OUT's lock (`gpufeed prepare` may resume what it left)."""
    from pipeline.io.output import Output
    from pipeline.prepare.resume import remove_lock

    record = store().get(job_id)
    if record is None or record.kind != "prepare":
        return
    try:
        spec = PrepareSpec.from_dict(record.payload["spec"])
        with _job_storage(record, spec):
            remove_lock(Output(spec.out), job=job_id)
    except Exception as exc:  # noqa: BLE001 - the lock names the job, and the next plan takes it over
        logger.warning("job %s: could not remove the lock of its OUT: %s", job_id, exc)


def _retry_if_retryable(job_id: str, what: str, exc: GpufeedError) -> int:
    """Send the running task again later for an error that says trying again may work (a StorageError).

    Raises celery's Retry while tries are left: the task goes back to the broker
    with a countdown (doubling from GPUFEED_RETRY_DELAY, at most half of
    GPUFEED_STALE_AFTER, so the watchdog does not take the wait for a dead job).

    Returns:
        How many times the task has run, when it is not sent again: the job fails.
    """
    task = current_task  # a proxy: false outside a task
    if not task or task.request.called_directly:
        return 1
    settings = get_settings()
    tries = int(task.request.retries or 0) + 1
    if not exc.retryable or tries >= settings.max_attempts:
        return tries
    delay = min(settings.retry_delay_s * 2 ** (tries - 1), settings.stale_after_s / 2)
    logger.warning(
        "job %s: %s failed (%s); trying again in %.1f s (run %d of at most %d)",
        job_id, what, exc, delay, tries + 1, settings.max_attempts,
    )
    store().update(job_id, last_activity=store().now())
    raise task.retry(exc=exc, countdown=delay, max_retries=settings.max_attempts - 1)


def _skipped(job_id: str, run: UnitRun) -> dict[str, Any]:
    return {"job": job_id, "unit": run.unit, "skipped": run.status}


def _check_attempts(job_id: str, unit: str) -> None:
    attempts = store().count_attempt(job_id, unit)
    limit = get_settings().max_attempts
    if attempts > limit:
        raise GpufeedError(
            f"started {attempts - 1} times without finishing (its worker died each time: a file that crashes "
            "the decoder, or too little memory?)"
        )


def _worker_checked_spec(spec_dict: dict[str, Any]) -> PrepareSpec:
    """The spec of a message, refused here too if it leaves this worker's allowed roots."""
    spec = PrepareSpec.from_dict(spec_dict)
    roots = get_settings().allowed_roots
    security.check_path(spec.source, roots, "SRC")
    security.check_path(spec.out, roots, "OUT")
    return spec


# ---------------------------------------------------------------------------
# prepare (and re-augment): plan -> chord(shards) -> finalize


@app.task(bind=True, name="gpufeed.plan_prepare")
def plan_prepare_task(self: Any, job_id: str) -> dict[str, Any]:
    """List the source, plan the shards, fan out one task per shard with finalize as the chord's callback."""
    from pipeline.io.fs import confined_opens
    from pipeline.prepare.job import plan_prepare

    with job_errors(job_id, "planning"), UnitRun(store(), job_id, "plan", self.request.id) as run:
        if run.status != "ok":
            return _skipped(job_id, run)
        record = store().require(job_id)
        if store().client.hget(store().job_key(job_id), "fanned_out"):
            return {"job": job_id, "unit": "plan", "skipped": "already planned"}
        _check_attempts(job_id, "plan")
        settings = get_settings()
        payload = security.validate_job(record.kind, record.payload, settings)
        store().transition(job_id, "running", ACTIVE)
        spec, force, overwrite = _planned_spec(record, payload)
        with _job_storage(record, spec), confined_opens(settings.allowed_roots):
            check_source = security.listed_source_check(spec.source, settings.allowed_roots)
            run.check()
            mark_copies(spec, job_id)
            lock_for = job_id if record.kind == "prepare" else None  # held until finish_prepare; a re-augment's only while it plans
            info = plan_prepare(spec, force=force, overwrite=overwrite, check_source=check_source, job=lock_for)
            run.check()
            if info.already_complete:
                store().update(job_id, shards_total=info.shards, shards_done=info.shards, listed=info.listed)
                _succeed(record, spec)
                return {"job": job_id, "already_complete": True}
        store().update(
            job_id, shards_total=info.shards, listed=info.listed, prepare_spec=spec.to_dict(), warnings=info.warnings, fanned_out=1
        )
        spec_dict = spec.to_dict()
        header = [write_prepare_shard_task.si(job_id, spec_dict, i).set(queue=record.queue) for i in range(info.shards)]
        chord(header)(finalize_prepare_task.si(job_id, spec_dict).set(queue=record.queue))
        return {"job": job_id, "shards": info.shards, "pending": len(info.pending)}
    return {"job": job_id, "unit": "plan", "failed": True}


def _job_storage(record: JobRecord, spec: PrepareSpec) -> contextlib.AbstractContextManager[None]:
    """The job's non-secret store settings (endpoint, profile …) over this worker's own, for one step.

    Credentials are never in a job: each worker has its own (AWS_* variables, ~/.aws).
    """
    from pipeline.io.fs import storage_options_for

    options = record.payload.get("storage_options") if record.kind == "prepare" else None
    return storage_options_for((spec.source, spec.out), options)


def _planned_spec(record: JobRecord, payload: dict[str, Any]) -> tuple[PrepareSpec, bool, bool]:
    if record.kind == "prepare":
        return PrepareSpec.from_dict(payload["spec"]), payload["force"], payload["overwrite"]
    from pipeline.prepare.reshard import ReshardSpec, plan_reaugment

    if record.prepare_spec is None:  # the first plan claims the version folder; a re-run reuses it
        claimed = plan_reaugment(ReshardSpec.from_dict(payload["spec"]))
        stored = store().set_if_absent(record.id, "prepare_spec", claimed.to_dict())
        record.prepare_spec = json.loads(stored)
    assert record.prepare_spec is not None
    return _worker_checked_spec(record.prepare_spec), False, False


@app.task(bind=True, name="gpufeed.write_prepare_shard")
def write_prepare_shard_task(self: Any, job_id: str, spec_dict: dict[str, Any], shard: int) -> dict[str, Any]:
    """Write one shard (skipped when already complete) and count it in the job."""
    from pipeline.io.fs import confined_opens
    from pipeline.prepare.job import write_prepare_shard

    unit = f"shard:{shard}"
    with job_errors(job_id, f"shard {shard}"), UnitRun(store(), job_id, unit, self.request.id) as run:
        if run.status != "ok":
            return _skipped(job_id, run)
        if not isinstance(shard, int) or isinstance(shard, bool):
            raise GpufeedError(f"shard index must be a whole number, got {shard!r}")
        spec = _worker_checked_spec(spec_dict)
        if shard in store().done_shards(job_id):
            return {"job": job_id, "shard": shard, "skipped": "done"}
        _check_attempts(job_id, unit)
        mark_copies(spec, job_id)  # the listing this machine downloads goes once the job is over
        roots = get_settings().allowed_roots
        check_source = security.opened_source_check(roots)  # the listing in OUT is not trusted
        with _job_storage(store().require(job_id), spec), confined_opens(roots):  # nor a link swapped in after the check
            written = write_prepare_shard(spec, shard, progress=run.progress, check_source=check_source)
        run.check()
        processed = 0 if written.skipped else written.samples + written.rejected
        _, done, total = store().record_shard(job_id, shard, written.samples, written.rejected, processed, run.entry["worker"])
        if total and done >= total:
            _send_finalize(job_id, spec_dict)
        return {"job": job_id, "shard": shard, "samples": written.samples, "rejected": written.rejected, "skipped": written.skipped}
    return {"job": job_id, "shard": shard, "failed": True}


def _send_finalize(job_id: str, spec_dict: dict[str, Any]) -> None:
    # The chord's callback also finalizes; this covers a chord broken by a re-dispatched shard.
    if store().client.hsetnx(store().job_key(job_id), "finalize_sent", repr(time.time())):
        record = store().require(job_id)
        finalize_prepare_task.apply_async(args=[job_id, spec_dict], queue=record.queue)


@app.task(bind=True, name="gpufeed.finalize_prepare")
def finalize_prepare_task(self: Any, job_id: str, spec_dict: dict[str, Any]) -> dict[str, Any]:
    """Write the manifest once every shard is complete and valid (a no-op when already done)."""
    with job_errors(job_id, "finalize"), UnitRun(store(), job_id, "finalize", self.request.id) as run:
        if run.status != "ok":
            return _skipped(job_id, run)
        record = store().require(job_id)
        missing = record.shards_total - len(store().done_shards(job_id))
        if record.state != "running" or missing > 0:
            return {"job": job_id, "unit": "finalize", "waiting_for_shards": missing}
        if not store().transition(job_id, "running", ("running",), finalizing=1):
            return {"job": job_id, "unit": "finalize", "skipped": "job no longer running"}
        spec = _worker_checked_spec(spec_dict)
        _check_attempts(job_id, "finalize")
        with _job_storage(record, spec):
            samples, files = _succeed(record, spec)
        return {"job": job_id, "samples": samples, "shards": files}
    return {"job": job_id, "unit": "finalize", "failed": True}


def _succeed(record: JobRecord, spec: PrepareSpec) -> tuple[int, int]:
    """Finish the job in the library (safe to repeat) and record its summary; returns (samples, shard files)."""
    if record.kind == "reshard":
        from pipeline.prepare.reshard import ReshardSpec, publish_reaugment

        reshard = publish_reaugment(ReshardSpec.from_dict(record.payload["spec"]), spec)
        samples, rejected, files = reshard.samples, reshard.rejected, reshard.shards_after * max(1, reshard.variants)
        summary = reshard.to_dict()
    else:
        from pipeline.prepare.job import finish_prepare

        result = finish_prepare(spec, job=record.id)
        samples, rejected, files = result.samples, result.rejected, result.shards
        summary = {
            "manifest": result.manifest,
            "samples": samples,
            "rejected": rejected,
            "decoded_with_warnings": result.decoded_with_warnings,
            "shards": files,
            "bytes": result.bytes,
        }
    store().transition(record.id, "succeeded", ACTIVE, samples=samples, rejected=rejected, result=summary)
    return samples, files


# ---------------------------------------------------------------------------
# re-pack, disk benchmark, cleanup after a cancel, scheduled runs


@app.task(bind=True, name="gpufeed.repack_dataset")
def repack_dataset_task(self: Any, job_id: str) -> dict[str, Any]:
    """Re-pack a dataset into a new shard layout (no decoding) and swap it in; a re-delivery finishes the same re-pack."""
    from pipeline.prepare.reshard import ReshardSpec, repack_dataset

    with job_errors(job_id, "reshard"), UnitRun(store(), job_id, "reshard", self.request.id) as run:
        if run.status != "ok":
            return _skipped(job_id, run)
        _check_attempts(job_id, "reshard")
        record = store().require(job_id)
        payload = security.validate_job(record.kind, record.payload, get_settings())
        store().transition(job_id, "running", ACTIVE)

        def progress(done: int, total: int) -> None:
            run.done = done
            store().update(job_id, shards_done=done, shards_total=total)
            run.check()

        spec = ReshardSpec.from_dict(payload["spec"])
        result = repack_dataset(spec, progress=progress, version=_repack_version(job_id, spec))
        store().transition(job_id, "succeeded", ACTIVE, samples=result.samples, result=result.to_dict())
        return result.to_dict()
    return {"job": job_id, "unit": "reshard", "failed": True}


def _repack_version(job_id: str, spec: Any) -> str:
    """The version folder of the job's re-pack: claimed by its first delivery, the same for every later one."""
    from pipeline.prepare.reshard import claim_repack

    key = store().job_key(job_id)
    stored = store().client.hget(key, "repack_version")
    if stored is not None:
        return str(stored)
    claimed = claim_repack(spec)
    stored = store().set_if_absent(job_id, "repack_version", claimed)
    if stored != claimed and claimed:  # a delivery running at the same time claimed first: leave it that one
        from pipeline.io.output import Output

        Output(spec.dataset).remove(claimed)
    return str(stored)


@app.task(bind=True, name="gpufeed.benchmark_disk")
def benchmark_disk_task(self: Any, job_id: str) -> dict[str, Any]:
    """Run the disk benchmark on a worker's disk and keep the report in the job."""
    with job_errors(job_id, "bench-disk"), UnitRun(store(), job_id, "bench", self.request.id) as run:
        if run.status != "ok":
            return _skipped(job_id, run)
        _check_attempts(job_id, "bench")
        record = store().require(job_id)
        payload = security.validate_job(record.kind, record.payload, get_settings())
        from pipeline.measure.disk.bench import benchmark_disk

        store().transition(job_id, "running", ACTIVE)
        report = benchmark_disk(payload["path"], **payload["options"])
        result = _as_dict(report)
        store().transition(job_id, "succeeded", ACTIVE, result=result)
        return result
    return {"job": job_id, "unit": "bench", "failed": True}


def _as_dict(report: Any) -> dict[str, Any]:
    if hasattr(report, "to_dict"):
        return dict(report.to_dict())
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
        return dataclasses.asdict(report)
    return dict(report)


@app.task(bind=True, name="gpufeed.cleanup_job")
def cleanup_job_task(self: Any, job_id: str) -> dict[str, Any]:
    """After a cancel: wait for the job's running tasks to stop, remove its partial shards (finished ones stay), free its outputs."""
    settings = get_settings()
    record = store().get(job_id)
    if record is None or record.state != "cancelled":
        return {"job": job_id, "skipped": "not cancelled"}
    deadline = time.monotonic() + settings.stale_after_s + 2 * settings.heartbeat_interval_s
    while time.monotonic() < deadline:
        record = store().require(job_id)
        now = store().now()
        if not any(now - float(e.get("beat", 0)) <= settings.stale_after_s for e in record.running.values()):
            break
        time.sleep(min(1.0, settings.heartbeat_interval_s / 2))
    _discard_output(record)
    store().release_locks(job_id)
    return {"job": job_id, "cleaned": True}


def _discard_output(record: JobRecord) -> None:
    from pipeline.prepare.job import discard_partial_shards

    if record.kind == "prepare":  # finished shards stay: the same job submitted again resumes
        spec = _worker_checked_spec(record.payload["spec"])
        with _job_storage(record, spec):
            discard_partial_shards(spec, job=record.id)
    elif record.kind == "reshard" and record.prepare_spec is not None:
        from pipeline.prepare.reshard import ReshardSpec, discard_reaugment

        discard_reaugment(ReshardSpec.from_dict(record.payload["spec"]), _worker_checked_spec(record.prepare_spec))
    # A re-pack removes its own partial version when it stops.


@app.task(bind=True, name="gpufeed.run_schedule")
def run_schedule_task(self: Any, name: str, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    """A schedule fired: submit its job like `gpufeed submit` would (skipped while the last one still runs)."""
    from .schedules import record_schedule_run

    settings = get_settings()
    try:
        job_id = submit_job(kind, payload, settings, store())
    except GpufeedError as exc:
        logger.warning("schedule %s: not submitted: %s", name, exc)
        record_schedule_run(store().client, settings, name, error=str(exc))
        return {"schedule": name, "skipped": str(exc)}
    record_schedule_run(store().client, settings, name, job=job_id)
    return {"schedule": name, "job": job_id}
