"""One signed GET per object: how prepare reads many small source files from an S3 store.

A source image is one request, and through s3fs (aiobotocore) that request
costs 1.5-3 ms of CPU on the client: the endpoint rules, the event hooks,
the user agent, the response parser. A 1 MP JPEG decodes and resizes in
about 2 ms, so on a machine whose cores are all busy decoding, reading the
file costs more than using it. `S3Getter` sends the same request without
that machinery: the URL is built from what the s3fs client resolved
(endpoint, region, addressing), the request is signed with botocore's own
SigV4 signer and the client's own credentials, and urllib3 sends it on a
pool of kept-alive connections. That is about a tenth of the CPU.

It is a fast path only. Anything it is not sure of is left to s3fs:

- `getter_for` gives None (s3fs reads every file) for a filesystem that is
  not s3fs, or whose options ask for something the fast path does not do
  (requester pays, versions, SSE-C and other extra request arguments, a
  proxy, a `verify=` of its own, virtual-host addressing on a custom
  endpoint); TLS is checked against AWS_CA_BUNDLE where set, as botocore does;
- `S3Getter.get` gives None (the caller asks s3fs) for any answer but 200,
  206 and 404: a region redirect, a refusal, a throttle, a server error, a
  dropped connection, where s3fs's retries and error messages take over.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any
from urllib.parse import quote, urlsplit

CREDENTIALS_TTL_S = 60.0  # how long frozen credentials are reused before asking the client again
POOL_CONNECTIONS = 64  # kept-alive connections per host: at least the I/O threads of a worker
TIMEOUT_S = 60.0
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
        import urllib3
        from botocore.httpsession import get_cert_path  # type: ignore[import-untyped]

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
        self._http = urllib3.PoolManager(
            maxsize=POOL_CONNECTIONS,
            block=False,
            retries=False,
            timeout=urllib3.Timeout(connect=TIMEOUT_S, read=TIMEOUT_S),
            ca_certs=(os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True)) if parts.scheme == "https" else None,
        )

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

    def get(self, path: str, end: int) -> bytes | None:
        """The first `end` bytes of the object at `path` (``bucket/key``): one GET.

        Returns:
            The bytes (the whole object when it is shorter); None when the store
            answered anything but the object or its absence: the caller reads it through s3fs.

        Raises:
            FileNotFoundError: the store says there is no such object.
        """
        bucket, _, key = path.partition("/")
        url = self.url(bucket, key) if key else None
        if url is None:
            return None
        for attempt in (0, 1):
            headers = self._signed(url, {"Range": f"bytes=0-{end - 1}"}, fresh=attempt > 0)
            if headers is None:
                return None
            try:
                response = self._http.request("GET", url, headers=headers, preload_content=True, redirect=False)
            except Exception:  # noqa: BLE001 - a dropped connection, a timeout: s3fs retries and names it
                return None
            if response.status in (200, 206):
                data: bytes = response.data
                return data
            if response.status == 404:
                raise FileNotFoundError(f"no such object: s3://{path}")
            if response.status != 403 or self.anonymous:  # 403: maybe expired credentials, tried once more afresh
                return None
        return None

    def _signed(self, url: str, headers: dict[str, str], fresh: bool) -> dict[str, str] | None:
        if self.anonymous:
            return headers
        from botocore.auth import S3SigV4Auth  # type: ignore[import-untyped]
        from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]

        credentials = self._frozen_credentials(fresh)
        if credentials is None:
            return None
        request = AWSRequest(method="GET", url=url, headers=headers)
        S3SigV4Auth(credentials, "s3", self.region).add_auth(request)
        return dict(request.headers.items())

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


def _plain_options(fs: Any) -> bool:
    """Whether `fs` was made with only options the fast path reproduces (endpoint, region, credentials, pool sizes)."""
    if fs.version_aware or fs.requester_pays or fs.s3_additional_kwargs or fs.req_kw:
        return False
    if set(fs.storage_options) - _SUPPORTED_OPTIONS:
        return False
    if set(fs.client_kwargs) - _SUPPORTED_CLIENT_KWARGS or set(fs.config_kwargs) - _SUPPORTED_CONFIG_KWARGS:
        return False
    return True
