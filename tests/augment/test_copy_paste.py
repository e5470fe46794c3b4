"""Ultralytics' CopyPaste (mode "flip") in the YOLO plan: the scanline fill, the choice of copies, their pixels.

The fill is checked against a direct even-odd test of every pixel's
centre; the choice against ultralytics' rule written out (a mirrored box
covers under 30 % of every box, the least covering first); the pixels on a
picture whose object is not symmetric (a red square, its left half blue):
its copy shows it mirrored, through `render` and `render_jpegs` alike.
`copy_paste=0`, and copy-paste without polygons, change nothing: the
same plan, the same pixels.
"""

from __future__ import annotations

import dataclasses
import io
import random

import numpy as np
import pytest
from PIL import Image

from pipeline.augment.affine import RandomAffine
from pipeline.augment.copy_paste import IOA_THR, choose, mirrored_boxes
from pipeline.augment.render import render, render_jpegs
from pipeline.augment.warp import ioa
from pipeline.augment.yolo import YoloRecipe, plan
from pipeline.polygons import fill_polygons


def inside_even_odd(points: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Whether each (x, y) lies inside the polygon by the even-odd rule: a ray to the right crosses its edges an odd
    number of times."""
    inside = np.zeros(x.shape, bool)
    for (xa, ya), (xb, yb) in zip(points, np.roll(points, -1, axis=0)):
        if ya == yb:
            continue
        spans = (np.minimum(ya, yb) <= y) & (y < np.maximum(ya, yb))
        crossing = xa + (y - ya) * (xb - xa) / (yb - ya)
        inside ^= spans & (x < crossing)
    return inside


def polygon(rng: np.random.Generator, kind: str) -> np.ndarray:
    centre, radius = rng.uniform(10, 50, 2), rng.uniform(5, 30)
    if kind == "convex":
        angles = np.sort(rng.uniform(0, 2 * np.pi, int(rng.integers(3, 12))))
        radii = np.full(len(angles), radius)
    elif kind == "star":  # concave
        angles = np.linspace(0, 2 * np.pi, 10, endpoint=False)
        radii = np.where(np.arange(10) % 2, radius / 2.5, radius)
    else:  # a pentagram: self-crossing, its middle outside by the even-odd rule
        angles = np.arange(5) * 4 * np.pi / 5
        radii = np.full(5, radius)
    return centre + np.stack([np.cos(angles), np.sin(angles)], 1) * radii[:, None]


@pytest.mark.parametrize("kind", ["convex", "star", "pentagram"])
def test_the_fill_takes_the_pixels_whose_centres_lie_inside(kind: str) -> None:
    rng = np.random.default_rng(["convex", "star", "pentagram"].index(kind))
    for _ in range(40):
        points = polygon(rng, kind)
        origin = (int(rng.integers(-5, 20)), int(rng.integers(-5, 20)))
        width, height = int(rng.integers(20, 70)), int(rng.integers(20, 70))
        got = fill_polygons([points], (width, height), origin)
        v, u = np.mgrid[0:height, 0:width]
        want = inside_even_odd(points, u + origin[0] + 0.5, v + origin[1] + 0.5)
        assert got.shape == (height, width) and np.array_equal(got, want), (kind, int((got != want).sum()))
    square = np.array([[2.0, 3.0], [7.0, 3.0], [7.0, 5.0], [2.0, 5.0]])  # whole pixels: 5 x 2 of them
    filled = fill_polygons([square, square + 20], (30, 30))
    assert filled.sum() == 20 and filled[3:5, 2:7].all() and filled[23:25, 22:27].all()
    assert not fill_polygons([], (8, 8)).any() and not fill_polygons([square[:2]], (8, 8)).any()


def test_the_copies_are_ultralytics_choice_the_least_covering_first() -> None:
    rng = np.random.default_rng(3)
    width = 200.0
    for _ in range(200):
        count = int(rng.integers(1, 9))
        corners = rng.uniform(0, width, (count, 2))
        boxes = np.concatenate([corners, corners + rng.uniform(4, 60, (count, 2))], 1)
        candidates = sorted(rng.choice(count, int(rng.integers(0, count + 1)), replace=False).tolist())
        cover = np.array([[ioa(mirrored_boxes(boxes[[k]], width), boxes[[j]])[0, 0] for j in range(count)]
                          for k in range(count)])  # fmt: skip
        fitting = [k for k in candidates if (cover[k] < IOA_THR).all()]
        for p in (0.0, 0.3, 0.5, 1.0):
            picked = choose(p, boxes, candidates, width).tolist()
            assert len(picked) == round(p * len(fitting)) and set(picked) <= set(fitting)
            assert len(set(picked)) == len(picked)
            left = [k for k in fitting if k not in picked]
            worst = max((cover[k].max() for k in picked), default=-1.0)
            assert all(cover[k].max() >= worst for k in left)  # none left covers less than one taken
            assert [cover[k].max() for k in picked] == sorted(cover[k].max() for k in picked)
    assert choose(1.0, np.array([[10.0, 10, 190, 50]]), [0], width).tolist() == []  # its mirror covers itself


SIZE = 160


def asymmetric() -> tuple[np.ndarray, np.ndarray, list]:
    """A 160 x 160 grey picture with a red square whose left half is blue, its box and outline."""
    picture = np.full((SIZE, SIZE, 3), 90, np.uint8)
    picture[40:80, 20:60] = (230, 20, 20)
    picture[40:80, 20:40] = (20, 20, 230)
    box = np.array([[20.0, 40, 60, 80]])
    outline = [[np.array([[20.0, 40], [60, 40], [60, 80], [20, 80]])]]
    return picture, box, outline


STILL = YoloRecipe(size=SIZE, mosaic=None, affine=RandomAffine(translate=0.0, scale=0.0), fliplr=0.0, hsv=None)


def test_a_copy_shows_its_object_mirrored() -> None:
    picture, box, outline = asymmetric()
    made = plan(dataclasses.replace(STILL, copy_paste=1.0), random.Random(0), [(SIZE, SIZE)], [box], [np.array([3])],
                polygons=[outline])  # fmt: skip
    assert np.allclose(made.boxes, [[20, 40, 60, 80], [100, 40, 140, 80]])  # the output is the canvas: x -> 160 - x
    assert made.copied.tolist() == [False, True] and made.labels.tolist() == [3, 3]
    assert made.source_of.tolist() == [0, 0] and made.box_index.tolist() == [0, 0]
    assert made.mirror is not None and made.pasted is not None and len(made.pasted) == 1
    assert made.polygons is not None and np.allclose(made.polygons[1][0], made.pasted[0])
    out = render(made, [picture]).transpose(1, 2, 0)
    assert np.array_equal(out[:, :100], picture[:, :100]) and np.array_equal(out[:, 140:], picture[:, 140:])
    assert (out[42:78, 102:118] == (230, 20, 20)).all() and (out[42:78, 122:138] == (20, 20, 230)).all()  # mirrored
    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="JPEG", quality=95)
    decoded = np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))
    from_jpeg = render_jpegs(made, [buffer.getvalue()]).transpose(1, 2, 0)
    assert np.abs(from_jpeg.astype(int) - decoded[:, ::-1].astype(int))[42:78, 102:138].mean() < 3
    assert np.abs(from_jpeg.astype(int)[:, :100] - decoded[:, :100].astype(int)).mean() < 3


def test_a_copy_goes_through_the_warp_and_the_flips_with_its_pixels() -> None:
    picture, box, outline = asymmetric()
    recipe = YoloRecipe(size=SIZE, mosaic=None, affine=RandomAffine(degrees=20, scale=0.3), fliplr=1.0, flipud=1.0,
                        hsv=None, copy_paste=1.0)  # fmt: skip
    made = plan(recipe, random.Random(4), [(SIZE, SIZE)], [box], [np.array([0])], polygons=[outline])
    assert made.copied.tolist() == [False, True] and made.pasted is not None and made.mirror is not None
    out = render(made, [picture])
    # each output pixel 2 px or more inside the pasted outline shows the canvas' mirror image there
    shifts = ((2, 2), (-2, -2), (2, -2), (-2, 2))
    v, u = np.nonzero(np.all([fill_polygons([p + d for p in made.pasted], (SIZE, SIZE)) for d in shifts], axis=0))
    points = np.linalg.inv(made.warp @ made.mirror) @ np.stack([u + 0.5, v + 0.5, np.ones(len(u))])
    x, y = (points[0] / points[2]).astype(int), (points[1] / points[2]).astype(int)
    close = np.abs(out[:, v, u].T.astype(int) - picture[y, x].astype(int)).max(1) <= 40
    assert len(u) > 300 and close.mean() > 0.95, (len(u), close.mean())


def test_copy_paste_off_or_without_polygons_changes_nothing() -> None:
    rng = np.random.default_rng(9)
    originals = [(int(rng.integers(100, 300)), int(rng.integers(100, 300))) for _ in range(4)]
    pictures = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for w, h in originals]
    boxes = [np.array([[10.0, 10, 60, 50], [70, 30, 95, 90]]) for _ in range(4)]
    labels = [np.array([0, 1]) for _ in range(4)]
    outlines = [[[np.array([[10.0, 10], [60, 10], [35, 50]])], [np.array([[70.0, 30], [95, 60], [80, 90]])]]
                for _ in range(4)]  # fmt: skip
    for seed in range(20):
        plain = plan(YoloRecipe(size=SIZE), random.Random(seed), originals, boxes, labels, polygons=outlines)
        assert plain.pasted is None and plain.mirror is None and not plain.copied.any()
        assert len(plain.copied) == len(plain.boxes)
        pasted = plan(YoloRecipe(size=SIZE, copy_paste=1.0), random.Random(seed), originals, boxes, labels,
                      polygons=outlines)  # fmt: skip
        # it draws nothing: the same warp, gains and boxes, the copies after them
        assert np.array_equal(pasted.warp, plain.warp) and pasted.hsv_gains == plain.hsv_gains
        assert np.array_equal(pasted.boxes[~pasted.copied], plain.boxes)
        shown, base = render(pasted, pictures), render(plain, pictures)
        if pasted.pasted:
            outside = ~fill_polygons(pasted.pasted, (SIZE, SIZE))
            assert np.array_equal(shown[:, outside], base[:, outside])
        else:
            assert np.array_equal(shown, base)
        # no polygons: nothing to paste, the plan and pixels as without copy-paste
        boxes_only = plan(YoloRecipe(size=SIZE, copy_paste=1.0), random.Random(seed), originals, boxes, labels)
        without = plan(YoloRecipe(size=SIZE), random.Random(seed), originals, boxes, labels)
        assert boxes_only.pasted is None and np.array_equal(boxes_only.boxes, without.boxes)
        assert np.array_equal(render(boxes_only, pictures), render(without, pictures))
    with pytest.raises(ValueError, match="copy_paste"):
        YoloRecipe(copy_paste=1.5)
