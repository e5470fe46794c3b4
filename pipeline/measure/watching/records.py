"""The recorder's files of `gpufeed watch`, read as untrusted input.

The watched command writes them (`hook/`: one JSON line of running totals per flush, one
file `<pid>.jsonl` per process), and whatever runs there may write anything: other JSON, other
types, NaN, negative counters, deep nesting, huge lines, a flood of lines, a FIFO or a link in
place of a file. So every line is checked against the record's shape and only the fields the
sampler uses are kept, with their types; a line that does not fit is dropped and counted
(`RecorderFiles.dropped`, shown in the report). Memory and time stay bounded: at most
`MAX_FILES` files are followed, at most `READ_WINDOW` bytes of each are read per interval (the
newest: each line holds totals, so an older one is superseded by a newer one), a line longer than
`MAX_LINE_BYTES` is dropped unparsed, and only regular files are opened, never waited on.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import stat
from typing import Any

MAX_FILES = 4096  # processes followed: a training run's ranks and their loader workers
READ_WINDOW = 1 << 20  # bytes of a file read per interval, the newest ones
MAX_LINE_BYTES = 256 << 10  # a record is under 1 KiB; its argv is cut to 8 arguments
_MAX_COUNT = 1 << 53  # counters past this are not counts (and would lose their value as floats)
_MAX_SECONDS = 1e9  # about 30 years

MAX_LOADERS = 64  # loaders (creation sites) in one record; the recorder keeps 32
MAX_SITE_CHARS = 400  # "Dataset at file.py:line"
_LOOP_COUNTS = ("batches", "samples", "iterations", "num_workers")
_LOOP_SECONDS = ("wait_s", "step_s", "first_s")
_LOADER_COUNTS = (*_LOOP_COUNTS, "batch_size", "tensors", "nograd", "eval_mode", "updated")
_LOADER_SECONDS = (*_LOOP_SECONDS, "model_s", "outside_s", "outside_cpu_s")
_KINDS = ("torch", "gpufeed")
_FETCH_COUNTS = ("batches",)
_FETCH_SECONDS = ("seconds", "cpu_s", "runq_s")


class BadRecord(ValueError):
    """A line of a recorder's file that is not a record."""


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_COUNT:
        raise BadRecord(f"not a count: {type(value).__name__}")
    return value


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRecord(f"not seconds: {type(value).__name__}")
    if isinstance(value, int) and abs(value) > _MAX_COUNT:
        raise BadRecord("seconds out of range")
    seconds = float(value)
    if not (math.isfinite(seconds) and 0.0 <= seconds <= _MAX_SECONDS):
        raise BadRecord("seconds out of range")
    return seconds


def _part(record: dict[str, Any], name: str, counts: tuple[str, ...], seconds: tuple[str, ...]) -> dict[str, Any]:
    part = record.get(name, {})
    if not isinstance(part, dict):
        raise BadRecord(f"{name} is not an object")
    kept: dict[str, Any] = {field: _count(part.get(field, 0)) for field in counts}
    kept.update({field: _seconds(part.get(field, 0.0)) for field in seconds})
    return kept


