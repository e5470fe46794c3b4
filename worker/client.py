"""Submitting and cancelling jobs: used by the CLI and by scheduled runs.

A job is validated, recorded in Redis (locking its outputs) and started by
queueing its first unit (see `worker.dispatch`).
"""

from __future__ import annotations

from typing import Any

from .dispatch import first_unit, send_unit
from .jobs import JobRecord, JobStore, ServiceError
from .security import job_paths, lock_name, validate_job
from .settings import ServiceSettings


def submit_job(kind: str, payload: dict[str, Any], settings: ServiceSettings, store: JobStore | None = None) -> str:
    """Validate a job, record it (locking its outputs) and queue its first task; returns the job id.

    Raises:
        ConfigError: the spec is invalid or names paths outside GPUFEED_ALLOWED_ROOTS.
        JobConflictError: another active job writes the same output.
        ServiceError: Redis cannot be reached.
    """
    from .app import app

    payload = validate_job(kind, payload, settings)
    store = store if store is not None else JobStore(settings)
    locks = sorted({lock_name(path) for path in job_paths(kind, payload)})
    job_id = store.create(kind, payload, locks, settings.queue)
    try:
        send_unit(app, store.require(job_id), first_unit(kind, payload))
    except Exception as exc:
        store.fail(job_id, f"could not queue the job: {exc}")
        raise ServiceError(f"could not queue job {job_id}: {exc}") from exc
    return job_id


def cancel_job(job_id: str, settings: ServiceSettings, store: JobStore | None = None) -> JobRecord:
    """Cancel a queued or running job: no more of its tasks start, and a cleanup task removes its partial output.

    Raises:
        ServiceError: the job is unknown, already finished, or writing its manifest.
    """
    from .app import app

    store = store if store is not None else JobStore(settings)
    record = store.require(job_id)
    outcome = store.cancel(job_id)
    if outcome == "finalizing":
        raise ServiceError(f"job {job_id} is writing its manifest and can no longer be cancelled")
    if outcome != "ok":
        raise ServiceError(f"job {job_id} is already {outcome or record.state}; there is nothing to cancel")
    record = store.require(job_id)
    send_unit(app, record, "cleanup")
    return record


def listening_workers(queue: str, timeout: float = 1.0) -> list[str] | None:
    """The workers consuming `queue` now, asked through the broker (they answer within `timeout` seconds).

    Returns:
        Their names (empty: no worker listens), or None when the broker could not be asked.
    """
    from .app import app

    try:
        replies = app.control.inspect(timeout=timeout).active_queues() or {}
    except Exception:  # an unreachable broker is reported by the job store's own calls
        return None
    return sorted(name for name, queues in replies.items() if any(q.get("name") == queue for q in queues or []))
