"""The loader's input side: which samples an epoch reads, in which order, from which bytes.

An epoch's order is a pure function of (seed, epoch, rank, world size) and the
dataset: shards are shuffled, concatenated and cut into one contiguous range
per rank (whole shards read sequentially, at most one partial shard at each
end), a few shards are interleaved, then a seeded shuffle buffer mixes
samples. Because the order is deterministic, resuming mid-epoch is just
replaying the order and skipping what was already delivered.
`epoch_records` puts these steps together: the records a run's producer
batches (`runs.py`). Damaged shards are reported as they are met and the
samples lost with them made up at the end of the epoch (`damage.py`), so the
epoch still has its planned number of records."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

from ..errors import ManifestError, SampleError, SourceError
from ..io.tar import DigestReader, TarFormatError, iter_tar_samples
from ..specs import LoaderSpec
from ..targets import task_members
from .damage import Damage, Report, ignore
from .dataset import ShardRef
from .streaming import ShardOpener

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
    order = shard_order(len(shards), seed=seed, epoch=epoch, shuffle=shuffle)
    total = sum(s.samples for s in shards)
    per_rank = total // world if drop_last else -(-total // world)
    own, padding = _plan(shards, order, total, per_rank, rank)
    return own + padding, per_rank


def _plan(
    shards: list[ShardRef], order: list[int], total: int, per_rank: int, rank: int
) -> tuple[list[Segment], list[Segment]]:
    """A rank's segments of its own range of the epoch, and those of its wrap-around (padding)."""
    (start, stop), (_, wrap) = plan_ranges(total, per_rank, rank)
    return _cut(shards, order, start, stop), _cut(shards, order, 0, wrap)


