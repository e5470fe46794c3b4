"""`gpufeed estimate-memory`: what a training step needs on the device, and how big a batch fits (SPEC §3).

Parsing and printing only: the trace and the estimate live in pipeline.measure.memory.estimate.
"""

from __future__ import annotations

from typing import Any

import click

from ..units import format_bytes, format_count
from .common import option_errors
from .measuring import (
    measure_errors,
    number_cell,
    parse_rate_option,
    plot_option,
    print_json,
    print_note,
    say_progress,
    text_table,
    write_plot,
)

LOADER_BATCH = 64  # estimate-memory's loader measurement without --batch-size

MEMORY_OPTIONS = {
    "model=": "--model",
    "loss=": "--loss",
    "input_shape": "--input",
    "vram=": "--vram",
    "device_flops": "--device-flops",
    "batch_size": "--batch-size",
}
"""How `gpufeed estimate-memory` spells the settings its library errors and notes name."""


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
@measure_errors
@option_errors(MEMORY_OPTIONS)
def estimate_memory_command(
    model: str, input_shape: str, optimizer: str, dtype: str | None, autocast: str | None, channels_last: bool,
    foreach: bool | None, zero_grad: str, loss: str | None, vram: str | None, margin: float, for_device: str,
    cuda_context: str | None, meta: bool, inference: bool, batch_size: int | None, device_flops: str | None,
    measure: bool | None, device: str, loader_images_per_s: float | None, dataset: str | None, as_json: bool,
    plot: str | None,
) -> None:
    """Trace a training step: its peak memory, the largest batch, the rule of thumb beside it, FLOPs and images/s."""
    from ..measure.memory.estimate import estimate_memory, load_model

    flops = parse_rate_option(device_flops) if device_flops else None
    if dataset and loader_images_per_s is None:
        from ..measure.loader import check_batches, dataset_samples, measure_loader

        samples = dataset_samples(dataset)
        loader_batch = batch_size or min(LOADER_BATCH, samples)
        if batch_size is None and loader_batch < LOADER_BATCH:  # the rate per image hardly depends on the batch
            print_note(f"the loader is measured at batch {loader_batch}: {dataset} holds only {format_count(samples, 'sample')}")
        check_batches(dataset, loader_batch, samples=samples)  # before the step is traced, not after
        say_progress(f"measuring the loader over {dataset}")
        point = measure_loader(dataset, batch_size=loader_batch, device=device)
        loader_images_per_s = point.idle_images_per_s  # scaled to an idle machine, as advise does
    say_progress("tracing a training step")
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
    write_plot("memory", plot, estimate)
    if as_json:
        print_json(estimate.to_dict())
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
    click.echo(text_table(rows, ("", "traced", "rule of thumb"), "lrr"))
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
    click.echo(text_table(flops, align="llr"))
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
         "yes" if r.fits else "no", number_cell(r.images_per_s))
        for r in e.rows
    ]
    click.echo(text_table(batches, ("batch", "memory", "rule of thumb", "fits", "images/s")))
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


COMMANDS = (estimate_memory_command,)
