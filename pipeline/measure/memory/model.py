"""The model a user names, and what its forward pass holds: `estimate-memory`'s and `advise`'s inputs.

`load_model` and `load_loss` import ``module:factory`` or ``file.py:factory``; `parse_shape` reads
one sample's shape and `check_model_input` runs the model once on it, so a wrong shape is one clear
error. On fake tensors (no memory, no compute) `count_activations` counts the bytes the modules
output per sample (the rule of thumb's activations) and `count_flops` the forward FLOPs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ...errors import ConfigError
from .trace import StepSpec, fake_input, fake_model


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
        for tensor in _tensors_in(output):
            storage = tensor.untyped_storage()
            kept.setdefault(id(storage), (storage, tensor))

    spec = spec or StepSpec(training=training)
    handles = [module.register_forward_hook(record) for module in model.modules()]
    try:
        with fake_model(model, dataclasses.replace(spec, training=training)), torch.no_grad(), _warnings_silenced():
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
def _warnings_silenced() -> Iterator[None]:
    """These passes run under no_grad, where some models warn (reentrant checkpointing): not the user's step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _autocast(spec: StepSpec) -> Any:
    import torch

    if not spec.autocast:
        return contextlib.nullcontext()
    return torch.autocast(spec.device, dtype=getattr(torch, spec.autocast))


def _tensors_in(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors_in(item)]
    return []


def count_flops(model: Any, input_shape: Sequence[int], spec: StepSpec | None = None) -> int:
    """Forward FLOPs for one sample (multiply-add = 2 FLOPs), from torch's FlopCounterMode on fake tensors."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    spec = dataclasses.replace(spec or StepSpec(), training=False)
    with fake_model(model, spec), torch.no_grad(), _warnings_silenced(), FlopCounterMode(display=False) as counter:
        model(fake_input(input_shape, 1, spec))
    return int(counter.get_total_flops())


__all__ = ["check_model_input", "count_activations", "count_flops", "load_loss", "load_model", "parse_shape"]
