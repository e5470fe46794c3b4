"""Output (local and fsspec), device detection and free space."""

from __future__ import annotations

import errno
import os
import shutil
import uuid

import pytest

from pipeline.errors import StorageError
from pipeline.io.devices import DeviceInfo, device_info, faster_local_disk, free_bytes
from pipeline.io.output import Output

KINDS = {"nvme", "ssd", "rotational", "network", "memory", "unknown"}


# ---------------------------------------------------------------------------
# Local output


def test_local_output_paths(tmp_path):
    out = Output(str(tmp_path) + "/")
    assert out.is_local
    assert out.url == str(tmp_path)
    assert out.root == str(tmp_path)
    assert out.local("a/b.tar") == os.path.join(str(tmp_path), "a", "b.tar")
    assert Output(f"file://{tmp_path}").root == str(tmp_path)


def test_local_write_bytes_atomic(tmp_path):
    out = Output(str(tmp_path / "out"))
    out.write_bytes_atomic("manifest.json", b'{"a": 1}')
    assert (tmp_path / "out" / "manifest.json").read_bytes() == b'{"a": 1}'
    assert out.exists("manifest.json")
    assert out.size("manifest.json") == 8
    assert out.read_bytes("manifest.json") == b'{"a": 1}'
    with out.open_read("manifest.json") as handle:
        assert handle.read() == b'{"a": 1}'
    assert out.listdir() == ["manifest.json"]  # no temp file left behind


def test_local_write_bytes_atomic_replaces_and_makes_folders(tmp_path):
    out = Output(str(tmp_path))
    out.write_bytes_atomic("sub/deeper/x.json", b"old")
    out.write_bytes_atomic("sub/deeper/x.json", b"new!")
    assert out.read_bytes("sub/deeper/x.json") == b"new!"
    assert out.size("sub/deeper/x.json") == 4
    assert out.listdir("sub/deeper") == ["x.json"]
    assert out.listdir("sub") == ["deeper"]


def test_local_write_failure_is_storage_error_and_leaves_no_temp(tmp_path, monkeypatch):
    out = Output(str(tmp_path))

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(StorageError, match="no space left"):
        out.write_bytes_atomic("manifest.json", b"{}")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_local_write_into_a_file_is_storage_error(tmp_path):
    (tmp_path / "blocker").write_bytes(b"")
    out = Output(str(tmp_path / "blocker"))
    with pytest.raises(StorageError, match="cannot write"):
        out.write_bytes_atomic("x.json", b"{}")


def test_local_missing(tmp_path):
    out = Output(str(tmp_path))
    assert not out.exists("nope.tar")
    assert out.size("nope.tar") is None
    assert out.listdir("nope") == []
    assert Output(str(tmp_path / "absent")).listdir() == []
    with pytest.raises(OSError):
        out.read_bytes("nope.tar")


def test_local_remove(tmp_path):
    out = Output(str(tmp_path))
    out.write_bytes_atomic("a.json", b"1")
    out.write_bytes_atomic("d/b.json", b"2")
    out.write_bytes_atomic("d/e/c.json", b"3")
    out.remove("a.json")
    assert not out.exists("a.json")
    out.remove("d")  # folders go with everything in them
    assert not out.exists("d")
    out.remove("never-there")  # no error for what is already gone
    assert out.listdir() == []


def test_local_makedirs_and_publish_is_a_no_op(tmp_path):
    out = Output(str(tmp_path / "new" / "out"))
    out.makedirs()
    assert os.path.isdir(tmp_path / "new" / "out")
    with open(out.local("shard.tar"), "wb") as handle:
        handle.write(b"x" * 10)
    out.publish("shard.tar")
    assert out.exists("shard.tar") and out.size("shard.tar") == 10


def test_local_makedirs_failure_is_storage_error(tmp_path):
    (tmp_path / "blocker").write_bytes(b"")
    with pytest.raises(StorageError, match="cannot create output folder"):
        Output(str(tmp_path / "blocker" / "out")).makedirs()


# ---------------------------------------------------------------------------
# fsspec output (memory://)


@pytest.fixture
def memory_output():
    out = Output(f"memory://gpufeed-test-{uuid.uuid4().hex}/out")
    out.makedirs()
    yield out
    out.remove("")
    shutil.rmtree(out.staging, ignore_errors=True)


def test_memory_output_stages_locally(memory_output):
    out = memory_output
    assert not out.is_local
    assert os.path.isdir(out.staging)
    assert out.local("x.tar").startswith(out.staging + os.sep)


