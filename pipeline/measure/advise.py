"""`gpufeed advise SRC --target PATH`: why the GPU waits, what to do, and what it will give.

The differential diagnosis of data stalls (SPEC §3), measured on the user's
own data and machine. Each stage of the input pipeline has a ceiling, the
images/s it sustains on its own:

1. the GPU: synthetic batches through the model (or a given figure);
2. CPU decode: the loader over a page-cached sample of the raw files
   (read from memory, decode, crop, finish), so storage plays no part;
3. storage: the raw sample files read cold (evicted from the page cache)
   with as many readers as the loader has workers, no decoding;
4. the host-to-device copy of uint8 batches (CUDA only).

The lowest ceiling is the bottleneck. The recommendation comes from
measuring what preparing would give: a sample is prepared with each candidate
format (JPEG at the recommended size, and raw `.npy`) into a temp folder on
the target, and the real loader is run over it; that rate, capped by the
target disk's sequential read rate, is the prediction. `apply_advice` then
prepares the whole dataset and measures the loader on it, so the prediction
is checked, not just made.

Loader rates are scaled to an otherwise idle machine: each run also records
the CPU share other processes took meanwhile (`LoaderPoint.idle_images_per_s`),
so a busy neighbour on a shared machine does not pass for a slow pipeline.

`plan_advice` is the arithmetic (ceilings -> bottleneck -> recommendation ->
prediction) as a pure function of the measurements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import ConfigError, write_failure
from ..units import format_bytes, format_count, format_rate

MiB = 1 << 20
NPY_GAIN = 1.25  # .npy must beat JPEG by this much to be worth its bytes
SHARD_MIN, SHARD_MAX, SHARD_TARGET_COUNT = 16 * MiB, 256 * MiB, 64
FREE_SPACE_SHARE = 0.8  # never plan to fill more than this share of the target's free space
STAGES = {
    "gpu": "GPU",
    "cpu_decode": "CPU decode (page-cached raw data)",
    "storage": "storage (cold raw files)",
    "host_to_device": "host-to-device copy",
}

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------
# The arithmetic: pure functions of the measurements


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
        mode="shorter",
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
            "--variants 0: the loader's random-resized crop and flip are cheap at the prepared size; "
            "use --variants K when your own augmentation costs CPU at training time"
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
    if inputs.raw_shorter_side > inputs.prepared_size:
        return (
            f"--size {inputs.prepared_size}: pre-resize the {inputs.raw_shorter_side:.0f} px raw images "
            f"(shorter side) once, instead of decoding all their pixels every epoch"
        )
    return f"--size {inputs.prepared_size}: the raw images are already this small; packing them into shards is what helps"


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
            f"CPU decode is the bottleneck: {format_count(inputs.cores, 'core')} decode and crop the raw images at "
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


# ---------------------------------------------------------------------------
# The measurements


@dataclasses.dataclass
class AdviseResult:
    """A measured diagnosis: the inputs, the advice, and how each figure was obtained."""

    source: str
    target: str
    out: str
    listed: int
    sample: int
    batch_size: int
    crop: int
    device: str
    inputs: AdviseInputs
    advice: Advice
    details: dict[str, Any]
    seconds: float
    sample_items: list[Any] = dataclasses.field(default_factory=list, repr=False)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def command(self) -> list[str]:
        return self.advice.recommendation.command(self.source, self.out)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("sample_items")
        data["command"] = self.command
        data["bottleneck"] = self.advice.bottleneck
        data["predicted_loader_images_per_s"] = self.advice.predicted_loader
        data["prepare_helps"] = self.advice.prepare_helps
        return data


@dataclasses.dataclass
class ApplyResult:
    """`--apply`: the recommended prepare, run, and the loader measured on its output.

    On a shared machine the CPU that other processes leave over changes from
    second to second, and a CPU-bound loader's images/s with it. Two things
    keep the check fair: every loader rate is scaled to an otherwise idle
    machine (`LoaderPoint.idle_images_per_s`, from the CPU share other
    processes took during that very run), and the prediction itself (the
    loader over the prepared *sample*, capped by the target disk) is re-run
    alternately with the measurement over the full output (ABBA BAAB), so
    both see the same machine. `error` compares those two; the figure
    `advise` printed earlier is kept beside it (`error_advise_time`).

    Attributes:
        predicted_loader_images_per_s: the prediction as `advise` printed it.
        predicted_now_images_per_s: the same prediction, re-measured alongside the check.
        measured_loader_images_per_s: the loader over the full prepared output (idle-machine scale).
        measured_wall_images_per_s: the same runs' plain images per wall-clock second.
        others_cpu_share: mean share of the machine's CPU other processes used during the check.
    """

    out: str
    samples: int
    prepare_seconds: float
    prepare_images_per_s: float
    predicted_loader_images_per_s: float
    predicted_now_images_per_s: float
    measured_loader_images_per_s: float
    measured_wall_images_per_s: float
    measured_stall_fraction: float
    others_cpu_share: float | None = None

    @property
    def error(self) -> float:
        """(prediction − measured) / measured, both taken alongside each other."""
        return self.predicted_now_images_per_s / self.measured_loader_images_per_s - 1.0

    @property
    def error_advise_time(self) -> float:
        """(prediction printed by advise − measured) / measured."""
        return self.predicted_loader_images_per_s / self.measured_loader_images_per_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["error"] = self.error
        data["error_advise_time"] = self.error_advise_time
        return data


def advise(
    source: str,
    target: str,
    *,
    gpu_images_per_s: float | None = None,
    model: str | Any | None = None,
    input_shape: str | Sequence[int] = (3, 224, 224),
    batch_size: int = 64,
    crop: int = 224,
    sample: int = 128,
    num_workers: int | None = None,
    measure_seconds: float = 2.0,
    device: str = "auto",
    out: str | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    vram: int | str | None = None,
    optimizer: str = "sgd",
) -> AdviseResult:
    """Measure every ceiling on a sample of SOURCE and this machine, and plan what to prepare.

    Args:
        source: raw images (folder, CSV/JSONL list or URL).
        target: local folder where the shards would go (its disk is measured; temp files go there).
        gpu_images_per_s: the GPU's consumption rate, if known.
        model: else a model (nn.Module or "module:factory") timed on synthetic batches.
        input_shape: the model's input for one sample.
        batch_size: training batch size (also used for every loader measurement).
        crop: the loader's crop size.
        sample: images sampled from SOURCE; raised to two batches' worth (2 x batch_size), which every
            loader measurement needs, when SOURCE has that many (`notes` says so).
        num_workers: loader workers (default: available cores).
        measure_seconds: seconds each loader measurement runs.
        device: the loader's and the model's device.
        out: OUT for the recommended command (default: TARGET/<source name>-<size>).
        seed: seed of the sample.
        progress: called with a short text before each stage.
        vram: the model's device memory ("16GiB", "device"; default: the CUDA device's, where there is one):
            the model is timed at the largest batch that fits it (`model_consumption`).
        optimizer: the model's optimizer (sgd, momentum, adam, adamw), for its memory and step time.

    Returns:
        An AdviseResult.

    Raises:
        ConfigError: neither a GPU rate nor a model, bad settings, or fewer images that prepare accepts
            in SOURCE than two batches (checked before anything is measured).
        SourceError: the source cannot be listed.
    """
    from ..io.devices import device_info
    from ..prepare.pool import available_cores
    from .decode import usable_sample

    started = time.perf_counter()
    if (gpu_images_per_s is None) == (model is None):
        raise ConfigError("give exactly one of gpu_images_per_s=N or model=module:factory")
    if gpu_images_per_s is not None and gpu_images_per_s <= 0:
        raise ConfigError("gpu_images_per_s must be positive")
    if "://" in target and not target.startswith("file://"):
        raise ConfigError(f"target={target} is not a local folder: give the folder on the disk the shards will be read from")
    if sample < 1 or batch_size < 1:
        raise ConfigError(f"sample={sample} and batch_size={batch_size}: both must be at least 1")
    _check_target(target)
    say = progress or (lambda text: None)
    cores = num_workers or available_cores()
    prepared_size = round(crop / 0.875)  # the loader's eval crop reads 224 of 256
    notes = []
    wanted = max(sample, 2 * batch_size)
    items, blobs, listed = usable_sample(source, wanted, seed)
    if len(items) < 2 * batch_size:  # before minutes of measuring, not after
        fix = f"give batch_size={len(items) // 2} or less" if len(items) >= 2 else "give a source with more images"
        raise ConfigError(
            f"{source} has {format_count(len(items), 'image')} that prepare accepts, fewer than the two batches of "
            f"batch_size={batch_size} each loader measurement needs: {fix}"
        )
    if len(items) > sample:
        notes.append(
            f"sample={sample} was raised to {len(items)}: each loader measurement needs two batches "
            f"of batch_size={batch_size} (a smaller batch_size allows a smaller sample)"
        )
    details: dict[str, Any] = {"cores": cores, "num_workers": cores, "sample_asked": sample}
    with _scratch(_writable_target(target)) as scratch:  # a target that cannot be used fails now, not after minutes
        say(f"measuring the GPU rate ({'given' if gpu_images_per_s else 'synthetic batches'})")
        gpu = gpu_images_per_s or _model_rate(
            model, input_shape, batch_size, device, measure_seconds, details, vram=vram, optimizer=optimizer
        )
        details["gpu_source"] = "given" if gpu_images_per_s else "measured"
        say("reading the raw sample cold from storage")
        storage_rate = _cold_read_rate(items, cores, details)
        say("loader over the page-cached raw sample")
        raw_pattern = _pack_raw(items, blobs, scratch)
        decode_point = _loader_point(raw_pattern, batch_size, cores, device, measure_seconds)
        decode_rate = decode_point.idle_images_per_s
        details["cpu_decode_others_cpu_share"] = decode_point.others_cpu_share
        say("host-to-device copy")
        h2d = _host_to_device_rate(batch_size, crop, device)
        say("target disk")
        read_mb_s, free = _target_disk(target, details)
        candidates = []
        for fmt in ("jpeg", "npy"):
            say(f"preparing the sample as {fmt} at {prepared_size} px and running the loader over it")
            candidates.append(_measure_candidate(items, scratch, fmt, prepared_size, batch_size, cores, device, measure_seconds))
    inputs = AdviseInputs(
        ceilings=Ceilings(gpu=gpu, cpu_decode=decode_rate, storage=storage_rate, host_to_device=h2d),
        candidates=tuple(candidates),
        samples=listed,
        cores=cores,
        prepared_size=prepared_size,
        raw_shorter_side=_median_shorter_side(blobs),
        raw_bytes_per_sample=sum(len(b) for b in blobs) / max(1, len(blobs)),
        target_read_mb_s=read_mb_s,
        target_free_bytes=free,
        storage_kind=_describe_storage(source, device_info, details),
        target_kind=details.get("target_device_kind", "unknown"),
        consumer="model on the CPU" if details.get("gpu_device") == "cpu" else "GPU",
    )
    advice = plan_advice(inputs)
    name = os.path.basename(os.path.normpath(source.split("://")[-1])) or "dataset"
    out = out or os.path.join(target, f"{name}-{prepared_size}-{advice.recommendation.format}")
    return AdviseResult(
        source, target, out, listed, len(items), batch_size, crop, device, inputs, advice, details,
        time.perf_counter() - started, items, notes,
    )


def apply_advice(result: AdviseResult, out: str | None = None, *, measure_seconds: float = 2.0) -> ApplyResult:
    """Run the recommended prepare into OUT and measure the loader on the result against the prediction.

    Raises:
        The errors of `prepare_dataset` and `make_loader`.
    """
    from ..prepare.job import prepare_dataset
    from ..specs import AugmentSpec, EncodeSpec, PrepareSpec, ResizeSpec, ShardSpec

    rec = result.advice.recommendation
    out = out or result.out
    spec = PrepareSpec(
        source=result.source,
        out=out,
        resize=ResizeSpec(size=rec.size, mode=rec.mode),
        augment=AugmentSpec(variants=rec.variants),
        encode=EncodeSpec(format=rec.format, quality=rec.quality),
        shards=ShardSpec(max_bytes=rec.shard_bytes),
    )
    prepared = prepare_dataset(spec, workers=rec.num_workers)
    half = measure_seconds / 2
    with _scratch(result.target) as scratch:
        sample_out, sample_bytes = _prepare_sample(result.sample_items, scratch, rec.format, rec.size, rec.num_workers)
        full: list[Any] = []
        sample: list[Any] = []
        for which in "ABBABAAB":  # a drift in machine load hits both alike
            dataset, runs = (out, full) if which == "A" else (sample_out, sample)
            runs.append(_loader_point(dataset, result.batch_size, rec.num_workers, result.device, half))
    now = Candidate(rec.format, _mean(p.idle_images_per_s for p in sample), sample_bytes)
    shares = [p.others_cpu_share for p in full + sample if p.others_cpu_share is not None]
    return ApplyResult(
        out=out,
        samples=prepared.samples,
        prepare_seconds=prepared.seconds,
        prepare_images_per_s=prepared.images_per_s,
        predicted_loader_images_per_s=result.advice.predicted_loader,
        predicted_now_images_per_s=candidate_ceiling(now, result.inputs.target_read_mb_s),
        measured_loader_images_per_s=_mean(p.idle_images_per_s for p in full),
        measured_wall_images_per_s=_mean(p.images_per_s for p in full),
        measured_stall_fraction=_mean(p.stall_fraction for p in full),
        others_cpu_share=_mean(shares) if shares else None,
    )


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)


def _writable_target(target: str) -> str:
    """TARGET as a folder (created if missing).

    Raises:
        ConfigError: TARGET is a file.
        StorageError: the folder cannot be created.
    """
    _check_target(target)
    try:
        os.makedirs(target, exist_ok=True)
    except OSError as exc:
        raise write_failure(target, exc) from exc
    return target


def _check_target(target: str) -> None:
    """ConfigError when TARGET is a file (checked first: nothing is measured or created before)."""
    if os.path.exists(target) and not os.path.isdir(target):
        folder = os.path.dirname(os.path.abspath(target))
        raise ConfigError(f"target={target} is a file; give the folder the shards would go to, e.g. {folder}")


@contextlib.contextmanager
def _scratch(target: str) -> Iterator[str]:
    """A temp folder on the target disk, removed afterwards (Ctrl-C included).

    Raises:
        StorageError: nothing can be written there.
    """
    try:
        folder = tempfile.mkdtemp(prefix=".gpufeed-advise-", dir=target)
    except OSError as exc:
        raise write_failure(target, exc) from exc
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class ModelConsumption:
    """The model as the loader's consumer: from the memory a batch needs to the images/s the loader must deliver.

    Attributes:
        batch_size: the batch it trains at: the largest that fits `vram_bytes`, else the one asked for.
        step_seconds: one training step at that batch.
        images_per_s: what the loader must deliver to keep it busy.
        device: where the steps were timed.
        vram_bytes: the memory limit (None: not known, so the batch asked for).
        rows: (batch, memory bytes, fits, step seconds, images/s) from batch 1 up to `batch_size`.
    """

    batch_size: int
    step_seconds: float
    images_per_s: float
    device: str
    vram_bytes: int | None = None
    rows: tuple[tuple[int, int, bool, float, float], ...] = ()


def model_consumption(
    model: Any, input_shape: Any, *, batch_size: int, vram: int | str | None = None, optimizer: str = "sgd",
    device: str = "auto", seconds: float = 2.0,
) -> ModelConsumption:
    """Time the model's steps; with a memory limit, at the largest batch that fits it (`estimate_memory`).

    Without `vram` (and with no CUDA device to read it from) the step is timed
    at `batch_size`, as before the memory was known.

    Raises:
        ConfigError: a bad model, or one that does not fit at batch 1.
    """
    from .memory import check_model_input, estimate_memory, load_model, measure_step_times, parse_shape

    module = load_model(model) if isinstance(model, str) else model
    shape = parse_shape(input_shape)
    check_model_input(module, shape, model if isinstance(model, str) else type(model).__name__)
    cuda = _device_is_cuda(device)
    if vram is None and cuda:
        vram = "device"
    if vram is None:
        timing = measure_step_times(module, shape, [batch_size], optimizer=optimizer, device=device, min_seconds=seconds)
        step = timing.points[0][1]
        return ModelConsumption(batch_size, step, batch_size / step, timing.device)
    estimate = estimate_memory(
        module, shape, optimizer=optimizer, vram=vram, measure=True, device=device, measure_seconds=seconds,
        for_device="cuda" if cuda else "cpu",  # the memory of the device the steps run on
    )
    if not estimate.max_batch_size or estimate.throughput is None:
        raise ConfigError(f"the model does not fit in {format_bytes(estimate.vram_bytes)} at batch 1")
    timing = estimate.throughput
    rows = tuple(
        (r.batch_size, r.memory_bytes, r.fits, r.batch_size / (r.images_per_s or 1.0), r.images_per_s or 0.0)
        for r in estimate.rows
    )
    batch = estimate.max_batch_size
    rate = timing.images_per_s(batch)
    return ModelConsumption(batch, batch / rate, rate, timing.device, estimate.vram_bytes, rows)


def _device_is_cuda(device: str) -> bool:
    from ..loader.loader import resolve_device

    return resolve_device(device).type == "cuda"


def _model_rate(
    model: Any, input_shape: Any, batch_size: int, device: str, seconds: float, details: dict[str, Any],
    vram: int | str | None = None, optimizer: str = "sgd",
) -> float:
    consumption = model_consumption(
        model, input_shape, batch_size=batch_size, vram=vram, optimizer=optimizer, device=device, seconds=seconds
    )
    details["gpu_device"] = consumption.device
    details["gpu_step_seconds"] = consumption.step_seconds
    details["gpu_batch_size"] = consumption.batch_size
    if consumption.vram_bytes is not None:
        details["gpu_vram_bytes"] = consumption.vram_bytes
        details["gpu_memory_rows"] = [
            {"batch_size": b, "memory_bytes": m, "fits": f, "step_seconds": t, "images_per_s": r}
            for b, m, f, t, r in consumption.rows
        ]
    return consumption.images_per_s


def _cold_read_rate(items: list[Any], readers: int, details: dict[str, Any]) -> float:
    """Files/s reading the sample's files with `readers` threads after evicting them from the page cache."""
    from concurrent.futures import ThreadPoolExecutor

    from ..io.fs import local_path

    paths = list(dict.fromkeys(local_path(item.url) for item in items))  # a shard's images share its tar
    evictable = all(path is not None for path in paths)
    details["storage_cache_evicted"] = evictable
    total_bytes = done = 0
    started = time.perf_counter()
    with ThreadPoolExecutor(max(1, readers), thread_name_prefix="gpufeed-cold-read") as pool:
        while True:
            if evictable:
                for path in paths:
                    _evict(path)  # type: ignore[arg-type]
            total_bytes += sum(pool.map(_read_size, items))
            done += len(items)
            elapsed = time.perf_counter() - started
            if elapsed >= 0.5 or not evictable:  # remote files cannot be evicted: one pass
                details["storage_mb_s"] = total_bytes / elapsed / 1e6
                return done / elapsed


