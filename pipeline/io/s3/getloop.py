"""gpufeed's S3 client for reads ahead: many signed GETs in flight on one event-loop thread.

A store 20 ms away must have tens of reads in flight to keep the CPUs fed.
On a pool of I/O threads each read is a thread: they wake one another,
queue for the interpreter lock, and switch five or six times per file,
which on a machine whose cores are all decoding costs more than the read
itself. A `GetLoop` keeps the same requests in flight on one thread: up to
`connections` kept-alive, non-blocking connections to the store
(`http1.Connection`, each with one request at a time), and a `selectors`
loop that sends a request, reads its answer straight into the buffer that
holds it, and starts the next one on the same connection. A blocking read
does not come here: it is sent on the caller's own thread
(`blocking.BlockingClient`), through the same request builder, parser
and decisions.

Each request is built by `request.GetRequest` (URL from `S3Settings`,
Range, Signature Version 4 from `sign`) and its answer read by
`http1.Connection`. What it gives: the bytes, FileNotFoundError for an
object the store says is absent, or None where the caller must read the
object through s3fs. On the way (`request.judge_answer`,
`judge_failure`):

- a 301 (or 400) with ``x-amz-bucket-region`` teaches the bucket's region
  (`S3Settings.learn_region`), and the request goes again there, at most
  `request.MAX_REGION_CHANGES` times and never back to a region it was
  sent to (a StorageError then); a 403 is tried once more with
  credentials resolved afresh; a bucket that still refuses, or redirects
  without naming a region, is left to s3fs from then on
  (`S3Settings.refuse`), not asked again per object;
- transient failures (a connection reset or dropped, a 500, 502, 503
  SlowDown, 504) are retried with exponential backoff and jitter, at most
  RETRIES times; a kept-alive connection the store closed meanwhile is
  tried again at once;
- a Content-Length or chunk size that is not a plain non-negative number
  is refused at once; bodies are capped (`http1`);
- a whole-object GET asks for the store's checksum (``x-amz-checksum-mode:
  ENABLED``) and checks ``x-amz-checksum-crc32``, ``-sha1`` and ``-sha256``
  (full-object values; composite ``-N`` ones are not checked) and
  ``Content-MD5`` where the answer has one; a mismatch is retried like a
  transient failure, then left to s3fs; ranged reads carry no checksum;
- host names are resolved on a small thread pool (`http1.resolve`), never
  on the loop: requests in flight go on while a slow DNS answer is awaited;
- a connection with no progress for `http1.TIMEOUT_S` gives its request None; one
  idle for `http1.KEEP_IDLE_S` is closed; a request still unanswered at its
  deadline (`S3Settings.deadline_s`, from its first try, retries included)
  gives a StorageError, however slowly its bytes still come;
- the bodies in flight hold at most `budget_bytes` (READ_AHEAD_BYTES) by
  the lengths their answers declare: an answer whose length does not fit
  beside the others waits, its head read, until it does (one answer is
  always let in), so the memory of reads ahead is bounded by bytes, not
  by their count; a body's buffer grows as its bytes come (`http1`), so a
  length declared and never sent costs nothing.
"""

from __future__ import annotations

import collections
import heapq
import selectors
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..transport import Body, Into
from . import http1
from .config import S3Settings
from .http1 import SENDING, Connection
from .request import AGAIN, RETRY, GetRequest, Verdict, judge_answer, judge_failure

IDLE_S = 1.0  # the longest the loop sleeps with nothing to do (it is woken for new requests)
READ_AHEAD_BYTES = 256 << 20  # the most body bytes the answers in flight may declare at once (see the module)
DNS_TTL_S = 30.0  # how long a resolved address is reused
DNS_THREADS = 2


