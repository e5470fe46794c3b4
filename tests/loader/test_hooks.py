"""The user's hooks in real loader epochs: what they return is checked at once, what they raise is theirs.

A `sample_transform` or `batch_transform` that returns something a batch
cannot take (boxes as strings, a mask of another size than the image, None,
a list) stops the epoch with a `HookError`, a ConfigError whose message
names the hook, the field, what was expected and what came, in thread and
process workers alike; an exception the hook raises itself reaches the
training loop as it is.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline import ConfigError, HookError, make_loader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from task_data import CLASSES, write_task_dataset  # noqa: E402

pytestmark = pytest.mark.timeout(60)

CROP = 32


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hooks")
    return {task: write_task_dataset(base / task, task, 8, shard_samples=8, size=(48, 40)) for task in ("detection", "segmentation")}


def loader_for(root: Path, **options: Any):
    settings: dict[str, Any] = {"device": "cpu", "crop": CROP, "num_workers": 2, "dtype": "uint8", "seed": 1}
    settings.update(options)
    return make_loader(root, 4, **settings)


# Hooks at the top level of the module: process workers get them by pickle.
def boxes_as_strings(sample: dict) -> dict:
    return {**sample, "boxes": [["a", "b", "c", "d"]] * len(sample["boxes"])}


def mask_of_another_shape(sample: dict) -> dict:
    return {**sample, "mask": np.zeros((CROP // 2, CROP), np.uint8)}


def returns_none(sample: dict) -> None:
    return None


def returns_a_list(sample: dict) -> list:
    return [sample["image"]]


def labels_past_the_classes(sample: dict) -> dict:
    return {**sample, "box_labels": np.full(len(sample["boxes"]), 77, np.int64)}


def one_box_fewer(sample: dict) -> dict:
    return {**sample, "boxes": sample["boxes"][1:]}


def image_as_float(sample: dict) -> dict:
    return {**sample, "image": sample["image"].astype(np.float32)}


class TheUsersOwnError(Exception):
    pass


def raises_its_own(sample: dict) -> dict:
    raise TheUsersOwnError(f"no luck with {sample['key']}")


def slow(sample: dict) -> dict:
    time.sleep(0.25)
    return sample


def all_boxes_dropped(sample: dict) -> dict:
    """A valid edit: no boxes left, given as plain empty lists."""
    return {**sample, "boxes": [], "box_labels": [], "iscrowd": []}


BAD_SAMPLE_HOOKS = {  # hook -> (task, what the message must say)
    boxes_as_strings: ("detection", ["'boxes'", "expected a float array of shape (N, 4)", "<U1"]),
    mask_of_another_shape: ("segmentation", ["'mask'", f"({CROP}, {CROP})", f"({CROP // 2}, {CROP})"]),
    returns_none: ("detection", ["returned None", "expected the sample dict"]),
    returns_a_list: ("segmentation", ["returned a list of 1", "expected the sample dict"]),
    labels_past_the_classes: ("detection", ["'box_labels'", f"0 to {len(CLASSES) - 1}", "holding 77"]),
    one_box_fewer: ("detection", ["'box_labels'", "expected an integer array of shape"]),
    image_as_float: ("segmentation", ["'image'", "float32", f"a uint8 array of shape ({CROP}, {CROP}, 3)"]),
}


@pytest.mark.parametrize("hook", list(BAD_SAMPLE_HOOKS), ids=lambda hook: hook.__name__)
def test_a_sample_transform_returning_what_a_batch_cannot_take_is_a_hook_error(datasets: dict[str, Path], hook: Any) -> None:
    task, said = BAD_SAMPLE_HOOKS[hook]
    worker_type = "process" if hook in (boxes_as_strings, mask_of_another_shape) else "thread"
    for on_error in ("skip", "raise"):  # a hook's mistake is not damage to skip
        with pytest.raises(HookError) as raised:
            list(loader_for(datasets[task], sample_transform=hook, worker_type=worker_type, on_error=on_error))
        message = str(raised.value)
        assert isinstance(raised.value, ConfigError) and message.startswith("sample_transform returned"), message
        assert "for sample sample0000" in message and all(part in message for part in said), message


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_a_sample_transform_that_raises_raises_its_own_exception(datasets: dict[str, Path], worker_type: str) -> None:
    with pytest.raises(TheUsersOwnError, match="no luck with sample0000"):
        list(loader_for(datasets["detection"], sample_transform=raises_its_own, worker_type=worker_type))


def test_a_sample_transform_may_empty_a_sample_of_its_boxes(datasets: dict[str, Path]) -> None:
    batches = list(loader_for(datasets["detection"], sample_transform=all_boxes_dropped, on_error="raise"))
    assert len(batches) == 2
    for batch in batches:
        for boxes, labels, crowd in zip(batch.boxes, batch.box_labels, batch.iscrowd):
            assert boxes.shape == (0, 4) and labels.shape == (0,) and crowd.shape == (0,)


def test_a_batch_transform_returning_none_is_a_hook_error_not_an_empty_epoch(datasets: dict[str, Path]) -> None:
    loader = loader_for(datasets["segmentation"], task="classification", batch_transform=lambda batch: None)
    assert len(loader) == 2
    with pytest.raises(HookError, match=r"batch_transform returned None; expected the batch to deliver"):
        list(loader)
    with pytest.raises(HookError, match=r"batch_transform returned a str"):
        list(loader_for(datasets["detection"], batch_transform=lambda batch: "done"))


def test_a_batch_transform_that_raises_raises_its_own_exception(datasets: dict[str, Path]) -> None:
    def refuse(batch: Any) -> Any:
        raise TheUsersOwnError("not this batch")

    with pytest.raises(TheUsersOwnError, match="not this batch"):
        list(loader_for(datasets["detection"], batch_transform=refuse))


def test_a_batch_transform_may_return_any_structure_of_tensors(datasets: dict[str, Path]) -> None:
    batches = list(loader_for(datasets["detection"], batch_transform=lambda batch: {"pixels": batch.images.float()}))
    assert len(batches) == 2 and all(isinstance(b["pixels"], torch.Tensor) and b["pixels"].shape[0] == 4 for b in batches)


def test_a_loader_left_mid_epoch_is_not_stopped_by_a_forked_worker_that_collects_its_copy(datasets: dict[str, Path]) -> None:
    """A loader a hook's error left mid-epoch lives on in the next loader's forked workers: collecting it there
    must not wait for pieces of a pool that is not theirs (the worker would never take its own pieces)."""
    loader = loader_for(datasets["detection"], worker_type="process", sample_transform=slow)
    batches = iter(loader)
    next(batches)  # mid-epoch: the next batch's pieces are in its pool
    child = os.fork()
    if child == 0:  # pragma: no cover - the forked copy
        loader.__del__()  # what the garbage collector does with the copy
        os._exit(0)
    deadline = time.monotonic() + 10
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert done == (child, 0)
    assert len(list(batches)) == len(loader) - 1  # the epoch goes on in the process that owns it
