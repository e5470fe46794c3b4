"""Secrets out of text, and found in settings: every credential shape gpufeed knows.

`redact_url` / `redact_urls` show a URL's user information, signed-query values and the
known credential formats in text as ``***``: used wherever a URL or a message may be shown,
logged or recorded, and by every `GpufeedError`'s message. `find_credentials` names the
fields of a JSON-like value that hold a credential (a name that says so, or a value of a
known format), so that a job that holds one is refused before anything records it. It
imports nothing of gpufeed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any
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


# The scheme's length is bounded, so a long run of letters without "://" costs the scan no more than a short one.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s'\"<>]*[^\s'\"<>),;:.]")


def redact_urls(text: str) -> str:
    """`text` (an error message, a log line) with every URL in it passed through `redact_url`,
    and every other known credential format in it (`redact_credentials`) shown as ``***``."""
    return redact_credentials(_URL_IN_TEXT.sub(lambda found: redact_url(found.group(0)), text))


# Credential formats found in values and text: (what it is, the pattern, how a match is shown). Each pattern
# starts only where a run of its characters starts (or at a fixed word), so a scan stays linear in the text.
_TOKEN = r"[A-Za-z0-9._~+/-]{16,}=*"
_FORMATS: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("a private key", re.compile(r"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----[A-Za-z0-9+/=\s:,.\\]*(?:-----END [A-Z0-9 ]{0,60}-----)?"), "***"),
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|ABIA|ACCA)[A-Z0-9]{16}\b"), "***"),
    ("an Azure connection string", re.compile(r"(?i)\b(DefaultEndpointsProtocol|AccountKey|SharedAccessKey|SharedAccessSignature)(=)[^;\s'\"]*"), r"\1\2***"),
    ("a shared access signature", re.compile(r"(?i)(^|[?&;\s])(sig|x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|x-goog-credential)(=)[^&;\s'\"]+"), r"\1\2\3***"),
    ("an authorization header", re.compile(rf"(?i)\b(bearer|basic|digest)(\s+)(?!/){_TOKEN}"), r"\1\2***"),
    ("an authorization header", re.compile(r"(?i)^\s*(bearer|basic|digest)(\s+)\S+"), r"\1\2***"),
    ("a GitHub token", re.compile(r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{20,})"), "***"),
    ("a Slack token", re.compile(r"(?<![A-Za-z0-9-])xox[abposr]-[A-Za-z0-9-]{10,}"), "***"),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}"), "***"),
    ("a JSON web token", re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), "***"),
)
# NAME=VALUE, or "NAME": "VALUE" (JSON, a dict's repr), in text: a credential where NAME is a credential's.
_NAME_VALUE = re.compile(r"(?<![\w-])([\w-]{1,128})([\"']?\s*=\s*[\"']?|[\"']\s*:\s*[\"'])(?!\*\*\*)[^\s&;,'\"}]+")
_CREDENTIAL_NAME = re.compile(
    r"(?i)secret|passw(?:or)?d|passphrase|(?:access|account|api|private)[_-]?key|(?:session|security|auth|access|refresh|id)[_-]?token"
)


def _named_credential(found: re.Match[str]) -> str:
    name, separator = found.group(1), found.group(2)
    return f"{name}{separator}***" if _CREDENTIAL_NAME.search(name) else found.group(0)


def credential_in(text: str) -> str | None:
    """What known credential format `text` holds (e.g. ``"an AWS access key id"``), or None.

    Besides those of `_FORMATS`, a URL with user information (``NAME:PASSWORD@``) or a
    signed-query parameter counts.
    """
    for what, pattern, _ in _FORMATS:
        if pattern.search(text):
            return what
    if any(_CREDENTIAL_NAME.search(found.group(1)) for found in _NAME_VALUE.finditer(text)):
        return "a credential"
    for found in _URL_IN_TEXT.finditer(text):
        if redact_url(found.group(0)) != found.group(0):
            return "a URL with user information or a signed query"
    return None


def redact_credentials(text: str) -> str:
    """`text` with every known credential format in it, and the value of each NAME=VALUE whose NAME is a
    credential's (``aws_secret_access_key=…``), shown as ``***`` (URLs: `redact_urls`)."""
    for _, pattern, shown in _FORMATS:
        text = pattern.sub(shown, text)
    return _NAME_VALUE.sub(_named_credential, text)


