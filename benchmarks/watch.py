"""What does `gpufeed watch`'s hook cost a training loop?

The loop of benchmarks/loader.py (one epoch, each batch touched once: the least
a training step could do, so the hook's share is the largest it can be) over

  gpufeed Loader     make_loader(batch 64, crop 56, 2 thread workers, CPU) over
                     small prepared demo shards (made once under --data)
  torch DataLoader   a map-style Dataset of in-memory uint8 64x64 images, a random
                     56 px crop per sample, batch 64, num_workers=2

each run (--epochs epochs) with the hook's patches in place and recording into a folder (as under
`gpufeed watch`) and with the original methods back ("plain"), in one process,
rounds alternating and the order reversed each round; the best run of each
counts (noise only ever slows a run down), and the median of the rounds'
hook/plain ratios. On a shared machine both swing by several % either way,
so the figure to quote is the last one: the hook's own cost per next()
(timed on a DataLoader whose batches cost nothing, with and without the
hook in 30 alternating rounds, the difference of the medians) as a share of
each row's batch time; the target is <= 1 %.

Usage:
    python benchmarks/watch.py [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torch.utils.data import dataloader as torch_dataloader  # noqa: E402
from torch.utils.data._utils import fetch as torch_fetch  # noqa: E402

from pipeline import PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset  # noqa: E402
from pipeline.demo import make_demo_dataset  # noqa: E402
from pipeline.loader import loader as gpufeed_loader  # noqa: E402
from pipeline.measure.watching.hook import gpufeed_watch_hook as hook  # noqa: E402

BATCH, CROP, WORKERS = 64, 56, 2
PATCHED = [
    (torch_dataloader._BaseDataLoaderIter, "__next__"),
    (torch_fetch._MapDatasetFetcher, "fetch"),
    (torch_fetch._IterableDatasetFetcher, "fetch"),
    (gpufeed_loader.Loader, "__iter__"),
]


def touch(images: Any) -> float:
    """Read one element, as benchmarks/loader.py's consumer does."""
    return float(images[(0,) * images.ndim])


def time_epoch(batches: Iterable[Any]) -> tuple[int, float]:
    images, start = 0, time.perf_counter()  # one epoch, as in benchmarks/loader.py
    for batch in batches:
        touch(batch[0])
        images += len(batch[1])
    return images, time.perf_counter() - start


