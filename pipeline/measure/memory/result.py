"""What `estimate_memory` returns, and the arithmetic on it: the estimate, its rows, the rule of thumb, the speed model.

`MemoryEstimate` holds the traced figures (and the `DeviceMemory` behind them), `RuleOfThumb` the
textbook arithmetic beside them (see `memory`'s docstring), `ThroughputModel` the step time as
``overhead + B × seconds_per_sample``, and `batch_rows` the table of batch sizes the report shows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from ...errors import ConfigError
from .trace import ACTIVATIONS, BUFFERS, GRADIENTS, INPUTS, OPTIMIZERS, PARAMETERS, STATE, TEMPORARIES

# Parameters + gradients + optimizer state, in units of the parameter memory.
STATE_MULTIPLIER = {"sgd": 2, "momentum": 3, "adam": 4, "adamw": 4}
SATURATION = 0.9  # "saturated": within 10 % of the device's peak images/s
REPORT_BATCH = 32  # the batch the breakdown is shown for when neither a batch nor a VRAM limit is given


@dataclasses.dataclass(frozen=True)
class ThroughputModel:
    """Step time = overhead_s + batch × seconds_per_sample.

    Attributes:
        overhead_s: fixed cost of a step (kernel launches, optimizer, Python).
        seconds_per_sample: marginal cost of one more sample.
        source: "measured" (timed on synthetic batches) or "given" (from FLOP/s).
        device: where it was measured.
        points: (batch, seconds per step) measured.
    """

    overhead_s: float
    seconds_per_sample: float
    source: str
    device: str = ""
    points: tuple[tuple[int, float], ...] = ()

    def images_per_s(self, batch: int) -> float:
        return batch / (self.overhead_s + batch * self.seconds_per_sample)

    @property
    def peak_images_per_s(self) -> float:
        return 1.0 / self.seconds_per_sample

    def saturation_batch(self, fraction: float = SATURATION) -> int:
        """Smallest batch reaching `fraction` of the peak: B ≥ f·overhead / ((1 − f)·per_sample)."""
        batch = fraction * self.overhead_s / ((1 - fraction) * self.seconds_per_sample)
        return max(1, math.ceil(batch - 1e-9))  # 90.00000000000001 is 90


@dataclasses.dataclass
class BatchRow:
    """One batch size: the memory a step needs (traced), what the rule of thumb says, and images/s."""

    batch_size: int
    memory_bytes: int
    fits: bool
    images_per_s: float | None
    rule_memory_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class RuleOfThumb:
    """The textbook arithmetic (see `memory`'s docstring), kept as the explanation of the traced figures.

    Attributes:
        parameter_bytes: the parameters as stored.
        multiplier: parameters + gradients + optimizer state in units of the parameters (×2, ×3, ×4; ×1 inference).
        buffer_bytes: buffers (BatchNorm statistics …).
        activation_bytes_per_sample: the distinct tensors the modules output for one sample (forward hooks).
        activation_factor: ×2 in training (activation and gradient), ×1 in inference.
        input_bytes_per_sample: one sample of the input batch.
    """

    parameter_bytes: int
    multiplier: int
    buffer_bytes: int
    activation_bytes_per_sample: int
    activation_factor: int
    input_bytes_per_sample: int

    @property
    def fixed_bytes(self) -> int:
        return self.parameter_bytes * self.multiplier + self.buffer_bytes

    @property
    def per_sample_bytes(self) -> int:
        return self.activation_bytes_per_sample * self.activation_factor + self.input_bytes_per_sample

    def memory_for_batch(self, batch: int) -> int:
        return self.fixed_bytes + batch * self.per_sample_bytes

    def breakdown(self, batch: int) -> dict[str, int]:
        """The rule's figures in the traced categories (it has no temporaries)."""
        training = self.multiplier > 1
        return {
            PARAMETERS: self.parameter_bytes,
            BUFFERS: self.buffer_bytes,
            GRADIENTS: self.parameter_bytes if training else 0,
            STATE: self.parameter_bytes * max(0, self.multiplier - 2),
            INPUTS: batch * self.input_bytes_per_sample,
            ACTIVATIONS: batch * self.activation_bytes_per_sample * self.activation_factor,
            TEMPORARIES: 0,
        }


@dataclasses.dataclass
class MemoryEstimate:
    """What one training step of a model needs on the device (see `memory`'s docstring).

    The byte figures of the model state (parameters, gradients, optimizer
    state, buffers) are the traced storages; `memory_for_batch` is the traced
    peak, with the allocator and the CUDA context on CUDA. Near the largest
    batch the peak is ``fixed_bytes + B × per_sample_bytes``; `breakdown` is
    what is alive at the peak of `peak_batch`, and `rule` the textbook figures.
    """

    model: str
    input_shape: tuple[int, ...]
    dtype: str
    dtype_bytes: int
    optimizer: str
    training: bool
    parameters: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    activation_bytes_per_sample: int
    activation_factor: int
    input_bytes_per_sample: int
    flops_per_sample_forward: int
    flops_per_sample_step: int
    rule: RuleOfThumb
    autocast: str | None = None
    channels_last: bool = False
    foreach: bool = False
    set_to_none: bool = True
    loss: str = "cross-entropy"
    memory_device: str = "cpu"
    traced_on: str = "cpu"
    traced_batches: tuple[int, ...] = ()
    affine: bool = True
    fixed_bytes: int = 0
    per_sample_bytes: int = 0
    peak_batch: int = REPORT_BATCH
    peak_phase: str = ""
    breakdown: dict[str, int] = dataclasses.field(default_factory=dict)
    phase_peaks: dict[str, int] = dataclasses.field(default_factory=dict)
    kept_activation_bytes_per_sample: int = 0
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    cuda_context_bytes: int = 0
    cuda_context_source: str = ""
    vram_bytes: int | None = None
    safety_margin: float = 0.1
    max_batch_size: int | None = None
    rule_max_batch_size: int | None = None
    throughput: ThroughputModel | None = None
    device_flops: float | None = None
    rows: list[BatchRow] = dataclasses.field(default_factory=list)
    batch_size: int | None = None
    loader_images_per_s: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    memory: Any = dataclasses.field(default=None, repr=False, compare=False)  # the DeviceMemory behind it

    def memory_for_batch(self, batch: int) -> int:
        """The device memory a step of `batch` needs: the traced peak (+ allocator and context on CUDA)."""
        return int(self.memory.need(batch))

    def allocated_for_batch(self, batch: int) -> int:
        """The peak of tensor bytes; on CUDA the allocator's blocks, as ``max_memory_allocated`` reports."""
        return int(self.memory.allocated(batch))

    def reserved_for_batch(self, batch: int) -> int:
        """On CUDA the allocator's segments, as ``max_memory_reserved`` reports; else the allocated bytes."""
        return int(self.memory.reserved(batch))

    def peak_phase_for_batch(self, batch: int) -> str:
        """Where in the step the peak of `batch` is: forward, backward, optimizer step or zero_grad."""
        model = self.memory.at(batch)
        position = model.peak_position(batch)
        return [name for name, begin in model.phases if begin <= position][-1] if model.phases else ""

    @property
    def activation_multiple(self) -> float | None:
        """The peak's growth per sample, less the input, in units of the module outputs (the rule says ×2)."""
        if not self.activation_bytes_per_sample:
            return None
        return (self.per_sample_bytes - self.input_bytes_per_sample) / self.activation_bytes_per_sample

    @property
    def rule_error(self) -> float:
        """(rule of thumb − traced) / traced at `peak_batch`, both as tensor bytes."""
        traced = self.memory.peak(self.peak_batch)
        return self.rule.memory_for_batch(self.peak_batch) / traced - 1.0

    @property
    def feed_batch(self) -> int | None:
        """The batch the loader check is made for: the one asked for, else the largest that fits."""
        return self.batch_size or self.max_batch_size

    @property
    def required_images_per_s(self) -> float | None:
        """What the device consumes at `feed_batch` (needs a throughput model)."""
        if self.throughput is None or not self.feed_batch:
            return None
        return self.throughput.images_per_s(self.feed_batch)

    @property
    def loader_can_feed(self) -> bool | None:
        need = self.required_images_per_s
        if need is None or self.loader_images_per_s is None:
            return None
        return self.loader_images_per_s >= need

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(dataclasses.replace(self, memory=None))
        del data["memory"]
        data["rule"]["fixed_bytes"] = self.rule.fixed_bytes
        data["rule"]["per_sample_bytes"] = self.rule.per_sample_bytes
        data["rule"]["memory_bytes"] = self.rule.memory_for_batch(self.peak_batch)
        data["rule"]["breakdown"] = self.rule.breakdown(self.peak_batch)
        data["rule_error"] = self.rule_error
        data["activation_multiple"] = self.activation_multiple
        data["memory_bytes"] = self.memory_for_batch(self.peak_batch)
        data["feed_batch"] = self.feed_batch
        data["required_images_per_s"] = self.required_images_per_s
        data["loader_can_feed"] = self.loader_can_feed
        if self.throughput is not None:
            data["throughput"]["peak_images_per_s"] = self.throughput.peak_images_per_s
            data["throughput"]["saturation_batch"] = self.throughput.saturation_batch()
        return data


# ---------------------------------------------------------------------------
# The pure arithmetic


def model_state_bytes(parameter_bytes: int, optimizer: str, training: bool) -> tuple[int, int]:
    """(gradient bytes, optimizer state bytes) of the rule of thumb for `parameter_bytes` of parameters."""
    if optimizer not in STATE_MULTIPLIER:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if not training:
        return 0, 0
    return parameter_bytes, (STATE_MULTIPLIER[optimizer] - 2) * parameter_bytes


def largest_batch(vram_bytes: int, safety_margin: float, fixed_bytes: int, per_sample_bytes: int) -> int:
    """The largest batch with fixed + batch × per_sample ≤ vram × (1 − margin); 0 if none fits."""
    usable = vram_bytes * (1.0 - safety_margin) - fixed_bytes
    if usable <= 0 or per_sample_bytes <= 0:
        return 0
    return int(usable // per_sample_bytes)


def batch_rows(estimate: MemoryEstimate, batches: Sequence[int] | None = None) -> list[BatchRow]:
    """Memory and images/s for powers of two up to the largest batch (or `batches`)."""
    if batches is None:
        top = estimate.max_batch_size or 256
        batches = sorted({2**k for k in range(max(1, top).bit_length())} | ({top} if top else set()))
    rows = []
    for batch in batches:
        memory = estimate.memory_for_batch(batch)
        fits = estimate.vram_bytes is None or memory <= estimate.vram_bytes * (1 - estimate.safety_margin)
        rate = estimate.throughput.images_per_s(batch) if estimate.throughput else None
        rows.append(BatchRow(batch, memory, fits, rate, estimate.rule.memory_for_batch(batch)))
    return rows


__all__ = [
    "REPORT_BATCH", "SATURATION", "STATE_MULTIPLIER", "BatchRow", "MemoryEstimate", "RuleOfThumb", "ThroughputModel",
    "batch_rows", "largest_batch", "model_state_bytes",
]
