"""A YOLO-seg source folder of red shapes on a plain or graded ground, prepared for the recipe's loader tests.

`write_source` draws `count` pictures of random size, each with the shapes
`outlines` gives (one label each, in order), and writes their YOLO-seg
labels (normalised outlines), or only the boxes around them, and a
data.yaml; `prepared` prepares such a folder with the longer side at
`size`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from pipeline import PrepareSpec, ResizeSpec, prepare_dataset

RED = (230, 20, 20)
Outlines = Callable[[np.random.Generator, int, int], list[np.ndarray]]
"""(rng, width, height) -> the picture's shapes, (P, 2) pixels each; shape k has label k."""


def grey(width: int, height: int) -> Image.Image:
    return Image.new("RGB", (width, height), (128, 128, 128))


def graded(width: int, height: int) -> Image.Image:
    """A smooth ground that differs everywhere (a misplaced pixel shows)."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 100 / (width + height) + 60], axis=2)
    return Image.fromarray(base.clip(0, 255).astype(np.uint8))


def write_source(root: Path, outlines: Outlines, *, count: int, seed: int, names: tuple[str, str],
                 sides: tuple[int, int] = (160, 320), ground: Callable[[int, int], Image.Image] = grey,
                 suffix: str = "png", boxes_only: bool = False) -> Path:  # fmt: skip
    """The folder `root` (images/, labels/, data.yaml) of `count` pictures; returns it."""
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    rng = np.random.default_rng(seed)
    for number in range(count):
        width, height = int(rng.integers(*sides)), int(rng.integers(*sides))
        picture = ground(width, height)
        lines = []
        for label, points in enumerate(outlines(rng, width, height)):
            ImageDraw.Draw(picture).polygon([tuple(p) for p in points], fill=RED)
            if boxes_only:
                (x0, y0), (x1, y1) = points.min(0), points.max(0)
                cx, cy, w, h = (x0 + x1) / 2 / width, (y0 + y1) / 2 / height, (x1 - x0) / width, (y1 - y0) / height
                lines.append(f"{label} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}")
            else:
                lines.append(f"{label} " + " ".join(f"{x / width:.6f} {y / height:.6f}" for x, y in points))
        picture.save(root / "images" / f"{number:03d}.{suffix}", **({"quality": 92} if suffix == "jpg" else {}))
        (root / "labels" / f"{number:03d}.txt").write_text("\n".join(lines) + "\n")
    (root / "data.yaml").write_text(f"names: [{names[0]}, {names[1]}]\n")
    return root


def prepared(source: Path, out: Path, size: int) -> Path:
    """`source` prepared into `out`, the longer side at `size`; returns `out`."""
    prepare_dataset(PrepareSpec(str(source), str(out), resize=ResizeSpec(size=size, mode="longer")), workers=0)
    return out
