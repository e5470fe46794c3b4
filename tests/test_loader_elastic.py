"""Elastic resume: an epoch saved mid-way by 2 ranks continues on 1 rank or on 3, nothing twice, nothing skipped.

Real ranks under torchrun (gloo on loopback, hard timeouts), one collective per
batch so a rank with a batch more or less would show. Labels are each image's
own index, so the batches name the samples delivered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loader_data import prepare_labelled

from pipeline import ConfigError
from pipeline.loader import make_loader, merge_states

N = 96
PER_SHARD = 12  # 8 shards
BATCH = 8
SAVED_AFTER = 2  # batches each of the 2 ranks delivers before the checkpoint

SCRIPT = r"""
import json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
from pipeline.loader import make_loader, merge_states

rank, world = dist.get_rank(), dist.get_world_size()
mode, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
loader = make_loader(root, 8, device="cpu", crop=32, num_workers=1, shuffle_buffer=32)


def step(value):
    both = torch.tensor([value, -value], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both[0].item() == -both[1].item() == value


labels, synced = [], True
if mode == "save":
    loader.set_epoch(1)
    for count, (_, batch) in enumerate(loader):
        labels += [int(v) for v in batch]
        synced &= step(count)
        if count + 1 == int(sys.argv[4]):
            break
    states = [None] * world
    dist.all_gather_object(states, loader.state_dict())
    if rank == 0:
        with open(os.path.join(out, "checkpoint.json"), "w") as handle:
            json.dump({"loader": merge_states(states)}, handle)
else:
    with open(os.path.join(out, "checkpoint.json")) as handle:
        loader.load_state_dict(json.load(handle)["loader"])
    for count, (_, batch) in enumerate(loader):
        labels += [int(v) for v in batch]
        synced &= step(count)
    after = sum(1 for _ in loader)  # the next epoch: whole again
with open(os.path.join(out, f"{mode}-{world}-rank{rank}.json"), "w") as handle:
    result = {"labels": labels, "synced": synced, "len": len(loader)}
    if mode == "resume":
        result["next_epoch_batches"] = after
    json.dump(result, handle)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_labelled(tmp_path_factory.mktemp("elastic"), "ds", N, shard_samples=PER_SHARD)


def run_ranks(out: Path, port: int, ranks: int, *args: str) -> list[dict]:
    script = out / "ranks.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
               "127.0.0.1", "--master_port", str(port), str(script), *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"{args[0]}-{ranks}-rank{rank}.json").read_text()) for rank in range(ranks)]


@pytest.fixture(scope="module")
def saved(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A checkpoint of epoch 1 saved by 2 ranks after SAVED_AFTER batches each, and the labels they delivered."""
    from conftest import free_port

    out = tmp_path_factory.mktemp("checkpoint")
    ranks = run_ranks(out, free_port(), 2, "save", str(dataset), str(out), str(SAVED_AFTER))
    assert all(rank["synced"] for rank in ranks)
    delivered = [label for rank in ranks for label in rank["labels"]]
    assert len(delivered) == 2 * SAVED_AFTER * BATCH
    return out, delivered


@pytest.mark.parametrize("world", [1, 3])
def test_an_epoch_saved_by_two_ranks_continues_on_another_world_size(
    dataset: Path, saved: tuple[Path, list[int]], tmp_path: Path, world: int, get_free_port
) -> None:
    checkpoint, delivered = saved
    (tmp_path / "checkpoint.json").write_text((checkpoint / "checkpoint.json").read_text())
    ranks = run_ranks(tmp_path, get_free_port(), world, "resume", str(dataset), str(tmp_path))
    assert all(rank["synced"] for rank in ranks)
    counts = [len(rank["labels"]) for rank in ranks]
    left = N - len(delivered)  # drop_last: 96 samples split evenly over 2 ranks, nothing dropped at the start
    per_rank = left // (world * BATCH) * BATCH
    assert counts == [per_rank] * world  # equal whole batches on every new rank
    resumed = [label for rank in ranks for label in rank["labels"]]
    epoch = delivered + resumed
    assert len(epoch) == len(set(epoch))  # nothing twice
    assert len(set(range(N)) - set(epoch)) == left - world * per_rank  # the documented remainder, under a batch a rank
    assert left - world * per_rank < world * BATCH
    assert all(rank["next_epoch_batches"] == rank["len"] == N // world // BATCH for rank in ranks)


def test_merge_states_needs_every_rank_of_one_epoch(dataset: Path) -> None:
    states = [
        make_loader(str(dataset), BATCH, device="cpu", crop=32, rank=rank, world_size=2).state_dict() for rank in (0, 1)
    ]
    merged = merge_states(states)
    assert merged["rank_batches"] == [0, 0] and merged["world_size"] == 2
    with pytest.raises(ConfigError, match="one state of each of the 2 ranks"):
        merge_states(states[:1])
    with pytest.raises(ConfigError, match="differ in epoch"):
        merge_states([states[0], {**states[1], "epoch": 3}])
    one = make_loader(str(dataset), BATCH, device="cpu", crop=32, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="merge_states"):
        one.load_state_dict(states[1])  # one rank's state at another world size
    one.load_state_dict(json.loads(json.dumps(merged)))  # a merged one at any: survives a checkpoint file
    assert sorted(int(v) for _, labels in one for v in labels) == list(range(N))
