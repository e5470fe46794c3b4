"""One signed GET per object: how prepare lists and reads many small files (source images, its own records) on an S3 store.

A source image is one request, and through s3fs (aiobotocore) that request
costs 1.5-3 ms of CPU on the client: the endpoint rules, the event hooks,
the user agent, the response parser. A 1 MP JPEG decodes and resizes in
about 2 ms, so on a machine whose cores are all busy decoding, reading the
file costs more than using it. `S3Getter` sends the same request without
that machinery: the URL is built from what the s3fs client resolved
(endpoint, region, addressing), the request is signed (AWS Signature
Version 4, `sign_get`, with the client's own credentials; the day's signing
key is kept) and sent on a kept-alive connection of the calling thread, its
answer read by `_exchange` (a status line, headers, a body of
Content-Length bytes or chunks). That is about a tenth of the CPU.

Listing a source goes the same way (`S3Getter.list_objects`): signed
ListObjectsV2 requests whose XML is parsed here (`parse_listing`), where
botocore spends 70-130 microseconds of CPU per key (a seventh of that here).

It is a fast path only. Anything it is not sure of is left to s3fs:

- `getter_for` gives None (s3fs reads every file) for a filesystem that is
  not s3fs, or whose options ask for something the fast path does not do
  (requester pays, versions, SSE-C and other extra request arguments, a
  proxy, a `verify=` of its own, virtual-host addressing on a custom
  endpoint); TLS is checked against AWS_CA_BUNDLE where set, as botocore does;
- `S3Getter.get` gives None (the caller asks s3fs) for any answer but 200,
  206 and 404: a region redirect, a refusal, a throttle, a server error, a
  dropped connection, where s3fs's retries and error messages take over;
  `S3Getter.list_objects` gives None for any answer but a whole listing.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import os
import socket
import threading
import time
from typing import Any
from urllib.parse import quote, unquote_plus, urlsplit

CREDENTIALS_TTL_S = 60.0  # how long frozen credentials are reused before asking the client again
TIMEOUT_S = 60.0  # connect, and each read of an answer
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # the payload hash of a request without a body
READ_BUFFER = 1 << 16
IDLE_CONNECTIONS = 32  # kept-alive connections kept for later requests, per endpoint
LIST_PAGE_KEYS = 1000  # keys per ListObjectsV2 answer: the most S3 gives
_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")
_SUPPORTED_OPTIONS = {"endpoint_url", "key", "secret", "token", "anon", "profile", "client_kwargs", "config_kwargs"}
_SUPPORTED_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_SUPPORTED_CONFIG_KWARGS = {
    "max_pool_connections", "connect_timeout", "read_timeout", "retries",
    "response_checksum_validation", "request_checksum_calculation",
}  # fmt: skip

_GETTERS: dict[tuple[int, str], S3Getter | None] = {}
_GETTERS_LOCK = threading.Lock()


def getter_for(fs: Any) -> S3Getter | None:
    """The fast getter for an s3fs filesystem (one per filesystem and process), or None where s3fs must read."""
    key = (os.getpid(), str(getattr(fs, "_fs_token", id(fs))))  # the token: the filesystem's class and options
    with _GETTERS_LOCK:
        if key not in _GETTERS:
            try:
                _GETTERS[key] = S3Getter.for_filesystem(fs)
            except Exception:  # noqa: BLE001 - anything unexpected in the client's make-up: s3fs reads
                _GETTERS[key] = None
        return _GETTERS[key]


class S3Getter:
    """Signed GETs of objects in one S3 endpoint (see the module).

    Args:
        client: the s3fs filesystem's aiobotocore client (its endpoint, region and credentials are used).
        loop: the event loop that client runs on (credentials are refreshed there).
        endpoint_url: where requests go; AWS's own endpoints are addressed virtual-host style.
        region: the signing region.
        anonymous: send requests unsigned.
    """

    def __init__(self, client: Any, loop: Any, endpoint_url: str, region: str, anonymous: bool) -> None:
        self._client = client
        self._loop = loop
        self.endpoint = endpoint_url.rstrip("/")
        parts = urlsplit(self.endpoint)
        self._aws = (parts.hostname or "").endswith(".amazonaws.com")
        self._scheme = parts.scheme
        self.region = region
        self.anonymous = anonymous
        self._credentials: Any = None
        self._credentials_at = 0.0
        self._lock = threading.Lock()
        # kept-alive connections not in use, by (host, port): any thread takes one, so the short-lived
        # threads of a burst of reads (records, plans) reuse the connections of the last burst
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._idle_lock = threading.Lock()
        self._tls: Any = None
        if parts.scheme == "https":
            import ssl

            from botocore.httpsession import get_cert_path  # type: ignore[import-untyped]

            self._tls = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True))

    @classmethod
    def for_filesystem(cls, fs: Any) -> S3Getter | None:
        """A getter for `fs`, or None where its options ask for what only s3fs does."""
        if type(fs).__name__ != "S3FileSystem" or not _plain_options(fs):
            return None
        if any(os.environ.get(name) for name in _PROXY_VARIABLES):
            return None
        client = fs.s3  # connects: endpoint, region and credentials resolved as s3fs resolves them
        config = client.meta.config
        if getattr(config, "proxies", None) or (config.s3 or {}).get("addressing_style") not in (None, "auto", "path"):
            return None
        from botocore import UNSIGNED  # type: ignore[import-untyped]

        anonymous = getattr(config, "signature_version", None) is UNSIGNED
        if not anonymous and getattr(client, "_request_signer", None) is None:
            return None
        endpoint = str(client.meta.endpoint_url)
        return cls(client, fs.loop, endpoint, str(client.meta.region_name or "us-east-1"), anonymous)

    def url(self, bucket: str, key: str) -> str | None:
        """The object's URL: path style on a custom endpoint, virtual-host style on AWS; None if the name does not fit."""
        quoted = quote(key, safe="/~")
        if not self._aws:
            return f"{self.endpoint}/{bucket}/{quoted}"
        if "." in bucket or bucket.lower() != bucket:  # not a DNS label TLS can check: s3fs knows what to do
            return None
        return f"{self._scheme}://{bucket}.s3.{self.region}.amazonaws.com/{quoted}"

    def get(self, path: str, end: int | None = None, start: int = 0) -> bytes | None:
        """Bytes `start` to `end` (exclusive) of the object at `path` (``bucket/key``); to its end if `end` is None: one GET.

        Returns:
            The bytes (fewer when the object ends first); None when the store
            answered anything but those bytes or the object's absence (a range
            past the end, a store that ignored the range of a read from the
            middle): the caller reads it through s3fs.

        Raises:
            FileNotFoundError: the store says there is no such object.
        """
        bucket, _, key = path.partition("/")
        url = self.url(bucket, key) if key else None
        if url is None:
            return None
        headers = {"Range": f"bytes={start}-{'' if end is None else end - 1}"} if start or end is not None else {}
        answer = self._signed_get(url, headers)
        if answer is None:
            return None
        status, body, content_range = answer
        if status in (200, 206) and starts_at(content_range, start, status):
            return body
        if status == 404:
            raise FileNotFoundError(f"no such object: s3://{path}")
        return None

    def _signed_get(self, url: str, headers: dict[str, str], query: str = "") -> tuple[int, bytes, str | None] | None:
        """(status, body, Content-Range) of one signed GET of `url` (`query`: canonical); None where s3fs must take over.

        A 403 is tried once more with credentials fetched afresh (they may have
        expired); a dropped connection, a timeout or an answer not understood is None.
        """
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        path = parts.path or "/"
        answer: tuple[int, bytes, str | None] | None = None
        for attempt in (0, 1):
            signed = headers
            if not self.anonymous:
                credentials = self._frozen_credentials(fresh=attempt > 0)
                if credentials is None:
                    return None
                signed = sign_get(parts.netloc, path, headers, credentials, self.region, query=query)
            try:
                answer = self._request(host, port, parts.netloc, f"{path}?{query}" if query else path, signed)
            except (OSError, ValueError):
                return None
            if answer[0] != 403 or self.anonymous:
                break
        return answer

    def list_objects(self, path: str, delimiter: str | None = None) -> tuple[list[str], list[str]] | None:
        """Every key under `path` (``bucket/prefix``: keys starting with it), and with `delimiter` the common prefixes.

        One ListObjectsV2 request per LIST_PAGE_KEYS keys, parsed here: botocore's
        parser costs 70-130 microseconds of CPU per key, which a
        million-image bucket turns into minutes.

        Returns:
            (keys, prefixes), both ``bucket/...`` paths in the store's order; None
            when the store answered anything but a listing (the caller lists through s3fs).
        """
        bucket, _, prefix = path.partition("/")
        url = self.url(bucket, "") if bucket else None
        if url is None:
            return None
        url = url.rstrip("/")  # the bucket itself: /bucket on a custom endpoint, / on its own host
        keys: list[str] = []
        prefixes: list[str] = []
        token: str | None = None
        while True:
            params = {"list-type": "2", "encoding-type": "url", "max-keys": str(LIST_PAGE_KEYS), "prefix": prefix}
            if delimiter:
                params["delimiter"] = delimiter
            if token:
                params["continuation-token"] = token
            answer = self._signed_get(url, {}, query=canonical_query(params))
            if answer is None or answer[0] != 200:
                return None
            try:
                page_keys, page_prefixes, token = parse_listing(answer[1])
            except ValueError:
                return None
            keys += [f"{bucket}/{key}" for key in page_keys]
            prefixes += [f"{bucket}/{name}" for name in page_prefixes]
            if token is None:
                return keys, prefixes

    def _request(
        self, host: str, port: int, host_header: str, path: str, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None]:
        """(status, body, Content-Range) of one GET on an idle kept-alive connection (else a new one); a stale one is replaced once."""
        head = f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in headers.items()
        )
        request = (head + "\r\n").encode("latin-1")
        for attempt in (0, 1):
            connection = self._take_idle((host, port)) if attempt == 0 else None
            fresh = connection is None
            if connection is None:
                connection = _Connection(host, port, self._tls)
            try:
                status, body, keep, content_range = connection.exchange(request)
            except (OSError, ValueError) as exc:
                connection.close()  # after an answer not understood, what is left of it would garble the next one
                if isinstance(exc, ValueError) or fresh or attempt:  # a new connection that fails is the store's answer
                    raise
                continue  # the store closed a kept-alive connection meanwhile: once more on a new one
            if keep:
                self._keep_idle((host, port), connection)
            else:
                connection.close()
            return status, body, content_range
        raise OSError("no answer")

    def _take_idle(self, where: tuple[str, int]) -> _Connection | None:
        with self._idle_lock:
            idle = self._idle.get(where)
            return idle.pop() if idle else None

    def _keep_idle(self, where: tuple[str, int], connection: _Connection) -> None:
        with self._idle_lock:
            idle = self._idle.setdefault(where, [])
            if len(idle) < IDLE_CONNECTIONS:
                idle.append(connection)
                return
        connection.close()

    @property
    def tls_context(self) -> Any:
        """The TLS settings connections to an https endpoint use (None for http)."""
        return self._tls

    def credentials(self) -> Any:
        """The frozen credentials requests are signed with now (None where none can be had)."""
        return self._frozen_credentials(fresh=False)

    def _frozen_credentials(self, fresh: bool) -> Any:
        with self._lock:
            if fresh or self._credentials is None or time.monotonic() - self._credentials_at > CREDENTIALS_TTL_S:
                self._credentials = self._fetch_credentials()
                self._credentials_at = time.monotonic()
            return self._credentials

    def _fetch_credentials(self) -> Any:
        import inspect

        from fsspec.asyn import sync

        credentials = self._client._request_signer._credentials
        if credentials is None:
            return None

        async def freeze() -> Any:
            frozen = credentials.get_frozen_credentials()
            return await frozen if inspect.isawaitable(frozen) else frozen

        frozen = sync(self._loop, freeze)
        return frozen if getattr(frozen, "access_key", None) else None


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


