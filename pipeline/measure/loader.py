"""`gpufeed bench loader DATASET`: the loader's images/s and stall fraction for a range of num_workers.

The training loop is simulated: a consumer that needs `batch / consumer_images_per_s`
seconds per batch (sleeping, so it takes no CPU from the loader, like a GPU
would), or no time at all when no rate is given (the loader's own ceiling).
The first batch (worker start, first shard read) is not counted; epochs
follow one another until at least `min_seconds` have been measured.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..units import format_count

MAX_OTHERS_SHARE = 0.75


@dataclasses.dataclass
class LoaderPoint:
    """One loader measurement.

    Attributes:
        num_workers: decode workers.
        images_per_s: images delivered per wall-clock second (after the first batch).
        stall_fraction: share of the loop's time spent waiting for data.
        batches, images, seconds: what was measured.
        best_images_per_s: the best rate over any `window_s` stretch of the run. On a
            shared machine other processes only ever slow a run down, so this is
            the steadier figure to compare two runs by.
        window_s: the length of those stretches.
        others_cpu_share: share of the machine's CPU that other processes used meanwhile.
    """

    num_workers: int
    images_per_s: float
    stall_fraction: float
    batches: int
    images: int
    seconds: float
    best_images_per_s: float = 0.0
    window_s: float = 0.0
    others_cpu_share: float | None = None

    @property
    def idle_images_per_s(self) -> float:
        """images/s scaled to a machine nobody else uses: images_per_s / (1 − others' CPU share).

        A first-order correction that assumes the loader would use the CPU the
        others took; it is capped at 4x (others above 75 %: too busy to say).
        """
        share = min(self.others_cpu_share or 0.0, MAX_OTHERS_SHARE)
        return self.images_per_s / (1.0 - share)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["idle_images_per_s"] = self.idle_images_per_s
        return data


@dataclasses.dataclass
class LoaderBenchResult:
    """The loader over a range of num_workers against one consumer."""

    dataset: str
    batch_size: int
    consumer_images_per_s: float | None
    device: str
    worker_type: str
    points: list[LoaderPoint]

    @property
    def best(self) -> LoaderPoint:
        """The fewest workers within 5 % of the highest images/s."""
        top = max(point.images_per_s for point in self.points)
        return min((p for p in self.points if p.images_per_s >= 0.95 * top), key=lambda p: p.num_workers)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["points"] = [point.to_dict() for point in self.points]
        data["best_num_workers"] = self.best.num_workers
        return data


def default_worker_counts(cores: int | None = None) -> list[int]:
    """1, 2, 4, … up to twice the available cores (and the core count itself)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    counts = {cores, 2 * cores}
    count = 1
    while count < 2 * cores:
        counts.add(count)
        count *= 2
    return sorted(counts)


def measure_loader(
    dataset: str,
    *,
    batch_size: int = 64,
    num_workers: int | str = "auto",
    consumer_images_per_s: float | None = None,
    min_seconds: float = 2.0,
    min_batches: int = 4,
    device: str = "auto",
    window_s: float | None = None,
    **options: Any,
) -> LoaderPoint:
    """Run the loader over `dataset` against a simulated consumer and time it.

    Args:
        dataset: what `make_loader` takes (manifest, folder or brace pattern).
        batch_size: samples per batch.
        num_workers: decode workers (or "auto").
        consumer_images_per_s: the simulated training loop's rate; None: infinitely fast.
        min_seconds: measure at least this long (after the first batch).
        min_batches: and at least this many batches.
        device: the loader's device ("auto", "cpu", "cuda").
        window_s: stretch length for `best_images_per_s` (default: a quarter of min_seconds).
        **options: any other make_loader option.

    Returns:
        A LoaderPoint.

    Raises:
        ConfigError: bad settings (from make_loader, or a non-positive rate).
        ManifestError: the dataset cannot be read.
    """
    if consumer_images_per_s is not None and consumer_images_per_s <= 0:
        raise ConfigError("the consumer's images/s must be positive")
    from ..loader.loader import make_loader

    check_batches(dataset, batch_size)
    loader = make_loader(dataset, batch_size, device=device, num_workers=num_workers, **options)
    try:
        return _timed_run(loader, consumer_images_per_s, min_seconds, min_batches, window_s or min_seconds / 4)
    finally:
        loader.close()


def dataset_samples(dataset: str) -> int:
    """The samples of a prepared dataset (its manifest's count; a brace pattern's shards are counted).

    Raises:
        ManifestError, ConfigError: as `make_loader` for a source that is not a dataset.
    """
    from ..loader.dataset import resolve_dataset

    return resolve_dataset(dataset).samples


def check_batches(dataset: str, batch_size: int, batches: int = 1, samples: int | None = None) -> None:
    """ConfigError, before anything is measured, when `dataset` holds fewer than `batches` full batches.

    A measurement times whole batches, so a dataset smaller than one batch has
    nothing to time; the message names `batch_size` and the largest that works.

    Args:
        dataset: what `make_loader` takes.
        batch_size: samples per batch of the measurement.
        batches: full batches the measurement needs.
        samples: the dataset's samples, when already known (else read from it).
    """
    count = dataset_samples(dataset) if samples is None else samples
    if count >= batches * batch_size:
        return
    need = "one batch" if batches == 1 else f"{batches} batches"
    fix = f"give batch_size={count // batches} or less" if count >= batches else "give a dataset with more samples"
    raise ConfigError(
        f"{dataset} holds {format_count(count, 'sample')}, fewer than {need} of batch_size={batch_size}, "
        f"which the loader measurement needs: {fix}"
    )


def _timed_run(
    loader: Any, consumer_images_per_s: float | None, min_seconds: float, min_batches: int, window_s: float
) -> LoaderPoint:
    import torch

    cuda = loader.device.type == "cuda"
    images = batches = 0
    timeline: list[tuple[float, int]] = []
    meter: CpuMeter | None = None
    started = waited_before = stepped_before = 0.0
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        for batch, _labels in loader:
            if cuda:
                torch.cuda.current_stream(loader.device).synchronize()
            if meter is None:  # the first batch pays for starting up: not counted
                meter, started = CpuMeter(), time.perf_counter()
                waited_before, stepped_before = loader.stats.wait_s, loader.stats.step_s
            else:
                images += int(batch.shape[0])
                batches += 1
            if consumer_images_per_s:
                time.sleep(int(batch.shape[0]) / consumer_images_per_s)
            elapsed = time.perf_counter() - started
            timeline.append((elapsed, images))
            if elapsed >= min_seconds and batches >= min_batches:
                waited = loader.stats.wait_s - waited_before
                stepped = loader.stats.step_s - stepped_before
                return LoaderPoint(
                    num_workers=loader.num_workers,
                    images_per_s=images / elapsed,
                    stall_fraction=waited / (waited + stepped) if waited + stepped > 0 else 0.0,
                    batches=batches,
                    images=images,
                    seconds=elapsed,
                    best_images_per_s=best_window_rate(timeline, window_s),
                    window_s=window_s,
                    others_cpu_share=meter.others_share(),
                )
        epoch += 1


class CpuMeter:
    """How much of the machine's CPU *other* processes used since it was made (from /proc/stat).

    On a shared machine this says how far a timing can be trusted.
    """

    def __init__(self) -> None:
        self._machine = _machine_jiffies()
        self._ours = time.process_time()

    def others_share(self) -> float | None:
        """Other processes' share of all CPUs (0-1), or None where /proc/stat is missing."""
        now = _machine_jiffies()
        if now is None or self._machine is None:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        total = (now[0] - self._machine[0]) / ticks
        busy = total - (now[1] - self._machine[1]) / ticks
        ours = time.process_time() - self._ours
        return min(1.0, max(0.0, (busy - ours) / total)) if total > 0 else None


def _machine_jiffies() -> tuple[int, int] | None:
    """(all jiffies, idle + iowait jiffies) over every CPU."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            values = [int(v) for v in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(values[:8]), values[3] + values[4]


def best_window_rate(timeline: Sequence[tuple[float, int]], window_s: float) -> float:
    """The highest images/s over any stretch of at least `window_s` seconds.

    Args:
        timeline: (seconds, images so far) after each batch, in order.
        window_s: the shortest stretch considered.
    """
    best = 0.0
    end = 0
    for start, (t0, n0) in enumerate(timeline):
        end = max(end, start + 1)
        while end < len(timeline) and timeline[end][0] - t0 < window_s:
            end += 1
        if end >= len(timeline):
            break
        t1, n1 = timeline[end]
        best = max(best, (n1 - n0) / (t1 - t0))
    if best == 0.0 and len(timeline) >= 2:  # the run is shorter than one window
        (t0, n0), (t1, n1) = timeline[0], timeline[-1]
        best = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
    return best


def benchmark_loader(
    dataset: str,
    *,
    workers: Sequence[int] | None = None,
    batch_size: int = 64,
    consumer_images_per_s: float | None = None,
    min_seconds: float = 2.0,
    device: str = "auto",
    worker_type: str = "thread",
    **options: Any,
) -> LoaderBenchResult:
    """Measure the loader for each num_workers in `workers` (default: 1, 2, 4 … 2 × cores).

    Raises:
        ConfigError, ManifestError: as `measure_loader`.
    """
    counts = list(workers) if workers else default_worker_counts()
    if any(count < 1 for count in counts):
        raise ConfigError("num_workers must be at least 1")
    points = [
        measure_loader(
            dataset,
            batch_size=batch_size,
            num_workers=count,
            consumer_images_per_s=consumer_images_per_s,
            min_seconds=min_seconds,
            device=device,
            worker_type=worker_type,
            **options,
        )
        for count in counts
    ]
    return LoaderBenchResult(dataset, batch_size, consumer_images_per_s, device, worker_type, points)
