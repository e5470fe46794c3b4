"""Filesystem helpers shared by every stage: local paths or fsspec URLs, bounded reads, hashes, URLs fit to print."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import SourceError


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str | None:
    """The local filesystem path for `path` or a file:// URL, else None."""
    if path.startswith("file://"):
        return path[len("file://") :]
    if "://" in path:
        return None
    return path


def resolve_location(path: str) -> str:
    """`path` spelled one way wherever it was typed from: what a job records as its SRC.

    A local path is made absolute and normalised (`raw`, `raw/`, `./raw` and
    `/data/raw` from /data are all `/data/raw`; `~` is expanded); symlinks
    are kept as written (`same_location` looks through them). A URL stays a
    URL, trailing slashes dropped.

    Args:
        path: a local path or a URL.

    Returns:
        The resolved spelling.
    """
    if "://" in path:
        scheme, rest = path.split("://", 1)
        return f"{scheme}://{rest.rstrip('/')}" if rest.strip("/") else path
    return os.path.abspath(os.path.expanduser(path))


def same_location(first: str, second: str) -> bool:
    """Whether two spellings name the same place: equal once resolved, or local and the same folder through symlinks."""
    if resolve_location(first) == resolve_location(second):
        return True
    local_first, local_second = local_path(first), local_path(second)
    if local_first is None or local_second is None:
        return False
    return os.path.realpath(local_first) == os.path.realpath(local_second)


def redact_url(url: str) -> str:
    """`url` with its password, if any, replaced by ``***``: fit for messages, logs and reports.

    Args:
        url: any URL, e.g. ``redis://:secret@host:6379/0``.

    Returns:
        The same URL with ``***`` for the password (``redis://:***@host:6379/0``);
        the user name, the host as written, port, path and query are kept. A URL
        without a password comes back unchanged, one that cannot be parsed as
        ``<unparseable URL>``.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def open_fs(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a URL; errors become SourceError.

    Args:
        url: a local path or an fsspec URL (``s3://bucket/key``, ``gs://…``).
        storage_options: keyword arguments for the filesystem (e.g. ``endpoint_url``,
            ``profile``, ``anon``); credentials otherwise come from the usual places.
    """
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, TypeError, ValueError) as exc:
        raise SourceError(f"cannot open {url}: {exc}") from exc
    return fs, path


def read_source_bytes(url: str, max_bytes: int) -> bytes:
    """Read one input file whole; OSError for anything unreadable or too large."""
    local = local_path(url)
    if local is not None:
        with open(local, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > max_bytes:
                raise OSError(f"file is {size} bytes, over the {max_bytes}-byte input limit")
            return handle.read()
    fs, path = open_fs(url)
    size = fs.size(path)
    if size is not None and size > max_bytes:
        raise OSError(f"file is {size} bytes, over the {max_bytes}-byte input limit")
    data: bytes = fs.cat_file(path)
    return data


def temp_suffix() -> str:
    """`.tmp-HOST-PID`: unique among writers on every machine that shares OUT."""
    import socket

    return f".tmp-{socket.gethostname()}-{os.getpid()}"


def file_sha256(path: str, chunk: int = 4 * 1024 * 1024) -> tuple[str, int]:
    """(sha256 hex, size) of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size
