"""Job records, progress, heartbeats and output locks, kept in Redis.

A job is a hash `gpufeed:job:ID` (spec, state, counters, timestamps, error)
plus two side hashes: `…:shards` (one entry per finished shard, first writer
wins, so a duplicate run never counts twice) and `…:running` (one entry per
task running for the job, refreshed by its heartbeat). Every state change is
a small Lua script, so concurrent workers, the watchdog and `gpufeed cancel`
never overwrite each other's decisions; timestamps used to judge staleness
come from the Redis server's clock, not the machines'. Finished jobs expire
after GPUFEED_JOB_TTL. An output path is locked (`gpufeed:lock:PATH`) by the
job writing it, so two jobs never write the same OUT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

from pipeline.errors import GpufeedError, JobConflictError
from pipeline.redact import redact_url, redact_urls, redact_value

from .settings import ServiceSettings

log = logging.getLogger(__name__)

STATES = ("queued", "running", "succeeded", "failed", "cancelled")
ACTIVE = ("queued", "running")
FINAL = ("succeeded", "failed", "cancelled")


class ServiceError(GpufeedError):
    """The service cannot be reached or refused a request (Redis down, wrong password, unknown job)."""


class JobStopped(Exception):
    """Raised inside a running task when its job was cancelled or failed elsewhere."""


# Lua scripts. `now()` is the Redis server's clock, shared by every machine.
_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) + tonumber(t[2]) / 1e6 "

_CREATE = """
for i = 4, #KEYS do
  local holder = redis.call('GET', KEYS[i])
  if holder and holder ~= ARGV[1] then
    local other = ARGV[3] .. holder
    local state = redis.call('HGET', other, 'state')
    local cleaned = redis.call('HGET', other, 'cleaned')
    if state == 'queued' or state == 'running' or (state == 'cancelled' and cleaned ~= '1') then
      return holder
    end
  end
end
for i = 4, #KEYS do redis.call('SET', KEYS[i], ARGV[1]) end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
return false
"""

# KEYS: job, shards, running, active, locks...; ARGV: new state, allowed (comma list), ttl ('' = not final),
# job id, release locks ('1'/'0'), field/value pairs...
_TRANSITION = (
    _NOW
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {0, ''} end
local allowed = false
for s in string.gmatch(ARGV[2], '[^,]+') do if s == state then allowed = true end end
if not allowed then return {0, state} end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'last_activity', now, unpack(ARGV, 6))
if ARGV[1] == 'running' and not redis.call('HGET', KEYS[1], 'started') then
  redis.call('HSET', KEYS[1], 'started', now)
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'finished', now)
  for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
  redis.call('SREM', KEYS[4], ARGV[4])
end
if ARGV[5] == '1' then
  for i = 5, #KEYS do
    if redis.call('GET', KEYS[i]) == ARGV[4] then redis.call('DEL', KEYS[i]) end
  end
end
return {1, state}
"""
)

# KEYS: job, running; ARGV: unit, entry json (without beat), stale seconds, token
_BEGIN = (
    _NOW
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'running' then return {'inactive', state or ''} end
local current = redis.call('HGET', KEYS[2], ARGV[1])
if current then
  local other = cjson.decode(current)
  if other.token ~= ARGV[4] and now - tonumber(other.beat) < tonumber(ARGV[3]) then return {'busy', state} end
end
local entry = cjson.decode(ARGV[2])
entry.beat = now
entry.started = now
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(entry))
redis.call('HSET', KEYS[1], 'last_activity', now)
return {'ok', state}
"""
)

# KEYS: job, running; ARGV: unit, token, done, entry json (to re-register a removed entry)
_BEAT = (
    _NOW
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'running' then return state or '' end
local current = redis.call('HGET', KEYS[2], ARGV[1])
local entry
if current then
  entry = cjson.decode(current)
  if entry.token ~= ARGV[2] then return state end
else
  entry = cjson.decode(ARGV[4])
  entry.started = now
end
entry.beat = now
entry.done = tonumber(ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(entry))
return state
"""
)

