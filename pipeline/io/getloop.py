"""gpufeed's S3 client: signed GETs, many in flight on one thread, one request builder and one response parser.

A store 20 ms away must have tens of reads in flight to keep the CPUs fed.
On a pool of I/O threads each read is a thread: they wake one another,
queue for the interpreter lock, and switch five or six times per file,
which on a machine whose cores are all decoding costs more than the read
itself. A `GetLoop` keeps the same requests in flight on one thread: up to
`connections` kept-alive, non-blocking connections to the store, each with
one request at a time, and a `selectors` loop that sends a request, reads
its answer straight into the buffer that holds it, and starts the next one
on the same connection. A blocking read (`S3Transport.read_range`) is one
request on the same loop, waited for.

Each request is built by `_Request.head` (URL from `S3Settings`, Range,
Signature Version 4 from `s3sign`) and its answer read by `_Link` (status
line, headers, a body of Content-Length bytes or chunks). What it gives:
the bytes, FileNotFoundError for an object the store says is absent, or
None where the caller must read the object through s3fs. On the way:

- a 301 (or 400) with ``x-amz-bucket-region`` teaches the bucket's region
  once (`S3Settings.learn_region`), and the request goes again there; a
  403 is tried once more with credentials resolved afresh; a bucket that
  still redirects or refuses is left to s3fs from then on
  (`S3Settings.refuse`), not asked again per object;
- transient failures (a connection reset or dropped, a 500, 502, 503
  SlowDown, 504) are retried with exponential backoff and jitter, at most
  RETRIES times; a kept-alive connection the store closed meanwhile is
  tried again at once;
- a Content-Length or chunk size that is not a plain non-negative number
  is refused at once; bodies are capped (the range asked for, else
  BODY_LIMIT; an error document at ERROR_LIMIT);
- a whole-object GET asks for the store's checksum (``x-amz-checksum-mode:
  ENABLED``) and checks ``x-amz-checksum-crc32``, ``-sha1`` and ``-sha256``
  (full-object values; composite ``-N`` ones are not checked) and
  ``Content-MD5`` where the answer has one; a mismatch is retried like a
  transient failure, then left to s3fs; ranged reads carry no checksum;
- host names are resolved on a small thread pool (`_resolve`), never on the
  loop: requests in flight go on while a slow DNS answer is awaited.
"""

from __future__ import annotations

import base64
import collections
import errno
import hashlib
import heapq
import ipaddress
import random
import selectors
import socket
import ssl
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from .s3config import S3Settings
from .s3sign import canonical_query, sign_get
from .transport import Body, Into

IDLE_S = 1.0  # the longest the loop sleeps with nothing to do (it is woken for new requests)
KEEP_IDLE_S = 15.0  # a kept-alive connection unused this long is closed (stores close theirs after 20 s or so)
TIMEOUT_S = 60.0  # a connection with no progress this long is given up (its request: None)
HEAD_LIMIT = 64 << 10  # an answer's status line and headers
ERROR_LIMIT = 1 << 20  # the body of an answer that is not the object (an error document) is read up to this
BODY_LIMIT = 1 << 30  # the most bytes a whole-object GET reads; a larger object is left to s3fs
RECV_BYTES = 1 << 16  # what is read at a time before the body's size is known
RETRIES = 3  # transient failures retried per request
BACKOFF_S = 0.05  # the first retry's delay; doubled each time, with jitter
DNS_TTL_S = 30.0  # how long a resolved address is reused
DNS_THREADS = 2
RETRIED_STATUSES = (500, 502, 503, 504)

_CONNECTING, _HANDSHAKE, _SENDING, _READING = range(4)


