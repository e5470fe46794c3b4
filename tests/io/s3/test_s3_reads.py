"""How prepare reads a source file from an S3 store: one signed GET each, with s3fs behind it for the rest.

Against the local S3 server (moto on 127.0.0.1): the bytes are the same as
s3fs reads, each file costs exactly one request, the input limit, empty and
missing files behave as on local disk, options the fast path does not
reproduce leave the reading to s3fs, and a store that answers oddly is read
through s3fs instead.
"""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("s3fs")

from pipeline.io.fs import open_fs, read_source_bytes, storage_options_for  # noqa: E402
from pipeline.io.s3.config import S3Credentials, S3Settings  # noqa: E402
from pipeline.io.s3.transport import S3Transport  # noqa: E402
from pipeline.io.transport import FsspecTransport  # noqa: E402
from pipeline.io.transports import transport_for  # noqa: E402

if TYPE_CHECKING:
    from s3_fixtures import Bucket, S3Server

pytest_plugins = ["s3_fixtures"]


@pytest.fixture
def files(s3_server: S3Server, s3_upload: Any, tmp_path: Path) -> Bucket:
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "a.bin").write_bytes(bytes(range(256)) * 700)  # 179,200 bytes
    (folder / "name with spaces+plus~.bin").write_bytes(b"odd names are quoted as botocore quotes them")
    (folder / "empty.bin").write_bytes(b"")
    bucket: Bucket = s3_upload(folder)
    return bucket


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A loopback HTTP server answering with `handler` while the block runs: its endpoint URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def fast(fs: Any) -> S3Transport | None:
    """The fast S3 transport of `fs`, or None where s3fs serves it."""
    transport = transport_for(fs)
    return transport if isinstance(transport, S3Transport) else None


def anonymous(endpoint: str, region: str = "us-east-1") -> S3Transport:
    """The fast transport of an endpoint, unsigned (no s3fs behind it: only its own answers are looked at)."""
    return S3Transport(S3Settings(endpoint, region, None), FsspecTransport(None))


def read(server: S3Server, url: str, max_bytes: int = 1 << 26, **options: Any) -> bytes:
    with storage_options_for([url], {**server.storage_options, **options}):
        return read_source_bytes(url, max_bytes)


def test_the_fast_path_reads_what_s3fs_reads_in_one_get(s3_server: S3Server, files: Bucket) -> None:
    fs = s3_server.filesystem()
    names = ("a.bin", "name with spaces+plus~.bin")
    expected = [fs.cat_file(f"{files.name}/{files.key(name)}") for name in names]
    with storage_options_for([files.url], s3_server.storage_options):
        assert fast(open_fs(files.url)[0]) is not None
    s3_server.reset_reads()
    assert [read(s3_server, f"{files.url}/{name}") for name in names] == expected
    assert s3_server.requests() == {"GET": 2}


def test_limits_empty_and_missing_files_behave_as_on_disk(s3_server: S3Server, files: Bucket) -> None:
    assert read(s3_server, f"{files.url}/a.bin", max_bytes=179_200) == bytes(range(256)) * 700
    with pytest.raises(OSError, match="over the 179199-byte input limit"):
        read(s3_server, f"{files.url}/a.bin", max_bytes=179_199)
    assert read(s3_server, f"{files.url}/empty.bin") == b""
    with pytest.raises(FileNotFoundError):
        read(s3_server, f"{files.url}/not-there.bin")


def test_ranges_and_whole_objects_are_one_get_each(s3_server: S3Server, files: Bucket) -> None:
    # What the shard cache (pieces of a shard) and a remote OUT (its records, whole) ask for.
    data = bytes(range(256)) * 700
    with storage_options_for([files.url], s3_server.storage_options):
        fs, root = open_fs(files.url)
        getter = fast(fs)
    assert getter is not None
    s3_server.reset_reads()
    assert getter.fetch(f"{root}/a.bin") == data
    assert getter.fetch(f"{root}/a.bin", 70_000, start=1000) == data[1000:70_000]
    assert getter.fetch(f"{root}/a.bin", 500_000, start=179_000) == data[179_000:]  # the object ends first
    assert getter.fetch(f"{root}/a.bin", start=179_000) == data[179_000:]
    assert s3_server.requests() == {"GET": 4}
    assert getter.fetch(f"{root}/a.bin", 180_500, start=179_200) is None  # past the end (416): s3fs says what that is


