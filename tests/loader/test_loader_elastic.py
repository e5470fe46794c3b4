"""Elastic resume: an epoch saved mid-way by 2 ranks continues on 1 rank or on 3, nothing twice, nothing skipped.

Real ranks under torchrun (gloo on loopback, hard timeouts), one collective per
batch so a rank with a batch more or less would show. Labels are each image's
own index, so the batches name the samples delivered.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from loader_data import prepare_labelled

from pipeline import ConfigError
from pipeline.loader import make_loader, merge_states
from pipeline.loader.damage import ignore
from pipeline.loader.elastic import advance, complement, count, normalize, rank_share, started, take
from pipeline.loader.epoch import epoch_records, padding_positions

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
root, out, drop, load, save, stop, tag = sys.argv[1:8]
loader = make_loader(root, 8, device="cpu", crop=32, num_workers=1, shuffle_buffer=32, drop_last=drop == "drop")


def step(value):
    both = torch.tensor([value, -value], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both[0].item() == -both[1].item() == value


if load == "-":
    loader.set_epoch(1)
else:
    with open(os.path.join(out, load)) as handle:
        loader.load_state_dict(json.load(handle)["loader"])
labels, batches, synced = [], 0, True
for count, (_, batch) in enumerate(loader):
    labels += [int(v) for v in batch]
    batches += 1
    synced &= step(count)
    if count + 1 == int(stop):
        break
synced &= step(batches)  # the ranks agree on the batch count
result = {"labels": labels, "batches": batches, "synced": synced, "len": len(loader)}
if save != "-":
    states = [None] * world
    dist.all_gather_object(states, loader.state_dict())
    if rank == 0:
        with open(os.path.join(out, save), "w") as handle:
            json.dump({"loader": merge_states(states)}, handle)
if int(stop) == 0:
    result["next_epoch_batches"] = sum(1 for _ in loader)  # the next epoch: whole again
with open(os.path.join(out, f"{tag}-rank{rank}.json"), "w") as handle:
    json.dump(result, handle)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_labelled(tmp_path_factory.mktemp("elastic"), "ds", N, shard_samples=PER_SHARD)


def run_ranks(out: Path, ranks: int, drop: str, load: str, save: str, stop: int, tag: str) -> list[dict]:
    """The script on `ranks` ranks under torchrun; each rank's result (its labels, batches, whether in step)."""
    from conftest import free_port

    script = out / "ranks.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    args = [str(out.parent / "ds"), str(out), drop, load, save, str(stop), tag]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), str(script), *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((out / f"{tag}-rank{rank}.json").read_text()) for rank in range(ranks)]
    assert all(result["synced"] for result in results)
    assert len({result["batches"] for result in results}) == 1  # every rank the same number of batches
    return results


def labels_of(results: list[dict]) -> list[int]:
    return [label for result in results for label in result["labels"]]


@pytest.fixture(scope="module")
def runs(dataset: Path) -> Path:
    """The folder the torchrun runs share: the dataset beside it, their checkpoints and results in it."""
    out = dataset.parent / "runs"
    out.mkdir()
    return out


@pytest.fixture(scope="module")
def saved(runs: Path) -> Callable[[str], list[int]]:
    """Epoch 1 saved by 2 ranks after SAVED_AFTER batches each, once per drop ("drop" or "keep" for drop_last):
    the labels they delivered; the checkpoint is saved-{drop}.json."""
    labels: dict[str, list[int]] = {}

    def save(drop: str) -> list[int]:
        if drop not in labels:
            ranks = run_ranks(runs, 2, drop, "-", f"saved-{drop}.json", SAVED_AFTER, f"save-{drop}")
            labels[drop] = labels_of(ranks)
            assert len(labels[drop]) == 2 * SAVED_AFTER * BATCH
        return labels[drop]

    return save


