"""Pictures with sharp step edges, and where a resampled picture puts those edges.

`step_picture` paints a bright grey rectangle on a dark, flat surround (its
"halo"), with a smooth coloured texture further out: the rectangle's edges
lie on whole pixels of the picture, so they are exactly its box. After any
crop, resize, pad or flip, `edge_errors` finds each edge of the rectangle
in the resampled pixels as the 50 % crossing between the levels on either
side (the step blurred by any symmetric filter crosses half-way exactly at
the edge; sampling it and interpolating linearly between pixel centres
leaves an error of a few hundredths of a pixel, the measurement's floor)
and says how far it lies from where the box says the edge is. A box half a
pixel off its pixels shows as half a pixel here.
"""

from __future__ import annotations

import math

import numpy as np

DARK, BRIGHT = 40.0, 215.0  # the surround and the rectangle, grey (no chroma for JPEG's subsampling to blur)


def step_picture(width: int, height: int, rect: tuple[int, int, int, int], seed: int) -> np.ndarray:
    """(height, width, 3) uint8: a BRIGHT rectangle `rect` (x0, y0, x1, y1, whole pixels) on DARK, texture beyond.

    The surround stays flat DARK for `halo(width, height)` pixels around the
    rectangle, then blends over 4 pixels into a smooth texture (periods of
    1/20 to 1/5 of the longer side, each channel its own: several output
    pixels at the zooms the tests use, so that filters which would alias
    finer detail differently still agree) that gives the pixel comparisons
    something besides the step to agree on.
    """
    rng = np.random.default_rng(seed)
    x0, y0, x1, y1 = rect
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64)
    texture = np.zeros((height, width, 3))
    for channel in range(3):
        for _ in range(3):
            period = rng.uniform(0.05, 0.2) * max(width, height)
            angle = rng.uniform(0.0, math.pi)
            phase = rng.uniform(0.0, 2 * math.pi)
            along = xs * math.cos(angle) + ys * math.sin(angle)
            texture[:, :, channel] += 22 * np.sin(2 * math.pi * along / period + phase)
    texture += 100 + rng.uniform(-20, 20, 3)
    gap = np.maximum(np.maximum(x0 - (xs + 0.5), (xs + 0.5) - x1), np.maximum(y0 - (ys + 0.5), (ys + 0.5) - y1))
    blend = np.clip((gap - halo(width, height)) / 4.0, 0.0, 1.0)[:, :, None]
    pixels = DARK * (1 - blend) + texture * blend
    pixels[y0:y1, x0:x1] = BRIGHT
    return np.clip(np.round(pixels), 0, 255).astype(np.uint8)


def halo(width: int, height: int) -> int:
    """The flat surround's width in pixels (`edge_errors` reads the levels outside an edge within it)."""
    return max(20, math.ceil(0.12 * max(width, height)))


def edge_errors(
    pixels: np.ndarray,
    box: tuple[float, float, float, float],
    region: tuple[int, int, int, int],
    zoom: float,
    flat: float,
) -> dict[str, float]:
    """Measured minus boxed position of each edge of the rectangle that the picture shows whole.

    Args:
        pixels: the resampled picture, (H, W, 3) or (3, H, W) uint8.
        box: where the rectangle's box says it is, XYXY in these pixels.
        region: the part (XYXY) holding the picture's pixels (the rest is padding).
        zoom: output pixels per source pixel (the blur's width follows it).
        flat: the width of the flat surround in these pixels (`halo` times
            the zoom): the levels outside are read within it, or not at all.

    Returns:
        {"x0", "y0", "x1", "y1"} -> signed error in pixels, for each edge
        with the levels either side in the picture (an edge cut by the crop,
        or too near another edge or the padding, is left out).
    """
    grey = np.asarray(pixels, np.float64)
    grey = grey.mean(axis=0) if grey.shape[0] == 3 and grey.shape[2] != 3 else grey.mean(axis=2)
    reach = math.ceil(1.5 * max(1.0, zoom)) + 1  # the blurred step's half-width, and a pixel
    found: dict[str, float] = {}
    if reach + 5 > flat:
        return found  # the texture reaches the levels outside: nothing to measure at this zoom
    x0, y0, x1, y1 = box
    for axis, (low, high), (across_low, across_high) in ((1, (x0, x1), (y0, y1)), (0, (y0, y1), (x0, x1))):
        # the profile across the edges: the mean of the lines well inside the rectangle's other extent
        first, last = math.ceil(across_low) + reach, math.floor(across_high) - reach
        if last - first < 2:
            continue
        profile = grey[first:last, :].mean(axis=0) if axis == 1 else grey[:, first:last].mean(axis=1)
        start, stop = (region[0], region[2]) if axis == 1 else (region[1], region[3])
        for name, edge, outward in ((("x0", "y0")[1 - axis], low, -1), (("x1", "y1")[1 - axis], high, 1)):
            measured = _crossing(profile, edge, outward, reach, (low, high), (start, stop))
            if measured is not None:
                found[name] = measured - edge
    return found


def _crossing(
    profile: np.ndarray, edge: float, outward: int, reach: int, extent: tuple[float, float], span: tuple[int, int]
) -> float | None:
    """Where `profile` crosses half-way between its levels outside and inside the edge near `edge`."""
    centre = math.floor(edge)
    outside = [centre + outward * k for k in range(reach + 1, reach + 4)]
    inside = [centre - outward * k for k in range(reach + 1, reach + 4)]
    low, high = extent
    if min(outside + inside) < span[0] or max(outside + inside) >= span[1]:
        return None  # the padding or the picture's border is too near
    if min(inside) < math.ceil(low) + reach or max(inside) >= math.floor(high) - reach:
        return None  # the other edge's blur is too near
    dark, bright = float(np.median(profile[outside])), float(np.median(profile[inside]))
    if bright - dark < 0.5 * (BRIGHT - DARK):
        return None
    half = (dark + bright) / 2
    best = None
    for k in range(centre - reach, centre + reach):
        a, b = profile[k] - half, profile[k + 1] - half
        if a == b or a * b > 0:
            continue
        at = k + 0.5 + a / (a - b)  # pixel k's centre is k + 0.5
        if best is None or abs(at - edge) < abs(best - edge):
            best = at
    return best


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 pictures, in dB (inf where equal)."""
    error = np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
    return math.inf if error == 0 else 10 * math.log10(255.0**2 / error)
