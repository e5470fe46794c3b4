"""colour.c's HSV gains: the AVX2 and AVX-512 loops (8 or 16 pixels at once, tables computed) equal the scalar loop.

Every one of the 2^24 RGB colours, under gains that shift the hue both
ways, saturate and desaturate, brighten past 255 and darken, must come out
of both loops the same, bit for bit (the scalar loop is the one the tests
against ultralytics' RandomHSV hold to its arithmetic). The AVX2 loop
computes a value table in integers where that gives the table, else in
doubles (-0.32: the integers miss an entry), and a hue table that is no
shift (a gain a hair below 0 puts 180 in it) sends the image to the scalar
loop; an image whose pixel count is not a multiple of eight ends in the
scalar loop, as the same.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline import native
from pipeline.augment.hsv import hsv_in_place

GAINS = [(0.01, 0.5, -0.3), (-0.015, -0.7, 0.4), (0.0, 0.0, 0.0), (0.5, 1.0, 1.0), (-0.2, -1.0, -1.0),
         (0.0, 0.442, -0.32), (-1e-18, 0.5, 0.5)]  # fmt: skip


@pytest.fixture(scope="module")
def every_colour() -> np.ndarray:
    colours = np.arange(1 << 24, dtype=np.uint32)
    return np.stack([(colours >> 16) & 255, (colours >> 8) & 255, colours & 255]).astype(np.uint8).reshape(3, 4096, 4096)


@pytest.mark.skipif(native.library() is None, reason="the native library cannot be built here")
@pytest.mark.parametrize("gains", GAINS, ids=str)
def test_the_simd_loops_equal_the_scalar_loop_on_every_colour(every_colour: np.ndarray, gains: tuple) -> None:
    scalar = every_colour.copy()
    hsv_in_place(scalar, gains, simd=False)
    for level in (1, 2):  # AVX2; the widest the CPU has (AVX-512 where it is there)
        fast = every_colour.copy()
        hsv_in_place(fast, gains, simd=level)
        assert np.array_equal(fast, scalar), (level, int((fast != scalar).sum()))
    assert not np.array_equal(scalar, every_colour) or gains == (0.0, 0.0, 0.0)


@pytest.mark.skipif(native.library() is None, reason="the native library cannot be built here")
def test_an_odd_sized_image_ends_in_the_scalar_loop_alike() -> None:
    image = np.random.default_rng(1).integers(0, 256, (3, 37, 29), dtype=np.uint8)  # 1073 = 67 x 16 + 8 + 1
    fast, scalar = image.copy(), image.copy()
    hsv_in_place(fast, GAINS[0])
    hsv_in_place(scalar, GAINS[0], simd=False)
    assert np.array_equal(fast, scalar)
