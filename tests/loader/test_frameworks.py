"""The loops of real training frameworks over a gpufeed Loader: PyTorch Lightning and accelerate.

Their loops stop after `len(loader)` batches (or a limit) without asking for
the end of the iteration, and call `iter()` again for the next epoch; the
loader must start a new, reshuffled pass each time, as a DataLoader does.
Every dataset is labelled by each image's own index, so a batch's labels
name its samples.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
from loader_data import prepare_labelled

from pipeline.loader import make_loader

lightning = pytest.importorskip("lightning.pytorch", reason="the test extra brings lightning")

N = 40
BATCH = 4
CROP = 32


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_labelled(tmp_path_factory.mktemp("frameworks"), "ds", N, shard_samples=10)


def loader_for(dataset: Path, **options: object):
    options.setdefault("device", "cpu")
    options.setdefault("num_workers", 1)
    options.setdefault("shuffle_buffer", 16)
    return make_loader(str(dataset), BATCH, crop=CROP, dtype="float32", **options)  # type: ignore[arg-type]


def epoch_order(dataset: Path, epoch: int) -> list[int]:
    """The labels of `epoch` as a fresh loader, told the epoch, delivers them."""
    fresh = loader_for(dataset)
    fresh.set_epoch(epoch)
    try:
        return [int(v) for _, labels in fresh for v in labels]
    finally:
        fresh.close()


class Recorder(lightning.LightningModule):
    """A tiny model that records the labels of every training and validation batch, by epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3 * CROP * CROP, 3)
        self.trained: dict[int, list[int]] = {}
        self.validated: dict[int, list[int]] = {}

    def training_step(self, batch, batch_index):
        images, labels = batch
        self.trained.setdefault(self.current_epoch, []).extend(int(v) for v in labels)
        return torch.nn.functional.cross_entropy(self.layer(images.flatten(1)), labels % 3)

    def validation_step(self, batch, batch_index):
        images, labels = batch
        if not self.trainer.sanity_checking:
            self.validated.setdefault(self.current_epoch, []).extend(int(v) for v in labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(root: Path, **options: object):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lightning.Trainer(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(root),
            **options,  # type: ignore[arg-type]
        )


@pytest.fixture(autouse=True)
def quiet_lightning(caplog: pytest.LogCaptureFixture):
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_lightning_fits_three_epochs_each_a_whole_reshuffled_pass(dataset: Path, tmp_path: Path) -> None:
    train, val = loader_for(dataset), loader_for(dataset, train=False)
    model = Recorder()
    trainer(tmp_path, max_epochs=3, enable_checkpointing=False, num_sanity_val_steps=2).fit(model, train, val)
    assert sorted(model.trained) == [0, 1, 2]
    for epoch in range(3):
        assert model.trained[epoch] == epoch_order(dataset, epoch)
        assert sorted(model.trained[epoch]) == list(range(N))
        assert sorted(model.validated[epoch]) == list(range(N))  # eval: every sample, every epoch
    assert len({tuple(order) for order in model.trained.values()}) == 3
    train.close()
    val.close()


def test_lightning_with_limit_train_batches_starts_each_epoch_anew(dataset: Path, tmp_path: Path) -> None:
    # limit_train_batches stops every epoch early: each one is still a new, reshuffled pass.
    train, val = loader_for(dataset), loader_for(dataset, train=False)
    model = Recorder()
    limit = 3
    fit = trainer(tmp_path, max_epochs=3, enable_checkpointing=False, limit_train_batches=limit, limit_val_batches=2)
    fit.fit(model, train, val)
    for epoch in range(3):
        assert model.trained[epoch] == epoch_order(dataset, epoch)[: limit * BATCH]
        assert len(model.validated[epoch]) == 2 * BATCH
    train.close()
    val.close()


def test_lightning_resumes_mid_epoch_from_its_checkpoint_with_the_loader_state(dataset: Path, tmp_path: Path) -> None:
    # Lightning keeps the loader's state_dict() in its checkpoint and gives it
    # back with load_state_dict() before the resumed epoch: the resumed run
    # trains on exactly the batches the first had not reached.
    checkpoint = lightning.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4, save_top_k=-1)
    first = Recorder()
    train = loader_for(dataset)
    trainer(tmp_path, max_epochs=2, callbacks=[checkpoint], limit_val_batches=0).fit(first, train)
    train.close()
    saved = tmp_path / "ckpt" / "epoch=1-step=16.ckpt"  # 10 batches an epoch: saved after batch 6 of epoch 1
    assert saved.exists(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    state = torch.load(saved, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert (state["epoch"], state["batches"]) == (1, 6)
    resumed = Recorder()
    train = loader_for(dataset)
    trainer(tmp_path, max_epochs=2, limit_val_batches=0, enable_checkpointing=False).fit(
        resumed, train, ckpt_path=str(saved)
    )
    train.close()
    order = epoch_order(dataset, 1)
    assert first.trained[1] == order
    assert resumed.trained[1] == order[6 * BATCH :]  # nothing repeated, nothing skipped
    assert sorted(resumed.trained) == [1]


def test_accelerate_prepare_runs_two_epochs_each_a_whole_reshuffled_pass(dataset: Path) -> None:
    accelerate = pytest.importorskip("accelerate", reason="the test extra brings accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(3 * CROP * CROP, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = loader_for(dataset)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    seen: list[list[int]] = []
    for _ in range(2):
        labels_seen: list[int] = []
        for step, (images, labels) in enumerate(prepared):
            loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels % 3)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            labels_seen += [int(v) for v in labels]
            if step + 1 == len(prepared):  # as accelerate's examples do: stop at the length, not at the end
                break
        seen.append(labels_seen)
    assert seen == [epoch_order(dataset, 0), epoch_order(dataset, 1)]
    assert all(sorted(labels) == list(range(N)) for labels in seen) and seen[0] != seen[1]
    loader.close()
