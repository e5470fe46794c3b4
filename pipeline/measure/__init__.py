"""Measurements behind `gpufeed bench …`, `advise`, `estimate-memory`, `watch` and `doctor` (SPEC §3).

    disk.py           benchmark_disk(path) -> DiskBenchResult: what the storage under a path delivers
    disk_result.py    DiskBenchResult, the kind the random reads show, the read ceilings kept for watch
    disk_runner.py    the test files of one disk benchmark, the timed read loops, their private folder
    decode.py         benchmark_decode(source) -> DecodeBenchResult: per-core decode speed, raw vs prepared
    loader.py         benchmark_loader(dataset) -> LoaderBenchResult: the loader against a simulated consumer
    advise.py         advise() / apply_advice(): the differential diagnosis run on the user's data
    advise_plan.py    plan_advice(): ceilings -> bottleneck -> recommendation -> prediction (pure arithmetic)
    advise_probes.py  each ceiling measured: the model, cold reads, CPU decode, host-to-device, the target disk
    memory.py         estimate_memory(): what a training step needs on the device
    memory_result.py  MemoryEstimate, RuleOfThumb, ThroughputModel and the arithmetic on them
    memory_model.py   the model, loss and shape a user names; activations and FLOPs on fake tensors
    memory_timing.py  step times on synthetic batches, fitted to overhead + batch x per-sample
    memory_trace.py   one training step traced on fake tensors: every allocation and free, by category
    memory_device.py  the traced events on a device: CUDA's caching allocator, the context, the largest batch
    doctor.py         what this machine has: PIL and its codecs, decoders, the native library, Redis
    plots.py          the PNG charts of --plot (matplotlib, the [plots] extra)
    watcher.py        run_watched(command) / watch(): run a training command (or a block) under watch
    watch_report.py   WatchReport and its parts: each loop's, GPU's and interval's figures, the Verdict
    watch_sampler.py  Sampler: the process tree, the recorder's files and the GPUs, every interval
    watch_records.py  the recorder's files read as untrusted input: records checked, bad ones dropped and counted
    watch_verdict.py  judge(report): data-bound or compute-bound, what limits the data, the next step
    watch_hook/       the recorder watch puts in the watched processes (standard library only)

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
