"""The arithmetic of `gpufeed advise`: ceilings -> bottleneck -> recommendation -> prediction.

Pure functions of the measurements (`plan_advice(AdviseInputs) -> Advice`), so every decision
can be checked with fixed figures; `advise` measures the inputs and calls it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from ...errors import ConfigError
from ...units import format_bytes, format_count, format_rate

MiB = 1 << 20
NPY_GAIN = 1.25  # .npy must beat JPEG by this much to be worth its bytes
SHARD_MIN, SHARD_MAX, SHARD_TARGET_COUNT = 16 * MiB, 256 * MiB, 64
FREE_SPACE_SHARE = 0.8  # never plan to fill more than this share of the target's free space
MIN_REPEATS = 2  # a spread needs two measurements
STAGES = {
    "gpu": "GPU",
    "cpu_decode": "CPU decode (page-cached raw data)",
    "storage": "storage (cold raw files)",
    "host_to_device": "host-to-device copy",
}


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Images/s each stage sustains on its own (None: does not apply here).

    Attributes:
        gpu: what the model consumes (training steps on synthetic batches, or given).
        cpu_decode: the loader over page-cached raw data.
        storage: raw files read cold from where they live (no decode).
        host_to_device: uint8 batch copies to the GPU (None without CUDA).
    """

    gpu: float
    cpu_decode: float
    storage: float | None = None
    host_to_device: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to prepare, measured on a sample.

    Attributes:
        format: "jpeg" or "npy".
        loader_images_per_s: the loader over the page-cached prepared sample.
        bytes_per_sample: mean bytes per sample in the shards.
        others_cpu_share: CPU share other processes took during the measurement (for the record).
    """

    format: str
    loader_images_per_s: float
    bytes_per_sample: float
    others_cpu_share: float | None = None


@dataclasses.dataclass(frozen=True)
class AdviseInputs:
    """Everything `plan_advice` decides from."""

    ceilings: Ceilings
    candidates: tuple[Candidate, ...]
    samples: int
    cores: int
    prepared_size: int
    raw_shorter_side: float
    raw_bytes_per_sample: float
    target_read_mb_s: float | None = None
    target_free_bytes: int | None = None
    quality: int = 90
    storage_kind: str = "unknown"
    target_kind: str = "unknown"
    consumer: str = "GPU"  # what consumes the batches, as the sentences name it
    task: str = "classification"  # what the samples hold (the listing's task)
    resize_mode: str = "shorter"  # --mode: "longer" for the letterbox of detection and segmentation


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The `gpufeed prepare` settings to use, and the loader's num_workers."""

    size: int
    mode: str
    format: str
    quality: int
    shard_bytes: int
    variants: int
    num_workers: int

    def command(self, source: str, out: str) -> list[str]:
        """The `gpufeed prepare` command line, as a list of arguments."""
        args = ["gpufeed", "prepare", source, out, "--size", str(self.size), "--mode", self.mode, "--format", self.format]
        if self.format in ("jpeg", "webp"):
            args += ["--quality", str(self.quality)]
        args += ["--shard-size", format_bytes(self.shard_bytes, exact=True), "--variants", str(self.variants)]
        args += ["--workers", str(self.num_workers)]
        return args


@dataclasses.dataclass(frozen=True)
class Advice:
    """What `plan_advice` concluded.

    Attributes:
        bottleneck: "gpu", "cpu_decode", "storage" or "host_to_device".
        sentence: the diagnosis in one plain sentence.
        predicted_before: training images/s today (the lowest ceiling).
        recommendation: the prepare settings.
        predicted_loader: the loader's images/s on the prepared data (what --apply checks).
        predicted_after: training images/s after preparing.
        after_ceilings: the ceilings after preparing (images/s; None: does not apply).
        reasons: one line per choice made.
    """

    bottleneck: str
    sentence: str
    predicted_before: float
    recommendation: Recommendation
    predicted_loader: float
    predicted_after: float
    after_ceilings: dict[str, float | None]
    reasons: tuple[str, ...]

    @property
    def prepare_helps(self) -> bool:
        """Whether preparing makes training faster: the data pipeline is the bottleneck and the prediction beats today."""
        return self.bottleneck != "gpu" and self.predicted_after > self.predicted_before


def find_bottleneck(ceilings: Ceilings) -> tuple[str, float]:
    """The stage with the lowest ceiling and that ceiling (the GPU wins ties: nothing to fix)."""
    stages = [(name, value) for name, value in ceilings.as_dict().items() if value is not None]
    return min(stages, key=lambda pair: (pair[1], pair[0] != "gpu"))


