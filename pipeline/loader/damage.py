"""Damaged data and the error policy: what is counted, what is said, what takes the place of what was lost.

Damage turns up in two places. Reading an epoch's shards (`epoch.py`) meets
shards that are missing, unreadable, cut short (fewer samples than the
manifest says) or, with `verify=True`, not matching their sha256, and samples
without an image or whose label is no class index of the manifest (not an
integer, negative, past the classes; past int64 without a list); decoding (`workers.py`, `device.py`) meets samples whose
bytes do not decode. With `on_error="raise"` the first of these stops the
epoch with a `SampleError` naming it. With `on_error="skip"` (the default)
each becomes a `Damage`: the stats count it, the log names it once, and the
shortfall is made up so that every rank yields `len(loader)` full batches
without talking to another:

- Samples lost while reading are made up at the end of the epoch by reading
  again the parts of this epoch's shards that this rank read without fault,
  in the epoch's order and from the first, wrapping around as often as
  needed (train mode mixes them in a shuffle buffer of their own), at most
  64 times over (more lost than that is a SampleError: a dataset to check,
  not one to re-draw from for ever). They come with fresh ordinals, so fresh
  crops and flips. A rank none of whose shards
  could be read takes the epoch's other shards the same way; a rank that
  can read nothing at all raises a SampleError.
- A sample that does not decode is replaced in its batch position by a
  sample of the same batch that did, drawn with a generator seeded by
  (seed, epoch, rank, batch): decoded again with the failed position's crop
  seed (a new view) or, should that fail, with its own. A batch none of
  whose samples decodes borrows from the batches behind it.

Everything here is a pure function of the seed, the epoch, the rank and what
failed, so a resumed epoch (`load_state_dict`) replaces exactly as an
uninterrupted one. Nothing of it runs for a clean batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from ..errors import SampleError

Item = tuple[str, bytes, int]  # what a decoder gets per sample: (extension, bytes, crop seed)
Extras = dict[str, bytes] | None  # the members a sample brings besides its image (its targets), None: none kept
Donor = tuple[Item, int, str, Extras]  # a sample that can stand in for another: its item, label, key and extras


@dataclasses.dataclass(frozen=True)
class Damage:
    """Something a run met that it could not use, and what was done about it.

    Attributes:
        message: what to tell the user ("" when there is nothing to say).
        lost: samples of the epoch lost with it.
        replaced: samples re-drawn in their place.
        shard: the damaged shard, when a shard is damaged.
        sample: the damaged sample's key, when a sample is.
        reason: what is wrong, without the names.
        source: the shard a damaged sample was read from, when known.
    """

    message: str
    lost: int = 0
    replaced: int = 0
    shard: str = ""
    sample: str = ""
    reason: str = ""
    source: str = ""

    def error(self) -> SampleError:
        """The SampleError `on_error="raise"` stops with."""
        return SampleError(self.message, shard=self.shard or self.source, sample=self.sample, reason=self.reason)


Report = Callable[[Damage], None]


class DamageLog:
    """The reading side's report: under "raise" the first damage is raised, under "skip" it waits to be told.

    The producer thread reads; the training loop's thread counts and logs.
    Messages wait in `pending` until the producer passes them on with the
    next batch, in order.

    Args:
        on_error: "skip" or "raise".
    """

    def __init__(self, on_error: str) -> None:
        self.strict = on_error == "raise"
        self.pending: list[Damage] = []

    def __call__(self, damage: Damage) -> None:
        if self.strict and (damage.lost or damage.shard):
            raise damage.error()
        self.pending.append(damage)


def ignore(damage: Damage) -> None:
    """A report that says nothing: for reading again what was reported already."""


def replace_failures(
    failures: list[tuple[int, str]],
    items: list[Item],
    labels: np.ndarray,
    keys: list[str],
    decode_at: Callable[[int, Item, Extras], bool],
    rng: np.random.Generator,
    later: Iterable[Donor],
    extras: list[Extras] | None = None,
) -> list[Damage]:
    """Fill the batch positions whose sample did not decode, in place; what was done, one Damage a position.

    Args:
        failures: (position, reason) of each sample that did not decode, in position order.
        items: the batch's (extension, bytes, seed) per position; replaced ones are updated.
        labels: the batch's labels; a replaced position gets its donor's.
        keys: the batch's sample keys; a replaced position gets its donor's.
        decode_at: decodes an item (with its extras: its targets) into a
            position; False when it does not decode.
        rng: draws the order in which the batch's good samples stand in.
        later: samples of the batches behind this one, for a batch with no good sample.
        extras: the batch's kept members per position (a task's targets), None:
            none; a replaced position gets its donor's.

    Returns:
        One Damage per failed position (lost 1, replaced 1).

    Raises:
        SampleError: nothing in this batch or the ones behind it decodes.
    """
    bad = {position for position, _ in failures}
    good = [position for position in range(len(items)) if position not in bad]
    kept = extras if extras is not None else [None] * len(items)
    own: list[Donor] = [
        (items[good[k]], int(labels[good[k]]), keys[good[k]], kept[good[k]]) for k in rng.permutation(len(good))
    ]
    borrowed = _Borrowed(iter(later))
    done = []
    for turn, (position, reason) in enumerate(failures):
        key, seed = keys[position], items[position][2]
        for item, label, donor_key, members in _candidates(own, borrowed, turn):
            fresh = (item[0], item[1], seed)
            chosen = fresh if decode_at(position, fresh, members) else item if decode_at(position, item, members) else None
            if chosen is not None:
                items[position], labels[position], keys[position] = chosen, label, donor_key
                if extras is not None:
                    extras[position] = members
                break
        else:
            raise SampleError(
                f"sample {key}: {reason}; no sample of its batch or of the batches behind it decodes to replace it",
                sample=key,
                reason=reason,
            )
        message = f"sample {key}: {reason}; replaced by sample {donor_key}"
        done.append(Damage(message, lost=1, replaced=1, sample=key, reason=reason))
    return done


class _Borrowed:
    """Donors from the batches behind, pulled only when a batch has no good sample of its own."""

    def __init__(self, source: Iterator[Donor]) -> None:
        self.source = source
        self.seen: list[Donor] = []
        self.exhausted = False

    def pull(self) -> Donor | None:
        if self.exhausted:
            return None
        donor = next(self.source, None)
        if donor is None:
            self.exhausted = True
            return None
        self.seen.append(donor)
        return donor


def _candidates(own: list[Donor], borrowed: _Borrowed, turn: int) -> Iterator[Donor]:
    """Who may stand in for the `turn`-th failure: the batch's own good samples from the turn-th on, then borrowed ones."""
    for k in range(len(own)):
        yield own[(turn + k) % len(own)]
    while len(borrowed.seen) <= turn and borrowed.pull() is not None:
        pass
    known = len(borrowed.seen)
    for k in range(known):
        yield borrowed.seen[(turn + k) % known]
    while (donor := borrowed.pull()) is not None:
        yield donor
