"""`prepare` with SRC, OUT or both on a real S3 server on loopback (moto): the same dataset as a local run."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pipeline import PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset
from pipeline.io.fs import is_secret_option, storage_options_for
from pipeline.manifest import read_manifest, verify_dataset

if TYPE_CHECKING:
    from s3_fixtures import Bucket, S3Server

pytest_plugins = ["s3_fixtures"]

ROOT = Path(__file__).resolve().parents[2]
IMAGES = 12


@pytest.fixture(scope="module")
def raw_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.demo import make_demo_dataset

    raw = tmp_path_factory.mktemp("s3-prepare") / "raw"
    make_demo_dataset(str(raw), IMAGES, min_side=80, max_side=140, workers=1)
    return raw


def spec_of(source: str, out: str) -> PrepareSpec:
    return PrepareSpec(source=source, out=out, resize=ResizeSpec(size=48), shards=ShardSpec(max_samples=5))


def samples_of(shards: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    """key -> member extension -> bytes, the sample json without its `source` (a path here, a URL there)."""
    samples: dict[str, dict[str, Any]] = {}
    for data in shards.values():
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                payload = tar.extractfile(member).read()  # type: ignore[union-attr]
                if ext == "json":
                    meta = json.loads(payload)
                    meta.pop("source", None)
                    payload = meta
                samples.setdefault(key, {})[ext] = payload
    return samples


def local_shards(out: Path) -> dict[str, bytes]:
    return {info.path: (out / info.path).read_bytes() for info in read_manifest(str(out)).shards}


def remote_shards(server: S3Server, url: str) -> dict[str, bytes]:
    fs = server.filesystem()
    root = url.removeprefix("s3://")
    manifest = json.loads(fs.cat_file(f"{root}/manifest.json"))
    return {entry["path"]: fs.cat_file(f"{root}/{entry['path']}") for entry in manifest["shards"]}


@pytest.fixture(scope="module")
def local_run(raw_images: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("s3-prepare-local") / "shards"
    prepare_dataset(spec_of(str(raw_images), str(out)), workers=0)
    return local_shards(out)


def test_prepare_s3_to_local_equals_the_local_run(s3_server, s3_upload, raw_images, local_run, tmp_path):
    bucket: Bucket = s3_upload(raw_images)
    out = tmp_path / "shards"
    result = prepare_dataset(spec_of(bucket.url, str(out)), workers=2, storage_options=s3_server.storage_options)
    assert result.samples == IMAGES and result.rejected == 0
    assert verify_dataset(str(out)).ok
    assert samples_of(local_shards(out)) == samples_of(local_run)
    assert read_manifest(str(out)).source == bucket.url


@pytest.mark.parametrize("arena_bytes", [None, 512])
def test_the_workers_get_the_bytes_through_shared_memory_or_the_pipe_when_it_is_full(
    s3_server, s3_upload, raw_images, local_run, tmp_path, monkeypatch, arena_bytes
):
    from pipeline.prepare import handoff, pool

    if arena_bytes is not None:  # smaller than every image: each one goes through the pool's pipe instead
        monkeypatch.setattr(pool, "ARENA_PER_WORKER", arena_bytes // 2)
    put, closed = [], []  # every range asked for: by a GET reading straight into the arena, or by a copy into it
    monkeypatch.setattr(
        handoff.Arena, "reserve", lambda self, size, _reserve=handoff.Arena.reserve: put.append(_reserve(self, size)) or put[-1]
    )
    monkeypatch.setattr(
        handoff.Arena, "close", lambda self, _close=handoff.Arena.close: closed.append(self.free_bytes() == self.size) or _close(self)
    )
    bucket: Bucket = s3_upload(raw_images)
    out = tmp_path / "shards"
    result = prepare_dataset(spec_of(bucket.url, str(out)), workers=2, storage_options=s3_server.storage_options)
    assert result.samples == IMAGES and result.rejected == 0
    assert samples_of(local_shards(out)) == samples_of(local_run)
    handed = [h for h in put if h is not None]
    assert len(put) == IMAGES and len(handed) == (IMAGES if arena_bytes is None else 0)
    assert closed and all(closed)  # every range given back before the arena closed


def test_a_system_that_refuses_the_shared_arena_gets_the_bytes_through_the_pipe(
    s3_server, s3_upload, raw_images, local_run, tmp_path, monkeypatch
):
    from pipeline.prepare import handoff

    def refuse(self: handoff.Arena, size: int) -> None:
        raise OSError(12, "Cannot allocate memory")  # as mmap does under strict overcommit

    monkeypatch.setattr(handoff.Arena, "__init__", refuse)
    bucket: Bucket = s3_upload(raw_images)
    out = tmp_path / "shards"
    result = prepare_dataset(spec_of(bucket.url, str(out)), workers=2, storage_options=s3_server.storage_options)
    assert result.samples == IMAGES and samples_of(local_shards(out)) == samples_of(local_run)


@pytest.mark.parametrize("workers", [0, 1])
def test_prepare_from_a_slow_store_reads_ahead_and_equals_the_local_run(
    s3_server, s3_upload, raw_images, local_run, tmp_path, monkeypatch, workers
):
    from pipeline.prepare import reads

    on_threads = []  # files read on threads rather than by the one loop of GETs: none, from a store that answers plainly
    monkeypatch.setattr(
        reads.SourceReads, "_read_on_threads", lambda self, item, _read=reads.SourceReads._read_on_threads: on_threads.append(item) or _read(self, item)
    )
    bucket: Bucket = s3_upload(raw_images)
    s3_server.delay(20)  # every request 20 ms late, as from a distant store
    out = tmp_path / "shards"
    result = prepare_dataset(spec_of(bucket.url, str(out)), workers=workers, storage_options=s3_server.storage_options)
    assert result.samples == IMAGES and result.rejected == 0
    assert samples_of(local_shards(out)) == samples_of(local_run)
    assert s3_server.max_in_flight(bucket.name) > 1  # one decoding process, several reads at once
    assert on_threads == []


def test_prepare_without_io_threads_reads_one_file_at_a_time(s3_server, s3_upload, raw_images, local_run, tmp_path):
    bucket: Bucket = s3_upload(raw_images)
    s3_server.delay(5)
    out = tmp_path / "shards"
    spec = spec_of(bucket.url, str(out))
    prepare_dataset(spec, workers=1, storage_options=s3_server.storage_options, io_threads=0)
    assert samples_of(local_shards(out)) == samples_of(local_run)
    assert s3_server.max_in_flight(bucket.name) == 1


@pytest.mark.parametrize("workers", [0, 1])
def test_prepare_read_ahead_rejects_what_reading_in_line_rejects(s3_server, s3_upload, raw_images, tmp_path, workers):
    bucket: Bucket = s3_upload(raw_images)
    names = sorted(path.relative_to(raw_images).as_posix() for path in raw_images.rglob("*") if path.is_file())
    bucket.put(names[0], b"not an image at all")
    sizes = sorted(path.stat().st_size for path in raw_images.rglob("*") if path.is_file())
    limit = sizes[len(sizes) // 2]  # the larger half is over the input limit: rejected when read
    spec = dataclasses.replace(spec_of(bucket.url, str(tmp_path / "unused")), max_file_bytes=limit)

    def rejects(io_threads: int) -> list[dict[str, Any]]:
        out = tmp_path / f"shards-{io_threads}"
        result = prepare_dataset(
            dataclasses.replace(spec, out=str(out)), workers=workers, storage_options=s3_server.storage_options, io_threads=io_threads
        )
        assert result.rejected > 1
        lines = (out / "rejected.jsonl").read_text().splitlines()
        return sorted((json.loads(line) for line in lines), key=json.dumps)

    ahead, in_line = rejects(32), rejects(0)
    assert ahead == in_line
    reasons = {entry.get("reason", "") for entry in ahead}
    assert any("over the" in reason for reason in reasons) and any("cannot read" not in reason for reason in reasons)


def test_prepare_local_to_s3_writes_the_same_shards(s3_server, raw_images, local_run, tmp_path):
    from s3_fixtures import upload

    bucket = upload(s3_server, _empty(tmp_path))  # a bucket of its own, empty
    out = f"s3://{bucket.name}/shards"
    result = prepare_dataset(spec_of(str(raw_images), out), workers=2, storage_options=s3_server.storage_options)
    assert result.samples == IMAGES
    with storage_options_for([out], s3_server.storage_options):
        assert verify_dataset(out).ok
    assert remote_shards(s3_server, out) == local_run  # byte for byte: only OUT differs
    listed = s3_server.filesystem().find(f"{bucket.name}/shards")
    assert not [path for path in listed if "/.gpufeed" in path or ".tmp-" in path]  # work folder and temp objects gone


def test_a_finished_prepare_sweeps_the_temp_objects_crashed_writers_left(s3_server, raw_images, local_run, tmp_path, monkeypatch):
    from s3_fixtures import upload

    from pipeline.prepare import resume

    bucket = upload(s3_server, _empty(tmp_path))
    out, root = f"s3://{bucket.name}/shards", f"{bucket.name}/shards"
    fs = s3_server.filesystem()
    crashed = ["shard-000000.tar.tmp-deadhost-41", "shard-000002.tar.tmp-deadhost-41", "manifest.json.tmp-deadhost-7"]
    others = ["notes.txt.tmp-deadhost-41", "shard-000000.tar.bak"]  # not temp names of the job's files: kept
    for name in crashed + others:
        fs.pipe_file(f"{root}/{name}", b"half an upload")
    monkeypatch.setattr(resume, "STALE_TEMP_OBJECT_S", 0.0)
    prepare_dataset(spec_of(str(raw_images), out), workers=0, storage_options=s3_server.storage_options)
    fs.invalidate_cache()
    left = {path.rsplit("/", 1)[-1] for path in fs.find(root)}
    assert not left & set(crashed)
    assert set(others) <= left
    assert remote_shards(s3_server, out) == local_run  # the final shards and manifest are untouched

    # A fresh temp object may be a live writer's, between its upload and its move: a re-run keeps it ...
    live = f"{root}/shard-000001.tar.tmp-livehost-3"
    fs.pipe_file(live, b"being moved")
    monkeypatch.setattr(resume, "STALE_TEMP_OBJECT_S", 3600.0)
    assert prepare_dataset(spec_of(str(raw_images), out), workers=0, storage_options=s3_server.storage_options).already_complete
    fs.invalidate_cache()
    assert fs.exists(live)
    # ... until it is older than the threshold.
    monkeypatch.setattr(resume, "STALE_TEMP_OBJECT_S", 0.0)
    prepare_dataset(spec_of(str(raw_images), out), workers=0, storage_options=s3_server.storage_options)
    fs.invalidate_cache()
    assert not fs.exists(live)
    with storage_options_for([out], s3_server.storage_options):
        assert verify_dataset(out).ok


def test_prepare_s3_to_s3_equals_the_local_run(s3_server, s3_upload, raw_images, local_run):
    bucket: Bucket = s3_upload(raw_images)
    out = f"s3://{bucket.name}/shards"
    prepare_dataset(spec_of(bucket.url, out), workers=0, storage_options=s3_server.storage_options)
    with storage_options_for([out], s3_server.storage_options):
        assert verify_dataset(out).ok
    assert samples_of(remote_shards(s3_server, out)) == samples_of(local_run)


def test_prepare_command_takes_storage_options_and_never_prints_a_secret(s3_server, s3_upload, raw_images, tmp_path):
    bucket: Bucket = s3_upload(raw_images)
    secret = "sEcReT-0123456789-never-shown"
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    options = ["--storage-option", f"endpoint_url={s3_server.endpoint}", "--storage-option", "key=testing"]
    options += ["--storage-option", f"secret={secret}", "--storage-option", "token=testing"]

    def prepare(source: str, *extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "pipeline", "prepare", source, str(tmp_path / "shards"), "--size", "48", "--json", "-q"]
        return subprocess.run([*command, *extra], capture_output=True, text=True, env=env, timeout=120, check=False)

    missing = prepare("s3://no-such-bucket-here/raw", *options)
    assert missing.returncode != 0 and "no-such-bucket-here" in missing.stdout  # the error is shown, the secret is not
    assert secret not in missing.stdout + missing.stderr
    malformed = prepare(bucket.url, "--storage-option", secret)
    assert malformed.returncode != 0 and "KEY=VALUE" in malformed.stdout + malformed.stderr
    assert secret not in malformed.stdout + malformed.stderr
    done = prepare(bucket.url, *options)  # moto takes any secret: the job runs on what was given, shown nowhere
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["samples"] == IMAGES
    assert secret not in done.stdout + done.stderr
    assert verify_dataset(str(tmp_path / "shards")).ok
    assert not [p for p in (tmp_path / "shards").rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.parametrize(
    ("name", "value", "secret"),
    [
        ("endpoint_url", "http://x", False),
        ("anon", True, False),
        ("profile", "team", False),
        ("key", "AKIA", True),
        ("secret", "s", True),
        ("token", "t", True),
        ("account_key", "k", True),
        ("client_kwargs", {"aws_secret_access_key": "s"}, True),
        ("client_kwargs", {"region_name": "eu-west-1"}, False),
    ],
)
def test_which_storage_options_are_credentials(name, value, secret):
    assert is_secret_option(name, value) is secret


def _empty(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


CLASSES = 20


def test_listing_a_store_lists_the_class_folders_at_once_and_equals_the_sequential_listing(s3_server, tmp_path):
    from s3_fixtures import upload

    from pipeline.prepare.sources import ListingInfo, list_images

    bucket = upload(s3_server, _empty(tmp_path))
    fs = s3_server.filesystem()
    root = f"{bucket.name}/raw"
    for number in range(CLASSES):
        for name in ("b.jpg", "a.png", "c.JPEG", "notes.txt", ".hidden.jpg"):
            fs.pipe_file(f"{root}/class-{number:02d}/{name}", b"x")
    fs.pipe_file(f"{root}/class-07/nested/deeper/z.jpg", b"x")
    fs.pipe_file(f"{root}/class-07/nested/y.webp", b"x")
    fs.pipe_file(f"{root}/beside.jpg", b"x")  # beside the class folders: listed, rejected
    url = f"s3://{root}"
    options = {**s3_server.storage_options, "skip_instance_cache": True}  # a fresh client each time: no listing cache

    def listing(threads: int) -> tuple[list[tuple[str, str, str | None, str]], ListingInfo, int]:
        s3_server.reset_reads()
        info = ListingInfo()
        with storage_options_for([url], options):
            items = [(item.url, item.rel, item.label, item.rejected) for item in list_images(url, info, threads=threads)]
        return items, info, s3_server.max_lists_in_flight(bucket.name)

    s3_server.delay(50)  # every request 50 ms late: a distant store
    sequential, sequential_info, sequential_lists = listing(threads=1)
    concurrent, concurrent_info, concurrent_lists = listing(threads=16)
    assert concurrent == sequential
    assert concurrent_info == sequential_info
    assert sequential_info.classes == [f"class-{number:02d}" for number in range(CLASSES)]
    assert sequential_info.ignored == CLASSES  # one notes.txt a class; hidden files are skipped uncounted
    assert len(sequential) == 1 + CLASSES * 3 + 2
    assert sequential[0][1:] == ("beside.jpg", None, sequential[0][3]) and sequential[0][3]
    assert ("class-07/nested/deeper/z.jpg", "class-07") in [(rel, label) for _, rel, label, _ in sequential]
    assert sequential_lists == 1  # one LIST after another
    assert concurrent_lists >= 4  # the class folders listed at once


def test_a_listing_error_on_the_store_is_a_source_error(s3_server, tmp_path, get_free_port):
    from pipeline.errors import SourceError
    from pipeline.prepare.sources import list_images

    options = {
        "endpoint_url": f"http://127.0.0.1:{get_free_port()}",
        "key": "testing",
        "secret": "testing",
        "skip_instance_cache": True,
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
    }
    url = "s3://nowhere/raw"
    with storage_options_for([url], options), pytest.raises(SourceError, match="cannot reach"):
        list(list_images(url))


@pytest.mark.parametrize("kind", ["folder", "list"])
def test_a_second_listing_in_one_process_lists_what_the_store_holds_now(s3_server, tmp_path, kind):
    """A long-lived process (a service worker, a notebook) lists a source twice while another machine changes it."""
    from s3_fixtures import upload

    from pipeline.prepare.sources import list_images

    bucket = upload(s3_server, _empty(tmp_path))
    other_machine = s3_server.filesystem()
    root = f"{bucket.name}/raw"
    for name in ("a.jpg", "b.jpg"):
        other_machine.pipe_file(f"{root}/cats/{name}", b"x")
    other_machine.pipe_file(f"{root}/dogs/c.jpg", b"x")
    url = f"s3://{root}"
    if kind == "list":
        other_machine.pipe_file(f"{root}/list.csv", b"path\ncats/a.jpg\ncats/b.jpg\n")
        url = f"{url}/list.csv"

    def listing() -> list[str]:
        with storage_options_for([url], s3_server.storage_options):  # the process's one cached client, as in a job
            return [item.rel for item in list_images(url)]

    first = listing()
    assert first == (["cats/a.jpg", "cats/b.jpg", "dogs/c.jpg"] if kind == "folder" else ["cats/a.jpg", "cats/b.jpg"])
    other_machine.rm_file(f"{root}/cats/a.jpg")
    other_machine.pipe_file(f"{root}/dogs/d.jpg", b"x")
    if kind == "list":
        other_machine.pipe_file(f"{root}/list.csv", b"path\ncats/b.jpg\ndogs/c.jpg\ndogs/d.jpg\n")
    assert listing() == ["cats/b.jpg", "dogs/c.jpg", "dogs/d.jpg"]


def test_output_on_a_store_answers_for_what_it_holds_now_not_what_this_process_listed(s3_server, tmp_path):
    from s3_fixtures import upload

    from pipeline.io.output import Output

    bucket = upload(s3_server, _empty(tmp_path))
    other_machine = s3_server.filesystem()
    root = f"{bucket.name}/ds"
    other_machine.pipe_file(f"{root}/shards/a.tar", b"x" * 10)
    other_machine.pipe_file(f"{root}/v1/b.tar", b"y")
    with storage_options_for([f"s3://{root}"], s3_server.storage_options):
        output = Output(f"s3://{root}")
        assert output.file_sizes() == {"shards/a.tar": 10, "v1/b.tar": 1}  # s3fs keeps this listing
        other_machine.rm_file(f"{root}/shards/a.tar")
        other_machine.rm_file(f"{root}/v1/b.tar")
        other_machine.pipe_file(f"{root}/v2/c.tar", b"zz")
        assert not output.exists("shards/a.tar")
        assert output.size("shards/a.tar") is None
        assert output.size("v2/c.tar") == 2
        assert output.listdir() == ["v2"]
        assert output.listdir("v1") == []
        assert output.file_sizes() == {"v2/c.tar": 2}


def test_a_second_run_in_one_process_rewrites_a_shard_deleted_since_the_first(s3_server, raw_images, local_run, tmp_path):
    """A long-lived worker finishes a job, someone deletes a shard, the same job comes again: it is repaired."""
    from s3_fixtures import upload

    bucket = upload(s3_server, _empty(tmp_path))
    out = f"s3://{bucket.name}/shards"
    spec = spec_of(str(raw_images), out)
    assert prepare_dataset(spec, workers=0, storage_options=s3_server.storage_options).samples == IMAGES
    assert prepare_dataset(spec, workers=0, storage_options=s3_server.storage_options).already_complete
    lost = sorted(local_run)[1]
    s3_server.filesystem().rm_file(f"{bucket.name}/shards/{lost}")
    again = prepare_dataset(spec, workers=0, storage_options=s3_server.storage_options)
    assert again.samples == IMAGES
    assert remote_shards(s3_server, out) == local_run  # the deleted shard is there again, byte for byte


def test_a_finish_on_a_machine_of_its_own_does_not_download_the_listing(s3_server, raw_images, local_run, tmp_path, monkeypatch):
    """The finish reads no source: the listing (100 MB and more for a million images) stays on the store."""
    import tempfile

    from s3_fixtures import upload

    from pipeline.prepare.job import finish_prepare, plan_prepare, write_prepare_shard

    bucket = upload(s3_server, _empty(tmp_path))
    out = f"s3://{bucket.name}/shards"
    spec = spec_of(str(raw_images), out)
    with storage_options_for([out], s3_server.storage_options):
        plan = plan_prepare(spec)
        for shard in plan.pending:
            write_prepare_shard(spec, shard)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "finishing-machine"))  # a staging folder of its own
        (tmp_path / "finishing-machine").mkdir()
        s3_server.reset_reads()
        manifest = finish_prepare(spec)
        read = s3_server.reads()
    assert manifest.samples == IMAGES
    assert not [key for key in read if "listing" in key], read
    assert len([key for key in read if "/.gpufeed/shards/" in key]) == plan.shards  # it read every shard's record
    assert remote_shards(s3_server, out) == local_run


def test_a_shard_step_on_a_store_reads_its_record_beside_the_plan_and_only_once(s3_server, raw_images, tmp_path):
    """Each step of a service job first reads the plan and the shard's record: one round trip for both, not two."""
    from s3_fixtures import upload

    from pipeline.prepare.job import plan_prepare, write_prepare_shard

    bucket = upload(s3_server, _empty(tmp_path))
    out = f"s3://{bucket.name}/shards"
    spec = spec_of(str(raw_images), out)
    record = f"{bucket.name}/shards/.gpufeed/shards/000000.json"
    with storage_options_for([out], s3_server.storage_options):
        plan_prepare(spec)
        first = write_prepare_shard(spec, 0)
        s3_server.delay(50)  # both GETs are in flight at once only if they are sent together
        try:
            s3_server.reset_reads()
            again = write_prepare_shard(spec, 0)  # a re-delivered step: the shard is complete, left as it is
            read, most = s3_server.reads(), s3_server.max_in_flight(bucket.name)
        finally:
            s3_server.delay(0)
    assert not first.skipped and again.skipped and (again.samples, again.rejected) == (first.samples, first.rejected)
    assert most >= 2
    assert read[record]["gets"] == 1, read  # the skip answers from the record it read first


