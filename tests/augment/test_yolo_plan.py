"""The YOLO plan's pixels sit where its boxes say, on both ways of rendering; its draws and filters behave.

Four step pictures (`step_edges`: a bright rectangle whose box is exact)
go through mosaic plans drawn from seeded generators; each rectangle's
edges, found in the rendered output, must lie where the planned box says,
at the measurement's floor: on the native path (scale and shift) and on
the general one (rotation, shear, a vertical flip).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from step_edges import edge_errors, halo, step_picture

from pipeline.augment.affine import RandomAffine
from pipeline.augment.render import _output_rect, render
from pipeline.augment.warp import is_axis_aligned
from pipeline.augment.yolo import YoloRecipe, plan

SIZE = 192
FLOOR_PX = 0.15  # each edge, resized natively (measured: 0.11 at most); a box half a pixel off its pixels fails
GENERAL_FLOOR_PX = 0.3  # sampled bilinearly through the inverse, without a filter (measured: 0.2 at most)


def pictures(seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    images, boxes = [], []
    for k in range(4):
        width, height = int(rng.integers(160, 420)), int(rng.integers(160, 420))
        w, h = int(width * rng.uniform(0.3, 0.5)), int(height * rng.uniform(0.3, 0.5))
        x0, y0 = (width - w) // 2, (height - h) // 2
        images.append(step_picture(width, height, (x0, y0, x0 + w, y0 + h), seed * 10 + k))
        boxes.append(np.array([[x0, y0, x0 + w, y0 + h]], np.float64))
    return images, boxes


@pytest.mark.parametrize(
    "recipe",
    [
        YoloRecipe(size=SIZE, hsv=None),
        YoloRecipe(size=SIZE, hsv=None, mosaic=None),
        YoloRecipe(size=SIZE, hsv=None, flipud=0.5),
    ],
    ids=["defaults", "mosaic off", "vertical flips (the general way)"],
)
def test_each_rectangle_renders_where_its_box_says(recipe: YoloRecipe) -> None:
    errors: list[float] = []
    general = 0
    for seed in range(24):
        images, boxes = pictures(seed)
        made = plan(recipe, random.Random(seed), [(i.shape[1], i.shape[0]) for i in images], boxes,
                    [np.array([k]) for k in range(4)])  # fmt: skip
        out = render(made, images)
        for box, tile in zip(made.boxes, made.source_of):
            matrix = made.matrix(int(tile))
            general += not (is_axis_aligned(matrix) and matrix[1, 1] > 0)
            rect = _output_rect(made, int(tile))
            assert rect is not None
            zoom = abs(matrix[0, 0])
            source = images[int(tile)]
            found = edge_errors(out, tuple(box), rect, zoom, halo(source.shape[1], source.shape[0]) * zoom)
            errors += [abs(v) for v in found.values()]
    assert len(errors) >= 40, len(errors)
    floor = GENERAL_FLOOR_PX if recipe.flipud else FLOOR_PX
    assert max(errors) < floor and float(np.mean(errors)) < floor / 2, (max(errors), float(np.mean(errors)))
    if recipe.flipud:
        assert general > 5


def test_a_plan_is_its_draws_and_its_boxes_stay_in_the_output() -> None:
    images, boxes = pictures(3)
    sizes = [(i.shape[1], i.shape[0]) for i in images]
    labels = [np.array([k]) for k in range(4)]
    recipe = YoloRecipe(size=SIZE, affine=RandomAffine(degrees=30, shear=10, perspective=0.001))
    a, b = (plan(recipe, random.Random(7), sizes, boxes, labels) for _ in range(2))
    assert np.array_equal(a.boxes, b.boxes) and np.array_equal(a.warp, b.warp) and a.hsv_gains == b.hsv_gains
    for seed in range(50):
        made = plan(recipe, random.Random(seed), sizes, boxes, labels)
        assert ((made.boxes >= 0) & (made.boxes <= SIZE)).all()
        assert ((made.boxes[:, 2] - made.boxes[:, 0] > 2) & (made.boxes[:, 3] - made.boxes[:, 1] > 2)).all()
        assert sorted(made.labels.tolist()) == sorted(made.source_of.tolist())  # each box keeps its own class
    with pytest.raises(ValueError, match="takes 4 images"):
        plan(YoloRecipe(size=SIZE), random.Random(0), sizes[:2], boxes[:2], labels[:2])
    with pytest.raises(ValueError, match="degrees"):
        RandomAffine(degrees=-1)
    assert dataclasses.replace(recipe, mosaic=None).sources == 1 and recipe.sources == 4


def test_a_reduced_decode_renders_as_its_original_does() -> None:
    # A DCT-scaled decode (here a quarter-size picture) is rendered through its scale, not as the original.
    from PIL import Image
    from step_edges import psnr

    images, boxes = pictures(11)
    made = plan(YoloRecipe(size=SIZE, hsv=None), random.Random(2), [(i.shape[1], i.shape[0]) for i in images], boxes,
                [np.array([k]) for k in range(4)])  # fmt: skip
    reduced, scales = [], []
    for image in images:
        small = (-(-image.shape[1] // 2), -(-image.shape[0] // 2))
        reduced.append(np.asarray(Image.fromarray(image).resize(small, Image.Resampling.BOX)))
        scales.append((small[0] / image.shape[1], small[1] / image.shape[0]))
    assert psnr(render(made, reduced, scales=scales), render(made, images)) > 30
    assert psnr(render(made, reduced), render(made, images)) < 20  # taken for originals, they would be wrong


@pytest.mark.parametrize("affine", [RandomAffine(), RandomAffine(degrees=25, shear=5)], ids=["default", "rotated"])
def test_rendering_from_the_jpegs_decodes_only_what_each_tile_shows_and_gives_the_same_pixels(affine: RandomAffine) -> None:
    # render_jpegs: each tile's region decoded at its DCT scale; render: the whole pictures, decoded at full size.
    import io

    from PIL import Image
    from step_edges import psnr

    from pipeline import native
    from pipeline.augment.render import decode_whole, render_jpegs

    if native.library() is None:
        pytest.skip("the native library is not built here")
    figures = []
    for seed in range(6):
        images, boxes = pictures(20 + seed)
        jpegs = []
        for image in images:
            buffer = io.BytesIO()
            Image.fromarray(image).save(buffer, "JPEG", quality=95)
            jpegs.append(buffer.getvalue())
        decoded = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) for data in jpegs]
        made = plan(YoloRecipe(size=SIZE, hsv=None, affine=affine), random.Random(seed),
                    [(i.shape[1], i.shape[0]) for i in images], boxes, [np.array([k]) for k in range(4)])  # fmt: skip
        figures.append(psnr(render_jpegs(made, jpegs), render(made, decoded)))
        # the loader's way for pictures several mosaics share: each decoded whole once, then read (no decode)
        decoder = native.RegionDecoder(native.library())
        wholes = [decode_whole(decoder, data) for data in jpegs]
        shared = render_jpegs(made, [b"not read" for _ in jpegs], decoder=decoder, decoded=list(wholes))
        assert psnr(shared, render(made, decoded)) > 45  # the same full-size pictures, the same resampler
    assert min(figures) > 35, [round(f, 1) for f in figures]


def test_an_outline_past_the_canvas_is_clamped_as_every_point_of_it_would_be() -> None:
    """Ultralytics clamps its outlines (resampled to 1000 points) to the canvas: the plan's clamp of the vertices and
    of each edge's crossings of the canvas' lines holds every point of the densely clamped outline on its path."""
    from pipeline.augment.yolo import _clamped

    rng = np.random.default_rng(4)
    canvas = (100, 80)
    for _ in range(50):
        points = rng.uniform(-60, 160, (int(rng.integers(3, 9)), 2))
        clamped = _clamped(points, canvas)
        assert (clamped >= 0).all() and (clamped <= canvas).all()
        t = np.linspace(0, 1, 400, endpoint=False)[:, None, None]
        dense = (points[None] + t * (np.roll(points, -1, 0) - points)[None]).transpose(1, 0, 2).reshape(-1, 2)
        dense = np.clip(dense, 0, canvas)
        a, b = clamped, np.roll(clamped, -1, 0)
        ab = b - a
        along = np.clip(((dense[:, None] - a[None]) * ab[None]).sum(-1) / np.maximum((ab**2).sum(-1), 1e-12), 0, 1)
        distance = np.linalg.norm(a[None] + along[..., None] * ab[None] - dense[:, None], axis=-1).min(1)
        assert distance.max() < 1e-6
        assert np.allclose([*clamped.min(0), *clamped.max(0)], [*dense.min(0), *dense.max(0)], atol=0.6)
