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

The loader and storage figures are measured in rounds, repeated (up to `repeats`)
until the verdict is stable: every round alone gives the verdict of the medians,
and the figures that decide it are further apart than their spread
(`judge_rounds`); else the result says it is not stable and which two figures
are within noise. The loader runs with the settings the user would train with
(`loader_settings`: the training size, the task's recipe, the decoder and device
chosen), and `AdviseResult.loader_line` is that make_loader call.

Loader rates are scaled to an otherwise idle machine: each run also records
the CPU share other processes took meanwhile (`LoaderPoint.idle_images_per_s`),
so a busy neighbour on a shared machine does not pass for a slow pipeline.

`plan_advice` is the arithmetic (ceilings -> bottleneck -> recommendation ->
prediction) as a pure function of the measurements, in `plan`; the probes
that measure each ceiling are in `probes`. This module runs them
(`advise`, `apply_advice`) and re-exports the plan's names.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import ConfigError, write_failure
from ...units import format_count
from .plan import (
    FREE_SPACE_SHARE,
    NPY_GAIN,
    SHARD_MAX,
    SHARD_MIN,
    SHARD_TARGET_COUNT,
    STAGES,
    Advice,
    AdviseInputs,
    Candidate,
    Ceilings,
    Confidence,
    Recommendation,
    candidate_ceiling,
    diagnosis_sentence,
    find_bottleneck,
    judge_rounds,
    median_inputs,
    plan_advice,
    round_figures,
    shard_bytes_for,
)
from .probes import (
    ModelConsumption,
    cold_read_rate,
    describe_storage,
    host_to_device_rate,
    loader_point,
    median_shorter_side,
    model_consumption,
    model_rate,
    pack_raw_sample,
    prepare_sample,
    scratch_folder,
    source_task,
    target_disk_figures,
    write_sample_source,
)

