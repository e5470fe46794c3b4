"""The S3 transport on gpufeed's own client (`getloop`, `blocking`): reads and listings, s3fs for the rest.

A source image is one request, and through s3fs (aiobotocore) that request
costs 1.5-3 ms of CPU on the client: the endpoint rules, the event hooks,
the user agent, the response parser. A 1 MP JPEG decodes and resizes in
about 2 ms, so on a machine whose cores are all busy decoding, reading the
file costs more than using it. `S3Transport` sends the same GETs at a
fraction of that CPU: reads ahead on `GetLoop` (one thread, many in
flight), a blocking read on the caller's own thread (`BlockingClient`,
the same request builder and parser). Listing goes the same way:
signed ListObjectsV2 requests whose XML is parsed here (`parse_listing`),
where botocore spends 70-130 microseconds of CPU per key (a seventh of
that here). Writes and removals, rare and large, go through s3fs.

It is a fast path only: `S3Transport.for_filesystem` gives None for options
it does not reproduce (`S3Settings.for_filesystem`), and any request the
client cannot answer with the bytes or the object's absence is made again
through s3fs, whose retries and error messages take over.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any
from urllib.parse import unquote_plus

from ...errors import StorageError
from ..transport import Body, FsspecTransport, Into, Transport
from .blocking import BlockingClient
from .config import S3Settings
from .getloop import GetLoop

LIST_PAGE_KEYS = 1000  # keys per ListObjectsV2 answer: the most S3 gives
EMPTY_PAGES_MAX = 100  # truncated pages in a row with nothing on them before a listing is judged endless (S3 gives a few)


class S3Transport(Transport):
    """S3 through gpufeed's own client, s3fs (`fallback`) for what it cannot do (see the module).

    Args:
        settings: the endpoint, addressing and credentials.
        fallback: the same filesystem's fsspec transport.
    """

    reads_ahead = True

    def __init__(self, settings: S3Settings, fallback: FsspecTransport) -> None:
        self.settings = settings
        self.fallback = fallback
        self._loop: GetLoop | None = None  # reads ahead, started on first use
        self._blocking = BlockingClient(settings)  # blocking reads and listings, on the caller's thread
        self._lock = threading.Lock()

    @classmethod
    def for_filesystem(cls, fs: Any) -> S3Transport | None:
        """The transport for s3fs filesystem `fs`, or None where its options ask for what only s3fs does."""
        settings = S3Settings.for_filesystem(fs)
        return None if settings is None else cls(settings, FsspecTransport(fs))

    def loop(self, in_flight: int) -> GetLoop:
        """The client reads ahead use, started on first use, with at least `in_flight` connections (a later job's
        reads in flight may be more)."""
        with self._lock:
            if self._loop is None:
                self._loop = GetLoop(self.settings, in_flight)
            self._loop.connections = max(self._loop.connections, in_flight)
            return self._loop

    def read_range(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        fetched = self.fetch(path, end, start)
        return self.fallback.read_range(path, start, end) if fetched is None else bytes(fetched)

    def fetch(self, path: str, end: int | None = None, start: int = 0) -> Body | None:
        """What the fast path gives for bytes `start` to `end` of `path`: the bytes, or None where s3fs must read them.

        Raises:
            FileNotFoundError: the store says there is no such object.
        """
        return self._blocking.get(path, end, start)

    def read_ahead(self, path: str, end: int | None = None, into: Into | None = None, in_flight: int = 1) -> Future[Body | None]:
        return self.loop(max(1, in_flight)).get(path, end, into=into)

    def list(self, path: str, delimiter: str | None = None) -> tuple[list[str], list[str]] | None:
        """Every key under `path` (``bucket/prefix``), and with `delimiter` the common prefixes.

        One ListObjectsV2 request per LIST_PAGE_KEYS keys, parsed here: botocore's
        parser costs 70-130 microseconds of CPU per key, which a
        million-image bucket turns into minutes.

        Returns:
            (keys, prefixes), both ``bucket/...`` paths in the store's order; None
            when the store answered anything but a listing (the caller lists through s3fs).

        Raises:
            StorageError: the store gives a continuation token it gave before, or
                EMPTY_PAGES_MAX pages in a row with nothing on them (its listing would
                never end), or a page fails as `BlockingClient.get` says.
        """
        bucket, _, prefix = path.partition("/")
        if not bucket:
            return None
        keys: list[str] = []
        prefixes: list[str] = []
        token: str | None = None
        tokens: set[str] = set()  # every page's token so far: one seen again is a listing going round in a loop
        empty = 0  # truncated pages in a row with no key and no prefix: a store paging through nothing for ever
        while True:
            params = {"list-type": "2", "encoding-type": "url", "max-keys": str(LIST_PAGE_KEYS), "prefix": prefix}
            if delimiter:
                params["delimiter"] = delimiter
            if token:
                params["continuation-token"] = token
            try:
                body = self._blocking.get(f"{bucket}/", query=params)
            except FileNotFoundError:
                return None
            if body is None:
                return None
            try:
                page_keys, page_prefixes, token = parse_listing(bytes(body))
            except ValueError:
                return None
            keys += [f"{bucket}/{key}" for key in page_keys]
            prefixes += [f"{bucket}/{name}" for name in page_prefixes]
            if token is None:
                return keys, prefixes
            empty = 0 if page_keys or page_prefixes else empty + 1
            if empty >= EMPTY_PAGES_MAX:
                raise StorageError(
                    f"cannot list s3://{path}: the store gave {empty} pages in a row with nothing on them, each "
                    "asking for another; it would never end"
                )
            if token in tokens:
                raise StorageError(
                    f"cannot list s3://{path}: the store gave a continuation token again after {len(tokens) + 1} "
                    "pages, as if the listing started over; it would never end"
                )
            tokens.add(token)

    def upload(self, source: str, path: str, *, part_bytes: int | None = None) -> None:
        self.fallback.upload(source, path, part_bytes=part_bytes)

    def remove(self, paths: Sequence[str]) -> None:
        self.fallback.remove(paths)

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        self._blocking.close()
        if loop is not None:
            loop.close()


def parse_listing(body: bytes) -> tuple[list[str], list[str], str | None]:
    """(keys, common prefixes, the next page's continuation token or None) of a ListObjectsV2 answer.

    Keys the store URL-encoded (``EncodingType`` url, asked for because XML
    cannot carry every byte a key may hold) come back decoded, as botocore
    decodes them.

    Raises:
        ValueError: the body is not a ListObjectsV2 answer (the caller lists through s3fs).
    """
    from xml.etree import ElementTree

    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError as exc:
        raise ValueError(f"not XML: {exc}") from exc
    if _local_name(root.tag) != "ListBucketResult":
        raise ValueError(f"not a listing: <{_local_name(root.tag)}>")
    fields = {_local_name(child.tag): child for child in root}
    encoded = (fields["EncodingType"].text or "") == "url" if "EncodingType" in fields else False

    def name(text: str | None) -> str:
        return unquote_plus(text or "") if encoded else text or ""

    keys: list[str] = []
    prefixes: list[str] = []
    for child in root:
        tag = _local_name(child.tag)
        if tag in ("Contents", "CommonPrefixes"):
            wanted = "Key" if tag == "Contents" else "Prefix"
            value = next((item.text for item in child if _local_name(item.tag) == wanted), None)
            if value is None:
                raise ValueError(f"a listing entry without <{wanted}>")
            (keys if tag == "Contents" else prefixes).append(name(value))
    truncated = "IsTruncated" in fields and (fields["IsTruncated"].text or "").strip().lower() == "true"
    token = fields["NextContinuationToken"].text if truncated and "NextContinuationToken" in fields else None
    if truncated and not token:
        raise ValueError("a truncated listing without a continuation token")
    return keys, prefixes, token


def _local_name(tag: str) -> str:
    return tag.rpartition("}")[2]