# KEYS: running; ARGV: unit, token ('' = any), stale seconds ('' = regardless of age)
_END = (
    _NOW
    + """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current then return 0 end
local entry = cjson.decode(current)
if ARGV[2] ~= '' and entry.token ~= ARGV[2] then return 0 end
if ARGV[3] ~= '' and now - tonumber(entry.beat) < tonumber(ARGV[3]) then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""
)

# KEYS: job, shards; ARGV: shard, record json, samples, rejected, processed, worker
_RECORD_SHARD = (
    _NOW
    + """
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return {0, 0, 0} end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'shards_done', 1)
  redis.call('HINCRBY', KEYS[1], 'samples', ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'rejected', ARGV[4])
  redis.call('HINCRBY', KEYS[1], 'processed', ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'worker:' .. ARGV[6], 1)
end
redis.call('HSET', KEYS[1], 'last_activity', now)
return {1, tonumber(redis.call('HGET', KEYS[1], 'shards_done') or '0'),
        tonumber(redis.call('HGET', KEYS[1], 'shards_total') or '0')}
"""
)

# KEYS: job, shards, running, active; ARGV: job id, ttl. A job writing its manifest can no longer be cancelled.
_CANCEL = (
    _NOW
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'running' then return state or '' end
if redis.call('HGET', KEYS[1], 'finalizing') == '1' then return 'finalizing' end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished', now, 'last_activity', now, 'error', 'cancelled on request')
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
redis.call('SREM', KEYS[4], ARGV[1])
return 'ok'
"""
)

_COUNTERS = ("shards_total", "shards_done", "samples", "rejected", "processed", "listed", "redispatched")


def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="seconds")


@dataclasses.dataclass
class JobRecord:
    """One job as stored in Redis."""

    id: str
    kind: str
    state: str
    payload: dict[str, Any]
    queue: str
    created: float
    started: float | None = None
    finished: float | None = None
    last_activity: float | None = None
    shards_total: int = 0
    shards_done: int = 0
    samples: int = 0
    rejected: int = 0
    processed: int = 0
    listed: int = 0
    redispatched: int = 0
    error: str = ""
    result: dict[str, Any] | None = None
    prepare_spec: dict[str, Any] | None = None
    workers: dict[str, int] = dataclasses.field(default_factory=dict)
    running: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    cleaned: bool = False
    finalizing: bool = False
    locks: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_hash(cls, job_id: str, data: dict[str, str], running: dict[str, str]) -> JobRecord:
        def number(name: str) -> float | None:
            return float(data[name]) if data.get(name) not in (None, "") else None

        record = cls(
            id=job_id,
            kind=data.get("kind", "?"),
            state=data.get("state", "?"),
            payload=json.loads(data.get("payload") or "{}"),
            queue=data.get("queue", ""),
            created=number("created") or 0.0,
            started=number("started"),
            finished=number("finished"),
            last_activity=number("last_activity"),
            error=data.get("error", ""),
            result=json.loads(data["result"]) if data.get("result") else None,
            prepare_spec=json.loads(data["prepare_spec"]) if data.get("prepare_spec") else None,
            cleaned=data.get("cleaned") == "1",
            finalizing=data.get("finalizing") == "1",
            locks=json.loads(data.get("locks") or "[]"),
            warnings=json.loads(data.get("warnings") or "[]"),
        )
        for name in _COUNTERS:
            setattr(record, name, int(float(data.get(name) or 0)))
        record.workers = {k[len("worker:") :]: int(v) for k, v in data.items() if k.startswith("worker:")}
        record.running = {unit: json.loads(entry) for unit, entry in running.items()}
        return record

    @property
    def in_flight(self) -> int:
        """Images done inside shards that are still being written."""
        return sum(int(entry.get("done") or 0) for entry in self.running.values())

    def images_per_s(self, now: float | None = None) -> float:
        if self.started is None:
            return 0.0
        end = self.finished if self.finished is not None else (now if now is not None else time.time())
        seconds = max(end - self.started, 1e-6)
        return (self.processed + (0 if self.finished else self.in_flight)) / seconds

    @property
    def out(self) -> str | None:
        spec = self.payload.get("spec") or {}
        return spec.get("out") or spec.get("dataset") or self.payload.get("path")

    def to_status(self, now: float | None = None) -> dict[str, Any]:
        """The `gpufeed status --json` document."""
        now = time.time() if now is None else now
        spec = self.payload.get("spec") or {}
        end = self.finished if self.finished is not None else now
        return {
            "job": self.id,
            "kind": self.kind,
            "state": self.state,
            "shards_done": self.shards_done,
            "shards_total": self.shards_total,
            "samples": self.samples,
            "rejected": self.rejected,
            "decoded_with_warnings": int((self.result or {}).get("decoded_with_warnings") or 0),
            "listed": self.listed,
            "images_per_s": round(self.images_per_s(now), 2),
            "error": self.error or None,
            "source": spec.get("source") or spec.get("dataset") or self.payload.get("path"),
            "out": self.out,
            "created": _iso(self.created),
            "started": _iso(self.started),
            "finished": _iso(self.finished),
            "seconds": round(end - self.started, 3) if self.started is not None else None,
            "workers": self.workers,
            "running": [
                {"task": unit, "worker": entry.get("worker"), "images_done": entry.get("done", 0)}
                for unit, entry in sorted(self.running.items())
            ],
            "redispatched": self.redispatched,
            "warnings": self.warnings,
            "result": self.result,
            "spec": self.payload,
        }


