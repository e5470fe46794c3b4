"""The S3 client's blocking reads: one GET at a time on the calling thread, through the same builder and parser.

A blocking read (`S3Transport.read_range`, a whole object read when
prepare runs with no I/O threads, the cache's range pieces, a listing's
pages) handed to the loop thread and waited for costs two thread switches
and a wake-up per GET: about twice the client CPU of the exchange itself
(0.63 ms against 0.32 ms a GET, benchmarks/README.md). `BlockingClient`
sends it on the caller's thread instead: the same `request.GetRequest` (one request builder), the
same `http1.Connection` (one parser: lengths refused, bodies capped) on a
socket that blocks for at most `http1.TIMEOUT_S` per step, and the same
verdicts (`judge_answer`, `judge_failure`): a region learnt, a 403 tried
once with fresh credentials, transient failures retried with backoff (the
caller's thread sleeps it out), a stale kept-alive connection tried again
at once, a checksum checked. No step waits past the request's deadline
(`S3Settings.deadline_s`, its retries included): a store that sends a
byte now and then ends in a StorageError then, as a redirect loop does. Idle connections are kept for the next read,
of any thread, in a small locked pool (KEEP connections at most, each
closed once idle for `http1.KEEP_IDLE_S`; a forked child makes its own).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..transport import Body
from . import http1
from .config import S3Settings
from .http1 import Connection
from .request import AGAIN, ANSWER, GetRequest, judge_answer, judge_failure

KEEP = 32  # idle connections kept for later blocking reads


class BlockingClient:
    """GETs on one S3 endpoint, each on the calling thread (see the module); thread-safe.

    Args:
        settings: the endpoint, addressing, regions and credentials to use (shared with the transport's loop).
    """

    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self._tls = http1.tls_context(settings)
        self._lock = threading.Lock()
        self._idle: list[Connection] = []
        self._pid = os.getpid()  # connections kept by another process (this one forked since) are not used here
        self._closed = False

    def get(self, path: str, end: int | None = None, start: int = 0, query: dict[str, str] | None = None) -> Body | None:
        """Bytes `start` to `end` (exclusive; to its end if None) of ``bucket/key``, or with `query` a request on the
        bucket (a listing): the bytes, or None where the caller must read them another way.

        Raises:
            FileNotFoundError: the store says there is no such object.
            StorageError: the store sends the request from region to region, or does not answer it whole by its deadline.
        """
        asked = GetRequest.askable(self.settings, path, query)
        if asked is None or self._closed:
            return None
        request = GetRequest(asked[0], asked[1], start, end, query)
        while True:
            if request.left() <= 0:
                raise request.late(self.settings)
            if self.settings.refused(request.bucket):
                return None
            try:
                request.place(self.settings)
                data = request.signed(self.settings)
            except Exception:  # noqa: BLE001 - the name does not fit, or signing failed: the caller reads it its way
                return None
            if data is None:
                return None
            what, value = self._exchange(request, data)
            if what == ANSWER:
                if isinstance(value, BaseException):
                    raise value
                return value
            if what != AGAIN:
                delay = request.backoff()
                if delay is None:
                    return None
                time.sleep(max(0.0, min(delay, request.left())))

    def close(self) -> None:
        """Close the idle connections; those in use are closed when their read ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _exchange(self, request: GetRequest, data: bytes) -> tuple[str, Body | BaseException | None]:
        """One try of `request` on a kept or new connection, and its verdict."""
        if request.left() <= 0:
            return self._timed_out(request)
        conn = self._kept(request)
        if conn is None:
            try:
                address = _resolve_within(request.host, request.port, request.left())
                conn = Connection.open(address, request.host, request.port, request.tls, max(1e-3, min(http1.TIMEOUT_S, request.left())))
            except TimeoutError:
                return self._timed_out(request)
            except OSError as exc:
                return judge_failure(request, exc, False, False)
        conn.start(request, data)
        conn.deadline = request.deadline  # no call on the socket waits past it
        try:
            while not conn.advance(self._tls):
                pass  # the socket blocks: each step waits for what it needs, TIMEOUT_S at most, never past the deadline
        except TimeoutError:
            conn.close()
            return self._timed_out(request)
        except Exception as exc:  # noqa: BLE001 - a socket error, an answer not understood, anything: this request only
            conn.close()
            return judge_failure(request, exc, conn.reused, conn.answered_any)
        _, status, headers, body = conn.finish()
        self._keep(conn)
        return judge_answer(self.settings, request, status, headers, body)

    def _timed_out(self, request: GetRequest) -> tuple[str, Body | BaseException | None]:
        """A step that waited its longest: past the deadline, a StorageError; else no progress in TIMEOUT_S, as the loop
        gives up such a request (None)."""
        return ANSWER, request.late(self.settings) if request.left() <= 0 else None

    def _kept(self, request: GetRequest) -> Connection | None:
        """An idle connection to the request's host, if one is kept (those idle too long are closed on the way)."""
        now = time.monotonic()
        stale: list[Connection] = []
        found = None
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = [], os.getpid()  # the parent's: left to it (a child's copies close with them)
            for at in range(len(self._idle) - 1, -1, -1):
                conn = self._idle[at]
                if now - conn.progress_at > http1.KEEP_IDLE_S:
                    stale.append(self._idle.pop(at))
                elif found is None and (conn.host, conn.port) == (request.host, request.port):
                    found = self._idle.pop(at)
        for conn in stale:
            conn.close()
        return found

    def _keep(self, conn: Connection) -> None:
        with self._lock:
            if conn.keep and not self._closed and len(self._idle) < KEEP:
                self._idle.append(conn)
                return
        conn.close()


_RESOLVERS: ThreadPoolExecutor | None = None
_RESOLVERS_LOCK = threading.Lock()
RESOLVER_THREADS = 4


def _resolve_within(host: str, port: int, seconds: float) -> object:
    """`host`'s address, waited for `seconds` at most: a resolver that never answers ends the request by its
    deadline (the lookup runs on a small pool of threads; one still waiting there is left to finish alone).

    Raises:
        TimeoutError: no answer within `seconds`.
        OSError: the name does not resolve.
    """
    global _RESOLVERS
    literal = http1.literal_address(host, port)
    if literal is not None:
        return literal
    with _RESOLVERS_LOCK:
        if _RESOLVERS is None:
            _RESOLVERS = ThreadPoolExecutor(RESOLVER_THREADS, thread_name_prefix="gpufeed-resolve")
        pool = _RESOLVERS
    return pool.submit(http1.resolve, host, port).result(timeout=max(1e-3, seconds) if seconds < 1e9 else None)
