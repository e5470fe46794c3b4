"""A plan's masks: each source's mask sampled nearest through its tile's whole matrix, one output pixel at a time.

The reference walks every output pixel: its centre through the warp's
inverse onto the canvas, kept where it lies in a tile's window, then
through that tile's inverse into the source, floored. `render_mask` (rows
and columns apart where the matrix is a scale and a shift, a grid of
centres otherwise) must give the same mask, and `instance_masks` each kept
box its own pixels, for mosaics with and without rotation, shear,
perspective and flips.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pipeline.augment.affine import RandomAffine
from pipeline.augment.masks import instance_masks, render_mask
from pipeline.augment.mosaic import Mosaic
from pipeline.augment.yolo import Plan, YoloRecipe, plan

SIZE = 64
RECIPES = {
    "defaults": YoloRecipe(size=SIZE, hsv=None, flipud=0.5),
    "warped": YoloRecipe(size=SIZE, hsv=None, flipud=0.5,
                         affine=RandomAffine(degrees=30, translate=0.1, scale=0.5, shear=8, perspective=0.0005)),
    "no_mosaic": YoloRecipe(size=SIZE, hsv=None, mosaic=None),
    "nine": YoloRecipe(size=SIZE, hsv=None, mosaic=Mosaic(n=9)),
}  # fmt: skip


def reference(made: Plan, maps: list[np.ndarray], fill: int) -> np.ndarray:
    out = np.full((SIZE, SIZE), fill, np.int64)
    inverse = np.linalg.inv(made.warp)
    for v in range(SIZE):
        for u in range(SIZE):
            x, y, w = inverse @ (u + 0.5, v + 0.5, 1.0)
            x, y = x / w, y / w
            for tile, picture in zip(made.tiles, maps):
                x0, y0, x1, y1 = tile.window
                if x0 <= x < x1 and y0 <= y < y1:
                    sx, sy, _ = np.linalg.inv(tile.matrix) @ (x, y, 1.0)
                    row = min(max(int(np.floor(sy)), 0), picture.shape[0] - 1)
                    col = min(max(int(np.floor(sx)), 0), picture.shape[1] - 1)
                    out[v, u] = picture[row, col]
                    break
    return out


def sources(rng: np.random.Generator, count: int) -> tuple[list[tuple[int, int]], list[np.ndarray], list[np.ndarray]]:
    """Pictures' sizes, their boxes, and instance maps where box n is the rectangle it names (value n + 1)."""
    sizes, boxes, maps = [], [], []
    for _ in range(count):
        width, height = int(rng.integers(20, 90)), int(rng.integers(20, 90))
        found = np.zeros((height, width), np.uint8)
        own = []
        for n in range(int(rng.integers(0, 4))):
            x0, y0 = int(rng.integers(0, width - 6)), int(rng.integers(0, height - 6))
            x1, y1 = int(rng.integers(x0 + 4, width + 1)), int(rng.integers(y0 + 4, height + 1))
            found[y0:y1, x0:x1] = n + 1  # later boxes cover earlier ones where they overlap
            own.append([x0, y0, x1, y1])
        sizes.append((width, height))
        boxes.append(np.array(own, np.float64).reshape(-1, 4))
        maps.append(found)
    return sizes, boxes, maps


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_masks_are_sampled_nearest_through_each_tiles_matrix(name: str) -> None:
    recipe = RECIPES[name]
    rng = np.random.default_rng(sorted(RECIPES).index(name))
    for seed in range(6):
        sizes, boxes, _ = sources(rng, recipe.sources)
        coded = [(np.arange(w * h, dtype=np.int64).reshape(h, w) * 16 + k) for k, (w, h) in enumerate(sizes)]
        made = plan(recipe, random.Random(seed), sizes, boxes, [np.zeros(len(b), np.int64) for b in boxes])
        fill = -1
        got = render_mask(made, [c.astype(np.int64) for c in coded], fill)
        assert np.array_equal(got, reference(made, coded, fill)), (name, seed)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_kept_box_gets_its_own_pixels(name: str) -> None:
    recipe = RECIPES[name]
    rng = np.random.default_rng(10 + sorted(RECIPES).index(name))
    checked = 0
    for seed in range(8):
        sizes, boxes, maps = sources(rng, recipe.sources)
        made = plan(recipe, random.Random(seed), sizes, boxes, [np.arange(len(b), dtype=np.int64) for b in boxes])
        shown = len(made.tiles)
        masks = instance_masks(made, maps[:shown], [len(b) for b in boxes[:shown]])
        assert masks.shape == (len(made.boxes), SIZE, SIZE) and masks.dtype == np.uint8
        placed = [reference(made, [(m == n + 1) * (t + 1) if t == tile else np.zeros_like(m) for t, m in enumerate(maps)], 0)
                  for tile, n in zip(made.source_of, made.box_index)]  # fmt: skip
        for k, (mask, expected) in enumerate(zip(masks, placed)):
            assert np.array_equal(mask.astype(bool), expected > 0), (name, seed, k)
            checked += int(mask.any())
        assert (masks.sum(axis=0) <= 1).all()  # an output pixel belongs to one box at most
    assert checked >= 4


def test_a_source_without_a_mask_gives_the_fill_where_it_shows() -> None:
    recipe = RECIPES["defaults"]
    sizes, boxes, maps = sources(np.random.default_rng(3), 4)
    for seed in range(20):  # a plan whose first source shows
        made = plan(recipe, random.Random(seed), sizes, boxes, [np.zeros(len(b), np.int64) for b in boxes])
        first = reference(made, [np.ones_like(maps[0]), *(np.zeros_like(m) for m in maps[1:])], 0) == 1
        if first.sum() > 100:
            break
    ones = [np.ones_like(m) for m in maps]
    whole = render_mask(made, ones, 255)
    missing = render_mask(made, [None, *ones[1:]], 255)
    assert first.sum() > 100
    assert (missing[first] == 255).all() and (whole[first] == 1).all()
    assert np.array_equal(missing[~first], whole[~first])
