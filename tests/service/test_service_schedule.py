"""Schedules: `gpufeed schedule add|list|remove`, fired by a running `gpufeed beat`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from service_harness import Service, assert_verified, dataset_samples

pytestmark = pytest.mark.slow
pytest_plugins = ["service_fixtures"]  # service, small_raw, slow_raw


def _reshard_jobs(service: Service) -> list[dict[str, object]]:
    return [r.to_status() for r in service.store.list_jobs() if r.kind == "reshard"]


def test_a_scheduled_reshard_fires_from_a_running_beat(service: Service, small_raw: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    prepared = service.cli("prepare", str(small_raw), str(dataset), "--shard-samples", "5", "--workers", "0", "-q")
    assert prepared.returncode == 0, prepared.stderr
    before = dataset_samples(dataset)

    added = service.cli("schedule", "add", "repack", "--every", "2s", "reshard", str(dataset), "--multiple-of", "4")
    assert added.returncode == 0, added.stderr
    assert "schedule repack: reshard" in added.stdout and "every 2s" in added.stdout
    again = service.cli("schedule", "add", "repack", "--every", "1h", "reshard", str(dataset), "--multiple-of", "4")
    assert again.returncode == 1 and "exists" in again.stderr
    listed = json.loads(service.cli("schedule", "list", "--json").stdout)
    assert [(s["name"], s["kind"], s["when"]) for s in listed] == [("repack", "reshard", "every 2s")]
    assert listed[0]["spec"]["spec"]["dataset"] == str(dataset) and listed[0]["spec"]["spec"]["multiple_of"] == 4

    service.start_worker("w1")
    service.start_beat()
    deadline = time.monotonic() + 60
    while not any(job["state"] == "succeeded" for job in _reshard_jobs(service)):
        assert time.monotonic() < deadline, f"no scheduled reshard ran: {_reshard_jobs(service)}"
        time.sleep(0.3)

    manifest = assert_verified(dataset)
    assert len(manifest.shards) % 4 == 0 and len(manifest.shards) == 8
    assert dataset_samples(dataset) == before
    text = service.cli("schedule", "list")
    assert text.returncode == 0 and text.stdout.startswith("repack: reshard ") and "last job" in text.stdout

    removed = service.cli("schedule", "remove", "repack")
    assert removed.returncode == 0, removed.stderr
    assert service.cli("schedule", "list").stdout.strip() == "no schedules"
    time.sleep(1)  # a run submitted just before the removal may still finish
    count = len(_reshard_jobs(service))
    time.sleep(4)
    assert len(_reshard_jobs(service)) == count  # nothing fires any more
    assert_verified(dataset)


def test_cron_schedules_are_stored_and_described(service: Service, small_raw: Path, tmp_path: Path) -> None:
    added = service.cli(
        "schedule", "add", "nightly", "--cron", "30 3 * * *", "reshard", str(tmp_path / "ds"), "--reaugment", "--seed", "9", "--json"
    )
    assert added.returncode == 0, added.stderr
    info = json.loads(added.stdout)
    assert info["when"] == "cron 30 3 * * * (UTC)" and info["spec"]["spec"]["reaugment"] is True
    assert info["next_run"] is not None and "T03:30:00" in info["next_run"]
    assert service.cli("schedule", "remove", "nightly").returncode == 0
