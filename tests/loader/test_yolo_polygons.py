"""make_loader(recipe="yolo") on a YOLO-seg dataset: each instance's polygons go through the mosaic and the warp.

Each picture holds red convex shapes (a hexagon and a triangle) on a grey
ground, labelled by their YOLO-seg outlines. Through the recipe (mosaic,
random scale and shift, flips; HSV off so that red stays red), every
delivered polygon must lie on red pixels and inside the output, and each
box must be the bounds of its polygons (ultralytics' `segment2box`), with
threads as with processes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import red_shapes
from PIL import Image, ImageDraw
from red_shapes import write_source

from pipeline import make_loader

CROP = 160
NO_HSV = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0}


def shapes(rng: np.random.Generator, width: int, height: int) -> list[np.ndarray]:
    """A hexagon in the left half and a triangle in the right half, in pixels."""
    x0, y0 = rng.uniform(0.05, 0.15) * width, rng.uniform(0.1, 0.3) * height
    w, h = rng.uniform(0.25, 0.35) * width, rng.uniform(0.3, 0.5) * height
    hexagon = np.array([[x0 + w / 3, y0], [x0 + 2 * w / 3, y0], [x0 + w, y0 + h / 2], [x0 + 2 * w / 3, y0 + h],
                        [x0 + w / 3, y0 + h], [x0, y0 + h / 2]])  # fmt: skip
    left, top = rng.uniform(0.55, 0.65) * width, rng.uniform(0.2, 0.4) * height
    triangle = np.array([[left, top], [left + 0.3 * width, top + 0.1 * height], [left + 0.1 * width, top + 0.45 * height]])
    return [hexagon, triangle]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("seg")
    source = write_source(base / "source", shapes, count=16, seed=7, names=("hexagon", "triangle"))
    return red_shapes.prepared(source, base / "out", 256)


def inside(points: np.ndarray, size: int) -> np.ndarray:
    """Pixels whose centre lies inside the polygon, a `size` x `size` picture."""
    canvas = Image.new("L", (size * 4, size * 4))
    ImageDraw.Draw(canvas).polygon([(float(x) * 4, float(y) * 4) for x, y in points], fill=255)
    return np.asarray(canvas.resize((size, size), Image.Resampling.BOX)) >= 200


def delivered(prepared: Path, worker_type: str, seed: int = 5) -> list:
    loader = make_loader(str(prepared), 4, device="cpu", crop=CROP, num_workers=2, dtype="uint8", recipe="yolo",
                         seed=seed, hyp=NO_HSV, worker_type=worker_type)  # fmt: skip
    return [(batch.images.numpy(), batch.boxes, batch.polygons) for _ in range(2) for batch in loader]


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_polygons_follow_the_mosaic_onto_their_pixels_and_shape_their_boxes(prepared: Path, worker_type: str) -> None:
    checked = 0
    for images, boxes, polygons in delivered(prepared, worker_type):
        assert polygons is not None and len(polygons) == len(boxes) == len(images)
        for image, own_boxes, own_polygons in zip(images, boxes, polygons):
            assert len(own_polygons) == len(own_boxes)
            red = (image[0] > 180) & (image[1] < 90)
            for box, parts in zip(own_boxes, own_polygons):
                assert parts, "every kept box keeps what is left of its outline"
                stacked = np.concatenate([p.numpy() for p in parts])
                assert np.allclose([*stacked.min(0), *stacked.max(0)], box.numpy(), atol=1e-3)
                assert (stacked >= -1e-3).all() and (stacked <= CROP + 1e-3).all()
                for points in parts:
                    drawn = inside(points.numpy(), CROP)
                    if drawn.sum() >= 30:  # the resampled outline blurs a pixel: only shapes of some size
                        assert red[drawn].mean() > 0.85, (worker_type, red[drawn].mean(), int(drawn.sum()))
                        checked += 1
    assert checked >= 40


def test_threads_and_processes_deliver_the_same_polygons(prepared: Path) -> None:
    threads, processes = delivered(prepared, "thread"), delivered(prepared, "process")
    for (_, _, ours), (_, _, theirs) in zip(threads, processes):
        assert [[[p.tolist() for p in parts] for parts in image] for image in ours] == \
            [[[p.tolist() for p in parts] for parts in image] for image in theirs]  # fmt: skip


def test_mixup_and_cutmix_carry_each_boxs_polygons(prepared: Path) -> None:
    loader = make_loader(str(prepared), 4, device="cpu", crop=CROP, num_workers=2, dtype="uint8", recipe="yolo", seed=5,
                         hyp={**NO_HSV, "mixup": 1.0, "cutmix": 1.0})  # fmt: skip
    plain = sum(len(b) for _, boxes, _ in delivered(prepared, "thread") for b in boxes) / 2
    mixed = 0
    for batch in loader:
        assert batch.polygons is not None
        for boxes, polygons in zip(batch.boxes, batch.polygons):
            assert len(polygons) == len(boxes)
            mixed += len(boxes)
            for box, parts in zip(boxes, polygons):
                for points in parts:  # a polygon never leaves its box (a pasted box and its polygons cut alike)
                    assert (points.min(0).values >= box[:2] - 1e-3).all() and (points.max(0).values <= box[2:] + 1e-3).all()
    assert mixed > plain  # every output holds another's boxes too
