"""Faults of the object store while a prepare writes to it (moto on loopback): refused writes, a restart.

What must hold whatever happens: no manifest on the store lists a shard that is missing
or whose size or sha256 differ, no partial object is ever visible under a final shard
name, and no multipart upload is left in progress once a job has retried or finished.
A job either finishes (and verifies) or stops with a clear one-line error.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pipeline import PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset
from pipeline.errors import StorageError
from pipeline.io.fs import storage_options_for
from pipeline.io.output import Output
from pipeline.manifest import read_manifest, verify_dataset

if TYPE_CHECKING:
    from s3_fixtures import Bucket, S3Server
    from service_harness import Service

pytest_plugins = ["s3_fixtures", "service_fixtures"]

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
PART = 5 * MiB  # the smallest part S3 (and moto) takes
IMAGES = 24
PER_SHARD = 3  # 8 shards
SIZE = 48


def multipart_uploads(server: S3Server, bucket: str) -> list[dict[str, Any]]:
    """The multipart uploads in progress in a bucket, as the store lists them."""
    page = server.filesystem().call_s3("list_multipart_uploads", Bucket=bucket)
    return list(page.get("Uploads") or [])


def objects(server: S3Server, root: str) -> dict[str, int]:
    """Every object under `root` (``bucket/prefix``) with its size."""
    found = server.filesystem().find(root, detail=True)
    return {path: int(info["size"]) for path, info in found.items() if info.get("type") != "directory"}


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.01)
    return value


def empty_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir(exist_ok=True)
    return folder


# ---------------------------------------------------------------------------
# A multipart upload cut short


def publish_cut_short(server: S3Server, bucket: Bucket, output: Output, rel: str) -> list[BaseException]:
    """Publish `rel` (a file of several parts) while the store takes the right to write away between
    two parts: the next part, the abort and the clean-up are refused. Returns what the publish raised."""
    server.throttle_uploads(8 * MiB)  # about 2 s for a 16 MiB file: the test acts between parts
    failure: list[BaseException] = []

    def publish() -> None:
        try:
            output.publish(rel)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            failure.append(exc)

    uploader = threading.Thread(target=publish)
    try:
        uploader.start()
        wait_for(lambda: multipart_uploads(server, bucket.name), "multipart upload")
        wait_for(lambda: f"{output.remote_root}/{rel}" in server.uploading(), "part being uploaded")
        server.refuse_writes(True)
        uploader.join(timeout=60)
    finally:
        server.refuse_writes(False)
        server.throttle_uploads(0)
    assert not uploader.is_alive()
    return failure


def test_a_multipart_upload_cut_short_is_aborted_and_a_retry_leaves_none_in_progress(
    s3_server: S3Server, s3_upload: Callable[[Path], Bucket], tmp_path: Path
) -> None:
    bucket = s3_upload(empty_folder(tmp_path))
    url = f"s3://{bucket.name}/shards"
    with storage_options_for([url], s3_server.storage_options):
        output = Output(url, part_bytes=PART)
        output.makedirs()
        data = os.urandom(3 * PART + MiB)  # four parts
        Path(output.local("big.tar")).write_bytes(data)
        failure = publish_cut_short(s3_server, bucket, output, "big.tar")
        assert len(failure) == 1 and isinstance(failure[0], StorageError), failure
        message = str(failure[0])
        assert "upload big.tar to" in message and "\n" not in message
        left = multipart_uploads(s3_server, bucket.name)
        assert [upload["Key"] for upload in left] == ["shards/big.tar"]  # its parts kept, unseen
        assert f"{bucket.name}/shards/big.tar" not in objects(s3_server, bucket.name)  # no object until an upload completes
        assert Path(output.local("big.tar")).read_bytes() == data  # the local file is kept for the retry

        output.publish("big.tar")  # the store takes writes again: the retry goes up and cleans up what was left

    assert multipart_uploads(s3_server, bucket.name) == []
    assert s3_server.filesystem().cat_file(f"{bucket.name}/shards/big.tar") == data
    assert list(objects(s3_server, bucket.name)) == [f"{bucket.name}/shards/big.tar"]


def test_an_upload_that_fails_over_an_earlier_copy_keeps_that_copy(
    s3_server: S3Server, s3_upload: Callable[[Path], Bucket], tmp_path: Path
) -> None:
    # On S3 a file is uploaded under its final name: what a failed upload leaves is parts, never
    # an object, and the clean-up aborts them without touching the complete copy already there.
    bucket = s3_upload(empty_folder(tmp_path))
    url = f"s3://{bucket.name}/shards"
    earlier, later = os.urandom(3 * PART + MiB), os.urandom(3 * PART + MiB)
    with storage_options_for([url], s3_server.storage_options):
        output = Output(url, part_bytes=PART)
        output.makedirs()
        Path(output.local("big.tar")).write_bytes(earlier)
        output.publish("big.tar")
        Path(output.local("big.tar")).write_bytes(later)
        failure = publish_cut_short(s3_server, bucket, output, "big.tar")
        assert len(failure) == 1 and isinstance(failure[0], StorageError), failure
        assert s3_server.filesystem().cat_file(f"{bucket.name}/shards/big.tar") == earlier  # still the whole earlier copy

        Path(output.local("other.tar")).write_bytes(b"another member")
        output.publish("other.tar")  # the next publish cleans up what the failed one left: its parts only

    assert multipart_uploads(s3_server, bucket.name) == []
    assert s3_server.filesystem().cat_file(f"{bucket.name}/shards/big.tar") == earlier
    assert sorted(objects(s3_server, bucket.name)) == [f"{bucket.name}/shards/big.tar", f"{bucket.name}/shards/other.tar"]


def test_publishing_and_reading_a_small_file_on_s3_is_one_request_each(
    s3_server: S3Server, s3_upload: Callable[[Path], Bucket], tmp_path: Path
) -> None:
    # A shard task publishes a shard and its record and reads the plan and records: against a
    # store 20 ms away every extra request (a temp name's copy and delete, a HEAD before a GET)
    # is time the workers wait.
    bucket = s3_upload(empty_folder(tmp_path))
    url = f"s3://{bucket.name}/shards"
    with storage_options_for([url], s3_server.storage_options):
        output = Output(url)
        output.makedirs()
        Path(output.local("shard-000000.tar")).write_bytes(b"x" * 4096)
        s3_server.reset_reads()
        output.publish("shard-000000.tar")
        assert s3_server.requests() == {"PUT": 1}
        assert list(objects(s3_server, bucket.name)) == [f"{bucket.name}/shards/shard-000000.tar"]

        s3_server.reset_reads()
        assert output.read_bytes("shard-000000.tar") == b"x" * 4096
        assert output.read_if_exists("nothing.json") is None
        assert s3_server.requests() == {"GET": 2}
        with pytest.raises(FileNotFoundError):
            output.read_bytes("nothing.json")


def test_a_finished_prepare_aborts_the_uploads_left_in_progress_under_out(
    s3_server: S3Server, s3_upload: Callable[[Path], Bucket], raw_images: Path, tmp_path: Path
) -> None:
    bucket = s3_upload(empty_folder(tmp_path))
    out = f"s3://{bucket.name}/shards"
    fs = s3_server.filesystem()
    # What a writer killed mid-upload leaves: a multipart upload with a part, never completed or aborted.
    for key in ("shards/shard-000001.tar.tmp-elsewhere-1", "other/keep.bin"):
        started = fs.call_s3("create_multipart_upload", Bucket=bucket.name, Key=key)
        fs.call_s3("upload_part", Bucket=bucket.name, Key=key, UploadId=started["UploadId"], PartNumber=1, Body=b"x" * 1024)
    prepare_dataset(spec_of(str(raw_images), out), workers=0, storage_options=s3_server.storage_options)
    assert [upload["Key"] for upload in multipart_uploads(s3_server, bucket.name)] == ["other/keep.bin"]  # outside OUT: not its own
    with storage_options_for([out], s3_server.storage_options):
        assert verify_dataset(out).ok


# ---------------------------------------------------------------------------
# The store restarted (empty) while shards are being uploaded


@pytest.fixture(scope="module")
def raw_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.demo import make_demo_dataset

    raw = tmp_path_factory.mktemp("faults") / "raw"
    make_demo_dataset(str(raw), IMAGES, min_side=80, max_side=140, workers=1)
    return raw


@pytest.fixture(scope="module")
def reference(raw_images: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The shards of the same job on local disk: what every shard on the store must be, byte for byte."""
    out = tmp_path_factory.mktemp("faults-local") / "shards"
    prepare_dataset(spec_of(str(raw_images), str(out)), workers=0)
    return {info.path: (out / info.path).read_bytes() for info in read_manifest(str(out)).shards}


