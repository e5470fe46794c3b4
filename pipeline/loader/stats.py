"""`LoaderStats`: where the time of a training loop goes, and what damage cost it."""

from __future__ import annotations

import dataclasses

from ..units import wait_share


@dataclasses.dataclass
class LoaderStats:
    """Where the time of a training loop goes.

    Attributes:
        batches: batches delivered.
        samples: samples delivered.
        wait_s: seconds the training loop waited for data inside `next()`.
        step_s: seconds the training loop spent between batches (its own work).
        skipped: samples lost to damage: in shards that are missing, unreadable
            or cut short (counted from the manifest's sample counts), without
            an image, or that did not decode.
        replaced: samples re-drawn in place of lost ones, so every batch is
            full (fewer than `skipped` when drop_last would have dropped as
            many samples anyway).
        bad_shards: damaged shards met (missing, unreadable, cut short, or
            failing verify=True), once per epoch that read them.
        boxes_dropped: detection: boxes the crops cut under `min_visible`
            of their area, dropped from the delivered targets.
        images_emptied: detection: delivered images that had boxes and were
            left with none by their crop (what a crop recipe costs a
            detector; the letterbox, the detection default, drops none).
    """

    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    step_s: float = 0.0
    skipped: int = 0
    replaced: int = 0
    bad_shards: int = 0
    boxes_dropped: int = 0
    images_emptied: int = 0

    @property
    def stall_fraction(self) -> float:
        """Share of the loop's time spent waiting for data (0 = never stalled)."""
        return wait_share(self.wait_s, self.step_s)

    @property
    def images_per_s(self) -> float:
        """Samples delivered per second of the loop's time (waiting plus its own steps)."""
        total = self.wait_s + self.step_s
        return self.samples / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        """The counters and the two rates, for JSON."""
        data = dataclasses.asdict(self)
        data["stall_fraction"] = self.stall_fraction
        data["images_per_s"] = self.images_per_s
        return data

    def __str__(self) -> str:
        return (
            f"{self.batches} batches, {self.samples} samples, {self.images_per_s:.0f} images/s, "
            f"waited {self.wait_s:.2f} s for data, stall fraction {self.stall_fraction:.1%} "
            f"(share of the loop's time spent waiting for data), "
            f"{self.skipped} skipped, {self.replaced} replaced, {self.bad_shards} bad shards"
            + (
                f", {self.boxes_dropped} boxes dropped by crops ({self.images_emptied} images left without one)"
                if self.boxes_dropped
                else ""
            )
        )
