"""`gpufeed bench …`, `gpufeed advise`, `gpufeed estimate-memory`: measuring and advising (SPEC §3).

Parsing and printing only: the measurements live in pipeline.measure (disk, decode, loader, advise, memory, plots).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click

from ..errors import ConfigError
from ..units import format_bytes, format_count, parse_bytes, parse_rate
from .common import Duration, exit_on_user_errors, option_errors, renamed_option, require_extra, with_option_names

# Ctrl-C: the benchmarks have removed their test files by the time this prints.
_measure_errors = exit_on_user_errors("interrupted; temporary test files were removed")


def _say(text: str) -> None:
    if sys.stderr.isatty():
        click.echo(f"gpufeed: {text} …", err=True)


def _note(text: str) -> None:
    click.echo(f"gpufeed: note: {text}", err=True)


LOADER_BATCH = 64  # estimate-memory's loader measurement without --batch-size


def _sizes(text: str, name: str) -> list[int]:
    try:
        return [parse_bytes(part) for part in text.split(",") if part.strip()]
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=name) from None


def _size(text: str, name: str) -> int:
    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=name) from None


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected numbers like 1,2,4, got {text!r}", param_hint=name) from None
    if not values or min(values) < 1:
        raise click.BadParameter("expected positive numbers", param_hint=name)
    return values


def _rate(text: str, name: str = "--device-flops") -> float:
    try:
        return parse_rate(text, name)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=name) from None


def _num(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _table(rows: Sequence[tuple[str, ...]], header: tuple[str, ...] | None = None, align: str = "") -> str:
    """Columns padded to their widest cell; `align` has one l or r per column (default: l then r)."""
    lines = ([header] if header else []) + list(rows)
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    align = align or "l" + "r" * (len(widths) - 1)
    out = []
    for index, line in enumerate(lines):
        cells = [cell.ljust(width) if side == "l" else cell.rjust(width) for cell, width, side in zip(line, widths, align)]
        out.append("  ".join(cells).rstrip())
        if header and index == 0:
            out.append("  ".join("-" * width for width in widths))
    return "\n".join(out)


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _plots_available(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value:  # checked before measuring, not after minutes of it
        require_extra("plots", ("matplotlib",), "--plot")
    return value


def plot_option(text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--plot FILE.png` with help `text`; refused at once, with the install line, where matplotlib is missing."""
    return click.option("--plot", default=None, callback=_plots_available, help=text)


def _plot(kind: str, plot: str | None, result: Any, **extra: Any) -> None:
    if not plot:
        return
    from ..measure import plots

    path = getattr(plots, f"plot_{kind}")(result, plot, **extra)
    click.echo(f"plot: {path}", err=True)


# ---------------------------------------------------------------------------
# gpufeed bench disk | decode | loader


@click.group()
def bench() -> None:
    """Measure storage, decoders and the loader on this machine."""


