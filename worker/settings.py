"""Service settings: the only place in gpufeed's service that reads the environment.

Every knob has a default that suits a small cluster; tests and operators
override them through environment variables (durations accept `90`, `90s`,
`10m`, `6h`, `7d`):

| variable | default | meaning |
|---|---|---|
| GPUFEED_BROKER_URL | redis://localhost:6379/0 | Redis broker (a password goes in the URL: redis://:PASS@host:6379/0) |
| GPUFEED_RESULT_BACKEND | the broker URL | Celery result backend (chords need one) |
| GPUFEED_ALLOWED_ROOTS | (none: every job refused) | folders jobs may read and write, `:`-separated; URL prefixes (s3://bucket/x) `,`-separated |
| GPUFEED_QUEUE | gpufeed | queue jobs are sent to |
| GPUFEED_JOB_TTL | 7d | how long finished job records are kept |
| GPUFEED_SHARD_TIME_LIMIT | 1h | soft limit of one shard (or plan, finalize, reshard) task; the hard limit is 60 s more |
| GPUFEED_VISIBILITY_TIMEOUT | time limit + 10m | when Redis re-delivers an unacknowledged message |
| GPUFEED_HEARTBEAT_INTERVAL | 10s | how often running tasks refresh their heartbeat |
| GPUFEED_STALE_AFTER | 60s | a task whose heartbeat is older is presumed dead and re-dispatched |
| GPUFEED_WATCHDOG_INTERVAL | 15s | how often a worker looks for stale tasks |
| GPUFEED_BEAT_INTERVAL | 30s | longest sleep of `gpufeed beat` (new schedules are seen this fast) |
| GPUFEED_MAX_SPEC_BYTES | 64KiB | largest job spec accepted |
| GPUFEED_MAX_PIXELS | 89478485 | largest `--max-pixels` a job may ask for (decompression bombs) |
| GPUFEED_MAX_FILE_BYTES | 512MiB | largest input file a job may allow |
| GPUFEED_MAX_ATTEMPTS | 5 | a task started this often without finishing fails its job (e.g. a file that crashes the decoder); a task that hits a retryable error (StorageError) runs at most this often too |
| GPUFEED_RETRY_DELAY | 10s | first pause before a retryable error is tried again; it doubles each time, up to half of GPUFEED_STALE_AFTER |
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping

from pipeline.errors import ConfigError
from pipeline.io.fs import redact_url
from pipeline.measure.doctor import BROKER_URL_ENV, DEFAULT_BROKER_URL
from pipeline.specs import DEFAULT_MAX_PIXELS
from pipeline.units import parse_bytes, parse_duration

HARD_LIMIT_GRACE_S = 60
KEY_PREFIX = "gpufeed:"


@dataclasses.dataclass(frozen=True)
class ServiceSettings:
    """The service's configuration, validated; see the module docstring for the variables."""

    broker_url: str = DEFAULT_BROKER_URL
    result_backend: str = DEFAULT_BROKER_URL
    allowed_roots: tuple[str, ...] = ()
    queue: str = "gpufeed"
    job_ttl_s: float = 7 * 86400
    shard_time_limit_s: float = 3600
    visibility_timeout_s: float = 3600 + HARD_LIMIT_GRACE_S + 600
    heartbeat_interval_s: float = 10
    stale_after_s: float = 60
    watchdog_interval_s: float = 15
    beat_interval_s: float = 30
    max_spec_bytes: int = 64 * 1024
    max_attempts: int = 5
    retry_delay_s: float = 10
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = 512 * 1024 * 1024
    key_prefix: str = KEY_PREFIX

    def __post_init__(self) -> None:
        for name in ("broker_url", "result_backend"):
            if not getattr(self, name).startswith(("redis://", "rediss://", "unix://")):
                raise ConfigError(f"{name} must be a redis:// URL, got {redact_url(getattr(self, name))!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.queue):
            raise ConfigError(f"GPUFEED_QUEUE must be a simple name, got {self.queue!r}")
        if self.visibility_timeout_s <= self.hard_time_limit_s:
            raise ConfigError(
                f"GPUFEED_VISIBILITY_TIMEOUT ({self.visibility_timeout_s:.0f} s) must be longer than the slowest "
                f"task may run ({self.hard_time_limit_s:.0f} s), or Redis would hand running tasks to a second worker"
            )
        if self.heartbeat_interval_s * 2 > self.stale_after_s:
            raise ConfigError(
                f"GPUFEED_STALE_AFTER ({self.stale_after_s:g} s) must be at least twice "
                f"GPUFEED_HEARTBEAT_INTERVAL ({self.heartbeat_interval_s:g} s)"
            )

    @property
    def hard_time_limit_s(self) -> float:
        return self.shard_time_limit_s + HARD_LIMIT_GRACE_S


def _roots(text: str) -> tuple[str, ...]:
    """`/data:/shards` or `/data,s3://bucket/prefix`: commas always separate, colons only between paths."""
    roots: list[str] = []
    for piece in text.split(","):
        parts = [piece] if "://" in piece else piece.split(":")
        roots += [part.strip() for part in parts if part.strip()]
    return tuple(roots)


def settings_from_env(env: Mapping[str, str]) -> ServiceSettings:
    """Build settings from an environment mapping (os.environ in production)."""
    broker = env.get(BROKER_URL_ENV) or DEFAULT_BROKER_URL
    limit = parse_duration(env.get("GPUFEED_SHARD_TIME_LIMIT", "1h"), "GPUFEED_SHARD_TIME_LIMIT")
    visibility = env.get("GPUFEED_VISIBILITY_TIMEOUT")
    return ServiceSettings(
        broker_url=broker,
        result_backend=env.get("GPUFEED_RESULT_BACKEND") or broker,
        allowed_roots=_roots(env.get("GPUFEED_ALLOWED_ROOTS", "")),
        queue=env.get("GPUFEED_QUEUE") or "gpufeed",
        job_ttl_s=parse_duration(env.get("GPUFEED_JOB_TTL", "7d"), "GPUFEED_JOB_TTL"),
        shard_time_limit_s=limit,
        visibility_timeout_s=(
            parse_duration(visibility, "GPUFEED_VISIBILITY_TIMEOUT") if visibility else limit + HARD_LIMIT_GRACE_S + 600
        ),
        heartbeat_interval_s=parse_duration(env.get("GPUFEED_HEARTBEAT_INTERVAL", "10s"), "GPUFEED_HEARTBEAT_INTERVAL"),
        stale_after_s=parse_duration(env.get("GPUFEED_STALE_AFTER", "60s"), "GPUFEED_STALE_AFTER"),
        watchdog_interval_s=parse_duration(env.get("GPUFEED_WATCHDOG_INTERVAL", "15s"), "GPUFEED_WATCHDOG_INTERVAL"),
        beat_interval_s=parse_duration(env.get("GPUFEED_BEAT_INTERVAL", "30s"), "GPUFEED_BEAT_INTERVAL"),
        max_spec_bytes=parse_bytes(env.get("GPUFEED_MAX_SPEC_BYTES", "64KiB")),
        max_attempts=_parse_count(env.get("GPUFEED_MAX_ATTEMPTS", "5"), "GPUFEED_MAX_ATTEMPTS"),
        retry_delay_s=parse_duration(env.get("GPUFEED_RETRY_DELAY", "10s"), "GPUFEED_RETRY_DELAY"),
        max_pixels=_parse_count(env.get("GPUFEED_MAX_PIXELS", str(DEFAULT_MAX_PIXELS)), "GPUFEED_MAX_PIXELS"),
        max_file_bytes=parse_bytes(env.get("GPUFEED_MAX_FILE_BYTES", "512MiB")),
    )


def _parse_count(text: str, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, got {text!r}") from None
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")
    return value


@functools.lru_cache(maxsize=1)
def get_settings() -> ServiceSettings:
    """The settings of this process, read from the environment once."""
    return settings_from_env(os.environ)
