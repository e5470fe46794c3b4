"""The loader's delivered boxes, masks and pixels against the real transforms.v2, replaying each sample's geometry.

A COCO detection dataset of JPEGs of odd sizes (203x151, 151x97, and 643x483,
which the loader decodes DCT-scaled at M/8 for its downscales), each a
bright rectangle whose edges are its first box, with tiny and edge-touching
boxes and polygon shapes (so the shards carry mask.png and instances.png),
is prepared without a resize and loaded with every recipe: random-resized
crops and flips, the eval centre crop, letterbox (train, with flips, and
eval), and scale_jitter both padded and windowed. Each delivered sample's
`geometry` field says which part of the stored image it shows, where, and
whether mirrored; the stored sample, read back from its shard, goes through
what a torchvision user writes for that geometry: `v2.functional.resized_crop`
of the integer box (antialiased), or `Resize(S / 0.875)` then `CenterCrop(S)`
in eval, then `pad` (the fill; the ignore index for the class mask, 0 for
the instances) and `horizontal_flip`. v2 runs in the cached torchvision venv
(`extra_venvs`).

- boxes: v2's, less the degenerate ones v2 keeps and gpufeed drops, to
  float precision (a windowed scale_jitter reads a fractional box, which v2
  replays on the boxes alone);
- the class mask and each instance's mask: v2's, pixel for pixel;
- pixels: close to v2's (PSNR and mean absolute difference, with floors set
  below what was measured), and each edge of the rectangle where the
  delivered box says it is, as far as the 50 % crossing can tell
  (`step_edges`): no further off than v2's own pixels are from v2's box,
  plus EDGE_MARGIN at each edge and MEAN_EDGE_MARGIN on average over a run
  (a fractional window, whose pixels v2 cannot replay, against v2's worst
  and mean anywhere); a slip of a quarter of a pixel fails.

The region decoder (the default), simplejpeg and Pillow all deliver, in the
calling thread and in worker threads.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from extra_venvs import venv_python
from PIL import Image

from pipeline import PrepareSpec, ResizeSpec, make_loader, prepare_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "prepare"))
from step_edges import edge_errors, halo, psnr, step_picture  # noqa: E402
from test_transforms_v2 import TORCHVISION  # noqa: E402

CROP = 96
EVAL_FRACTION = 0.875
SHAPES = [(203, 151)] * 4 + [(151, 97)] * 4 + [(643, 483)] * 2  # stored width x height
RUNS: dict[str, dict[str, Any]] = {
    "crop-train": {"train": True, "recipe": "crop", "scale": (0.25, 1.0)},
    "crop-train-pil": {"train": True, "recipe": "crop", "scale": (0.25, 1.0), "decoder": "pil", "seed": 4},
    "crop-eval": {"train": False, "recipe": "crop"},
    "crop-eval-simplejpeg": {"train": False, "recipe": "crop", "decoder": "simplejpeg", "num_workers": 2},
    "letterbox-train": {"train": True, "recipe": "letterbox", "num_workers": 2},
    "letterbox-eval": {"train": False, "recipe": "letterbox"},
    "jitter-pad": {"train": True, "recipe": "scale_jitter", "jitter": (0.4, 0.95)},
    "jitter-window": {"train": True, "recipe": "scale_jitter", "jitter": (1.2, 2.0)},
}
MIN_PSNR_DB = 33.0  # measured: 36.8 dB at the least (DCT-scaled decodes); half a pixel of slip: 29-32 at a run's worst
MAX_MEAN_ABS = 2.0  # measured: 1.4 at the most; half a pixel of slip: 2.1-3.9 at a run's worst
EDGE_MARGIN = 0.25  # px beyond v2's own error at the same edge (measured: 0.08 at the most)
MEAN_EDGE_MARGIN = 0.08  # px beyond v2's mean error over a run's edges (measured: 0.004 at the most)
V2_SCRIPT = r"""
import json, sys
import numpy as np
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

FILL = {"image": 114, "mask": 255, "instances": 0}


def apply(op, name, item):
    kind, *args = op
    if kind == "resized_crop":
        top, left, height, width, out_h, out_w = args
        return F.resized_crop(item, top, left, height, width, [out_h, out_w], antialias=True)
    if kind == "crop":
        return F.crop(item, *args)
    if kind == "resize":
        return F.resize(item, list(args), antialias=True)
    if kind == "shorter":
        return v2.Resize(args[0])(item)
    if kind == "center_crop":
        return v2.CenterCrop(args[0])(item)
    if kind == "pad":
        return F.pad(item, list(args), fill=FILL.get(name, 0))
    assert kind == "hflip", kind
    return F.horizontal_flip(item)