def _resolve(host: str, port: int) -> Any:
    """The first address of `host` (a thread of the resolver pool calls it; tests replace it)."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]


class GetLoop:
    """GETs on one S3 endpoint, up to `connections` in flight, on one background thread (see the module).

    Args:
        settings: the endpoint, addressing, regions and credentials to use.
        connections: how many requests may be in flight at once, one per connection.
    """

    def __init__(self, settings: S3Settings, connections: int) -> None:
        self.settings = settings
        self.connections = max(1, connections)
        self._tls: Any = None
        if settings.scheme == "https":
            self._tls = ssl.create_default_context(cafile=settings.tls_ca)
        self._selector = selectors.DefaultSelector()
        self._waker_in, self._waker_out = socket.socketpair()
        self._waker_in.setblocking(False)
        self._waker_out.setblocking(False)
        self._selector.register(self._waker_in, selectors.EVENT_READ, None)
        self._queue: collections.deque[_Request] = collections.deque()
        self._lock = threading.Lock()
        self._closing = False
        self._idle: list[_Link] = []
        self._busy: set[_Link] = set()
        self._later: list[tuple[float, int, _Request]] = []  # (when, order, request): retries waiting out a backoff
        self._order = 0
        self._addresses: dict[tuple[str, int], tuple[Any, float]] = {}
        self._resolving: dict[tuple[str, int], list[_Request]] = {}
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
        """
        future: Future[Body | None] = Future()
        bucket, _, key = path.partition("/")
        if not bucket or (not key and query is None) or self.settings.refused(bucket) or self.settings.bucket_url(bucket) is None:
            future.set_result(None)
            return future
        with self._lock:
            if self._closing:
                future.cancel()
                return future
            wake = not self._queue  # a queue with requests in it is looked at whenever a connection comes free
            self._queue.append(_Request(bucket, key, start, end, query, future, into))
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
                timeout = IDLE_S
                if self._later:
                    timeout = max(0.0, min(timeout, self._later[0][0] - time.monotonic()))
                for key, _ in self._selector.select(timeout=timeout):
                    if key.data is None:
                        self._drain_waker()
                    else:
                        self._step(key.data)
                self._release_due()
                self._start_queued()
                if time.monotonic() - self._expired_at > min(1.0, IDLE_S):
                    self._expire()
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

    def _retry_later(self, request: _Request) -> bool:
        """Put `request` back after a backoff; False once it has had its RETRIES."""
        if request.attempts >= RETRIES or self._closing:
            return False
        delay = BACKOFF_S * (2**request.attempts) * (0.5 + random.random())
        request.attempts += 1
        self._order += 1
        heapq.heappush(self._later, (time.monotonic() + delay, self._order, request))
        return True

    def _again(self, request: _Request) -> None:
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
            if request.future.cancelled():
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
            link = self._idle_link(request) or self._new_link(request, address)
            if link is None:
                continue  # the request was answered None: no connection could be made
            try:
                self._begin(link, request)
            except Exception:  # noqa: BLE001 - signing failed (credentials, clock): the caller reads it its way
                self._busy.discard(link)
                self._drop(link)
                request.answer(None)

    def _address(self, request: _Request) -> Any:
        """The request's host's address, known or a literal; None: it is being resolved (the request waits for it)."""
        where = (request.host, request.port)
        known = self._addresses.get(where)
        if known is not None and time.monotonic() - known[1] < DNS_TTL_S:
            return known[0]
        try:
            ipaddress.ip_address(request.host)
        except ValueError:
            pass
        else:
            address = socket.getaddrinfo(request.host, request.port, type=socket.SOCK_STREAM)[0]  # a literal: no DNS
            self._addresses[where] = (address, time.monotonic())
            return address
        with self._lock:
            waiting = self._resolving.get(where)
            if waiting is not None:
                waiting.append(request)
                return None
            self._resolving[where] = [request]
        try:
            self._pool.submit(_resolve, *where).add_done_callback(lambda done: self._resolved(where, done))
        except RuntimeError:  # shutting down
            self._resolving.pop(where, None)
            request.future.cancel()
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

    def _idle_link(self, request: _Request) -> _Link | None:
        """A kept-alive connection to the request's host, if one is idle (one to another host is closed for room)."""
        for at, link in enumerate(self._idle):
            if (link.host, link.port) == (request.host, request.port):
                return self._idle.pop(at)
        if self._idle and len(self._idle) + len(self._busy) >= self.connections:
            self._drop(self._idle.pop(0))
        return None

    def _new_link(self, request: _Request, address: Any) -> _Link | None:
        try:
            sock = socket.socket(address[0], address[1], address[2])
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            code = sock.connect_ex(address[4])
        except OSError:
            if not self._retry_later(request):
                request.answer(None)
            return None
        if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            if not self._retry_later(request):
                request.answer(None)
            return None
        return _Link(sock, request.host, request.port, request.tls)

    def _begin(self, link: _Link, request: _Request) -> None:
        """Sign `request` and start it on `link`."""
        credentials = None
        if not self.settings.anonymous:
            assert self.settings.credentials is not None
            credentials = self.settings.credentials.get(fresh=request.fresh_credentials)
            request.fresh_credentials = False
            if credentials is None:
                self._idle.append(link)
                request.answer(None)
                return
        link.start(request, request.head(credentials, self.settings.region_of(request.bucket)))
        self._busy.add(link)
        self._watch(link)
        if link.state == _SENDING:
            self._step(link)  # most requests go out at once, without a round through the selector

    def _watch(self, link: _Link) -> None:
        events = selectors.EVENT_WRITE if link.wants_write else selectors.EVENT_READ
        if link.registered is None:
            self._selector.register(link.sock, events, link)
        elif link.registered != events:
            self._selector.modify(link.sock, events, link)
        link.registered = events

    def _step(self, link: _Link) -> None:
        """Move `link` on as far as its socket allows; finish its request when the answer is whole."""
        try:
            done = link.advance(self._tls)
        except Exception as exc:  # noqa: BLE001 - a socket error, an answer not understood, anything: this request only
            self._fail(link, exc)
            return
        if not done:
            self._watch(link)
            return
        request, status, headers, body = link.finish()
        self._busy.discard(link)
        if link.keep and not self._closing:
            self._unwatch(link)
            self._idle.append(link)
        else:
            self._drop(link)
        self._settle(request, status, headers, body)

    def _settle(self, request: _Request, status: int, headers: dict[str, str], body: Body) -> None:
        """What the answer means for `request`: its bytes, absence, another try, or None (see the module)."""
        settings = self.settings
        if status in (200, 206) and starts_at(headers.get("content-range"), request.start, status):
            if request.whole and not checksum_matches(headers, body):
                if not self._retry_later(request):
                    request.answer(None)
                return
            request.answer(body)
        elif status == 404:
            request.answer(FileNotFoundError(f"no such object: s3://{request.bucket}/{request.key}"))
        elif status in (301, 307, 400) and settings.learn_region(request.bucket, headers.get("x-amz-bucket-region", "")):
            self._again(request)  # the bucket lives elsewhere: learnt once, every later request goes there
        elif status == 403 and not settings.anonymous and not request.refreshed:
            request.refreshed = request.fresh_credentials = True  # they may have expired: resolved anew, once
            self._again(request)
        elif status in RETRIED_STATUSES and self._retry_later(request):
            pass
        else:
            if status in (301, 307, 403) or (status == 400 and "x-amz-bucket-region" in headers):
                settings.refuse(request.bucket)  # the fast path cannot reach it: s3fs, from now on
            request.answer(None)

    def _fail(self, link: _Link, exc: BaseException) -> None:
        request = link.request
        self._busy.discard(link)
        self._drop(link)
        if request is None:
            return
        if isinstance(exc, ValueError):  # an answer not understood or over its bound: not something a retry mends
            request.answer(None)
        elif link.reused and not link.answered_any and not request.stale_retried:
            request.stale_retried = True  # the store closed a kept-alive connection meanwhile: once more on a new one
            self._again(request)
        elif not self._retry_later(request):
            request.answer(None)

    def _expire(self) -> None:
        """Give up requests that made no progress for TIMEOUT_S; close connections idle for KEEP_IDLE_S."""
        now = self._expired_at = time.monotonic()
        for link in [link for link in self._busy if now - link.progress_at > TIMEOUT_S]:
            self._busy.discard(link)
            self._drop(link)
            if link.request is not None:
                link.request.answer(None)
        for link in [link for link in self._idle if now - link.progress_at > KEEP_IDLE_S]:
            self._idle.remove(link)
            self._drop(link)

    def _unwatch(self, link: _Link) -> None:
        if link.registered is not None:
            self._selector.unregister(link.sock)
            link.registered = None

    def _drop(self, link: _Link) -> None:
        self._unwatch(link)
        link.close()

    def _shut_down(self) -> None:
        with self._lock:
            self._closing = True
            queued = list(self._queue) + [entry[2] for entry in self._later]
            for waiting in self._resolving.values():
                queued += waiting
            self._queue.clear()
            self._later.clear()
            self._resolving.clear()
        for link in list(self._busy):
            if link.request is not None:
                queued.append(link.request)
            self._drop(link)
        for link in self._idle:
            self._drop(link)
        self._busy.clear()
        self._idle.clear()
        for request in queued:
            request.future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._selector.close()
        self._waker_in.close()
        self._waker_out.close()


