"""Many signed GETs in flight on one thread: how prepare reads a remote SRC's files, a store's latency hidden.

A store 20 ms away must have tens of reads in flight to keep the CPUs fed.
On a pool of I/O threads each read is a thread: they wake one another,
queue for the interpreter lock, and switch five or six times per file,
which on a machine whose cores are all decoding costs more than the read
itself. A `GetLoop` keeps the same requests in flight on one thread: up to
`connections` kept-alive, non-blocking connections to the store, each with
one request at a time, and a `selectors` loop that sends a request, reads
its answer straight into the buffer that holds it, and starts the next one
on the same connection. That is under half the CPU per file, and one
wake-up where the threads had several.

It sends what `s3get.S3Getter.get` sends (the same URL, Range and
Signature Version 4) and gives what it gives: the bytes, FileNotFoundError
for an object the store says is absent, or None for anything else (another
status, a chunked answer, a connection that failed or timed out), where the
caller reads the file the ordinary way. TLS endpoints are read the same way,
their handshake done without blocking.
"""

from __future__ import annotations

import collections
import errno
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any
from urllib.parse import urlsplit

from .s3get import S3Getter, sign_get, starts_at

IDLE_S = 1.0  # the longest the loop sleeps with nothing to do (it is woken for new requests)
KEEP_IDLE_S = 15.0  # a kept-alive connection unused this long is closed (stores close theirs after 20 s or so)
TIMEOUT_S = 60.0  # a connection with no progress this long is given up (its request: None)
HEAD_LIMIT = 64 << 10  # an answer's status line and headers
ERROR_LIMIT = 1 << 20  # the body of an answer that is not the object (an error document) is read up to this
RECV_BYTES = 1 << 16  # what is read at a time before the body's size is known

_CONNECTING, _HANDSHAKE, _SENDING, _READING = range(4)

Body = bytearray | memoryview
"""An answer's bytes: a new bytearray, or the caller's memoryview (`into`)."""
Into = Callable[[int], memoryview | None]
"""Asked for a buffer of the body's size; None: read into a new one."""


class GetLoop:
    """GETs of objects in one S3 endpoint, up to `connections` in flight, on one background thread (see the module).

    Args:
        getter: the endpoint, region and credentials to use (its URLs and signatures).
        connections: how many requests may be in flight at once, one per connection.
    """

    def __init__(self, getter: S3Getter, connections: int) -> None:
        self.getter = getter
        self.connections = max(1, connections)
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
        self._expired_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="gpufeed-get-loop", daemon=True)
        self._thread.start()

    def get(self, path: str, end: int | None = None, start: int = 0, into: Into | None = None) -> Future[Body | None]:
        """Bytes `start` to `end` (exclusive) of ``bucket/key``, as `S3Getter.get` gives them, when they come.

        The future's result is the bytes (fewer when the object ends first),
        or None where the caller must read the object another way; it raises
        FileNotFoundError when the store says there is no such object. It is
        cancelled when the loop is closed first.

        `into`, where given, is asked (on the loop's thread) for a buffer of
        the body's size once the store has said it; the body is read straight
        into the writable memoryview it gives, which is then the result. None
        (or a view of another size) reads the body into a new bytearray.
        """
        future: Future[Body | None] = Future()
        bucket, _, key = path.partition("/")
        url = self.getter.url(bucket, key) if key else None
        if url is None:
            future.set_result(None)
            return future
        headers = {"Range": f"bytes={start}-{'' if end is None else end - 1}"} if start or end is not None else {}
        with self._lock:
            if self._closing:
                future.cancel()
                return future
            wake = not self._queue  # a queue with requests in it is looked at whenever a connection comes free
            most = None if end is None else max(0, end - start)
            self._queue.append(_Request(url, headers, start, most, future, into))
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
                for key, _ in self._selector.select(timeout=IDLE_S):
                    if key.data is None:
                        self._drain_waker()
                    else:
                        self._step(key.data)
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

    def _start_queued(self) -> None:
        while True:
            with self._lock:
                if not self._queue or len(self._busy) >= self.connections:
                    return
                request = self._queue.popleft()
            if request.future.cancelled():
                continue
            link = self._idle_link(request) or self._new_link(request)
            if link is None:
                continue  # the request was answered None: no connection could be made
            try:
                self._begin(link, request)
            except Exception:  # noqa: BLE001 - signing failed (credentials, clock): the caller reads it its way
                self._busy.discard(link)
                self._drop(link)
                request.answer(None)

    def _idle_link(self, request: _Request) -> _Link | None:
        """A kept-alive connection to the request's host, if one is idle (one to another host is closed for room)."""
        for at, link in enumerate(self._idle):
            if (link.host, link.port) == (request.host, request.port):
                return self._idle.pop(at)
        if self._idle and len(self._idle) + len(self._busy) >= self.connections:
            self._drop(self._idle.pop(0))
        return None

    def _new_link(self, request: _Request) -> _Link | None:
        try:
            address = socket.getaddrinfo(request.host, request.port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(address[0], address[1], address[2])
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            code = sock.connect_ex(address[4])
        except OSError:
            request.answer(None)
            return None
        if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            request.answer(None)
            return None
        return _Link(sock, request.host, request.port, request.tls)

    def _begin(self, link: _Link, request: _Request) -> None:
        """Sign `request` and start it on `link`."""
        headers = request.headers
        if not self.getter.anonymous:
            credentials = self.getter.credentials()
            if credentials is None:
                self._idle.append(link)
                request.answer(None)
                return
            headers = sign_get(request.netloc, request.path, headers, credentials, self.getter.region)
        head = f"GET {request.path} HTTP/1.1\r\nHost: {request.netloc}\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in headers.items()
        )
        link.start(request, (head + "\r\n").encode("latin-1"))
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
            done = link.advance(self.getter)
        except Exception as exc:  # noqa: BLE001 - a socket error, an answer not understood, anything: this request only
            self._fail(link, exc)
            return
        if not done:
            self._watch(link)
            return
        request, answer, keep = link.finish()
        self._busy.discard(link)
        if keep and not self._closing:
            self._unwatch(link)
            self._idle.append(link)
        else:
            self._drop(link)
        request.answer(answer)

    def _fail(self, link: _Link, exc: BaseException) -> None:
        request = link.request
        self._busy.discard(link)
        self._drop(link)
        if request is None:
            return
        if link.reused and not link.answered_any and not request.retried:
            request.retried = True  # the store closed a kept-alive connection meanwhile: once more on a new one
            with self._lock:
                self._queue.appendleft(request)
            return
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
            queued = list(self._queue)
            self._queue.clear()
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
        self._selector.close()
        self._waker_in.close()
        self._waker_out.close()


