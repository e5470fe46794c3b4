"""Elastic resume: an epoch continued at another world size, no sample twice, none skipped.

An epoch started at world size W0 is one sequence of records, its *base*:
rank 0's records of the epoch (`epoch_records` at W0), then rank 1's, and so
on, `records_per_rank` each. What of it has been delivered is a few runs of
base positions (`Progress`), which compose: a run that resumed from some
progress deals the rest of the base (the positions not delivered, in order)
out to its ranks (`share_records`); when it saves, each rank has delivered a
prefix of its share, and the progress plus those prefixes is where the next
run starts (`advance`), whatever the world sizes on the way (4 -> 2 -> 3 ...).
A state holds the runs, never a list of samples: a few per resume.

The shares, for R records left and W ranks now (every rank the same number
of batches, as DDP needs):

- drop_last=False: ranks get floor(R/W) or ceil(R/W) records, in rank order
  the ceil ones first; the last batch of a rank may be partial. Where those
  would differ in batch count (floor(R/W) is a multiple of the batch size and
  W does not divide R) every rank gets ceil(R/W) instead and the last ranks
  wrap around to the first records of the rest: padding, W - (R mod W)
  records (fewer than W, as the padding of a whole epoch), the fewest that
  gives equal batch counts without skipping any.
- drop_last=True: every rank gets the same whole batches, floor(R / (W x
  batch size)) of them; fewer than W x batch size records are left out, as
  the whole epoch leaves out its uneven tail. They are not delivered, but
  they stay in the rest, so a later resume of the same epoch may deliver them.

The padding of the epoch's first plan (drop_last=False, a world size that
does not divide the dataset) counts as delivered from the start, so a
resumed epoch does not deliver it: no sample more often than the epoch at W0
would have delivered it, besides the new padding above. Where its padding
falls is worked out from the plan without reading (`padding_positions`):
exact while no shard is damaged (damage is made up as in any epoch).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence

from ..errors import ConfigError
from ..specs import LoaderSpec
from .damage import Report
from .dataset import ShardRef
from .epoch import Record, epoch_records, padding_positions, records_per_rank
from .streaming import ShardOpener

Runs = tuple[tuple[int, int], ...]  # [start, stop) position ranges, in order


@dataclasses.dataclass(frozen=True)
class Progress:
    """What of an epoch has been delivered, over all ranks: runs of its base sequence.

    Attributes:
        world_size: the world size the epoch started with (its base: that many ranks' records).
        runs: the base positions delivered, as sorted, disjoint [start, stop) runs.
    """

    world_size: int
    runs: Runs

    def to_state(self) -> dict[str, object]:
        """JSON-able: {"world_size": W0, "runs": [[start, stop], ...]}."""
        return {"world_size": self.world_size, "runs": [list(run) for run in self.runs]}


def normalize(runs: Iterable[tuple[int, int]]) -> Runs:
    """Runs sorted, with the empty ones left out and the touching or overlapping ones joined."""
    joined: list[tuple[int, int]] = []
    for start, stop in sorted(run for run in runs if run[1] > run[0]):
        if joined and start <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(stop, joined[-1][1]))
        else:
            joined.append((start, stop))
    return tuple(joined)


def complement(runs: Runs, length: int) -> Runs:
    """The positions of [0, length) not in `runs` (sorted and disjoint), as runs."""
    rest: list[tuple[int, int]] = []
    at = 0
    for start, stop in runs:
        if start > at:
            rest.append((at, start))
        at = max(at, stop)
    if length > at:
        rest.append((at, length))
    return tuple(rest)


def count(runs: Sequence[tuple[int, int]]) -> int:
    """Positions the runs hold."""
    return sum(stop - start for start, stop in runs)


def take(runs: Runs, lo: int, hi: int) -> Runs:
    """Positions lo..hi-1 of the sequence the runs make; from lo, wrapping to its start while hi is past its end."""
    length = count(runs)
    taken: list[tuple[int, int]] = []
    while lo < hi and length:
        first = lo % length
        step = min(hi - lo, length - first)
        taken.extend(_cut_runs(runs, first, first + step))
        lo += step
    return tuple(taken)


def _cut_runs(runs: Runs, lo: int, hi: int) -> list[tuple[int, int]]:
    cut, offset = [], 0
    for start, stop in runs:
        begin, end = max(lo, offset), min(hi, offset + stop - start)
        if end > begin:
            cut.append((start + begin - offset, start + end - offset))
        offset += stop - start
        if offset >= hi:
            break
    return cut


def share_records(remaining: int, world_size: int, batch_size: int, drop_last: bool) -> list[tuple[int, int]]:
    """Each new rank's [lo, hi) of the `remaining` records left, by rank (see the module's docstring).

    hi past `remaining` wraps around to the first records (padding); every
    rank's share is the same number of batches of `batch_size`.
    """
    if drop_last:
        each = remaining // (world_size * batch_size) * batch_size
        return [(rank * each, (rank + 1) * each) for rank in range(world_size)]
    low, extra = divmod(remaining, world_size)
    if extra and low % batch_size == 0:  # floor and ceil shares would differ by a batch: all get ceil
        return [(rank * (low + 1), (rank + 1) * (low + 1)) for rank in range(world_size)]
    bounds = [rank * low + min(rank, extra) for rank in range(world_size + 1)]
    return list(zip(bounds, bounds[1:]))


def rank_share(runs: Runs, length: int, world_size: int, batch_size: int, drop_last: bool, rank: int) -> Runs:
    """Base positions rank `rank` of `world_size` delivers, in its order, resuming from `runs` of a base of `length`."""
    rest = complement(runs, length)
    lo, hi = share_records(count(rest), world_size, batch_size, drop_last)[rank]
    return take(rest, lo, hi)


def advance(runs: Runs, length: int, batch_size: int, drop_last: bool, batches: Sequence[int]) -> Runs:
    """`runs` plus what the ranks of a run that resumed from them delivered: `batches` of its shares, by rank."""
    rest = complement(runs, length)
    shares = share_records(count(rest), len(batches), batch_size, drop_last)
    delivered = list(runs)
    for (lo, hi), done in zip(shares, batches):
        delivered.extend(take(rest, lo, lo + min(done * batch_size, hi - lo)))
    return normalize(delivered)


def started(per_rank: int, batch_size: int, batches: Sequence[int], padding: Iterable[int] = ()) -> Runs:
    """The runs of an epoch that started at this world size: each rank's delivered batches, and the plan's padding."""
    runs = [(rank * per_rank, rank * per_rank + min(done * batch_size, per_rank)) for rank, done in enumerate(batches)]
    return normalize([*runs, *((position, position + 1) for position in padding)])


def base_length(shards: list[ShardRef], spec: LoaderSpec, world_size: int) -> int:
    """Records of an epoch's base at `world_size`: every rank's records of the epoch."""
    return world_size * records_per_rank(shards, spec, world_size)


def saved_progress(
    shards: list[ShardRef], spec: LoaderSpec, epoch: int, resumed: Progress | None, batches: Sequence[int]
) -> Progress:
    """Where the ranks of a run stood when they saved: `batches` delivered by rank, having resumed from `resumed`.

    `resumed` None: the run started the epoch (at `len(batches)` ranks).
    """
    world_size = len(batches)
    if resumed is None:
        per_rank = records_per_rank(shards, spec, world_size)
        padding = [
            rank * per_rank + position
            for rank in range(world_size)
            for position in padding_positions(shards, spec, epoch, rank, world_size)
        ]
        return Progress(world_size, started(per_rank, spec.batch_size, batches, padding))
    check_progress(shards, spec, resumed)
    length = base_length(shards, spec, resumed.world_size)
    return Progress(
        resumed.world_size, advance(resumed.runs, length, spec.batch_size, spec.effective_drop_last, batches)
    )


def check_progress(shards: list[ShardRef], spec: LoaderSpec, progress: Progress) -> None:
    """ConfigError when the runs do not fit this dataset's epoch at their world size (another dataset or drop_last)."""
    length = base_length(shards, spec, progress.world_size)
    if progress.runs != normalize(progress.runs) or (progress.runs and progress.runs[-1][1] > length):
        raise ConfigError(
            f"the state's delivered runs do not fit an epoch of this dataset at world_size={progress.world_size} "
            f"({length} records): it was saved with another dataset or another drop_last"
        )