def spec_of(source: str, out: str) -> PrepareSpec:
    return PrepareSpec(source=source, out=out, resize=ResizeSpec(size=SIZE), shards=ShardSpec(max_samples=PER_SHARD))


@pytest.fixture
def own_server(s3_server: S3Server, tmp_path: Path) -> Iterator[S3Server]:
    """A server of this test's own, free to stop and restart (the session's keeps its buckets); credentials as for the session's."""
    from s3_fixtures import S3Server as Server

    folder = tmp_path / "own-s3"
    folder.mkdir()
    server = Server(folder).start()
    try:
        yield server
    finally:
        server.stop()


def restart_mid_upload(server: S3Server, bucket: str) -> str:
    """Once shard 0 is on the store and a later shard is going up, stop the server, start it again (empty), recreate the bucket.

    Returns:
        The key that was being uploaded when the server stopped.
    """
    fs = server.filesystem()

    def later_shard_going_up() -> str:
        going = [key for key in server.uploading() if "/shard-" in key and "shard-000000" not in key]
        return going[0] if going and fs.exists(f"{bucket}/shards/shard-000000.tar") else ""

    interrupted = str(wait_for(later_shard_going_up, "shard upload after the first"))
    server.stop()
    time.sleep(0.5)
    server.start()
    server.filesystem().mkdir(bucket)  # the store is back, empty, its bucket made again
    return interrupted


