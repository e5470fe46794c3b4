"""gpufeed's resize sizes and centre crops against the real torchvision.transforms.v2.

torchvision does not load beside this venv's CPU torch, so v2 runs in a
cached venv of its own (`extra_venvs.VISION`: torch 2.14.1 + torchvision 0.29.1 + ultralytics, a
CUDA build that runs on the CPU, built once into gpufeed's user cache) and
answers in JSON; the test compares gpufeed's geometry with it, box for box.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from extra_venvs import VISION, venv_python

from pipeline.loader.crops import CropSpec, centre_crop_box
from pipeline.prepare.transforms import center_crop_box, output_size
from pipeline.specs import ResizeSpec

TORCHVISION = VISION  # torchvision 0.29.1 (with ultralytics, in one venv)
SIZES = [(641, 479), (479, 641), (300, 200), (257, 256), (227, 224), (1000, 333), (333, 1000), (225, 224), (643, 483)]
V2_SCRIPT = r"""
import json, sys
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

cases = json.load(sys.stdin)
answers = []
for width, height, size, resize in cases:
    image = tv_tensors.Image(torch.zeros(3, height, width, dtype=torch.uint8))
    box = tv_tensors.BoundingBoxes([[1.5, 2.5, width - 3.25, height - 1.75]], format="XYXY", canvas_size=(height, width))
    shorter = v2.Resize(size)(image).shape[-2:]
    longer = v2.Resize(None, max_size=size)(image).shape[-2:]
    _, cropped = v2.Compose([v2.Resize(size), v2.CenterCrop(size)])(image, box)
    _, evaluated = v2.Compose([v2.Resize(resize), v2.CenterCrop(size)])(image, box)
    answers.append({"shorter": [shorter[1], shorter[0]], "longer": [longer[1], longer[0]],
                    "center_crop": cropped.tolist()[0], "eval": evaluated.tolist()[0]})
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def v2_answers() -> list[dict]:
    python = venv_python("vision", TORCHVISION)
    cases = [[w, h, 224, 256] for w, h in SIZES]
    done = subprocess.run(
        [str(python), "-c", V2_SCRIPT], input=json.dumps(cases), capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def seen_through(box: tuple[float, float, float, float], crop: tuple[float, float, float, float]) -> list[float]:
    """The test box as a crop (left, top, right, bottom of the original) resized to 224 shows it, clamped as v2 clamps."""
    x0, y0, x1, y1 = crop
    sx, sy = 224 / (x1 - x0), 224 / (y1 - y0)
    moved = [(box[0] - x0) * sx, (box[1] - y0) * sy, (box[2] - x0) * sx, (box[3] - y0) * sy]
    return [min(max(value, 0.0), 224.0) for value in moved]


@pytest.mark.parametrize("index", range(len(SIZES)))
def test_resize_sizes_and_centre_crops_equal_v2(v2_answers: list[dict], index: int) -> None:
    width, height = SIZES[index]
    want = v2_answers[index]
    box = (1.5, 2.5, width - 3.25, height - 1.75)
    assert output_size(ResizeSpec(size=224, mode="shorter", upscale=True), width, height) == tuple(want["shorter"])
    assert output_size(ResizeSpec(size=224, mode="longer", upscale=True), width, height) == tuple(want["longer"])
    crop, side = center_crop_box(ResizeSpec(size=224, mode="center-crop", upscale=True), width, height)
    assert side == 224 and seen_through(box, crop) == pytest.approx(want["center_crop"], abs=1e-3)
    left, top, w, h = centre_crop_box(width, height, CropSpec(224, False))  # the loader's eval crop: 256 then 224
    assert seen_through(box, (left, top, left + w, top + h)) == pytest.approx(want["eval"], abs=1e-3)
