"""Recurring jobs (e.g. a nightly reshard), stored in Redis with celery-redbeat.

A schedule is a redbeat entry whose task, `gpufeed.run_schedule`, submits an
ordinary job when it fires, so every run shows up in `gpufeed jobs`. The
schedule lives in Redis, not in a beat process's file, so any number of
`gpufeed beat` processes may run (redbeat's lock lets one of them tick) and
`gpufeed schedule add|list|remove` work from any machine.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from typing import Any

from pipeline.errors import ConfigError
from pipeline.units import parse_duration

from .jobs import ServiceError
from .settings import ServiceSettings

RUN_TASK = "gpufeed.run_schedule"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclasses.dataclass
class ScheduleInfo:
    """One schedule as `gpufeed schedule list` shows it."""

    name: str
    when: str
    kind: str
    spec: dict[str, Any]
    next_run: str | None
    last_run: str | None
    runs: int
    last_job: str | None = None
    last_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_schedule(every: str | None, cron: str | None) -> Any:
    """A Celery schedule from `--every 6h` or `--cron "0 3 * * *"` (minute hour day-of-month month day-of-week, UTC).

    Raises:
        ConfigError: neither or both given, or not a valid interval / crontab.
    """
    from celery.schedules import crontab, schedule

    if (every is None) == (cron is None):
        raise ConfigError("give exactly one of --every (e.g. 6h) or --cron (e.g. '0 3 * * *')")
    if every is not None:
        return schedule(run_every=datetime.timedelta(seconds=parse_duration(every, "--every")))
    fields = str(cron).split()
    if len(fields) != 5:
        raise ConfigError(f"--cron needs five fields (minute hour day-of-month month day-of-week), got {cron!r}")
    minute, hour, day_of_month, month, day_of_week = fields
    try:
        return crontab(minute=minute, hour=hour, day_of_month=day_of_month, month_of_year=month, day_of_week=day_of_week)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"--cron {cron!r} is not a valid crontab: {exc}") from exc


def describe(schedule: Any) -> str:
    from celery.schedules import crontab

    if isinstance(schedule, crontab):
        parts = (schedule._orig_minute, schedule._orig_hour, schedule._orig_day_of_month, schedule._orig_month_of_year, schedule._orig_day_of_week)
        return "cron " + " ".join(str(p) for p in parts) + " (UTC)"
    seconds = schedule.run_every.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"every {seconds / size:g}{unit}"
    return f"every {seconds:g}s"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"schedule name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
    return name


def _entry_key(app: Any, name: str) -> str:
    from redbeat.schedulers import RedBeatSchedulerEntry, ensure_conf

    ensure_conf(app)
    return str(RedBeatSchedulerEntry.generate_key(app, name))


def add_schedule(
    app: Any, settings: ServiceSettings, name: str, kind: str, payload: dict[str, Any], *, every: str | None, cron: str | None
) -> ScheduleInfo:
    """Store a schedule that submits `kind` with `payload` (already validated) when it fires.

    Raises:
        ConfigError: bad name or timing, or a schedule of that name exists.
    """
    from redbeat.schedulers import RedBeatSchedulerEntry, get_redis

    check_name(name)
    when = make_schedule(every, cron)
    key = _entry_key(app, name)
    if get_redis(app).exists(key):
        raise ConfigError(f"a schedule named {name!r} exists; remove it first (gpufeed schedule remove {name})")
    entry = RedBeatSchedulerEntry(
        name, RUN_TASK, when, args=[name, kind, payload], options={"queue": settings.queue}, app=app
    )
    entry.last_run_at = app.now()  # the first run comes one interval from now, not at once
    entry.save()
    return _info(app, settings, RedBeatSchedulerEntry.from_key(key, app=app))


def list_schedules(app: Any, settings: ServiceSettings) -> list[ScheduleInfo]:
    from redbeat.schedulers import RedBeatSchedulerEntry, get_redis

    _entry_key(app, "x")  # sets app.redbeat_conf
    keys = get_redis(app).zrange(app.redbeat_conf.schedule_key, 0, -1)
    infos = []
    for key in keys:
        try:
            entry = RedBeatSchedulerEntry.from_key(key, app=app)
        except KeyError:
            continue
        if entry.task == RUN_TASK:
            infos.append(_info(app, settings, entry))
    return sorted(infos, key=lambda info: info.name)


def remove_schedule(app: Any, settings: ServiceSettings, name: str) -> None:
    """Delete a schedule (jobs it already submitted are not touched).

    Raises:
        ServiceError: no schedule has that name.
    """
    from redbeat.schedulers import RedBeatSchedulerEntry

    key = _entry_key(app, check_name(name))
    try:
        entry = RedBeatSchedulerEntry.from_key(key, app=app)
    except KeyError:
        raise ServiceError(f"no schedule named {name!r}; see gpufeed schedule list") from None
    entry.delete()
    _runs_client(app).delete(_runs_key(settings, name))


def record_schedule_run(client: Any, settings: ServiceSettings, name: str, *, job: str | None = None, error: str | None = None) -> None:
    """Remember the last job a schedule submitted (or why it did not)."""
    client.hset(_runs_key(settings, name), mapping={"job": job or "", "error": error or ""})


def _runs_key(settings: ServiceSettings, name: str) -> str:
    return f"{settings.key_prefix}schedule-runs:{name}"


def _runs_client(app: Any) -> Any:
    from redbeat.schedulers import get_redis

    return get_redis(app)


def _iso(value: Any) -> str | None:
    if not isinstance(value, datetime.datetime):
        return None
    rounded = (value + datetime.timedelta(microseconds=500_000)).replace(microsecond=0)  # Celery's estimate is off by microseconds
    return rounded.isoformat()


def _next_run(app: Any, entry: Any) -> datetime.datetime | None:
    # redbeat's due_at adds "time left from now" to the last run; this is the moment itself.
    if entry.last_run_at is None:
        return app.now()
    remaining = entry.schedule.remaining_estimate(entry.last_run_at)
    if remaining is None:
        return None
    return app.now() + max(remaining, datetime.timedelta(0))


def _info(app: Any, settings: ServiceSettings, entry: Any) -> ScheduleInfo:
    _name, kind, payload = entry.args
    runs = _runs_client(app).hgetall(_runs_key(settings, entry.name)) or {}
    return ScheduleInfo(
        name=entry.name,
        when=describe(entry.schedule),
        kind=kind,
        spec=json.loads(json.dumps(payload)),
        next_run=_iso(_next_run(app, entry)),
        last_run=_iso(entry.last_run_at),
        runs=int(getattr(entry, "total_run_count", 0) or 0),
        last_job=runs.get("job") or None,
        last_error=runs.get("error") or None,
    )
