"""One GET of gpufeed's S3 client: what it asks for, its bytes (the one request builder), and what its answer means.

Both ways the client sends requests, many in flight on a loop thread
(`getloop.GetLoop`) and one at a time on the calling thread
(`blocking.BlockingClient`), build them here (`GetRequest.signed`) and
take their decisions here: `judge_answer` for an answer that came whole,
`judge_failure` for a connection that failed or an answer not understood.
Each gives a verdict (ANSWER with the value, AGAIN at once, RETRY after
`GetRequest.backoff`); the caller carries it out its own way.

Nothing is tried without end. A request is sent again at once for a
region the store names (a 301, 307 or 400 with ``x-amz-bucket-region``)
at most MAX_REGION_CHANGES times, and never back to a region it was sent
to: a store that names the region the request went to, or sends it from
region to region, gets a StorageError naming the object and the regions.
The answer's ``Location`` is never followed (the request goes to the
endpoint configured, for the region named); a redirect to another host
is a StorageError, not handed to s3fs (whose HTTP client would follow it,
credentials and all), except between AWS's own hosts, as S3 documents
its temporary redirects. Transient failures are tried
RETRIES times; and all of it (connecting, headers, body, retries) ends by
the request's deadline (`S3Settings.deadline_s`), where it is a
StorageError too (`GetRequest.late`).
"""

from __future__ import annotations

import base64
import hashlib
import random
import re
import time
import zlib
from concurrent.futures import Future
from typing import Any
from urllib.parse import urlsplit

from ...errors import StorageError
from ..transport import Body, Into
from .config import DEADLINE_ENV, S3Settings, valid_region
from .sign import canonical_query, sign_get

BODY_LIMIT = 1 << 30  # the most bytes a whole-object GET reads; a larger object is left to s3fs
LIST_LIMIT = 16 << 20  # the most bytes of one listing page (1,000 keys of 1,024 bytes, URL-encoded, take 4 MB)
MAX_REGION_CHANGES = 3  # regions one request is sent on to, one after another, before it is given up
RETRIES = 3  # transient failures retried per request
BACKOFF_S = 0.05  # the first retry's delay; doubled each time, with jitter
RETRIED_STATUSES = (500, 502, 503, 504)
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_HOST_NAME = re.compile(r"[A-Za-z0-9.-]{1,253}")

ANSWER, AGAIN, RETRY = "answer", "again", "retry"  # a verdict: give the value; send again at once; after a backoff
Verdict = tuple[str, "Body | BaseException | None"]


