"""Secrets out of text: a URL's user information and signed-query values shown as ``***``.

Used wherever a URL may be shown, logged or recorded, and by every
`GpufeedError`'s message. It imports nothing of gpufeed.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit, urlunsplit

# Query parameters of signed URLs (S3 and GCS presigned URLs, Azure SAS, CloudFront …) whose value is a secret.
_SECRET_QUERY = re.compile(r"secret|token|passw|credential|signature|^sig$|^sas|key|auth|policy|session|^x-amz-|^x-goog-", re.I)


def redact_url(url: str) -> str:
    """`url` with its user information and the values of signed-query parameters replaced by ``***``.

    Fit for messages, logs, job records and reports.

    Args:
        url: any URL, e.g. ``redis://:secret@host:6379/0`` or
            ``https://host/key?X-Amz-Credential=…&X-Amz-Signature=…``.

    Returns:
        The same URL with ``***`` for the user name and the password
        (``redis://:***@host:6379/0``, ``http://***:***@host/``) and for the value
        of each query parameter whose name marks a credential or a signature
        (``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``, ``sig``,
        ``token`` …); the host as written, port, path and other parameters
        (``?ssl=1``) are kept. A URL without either comes back unchanged, one
        that cannot be parsed as ``<unparseable URL>``.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    userinfo, at, host = parts.netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        parts = parts._replace(netloc=f"{'***' if user else ''}{colon}{'***' if colon else ''}@{host}")
    if parts.query:
        pairs = [pair.partition("=") for pair in parts.query.split("&")]
        parts = parts._replace(
            query="&".join(name + equals + ("***" if value and _SECRET_QUERY.search(unquote(name)) else value) for name, equals, value in pairs)
        )
    return urlunsplit(parts) if (at or parts.query) else url


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]*[^\s'\"<>),;:.]")


def redact_urls(text: str) -> str:
    """`text` (an error message, a log line) with every URL in it passed through `redact_url`."""
    return _URL_IN_TEXT.sub(lambda found: redact_url(found.group(0)), text)
