"""`gpufeed advise`: the differential diagnosis run on the user's data, and the change it recommends.

    diagnosis.py  advise() / apply_advice(): the probes run, the plan made, the advice measured when applied
    plan.py       plan_advice(): ceilings -> bottleneck -> recommendation -> prediction (pure arithmetic)
    probes.py     each ceiling measured: the model, cold reads, CPU decode, host-to-device, the target disk

`pipeline.measure.advise.advise`, `apply_advice` and `plan_advice` are imported from these on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_attributes

if TYPE_CHECKING:
    from .diagnosis import advise, apply_advice, plan_advice

__getattr__ = lazy_attributes(__name__, {"advise": ".diagnosis", "apply_advice": ".diagnosis", "plan_advice": ".diagnosis"})
__all__ = ["advise", "apply_advice", "plan_advice"]