@bench.command("disk")
@click.argument("path")
@renamed_option(
    "--file-size", default="1GiB", show_default=True, old=("--size",), help="Test file size (larger than any device cache)."
)
@click.option("--block-sizes", default="1MiB,2MiB,4MiB", show_default=True, help="Sequential block sizes.")
@click.option("--duration", type=Duration(), default="2s", show_default=True, help="How long each read test runs (2, 0.5s, 1m).")
@click.option("--threads", default=16, show_default=True, help="Reads in flight for the queue-depth-N figures.")
@click.option("--small-file-size", default=None, help="Small-file size (default: the --dataset mean, else 110kB).")
@click.option("--dataset", default=None, help="Take the small-file size from this dataset's mean file size.")
@click.option("--small-files", default=512, show_default=True, help="How many small files to read.")
@click.option("--no-direct", is_flag=True, help="Do not try O_DIRECT; evict files with posix_fadvise instead.")
@click.option(
    "--tests",
    default="seq_write,seq_read,randread,small_files",
    show_default=True,
    help="Which tests to run, comma-separated: seq_write, seq_read, randread, small_files.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@plot_option("Write a PNG chart (IOPS vs threads, MB/s vs block size).")
@_measure_errors
def bench_disk(
    path: str,
    file_size: str,
    block_sizes: str,
    duration: float,
    threads: int,
    small_file_size: str | None,
    dataset: str | None,
    small_files: int,
    no_direct: bool,
    tests: str,
    as_json: bool,
    plot: str | None,
) -> None:
    """Sequential and random read speed, latency and small-file reads of the storage under PATH."""
    from ..measure.disk import benchmark_disk, mean_file_bytes, remember_result

    small = parse_bytes(small_file_size) if small_file_size else (mean_file_bytes(dataset) if dataset else None)
    _say(f"measuring {path}")
    result = benchmark_disk(
        path,
        file_bytes=_size(file_size, "--file-size"),
        block_sizes=_sizes(block_sizes, "--block-sizes"),
        duration_s=duration,
        threads=threads,
        small_file_bytes=small,
        small_files=small_files,
        tests=[name.strip() for name in tests.split(",") if name.strip()],
        direct=False if no_direct else None,
    )
    remember_result(result)  # the ceiling `gpufeed watch` compares a run's reads with
    _plot("disk", plot, result)
    if as_json:
        _emit_json(result.to_dict())
        return
    free = format_bytes(result.free_bytes)
    click.echo(f"{result.path}: {result.device_kind} ({result.fstype}{', ' + result.device if result.device else ''}), {free} free")
    if result.kind_note:
        click.echo(f"note: {result.kind_note}")
    click.echo(f"page cache bypass: {result.cache_bypass}; test file {format_bytes(result.file_bytes)}, {duration:g} s per test")
    rows = []
    if result.seq_write_mb_s is not None:
        rows.append(("sequential write (fsync included)", _num(result.seq_write_mb_s), "MB/s", "", ""))
    for block, rate in sorted(result.seq_read_by_block.items()):
        rows.append((f"sequential read, {format_bytes(block)} blocks", _num(rate), "MB/s", "", ""))
    for point in result.randread_sweep:
        rows.append(
            (f"random 4 KiB read, {format_count(point.threads, 'thread')}", _num(point.iops), "IOPS",
             f"{point.p50_ms:.3f}", f"{point.p99_ms:.3f}")
        )
    small_size = format_bytes(result.small_file_bytes)
    if result.small_file_reads_per_s is not None:
        rows.append((f"small files ({small_size}), 1 thread", _num(result.small_file_reads_per_s_qd1), "files/s", "", ""))
        rows.append(
            (f"small files ({small_size}), {result.threads} threads", _num(result.small_file_reads_per_s), "files/s", "", "")
        )
    click.echo(_table(rows, ("test", "rate", "", "p50 ms", "p99 ms"), "lrlrr"))
    for warning in result.warnings:
        click.echo(f"gpufeed: warning: {warning}", err=True)


def _decoder_names(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    from ..measure.decode import decoder_name

    try:
        return tuple(decoder_name(value) for value in values)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


@bench.command("decode")
@click.argument("src")
@click.option("--sample", default=32, show_default=True, help="Images sampled from SRC.")
@click.option("--size", default=256, show_default=True, help="Shorter side of the prepared copy in pixels (prepare --size).")
@renamed_option(
    "--crop",
    default=224,
    show_default=True,
    old=("--target",),
    help="The training input in pixels: every decode is resized to this shorter side (region: a crop this size).",
)
@click.option("--quality", default=90, show_default=True, help="JPEG quality of the prepared copy.")
@renamed_option(
    "--duration",
    type=Duration(),
    default="0.5s",
    show_default=True,
    old=("--seconds",),
    help="Minimum time measured per decoder and sample (0.5, 2s).",
)
@click.option(
    "--decoder",
    "decoders",
    multiple=True,
    callback=_decoder_names,
    help="Only this decoder (repeatable): region (the loader's), pil, pil-draft, simplejpeg, pyturbojpeg, opencv.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@plot_option("Write a PNG chart (images/s per core by decoder).")
@_measure_errors
def bench_decode(
    src: str, sample: int, size: int, crop: int, quality: int, duration: float, decoders: tuple[str, ...],
    as_json: bool, plot: str | None,
) -> None:
    """Per-core decode + resize images/s on a sample of SRC, raw vs prepared, for each decoder."""
    from ..measure.decode import benchmark_decode

    _say(f"decoding a sample of {src}")
    result = benchmark_decode(
        src, sample=sample, target=crop, size=size, quality=quality, min_seconds=duration, decoders=list(decoders) or None
    )
    _plot("decode", plot, result)
    if as_json:
        _emit_json(result.to_dict())
        return
    click.echo(
        f"{result.samples} images of {src}: raw {result.raw_mean_pixels / 1e6:.2f} MP, {result.raw_mean_bytes / 1e3:.0f} kB; "
        f"prepared (shorter side {result.prepared_size}) {result.prepared_mean_pixels / 1e6:.2f} MP, "
        f"{result.prepared_mean_bytes / 1e3:.0f} kB JPEG q{result.quality}, {result.npy_mean_bytes / 1e3:.0f} kB .npy"
    )
    click.echo(f"images/s per core, decode + resize to shorter side {result.target}:")
    rows = [
        (row.decoder, _num(row.raw_images_per_s), _num(row.prepared_images_per_s),
         f"{row.speedup:.1f}x" if row.speedup else "", row.note)
        for row in result.rows
    ]
    click.echo(_table(rows, ("decoder", "raw", "prepared", "speedup", "note"), "lrrrl"))


STALL_MEANING = "stall: the share of the training loop's time spent waiting for data"


@bench.command("loader")
@click.argument("dataset")
@renamed_option(
    "--num-workers",
    default=None,
    old=("--workers",),
    help="The loader's num_workers values to measure, e.g. 1,2,4 (default: 1,2,4 … 2 x cores).",
)
@click.option("--batch-size", default=64, show_default=True, help="Samples per batch.")
@click.option(
    "--gpu-images-per-s",
    type=float,
    default=None,
    help="Simulated consumer rate; without it the consumer is infinitely fast and there is no stall to measure.",
)
@renamed_option(
    "--duration",
    type=Duration(),
    default="2s",
    show_default=True,
    old=("--seconds",),
    help="Time measured per num_workers value (2, 0.5s, 1m).",
)
@click.option("--device", default="auto", show_default=True, help="The loader's device: auto, cpu, cuda.")
@click.option(
    "--worker-type",
    type=click.Choice(["thread", "process"]),
    default="thread",
    show_default=True,
    help="Decode in threads of this process or in worker processes.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@plot_option("Write a PNG chart (images/s, and the stall fraction against a consumer rate, vs num_workers).")
@_measure_errors
def bench_loader(
    dataset: str, num_workers: str | None, batch_size: int, gpu_images_per_s: float | None, duration: float,
    device: str, worker_type: str, as_json: bool, plot: str | None,
) -> None:
    """The loader's images/s (and stall fraction, against --gpu-images-per-s) over DATASET for a range of num_workers."""
    from ..measure.loader import benchmark_loader

    _say(f"running the loader over {dataset}")
    with option_errors({"batch_size": "--batch-size", "num_workers": "--num-workers"}):
        result = benchmark_loader(
            dataset,
            workers=_ints(num_workers, "--num-workers") if num_workers else None,
            batch_size=batch_size,
            consumer_images_per_s=gpu_images_per_s,
            min_seconds=duration,
            device=device,
            worker_type=worker_type,
        )
    _plot("loader", plot, result)
    if as_json:
        _emit_json(result.to_dict())
        return
    consumer = f"a consumer of {gpu_images_per_s:g} images/s" if gpu_images_per_s else "an infinitely fast consumer"
    click.echo(f"loader over {dataset}, batch {batch_size}, {worker_type} workers, against {consumer}:")
    rows: list[tuple[str, ...]] = []
    for p in result.points:
        busy = "n/a" if p.others_cpu_share is None else f"{p.others_cpu_share:.0%}"
        # Against an infinitely fast consumer the loop always waits for data: that says nothing, so no column.
        stall = (f"{p.stall_fraction:.1%}",) if gpu_images_per_s else ()
        rows.append((str(p.num_workers), _num(p.images_per_s), *stall, busy))
    header = ("num_workers", "images/s", *(("stall",) if gpu_images_per_s else ()), "CPU used by other processes")
    click.echo(_table(rows, header))
    if gpu_images_per_s:
        click.echo(f"({STALL_MEANING})")
    click.echo(f"best: num_workers={result.best.num_workers} ({result.best.images_per_s:.0f} images/s)")


# ---------------------------------------------------------------------------
# gpufeed advise


MEMORY_OPTIONS = {
    "model=": "--model",
    "loss=": "--loss",
    "input_shape": "--input",
    "vram=": "--vram",
    "device_flops": "--device-flops",
    "batch_size": "--batch-size",
}
"""How `gpufeed estimate-memory` spells the settings its library errors and notes name."""

ADVISE_OPTIONS = {
    **MEMORY_OPTIONS,
    "gpu_images_per_s": "--gpu-images-per-s",
    "sample=": "--sample",
    "target=": "--target",
}
"""How `gpufeed advise` spells them (its model is timed through estimate-memory's code)."""


@click.command()
@click.argument("src")
@click.option("--target", required=True, help="Local folder where the shards would go (its disk is measured).")
@click.option("--gpu-images-per-s", type=float, default=None, help="The GPU's consumption rate, if known.")
@click.option("--model", default=None, help="Else time this model on synthetic batches: module:factory.")
@click.option(
    "--input", "input_shape", default="3,224,224", show_default=True, help="The model's input for one sample, channels first."
)
@click.option("--vram", default=None,
              help="The model's device memory (e.g. 16GiB; default: the CUDA device's): time it at the largest batch that fits.")
@click.option("--optimizer", type=click.Choice(["sgd", "momentum", "adam", "adamw"]), default="sgd", show_default=True,
              help="The model's optimizer, for its memory and step time.")
@click.option("--batch-size", default=64, show_default=True, help="Training batch size.")
@click.option("--crop", default=224, show_default=True, help="The loader's crop in pixels (the recommended --size is crop / 0.875).")
@click.option(
    "--sample",
    default=128,
    show_default=True,
    help="Images sampled from SRC for the measurements (at least two batches: 2 x --batch-size).",
)
@renamed_option(
    "--duration", type=Duration(), default="2s", show_default=True, old=("--seconds",), help="Time per loader measurement."
)
@click.option("--device", default="auto", show_default=True, help="Device of the loader and the model.")
@click.option("--apply", "apply_out", default=None, help="Run the recommended prepare into OUT and measure the loader on it.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@plot_option("Write a PNG chart of the ceilings.")
@_measure_errors
@option_errors(ADVISE_OPTIONS)
def advise(
    src: str, target: str, gpu_images_per_s: float | None, model: str | None, input_shape: str, vram: str | None,
    optimizer: str, batch_size: int, crop: int, sample: int, duration: float, device: str, apply_out: str | None,
    as_json: bool, plot: str | None,
) -> None:
    """Diagnose why the GPU would wait on SRC, and print the `gpufeed prepare` command that fixes it."""
    from ..measure.advise import advise as run_advise
    from ..measure.advise import apply_advice

    result = run_advise(
        src,
        target,
        gpu_images_per_s=gpu_images_per_s,
        model=model,
        input_shape=input_shape,
        batch_size=batch_size,
        crop=crop,
        sample=sample,
        measure_seconds=duration,
        device=device,
        out=apply_out,
        progress=_say,
        vram=vram,
        optimizer=optimizer,
    )
    result.notes = [with_option_names(note, ADVISE_OPTIONS) for note in result.notes]
    if not as_json:
        _print_advice(result)
    applied = None
    if apply_out:
        _say("running the recommended prepare")
        applied = apply_advice(result, apply_out, measure_seconds=duration)
        if not as_json:
            _print_applied(applied, result)
    _plot("advise", plot, result, applied=applied)
    if as_json:
        data = result.to_dict()
        data["applied"] = applied.to_dict() if applied else None
        _emit_json(data)


def _print_applied(applied: Any, result: Any = None) -> None:
    click.echo(f"\napplied: {applied.samples} samples prepared into {applied.out} in {applied.prepare_seconds:.1f} s")
    busy = (
        f"; other processes used {applied.others_cpu_share:.0%} of the CPU meanwhile "
        f"(plain wall-clock rate {applied.measured_wall_images_per_s:.0f} images/s)"
        if applied.others_cpu_share
        else ""
    )
    click.echo(f"loader on {applied.out}: measured {applied.measured_loader_images_per_s:.0f} images/s{busy}")
    click.echo(
        f"  predicted {applied.predicted_now_images_per_s:.0f} ({applied.error:+.0%}): the prediction (the loader over "
        "the prepared sample) re-run alternately with that measurement, so both saw the same machine"
    )
    click.echo(
        f"  advise printed {applied.predicted_loader_images_per_s:.0f} ({applied.error_advise_time:+.0%}): the same "
        f"prediction, measured earlier{_then_and_now(applied, result)}; the figure above is the fair comparison"
    )


def _then_and_now(applied: Any, result: Any) -> str:
    """How busy the machine was when advise measured its prediction, against during the check."""
    if result is None:
        return ""
    chosen = next((c for c in result.inputs.candidates if c.format == result.advice.recommendation.format), None)
    then, now = getattr(chosen, "others_cpu_share", None), applied.others_cpu_share
    if then is None or now is None:
        return " on a machine whose load has changed since"
    return f" while other processes used {then:.0%} of the CPU (during the check: {now:.0%})"


def _print_no_prepare(result: Any) -> None:
    advice = result.advice
    if advice.bottleneck == "gpu":
        why = f"training stays at the {result.inputs.consumer}'s {advice.predicted_before:,.0f} images/s whatever the data pipeline does"
    else:
        why = f"the prepared data would give {advice.predicted_after:,.0f} images/s, no more than today's {advice.predicted_before:,.0f}"
    click.echo(f"\nrecommended: nothing to prepare for speed: {why}.")


def _print_model_memory(details: dict[str, Any]) -> None:
    """From memory to data rate: what each batch needs on the device, and the images/s the loader must deliver."""
    rows = details.get("gpu_memory_rows")
    if not rows:
        return
    click.echo(
        f"\nthe model's batch: the largest that fits {format_bytes(details['gpu_vram_bytes'])} is "
        f"{details['gpu_batch_size']}; the loader must deliver its images/s:"
    )
    table = [
        (str(r["batch_size"]), format_bytes(r["memory_bytes"]), "yes" if r["fits"] else "no",
         f"{r['step_seconds'] * 1e3:.1f}", _num(r["images_per_s"]))
        for r in rows
    ]
    click.echo(_table(table, ("batch", "memory", "fits", "step ms", "images/s")))


def _print_advice(result: Any) -> None:
    advice, inputs = result.advice, result.inputs
    ceilings = inputs.ceilings
    click.echo(
        f"{result.source}: {format_count(result.listed, 'image')} (sample of {result.sample}), {format_count(inputs.cores, 'core')}; "
        f"target {result.target} ({inputs.target_kind})"
    )
    if result.details.get("gpu_source") == "given":
        gpu_label = "GPU (given)"
    else:
        gpu_label = f"{inputs.consumer} (measured on {result.details.get('gpu_device', '?')})"
    rows = [
        ("gpu", gpu_label, ceilings.gpu),
        ("cpu_decode", "CPU decode: loader over page-cached raw files", ceilings.cpu_decode),
        ("storage", f"storage: raw files read cold from {inputs.storage_kind}", ceilings.storage),
        ("host_to_device", "host-to-device copy", ceilings.host_to_device),
    ]
    table = []
    for name, label, value in rows:
        note = "<- bottleneck" if name == advice.bottleneck else ("no CUDA device" if value is None else "")
        table.append((label, _num(value), note))
    click.echo(_table(table, ("ceiling", "images/s", ""), "lrl"))
    _print_model_memory(result.details)
    busy = result.details.get("cpu_decode_others_cpu_share")
    if busy:
        click.echo(
            f"(loader rates are scaled to an otherwise idle machine: other processes used {busy:.0%} of the CPU "
            "while they were measured)"
        )
    for note in result.notes:
        click.echo(f"note: {note}")
    click.echo(f"\n{advice.sentence}")
    if not advice.prepare_helps:
        _print_no_prepare(result)
        return
    click.echo("\nrecommended:")
    click.echo("  " + shlex.join(result.command))
    click.echo(
        f"  then: make_loader({result.out!r}, batch_size={result.batch_size}, "
        f"num_workers={advice.recommendation.num_workers})"
    )
    for reason in advice.reasons:
        click.echo(f"  - {reason}")
    click.echo(
        f"\npredicted: loader {advice.predicted_loader:.0f} images/s after preparing "
        f"(data pipeline today: {min(v for v in (ceilings.cpu_decode, ceilings.storage, ceilings.host_to_device) if v):.0f}); "
        f"training {advice.predicted_after:.0f} images/s (today {advice.predicted_before:.0f})"
    )


# ---------------------------------------------------------------------------
# gpufeed estimate-memory


@click.command("estimate-memory")
@click.option("--model", required=True, help="module:factory returning a torch.nn.Module.")
@click.option("--input", "input_shape", default="3,224,224", show_default=True, help="One sample's shape, channels first.")
@click.option(
    "--optimizer",
    type=click.Choice(["sgd", "momentum", "adam", "adamw"]),
    default="adam",
    show_default=True,
    help="Its state: sgd none, momentum one copy of the parameters, adam and adamw two.",
)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16", "float64"]), default=None,
              help="Cast the model and its input to this dtype (default: as built).")
@click.option("--autocast", type=click.Choice(["float16", "bfloat16", "fp16", "bf16"]), default=None,
              help="Mixed precision with torch.autocast: float32 parameters, low-precision activations.")
@click.option("--channels-last", is_flag=True, help="The model and its input in channels_last memory format.")
@click.option("--foreach/--no-foreach", default=None, help="The optimizer's foreach kernels (default: the device's).")
@click.option("--zero-grad", "zero_grad", type=click.Choice(["none", "zeros"]), default="none", show_default=True,
              help="zero_grad(set_to_none=True) frees the gradients between steps; zeros keeps them zeroed.")
@click.option("--loss", default=None, help="module:fn called as fn(output, inputs) (default: cross-entropy).")
@click.option("--vram", default=None, help="Device memory, e.g. 16GiB or 80GB, or 'device' (the CUDA device's).")
@click.option("--margin", default=0.1, show_default=True, help="Share of VRAM kept free.")
@click.option("--for", "for_device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="Memory as CUDA holds it (allocator and context included) or plain tensor bytes; auto: CUDA "
                   "when --vram is given or a CUDA device is here.")
@click.option("--cuda-context", default=None, help="The CUDA context's memory (default: measured, else 512MiB).")
@click.option("--meta", is_flag=True, help="Build the model on the meta device: no memory for its weights, any size.")
@click.option("--inference", is_flag=True, help="Inference under torch.no_grad: no gradients or optimizer state.")
@click.option("--batch-size", type=int, default=None, help="Batch to report and check the loader against (default: largest that fits).")
@click.option("--device-flops", default=None, help="Device FLOP/s, e.g. 312T; else measured on synthetic batches.")
@click.option("--measure/--no-measure", default=None, help="Time steps on synthetic batches (default: when no --device-flops).")
@click.option("--device", default="auto", show_default=True, help="Device to measure on.")
@click.option("--loader-images-per-s", type=float, default=None, help="The loader's rate, if known.")
@click.option("--dataset", default=None, help="Else measure the loader over this prepared dataset.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@plot_option("Write a PNG chart (memory and images/s vs batch size).")
@_measure_errors
@option_errors(MEMORY_OPTIONS)
def estimate_memory_command(
    model: str, input_shape: str, optimizer: str, dtype: str | None, autocast: str | None, channels_last: bool,
    foreach: bool | None, zero_grad: str, loss: str | None, vram: str | None, margin: float, for_device: str,
    cuda_context: str | None, meta: bool, inference: bool, batch_size: int | None, device_flops: str | None,
    measure: bool | None, device: str, loader_images_per_s: float | None, dataset: str | None, as_json: bool,
    plot: str | None,
) -> None:
    """Trace a training step: its peak memory, the largest batch, the rule of thumb beside it, FLOPs and images/s."""
    from ..measure.memory import estimate_memory, load_model

    flops = _rate(device_flops) if device_flops else None
    if dataset and loader_images_per_s is None:
        from ..measure.loader import check_batches, dataset_samples, measure_loader

        samples = dataset_samples(dataset)
        loader_batch = batch_size or min(LOADER_BATCH, samples)
        if batch_size is None and loader_batch < LOADER_BATCH:  # the rate per image hardly depends on the batch
            _note(f"the loader is measured at batch {loader_batch}: {dataset} holds only {format_count(samples, 'sample')}")
        check_batches(dataset, loader_batch, samples=samples)  # before the step is traced, not after
        _say(f"measuring the loader over {dataset}")
        point = measure_loader(dataset, batch_size=loader_batch, device=device)
        loader_images_per_s = point.idle_images_per_s  # scaled to an idle machine, as advise does
    _say("tracing a training step")
    estimate = estimate_memory(
        load_model(model, meta=True) if meta else model,
        input_shape,
        optimizer=optimizer,
        dtype=dtype,
        training=not inference,
        vram=vram,
        safety_margin=margin,
        batch_size=batch_size,
        device_flops=flops,
        measure=(flops is None and not meta) if measure is None else measure,
        device=device,
        loader_images_per_s=loader_images_per_s,
        autocast=autocast,
        channels_last=channels_last,
        foreach=foreach,
        set_to_none=zero_grad == "none",
        loss=loss,
        for_device=for_device,
        cuda_context=cuda_context,
    )
    if meta:
        estimate.model = model
    _plot("memory", plot, estimate)
    if as_json:
        _emit_json(estimate.to_dict())
        return
    _print_memory(estimate)


def _print_memory(e: Any) -> None:
    click.echo(_memory_title(e))
    where = "on CUDA (the caching allocator and the CUDA context included)" if e.memory_device == "cuda" else "of tensors"
    click.echo(
        f"memory {where}, traced on {e.traced_on} at batches {', '.join(map(str, e.traced_batches))}"
        + (": every storage is c + s·B bytes (checked on the third)" if e.affine else "")
    )
    rule = e.rule.breakdown(e.peak_batch)
    traced_total = sum(e.breakdown.values())
    rule_total = e.rule.memory_for_batch(e.peak_batch)
    rows = [(name, format_bytes(e.breakdown[name]), format_bytes(rule[name])) for name in e.breakdown]
    rows.append(("total", format_bytes(traced_total), f"{format_bytes(rule_total)} ({e.rule_error:+.0%})"))
    click.echo(f"\nat batch {e.peak_batch} the peak is in the {e.peak_phase or 'step'}:")
    click.echo(_table(rows, ("", "traced", "rule of thumb"), "lrr"))
    click.echo(_memory_explanation(e))
    if e.memory_device == "cuda":
        click.echo(
            f"on CUDA: allocator blocks {format_bytes(e.allocated_bytes)}, segments {format_bytes(e.reserved_bytes)}, "
            f"+ CUDA context {format_bytes(e.cuda_context_bytes)} ({e.cuda_context_source}): "
            f"{format_bytes(e.memory_for_batch(e.peak_batch))}, all included below"
        )
    click.echo(
        f"near batch {e.peak_batch} the peak is {format_bytes(e.fixed_bytes)} + B × {format_bytes(e.per_sample_bytes)}"
    )
    flops = [
        ("parameters", f"{e.parameters:,}", format_bytes(e.parameter_bytes)),
        ("FLOPs per sample", "forward", f"{e.flops_per_sample_forward / 1e9:.3f} GFLOP"),
        ("FLOPs per sample", "step" if e.training else "forward", f"{e.flops_per_sample_step / 1e9:.3f} GFLOP"),
    ]
    click.echo(_table(flops, align="llr"))
    if e.vram_bytes:
        click.echo(
            f"largest batch in {format_bytes(e.vram_bytes)} with a {e.safety_margin:.0%} margin: {e.max_batch_size} "
            f"({format_bytes(e.memory_for_batch(e.max_batch_size or 1))}; the rule of thumb would say "
            f"{e.rule_max_batch_size})"
        )
    for note in e.notes:
        click.echo(f"note: {note}")
    if e.throughput is not None:
        t = e.throughput
        how = f"measured on {t.device}" if t.source == "measured" else "from the given FLOP/s"
        click.echo(
            f"speed ({how}): step = {t.overhead_s * 1e3:.1f} ms + {t.seconds_per_sample * 1e3:.3f} ms/sample; "
            f"peak {t.peak_images_per_s:,.0f} images/s ({(e.device_flops or 0) / 1e12:.2f} TFLOP/s); "
            f"batch {t.saturation_batch()} reaches 90 % of it, beyond that a bigger batch only costs memory"
        )
    batches = [
        (str(r.batch_size), format_bytes(r.memory_bytes), format_bytes(r.rule_memory_bytes),
         "yes" if r.fits else "no", _num(r.images_per_s))
        for r in e.rows
    ]
    click.echo(_table(batches, ("batch", "memory", "rule of thumb", "fits", "images/s")))
    if e.loader_can_feed is not None:
        need = e.required_images_per_s or 0.0
        verdict = "can" if e.loader_can_feed else "cannot"
        click.echo(
            f"the loader ({e.loader_images_per_s:,.0f} images/s) {verdict} feed batch {e.feed_batch} "
            f"({need:,.0f} images/s)"
            + ("" if e.loader_can_feed else f": the device would wait {1 - (e.loader_images_per_s or 0) / need:.0%} of the time")
        )


def _memory_title(e: Any) -> str:
    precision = f"{e.autocast} autocast" if e.autocast else e.dtype
    if not e.training:
        mode = "inference (torch.no_grad)"
    else:
        kernels = "foreach" if e.foreach else "per-parameter"
        mode = f"training with {e.optimizer} ({kernels}), zero_grad(set_to_none={e.set_to_none}), loss {e.loss}"
    layout = ", channels_last" if e.channels_last else ""
    return f"{e.model}, input {','.join(map(str, e.input_shape))}, {precision}{layout}, {mode}"


def _memory_explanation(e: Any) -> str:
    """Why the rule is off: the activations per sample, traced against the module outputs."""
    outputs = e.activation_bytes_per_sample
    if not outputs:
        return "the module outputs hold nothing per sample"
    rule_factor = e.activation_factor
    lines = [
        f"activations per sample: the peak grows by {format_bytes(e.per_sample_bytes)} a sample = "
        f"×{e.activation_multiple:.2f} the module outputs ({format_bytes(outputs)}) + the input; "
        f"the ×{rule_factor} rule says ×{rule_factor}"
    ]
    if e.kept_activation_bytes_per_sample:
        lines.append(
            f"kept for backward: ×{e.kept_activation_bytes_per_sample / outputs:.2f} the module outputs per sample"
        )
    phases = ", ".join(f"{name} {format_bytes(value)}" for name, value in e.phase_peaks.items())
    lines.append(f"peak by phase at batch {e.peak_batch}: {phases}")
    return "\n".join(lines)


COMMANDS = (bench, advise, estimate_memory_command)
