"""ColorJitter: torchvision's arithmetic per image, and the loader's batches jittered in train mode only.

The same images, orders and factors go through torchvision's own
`transforms.v2.functional` adjustments (0.29.1, in the cached "vision"
venv) and through `jitter_batch`: the pixels must agree to a level (float
sums in another order), equal almost everywhere. The loader with
`color_jitter=` (or `augment=[..., ColorJitter(...)]`) changes the pixels
of training batches, the same for the same seed, and never the labels or
an evaluation batch; its float CPU batches are its uint8 ones normalised.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from extra_venvs import VISION, venv_python
from loader_data import prepare_labelled

from pipeline import make_loader
from pipeline.augment.color import ColorJitter, jitter_batch
from pipeline.augment.ops import Flip, RandomResizedCrop, loader_settings

TORCHVISION_SCRIPT = r"""
import json, sys
import numpy as np
import torch
from torchvision.transforms.v2 import functional as F

case = json.load(sys.stdin)
images = torch.from_numpy(np.load(case["images"]))
adjust = [F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue]
out = []
for image, (order, factors) in zip(images, case["draws"]):
    for k in order:
        if factors[k] is not None:
            image = adjust[k](image, factors[k])
    out.append(image)
np.save(case["out"], torch.stack(out).numpy())
"""


def test_the_adjustments_are_torchvisions(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (12, 3, 24, 20), dtype=np.uint8)
    images[:, :, :8] = images[:, :1, :8]  # grey rows: hue and saturation leave them
    images[:3] = np.linspace(0, 255, 3 * 24 * 20).reshape(3, 24, 20).astype(np.uint8)  # smooth ramps
    jitter = ColorJitter(brightness=0.6, contrast=0.6, saturation=0.8, hue=0.3)
    draws = [jitter.draw(rng) for _ in range(len(images))]
    draws[0] = ((3, 2, 1, 0), (None, None, None, 0.5))  # hue alone, half way round
    draws[1] = ((0, 1, 2, 3), (1.6, None, None, None))  # brightness past 255
    draws[2] = ((1, 0, 3, 2), (None, 0.0, 0.0, None))  # contrast and saturation to grey
    np.save(tmp_path / "images.npy", images)
    case = {"images": str(tmp_path / "images.npy"), "draws": draws, "out": str(tmp_path / "theirs.npy")}
    python = venv_python("vision", VISION)
    done = subprocess.run([str(python), "-c", TORCHVISION_SCRIPT], input=json.dumps(case), capture_output=True,
                          text=True, timeout=300, check=False, env={**os.environ})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = np.load(tmp_path / "theirs.npy").astype(int)
    ours = jitter_batch(torch.from_numpy(images), draws).numpy().astype(int)
    difference = np.abs(ours - theirs)
    assert difference.max() <= 1 and (difference == 0).mean() > 0.99, (difference.max(), (difference == 0).mean())
    assert (ours != images).any(axis=(1, 2, 3)).all()  # every image changed


def test_a_draw_skips_the_adjustments_whose_range_is_zero() -> None:
    rng = np.random.default_rng(0)
    order, factors = ColorJitter(brightness=0.2).draw(rng)
    assert sorted(order) == [0, 1, 2, 3] and factors[1:] == (None, None, None) and 0.8 <= factors[0] <= 1.2
    assert not ColorJitter().active and ColorJitter(hue=0.1).active
    image = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (2, 3, 9, 9), dtype=np.uint8))
    assert torch.equal(jitter_batch(image, [((0, 1, 2, 3), (None, None, None, None))] * 2), image)
    for bad in ({"hue": 0.6}, {"brightness": -0.1}, {"saturation": float("nan")}, {"contrast": True}):
        with pytest.raises(ValueError, match="ColorJitter"):
            ColorJitter(**bad)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_labelled(tmp_path_factory.mktemp("color"), "jitter", 24)


def _batches(dataset: Path, **options: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    options = {"device": "cpu", **options}
    loader = make_loader(str(dataset), 8, crop=48, num_workers=2, seed=5, **options)  # type: ignore[arg-type]
    return [(images.clone(), labels.clone()) for images, labels in loader]


def test_the_loader_jitters_training_batches_only(dataset: Path) -> None:
    plain = _batches(dataset, dtype="uint8")
    jittered = _batches(dataset, dtype="uint8", color_jitter=(0.5, 0.5, 0.5, 0.1))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(plain, jittered))  # the same samples, labels untouched
    changed = [not torch.equal(a[0], b[0]) for a, b in zip(plain, jittered)]
    assert all(changed), changed
    assert all(torch.equal(a[0], b[0]) for a, b in zip(jittered, _batches(dataset, dtype="uint8", color_jitter=(0.5, 0.5, 0.5, 0.1))))
    as_ops = _batches(dataset, dtype="uint8", augment=[RandomResizedCrop(), Flip(), ColorJitter(0.5, 0.5, 0.5, 0.1)])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(jittered, as_ops))
    evaluation = [_batches(dataset, dtype="uint8", train=False, color_jitter=jitter) for jitter in ((0, 0, 0, 0), (0.5, 0.5, 0.5, 0.1))]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(*evaluation))
    # float batches on the CPU: the uint8 pixels, jittered, then normalised (the fused normalisation stands aside)
    floats = _batches(dataset, color_jitter=(0.5, 0.5, 0.5, 0.1), mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    assert all(torch.allclose(f[0] * 255, j[0].float(), atol=1e-3) for f, j in zip(floats, jittered))


def test_the_op_list_and_the_setting_are_checked(dataset: Path) -> None:
    from pipeline import ConfigError

    settings = loader_settings([RandomResizedCrop(), ColorJitter(brightness=0.3, hue=0.05)])
    assert settings["color_jitter"] == (0.3, 0.0, 0.0, 0.05) and settings["recipe"] == "crop"
    for ops, reason in (([ColorJitter()], "besides ColorJitter"), ([RandomResizedCrop(), ColorJitter(), ColorJitter()], "at most one")):
        with pytest.raises(ConfigError, match=reason):
            loader_settings(ops)
    with pytest.raises(ConfigError, match="hue"):
        make_loader(str(dataset), 8, device="cpu", color_jitter=(0.1, 0.1, 0.1, 0.7))
    with pytest.raises(ConfigError, match="not both"):
        make_loader(str(dataset), 8, device="cpu", color_jitter=(0.1, 0, 0, 0), augment=[RandomResizedCrop(), ColorJitter(0.2)])


@pytest.mark.cuda
def test_cuda_batches_are_jittered_as_the_cpus(dataset: Path) -> None:
    on_cpu = _batches(dataset, dtype="uint8", color_jitter=(0.5, 0.5, 0.5, 0.1))
    on_cuda = _batches(dataset, dtype="uint8", color_jitter=(0.5, 0.5, 0.5, 0.1), device="cuda")
    for (a, _), (b, _) in zip(on_cpu, on_cuda):
        difference = (a.int() - b.cpu().int()).abs()
        assert difference.max() <= 1 and (difference == 0).float().mean() > 0.99
