"""Measurements behind `gpufeed bench …`, `advise`, `estimate-memory` and `doctor` (SPEC §3).

    disk.py     benchmark_disk(path) -> DiskBenchResult: what the storage under a path delivers
    decode.py   benchmark_decode(source) -> DecodeBenchResult: per-core decode speed, raw vs prepared
    loader.py   benchmark_loader(dataset) -> LoaderBenchResult: the loader against a simulated consumer
    advise.py   the differential diagnosis: every stage's ceiling, the bottleneck, the prepare to run
    memory.py   estimate_memory(): what a training step needs on the device
    doctor.py   what this machine has: PIL and its codecs, decoders, the native library, Redis
    plots.py    the PNG charts of --plot (matplotlib, the [plots] extra)
    watcher.py  run_watched(command) / watch(): is a training run waiting for data, and on what
    watch_hook/ the recorder watch puts in the watched processes (standard library only)

Each function measures and returns a dataclass with `to_dict()`; nothing here prints.
`pipeline.measure.watch()` is the library form of `gpufeed watch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .watcher import Watch, WatchReport, watch


def __getattr__(name: str) -> Any:
    if name in ("Watch", "WatchReport", "watch"):
        from . import watcher

        return getattr(watcher, name)
    raise AttributeError(f"module 'pipeline.measure' has no attribute {name!r}")


__all__ = ["Watch", "WatchReport", "watch"]
