"""Filesystem helpers shared by every stage: local paths or fsspec URLs, bounded reads, hashes, URLs fit to print."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError, SourceError, StorageError
from ..redact import find_credentials, redact_url, redact_urls
from .transports import transport_for


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


def redact_location(path: str) -> str:
    """What a record keeps of a source or a file: a URL through `redact_url`, a local path as it is."""
    return redact_url(path) if is_url(path) else path


def url_secrets(url: str) -> list[str]:
    """What in a URL may be a credential: ``user information`` (``KEY:SECRET@``) and ``a query string``
    (a presigned URL's signature), as a message names them; [] for a local path or a plain URL."""
    if not is_url(url):
        return []
    try:
        parts = urlsplit(url)
    except ValueError:
        return ["an unparseable address"]
    found = []
    if "@" in parts.netloc:
        found.append("user information (NAME:PASSWORD@)")
    if parts.query:
        found.append("a query string (?...)")
    return found


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
        raise SourceError(redact_urls(f"cannot open {url}: {exc}")) from exc
    return fs, path


def forget_listings(fs: Any, path: str) -> None:
    """Make `fs` ask the store again about `path` and everything under it.

    An fsspec filesystem is shared by every caller in a process with the same
    options, and s3fs keeps each folder listing it made for the life of that
    process: a second prepare of a source another machine has added images to
    (or deleted some from) since the first one would list it as it was.

    Args:
        fs: an fsspec filesystem.
        path: a folder or file inside it (no protocol).
    """
    fs.invalidate_cache(path)  # the path and its parents
    listings = getattr(fs, "dircache", None)
    if listings:
        inside = path.rstrip("/") + "/"
        for key in [key for key in list(listings) if str(key).startswith(inside)]:
            listings.pop(key, None)


LEAN_PUT_BYTES = 16 << 20  # uploads up to this size go without "Expect: 100-continue": one round trip, not two


def lean_puts(fs: Any) -> None:
    """Make small uploads to S3 through `fs` one round trip instead of two (no-op for other filesystems).

    botocore puts ``Expect: 100-continue`` on every PutObject of a file, and the
    client then waits a round trip for the store's go-ahead before it sends the
    body: a 1 KB record 20 ms away took 45 ms. The header only spares sending a
    body the store would refuse, which for a small one costs less than the wait.
    """
    if type(fs).__name__ != "S3FileSystem":
        return
    try:
        client = fs.s3
        if getattr(client, "_gpufeed_lean_puts", False):
            return
        client.meta.events.register_last("before-send.s3.PutObject", _drop_expect_for_small_bodies)
        client._gpufeed_lean_puts = True
    except Exception:  # noqa: BLE001 - a client of another make-up: uploads as botocore sends them
        return


def _drop_expect_for_small_bodies(request: Any, **_: Any) -> None:
    """botocore's before-send hook: the request about to go out, its headers final (returns None: it is sent)."""
    headers = request.headers
    expect = headers.get("Expect")
    if expect is None or (expect.decode() if isinstance(expect, bytes) else str(expect)).lower() != "100-continue":
        return
    try:
        size = int(headers.get("Content-Length"))
    except (TypeError, ValueError):
        return  # a body of unknown length: as botocore sends it
    if size <= LEAN_PUT_BYTES:
        del headers["Expect"]


# Option names that carry credentials (s3fs `key`/`secret`/`token`, gcsfs `token`, adlfs `account_key` …):
# kept in this process only, never recorded in a job or shown.
def is_secret_option(name: str, value: Any = None) -> bool:
    """Whether a storage option holds a credential (its name says so, or a value at any depth in it does).

    Args:
        name: the option's name, e.g. ``endpoint_url`` (not secret) or ``secret`` (secret).
        value: its value; a dict (``client_kwargs``, ``headers``) is secret when any of its keys
            or values is, a URL (``endpoint_url``) when it holds user information or a query string.

    Returns:
        True for ``key``, ``secret``, ``token``, ``*_key``, ``password``, ``Authorization`` and the
        like, and for values of a credential's format (`pipeline.redact.find_credentials`).
    """
    return any(find_credentials({name: value}, "", url_credential))


def url_credential(text: str) -> str | None:
    """What of a credential a store setting's URL holds (`url_secrets`: user information, a query string), or None."""
    found = url_secrets(text)  # a store setting's URL (endpoint_url) carries neither, not even a query string
    return " and ".join(found) + " (may be a credential)" if found else None


def _protocols(urls: Iterable[str]) -> list[str]:
    return sorted({url.split("://", 1)[0] for url in urls if is_url(url)})


@contextlib.contextmanager
def storage_options_for(urls: Iterable[str], storage_options: Mapping[str, Any] | None) -> Iterator[None]:
    """Make `storage_options` the defaults of every filesystem of `urls`' protocols opened in this process, while inside.

    They go into fsspec's own per-protocol defaults (``fsspec.config.conf``), so
    every filesystem a job opens (its listing, each source read, OUT) gets them,
    and so do the pool processes it forks; options given to a call win over them.
    Outside the block the defaults are what they were (e.g. ``FSSPEC_S3_ENDPOINT_URL``
    from the environment).

    Args:
        urls: the job's locations (local paths are skipped).
        storage_options: fsspec options, e.g. ``{"endpoint_url": "http://…", "anon": True}``.
    """
    from fsspec.config import conf

    if not storage_options:
        yield
        return
    saved = {protocol: conf.get(protocol) for protocol in _protocols(urls)}
    try:
        for protocol in saved:
            conf[protocol] = {**(saved[protocol] or {}), **storage_options}
        yield
    finally:
        for protocol, before in saved.items():
            if before is None:
                conf.pop(protocol, None)
            else:
                conf[protocol] = before


def store_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a store's client raises when the store is away or refuses a call (OSError, botocore's)."""
    errors: list[type[BaseException]] = [OSError]
    try:
        from botocore.exceptions import BotoCoreError  # type: ignore[import-untyped]

        errors.append(BotoCoreError)
    except ImportError:
        pass
    return tuple(errors)


def at_once(*calls: Callable[[], Any]) -> list[Any]:
    """Run independent calls (each a few round trips to a store) on threads of their own; their results in order.

    Every call runs to its end; the first one's error (in the order given) is raised then.
    """
    if len(calls) < 2:
        return [call() for call in calls]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls), thread_name_prefix="gpufeed-at-once") as pool:
        running = [pool.submit(call) for call in calls]
        return [future.result() for future in running]


def store_failure(what: str, url: str, exc: BaseException) -> StorageError:
    """A StorageError for a failed call to a store (retryable), its URL without a password.

    The store's exception is named by its class and text: fsspec and botocore messages
    name the bucket and key, never the credentials.
    """
    detail = str(exc) or type(exc).__name__
    return StorageError(f"cannot {what} {redact_url(url)}: {detail}")


def abort_uploads(fs: Any, path: str, *, under: bool = False) -> int:
    """Abort the multipart uploads in progress to one object of an S3 store (or, with `under`, to every key below it).

    An upload that fails part way leaves its parts on S3, stored and billed but never
    visible, until it is aborted. s3fs aborts its own, but not when the abort fails too
    (the store refusing or away) or when the upload was cut short by other means. Other
    stores have nothing to abort: 0.

    Args:
        fs: the store's filesystem.
        path: the object (``bucket/key``), or with `under` a prefix.
        under: abort every upload whose key starts with `path`.

    Returns:
        How many uploads were aborted.

    Raises:
        OSError, BotoCoreError: the store cannot be reached or refuses the listing or an abort.
    """
    call = getattr(fs, "call_s3", None)
    if call is None:
        return 0
    bucket, key, _ = fs.split_path(path)
    aborted = 0
    markers: dict[str, str] = {}
    while True:
        page = call("list_multipart_uploads", Bucket=bucket, Prefix=key, **markers)
        for upload in page.get("Uploads") or []:
            if under or upload["Key"] == key:
                call("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
        if not page.get("IsTruncated"):
            return aborted
        markers = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}


_SPECIAL_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                  (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))


def open_regular(path: str) -> Any:
    """A local file opened for reading in binary, where it is a regular file (symlinks followed).

    A FIFO, socket or device is never opened to be read: a FIFO would wait
    for a writer for ever and a device may never end. It is refused before
    the open, and checked again on the open descriptor (opened without
    blocking), so a file swapped for a FIFO between the two is refused too.

    Raises:
        OSError: the file cannot be opened, or is not a regular file (its
            `strerror` says what it is instead).
    """
    return open_regular_stat(path)[0]


_CONFINED_TO: tuple[str, ...] | None = None  # real folders every file `open_regular` opens must lie under; None: anywhere


@contextlib.contextmanager
def confined_opens(roots: Iterable[str]) -> Iterator[None]:
    """While inside, every file `open_regular` opens in this process must lie under one of the local `roots`.

    A check of a path before it is opened can be outrun: a link put in place of a folder or file between
    the check and the open leads the open elsewhere. This one looks at what was opened: the descriptor's
    own path (links resolved by the kernel, `/proc/self/fd`), so whatever was swapped in, a file outside
    the roots is closed unread. The service's tasks run inside it with GPUFEED_ALLOWED_ROOTS; the pool
    processes a prepare forks meanwhile inherit it. URL roots name no local file: with only those, no
    local file opens.
    """
    global _CONFINED_TO
    before = _CONFINED_TO
    _CONFINED_TO = tuple(os.path.realpath(root) for root in roots if local_path(root) is not None and "://" not in root)
    try:
        yield
    finally:
        _CONFINED_TO = before


def _require_confined(fd: int, path: str) -> None:
    roots = _CONFINED_TO
    if roots is None:
        return
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc: the path's links resolved now, after the open
        opened = os.path.realpath(path)
    if not any(opened == root or opened.startswith(root.rstrip("/") + "/") for root in roots):
        raise OSError(errno.EACCES, f"it opens {opened!r}, outside the allowed roots ({', '.join(roots) or 'none local'}); not read", path)


def open_regular_stat(path: str) -> tuple[Any, os.stat_result]:
    """`open_regular`, with the open file's stat (its size: `st_size`), taken once on the descriptor.

    Inside `confined_opens`, a file whose descriptor lies outside the roots is closed unread.

    Raises:
        OSError: as `open_regular`, or the opened file is outside `confined_opens`' roots.
    """
    _require_regular(os.stat(path).st_mode, path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _require_confined(fd, path)
        status = os.fstat(fd)
        _require_regular(status.st_mode, path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), status
    except BaseException:
        os.close(fd)
        raise


def _require_regular(mode: int, path: str) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _SPECIAL_KINDS if test(mode)), "a special file")
        raise OSError(0, f"{kind}, not a regular file", path)


def read_source_bytes(url: str, max_bytes: int) -> bytes:
    """Read one input file whole; OSError for anything unreadable, too large or not a regular file.

    A remote file is one request: a GET of its first ``max_bytes + 1`` bytes
    (a Range the store clips to the object), so a file over the limit is known
    from what came back, without asking its size first (fsspec's plain
    ``cat_file`` would). It goes through the filesystem's transport
    (`transports.transport_for`): on S3 the fast path, at a fraction of the
    client CPU s3fs spends on it; else, or when it cannot tell, s3fs. A store that refuses the range (an
    empty object answers 416 on S3) is read the plain way: its size, then the
    whole object.
    """
    local = local_path(url)
    if local is not None:
        handle, status = open_regular_stat(local)
        with handle:
            size = status.st_size
            if size > max_bytes:
                raise OSError(f"file is {size} bytes, over the {max_bytes}-byte input limit")
            return handle.read()
    fs, path = open_fs(url)
    try:
        data: bytes = transport_for(fs).read_range(path, 0, max_bytes + 1)
    except FileNotFoundError:
        raise
    except Exception as exc:
        if not isinstance(exc, (*store_errors(), ValueError, NotImplementedError)):
            raise
        data = b""
        size = fs.size(path)
        if size is not None and size > max_bytes:
            raise OSError(f"file is {size} bytes, over the {max_bytes}-byte input limit") from None
        if size != 0:
            data = fs.cat_file(path)
    if len(data) > max_bytes:
        raise OSError(f"file is over the {max_bytes}-byte input limit")
    return data


def read_source_head(url: str, size: int) -> bytes:
    """The first `size` bytes of one input file (all of a shorter one): where its header is, without the rest.

    A local file is opened as `read_source_bytes` opens it (a regular file only,
    under `confined_opens`' roots); a remote one is one ranged GET.

    Raises:
        OSError: the file cannot be read, or is not a regular file.
        Exception: what the store's client raises (`store_errors`).
    """
    local = local_path(url)
    if local is not None:
        handle, _ = open_regular_stat(local)
        with handle:
            return handle.read(size)
    fs, path = open_fs(url)
    return transport_for(fs).read_range(path, 0, size)


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


def process_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (one of another user's counts): who left a temp file or a lock."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def byte_bound(variable: str, default: int, what: str) -> int:
    """A size bound a user may raise through an environment variable: $`variable`, else `default`.

    Args:
        variable: the variable's name (GPUFEED_MAX_MEMBER_BYTES, ...).
        default: the bound without it.
        what: what the bound is on, for the error ("tar member", "JSON file").

    Raises:
        ConfigError: the variable is set to something that is not a positive integer.
    """
    text = os.environ.get(variable)
    if not text:
        return default
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError(f"{variable}={text!r}: give the largest {what} to read, in bytes (a positive integer)")
    return int(text)
