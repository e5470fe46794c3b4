"""Submitting, dispatching and cancelling jobs: used by the CLI, by scheduled runs and by the watchdog.

A job runs as units: `plan` (list and plan a prepare, then fan out one
`shard:N` task per shard in a chord whose callback is `finalize`),
`reshard` (a re-pack in one task), `bench` (a disk benchmark) and `cleanup`
(after a cancel). Any unit can be sent again: every task is idempotent.
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import ConfigError

from .jobs import FINAL, JobRecord, JobStore, ServiceError
from .security import job_paths, lock_name, validate_job
from .settings import ServiceSettings

TASK_NAMES = {
    "plan": "gpufeed.plan_prepare",
    "shard": "gpufeed.write_prepare_shard",
    "finalize": "gpufeed.finalize_prepare",
    "reshard": "gpufeed.repack_dataset",
    "bench": "gpufeed.benchmark_disk",
    "cleanup": "gpufeed.cleanup_job",
}


def first_unit(kind: str, payload: dict[str, Any]) -> str:
    """The unit a job starts with."""
    if kind == "prepare" or (kind == "reshard" and payload["spec"].get("reaugment")):
        return "plan"
    return "reshard" if kind == "reshard" else "bench"


def task_message(record: JobRecord, unit: str) -> tuple[str, list[Any]]:
    """(task name, JSON arguments) that run `unit` of a job."""
    name, _, index = unit.partition(":")
    if name == "shard":
        return TASK_NAMES[name], [record.id, record.prepare_spec, int(index)]
    if name == "finalize":
        return TASK_NAMES[name], [record.id, record.prepare_spec]
    return TASK_NAMES[name], [record.id]


def send_unit(record: JobRecord, unit: str) -> None:
    """Queue one unit of a job (on the job's queue)."""
    from .app import app

    name, args = task_message(record, unit)
    app.send_task(name, args=args, queue=record.queue)


def check_bench_available() -> None:
    import importlib.util

    try:
        found = importlib.util.find_spec("pipeline.bench.disk") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ConfigError(
            "this gpufeed has no disk benchmark (pipeline.bench.disk is missing), so bench-disk jobs cannot run; "
            "update gpufeed on this machine and on the workers"
        )


def submit_job(kind: str, payload: dict[str, Any], settings: ServiceSettings, store: JobStore | None = None) -> str:
    """Validate a job, record it (locking its outputs) and queue its first task; returns the job id.

    Raises:
        ConfigError: the spec is invalid or names paths outside GPUFEED_ALLOWED_ROOTS.
        JobConflictError: another active job writes the same output.
        ServiceError: Redis cannot be reached.
    """
    payload = validate_job(kind, payload, settings)
    if kind == "bench-disk":
        check_bench_available()
    store = store if store is not None else JobStore(settings)
    locks = sorted({lock_name(path) for path in job_paths(kind, payload)})
    job_id = store.create(kind, payload, locks, settings.queue)
    try:
        send_unit(store.require(job_id), first_unit(kind, payload))
    except Exception as exc:
        store.fail(job_id, f"could not queue the job: {exc}")
        raise ServiceError(f"could not queue job {job_id}: {exc}") from exc
    return job_id


def cancel_job(job_id: str, settings: ServiceSettings, store: JobStore | None = None) -> JobRecord:
    """Cancel a queued or running job: no more of its tasks start, and a cleanup task removes its partial output.

    Raises:
        ServiceError: the job is unknown, already finished, or writing its manifest.
    """
    store = store if store is not None else JobStore(settings)
    record = store.require(job_id)
    outcome = store.cancel(job_id)
    if outcome == "finalizing":
        raise ServiceError(f"job {job_id} is writing its manifest and can no longer be cancelled")
    if outcome != "ok":
        raise ServiceError(f"job {job_id} is already {outcome or record.state}; there is nothing to cancel")
    record = store.require(job_id)
    send_unit(record, "cleanup")
    return record


def is_final(state: str) -> bool:
    return state in FINAL
