"""The Celery application: `celery -A worker.app worker` (or `gpufeed worker`).

Configuration comes from `worker.settings` only. Reliability choices, each
for a reason:

- JSON is the only accepted content type: a pickle message could run code on
  the worker while it is being decoded, so it is refused before decoding.
- `task_acks_late` + `task_reject_on_worker_lost`: a message is acknowledged
  only after its task finished, and handed out again when the process
  running it dies; shard tasks are idempotent, so a second run is harmless.
- `worker_prefetch_multiplier = 1`: a worker holds no more messages than it
  runs, so a dead worker strands none and long tasks spread evenly.
- The broker's visibility timeout is longer than the hard time limit of any
  task, so Redis never hands a running task to a second worker by itself;
  the watchdog (heartbeats, `worker.watchdog`) recovers from dead workers
  within GPUFEED_STALE_AFTER instead.
"""

from __future__ import annotations

import functools
from typing import Any

from celery import Celery, bootsteps

from .dispatch import send_unit
from .settings import ServiceSettings, get_settings


def celery_config(settings: ServiceSettings) -> dict[str, Any]:
    """The Celery settings for `settings` (kept as data so tests can check them)."""
    transport = {
        "visibility_timeout": int(settings.visibility_timeout_s),
        "socket_connect_timeout": 5,
        "socket_timeout": 30,
        "health_check_interval": 15,
    }
    return {
        "broker_url": settings.broker_url,
        "result_backend": settings.result_backend,
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "broker_transport_options": transport,
        "result_backend_transport_options": {"visibility_timeout": int(settings.visibility_timeout_s)},
        "task_soft_time_limit": int(settings.shard_time_limit_s),
        "task_time_limit": int(settings.hard_time_limit_s),
        "task_default_queue": settings.queue,
        "task_track_started": True,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "result_backend_always_retry": True,
        "result_backend_max_retries": 20,
        "result_expires": int(settings.job_ttl_s),
        "enable_utc": True,
        "timezone": "UTC",
        "beat_scheduler": "redbeat.RedBeatScheduler",
        "beat_max_loop_interval": settings.beat_interval_s,
        "redbeat_redis_url": settings.broker_url,
        "redbeat_redis_options": {"retry_period": 120},
        "redbeat_key_prefix": f"{settings.key_prefix}schedule:",
        "redbeat_lock_timeout": max(30, int(settings.beat_interval_s * 5)),
    }


class WatchdogStep(bootsteps.StartStopStep):
    """Runs the watchdog on the worker's timer (in the main process, between other work)."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None

    def start(self, worker: Any) -> None:
        from .watchdog import Watchdog

        settings = get_settings()
        watchdog = Watchdog(settings, worker.hostname, functools.partial(send_unit, worker.app))
        self.tref = worker.timer.call_repeatedly(settings.watchdog_interval_s, watchdog.safe_tick, priority=10)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None


def make_app(settings: ServiceSettings) -> Celery:
    celery_app = Celery("gpufeed", include=["worker.tasks"])
    celery_app.conf.update(celery_config(settings))
    celery_app.steps["worker"].add(WatchdogStep)
    return celery_app


app = make_app(get_settings())
