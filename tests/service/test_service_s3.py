"""The service with SRC and OUT on a real S3 server on loopback (moto): workers that share no folder, only the store."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from service_harness import dataset_samples

from pipeline import PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset
from pipeline.io.fs import storage_options_for
from pipeline.manifest import verify_dataset

if TYPE_CHECKING:
    from s3_fixtures import S3Server
    from service_harness import Service

pytest_plugins = ["s3_fixtures", "service_fixtures"]

SECRET = "sEcReT-job-credential-never-recorded"


def machine_env(root: Path, name: str) -> dict[str, str]:
    """What a machine of its own has: its own temp folder, home and shard cache (nothing shared with the others)."""
    folders = {kind: root / name / kind for kind in ("tmp", "home", "cache")}
    for folder in folders.values():
        folder.mkdir(parents=True)
    return {"TMPDIR": str(folders["tmp"]), "HOME": str(folders["home"]), "GPUFEED_CACHE": str(folders["cache"])}


def s3_samples(server: S3Server, url: str, into: Path) -> dict[str, dict[str, bytes]]:
    """A dataset on the store, copied down to compare it with a local one."""
    server.filesystem().get(url.removeprefix("s3://") + "/", str(into), recursive=True)
    return dataset_samples(into)


def without_sources(samples: dict[str, dict[str, bytes]]) -> dict[str, dict[str, object]]:
    """The samples with the `source` of their json left out (a path locally, a URL on the store)."""
    out: dict[str, dict[str, object]] = {}
    for key, members in samples.items():
        out[key] = {ext: data for ext, data in members.items() if ext != "json"}
        meta = json.loads(members["json"])
        meta.pop("source", None)
        out[key]["json"] = meta
    return out


def test_three_workers_sharing_only_the_store_equal_a_local_run(
    s3_server: S3Server, s3_upload, small_raw: Path, service: Service, tmp_path: Path
):
    bucket = s3_upload(small_raw)
    src, out = bucket.url, f"s3://{bucket.name}/shards"
    workers = tmp_path / "machines"
    service.env["GPUFEED_ALLOWED_ROOTS"] = f"s3://{bucket.name}/"
    for name in ("w1", "w2", "w3"):
        service.start_worker(name, env=machine_env(workers, name))
    submitter = machine_env(workers, "submitter")
    s3_server.reset_reads()
    result = service.cli(
        "submit",
        "prepare",
        src,
        out,
        "--size",
        "64",
        "--shard-samples",
        "3",
        "--storage-option",
        f"endpoint_url={s3_server.endpoint}",
        "--json",
        env=submitter,
    )
    assert result.returncode == 0, result.stderr
    job = json.loads(result.stdout)["job"]
    record = service.wait_finished(job, timeout=180)
    assert record.state == "succeeded", (record.error, record.to_status())
    # SRC is listed once, by the plan, which checks each listed file against the allowed roots as it goes
    source_listings = {prefix: n for prefix, n in s3_server.listings().items() if prefix.startswith(f"{bucket.name}/data")}
    assert source_listings and set(source_listings.values()) == {1}, source_listings
    shards = service.store.client.hvals(f"{service.store.job_key(job)}:shards")
    assert len({json.loads(entry)["worker"] for entry in shards}) >= 2  # shards written on several "machines"
    with storage_options_for([out], s3_server.storage_options):
        assert verify_dataset(out).ok
    local = tmp_path / "local"
    spec = PrepareSpec(source=str(small_raw), out=str(local), resize=ResizeSpec(size=64), shards=ShardSpec(max_samples=3))
    prepare_dataset(spec, workers=0)
    assert without_sources(s3_samples(s3_server, out, tmp_path / "down")) == without_sources(dataset_samples(local))
    left = s3_server.filesystem().find(f"{bucket.name}/shards")
    assert not [path for path in left if "/.gpufeed" in path or ".tmp-" in path]
    # Every machine's copy of the listing goes once the job is over (the watchdog ticks each second here).
    deadline = time.monotonic() + 30
    while (copies := sorted(workers.glob("w*/tmp/gpufeed-staging-*"))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not copies


def test_copies_go_only_when_every_job_marked_on_them_is_over(tmp_path: Path):
    from worker.staging import MARK, remove_finished_copies

    shared, mine, by_hand = (tmp_path / f"gpufeed-staging-{name}" for name in ("shared", "mine", "hand"))
    for folder in (shared, mine, by_hand):
        (folder / ".gpufeed").mkdir(parents=True)
        (folder / ".gpufeed" / "listing.jsonl").write_text("{}\n")
    (shared / f"{MARK}old").touch()
    (shared / f"{MARK}running").touch()
    (mine / f"{MARK}old").touch()
    over = {"old"}
    assert remove_finished_copies(over.__contains__, str(tmp_path)) == [str(mine)]
    assert shared.exists() and not (shared / f"{MARK}old").exists()  # a running job still reads it
    assert by_hand.exists()  # no job marked it: a prepare run by hand
    over.add("running")
    assert remove_finished_copies(over.__contains__, str(tmp_path)) == [str(shared)]
    assert not shared.exists() and by_hand.exists()


def test_a_credential_is_refused_by_submit_and_recorded_nowhere(s3_server: S3Server, s3_upload, small_raw: Path, service: Service):
    bucket = s3_upload(small_raw)
    service.env["GPUFEED_ALLOWED_ROOTS"] = f"s3://{bucket.name}/"
    result = service.cli(
        "submit",
        "prepare",
        bucket.url,
        f"s3://{bucket.name}/shards",
        "--storage-option",
        f"secret={SECRET}",
        "--storage-option",
        f"endpoint_url={s3_server.endpoint}",
        "--json",
    )
    assert result.returncode != 0
    assert "secret" in result.stdout + result.stderr and "environment" in result.stdout + result.stderr
    assert SECRET not in result.stdout + result.stderr
    dump = b"".join(
        json.dumps({k.decode(): v.decode(errors="replace") for k, v in service.store.client.hgetall(key).items()}).encode()
        if service.store.client.type(key) == b"hash"
        else key
        for key in service.store.client.keys("*")
    )
    assert SECRET.encode() not in dump


@pytest.mark.parametrize("option", ["key=AKIA-not-shown", "token=not-shown", 'client_kwargs={"aws_secret_access_key": "not-shown"}'])
def test_submit_refuses_every_kind_of_credential(service: Service, tmp_path: Path, option: str):
    result = service.cli("submit", "prepare", str(tmp_path / "raw"), str(tmp_path / "out"), "--storage-option", option)
    assert result.returncode != 0
    assert "not-shown" not in result.stdout + result.stderr
    assert "credentials" in result.stdout + result.stderr