@pytest.mark.parametrize("drop", ["drop", "keep"])
@pytest.mark.parametrize("world", [1, 3])
def test_an_epoch_saved_by_two_ranks_continues_on_another_world_size(
    runs: Path, saved: Callable[[str], list[int]], world: int, drop: str
) -> None:
    delivered = saved(drop)
    ranks = run_ranks(runs, world, drop, f"saved-{drop}.json", "-", 0, f"resume-{drop}-{world}")
    counts = [len(rank["labels"]) for rank in ranks]
    left = N - len(delivered)  # 96 samples split evenly over 2 ranks: no tail dropped, no padding at the start
    epoch = delivered + labels_of(ranks)
    assert len(epoch) == len(set(epoch))  # nothing twice
    if drop == "drop":
        per_rank = left // (world * BATCH) * BATCH
        assert counts == [per_rank] * world  # equal full batches on every new rank
        assert len(set(range(N)) - set(epoch)) == left - world * per_rank < world * BATCH  # the documented tail
        whole = N // world // BATCH
    else:
        low, extra = divmod(left, world)
        assert counts == [low + 1] * extra + [low] * (world - extra)  # floor/ceil shares: 22, 21, 21 of 64 on 3
        assert sorted(epoch) == list(range(N))  # nothing skipped
        whole = -(-(-(-N // world)) // BATCH)
    assert all(rank["next_epoch_batches"] == rank["len"] == whole for rank in ranks)


def test_an_epoch_resumed_at_another_world_size_is_saved_and_resumed_again(
    runs: Path, saved: Callable[[str], list[int]]
) -> None:
    delivered = saved("keep")
    middle = run_ranks(runs, 3, "keep", "saved-keep.json", "again.json", 1, "chain-3")  # 2 -> 3, one batch each
    last = run_ranks(runs, 2, "keep", "again.json", "-", 0, "chain-2")  # 3 -> 2, the rest
    assert [len(rank["labels"]) for rank in middle] == [BATCH] * 3
    assert [len(rank["labels"]) for rank in last] == [20, 20]  # 96 - 32 - 24 = 40 left, 20 each
    epoch = delivered + labels_of(middle) + labels_of(last)
    assert sorted(epoch) == list(range(N))  # nothing twice, nothing skipped


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


def test_a_state_of_an_older_elastic_resume_is_refused_with_what_to_do(dataset: Path) -> None:
    loader = make_loader(str(dataset), BATCH, device="cpu", crop=32, rank=0, world_size=3)
    old = {**loader.state_dict(), "resumed": {"world_size": 2, "rank_batches": [2, 2]}}  # as gpufeed saved it before
    with pytest.raises(ConfigError, match="older gpufeed.*set_epoch"):
        loader.load_state_dict(old)
    with pytest.raises(ConfigError, match="another dataset or another drop_last"):
        loader.load_state_dict({**loader.state_dict(), "resumed": {"world_size": 2, "runs": [[0, 10_000]]}})


def test_padding_positions_are_where_a_short_rank_wraps_around(dataset: Path) -> None:
    loader = make_loader(str(dataset), BATCH, device="cpu", crop=32, drop_last=False, shuffle_buffer=32)
    shards, world = loader.dataset.sets[0], 5  # 96 over 5 ranks: 20 each, the last one's 4 wrap around
    keys = [[record.key for record in epoch_records(shards, loader.spec, 1, rank, world, ignore)] for rank in range(5)]
    seen = Counter(key for rank in keys for key in rank)
    for rank in range(world):
        expected = [i for i, key in enumerate(keys[rank]) if seen[key] > 1] if rank else []
        assert padding_positions(shards, loader.spec, 1, rank, world) == expected
    assert len(padding_positions(shards, loader.spec, 1, 4, world)) == 4


def test_the_padding_of_the_first_plan_is_not_delivered_again(dataset: Path) -> None:
    """5 ranks (the last one's 4 records padding) -> 3 -> 2, drop_last=False, in one process with rank= given."""

    def stage(world: int, state: dict | None, batches: int | None) -> tuple[list[list[int]], dict]:
        labels, states = [], []
        for rank in range(world):
            loader = make_loader(
                str(dataset), BATCH, device="cpu", crop=32, num_workers=0, shuffle_buffer=32, drop_last=False,
                rank=rank, world_size=world,
            )  # fmt: skip
            if state is None:
                loader.set_epoch(1)
            else:
                loader.load_state_dict(json.loads(json.dumps(state)))
            iteration = iter(loader)
            labels.append([int(v) for _, batch in itertools.islice(iteration, batches) for v in batch])
            iteration.close()
            states.append(loader.state_dict())
            loader.close()
        return labels, merge_states(states)

    first, state = stage(5, None, 1)
    middle, state = stage(3, state, 2)
    last, _ = stage(2, state, None)
    assert [len(rank) for rank in first + middle] == [BATCH] * 5 + [2 * BATCH] * 3
    assert len({-(-len(rank) // BATCH) for rank in last}) == 1  # the same batches on both
    loader = make_loader(str(dataset), BATCH, device="cpu", crop=32, drop_last=False, shuffle_buffer=32)
    padding = padding_positions(loader.dataset.sets[0], loader.spec, 1, 4, 5)
    delivered = [label for stage in (first, middle, last) for rank in stage for label in rank]
    assert sorted(set(delivered)) == list(range(N))  # nothing skipped
    # twice only the samples the last of the 5 ranks had already delivered as padding, as the whole epoch would
    assert len(delivered) == N + sum(position < BATCH for position in padding)


def model_base(total: int, world: int, batch: int, drop_last: bool) -> tuple[int, Callable[[int], int], list[int]]:
    """An epoch's base at `world` in the abstract: records a rank, the sample at each position, the padding's positions.

    Each rank's records in plan order (the shuffle within a rank moves
    positions, not which samples a rank holds).
    """
    planned = total // world if drop_last else -(-total // world)
    per_rank = planned // batch * batch if drop_last else planned

    def plan_index(position: int) -> int:
        rank, offset = divmod(position, per_rank)
        return rank * planned + offset

    padding = [p for p in range(world * per_rank) if plan_index(p) >= total]
    return per_rank, lambda position: plan_index(position) % total, padding


def positions(runs: Sequence[tuple[int, int]]) -> list[int]:
    return [p for start, stop in runs for p in range(start, stop)]


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    total=st.integers(1, 160),
    batch=st.integers(1, 10),
    worlds=st.lists(st.integers(1, 7), min_size=2, max_size=4),
    drop_last=st.booleans(),
)
def test_elastic_shares_deliver_the_epoch_once_in_equal_batches(
    data: st.DataObject, total: int, batch: int, worlds: list[int], drop_last: bool
) -> None:
    """Saved at worlds[0], resumed at each next world size (saved again mid-way), the last one to the end."""
    first = worlds[0]
    assume(not drop_last or total // first >= batch)  # make_loader refuses an empty epoch
    per_rank, sample, padding = model_base(total, first, batch, drop_last)
    length = first * per_rank
    progress = [data.draw(st.integers(0, -(-per_rank // batch))) for _ in range(first)]
    runs = started(per_rank, batch, progress, padding)
    taken = [r * per_rank + i for r, done in enumerate(progress) for i in range(min(done * batch, per_rank))]
    delivered = [sample(p) for p in taken]
    repeats = len(set(taken) & set(padding))  # padding delivered before the save: the only repeats of the first plan
    for stage, world in enumerate(worlds[1:], 2):
        rest = length - count(runs)
        shares = [rank_share(runs, length, world, batch, drop_last, rank) for rank in range(world)]
        sizes = [count(share) for share in shares]
        steps = -(-sizes[0] // batch)
        assert all(-(-size // batch) == steps for size in sizes)  # DDP: every rank the same batches
        low, extra = divmod(rest, world)
        if drop_last:
            assert all(size == sizes[0] and size % batch == 0 for size in sizes)
            assert 0 <= rest - sum(sizes) < world * batch
        else:
            assert max(sizes) - min(sizes) <= 1 or sum(sizes) == rest == 0
            padded = sum(sizes) - rest
            assert padded == (world - extra if extra and low % batch == 0 else 0) < world  # the fewest, < world
            repeats += padded
        done = [steps if stage == len(worlds) else data.draw(st.integers(0, steps)) for _ in range(world)]
        for share, batches in zip(shares, done):
            delivered += [sample(p) for p in positions(share)[: batches * batch]]
        runs = advance(runs, length, batch, drop_last, done)
    times = Counter(delivered)
    if drop_last:
        assert max(times.values(), default=1) == 1  # nothing twice
        assert total - len(times) - (total - length) < worlds[-1] * batch  # left out: the last world's tail only
    else:
        assert set(times) == set(range(total))  # nothing skipped
        assert len(delivered) - total <= repeats  # twice only what padding repeats


@settings(max_examples=200, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20))), length=st.integers(0, 80))
def test_runs_arithmetic(runs: list[tuple[int, int]], length: int) -> None:
    joined = normalize((start, start + size) for start, size in runs)
    inside = {p for start, size in runs for p in range(start, start + size)}
    assert positions(joined) == sorted(inside)
    assert all(a[1] < b[0] for a, b in zip(joined, joined[1:]))  # disjoint, not touching
    clipped = normalize((min(a, length), min(b, length)) for a, b in joined)
    rest = complement(clipped, length)
    assert sorted(positions(rest) + positions(clipped)) == list(range(length))
    if count(rest):
        assert positions(take(rest, 0, 2 * count(rest) + 1)) == (positions(rest) * 3)[: 2 * count(rest) + 1]