def assert_store_consistent(server: S3Server, bucket: str, reference: dict[str, bytes]) -> bool:
    """What the store holds after the fault: no partial shard under a final name, no manifest that lies.

    Returns:
        Whether the store holds a manifest (it then verifies, sha256 included).
    """
    fs = server.filesystem()
    held = objects(server, bucket)
    for path, size in held.items():
        name = path.rsplit("/", 1)[-1]
        if name.startswith("shard-") and name.endswith(".tar"):  # a final name: the whole shard, as the local run wrote it
            assert fs.cat_file(path) == reference[name], f"{path} is not the complete shard"
            assert size == len(reference[name])
    manifest_path = f"{bucket}/shards/manifest.json"
    if manifest_path not in held:
        return False
    manifest = json.loads(fs.cat_file(manifest_path))
    for entry in manifest["shards"]:
        data = fs.cat_file(f"{bucket}/shards/{entry['path']}")  # raises if the manifest lists a missing shard
        assert len(data) == entry["bytes"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert data == reference[entry["path"]]
    assert sorted(entry["path"] for entry in manifest["shards"]) == sorted(reference)
    return True


def samples_of(shards: dict[str, bytes]) -> dict[str, bytes]:
    members: dict[str, bytes] = {}
    for data in shards.values():
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                members[member.name] = tar.extractfile(member).read()  # type: ignore[union-attr]
    return members


def run_again_and_verify(server: S3Server, bucket: str, raw: Path, reference: dict[str, bytes]) -> None:
    """The same job run again on the store that came back: it finishes, and the dataset verifies."""
    out = f"s3://{bucket}/shards"
    server.throttle_uploads(0)
    prepare_dataset(spec_of(str(raw), out), workers=0, storage_options=server.storage_options)
    with storage_options_for([out], server.storage_options):
        result = verify_dataset(out)
    assert result.ok, result.problems
    assert assert_store_consistent(server, bucket, reference)
    left = [path for path in objects(server, bucket) if ".tmp-" in path or "/.gpufeed" in path]
    assert left == []
    assert multipart_uploads(server, bucket) == []


def test_a_store_restarted_mid_upload_never_gets_a_manifest_of_lost_shards(
    own_server: S3Server, raw_images: Path, reference: dict[str, bytes]
) -> None:
    bucket = "gpufeed-restart-api"
    own_server.filesystem().mkdir(bucket)
    own_server.throttle_uploads(20_000)  # a shard takes about half a second to go up
    out = f"s3://{bucket}/shards"
    outcome: list[BaseException | None] = []

    def prepare() -> None:
        try:
            prepare_dataset(spec_of(str(raw_images), out), workers=0, storage_options=own_server.storage_options)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    job = threading.Thread(target=prepare)
    job.start()
    try:
        restart_mid_upload(own_server, bucket)
    finally:
        job.join(timeout=300)
    assert not job.is_alive() and len(outcome) == 1
    error = outcome[0]
    if error is not None:  # it stopped: with the error the API promises, said in one line
        assert isinstance(error, StorageError), repr(error)
        assert "\n" not in str(error) and bucket in str(error)
    has_manifest = assert_store_consistent(own_server, bucket, reference)
    assert has_manifest == (error is None)
    if error is None:
        return
    run_again_and_verify(own_server, bucket, raw_images, reference)


def test_the_prepare_command_on_a_store_restarted_mid_upload_stops_in_one_line_or_finishes(
    own_server: S3Server, raw_images: Path, reference: dict[str, bytes], tmp_path: Path
) -> None:
    bucket = "gpufeed-restart-cli"
    own_server.filesystem().mkdir(bucket)
    own_server.throttle_uploads(20_000)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["TMPDIR"] = str(tmp_path)  # the staging folder of this run alone
    command = [sys.executable, "-m", "pipeline", "prepare", str(raw_images), f"s3://{bucket}/shards", "--size", str(SIZE)]
    command += ["--shard-samples", str(PER_SHARD), "--workers", "0", "-q"]
    for name, value in own_server.storage_options.items():
        command += ["--storage-option", f"{name}={value}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        restart_mid_upload(own_server, bucket)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "Traceback" not in stdout + stderr
    if process.returncode != 0:
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("gpufeed: error: "), stderr
        assert bucket in lines[0]
    has_manifest = assert_store_consistent(own_server, bucket, reference)
    assert has_manifest == (process.returncode == 0)
    if process.returncode == 0:
        return
    run_again_and_verify(own_server, bucket, raw_images, reference)


def test_a_service_job_on_a_store_restarted_mid_upload_fails_in_one_line_or_verifies(
    own_server: S3Server, service: Service, raw_images: Path, reference: dict[str, bytes], tmp_path: Path
) -> None:
    bucket = "gpufeed-restart-service"
    own_server.filesystem().mkdir(bucket)
    out = f"s3://{bucket}/shards"
    service.env["GPUFEED_ALLOWED_ROOTS"] = f"{raw_images.parent},s3://{bucket}/"
    machine = tmp_path / "machine"
    machine.mkdir()
    service.start_worker("w1", env={"TMPDIR": str(machine)})  # one worker: its own staging folder
    own_server.throttle_uploads(20_000)
    flags = ["--size", str(SIZE), "--shard-samples", str(PER_SHARD), "--storage-option", f"endpoint_url={own_server.endpoint}"]
    job = service.submit("prepare", str(raw_images), out, *flags)
    restart_mid_upload(own_server, bucket)
    record = service.wait_finished(job, timeout=240)
    assert record.state in ("succeeded", "failed"), record.to_status()
    if record.state == "failed":  # stopped: why, in one line
        assert record.error and "\n" not in record.error and "Traceback" not in record.error
        assert "internal error" not in record.error, record.error
    has_manifest = assert_store_consistent(own_server, bucket, reference)
    assert has_manifest == (record.state == "succeeded"), record.error
    if record.state == "failed":
        run_again_and_verify(own_server, bucket, raw_images, reference)