class GetRequest:
    """One GET: what it asks for, where it goes now (`place`), its tries, and the future its answer goes to (if any)."""

    __slots__ = (
        "bucket", "key", "start", "end", "query", "future", "into", "url", "host", "port", "netloc", "path", "tls",
        "attempts", "stale_retried", "refreshed", "fresh_credentials", "regions", "deadline",
    )  # fmt: skip

    def __init__(
        self,
        bucket: str,
        key: str,
        start: int,
        end: int | None,
        query: dict[str, str] | None,
        future: Future[Body | None] | None = None,
        into: Into | None = None,
    ) -> None:
        self.bucket, self.key, self.start, self.end, self.query = bucket, key, start, end, query
        self.future, self.into = future, into
        self.url = self.host = self.netloc = self.path = ""
        self.port, self.tls = 0, False
        self.attempts = 0
        self.stale_retried = self.refreshed = self.fresh_credentials = False
        self.regions: list[str] = []  # the regions it was signed for, in turn
        self.deadline: float | None = None  # when it is given up (monotonic), from its first try on

    @staticmethod
    def askable(settings: S3Settings, path: str, query: dict[str, str] | None) -> tuple[str, str] | None:
        """(bucket, key) of `path` where the client may ask for it; None where the caller must read it another way."""
        bucket, _, key = path.partition("/")
        if not bucket or (not key and query is None) or settings.refused(bucket) or settings.bucket_url(bucket) is None:
            return None
        return bucket, key

    @property
    def whole(self) -> bool:
        """Whether the whole object is asked for (its checksum is asked for and checked)."""
        return self.query is None and self.start == 0 and self.end is None

    @property
    def most(self) -> int:
        """The most bytes the answer may have: the range's length, else BODY_LIMIT (LIST_LIMIT for a listing)."""
        if self.query is not None:
            return LIST_LIMIT
        return BODY_LIMIT if self.end is None else max(0, self.end - self.start)

    @property
    def what(self) -> str:
        """What the request does, for a message: ``read s3://bucket/key`` or ``list s3://bucket/prefix``."""
        if self.query is not None:
            return f"list s3://{self.bucket}/{self.query.get('prefix', '')}"
        return f"read s3://{self.bucket}/{self.key}"

    def left(self) -> float:
        """Seconds left before the request's deadline (infinite before its first try)."""
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def late(self, settings: S3Settings) -> StorageError:
        """The error of a request past its deadline."""
        return StorageError(
            f"cannot {self.what}: the store did not answer it whole within {settings.deadline_s:g} s, the deadline "
            f"of one request (set {DEADLINE_ENV} for another); it sends too slowly or not at all"
        )

    def place(self, settings: S3Settings) -> None:
        """Where the request goes now (the bucket's region may have been learnt since the last try); the first
        placing starts its deadline, so the lookup of the host's name counts against it too."""
        if self.deadline is None:
            self.deadline = time.monotonic() + settings.deadline_s
        url = settings.bucket_url(self.bucket) if self.query is not None else settings.url(self.bucket, self.key)
        if url is None:
            raise ValueError("the bucket's name does not fit the addressing")
        parts = urlsplit(url)
        self.url, self.netloc, self.path, self.tls = url, parts.netloc, parts.path or "/", parts.scheme == "https"
        self.host, self.port = parts.hostname or "", parts.port or (443 if self.tls else 80)

    def signed(self, settings: S3Settings) -> bytes | None:
        """The request's bytes, signed with the credentials `settings` resolve (afresh after a 403); None: there are none."""
        credentials = None
        if not settings.anonymous:
            assert settings.credentials is not None
            credentials = settings.credentials.get(fresh=self.fresh_credentials)
            self.fresh_credentials = False
            if credentials is None:
                return None
        region = settings.region_of(self.bucket)
        if not self.regions or self.regions[-1] != region:
            self.regions.append(region)
        return self.head(credentials, region)

    def head(self, credentials: Any, region: str) -> bytes:
        """The request's bytes: the one request builder (signed where `credentials` are given)."""
        headers: dict[str, str] = {}
        if self.start or self.end is not None:
            headers["Range"] = f"bytes={self.start}-{'' if self.end is None else self.end - 1}"
        if self.whole:
            headers["x-amz-checksum-mode"] = "ENABLED"
        query = canonical_query(self.query) if self.query is not None else ""
        if credentials is not None:
            headers = sign_get(self.netloc, self.path, headers, credentials, region, query=query)
        target = f"{self.path}?{query}" if query else self.path
        text = f"GET {target} HTTP/1.1\r\nHost: {self.netloc}\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in headers.items()
        )
        return (text + "\r\n").encode("latin-1")

    def backoff(self) -> float | None:
        """The delay before the next try (exponential, with jitter), counted; None once the request has had its RETRIES."""
        if self.attempts >= RETRIES:
            return None
        delay = BACKOFF_S * (2**self.attempts) * (0.5 + random.random())
        self.attempts += 1
        return delay

    @property
    def cancelled(self) -> bool:
        """Whether the caller gave up waiting for the answer (its future was cancelled)."""
        return self.future is not None and self.future.cancelled()

    def cancel(self) -> None:
        """No answer is coming (the client is closing): its future is cancelled."""
        if self.future is not None:
            self.future.cancel()

    def answer(self, value: Body | BaseException | None) -> None:
        """Give the request's future its result (an exception is raised from it)."""
        if self.future is None or self.future.done():
            return
        if isinstance(value, BaseException):
            self.future.set_exception(value)
        else:
            self.future.set_result(value)


def judge_answer(settings: S3Settings, request: GetRequest, status: int, headers: dict[str, str], body: Body) -> Verdict:
    """What a whole answer means for `request`: its bytes, absence, another try, or None (see `getloop`'s module)."""
    if status in (200, 206) and starts_at(headers.get("content-range"), request.start, status):
        if request.whole and not checksum_matches(headers, body):
            return RETRY, None
        return ANSWER, body
    if status == 404:
        return ANSWER, FileNotFoundError(f"no such object: s3://{request.bucket}/{request.key}")
    region = headers.get("x-amz-bucket-region", "")
    if status in (301, 307, 400) and valid_region(region):
        moved = _moved(settings, request, status, region)
        if moved is not None:
            return moved
    if status in REDIRECT_STATUSES and _elsewhere(request, headers.get("location", "")):
        host = urlsplit(headers["location"]).hostname or ""
        return ANSWER, StorageError(
            f"cannot {request.what}: the store redirects it to another host"
            f"{f' ({host})' if _HOST_NAME.fullmatch(host) else ''}, which is not followed; set the storage option "
            "endpoint_url to the bucket's own endpoint"
        )
    if status == 403 and not settings.anonymous and not request.refreshed:
        request.refreshed = request.fresh_credentials = True  # they may have expired: resolved anew, once
        return AGAIN, None
    if status in RETRIED_STATUSES:
        return RETRY, None
    if status in (301, 307, 403) or (status == 400 and "x-amz-bucket-region" in headers):
        settings.refuse(request.bucket)  # the fast path cannot reach it: s3fs, from now on
    return ANSWER, None


