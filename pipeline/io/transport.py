"""The storage transport: what every stage asks of a store, one implementation per backend.

A `Transport` reads a range of an object, reads whole objects many at a
time (`read_ahead`), lists a prefix, uploads a file (on S3 nothing is
visible until it is whole) and removes objects. Paths are
``bucket/key`` as fsspec names them. Two implementations:

- `FsspecTransport` (here): any fsspec filesystem (s3fs with any option,
  gcs, http, memory, ...): the general path and every other one's fallback;
- `S3Transport` (`s3/transport.py`): plain S3 endpoints, a fraction of the
  client CPU s3fs spends per request; anything it is not sure of goes to
  the fsspec path of the same filesystem.

`transport_for(fs)` (`transports.py`) picks one per filesystem and process.
Errors are fsspec's: FileNotFoundError for a missing object, OSError
(EINVAL for a range past the end) and the store's own errors otherwise.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

Body = bytearray | memoryview | bytes
"""An answer's bytes: a new buffer, or the caller's memoryview (`Into`)."""
Into = Callable[[int], memoryview | None]
"""Asked for a buffer of the body's size; None: read into a new one."""


class Transport(abc.ABC):
    """The operations the stages need of a store (see the module)."""

    reads_ahead: bool = False
    """Whether `read_ahead` keeps many reads in flight itself (else the caller reads on threads)."""

    @abc.abstractmethod
    def read_range(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes `start` to `end` (exclusive; to the object's end if None) of `path`; fewer when the object ends first.

        Raises:
            FileNotFoundError: there is no such object.
            OSError: the store cannot give them (EINVAL: the range starts past the end).
        """

    def read_ahead(self, path: str, end: int | None = None, into: Into | None = None, in_flight: int = 1) -> Future[Body | None]:
        """The first `end` bytes of `path` (all if None), when they come, with up to `in_flight` reads at once.

        The future's result is the bytes or None where the caller must read
        the object its own way (`read_range` on a thread); it raises
        FileNotFoundError for a missing object. `into`, where given, is asked
        for a buffer of the body's size, which is then the result.
        """
        future: Future[Body | None] = Future()
        future.set_result(None)
        return future

    def list(self, path: str, delimiter: str | None = None) -> tuple[list[str], list[str]] | None:
        """(keys, common prefixes) under `path` (``bucket/prefix``: a plain string prefix), ``bucket/...`` paths in the
        store's order; None where the caller lists through fsspec's own walk."""
        return None

    @abc.abstractmethod
    def upload(self, source: str, path: str, *, part_bytes: int | None = None) -> None:
        """Put local file `source` at `path` (in parts of `part_bytes` where the store uploads in parts); on S3 the
        object is visible under its name only once whole (`Output.publish` names a temp object on other stores)."""

    @abc.abstractmethod
    def remove(self, paths: Sequence[str]) -> None:
        """Remove the objects at `paths` (missing ones are no error)."""

    def close(self) -> None:
        """Stop what runs in the background (connections, threads)."""


class FsspecTransport(Transport):
    """Any fsspec filesystem: each operation is the filesystem's own call.

    Args:
        fs: the filesystem (s3fs, gcsfs, http, memory, local ...).
    """

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def read_range(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        if start == 0 and end is None:
            return bytes(self.fs.cat_file(path))
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def upload(self, source: str, path: str, *, part_bytes: int | None = None) -> None:
        self.fs.put_file(source, path, **({"chunksize": part_bytes} if part_bytes else {}))

    def remove(self, paths: Sequence[str]) -> None:
        for path in paths:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