class QuietStore(http.server.BaseHTTPRequestHandler):
    """A loopback store for one test: it logs nothing."""

    def log_message(self, *args: Any) -> None:
        pass


class KeptAliveStore(QuietStore):
    """A quiet store speaking HTTP/1.1 (connections kept alive), counting the connections it was given."""

    protocol_version = "HTTP/1.1"
    connections = 0

    def setup(self) -> None:
        super().setup()
        type(self).connections += 1

    def answer(self, body: bytes, status: int = 200) -> None:
        """An answer with `body`, the connection kept."""
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class RangesAs200(QuietStore):
    """A loopback server answering every GET 200, for the object "0123456789": with `ranges`, the
    bytes asked for and their Content-Range (as rclone's S3 server does); without, the whole object
    (a server that ignores Range); with `wrong_start`, bytes from elsewhere than asked."""

    ranges = False
    wrong_start = False

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        data = b"0123456789"
        first, last = 0, len(data) - 1
        if self.ranges:
            asked = self.headers["Range"].removeprefix("bytes=").split("-")
            first, last = int(asked[0]) + self.wrong_start, min(int(asked[1]), last)
        self.send_response(200)
        self.send_header("Content-Length", str(last - first + 1))
        if self.ranges:
            self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
        self.end_headers()
        self.wfile.write(data[first : last + 1])


@pytest.mark.parametrize(
    ("ranges", "wrong_start", "from_the_middle"),
    [(False, False, None), (True, False, b"4567"), (True, True, None)],
    ids=["range-ignored", "range-in-a-200", "another-range-in-a-200"],
)
def test_a_200_answer_is_taken_only_for_the_bytes_asked_for(ranges: bool, wrong_start: bool, from_the_middle: bytes | None) -> None:
    RangesAs200.ranges, RangesAs200.wrong_start = ranges, wrong_start
    with serving(RangesAs200) as endpoint:
        getter = anonymous(endpoint)
        if not wrong_start:
            # from the start: the bytes asked for; a whole object instead is more than asked for (bodies are capped
            # at the range's length): s3fs reads it
            assert getter.fetch("bucket/key", 4) == (b"0123" if ranges else None)
        assert getter.fetch("bucket/key", 8, start=4) == from_the_middle  # from the middle: only where it says so


def test_anonymous_access_reads_unsigned(s3_server: S3Server, files: Bucket) -> None:
    s3_server.filesystem().chmod(f"{files.name}/{files.key('a.bin')}", acl="public-read")
    options = {"endpoint_url": s3_server.endpoint, "anon": True}
    with storage_options_for([files.url], options):
        fs, _ = open_fs(files.url)
        getter = fast(fs)
        assert getter is not None and getter.settings.anonymous
        assert read_source_bytes(f"{files.url}/a.bin", 1 << 26) == bytes(range(256)) * 700


@pytest.mark.parametrize(
    "options",
    [{"requester_pays": True}, {"version_aware": True}, {"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256"}},
     {"client_kwargs": {"verify": False}}, {"config_kwargs": {"s3": {"addressing_style": "virtual"}}}],
    ids=["requester-pays", "versions", "extra-arguments", "own-verify", "virtual-host"],
)  # fmt: skip
def test_options_only_s3fs_honours_leave_the_reading_to_s3fs(
    s3_server: S3Server, files: Bucket, options: dict[str, Any]
) -> None:
    with storage_options_for([files.url], {**s3_server.storage_options, **options}):
        fs, _ = open_fs(files.url)
        assert fast(fs) is None
        if "s3_additional_kwargs" in options or "s3" in options.get("config_kwargs", {}):
            return  # moto would refuse SSE-C over plain HTTP, and has no virtual-host names on loopback
        assert read_source_bytes(f"{files.url}/a.bin", 1 << 26) == bytes(range(256)) * 700