def _moved(settings: S3Settings, request: GetRequest, status: int, region: str) -> Verdict | None:
    """What an answer naming the bucket's `region` means: send it there, or a loop given up; None: not a move (a 400
    naming the region the request went to is a bad request for another reason)."""
    sent_to = request.regions[-1] if request.regions else settings.region_of(request.bucket)
    if region == sent_to:
        if status == 400:
            return None
        return ANSWER, StorageError(
            f"cannot {request.what}: the store redirects it to region {region}, the region it was sent to "
            f"(HTTP {status}); check the endpoint (storage option endpoint_url) and the bucket's region"
        )
    if region in request.regions or len(request.regions) > MAX_REGION_CHANGES:
        return ANSWER, StorageError(
            f"cannot {request.what}: the store sends it from region to region "
            f"({' -> '.join([*request.regions, region])}), given up after {len(request.regions) - 1} region changes; "
            "check the endpoint (storage option endpoint_url) and the bucket's region"
        )
    settings.learn_region(request.bucket, region)  # every later request of the bucket goes there (unless learnt already)
    return AGAIN, None


def _elsewhere(request: GetRequest, location: str) -> bool:
    """Whether a redirect's `location` names another host than the request went to (AWS's hosts between themselves aside)."""
    try:
        parts = urlsplit(location)
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is no number: nowhere a request could go
        return True
    if not host:
        return False  # a path on the same host
    if (host, port or request.port) == (request.host, request.port):
        return False
    return not (host.endswith(".amazonaws.com") and request.host.endswith(".amazonaws.com"))


def judge_failure(request: GetRequest, exc: BaseException, reused: bool, answered_any: bool) -> Verdict:
    """What a failed exchange means for `request`: `reused` (the connection served others before), `answered_any`
    (the store sent some of this answer)."""
    if isinstance(exc, ValueError):  # an answer not understood or over its bound: not something a retry mends
        return ANSWER, None
    if reused and not answered_any and not request.stale_retried:
        request.stale_retried = True  # the store closed a kept-alive connection meanwhile: once more on a new one
        return AGAIN, None
    return RETRY, None


def starts_at(content_range: str | None, start: int, status: int) -> bool:
    """Whether an answer's body begins at byte `start` of the object.

    A 206 says where in its Content-Range; so does the 200 some S3 servers send
    for a range (rclone's). A 200 without one is the whole object: its start.
    """
    if content_range is None:
        return status == 206 or start == 0
    unit, _, rest = content_range.partition(" ")
    first = rest.partition("-")[0]
    return unit.strip().lower() == "bytes" and first.strip().isdigit() and int(first) == start


def checksum_matches(headers: dict[str, str], body: Body) -> bool:
    """Whether `body` has the checksums its answer carries (those a whole-object GET can be checked against).

    Checked: x-amz-checksum-crc32, -sha1, -sha256 (base64 of the big-endian
    CRC or the digest) and Content-MD5. A composite value (``...-N``, a
    multipart object's checksum of part checksums), CRC32C and CRC64NVME are
    not checked.
    """
    checks = {
        "x-amz-checksum-crc32": lambda data: zlib.crc32(data).to_bytes(4, "big"),
        "x-amz-checksum-sha1": lambda data: hashlib.sha1(data).digest(),
        "x-amz-checksum-sha256": lambda data: hashlib.sha256(data).digest(),
        "content-md5": lambda data: hashlib.md5(data).digest(),
    }
    for name, digest in checks.items():
        value = headers.get(name)
        if not value or "-" in value:
            continue
        try:
            expected = base64.b64decode(value, validate=True)
        except ValueError:
            return False
        if digest(body) != expected:
            return False
    return True
