"""Many GETs in flight on one thread (`pipeline.io.s3.getloop`): the same answers as the blocking fast path gives.

Against the local S3 server (moto on 127.0.0.1) and small loopback stores:
the bytes are those `S3Transport.fetch` reads, a missing object is
FileNotFoundError, every other answer (another status, a dropped connection)
is None for the caller to read the ordinary way, kept-
alive connections are used again (and one the store closed meanwhile is
replaced without losing the request), answers can be read straight into the
caller's buffer, TLS works, and requests from many threads are all served,
none left waiting for a wake-up that never comes.
"""

from __future__ import annotations

import contextlib
import datetime
import http.server
import ipaddress
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("s3fs")

from test_s3_reads import KeptAliveStore, OddStore, QuietStore, serving  # noqa: E402

from pipeline.io.fs import open_fs, storage_options_for  # noqa: E402
from pipeline.io.s3 import (
    getloop,  # noqa: E402
    http1,  # noqa: E402
)
from pipeline.io.s3.config import S3Settings  # noqa: E402
from pipeline.io.s3.getloop import GetLoop  # noqa: E402
from pipeline.io.s3.transport import S3Transport  # noqa: E402
from pipeline.io.transport import FsspecTransport  # noqa: E402

if TYPE_CHECKING:
    from s3_fixtures import Bucket, S3Server

pytest_plugins = ["s3_fixtures"]

WAIT_S = 30.0  # far longer than any answer here takes; far shorter than a missed wake-up (IDLE_S below)


@pytest.fixture(autouse=True)
def no_idle_wakeups(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop sleeps until woken: a request it was not woken for would wait past every test's patience."""
    monkeypatch.setattr(getloop, "IDLE_S", 600.0)


@pytest.fixture
def objects(s3_server: S3Server, s3_upload: Any, tmp_path: Path) -> Bucket:
    folder = tmp_path / "objects"
    folder.mkdir()
    for number in range(40):
        (folder / f"{number:02d}.bin").write_bytes(bytes([number]) * (1000 + 9000 * number))  # up to 352 KB
    (folder / "name with spaces+plus~.bin").write_bytes(b"odd names are quoted as botocore quotes them")
    bucket: Bucket = s3_upload(folder)
    return bucket


def store_getter(server: S3Server, bucket: Bucket) -> tuple[S3Transport, str]:
    with storage_options_for([bucket.url], server.storage_options):
        fs, root = open_fs(bucket.url)
        getter = S3Transport.for_filesystem(fs)  # not transport_for's: this process's cache of transports stays as it was
    assert getter is not None
    return getter, root


def anonymous_getter(endpoint: str) -> S3Transport:
    return S3Transport(S3Settings(endpoint, "us-east-1", None), FsspecTransport(None))


@contextlib.contextmanager
def loop_serving(handler: type[http.server.BaseHTTPRequestHandler], connections: int) -> Iterator[GetLoop]:
    """A loop of `connections` to a loopback store answering with `handler`, while the block runs."""
    with serving(handler) as endpoint:
        loop = GetLoop(anonymous_getter(endpoint).settings, connections)
        try:
            yield loop
        finally:
            loop.close()


def test_many_gets_in_flight_give_what_the_blocking_fast_path_gives(s3_server: S3Server, objects: Bucket) -> None:
    getter, root = store_getter(s3_server, objects)
    names = [f"{number:02d}.bin" for number in range(40)] + ["name with spaces+plus~.bin"]
    expected = [getter.fetch(f"{root}/{name}", 1 << 26) for name in names]
    loop = GetLoop(getter.settings, connections=8)
    try:
        s3_server.reset_reads()
        answers = [loop.get(f"{root}/{name}", 1 << 26) for name in names]
        assert [bytes(answer.result(WAIT_S)) for answer in answers] == expected
        assert s3_server.requests() == {"GET": len(names)}  # one signed GET each, as the blocking path sends
        assert loop.get(f"{root}/05.bin", 100, start=10).result(WAIT_S) == expected[5][10:100]
        with pytest.raises(FileNotFoundError):
            loop.get(f"{root}/not-there.bin", 100).result(WAIT_S)
    finally:
        loop.close()


def test_requests_from_many_threads_are_all_served_without_waiting_for_a_timer(
    s3_server: S3Server, objects: Bucket
) -> None:
    # Each burst finds the loop asleep or just finishing the last one: a wake-up lost in between leaves it asleep.
    getter, root = store_getter(s3_server, objects)
    loop = GetLoop(getter.settings, connections=4)
    failures: list[BaseException] = []

    def burst(offset: int) -> None:
        try:
            for round_ in range(15):
                paths = [f"{root}/{(offset + round_ + i) % 40:02d}.bin" for i in range(3)]
                for path, answer in zip(paths, [loop.get(path, 1 << 26) for path in paths], strict=True):
                    assert len(answer.result(WAIT_S)) == 1000 + 9000 * int(path[-6:-4])
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=burst, args=(offset,)) for offset in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        loop.close()
    assert not failures, failures[0]


