"""A loopback S3 store that misbehaves on purpose, one way at a time: the S3 client's hostile cases.

`HostileStore(mode)` listens on 127.0.0.1 (a free port), a thread per
connection, and counts every request it is sent (`requests`). What it does
with a GET, by mode:

- ``region-same``: 301 PermanentRedirect naming `region` (the one the client was sent to);
- ``region-alternate``: 301 naming eu-west-1 and us-west-2 in turn;
- ``region-new``: 301 naming a region it never named before;
- ``token-repeat``: a ListObjectsV2 page of one key, truncated, always with the same continuation token;
- ``token-cycle``: the same, with tokens that go round two by two (A, B, A, B ...);
- ``empty-pages``: ListObjectsV2 pages with no key, truncated, each with a token never given before;
- ``slow-head``: the status line and headers one byte every `drip_s`;
- ``slow-body``: a 200 of `declared` bytes, the body one byte every `drip_s`;
- ``lying-length``: a 200 declaring `declared` bytes (the range asked for, where that is less), `sends`
  of them, then the connection closed (`hold`: kept open, silent, until the store stops);
- ``bad-length``: a 200 whose Content-Length is `length_text`;
- ``huge-chunk``: a chunked 200 whose first chunk declares 0xfffffffffffffff bytes;
- ``moved-elsewhere``: a 307 whose Location is `location` (another server), naming no region;
- ``whole``: a 200 of `declared` bytes, whatever range was asked for;
- ``honest``: a 200 of the range asked for (`declared` bytes at most), all sent at once (what the memory
  cases measure against).

With `keys` given, a listing (a GET with ``list-type``) is answered
honestly, one page of those keys under the prefix, and only the other
requests misbehave: a prepare lists its sources, then meets the
misbehaviour reading them. Every wait in a handler ends when the store
stops (`stop`), so a test never waits for a handler it no longer needs.
"""

from __future__ import annotations

import http.server
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qs, urlsplit

LOOPBACK = "127.0.0.1"
REGIONS = ("us-east-2", "eu-west-1", "us-west-2", "ap-south-1", "sa-east-1", "ca-central-1", "eu-north-1", "af-south-1")
PIECE = 1 << 16
WAIT_S = 30.0  # the longest a handler waits for anything (the store stops first)


