"""Re-pack a prepared dataset into new shards, or re-augment it from the source, swapping it in atomically.

Re-packing copies every sample's tar members as they are (no decoding) into a
new shard layout: bounded by samples or bytes per shard, and optionally a
shard count that is a multiple of W (world size x loader workers, so every
GPU worker gets whole shards). Shards are balanced to within one sample.

In place, a new version is written beside the old one in `DATASET/rNNNN/`
and the manifest is the switch: `manifest.json` is replaced in one atomic
rename once the new shards are complete and verified. A reader that opened
the old manifest keeps reading the old files, which stay until `keep` newer
versions exist. `--out NEW` writes a complete dataset to NEW instead.

Re-augmenting runs prepare again from the recorded source and settings with a
new seed (fresh variant sets) into the new version, through the same step
API a distributed runner uses (`plan_reaugment` -> prepare ->
`publish_reaugment`).

A swap records what it does in its version folder (`.gpufeed-swap.json`)
before the switch, so a run that stops right after the switch is completed,
not repeated, by the next `publish_reaugment` of the same version, and
reports what the first one did.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ConfigError, JobConflictError, ManifestError
from ..io.output import Output
from ..io.tar import ShardInfo, TarShardWriter, iter_tar_samples, sample_tar_bytes
from ..manifest import (
    MANIFEST_NAME,
    REJECTED_NAME,
    Manifest,
    read_manifest,
    shard_location,
    verify_dataset,
    write_manifest,
)
from ..specs import MAX_SHARDS, PrepareSpec, ShardSpec, Spec, check_int
from .job import prepare_dataset
from .plan import shard_name
from .steps import discard_prepare, finish_prepare
from .versions import (
    ROOT_SHARD,
    VERSION_DIR,
    SwapInfo,
    claim_version,
    shards_per_set,
    swap_version,
    swapped_in,
)

ReshardProgress = Callable[[int, int], None]
"""Called with (shards written, shards to write) after every new shard."""


@dataclasses.dataclass(frozen=True)
class ReshardSpec(Spec):
    """One reshard of an existing dataset.

    Attributes:
        dataset: the prepared dataset (folder or URL holding manifest.json).
        out: write the result here as a new dataset instead of a new version in place.
        shards: exactly this many shards per variant set (`--shards`), on its own: not with
            `max_samples`, `max_bytes`, `multiple_of` or `reaugment`.
        max_samples: at most this many samples per shard (`--shard-samples`).
        max_bytes: about this many bytes per shard at most (`--shard-size`).
        multiple_of: make the number of shards (per variant set) a multiple of this.
        reaugment: prepare again from the source with `seed` instead of re-packing.
        seed: the new augmentation seed (with `reaugment`).
        keep: older versions kept for readers that still use them (in place).
    """

    dataset: str
    out: str | None = None
    max_samples: int | None = None
    max_bytes: int | None = None
    multiple_of: int | None = None
    reaugment: bool = False
    seed: int | None = None
    keep: int = 1
    shards: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not self.dataset.strip():
            raise ConfigError("dataset must be a non-empty path or URL")
        if self.out is not None and (not isinstance(self.out, str) or not self.out.strip()):
            raise ConfigError("out must be a non-empty path or URL")
        if self.out is not None and self.out.rstrip("/") == self.dataset.rstrip("/"):
            raise ConfigError("out must differ from dataset (without it, a reshard writes a new version in place)")
        if self.max_samples is not None:
            check_int("max_samples", self.max_samples, 1)
        if self.max_bytes is not None:
            check_int("max_bytes", self.max_bytes, 64 * 1024)
        if self.multiple_of is not None:
            check_int("multiple_of", self.multiple_of, 1, MAX_SHARDS)
        if self.shards is not None:
            self._check_shards()
        if not isinstance(self.reaugment, bool):
            raise ConfigError("reaugment must be true or false")
        check_int("keep", self.keep, 0, 100)
        if self.reaugment:
            if self.seed is None:
                raise ConfigError("reaugment needs seed=S: what the new augmentations are drawn with")
            check_int("seed", self.seed, 0, 2**63 - 1)
            if self.multiple_of is not None:
                raise ConfigError("multiple_of cannot be combined with reaugment; re-pack after re-augmenting")
        elif self.seed is not None:
            raise ConfigError("seed only applies with reaugment (re-packing keeps every sample's bytes)")
        elif self.max_samples is None and self.max_bytes is None and self.multiple_of is None and self.shards is None:
            raise ConfigError("give max_samples, shards, max_bytes or multiple_of (or reaugment with seed=S)")

    def _check_shards(self) -> None:
        check_int("shards", self.shards, 1, MAX_SHARDS)
        layout = (("max_samples", self.max_samples), ("max_bytes", self.max_bytes), ("multiple_of", self.multiple_of))
        others = [name for name, value in layout if value is not None]
        if others:
            raise ConfigError(f"shards sets the layout on its own; give it without {', '.join(others)}")
        if self.reaugment:
            raise ConfigError("shards re-packs; re-augment first, then reshard with shards=N")


@dataclasses.dataclass
class ReshardResult:
    """A finished reshard."""

    dataset: str
    out: str
    version: str
    shards_before: int
    shards_after: int
    samples: int
    rejected: int
    variants: int
    bytes: int
    seconds: float
    reaugmented: bool
    removed: list[str] = dataclasses.field(default_factory=list)
    decoded_with_warnings: int = 0  # the dataset's, from its manifest (see `PrepareResult`)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["seconds"] = round(self.seconds, 3)
        return data


def reshard_dataset(
    spec: ReshardSpec, *, workers: int | None = None, progress: ReshardProgress | None = None
) -> ReshardResult:
    """Re-pack (no decoding) or re-augment DATASET; see the module docstring.

    Args:
        spec: what to do.
        workers: prepare processes when re-augmenting (None: available cores).
        progress: called with (shards written, shards to write) while re-packing.

    Raises:
        ConfigError: impossible settings (e.g. more shards than samples).
        ManifestError: DATASET is not a prepared dataset, or the new version failed verification.
        JobConflictError: DATASET changed while it was being resharded (nothing is swapped).
    """
    if not spec.reaugment:
        return repack_dataset(spec, progress=progress)
    started = time.perf_counter()
    staged = plan_reaugment(spec)
    try:
        prepare_dataset(staged, workers=workers)
    except BaseException:
        discard_reaugment(spec, staged)
        raise
    return publish_reaugment(spec, staged, started=started)


# ---------------------------------------------------------------------------
# Re-packing


def target_shard_count(manifest: Manifest, spec: ReshardSpec) -> int:
    """Shards per variant set after the reshard.

    Raises:
        ConfigError: the dataset has fewer samples than the shards asked for.
    """
    samples = manifest.samples
    if samples == 0:
        raise ConfigError("DATASET holds no samples; there is nothing to re-pack")
    sets = _shard_sets(manifest)
    count = len(sets[0][1]) if spec.shards is None else spec.shards
    if spec.max_samples is not None or spec.max_bytes is not None:
        count = 1
        if spec.max_samples is not None:
            count = max(count, math.ceil(samples / spec.max_samples))
        if spec.max_bytes is not None:
            set_bytes = sum(shard.bytes for shard in sets[0][1])
            count = max(count, math.ceil(set_bytes / spec.max_bytes))
    if spec.multiple_of is not None:
        count = math.ceil(count / spec.multiple_of) * spec.multiple_of
    if count > samples:
        raise ConfigError(
            f"cannot cut {samples} samples into {count} shards (each shard needs at least one sample)"
            + (f"; --multiple-of {spec.multiple_of} needs at least that many samples" if spec.multiple_of else "")
        )
    return count


def claim_repack(spec: ReshardSpec) -> str:
    """Claim the version folder a re-pack of DATASET writes (`rNNNN`; "" with `spec.out`), for `repack_dataset(version=)`.

    A runner that may deliver the same re-pack more than once (a worker lost
    after its swap) claims once and hands every delivery the same version.
    """
    return "" if spec.out is not None else claim_version(Output(spec.dataset))


def repack_dataset(spec: ReshardSpec, *, progress: ReshardProgress | None = None, version: str | None = None) -> ReshardResult:
    """Copy every sample into a new shard layout, verify it, then swap it in (or write it to `spec.out`).

    Args:
        spec: the re-pack (not `reaugment`).
        progress: called with (shards written, shards to write) after every new shard.
        version: what `claim_repack` returned for this re-pack. A run whose re-pack already
            happened (the version is current, or `spec.out` holds its dataset) writes nothing
            and returns that re-pack's result; one whose earlier run stopped before its swap
            writes the version folder again. None claims a fresh version: a re-pack of its own.

    Raises:
        ConfigError: impossible settings (e.g. more shards than samples).
        ManifestError: DATASET is not a prepared dataset, or the new version failed verification.
        JobConflictError: DATASET changed while it was being re-packed, or `version` was
            swapped in and replaced since (nothing is swapped).
    """
    started = time.perf_counter()
    source = Output(spec.dataset)
    done = _repacked_already(spec, source, version, started) if version is not None else None
    if done is not None:
        return done
    manifest = read_manifest(source)
    for shard in manifest.shards:  # never a link out of the dataset, checked before any is read
        shard_location(source, shard.path)
    sets = _shard_sets(manifest)
    count = target_shard_count(manifest, spec)
    target, version = _open_target(spec, source, version)
    try:
        shards: list[ShardInfo] = []
        for variant, old in sets:
            for info in _repack_set(source, old, target, version, variant, count):
                shards.append(info)
                if progress is not None:
                    progress(len(shards), count * len(sets))
        new = dataclasses.replace(manifest, shards=shards, created="")
        _verify_or_raise(target, new)
        removed = _publish(spec, source, target, manifest, new, version)
    except BaseException:
        _discard_target(spec, source, target, version)
        raise
    return _repack_result(spec, new, version, len(sets[0][1]), removed, started)


def _shard_sets(manifest: Manifest) -> list[tuple[int | None, list[ShardInfo]]]:
    """The manifest's shards grouped by variant set, in manifest order."""
    sets: dict[int | None, list[ShardInfo]] = {}
    for shard in manifest.shards:
        sets.setdefault(shard.variant, []).append(shard)
    if not sets:
        raise ManifestError("the manifest lists no shards")
    return [(variant, sets[variant]) for variant in sorted(sets, key=lambda v: -1 if v is None else v)]


