"""The service end to end: real Redis, real `gpufeed worker` processes, the CLI as a user runs it."""

from __future__ import annotations

import contextlib
import json
import pickle
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from service_harness import (
    SLOW_FLAGS,
    SLOWER_FLAGS,
    Service,
    assert_verified,
    dataset_samples,
    service_fixture,
    shard_bytes,
)

from pipeline.io.tar import iter_tar_samples
from pipeline.manifest import read_manifest
from pipeline.prepare.job import prepare_dataset
from pipeline.specs import PrepareSpec

pytestmark = pytest.mark.slow
pytest_plugins = ["service_fixtures"]  # service, small_raw, slow_raw


def local_prepare_of(service: Service, job: str, out: Path) -> Path:
    """Prepare locally, in this process, exactly what the job was asked to do, SRC relative as a user types it."""
    spec = dict(service.record(job).payload["spec"])
    source = Path(spec["source"])
    spec["out"] = str(out)
    spec["source"] = source.name
    with contextlib.chdir(source.parent):
        prepare_dataset(PrepareSpec.from_dict(spec), workers=0)
    return out


def test_two_workers_share_a_job_and_match_a_local_prepare(service: Service, slow_raw: Path, tmp_path: Path) -> None:
    service.start_worker("w1")
    service.start_worker("w2")
    out = tmp_path / "out"
    job = service.submit("prepare", str(slow_raw), str(out), *SLOW_FLAGS)

    service.wait_finished(job)
    status = service.status(job)
    assert status["state"] == "succeeded", status
    assert status["shards_done"] == status["shards_total"] == 10
    assert status["samples"] == 40 and status["rejected"] == 0 and status["error"] is None
    assert status["images_per_s"] > 0
    host = socket.gethostname()
    assert sorted(status["workers"]) == [f"w1@{host}", f"w2@{host}"], status["workers"]
    assert all(count >= 1 for count in status["workers"].values())
    assert sum(status["workers"].values()) == 10
    inspect = service.cli("inspect", str(out), "--verify")
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr

    local = local_prepare_of(service, job, tmp_path / "local")
    assert shard_bytes(out) == shard_bytes(local)  # byte-identical shards, sample for sample
    assert dataset_samples(out) == dataset_samples(local)
    service_manifest = json.loads((out / "manifest.json").read_text())
    local_manifest = json.loads((local / "manifest.json").read_text())
    assert service_manifest["shards"] == local_manifest["shards"]
    assert service_manifest["params"] == local_manifest["params"]


