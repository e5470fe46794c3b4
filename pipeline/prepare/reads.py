"""How a prepare's remote source files are read ahead: many at once, for the store's latency, not for the cores.

`SourceReads.submit` starts one file's read and gives a future of what
`sample.read_item` gives for it (its bytes, or the reason it cannot be
read), or of a `Handoff` where the bytes went into the shared arena the
workers take them from (`handoff.py`).

On an S3 store the fast path serves (`io/transports.py`), the reads are the
transport's `read_ahead`: one thread, tens of requests in flight, each
answer read straight into the arena where there is one. Every
other read runs `read_item` on a pool of `io_threads` threads, and so does
every file whose GET did not give its bytes within the input limit (another
status, a missing object, a file too large, a dropped connection): that read
decides what the file is, with the same reasons and errors as ever, so the
loop changes how fast files come and nothing else. A gpufeed error of the
loop's (a StorageError: the store redirects in a loop, or misses the
request's deadline) is the read's error as it is, not tried again.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from ..errors import GpufeedError
from ..io.fs import open_fs
from ..io.transport import Body, Transport
from ..io.transports import transport_for
from ..specs import PrepareSpec
from .handoff import Arena, Handoff
from .sample.make import read_item
from .sources import SourceItem

Fetched = bytes | str | Handoff
"""A source read ahead: its bytes, the reason it cannot be read, or where its bytes wait in the arena."""


class SourceReads:
    """Remote source files read ahead in this process (see the module).

    Args:
        spec: the job's settings (the input limit).
        io_threads: reads in flight: the loop's connections, or the threads' count.
        arena: where bytes are left for forked workers; None gives the bytes themselves.
    """

    def __init__(self, spec: PrepareSpec, io_threads: int, arena: Arena | None = None) -> None:
        self.spec = spec
        self.io_threads = max(1, io_threads)
        self.arena = arena
        self._lock = threading.Lock()
        self._threads: ThreadPoolExecutor | None = None
        self._closed = False

    def submit(self, item: SourceItem) -> Future[Fetched]:
        """Start reading `item`; the future gives what `read_item` gives (or the bytes' `Handoff`)."""
        loop, path = self._loop_for(item.url)
        if loop is None:
            return self._read_on_threads(item)
        out: Future[Fetched] = Future()
        reserved: list[Handoff | None] = []  # what `into` got from the arena: a range, or None (it was full)
        into = None if self.arena is None else _reserving(self.arena, reserved)
        got = loop.read_ahead(path, self.spec.max_file_bytes + 1, into=into, in_flight=self.io_threads)
        got.add_done_callback(lambda answer: self._settle(answer, item, out, reserved))
        return out

    def close(self) -> None:
        """Stop the threads (their queued reads are cancelled); the transport stays, for this process's next job."""
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=True, cancel_futures=True)

    def _settle(
        self, answer: Future[Body | None], item: SourceItem, out: Future[Fetched], reserved: list[Handoff | None]
    ) -> None:
        """The loop's answer for `item` into `out` (on the loop's thread); anything but the bytes is read again on a thread."""
        failure = None if answer.cancelled() else answer.exception()
        body = None if answer.cancelled() or failure is not None else answer.result()
        try:
            if isinstance(failure, GpufeedError):  # the store misbehaves: a second read would wait it out again
                self._free(reserved)
                with contextlib.suppress(InvalidStateError):
                    out.set_exception(failure)
                return
            if body is not None and len(body) <= self.spec.max_file_bytes:
                self._deliver(out, self._fetched(body, reserved))
                return
            self._free(reserved)
            if answer.cancelled() or out.cancelled():
                out.cancel()
                return
            try:
                again = self._read_on_threads(item)
            except RuntimeError:  # closed meanwhile (the job stopped): nobody waits for this file
                out.cancel()
                return
            again.add_done_callback(lambda read: self._chain(read, out))
        finally:
            if isinstance(body, memoryview):
                body.release()  # the arena's mapping may close once no view of it is left

    def _chain(self, read: Future[Fetched], out: Future[Fetched]) -> None:
        if read.cancelled():
            out.cancel()
        elif read.exception() is not None:
            with contextlib.suppress(InvalidStateError):
                out.set_exception(read.exception())
        else:
            self._deliver(out, read.result())

    def _deliver(self, out: Future[Fetched], value: Fetched) -> None:
        try:
            out.set_result(value)
        except InvalidStateError:  # cancelled by its reader meanwhile: nobody takes these bytes
            if isinstance(value, Handoff) and self.arena is not None:
                self.arena.free(value)

    def _fetched(self, body: Body, reserved: list[Handoff | None]) -> Fetched:
        if reserved and reserved[0] is not None and isinstance(body, memoryview):
            return reserved[0]  # read straight into the arena
        tried = bool(reserved)  # and the arena was full: the bytes go through the pipe
        self._free(reserved)
        return bytes(body) if tried else self._placed(bytes(body))

    def _free(self, reserved: list[Handoff | None]) -> None:
        handoff = reserved.pop() if reserved else None
        if handoff is not None and self.arena is not None:
            self.arena.free(handoff)

    def _read_on_threads(self, item: SourceItem) -> Future[Fetched]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the reads are closed")
            if self._threads is None:
                self._threads = ThreadPoolExecutor(self.io_threads, thread_name_prefix="gpufeed-read")
            return self._threads.submit(self._read_now, item)

    def _read_now(self, item: SourceItem) -> Fetched:
        data = read_item(item, self.spec)
        return self._placed(data) if isinstance(data, bytes) else data

    def _placed(self, data: bytes) -> bytes | Handoff:
        """`data` copied into the arena where there is one and it fits (its `Handoff`), else the bytes themselves."""
        return (self.arena.put(data) if self.arena is not None else None) or data

    def _loop_for(self, url: str) -> tuple[Transport | None, str]:
        """The transport of the store `url` is on where it reads ahead itself, and the object's path; (None, "") where threads read it."""
        try:
            fs, path = open_fs(url)
        except Exception:  # noqa: BLE001 - the read on a thread says what is wrong with it
            return None, ""
        transport = transport_for(fs)
        return (transport, path) if transport.reads_ahead else (None, "")


def _reserving(arena: Arena, reserved: list[Handoff | None]) -> Any:
    """An `into` for the loop: a range of the arena of the body's size, or None when it is full (noted in `reserved`)."""

    def into(size: int) -> memoryview | None:
        handoff = arena.reserve(size)
        reserved.append(handoff)
        return None if handoff is None else arena.view(handoff)

    return into