def test_a_request_made_while_the_loop_takes_its_wake_up_is_not_left_waiting(
    s3_server: S3Server, objects: Bucket
) -> None:
    # The worst moment for a wake-up: a request arrives while the loop is reading the signal of the one before.
    getter, root = store_getter(s3_server, objects)
    loop = GetLoop(getter.settings, connections=4)
    waker, landed = loop._waker_in, []

    class Interrupted:
        def recv(self, size: int) -> bytes:
            if not landed:
                landed.append(loop.get(f"{root}/02.bin", 1 << 26))  # lands between the loop waking and reading why
            return waker.recv(size)

        def close(self) -> None:
            waker.close()

    loop._waker_in = Interrupted()  # type: ignore[assignment]
    try:
        assert len(loop.get(f"{root}/01.bin", 1 << 26).result(WAIT_S)) == 10_000
        assert len(landed[0].result(WAIT_S)) == 19_000
        assert len(loop.get(f"{root}/03.bin", 1 << 26).result(WAIT_S)) == 28_000  # the next request wakes the loop
    finally:
        loop.close()


def test_an_answer_is_read_straight_into_the_buffer_the_caller_gives(s3_server: S3Server, objects: Bucket) -> None:
    getter, root = store_getter(s3_server, objects)
    buffer = bytearray(400_000)
    asked: list[int] = []

    def into(size: int) -> memoryview:
        asked.append(size)
        return memoryview(buffer)[:size]

    loop = GetLoop(getter.settings, connections=2)
    try:
        body = loop.get(f"{root}/12.bin", 1 << 26, into=into).result(WAIT_S)
        assert isinstance(body, memoryview) and body.obj is buffer and asked == [109_000]
        assert buffer[:109_000] == bytes([12]) * 109_000
        body.release()
        # a missing object's answer is not the object: the caller's buffer is not asked for
        with pytest.raises(FileNotFoundError):
            loop.get(f"{root}/none.bin", 1 << 26, into=into).result(WAIT_S)
        assert asked == [109_000]
        # a buffer of another size (or none) reads into a new one
        assert loop.get(f"{root}/01.bin", 1 << 26, into=lambda size: None).result(WAIT_S) == bytes([1]) * 10_000
    finally:
        loop.close()


@pytest.mark.parametrize("status", [301, 307, 400, 403, 416, 500, 503])
def test_any_answer_but_the_object_or_its_absence_is_none(status: int) -> None:
    OddStore.status = status
    with loop_serving(OddStore, connections=2) as loop:
        assert loop.get("bucket/key", 100).result(WAIT_S) is None


