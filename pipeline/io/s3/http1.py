"""The HTTP/1.1 exchange on one connection to the store: a request's bytes out, its answer parsed (the one parser).

A `Connection` is a socket and the state of the request on it, a small
state machine that `advance` moves on as far as the socket allows:
connecting, the TLS handshake, sending, reading the status line and
headers, then a body of Content-Length bytes or chunks (`ChunkedBody`),
read straight into the buffer that holds it. Its socket is non-blocking
on the loop thread (`getloop`), where `advance` is called whenever the
selector says it is ready, or blocking with a timeout on a caller's
thread (`blocking`), where `advance` is called until it is done. Either
way the same checks hold: a Content-Length or chunk size that is not a
plain non-negative number is refused at once (ValueError), bodies are
capped (the range asked for, else BODY_LIMIT; an error document at
ERROR_LIMIT), and headers at HEAD_LIMIT.

Memory follows the bytes that came, not the length an answer declares: a
body's buffer starts at FIRST_BODY_BYTES and doubles as bytes arrive (up
to the length), unless the caller gave one (`GetRequest.into`); a body
that ends before its length is an error (ConnectionResetError), never
taken for the object. Where a `ByteBudget` is given (the loop's reads
ahead), an answer whose head is in waits (`held`) until its length fits
in the budget beside the bodies in flight.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import ssl
import time
from typing import Any

from ..transport import Body
from .config import S3Settings
from .request import GetRequest, starts_at

TIMEOUT_S = 60.0  # a connection with no progress this long is given up (its request: None)
KEEP_IDLE_S = 15.0  # a kept-alive connection unused this long is closed (stores close theirs after 20 s or so)
HEAD_LIMIT = 64 << 10  # an answer's status line and headers
ERROR_LIMIT = 1 << 20  # the body of an answer that is not the object (an error document) is read up to this
RECV_BYTES = 1 << 16  # what is read at a time before the body's size is known
FIRST_BODY_BYTES = 1 << 20  # a body's first buffer; doubled as its bytes come, up to its length
CHUNKED = -1  # the body's length where it comes in chunks

CONNECTING, HANDSHAKE, SENDING, READING = range(4)


def resolve(host: str, port: int) -> Any:
    """The first address of `host` (off the loop thread: its resolver pool, or a blocking caller; tests replace it)."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]


def literal_address(host: str, port: int) -> Any:
    """The address of `host` where it is an IP literal (no lookup, so no wait); None for a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]


class ByteBudget:
    """Body bytes the answers in flight may hold at once (one answer is let in whatever its size when none holds any).

    Args:
        limit: the most bytes, counted by the lengths the answers declare (capped by what each may have).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def fits(self, count: int) -> bool:
        return not self.used or self.used + count <= self.limit

    def take(self, count: int) -> bool:
        """Count `count` bytes in if they fit; False (nothing counted) if not."""
        if not self.fits(count):
            return False
        self.used += count
        return True

    def give(self, count: int) -> None:
        self.used -= count


def tls_context(settings: S3Settings) -> Any:
    """The TLS context for the settings' endpoint (its CA bundle where one is configured); None for plain http."""
    return ssl.create_default_context(cafile=settings.tls_ca) if settings.scheme == "https" else None