def test_memory_publish_of_a_staged_file(memory_output):
    out = memory_output
    os.makedirs(os.path.dirname(out.local("v0/shard-000000.tar")), exist_ok=True)
    with open(out.local("v0/shard-000000.tar"), "wb") as handle:
        handle.write(b"tar bytes" * 100)
    assert not out.exists("v0/shard-000000.tar")
    out.publish("v0/shard-000000.tar")
    assert out.exists("v0/shard-000000.tar")
    assert out.size("v0/shard-000000.tar") == 900
    assert out.read_bytes("v0/shard-000000.tar") == b"tar bytes" * 100
    with out.open_read("v0/shard-000000.tar") as handle:
        assert handle.read(9) == b"tar bytes"
    assert not os.path.exists(out.local("v0/shard-000000.tar"))  # the staged copy is gone
    assert out.listdir() == ["v0"]
    assert out.listdir("v0") == ["shard-000000.tar"]  # no temp name left on the remote
    assert out.fs.exists(f"{out.remote_root}/v0/shard-000000.tar")


def test_memory_write_bytes_atomic(memory_output):
    out = memory_output
    out.write_bytes_atomic("manifest.json", b"{}")
    out.write_bytes_atomic("manifest.json", b'{"v": 2}')
    assert out.read_bytes("manifest.json") == b'{"v": 2}'
    assert out.listdir() == ["manifest.json"]
    assert not os.path.exists(out.local("manifest.json"))


def test_memory_remove_and_missing(memory_output):
    out = memory_output
    out.write_bytes_atomic("a.json", b"1")
    out.write_bytes_atomic("d/b.json", b"2")
    assert out.size("missing.json") is None
    assert out.listdir("missing") == []
    out.remove("a.json")
    out.remove("d")
    out.remove("missing.json")
    assert not out.exists("a.json") and not out.exists("d/b.json")
    assert out.listdir() == []


def test_memory_publish_failure_is_storage_error(memory_output, monkeypatch):
    out = memory_output
    with open(out.local("x.tar"), "wb") as handle:
        handle.write(b"x")

    def refuse(*args, **kwargs):
        raise OSError(errno.EIO, "upload failed")

    monkeypatch.setattr(out.fs, "put_file", refuse)
    with pytest.raises(StorageError, match="cannot upload x.tar"):
        out.publish("x.tar")
    assert os.path.exists(out.local("x.tar"))  # kept for the retry


# ---------------------------------------------------------------------------
# Device and free space


def test_device_info_of_a_tmp_path(tmp_path):
    info = device_info(str(tmp_path))
    assert isinstance(info, DeviceInfo)
    assert info.kind in KINDS
    assert info.fstype and info.fstype != ""
    assert info.mount_point and str(tmp_path).startswith(info.mount_point.rstrip("/"))


def test_device_info_of_a_path_not_yet_created(tmp_path):
    info = device_info(str(tmp_path / "not" / "yet"))
    assert info == device_info(str(tmp_path))


def test_device_info_of_a_file_url(tmp_path):
    assert device_info(f"file://{tmp_path}") == device_info(str(tmp_path))


def test_device_info_of_proc_and_shm():
    assert device_info("/proc/self").fstype == "proc"
    if os.path.isdir("/dev/shm") and device_info("/dev/shm").fstype == "tmpfs":
        assert device_info("/dev/shm").kind == "memory"


@pytest.mark.parametrize("url", ["s3://bucket/data", "gs://bucket/x", "memory://x/out", "https://host/d"])
def test_device_info_of_a_remote_url(url):
    info = device_info(url)
    assert info.kind == "network"
    assert info.fstype == url.split("://")[0]


@pytest.mark.parametrize(
    ("fstype", "source", "kind"),
    [
        ("nfs4", "server:/export", "network"),
        ("cifs", "//server/share", "network"),
        ("fuse.sshfs", "me@host:", "network"),
        ("fuse.somethingnew", "thing", "network"),
        ("tmpfs", "tmpfs", "memory"),
        ("ramfs", "none", "memory"),
        ("overlay", "overlay", "unknown"),
        ("ext4", "/dev/nvme0n1p2", "nvme"),
    ],
)
def test_device_kind_from_the_mount_table(monkeypatch, fstype, source, kind):
    import pipeline.io.devices as storage

    monkeypatch.setattr(storage, "_mount_for", lambda path: ("/mnt/data", fstype, source))
    info = device_info("/mnt/data/out")
    assert info.kind == kind
    assert info.fstype == fstype


def test_faster_local_disk_is_an_nvme_name_or_none():
    name = faster_local_disk()
    assert name is None or name.startswith("nvme")