class GetLoop:
    """GETs on one S3 endpoint, up to `connections` in flight, on one background thread (see the module).

    Args:
        settings: the endpoint, addressing, regions and credentials to use.
        connections: how many requests may be in flight at once, one per connection.
        budget_bytes: the most body bytes the answers in flight may declare at once (one is let in whatever its size).
    """

    def __init__(self, settings: S3Settings, connections: int, budget_bytes: int = READ_AHEAD_BYTES) -> None:
        self.settings = settings
        self.connections = max(1, connections)
        self._budget = http1.ByteBudget(budget_bytes)
        self._held: collections.deque[Connection] = collections.deque()  # answers waiting for the budget, in turn
        self._soonest = float("inf")  # no request in flight has an earlier deadline
        self._tls = http1.tls_context(settings)
        self._selector = selectors.DefaultSelector()
        self._waker_in, self._waker_out = socket.socketpair()
        self._waker_in.setblocking(False)
        self._waker_out.setblocking(False)
        self._selector.register(self._waker_in, selectors.EVENT_READ, None)
        self._queue: collections.deque[GetRequest] = collections.deque()
        self._lock = threading.Lock()
        self._closing = False
        self._idle: list[Connection] = []
        self._busy: set[Connection] = set()
        self._later: list[tuple[float, int, GetRequest]] = []  # (when, order, request): retries waiting out a backoff
        self._order = 0
        self._addresses: dict[tuple[str, int], tuple[Any, float]] = {}
        self._resolving: dict[tuple[str, int], list[GetRequest]] = {}
        self._pool = ThreadPoolExecutor(DNS_THREADS, thread_name_prefix="gpufeed-resolve")
        self._expired_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="gpufeed-get-loop", daemon=True)
        self._thread.start()

    def get(
        self,
        path: str,
        end: int | None = None,
        start: int = 0,
        into: Into | None = None,
        query: dict[str, str] | None = None,
    ) -> Future[Body | None]:
        """Bytes `start` to `end` (exclusive; to its end if None) of ``bucket/key``, when they come.

        The future's result is the bytes (fewer when the object ends first),
        or None where the caller must read the object another way; it raises
        FileNotFoundError when the store says there is no such object. It is
        cancelled when the loop is closed first. `query` (for a request on
        the bucket itself, ``bucket/`` and no key: a listing) is sent as the
        query string.

        `into`, where given, is asked (on the loop's thread) for a buffer of
        the body's size once the store has said it; the body is read straight
        into the writable memoryview it gives, which is then the result. None
        (or a view of another size) reads the body into a new bytearray.

        The future raises StorageError where the store sends the request from
        region to region or does not answer it whole by its deadline.
        """
        future: Future[Body | None] = Future()
        asked = GetRequest.askable(self.settings, path, query)
        if asked is None:
            future.set_result(None)
            return future
        bucket, key = asked
        with self._lock:
            if self._closing:
                future.cancel()
                return future
            wake = not self._queue  # a queue with requests in it is looked at whenever a connection comes free
            self._queue.append(GetRequest(bucket, key, start, end, query, future, into))
        if wake:
            self._wake()
        return future

    def close(self) -> None:
        """Stop the loop: requests not answered yet are cancelled, connections closed."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # -- the loop thread

    def _wake(self) -> None:
        try:
            self._waker_out.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is pending already (or the loop has gone)

    def _run(self) -> None:
        try:
            while not self._closing:
                timeout = min(IDLE_S, self._soonest - time.monotonic())
                if self._later:
                    timeout = min(timeout, self._later[0][0] - time.monotonic())
                for key, _ in self._selector.select(timeout=max(0.0, timeout)):
                    if key.data is None:
                        self._drain_waker()
                    else:
                        self._step(key.data)
                self._release_due()
                self._start_queued()
                now = time.monotonic()
                if now - self._expired_at > min(1.0, IDLE_S) or now >= self._soonest:
                    self._expire()
                if self._held:
                    self._resume_held()
        finally:
            self._shut_down()

    def _drain_waker(self) -> None:
        try:
            while self._waker_in.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _release_due(self) -> None:
        now = time.monotonic()
        while self._later and self._later[0][0] <= now:
            request = heapq.heappop(self._later)[2]
            with self._lock:
                self._queue.appendleft(request)

    def _retry_later(self, request: GetRequest) -> bool:
        """Put `request` back after a backoff; False once it has had its RETRIES."""
        delay = None if self._closing else request.backoff()
        if delay is None:
            return False
        self._order += 1
        heapq.heappush(self._later, (time.monotonic() + delay, self._order, request))
        return True

    def _again(self, request: GetRequest) -> None:
        """Send `request` again at once (a region learnt, credentials refreshed, a stale connection)."""
        with self._lock:
            self._queue.appendleft(request)
        self._wake()

    def _start_queued(self) -> None:
        while True:
            with self._lock:
                if not self._queue or len(self._busy) >= self.connections:
                    return
                request = self._queue.popleft()
            if request.cancelled:
                continue
            if request.left() <= 0:  # sent before, and its deadline passed while it waited
                request.answer(request.late(self.settings))
                continue
            if self.settings.refused(request.bucket):
                request.answer(None)
                continue
            try:
                request.place(self.settings)
            except ValueError:
                request.answer(None)
                continue
            address = self._address(request)
            if address is None:
                continue  # parked until its host is resolved
            conn = self._idle_connection(request) or self._new_connection(request, address)
            if conn is None:
                continue  # the request was answered None: no connection could be made
            try:
                self._begin(conn, request)
            except Exception:  # noqa: BLE001 - signing failed (credentials, clock): the caller reads it its way
                self._busy.discard(conn)
                self._drop(conn)
                request.answer(None)

    def _address(self, request: GetRequest) -> Any:
        """The request's host's address, known or a literal; None: it is being resolved (the request waits for it)."""
        where = (request.host, request.port)
        known = self._addresses.get(where)
        if known is not None and time.monotonic() - known[1] < DNS_TTL_S:
            return known[0]
        address = http1.literal_address(request.host, request.port)
        if address is not None:
            self._addresses[where] = (address, time.monotonic())
            return address
        if request.deadline is not None:  # parked: a resolver that never answers still ends it by its deadline
            self._soonest = min(self._soonest, request.deadline)
        with self._lock:
            waiting = self._resolving.get(where)
            if waiting is not None:
                waiting.append(request)
                return None
            self._resolving[where] = [request]
        try:
            self._pool.submit(http1.resolve, *where).add_done_callback(lambda done: self._resolved(where, done))
        except RuntimeError:  # shutting down
            self._resolving.pop(where, None)
            request.cancel()
        return None

    def _resolved(self, where: tuple[str, int], done: Future[Any]) -> None:
        """(On a resolver thread) the address is known: its requests go back to the queue."""
        with self._lock:
            waiting = self._resolving.pop(where, [])
            if done.cancelled():
                return
            if done.exception() is None:
                self._addresses[where] = (done.result(), time.monotonic())
                self._queue.extendleft(reversed(waiting))
                waiting = []
        for request in waiting:  # the name does not resolve: the caller reads it its way (s3fs says why)
            request.answer(None)
        self._wake()

    def _idle_connection(self, request: GetRequest) -> Connection | None:
        """A kept-alive connection to the request's host, if one is idle (one to another host is closed for room)."""
        for at, conn in enumerate(self._idle):
            if (conn.host, conn.port) == (request.host, request.port):
                return self._idle.pop(at)
        if self._idle and len(self._idle) + len(self._busy) >= self.connections:
            self._drop(self._idle.pop(0))
        return None

    def _new_connection(self, request: GetRequest, address: Any) -> Connection | None:
        try:
            conn = Connection.open(address, request.host, request.port, request.tls)
        except OSError:
            if not self._retry_later(request):
                request.answer(None)
            return None
        conn.budget = self._budget
        return conn

    def _begin(self, conn: Connection, request: GetRequest) -> None:
        """Sign `request` and start it on `conn`."""
        data = request.signed(self.settings)
        if data is None:  # no credentials: the caller reads it its way
            self._idle.append(conn)
            request.answer(None)
            return
        conn.start(request, data)
        self._busy.add(conn)
        if request.deadline is not None:
            self._soonest = min(self._soonest, request.deadline)
        self._watch(conn)
        if conn.state == SENDING:
            self._step(conn)  # most requests go out at once, without a round through the selector

    def _watch(self, conn: Connection) -> None:
        events = selectors.EVENT_WRITE if conn.wants_write else selectors.EVENT_READ
        if conn.registered is None:
            self._selector.register(conn.sock, events, conn)
        elif conn.registered != events:
            self._selector.modify(conn.sock, events, conn)
        conn.registered = events

    def _step(self, conn: Connection) -> None:
        """Move `conn` on as far as its socket allows; finish its request when the answer is whole."""
        try:
            done = conn.advance(self._tls)
        except Exception as exc:  # noqa: BLE001 - a socket error, an answer not understood, anything: this request only
            self._fail(conn, exc)
            return
        if not done:
            if conn.held:  # its socket is not watched until the budget has room (`_resume_held`)
                self._unwatch(conn)
                self._held.append(conn)
            else:
                self._watch(conn)
            return
        request, status, headers, body = conn.finish()
        self._busy.discard(conn)
        if conn.keep and not self._closing:
            self._unwatch(conn)
            self._idle.append(conn)
        else:
            self._drop(conn)
        self._carry_out(request, judge_answer(self.settings, request, status, headers, body))

    def _carry_out(self, request: GetRequest, verdict: Verdict) -> None:
        """Do what `request` decided for `request`: answer it, send it again at once, or after a backoff."""
        what, value = verdict
        if what == AGAIN:
            self._again(request)
        elif what == RETRY:
            if not self._retry_later(request):
                request.answer(None)
        else:
            request.answer(value)

    def _fail(self, conn: Connection, exc: BaseException) -> None:
        request = conn.request
        self._busy.discard(conn)
        self._drop(conn)
        if request is not None:
            self._carry_out(request, judge_failure(request, exc, conn.reused, conn.answered_any))

    def _resume_held(self) -> None:
        """Let the held answers on, in turn, as far as the budget has room for them."""
        while self._held:
            conn = self._held[0]
            if conn not in self._busy or not conn.held:  # given up meanwhile
                self._held.popleft()
                continue
            if not self._budget.fits(conn.wanted):
                return
            self._held.popleft()
            self._step(conn)

    def _expire(self) -> None:
        """Give up requests past their deadline (a StorageError) or with no progress for TIMEOUT_S (None); close
        connections idle for KEEP_IDLE_S."""
        now = self._expired_at = time.monotonic()
        self._soonest = float("inf")
        for conn in list(self._busy):
            request = conn.request
            deadline = float("inf") if request is None or request.deadline is None else request.deadline
            late = deadline <= now
            if not late and (conn.held or now - conn.progress_at <= http1.TIMEOUT_S):  # a held one waits for us
                self._soonest = min(self._soonest, deadline)
                continue
            self._busy.discard(conn)
            self._drop(conn)
            if request is not None:
                request.answer(request.late(self.settings) if late else None)
        for conn in [conn for conn in self._idle if now - conn.progress_at > http1.KEEP_IDLE_S]:
            self._idle.remove(conn)
            self._drop(conn)
        overdue: list[GetRequest] = []
        with self._lock:  # requests parked while their host's name is resolved: the deadline counts there too
            for waiting in self._resolving.values():
                kept: list[GetRequest] = []
                for request in waiting:
                    deadline = float("inf") if request.deadline is None else request.deadline
                    if deadline <= now:
                        overdue.append(request)
                    else:
                        kept.append(request)
                        self._soonest = min(self._soonest, deadline)
                waiting[:] = kept
        for request in overdue:
            request.answer(request.late(self.settings))

    def _unwatch(self, conn: Connection) -> None:
        if conn.registered is not None:
            self._selector.unregister(conn.sock)
            conn.registered = None

    def _drop(self, conn: Connection) -> None:
        self._unwatch(conn)
        conn.close()

    def _shut_down(self) -> None:
        with self._lock:
            self._closing = True
            queued = list(self._queue) + [entry[2] for entry in self._later]
            for waiting in self._resolving.values():
                queued += waiting
            self._queue.clear()
            self._later.clear()
            self._resolving.clear()
        for conn in list(self._busy):
            if conn.request is not None:
                queued.append(conn.request)
            self._drop(conn)
        for conn in self._idle:
            self._drop(conn)
        self._busy.clear()
        self._idle.clear()
        for request in queued:
            request.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._selector.close()
        self._waker_in.close()
        self._waker_out.close()