def shard_bytes_for(total_bytes: float) -> int:
    """Shard size: about 64 shards (whole shards per rank × worker, a shuffle across them), 16-256 MiB."""
    wanted = total_bytes / SHARD_TARGET_COUNT
    mib = 2 ** max(0, math.ceil(math.log2(max(wanted, 1) / MiB)))
    return int(min(SHARD_MAX, max(SHARD_MIN, mib * MiB)))


def candidate_ceiling(candidate: Candidate, target_read_mb_s: float | None) -> float:
    """The loader's images/s on data prepared this way: its CPU rate, capped by the target's reads."""
    if target_read_mb_s is None or candidate.bytes_per_sample <= 0:
        return candidate.loader_images_per_s
    return min(candidate.loader_images_per_s, target_read_mb_s * 1e6 / candidate.bytes_per_sample)


def plan_advice(inputs: AdviseInputs) -> Advice:
    """Ceilings -> bottleneck -> recommendation -> prediction, from measurements only.

    Raises:
        ConfigError: no candidate was measured.
    """
    if not inputs.candidates:
        raise ConfigError("advice needs at least one measured candidate format")
    ceilings = inputs.ceilings
    bottleneck, before = find_bottleneck(ceilings)
    chosen, format_reason = _choose_format(inputs)
    loader_after = candidate_ceiling(chosen, inputs.target_read_mb_s)
    after = {"gpu": ceilings.gpu, "loader": loader_after, "host_to_device": ceilings.host_to_device}
    predicted_after = min(value for value in after.values() if value is not None)
    total = chosen.bytes_per_sample * inputs.samples
    recommendation = Recommendation(
        size=inputs.prepared_size,
        mode=inputs.resize_mode,
        format=chosen.format,
        quality=inputs.quality,
        shard_bytes=shard_bytes_for(total),
        variants=0,
        num_workers=inputs.cores,
    )
    reasons = (
        _size_reason(inputs),
        format_reason,
        (
            f"--shard-size {format_bytes(recommendation.shard_bytes, exact=True)}: {total / 1e6:.0f} MB in about "
            f"{format_count(max(1, math.ceil(total / recommendation.shard_bytes)), 'shard')}, read sequentially"
        ),
        (
            f"--variants 0: the loader's {'letterbox' if inputs.resize_mode == 'longer' else 'random-resized crop'} "
            "and flip are cheap at the prepared size; use --variants K when your own augmentation costs CPU at training time"
        ),
        f"num_workers={inputs.cores}: one decode thread per available core (as measured)",
    )
    return Advice(
        bottleneck=bottleneck,
        sentence=diagnosis_sentence(bottleneck, inputs),
        predicted_before=before,
        recommendation=recommendation,
        predicted_loader=loader_after,
        predicted_after=predicted_after,
        after_ceilings=after,
        reasons=reasons,
    )


def _choose_format(inputs: AdviseInputs) -> tuple[Candidate, str]:
    by_format = {c.format: c for c in inputs.candidates}
    jpeg, npy = by_format.get("jpeg"), by_format.get("npy")
    if jpeg is None or npy is None:
        only = jpeg or npy or inputs.candidates[0]
        return only, f"--format {only.format}: the only format measured"
    jpeg_rate = candidate_ceiling(jpeg, inputs.target_read_mb_s)
    npy_rate = candidate_ceiling(npy, inputs.target_read_mb_s)
    npy_total = npy.bytes_per_sample * inputs.samples
    fits = inputs.target_free_bytes is None or npy_total <= FREE_SPACE_SHARE * inputs.target_free_bytes
    cpu_bound = jpeg_rate < inputs.ceilings.gpu
    ratio = npy.bytes_per_sample / max(jpeg.bytes_per_sample, 1.0)
    if cpu_bound and fits and npy_rate >= NPY_GAIN * jpeg_rate:
        return npy, (
            f"--format npy: with JPEG the CPU would still be the limit ({format_rate(jpeg_rate)}) and the disk is not; "
            f"raw .npy needs no decode ({format_rate(npy_rate)}) at {ratio:.0f}x the bytes"
        )
    if not cpu_bound:
        why = f"JPEG already feeds the {inputs.consumer} ({jpeg_rate:.0f} >= {format_rate(inputs.ceilings.gpu)})"
    elif not fits:
        why = f".npy would need {npy_total / 1e9:.1f} GB, more than the target can spare"
    else:
        why = f".npy would give {format_rate(npy_rate)} against JPEG's {jpeg_rate:.0f}, not worth {ratio:.0f}x the bytes"
    return jpeg, f"--format jpeg --quality {inputs.quality}: {why}"