def _site(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_SITE_CHARS:
        raise BadRecord("site is not a short string")
    return value


def _loaders(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's loaders, checked; a record of the older shape gives its "torch" and "gpufeed" parts as loaders."""
    loaders = record.get("loaders")
    if loaders is None:
        parts = [(kind, _part(record, kind, _LOADER_COUNTS, _LOADER_SECONDS)) for kind in _KINDS]
        fetch = _part(record, "fetch", _FETCH_COUNTS, _FETCH_SECONDS)  # this shape kept the Dataset's time there
        return [{**part, "site": "", "kind": kind, "fetch": fetch} for kind, part in parts if part["batches"]]
    if not isinstance(loaders, list) or len(loaders) > MAX_LOADERS:
        raise BadRecord(f"loaders is not a list of at most {MAX_LOADERS}")
    kept = []
    for loader in loaders:
        if not isinstance(loader, dict):
            raise BadRecord("a loader is not an object")
        kind = loader.get("kind")
        if kind not in _KINDS:
            raise BadRecord("a loader's kind is neither torch nor gpufeed")
        checked = _part({"loader": loader}, "loader", _LOADER_COUNTS, _LOADER_SECONDS)
        checked.update(site=_site(loader.get("site", "")), kind=kind)
        checked["fetch"] = _part(loader, "fetch", _FETCH_COUNTS, _FETCH_SECONDS)
        kept.append(checked)
    return kept


def _totals(loaders: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The counters of one kind's loaders added up."""
    mine = [loader for loader in loaders if loader["kind"] == kind]
    totals: dict[str, Any] = {field: sum(loader[field] for loader in mine) for field in _LOOP_COUNTS}
    totals.update({field: sum(loader[field] for loader in mine) for field in _LOOP_SECONDS})
    return totals


def parse_record(line: bytes, pid: int) -> dict[str, Any]:
    """The record of one line of `<pid>.jsonl`, with only the fields the sampler reads, checked.

    Args:
        line: the line, without its newline.
        pid: the process the file is named after: the record must be that process's.

    Returns:
        {"pid", "ppid", "rank", "worker", "site", "updates", "sampler_cpu_s", "loaders", "fetch"}: counts
        as ints and seconds as finite floats, all ≥ 0; missing counters are 0; "site" (a worker's loader)
        a short string or None; "loaders" one dict per loader (its counters, "site", "kind", "fetch");
        "torch" and "gpufeed" the counters of each kind's loaders added up.

    Raises:
        BadRecord: the line is not such a record (invalid JSON, another shape or type, a value out of range).
    """
    if len(line) > MAX_LINE_BYTES:
        raise BadRecord("line too long")
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
        raise BadRecord("not JSON") from exc
    if not isinstance(record, dict):
        raise BadRecord("not an object")
    if record.get("pid") != pid or isinstance(record.get("pid"), bool):
        raise BadRecord("not the record of the process its file names")
    ppid, rank = record.get("ppid", 0), record.get("rank")
    worker = record.get("worker", False)
    if not isinstance(worker, bool):
        raise BadRecord("worker is not true or false")
    site = record.get("site")
    loaders = _loaders(record)
    return {
        "pid": pid,
        "ppid": _count(ppid),
        "rank": None if rank is None else _count(rank),
        "worker": worker,
        "site": None if site is None else _site(site),
        "updates": _count(record.get("updates", 0)),
        "sampler_cpu_s": _seconds(record.get("sampler_cpu_s", 0.0)),
        "loaders": loaders,
        "torch": _totals(loaders, "torch"),
        "gpufeed": _totals(loaders, "gpufeed"),
        "fetch": _part(record, "fetch", _FETCH_COUNTS, _FETCH_SECONDS),
    }


@dataclasses.dataclass
class _Followed:
    """Where the reading of one file stands."""

    pid: int
    offset: int = 0
    in_long_line: bool = False  # the bytes up to the next newline belong to a line already dropped


class RecorderFiles:
    """The last valid record of each watched process; `dropped` counts the lines that were not records."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.files: dict[str, _Followed] = {}
        self.last: dict[int, dict[str, Any]] = {}
        self.dropped = 0
        self.ignored_files: set[str] = set()  # bounded by MAX_FILES too: past it, names are not remembered

    def read(self) -> dict[int, dict[str, Any]]:
        """Read what each file gained since the last call; returns pid -> its newest valid record."""
        try:
            entries = os.scandir(self.directory)
        except OSError:
            return self.last
        with entries:
            for entry in entries:
                followed = self._followed(entry.name)
                if followed is not None:
                    self._read_file(entry.name, followed)
        return self.last

    def _followed(self, name: str) -> _Followed | None:
        followed = self.files.get(name)
        if followed is not None or name in self.ignored_files:
            return followed
        stem, dot, extension = name.partition(".")
        valid = dot and extension == "jsonl" and stem.isascii() and stem.isdigit() and len(stem) <= 10
        if not valid or len(self.files) >= MAX_FILES:
            self._ignore(name)
            return None
        followed = self.files[name] = _Followed(int(stem))
        return followed

    def _ignore(self, name: str) -> None:
        """A file that is not a process's records counts as one bad record (once, while names are remembered)."""
        if len(self.ignored_files) < MAX_FILES:
            self.ignored_files.add(name)
            self.dropped += 1

    def _read_file(self, name: str, followed: _Followed) -> None:
        try:
            chunk = _read_regular(os.path.join(self.directory, name), followed, READ_WINDOW)
        except BadRecord:  # a FIFO, a link, a device: never read, and counted once
            del self.files[name]
            self._ignore(name)
            return
        if not chunk:
            return
        complete = chunk.rfind(b"\n") + 1
        if not complete:
            if len(chunk) >= READ_WINDOW:  # one line longer than the window: dropped, its rest skipped
                followed.offset += len(chunk)
                self.dropped += 0 if followed.in_long_line else 1
                followed.in_long_line = True
            return
        followed.offset += complete
        lines = chunk[:complete].split(b"\n")[:-1]
        if followed.in_long_line:  # the end of a line dropped before
            lines, followed.in_long_line = lines[1:], False
        newest = None
        for line in lines:
            try:
                newest = parse_record(line, followed.pid)
            except BadRecord:
                self.dropped += 1
        if newest is not None:
            self.last[followed.pid] = newest


def _read_regular(path: str, followed: _Followed, window: int) -> bytes | None:
    """Up to `window` new bytes of a regular file (the newest, when more came); None when it cannot be read now.

    Opened without following a link and without blocking (a FIFO would wait for a writer for ever).
    When more than `window` bytes came since the last read, the older ones are skipped: the
    bytes up to the first newline of the window then belong to a line cut in two, and are skipped too.

    Raises:
        BadRecord: it is not a regular file (a link, a FIFO, a socket, a device).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symbolic link
            raise BadRecord("not a regular file") from exc
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadRecord("not a regular file")
        if info.st_size < followed.offset:  # cut short: read again from its start
            followed.offset, followed.in_long_line = 0, False
        if info.st_size - followed.offset > window:
            followed.offset = info.st_size - window
            followed.in_long_line = True
        return os.pread(fd, window, followed.offset) if info.st_size > followed.offset else None
    except OSError:
        return None
    finally:
        os.close(fd)


__all__ = ["MAX_FILES", "MAX_LOADERS", "MAX_LINE_BYTES", "READ_WINDOW", "BadRecord", "RecorderFiles", "parse_record"]