class Crops(Dataset):
    """In-memory uint8 images, a random crop each: a DataLoader whose batches cost about what small decodes do."""

    def __init__(self, count: int) -> None:
        self.images = torch.randint(0, 255, (count, 3, 64, 64), dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        y, x = torch.randint(0, 64 - CROP + 1, (2,)).tolist()
        return self.images[index, :, y : y + CROP, x : x + CROP].float().div(255), index


def cost_of_next(patched: dict[tuple[type, str], Any], originals: dict[tuple[type, str], Any], rounds: int = 30) -> float:
    """The hook's own cost per next(), in seconds: a DataLoader whose batches cost nothing (single samples, no
    workers), with and without the hook in alternating rounds; the difference of the medians. With
    num_workers=0 the fetch is timed in the training process too (what the workers do otherwise): pass
    only the iterator's entry in `patched` for what a training process with workers pays."""
    loader = DataLoader(range(20_000), batch_size=None)
    times: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(rounds):
        for on in ((True, False) if round_ % 2 == 0 else (False, True)):
            switch(patched, originals, on)
            start = time.perf_counter()
            for _ in loader:
                pass
            times[on].append((time.perf_counter() - start) / 20_000)
    return statistics.median(times[True]) - statistics.median(times[False])


def cost_of_timed_iteration(rounds: int = 30) -> float:
    """The cost per batch of the wrapper the hook puts around a gpufeed Loader iteration (same method as above)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(rounds):
        for on in ((True, False) if round_ % 2 == 0 else (False, True)):
            batches = iter(range(20_000))
            start = time.perf_counter()
            for _ in hook._timed(batches, hook._Loop("benchmark", "gpufeed")) if on else batches:
                pass
            times[on].append((time.perf_counter() - start) / 20_000)
    return statistics.median(times[True]) - statistics.median(times[False])


def ensure_dataset(data: Path, images: int) -> Path:
    prepared = data / "prepared"
    if not (prepared / "manifest.json").exists():
        make_demo_dataset(data / "raw", images, min_side=96, max_side=160)
        spec = PrepareSpec(
            source=str(data / "raw"), out=str(prepared), resize=ResizeSpec(size=64),
            shards=ShardSpec(max_bytes=None, max_samples=256),
        )  # fmt: skip
        prepare_dataset(spec)
    return prepared


def switch(patched: dict[tuple[type, str], Any], originals: dict[tuple[type, str], Any], on: bool) -> None:
    for (cls, name), method in (patched if on else originals).items():
        setattr(cls, name, method)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=10, help="Epochs per timed run.")
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "results" / "watch-data")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    prepared = ensure_dataset(args.data, args.images)

    originals = {(cls, name): cls.__dict__[name] for cls, name in PATCHED}
    folder = tempfile.mkdtemp(prefix="gpufeed-watch-bench-")
    hook.start(folder)
    patched = {(cls, name): cls.__dict__[name] for cls, name in PATCHED}
    assert all(patched[key] is not originals[key] for key in patched), "the hook did not patch"

    loader = gpufeed_loader.make_loader(str(prepared), BATCH, device="cpu", crop=CROP, num_workers=WORKERS)
    dataset = Crops(args.images)
    # Forked workers keep the methods of their fork: one DataLoader per state, each started (and warmed) in it.
    dataloaders = {}
    for on in (True, False):
        switch(patched, originals, on)
        dataloaders[on] = DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True)
        time_epoch(dataloaders[on])
    rows: dict[str, Callable[[bool], Iterable[Any]]] = {
        "gpufeed Loader": lambda on: loader, "torch DataLoader": lambda on: dataloaders[on],
    }  # fmt: skip
    best: dict[tuple[str, bool], float] = {}
    ratios: dict[str, list[float]] = {name: [] for name in rows}
    for name, batches in rows.items():
        time_epoch(batches(True))  # warm: workers started, pages cached
        for round_ in range(args.rounds):
            pair = {}
            for on in ((True, False) if round_ % 2 == 0 else (False, True)):
                switch(patched, originals, on)
                pair[on] = sum(time_epoch(batches(on))[1] for _ in range(args.epochs))
                best[name, on] = min(best.get((name, on), float("inf")), pair[on])
            ratios[name].append(pair[True] / pair[False])
    extra_us_zero = 1e6 * cost_of_next(patched, originals)
    iterator = (torch_dataloader._BaseDataLoaderIter, "__next__")
    iterator_us = 1e6 * cost_of_next({iterator: patched[iterator]}, {iterator: originals[iterator]})
    switch(patched, originals, True)
    loader_us = 1e6 * cost_of_timed_iteration()
    switch(patched, originals, True)
    loader.close()
    hook.stop()
    recorded = sorted(os.listdir(folder))

    result: dict[str, Any] = {"rounds": args.rounds, "epochs": args.epochs, "images": args.images, "rows": {}}
    images = args.images * args.epochs
    result["hook_us_per_batch_num_workers_0"] = round(extra_us_zero, 3)
    result["hook_us_per_batch_with_workers"] = round(iterator_us, 3)
    result["hook_us_per_gpufeed_batch"] = round(loader_us, 3)
    for name in rows:
        plain, hooked = best[name, False], best[name, True]
        extra_us = loader_us if name == "gpufeed Loader" else iterator_us  # what this row's training loop pays
        ratio = statistics.median(ratios[name])
        batch_us = 1e6 * plain / (images / BATCH)
        result["rows"][name] = {
            "plain_s": round(plain, 4), "hook_s": round(hooked, 4), "best_ratio": round(hooked / plain, 4),
            "median_pair_ratio": round(ratio, 4), "pair_ratios": [round(r, 4) for r in ratios[name]],
            "batch_us": round(batch_us, 1), "hook_share_of_batch": round(extra_us / batch_us, 6),
        }  # fmt: skip
        print(f"{name:17s} plain {images / plain:8.0f} images/s   hook {images / hooked:8.0f} images/s   "
              f"hook/plain time: median of {len(ratios[name])} pairs {ratio:.3f}, best runs {hooked / plain:.3f}   "
              f"the hook's {extra_us:.2f} us per batch = {100 * extra_us / batch_us:.3f} % of a {batch_us:.0f} us batch "
              f"({'ok' if extra_us / batch_us <= 0.01 else 'over 1 %'})")
    print(f"the hook per batch: gpufeed Loader {loader_us:.2f} us; torch DataLoader {iterator_us:.2f} us with workers "
          f"(the fetch is timed in them), {extra_us_zero:.2f} us with num_workers=0 (the fetch timed in the training process)")
    print(f"recorded into {len(recorded)} file(s): {', '.join(recorded)}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