def _size_reason(inputs: AdviseInputs) -> str:
    if inputs.resize_mode == "longer":
        return (
            f"--size {inputs.prepared_size} --mode longer: {inputs.task} trains on the whole image letterboxed to "
            f"{inputs.prepared_size} px, so its longer side is stored at the training size (a shorter-side resize "
            "would store pixels the letterbox throws away)"
        )
    if inputs.raw_shorter_side > inputs.prepared_size:
        return (
            f"--size {inputs.prepared_size}: pre-resize the {inputs.raw_shorter_side:.0f} px raw images "
            f"(shorter side) once, instead of decoding all their pixels every epoch"
        )
    return f"--size {inputs.prepared_size}: the raw images are already this small; packing them into shards is what helps"


@dataclasses.dataclass(frozen=True)
class Confidence:
    """How sure a verdict is, from the measurement repeated until its ranking held (or did not).

    Attributes:
        stable: at least `MIN_REPEATS` repeats, each alone gave the verdict of their medians, and the
            figures that decided it are further apart than their spread (their ranges do not overlap).
        repeats: rounds measured.
        spread: per figure ("cpu_decode", "storage", "jpeg", "npy", ...), (max − min) / median over the rounds.
        close: where not stable, the two figures within noise: ((name, images/s), (name, images/s)).
        statement: the same in one sentence.
    """

    stable: bool
    repeats: int
    spread: dict[str, float]
    close: tuple[tuple[str, float], tuple[str, float]] | None
    statement: str


def round_figures(inputs: AdviseInputs) -> dict[str, float]:
    """One round's images/s by name: the ceilings, then each candidate format's loader (capped by the target disk)."""
    figures = {name: value for name, value in inputs.ceilings.as_dict().items() if value is not None}
    figures.update({c.format: candidate_ceiling(c, inputs.target_read_mb_s) for c in inputs.candidates})
    return figures