def progress_from_state(state: object) -> Progress:
    """A state's {"world_size": W0, "runs": [[start, stop], ...]} as a Progress; ConfigError for other shapes."""
    try:
        assert isinstance(state, dict)
        runs = tuple((int(start), int(stop)) for start, stop in state["runs"])
        return Progress(int(state["world_size"]), runs)
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            "this state was saved in an epoch resumed at another world size by an older gpufeed, which "
            "recorded it differently: start that epoch again (set_epoch), or continue it with that version"
        ) from exc


def elastic_records(
    shards: list[ShardRef],
    spec: LoaderSpec,
    epoch: int,
    progress: Progress,
    rank: int,
    world_size: int,
    report: Report,
    opener: ShardOpener | None = None,
) -> Iterator[Record]:
    """This rank's share of what is left of an epoch (see the module's docstring for the guarantee).

    The saved ranks' orders (`epoch_records` at the epoch's first world
    size) are replayed, read but not decoded, up to each run of the share.

    Args:
        shards: the shards the epoch reads.
        spec: the loader's settings.
        epoch: the epoch number.
        progress: what of the epoch had been delivered when it was saved.
        rank: this process's rank now.
        world_size: the number of ranks now.
        report: receives the damage met (see `epoch_records`).
        opener: opens the shards.

    Yields:
        Records with consecutive ordinals from 0.
    """
    per_rank = records_per_rank(shards, spec, progress.world_size)
    length = progress.world_size * per_rank
    share = rank_share(progress.runs, length, world_size, spec.batch_size, spec.effective_drop_last, rank)
    records = _replay(shards, spec, epoch, progress.world_size, per_rank, share, report, opener)
    for ordinal, record in enumerate(records):
        yield dataclasses.replace(record, ordinal=ordinal)


def _replay(
    shards: list[ShardRef],
    spec: LoaderSpec,
    epoch: int,
    saved_world: int,
    per_rank: int,
    share: Runs,
    report: Report,
    opener: ShardOpener | None,
) -> Iterator[Record]:
    """The records at the share's base positions, in its order: each saved rank's records read again up to them."""
    source: Iterator[Record] | None = None
    saved_rank = at = -1  # the saved rank `source` reads, and its position next
    for start, stop in _by_rank(share, per_rank):
        old, offset = divmod(start, per_rank)
        if source is None or old != saved_rank or offset < at:
            source = epoch_records(shards, spec, epoch, old, saved_world, report, opener)
            saved_rank, at = old, 0
        yield from itertools.islice(source, offset - at, offset - at + stop - start)
        at = offset + stop - start


def _by_rank(runs: Runs, per_rank: int) -> Iterator[tuple[int, int]]:
    """The runs, cut where one saved rank's records end and the next one's begin."""
    for start, stop in runs:
        while start < stop:
            end = min(stop, (start // per_rank + 1) * per_rank)
            yield start, end
            start = end
