"""A task's unit of a job while it runs: registered in the job's `running` hash, kept alive by a heartbeat.

The watchdog judges a unit by its heartbeat (`worker/watchdog.py`); a cancel
reaches a running unit through it and through `UnitRun.check()` between its
phases. The records themselves are `worker/jobs.py`'s.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Any

from .jobs import ACTIVE, JobStopped, JobStore

log = logging.getLogger(__name__)


def worker_name() -> str:
    """This task's worker (celery -n name), else host:pid."""
    try:
        from celery import current_task

        hostname = current_task.request.hostname if current_task else None
    except Exception:  # pragma: no cover - outside a task
        hostname = None
    return hostname or f"{socket.gethostname()}:{os.getpid()}"


class UnitRun:
    """A task's registration in its job's `running` hash, with a heartbeat thread.

    Entering registers the task (`status` says whether to go on: "ok", or
    "busy" when a live duplicate already runs it, or "inactive" when the job
    was cancelled or finished). While it runs, a thread refreshes the
    heartbeat and notices cancellation; `check()` (and `progress`) then raise
    JobStopped. Leaving removes the registration.
    """

    def __init__(self, store: JobStore, job_id: str, unit: str, task_id: str | None = None) -> None:
        self.store = store
        self.job_id = job_id
        self.unit = unit
        self.token = uuid.uuid4().hex
        self.entry: dict[str, Any] = {"worker": worker_name(), "pid": os.getpid(), "task": task_id or ""}
        self.done = 0
        self.status = ""
        self.stopped_state = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> UnitRun:
        self.status = self.store.begin_unit(self.job_id, self.unit, self.entry, self.token)
        if self.status == "ok":
            self._thread = threading.Thread(target=self._run, name=f"gpufeed-heartbeat-{self.unit}", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        interval = self.store.settings.heartbeat_interval_s
        while not self._stop.wait(interval):
            try:
                state = self.store.beat(self.job_id, self.unit, self.token, self.done, self.entry)
            except Exception as exc:  # Redis away: keep working, the watchdog judges by the heartbeat
                log.warning("heartbeat of job %s %s failed: %s", self.job_id, self.unit, exc)
                continue
            if state not in ACTIVE:
                self.stopped_state = state or "gone"

    def check(self) -> None:
        """Raise JobStopped when the job is no longer active: a cancel stops the task here, between its phases.

        The heartbeat thread notices a cancel only every heartbeat interval; so
        that a cancelled job's shards stop at their next chunk of images instead
        of going on to completion, the job's state is also read here (one HGET
        per chunk: nothing beside decoding the chunk).
        """
        if not self.stopped_state:
            try:
                state = self.store.client.hget(self.store.job_key(self.job_id), "state")
            except Exception as exc:  # Redis away: the heartbeat decides, as before
                log.warning("could not read the state of job %s: %s", self.job_id, exc)
            else:
                if state not in ACTIVE:
                    self.stopped_state = state or "gone"
        if self.stopped_state:
            raise JobStopped(self.stopped_state)

    def progress(self, state: Any) -> None:
        """A prepare progress callback: records images done, stops a cancelled job."""
        self.done = int(getattr(state, "done", 0))
        self.check()

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.status == "ok":
            try:
                self.store.end_unit(self.job_id, self.unit, self.token)
            except Exception as exc:  # the entry goes stale and the watchdog clears it
                log.warning("could not unregister job %s %s: %s", self.job_id, self.unit, exc)
