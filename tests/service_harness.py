"""Helpers for the service tests: a private Redis, real `gpufeed worker`/`beat`/`flower` processes, the CLI.

Workers run as `python -m pipeline worker …` subprocesses in their own
process group (so a test can SIGKILL the main process alone, and teardown
can stop the whole group); every process a test starts is stopped in the
fixture's teardown. Service timings are shortened through the environment
(heartbeat 1 s, stale after 4 s, watchdog every 1 s, retries after 0.2 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.io.output import Output
from pipeline.io.tar import iter_tar_samples
from pipeline.manifest import read_manifest, verify_dataset

READY_TIMEOUT_S = 60.0
FAST_SERVICE_ENV = {
    "GPUFEED_HEARTBEAT_INTERVAL": "1",
    "GPUFEED_STALE_AFTER": "4",
    "GPUFEED_WATCHDOG_INTERVAL": "1",
    "GPUFEED_BEAT_INTERVAL": "1",
    "GPUFEED_RETRY_DELAY": "0.2",
    "GPUFEED_JOB_TTL": "1h",
}


class ServiceProcess:
    """A worker or beat subprocess in its own process group, logging to a file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self.args = args
        handle = open(log, "ab")  # noqa: SIM115 - the child owns it
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pipeline", *args],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        handle.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, needle: str, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            if self.process.poll() is not None:
                raise AssertionError(f"{self.args} exited ({self.process.returncode}):\n{self.text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.args}: no {needle!r} after {timeout} s:\n{self.text()[-3000:]}")
            time.sleep(0.1)

    def kill_main(self) -> None:
        """SIGKILL the main process only, as a crash would (its pool children are left to their fate)."""
        os.kill(self.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL whatever is left."""
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                break
            if self.process.poll() is not None:
                # The main process is gone; give orphaned children a moment, then make sure.
                time.sleep(0.2)
                break
            time.sleep(0.1)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


class Service:
    """One test's service: environment, processes, CLI, and direct reads of job records."""

    def __init__(self, broker_url: str, roots: list[Path], logs: Path, **env: str) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("GPUFEED_") or k == "GPUFEED_TEST_REDIS_URL"}
        self.env = {
            **base,
            **FAST_SERVICE_ENV,
            "GPUFEED_BROKER_URL": broker_url,
            "GPUFEED_ALLOWED_ROOTS": ":".join(str(root) for root in roots),
            **env,
        }
        self.logs = logs
        self.processes: list[ServiceProcess] = []
        self._store: Any = None

    @property
    def store(self) -> Any:
        from worker.jobs import JobStore
        from worker.settings import settings_from_env

        if self._store is None:
            self._store = JobStore(settings_from_env(self.env))
        return self._store

    def start_worker(self, name: str, *extra: str, env: dict[str, str] | None = None, wait: bool = True) -> ServiceProcess:
        args = ["worker", "-n", f"{name}@%h", "--concurrency", "1", "--pool", "prefork", "--without-mingle", "--without-gossip", *extra]
        process = ServiceProcess(args, {**self.env, **(env or {})}, self.logs / f"{name}.log")
        self.processes.append(process)
        if wait:
            process.wait_for_log(" ready.")
        return process

    def start_beat(self) -> ServiceProcess:
        process = ServiceProcess(["beat"], self.env, self.logs / "beat.log")
        self.processes.append(process)
        process.wait_for_log("beat: Starting")
        return process

    def start_flower(self, port: int, *extra: str, env: dict[str, str] | None = None) -> ServiceProcess:
        process = ServiceProcess(["flower", "--port", str(port), *extra], {**self.env, **(env or {})}, self.logs / "flower.log")
        self.processes.append(process)
        process.wait_for_log("Visit me at")
        return process

    def stop_all(self) -> None:
        for process in self.processes:
            process.stop()
        self.processes.clear()
        if self._store is not None:
            self._store.client.close()

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pipeline", *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def submit(self, *args: str) -> str:
        result = self.cli("submit", *args, "--json")
        assert result.returncode == 0, result.stderr
        return str(json.loads(result.stdout)["job"])

    def status(self, job: str) -> dict[str, Any]:
        result = self.cli("status", job, "--json")
        assert result.returncode == 0, result.stderr
        return dict(json.loads(result.stdout))

    def record(self, job: str) -> Any:
        return self.store.require(job)

    def wait_until(self, job: str, predicate: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            record = self.record(job)
            if predicate(record):
                return record
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.log.name}\n{p.text()[-2500:]}" for p in self.processes)
                raise AssertionError(f"job {job}: not {what} after {timeout} s: {record.to_status()}\n{logs}")
            time.sleep(0.2)

    def wait_finished(self, job: str, timeout: float = 120) -> Any:
        return self.wait_until(job, lambda r: r.state in ("succeeded", "failed", "cancelled"), timeout, "finished")


def service_fixture(broker_url: str, roots: list[Path], logs: Path, **env: str) -> Iterator[Service]:
    service = Service(broker_url, roots, logs, **env)
    try:
        yield service
    finally:
        service.stop_all()


def dataset_samples(root: Path) -> dict[str, dict[str, bytes]]:
    """Every sample of a prepared dataset by key (all variant sets; keys prefixed by the set)."""
    manifest = read_manifest(Output(str(root)))
    samples: dict[str, dict[str, bytes]] = {}
    for shard in manifest.shards:
        for key, members in iter_tar_samples(str(root / shard.path)):
            name = f"v{shard.variant}/{key}" if shard.variant is not None else key
            assert name not in samples, f"duplicate key {name}"
            samples[name] = members
    return samples


def assert_verified(root: Path) -> Any:
    manifest = read_manifest(Output(str(root)))
    result = verify_dataset(Output(str(root)), manifest)
    assert result.ok, result.problems
    return manifest


def shard_bytes(root: Path) -> list[bytes]:
    manifest = read_manifest(Output(str(root)))
    return [(root / shard.path).read_bytes() for shard in manifest.shards]


def skip_without_redis_server() -> None:
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")


# ---------------------------------------------------------------------------
# Flags of the service tests' jobs

# 40 photo-like images of 800-1200 px prepared to 512 px PNGs: about 0.1 s per image,
# so a job lasts long enough to be interrupted. With variants the cost triples.
SLOW_FLAGS = ["--size", "512", "--format", "png", "--shard-samples", "4"]
SLOWER_FLAGS = [*SLOW_FLAGS, "--variants", "2"]