def test_status_json_jobs_and_records_outlive_the_workers(service: Service, small_raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = service.submit("prepare", str(small_raw), str(out), "--shard-samples", "5")
    queued = service.status(job)  # no worker yet: the job waits in Redis
    assert queued["state"] == "queued" and queued["shards_done"] == 0
    for field in ("state", "shards_done", "shards_total", "samples", "rejected", "error", "images_per_s", "created"):
        assert field in queued

    worker = service.start_worker("w1")
    service.wait_finished(job, timeout=60)
    worker.stop()  # the record lives in Redis, not in a worker
    status = service.status(job)
    assert status["state"] == "succeeded"
    assert (status["shards_done"], status["shards_total"], status["samples"]) == (5, 5, 24)
    assert status["result"]["manifest"] == f"{out}/manifest.json"
    manifest = assert_verified(out)
    summary = {"samples": 24, "rejected": 0, "decoded_with_warnings": 0, "shards": 5, "bytes": sum(s.bytes for s in manifest.shards)}
    assert {key: status["result"][key] for key in summary} == summary
    assert status["decoded_with_warnings"] == 0

    text = service.cli("status", job)
    assert text.returncode == 0 and f"job {job}" in text.stdout and "succeeded" in text.stdout
    listing = service.cli("jobs")
    assert listing.returncode == 0 and job in listing.stdout
    listed = json.loads(service.cli("jobs", "--json").stdout)
    assert [doc["job"] for doc in listed] == [job]

    ttl = service.store.client.ttl(service.store.job_key(job))
    assert 0 < ttl <= 3600  # finished jobs expire after GPUFEED_JOB_TTL (1h here)


def test_a_finalize_repeated_after_its_manifest_was_written_succeeds_with_the_same_summary(
    service: Service, small_raw: Path, tmp_path: Path
) -> None:
    """A finalize whose worker died right after the manifest is re-delivered: the job succeeds, nothing is rewritten."""
    import shutil

    from pipeline.prepare.job import finish_prepare, plan_prepare, write_prepare_shard
    from worker.app import app
    from worker.dispatch import send_unit

    out = tmp_path / "out"
    spec = PrepareSpec.from_dict({"source": str(small_raw), "out": str(out), "shards": {"max_samples": 8}})
    written = [write_prepare_shard(spec, shard) for shard in range(plan_prepare(spec).shards)]
    work = shutil.copytree(out / ".gpufeed", tmp_path / "work")
    first = finish_prepare(spec)  # the first finalize wrote the manifest, then its worker died ...
    shutil.copytree(work, out / ".gpufeed")  # ... before it removed the work folder
    manifest = (out / "manifest.json").read_bytes()
    store = service.store
    job = store.create("prepare", {"spec": spec.to_dict(), "force": False, "overwrite": False}, [str(out)], "gpufeed")
    store.transition(job, "running", ("queued",))
    store.update(job, shards_total=len(written), prepare_spec=spec.to_dict(), fanned_out=1)
    for shard in written:
        store.record_shard(job, shard.shard, shard.samples, shard.rejected, shard.samples + shard.rejected, "w@host")

    service.start_worker("w1")
    send_unit(app, store.require(job), "finalize")
    record = service.wait_finished(job, timeout=60)
    assert record.state == "succeeded", record.error
    assert (out / "manifest.json").read_bytes() == manifest and not (out / ".gpufeed").exists()
    assert (record.samples, record.rejected) == (first.samples, first.rejected) == (24, 0)
    assert record.result == {
        "manifest": f"{out}/manifest.json",
        "samples": 24,
        "rejected": 0,
        "shards": first.shards,
        "bytes": first.bytes,
        "decoded_with_warnings": 0,
    }
    assert first.shards == len(written) and first.bytes == sum(s.bytes for s in assert_verified(out).shards)


def test_finished_jobs_expire_after_the_configured_time(private_redis: Any, small_raw: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    for service in service_fixture(private_redis.url, [small_raw.parent, tmp_path], logs, GPUFEED_JOB_TTL="2s"):
        service.start_worker("w1")
        job = service.submit("prepare", str(small_raw), str(tmp_path / "out"), "--shard-samples", "12")
        assert service.wait_finished(job, timeout=60).state == "succeeded"
        deadline = time.monotonic() + 10
        while service.store.get(job) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert service.store.get(job) is None
        result = service.cli("status", job)
        assert result.returncode == 1 and "no job" in result.stderr and "Traceback" not in result.stderr
        assert json.loads(service.cli("jobs", "--json").stdout) == []


def _shard_files(out: Path) -> dict[str, int]:
    """Every file under OUT but the work folder, with its modification time."""
    return {
        str(path.relative_to(out)): path.stat().st_mtime_ns
        for path in out.rglob("*")
        if path.is_file() and ".gpufeed" not in path.relative_to(out).parts
    }


def test_cancel_stops_the_job_removes_its_partial_shards_and_keeps_the_finished_ones(
    service: Service, slow_raw: Path, tmp_path: Path
) -> None:
    service.start_worker("w1")
    out = tmp_path / "out"
    job = service.submit("prepare", str(slow_raw), str(out), *SLOWER_FLAGS)
    service.wait_until(job, lambda r: r.shards_done >= 1, 120, "one shard done")

    result = service.cli("cancel", job)
    assert result.returncode == 0, result.stderr
    record = service.wait_until(job, lambda r: r.cleaned, 60, "cleaned up")
    assert record.state == "cancelled"
    done = service.store.done_shards(job)
    assert done and len(done) == record.shards_done < record.shards_total
    # What is left is the finished shards, each in every variant set, and nothing partial: no temp file, no manifest.
    # (A shard whose last chunk was being written as the cancel came is finished too: it stays, valid.)
    kept = _shard_files(out)
    indices = {int(name.removesuffix(".tar").rpartition("-")[2]) for name in kept}
    assert indices >= done and len(indices - done) <= 1, (indices, done)  # one worker process: one shard in flight
    assert sorted(kept) == sorted(f"v{v}/shard-{shard:06d}.tar" for v in range(2) for shard in indices), kept
    for name in kept:
        with open(out / name, "rb") as handle:
            assert sum(1 for _ in iter_tar_samples(handle, name)) == 4
    assert (out / ".gpufeed").is_dir()  # the plan: the same job submitted again resumes
    time.sleep(3)  # the rest of its shards are still queued: the worker must skip every one, none completes
    record = service.record(job)
    assert record.state == "cancelled" and record.shards_done == len(done) and not record.running
    assert _shard_files(out) == kept
    assert service.status(job)["state"] == "cancelled"
    again = service.cli("cancel", job)
    assert again.returncode == 1 and "already cancelled" in again.stderr

    # The output is free again: the same job resumes, writing only the shards the cancel left unwritten.
    job2 = service.submit("prepare", str(slow_raw), str(out), *SLOWER_FLAGS)
    finished = service.wait_finished(job2)
    assert finished.state == "succeeded", finished.error
    assert_verified(out)
    after = _shard_files(out)
    assert {name: after[name] for name in kept} == kept  # the finished shards were not written again


def test_a_second_job_on_the_same_out_is_refused(service: Service, small_raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = service.submit("prepare", str(small_raw), str(out))
    second = service.cli("submit", "prepare", str(small_raw), str(out), "--size", "128")
    assert second.returncode == 1
    assert second.stderr.startswith("gpufeed: error: ") and f"job {first}" in second.stderr, second.stderr
    assert "Traceback" not in second.stderr
    (tmp_path / "alias").symlink_to(tmp_path)  # the same folder by another name
    third = service.cli("submit", "prepare", str(small_raw), str(tmp_path / "alias" / "out"))
    assert third.returncode == 1 and f"job {first}" in third.stderr
    assert len(service.store.list_jobs()) == 1

    service.start_worker("w1")
    assert service.wait_finished(first, timeout=60).state == "succeeded"
    fourth = service.submit("prepare", str(small_raw), str(out))  # finished jobs free their output
    assert service.wait_finished(fourth, timeout=60).state == "succeeded"


def test_allowed_roots_are_enforced_at_submission_and_in_the_worker(
    private_redis: Any, small_raw: Path, tmp_path: Path
) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "escape").symlink_to(outside)
    logs = tmp_path / "logs"
    logs.mkdir()
    for service in service_fixture(private_redis.url, [allowed, small_raw], logs):
        refused = {
            "OUT outside": ["prepare", str(small_raw), str(outside / "out")],
            "OUT via ..": ["prepare", str(small_raw), f"{allowed}/../outside/out"],
            "OUT via a symlink": ["prepare", str(small_raw), str(allowed / "escape" / "out")],
            "SRC outside": ["prepare", str(tmp_path), str(allowed / "out")],
            "DATASET outside": ["reshard", str(outside), "--multiple-of", "2"],
        }
        for case, args in refused.items():
            result = service.cli("submit", *args)
            assert result.returncode == 1, case
            assert result.stderr.startswith("gpufeed: error: ") and "Traceback" not in result.stderr, (case, result.stderr)
            assert "GPUFEED_ALLOWED_ROOTS" in result.stderr or "'..'" in result.stderr, (case, result.stderr)
        assert service.store.list_jobs() == []

        # A submitter with a wider view than the worker: the worker refuses on its own.
        wide = {"GPUFEED_ALLOWED_ROOTS": f"{allowed}:{small_raw}:{outside}"}
        service.start_worker("w1")
        result = service.cli("submit", "prepare", str(small_raw), str(outside / "out"), "--json", env=wide)
        assert result.returncode == 0, result.stderr
        job = json.loads(result.stdout)["job"]
        record = service.wait_finished(job, timeout=60)
        assert record.state == "failed" and "outside GPUFEED_ALLOWED_ROOTS" in record.error, record.error
        assert not (outside / "out").exists()

        # A list file inside the roots that names a file outside them is refused by the worker.
        listing = allowed / "list.csv"
        secret = outside / "secret.jpg"
        secret.write_bytes((next(small_raw.rglob("*.jpg"))).read_bytes())
        listing.write_text(f"path,label\n{next(small_raw.rglob('*.jpg'))},a\n{secret},b\n")
        job = service.submit("prepare", str(listing), str(allowed / "from-list"))
        record = service.wait_finished(job, timeout=60)
        assert record.state == "failed" and str(secret) in record.error, record.error
        assert not (allowed / "from-list" / "manifest.json").exists()


class _Evil:
    """Unpickling this creates a file: proof that a worker executed a pickle payload."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_a_pickle_message_is_refused_not_executed(service: Service, small_raw: Path, tmp_path: Path) -> None:
    from celery import Celery

    worker = service.start_worker("w1")
    marker = tmp_path / "pwned"
    sender = Celery("attacker", broker=service.env["GPUFEED_BROKER_URL"])
    sender.conf.update(task_serializer="pickle", accept_content=["pickle", "json"])
    pickle.dumps(_Evil(marker))  # the payload is valid pickle
    sender.send_task("gpufeed.plan_prepare", args=[_Evil(marker)], queue="gpufeed", serializer="pickle")

    # A normal job queued after it still runs: the worker refused the message and went on.
    job = service.submit("prepare", str(small_raw), str(tmp_path / "out"))
    assert service.wait_finished(job, timeout=60).state == "succeeded"
    assert not marker.exists()
    assert "ContentDisallowed" in worker.text() or "Refusing to deserialize" in worker.text()


def test_a_password_protected_redis_works_through_the_url(private_redis: Any, small_raw: Path, tmp_path: Path) -> None:
    server = private_redis
    client = server.client()
    client.config_set("requirepass", "s3cret-pass")  # set after start: the fixture's readiness ping has no password
    client.close()
    url = f"redis://:s3cret-pass@127.0.0.1:{server.port}/0"
    logs = tmp_path / "logs"
    logs.mkdir()
    for service in service_fixture(url, [small_raw, tmp_path], logs):
        service.start_worker("w1")
        job = service.submit("prepare", str(small_raw), str(tmp_path / "out"), "--shard-samples", "8")
        assert service.wait_finished(job, timeout=60).state == "succeeded"
        assert_verified(tmp_path / "out")
        for bad_url in (f"redis://127.0.0.1:{server.port}/0", f"redis://:wrong@127.0.0.1:{server.port}/0"):
            result = service.cli("status", job, env={"GPUFEED_BROKER_URL": bad_url})
            assert result.returncode == 1 and "Traceback" not in result.stderr
            assert "password" in result.stderr or "credentials" in result.stderr, result.stderr
            assert "s3cret" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["submit", "prepare", "{data}", "{out}", "--quality", "500"], "--quality", id="bad-quality"),
        pytest.param(["submit", "prepare", "{data}", "{out}", "--shard-size", "lots"], "not a size", id="bad-size"),
        pytest.param(["submit", "prepare", "{data}", "{out}", "--mode", "sideways"], "--mode", id="bad-mode"),
        pytest.param(["submit", "reshard", "{out}"], "--shard-samples", id="reshard-without-layout"),
        pytest.param(["submit", "reshard", "{out}", "--seed", "3"], "--reaugment", id="seed-without-reaugment"),
        pytest.param(["submit", "bench-disk", "{out}", "--duration", "9999"], "duration_s", id="bench-too-long"),
        pytest.param(["status", "nosuchjob"], "no job", id="unknown-job"),
        pytest.param(["cancel", "nosuchjob"], "no job", id="cancel-unknown-job"),
        pytest.param(["schedule", "add", "n", "--cron", "not a cron", "reshard", "{out}", "--multiple-of", "2"], "--cron", id="bad-cron"),
        pytest.param(["schedule", "add", "n", "--every", "soon", "reshard", "{out}", "--multiple-of", "2"], "--every", id="bad-every"),
        pytest.param(["schedule", "add", "n", "--every", "1h", "prepare", "{data}"], "reshard DATASET", id="schedule-prepare"),
        pytest.param(["schedule", "remove", "nothing"], "no schedule", id="remove-unknown-schedule"),
    ],
)
def test_invalid_requests_get_one_clear_line(
    service: Service, small_raw: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    args = [a.format(data=small_raw, out=tmp_path / "out") for a in args]
    result = service.cli(*args)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpufeed: error: "), result.stderr
    assert message in lines[0], lines[0]


def test_an_unreachable_redis_is_a_clear_error(service: Service, small_raw: Path, tmp_path: Path, get_free_port: Any) -> None:
    env = {"GPUFEED_BROKER_URL": f"redis://:hidden@127.0.0.1:{get_free_port()}/0"}
    for args in (["submit", "prepare", str(small_raw), str(tmp_path / "out")], ["jobs"], ["schedule", "list"]):
        result = service.cli(*args, env=env)
        assert result.returncode == 1, args
        assert "cannot reach Redis" in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert "hidden" not in result.stderr


def test_without_allowed_roots_every_job_is_refused(service: Service, small_raw: Path, tmp_path: Path) -> None:
    result = service.cli("submit", "prepare", str(small_raw), str(tmp_path / "out"), env={"GPUFEED_ALLOWED_ROOTS": ""})
    assert result.returncode == 1 and "GPUFEED_ALLOWED_ROOTS is not set" in result.stderr


def test_reshard_and_reaugment_through_the_service(service: Service, small_raw: Path, tmp_path: Path) -> None:
    service.start_worker("w1")
    out = tmp_path / "ds"
    job = service.submit("prepare", str(small_raw), str(out), "--shard-samples", "5", "--variants", "2", "--size", "64")
    assert service.wait_finished(job, timeout=60).state == "succeeded"
    before = dataset_samples(out)

    job = service.submit("reshard", str(out), "--multiple-of", "4")
    record = service.wait_finished(job, timeout=60)
    assert record.state == "succeeded", record.error
    manifest = assert_verified(out)
    assert len([s for s in manifest.shards if s.variant == 0]) % 4 == 0
    assert dataset_samples(out) == before  # the same samples, byte for byte
    assert record.result["shards_before"] == 5 and record.result["shards_after"] == 8

    job = service.submit("reshard", str(out), "--reaugment", "--seed", "7")
    record = service.wait_finished(job, timeout=60)
    assert record.state == "succeeded", record.error
    manifest = assert_verified(out)
    assert manifest.params["seed"] == 7 and record.result["reaugmented"]
    after = dataset_samples(out)
    assert after.keys() == before.keys()  # the same sources ...
    assert any(after[k]["jpg"] != before[k]["jpg"] for k in after)  # ... augmented differently


def test_a_disk_benchmark_runs_on_a_worker(service: Service, tmp_path: Path) -> None:
    service.start_worker("w1")
    disk = tmp_path / "disk"
    disk.mkdir()
    result = service.cli(
        "submit", "bench-disk", str(disk), "--file-size", "4MiB", "--duration", "0.1", "--threads", "2", "--wait", "--json"
    )
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["kind"] == "bench-disk" and status["state"] == "succeeded", status
    report = status["result"]
    assert report["path"] == str(disk) and report["file_bytes"] >= 4 << 20
    assert report["seq_read_by_block"] and all(rate > 0 for rate in report["seq_read_by_block"].values())
    assert list(disk.iterdir()) == []  # the benchmark removed its test files


def test_the_service_repairs_a_dataset_and_reaugments_one_prepared_from_a_relative_src(
    service: Service, small_raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service.start_worker("w1")
    out = tmp_path / "ds"
    job = service.submit("prepare", str(small_raw), str(out), "--shard-samples", "5")
    assert service.wait_finished(job, timeout=60).state == "succeeded"
    before = shard_bytes(out)
    (out / "shard-000003.tar").unlink()
    job = service.submit("prepare", str(small_raw), str(out), "--shard-samples", "5")  # the same job again
    record = service.wait_finished(job, timeout=60)
    assert record.state == "succeeded", record.error
    assert shard_bytes(out) == before and not (out / ".gpufeed").exists()
    assert_verified(out)

    local = tmp_path / "local"
    monkeypatch.chdir(small_raw.parent)
    spec = {"source": small_raw.name, "out": str(local), "shards": {"max_samples": 5}, "augment": {"variants": 1}}
    prepare_dataset(PrepareSpec.from_dict(spec), workers=0)
    job = service.submit("reshard", str(local), "--reaugment", "--seed", "7")  # the worker needs an absolute SRC
    record = service.wait_finished(job, timeout=60)
    assert record.state == "succeeded", record.error
    assert read_manifest(local).params["seed"] == 7


def test_a_coco_detection_job_on_two_workers_matches_a_local_prepare(service: Service, tmp_path: Path) -> None:
    from pipeline.demo import make_coco_dataset

    instances = make_coco_dataset(str(tmp_path / "coco"), images=24)
    service.start_worker("w1")
    service.start_worker("w2")
    out = tmp_path / "out"
    job = service.submit("prepare", instances, str(out), "--size", "64", "--shard-samples", "6")
    service.wait_finished(job, timeout=90)
    status = service.status(job)
    assert status["state"] == "succeeded", status
    manifest = assert_verified(out)
    assert manifest.task == "detection" and manifest.classes == ["cat", "dog", "bird"]
    assert manifest.fields == ["boxes.npy", "box_labels.npy", "iscrowd.npy", "mask.png", "instances.png", "polygons.json"]  # shapes painted and kept
    local = tmp_path / "local"
    spec = dict(service.record(job).payload["spec"])
    prepare_dataset(PrepareSpec.from_dict({**spec, "out": str(local)}), workers=0)
    assert shard_bytes(out) == shard_bytes(local)  # boxes, masks and all, sample for sample