def plan_ranges(total: int, per_rank: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rank's range of the epoch's `total` samples in shard order, and its wrap-around (padding) from the start."""
    start = rank * per_rank
    stop = start + per_rank
    return (start, min(stop, total)), (0, max(0, stop - total))


def shard_order(count: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's order of its `count` shards (the same on every rank)."""
    order = list(range(count))
    if shuffle:
        np.random.default_rng([seed, epoch, 0x5A4D]).shuffle(order)
    return order


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


ShardSample = tuple[str, dict[str, bytes], str]  # a sample as read: its key, its members, its shard's URL


@dataclasses.dataclass
class Record:
    """One sample on its way to a batch: compressed bytes, label, and a stable id for seeding."""

    key: str
    data: bytes
    extension: str
    label: int
    ordinal: int
    extras: dict[str, bytes] | None = None  # the members a task or fields= keeps (`tasks.TaskPlan.keep`)
    shard: str = ""  # the shard it was read from (what a damage message names)


def pick_image(members: dict[str, bytes]) -> tuple[str, bytes] | None:
    for extension in IMAGE_EXTENSIONS:
        if extension in members:
            return extension, members[extension]
    return None


MAX_LABEL = 2**63 - 1  # labels are int64


def label_bound(shards: list[Any]) -> int:
    """One past the largest label the shards' samples may have: their manifest's class count, else int64's bound."""
    counts = [shard.classes for shard in shards if getattr(shard, "classes", None) is not None]
    return min(counts) if counts else MAX_LABEL + 1


def sample_label(members: dict[str, bytes], bound: int) -> tuple[int, str]:
    """A sample's label and "", or (-1, why it is damaged); -1 and "" for a sample without a `cls` (unlabelled).

    A label is ASCII decimal digits (spaces around them allowed), 0 <= label < `bound`.
    """
    text = members.get("cls")
    if text is None:
        return -1, ""
    digits = text.strip()
    if digits.isdigit() and len(digits) <= 19:  # bytes.isdigit: ASCII 0-9 only; 19 digits fit an int64
        label = int(digits)
        if label < bound:
            return label, ""
        allowed = "int64" if bound > MAX_LABEL else f"{bound} classes"
        return -1, f"label {label} is out of range (the dataset has {allowed})"
    return -1, f"label {text[:24]!r} is not a non-negative integer"


@dataclasses.dataclass
class ReadLog:
    """How reading an epoch's segments went: where to report damage, and which parts read without fault.

    Attributes:
        report: receives a Damage for each damaged shard met.
        verify: check each shard's sha256 (and size) against the manifest's as it streams.
        good: the parts read without fault, by segment number: what makes up for lost samples.
        opener: opens each shard, given the ones the epoch opens after it (read-ahead of remote shards).
    """

    report: Report
    verify: bool = False
    opener: ShardOpener = dataclasses.field(default_factory=ShardOpener)
    good: dict[int, Segment] = dataclasses.field(default_factory=dict)


def read_segments(
    shards: list[ShardRef], segments: list[Segment], interleave: int, log: ReadLog
) -> Iterator[ShardSample]:
    """Samples of the segments, `interleave` shards open at once, taken in turn.

    A shard that cannot be opened, is corrupt or ends early (or, with
    `log.verify`, does not match its sha256) is reported once to
    `log.report`, with the samples of the segment lost; the rest of that
    shard is skipped and the epoch goes on.
    """

    def open_segment(number: int, later: list[int]) -> Iterator[ShardSample]:
        upcoming = [shards[segments[n].shard] for n in later[: log.opener.ahead]]
        return _segment_samples(shards, number, segments[number], upcoming, log)

    return take_turns(len(segments), interleave, open_segment)


def take_turns(count: int, interleave: int, open_stream: Callable[[int, list[int]], Iterator[Any]]) -> Iterator[Any]:
    """The items of streams 0..count-1, `interleave` open at once, taken in turn.

    `open_stream(number, later)` opens stream `number`; `later` are the
    numbers of the streams still to open after it, in order.
    """
    pending = list(range(count))
    active: list[Iterator[Any]] = []
    while pending or active:
        while pending and len(active) < interleave:
            number = pending.pop(0)
            active.append(open_stream(number, pending))
        for stream in list(active):
            item = next(stream, None)
            if item is None:
                active.remove(stream)
            else:
                yield item


def _segment_samples(
    shards: list[ShardRef], number: int, segment: Segment, upcoming: list[ShardRef], log: ReadLog
) -> Iterator[ShardSample]:
    shard = shards[segment.shard]
    url = shard.url
    read = 0  # samples of the shard read so far, from its start
    hashed = False  # the damage is a hash mismatch: what was read cannot be trusted either
    try:
        with log.opener.open(shard, upcoming) as handle:
            reader = DigestReader(handle) if log.verify else handle
            samples = iter_tar_samples(reader, url)
            try:
                for read, (key, members) in enumerate(samples, 1):
                    if read > segment.stop:
                        break
                    if read > segment.start:
                        yield key, members, url
            finally:
                samples.close()
            reason = f"it ends after {read} samples, the manifest says {shard.samples}" if read < segment.stop else ""
            if not reason and isinstance(reader, DigestReader):
                reason = _hash_problem(shard, reader)
                hashed = bool(reason)
    except TarFormatError as exc:
        reason = exc.reason
    except (OSError, ManifestError, SourceError) as exc:
        reason = _open_problem(exc)
    intact = min(max(read, segment.start), segment.stop)  # the segment's samples read before the damage
    if not reason:
        log.good[number] = segment
        return
    lost = segment.stop - intact
    if intact > segment.start and not hashed:  # what was read before the damage is good
        log.good[number] = Segment(segment.shard, segment.start, intact)
    said = f"{lost} of this epoch's samples lost with it" if lost else "its samples were already read"
    log.report(Damage(f"damaged shard {url}: {reason} ({said})", lost=lost, shard=url, reason=reason))


def _hash_problem(shard: ShardRef, reader: DigestReader) -> str:
    """Why a shard whose samples all read is still damaged under verify=True ("" when it is not)."""
    reader.drain()  # the rest of the shard (a segment may end inside it): the hash covers every byte
    if shard.bytes is not None and reader.bytes != shard.bytes:
        return f"{reader.bytes} bytes, the manifest says {shard.bytes} (sha256 mismatch)"
    if reader.hexdigest() != shard.sha256:
        return "its bytes do not match the manifest's sha256"
    return ""


def _open_problem(exc: BaseException) -> str:
    """What stopped a shard from being read, without the shard's name (the message adds it once)."""
    cause = exc.__cause__ if isinstance(exc, (ManifestError, SourceError)) and isinstance(exc.__cause__, OSError) else exc
    if isinstance(cause, OSError):
        return f"cannot read it: {cause.strerror or type(cause).__name__}"
    return str(exc)


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
    shards: list[Any],
    spec: LoaderSpec,
    epoch: int,
    rank: int,
    world_size: int,
    report: Report,
    opener: ShardOpener | None = None,
) -> Iterator[Record]:
    """This rank's samples of an epoch, in their deterministic order.

    As many as the epoch's batches take: every sample of the rank's plan
    (`plan_epoch`), or with `drop_last` the full batches' worth of them.
    Samples lost to damage are made up at the end by reading again this
    rank's parts of the epoch that read without fault (`damage.py`).

    Args:
        shards: the shards the epoch reads (one variant set of the dataset).
        spec: the loader's settings (seed, shuffling, interleave, drop_last, verify).
        epoch: the epoch number.
        rank: this process's rank.
        world_size: the number of ranks.
        report: receives a Damage for each damaged shard or sample, and one
            for the replacements; under on_error="raise" it raises instead.
        opener: opens the shards (read-ahead and the cache of remote ones);
            None: local files as they are, remote shards read ahead.

    Yields:
        Records with consecutive ordinals from 0.

    Raises:
        SampleError: nothing of the epoch's shards can be read to make up for lost samples.
    """
    drop_last = spec.effective_drop_last
    segments, per_rank = plan_epoch(
        shards, seed=spec.seed, epoch=epoch, rank=rank, world=world_size, shuffle=spec.train, drop_last=drop_last
    )
    wanted = per_rank // spec.batch_size * spec.batch_size if drop_last else per_rank
    log = ReadLog(report, spec.verify, opener=opener or ShardOpener())
    samples = shuffle_rank(read_segments(shards, segments, epoch_interleave(spec), log), spec, epoch, rank)
    bound = label_bound(shards)
    keep = kept_members(spec)
    delivered = yield from _records(samples, 0, wanted, report, bound, keep)
    for _ in samples:  # the rest of the plan: damage in the last shards is seen, verify hashes them whole
        pass
    if delivered < wanted:
        report(Damage("", replaced=wanted - delivered))
        stand_ins = _stand_ins(shards, segments, log, spec, epoch, rank, wanted - delivered, bound)
        yield from _records(stand_ins, delivered, wanted, ignore, bound, keep)


