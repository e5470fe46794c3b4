"""Re-dispatch the work of dead workers, without waiting for the broker's visibility timeout.

Every running task refreshes a heartbeat in its job's `running` hash. Each
worker runs this watchdog on its timer; one at a time (a short Redis lock)
it looks at every active job and

1. re-sends each task whose heartbeat is older than GPUFEED_STALE_AFTER: its
   worker died (SIGKILL, lost machine) and Redis would only hand the message
   out again after the visibility timeout;
2. re-sends what a job still needs when nothing of it is running, nothing
   is queued and it has made no progress for GPUFEED_STALE_AFTER: a message
   lost between Redis and a dying worker, or a chord whose callback will not
   come. Missing shards are sent again, or the finalize when none is missing.

A second run of any task is harmless: shard tasks skip finished shards and
rewrite atomically, finalize is a no-op once the job succeeded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .dispatch import first_unit
from .jobs import ACTIVE, JobRecord, JobStore
from .settings import ServiceSettings

log = logging.getLogger(__name__)
QUEUE_PRIORITY_SEP = "\x06\x16"  # kombu's Redis transport: QUEUE, QUEUE\x06\x163, … per priority step
PRIORITY_STEPS = (3, 6, 9)


class Watchdog:
    """One worker's watchdog (see the module docstring).

    Args:
        settings: the service settings (staleness, intervals, key prefix).
        worker: this worker's name, held in the watchdog lock while it checks.
        send: queues one unit of a job again, `send(record, unit)` (the worker
            passes `worker.dispatch.send_unit` bound to its Celery app).
        store: the job store (default: one connected on first use).
    """

    def __init__(
        self,
        settings: ServiceSettings,
        worker: str,
        send: Callable[[JobRecord, str], None],
        store: JobStore | None = None,
    ) -> None:
        self.settings = settings
        self.worker = worker
        self.send = send
        self._store = store

    @property
    def store(self) -> JobStore:
        if self._store is None:  # created lazily: the worker forks its pool after this object exists
            self._store = JobStore(self.settings)
        return self._store

    def safe_tick(self) -> None:
        """A tick that never raises (it runs on the worker's timer): this machine's leftovers, then every job."""
        for step in (self.remove_finished_copies, self.tick):
            try:
                step()
            except Exception as exc:  # Redis away for a moment: try again next tick
                log.warning("gpufeed watchdog: %s", exc)

    def remove_finished_copies(self) -> list[str]:
        """Remove this machine's copies of the work files of jobs that are over (see `worker.staging`)."""
        from .staging import remove_finished_copies

        def is_over(job_id: str) -> bool:
            record = self.store.get(job_id)
            return record is None or record.state not in ACTIVE

        return remove_finished_copies(is_over)

    def tick(self) -> list[tuple[str, str]]:
        """Check every active job once; returns the (job, unit) pairs sent again."""
        lock = f"{self.settings.key_prefix}watchdog"
        hold_ms = max(100, int(self.settings.watchdog_interval_s * 900))
        if not self.store.client.set(lock, self.worker, nx=True, px=hold_ms):
            return []  # another worker's watchdog has this round
        sent: list[tuple[str, str]] = []
        now = self.store.now()
        for job_id in self.store.active_ids():
            record = self.store.get(job_id)
            if record is None or record.state not in ACTIVE:
                self.store.client.srem(self.store.active_key, job_id)
                continue
            sent += [(job_id, unit) for unit in self.check_job(record, now)]
        return sent

    def check_job(self, record: JobRecord, now: float) -> list[str]:
        stale = self.settings.stale_after_s
        sent = []
        live = False
        for unit, entry in record.running.items():
            if now - float(entry.get("beat", 0)) <= stale:
                live = True
            elif self.store.end_unit(record.id, unit, token=str(entry.get("token", "")), stale_only=True):
                log.warning("gpufeed watchdog: job %s %s on %s stopped beating; sending it again", record.id, unit, entry.get("worker"))
                sent.append(unit)
        if not live and not sent and now - (record.last_activity or record.created) > stale and self.queued(record.queue) == 0:
            sent += self.missing_units(record)
            if sent:
                log.warning("gpufeed watchdog: job %s made no progress and nothing is queued; sending %s", record.id, sent)
        for unit in sent:
            if unit != "cleanup":
                self.send(record, unit)
        if sent:
            self.store.client.hincrby(self.store.job_key(record.id), "redispatched", len(sent))
            self.store.update(record.id, last_activity=now)
        return sent

    def missing_units(self, record: JobRecord) -> list[str]:
        """What a job without running or queued tasks still needs."""
        start = first_unit(record.kind, record.payload)
        if start != "plan" or not record.prepare_spec or not record.shards_total:
            return [start]
        done = self.store.done_shards(record.id)
        missing = [f"shard:{i}" for i in range(record.shards_total) if i not in done]
        return missing or ["finalize"]

    def queued(self, queue: str) -> int:
        """Messages waiting in a queue (all priority lists)."""
        names = [queue] + [f"{queue}{QUEUE_PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]
        pipe: Any = self.store.client.pipeline()
        for name in names:
            pipe.llen(name)
        return int(sum(pipe.execute()))
