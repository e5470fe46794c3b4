"""A local S3-compatible server for the tests: moto's server mode, plus a request counter, throttles and faults.

Run as ``python s3_server.py PORT``; it listens on 127.0.0.1 only. Every GET of an
object is counted (requests and body bytes, by ``bucket/key``), so a test can tell how
many times a shard was downloaded, also by other processes; so is the most object GETs
ever in flight at once, and the most bucket listings (LIST requests) in flight at once. Extra routes, under a prefix no bucket name can take (bucket
names have no underscore):

- ``GET /_test/reads``: the counts as JSON, ``{"bucket/key": {"gets": n, "bytes": b}}``;
- ``GET /_test/in_flight``: ``{"max": n, "lists": m, "puts": p}``, the most object GETs, LIST
  requests and object writes (PUT, POST, DELETE) served at once; ``?bucket=NAME``: those of one bucket only, so a request
  another test left running on another bucket does not count;
- ``GET /_test/requests``: every request by method, ``{"GET": n, "HEAD": n, ...}``;
- ``GET /_test/listings``: the LIST requests by what they list, ``{"bucket/prefix": n}``;
- ``POST /_test/reset``: zero the counts (and those maxima);
- ``POST /_test/throttle?bytes_per_s=N``: serve object bodies at about N bytes/s (0: full speed);
  ``?upload_bytes_per_s=N``: take in upload bodies (PUT, POST) at about N bytes/s;
- ``GET /_test/uploading``: ``{"keys": [...]}``, the objects whose bodies are being received now;
- ``POST /_test/refuse?writes=1``: answer every write (PUT, POST, DELETE) 403 AccessDenied,
  as a store whose permissions were taken away does (``writes=0``: accept them again);
- ``POST /_test/latency?ms=N``: answer every request N ms late, as a distant store does (0: at once).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs, unquote

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

LOOPBACK = "127.0.0.1"
THROTTLE_PIECE = 4096


class CountingApp:
    """WSGI middleware in front of moto: counts object reads, throttles bodies, answers /_test/."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.reads: dict[str, dict[str, int]] = {}
        self.bytes_per_s = 0
        self.latency_s = 0.0
        self.methods: dict[str, int] = {}
        self.listings: dict[str, int] = {}  # LIST requests by "bucket/prefix"
        # In flight now and the most at once since the last reset, by bucket and by kind ("get", "list", "put").
        self.in_flight: dict[tuple[str, str], int] = {}
        self.max_in_flight: dict[tuple[str, str], int] = {}
        self.upload_bytes_per_s = 0
        self.uploading: dict[str, int] = {}
        self.refuse_writes = False

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = unquote(environ.get("PATH_INFO", ""))
        if path.startswith("/_test/"):
            return self._control(path, environ, start_response)
        method = environ.get("REQUEST_METHOD", "")
        with self.lock:
            self.methods[method] = self.methods.get(method, 0) + 1
        key = path.lstrip("/")
        if method in ("PUT", "POST", "DELETE"):
            if self.refuse_writes:
                return _refuse(environ, start_response)
            if "/" in key:
                return self._upload(key, environ, start_response)
        counted = method == "GET" and "/" in key and not environ.get("QUERY_STRING")
        listing = method == "GET" and bool(key) and "/" not in key.rstrip("/") and _is_listing(environ)
        bucket = key.split("/", 1)[0]
        if counted:
            self._begin(bucket, "get")
        if listing:
            self._begin(bucket, "list")
            prefix = parse_qs(environ.get("QUERY_STRING", "")).get("prefix", [""])[0]
            with self.lock:
                self.listings[f"{bucket}/{prefix}"] = self.listings.get(f"{bucket}/{prefix}", 0) + 1
        try:
            if self.latency_s:
                time.sleep(self.latency_s)
            body = self.app(environ, start_response)
        except BaseException:
            if counted:
                self._end(bucket, "get")
            raise
        finally:
            if listing:
                self._end(bucket, "list")
        if not counted:
            return body
        with self.lock:
            self.reads.setdefault(key, {"gets": 0, "bytes": 0})["gets"] += 1
        return self._count(key, body)

    def _begin(self, bucket: str, kind: str) -> None:
        with self.lock:
            now = self.in_flight[bucket, kind] = self.in_flight.get((bucket, kind), 0) + 1
            self.max_in_flight[bucket, kind] = max(self.max_in_flight.get((bucket, kind), 0), now)

    def _end(self, bucket: str, kind: str) -> None:
        with self.lock:
            self.in_flight[bucket, kind] -= 1

    def _most_in_flight(self, kind: str, bucket: str | None) -> int:
        return max((most for (name, what), most in self.max_in_flight.items() if what == kind and bucket in (None, name)), default=0)

    def _upload(self, key: str, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """A write of an object: its body taken in at the upload throttle's pace, the key listed as uploading meanwhile."""
        if self.upload_bytes_per_s and "wsgi.input" in environ:
            environ["wsgi.input"] = SlowInput(environ["wsgi.input"], lambda: self.upload_bytes_per_s)
        with self.lock:
            self.uploading[key] = self.uploading.get(key, 0) + 1
        bucket = key.split("/", 1)[0]
        self._begin(bucket, "put")
        try:
            if self.latency_s:
                time.sleep(self.latency_s)
            return self.app(environ, start_response)
        finally:
            self._end(bucket, "put")
            with self.lock:
                self.uploading[key] -= 1
                if not self.uploading[key]:
                    del self.uploading[key]

    def _count(self, key: str, body: Iterable[bytes]) -> Iterator[bytes]:
        """The body, counted and throttled; the GET stops being in flight as its last piece is handed over.

        Not after: the client has every byte once the server writes the last piece, and may
        send its next request on another connection before this generator is resumed to end.
        """
        bucket = key.split("/", 1)[0]
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self._end(bucket, "get")

        try:
            pieces = self._pieces(key, body)
            piece = next(pieces, None)
            while piece is not None:
                following = next(pieces, None)
                if following is None:
                    end()
                yield piece
                piece = following
        finally:
            end()
            close = getattr(body, "close", None)
            if close is not None:
                close()

    def _pieces(self, key: str, body: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in body:
            for start in range(0, len(chunk), THROTTLE_PIECE if self.bytes_per_s else max(len(chunk), 1)):
                piece = chunk[start : start + THROTTLE_PIECE] if self.bytes_per_s else chunk
                with self.lock:
                    self.reads[key]["bytes"] += len(piece)
                if self.bytes_per_s:
                    time.sleep(len(piece) / self.bytes_per_s)
                yield piece

    def _control(self, path: str, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        with self.lock:
            if path == "/_test/reads":
                payload = json.dumps(self.reads).encode()
            elif path == "/_test/in_flight":
                bucket = query.get("bucket", [None])[0]
                most = {kind: self._most_in_flight(counted, bucket) for kind, counted in (("max", "get"), ("lists", "list"), ("puts", "put"))}
                payload = json.dumps(most).encode()
            elif path == "/_test/requests":
                payload = json.dumps(self.methods).encode()
            elif path == "/_test/listings":
                payload = json.dumps(self.listings).encode()
            elif path == "/_test/reset":
                self.reads = {}
                self.methods = {}
                self.listings = {}
                self.max_in_flight = dict(self.in_flight)
                payload = b"{}"
            elif path == "/_test/latency":
                self.latency_s = int(query.get("ms", ["0"])[0]) / 1000
                payload = b"{}"
            elif path == "/_test/throttle":
                if "bytes_per_s" in query:
                    self.bytes_per_s = int(query["bytes_per_s"][0])
                if "upload_bytes_per_s" in query:
                    self.upload_bytes_per_s = int(query["upload_bytes_per_s"][0])
                payload = b"{}"
            elif path == "/_test/uploading":
                payload = json.dumps({"keys": sorted(self.uploading)}).encode()
            elif path == "/_test/refuse":
                self.refuse_writes = query.get("writes", ["0"])[0] == "1"
                payload = b"{}"
            else:
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"unknown test route"]
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
        return [payload]


class SlowInput:
    """A request body read at about `rate()` bytes/s, a piece at a time: an upload over a slow link."""

    def __init__(self, stream: Any, rate: Callable[[], int]) -> None:
        self.stream = stream
        self.rate = rate

    def _wait(self, size: int) -> None:
        rate = self.rate()
        if rate and size > 0:
            time.sleep(size / rate)

    def read(self, size: int = -1) -> bytes:
        if not self.rate():
            return bytes(self.stream.read(size))
        pieces: list[bytes] = []
        left = size if size is not None and size >= 0 else None
        while left is None or left > 0:
            piece = self.stream.read(THROTTLE_PIECE if left is None else min(left, THROTTLE_PIECE))
            if not piece:
                break
            self._wait(len(piece))
            pieces.append(piece)
            if left is not None:
                left -= len(piece)
        return b"".join(pieces)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)[:THROTTLE_PIECE] if self.rate() else buffer
        count = int(self.stream.readinto(view) or 0)
        self._wait(count)
        return count

    def readline(self, size: int = -1) -> bytes:
        data: bytes = self.stream.readline(size)
        self._wait(len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message><RequestId>gpufeed-test</RequestId></Error>"
)


def _refuse(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    """403 AccessDenied for a write, its body read first so the connection stays usable."""
    length = int(environ.get("CONTENT_LENGTH") or 0)
    stream = environ.get("wsgi.input")
    while length > 0 and stream is not None:
        piece = stream.read(min(length, 1 << 16))
        if not piece:
            break
        length -= len(piece)
    start_response("403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(ACCESS_DENIED)))])
    return [ACCESS_DENIED]


def _is_listing(environ: dict[str, Any]) -> bool:
    """Whether a GET of a bucket lists its objects (ListObjects, ListObjectsV2), not its settings (``?location`` …)."""
    query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    return not query or bool({"list-type", "prefix", "delimiter", "marker", "continuation-token"} & set(query))


def main(port: int) -> None:
    app = CountingApp(DomainDispatcherApplication(create_backend_app))
    server = make_server(LOOPBACK, port, app, threaded=True, request_handler=MotoRequestHandler)
    print(f"listening on {LOOPBACK}:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]))
