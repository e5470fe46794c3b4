"""Measurements behind `gpufeed bench …`, `advise`, `estimate-memory`, `watch` and `doctor` (SPEC §3).

    decode.py         benchmark_decode(source) -> DecodeBenchResult: per-core decode speed, raw vs prepared
    loader.py         benchmark_loader(dataset) -> LoaderBenchResult: the loader against a simulated consumer
    doctor.py         what this machine has: PIL and its codecs, decoders, the native library, Redis
    plots.py          the PNG charts of --plot (matplotlib, the [plots] extra)
    disk/             benchmark_disk(path) -> DiskBenchResult: what the storage under a path delivers
    advise/           advise() / apply_advice(): the differential diagnosis run on the user's data
    memory/           estimate_memory(): what a training step needs on the device
    watching/         run_watched(command) / watch(): a training command (or a block) under watch

Each function measures and returns a dataclass with `to_dict()`; nothing here prints.
`pipeline.measure.watch()` is the library form of `gpufeed watch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

if TYPE_CHECKING:
    from .watching.run import Watch, WatchReport, watch

__getattr__ = lazy_attributes(__name__, {"Watch": ".watching.run", "WatchReport": ".watching.run", "watch": ".watching.run"})
__all__ = ["Watch", "WatchReport", "watch"]