class IgnoresRanges(KeptAliveStore):
    """Answers every GET with 1,000 bytes, whatever range was asked for."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b"z" * 1000)


def test_an_answer_longer_than_the_range_asked_for_is_none_and_not_read_into_memory() -> None:
    with loop_serving(IgnoresRanges, connections=1) as loop:
        assert loop.get("b/k", 100).result(WAIT_S) is None  # the caller reads it its way (and finds it too long)
        assert loop.get("b/k", 1000).result(WAIT_S) == b"z" * 1000


class ChunkedOnce(KeptAliveStore):
    """Answers its first GET in chunks, the others with a length; counts its connections."""

    connections = 0
    answered = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        ChunkedOnce.answered += 1
        self.send_response(200)
        if ChunkedOnce.answered == 1:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"5\r\nhello\r\n0\r\n\r\n")
            return
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"plain")


def test_a_chunked_answer_is_read_and_its_connection_used_again() -> None:
    ChunkedOnce.connections = ChunkedOnce.answered = 0
    with loop_serving(ChunkedOnce, connections=1) as loop:
        assert loop.get("b/k1", 100).result(WAIT_S) == b"hello"
        assert loop.get("b/k2", 100).result(WAIT_S) == b"plain"  # read after the chunked answer's end
        assert ChunkedOnce.connections == 1


class EchoStore(KeptAliveStore):
    """Answers each GET with its path, keeping the connection."""

    connections = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = self.path.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class ClosesAfterEach(EchoStore):
    """Speaks HTTP/1.1 but closes every connection after one answer without saying so: a kept-alive one gone stale."""

    connections = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        super().do_GET()
        self.close_connection = True


def test_a_kept_alive_connection_the_store_closed_is_replaced_and_the_request_answered() -> None:
    ClosesAfterEach.connections = 0
    with loop_serving(ClosesAfterEach, connections=1) as loop:
        assert [loop.get(f"b/k{i}", 100).result(WAIT_S) for i in range(4)] == [f"/b/k{i}".encode() for i in range(4)]
        assert ClosesAfterEach.connections == 4


def test_connections_are_kept_alive_and_no_more_are_opened_than_allowed() -> None:
    EchoStore.connections = 0
    with loop_serving(EchoStore, connections=3) as loop:
        answers = [loop.get(f"b/k{i}", 100) for i in range(30)]
        assert [answer.result(WAIT_S) for answer in answers] == [f"/b/k{i}".encode() for i in range(30)]
        assert 1 <= EchoStore.connections <= 3


def test_a_connection_left_idle_is_closed_and_the_next_request_opens_another(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "KEEP_IDLE_S", 0.2)
    monkeypatch.setattr(getloop, "IDLE_S", 0.05)
    EchoStore.connections = 0
    with loop_serving(EchoStore, connections=1) as loop:
        assert loop.get("b/k1", 100).result(WAIT_S) == b"/b/k1"
        assert loop.get("b/k2", 100).result(WAIT_S) == b"/b/k2"
        assert EchoStore.connections == 1  # kept alive between requests in a row
        deadline = time.monotonic() + WAIT_S
        while loop._idle and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not loop._idle  # closed once idle longer than KEEP_IDLE_S, by the loop itself
        assert loop.get("b/k3", 100).result(WAIT_S) == b"/b/k3"
        assert EchoStore.connections == 2


class Silent(QuietStore):
    """Takes a request and never answers until told to."""

    release = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        Silent.release.wait(WAIT_S)


def test_closing_the_loop_cancels_what_is_unanswered(monkeypatch: pytest.MonkeyPatch) -> None:
    Silent.release.clear()
    with serving(Silent) as endpoint:
        loop = GetLoop(anonymous_getter(endpoint).settings, connections=1)
        answers = [loop.get(f"b/k{i}", 100) for i in range(3)]  # one sent, two queued
        loop.close()
        Silent.release.set()
        for answer in answers:
            with pytest.raises(CancelledError):
                answer.result(WAIT_S)
        assert loop.get("b/late", 100).cancelled()


def test_a_store_that_stops_answering_gives_none_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "TIMEOUT_S", 0.5)
    monkeypatch.setattr(getloop, "IDLE_S", 0.1)
    Silent.release.clear()
    with serving(Silent) as endpoint:
        loop = GetLoop(anonymous_getter(endpoint).settings, connections=1)
        try:
            assert loop.get("b/k", 100).result(WAIT_S) is None
        finally:
            Silent.release.set()
            loop.close()


def test_an_unreachable_store_is_none(get_free_port: Any) -> None:
    loop = GetLoop(anonymous_getter(f"http://127.0.0.1:{get_free_port()}").settings, 2)
    try:
        assert loop.get("bucket/key", 100).result(WAIT_S) is None
    finally:
        loop.close()


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, for a TLS store on loopback."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = folder / "store.pem", folder / "store.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


class BigEcho(EchoStore):
    """Answers each GET with 300 KB (many TLS records) ending in its path."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b"x" * 300_000 + self.path.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_tls_store_is_read_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))  # trusted as botocore would trust it
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BigEcho)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    BigEcho.connections = 0
    try:
        getter = anonymous_getter(f"https://127.0.0.1:{server.server_address[1]}")
        loop = GetLoop(getter.settings, connections=2)
        try:
            answers = [loop.get(f"b/k{i}", 1 << 20) for i in range(6)]
            assert [bytes(answer.result(WAIT_S)) for answer in answers] == [
                b"x" * 300_000 + f"/b/k{i}".encode() for i in range(6)
            ]
            assert BigEcho.connections <= 2
        finally:
            loop.close()
        untrusted = anonymous_getter(f"https://localhost:{server.server_address[1]}")
        loop = GetLoop(untrusted.settings, connections=1)  # the certificate does not name localhost: refused, so None
        try:
            assert loop.get("b/k", 100).result(WAIT_S) is None
        finally:
            loop.close()
    finally:
        server.shutdown()
        server.server_close()
