"""`gpufeed estimate-memory`: what a training step needs on the device, and how big a batch fits.

The number comes from tracing one real training step on fake tensors
(`pipeline.measure.memory.trace`): forward, loss, backward, the optimizer
step with its temporaries and ``zero_grad``, every allocation and free in
order, at three batch sizes. Each storage is then ``c + s·B`` bytes, so the
peak of live bytes is known for every batch and the largest batch that fits
is a formula, not a search by crashing into OOM. On CUDA the same events
run through a model of the caching allocator (512-byte blocks, 2 MiB and
20 MiB segments) and the CUDA context is added.

The textbook arithmetic stays beside it as the explanation (`RuleOfThumb`),
per training step with parameters of `b` bytes:

- parameters: P elements -> P·b bytes;
- gradients: P·b (training only);
- optimizer state: SGD none, momentum P·b, Adam 2·P·b, so that parameters +
  gradients + state are ×2 (SGD), ×3 (momentum), ×4 (Adam) the parameter memory;
- activations: the distinct tensors that the model's modules output for one
  sample, counted with forward hooks, ×2 in training (the activation and its
  gradient); ×1 under `torch.no_grad()` (inference: no gradients anywhere);
- the input batch itself.

The report shows both, category by category, and how far the rule is off.
FLOPs per sample come from `torch.utils.flop_counter` (forward; a training
step is ≈3×). With the device's FLOP/s (given), or step times measured on
synthetic batches, a step of batch B takes ``overhead + B × seconds_per_sample``,
so images/s = B / (overhead + B × seconds_per_sample): it rises with B until
the device is saturated, after which a bigger batch only costs memory.

This module puts the estimate together (`estimate_memory`); its parts are beside it:
`model` (the model, loss and shape a user names; activations and FLOPs on fake
tensors), `trace` (the traced step), `device` (the device's allocator and
context), `timing` (step times on the real device) and `result` (the
`MemoryEstimate` and its arithmetic). Their public names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import ConfigError
from ...units import format_bytes
from .device import MAX_BATCH, DeviceMemory, choose_memory_device, context_bytes, parse_vram, trace_device
from .model import check_model_input, count_activations, count_flops, load_loss, load_model, parse_shape
from .result import (
    REPORT_BATCH,
    SATURATION,
    STATE_MULTIPLIER,
    BatchRow,
    MemoryEstimate,
    RuleOfThumb,
    ThroughputModel,
    batch_rows,
    largest_batch,
    model_state_bytes,
)
from .timing import fit_step_times, measure_step_times
from .trace import ACTIVATIONS, BUFFERS, GRADIENTS, OPTIMIZERS, PARAMETERS, STATE, TRACE_BATCHES, StepSpec, trace_step

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
AUTOCAST = {"float16": "float16", "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _step_tracer(module: Any, shape: tuple[int, ...], spec: StepSpec, name: str) -> Callable[[int], Any]:
    def trace(batch: int) -> Any:
        try:
            return trace_step(module, shape, batch, spec)
        except ConfigError:
            raise
        except Exception as exc:  # the model's own code, or an operation fake tensors cannot follow
            hint = ""
            if "DynamicOutputShape" in type(exc).__name__ or "data-dependent" in str(exc):
                hint = " (an operation whose output size depends on the data cannot be traced without data)"
            raise ConfigError(f"tracing a step of {name} at batch {batch} failed: {type(exc).__name__}: {exc}{hint}") from exc

    return trace


def estimate_memory(
    model: Any,
    input_shape: str | Sequence[int],
    *,
    optimizer: str = "adam",
    dtype: str | None = None,
    training: bool = True,
    vram: int | str | None = None,
    safety_margin: float = 0.1,
    batch_size: int | None = None,
    device_flops: float | None = None,
    measure: bool = False,
    device: str = "auto",
    measure_seconds: float = 2.0,
    loader_images_per_s: float | None = None,
    autocast: str | None = None,
    channels_last: bool = False,
    foreach: bool | None = None,
    set_to_none: bool = True,
    loss: str | Callable[[Any, Any], Any] | None = None,
    for_device: str = "auto",
    cuda_context: int | str | None = None,
) -> MemoryEstimate:
    """Trace a training step: its peak memory, the largest batch, the rule of thumb beside it, FLOPs and images/s.

    Args:
        model: an nn.Module (on any device, the meta device included), or ``"module:factory"``.
        input_shape: one sample's shape, e.g. (3, 224, 224) or "3,224,224".
        optimizer: "sgd", "momentum" (SGD with momentum 0.9), "adam" or "adamw".
        dtype: cast the model and its input to float32, float16, bfloat16 or float64 (None: as built).
        training: False traces inference under torch.no_grad in eval mode.
        vram: device memory in bytes, as text ("16GiB"), or "device" (the CUDA device's); None: no limit.
        safety_margin: share of `vram` kept free (fragmentation, library workspaces).
        batch_size: the batch to report and check the loader against (default: the largest that fits).
        device_flops: the device's sustained FLOP/s; images/s follow from FLOPs per step.
        measure: time steps on synthetic batches on `device` (overrides device_flops' per-sample cost).
        device: where to measure ("auto", "cpu", "cuda").
        measure_seconds: time budget of the measurement.
        loader_images_per_s: the loader's rate, to say whether it can feed the device.
        autocast: "float16" or "bfloat16": mixed precision with torch.autocast (parameters stay float32).
        channels_last: the model and its input in channels_last memory format.
        foreach: the optimizer's foreach implementation; None: the device's default (CUDA yes, CPU no).
        set_to_none: zero_grad(set_to_none=…) after each step; False keeps zeroed gradients.
        loss: ``fn(output, inputs)`` returning a scalar, or ``"module:fn"``; None: cross-entropy.
        for_device: the memory of "cuda" (allocator and context included) or "cpu" (tensor bytes);
            "auto": CUDA when a VRAM is given or a CUDA device is here.
        cuda_context: the CUDA context's memory (default: measured on a CUDA device, else assumed 512 MiB).

    Returns:
        A MemoryEstimate.

    Raises:
        ConfigError: a bad setting, model or loss spec, or a step that cannot be traced.
    """
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if autocast is not None and autocast not in AUTOCAST:
        raise ConfigError(f"autocast must be one of {', '.join(AUTOCAST)}, got {autocast!r}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if not 0 <= safety_margin < 1:
        raise ConfigError("safety_margin must be between 0 and 1")
    if batch_size is not None and batch_size < 1:
        raise ConfigError("batch_size must be at least 1")
    shape = parse_shape(input_shape)
    name = model if isinstance(model, str) else type(model).__name__
    module = load_model(model) if isinstance(model, str) else model
    check_model_input(module, shape, name)
    target = choose_memory_device(for_device, vram)
    vram_bytes = parse_vram(vram)
    spec = StepSpec(
        optimizer=optimizer,
        foreach=target == "cuda" if foreach is None else foreach,
        training=training,
        autocast=AUTOCAST[autocast] if autocast else None,
        dtype=dtype,
        channels_last=channels_last,
        set_to_none=set_to_none,
        loss=load_loss(loss) if loss is not None else None,
        device=trace_device(target),
    )
    context, context_source = context_bytes(cuda_context, target)
    fallback = ""
    try:
        memory = DeviceMemory(_step_tracer(module, shape, spec, name), target, context)
    except ConfigError as exc:
        if spec.device == "cpu":
            raise
        fallback = f"tracing with CUDA's kernels failed: {exc}"
        spec = dataclasses.replace(spec, device="cpu")
        memory = DeviceMemory(_step_tracer(module, shape, spec, name), target, context)
    estimate = _traced_estimate(module, name, shape, spec, memory, optimizer, loss)
    estimate.cuda_context_bytes, estimate.cuda_context_source = context, context_source
    estimate.memory_device = target
    estimate.safety_margin, estimate.batch_size = safety_margin, batch_size
    estimate.device_flops, estimate.loader_images_per_s = device_flops, loader_images_per_s
    if vram_bytes is not None:
        estimate.vram_bytes = vram_bytes
        estimate.max_batch_size = memory.largest_batch(int(vram_bytes * (1 - safety_margin)))
        estimate.rule_max_batch_size = largest_batch(
            vram_bytes, safety_margin, estimate.rule.fixed_bytes, estimate.rule.per_sample_bytes
        )
        if estimate.max_batch_size == 0:
            estimate.notes.append("the model state alone does not fit in this VRAM with the safety margin")
        elif estimate.max_batch_size >= MAX_BATCH:
            estimate.notes.append(f"the search for the largest batch stops at {MAX_BATCH:,}")
    _locate_peak(estimate, memory, batch_size or estimate.max_batch_size or REPORT_BATCH)
    _add_trace_notes(estimate, memory, spec, fallback or "no CUDA device here")
    estimate.throughput = _throughput_model(estimate, module, measure, device, measure_seconds)
    if estimate.throughput is not None and estimate.device_flops is None:
        estimate.device_flops = estimate.flops_per_sample_step / estimate.throughput.seconds_per_sample
    estimate.rows = batch_rows(estimate)
    _note_allocator_dips(estimate)
    return estimate


def _note_allocator_dips(estimate: MemoryEstimate) -> None:
    """Say why a smaller batch can need more memory on CUDA than a larger one (the allocator's segments).

    The tensor bytes grow with the batch; CUDA's figure is the caching allocator's
    segments, and a tensor of up to 1 MiB comes from a 2 MiB segment of the small
    pool while one above it shares a 20 MiB segment of the large pool: at batch 1
    many small-pool segments can add up to more than batch 2's shared large one.
    `torch.cuda.max_memory_reserved` reports the same, so the figures are kept.
    """
    rows = estimate.rows
    dips = [(low, high) for low, high in zip(rows, rows[1:]) if high.memory_bytes < low.memory_bytes]
    if estimate.memory_device != "cuda" or not dips:
        return
    low, high = dips[0]
    estimate.notes.append(
        f"batch {low.batch_size} needs more device memory than batch {high.batch_size} "
        f"({format_bytes(low.memory_bytes)} against {format_bytes(high.memory_bytes)}) in CUDA's caching allocator: "
        f"tensors that share a 20 MiB segment at batch {high.batch_size} are 1 MiB or less at batch {low.batch_size} "
        "and take 2 MiB segments of their own (torch.cuda.max_memory_reserved shows the same; the tensor bytes "
        "grow with the batch)"
    )


def _traced_estimate(
    module: Any, name: str, shape: tuple[int, ...], spec: StepSpec, memory: DeviceMemory, optimizer: str,
    loss: Any,
) -> MemoryEstimate:
    """The estimate's model-state figures (from the trace), the rule of thumb and the FLOPs."""
    reference = memory.at(TRACE_BATCHES[0])
    marks = dict(reference.phases)
    state = reference.breakdown(TRACE_BATCHES[0], marks.get("optimizer step", marks["forward"]))
    parameters = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    dtype = spec.dtype or _parameter_dtype(module)
    size = DTYPE_BYTES.get(dtype, 4)
    forward_flops = count_flops(module, shape, spec)
    activations = count_activations(module, shape, spec.training, spec=spec)
    input_bytes = math.prod(shape) * (size if spec.dtype else 4)  # float32 unless the model is cast
    rule = RuleOfThumb(
        parameter_bytes=state[PARAMETERS],
        multiplier=STATE_MULTIPLIER[optimizer] if spec.training else 1,
        buffer_bytes=state[BUFFERS],
        activation_bytes_per_sample=activations,
        activation_factor=2 if spec.training else 1,
        input_bytes_per_sample=input_bytes,
    )
    return MemoryEstimate(
        model=name,
        input_shape=shape,
        dtype=dtype,
        dtype_bytes=size,
        optimizer=optimizer,
        training=spec.training,
        parameters=parameters,
        parameter_bytes=state[PARAMETERS],
        gradient_bytes=state[GRADIENTS] if spec.training else 0,
        optimizer_state_bytes=state[STATE] if spec.training else 0,
        buffer_bytes=state[BUFFERS],
        activation_bytes_per_sample=activations,
        activation_factor=rule.activation_factor,
        input_bytes_per_sample=input_bytes,
        flops_per_sample_forward=forward_flops,
        flops_per_sample_step=3 * forward_flops if spec.training else forward_flops,
        rule=rule,
        autocast=spec.autocast,
        channels_last=spec.channels_last,
        foreach=spec.foreach,
        set_to_none=spec.set_to_none,
        loss="cross-entropy" if loss is None else loss if isinstance(loss, str) else getattr(loss, "__name__", "custom"),
        traced_on=spec.device,
        traced_batches=reference.batches if memory.affine else TRACE_BATCHES,
        affine=memory.affine,
        memory=memory,
    )


def _parameter_dtype(module: Any) -> str:
    for tensor in module.parameters():
        if tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return "float32"


def _locate_peak(estimate: MemoryEstimate, memory: DeviceMemory, batch: int) -> None:
    """Fill in the traced figures at `batch`: breakdown, phase, c + s·B, kept activations, allocator."""
    model = memory.at(batch)
    estimate.peak_batch = batch
    estimate.breakdown = model.breakdown(batch)
    estimate.phase_peaks = model.phase_peaks(batch)
    estimate.peak_phase = estimate.peak_phase_for_batch(batch)
    if memory.affine:
        estimate.fixed_bytes, estimate.per_sample_bytes = model.affine_peak(batch)
    else:  # the slope between this batch and the next one up, each traced
        estimate.per_sample_bytes = memory.peak(batch + 1) - memory.peak(batch)
        estimate.fixed_bytes = memory.peak(batch) - batch * estimate.per_sample_bytes
    marks = dict(model.phases)
    if "backward" in marks and memory.affine:
        kept = model.breakdown(batch, marks["backward"])[ACTIVATIONS] - model.breakdown(0, marks["backward"])[ACTIVATIONS]
        estimate.kept_activation_bytes_per_sample = round(kept / batch)
    estimate.allocated_bytes = memory.allocated(batch)
    estimate.reserved_bytes = memory.reserved(batch)


def _add_trace_notes(estimate: MemoryEstimate, memory: DeviceMemory, spec: StepSpec, why_cpu: str) -> None:
    if not memory.affine:
        estimate.notes.append(
            f"the memory is not affine in the batch ({memory.reason}): each batch shown was traced on its own"
        )
    if estimate.memory_device == "cuda" and spec.device != "cuda":
        estimate.notes.append(
            f"traced with the CPU's kernels and autocast rules ({why_cpu}); "
            "CUDA's may keep a few tensors in another dtype or size"
        )
    if estimate.memory_device == "cuda":
        estimate.notes.append(
            "CUDA library workspaces (cuBLAS: 4 MiB, 32 MiB on Hopper and newer; cuDNN's per convolution) "
            "are not in the trace: the safety margin covers them"
        )


def _throughput_model(
    estimate: MemoryEstimate, module: Any, measure: bool, device: str, seconds: float
) -> ThroughputModel | None:
    if measure:
        top = estimate.max_batch_size or 32
        batches = sorted({max(1, min(top, 4)), max(1, min(top, 16))})
        return measure_step_times(
            module,
            estimate.input_shape,
            batches,
            optimizer=estimate.optimizer,
            training=estimate.training,
            device=device,
            min_seconds=seconds,
        )
    if estimate.device_flops:
        if estimate.device_flops <= 0 or estimate.flops_per_sample_step <= 0:
            return None
        return ThroughputModel(0.0, estimate.flops_per_sample_step / estimate.device_flops, "given")
    return None


__all__ = [
    "AUTOCAST", "DTYPE_BYTES", "REPORT_BATCH", "SATURATION", "STATE_MULTIPLIER", "BatchRow", "MemoryEstimate",
    "RuleOfThumb", "ThroughputModel", "batch_rows", "check_model_input", "count_activations", "count_flops",
    "estimate_memory", "fit_step_times", "largest_batch", "load_loss", "load_model", "measure_step_times",
    "model_state_bytes", "parse_shape",
]
