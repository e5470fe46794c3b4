"""`gpufeed estimate-memory`: what a training step needs on the device, and how big a batch fits.

The number comes from tracing one real training step on fake tensors
(`pipeline.measure.memory_trace`): forward, loss, backward, the optimizer
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import ConfigError
from ..units import format_bytes
from .memory_device import MAX_BATCH, DeviceMemory, choose_memory_device, context_bytes, parse_vram, trace_device
from .memory_trace import (
    ACTIVATIONS,
    BUFFERS,
    GRADIENTS,
    INPUTS,
    OPTIMIZERS,
    PARAMETERS,
    STATE,
    TEMPORARIES,
    TRACE_BATCHES,
    StepSpec,
    fake_input,
    fake_model,
    first_tensor,
    make_optimizer,
    trace_step,
)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
AUTOCAST = {"float16": "float16", "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
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
    """The textbook arithmetic (see the module docstring), kept as the explanation of the traced figures.

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
    """What one training step of a model needs on the device (see the module docstring).

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


def fit_step_times(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (overhead_s, seconds_per_sample) of step time = overhead + batch × per_sample."""
    if not points:
        raise ConfigError("no step times to fit")
    if len({b for b, _ in points}) == 1:
        batch = points[0][0]
        return 0.0, sum(t for _, t in points) / len(points) / batch
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b, _ in points)
    if slope <= 0:  # noise swamped the marginal cost: treat the whole step as per-sample work
        largest = max(points)
        return 0.0, largest[1] / largest[0]
    overhead = max(0.0, mean_t - slope * mean_b)
    return overhead, slope


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


# ---------------------------------------------------------------------------
# Models, losses and shapes


def load_model(spec: str, *, meta: bool = False) -> Any:
    """Build a model from ``module:factory`` or ``path/to/file.py:factory``.

    The factory is a callable returning an nn.Module, called without
    arguments (an nn.Module instance is taken as it is). The current
    directory is importable, as with ``python -m``.

    Args:
        spec: where the factory is.
        meta: build the model on the meta device: no memory for its weights, so a model of any size
            can be traced (its steps cannot be timed).

    Raises:
        ConfigError: the spec is malformed, the import fails, or the result is not a module.
    """
    import torch

    target = _load_object(spec, "model", "module:factory", "torchvision.models:resnet50")
    if callable(target) and not isinstance(target, torch.nn.Module):
        with torch.device("meta") if meta else contextlib.nullcontext():
            target = _call_factory(spec, target)
    if not isinstance(target, torch.nn.Module):
        raise ConfigError(f"{spec} returned {type(target).__name__}, not a torch.nn.Module")
    return target