def epoch_interleave(spec: LoaderSpec) -> int:
    """Shards an epoch reads at once, taken in turn: `spec.interleave` in train mode, else one after the other."""
    return spec.interleave if spec.train else 1


def shuffle_rank(items: Iterator[Any], spec: LoaderSpec, epoch: int, rank: int) -> Iterator[Any]:
    """A rank's samples of an epoch, as read, through its seeded shuffle buffer (train mode; else as they are)."""
    if not spec.train:
        return items
    return shuffle_buffer(items, spec.shuffle_buffer, np.random.default_rng([spec.seed, epoch, rank, 0x5B]))


def kept_members(spec: LoaderSpec) -> frozenset[str] | None:
    """The members a record keeps besides its image and class: those of the spec's task and fields; None: none."""
    if spec.task in (None, "classification") and not spec.fields:
        return None
    return task_members(spec.task or "classification", spec.fields)


def _records(
    samples: Iterator[ShardSample],
    ordinal: int,
    wanted: int,
    report: Report,
    bound: int,
    keep: frozenset[str] | None = None,
) -> Generator[Record, None, int]:
    """Records numbered from `ordinal` until `wanted`; returns where the numbering stopped.

    A sample without an image or with a label that is no integer in [0, `bound`) is damage, reported.
    With `keep`, each record keeps those of its members (the task's targets, the fields asked for).
    """
    if ordinal >= wanted:
        return ordinal
    for key, members, shard in samples:
        picked = pick_image(members)
        label, reason = sample_label(members, bound)
        if picked is None or reason:
            reason = reason or f"no image member ({', '.join(sorted(members))})"
            report(Damage(f"sample {key} of {shard}: {reason}", lost=1, sample=key, reason=reason, source=shard))
            continue
        extras = None if keep is None else {name: members[name] for name in keep if name in members}
        yield Record(key, picked[1], picked[0], label, ordinal, extras, shard)
        ordinal += 1
        if ordinal >= wanted:
            break
    return ordinal


