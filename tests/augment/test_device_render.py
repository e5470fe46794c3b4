"""`device_render.render_batch` (ultralytics' resize, paste and warp in torch) against `render` (the CPU's one resample).

The same plans and pictures (smooth photo-like pictures with sharp
rectangles, as test_yolo_vs_ultralytics.py draws them) through both: the
outputs agree to 30 dB PSNR or better away from the seams between tiles
(where the two ways may take a row from different neighbours) for the
default recipe, rotation, shear and perspective, mosaic off, the mosaic of
nine, copy-paste and flips. Against ultralytics' own pixels:
test_yolo_vs_ultralytics.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from test_yolo_vs_ultralytics import (
    MIN_PSNR_DB,
    RECIPES,
    SIZE,
    Units,
    away_from_seams,
    polygons_in,
    psnr,
    write_case,
)

from pipeline.augment.affine import RandomAffine
from pipeline.augment.device_render import render_batch
from pipeline.augment.render import render
from pipeline.augment.warp import hflip
from pipeline.augment.yolo import Plan, YoloRecipe, plan
from pipeline.polygons import fill_polygons

CASES = {
    **{name: dataclasses.replace(recipe, hsv=None) for name, recipe in RECIPES.items()},
    "copy-paste": dataclasses.replace(RECIPES["defaults"], hsv=None, copy_paste=1.0),
    "copy-paste, rotation": dataclasses.replace(RECIPES["rotation, shear, perspective"], hsv=None, copy_paste=1.0),
    "flips": dataclasses.replace(RECIPES["defaults"], hsv=None, fliplr=1.0, flipud=1.0),
}


def planned(tmp_path: Path, recipe: YoloRecipe, count: int, seed: int) -> tuple[list[Plan], list[list[np.ndarray]]]:
    """`count` plans of `recipe` and their pictures (H, W, 3 RGB), polygons in every box where it copy-pastes."""
    rng = np.random.default_rng(seed)
    plans, pictures = [], []
    for number in range(count):
        case = write_case(tmp_path, number, rng, recipe.sources)
        originals = [(p.shape[1], p.shape[0]) for p in case["pictures"]]
        boxes = [np.array(b, np.float64) for b in case["boxes"]]
        labels = [np.array(v, np.int64) for v in case["labels"]]
        polygons = None
        if recipe.copy_paste:
            polygons = [[[np.array(points, np.float64)] for points in polygons_in(b, rng)] for b in case["boxes"]]
        units = Units(rng.uniform(0, 1, 16).tolist())
        plans.append(plan(recipe, units, originals, boxes, labels, polygons=polygons))
        pictures.append(case["pictures"])
    return plans, pictures


def as_tensors(pictures: list[list[np.ndarray]], device: str = "cpu") -> list[list[torch.Tensor]]:
    """Each picture as nvjpeg decodes it: uint8 [3, H, W]."""
    return [
        [torch.from_numpy(np.ascontiguousarray(p.transpose(2, 0, 1))).to(device) for p in group] for group in pictures
    ]


@pytest.mark.parametrize("name", list(CASES))
def test_render_batch_agrees_with_render_away_from_seams(tmp_path: Path, name: str) -> None:
    recipe = CASES[name]
    plans, pictures = planned(tmp_path, recipe, 12, list(CASES).index(name))
    batch = render_batch(plans, as_tensors(pictures), chunk=5)  # chunks of unlike canvases (mosaic off)
    assert batch.dtype == torch.uint8 and batch.shape == (12, 3, SIZE, SIZE)
    figures, whole = [], []
    for made, group, ours in zip(plans, pictures, batch.numpy()):
        theirs = render(made, group)
        away = away_from_seams(made)
        figures.append(psnr(ours.transpose(1, 2, 0)[away], theirs.transpose(1, 2, 0)[away]))
        whole.append(psnr(ours, theirs))
    if recipe.copy_paste:
        assert sum(made.pasted is not None and fill_polygons(made.pasted, (SIZE, SIZE)).sum() > 20 for made in plans) >= 4
    assert min(figures) >= MIN_PSNR_DB, (name, [round(f, 1) for f in figures])
    print(f"render_batch vs render, {name}: PSNR away from seams min {min(figures):.1f} dB "
          f"(median {np.median(figures):.1f}), whole min {min(whole):.1f} dB (median {np.median(whole):.1f})")  # fmt: skip


def test_the_pasted_outlines_show_the_mirrored_canvas(tmp_path: Path) -> None:
    """Under the outlines: the output of the plan through `warp @ mirror`, the mirror being x -> W - x of the
    canvas (what `canvas.flip(-1)` shows); elsewhere the plan's own output."""
    plans, pictures = planned(tmp_path, CASES["copy-paste"], 12, 4)
    made = next(p for p in plans if p.pasted and fill_polygons(p.pasted, (SIZE, SIZE)).sum() > 20)
    group = pictures[plans.index(made)]
    assert made.mirror is not None and np.array_equal(made.mirror, hflip(made.canvas[0]))
    both = render_batch([made, dataclasses.replace(made, pasted=None, mirror=None),
                         dataclasses.replace(made, warp=made.warp @ made.mirror, pasted=None, mirror=None)],
                        as_tensors([group] * 3))  # fmt: skip
    under = torch.from_numpy(fill_polygons(made.pasted or [], (SIZE, SIZE)))
    assert torch.equal(both[0][:, under], both[2][:, under]) and torch.equal(both[0][:, ~under], both[1][:, ~under])