Progress = Callable[[str], None]
MAX_REPEATS = 9  # rounds of loader and storage measurements at most


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
    confidence: Confidence | None = None
    loader_settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    split: str | None = None  # the YOLO split advised on, where the source has several
    classes: list[str] = dataclasses.field(default_factory=list, repr=False)  # the source's, as its listing gave them

    @property
    def command(self) -> list[str]:
        command = self.advice.recommendation.command(self.source, self.out)
        return command + ["--split", self.split] if self.split is not None else command

    @property
    def loader_line(self) -> str:
        """The make_loader(...) line over OUT with every setting the loader was measured with."""
        settings = self.loader_settings or {"batch_size": self.batch_size, "crop": self.crop}
        return loader_call(self.out, settings)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("sample_items")
        data.pop("classes")
        data["command"] = self.command
        data["loader_line"] = self.loader_line
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
    repeats: int = 5,
    split: str | None = None,
) -> AdviseResult:
    """Measure every ceiling on a sample of SOURCE and this machine, and plan what to prepare.

    Args:
        source: raw images (folder, CSV/JSONL list or URL).
        target: local folder where the shards would go (its disk is measured; temp files go there).
        gpu_images_per_s: the GPU's consumption rate, if known.
        model: else a model (nn.Module or "module:factory") timed on synthetic batches.
        input_shape: the model's input for one sample.
        batch_size: training batch size (also used for every loader measurement).
        crop: the loader's output size: the training size. On a detection or segmentation
            source (prepare's listing, or a prepared dataset's manifest, says which) the loader
            letterboxes to it and the recommendation is `--size CROP --mode longer`; else it
            crops and the recommendation is `--size CROP/0.875 --mode shorter`.
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
        repeats: rounds of the loader and storage measurements at most (1 to `MAX_REPEATS`): they are
            repeated until the verdict is stable (`judge_rounds`), and the result says whether it became so.
        split: the split of a YOLO dataset with several (data.yaml's train/val/test, images/<split>/)
            to sample; default: its training split (`train`, else its first), as the notes say.

    Returns:
        An AdviseResult; its `confidence` says how sure the verdict is, its `loader_line` is the
        make_loader call the loader was measured with.

    Raises:
        ConfigError: neither a GPU rate nor a model, bad settings, or fewer images that prepare accepts
            in SOURCE than two batches (checked before anything is measured).
        SourceError: the source cannot be listed.
    """
    from ...io.devices import device_info
    from ...prepare.pool import available_cores
    from ..decode import usable_sample

    started = time.perf_counter()
    if (gpu_images_per_s is None) == (model is None):
        raise ConfigError("give exactly one of gpu_images_per_s=N or model=module:factory")
    if gpu_images_per_s is not None and gpu_images_per_s <= 0:
        raise ConfigError("gpu_images_per_s must be positive")
    if "://" in target and not target.startswith("file://"):
        raise ConfigError(f"target={target} is not a local folder: give the folder on the disk the shards will be read from")
    if sample < 1 or batch_size < 1 or crop < 1:
        raise ConfigError(f"sample={sample}, batch_size={batch_size} and crop={crop}: each must be at least 1")
    if not 1 <= repeats <= MAX_REPEATS:
        raise ConfigError(f"repeats={repeats}: give 1 to {MAX_REPEATS} (rounds of measurements at most)")
    _check_target(target)
    say = progress or (lambda text: None)
    cores = num_workers or available_cores()
    notes: list[str] = []
    split = _split_advised(source, split, notes)
    task, classes = source_task(source, split)
    letterbox = task in LETTERBOX_TASKS
    # Letterboxed training reads the whole image at the training size; a crop reads 224 of 256.
    prepared_size = crop if letterbox else round(crop / 0.875)
    settings = loader_settings(batch_size, crop, cores, device, "letterbox" if letterbox else None)
    wanted = max(sample, 2 * batch_size)
    items, blobs, listed = usable_sample(source, wanted, seed, split)
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
    details: dict[str, Any] = {"cores": cores, "num_workers": cores, "sample_asked": sample, "task": task}
    with scratch_folder(_writable_target(target)) as scratch:  # a target that cannot be used fails now, not after minutes
        say(f"measuring the GPU rate ({'given' if gpu_images_per_s else 'synthetic batches'})")
        gpu = gpu_images_per_s or model_rate(
            model, input_shape, batch_size, device, measure_seconds, details, vram=vram, optimizer=optimizer
        )
        details["gpu_source"] = "given" if gpu_images_per_s else "measured"
        say("host-to-device copy")
        h2d = host_to_device_rate(batch_size, crop, device)
        say("target disk")
        read_mb_s, free = target_disk_figures(target, details)
        raw_pattern = pack_raw_sample(items, blobs, scratch)
        sample_source = write_sample_source(items, scratch, task, classes)
        prepared = {}
        for fmt in CANDIDATE_FORMATS:
            say(f"preparing the sample as {fmt} at {prepared_size} px ({'longer' if letterbox else 'shorter'} side)")
            prepared[fmt] = prepare_sample(sample_source, scratch, fmt, prepared_size, cores, mode="longer" if letterbox else "shorter")
        base = AdviseInputs(
            ceilings=Ceilings(gpu=gpu, cpu_decode=0.0, host_to_device=h2d),
            candidates=(),
            samples=listed,
            cores=cores,
            prepared_size=prepared_size,
            raw_shorter_side=median_shorter_side(blobs),
            raw_bytes_per_sample=sum(len(b) for b in blobs) / max(1, len(blobs)),
            target_read_mb_s=read_mb_s,
            target_free_bytes=free,
            storage_kind=describe_storage(source, device_info, details),
            target_kind=details.get("target_device_kind", "unknown"),
            consumer="model on the CPU" if details.get("gpu_device") == "cpu" else "GPU",
            task=task,
            resize_mode="longer" if letterbox else "shorter",
        )
        rounds: list[AdviseInputs] = []
        while True:
            say(f"measuring the loader and the storage, repeat {len(rounds) + 1} of at most {repeats}")
            rounds.append(_measure_round(base, items, raw_pattern, prepared, settings, measure_seconds, len(rounds), details))
            confidence = judge_rounds(rounds)
            if confidence.stable or len(rounds) >= repeats:
                break
    inputs = median_inputs(rounds)
    details["cpu_decode_others_cpu_share"] = statistics.median(details.pop("cpu_decode_others_cpu_shares"))
    details["repeats"] = [round_figures(r) for r in rounds]
    advice = plan_advice(inputs)
    name = os.path.basename(os.path.normpath(source.split("://")[-1])) or "dataset"
    if split is not None:
        name = f"{name}-{split}"
    out = out or os.path.join(target, f"{name}-{prepared_size}-{advice.recommendation.format}")
    return AdviseResult(
        source, target, out, listed, len(items), batch_size, crop, device, inputs, advice, details,
        time.perf_counter() - started, items, notes, confidence, settings, split, classes,
    )


def _split_advised(source: str, split: str | None, notes: list[str]) -> str | None:
    """The split of a YOLO source to advise on: `split`, else the training one where it has several (a note says so)."""
    from ...prepare.formats.yolo_splits import splits_of

    if split is not None:
        return split
    splits = splits_of(source)
    if not splits:
        return None
    chosen = "train" if "train" in splits else splits[0]
    notes.append(
        f"{source} holds the splits {', '.join(splits)}: advised on {chosen!r}, the data training reads "
        f"(--split chooses another); the recommended command prepares that split"
    )
    return chosen


CANDIDATE_FORMATS = ("jpeg", "npy")
LETTERBOX_TASKS = ("detection", "segmentation")  # trained on the whole image: letterboxed, not cropped