class HostileStore(http.server.ThreadingHTTPServer):
    """A loopback store playing one misbehaviour (see the module); attributes set before `start` shape it."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, mode: str, **shape: Any) -> None:
        super().__init__((LOOPBACK, 0), _Handler)
        self.mode = mode
        self.region = "us-east-1"
        self.drip_s = 0.25
        self.declared = 512 << 20
        self.sends = 4096
        self.hold = False
        self.length_text = "-1"
        self.location = ""
        self.keys: list[str] = []
        for name, value in shape.items():
            if not hasattr(self, name):
                raise AttributeError(f"a hostile store has no {name!r}")
            setattr(self, name, value)
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._count = 0
        self._numbers = itertools.count()

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.server_address[1]}"

    @property
    def requests(self) -> int:
        """Requests sent to the store so far."""
        with self._lock:
            return self._count

    def counted(self) -> int:
        """Count one request; its number (from 0)."""
        with self._lock:
            self._count += 1
        return next(self._numbers)

    def start(self) -> HostileStore:
        threading.Thread(target=self.serve_forever, args=(0.05,), name="hostile-store", daemon=True).start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.shutdown()
        self.server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up on a misbehaviour is what the cases want, not an error to print


@contextmanager
def hostile(mode: str, **shape: Any) -> Iterator[HostileStore]:
    """A `HostileStore` playing `mode` while the block runs."""
    store = HostileStore(mode, **shape).start()
    try:
        yield store
    finally:
        store.stop()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HostileStore

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        number = self.server.counted()
        try:
            if self.server.keys and "list-type" in parse_qs(urlsplit(self.path).query):
                self._page(self.server.keys, None)
                return
            getattr(self, "_" + self.server.mode.replace("-", "_"))(number)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up on it: what the cases want

    do_HEAD = do_GET  # noqa: N815 - s3fs asks with HEAD too

    # -- the modes

    def _region_same(self, number: int) -> None:
        self._moved(301, self.server.region)

    def _region_alternate(self, number: int) -> None:
        self._moved(301, ("eu-west-1", "us-west-2")[number % 2])

    def _region_new(self, number: int) -> None:
        self._moved(301, REGIONS[number % len(REGIONS)])

    def _token_repeat(self, number: int) -> None:
        self._page([f"k{number}.jpg"], "the-same-token")

    def _token_cycle(self, number: int) -> None:
        self._page([f"k{number}.jpg"], ("token-a", "token-b")[number % 2])

    def _empty_pages(self, number: int) -> None:
        self._page([], f"token-{number}")

    def _slow_head(self, number: int) -> None:
        self._drip(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nabcd")

    def _slow_body(self, number: int) -> None:
        self._head(200, {"Content-Length": str(self.server.declared)})
        self._drip(b"x" * self.server.declared)

    def _lying_length(self, number: int) -> None:
        self._head(200, {"Content-Length": str(min(self.server.declared, self._asked()))})
        self._send(b"y" * self.server.sends)
        if self.server.hold:
            self.server.stopped.wait(WAIT_S)
        self.close_connection = True

    def _bad_length(self, number: int) -> None:
        self._head(200, {"Content-Length": self.server.length_text})
        self._send(b"z" * 64)
        self.close_connection = True

    def _huge_chunk(self, number: int) -> None:
        self._head(200, {"Transfer-Encoding": "chunked"})
        self._send(b"fffffffffffffff\r\n" + b"c" * 4096)
        self.close_connection = True

    def _moved_elsewhere(self, number: int) -> None:
        body = b"<Error><Code>TemporaryRedirect</Code><Message>Please re-send this request elsewhere</Message></Error>"
        self._head(307, {"Location": self.server.location + self.path, "Content-Length": str(len(body))})
        self._send(body)

    def _whole(self, number: int) -> None:
        self._head(200, {"Content-Length": str(self.server.declared)})
        self._send_many(b"w", self.server.declared)

    def _honest(self, number: int) -> None:
        size = min(self.server.declared, self._asked())
        self._head(200, {"Content-Length": str(size)})
        self._send_many(b"h", size)

    # -- the pieces

    def _asked(self) -> int:
        """The length of the range the request asks for (a large number where it asks for none)."""
        ranged = (self.headers.get("Range") or "").removeprefix("bytes=").split("-")
        if len(ranged) == 2 and ranged[0].isdigit() and ranged[1].isdigit():
            return int(ranged[1]) - int(ranged[0]) + 1
        return 1 << 62

    def _moved(self, status: int, region: str) -> None:
        body = (
            "<Error><Code>PermanentRedirect</Code><Message>The bucket you are attempting to access must be addressed "
            f"using the specified endpoint.</Message><Region>{region}</Region></Error>"
        ).encode()
        self._head(status, {"x-amz-bucket-region": region, "Content-Length": str(len(body))})
        self._send(body)

    def _page(self, keys: list[str], token: str | None) -> None:
        """A ListObjectsV2 page of `keys` under the prefix asked for, truncated with `token` where one is given."""
        prefix = parse_qs(urlsplit(self.path).query).get("prefix", [""])[0]
        contents = "".join(f"<Contents><Key>{prefix}{key}</Key><Size>1000</Size></Contents>" for key in keys)
        more = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>" if token else ""
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>bucket</Name>'
            f"<Prefix>{prefix}</Prefix><KeyCount>{len(keys)}</KeyCount><MaxKeys>1000</MaxKeys>{more}{contents}"
            "</ListBucketResult>"
        ).encode()
        self._head(200, {"Content-Type": "application/xml", "Content-Length": str(len(body))})
        self._send(body)

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _send(self, data: bytes) -> None:
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    def _send_many(self, byte: bytes, count: int) -> None:
        """`count` copies of `byte`, a piece at a time (the test process measuring memory holds no copy of the whole)."""
        piece = byte * PIECE
        for _ in range(count // PIECE):
            self.wfile.write(piece)
        self._send(byte * (count % PIECE))

    def _drip(self, data: bytes) -> None:
        """`data` one byte every `drip_s`, until it is all sent or the store stops."""
        for at in range(len(data)):
            self.wfile.write(data[at : at + 1])
            self.wfile.flush()
            if self.server.stopped.wait(self.server.drip_s):
                break
        self.close_connection = True
