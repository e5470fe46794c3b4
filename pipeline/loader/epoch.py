"""The loader's input side: which samples an epoch reads, in which order, from which bytes.

An epoch's order is a pure function of (seed, epoch, rank, world size) and the
dataset: shards are shuffled, concatenated and cut into one contiguous range
per rank (whole shards read sequentially, at most one partial shard at each
end), a few shards are interleaved, then a seeded shuffle buffer mixes
samples. Because the order is deterministic, resuming mid-epoch is just
replaying the order and skipping what was already delivered.
`epoch_records` puts these steps together: the records a run's producer
batches (`workers.py`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import ManifestError
from ..io.tar import TarFormatError, iter_tar_samples
from ..specs import LoaderSpec
from .dataset import ShardRef, open_shard

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "npy", "ppm", "bmp", "tif", "tiff")


@dataclasses.dataclass(frozen=True)
class Segment:
    """Members [start, stop) of one shard."""

    shard: int
    start: int
    stop: int


def plan_epoch(
    shards: list[ShardRef], *, seed: int, epoch: int, rank: int, world: int, shuffle: bool, drop_last: bool
) -> tuple[list[Segment], int]:
    """This rank's segments for an epoch and its sample count.

    Every rank gets the same count: with `drop_last` the global tail that
    does not divide evenly is dropped (a different tail each epoch), else
    ranks that come up short wrap around to the start (padding, as
    torch's DistributedSampler does).
    """
    order = list(range(len(shards)))
    if shuffle:
        np.random.default_rng([seed, epoch, 0x5A4D]).shuffle(order)
    total = sum(s.samples for s in shards)
    per_rank = total // world if drop_last else -(-total // world)
    start = rank * per_rank
    stop = start + per_rank
    segments: list[Segment] = []
    for lo, hi in ((start, min(stop, total)), (0, max(0, stop - total))):
        if hi > lo:
            segments.extend(_cut(shards, order, lo, hi))
    return segments, per_rank


def _cut(shards: list[ShardRef], order: list[int], lo: int, hi: int) -> list[Segment]:
    segments = []
    offset = 0
    for index in order:
        count = shards[index].samples
        begin, end = max(lo, offset), min(hi, offset + count)
        if end > begin:
            segments.append(Segment(index, begin - offset, end - offset))
        offset += count
        if offset >= hi:
            break
    return segments


@dataclasses.dataclass
class Record:
    """One sample on its way to a batch: compressed bytes, label, and a stable id for seeding."""

    key: str
    data: bytes
    extension: str
    label: int
    ordinal: int


def pick_image(members: dict[str, bytes]) -> tuple[str, bytes] | None:
    for extension in IMAGE_EXTENSIONS:
        if extension in members:
            return extension, members[extension]
    return None


def read_segments(
    shards: list[ShardRef], segments: list[Segment], interleave: int, on_error: Any
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Samples of the segments, `interleave` shards open at once, taken in turn.

    A corrupt shard part is reported through `on_error(message)` and the
    rest of that shard is skipped; the epoch goes on.
    """
    pending = list(segments)
    active: list[Iterator[tuple[str, dict[str, bytes]]]] = []
    while pending or active:
        while pending and len(active) < interleave:
            active.append(_segment_samples(shards, pending.pop(0), on_error))
        for stream in list(active):
            item = next(stream, None)
            if item is None:
                active.remove(stream)
            else:
                yield item


def _segment_samples(shards: list[ShardRef], segment: Segment, on_error: Any) -> Iterator[tuple[str, dict[str, bytes]]]:
    url = shards[segment.shard].url
    try:
        with open_shard(url) as handle:
            for position, sample in enumerate(iter_tar_samples(handle, url)):
                if position >= segment.stop:
                    return
                if position >= segment.start:
                    yield sample
    except (TarFormatError, OSError, ManifestError) as exc:
        on_error(f"{url}: {exc}; skipping the rest of this shard")


def shuffle_buffer(items: Iterator[Any], size: int, rng: np.random.Generator, initial: int = 64) -> Iterator[Any]:
    """Seeded shuffle buffer: deterministic for a given input order and rng.

    It starts yielding once `initial` items are in (so the first batch of an
    epoch does not wait for the whole buffer to fill) and reads two items per
    yield until it holds `size`.
    """
    if size <= 1:
        yield from items
        return
    buffer: list[Any] = []
    initial = min(initial, size)
    for item in items:
        buffer.append(item)
        if len(buffer) < size:
            extra = next(items, None)
            if extra is not None:
                buffer.append(extra)
        if len(buffer) >= initial:
            slot = int(rng.integers(len(buffer)))
            buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
            yield buffer.pop()
    rng.shuffle(buffer)
    yield from buffer


def epoch_records(
    shards: list[Any], spec: LoaderSpec, epoch: int, rank: int, world_size: int, errors: list[str]
) -> Iterator[Record]:
    """This rank's samples of an epoch, in their deterministic order.

    Args:
        shards: the shards the epoch reads (one variant set of the dataset).
        spec: the loader's settings (seed, shuffling, interleave, drop_last).
        epoch: the epoch number.
        rank: this process's rank.
        world_size: the number of ranks.
        errors: receives a message for each shard part or sample skipped.

    Yields:
        Records with consecutive ordinals from 0, at most as many as each rank gets.
    """
    segments, per_rank = plan_epoch(
        shards,
        seed=spec.seed,
        epoch=epoch,
        rank=rank,
        world=world_size,
        shuffle=spec.train,
        drop_last=spec.effective_drop_last,
    )
    samples = read_segments(shards, segments, spec.interleave if spec.train else 1, errors.append)
    if spec.train:
        rng = np.random.default_rng([spec.seed, epoch, rank, 0x5B])
        samples = shuffle_buffer(samples, spec.shuffle_buffer, rng)
    ordinal = 0
    for key, members in samples:
        picked = pick_image(members)
        if picked is None:
            errors.append(f"sample {key} has no image member ({', '.join(sorted(members))})")
            continue
        label = int(members["cls"]) if members.get("cls", b"").strip().lstrip(b"-").isdigit() else -1
        yield Record(key, picked[1], picked[0], label, ordinal)
        ordinal += 1
        if ordinal >= per_rank:
            return