class _Request:
    """One GET: what it asks for, where it goes now (`place`), its tries, and the future its answer goes to."""

    __slots__ = (
        "bucket", "key", "start", "end", "query", "future", "into", "url", "host", "port", "netloc", "path", "tls",
        "attempts", "stale_retried", "refreshed", "fresh_credentials",
    )  # fmt: skip

    def __init__(
        self,
        bucket: str,
        key: str,
        start: int,
        end: int | None,
        query: dict[str, str] | None,
        future: Future[Body | None],
        into: Into | None,
    ) -> None:
        self.bucket, self.key, self.start, self.end, self.query = bucket, key, start, end, query
        self.future, self.into = future, into
        self.url = self.host = self.netloc = self.path = ""
        self.port, self.tls = 0, False
        self.attempts = 0
        self.stale_retried = self.refreshed = self.fresh_credentials = False

    @property
    def whole(self) -> bool:
        """Whether the whole object is asked for (its checksum is asked for and checked)."""
        return self.query is None and self.start == 0 and self.end is None

    @property
    def most(self) -> int:
        """The most bytes the object's answer may have: the range's length, else BODY_LIMIT."""
        return BODY_LIMIT if self.end is None else max(0, self.end - self.start)

    def place(self, settings: S3Settings) -> None:
        """Where the request goes now (the bucket's region may have been learnt since the last try)."""
        url = settings.bucket_url(self.bucket) if self.query is not None else settings.url(self.bucket, self.key)
        if url is None:
            raise ValueError("the bucket's name does not fit the addressing")
        parts = urlsplit(url)
        self.url, self.netloc, self.path, self.tls = url, parts.netloc, parts.path or "/", parts.scheme == "https"
        self.host, self.port = parts.hostname or "", parts.port or (443 if self.tls else 80)

    def head(self, credentials: Any, region: str) -> bytes:
        """The request's bytes: the one request builder (signed where `credentials` are given)."""
        headers: dict[str, str] = {}
        if self.start or self.end is not None:
            headers["Range"] = f"bytes={self.start}-{'' if self.end is None else self.end - 1}"
        if self.whole:
            headers["x-amz-checksum-mode"] = "ENABLED"
        query = canonical_query(self.query) if self.query is not None else ""
        if credentials is not None:
            headers = sign_get(self.netloc, self.path, headers, credentials, region, query=query)
        target = f"{self.path}?{query}" if query else self.path
        text = f"GET {target} HTTP/1.1\r\nHost: {self.netloc}\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in headers.items()
        )
        return (text + "\r\n").encode("latin-1")

    def answer(self, value: Body | BaseException | None) -> None:
        if self.future.done():
            return
        if isinstance(value, BaseException):
            self.future.set_exception(value)
        else:
            self.future.set_result(value)


