"""Shard planning: which listing index goes to which shard, without a list in memory.

The plan maps output positions to listing indices through a seeded
pseudo-random permutation (a small Feistel network with cycle walking), so a
shard's members are computed on demand: shuffling millions of samples across
shards needs no in-memory list. A plan without the shuffle (`order="aspect"`,
whose listing is already in the order the shards keep: `aspect.py`) maps each
position to the listing index of the same number.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_OWN_SHARD_PATH = re.compile(r"(?:v\d+/)?shard-(\d{6,})\.tar")


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Which listing indices go into which shard.

    Attributes:
        items: number of listed sources.
        samples_per_shard: planned positions per shard (rejects leave gaps).
        seed: permutation seed.
        shuffle: positions go through the permutation; False: position i is listing index i.
    """

    items: int
    samples_per_shard: int
    seed: int
    shuffle: bool = True

    @property
    def shards(self) -> int:
        return max(1, -(-self.items // self.samples_per_shard)) if self.items else 0

    def positions(self, shard: int) -> range:
        start = shard * self.samples_per_shard
        return range(start, min(self.items, start + self.samples_per_shard))

    def indices(self, shard: int) -> np.ndarray:
        """Listing indices of the shard's members, in write order."""
        span = self.positions(shard)
        if not self.shuffle:
            return np.arange(span.start, span.stop, dtype=np.int64)
        return permute(np.arange(span.start, span.stop, dtype=np.uint64), self.items, self.seed)

    def to_dict(self) -> dict[str, int]:
        data = dataclasses.asdict(self)
        if self.shuffle:  # recorded as plans were before the unshuffled one existed
            del data["shuffle"]
        return data


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    # splitmix64 finaliser: a good 64-bit mixing function, vectorised.
    with np.errstate(over="ignore"):
        z = (values + key) & _MASK64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return z ^ (z >> np.uint64(31))


def permute(positions: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A seeded bijection of range(n) applied to `positions` (uint64 array).

    A balanced Feistel network permutes [0, 4^k) with 4^k >= n; values that
    land outside [0, n) are walked again until they fall inside (cycle walking
    keeps it a bijection of [0, n)).
    """
    if n <= 1:
        return positions.astype(np.int64)
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half_bits) - 1)
    keys = [
        np.uint64((seed * 0x9E3779B97F4A7C15 + round_ * 0xD1B54A32D192ED03) & 0xFFFFFFFFFFFFFFFF) for round_ in range(4)
    ]

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half_bits), x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & mask)
        return (left << np.uint64(half_bits)) | right

    out = encrypt(positions.astype(np.uint64))
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = encrypt(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


def plan_shards(items: int, samples_per_shard: int, seed: int, *, shuffle: bool = True) -> ShardPlan:
    """A ShardPlan of `items` sources with at most `samples_per_shard` per shard (shuffled unless `shuffle` is False)."""
    return ShardPlan(items=items, samples_per_shard=max(1, samples_per_shard), seed=seed, shuffle=shuffle)


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def planned_shard_of(path: str) -> int | None:
    """The planned shard a file of a prepare's own layout belongs to, from its path in OUT.

    `shard-000002.tar` and `v1/shard-000002.tar` -> 2; None for any other path
    (a re-pack's version folder `r0001/…` is not a prepare's layout).
    """
    match = _OWN_SHARD_PATH.fullmatch(path)
    return int(match.group(1)) if match else None
