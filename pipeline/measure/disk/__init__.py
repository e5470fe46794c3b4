"""`gpufeed bench disk`: what the storage under a path delivers, read as training reads it.

    bench.py    benchmark_disk(path) -> DiskBenchResult: the repeats, their medians and spread, the warnings
    result.py   DiskBenchResult, the kind the random reads show, the read ceilings kept for watch
    runner.py   the test files of one disk benchmark, the timed read loops, their private folder

`pipeline.measure.disk.benchmark_disk` and `DiskBenchResult` are imported from these on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .bench import DiskBenchResult, benchmark_disk

_NAMES = ("benchmark_disk", "DiskBenchResult")


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        from . import bench

        return getattr(bench, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DiskBenchResult", "benchmark_disk"]