class _Link:
    """One non-blocking connection to the store and the request on it, as a small state machine: the one parser."""

    def __init__(self, sock: socket.socket, host: str, port: int, tls: bool) -> None:
        self.sock: Any = sock
        self.host, self.port, self.tls = host, port, tls
        self.state = _CONNECTING
        self.wants_write = True  # a connect in progress is finished when the socket turns writable
        self.registered: int | None = None
        self.request: _Request | None = None
        self.reused = False
        self.served = 0
        self.progress_at = time.monotonic()
        self.keep = False
        self.answered_any = False
        self._out = memoryview(b"")
        self._head = bytearray()
        self._status = 0
        self._headers: dict[str, str] = {}
        self._body: Body | None = None
        self._got = 0
        self._chunks: _Chunks | None = None

    def start(self, request: _Request, data: bytes) -> None:
        self.request = request
        self.reused = self.served > 0
        self._out = memoryview(data)
        self._head = bytearray()
        self._body = None
        self._chunks = None
        self._got = 0
        self.answered_any = False
        self.progress_at = time.monotonic()
        if self.state == _READING:  # a kept-alive connection: its next request goes straight out
            self.state = _SENDING

    def advance(self, tls: Any) -> bool:
        """Do what the socket allows now; True once the whole answer is in."""
        if self.state == _CONNECTING:
            failure = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if failure:
                raise OSError(failure, "cannot connect to the store")
            if self.tls:
                self.sock = tls.wrap_socket(self.sock, server_hostname=self.host, do_handshake_on_connect=False)
                self.state = _HANDSHAKE
            else:
                self.state = _SENDING
        if self.state == _HANDSHAKE:
            if not self._io(self.sock.do_handshake):
                return False
            self.state = _SENDING
        if self.state == _SENDING:
            while self._out:
                sent = self._io(self.sock.send, self._out, writing=True)
                if sent is None:
                    return False
                self._out = self._out[sent:]
            self.state, self.wants_write = _READING, False
        return self._read()

    def _read(self) -> bool:
        while True:
            if self._body is None and self._chunks is None:
                data = self._io(self.sock.recv, RECV_BYTES)
                if data is None:
                    return False
                if not data:
                    raise ConnectionResetError("the store closed the connection")
                self.answered_any = True
                self._head += data
                if not self._parse_head():
                    continue
            elif self._chunks is not None:
                data = self._io(self.sock.recv, RECV_BYTES)
                if data is None:
                    return False
                if not data:
                    raise ConnectionResetError("the store closed the connection in a chunked answer")
                self._chunks.feed(data)
            else:
                assert self._body is not None
                view = memoryview(self._body)[self._got :]
                got = self._io(self.sock.recv_into, view) if view else 0
                if got is None:
                    return False
                if view and not got:
                    raise ConnectionResetError(f"the answer ended after {self._got} of {len(self._body)} bytes")
                self._got += got
            if self._chunks is not None:
                if self._chunks.done:
                    self._body = self._chunks.body()
                    return True
            elif self._body is not None and self._got >= len(self._body):
                return True
            if not self.tls:
                return False  # one read per readiness; a TLS socket may hold decrypted bytes the selector cannot see

    def _parse_head(self) -> bool:
        """True once the status line and headers are in (the body's buffer is made, with what followed them)."""
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > HEAD_LIMIT:
                raise ValueError("an answer's headers too long")
            return False
        lines = bytes(self._head[:end]).decode("latin-1").split("\r\n")
        version, status, *_ = lines[0].split(" ", 2) + [""]
        if not version.startswith("HTTP/1.") or not status.isdigit() or len(status) != 3:
            raise ValueError(f"not an HTTP answer: {lines[0][:64]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length" and headers.get(name, value) != value:
                raise ValueError("an answer with two lengths")
            headers[name] = value
        self._status, self._headers = int(status), headers
        self.keep = version != "HTTP/1.0" and headers.get("connection", "").lower() != "close"
        assert self.request is not None
        limit = self.request.most if self._is_the_object(self.request) else ERROR_LIMIT
        rest = self._head[end + 4 :]
        if headers.get("transfer-encoding", "").lower() == "chunked":
            self._chunks = _Chunks(limit)
            self._chunks.feed(rest)
            return True
        if "transfer-encoding" in headers:
            raise ValueError(f"an answer in {headers['transfer-encoding']!r} encoding")
        if "content-length" not in headers:
            raise ValueError("an answer without a length")  # read to the end: rare; s3fs reads it instead
        length = _length(headers["content-length"])
        if length > limit:
            raise ValueError(f"an answer of {length} bytes, over the {limit} it may have")
        if len(rest) > length:
            raise ValueError("more bytes than the answer's length")  # nothing was asked for after it
        body = self._buffer(length)
        body[: len(rest)] = rest
        self._body = body
        self._got = len(rest)
        return True

    def _buffer(self, length: int) -> bytearray | memoryview:
        """Where the body goes: the caller's buffer for the bytes it asked for, where it gives one; else a new one."""
        request = self.request
        assert request is not None
        if request.into is not None and self._is_the_object(request):
            view = request.into(length)
            if view is not None and len(view) == length:
                return view
        return bytearray(length)

    def _is_the_object(self, request: _Request) -> bool:
        return self._status in (200, 206) and starts_at(self._headers.get("content-range"), request.start, self._status)

    def finish(self) -> tuple[_Request, int, dict[str, str], Body]:
        """(the request, the answer's status, headers and body); the link is free for its next request."""
        request, body = self.request, self._body
        assert request is not None and body is not None
        self.request, self._body, self._chunks = None, None, None
        self.served += 1
        return request, self._status, self._headers, body

    def _io(self, call: Any, *args: Any, writing: bool = False) -> Any:
        """`call(*args)`, or None where the socket must wait (and which way: `wants_write`)."""
        try:
            result = call(*args)
        except BlockingIOError:
            self.wants_write = writing
            return None
        except ssl.SSLWantReadError:
            self.wants_write = False
            return None
        except ssl.SSLWantWriteError:
            self.wants_write = True
            return None
        self.progress_at = time.monotonic()
        return True if result is None else result

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _Chunks:
    """A chunked body decoded as it comes, sizes checked at once, at most `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.done = False
        self._raw = bytearray()
        self._pieces: list[bytes] = []
        self._size = 0

    def feed(self, data: bytes | bytearray) -> None:
        self._raw += data
        while not self.done:
            line_end = self._raw.find(b"\r\n")
            if line_end < 0:
                if len(self._raw) > 1024:
                    raise ValueError("a chunk size line too long")
                return
            size_text = bytes(self._raw[:line_end]).split(b";")[0].strip()
            if not size_text or len(size_text) > 16 or any(c not in b"0123456789abcdefABCDEF" for c in size_text):
                raise ValueError(f"a chunk size that is not a hex number: {size_text[:20]!r}")
            size = int(size_text, 16)
            if size == 0:
                trailers_end = self._raw.find(b"\r\n\r\n", line_end)
                if self._raw[line_end : line_end + 4] == b"\r\n\r\n" or trailers_end >= 0:
                    self.done = True
                elif len(self._raw) > HEAD_LIMIT:
                    raise ValueError("chunked trailers too long")
                return
            if self._size + size > self.limit:
                raise ValueError(f"a chunked answer over the {self.limit} bytes it may have")
            if len(self._raw) < line_end + 2 + size + 2:
                return
            start = line_end + 2
            if self._raw[start + size : start + size + 2] != b"\r\n":
                raise ValueError("a chunk not followed by CRLF")
            self._pieces.append(bytes(self._raw[start : start + size]))
            self._size += size
            del self._raw[: start + size + 2]

    def body(self) -> bytearray:
        return bytearray(b"".join(self._pieces))


def _length(text: str) -> int:
    """A Content-Length: plain decimal digits only (a sign, a space, hex or 20 digits are refused at once)."""
    if not text.isdigit() or not text.isascii() or len(text) > 19:
        raise ValueError(f"a Content-Length that is not a byte count: {text[:32]!r}")
    return int(text)


def starts_at(content_range: str | None, start: int, status: int) -> bool:
    """Whether an answer's body begins at byte `start` of the object.

    A 206 says where in its Content-Range; so does the 200 some S3 servers send
    for a range (rclone's). A 200 without one is the whole object: its start.
    """
    if content_range is None:
        return status == 206 or start == 0
    unit, _, rest = content_range.partition(" ")
    first = rest.partition("-")[0]
    return unit.strip().lower() == "bytes" and first.strip().isdigit() and int(first) == start


def checksum_matches(headers: dict[str, str], body: Body) -> bool:
    """Whether `body` has the checksums its answer carries (those a whole-object GET can be checked against).

    Checked: x-amz-checksum-crc32, -sha1, -sha256 (base64 of the big-endian
    CRC or the digest) and Content-MD5. A composite value (``...-N``, a
    multipart object's checksum of part checksums), CRC32C and CRC64NVME are
    not checked.
    """
    checks = {
        "x-amz-checksum-crc32": lambda data: zlib.crc32(data).to_bytes(4, "big"),
        "x-amz-checksum-sha1": lambda data: hashlib.sha1(data).digest(),
        "x-amz-checksum-sha256": lambda data: hashlib.sha256(data).digest(),
        "content-md5": lambda data: hashlib.md5(data).digest(),
    }
    for name, digest in checks.items():
        value = headers.get(name)
        if not value or "-" in value:
            continue
        try:
            expected = base64.b64decode(value, validate=True)
        except ValueError:
            return False
        if digest(body) != expected:
            return False
    return True
