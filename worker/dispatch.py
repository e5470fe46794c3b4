"""The units a job runs as, and the Celery message that runs each one.

A job runs as units: `plan` (list and plan a prepare, then fan out one
`shard:N` task per shard in a chord whose callback is `finalize`),
`reshard` (a re-pack in one task), `bench` (a disk benchmark) and `cleanup`
(after a cancel). Any unit can be sent again: every task is idempotent.

This module imports no Celery app: the sender is given the app, so the
client, the watchdog and the app itself can all use it.
"""

from __future__ import annotations

from typing import Any

from .jobs import JobRecord

TASK_NAMES = {
    "plan": "gpufeed.plan_prepare",
    "shard": "gpufeed.write_prepare_shard",
    "finalize": "gpufeed.finalize_prepare",
    "reshard": "gpufeed.repack_dataset",
    "bench": "gpufeed.benchmark_disk",
    "cleanup": "gpufeed.cleanup_job",
}


def first_unit(kind: str, payload: dict[str, Any]) -> str:
    """The unit a job of `kind` starts with."""
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


def send_unit(app: Any, record: JobRecord, unit: str) -> None:
    """Queue one unit of a job on the job's queue, through the Celery `app`."""
    name, args = task_message(record, unit)
    app.send_task(name, args=args, queue=record.queue)
