"""`gpufeed advise SRC --target DIR`: why the GPU would wait, and the `gpufeed prepare` that fixes it (SPEC §3).

Parsing and printing only: the measurements and the plan live in pipeline.measure.advise.diagnosis.
"""

from __future__ import annotations

import shlex
from typing import Any

import click

from ..units import format_bytes, format_count
from .common import Duration, option_errors, renamed_option, with_option_names
from .measuring import measure_errors, number_cell, plot_option, print_json, say_progress, text_table, write_plot
from .memory import MEMORY_OPTIONS

ADVISE_OPTIONS = {
    **MEMORY_OPTIONS,
    "gpu_images_per_s": "--gpu-images-per-s",
    "sample=": "--sample",
    "target=": "--target",
    "crop=": "--crop",
    "repeats=": "--repeats",
    "split=": "--split",
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
@click.option(
    "--crop", default=224, show_default=True,
    help="The training size in pixels: detection and segmentation letterbox to it (--size CROP --mode longer); "
    "classification crops it (--size CROP/0.875).",
)
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
@click.option("--repeats", default=5, show_default=True,
              help="Rounds of loader and storage measurements at most, until the verdict is stable.")
@click.option("--split", default=None,
              help="A YOLO dataset's split to advise on (default: its training split, where it has several).")
@click.option("--apply", "apply_out", default=None, help="Run the recommended prepare into OUT and measure the loader on it.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@plot_option("Write a PNG chart of the ceilings.")
@measure_errors
@option_errors(ADVISE_OPTIONS)
def advise(
    src: str, target: str, gpu_images_per_s: float | None, model: str | None, input_shape: str, vram: str | None,
    optimizer: str, batch_size: int, crop: int, sample: int, duration: float, device: str, repeats: int,
    split: str | None, apply_out: str | None, as_json: bool, plot: str | None,
) -> None:
    """Diagnose why the GPU would wait on SRC, and print the `gpufeed prepare` command that fixes it."""
    from ..measure.advise.diagnosis import advise as run_advise
    from ..measure.advise.diagnosis import apply_advice

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
        progress=say_progress,
        vram=vram,
        optimizer=optimizer,
        repeats=repeats,
        split=split,
    )
    result.notes = [with_option_names(note, ADVISE_OPTIONS) for note in result.notes]
    if not as_json:
        _print_advice(result)
    applied = None
    if apply_out:
        say_progress("running the recommended prepare")
        applied = apply_advice(result, apply_out, measure_seconds=duration)
        if not as_json:
            _print_applied(applied, result)
    write_plot("advise", plot, result, applied=applied)
    if as_json:
        data = result.to_dict()
        data["applied"] = applied.to_dict() if applied else None
        print_json(data)


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
         f"{r['step_seconds'] * 1e3:.1f}", number_cell(r["images_per_s"]))
        for r in rows
    ]
    click.echo(text_table(table, ("batch", "memory", "fits", "step ms", "images/s")))


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
        table.append((label, number_cell(value), note))
    click.echo(text_table(table, ("ceiling", "images/s", ""), "lrl"))
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
    if result.confidence is not None:
        click.echo(f"verdict {result.confidence.statement}")
    if not advice.prepare_helps:
        _print_no_prepare(result)
        return
    click.echo("\nrecommended:")
    click.echo("  " + shlex.join(result.command))
    click.echo(f"  then: {result.loader_line}")
    for reason in advice.reasons:
        click.echo(f"  - {reason}")
    click.echo(
        f"\npredicted: loader {advice.predicted_loader:.0f} images/s after preparing "
        f"(data pipeline today: {min(v for v in (ceilings.cpu_decode, ceilings.storage, ceilings.host_to_device) if v):.0f}); "
        f"training {advice.predicted_after:.0f} images/s (today {advice.predicted_before:.0f})"
    )


COMMANDS = (advise,)
