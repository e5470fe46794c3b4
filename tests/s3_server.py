"""A local S3-compatible server for the tests: moto's server mode, plus a request counter and a throttle.

Run as ``python s3_server.py PORT``; it listens on 127.0.0.1 only. Every GET of an
object is counted (requests and body bytes, by ``bucket/key``), so a test can tell how
many times a shard was downloaded, also by other processes; so is the most object GETs
ever in flight at once, and the most bucket listings (LIST requests) in flight at once. Extra routes, under a prefix no bucket name can take (bucket
names have no underscore):

- ``GET /_test/reads``: the counts as JSON, ``{"bucket/key": {"gets": n, "bytes": b}}``;
- ``GET /_test/in_flight``: ``{"max": n, "lists": m}``, the most object GETs and the most
  LIST requests served at once;
- ``POST /_test/reset``: zero the counts (and those maxima);
- ``POST /_test/throttle?bytes_per_s=N``: serve object bodies at about N bytes/s (0: full speed);
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
        self.in_flight = 0
        self.max_in_flight = 0
        self.lists_in_flight = 0
        self.max_lists_in_flight = 0

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = unquote(environ.get("PATH_INFO", ""))
        if path.startswith("/_test/"):
            return self._control(path, environ, start_response)
        method = environ.get("REQUEST_METHOD", "")
        key = path.lstrip("/")
        counted = method == "GET" and "/" in key and not environ.get("QUERY_STRING")
        listing = method == "GET" and bool(key) and "/" not in key.rstrip("/") and _is_listing(environ)
        if counted:
            with self.lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if listing:
            with self.lock:
                self.lists_in_flight += 1
                self.max_lists_in_flight = max(self.max_lists_in_flight, self.lists_in_flight)
        try:
            if self.latency_s:
                time.sleep(self.latency_s)
            body = self.app(environ, start_response)
        except BaseException:
            if counted:
                self._done()
            raise
        finally:
            if listing:
                with self.lock:
                    self.lists_in_flight -= 1
        if not counted:
            return body
        with self.lock:
            self.reads.setdefault(key, {"gets": 0, "bytes": 0})["gets"] += 1
        return self._count(key, body)

    def _done(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def _count(self, key: str, body: Iterable[bytes]) -> Iterator[bytes]:
        try:
            for chunk in body:
                for start in range(0, len(chunk), THROTTLE_PIECE if self.bytes_per_s else max(len(chunk), 1)):
                    piece = chunk[start : start + THROTTLE_PIECE] if self.bytes_per_s else chunk
                    with self.lock:
                        self.reads[key]["bytes"] += len(piece)
                    if self.bytes_per_s:
                        time.sleep(len(piece) / self.bytes_per_s)
                    yield piece
        finally:
            self._done()
            close = getattr(body, "close", None)
            if close is not None:
                close()

    def _control(self, path: str, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        with self.lock:
            if path == "/_test/reads":
                payload = json.dumps(self.reads).encode()
            elif path == "/_test/in_flight":
                payload = json.dumps({"max": self.max_in_flight, "lists": self.max_lists_in_flight}).encode()
            elif path == "/_test/reset":
                self.reads = {}
                self.max_in_flight = self.in_flight
                self.max_lists_in_flight = self.lists_in_flight
                payload = b"{}"
            elif path == "/_test/latency":
                self.latency_s = int(query.get("ms", ["0"])[0]) / 1000
                payload = b"{}"
            elif path == "/_test/throttle":
                self.bytes_per_s = int(query.get("bytes_per_s", ["0"])[0])
                payload = b"{}"
            else:
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"unknown test route"]
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
        return [payload]


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