def test_free_bytes(tmp_path):
    free = free_bytes(str(tmp_path))
    assert isinstance(free, int) and free > 0
    assert free_bytes(str(tmp_path / "not" / "yet")) == pytest.approx(free, rel=0.05)
    assert free_bytes(f"file://{tmp_path}") == pytest.approx(free, rel=0.05)
    assert free_bytes("s3://bucket/data") is None


def test_urls_in_messages_lose_their_user_information_and_signatures():
    from pipeline.io.fs import redact_urls

    text = "cannot open https://KEY:SECRET@h/l.csv?X-Amz-Signature=SIG&v=2: 403 (see 's3://b/k?token=TOK')."
    assert redact_urls(text) == "cannot open https://***:***@h/l.csv?X-Amz-Signature=***&v=2: 403 (see 's3://b/k?token=***')."
    assert redact_urls("/data/raw?x=1 and no URL") == "/data/raw?x=1 and no URL"


@pytest.mark.parametrize("as_json", [False, True])
def test_prepare_of_a_url_with_credentials_never_prints_them(tmp_path, get_free_port, as_json):
    import subprocess
    import sys

    src = f"https://KEYID:PASSWORD@127.0.0.1:{get_free_port()}/list.csv?X-Amz-Credential=CRED&X-Amz-Signature=SIG"
    args = [sys.executable, "-m", "pipeline", "prepare", src, str(tmp_path / "out")] + (["--json"] if as_json else [])
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    shown = result.stdout + result.stderr
    assert result.returncode != 0 and "127.0.0.1" in shown and "Traceback" not in shown, shown
    assert not [secret for secret in ("KEYID", "PASSWORD", "CRED", "SIG") if secret in shown], shown


def test_a_prepare_from_presigned_urls_stores_none_of_their_signatures(tmp_path, get_free_port):
    # A list file at a presigned URL naming presigned image URLs (an HTTP server on loopback
    # ignores the query): the job runs, and neither the manifest, rejected.jsonl, the samples'
    # records in the shards nor the output holds a signature; a fresh signature is the same job.
    import functools
    import http.server
    import json
    import subprocess
    import sys
    import threading

    from pipeline.demo import make_demo_dataset

    make_demo_dataset(tmp_path / "raw", 6, classes=2, workers=1)
    port = get_free_port()
    signed = "X-Amz-Credential=AKIA%2F20261202%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Signature=SIGIMAGE"
    base = f"http://127.0.0.1:{port}"
    rows = [{"path": f"{base}/{p.relative_to(tmp_path)}?{signed}", "label": 0} for p in sorted((tmp_path / "raw").rglob("*.jpg"))]
    rows.append({"path": f"{base}/list.jsonl?X-Amz-Signature=SIGBAD", "label": 0})  # not an image: rejected
    (tmp_path / "list.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "out"
        for signature in ("SIGLIST", "SIGFRESH"):
            src = f"{base}/list.jsonl?X-Amz-Signature={signature}"
            args = [sys.executable, "-m", "pipeline", "prepare", src, str(out), "--size", "32", "--json", "--workers", "0"]
            result = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
            assert result.returncode == 0, result.stderr
            assert json.loads(result.stdout)["samples"] == 6
            stored = b"".join(path.read_bytes() for path in out.rglob("*") if path.is_file())
            shown = (result.stdout + result.stderr).encode()
            for secret in (b"SIGLIST", b"SIGFRESH", b"SIGIMAGE", b"SIGBAD", b"AKIA"):
                assert secret not in stored and secret not in shown, secret
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["source"] == f"{base}/list.jsonl?X-Amz-Signature=***"
        assert json.loads((out / "rejected.jsonl").read_text())["source"].endswith("X-Amz-Signature=***")
    finally:
        server.shutdown()
        server.server_close()


def test_library_errors_show_no_url_secret_to_python_callers(tmp_path, get_free_port):
    from pipeline import PrepareSpec, prepare_dataset
    from pipeline.errors import GpufeedError, SourceError

    assert str(SourceError("cannot read https://K:S@h/x?X-Amz-Signature=SIG&v=1")) == (
        "cannot read https://***:***@h/x?X-Amz-Signature=***&v=1"
    )
    src = f"http://KEYID:PASSWORD@127.0.0.1:{get_free_port()}/list.jsonl?X-Amz-Signature=SIGNATURE"
    with pytest.raises(GpufeedError) as caught:
        prepare_dataset(PrepareSpec(source=src, out=str(tmp_path / "out")), workers=0)
    shown = str(caught.value)
    assert "127.0.0.1" in shown and not [s for s in ("KEYID", "PASSWORD", "SIGNATURE") if s in shown], shown