def loader_settings(batch_size: int, crop: int, num_workers: int, device: str, recipe: str | None) -> dict[str, Any]:
    """Every make_loader setting advise measures with, "auto" resolved to what it chose on this machine."""
    from ...loader.cpu_decode import default_decoder
    from ...loader.loader import resolve_device

    settings: dict[str, Any] = {
        "batch_size": batch_size, "crop": crop, "num_workers": num_workers, "decoder": default_decoder(),
        "device": str(resolve_device(device)),
    }
    if recipe is not None:
        settings["recipe"] = recipe
    return settings


def loader_call(dataset: str, settings: dict[str, Any]) -> str:
    """The make_loader(...) line that reproduces a measurement: the dataset and every setting, as Python."""
    options = ", ".join(f"{key}={value!r}" for key, value in settings.items() if key != "batch_size")
    return f"make_loader({dataset!r}, batch_size={settings['batch_size']}, {options})"


def _measure_options(settings: dict[str, Any]) -> dict[str, Any]:
    """The make_loader settings a measurement passes as options (`loader_point` takes the rest by position)."""
    return {key: value for key, value in settings.items() if key not in ("batch_size", "num_workers", "device")}


def _measure_round(
    base: AdviseInputs, items: list[Any], raw_pattern: str, prepared: dict[str, tuple[str, float]],
    settings: dict[str, Any], seconds: float, number: int, details: dict[str, Any],
) -> AdviseInputs:
    """One round: the cold reads, the loader over the raw sample and over each prepared format.

    The order turns round every other round, so a drift in the machine's load falls on each alike.
    """
    options = _measure_options(settings)
    batch, workers, device = settings["batch_size"], settings["num_workers"], settings["device"]
    # The raw tar holds classes only: it is timed with the same crop and recipe, which need no boxes.
    jobs = [("raw", raw_pattern), *((fmt, folder) for fmt, (folder, _) in prepared.items())]
    points = {}
    for name, dataset in jobs if number % 2 == 0 else reversed(jobs):
        points[name] = loader_point(dataset, batch, workers, device, seconds, **options)
    storage = cold_read_rate(items, workers, details)
    details.setdefault("cpu_decode_others_cpu_shares", []).append(points["raw"].others_cpu_share or 0.0)
    candidates = tuple(
        Candidate(fmt, points[fmt].idle_images_per_s, size, points[fmt].others_cpu_share)
        for fmt, (_, size) in prepared.items()
    )
    ceilings = dataclasses.replace(base.ceilings, cpu_decode=points["raw"].idle_images_per_s, storage=storage)
    return dataclasses.replace(base, ceilings=ceilings, candidates=candidates)


def apply_advice(result: AdviseResult, out: str | None = None, *, measure_seconds: float = 2.0) -> ApplyResult:
    """Run the recommended prepare into OUT and measure the loader on the result against the prediction.

    Raises:
        The errors of `prepare_dataset` and `make_loader`.
    """
    from ...prepare.job import prepare_dataset
    from ...specs import AugmentSpec, EncodeSpec, PrepareSpec, ResizeSpec, ShardSpec

    rec = result.advice.recommendation
    out = out or result.out
    spec = PrepareSpec(
        source=result.source,
        out=out,
        split=result.split,
        resize=ResizeSpec(size=rec.size, mode=rec.mode),
        augment=AugmentSpec(variants=rec.variants),
        encode=EncodeSpec(format=rec.format, quality=rec.quality),
        shards=ShardSpec(max_bytes=rec.shard_bytes),
    )
    prepared = prepare_dataset(spec, workers=rec.num_workers)
    half = measure_seconds / 2
    settings = result.loader_settings or loader_settings(result.batch_size, result.crop, rec.num_workers, result.device, None)
    options = _measure_options(settings)
    with scratch_folder(result.target) as scratch:
        task = result.inputs.task
        classes = result.classes if task == "segmentation" else []  # classes.txt of the masks
        sample_source = write_sample_source(result.sample_items, scratch, task, classes)
        sample_out, sample_bytes = prepare_sample(sample_source, scratch, rec.format, rec.size, rec.num_workers, mode=rec.mode)
        full: list[Any] = []
        sample: list[Any] = []
        for which in "ABBABAAB":  # a drift in machine load hits both alike
            dataset, runs = (out, full) if which == "A" else (sample_out, sample)
            runs.append(loader_point(dataset, result.batch_size, rec.num_workers, settings["device"], half, **options))
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



__all__ = [
    "FREE_SPACE_SHARE", "MAX_REPEATS", "NPY_GAIN", "SHARD_MAX", "SHARD_MIN", "SHARD_TARGET_COUNT", "STAGES", "Advice",
    "AdviseInputs", "AdviseResult", "ApplyResult", "Candidate", "Ceilings", "Confidence", "ModelConsumption", "Progress",
    "Recommendation", "advise", "apply_advice", "candidate_ceiling", "diagnosis_sentence", "find_bottleneck",
    "judge_rounds", "loader_call", "loader_settings", "model_consumption", "plan_advice", "shard_bytes_for",
]
