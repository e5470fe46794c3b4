"""Instance polygons: the member's codec holds against hostile bytes, and the geometry moves points as boxes move."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.polygons import (
    MAX_SAMPLE_POINTS,
    clip_polygon,
    decode,
    encode,
    orient_points,
    place_polygons,
    transform_polygons,
)
from pipeline.targets import affine_boxes, orient_boxes, place_boxes


def square(x0: float, y0: float, x1: float, y1: float) -> np.ndarray:
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], np.float64)


def bounds(points: np.ndarray) -> list[float]:
    return [*points.min(axis=0).tolist(), *points.max(axis=0).tolist()]


def area(points: np.ndarray) -> float:
    x, y = points[:, 0], points[:, 1]
    return abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1)))) / 2


def test_the_member_round_trips_per_box_in_cocos_flat_form() -> None:
    polygons = [[square(1, 2, 3.25, 4.5)], [], [square(0, 0, 1, 1), np.array([[5, 5], [9, 5], [7, 8.1234567]])]]
    data = encode(polygons)
    assert data.startswith(b"[[[1.0,2.0,3.25,2.0,")  # COCO's [x0, y0, x1, y1, ...], readable by plain json
    back = decode(data, 3)
    assert [len(parts) for parts in back] == [1, 0, 2]
    np.testing.assert_allclose(back[2][1], [[5, 5], [9, 5], [7, 8.123]], atol=1e-9)  # kept to 1/1000 px


@pytest.mark.parametrize(
    "data, boxes, reason",
    [
        (b"{", 1, "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, 1, "not JSON"),  # nesting past the recursion limit
        (b"[[]]", 2, "1 entries for 2 boxes"),
        (b'{"a": 1}', 1, "not a list of entries"),
        (b"[[[1,2,3,4]]]", 1, "at least three"),
        (b"[[[1,2,3,4,5]]]", 1, "at least three"),
        (b'[[[1,2,3,4,5,"6"]]]', 1, "not a number"),
        (b"[[[1,2,3,4,5,true]]]", 1, "not a number"),
        (b"[[[1,2,3,4,5,1e400]]]", 1, "not finite"),
        (b"[[[1,2,3,4,5,NaN]]]", 1, "not finite"),
        (b"[7]", 1, "a list of polygons"),
        (b"[[" + b",".join([b"[" + b",".join([b"1"] * 20_000) + b"]"] * (MAX_SAMPLE_POINTS // 10_000 + 1)) + b"]]", 1, "over"),
    ],
)
def test_a_damaged_member_is_refused_with_the_reason(data: bytes, boxes: int, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        decode(data, boxes)


def test_points_turn_upright_as_boxes_do_for_every_orientation() -> None:
    rng = np.random.default_rng(0)
    box = np.array([[13.0, 7.0, 41.5, 30.25]])
    corners = square(*box[0])
    for orientation in range(1, 9):
        turned = orient_points(corners + rng.normal(0, 0, corners.shape), orientation, 60, 45)
        np.testing.assert_allclose(bounds(turned), orient_boxes(box, orientation, 60, 45)[0], atol=1e-5)


def test_a_convex_polygon_is_clipped_exactly_and_a_concave_one_keeps_its_area_inside() -> None:
    # A square half out of the window: exactly the overlap.
    clipped = clip_polygon(square(-10, 5, 10, 15), (0, 0, 100, 100))
    assert clipped is not None and bounds(clipped) == [0, 5, 10, 15] and area(clipped) == pytest.approx(100)
    # A U shape whose two arms leave through the top edge: the area inside the window is kept.
    u = np.array([[0, 0], [30, 0], [30, 30], [20, 30], [20, 10], [10, 10], [10, 30], [0, 30]], np.float64)
    cut = clip_polygon(u, (0, 0, 30, 20))
    assert cut is not None and area(cut) == pytest.approx(30 * 10 + 2 * 10 * 10)
    # Wholly outside, or left a sliver of no area: gone.
    assert clip_polygon(square(200, 200, 210, 210), (0, 0, 100, 100)) is None
    assert clip_polygon(square(-10, 0, 0, 10), (0, 0, 100, 100)) is None


def test_the_loaders_placement_moves_polygons_as_it_moves_boxes() -> None:
    # A placement that crops, scales unequally, shifts and flips: a rectangle's polygon ends as its box.
    rng = np.random.default_rng(1)
    for _ in range(200):
        x0, y0 = rng.uniform(0, 80, 2)
        x1, y1 = x0 + rng.uniform(1, 60), y0 + rng.uniform(1, 60)
        box = (float(rng.uniform(0, 40)), float(rng.uniform(0, 40)), float(rng.uniform(20, 100)), float(rng.uniform(20, 100)))
        dest = (int(rng.integers(0, 10)), int(rng.integers(0, 10)), 54, 54)
        flip = bool(rng.integers(2))
        moved, keep = place_boxes(np.array([[x0, y0, x1, y1]], np.float32), box, dest, 64, 0.0, flip)
        [parts] = place_polygons([[square(x0, y0, x1, y1)]], box, dest, 64, flip)
        expected = _clip_to(moved[0], dest, flip)  # the box clipped to the output, the polygon to the destination
        if keep[0] and expected[2] - expected[0] > 1e-3 and expected[3] - expected[1] > 1e-3:
            [points] = parts
            assert points.dtype == np.float32
            assert bounds(points) == pytest.approx(expected, abs=1e-3)
        else:
            assert parts == [] or area(parts[0]) < 1e-3


def _clip_to(box: np.ndarray, dest: tuple[int, int, int, int], flip: bool) -> list[float]:
    x, y, w, h = dest
    lo_x, hi_x = (64 - x - w, 64 - x) if flip else (x, x + w)
    return [max(box[0], lo_x), max(box[1], y), min(box[2], hi_x), min(box[3], y + h)]


def test_prepares_geometry_moves_polygons_as_it_moves_boxes() -> None:
    # Stored 40x30 with orientation 6 (upright 30x40), a rotated crop's matrix, a flip and an offset.
    angle = np.deg2rad(10)
    matrix = (np.cos(angle) * 0.5, -np.sin(angle) * 0.5, 3.0, np.sin(angle) * 0.5, np.cos(angle) * 0.5, 2.0)
    corners = square(5, 6, 20, 18)
    [[moved]] = transform_polygons([[corners]], (40, 30), 6, matrix, 50, (4, 1), (-50, -50, 200, 200))
    upright = orient_boxes(np.array([[5, 6, 20, 18]], np.float64), 6, 40, 30)
    expected = affine_boxes(upright.astype(np.float64), matrix)[0].astype(np.float64)
    expected[[0, 2]] = 50 - expected[[2, 0]]
    expected += [4, 1, 4, 1]
    np.testing.assert_allclose(bounds(moved), expected, atol=1e-3)  # a rotated box is its corners' bounds
