"""Prepare and load through an S3 store that answers every request 20 ms late, next to local disk.

The store is moto's S3 server on 127.0.0.1 (tests/s3_server.py, run as a
subprocess) with a per-request delay, so every GET, HEAD and listing pays
what a distant bucket costs; the bytes themselves move at loopback speed.
Rows, measured in the same run, in alternating rounds (the best run counts):

  prepare local->local        prepare_dataset from the raw JPEGs on disk (the baseline)
  prepare s3->local           the same job from the bucket, reads on I/O threads (io_threads=32)
  prepare s3->local, serial   the same, io_threads=0: one read at a time per worker
  loader local disk           one epoch of make_loader over the prepared shards on disk (the baseline)
  loader s3 epoch 1           make_loader("s3://...", cache_dir=fresh): read-ahead, filling the cache
  loader s3 epoch 2           the next epoch of that loader: served from the cache

Targets: loader epoch 1 >= 80 % of local disk, epoch 2 >= 95 %, prepare s3->local >= 80 %
of local->local.

Usage:
    python benchmarks/remote.py [--n 600] [--rounds 2] [--latency-ms 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

try:
    from . import common
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import common  # type: ignore[no-redef]

Run, Row = common.Run, common.Row

SIZE = 256
DEMO_SIDES = (800, 1250)  # ~1 MP photo-like JPEGs
BATCH = 64
TARGETS = {"loader_epoch1": 0.80, "loader_epoch2": 0.95, "prepare_s3": 0.80}


def time_prepare(source: str, out: str, store: common.Store, io_threads: int) -> Run:
    from pipeline import PrepareSpec, ResizeSpec, prepare_dataset

    shutil.rmtree(out, ignore_errors=True)
    spec = PrepareSpec(source=source, out=out, resize=ResizeSpec(size=SIZE))
    store.reset()
    with common.NoiseMeter() as meter:
        started = time.perf_counter()
        result = prepare_dataset(
            spec, workers=common.available_processes(), storage_options=store.options, io_threads=io_threads
        )
        seconds = time.perf_counter() - started
    detail = {"max_reads_in_flight": store.max_in_flight()} if source.startswith("s3://") else {}
    return Run(result.samples, seconds, detail, meter.share)


def time_epochs(source: str, store: common.Store, cache_dir: str | None, epochs: int) -> list[Run]:
    from pipeline import make_loader

    loader = make_loader(
        source, BATCH, device="cpu", shuffle_buffer=256, cache_dir=cache_dir,
        storage_options=store.options if source.startswith("s3://") else None,
    )  # fmt: skip
    runs = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        with common.NoiseMeter() as meter:
            started = time.perf_counter()
            images = sum(len(labels) for _, labels in loader)
            seconds = time.perf_counter() - started
        runs.append(Run(images, seconds, {}, meter.share))
    return runs


def ratio(row: Row, baseline: Row) -> float:
    best, base = row.best, baseline.best
    return best.images_per_s / base.images_per_s if best and base and base.images_per_s else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=600, help="demo images (~1 MP)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-ms", type=int, default=20)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("NO_PROXY", common.LOOPBACK)
    from pipeline.demo import make_demo_dataset

    work = tempfile.mkdtemp(prefix="gpufeed-remote-")
    store = common.Store(work, args.latency_ms)
    try:
        raw, shards = os.path.join(work, "raw"), os.path.join(work, "shards")
        make_demo_dataset(
            raw, args.n, min_side=DEMO_SIDES[0], max_side=DEMO_SIDES[1], workers=common.available_processes()
        )
        rows = {
            name: Row(name)
            for name in (
                "prepare_local",
                "prepare_s3",
                "prepare_s3_serial",
                "loader_local",
                "loader_epoch1",
                "loader_epoch2",
            )
        }
        time_prepare(raw, shards, store, 0)  # the dataset the loader rows read (and a warm page cache)
        common.upload(store, raw, "s3://bench/raw")
        common.upload(store, shards, "s3://bench/shards")
        out = os.path.join(work, "out")
        for round_ in range(max(2, args.rounds)):
            rows["prepare_local"].runs.append(time_prepare(raw, out, store, 32))
            rows["prepare_s3"].runs.append(time_prepare("s3://bench/raw", out, store, 32))
            rows["prepare_s3_serial"].runs.append(time_prepare("s3://bench/raw", out, store, 0))
            rows["loader_local"].runs.extend(time_epochs(shards, store, None, 1))
            cache = os.path.join(work, f"cache-{round_}")
            first, second = time_epochs("s3://bench/shards", store, cache, 2)
            rows["loader_epoch1"].runs.append(first)
            rows["loader_epoch2"].runs.append(second)
        report(rows, args)
    finally:
        store.stop()
        shutil.rmtree(work, ignore_errors=True)


def report(rows: dict[str, Row], args: argparse.Namespace) -> None:
    ratios = {
        "prepare_s3": ratio(rows["prepare_s3"], rows["prepare_local"]),
        "prepare_s3_serial": ratio(rows["prepare_s3_serial"], rows["prepare_local"]),
        "loader_epoch1": ratio(rows["loader_epoch1"], rows["loader_local"]),
        "loader_epoch2": ratio(rows["loader_epoch2"], rows["loader_local"]),
    }
    print(f"{args.n} images, {args.latency_ms} ms per request, {common.available_processes()} processes")
    for name, row in rows.items():
        best = row.best
        assert best is not None
        runs = ", ".join(f"{run.images_per_s:.1f}" for run in row.runs)
        noise = ", ".join("-" if run.noise is None else f"{run.noise:.0%}" for run in row.runs)
        print(f"  {name:<18} {best.images_per_s:8.1f} images/s  (runs {runs}; other load {noise}) {best.detail or ''}")
    for name, value in ratios.items():
        target = TARGETS.get(name)
        verdict = "" if target is None else (f"  target >= {target:.0%}: " + ("met" if value >= target else "NOT met"))
        print(f"  {name:<18} {value:6.1%} of its local baseline{verdict}")
    if args.json:
        data = {"rows": {name: row.to_dict(name) for name, row in rows.items()}, "ratios": ratios, "targets": TARGETS}
        with open(args.json, "w") as handle:
            json.dump(data, handle, indent=2)


if __name__ == "__main__":
    main()
