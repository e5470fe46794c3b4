"""Sizes, durations and rates: one parser and one formatter for each, shared by every stage.

Sizes are bytes (`256MB` = 256 * 10**6, `1.5GiB` = 1.5 * 2**30), durations seconds
(`90`, `90s`, `10m`, `6h`, `7d`).
"""

from __future__ import annotations

import re

from .errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*((?:[kmgt]i?)?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(text: str | int) -> int:
    """Parse `256MB`, `1.5GiB`, `64k` or a plain integer into bytes.

    Raises:
        ConfigError: when the text is not a size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"a size cannot be negative: {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(f"not a size: {text!r} (try 256MB, 1GiB or a number of bytes)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    binary = "i" in unit
    letter = unit[:1] if unit[:1] in "kmgt" else ""
    factor = 1024 ** ("kmgt".index(letter) + 1) if binary and letter else _UNITS[letter]
    return int(number * factor)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d)?\s*$", re.IGNORECASE)
_UNIT_SECONDS = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, name: str = "duration") -> float:
    """Seconds in `90`, `90s`, `10m`, `6h` or `7d`.

    Raises:
        ConfigError: when the text is not a positive duration.
    """
    match = _DURATION.match(str(text))
    if not match:
        raise ConfigError(f"{name}: not a duration: {text!r} (try 90s, 10m, 6h or 7d)")
    seconds = float(match.group(1)) * _UNIT_SECONDS[(match.group(2) or "").lower() or None]
    if seconds <= 0:
        raise ConfigError(f"{name} must be more than zero, got {text!r}")
    return seconds