def _read_size(item: Any) -> int:
    """Bytes read of one image: its file, or its byte range where it sits in a tar (never the whole tar)."""
    from .decode import item_bytes

    try:
        return len(item_bytes(item, 1 << 30))
    except (OSError, ValueError):
        return 0


def _evict(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _image_extension(rel: str) -> str:
    extension = rel.rsplit(".", 1)[-1].lower() if "." in rel else ""
    if extension in ("jpg", "jpeg", "jpe", "jfif"):
        return "jpg"
    # The loader picks members by these names; any other format goes through PIL, which reads the content.
    return extension if extension in ("png", "webp", "bmp", "tif", "tiff", "ppm") else "ppm"


def _pack_raw(items: list[Any], blobs: list[bytes], scratch: str) -> str:
    """The raw sample bytes, unchanged, in one tar; returns a brace pattern the loader reads."""
    from ..io.tar import sample_tar_bytes

    folder = os.path.join(scratch, "raw")
    os.makedirs(folder)
    with open(os.path.join(folder, "shard-000000.tar"), "wb") as handle:
        handle.writelines(sample_tar_bytes(f"s{index:06d}", {_image_extension(item.rel): data, "cls": b"0"}) for index, (item, data) in enumerate(zip(items, blobs)))
        handle.write(bytes(1024))
    return os.path.join(folder, "shard-{000000..000000}.tar")


def _loader_point(dataset: str, batch_size: int, workers: int, device: str, seconds: float) -> Any:
    from .loader import measure_loader

    return measure_loader(dataset, batch_size=batch_size, num_workers=workers, device=device, min_seconds=seconds)


def _host_to_device_rate(batch_size: int, crop: int, device: str) -> float | None:
    import torch

    if device == "cpu" or not torch.cuda.is_available() or (device != "auto" and not device.startswith("cuda")):
        return None
    target = torch.device("cuda" if device == "auto" else device)
    host = torch.empty((batch_size, crop, crop, 3), dtype=torch.uint8, pin_memory=True)
    host.to(target, non_blocking=True)
    torch.cuda.synchronize(target)
    copies, started = 0, time.perf_counter()
    while time.perf_counter() - started < 0.5 or copies < 5:
        host.to(target, non_blocking=True)
        torch.cuda.synchronize(target)
        copies += 1
    return copies * batch_size / (time.perf_counter() - started)


def _target_disk(target: str, details: dict[str, Any]) -> tuple[float | None, int | None]:
    from ..io.devices import free_bytes
    from .disk import benchmark_disk

    free = free_bytes(target)
    try:
        disk = benchmark_disk(
            target, file_bytes=64 * MiB, block_sizes=(MiB,), duration_s=0.5, threads=1, tests=("seq_read", "randread")
        )  # the random reads tell flash from a spinning disk where the kernel cannot (virtual disks)
    except Exception as exc:  # a full or odd disk must not stop the diagnosis
        details["target_disk_error"] = str(exc)
        return None, free
    details["target_device_kind"] = disk.device_kind
    details["target_device"] = disk.device
    details["target_seq_read_mb_s"] = disk.seq_read_mb_s
    details["target_direct_io"] = disk.direct_io
    return disk.seq_read_mb_s, free


def _measure_candidate(
    items: list[Any], scratch: str, fmt: str, size: int, batch_size: int, workers: int, device: str, seconds: float
) -> Candidate:
    """Prepare the sample with `fmt` at `size` (the real prepare) and run the loader over it."""
    out, bytes_per_sample = _prepare_sample(items, scratch, fmt, size, workers)
    point = _loader_point(out, batch_size, workers, device, seconds)
    return Candidate(fmt, point.idle_images_per_s, bytes_per_sample, point.others_cpu_share)


def _prepare_sample(items: list[Any], scratch: str, fmt: str, size: int, workers: int) -> tuple[str, float]:
    """`gpufeed prepare` of just the sample into scratch/<fmt>; returns (folder, mean bytes per sample)."""
    from ..io.fs import local_path
    from ..io.output import Output
    from ..manifest import read_manifest
    from ..prepare.job import prepare_dataset
    from ..specs import EncodeSpec, PrepareSpec, ResizeSpec

    listing = os.path.join(scratch, f"sample-{fmt}.jsonl")
    with open(listing, "w", encoding="utf-8") as handle:
        for number, item in enumerate(items):
            local = local_path(item.url)
            # A list's relative paths are relative to the list's own folder: write absolute ones.
            path = os.path.abspath(local) if local is not None else item.url
            if isinstance(item.targets, dict) and item.targets.get("tar") is not None:
                path = _extracted(item, scratch, number)  # a list row names a file: the member, not its tar
            label = f', "label": {_json(item.label)}' if item.label is not None else ""
            handle.write(f'{{"path": {_json(path)}{label}}}\n')
    out = os.path.join(scratch, fmt)
    spec = PrepareSpec(source=listing, out=out, resize=ResizeSpec(size=size), encode=EncodeSpec(format=fmt))
    prepare_dataset(spec, workers=workers, force=True)
    manifest = read_manifest(Output(out))
    return out, sum(s.bytes for s in manifest.shards) / max(1, manifest.samples)


def _extracted(item: Any, scratch: str, number: int) -> str:
    """An image inside a tar (WebDataset shards as the source) written out as a file of the scratch folder."""
    from .decode import item_bytes

    folder = os.path.join(scratch, "sample-members")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, str(number))
    if not os.path.exists(path):  # written once, for every candidate format
        try:
            data = item_bytes(item)
        except (OSError, ValueError):
            data = b""  # prepare rejects it, as it would the member
        with open(path, "wb") as handle:
            handle.write(data)
    return path


def _json(value: str) -> str:
    import json

    return json.dumps(value)


def _median_shorter_side(blobs: list[bytes]) -> float:
    from ..decode import open_image
    from ..errors import DecodeError

    sides = []
    for data in blobs:
        with contextlib.suppress(DecodeError):
            sides.append(min(open_image(data).size))
    return float(statistics.median(sides)) if sides else 0.0


def _describe_storage(source: str, device_info: Any, details: dict[str, Any]) -> str:
    from ..io.fs import local_path

    if local_path(source) is None:
        return "network"
    info = device_info(source)
    kind = info.kind
    if info.device and info.device == details.get("target_device"):  # the target's random reads classified it
        kind = details.get("target_device_kind") or kind
    return f"{kind} ({info.fstype})"