class _Request:
    """One GET: where it goes (the URL taken apart once), what it asks for, and the future its answer goes to."""

    __slots__ = (
        "url",
        "host",
        "port",
        "netloc",
        "path",
        "tls",
        "headers",
        "start",
        "most",
        "future",
        "into",
        "retried",
    )

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        start: int,
        most: int | None,
        future: Future[Body | None],
        into: Into | None,
    ) -> None:
        parts = urlsplit(url)
        self.url, self.netloc, self.path, self.tls = url, parts.netloc, parts.path or "/", parts.scheme == "https"
        self.host, self.port = parts.hostname or "", parts.port or (443 if self.tls else 80)
        self.headers, self.start, self.future, self.into = headers, start, future, into
        self.most = most  # the most bytes the answer may have: the range's length
        self.retried = False

    def answer(self, value: Body | BaseException | None) -> None:
        if self.future.cancelled():
            return
        if isinstance(value, BaseException):
            self.future.set_exception(value)
        else:
            self.future.set_result(value)


class _Link:
    """One non-blocking connection to the store and the request on it, as a small state machine."""

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
        self._out = memoryview(b"")
        self._head = bytearray()
        self._status = 0
        self._headers: dict[str, str] = {}
        self._body: Body | None = None
        self._got = 0
        self._keep = False
        self.answered_any = False

    def start(self, request: _Request, data: bytes) -> None:
        self.request = request
        self.reused = self.served > 0
        self._out = memoryview(data)
        self._head = bytearray()
        self._body = None
        self._got = 0
        self.answered_any = False
        self.progress_at = time.monotonic()
        if self.state == _READING:  # a kept-alive connection: its next request goes straight out
            self.state = _SENDING

    def advance(self, getter: S3Getter) -> bool:
        """Do what the socket allows now; True once the whole answer is in."""
        if self.state == _CONNECTING:
            failure = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if failure:
                raise OSError(failure, "cannot connect to the store")
            if self.tls:
                self.sock = getter.tls_context.wrap_socket(
                    self.sock, server_hostname=self.host, do_handshake_on_connect=False
                )
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
            if self._body is None:
                data = self._io(self.sock.recv, RECV_BYTES)
                if data is None:
                    return False
                if not data:
                    raise ConnectionResetError("the store closed the connection")
                self.answered_any = True
                self._head += data
                if not self._parse_head():
                    continue
            else:
                view = memoryview(self._body)[self._got :]
                got = self._io(self.sock.recv_into, view) if view else 0
                if got is None:
                    return False
                if view and not got:
                    raise ConnectionResetError(f"the answer ended after {self._got} of {len(self._body)} bytes")
                self._got += got
            assert self._body is not None
            if self._got >= len(self._body):
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
        if not version.startswith("HTTP/1.") or not status.isdigit():
            raise ValueError(f"not an HTTP answer: {lines[0][:64]!r}")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" not in headers or "transfer-encoding" in headers:
            raise ValueError("an answer without a plain length")  # chunked and the like: read the ordinary way
        self._status, self._headers = int(status), headers
        self._keep = version != "HTTP/1.0" and headers.get("connection", "").lower() != "close"
        rest = self._head[end + 4 :]
        length = int(headers["content-length"])
        if len(rest) > length:
            raise ValueError("more bytes than the answer's length")  # nothing was asked for after it
        assert self.request is not None
        if self._is_the_object(self.request):
            if self.request.most is not None and length > self.request.most:
                raise ValueError("an answer longer than the range asked for")  # the caller reads it its way
        elif length > ERROR_LIMIT:
            raise ValueError("an error answer of more than a megabyte")
        self._body = self._buffer(length)
        self._body[: len(rest)] = rest
        self._got = len(rest)
        return True

    def _buffer(self, length: int) -> Body:
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

    def finish(self) -> tuple[_Request, Body | BaseException | None, bool]:
        """(the request, its answer as `S3Getter.get` gives it, whether the connection may be used again)."""
        request, body = self.request, self._body
        assert request is not None and body is not None
        self.request, self._body = None, None
        self.served += 1
        answer: Body | BaseException | None = None
        if self._is_the_object(request):
            answer = body
        elif self._status == 404:
            answer = FileNotFoundError(f"no such object: {request.url}")
        return request, answer, self._keep

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
