"""Measurements behind `gpufeed bench …` and `gpufeed advise` (SPEC §3).

    disk.py     benchmark_disk(path) -> DiskBenchResult: what the storage under a path delivers
    decode.py   benchmark_decode(source) -> DecodeBenchResult: per-core decode speed, raw vs prepared
    loader.py   benchmark_loader(dataset) -> LoaderBenchResult: the loader against a simulated consumer

Each function measures and returns a dataclass with `to_dict()`; nothing here
prints. torch is imported only by `loader.py`.
"""

from __future__ import annotations
