"""`gpufeed stage` and `stage_dataset`: a dataset copied from a real S3 server on loopback (moto) to local disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pipeline.errors import ConfigError, ManifestError, SourceError, StorageError
from pipeline.manifest import read_manifest, verify_dataset
from pipeline.stage import StageProgress, stage_dataset

if TYPE_CHECKING:
    from s3_fixtures import Bucket, S3Server

pytest_plugins = ["s3_fixtures"]

ROOT = Path(__file__).resolve().parents[1]


def relative_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_stage(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m pipeline stage ARGS` as a user runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "stage", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def endpoint_option(server: S3Server) -> list[str]:
    return ["--storage-option", f"endpoint_url={server.endpoint}"]


def test_staging_from_s3_copies_the_dataset_verified_and_equal(
    s3_server: S3Server, s3_variant_dataset: Path, s3_upload: Callable[[Path], Bucket], tmp_path: Path
) -> None:
    bucket = s3_upload(s3_variant_dataset)
    manifest = read_manifest(s3_variant_dataset)
    seen: list[StageProgress] = []
    result = stage_dataset(
        bucket.url, tmp_path / "dest", workers=4, storage_options=s3_server.storage_options, progress=seen.append
    )
    assert {s.path.split("/")[0] for s in manifest.shards} == {"v0", "v1"}
    assert (result.shards, result.copied, result.already) == (len(manifest.shards), len(manifest.shards), 0)
    assert result.bytes_copied == result.bytes == sum(s.bytes for s in manifest.shards)
    assert result.mb_per_s > 0
    assert relative_files(tmp_path / "dest") == relative_files(s3_variant_dataset)  # manifest and rejected.jsonl too
    assert verify_dataset(tmp_path / "dest").ok
    for shard in manifest.shards:
        assert s3_server.bytes_read(bucket.name, bucket.key(shard.path)) == shard.bytes
    assert seen[-1].shards_done == len(manifest.shards) and seen[-1].bytes_copied == result.bytes


def test_staging_again_copies_only_what_is_missing_or_wrong(
    s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    stage_dataset(s3_bucket.url, dest, storage_options=s3_server.storage_options)
    shards = read_manifest(dest).shards
    (dest / shards[0].path).unlink()
    damaged = bytearray((dest / shards[1].path).read_bytes())
    damaged[100] ^= 0xFF
    (dest / shards[1].path).write_bytes(bytes(damaged))
    s3_server.reset_reads()

    trusting = stage_dataset(s3_bucket.url, dest, verify=False, storage_options=s3_server.storage_options)
    assert (trusting.copied, trusting.already) == (1, len(shards) - 1)  # the damaged one has the right size: kept
    assert not verify_dataset(dest).ok

    again = stage_dataset(s3_bucket.url, dest, storage_options=s3_server.storage_options)
    assert (again.copied, again.already, again.bytes_copied) == (1, len(shards) - 1, shards[1].bytes)
    assert verify_dataset(dest).ok
    shards_read = {key for key in s3_server.reads() if key.endswith(".tar")}
    assert shards_read == {f"{s3_bucket.name}/{s3_bucket.key(s.path)}" for s in shards[:2]}


def test_a_killed_stage_resumes_and_the_manifest_comes_last(
    s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    shards = read_manifest(s3_bucket.local).shards
    s3_server.throttle(60_000)  # half a second a shard
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "stage", s3_bucket.url, str(dest), "--workers", "2", *endpoint_option(s3_server)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while sum((dest / s.path).exists() for s in shards) < 2:
            assert time.monotonic() < deadline and process.poll() is None, "the stage did not copy two shards"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    copied = [s for s in shards if (dest / s.path).exists()]
    assert 2 <= len(copied) < len(shards)
    assert not (dest / "manifest.json").exists()  # not a dataset until every shard is there
    assert [p for p in dest.rglob("*") if ".tmp-" in p.name]  # the copies it was making
    s3_server.throttle(0)
    s3_server.reset_reads()

    result = run_stage(s3_bucket.url, str(dest), "--json", *endpoint_option(s3_server))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["copied"], summary["already"]) == (len(shards) - len(copied), len(copied))
    assert relative_files(dest) == relative_files(s3_bucket.local)  # the killed run's temporary files are gone
    read_back = s3_server.reads()
    for shard in shards:
        assert (f"{s3_bucket.name}/{s3_bucket.key(shard.path)}" in read_back) == (shard not in copied)


def test_a_damaged_source_shard_is_an_error_and_no_manifest_is_written(
    s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path
) -> None:
    shards = read_manifest(s3_bucket.local).shards
    damaged = bytearray((s3_bucket.local / shards[2].path).read_bytes())
    damaged[len(damaged) // 3] ^= 0x01
    s3_bucket.put(shards[2].path, bytes(damaged))
    dest = tmp_path / "dest"
    with pytest.raises(ManifestError, match="does not match the manifest"):
        stage_dataset(s3_bucket.url, dest, storage_options=s3_server.storage_options)
    assert not (dest / "manifest.json").exists()
    assert not (dest / shards[2].path).exists()
    assert not [p for p in dest.rglob("*") if ".tmp-" in p.name]

    result = run_stage(s3_bucket.url, str(dest), *endpoint_option(s3_server))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpufeed: error: ") and "does not match the manifest" in lines[0]
    assert not (dest / "manifest.json").exists()


def test_the_command_prints_the_copy_speed(s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path) -> None:
    result = run_stage(s3_bucket.url, str(tmp_path / "dest"), *endpoint_option(s3_server))
    assert result.returncode == 0, result.stderr
    shards = len(read_manifest(s3_bucket.local).shards)
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"staged {shards} shards, ") and " MB/s; 0 already there" in first
    assert verify_dataset(tmp_path / "dest").ok
    again = run_stage(f"{s3_bucket.url}/manifest.json", str(tmp_path / "dest"), *endpoint_option(s3_server))
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("staged 0 shards, 0 B in ") and f"; {shards} already there" in again.stdout


def test_a_local_dataset_stages_too(s3_dataset: Path, tmp_path: Path) -> None:
    result = stage_dataset(s3_dataset, tmp_path / "dest", workers=2)
    assert result.copied == len(read_manifest(s3_dataset).shards)
    assert relative_files(tmp_path / "dest") == relative_files(s3_dataset)


def test_dest_holding_another_dataset_is_not_a_dataset_until_staged(
    s3_dataset: Path, s3_variant_dataset: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    stage_dataset(s3_variant_dataset, dest)
    damaged = tmp_path / "damaged"
    shutil.copytree(s3_dataset, damaged)
    first = read_manifest(damaged).shards[0].path
    (damaged / first).write_bytes(b"\0" * (damaged / first).stat().st_size)
    with pytest.raises(ManifestError):
        stage_dataset(damaged, dest)
    assert not (dest / "manifest.json").exists()  # the old dataset's manifest went before the copying began


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("gpufeed: error: ")
    return lines[0]


def test_bad_input_is_one_error_line(s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path, get_free_port) -> None:
    empty = f"s3://{s3_bucket.name}/nothing-here"
    assert "no manifest.json" in error_line(run_stage(empty, str(tmp_path / "a"), *endpoint_option(s3_server)))

    unreachable = [
        "--storage-option", f"endpoint_url=http://127.0.0.1:{get_free_port()}",
        "--storage-option", "retries=1",
        "--storage-option", 'config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2}',
    ]
    assert "cannot read" in error_line(run_stage(s3_bucket.url, str(tmp_path / "b"), *unreachable))

    (tmp_path / "file").write_text("not a folder")
    assert "is a file" in error_line(run_stage(s3_bucket.url, str(tmp_path / "file"), *endpoint_option(s3_server)))
    assert "local folder" in error_line(run_stage(s3_bucket.url, s3_bucket.url + "-copy", *endpoint_option(s3_server)))
    assert "KEY=VALUE" in result_stderr(run_stage(s3_bucket.url, str(tmp_path / "c"), "--storage-option", "novalue"))


def result_stderr(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2
    return result.stderr


def test_not_enough_free_space_is_refused_before_copying(
    s3_server: S3Server, s3_bucket: Bucket, small_tmpfs: Path
) -> None:
    with open(small_tmpfs / "ballast", "wb") as ballast:
        ballast.write(b"\0" * (shutil.disk_usage(small_tmpfs).free - 64 * 1024))
    with pytest.raises(StorageError, match="not enough free space"):
        stage_dataset(s3_bucket.url, small_tmpfs / "dest", storage_options=s3_server.storage_options)
    assert list((small_tmpfs / "dest").iterdir()) == []
    assert "not enough free space" in error_line(run_stage(s3_bucket.url, str(small_tmpfs / "dest"), *endpoint_option(s3_server)))


def test_library_errors_are_typed(s3_dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        stage_dataset(s3_dataset, tmp_path / "dest", workers=0)
    with pytest.raises(ManifestError, match="no manifest.json"):
        stage_dataset(tmp_path, tmp_path / "dest")
    escaping = tmp_path / "escaping"
    shutil.copytree(s3_dataset, escaping)
    data = json.loads((escaping / "manifest.json").read_text())
    data["shards"][0]["path"] = "../outside.tar"
    (escaping / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="outside the dataset"):
        stage_dataset(escaping, tmp_path / "dest")
    assert not (tmp_path / "outside.tar").exists()
    with pytest.raises(SourceError):
        stage_dataset("nosuchprotocol://bucket/data", tmp_path / "dest")