def _repacked_already(spec: ReshardSpec, source: Output, version: str, started: float) -> ReshardResult | None:
    """The result of the re-pack that claimed `version`, when it already happened (its swap completed now)."""
    if spec.out is None:
        swap = swapped_in(source, version)
        if swap is None:
            return None
        current = read_manifest(source)
        return _repack_result(spec, current, version, swap.shards_before, swap.removed, started)
    target = Output(spec.out)
    if not target.exists(MANIFEST_NAME):
        return None
    written, original = read_manifest(target), read_manifest(source)
    if _strip_layout(written) != _strip_layout(original) or shards_per_set(written) != target_shard_count(original, spec):
        return None  # another dataset: _open_target refuses it
    return _repack_result(spec, written, "", shards_per_set(original), [], started)


def _strip_layout(manifest: Manifest) -> dict[str, Any]:
    """A manifest without what a re-pack changes (its shards, when it was written)."""
    data = manifest.to_dict()
    data.pop("shards", None)
    data.pop("created", None)
    return data


def _repack_result(
    spec: ReshardSpec, manifest: Manifest, version: str, shards_before: int, removed: list[str], started: float
) -> ReshardResult:
    return ReshardResult(
        dataset=spec.dataset,
        out=spec.out or spec.dataset,
        version=version,
        shards_before=shards_before,
        shards_after=shards_per_set(manifest),
        samples=manifest.samples,
        rejected=manifest.rejected,
        variants=manifest.variants,
        bytes=sum(shard.bytes for shard in manifest.shards),
        seconds=time.perf_counter() - started,
        reaugmented=False,
        removed=removed,
        decoded_with_warnings=manifest.decoded_with_warnings,
    )