def _stand_ins(
    shards: list[ShardRef],
    segments: list[Segment],
    log: ReadLog,
    spec: LoaderSpec,
    epoch: int,
    rank: int,
    count: int,
    bound: int,
) -> Iterator[ShardSample]:
    """Samples to make up for `count` lost ones: the rank's good parts again, wrapping around (see `damage.py`)."""
    parts = [log.good[number] for number in sorted(log.good)]
    if not parts:  # nothing of this rank's own read: the epoch's other shards, in the epoch's order
        mine = {segment.shard for segment in segments}
        order = shard_order(len(shards), seed=spec.seed, epoch=epoch, shuffle=spec.train)
        parts = [Segment(index, 0, shards[index].samples) for index in order if index not in mine]
    stand_ins = _wrapping(shards, parts, count, log, bound)
    if spec.train:
        rng = np.random.default_rng([spec.seed, epoch, rank, 0x5C])
        stand_ins = shuffle_buffer(stand_ins, min(spec.shuffle_buffer, count), rng)
    return stand_ins


MAX_REDRAW_PASSES = 64  # stand-ins read the good parts at most this often: more lost is a dataset to check


def _wrapping(
    shards: list[ShardRef], parts: list[Segment], count: int, log: ReadLog, bound: int
) -> Iterator[ShardSample]:
    """At least `count` usable samples (an image, a good label) from `parts`, read again and again in order.

    Raises:
        SampleError: nothing in `parts` is usable, or `count` would take more
            than MAX_REDRAW_PASSES passes over them (far more was lost than read well).
    """
    given = 0
    for _ in range(MAX_REDRAW_PASSES):
        before = given
        for key, members, shard in read_segments(shards, parts, 1, ReadLog(ignore, opener=log.opener)):
            if pick_image(members) is not None and not sample_label(members, bound)[1]:
                yield key, members, shard
                given += 1
                if given >= count:
                    return
        if given == before:
            raise SampleError(
                f"{count} samples of this epoch were lost to damage and none of its shards "
                "can be read to make up for them; check the dataset with `gpufeed inspect --verify`"
            )
    raise SampleError(
        f"{count} samples of this epoch were lost to damage, over {MAX_REDRAW_PASSES} times the {given // MAX_REDRAW_PASSES} "
        "that read well to make up for them; check the dataset with `gpufeed inspect --verify`"
    )


def records_per_rank(shards: list[ShardRef], spec: LoaderSpec, world_size: int) -> int:
    """Records each rank's epoch holds at `world_size` (all ranks the same): its plan, or its full batches with drop_last."""
    total = sum(shard.samples for shard in shards)
    if spec.effective_drop_last:
        return total // world_size // spec.batch_size * spec.batch_size
    return -(-total // world_size)


def padding_positions(shards: list[ShardRef], spec: LoaderSpec, epoch: int, rank: int, world_size: int) -> list[int]:
    """Where this rank's padding falls among its records of the epoch (by position, from 0).

    Padding: with drop_last=False, the samples a rank that comes up short
    wraps around to (fewer than `world_size` over all ranks). Worked out
    from the plan's segment lengths alone, read and shuffled as
    `epoch_records` does (reading nothing), so it is exact as long as no
    shard is damaged.
    """
    if spec.effective_drop_last:
        return []
    total = sum(shard.samples for shard in shards)
    per_rank = -(-total // world_size)
    order = shard_order(len(shards), seed=spec.seed, epoch=epoch, shuffle=spec.train)
    own, padding = _plan(shards, order, total, per_rank, rank)
    if not padding:
        return []
    segments = own + padding

    def flags(number: int, _later: list[int]) -> Iterator[bool]:
        return itertools.repeat(number >= len(own), segments[number].stop - segments[number].start)

    ordered = shuffle_rank(take_turns(len(segments), epoch_interleave(spec), flags), spec, epoch, rank)
    return [position for position, pad in enumerate(itertools.islice(ordered, per_rank)) if pad]
