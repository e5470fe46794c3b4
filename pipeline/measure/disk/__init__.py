"""`gpufeed bench disk`: what the storage under a path delivers, read as training reads it.

    bench.py    benchmark_disk(path) -> DiskBenchResult: the repeats, their medians and spread, the warnings
    result.py   DiskBenchResult, the kind the random reads show, the read ceilings kept for watch
    runner.py   the test files of one disk benchmark, the timed read loops, their private folder

`pipeline.measure.disk.benchmark_disk` and `DiskBenchResult` are imported from these on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_attributes

if TYPE_CHECKING:
    from .bench import DiskBenchResult, benchmark_disk

__getattr__ = lazy_attributes(__name__, {"benchmark_disk": ".bench", "DiskBenchResult": ".bench"})
__all__ = ["DiskBenchResult", "benchmark_disk"]