def _open_target(spec: ReshardSpec, source: Output, version: str | None = None) -> tuple[Output, str]:
    """Where the new shards go: the version folder in DATASET (claimed now, or written again), or the root of `spec.out`."""
    if spec.out is None:
        if version is None:
            return source, claim_version(source)
        if not VERSION_DIR.fullmatch(version):
            raise ConfigError(f"{version!r} is not a version folder name (rNNNN); claim one with claim_repack")
        source.remove(version)  # what a run stopped before its swap wrote
        os.makedirs(source.local(version), exist_ok=True)
        return source, version
    target = Output(spec.out)
    if target.exists(MANIFEST_NAME):
        raise JobConflictError(f"{spec.out} already holds a dataset; choose an empty folder for --out")
    target.makedirs()
    return target, ""


def _repack_set(
    source: Output, old: list[ShardInfo], target: Output, version: str, variant: int | None, count: int
) -> Iterator[ShardInfo]:
    total = sum(shard.samples for shard in old)
    sizes = [total // count + (1 if i < total % count else 0) for i in range(count)]
    folder = (f"{version}/" if version else "") + (f"v{variant}/" if variant is not None else "")
    samples = _iter_set_samples(source, old)
    for index, size in enumerate(sizes):
        rel = folder + shard_name(index)
        with TarShardWriter(target.local(rel)) as writer:
            for _ in range(size):
                sample = next(samples, None)
                if sample is None:
                    raise ManifestError(f"{source.url}: the shards hold fewer samples than the manifest says; run inspect --verify")
                writer.write_sample_bytes(sample_tar_bytes(*sample))
            info = writer.commit(rel, variant)
        target.publish(rel)
        yield info
    if next(samples, None) is not None:
        raise ManifestError(f"{source.url}: the shards hold more samples than the manifest says; run inspect --verify")


def _iter_set_samples(source: Output, shards: list[ShardInfo]) -> Iterator[tuple[str, dict[str, bytes]]]:
    for shard in shards:
        with source.open_read(shard.path) as handle:
            yield from iter_tar_samples(handle, f"{source.url}/{shard.path}")


def _verify_or_raise(target: Output, manifest: Manifest) -> None:
    result = verify_dataset(target, manifest)
    if not result.ok:
        raise ManifestError("the new shards failed verification, nothing was swapped: " + "; ".join(result.problems[:5]))


def _publish(spec: ReshardSpec, source: Output, target: Output, old: Manifest, new: Manifest, version: str) -> list[str]:
    if spec.out is not None:
        if source.exists(REJECTED_NAME):
            target.write_bytes_atomic(REJECTED_NAME, source.read_bytes(REJECTED_NAME))
        write_manifest(target, new)
        return []
    return swap_version(source, old, new, version, spec.keep)


def _discard_target(spec: ReshardSpec, source: Output, target: Output, version: str) -> None:
    if spec.out is None:
        source.remove(version)
        return
    for name in target.listdir():
        if ROOT_SHARD.fullmatch(name) or (name.startswith(".shard-") and ".tmp-" in name):
            target.remove(name)


# ---------------------------------------------------------------------------
# Re-augmenting, in steps


def plan_reaugment(spec: ReshardSpec) -> PrepareSpec:
    """The prepare job that re-augments DATASET: its recorded settings with the new seed.

    In place, it writes into a freshly claimed version folder of DATASET.
    """
    output = Output(spec.dataset)
    manifest = read_manifest(output)
    params = dict(manifest.params)
    params["source"] = manifest.source
    params["seed"] = spec.seed
    if spec.max_samples is not None or spec.max_bytes is not None:
        params["shards"] = ShardSpec(max_bytes=spec.max_bytes, max_samples=spec.max_samples).to_dict()
    else:  # keep the current number of shards (which may come from an earlier re-pack)
        count = len(_shard_sets(manifest)[0][1])
        params["shards"] = ShardSpec(max_bytes=None, max_samples=math.ceil((manifest.samples + manifest.rejected) / count)).to_dict()
    params["out"] = spec.out if spec.out is not None else f"{output.url}/{claim_version(output)}"
    return PrepareSpec.from_dict(params)


def staged_version(spec: ReshardSpec, staged: PrepareSpec) -> str:
    """The version folder a re-augment writes to ("" with --out)."""
    if spec.out is not None:
        return ""
    return staged.out.rstrip("/").rsplit("/", 1)[-1]


def publish_reaugment(spec: ReshardSpec, staged: PrepareSpec, *, started: float | None = None) -> ReshardResult:
    """Finish a re-augment's prepare and swap it into DATASET (with --out: finish it there).

    Idempotent: once the swap happened (a re-delivered task, a worker that
    died right after the switch), a call finishes what that swap left undone
    and returns the same result; it never makes a second version.

    Args:
        spec: the reshard.
        staged: the prepare `plan_reaugment` made for it, all of its shards written.
        started: when the reshard began (`time.perf_counter()`), for `seconds`; default now.

    Returns:
        The reshard's result.

    Raises:
        StorageError: a staged shard is missing or does not match its record.
        ManifestError: the new version failed verification (nothing is swapped).
        JobConflictError: DATASET changed since the re-augment was planned (nothing is swapped),
            or a later reshard has replaced this one since its swap.
    """
    started = time.perf_counter() if started is None else started
    version = staged_version(spec, staged)
    if spec.out is not None:
        finish_prepare(staged)
        before = shards_per_set(read_manifest(Output(spec.dataset)))
        return _reaugment_result(spec, before, read_manifest(Output(spec.out)), version, [], started)
    output = Output(spec.dataset)
    stage = Output(staged.out)
    swap = swapped_in(output, version)
    if swap is None:
        finish_prepare(staged)
        swap = _swap_reaugmented(spec, output, stage, version)
    # The staged manifest named the shards from inside the version folder; only DATASET's is a switch.
    stage.remove(MANIFEST_NAME)
    stage.remove(REJECTED_NAME)
    return _reaugment_result(spec, swap.shards_before, read_manifest(output), version, swap.removed, started)


def _swap_reaugmented(spec: ReshardSpec, output: Output, stage: Output, version: str) -> SwapInfo:
    old = read_manifest(output)
    made = read_manifest(stage)
    shards = [dataclasses.replace(shard, path=f"{version}/{shard.path}") for shard in made.shards]
    new = dataclasses.replace(made, shards=shards, created="")
    _verify_or_raise(output, new)
    if stage.exists(REJECTED_NAME):
        output.write_bytes_atomic(REJECTED_NAME, stage.read_bytes(REJECTED_NAME))
    removed = swap_version(output, old, new, version, spec.keep)
    return SwapInfo(version, shards_per_set(old), removed)


def discard_reaugment(spec: ReshardSpec, staged: PrepareSpec) -> None:
    """Remove an unfinished re-augment (its version folder, or its partial output in --out)."""
    if spec.out is None:
        Output(spec.dataset).remove(staged_version(spec, staged))
        return
    discard_prepare(staged)


def _reaugment_result(
    spec: ReshardSpec, shards_before: int, new: Manifest, version: str, removed: list[str], started: float
) -> ReshardResult:
    return ReshardResult(
        dataset=spec.dataset,
        out=spec.out or spec.dataset,
        version=version,
        shards_before=shards_before,
        shards_after=shards_per_set(new),
        samples=new.samples,
        rejected=new.rejected,
        variants=new.variants,
        bytes=sum(shard.bytes for shard in new.shards),
        seconds=time.perf_counter() - started,
        reaugmented=True,
        removed=removed,
        decoded_with_warnings=new.decoded_with_warnings,
    )