def connect(settings: ServiceSettings, *, patient: bool = False) -> Any:
    """A redis client for the broker URL (password and db from the URL).

    `patient` clients (in workers) retry for about half a minute, so a Redis
    restart does not fail the task that happens to be talking to it.
    """
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retries = 12 if patient else 1
    return redis.Redis.from_url(
        settings.broker_url,
        decode_responses=True,
        socket_connect_timeout=5,
        socket_timeout=30,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=4.0, base=0.25), retries),
        retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError],
    )


@contextlib.contextmanager
def redis_errors(settings: ServiceSettings) -> Iterator[None]:
    """Turn redis-py errors into a ServiceError that says what to check."""
    import redis

    where = redact_url(settings.broker_url)
    try:
        yield
    except redis.exceptions.AuthenticationError as exc:
        raise ServiceError(f"Redis at {where} refused the credentials ({exc}); put the password in GPUFEED_BROKER_URL") from exc
    except redis.exceptions.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise ServiceError(f"Redis at {where} needs a password; put it in GPUFEED_BROKER_URL (redis://:PASSWORD@host:port/0)") from exc
        raise ServiceError(f"Redis at {where} refused a request: {exc}") from exc
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise ServiceError(f"cannot reach Redis at {where} ({exc}); start it or set GPUFEED_BROKER_URL") from exc