def load_loss(spec: str | Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A loss from ``module:fn`` (or a callable), called as ``fn(output, inputs)`` and returning a scalar.

    Raises:
        ConfigError: the spec cannot be imported or is not callable.
    """
    loss = _load_object(spec, "loss", "module:fn", "my_losses:mse") if isinstance(spec, str) else spec
    if not callable(loss):
        raise ConfigError(f"loss={spec} is {type(loss).__name__}, not a function of (output, inputs)")
    return loss


def _load_object(spec: str, setting: str, form: str, example: str) -> Any:
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{setting}={spec} must look like {form} (e.g. {example})")
    target: Any = _import_module(module_name, f"{setting}={spec}")
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    return target


def _call_factory(spec: str, factory: Callable[[], Any]) -> Any:
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise ConfigError(
            f"model={spec} needs arguments{_signature(factory)}; it is called without any: give a function "
            f"that takes none, e.g. def make(): return {spec.rpartition(':')[2]}(...) in a file, as file.py:make"
        ) from None
    except ValueError:  # no signature to read (some builtins): just call it
        pass
    try:
        return factory()
    except Exception as exc:
        raise ConfigError(f"model={spec} failed when called: {type(exc).__name__}: {_first_line(exc)}") from exc


def _signature(factory: Callable[..., Any]) -> str:
    try:
        return f" {inspect.signature(factory)}"
    except (TypeError, ValueError):
        return ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def check_model_input(model: Any, input_shape: Sequence[int], name: str = "the model") -> None:
    """Run `model` once on a zero batch of one `input_shape` sample, so a wrong input shape is one clear error.

    Raises:
        ConfigError: the model cannot take that input (e.g. channels last where it expects them first).
    """
    import torch

    was_training = model.training
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros((1, *input_shape), device=device))
    except Exception as exc:
        shape = ",".join(map(str, input_shape))
        hint = ""
        if len(input_shape) == 3 and input_shape[-1] in (1, 3, 4) and input_shape[0] not in (1, 3, 4):
            hint = f"; input_shape is channels first: did you mean {','.join(map(str, (input_shape[-1], *input_shape[:-1])))}?"
        raise ConfigError(
            f"{name} cannot take input_shape={shape} (one sample's shape): {type(exc).__name__}: {_first_line(exc)}{hint}"
        ) from exc
    finally:
        model.train(was_training)


def _import_module(name: str, option: str) -> Any:
    try:
        if name.endswith(".py"):
            if not os.path.isfile(name):
                raise ConfigError(f"{option}: file not found: {name}")
            module_spec = importlib.util.spec_from_file_location(f"gpufeed_model_{abs(hash(name))}", name)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        return importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {name!r} for {option}: {exc}") from exc


def parse_shape(text: str | Sequence[int]) -> tuple[int, ...]:
    """`3,224,224` -> (3, 224, 224).

    Raises:
        ConfigError: not a list of positive integers.
    """
    try:
        shape = tuple(int(part) for part in (text.split(",") if isinstance(text, str) else text))
    except ValueError:
        raise ConfigError(f"input_shape must be sizes like 3,224,224, got {text!r}") from None
    if not shape or any(size < 1 for size in shape):
        raise ConfigError(f"input_shape must be positive sizes like 3,224,224, got {text!r}")
    return shape


# ---------------------------------------------------------------------------
# Counting on the fake model


def count_activations(
    model: Any, input_shape: Sequence[int], training: bool, dtype_bytes: int | None = None, batch: int = 2,
    spec: StepSpec | None = None,
) -> int:
    """Bytes per sample of the distinct tensors the model's modules output (forward hooks): the rule's activations.

    Every module's output is recorded during a forward pass on fake tensors;
    tensors sharing storage (views such as flatten, in-place ops) count once,
    and views of the input not at all (the rule counts the input on its own).
    Floating-point tensors are counted at `dtype_bytes` per element (None: as
    they are, e.g. bfloat16 under autocast).
    """
    import torch

    kept: dict[int, Any] = {}  # id(storage) -> (storage, tensor); kept alive so that no id is reused

    def record(module: Any, inputs: Any, output: Any) -> None:
        for tensor in _tensors(output):
            storage = tensor.untyped_storage()
            kept.setdefault(id(storage), (storage, tensor))

    spec = spec or StepSpec(training=training)
    handles = [module.register_forward_hook(record) for module in model.modules()]
    try:
        with fake_model(model, dataclasses.replace(spec, training=training)), torch.no_grad(), _quiet():
            x = fake_input(input_shape, batch, spec)
            with _autocast(spec):
                model(x)
            kept.pop(id(x.untyped_storage()), None)  # a view of the input (flatten) is the input, counted as such
            total = 0
            for storage, tensor in kept.values():
                size = storage.nbytes()
                if dtype_bytes is not None and tensor.is_floating_point():
                    size = size // tensor.element_size() * dtype_bytes
                total += size
    finally:
        for handle in handles:
            handle.remove()
    return round(total / batch)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """These passes run under no_grad, where some models warn (reentrant checkpointing): not the user's step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _autocast(spec: StepSpec) -> Any:
    import torch

    if not spec.autocast:
        return contextlib.nullcontext()
    return torch.autocast(spec.device, dtype=getattr(torch, spec.autocast))


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def count_flops(model: Any, input_shape: Sequence[int], spec: StepSpec | None = None) -> int:
    """Forward FLOPs for one sample (multiply-add = 2 FLOPs), from torch's FlopCounterMode on fake tensors."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    spec = dataclasses.replace(spec or StepSpec(), training=False)
    with fake_model(model, spec), torch.no_grad(), _quiet(), FlopCounterMode(display=False) as counter:
        model(fake_input(input_shape, 1, spec))
    return int(counter.get_total_flops())


# ---------------------------------------------------------------------------
# The traced step on a device


def _tracer(module: Any, shape: tuple[int, ...], spec: StepSpec, name: str) -> Callable[[int], Any]:
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


# ---------------------------------------------------------------------------
# Step times on the real device


def measure_step_times(
    model: Any,
    input_shape: Sequence[int],
    batches: Sequence[int],
    *,
    optimizer: str = "adam",
    training: bool = True,
    device: str = "auto",
    min_seconds: float = 1.0,
) -> ThroughputModel:
    """Time steps on synthetic batches (forward, backward and optimizer step in training) and fit the model.

    Raises:
        ConfigError: an unknown device or optimizer, or a model on the meta device (no weights to run).
    """
    import copy

    import torch

    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("a model on the meta device has no weights to time: give device_flops instead")
    target = _device(device)
    model = copy.deepcopy(model).to(target)  # the caller's model stays where it is
    model.train(training)
    step_optimizer = make_optimizer(list(model.parameters()), optimizer) if training else None
    points = []
    per_batch = min_seconds / max(1, len(batches))
    for batch in batches:
        x = torch.randn((batch, *input_shape), device=target)
        _step(model, x, step_optimizer, target)  # warm-up: allocations, kernel selection, optimizer state
        steps, started = 0, time.perf_counter()
        while True:
            _step(model, x, step_optimizer, target)
            steps += 1
            elapsed = time.perf_counter() - started
            if steps >= 2 and elapsed >= per_batch:
                break
        points.append((batch, elapsed / steps))
    overhead, per_sample = fit_step_times(points)
    return ThroughputModel(overhead, per_sample, "measured", str(target), tuple(points))


def _device(device: str) -> Any:
    from ..loader.loader import resolve_device

    return resolve_device(device)


def _step(model: Any, x: Any, optimizer: Any, device: Any) -> None:
    import torch

    if optimizer is None:
        with torch.no_grad():
            model(x)
    else:
        first_tensor(model(x)).float().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------
# The estimate


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
        memory = DeviceMemory(_tracer(module, shape, spec, name), target, context)
    except ConfigError as exc:
        if spec.device == "cpu":
            raise
        fallback = f"tracing with CUDA's kernels failed: {exc}"
        spec = dataclasses.replace(spec, device="cpu")
        memory = DeviceMemory(_tracer(module, shape, spec, name), target, context)
    estimate = _describe(module, name, shape, spec, memory, optimizer, loss)
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
    _add_notes(estimate, memory, spec, fallback or "no CUDA device here")
    estimate.throughput = _throughput(estimate, module, measure, device, measure_seconds)
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


def _describe(
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


def _add_notes(estimate: MemoryEstimate, memory: DeviceMemory, spec: StepSpec, why_cpu: str) -> None:
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


def _throughput(
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