def test_a_new_plan_on_a_store_reads_no_shard_record_and_a_step_sends_its_record_beside_its_shard(s3_server, raw_images, tmp_path):
    """Round trips a distant store charges every job: none for records a new plan cannot have, one for a shard and its record."""
    from s3_fixtures import upload

    from pipeline.prepare.job import finish_prepare, plan_prepare, write_prepare_shard

    bucket = upload(s3_server, _empty(tmp_path))
    out = f"s3://{bucket.name}/shards"
    spec = spec_of(str(raw_images), out)
    with storage_options_for([out], s3_server.storage_options):
        s3_server.reset_reads()
        plan = plan_prepare(spec)
        assert plan.pending == list(range(plan.shards)) and plan.shards >= 2
        assert not [key for key in s3_server.reads() if "/.gpufeed/shards/" in key]  # a new plan has no records to read
        s3_server.delay(50)  # the shard and its record are taken in at once only if they are sent together
        try:
            s3_server.reset_reads()
            write_prepare_shard(spec, 0)
            most = s3_server.max_writes_in_flight(bucket.name)
        finally:
            s3_server.delay(0)
        assert most >= 2
        assert plan_prepare(spec).pending == list(range(1, plan.shards))  # a resumed plan reads the records
        for shard in range(1, plan.shards):
            write_prepare_shard(spec, shard)
        finish_prepare(spec)
        assert verify_dataset(out).ok
    left = s3_server.filesystem().find(f"{bucket.name}/shards")
    assert left and not [path for path in left if "/.gpufeed" in path]  # the work folder went, in one listing and one delete


