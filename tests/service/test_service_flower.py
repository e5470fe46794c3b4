"""`gpufeed flower`: Flower without Docker, on the service's app and broker, showing every worker and shard task."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from service_harness import Service

pytestmark = pytest.mark.slow
pytest_plugins = ["service_fixtures"]  # service, small_raw

WORKERS = ("w1", "w2", "w3")
USER, PASSWORD = "gpufeed", "flower-test"
API_TIMEOUT_S = 60.0


def get_json(port: int, path: str) -> Any:
    """GET http://127.0.0.1:PORT/PATH with the test's basic auth, as JSON."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def poll_json(port: int, path: str, done: Callable[[Any], bool], what: str) -> Any:
    """GET PATH until `done(answer)`, for at most API_TIMEOUT_S."""
    deadline = time.monotonic() + API_TIMEOUT_S
    answer: Any = None
    while True:
        try:
            answer = get_json(port, path)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            answer = repr(exc)
        else:
            if done(answer):
                return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"Flower {path}: no {what} after {API_TIMEOUT_S} s; last answer: {str(answer)[:2000]}")
        time.sleep(0.5)


def shard_tasks(tasks: dict[str, Any], job: str) -> dict[str, Any]:
    return {
        uuid: task
        for uuid, task in tasks.items()
        if task.get("name") == "gpufeed.write_prepare_shard" and job in str(task.get("args"))
    }


def test_flower_lists_every_worker_and_the_shard_tasks_of_a_job(
    service: Service, small_raw: Path, tmp_path: Path, get_free_port: Any
) -> None:
    for name in WORKERS:
        service.start_worker(name)
    port = get_free_port()
    flower = service.start_flower(port, f"--basic-auth={USER}:{PASSWORD}")
    assert f"http://127.0.0.1:{port}" in flower.text()  # loopback unless asked otherwise

    workers = poll_json(port, "/api/workers?refresh=1", lambda a: len(a) >= len(WORKERS), "three workers")
    assert sorted(name.split("@")[0] for name in workers) == sorted(WORKERS)

    job = service.submit("prepare", str(small_raw), str(tmp_path / "out"), "--shard-samples", "5")
    record = service.wait_finished(job)
    assert record.state == "succeeded", record.to_status()
    total = record.shards_total
    assert total == 5  # 24 samples, 5 a shard

    def all_shards_succeeded(tasks: Any) -> bool:
        found = shard_tasks(tasks, job)
        return len(found) >= total and all(task.get("state") == "SUCCESS" for task in found.values())

    tasks = shard_tasks(poll_json(port, "/api/tasks", all_shards_succeeded, f"{total} finished shard tasks"), job)
    assert len(tasks) == total
    assert {task["worker"] for task in tasks.values()} <= set(workers)