class JobStore:
    """Reads and writes job records; every method is one or two round trips."""

    def __init__(self, settings: ServiceSettings, client: Any = None, *, patient: bool = False) -> None:
        self.settings = settings
        self.client = client if client is not None else connect(settings, patient=patient)
        self.prefix = settings.key_prefix
        self._create = self.client.register_script(_CREATE)
        self._transition = self.client.register_script(_TRANSITION)
        self._begin = self.client.register_script(_BEGIN)
        self._beat = self.client.register_script(_BEAT)
        self._end = self.client.register_script(_END)
        self._record_shard = self.client.register_script(_RECORD_SHARD)
        self._cancel = self.client.register_script(_CANCEL)

    # -- keys
    def job_key(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}"

    def _keys(self, job_id: str) -> list[str]:
        base = self.job_key(job_id)
        return [base, f"{base}:shards", f"{base}:running", f"{self.prefix}jobs:active"]

    def lock_key(self, name: str) -> str:
        return f"{self.prefix}lock:{name}"

    @property
    def index_key(self) -> str:
        return f"{self.prefix}jobs"

    @property
    def active_key(self) -> str:
        return f"{self.prefix}jobs:active"

    def now(self) -> float:
        seconds, micros = self.client.time()
        return float(seconds) + float(micros) / 1e6

    # -- creating and reading
    def create(self, kind: str, payload: dict[str, Any], locks: list[str], queue: str) -> str:
        """Store a new queued job and lock its outputs; returns the job id.

        Raises:
            JobConflictError: another active job holds one of the outputs.
        """
        job_id = uuid.uuid4().hex[:12]
        created = time.time()
        fields = {
            "kind": kind,
            "state": "queued",
            "payload": json.dumps(payload, sort_keys=True),
            "queue": queue,
            "created": repr(created),
            "locks": json.dumps(locks),
            **{name: "0" for name in _COUNTERS},
        }
        keys = [self.job_key(job_id), self.index_key, self.active_key] + [self.lock_key(name) for name in locks]
        args = [job_id, repr(created), f"{self.prefix}job:"] + [part for item in fields.items() for part in item]
        holder = self._create(keys=keys, args=args)
        if holder:
            other = self.get(holder)
            state = other.state if other else "active"
            raise JobConflictError(
                f"{', '.join(locks)} is being written by job {holder} ({state}); "
                f"wait for it (gpufeed status {holder}) or cancel it (gpufeed cancel {holder})"
            )
        return job_id

    def get(self, job_id: str) -> JobRecord | None:
        pipe = self.client.pipeline()
        pipe.hgetall(self.job_key(job_id))
        pipe.hgetall(f"{self.job_key(job_id)}:running")
        data, running = pipe.execute()
        if not data:
            return None
        return JobRecord.from_hash(job_id, data, running)

    def require(self, job_id: str) -> JobRecord:
        record = self.get(job_id)
        if record is None:
            raise ServiceError(f"no job {job_id!r} (finished jobs are forgotten after GPUFEED_JOB_TTL); see gpufeed jobs")
        return record

    def resolve(self, job: str) -> str:
        """The id of the job that `job` names: its id, or the start of exactly one job's id.

        Raises:
            ServiceError: no job's id starts so, or several do (they are listed).
        """
        job = job.strip().lower()
        if job and self.client.exists(self.job_key(job)):
            return job
        if not job or any(char not in "0123456789abcdef" for char in job):  # ids are hex: nothing to match
            self.require(job)
        base = self.job_key("")
        pattern = f"{self.job_key(job)}*"
        matches = sorted({key[len(base) :] for key in self.client.scan_iter(match=pattern, count=1000)} - {""})
        matches = [match for match in matches if ":" not in match]  # a job's :shards and :running keys
        if len(matches) == 1:
            return matches[0]
        if not matches:
            self.require(job)
        shown = ", ".join(matches[:10]) + (f" and {len(matches) - 10} more" if len(matches) > 10 else "")
        raise ServiceError(f"{job!r} is the start of {len(matches)} job ids: {shown}; give more of the id")

    def list_jobs(self, limit: int = 50) -> list[JobRecord]:
        ids = self.client.zrevrange(self.index_key, 0, limit - 1)
        records = []
        for job_id in ids:
            record = self.get(job_id)
            if record is None:
                self.client.zrem(self.index_key, job_id)  # expired
            else:
                records.append(record)
        return records

    def active_ids(self) -> list[str]:
        return sorted(self.client.smembers(self.active_key))

    def update(self, job_id: str, **fields: Any) -> None:
        self.client.hset(self.job_key(job_id), mapping={k: _field(v) for k, v in fields.items()})

    def set_if_absent(self, job_id: str, name: str, value: Any) -> Any:
        """Store a field once; returns the stored value (the earlier one if it existed)."""
        key = self.job_key(job_id)
        self.client.hsetnx(key, name, _field(value))
        return self.client.hget(key, name)

    # -- state changes
    def transition(self, job_id: str, new: str, allowed: tuple[str, ...], **fields: Any) -> bool:
        """Move to `new` if the job is in one of `allowed`; finishing releases locks and sets the expiry."""
        final = new in FINAL
        record_locks = json.loads(self.client.hget(self.job_key(job_id), "locks") or "[]")
        release = final and new != "cancelled"  # a cancelled job keeps its locks until its files are gone
        keys = self._keys(job_id) + [self.lock_key(name) for name in record_locks]
        args = [new, ",".join(allowed), str(int(self.settings.job_ttl_s)) if final else "", job_id, "1" if release else "0"]
        args += [part for name, value in fields.items() for part in (name, _field(value))]
        ok, _previous = self._transition(keys=keys, args=args)
        return bool(ok)

    def release_locks(self, job_id: str) -> None:
        record_locks = json.loads(self.client.hget(self.job_key(job_id), "locks") or "[]")
        keys = self._keys(job_id) + [self.lock_key(name) for name in record_locks]
        state = self.client.hget(self.job_key(job_id), "state") or ""
        self._transition(keys=keys, args=[state, state, "", job_id, "1", "cleaned", "1"])

    def cancel(self, job_id: str) -> str:
        """Mark a queued or running job cancelled; returns 'ok', or why not (its state, or 'finalizing')."""
        return str(self._cancel(keys=self._keys(job_id), args=[job_id, str(int(self.settings.job_ttl_s))]))

    def count_attempt(self, job_id: str, unit: str) -> int:
        return int(self.client.hincrby(self.job_key(job_id), f"attempts:{unit}", 1))

    def fail(self, job_id: str, error: str) -> bool:
        return self.transition(job_id, "failed", ACTIVE, error=redact_urls(error)[:4000])

    # -- running tasks
    def begin_unit(self, job_id: str, unit: str, entry: dict[str, Any], token: str) -> str:
        """Register a running task; 'ok', 'busy' (a live run exists) or 'inactive' (job not active)."""
        keys = [self.job_key(job_id), f"{self.job_key(job_id)}:running"]
        status, _state = self._begin(keys=keys, args=[unit, json.dumps({**entry, "token": token}), self.settings.stale_after_s, token])
        return str(status)

    def beat(self, job_id: str, unit: str, token: str, done: int, entry: dict[str, Any]) -> str:
        keys = [self.job_key(job_id), f"{self.job_key(job_id)}:running"]
        return str(self._beat(keys=keys, args=[unit, token, done, json.dumps({**entry, "token": token})]))

    def end_unit(self, job_id: str, unit: str, token: str = "", stale_only: bool = False) -> bool:
        stale = str(self.settings.stale_after_s) if stale_only else ""
        return bool(self._end(keys=[f"{self.job_key(job_id)}:running"], args=[unit, token, stale]))

    def record_shard(
        self, job_id: str, shard: int, samples: int, rejected: int, processed: int, worker: str
    ) -> tuple[bool, int, int]:
        """Count a finished shard once; returns (counted, shards done, shards total)."""
        keys = [self.job_key(job_id), f"{self.job_key(job_id)}:shards"]
        record = json.dumps({"samples": samples, "rejected": rejected, "worker": worker})
        ok, done, total = self._record_shard(keys=keys, args=[shard, record, samples, rejected, processed, worker])
        return bool(ok), int(done), int(total)

    def done_shards(self, job_id: str) -> set[int]:
        return {int(s) for s in self.client.hkeys(f"{self.job_key(job_id)}:shards")}


def _field(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (dict, list)):  # a result, warnings, a spec: no credential reaches a record
        return json.dumps(redact_value(value), sort_keys=True)
    if isinstance(value, float):
        return repr(value)
    return redact_urls(str(value))
