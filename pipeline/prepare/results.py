"""What a prepare returns: the whole job's summary (`PrepareResult`), and the step API's (plan, one shard)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..manifest import MANIFEST_NAME, Manifest


@dataclasses.dataclass
class PrepareResult:
    """Summary of a finished prepare.

    The dataset's counts (`listed` .. `variants`, `decoded_with_warnings`)
    are those of its manifest; the rest describes the run that ended with it.
    `decoded_with_warnings` counts the samples whose decoders warned about
    damage they read past (each sample's json lists the messages under
    `decode_warnings`). `repaired` maps each shard file this run wrote again
    to what was wrong with it (`"was missing"`), and `verified` says whether
    the finished dataset's shards were hashed against the manifest before
    they were kept. `boxes_dropped` counts the boxes left out because less
    than `spec.min_visible` of their area stayed in their picture (over
    every variant set); `frames_unclear` the samples whose annotation's
    declared image size was neither the stored nor the upright one (the
    spec's `label_frame` decided, and a warning says so); `task` is what the
    samples hold (`targets.TASKS`).
    """

    out: str
    listed: int
    samples: int
    rejected: int
    ignored: int
    shards: int
    bytes: int
    classes: list[str]
    variants: int
    seconds: float
    processed: int
    resumed_shards: int
    workers: int
    already_complete: bool = False
    warnings: list[str] = dataclasses.field(default_factory=list)
    decoded_with_warnings: int = 0
    repaired: dict[str, str] = dataclasses.field(default_factory=dict)
    verified: bool = False
    boxes_dropped: int = 0
    task: str = "classification"
    frames_unclear: int = 0

    @property
    def images_per_s(self) -> float:
        """Images processed per second of this run (0 when it processed none)."""
        return self.processed / self.seconds if self.seconds > 0 else 0.0

    @property
    def manifest(self) -> str:
        """Where the dataset's manifest is."""
        return f"{self.out.rstrip('/')}/{MANIFEST_NAME}"

    def to_dict(self) -> dict[str, Any]:
        """The summary as JSON-ready values (what `gpufeed prepare --json` prints)."""
        data = dataclasses.asdict(self)
        data["images_per_s"] = round(self.images_per_s, 2)
        data["seconds"] = round(self.seconds, 3)
        data["manifest"] = self.manifest
        return data


def result_of(
    out: str,
    manifest: Manifest,
    *,
    ignored: int = 0,
    seconds: float = 0.0,
    processed: int = 0,
    resumed: int = 0,
    workers: int = 0,
    already_complete: bool = False,
    warnings: Sequence[str] = (),
    repaired: dict[str, str] | None = None,
    verified: bool = False,
) -> PrepareResult:
    return PrepareResult(
        out=out,
        listed=manifest.samples + manifest.rejected,  # every listed source is a sample or a reject
        samples=manifest.samples,
        rejected=manifest.rejected,
        ignored=ignored,
        shards=len(manifest.shards),
        bytes=sum(s.bytes for s in manifest.shards),
        classes=manifest.classes,
        variants=manifest.variants,
        seconds=seconds,
        processed=processed,
        resumed_shards=resumed,
        workers=workers,
        already_complete=already_complete,
        warnings=[*warnings, *_frame_warnings(manifest)],
        decoded_with_warnings=manifest.decoded_with_warnings,
        repaired=dict(repaired or {}),
        verified=verified,
        boxes_dropped=manifest.boxes_dropped,
        task=manifest.task,
        frames_unclear=manifest.frames_unclear,
    )


def _frame_warnings(manifest: Manifest) -> list[str]:
    """The warning that annotations declared image sizes that were neither the stored nor the upright one."""
    if not manifest.frames_unclear:
        return []
    frame = manifest.params.get("label_frame", "upright")
    return [
        f"{manifest.frames_unclear} annotated image(s) of EXIF-rotated files declare a size that is neither the "
        f"stored nor the upright one: their boxes were read as {frame} (label_frame); check the annotation tool's frame"
    ]


@dataclasses.dataclass(frozen=True)
class PreparePlanInfo:
    """What `plan_prepare` decided: how many shards to write, or that OUT is already complete.

    `shards` counts the planned shards of one variant set (each variant set
    gets a file per planned shard).
    """

    shards: int
    listed: int
    ignored: int
    classes: list[str]
    pending: list[int]
    already_complete: bool = False
    warnings: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """One planned shard once written: its files (one per variant set) and its rejects."""

    shard: int
    samples: int
    rejected: int
    skipped: bool

    @classmethod
    def of(cls, shard: int, record: dict[str, Any], skipped: bool) -> ShardRecord:
        """From the shard's record (`WorkFolder.write_shard_record`): its samples are its largest file's."""
        samples = max((info["samples"] for info in record["shards"]), default=0)
        return cls(shard, samples, len(record["rejected"]), skipped)
