"""What an S3 transport needs of an s3fs filesystem: its endpoint, region, addressing and credentials.

`S3Settings.for_filesystem` gives None where the filesystem's options ask
for something only s3fs does (requester pays, versions, SSE-C and other
extra request arguments, a proxy, a `verify=` of its own, virtual-host
addressing or acceleration, an endpoint path style cannot reach): the
caller then goes through s3fs, never around what was configured.

Addressing: the endpoint is used as configured, path style
(``ENDPOINT/bucket/key``), which every S3 endpoint shape serves: a custom
server, FIPS (``s3-fips.REGION``), dual-stack (``s3.dualstack.REGION``), VPC
interface endpoints (``bucket.vpce-....s3.REGION.vpce.amazonaws.com``).
Only AWS's plain regional endpoint (``s3.REGION.amazonaws.com``, or the
global ``s3.amazonaws.com``) is addressed virtual-host style, as botocore
does, for bucket names that are DNS labels. Transfer acceleration serves
virtual-host style only: it is left to s3fs.

Credentials come through botocore's public API: the keys given in the
options, else ``botocore.session.Session(profile=...).get_credentials()``
and its ``get_frozen_credentials()`` (refreshed as botocore refreshes them;
`S3Credentials.get(fresh=True)` resolves them anew, after a 403).

Every request has a total deadline (`deadline_s`): connecting, its
headers and its body, and every retry of it, in REQUEST_DEADLINE_S
seconds, or ``$GPUFEED_S3_DEADLINE_S`` where that is set (botocore has no
such option: its timeouts are per socket read, which a store sending a
byte now and then never reaches). A request past it ends as a
StorageError.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any
from urllib.parse import quote, urlsplit

from ...errors import ConfigError

CREDENTIALS_TTL_S = 60.0  # how long frozen credentials are reused before asking botocore again
_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")
_SUPPORTED_OPTIONS = {"endpoint_url", "key", "secret", "token", "anon", "profile", "client_kwargs", "config_kwargs"}
_SUPPORTED_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_SUPPORTED_CONFIG_KWARGS = {
    "max_pool_connections", "connect_timeout", "read_timeout", "retries",
    "response_checksum_validation", "request_checksum_calculation",
}  # fmt: skip
_PLAIN_AWS = re.compile(r"^s3(\.([a-z0-9-]+))?\.amazonaws\.com$")  # s3.amazonaws.com, s3.REGION.amazonaws.com
_REGION = re.compile(r"[a-z0-9-]{1,40}")
REQUEST_DEADLINE_S = 300.0
"""The default total deadline of one request, its retries included: a 1 GiB answer at 4 MB/s."""
DEADLINE_ENV = "GPUFEED_S3_DEADLINE_S"


def request_deadline() -> float:
    """The total deadline of one request, in seconds: $GPUFEED_S3_DEADLINE_S, else `REQUEST_DEADLINE_S`.

    Raises:
        ConfigError: the variable is set to something that is not a positive number of seconds.
    """
    text = os.environ.get(DEADLINE_ENV, "").strip()
    if not text:
        return REQUEST_DEADLINE_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"{DEADLINE_ENV}={text[:40]!r}: give the most seconds one S3 request may take (a positive number)")
    return seconds


def valid_region(name: str) -> bool:
    """Whether `name` can be a region's name (what a store's x-amz-bucket-region is taken for)."""
    return _REGION.fullmatch(name) is not None


class S3Credentials:
    """Frozen credentials (access_key, secret_key, token) through botocore's public API (see the module).

    Args:
        key, secret, token: the keys the options gave (all None: botocore's chain for `profile`).
        profile: the AWS profile to resolve them for.
    """

    def __init__(self, key: str | None, secret: str | None, token: str | None, profile: str | None) -> None:
        self._static = None
        if key and secret:
            from botocore.credentials import ReadOnlyCredentials  # type: ignore[import-untyped]

            self._static = ReadOnlyCredentials(key, secret, token)
        self._profile = profile
        self._source: Any = None
        self._frozen: Any = None
        self._at = 0.0
        self._lock = threading.Lock()

    def get(self, fresh: bool = False) -> Any:
        """The credentials to sign with now (None where none can be had); `fresh`: resolved anew."""
        if self._static is not None:
            return self._static
        with self._lock:
            if fresh or self._frozen is None or time.monotonic() - self._at > CREDENTIALS_TTL_S:
                if fresh or self._source is None:
                    import botocore.session  # type: ignore[import-untyped]

                    self._source = botocore.session.Session(profile=self._profile).get_credentials()
                frozen = self._source.get_frozen_credentials() if self._source is not None else None
                self._frozen = frozen if getattr(frozen, "access_key", None) else None
                self._at = time.monotonic()
            return self._frozen


class S3Settings:
    """Where an S3 filesystem's requests go and how they are signed (see the module).

    Args:
        endpoint_url: the endpoint as configured (or as botocore resolved it).
        region: the signing region.
        credentials: where signing keys come from; None: requests are sent unsigned.
        tls_ca: the CA bundle TLS is checked against (https only).
        deadline_s: the total deadline of one request; None: `request_deadline()`.

    Raises:
        ConfigError: $GPUFEED_S3_DEADLINE_S is not a positive number.
    """

    def __init__(
        self,
        endpoint_url: str,
        region: str,
        credentials: S3Credentials | None,
        tls_ca: str | None = None,
        deadline_s: float | None = None,
    ) -> None:
        self.endpoint = endpoint_url.rstrip("/")
        self.deadline_s = request_deadline() if deadline_s is None else deadline_s
        parts = urlsplit(self.endpoint)
        self.scheme = parts.scheme
        self.region = region
        self.credentials = credentials
        if tls_ca is None and self.scheme == "https":
            from botocore.httpsession import get_cert_path  # type: ignore[import-untyped]

            tls_ca = os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True)  # what botocore trusts
        self.tls_ca = tls_ca
        match = _PLAIN_AWS.match(parts.hostname or "")
        self.virtual_host = match is not None and not parts.port and parts.path in ("", "/")
        self._regions: dict[str, str] = {}  # bucket -> its region, learnt from a 301
        self._refused: set[str] = set()  # buckets the fast path cannot reach (left to s3fs)
        self._lock = threading.Lock()

    @property
    def anonymous(self) -> bool:
        return self.credentials is None

    @classmethod
    def for_filesystem(cls, fs: Any) -> S3Settings | None:
        """The settings of s3fs filesystem `fs`, or None where its options ask for what only s3fs does."""
        if type(fs).__name__ != "S3FileSystem" or not _plain_options(fs):
            return None
        if any(os.environ.get(name) for name in _PROXY_VARIABLES):
            return None
        client = fs.s3  # connects: endpoint and region resolved as s3fs resolves them
        config = client.meta.config
        if getattr(config, "proxies", None) or (config.s3 or {}).get("addressing_style") not in (None, "auto", "path"):
            return None
        if any((config.s3 or {}).get(flag) for flag in ("use_accelerate_endpoint", "use_dualstack_endpoint")):
            return None
        from botocore import UNSIGNED

        endpoint = str(client.meta.endpoint_url)
        if "s3-accelerate" in (urlsplit(endpoint).hostname or ""):
            return None  # acceleration serves virtual-host addressing only
        credentials = None
        if getattr(config, "signature_version", None) is not UNSIGNED:
            options = fs.storage_options
            credentials = S3Credentials(fs.key, fs.secret, fs.token, options.get("profile"))
        return cls(endpoint, str(client.meta.region_name or "us-east-1"), credentials)

    def region_of(self, bucket: str) -> str:
        """The region `bucket`'s requests are signed for: learnt from a 301, else the configured one."""
        return self._regions.get(bucket, self.region)

    def learn_region(self, bucket: str, region: str) -> None:
        """Remember that `bucket` lives in `region` (a 301's x-amz-bucket-region; one that is no region is not kept)."""
        if not valid_region(region) or self.region_of(bucket) == region:
            return
        with self._lock:
            self._regions[bucket] = region

    def refuse(self, bucket: str) -> None:
        """Leave `bucket` to s3fs from now on (it redirects or refuses what the fast path sends)."""
        with self._lock:
            self._refused.add(bucket)

    def refused(self, bucket: str) -> bool:
        return bucket in self._refused

    def bucket_url(self, bucket: str) -> str | None:
        """The URL of `bucket` itself (no trailing slash); None where the name does not fit the addressing."""
        if not self.virtual_host:
            return f"{self.endpoint}/{quote(bucket, safe='')}"
        if "." in bucket or bucket.lower() != bucket or not bucket:  # not a DNS label TLS can check
            return None
        return f"{self.scheme}://{bucket}.s3.{self.region_of(bucket)}.amazonaws.com"

    def url(self, bucket: str, key: str) -> str | None:
        """The object's URL (see the module); None if the bucket's name does not fit."""
        base = self.bucket_url(bucket)
        return None if base is None else f"{base}/{quote(key, safe='/~')}"


def _plain_options(fs: Any) -> bool:
    """Whether `fs` was made with only options a transport reproduces (endpoint, region, credentials, pool sizes)."""
    if fs.version_aware or fs.requester_pays or fs.s3_additional_kwargs or fs.req_kw:
        return False
    if set(fs.storage_options) - _SUPPORTED_OPTIONS:
        return False
    if set(fs.client_kwargs) - _SUPPORTED_CLIENT_KWARGS or set(fs.config_kwargs) - _SUPPORTED_CONFIG_KWARGS:
        return False
    return True
