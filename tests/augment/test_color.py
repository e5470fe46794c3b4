"""ColorJitter: torchvision's arithmetic per image, and the loader's batches jittered in train mode only.

The same images, orders and factors go through torchvision's own
`transforms.v2.functional` adjustments (0.29.1, in the cached "vision"
venv) and through `jitter_batch`: the pixels must agree to a level (float
sums in another order), equal almost everywhere. The loader with
`color_jitter=` (or `augment=[..., ColorJitter(...)]`) changes the pixels
of training batches, the same for the same seed, and never the labels or
an evaluation batch; its float CPU batches are its uint8 ones normalised.
On a CPU device the decode workers jitter each image (inline, threads,
processes; a stand-in for a damaged sample, a mosaic, a sample after the
user's sample_transform): the batches are exactly what the device's
per-batch ColorJitter makes of the unjittered ones with each batch's draws
(`color_draws`), and the fused normalisation in the threads stays on.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from extra_venvs import VISION, venv_python
from loader_data import prepare_labelled, rewrite_shard
from task_data import write_task_dataset

from pipeline import make_loader
from pipeline.augment.color import ColorJitter, jitter_batch, jitter_image
from pipeline.augment.ops import Flip, RandomResizedCrop, loader_settings
from pipeline.loader.device import color_draws

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


def test_an_image_alone_is_jittered_as_in_its_batch() -> None:
    rng = np.random.default_rng(4)
    images = torch.from_numpy(rng.integers(0, 256, (6, 3, 37, 53), dtype=np.uint8))
    jitter = ColorJitter(brightness=0.5, contrast=0.7, saturation=0.6, hue=0.4)
    draws = [jitter.draw(rng) for _ in range(len(images))]
    batch = jitter_batch(images, draws)
    for image, draw, jittered in zip(images, draws, batch):
        assert torch.equal(jitter_image(image, draw), jittered)
        assert torch.equal(jitter_image(image.flip(2), draw).flip(2), jittered)  # mirrored first: the same pixels
    with pytest.raises(ValueError, match="jitter_image"):
        jitter_image(images, draws[0])


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
    # float batches on the CPU: the uint8 pixels, jittered, then normalised (by the decode threads, as they write them)
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


JITTER = (0.5, 0.5, 0.5, 0.1)
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
WORKERS = {"inline": {"num_workers": 0}, "threads": {"num_workers": 2},
           "processes": {"num_workers": 2, "worker_type": "process"}}  # fmt: skip


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The labelled images with one image's bytes broken: its position gets a stand-in, jittered as its own."""
    root = prepare_labelled(tmp_path_factory.mktemp("color-damaged"), "jitter", 24)
    rewrite_shard(root, "shard-000000.tar", lambda index, members: {**members, "jpg": b"no jpeg"} if index == 3 else members)
    return root


Batches = list[tuple[torch.Tensor, Any]]  # (images, labels or boxes) of each batch


def _epoch(dataset: Path, epoch: int, **options: object) -> tuple[Batches, dict[str, int]]:
    """The batches of `epoch`, and what the loader says of it: samples replaced, CPU output buffers kept."""
    loader = make_loader(str(dataset), 8, device="cpu", crop=48, seed=5, **options)  # type: ignore[arg-type]
    loader.set_epoch(epoch)
    try:
        got = []
        for batch in loader:
            images, rest = (batch[0], batch[1]) if isinstance(batch, tuple) else (batch.images, batch.boxes)
            got.append((images.clone(), rest))
        return got, {"replaced": loader.stats.replaced, "buffers": len(loader._finish.outputs)}
    finally:
        loader.close()


def _on_the_device(batches: Batches, epoch: int) -> list[torch.Tensor]:
    """What the device's per-batch ColorJitter (`DeviceFinish._color_jitter`) makes of unjittered uint8 batches."""
    jitter = ColorJitter(*JITTER)
    return [jitter_batch(images, color_draws(jitter, 5, epoch, 0, index, len(images))) for index, (images, _) in enumerate(batches)]


def _normalised(images: torch.Tensor) -> torch.Tensor:
    """The device's float finish (`DeviceFinish._scale_shift`) of uint8 batches."""
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1) * 255.0, torch.tensor(STD).view(1, 3, 1, 1) * 255.0
    return images.float().mul_(1.0 / std).add_(-mean / std)


@pytest.mark.parametrize("workers", WORKERS.values(), ids=WORKERS.keys())
def test_on_a_cpu_device_the_workers_jitter_as_the_device_does(damaged: Path, workers: dict[str, object]) -> None:
    threads = workers.get("worker_type", "thread") == "thread"
    for epoch in (0, 1):
        plain, _ = _epoch(damaged, epoch, dtype="uint8", **workers)
        jittered, said = _epoch(damaged, epoch, dtype="uint8", color_jitter=JITTER, **workers)
        expected = _on_the_device(plain, epoch)
        assert said["replaced"] == 1 and len(jittered) == len(expected) == 3
        assert all(torch.equal(a[1], b[1]) for a, b in zip(plain, jittered))
        assert all(torch.equal(images, want) for (images, _), want in zip(jittered, expected))
        assert all(not torch.equal(a[0], b[0]) for a, b in zip(plain, jittered))
    floats, said = _epoch(damaged, 1, color_jitter=JITTER, mean=MEAN, std=STD, **workers)
    assert all(torch.equal(images, _normalised(want)) for (images, _), want in zip(floats, expected))
    assert bool(said["buffers"]) == threads  # the threads normalise into the output as they jitter: the fused finish
    evaluation = [_epoch(damaged, 0, dtype="uint8", train=False, **workers, **jitter)[0] for jitter in ({}, {"color_jitter": JITTER})]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(*evaluation))


@pytest.fixture(scope="module")
def detection(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Boxes on pictures, one of them broken (a mosaic showing it gets a stand-in)."""
    root = write_task_dataset(tmp_path_factory.mktemp("color-boxes") / "ds", "detection", 16, fmt="JPEG", size=(96, 72))
    rewrite_shard(root, "shard-000000.tar", lambda index, members: {**members, "jpg": b"no jpeg"} if index == 2 else members)
    return root


def swap_red_and_blue(sample: dict) -> dict:  # top level: process workers get it by pickle
    return {**sample, "image": np.ascontiguousarray(sample["image"][:, :, ::-1])}


TASKS = {"yolo-threads": {"recipe": "yolo"}, "yolo-processes": {"recipe": "yolo", "worker_type": "process"},
         "sample_transform": {"recipe": "letterbox", "sample_transform": swap_red_and_blue}}  # fmt: skip


@pytest.mark.parametrize("options", TASKS.values(), ids=TASKS.keys())
def test_a_tasks_samples_are_jittered_in_the_workers_after_all_else(detection: Path, options: dict[str, object]) -> None:
    """A mosaic after its HSV gains, a sample after the user's sample_transform: then its ColorJitter."""
    plain, _ = _epoch(detection, 0, dtype="uint8", num_workers=2, **options)
    jittered, said = _epoch(detection, 0, dtype="uint8", num_workers=2, color_jitter=JITTER, **options)
    assert said["replaced"] >= 1
    floats, _ = _epoch(detection, 0, num_workers=2, color_jitter=JITTER, mean=MEAN, std=STD, **options)
    expected = _on_the_device(plain, 0)
    for (images, boxes), (floated, _), (_, plain_boxes), want in zip(jittered, floats, plain, expected):
        assert torch.equal(images, want) and torch.equal(floated, _normalised(want))
        assert all(torch.equal(a, b) for a, b in zip(boxes, plain_boxes))