def test_a_proxy_in_the_environment_leaves_the_reading_to_s3fs(
    s3_server: S3Server, files: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    with storage_options_for([files.url], {**s3_server.storage_options, "skip_instance_cache": True}):
        assert fast(open_fs(files.url)[0]) is None


class OddStore(QuietStore):
    """A loopback server answering every GET with one status: what the fast path must not take for an object."""

    status = 503

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(self.status)
        self.send_header("Content-Length", "4")
        self.end_headers()
        self.wfile.write(b"nope")


@pytest.fixture
def odd_store() -> Iterator[str]:
    with serving(OddStore) as endpoint:
        yield endpoint


@pytest.mark.parametrize("status", [301, 307, 400, 403, 416, 500, 503])
def test_any_answer_but_the_object_or_its_absence_is_left_to_s3fs(odd_store: str, status: int) -> None:
    OddStore.status = status
    getter = anonymous(odd_store)
    assert getter.fetch("bucket/key", 100) is None
    assert getter.list("bucket/raw/", delimiter="/") is None  # no listing: s3fs lists, and says why not


def test_an_unreachable_store_is_left_to_s3fs(get_free_port: Any) -> None:
    getter = anonymous(f"http://127.0.0.1:{get_free_port()}")
    assert getter.fetch("bucket/key", 100) is None
    assert getter.list("bucket/raw/") is None


def test_urls_are_path_style_on_a_custom_endpoint_and_virtual_host_style_on_aws() -> None:
    custom = S3Settings("http://127.0.0.1:9000/", "us-east-1", None)
    assert custom.url("b", "raw/a b+c.jpg") == "http://127.0.0.1:9000/b/raw/a%20b%2Bc.jpg"
    aws = S3Settings("https://s3.amazonaws.com", "eu-west-1", None)
    assert aws.url("my-bucket", "k/1.jpg") == "https://my-bucket.s3.eu-west-1.amazonaws.com/k/1.jpg"
    assert aws.url("dotted.bucket", "k") is None  # TLS cannot check a dotted bucket's host name: s3fs reads it


@pytest.mark.parametrize("query", [None, {"list-type": "2", "prefix": "raw/a b+c~/", "delimiter": "/", "continuation-token": "x=y/z"}])
@pytest.mark.parametrize("token", [None, "a-session-token"])
@pytest.mark.parametrize(
    ("host", "path"),
    [("127.0.0.1:9000", "/bucket/raw/a%20b%2Bc~.jpg"), ("my-bucket.s3.eu-west-1.amazonaws.com", "/k/1.jpg")],
)
def test_the_signature_is_the_one_botocore_computes(
    monkeypatch: pytest.MonkeyPatch, host: str, path: str, token: str | None, query: dict[str, str] | None
) -> None:
    import datetime

    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from pipeline.io.s3.sign import canonical_query, sign_get

    at = datetime.datetime(2026, 11, 30, 23, 59, 58, tzinfo=datetime.timezone.utc)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: at.replace(tzinfo=None))
    credentials = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token).get_frozen_credentials()
    request = AWSRequest(method="GET", url=f"http://{host}{path}", headers={"Range": "bytes=0-99"}, params=query or {})
    botocore.auth.S3SigV4Auth(credentials, "s3", "eu-west-1").add_auth(request)
    signed_query = canonical_query(query) if query else ""
    ours = sign_get(host, path, {"Range": "bytes=0-99"}, credentials, "eu-west-1", now=at, query=signed_query)
    assert {name.lower(): value for name, value in ours.items()} == {
        name.lower(): value for name, value in request.headers.items()
    }


