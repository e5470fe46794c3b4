"""Sizes, durations and rates: each parser reads what its formatter prints."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.errors import ConfigError
from pipeline.units import format_bytes, format_duration, format_rate, parse_bytes, parse_duration, parse_rate

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 B"),
        (100, "100 B"),
        (1023, "1023 B"),
        (KiB, "1 KiB"),
        (512 * KiB, "512 KiB"),
        (1536 * KiB, "1.5 MiB"),
        (64 * MiB, "64 MiB"),
        (1000 * MiB, "1000 MiB"),
        (1.234 * GiB, "1.23 GiB"),
        (1.5 * GiB, "1.5 GiB"),
        (80e9, "74.51 GiB"),
        (3 * TiB, "3 TiB"),
        (-2 * MiB, "-2 MiB"),
        (None, "n/a"),
    ],
)
def test_format_bytes(size, text):
    assert format_bytes(size) == text


@pytest.mark.parametrize(
    ("size", "text"),
    [(16 * MiB, "16MiB"), (256 * MiB, "256MiB"), (GiB, "1GiB"), (4 * KiB, "4KiB"), (2 * TiB, "2TiB"), (1234, "1234"),
     (MiB + 1, "1048577"), (0, "0")],
)
def test_format_bytes_exact_is_a_command_line_size(size, text):
    assert format_bytes(size, exact=True) == text
    assert parse_bytes(text) == size


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**50))
def test_exact_sizes_read_back_exactly(size):
    assert parse_bytes(format_bytes(size, exact=True)) == size


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**50))
@example(1070)  # "1.04 KiB": 1064.96 bytes, read back to the nearest byte, not truncated to 1064
def test_sizes_read_back_within_the_printed_precision(size):
    back = parse_bytes(format_bytes(size))
    assert math.isclose(back, size, rel_tol=0.005, abs_tol=1)


@pytest.mark.parametrize(("seconds", "text"), [(0.04, "0.0 s"), (0.4, "0.4 s"), (12.345, "12.3 s"), (754.25, "754.2 s"), (None, "n/a")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@settings(max_examples=200, deadline=None)
@given(st.floats(0.05, 10**7))
def test_durations_read_back_within_a_tenth_of_a_second(seconds):
    assert abs(parse_duration(format_duration(seconds)) - seconds) <= 0.05 + 1e-9 * seconds


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("312T", 312e12),
        ("19.5 TFLOPS", 19.5e12),
        ("19.5TFLOPS", 19.5e12),
        ("2.5e13", 2.5e13),
        ("1G", 1e9),
        ("1g", 1e9),
        (" 3 gflop/s ", 3e9),
        ("5 flops", 5.0),
        ("1.2k/s", 1200.0),
        (".5T", 0.5e12),
        ("2P", 2e15),
        ("7M", 7e6),
        ("7m", 7e6),  # rates have no milli: m is mega, as in the earlier --device-flops parser
    ],
)
def test_parse_rate(text, rate):
    assert parse_rate(text) == pytest.approx(rate)


@pytest.mark.parametrize("text", ["lots", "", "1.2.3", "T", "-5T", "0", "0T", "5 X", "5 images"])
def test_parse_rate_refuses_what_is_not_a_positive_rate(text):
    with pytest.raises(ConfigError, match="--device-flops"):
        parse_rate(text, "--device-flops")


def test_parse_rate_says_what_a_rate_looks_like():
    with pytest.raises(ConfigError, match=r"not a rate: 'lots' \(try 312T"):
        parse_rate("lots")


@pytest.mark.parametrize(
    ("args", "text"),
    [((1234.4,), "1234 images/s"), ((26.2, "MB/s"), "26 MB/s"), ((312.0, "TFLOP/s", 2), "312.00 TFLOP/s"), ((None,), "n/a")],
)
def test_format_rate(args, text):
    assert format_rate(*args) == text


def test_a_formatted_flop_rate_reads_back():
    assert parse_rate(format_rate(19.5, "TFLOP/s", 1)) == pytest.approx(19.5e12)
