"""Generate a photo-like ImageFolder dataset for demos, tests and benchmarks.

Flat colours decode in a fraction of the time a photograph takes, which would
make every speed figure a lie. These images mix smooth gradients, shapes,
texture and sensor-like noise so that their JPEG entropy (and therefore decode
cost, ~200-350 KB per megapixel at quality 90) is close to real photos.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from .errors import ConfigError

DEFAULT_CLASSES = ("aurora", "canyon", "harbour", "meadow", "orchard", "tundra")


@dataclasses.dataclass(frozen=True)
class DemoDataResult:
    """What `make_demo_dataset` wrote."""

    root: str
    images: int
    classes: tuple[str, ...]
    bytes: int


def make_demo_dataset(
    root: str | os.PathLike[str],
    n: int = 1000,
    *,
    classes: int = 4,
    min_side: int = 800,
    max_side: int = 1600,
    quality: int = 90,
    seed: int = 0,
    workers: int | None = None,
) -> DemoDataResult:
    """Write `n` photo-like JPEGs into `root/<class>/<class>_NNNNNN.jpg`.

    Args:
        root: directory to create (may exist; existing files are overwritten).
        n: number of images.
        classes: number of class folders (at most 6).
        min_side: smallest width/height in pixels.
        max_side: largest width/height in pixels.
        quality: JPEG quality.
        seed: images are a pure function of (seed, index).
        workers: processes (default: available cores).

    Returns:
        A DemoDataResult with the count and total bytes.

    Raises:
        ConfigError: on impossible settings.
    """
    if n < 1:
        raise ConfigError("--n must be at least 1")
    if not 1 <= classes <= len(DEFAULT_CLASSES):
        raise ConfigError(f"--classes must be between 1 and {len(DEFAULT_CLASSES)}")
    if not 16 <= min_side <= max_side:
        raise ConfigError("sizes must satisfy 16 <= min-side <= max-side")
    names = DEFAULT_CLASSES[:classes]
    base = Path(root)
    for name in names:
        (base / name).mkdir(parents=True, exist_ok=True)
    jobs = [(str(base), names, i, min_side, max_side, quality, seed) for i in range(n)]
    workers = workers if workers is not None else len(os.sched_getaffinity(0))
    if workers > 1 and n > 8:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(workers) as pool:
            total = sum(pool.imap_unordered(_write_one, jobs, chunksize=8))
    else:
        total = sum(map(_write_one, jobs))
    return DemoDataResult(str(base), n, names, total)


def _write_one(job: tuple[str, tuple[str, ...], int, int, int, int, int]) -> int:
    from PIL import Image

    root, names, index, min_side, max_side, quality, seed = job
    name = names[index % len(names)]
    pixels = render_photo_like(index, min_side, max_side, seed=seed, tint=index % len(names))
    path = Path(root) / name / f"{name}_{index:06d}.jpg"
    Image.fromarray(pixels).save(path, format="JPEG", quality=quality)
    return path.stat().st_size


def render_photo_like(
    index: int, min_side: int = 800, max_side: int = 1600, *, seed: int = 0, tint: int = 0
) -> np.ndarray:
    """Return an HxWx3 uint8 array that compresses like a photograph.

    Built from C-speed PIL operations (bicubic upscaling of small random
    fields, anti-aliased shapes) so a thousand 1-2 MP images take seconds.
    """
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng([seed, index])
    width = int(rng.integers(min_side, max_side + 1))
    height = int(rng.integers(min_side, max_side + 1))
    # A smooth sky/ground gradient: a 4x4 colour field upscaled bicubically.
    base = rng.uniform(40, 215, (4, 4, 3))
    base[..., tint % 3] += 35
    canvas = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).resize(
        (width, height), Image.Resampling.BICUBIC
    )
    draw = ImageDraw.Draw(canvas, "RGBA")
    for _ in range(int(rng.integers(5, 11))):
        colour = tuple(int(c) for c in rng.integers(10, 245, 3)) + (int(rng.integers(120, 230)),)
        x0, y0 = rng.uniform(-0.1, 0.9) * width, rng.uniform(-0.1, 0.9) * height
        w, h = rng.uniform(0.08, 0.5) * width, rng.uniform(0.08, 0.5) * height
        kind = rng.integers(0, 3)
        if kind == 0:
            draw.ellipse((x0, y0, x0 + w, y0 + h), fill=colour)
        elif kind == 1:
            draw.rectangle((x0, y0, x0 + w, y0 + h), fill=colour)
        else:
            points = [(x0 + rng.uniform(0, w), y0 + rng.uniform(0, h)) for _ in range(5)]
            draw.polygon(points, fill=colour)
    canvas = canvas.filter(ImageFilter.GaussianBlur(1.2))
    image = np.asarray(canvas, dtype=np.int16)
    image = image + _texture(rng, height, width)[..., None]
    image += _grain(rng, height, width)
    return np.clip(image, 0, 255).astype(np.uint8)


def _texture(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    # Value noise at a few octaves, smoothly interpolated: foliage, fabric, rock.
    from PIL import Image

    texture = np.zeros((height, width), np.int16)
    for cells, amplitude in ((8, 18), (40, 12), (160, 8)):
        field = rng.integers(0, 256, (cells, cells), dtype=np.uint8)
        up = Image.fromarray(field).resize((width, height), Image.Resampling.BICUBIC)
        texture += (np.asarray(up, dtype=np.int16) - 128) * amplitude // 128
    return texture


_GRAIN_BANK: dict[int, np.ndarray] = {}


def _grain(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    # Sensor noise: a random window into a per-process bank of Gaussian noise,
    # so each image gets different grain without drawing millions of normals.
    bank = _GRAIN_BANK.get(0)
    if bank is None:
        bank = np.random.default_rng(1234).normal(0, 4.0, (2048, 2048, 3)).astype(np.int16)
        _GRAIN_BANK[0] = bank
    if height > bank.shape[0] or width > bank.shape[1]:
        reps = (-(-height // bank.shape[0]), -(-width // bank.shape[1]), 1)
        return np.tile(bank, reps)[:height, :width]
    y = int(rng.integers(0, bank.shape[0] - height + 1))
    x = int(rng.integers(0, bank.shape[1] - width + 1))
    return bank[y : y + height, x : x + width]
