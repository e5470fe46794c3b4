"""`gpufeed estimate-memory`: what a training step needs on the device, traced on fake tensors.

    estimate.py  estimate_memory(): the model traced, the device's view of it, the largest batch, the timing
    result.py    MemoryEstimate, RuleOfThumb, ThroughputModel and the arithmetic on them
    model.py     the model, loss and shape a user names; activations and FLOPs on fake tensors
    timing.py    step times on synthetic batches, fitted to overhead + batch x per-sample
    trace.py     one training step traced on fake tensors: every allocation and free, by category
    device.py    the traced events on a device: CUDA's caching allocator, the context, the largest batch

`pipeline.measure.memory.estimate_memory` and `MemoryEstimate` are imported from these on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_attributes

if TYPE_CHECKING:
    from .estimate import MemoryEstimate, estimate_memory

__getattr__ = lazy_attributes(__name__, {"estimate_memory": ".estimate", "MemoryEstimate": ".estimate"})
__all__ = ["MemoryEstimate", "estimate_memory"]
