"""gpufeed's YOLO plan and pixels against ultralytics' own Mosaic, RandomPerspective and RandomFlip, for the same draws.

Ultralytics (8.4.190, in a cached venv of its own: it needs torch 2.14.1 and
torchvision, and brings OpenCV and plain Pillow) runs its transforms on
four pictures: each read and resized as its `load_image` does, the mosaic
pasted, the canvas warped with `cv2.warpAffine`, the boxes through
`apply_bboxes`, `clip` and `box_candidates`, then flipped. Its `random` is
replaced by a list of unit draws, and gpufeed's `plan` takes the same list:
the boxes must agree within 0.5 px (the same boxes survive), the pixels to
30 dB PSNR or better away from the seams where tiles meet, and 26 dB with
them (gpufeed resamples each source once; ultralytics resizes, then warps
the canvas, and samples pixel centres half a pixel apart where the warp
scales, so a seam's row may come from the neighbouring tile). The draws cover ultralytics' defaults
(translate and scale), mosaic off, the mosaic of nine, and rotation, shear
and perspective; and with YOLO-seg polygons, ultralytics' `CopyPaste`
(mode "flip", which draws nothing) between the mosaic and the warp: the
same copies join the boxes, and their mirrored pixels the output, to the
same PSNR away from the pasted outlines' edges too (OpenCV fills them at
whole canvas pixels).
The venv's build is counted once per machine; without it the test skips,
saying why. It runs without a network (`unshare -n` where the machine has
it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from extra_venvs import VISION, venv_python
from PIL import Image

from pipeline.augment.affine import RandomAffine
from pipeline.augment.mosaic import Mosaic
from pipeline.augment.render import render
from pipeline.augment.yolo import Plan, YoloRecipe, plan
from pipeline.polygons import fill_polygons

ULTRALYTICS = VISION
SIZE = 160
MIN_PSNR_DB = 30.0  # away from the seams between tiles (`away_from_seams`)
MIN_WHOLE_PSNR_DB = 26.0  # with them: a seam row sampled from the neighbouring tile costs a few dB at 160 px
ULTRALYTICS_SCRIPT = r"""
import json, random, sys
import cv2
import numpy as np
from ultralytics.data.augment import CopyPaste, Mosaic, RandomFlip, RandomPerspective
from ultralytics.utils.instance import Instances
from ultralytics.utils.ops import resample_segments

cases = json.load(sys.stdin)
answers = []
for case in cases:
    units = iter(case["units"])
    random.uniform = lambda a, b: a + (b - a) * next(units)
    random.random = lambda: next(units)
    size = case["size"]
    patches = []
    shapes = case.get("segments") or [None] * len(case["images"])
    for path, boxes, classes, polygons in zip(case["images"], case["boxes"], case["labels"], shapes):
        im = cv2.imread(path)
        h0, w0 = im.shape[:2]
        r = size / max(h0, w0)
        if r != 1:
            w, h = min(int(np.ceil(w0 * r)), size), min(int(np.ceil(h0 * r)), size)
            im = cv2.resize(im, (w, h), interpolation=cv2.INTER_LINEAR)
        b = np.array(boxes, np.float32).reshape(-1, 4) / np.array([w0, h0, w0, h0], np.float32)
        segments = np.zeros((0, 1000, 2), np.float32)
        if polygons is not None:  # as its dataset loads YOLO-seg: 1000 points along each outline, normalised
            segments = np.stack(resample_segments([np.array(p, np.float32) / [w0, h0] for p in polygons]), 0)
        patches.append({"img": im, "resized_shape": im.shape[:2], "ori_shape": (h0, w0), "im_file": path,
                        "cls": np.array(classes, np.float32).reshape(-1, 1),
                        "instances": Instances(b, segments.astype(np.float32), None, bbox_format="xyxy",
                                               normalized=True)})
    labels = patches[0]
    mosaic_on = next(units) <= case["mosaic_p"]
    if mosaic_on:
        dataset = type("Dataset", (), {"cache": None, "get_image_and_label": lambda self, i: patches[i]})()
        mosaic = Mosaic(dataset, imgsz=size, p=1.0, n=case["mosaic_n"])
        mosaic.get_indexes = lambda: list(range(1, case["mosaic_n"]))  # the partners are given, not drawn
        params = mosaic.get_params(labels)
        labels = mosaic.apply_image(labels, params)
        labels = mosaic.apply_instances(labels, params)
        labels.pop("mix_labels", None)
    else:
        labels["instances"].convert_bbox(format="xyxy")
        labels["instances"].denormalize(labels["img"].shape[1], labels["img"].shape[0])
    if case.get("copy_paste"):  # v8_transforms' place for mode "flip": after the mosaic, before the warp
        labels = CopyPaste(p=case["copy_paste"], mode="flip")(labels)
    a = case["affine"]
    labels = RandomPerspective(degrees=a["degrees"], translate=a["translate"], scale=a["scale"], shear=a["shear"],
                               perspective=a["perspective"], size=(size, size))(labels)
    labels = RandomFlip(direction="vertical", p=case["flipud"])(labels)
    labels = RandomFlip(direction="horizontal", p=case["fliplr"])(labels)
    instances = labels["instances"]
    instances.convert_bbox(format="xyxy")
    if instances.normalized:
        instances.denormalize(size, size)
    np.save(case["out"], labels["img"][:, :, ::-1])
    answers.append({"boxes": instances.bboxes.tolist(), "labels": labels["cls"].reshape(-1).tolist()})
