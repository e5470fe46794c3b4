"""AWS Signature Version 4 for the S3 client (`request.py` builds them): one signer for every request it sends."""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
from typing import Any
from urllib.parse import quote

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # the payload hash of a request without a body


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


@functools.lru_cache(maxsize=16)
def _signing_key(secret: str, day: str, region: str) -> bytes:
    key = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key
