"""The S3 transport on gpufeed's own HTTP client (`s3get.S3Getter` for blocking requests, `getloop.GetLoop` for many in flight)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

from .getloop import GetLoop
from .s3get import S3Getter
from .transport import Body, FsspecTransport, Into, Transport


class S3Transport(Transport):
    """S3 through signed GETs of gpufeed's own client; s3fs (`fallback`) for anything else."""

    reads_ahead = True

    def __init__(self, getter: S3Getter, fallback: FsspecTransport) -> None:
        self.getter = getter
        self.fallback = fallback
        self._loop: GetLoop | None = None
        self._lock = threading.Lock()

    def read_range(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        fetched = self.getter.get(path, end, start=start)
        return self.fallback.read_range(path, start, end) if fetched is None else fetched

    def read_ahead(self, path: str, end: int | None = None, into: Into | None = None, in_flight: int = 1) -> Future[Body | None]:
        with self._lock:
            if self._loop is None:
                self._loop = GetLoop(self.getter, in_flight)
            self._loop.connections = max(self._loop.connections, in_flight)
            loop = self._loop
        return loop.get(path, end, into=into)  # type: ignore[return-value]

    def list(self, path: str, delimiter: str | None = None) -> tuple[list[str], list[str]] | None:
        return self.getter.list_objects(path, delimiter)

    def write(self, path: str, data: bytes) -> None:
        self.fallback.write(path, data)

    def remove(self, paths: Sequence[str]) -> None:
        self.fallback.remove(paths)

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()