class Connection:
    """One connection to the store and the request on it, as a small state machine: the one parser (see the module)."""

    def __init__(self, sock: socket.socket, host: str, port: int, tls: bool) -> None:  # a connect started on `sock`
        self.sock: Any = sock
        self.host, self.port, self.tls = host, port, tls
        self.state = CONNECTING
        self.wants_write = True  # a connect in progress is finished when the socket turns writable
        self.registered: int | None = None
        self.request: GetRequest | None = None
        self.reused = False
        self.served = 0
        self.progress_at = time.monotonic()
        self.keep = False
        self.answered_any = False
        self.budget: ByteBudget | None = None  # where the bodies' bytes are counted (the loop's), if anywhere
        self.held = False  # the answer's head is in; its body waits for room in the budget
        self._out = memoryview(b"")
        self._head = bytearray()
        self._status = 0
        self._headers: dict[str, str] = {}
        self._length: int | None = None  # the body's length once the head is in (CHUNKED: in chunks)
        self._limit = 0
        self._taken = 0  # bytes counted in the budget for this answer
        self.deadline: float | None = None  # a blocking socket's: no call on it waits past this (monotonic)
        self._timeout = sock.gettimeout()
        self._body: Body | None = None
        self._got = 0
        self._chunks: ChunkedBody | None = None

    @classmethod
    def open(cls, address: Any, host: str, port: int, tls: bool, timeout: float | None = None) -> Connection:
        """A connection to `address` (a `resolve` answer): non-blocking, its connect in progress, when `timeout` is None;
        else connected, blocking for at most `timeout` per step.

        Raises:
            OSError: the connection cannot be made (or, non-blocking, begun).
        """
        sock = socket.socket(address[0], address[1], address[2])
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if timeout is None:
                sock.setblocking(False)
                code = sock.connect_ex(address[4])
                if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                    raise OSError(code, "cannot connect to the store")
            else:
                sock.settimeout(timeout)
                sock.connect(address[4])
        except OSError:
            sock.close()
            raise
        return cls(sock, host, port, tls)

    def start(self, request: GetRequest, data: bytes) -> None:
        self.request = request
        self.reused = self.served > 0
        self._out = memoryview(data)
        self._head = bytearray()
        self._length = None
        self._body = None
        self._chunks = None
        self._got = 0
        self.answered_any = self.held = False
        self.progress_at = time.monotonic()
        if self.state == READING:  # a kept-alive connection: its next request goes straight out
            self.state = SENDING

    def advance(self, tls: Any) -> bool:
        """Do what the socket allows now; True once the whole answer is in."""
        if self.state == CONNECTING:
            failure = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if failure:
                raise OSError(failure, "cannot connect to the store")
            if self.tls:
                self.sock = tls.wrap_socket(self.sock, server_hostname=self.host, do_handshake_on_connect=False)
                self.state = HANDSHAKE
            else:
                self.state = SENDING
        if self.state == HANDSHAKE:
            if not self._io(self.sock.do_handshake):
                return False
            self.state = SENDING
        if self.state == SENDING:
            while self._out:
                sent = self._io(self.sock.send, self._out, writing=True)
                if sent is None:
                    return False
                self._out = self._out[sent:]
            self.state, self.wants_write = READING, False
        return self._read()

    @property
    def wanted(self) -> int:
        """The bytes the answer's body may take (its length, or its bound when it comes in chunks)."""
        return self._limit if self._length == CHUNKED else self._length or 0

    def _read(self) -> bool:
        while True:
            if self._length is None:
                data = self._io(self.sock.recv, RECV_BYTES)
                if data is None:
                    return False
                if not data:
                    raise ConnectionResetError("the store closed the connection")
                self.answered_any = True
                self._head += data
                if not self._parse_head():
                    continue
            if self._body is None and self._chunks is None:
                if not self._open_body():
                    return False  # held: the caller goes on once the budget has room
            elif self._chunks is not None:
                data = self._io(self.sock.recv, RECV_BYTES)
                if data is None:
                    return False
                if not data:
                    raise ConnectionResetError("the store closed the connection in a chunked answer")
                self._chunks.feed(data)
            elif not self._read_body():
                return False
            if self._chunks is not None:
                if self._chunks.done:
                    self._body = self._chunks.body()
                    return True
            elif self._got >= (self._length or 0):
                return True
            if not self.tls:
                return False  # one read per readiness; a TLS socket may hold decrypted bytes the selector cannot see

    def _read_body(self) -> bool:
        """Read what the socket has of a body of known length into its buffer (grown first if full); False: wait."""
        body, length = self._body, self._length or 0
        assert body is not None
        if self._got == len(body) < length:
            assert isinstance(body, bytearray)
            body.extend(bytes(min(length, 2 * len(body)) - len(body)))  # zeroed pages come as the bytes do
        with memoryview(body)[self._got :] as view:
            wanted = len(view)
            got = self._io(self.sock.recv_into, view) if wanted else 0
        if got is None:
            return False
        if wanted and not got:
            raise ConnectionResetError(f"the answer ended after {self._got} of its {length} bytes")
        self._got += got
        return True

    def _parse_head(self) -> bool:
        """True once the status line and headers are in (the body's length and bound known, nothing allocated)."""
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
        self._limit = self.request.most if self._is_the_object(self.request) else ERROR_LIMIT
        del self._head[: end + 4]  # what followed the head: the body's first bytes
        if headers.get("transfer-encoding", "").lower() == "chunked":
            self._length = CHUNKED
            return True
        if "transfer-encoding" in headers:
            raise ValueError(f"an answer in {headers['transfer-encoding']!r} encoding")
        if "content-length" not in headers:
            raise ValueError("an answer without a length")  # read to the end: rare; s3fs reads it instead
        length = content_length(headers["content-length"])
        if length > self._limit:
            raise ValueError(f"an answer of {length} bytes, over the {self._limit} it may have")
        if len(self._head) > length:
            raise ValueError("more bytes than the answer's length")  # nothing was asked for after it
        self._length = length
        return True

    def _open_body(self) -> bool:
        """Make the body's buffer with the bytes that came after the head; False (`held`) while the budget has no room."""
        if self.budget is not None and not self._taken:
            if not self.budget.take(self.wanted):
                self.held = True
                return False
            self._taken = self.wanted
        if self.held:
            self.held, self.progress_at = False, time.monotonic()  # its wait was the budget's, not the store's
        rest, self._head = self._head, bytearray()
        if self._length == CHUNKED:
            self._chunks = ChunkedBody(self._limit)
            self._chunks.feed(rest)
            return True
        body = self._buffer(self._length or 0)
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
        return bytearray(min(length, FIRST_BODY_BYTES))  # grown as the bytes come (`_read_body`)

    def _is_the_object(self, request: GetRequest) -> bool:
        return self._status in (200, 206) and starts_at(self._headers.get("content-range"), request.start, self._status)

    def finish(self) -> tuple[GetRequest, int, dict[str, str], Body]:
        """(the request, the answer's status, headers and body); the connection is free for its next request."""
        request, body = self.request, self._body
        assert request is not None and body is not None
        self.request, self._body, self._chunks = None, None, None
        self.served += 1
        self._give_back()
        return request, self._status, self._headers, body

    def _give_back(self) -> None:
        """The body's bytes no longer count in the budget (handed over, or the connection closed)."""
        if self.budget is not None and self._taken:
            self.budget.give(self._taken)
        self._taken = 0

    def _io(self, call: Any, *args: Any, writing: bool = False) -> Any:
        """`call(*args)`, or None where the socket must wait (and which way: `wants_write`).

        Raises:
            TimeoutError: a blocking socket waited TIMEOUT_S, or reached its `deadline`.
        """
        if self.deadline is not None:
            self._wait_at_most(self.deadline - time.monotonic())
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

    def _wait_at_most(self, seconds: float) -> None:
        """Let the blocking socket's next call wait `seconds` at most (TIMEOUT_S at most); TimeoutError if none is left."""
        if seconds <= 0:
            raise TimeoutError("the request's deadline passed")
        seconds = min(seconds, TIMEOUT_S)
        if seconds != self._timeout:  # the same while TIMEOUT_S fits before the deadline: no call to change it
            self.sock.settimeout(seconds)
            self._timeout = seconds

    def close(self) -> None:
        self._give_back()
        try:
            self.sock.close()
        except OSError:
            pass


class ChunkedBody:
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
        return bytearray().join(self._pieces)


def content_length(text: str) -> int:
    """A Content-Length: plain decimal digits only (a sign, a space, hex or 20 digits are refused at once)."""
    if not text.isdigit() or not text.isascii() or len(text) > 19:
        raise ValueError(f"a Content-Length that is not a byte count: {text[:32]!r}")
    return int(text)
