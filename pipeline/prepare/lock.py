"""One prepare at a time per OUT: OUT's lock (``OUT/.gpufeed.lock``), who holds it, and its removal."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

from ..errors import JobConflictError
from ..io.fs import process_alive
from ..io.output import Output

# Beside the work folder, not in it: a run removes and makes that folder again (--overwrite, a repair, its finish).
LOCK_NAME = ".gpufeed.lock"


@dataclasses.dataclass(frozen=True)
class LockHolder:
    """Who holds OUT's lock: a process (its pid and host, since when), for a service job its id."""

    pid: int
    host: str
    since: str
    job: str | None = None

    @classmethod
    def parse(cls, data: bytes | None) -> LockHolder | None:
        try:
            record = json.loads(data or b"")
            return cls(int(record["pid"]), str(record["host"]), str(record.get("since", "?")), record.get("job") or None)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None  # empty (a lock file being written) or not ours: no one known

    @classmethod
    def here(cls, job: str | None = None) -> LockHolder:
        import datetime
        import socket

        since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return cls(os.getpid(), socket.gethostname(), since, job)

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode("utf-8")

    def gone(self) -> bool:
        """Whether the process is known to be gone: it ran on this host and runs no more."""
        import socket

        return self.host == socket.gethostname() and not process_alive(self.pid)

    def describe(self) -> str:
        job = f" for service job {self.job}" if self.job else ""
        return f"process {self.pid} on {self.host}{job} (since {self.since})"


class OutLock:
    """OUT's lock (``OUT/.gpufeed.lock``), held by one prepare at a time.

    Locally the file is `flock`ed while held, so a process that dies lets go
    of it at once, and its record (pid, host, since) names the holder to the
    next run; on a store the record alone is a best-effort marker. A record left
    by a process that is gone from this host is taken over (not one of a service
    job: that holds OUT as long as any of its workers may write).

    A service job holds the lock from its plan to its finish, across processes:
    its plan takes it for the job (`job`), leaves the record when the plan ends
    (`keep`), and its finish (or its failure, or its discard) removes it; the
    shard steps do not touch it, so they run on many workers at once.

    Args:
        output: OUT.
        job: the service job this lock is taken for; a record of another job is
            taken over (the service lets one job at a time write an OUT).
    """

    def __init__(self, output: Output, job: str | None = None) -> None:
        self.output = output
        self.holder = LockHolder.here(job)
        self._fd: int | None = None
        self._made: list[str] = []

    def acquire(self) -> OutLock:
        """Take the lock.

        Raises:
            JobConflictError: another prepare holds it (the message names it).
            OSError: a local OUT cannot be made or written (read-only, no permission).
            StorageError: a remote OUT cannot be written.
        """
        if self.output.is_local:
            self._acquire_local()
        else:
            self._refuse_held(LockHolder.parse(self.output.read_if_exists(LOCK_NAME)))
            self.output.write_bytes_atomic(LOCK_NAME, self.holder.to_bytes())
        return self

    def _acquire_local(self) -> None:
        import fcntl

        self._make_out()
        path = self.output.local(LOCK_NAME)
        for _ in range(10):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:  # a read-only or full OUT, said as the file system says it (`describe_os_error`)
                self._unmake_out()
                exc.filename = self.output.root
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = LockHolder.parse(_read_fd(fd))
                os.close(fd)
                raise self._busy(holder) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:  # its holder removed it as it let go: take the new one
                same = False
            if same:
                break
            os.close(fd)
        else:  # pragma: no cover - the file replaced ten times over
            raise JobConflictError(f"{self.output.url}: another prepare keeps taking {LOCK_NAME}; try again")
        try:
            self._refuse_held(LockHolder.parse(_read_fd(fd)))
            os.ftruncate(fd, 0)
            os.pwrite(fd, self.holder.to_bytes(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _refuse_held(self, holder: LockHolder | None) -> None:
        """Refuse a lock record that names a live holder (locally: the flock is ours, so only a service job's)."""
        if holder is None or (holder.pid, holder.host) == (self.holder.pid, self.holder.host):
            return
        if holder.job is None and holder.gone():
            return  # a service job holds OUT while any of its workers runs, not only the one that planned it
        if self.holder.job is not None and holder.job is not None:
            return  # an earlier service job's: the service runs one job at a time on an OUT
        if self.output.is_local and holder.job is None:
            return  # a process that held the flock would hold it still
        raise self._busy(holder)

    def _busy(self, holder: LockHolder | None) -> JobConflictError:
        who = holder.describe() if holder is not None else "another process"
        where = f"{self.output.url.rstrip('/')}/{LOCK_NAME}"
        wait = f"gpufeed status {holder.job}" if holder is not None and holder.job else "wait for it to finish"
        return JobConflictError(
            f"{self.output.url} is being prepared by {who}: one prepare at a time per OUT; {wait} "
            f"(if it is gone for good, remove {where})"
        )

    def release(self, *, keep: bool = False) -> None:
        """Let go of the lock; with `keep` the record stays (a service job's plan: the job holds OUT on)."""
        if self.output.is_local:
            if self._fd is None:
                return
            with contextlib.suppress(OSError):
                if not keep and os.fstat(self._fd).st_ino == os.stat(self.output.local(LOCK_NAME)).st_ino:
                    os.unlink(self.output.local(LOCK_NAME))
            os.close(self._fd)
            self._fd = None
            self._unmake_out()
        elif not keep:
            remove_lock(self.output, self.holder)

    def _make_out(self) -> None:
        missing, folder = [], self.output.root
        while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
            missing.append(folder)
            folder = os.path.dirname(folder)
        os.makedirs(self.output.root, exist_ok=True)
        self._made = missing

    def _unmake_out(self) -> None:
        """Remove the folders this lock made, when nothing else was put in them."""
        for folder in self._made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        self._made = []

    def __enter__(self) -> OutLock:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, 4096, 0)


def remove_lock(output: Output, holder: LockHolder | None = None, *, job: str | None = None) -> None:
    """Remove OUT's lock record: the one `holder` wrote, or with `job` the one that service job left (any with neither).

    A local lock that a live process holds (flocked) is never removed.
    """
    if output.is_local:
        import fcntl

        path = output.local(LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _is_removable(LockHolder.parse(_read_fd(fd)), holder, job):
                os.unlink(path)
        except OSError:
            return  # held by a live process: its own
        finally:
            os.close(fd)
        return
    if _is_removable(LockHolder.parse(output.read_if_exists(LOCK_NAME)), holder, job):
        output.remove(LOCK_NAME)


def _is_removable(found: LockHolder | None, holder: LockHolder | None, job: str | None) -> bool:
    if job is not None:
        return found is not None and found.job == job
    if holder is not None:
        return found is None or (found.pid, found.host, found.since) == (holder.pid, holder.host, holder.since)
    return True