def redact_value(value: Any) -> Any:
    """A copy of a JSON-like `value` with every string in it (keys too) passed through `redact_urls`."""
    if isinstance(value, str):
        return redact_urls(value)
    if isinstance(value, Mapping):
        return {redact_urls(str(key)): redact_value(inner) for key, inner in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_value(inner) for inner in value]
    return value


# Option names that hold credentials: these words anywhere in the name ...
_SECRET_PARTS = (
    "secret", "password", "passwd", "passphrase", "token", "credential", "authoriz", "private", "cookie", "connection_string",
    "connectionstring", "conn_str",
)  # fmt: skip
# ... these as whole words of it (access_key, AccountKey, x-api-key: split at _, -, . and camelCase) ...
_SECRET_WORDS = frozenset({"key", "apikey", "sig", "sas", "signature", "session", "auth", "pwd", "pass"})
# ... except these, which name settings, not secrets (what they hold is checked all the same).
_NOT_SECRET_NAMES = frozenset({"signature_version", "session_kwargs"})


def _words(name: str) -> list[str]:
    spaced = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1 \2", re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name))
    return [word for word in re.split(r"[^a-z0-9]+", spaced.lower()) if word]


def is_secret_name(name: str) -> bool:
    """Whether a setting named `name` holds a credential: ``secret``, ``password``, ``token``,
    ``key``, ``access_key``, ``AccountKey``, ``Authorization``, ``sas_token``, ``sig`` …; not
    ``endpoint_url``, ``region_name``, ``anon``, ``profile``, ``SSEKMSKeyId``."""
    name = name[:256]  # no setting's name is longer; the scan of a longer one stays short
    lowered = name.lower()
    if lowered in _NOT_SECRET_NAMES:
        return False
    words = _words(name)
    if any(part in lowered for part in _SECRET_PARTS) or _SECRET_WORDS.intersection(words):
        return words[-1:] != ["id"] or "secret" in lowered or "access" in words
    return bool(words) and words[-1].endswith("key")


MAX_DEPTH = 32  # nesting a setting may have: deeper is refused, never walked


def find_credentials(
    value: Any, where: str, extra: Callable[[str], str | None] | None = None
) -> Iterator[tuple[str, str]]:
    """The fields of a JSON-like `value` that hold a credential: (field path, what it holds).

    A field holds one when its name says so (`is_secret_name`), at any depth, or when a
    string in it (or a key) has a known credential format (`credential_in`, and `extra`'s,
    when given). The paths name the fields, never the values: ``storage_options.headers.Authorization``,
    ``storage_options.client_kwargs.endpoints[1]``.

    Args:
        value: dicts, lists and scalars, as a job's JSON holds them.
        where: the path of `value` itself, e.g. ``storage_options``.
        extra: a further check of each string: what credential it holds, or None.

    Raises:
        ValueError: the value is nested deeper than `MAX_DEPTH` (its message names the path).
    """
    pending: list[tuple[str, Any, int]] = [(where, value, 0)]
    while pending:
        path, item, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"{path} is nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, str):
            what = credential_in(item) or (extra(item) if extra is not None else None)
            if what is not None:
                yield path, what
        elif isinstance(item, Mapping):
            for key, inner in item.items():
                name = str(key)
                if credential_in(name):
                    yield f"{path}.<a name that is itself a credential>", "a credential"
                    continue
                shown = f"{path}.{name[:64]}" if path else name[:64]
                if is_secret_name(name) and inner not in (None, "", False):
                    yield shown, "a credential (its name says so)"
                else:
                    pending.append((shown, inner, depth + 1))
        elif isinstance(item, (list, tuple)):
            pending.extend((f"{path}[{index}]", inner, depth + 1) for index, inner in enumerate(item))
