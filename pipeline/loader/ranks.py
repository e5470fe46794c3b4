"""The ranks: this process's place (given, or torch.distributed's), each rank's epoch size, their states merged.

`merge_states` turns every rank's `Loader.state_dict()` into one state that
`load_state_dict` continues at any world size (`elastic.py` deals it out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ConfigError
from ..specs import LoaderSpec
from .dataset import DatasetInfo


def given_placement(rank: int | None, world_size: int | None) -> tuple[int, int] | None:
    """(rank, world size) as given to make_loader, checked; None when neither is given."""
    if rank is None and world_size is None:
        return None
    placement = (rank or 0, world_size or 1)
    if not 0 <= placement[0] < placement[1]:
        raise ConfigError(f"rank {placement[0]} is outside world size {placement[1]}")
    return placement


def process_group_ready() -> bool:
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def distributed_placement() -> tuple[int, int]:
    """(rank, world size) that torch.distributed reports now; (0, 1) when it is not initialised."""
    if process_group_ready():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def check_resumed_world(saved: Any, world_size: int) -> None:
    """ConfigError when a loaded state (its world size `saved`; None: none loaded) was saved at another world size."""
    if saved is not None and saved != world_size:
        raise ConfigError(
            f"state was saved with world_size={saved!r}; this loader has {world_size!r}: to continue the epoch "
            "at another world size, gather every rank's state_dict() and load merge_states(them) on every rank"
        )


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's `Loader.state_dict()` as one state that `load_state_dict` continues at any world size.

    Gather them when saving a checkpoint, e.g. with torch.distributed::

        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, loader.state_dict())
        if dist.get_rank() == 0:
            torch.save({"loader": merge_states(states), ...}, path)

    and after a restart at another world size, every rank calls
    `loader.load_state_dict(checkpoint["loader"])`.

    States saved in an epoch that was itself resumed at another world size
    merge the same way (resume 4 -> 2, save, resume 3: still no sample twice
    and none skipped).

    Args:
        states: one state per rank of the run, in any order.

    Returns:
        A JSON-able state: the epoch, the seed, the batch size, the world size,
        the batches each rank had delivered and, for an epoch that was
        resumed, the runs of it delivered before (`resumed`): small, a few
        runs per resume, whatever the dataset's size.

    Raises:
        ConfigError: the states are not one of each rank of one run at one
            epoch (the same epoch, seed, batch size, world size and
            resumed runs).
    """
    if not states:
        raise ConfigError("merge_states needs the state_dict() of every rank, got none")
    first = states[0]
    for name in ("epoch", "seed", "batch_size", "world_size", "resumed"):
        values = sorted({repr(state.get(name)) for state in states})
        if len(values) > 1:
            raise ConfigError(f"the states to merge differ in {name}: {', '.join(values)}")
    world_size = int(first["world_size"])
    ranks = sorted(int(state["rank"]) for state in states)
    if ranks != list(range(world_size)):
        raise ConfigError(f"merge_states needs one state of each of the {world_size} ranks, got ranks {ranks}")
    batches = {int(state["rank"]): int(state["batches"]) for state in states}
    merged = {
        "epoch": int(first["epoch"]),
        "seed": first["seed"],
        "batch_size": first["batch_size"],
        "world_size": world_size,
        "rank_batches": [batches[rank] for rank in range(world_size)],
    }
    if first.get("resumed") is not None:
        merged["resumed"] = first["resumed"]
    return merged


def epoch_size(dataset: DatasetInfo, spec: LoaderSpec, world_size: int) -> tuple[int, int]:
    """(samples, batches) of one rank's epoch at `world_size`: its share of the dataset, after the split."""
    total = sum(shard.samples for shard in dataset.sets[0])
    if spec.effective_drop_last:
        per_rank = total // world_size
        return per_rank, per_rank // spec.batch_size
    per_rank = -(-total // world_size)
    return per_rank, -(-per_rank // spec.batch_size)


def check_epoch_size(dataset: DatasetInfo, spec: LoaderSpec, world_size: int) -> None:
    """ConfigError when a rank's epoch at `world_size` would hold no batch (drop_last, a batch too large)."""
    per_rank, batches = epoch_size(dataset, spec, world_size)
    if batches:
        return
    total = sum(shard.samples for shard in dataset.sets[0])
    ranks = "1 rank" if world_size == 1 else f"{world_size} ranks"
    fix = f"use batch_size <= {per_rank}" if per_rank else "use fewer ranks than samples"
    raise ConfigError(
        f"batch_size {spec.batch_size} is more than this rank's {per_rank} samples per epoch "
        f"({total} samples over {ranks}): fewer samples than one batch, so with drop_last=True every "
        f"epoch would be empty; {fix}, or drop_last=False for one partial batch"
    )
