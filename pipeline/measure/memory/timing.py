"""Step times on the real device: `measure_step_times` times synthetic batches and fits the `ThroughputModel`.

A step of batch B takes ``overhead + B × seconds_per_sample``; `fit_step_times` is the least-squares
fit of those two from the measured (batch, seconds) points.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ...errors import ConfigError
from .result import ThroughputModel
from .trace import first_tensor, make_optimizer


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
    target = _resolved_device(device)
    model = copy.deepcopy(model).to(target)  # the caller's model stays where it is
    model.train(training)
    step_optimizer = make_optimizer(list(model.parameters()), optimizer) if training else None
    points = []
    per_batch = min_seconds / max(1, len(batches))
    for batch in batches:
        x = torch.randn((batch, *input_shape), device=target)
        _run_step(model, x, step_optimizer, target)  # warm-up: allocations, kernel selection, optimizer state
        steps, started = 0, time.perf_counter()
        while True:
            _run_step(model, x, step_optimizer, target)
            steps += 1
            elapsed = time.perf_counter() - started
            if steps >= 2 and elapsed >= per_batch:
                break
        points.append((batch, elapsed / steps))
    overhead, per_sample = fit_step_times(points)
    return ThroughputModel(overhead, per_sample, "measured", str(target), tuple(points))


def _resolved_device(device: str) -> Any:
    from ...loader.loader import resolve_device

    return resolve_device(device)


def _run_step(model: Any, x: Any, optimizer: Any, device: Any) -> None:
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


__all__ = ["fit_step_times", "measure_step_times"]
