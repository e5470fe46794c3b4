"""Sizes, durations and rates (one parser and one formatter for each) and counts, shared by every stage.

Sizes are bytes (`256MB` = 256 * 10**6, `1.5GiB` = 1.5 * 2**30), durations seconds
(`90`, `90s`, `10m`, `6h`, `7d`), rates per second with an SI prefix (`312T`,
`19.5 TFLOPS`, `2.5e13`). What `format_bytes` and `format_duration` print, `parse_bytes`
and `parse_duration` read back.
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
    return int(round(number * factor))  # to the nearest byte: "1.04 KiB" is 1064.96 bytes


_BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(size: float | None, *, exact: bool = False) -> str:
    """A size for people: `1.5 GiB`, `64 MiB`, `512 KiB`, `100 B` (binary units, two decimals at most).

    Args:
        size: bytes; None prints `n/a` (a figure that was not measured).
        exact: print what `parse_bytes` reads back to the same whole number of
            bytes, for a command line: `64MiB` when a binary unit divides the
            size, else the plain number.
    """
    if size is None:
        return "n/a"
    if exact:
        whole = int(size)
        for unit, scale in _BINARY_UNITS:
            if whole and whole % scale == 0:
                return f"{whole // scale}{unit}"
        return str(whole)
    for unit, scale in _BINARY_UNITS:
        if abs(size) >= scale:
            return f"{size / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{size:.0f} B"


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


def format_duration(seconds: float | None) -> str:
    """A duration for people: `12.3 s` (what `parse_duration` reads back); None prints `n/a`."""
    return "n/a" if seconds is None else f"{seconds:.1f} s"


_RATE = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([kmgtp]?)\s*(?:flop/?s|flops|/s)?\s*$", re.IGNORECASE)
_SI_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def parse_rate(text: str, name: str = "rate") -> float:
    """Per-second rates: `312T`, `19.5 TFLOPS`, `1.2k/s`, `2.5e13` (prefixes k, M, G, T, P; `m` is mega).

    Raises:
        ConfigError: when the text is not a positive rate.
    """
    match = _RATE.match(str(text))
    if not match:
        raise ConfigError(f"{name}: not a rate: {text!r} (try 312T, 19.5TFLOPS or 2.5e13)")
    rate = float(match.group(1)) * _SI_PREFIX[match.group(2).lower()]
    if rate <= 0:
        raise ConfigError(f"{name} must be more than zero, got {text!r}")
    return rate


def format_rate(value: float | None, unit: str = "images/s", digits: int = 0) -> str:
    """A rate for people: `1234 images/s`, `26 MB/s`, `312.00 TFLOP/s`; None prints `n/a`.

    Args:
        value: the rate, in `unit`.
        unit: what is counted per second, as printed after the number.
        digits: decimals shown.
    """
    return "n/a" if value is None else f"{value:.{digits}f} {unit}"


def format_count(count: int, noun: str, plural: str | None = None) -> str:
    """`1 image`, `2 images`, `1 worker process`: a count with its noun in the right number.

    Args:
        count: how many.
        noun: the singular (`"image"`).
        plural: the plural when it is not the singular plus `s` (`"worker processes"`).
    """
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def wait_share(wait_s: float, step_s: float) -> float:
    """The stall fraction: the share of a loop's time spent waiting for data (0 when no time passed)."""
    total = wait_s + step_s
    return wait_s / total if total > 0 else 0.0