def test_small_uploads_go_in_one_round_trip_without_waiting_for_a_go_ahead(s3_server, tmp_path, monkeypatch):
    """botocore asks for "Expect: 100-continue" on every PUT of a file: a round trip more before the body goes."""
    from s3_fixtures import upload

    from pipeline.io.output import Output

    bucket = upload(s3_server, _empty(tmp_path))
    sent: list[dict[str, Any]] = []
    with storage_options_for([f"s3://{bucket.name}/ds"], s3_server.storage_options):
        output = Output(f"s3://{bucket.name}/ds")
        output.write_bytes_atomic("first.json", b"{}")  # the client gets its hook on the first upload
        output.fs.s3.meta.events.register_last("before-send.s3.PutObject", lambda request, **_: sent.append(dict(request.headers)))
        output.write_bytes_atomic("small.json", b"x" * 100)
        monkeypatch.setattr("pipeline.io.fs.LEAN_PUT_BYTES", 10, raising=False)
        output.write_bytes_atomic("large.json", b"y" * 100)
    assert [any(name.lower() == "expect" for name in headers) for headers in sent] == [False, True]
    other_machine = s3_server.filesystem()
    assert other_machine.cat_file(f"{bucket.name}/ds/small.json") == b"x" * 100
    assert other_machine.cat_file(f"{bucket.name}/ds/large.json") == b"y" * 100


def test_prepare_in_aspect_order_from_a_store_to_a_store_equals_the_local_run(s3_server, s3_upload, raw_images, tmp_path):
    """The headers come from the store (ranged reads), the sorted listing goes through OUT's work folder."""
    local = tmp_path / "local"
    prepare_dataset(dataclasses.replace(spec_of(str(raw_images), str(local)), order="aspect"), workers=0)
    bucket: Bucket = s3_upload(raw_images)
    out = f"s3://{bucket.name}/sorted"
    prepare_dataset(dataclasses.replace(spec_of(bucket.url, out), order="aspect"), workers=2,
                    storage_options=s3_server.storage_options)  # fmt: skip
    remote, here = remote_shards(s3_server, out), local_shards(local)
    in_order = {path: list(samples_of({path: data})) for path, data in here.items()}
    assert {path: list(samples_of({path: data})) for path, data in remote.items()} == in_order
    assert samples_of(remote) == samples_of(here)