answers = []
for case in json.load(sys.stdin):
    image = Image.open(case["image"]).convert("RGB")
    width, height = image.size
    items = {"boxes": tv_tensors.BoundingBoxes(case["boxes"], format="XYXY", canvas_size=(height, width))}
    if case["pixels"]:
        items["image"] = tv_tensors.Image(torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1))
        for name in ("mask", "instances"):
            items[name] = tv_tensors.Mask(torch.from_numpy(np.asarray(Image.open(case[name])).copy()))
    for op in case["ops"]:
        items = {name: apply(op, name, item) for name, item in items.items()}
    if case["pixels"]:
        np.save(case["out"] + "-image.npy", items["image"].permute(1, 2, 0).numpy())
        np.save(case["out"] + "-mask.npy", items["mask"].numpy())
        np.save(case["out"] + "-instances.npy", items["instances"].numpy())
    answers.append(items["boxes"].tolist())
print(json.dumps(answers))
"""


def write_coco(root: Path) -> str:
    """The pictures (`step_picture`) and their COCO annotations, each shape a polygon: returns the JSON's path.

    Boxes: 0 the rectangle, 1 a tiny one in the bottom-right corner, 2 a
    strip along the left, top and bottom edges, 3 a tiny one inside the
    rectangle (painted over it), 4 one with fractional corners.
    """
    rng = np.random.default_rng(17)
    root.mkdir(parents=True)
    images, annotations = [], []
    for number, (width, height) in enumerate(SHAPES):
        rect_w, rect_h = int(width * rng.uniform(0.4, 0.55)), int(height * rng.uniform(0.4, 0.55))
        x0, y0 = int(rng.integers(8, width - rect_w - 8)), int(rng.integers(8, height - rect_h - 8))
        rect = (x0, y0, x0 + rect_w, y0 + rect_h)
        assert halo(width, height) < min(width, height)
        name = f"{number:03d}.jpg"
        Image.fromarray(step_picture(width, height, rect, number)).save(root / name, quality=95)
        images.append({"id": number, "file_name": name, "width": width, "height": height})
        cx, cy = (rect[0] + rect[2]) // 2, (rect[1] + rect[3]) // 2
        boxes = [
            (*rect, 1),
            (width - 3.0, height - 2.0, float(width), float(height), 2),
            (0.0, 0.0, 5.0, float(height), 3),
            (cx - 1.0, cy - 1.0, cx + 1.0, cy + 1.0, 2),
            (7.5, 3.25, 7.5 + 0.3 * width, 3.25 + 0.25 * height, 1),
        ]
        for x_0, y_0, x_1, y_1, category in boxes:
            annotations.append({
                "id": len(annotations) + 1, "image_id": number, "category_id": category, "iscrowd": 0,
                "bbox": [x_0, y_0, x_1 - x_0, y_1 - y_0], "area": (x_1 - x_0) * (y_1 - y_0),
                "segmentation": [[x_0, y_0, x_1, y_0, x_1, y_1, x_0, y_1]],
            })  # fmt: skip
    categories = [{"id": k, "name": f"c{k}"} for k in (1, 2, 3)]
    path = root / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return str(path)


def stored_samples(out: Path, folder: Path) -> dict[str, dict[str, Any]]:
    """Each prepared sample by key: its image, mask.png and instances.png written to `folder`, and its boxes."""
    found: dict[str, dict[str, Any]] = {}
    for shard in sorted(out.glob("shard-*.tar")):
        members: dict[str, dict[str, bytes]] = {}
        with tarfile.open(shard) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                members.setdefault(key, {})[ext] = tar.extractfile(member).read()  # type: ignore[union-attr]
        for key, parts in members.items():
            sample: dict[str, Any] = {"boxes": np.load(io.BytesIO(parts["boxes.npy"])).astype(np.float64)}
            for ext in ("jpg", "mask.png", "instances.png"):
                path = folder / f"{key.replace('/', '_')}.{ext}"
                path.write_bytes(parts[ext])
                sample[ext] = str(path)
            with Image.open(sample["jpg"]) as image:
                sample["size"] = image.size
            found[key] = sample
    return found


def v2_ops(run: str, geometry: dict[str, Any]) -> tuple[list[list[Any]], bool]:
    """What a torchvision user writes for the sample's geometry, and whether v2 can replay its pixels too."""
    (sx0, sy0, sx1, sy1), (ox0, oy0, ox1, oy1) = geometry["source_box"], geometry["output_box"]
    if run.startswith("crop-eval"):
        ops: list[list[Any]] = [["shorter", round(CROP / EVAL_FRACTION)], ["center_crop", CROP]]
        pixels = True
    elif all(float(v).is_integer() for v in (sx0, sy0, sx1, sy1)):
        ops = [["resized_crop", int(sy0), int(sx0), int(sy1 - sy0), int(sx1 - sx0), oy1 - oy0, ox1 - ox0]]
        pixels = True
    else:  # a fractional window: v2's crop takes whole pixels, so only the boxes follow it
        ops = [["crop", sy0, sx0, sy1 - sy0, sx1 - sx0], ["resize", oy1 - oy0, ox1 - ox0]]
        pixels = False
    if (ox0, oy0, ox1, oy1) != (0, 0, CROP, CROP):
        ops.append(["pad", ox0, oy0, CROP - ox1, CROP - oy1])
    if geometry["flip"]:
        ops.append(["hflip"])
    return ops, pixels


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Per run, each delivered sample beside v2's replay of it."""
    python = venv_python("vision", TORCHVISION)
    base = tmp_path_factory.mktemp("loader-v2")
    out = base / "out"
    spec = PrepareSpec(write_coco(base / "coco"), str(out), resize=ResizeSpec(mode="none"), min_visible=0.0)
    prepare_dataset(spec, workers=0)
    (base / "stored").mkdir()
    (base / "v2").mkdir()
    stored = stored_samples(out, base / "stored")
    runs: dict[str, list[dict[str, Any]]] = {}
    cases = []
    for run, settings in RUNS.items():
        settings = {"seed": 3, "num_workers": 0, **settings}
        loader = make_loader(out, 5, device="cpu", crop=CROP, dtype="uint8", drop_last=False, fields=("geometry", "key"),
                             min_visible=0.0, **settings)  # fmt: skip
        samples = []
        for batch in loader:
            for index, key in enumerate(batch.keys):
                geometry = batch.fields["geometry"][index]
                ops, pixels = v2_ops(run, geometry)
                sample = stored[key]
                prefix = str(base / "v2" / f"{run}-{key.replace('/', '_')}")
                cases.append({"image": sample["jpg"], "mask": sample["mask.png"], "instances": sample["instances.png"],
                              "boxes": sample["boxes"].tolist(), "ops": ops, "pixels": pixels, "out": prefix})  # fmt: skip
                samples.append({
                    "key": key, "geometry": geometry, "prefix": prefix, "pixels": pixels, "size": sample["size"],
                    "image": batch.images[index].numpy().transpose(1, 2, 0).copy(),
                    "boxes": batch.boxes[index].numpy().astype(np.float64),
                    "mask": batch.masks[index].numpy(),
                    "instances": batch.targets[index]["masks"].numpy(),
                })  # fmt: skip
        assert sorted(s["key"] for s in samples) == sorted(stored), run  # every sample, once
        runs[run] = samples
    done = subprocess.run([str(python), "-c", V2_SCRIPT], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    answers = iter(json.loads(done.stdout))
    for samples in runs.values():
        for sample in samples:
            sample["v2_boxes"] = np.array(next(answers), np.float64).reshape(-1, 4)
            if sample["pixels"]:
                for name in ("image", "mask", "instances"):
                    sample[f"v2_{name}"] = np.load(f"{sample['prefix']}-{name}.npy")
    return runs


def zoom_of(geometry: dict[str, Any]) -> float:
    """Output pixels per stored pixel (the larger of the two axes')."""
    (sx0, sy0, sx1, sy1), (ox0, oy0, ox1, oy1) = geometry["source_box"], geometry["output_box"]
    return max((ox1 - ox0) / (sx1 - sx0), (oy1 - oy0) / (sy1 - sy0))


def scales(sample: dict[str, Any]) -> tuple[float, float]:
    """The zoom, and the picture's flat surround in output pixels (`step_edges.edge_errors` takes both)."""
    geometry = sample["geometry"]
    (sx0, sy0, sx1, sy1), (ox0, oy0, ox1, oy1) = geometry["source_box"], geometry["output_box"]
    least = min((ox1 - ox0) / (sx1 - sx0), (oy1 - oy0) / (sy1 - sy0))
    return zoom_of(geometry), halo(*sample["size"]) * least


@pytest.mark.parametrize("run", list(RUNS))
def test_delivered_boxes_and_masks_equal_v2(replayed: dict[str, list[dict[str, Any]]], run: str) -> None:
    samples = replayed[run]
    flips = [s["geometry"]["flip"] for s in samples]
    if RUNS[run]["train"]:
        assert any(flips) and not all(flips), run  # both ways
    else:
        assert not any(flips)
    worst = 0.0
    for sample in samples:
        want = sample["v2_boxes"]
        kept = (want[:, 2] > want[:, 0]) & (want[:, 3] > want[:, 1])  # v2 keeps degenerate boxes; gpufeed drops them
        got = sample["boxes"]
        assert got.shape == want[kept].shape, (run, sample["key"], got, want)
        if len(got):
            worst = max(worst, float(np.abs(got - want[kept]).max()))
        if not sample["pixels"]:
            continue
        np.testing.assert_array_equal(sample["mask"], sample["v2_mask"], err_msg=f"{run} {sample['key']}")
        ids = np.flatnonzero(kept) + 1
        own = (sample["v2_instances"][None] == ids[:, None, None]).astype(np.uint8)
        np.testing.assert_array_equal(sample["instances"], own, err_msg=f"{run} {sample['key']} instances")
    assert worst < 1e-3, (run, worst)


def test_the_runs_cover_dct_scaling_windows_and_padding(replayed: dict[str, list[dict[str, Any]]]) -> None:
    """The cases the module promises: downscales past 2x (DCT-scaled decodes), upscales, windows, padding."""
    zooms = [zoom_of(s["geometry"]) for samples in replayed.values() for s in samples]
    assert sum(zoom < 0.5 for zoom in zooms) >= 6 and sum(zoom > 1 for zoom in zooms) >= 6
    assert not any(s["pixels"] for s in replayed["jitter-window"])  # fractional windows, every one
    assert all(s["geometry"]["output_box"] != [0, 0, CROP, CROP] for s in replayed["letterbox-eval"])
    assert all(s["geometry"]["output_box"] != [0, 0, CROP, CROP] for s in replayed["jitter-pad"])


def v2_edge_errors(replayed: dict[str, list[dict[str, Any]]]) -> np.ndarray:
    """v2's own edge errors over every replayed sample: what the measurement can tell."""
    found: list[float] = []
    for samples in replayed.values():
        for sample in samples:
            if sample["pixels"] and (sample["v2_boxes"][0, 2:] > sample["v2_boxes"][0, :2]).all():
                region = tuple(sample["geometry"]["output_box"])
                found += edge_errors(sample["v2_image"], tuple(sample["v2_boxes"][0]), region, *scales(sample)).values()
    return np.abs(found)


@pytest.mark.parametrize("run", list(RUNS))
def test_delivered_pixels_agree_with_v2(replayed: dict[str, list[dict[str, Any]]], run: str) -> None:
    floor = v2_edge_errors(replayed)
    ours_all, theirs_all = [], []
    for sample in replayed[run]:
        geometry, key = sample["geometry"], sample["key"]
        region = tuple(geometry["output_box"])
        if sample["pixels"]:
            ratio = psnr(sample["image"], sample["v2_image"])
            mean_abs = float(np.abs(sample["image"].astype(int) - sample["v2_image"].astype(int)).mean())
            assert ratio > MIN_PSNR_DB and mean_abs < MAX_MEAN_ABS, (run, key, ratio, mean_abs, geometry)
        if not (sample["v2_boxes"][0, 2:] > sample["v2_boxes"][0, :2]).all():
            continue  # the rectangle is cropped away (so it is not the first box delivered)
        ours = edge_errors(sample["image"], tuple(sample["boxes"][0]), region, *scales(sample))
        theirs = {}
        if sample["pixels"]:
            theirs = edge_errors(sample["v2_image"], tuple(sample["v2_boxes"][0]), region, *scales(sample))
        for name, error in ours.items():
            bound = abs(theirs[name]) if name in theirs else floor.max()  # a window: v2's worst anywhere
            assert abs(error) <= bound + EDGE_MARGIN, (run, key, name, error, theirs.get(name), geometry)
            ours_all.append(abs(error))
            theirs_all.append(abs(theirs[name]) if name in theirs else floor.mean())
    assert len(ours_all) >= 12, (run, len(ours_all))
    # no bias either: on average as near the box as v2's pixels are to v2's (a slip of 0.25 px fails here)
    assert np.mean(ours_all) <= np.mean(theirs_all) + MEAN_EDGE_MARGIN, (run, np.mean(ours_all), np.mean(theirs_all))