def median_inputs(rounds: Sequence[AdviseInputs]) -> AdviseInputs:
    """The rounds' inputs with every measured figure replaced by its median over the rounds."""
    first = rounds[0]

    def median(values: Sequence[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return float(statistics.median(present)) if present else None

    ceilings = {
        name: median([getattr(r.ceilings, name) for r in rounds]) for name in first.ceilings.as_dict()
    }
    candidates = tuple(
        dataclasses.replace(
            c,
            loader_images_per_s=median([r.candidates[i].loader_images_per_s for r in rounds]) or 0.0,
            others_cpu_share=median([r.candidates[i].others_cpu_share for r in rounds]),
        )
        for i, c in enumerate(first.candidates)
    )
    return dataclasses.replace(first, ceilings=Ceilings(**ceilings), candidates=candidates)  # type: ignore[arg-type]


def judge_rounds(rounds: Sequence[AdviseInputs]) -> Confidence:
    """Whether the verdict of the rounds' medians holds: the same in every round, its deciding figures apart.

    The verdict is the bottleneck, whether preparing helps, and (where it does) the format. A
    ranking is "apart" when the winner's range over the rounds does not reach the runner-up's.

    Raises:
        ConfigError: no rounds, or a round without candidates.
    """
    if not rounds:
        raise ConfigError("a verdict needs at least one round of measurements")
    merged = median_inputs(rounds)
    verdict = _verdict(plan_advice(merged))
    figures = [round_figures(r) for r in rounds]
    names = [name for name in figures[0] if all(name in f for f in figures)]
    ranges = {name: (min(f[name] for f in figures), max(f[name] for f in figures)) for name in names}
    medians = round_figures(merged)
    spread = {name: (high - low) / medians[name] if medians[name] else 0.0 for name, (low, high) in ranges.items()}
    flips = sum(1 for r in rounds if _verdict(plan_advice(r)) != verdict)
    close = _close_call(merged, verdict, ranges, medians)
    n = len(rounds)
    stable = n >= MIN_REPEATS and flips == 0 and close is None
    if stable:
        statement = f"stable: the same verdict in all {n} repeats, its deciding figures further apart than their spread"
    elif n < MIN_REPEATS:
        statement = "measured once: no spread to judge the verdict by"
    else:
        pair = close or _closest_pair(medians)
        (a, va), (b, vb) = pair
        changed = f"; {flips} of {n} repeats alone gave another verdict" if flips else ""
        statement = f"not stable: the top two are within noise: {a} {va:.0f} vs {b} {vb:.0f} images/s over {n} repeats{changed}"
        close = pair
    return Confidence(stable, n, spread, close, statement)


def _verdict(advice: Advice) -> tuple[str, bool, str | None]:
    return advice.bottleneck, advice.prepare_helps, advice.recommendation.format if advice.prepare_helps else None


def _close_call(
    inputs: AdviseInputs, verdict: tuple[str, bool, str | None], ranges: dict[str, tuple[float, float]],
    medians: dict[str, float],
) -> tuple[tuple[str, float], tuple[str, float]] | None:
    """The first decision whose two figures' ranges overlap: the bottleneck against the runner-up, then the format."""
    stages = sorted((name for name in inputs.ceilings.as_dict() if name in ranges), key=lambda name: medians[name])
    pairs = [(stages[0], stages[1], 1.0)] if len(stages) > 1 else []
    if verdict[1] and {"jpeg", "npy"} <= ranges.keys():
        pairs.append(("jpeg", "gpu", 1.0))  # whether JPEG alone would keep up
        if medians["jpeg"] < medians["gpu"]:
            pairs.append(("npy", "jpeg", NPY_GAIN))  # then whether .npy beats JPEG by the margin it must
    for low_name, high_name, factor in pairs:
        (low_a, high_a), (low_b, high_b) = ranges[low_name], ranges[high_name]
        if high_a >= low_b * factor and high_b * factor >= low_a:
            return (low_name, medians[low_name]), (high_name, medians[high_name] * factor)
    return None


def _closest_pair(medians: dict[str, float]) -> tuple[tuple[str, float], tuple[str, float]]:
    ranked = sorted(medians.items(), key=lambda pair: pair[1])
    return ranked[0], ranked[1] if len(ranked) > 1 else ranked[0]


def diagnosis_sentence(bottleneck: str, inputs: AdviseInputs) -> str:
    """The diagnosis in one sentence a user understands."""
    c, gpu = inputs.ceilings, inputs.consumer
    data_rate = min(v for v in (c.cpu_decode, c.storage, c.host_to_device) if v is not None)
    if bottleneck == "gpu":
        return (
            f"The {gpu} is the bottleneck: the input pipeline delivers {format_rate(data_rate)}, more than the "
            f"{format_rate(c.gpu)} the model consumes, so faster data loading will not speed up training."
        )
    waits = 1 - {"cpu_decode": c.cpu_decode, "storage": c.storage or 0.0, "host_to_device": c.host_to_device or 0.0}[
        bottleneck
    ] / c.gpu
    if bottleneck == "cpu_decode":
        return (
            f"CPU decode is the bottleneck: {format_count(inputs.cores, 'core')} decode and "
            f"{'letterbox' if inputs.resize_mode == 'longer' else 'crop'} the raw images at "
            f"{format_rate(c.cpu_decode)}, but the {gpu} could take {format_rate(c.gpu)}, so it waits {waits:.0%} of the time."
        )
    if bottleneck == "storage":
        mb_s = (c.storage or 0.0) * inputs.raw_bytes_per_sample / 1e6
        return (
            f"Storage is the bottleneck: the raw files come off {inputs.storage_kind} storage at only "
            f"{format_rate(c.storage)} ({format_rate(mb_s, 'MB/s')}), while the {gpu} could take {format_rate(c.gpu)}, "
            f"so it waits {waits:.0%} of the time."
        )
    return (
        f"The host-to-device copy is the bottleneck: uint8 batches reach the {gpu} at {format_rate(c.host_to_device)}, "
        f"below the {format_rate(c.gpu)} it could take, so it waits {waits:.0%} of the time."
    )


__all__ = [
    "FREE_SPACE_SHARE", "MIN_REPEATS", "NPY_GAIN", "SHARD_MAX", "SHARD_MIN", "SHARD_TARGET_COUNT", "STAGES", "Advice",
    "AdviseInputs", "Candidate", "Ceilings", "Confidence", "Recommendation", "candidate_ceiling", "diagnosis_sentence",
    "find_bottleneck", "judge_rounds", "median_inputs", "plan_advice", "round_figures", "shard_bytes_for",
]