print(json.dumps(answers))
"""


class Units:
    """The draws ultralytics' `random.uniform` and `random.random` were given, in order."""

    def __init__(self, units: list[float]) -> None:
        self.units = iter(units)

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * next(self.units)

    def random(self) -> float:
        return next(self.units)


def picture(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A smooth photo-like picture with sharp rectangles (its boxes' objects)."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 / width), (y * 255 / height), ((x + y) * 127 / (width + height)) + 64], axis=2)
    return base.clip(0, 255).astype(np.uint8)


def write_case(folder: Path, number: int, rng: np.random.Generator, count: int = 4) -> dict:
    images, boxes, labels, pictures = [], [], [], []
    for k in range(count):
        width, height = int(rng.integers(90, 400)), int(rng.integers(90, 400))
        pixels = picture(rng, width, height)
        own = []
        for _ in range(int(rng.integers(1, 5))):
            w, h = rng.uniform(0.1, 0.5) * width, rng.uniform(0.1, 0.5) * height
            x0, y0 = rng.uniform(0, width - w), rng.uniform(0, height - h)
            own.append([x0, y0, x0 + w, y0 + h])
            pixels[int(y0) : int(y0 + h), int(x0) : int(x0 + w)] = rng.integers(0, 256, 3)
        path = folder / f"{number}-{k}.png"
        Image.fromarray(pixels).save(path)
        images.append(str(path))
        boxes.append(own)
        labels.append([int(v) for v in rng.integers(0, 5, len(own))])
        pictures.append(pixels)
    return {"images": images, "boxes": boxes, "labels": labels, "pictures": pictures}


RECIPES = {
    "defaults": YoloRecipe(size=SIZE),
    "mosaic off": YoloRecipe(size=SIZE, mosaic=None),
    "rotation, shear, perspective": YoloRecipe(
        size=SIZE, affine=RandomAffine(degrees=20, translate=0.2, scale=0.5, shear=5, perspective=0.0005), flipud=0.3
    ),
    "mosaic of nine": YoloRecipe(size=SIZE, mosaic=Mosaic(n=9)),
}


def away_from_seams(made: Plan, margin: float = 2.0) -> np.ndarray:
    """The output pixels whose centres fall over 2 canvas px from every tile's edges: where two tiles (or a tile
    and the fill) meet, ultralytics' warp, which samples OpenCV's pixel centres (half a pixel from the boxes'
    frame where it scales), may take a row from the neighbour this plan takes it from. Under a pasted outline the
    output shows the mirrored canvas: its tiles' edges are mirrored there."""
    size = made.size
    v, u = np.mgrid[0:size, 0:size]
    points = np.linalg.inv(made.warp) @ np.stack([u.ravel() + 0.5, v.ravel() + 0.5, np.ones(u.size)])
    cx, cy = points[0] / points[2], points[1] / points[2]
    if made.pasted:
        pasted = fill_polygons(made.pasted, (size, size)).ravel()
        cx = np.where(pasted, made.canvas[0] - cx, cx)
    away = np.ones(u.size, bool)
    for tile in made.tiles:
        x0, y0, x1, y1 = tile.window
        near_x = (cx > x0 - margin) & (cx < x1 + margin)
        near_y = (cy > y0 - margin) & (cy < y1 + margin)
        on_edge = (np.abs(cx - x0) < margin) | (np.abs(cx - x1) < margin) | (np.abs(cy - y0) < margin) | (np.abs(cy - y1) < margin)
        away &= ~(near_x & near_y & on_edge)
    return away.reshape(size, size)


def run_ultralytics(cases: list[dict]) -> list[dict]:
    python = venv_python("vision", ULTRALYTICS)
    config = Path(cases[0]["out"]).parent / "yolo-config"
    env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(config)}
    command = [str(python), "-c", ULTRALYTICS_SCRIPT]
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False).returncode == 0:
        command = ["unshare", "-n", *command]  # no network: nothing may be fetched
    payload = [{k: v for k, v in case.items() if k != "pictures"} for case in cases]
    done = subprocess.run(command, input=json.dumps(payload), capture_output=True, text=True, env=env, timeout=600,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return 10 * np.log10(255**2 / max(mse, 1e-9))


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_plan_gives_ultralytics_boxes_and_pixels_for_the_same_draws(tmp_path: Path, name: str) -> None:
    recipe = RECIPES[name]
    rng = np.random.default_rng(list(RECIPES).index(name))
    cases = []
    for number in range(12):
        case = write_case(tmp_path, number, rng, recipe.sources)
        affine = recipe.affine
        case.update(units=rng.uniform(0, 1, 16).tolist(), size=SIZE, out=str(tmp_path / f"{number}-ultralytics.npy"),
                    mosaic_p=recipe.mosaic.p if recipe.mosaic is not None else -1.0, fliplr=recipe.fliplr,
                    mosaic_n=recipe.sources if recipe.mosaic is not None else 4,
                    flipud=recipe.flipud, affine=dataclass_dict(affine))  # fmt: skip
        cases.append(case)
    answers = run_ultralytics(cases)
    figures: list[float] = []
    whole: list[float] = []
    errors: list[float] = []
    for case, answer in zip(cases, answers):
        units = Units(case["units"])
        originals = [(p.shape[1], p.shape[0]) for p in case["pictures"]]
        boxes = [np.array(b, np.float64) for b in case["boxes"]]
        labels = [np.array(v, np.int64) for v in case["labels"]]
        if recipe.mosaic is None:
            units.random()  # ultralytics' Mosaic(p=0) still draws whether to mosaic
        made = plan(dataclass_replace(recipe, hsv=None), units, originals, boxes, labels)
        want = np.array(answer["boxes"], np.float64).reshape(-1, 4)
        order_want = np.lexsort(np.round(want, 1).T[::-1])  # float32 rounding: ultralytics' 0 may be -8e-6
        order_got = np.lexsort(np.round(made.boxes.astype(np.float64), 1).T[::-1])
        assert len(made.boxes) == len(want), (name, case["units"][:3], made.boxes, want)
        if len(want):
            errors.append(float(np.abs(made.boxes[order_got] - want[order_want]).max()))
        assert not len(want) or errors[-1] < 0.5, (name, made.boxes, want)
        assert sorted(made.labels.tolist()) == sorted(int(v) for v in answer["labels"])
        ours = render(made, case["pictures"]).transpose(1, 2, 0)
        theirs = np.load(case["out"])
        away = away_from_seams(made)
        figures.append(psnr(ours[away], theirs[away]))
        whole.append(psnr(ours, theirs))
    assert min(figures) >= MIN_PSNR_DB, (name, [round(f, 1) for f in figures])
    assert min(whole) >= MIN_WHOLE_PSNR_DB, (name, [round(f, 1) for f in whole])


def dataclass_dict(value: object) -> dict:
    import dataclasses

    return dataclasses.asdict(value)  # type: ignore[call-overload]


def dataclass_replace(value: YoloRecipe, **changes: object) -> YoloRecipe:
    import dataclasses

    return dataclasses.replace(value, **changes)  # type: ignore[arg-type]


def test_mosaic_tiles_meet_at_the_centre_and_cover_the_canvas_where_their_images_reach() -> None:
    tiles = Mosaic().tiles(Units([0.5, 0.5]), 100, [(100, 50), (80, 100), (100, 100), (60, 60)])
    # centre (100, 100): the top-left image ends there, the bottom-right begins there
    assert tiles[0].window[2:] == (100, 100) and tiles[3].window[:2] == (100, 100)
    for tile in tiles:
        x0, y0, x1, y1 = tile.window
        assert 0 <= x0 < x1 <= 200 and 0 <= y0 < y1 <= 200


HSV_SCRIPT = r"""
import json, sys
import numpy as np
from ultralytics.data.augment import RandomHSV

case = json.load(sys.stdin)
image = np.load(case["image"])  # RGB
out = []
for units in case["units"]:
    np.random.uniform = lambda a, b, n, units=units: a + (b - a) * np.array(units)
    labels = {"img": np.ascontiguousarray(image[:, :, ::-1])}  # ultralytics works in BGR
    RandomHSV(*case["gains"])(labels)
    out.append(labels["img"][:, :, ::-1])
np.save(case["out"], np.stack(out))
"""


def test_hsv_on_a_batch_equals_ultralytics_per_image(tmp_path: Path) -> None:
    import torch

    from pipeline.augment.hsv import HSV, apply_hsv, hsv_in_place

    rng = np.random.default_rng(5)
    image = picture(rng, 96, 64)
    image[10:40, 20:70] = [250, 250, 250]  # white, grey and saturated patches
    image[40:60, 0:30] = [128, 128, 128]
    image[0:10, :] = rng.integers(0, 256, (10, 96, 3))
    np.save(tmp_path / "image.npy", image)
    hsv = HSV()
    units = rng.uniform(0, 1, (6, 3)).tolist()
    python = venv_python("vision", ULTRALYTICS)
    env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(tmp_path / "yolo-config")}
    case = {"image": str(tmp_path / "image.npy"), "units": units, "gains": [hsv.hue, hsv.saturation, hsv.value],
            "out": str(tmp_path / "hsv.npy")}  # fmt: skip
    done = subprocess.run([str(python), "-c", HSV_SCRIPT], input=json.dumps(case), capture_output=True, text=True,
                          env=env, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = np.load(tmp_path / "hsv.npy")
    gains = torch.tensor([hsv.draw(Units(u)) for u in units], dtype=torch.float32)
    batch = torch.from_numpy(np.repeat(image.transpose(2, 0, 1)[None], len(units), axis=0))
    ours = apply_hsv(batch, gains).numpy().transpose(0, 2, 3, 1)
    native = []
    for gain in gains.tolist():
        planar = np.ascontiguousarray(image.transpose(2, 0, 1))
        hsv_in_place(planar, tuple(gain))  # the worker's way: one image, in native code
        native.append(planar.transpose(1, 2, 0))
    for made in (ours, np.stack(native)):
        difference = np.abs(made.astype(int) - theirs.astype(int))
        # OpenCV's 8-bit HSV through its tables, back through floats: a level or two apart at most, equal almost
        # everywhere
        assert difference.max() <= 3 and (difference == 0).mean() > 0.9, (difference.max(), (difference == 0).mean())
        assert all(psnr(o, t) > 45 for o, t in zip(made, theirs))


def test_a_mosaic_of_nine_lays_its_images_around_the_first_without_overlap() -> None:
    sizes = [(100, 50), (80, 100), (100, 100), (60, 60), (100, 70), (40, 100), (100, 30), (90, 90), (100, 100)]
    tiles = Mosaic(n=9).tiles(Units([]), 100, sizes)  # no draw
    assert tiles[0].window == (50, 50, 150, 100)  # the first at (S, S) of the 3S canvas, seen from S/2 on
    covered = np.zeros((200, 200), np.int64)
    for tile in tiles:
        x0, y0, x1, y1 = tile.window
        assert 0 <= x0 <= x1 <= 200 and 0 <= y0 <= y1 <= 200
        covered[y0:y1, x0:x1] += 1
    assert covered.max() == 1 and covered.sum() > 0.5 * 200 * 200
    with pytest.raises(ValueError, match="4 images or of 9"):
        Mosaic(n=6)


def polygons_in(boxes: list[list[float]], rng: np.random.Generator) -> list[list[list[float]]]:
    """A convex outline in each box touching its four sides (a hexagon, its corners cut at random)."""
    out = []
    for x0, y0, x1, y1 in boxes:
        a, b = rng.uniform(0.15, 0.45, 2)
        w, h = x1 - x0, y1 - y0
        out.append([[x0 + a * w, y0], [x1, y0], [x1, y1 - b * h], [x1 - a * w, y1], [x0, y1], [x0, y0 + b * h]])
    return out


def segment_cases(tmp_path: Path, recipe: YoloRecipe, rng: np.random.Generator, count: int, share: float = 0.0,
                  segments: bool = True) -> list[dict]:  # fmt: skip
    """`count` cases of `recipe` (copy-paste `share`), each picture's objects outlined where `segments`."""
    cases = []
    for number in range(count):
        case = write_case(tmp_path, number, rng, recipe.sources)
        if segments:
            case["segments"] = [polygons_in(boxes, rng) for boxes in case["boxes"]]
        case.update(units=rng.uniform(0, 1, 16).tolist(), size=SIZE, out=str(tmp_path / f"{number}-ultralytics.npy"),
                    mosaic_p=recipe.mosaic.p if recipe.mosaic is not None else -1.0, fliplr=recipe.fliplr,
                    mosaic_n=recipe.sources if recipe.mosaic is not None else 4, copy_paste=share,
                    flipud=recipe.flipud, affine=dataclass_dict(recipe.affine))  # fmt: skip
        cases.append(case)
    return cases


def case_plan(recipe: YoloRecipe, case: dict) -> Plan:
    """The plan of `case` from its own draws (and its outlines, where it has them)."""
    units = Units(case["units"])
    if recipe.mosaic is None:
        units.random()  # ultralytics' Mosaic(p=0) still draws whether to mosaic
    originals = [(p.shape[1], p.shape[0]) for p in case["pictures"]]
    boxes = [np.array(b, np.float64) for b in case["boxes"]]
    labels = [np.array(v, np.int64) for v in case["labels"]]
    polygons = None
    if "segments" in case:
        polygons = [[[np.array(points, np.float64)] for points in shapes] for shapes in case["segments"]]
    return plan(recipe, units, originals, boxes, labels, polygons=polygons)


@pytest.mark.parametrize("name", ["defaults", "rotation, shear, perspective"])
def test_polygons_give_ultralytics_segment_boxes_for_the_same_draws(tmp_path: Path, name: str) -> None:
    """YOLO-seg through the mosaic and the warp: each box is the box around its outline's visible part, as
    ultralytics' `segment2box`, and the boxes that survive its 1 % area filter are the same."""
    recipe = RECIPES[name]
    rng = np.random.default_rng(40 + list(RECIPES).index(name))
    cases = segment_cases(tmp_path, recipe, rng, 16)
    answers = run_ultralytics(cases)
    errors, tighter = [], 0
    for case, answer in zip(cases, answers):
        originals = [(p.shape[1], p.shape[0]) for p in case["pictures"]]
        boxes = [np.array(b, np.float64) for b in case["boxes"]]
        labels = [np.array(v, np.int64) for v in case["labels"]]
        polygons = [[[np.array(points, np.float64)] for points in shapes] for shapes in case["segments"]]
        made = plan(dataclass_replace(recipe, hsv=None), Units(case["units"]), originals, boxes, labels, polygons=polygons)
        plain = plan(dataclass_replace(recipe, hsv=None), Units(case["units"]), originals, boxes, labels)
        want = np.array(answer["boxes"], np.float64).reshape(-1, 4)
        assert len(made.boxes) == len(want), (name, made.boxes, want)
        assert sorted(made.labels.tolist()) == sorted(int(v) for v in answer["labels"])
        if len(want):
            order_want = np.lexsort(np.round(want, 1).T[::-1])
            order_got = np.lexsort(np.round(made.boxes.astype(np.float64), 1).T[::-1])
            errors.append(float(np.abs(made.boxes[order_got] - want[order_want]).max()))
        assert made.polygons is not None and len(made.polygons) == len(made.boxes)
        for box, parts in zip(made.boxes, made.polygons):  # each box is the bounds of what is left of its outline
            stacked = np.concatenate(parts)
            assert np.allclose([*stacked.min(0), *stacked.max(0)], box, atol=1e-3)
            assert (stacked >= -1e-3).all() and (stacked <= SIZE + 1e-3).all()
        tighter += int(sum(float(np.prod(b[2:] - b[:2])) for b in made.boxes) < sum(float(np.prod(b[2:] - b[:2])) for b in plain.boxes) - 1)
    assert errors and max(errors) < 0.5, (name, [round(e, 2) for e in errors])
    if name != "defaults":
        assert tighter > 0  # a tilted outline's box is tighter than the tilted box's box


def away_from_outlines(made: Plan, margin: float = 2.0) -> np.ndarray:
    """The output pixels over `margin` px from every pasted outline's edge (all of them where none was pasted):
    OpenCV fills an outline at its vertices cut to whole canvas pixels, edge pixels included."""
    size = made.size
    if not made.pasted:
        return np.ones((size, size), bool)
    fills = [fill_polygons([points + (dx, dy) for points in made.pasted], (size, size))
             for dx in (-margin, 0.0, margin) for dy in (-margin, 0.0, margin)]  # fmt: skip
    return np.all([fill == fills[0] for fill in fills], axis=0)


COPY_PASTE = [("defaults", 0.5), ("defaults", 1.0), ("mosaic off", 1.0), ("rotation, shear, perspective", 1.0)]


@pytest.mark.parametrize(("name", "share"), COPY_PASTE)
def test_copy_paste_gives_ultralytics_boxes_and_pixels(tmp_path: Path, name: str, share: float) -> None:
    """Ultralytics' Mosaic, CopyPaste (mode "flip"), RandomPerspective and RandomFlip on YOLO-seg pictures against
    the plan with `copy_paste`: the same boxes (the copies' too) and the mirrored objects' pixels."""
    recipe = dataclass_replace(RECIPES[name], copy_paste=share, hsv=None)
    rng = np.random.default_rng(70 + COPY_PASTE.index((name, share)))
    cases = segment_cases(tmp_path, recipe, rng, 16, share)
    answers = run_ultralytics(cases)
    errors: list[float] = []
    figures: list[float] = []
    whole: list[float] = []
    copies = pasted = 0
    for case, answer in zip(cases, answers):
        made = case_plan(recipe, case)
        want = np.array(answer["boxes"], np.float64).reshape(-1, 4)
        assert len(made.boxes) == len(want), (name, share, made.boxes, made.copied, want)
        assert sorted(made.labels.tolist()) == sorted(int(v) for v in answer["labels"])
        errors += matched_errors(made.boxes.astype(np.float64), want)
        assert made.polygons is not None and len(made.polygons) == len(made.boxes) == len(made.copied)
        copies += int(made.copied.sum())
        pasted += int(made.pasted is not None and fill_polygons(made.pasted, (SIZE, SIZE)).sum() > 20)
        ours = render(made, case["pictures"]).transpose(1, 2, 0)
        theirs = np.load(case["out"])
        away = away_from_seams(made) & away_from_outlines(made)
        figures.append(psnr(ours[away], theirs[away]))
        whole.append(psnr(ours, theirs))
    assert errors and max(errors) < 0.5, (name, share, [round(e, 2) for e in errors])
    assert copies >= 8 and pasted >= 4, (copies, pasted)  # the copies were made, and shown
    assert min(figures) >= MIN_PSNR_DB, (name, share, [round(f, 1) for f in figures])
    assert min(whole) >= MIN_WHOLE_PSNR_DB, (name, share, [round(f, 1) for f in whole])
    print(f"{name}, copy_paste={share}: {copies} copies, {len(errors)} boxes within {max(errors):.3f} px"
          f"; PSNR away from seams and outlines min {min(figures):.1f} dB "
          f"(median {np.median(figures):.1f}), whole min {min(whole):.1f} dB")  # fmt: skip


def matched_errors(got: np.ndarray, want: np.ndarray) -> list[float]:
    """Each box of `got` paired with the nearest unpaired one of `want`: their L-inf distances, each under 0.5 px."""
    free = list(range(len(want)))
    errors = []
    for box in got:
        distances = np.abs(want[free] - box).max(1)
        nearest = int(np.argmin(distances))
        assert distances[nearest] < 0.5, (box, want[free])
        errors.append(float(distances[nearest]))
        free.pop(nearest)
    return errors


DEVICE_RENDER = [(name, 0.0) for name in RECIPES] + [("defaults", 1.0), ("rotation, shear, perspective", 1.0)]


@pytest.mark.parametrize(("name", "share"), DEVICE_RENDER)
def test_render_batch_gives_ultralytics_pixels(tmp_path: Path, name: str, share: float) -> None:
    """`device_render.render_batch` (torch: ultralytics' resize, paste and warp) against ultralytics' own pixels for
    the same draws, to the thresholds `render` meets, the whole batch of cases in one call."""
    import torch

    from pipeline.augment.device_render import render_batch

    recipe = dataclass_replace(RECIPES[name], copy_paste=share, hsv=None)
    rng = np.random.default_rng(90 + DEVICE_RENDER.index((name, share)))
    cases = segment_cases(tmp_path, recipe, rng, 12, share, segments=bool(share))
    run_ultralytics(cases)
    plans = []
    for case in cases:
        plans.append(case_plan(recipe, case))
    pictures = [
        [torch.from_numpy(np.ascontiguousarray(p.transpose(2, 0, 1))) for p in case["pictures"]] for case in cases
    ]
    batch = render_batch(plans, pictures).numpy().transpose(0, 2, 3, 1)
    figures: list[float] = []
    whole: list[float] = []
    for made, case, ours in zip(plans, cases, batch):
        theirs = np.load(case["out"])
        away = away_from_seams(made) & away_from_outlines(made)
        figures.append(psnr(ours[away], theirs[away]))
        whole.append(psnr(ours, theirs))
    if share:
        assert sum(bool(made.pasted) for made in plans) >= 4  # copies were pasted, and shown
    assert min(figures) >= MIN_PSNR_DB, (name, share, [round(f, 1) for f in figures])
    assert min(whole) >= MIN_WHOLE_PSNR_DB, (name, share, [round(f, 1) for f in whole])
    print(f"render_batch, {name}, copy_paste={share}: PSNR against ultralytics away from seams min {min(figures):.1f} dB"
          f" (median {np.median(figures):.1f}), whole min {min(whole):.1f} dB (median {np.median(whole):.1f})")  # fmt: skip
