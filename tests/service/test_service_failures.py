"""The service under failure: a worker SIGKILLed mid-job, Redis restarted mid-job, the watchdog's rules, retries."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from service_harness import (
    SLOWER_FLAGS,
    Service,
    assert_verified,
    dataset_samples,
    service_fixture,
    shard_bytes,
)

from pipeline.prepare.job import prepare_dataset
from pipeline.specs import PrepareSpec

pytestmark = pytest.mark.slow
pytest_plugins = ["service_fixtures"]  # service, small_raw, slow_raw


def test_a_sigkilled_worker_s_job_completes_on_another_worker(service: Service, slow_raw: Path, tmp_path: Path) -> None:
    w1 = service.start_worker("w1")
    out = tmp_path / "out"
    job = service.submit("prepare", str(slow_raw), str(out), *SLOWER_FLAGS)
    service.wait_until(
        job,
        lambda r: r.shards_done >= 1 and any(str(e.get("worker", "")).startswith("w1@") for e in r.running.values()),
        120,
        "running a shard on w1 after finishing one",
    )
    w1.kill_main()  # the main worker process, holding the unacknowledged message
    killed = time.monotonic()
    assert service.record(job).state == "running"

    service.start_worker("w2")
    record = service.wait_finished(job, timeout=150)
    elapsed = time.monotonic() - killed
    assert record.state == "succeeded", record.error
    assert elapsed < 120, f"took {elapsed:.0f} s: recovery waited for the broker, not the heartbeats"
    assert record.shards_done == record.shards_total == 10 and record.samples == 40
    inspect = service.cli("inspect", str(out), "--verify")
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr

    spec = dict(record.payload["spec"])
    spec["out"] = str(tmp_path / "local")
    prepare_dataset(PrepareSpec.from_dict(spec), workers=0)
    assert shard_bytes(out) == shard_bytes(tmp_path / "local")
    assert dataset_samples(out) == dataset_samples(tmp_path / "local")  # exactly the right samples, no duplicate keys


def test_a_worker_killed_mid_shard_leaves_no_temp_file_once_the_job_succeeds(
    service: Service, slow_raw: Path, tmp_path: Path
) -> None:
    w1 = service.start_worker("w1")
    out = tmp_path / "out"
    job = service.submit("prepare", str(slow_raw), str(out), *SLOWER_FLAGS)
    deadline = time.monotonic() + 120
    while not _temp_files(out):  # a shard being written: its temp files are there
        assert time.monotonic() < deadline, service.record(job).to_status()
        time.sleep(0.02)
    os.killpg(w1.pid, signal.SIGKILL)  # the worker and its pool child, in the middle of the shard
    w1.process.wait(timeout=10)
    assert _temp_files(out)
    local = service.cli("prepare", str(slow_raw), str(out), *SLOWER_FLAGS)  # the job holds OUT, its planner dead or not
    assert local.returncode != 0 and f"service job {job}" in local.stderr, local.stderr

    service.start_worker("w2")
    record = service.wait_finished(job, timeout=150)
    assert record.state == "succeeded", record.error
    assert _temp_files(out) == []
    assert not (out / ".gpufeed.lock").exists()
    assert_verified(out)


def _temp_files(out: Path) -> list[str]:
    return sorted(str(path.relative_to(out)) for path in out.rglob(".shard-*.tmp-*"))


def test_redis_restarted_mid_job_never_publishes_a_bad_manifest(
    redis_server_factory: Any, slow_raw: Path, tmp_path: Path
) -> None:
    server = redis_server_factory("--appendonly", "yes")
    logs = tmp_path / "logs"
    logs.mkdir()
    out = tmp_path / "out"
    for service in service_fixture(server.url, [slow_raw, tmp_path], logs):
        service.start_worker("w1")
        service.start_worker("w2")
        job = service.submit("prepare", str(slow_raw), str(out), *SLOWER_FLAGS)
        service.wait_until(job, lambda r: r.shards_done >= 2, 120, "two shards done")
        server.restart()  # graceful: the append-only file keeps every acknowledged write

        record = _wait_through_outages(service, job, timeout=180)
        if record.state == "succeeded":
            manifest = assert_verified(out)
            assert manifest.samples == 40 and len(dataset_samples(out)) == 80
        else:
            assert record.state == "failed" and record.error, record.to_status()
            assert not (out / "manifest.json").exists()
        if (out / "manifest.json").exists():
            assert_verified(out)


def _wait_through_outages(service: Service, job: str, timeout: float) -> Any:
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            return service.wait_finished(job, timeout=max(1.0, deadline - time.monotonic()))
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# ---------------------------------------------------------------------------
# The watchdog's rules, on a real Redis, without workers (messages are captured)


@pytest.fixture
def watchdog(private_redis: Any, tmp_path: Path) -> Any:
    from worker import watchdog as module
    from worker.jobs import JobStore
    from worker.settings import settings_from_env

    settings = settings_from_env(
        {
            "GPUFEED_BROKER_URL": private_redis.url,
            "GPUFEED_ALLOWED_ROOTS": str(tmp_path),
            "GPUFEED_STALE_AFTER": "4",
            "GPUFEED_HEARTBEAT_INTERVAL": "1",
            "GPUFEED_WATCHDOG_INTERVAL": "0.1",
        }
    )
    sent: list[tuple[str, str]] = []
    store = JobStore(settings)
    dog = module.Watchdog(settings, "test-worker", lambda record, unit: sent.append((record.id, unit)), store)
    dog.sent = sent
    yield dog
    store.client.close()


def _planned_job(store: Any, tmp_path: Path, shards: int) -> str:
    spec = PrepareSpec(source=str(tmp_path / "src"), out=str(tmp_path / "out"))
    job = store.create("prepare", {"spec": spec.to_dict(), "force": False, "overwrite": False}, [str(tmp_path / "out")], "gpufeed")
    store.transition(job, "running", ("queued",))
    store.update(job, shards_total=shards, prepare_spec=spec.to_dict(), fanned_out=1)
    return job


def _age(store: Any, job: str, unit: str | None, seconds: float) -> None:
    """Pretend the job (or one running unit) was last heard of `seconds` ago."""
    then = store.now() - seconds
    if unit is None:
        store.update(job, last_activity=then)
        return
    key = f"{store.job_key(job)}:running"
    entry = json.loads(store.client.hget(key, unit))
    entry["beat"] = then
    store.client.hset(key, unit, json.dumps(entry))


def test_the_watchdog_resends_a_shard_whose_heartbeat_stopped(watchdog: Any, tmp_path: Path) -> None:
    store = watchdog.store
    job = _planned_job(store, tmp_path, 3)
    assert store.begin_unit(job, "shard:1", {"worker": "dead@host"}, "token-1") == "ok"
    assert store.begin_unit(job, "shard:2", {"worker": "live@host"}, "token-2") == "ok"
    assert watchdog.tick() == []  # fresh heartbeats: nothing to do
    _age(store, job, "shard:1", 10)

    time.sleep(0.15)
    assert watchdog.tick() == [(job, "shard:1")]
    assert watchdog.sent == [(job, "shard:1")]
    record = store.require(job)
    assert set(record.running) == {"shard:2"} and record.redispatched == 1
    # A duplicate that arrives while a live run holds the shard steps aside.
    assert store.begin_unit(job, "shard:2", {"worker": "other@host"}, "token-3") == "busy"


def test_the_watchdog_resends_what_a_silent_job_still_needs(watchdog: Any, tmp_path: Path) -> None:
    store = watchdog.store
    job = _planned_job(store, tmp_path, 3)
    store.record_shard(job, 0, 4, 0, 4, "w@host")
    _age(store, job, None, 10)
    store.client.lpush("gpufeed", "a message of another job")
    assert watchdog.tick() == []  # something is queued: the job may simply be waiting its turn
    store.client.delete("gpufeed")

    time.sleep(0.15)
    assert sorted(unit for _, unit in watchdog.tick()) == ["shard:1", "shard:2"]
    time.sleep(0.15)
    assert watchdog.tick() == []  # it just acted: the job gets a full stale period to show progress

    store.record_shard(job, 1, 4, 0, 4, "w@host")
    store.record_shard(job, 2, 4, 0, 4, "w@host")
    _age(store, job, None, 10)
    time.sleep(0.15)
    assert watchdog.tick() == [(job, "finalize")]  # every shard done, no manifest yet


def test_a_unit_that_keeps_killing_its_worker_fails_the_job(watchdog: Any, tmp_path: Path) -> None:
    from worker.settings import get_settings
    from worker.tasks import _check_attempts

    store = watchdog.store
    job = _planned_job(store, tmp_path, 1)
    limit = get_settings().max_attempts
    import worker.tasks as tasks

    tasks._STORE = store
    try:
        for _ in range(limit):
            _check_attempts(job, "shard:0")
        with pytest.raises(Exception, match="started 5 times without finishing"):
            _check_attempts(job, "shard:0")
    finally:
        tasks._STORE = None


def test_finalize_refuses_a_shard_that_does_not_verify(service: Service, small_raw: Path, tmp_path: Path) -> None:
    from pipeline.prepare.job import plan_prepare, write_prepare_shard
    from worker.app import make_app
    from worker.dispatch import send_unit
    from worker.settings import settings_from_env

    spec = PrepareSpec.from_dict({"source": str(small_raw), "out": str(tmp_path / "out"), "shards": {"max_samples": 8}})
    plan = plan_prepare(spec)
    for shard in range(plan.shards):
        write_prepare_shard(spec, shard)
    store = service.store
    job = store.create("prepare", {"spec": spec.to_dict(), "force": False, "overwrite": False}, [str(tmp_path / "out")], "gpufeed")
    store.transition(job, "running", ("queued",))
    store.update(job, shards_total=plan.shards, prepare_spec=spec.to_dict(), fanned_out=1)
    for shard in range(plan.shards):
        store.record_shard(job, shard, 8, 0, 8, "w@host")
    victim = tmp_path / "out" / "shard-000001.tar"
    data = bytearray(victim.read_bytes())
    data[700] ^= 0xFF  # one flipped byte inside a member: same size, wrong sha256
    victim.write_bytes(bytes(data))

    service.start_worker("w1")
    send_unit(make_app(settings_from_env(service.env)), store.require(job), "finalize")
    record = service.wait_finished(job, timeout=60)
    assert record.state == "failed" and "missing or invalid" in record.error, record.error
    assert not (tmp_path / "out" / "manifest.json").exists()


# ---------------------------------------------------------------------------
# Retryable errors: a StorageError sends its task again instead of failing the job

# Loaded by the worker's interpreter at start (sitecustomize): the first GPUFEED_TEST_FAILURES
# writes of shard 1 raise the StorageError a full disk raises; each is counted in the marker file.
FAIL_SHARD_ONE = '''
import os

import pipeline.prepare.job as job
from pipeline.errors import StorageError

_write_prepare_shard = job.write_prepare_shard


def write_prepare_shard(spec, shard, *args, **kwargs):
    if shard == 1:
        marker = os.environ["GPUFEED_TEST_MARKER"]
        with open(marker, "a") as handle:
            handle.write("x")
        with open(marker) as handle:
            tries = len(handle.read())
        if tries <= int(os.environ["GPUFEED_TEST_FAILURES"]):
            raise StorageError(f"no space left on the device while writing shard 1 (try {tries})")
    return _write_prepare_shard(spec, shard, *args, **kwargs)


job.write_prepare_shard = write_prepare_shard
'''


def _start_failing_worker(service: Service, tmp_path: Path, failures: int, **env: str) -> Path:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FAIL_SHARD_ONE)
    marker = tmp_path / "shard-1-tries"
    path = os.pathsep.join(p for p in (str(hooks), service.env.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "GPUFEED_TEST_MARKER": str(marker), "GPUFEED_TEST_FAILURES": str(failures), **env}
    service.start_worker("w1", env=env)
    return marker


def test_a_storage_error_is_retried_and_the_job_succeeds(service: Service, small_raw: Path, tmp_path: Path) -> None:
    marker = _start_failing_worker(service, tmp_path, failures=1)
    out = tmp_path / "out"
    job = service.submit("prepare", str(small_raw), str(out), "--shard-samples", "8")
    record = service.wait_finished(job, timeout=120)

    assert record.state == "succeeded", record.error
    assert marker.read_text() == "xx"  # the first try failed, the second wrote the shard
    assert int(service.store.client.hget(service.store.job_key(job), "attempts:shard:1")) == 2
    assert record.shards_done == record.shards_total == 3 and record.samples == 24 and not record.error
    assert assert_verified(out).samples == 24
    assert "trying again" in service.processes[0].text()


def test_a_storage_error_that_persists_fails_the_job_after_the_allowed_runs(
    service: Service, small_raw: Path, tmp_path: Path
) -> None:
    marker = _start_failing_worker(service, tmp_path, failures=100, GPUFEED_MAX_ATTEMPTS="3")
    out = tmp_path / "out"
    job = service.submit("prepare", str(small_raw), str(out), "--shard-samples", "8")
    record = service.wait_finished(job, timeout=120)

    assert record.state == "failed"
    assert "no space left on the device" in record.error and "(tried 3 times)" in record.error, record.error
    assert marker.read_text() == "xxx"
    assert not (out / "manifest.json").exists()


def test_a_failed_job_lets_go_of_its_out_s_lock(service: Service, tmp_path: Path) -> None:
    raw = tmp_path / "broken" / "cat"
    raw.mkdir(parents=True)
    for number in range(3):
        (raw / f"{number}.jpg").write_bytes(b"not a JPEG at all")
    out = tmp_path / "out"
    service.start_worker("w1")
    job = service.submit("prepare", str(raw.parent), str(out), "--shard-samples", "2")
    record = service.wait_finished(job)
    assert record.state == "failed" and "no usable images" in record.error, record.error
    assert not (out / ".gpufeed.lock").exists()
    assert (out / "rejected.jsonl").exists()