def _plain_options(fs: Any) -> bool:
    """Whether `fs` was made with only options the fast path reproduces (endpoint, region, credentials, pool sizes)."""
    if fs.version_aware or fs.requester_pays or fs.s3_additional_kwargs or fs.req_kw:
        return False
    if set(fs.storage_options) - _SUPPORTED_OPTIONS:
        return False
    if set(fs.client_kwargs) - _SUPPORTED_CLIENT_KWARGS or set(fs.config_kwargs) - _SUPPORTED_CONFIG_KWARGS:
        return False
    return True


def sign_get(
    host: str,
    path: str,
    headers: dict[str, str],
    credentials: Any,
    region: str,
    now: datetime.datetime | None = None,
    query: str = "",
) -> dict[str, str]:
    """`headers` with AWS Signature Version 4 added for ``GET path?query`` (no body) on S3 in `region`.

    What botocore's S3SigV4Auth puts on the same request: x-amz-date,
    x-amz-content-sha256 (the empty payload's hash), x-amz-security-token when
    the credentials have a token, and Authorization, over every header given
    and Host.

    Args:
        host: the Host header (``bucket.s3.region.amazonaws.com``, ``127.0.0.1:9000``).
        path: the request's path, percent-encoded as sent.
        headers: the other headers (e.g. Range).
        credentials: frozen credentials (access_key, secret_key, token).
        region: the signing region.
        now: the signing time (UTC); the current time by default.
        query: the query string as sent, already canonical (`canonical_query`); empty for none.
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    signed = {name.lower(): str(value).strip() for name, value in headers.items()}
    signed.update({"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date})
    if credentials.token:
        signed["x-amz-security-token"] = credentials.token
    names = sorted(signed)
    canonical = "\n".join(
        ["GET", path, query, "".join(f"{name}:{signed[name]}\n" for name in names), ";".join(names), EMPTY_SHA256]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    signature = hmac.new(_signing_key(credentials.secret_key, day, region), to_sign.encode(), hashlib.sha256).hexdigest()
    out = {**headers, "X-Amz-Content-SHA256": EMPTY_SHA256, "X-Amz-Date": amz_date}
    if credentials.token:
        out["X-Amz-Security-Token"] = credentials.token
    out["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    return out


def canonical_query(params: dict[str, str]) -> str:
    """A query string in the form Signature Version 4 signs: names sorted, names and values percent-encoded."""
    return "&".join(f"{quote(name, safe='-_.~')}={quote(value, safe='-_.~')}" for name, value in sorted(params.items()))


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


@functools.lru_cache(maxsize=16)
def _signing_key(secret: str, day: str, region: str) -> bytes:
    key = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


class _Connection:
    """One kept-alive HTTP/1.1 connection (TLS where `tls` is given), one request at a time."""

    def __init__(self, host: str, port: int, tls: Any) -> None:
        sock = socket.create_connection((host, port), timeout=TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = tls.wrap_socket(sock, server_hostname=host) if tls is not None else sock
        self.reader = self.sock.makefile("rb", buffering=READ_BUFFER)

    def exchange(self, request: bytes) -> tuple[int, bytes, bool, str | None]:
        """Send `request`; (status, body, whether the connection may be used again, the Content-Range header)."""
        self.sock.sendall(request)
        status_line = self.reader.readline(8192)
        if not status_line:
            raise ConnectionResetError("the store closed the connection")
        version, status, *_ = status_line.decode("latin-1").split(" ", 2) + [""]
        if not version.startswith("HTTP/1.") or not status.isdigit():
            raise ValueError(f"not an HTTP answer: {status_line[:64]!r}")
        headers: dict[str, str] = {}
        while (line := self.reader.readline(65536)) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = self._chunked()
        elif "content-length" in headers:
            body = self._exactly(int(headers["content-length"]))
        else:
            raise ValueError("an answer without a length")  # read to the end: rare; s3fs reads it instead
        keep = version != "HTTP/1.0" and headers.get("connection", "").lower() != "close"
        return int(status), body, keep, headers.get("content-range")

    def _exactly(self, size: int) -> bytes:
        body = self.reader.read(size)
        if len(body) != size:
            raise ConnectionResetError(f"the answer ended after {len(body)} of {size} bytes")
        return body

    def _chunked(self) -> bytes:
        pieces: list[bytes] = []
        while True:
            size = int(self.reader.readline(1024).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.reader.readline(65536) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(pieces)
            pieces.append(self._exactly(size))
            self._exactly(2)  # the CRLF after each chunk

    def close(self) -> None:
        for closing in (self.reader, self.sock):
            try:
                closing.close()
            except OSError:
                pass