class ChunkedStore(KeptAliveStore):
    """Answers GETs in chunks on a kept-alive HTTP/1.1 connection, and counts the connections it was given."""

    connections = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(206)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in (b"hello, ", b"chunked ", b"world"):
            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")


def test_chunked_answers_are_read_and_the_connection_kept() -> None:
    with serving(ChunkedStore) as endpoint:
        getter = anonymous(endpoint)
        assert [getter.fetch(f"b/k{i}", 100) for i in range(3)] == [b"hello, chunked world"] * 3
        assert ChunkedStore.connections == 1


class SmallObjects(KeptAliveStore):
    """Answers every GET with the same few bytes on kept-alive connections, counting the connections."""

    connections = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.answer(b"ok")


def test_reads_on_new_threads_take_the_connections_earlier_threads_left_idle() -> None:
    """Records and plans are read by bursts of short-lived threads: each burst reuses the last one's connections."""
    from concurrent.futures import ThreadPoolExecutor

    with serving(SmallObjects) as endpoint:
        getter = anonymous(endpoint)
        for _ in range(3):
            barrier = threading.Barrier(4)

            def read(index: int) -> bytes | None:
                barrier.wait()  # all four in flight at once: four connections are needed
                return getter.fetch(f"b/k{index}", 100)

            with ThreadPoolExecutor(4) as pool:  # new threads each time
                assert list(pool.map(read, range(4))) == [b"ok"] * 4
        assert SmallObjects.connections <= 4 + 1  # one burst's worth (a connection may still be in a handler's hands)


class GarbledOnce(KeptAliveStore):
    """Answers its first GET with something that is not HTTP (and more of it after), every later one properly."""

    connections = 0
    answered = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        GarbledOnce.answered += 1
        if GarbledOnce.answered == 1:
            self.wfile.write(b"SPAM 200 OK\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nwrong")
            self.wfile.flush()
            return
        self.answer(b"right")


def test_a_connection_that_gave_an_answer_not_understood_is_not_used_again() -> None:
    with serving(GarbledOnce) as endpoint:
        getter = anonymous(endpoint)
        assert getter.fetch("b/k1", 100) is None  # s3fs reads this one
        assert getter.fetch("b/k2", 100) == b"right"  # not the rest of the garbled answer
        assert GarbledOnce.connections == 2


class RotatingKeys(KeptAliveStore):
    """Refuses requests signed with the key that expired (403); answers an object or a listing to the new one."""

    keys_seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        key = self.headers.get("Authorization", "").split("Credential=", 1)[-1].split("/", 1)[0]
        RotatingKeys.keys_seen.append(key)
        if key != "NEW":
            body, status = b"<Error><Code>ExpiredToken</Code></Error>", 403
        elif "list-type=2" in self.path:
            body, status = b"<ListBucketResult><IsTruncated>false</IsTruncated><Contents><Key>raw/a.jpg</Key></Contents></ListBucketResult>", 200
        else:
            body, status = b"object", 200
        self.answer(body, status)


@pytest.mark.parametrize("call", ["get", "list"])
def test_a_refusal_is_tried_once_more_with_credentials_fetched_afresh(call: str) -> None:
    from botocore.credentials import Credentials

    class Rotating(S3Credentials):
        fetched = 0

        def get(self, fresh: bool = False) -> Any:
            if fresh or not Rotating.fetched:
                Rotating.fetched += 1
            return Credentials("OLD" if Rotating.fetched == 1 else "NEW", "secret").get_frozen_credentials()

    RotatingKeys.keys_seen = []
    with serving(RotatingKeys) as endpoint:
        getter = S3Transport(S3Settings(endpoint, "us-east-1", Rotating(None, None, None, None)), FsspecTransport(None))
        if call == "get":
            assert getter.fetch("b/raw/a.jpg", 100) == b"object"
        else:
            assert getter.list("b/raw/") == (["b/raw/a.jpg"], [])
        assert RotatingKeys.keys_seen == ["OLD", "NEW"]