def test_a_picture_at_its_load_size_is_copied_exactly() -> None:
    """Mosaic off, no affine: the canvas is the picture (no resize), the warp the identity or the flip."""
    recipe = YoloRecipe(size=64, mosaic=None, affine=RandomAffine(translate=0.0, scale=0.0), hsv=None)
    picture = torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    for flip in (0.0, 1.0):
        made = plan(dataclasses.replace(recipe, fliplr=flip), Units([0.5] * 16), [(64, 64)], [np.zeros((0, 4))],
                    [np.zeros(0, np.int64)])  # fmt: skip
        out = render_batch([made], [[picture]])[0]
        assert torch.equal(out, picture.flip(-1) if flip else picture)


def test_out_is_written_in_place_and_an_empty_batch_is_empty(tmp_path: Path) -> None:
    plans, pictures = planned(tmp_path, CASES["defaults"], 3, 5)
    out = torch.zeros((3, 3, SIZE, SIZE), dtype=torch.uint8)
    assert render_batch(plans, as_tensors(pictures), out) is out
    assert torch.equal(out, render_batch(plans, as_tensors(pictures))) and out.any()
    empty = render_batch([], [])
    assert empty.dtype == torch.uint8 and empty.shape[0] == 0
    kept = torch.zeros((0, 3, SIZE, SIZE), dtype=torch.uint8)
    assert render_batch([], [], kept) is kept
    with pytest.raises(ValueError, match="tiles"):
        render_batch(plans[:1], [as_tensors(pictures)[0][:2]])
    with pytest.raises(ValueError, match="out must be"):
        render_batch(plans, as_tensors(pictures), torch.zeros((3, 3, SIZE, SIZE), dtype=torch.float32))


@pytest.mark.cuda
def test_cuda_renders_as_the_cpu(tmp_path: Path) -> None:
    for name in ("defaults", "rotation, shear, perspective", "mosaic off", "mosaic of nine", "copy-paste"):
        plans, pictures = planned(tmp_path, CASES[name], 6, 20 + list(CASES).index(name))
        on_cpu = render_batch(plans, as_tensors(pictures))
        on_cuda = render_batch(plans, as_tensors(pictures, "cuda"))
        assert on_cuda.device.type == "cuda" and on_cuda.dtype == torch.uint8
        difference = (on_cpu.int() - on_cuda.cpu().int()).abs()
        assert difference.max() <= 1 and (difference == 0).float().mean() > 0.99, (name, int(difference.max()))
