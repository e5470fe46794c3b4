"""`gpufeed estimate-memory`: what a model needs on the device, and how big a batch fits.

The seed arithmetic, per training step with `dtype` of `b` bytes:

- parameters: P elements -> P·b bytes;
- gradients: P·b (training only);
- optimizer state: SGD none, momentum P·b, Adam 2·P·b, so that parameters +
  gradients + state are ×2 (SGD), ×3 (momentum), ×4 (Adam) the parameter memory;
- activations: the distinct tensors that the model's modules output for one
  sample, counted with forward hooks, ×2 in training (the activation and its
  gradient); ×1 under `torch.no_grad()` (inference: no gradients anywhere);
- the input batch itself.

The largest batch is what fits in `vram × (1 − safety_margin)` after the
fixed part (parameters, gradients, optimizer state, buffers). FLOPs per
sample come from `torch.utils.flop_counter` (forward; a training step is ≈3×).
With the device's FLOP/s (given), or step times measured on synthetic
batches, a step of batch B takes ``overhead + B × seconds_per_sample``, so
images/s = B / (overhead + B × seconds_per_sample): it rises with B until the
device is saturated, after which a bigger batch only costs memory.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "adam")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
# Parameters + gradients + optimizer state, in units of the parameter memory.
STATE_MULTIPLIER = {"sgd": 2, "momentum": 3, "adam": 4}
SATURATION = 0.9  # "saturated": within 10 % of the device's peak images/s


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
    batch_size: int
    memory_bytes: int
    fits: bool
    images_per_s: float | None


@dataclasses.dataclass
class MemoryEstimate:
    """The memory and speed arithmetic of one model (see the module docstring).

    All byte figures use `dtype_bytes` per element; `per_sample_bytes` is
    activations × `activation_factor` + the input.
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
    vram_bytes: int | None = None
    safety_margin: float = 0.1
    max_batch_size: int | None = None
    throughput: ThroughputModel | None = None
    device_flops: float | None = None
    rows: list[BatchRow] = dataclasses.field(default_factory=list)
    batch_size: int | None = None
    loader_images_per_s: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def fixed_bytes(self) -> int:
        """Memory that does not grow with the batch: parameters, gradients, optimizer state, buffers."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes + self.buffer_bytes

    @property
    def per_sample_bytes(self) -> int:
        return self.activation_bytes_per_sample * self.activation_factor + self.input_bytes_per_sample

    def memory_for_batch(self, batch: int) -> int:
        return self.fixed_bytes + batch * self.per_sample_bytes

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
        data = dataclasses.asdict(self)
        data["fixed_bytes"] = self.fixed_bytes
        data["per_sample_bytes"] = self.per_sample_bytes
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
    """(gradient bytes, optimizer state bytes) for `parameter_bytes` of parameters."""
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
        rows.append(BatchRow(batch, memory, fits, rate))
    return rows


# ---------------------------------------------------------------------------
# Counting on a real model


def load_model(spec: str) -> Any:
    """Build a model from ``module:factory`` or ``path/to/file.py:factory``.

    The factory is a callable returning an nn.Module, called without
    arguments (an nn.Module instance is taken as it is). The current
    directory is importable, as with ``python -m``.

    Raises:
        ConfigError: the spec is malformed, the import fails, or the result is not a module.
    """
    import torch

    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ConfigError(f"--model must look like module:factory (e.g. torchvision.models:resnet50), got {spec!r}")
    target: Any = _import_model_module(module_name)
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    model = _call_factory(spec, target) if callable(target) and not isinstance(target, torch.nn.Module) else target
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _call_factory(spec: str, factory: Callable[[], Any]) -> Any:
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise ConfigError(
            f"--model {spec} needs arguments{_signature(factory)}; it is called without any: give a function "
            f"that takes none, e.g. def make(): return {spec.rpartition(':')[2]}(...) in a file, as file.py:make"
        ) from None
    except ValueError:  # no signature to read (some builtins): just call it
        pass
    try:
        return factory()
    except Exception as exc:
        raise ConfigError(f"--model {spec} failed when called: {type(exc).__name__}: {_first_line(exc)}") from exc


def _signature(factory: Callable[..., Any]) -> str:
    try:
        return f" {inspect.signature(factory)}"
    except (TypeError, ValueError):
        return ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def check_model_input(model: Any, input_shape: Sequence[int], name: str = "the model") -> None:
    """Run `model` once on a zero batch of one `input_shape` sample, so a wrong --input is one clear error.

    Raises:
        ConfigError: the model cannot take that input (e.g. channels last where it expects them first).
    """
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros((1, *input_shape)))
    except Exception as exc:
        shape = ",".join(map(str, input_shape))
        hint = ""
        if len(input_shape) == 3 and input_shape[-1] in (1, 3, 4) and input_shape[0] not in (1, 3, 4):
            hint = f"; --input is channels first: did you mean {','.join(map(str, (input_shape[-1], *input_shape[:-1])))}?"
        raise ConfigError(
            f"{name} cannot take --input {shape} (one sample's shape): {type(exc).__name__}: {_first_line(exc)}{hint}"
        ) from exc
    finally:
        model.train(was_training)


def _import_model_module(name: str) -> Any:
    try:
        if name.endswith(".py"):
            if not os.path.isfile(name):
                raise ConfigError(f"--model file not found: {name}")
            module_spec = importlib.util.spec_from_file_location(f"gpufeed_model_{abs(hash(name))}", name)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        return importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {name!r} for --model: {exc}") from exc


def parse_shape(text: str | Sequence[int]) -> tuple[int, ...]:
    """`3,224,224` -> (3, 224, 224).

    Raises:
        ConfigError: not a list of positive integers.
    """
    try:
        shape = tuple(int(part) for part in (text.split(",") if isinstance(text, str) else text))
    except ValueError:
        raise ConfigError(f"--input must be sizes like 3,224,224, got {text!r}") from None
    if not shape or any(size < 1 for size in shape):
        raise ConfigError(f"--input must be positive sizes like 3,224,224, got {text!r}")
    return shape


def count_activations(model: Any, input_shape: Sequence[int], training: bool, dtype_bytes: int, batch: int = 2) -> int:
    """Bytes per sample of the distinct tensors the model's modules output (forward hooks).

    Every module's output is recorded; tensors sharing storage (views such as
    flatten, in-place ops) count once. Outputs are kept alive during the pass
    so that freed memory cannot be reused under a recorded address.
    Floating-point tensors are counted at `dtype_bytes` per element.
    """
    import torch

    kept: list[Any] = []

    def record(module: Any, inputs: Any, output: Any) -> None:
        kept.extend(_tensors(output))

    handles = [module.register_forward_hook(record) for module in model.modules()]
    was_training = model.training
    try:
        model.train(training)
        with torch.no_grad():
            model(torch.zeros((batch, *input_shape)))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    seen: dict[int, int] = {}
    for tensor in kept:
        storage = tensor.untyped_storage()
        elements = storage.nbytes() // tensor.element_size()
        size = elements * (dtype_bytes if tensor.is_floating_point() else tensor.element_size())
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), size)
    return round(sum(seen.values()) / batch)


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def count_flops(model: Any, input_shape: Sequence[int]) -> int:
    """Forward FLOPs for one sample (multiply-add = 2 FLOPs), from torch's FlopCounterMode."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.zeros((1, *input_shape)))
    finally:
        model.train(was_training)
    return int(counter.get_total_flops())


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
        ConfigError: an unknown device or optimizer.
    """
    import copy

    import torch

    target = _device(device)
    model = copy.deepcopy(model).to(target)  # the caller's model stays where it is
    model.train(training)
    step_optimizer = _optimizer(model, optimizer) if training else None
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


def _optimizer(model: Any, name: str) -> Any:
    import torch

    params = model.parameters()
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if name == "momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def _step(model: Any, x: Any, optimizer: Any, device: Any) -> None:
    import torch

    if optimizer is None:
        with torch.no_grad():
            model(x)
    else:
        output = _tensors(model(x))[0]
        output.float().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def estimate_memory(
    model: Any,
    input_shape: str | Sequence[int],
    *,
    optimizer: str = "adam",
    dtype: str = "float32",
    training: bool = True,
    vram: int | str | None = None,
    safety_margin: float = 0.1,
    batch_size: int | None = None,
    device_flops: float | None = None,
    measure: bool = False,
    device: str = "auto",
    measure_seconds: float = 2.0,
    loader_images_per_s: float | None = None,
) -> MemoryEstimate:
    """Parameters, gradients, optimizer state, activations, the largest batch, FLOPs and images/s.

    Args:
        model: an nn.Module, or ``"module:factory"``.
        input_shape: one sample's shape, e.g. (3, 224, 224) or "3,224,224".
        optimizer: "sgd" (×2 of parameter memory in total), "momentum" (×3) or "adam" (×4).
        dtype: float32, float16, bfloat16 or float64: bytes per element of everything counted.
        training: False counts inference under torch.no_grad (no gradients, activations ×1).
        vram: device memory in bytes or as text ("16GiB"); None skips the batch limit.
        safety_margin: share of `vram` kept free (CUDA context, allocator fragmentation).
        batch_size: the batch to check the loader against (default: the largest that fits).
        device_flops: the device's sustained FLOP/s; images/s follow from FLOPs per step.
        measure: time steps on synthetic batches on `device` (overrides device_flops' per-sample cost).
        device: where to measure ("auto", "cpu", "cuda").
        measure_seconds: time budget of the measurement.
        loader_images_per_s: the loader's rate, to say whether it can feed the device.

    Returns:
        A MemoryEstimate.

    Raises:
        ConfigError: a bad setting or model spec.
    """
    from ..units import parse_bytes

    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if not 0 <= safety_margin < 1:
        raise ConfigError("safety_margin must be between 0 and 1")
    shape = parse_shape(input_shape)
    name = model if isinstance(model, str) else type(model).__name__
    module = load_model(model) if isinstance(model, str) else model
    check_model_input(module, shape, name)
    size = DTYPE_BYTES[dtype]
    parameters = sum(p.numel() for p in module.parameters())
    parameter_bytes = parameters * size
    gradient_bytes, state_bytes = model_state_bytes(parameter_bytes, optimizer, training)
    forward_flops = count_flops(module, shape)
    estimate = MemoryEstimate(
        model=name,
        input_shape=shape,
        dtype=dtype,
        dtype_bytes=size,
        optimizer=optimizer,
        training=training,
        parameters=parameters,
        parameter_bytes=parameter_bytes,
        gradient_bytes=gradient_bytes,
        optimizer_state_bytes=state_bytes,
        buffer_bytes=sum(b.numel() * (size if b.is_floating_point() else b.element_size()) for b in module.buffers()),
        activation_bytes_per_sample=count_activations(module, shape, training, size),
        activation_factor=2 if training else 1,
        input_bytes_per_sample=math.prod(shape) * size,
        flops_per_sample_forward=forward_flops,
        flops_per_sample_step=3 * forward_flops if training else forward_flops,
        safety_margin=safety_margin,
        batch_size=batch_size,
        device_flops=device_flops,
        loader_images_per_s=loader_images_per_s,
    )
    if vram is not None:
        estimate.vram_bytes = parse_bytes(vram)
        estimate.max_batch_size = largest_batch(
            estimate.vram_bytes, safety_margin, estimate.fixed_bytes, estimate.per_sample_bytes
        )
        if estimate.max_batch_size == 0:
            estimate.notes.append("the model state alone does not fit in this VRAM with the safety margin")
    estimate.throughput = _throughput(estimate, module, measure, device, measure_seconds)
    if estimate.throughput is not None and estimate.device_flops is None:
        estimate.device_flops = estimate.flops_per_sample_step / estimate.throughput.seconds_per_sample
    estimate.rows = batch_rows(estimate)
    return estimate


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
