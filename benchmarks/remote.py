"""Prepare and load through an S3 store that answers every request 20 ms late, next to local disk.

The store (benchmarks/s3store.py) is a real S3 server on 127.0.0.1 (rclone's
`serve s3` where installed, else moto's) behind a proxy that delays every
request, so every GET, PUT and listing pays what a distant bucket costs; the
bytes themselves move at loopback speed. Rows, measured in the same run, in
alternating rounds (the best run counts):

  prepare local->local        prepare_dataset from the raw JPEGs on disk (the baseline)
  prepare s3->local           the same job from the bucket, 32 reads in flight (io_threads=32: GETs on one event loop)
  prepare s3->local, serial   the same, io_threads=0: one read at a time per worker
  loader local disk           one epoch of make_loader over the prepared shards on disk (the baseline)
  loader s3 epoch 1           make_loader("s3://...", cache_dir=fresh): read-ahead, filling the cache
  loader s3 epoch 2           the next epoch of that loader: served from the cache

Targets: loader epoch 1 >= 80 % of local disk, epoch 2 >= 95 %, prepare s3->local >= 80 %
of local->local.

The store runs on the machine being measured, which a real bucket does not:
each run says what share of the CPUs the store itself used (`store`), and
each ratio is also given with that share handed back to the measured row
(images / (seconds x (1 - store share))): what the row would do with the
whole machine, as it has against a bucket elsewhere. The verdicts are on the
plain ratios.

Usage:
    python benchmarks/remote.py [--n 1200] [--loader-n 12000] [--rounds 2] [--latency-ms 20]
                                [--server auto|rclone|moto] [--loader-only | --serial-only] [--json FILE]

`--loader-only` times the three loader rows only (no demo images, no prepare rows);
`--serial-only` the serial prepare row and its local baseline only (the blocking reads' cost).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable

try:
    from . import common
    from .s3store import Store, upload
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import common  # type: ignore[no-redef]
    from s3store import Store, upload  # type: ignore[no-redef]

Run, Row = common.Run, common.Row

SIZE = 256
DEMO_SIDES = (800, 1250)  # ~1 MP photo-like JPEGs
LOADER_SIDES = (300, 400)  # the loader rows' dataset: small sources, the same 256-px shards, quick to make
BATCH = 64
LOADER_SHARD_SAMPLES = 250  # 48 shards of ~5 MB for 12,000 images: a dataset of many shards, as any real one is
TARGETS = {"loader_epoch1": 0.80, "loader_epoch2": 0.95, "prepare_s3": 0.80}


def measured(store: Store, timed: Callable[[], int]) -> Run:
    """Run `timed` (it returns the images it did), with its wall time, the other load, the store's CPU share and
    gpufeed's own CPU per image (this process and its workers, the store's processes not counted)."""
    cpu_before = store.cpu_seconds()
    own_before = own_cpu_seconds(store)
    with common.NoiseMeter() as meter:
        started = time.perf_counter()
        images = timed()
        seconds = time.perf_counter() - started
    store_share = (store.cpu_seconds() - cpu_before) / (seconds * (os.cpu_count() or 1))
    noise = None if meter.share is None else max(0.0, meter.share - store_share)
    own = (own_cpu_seconds(store) - own_before) / max(1, images) * 1000
    return Run(images, seconds, {"store_cpu_share": round(store_share, 3), "cpu_ms_per_image": round(own, 3)}, noise)


def own_cpu_seconds(store: Store) -> float:
    """CPU seconds of this process, its ended children and its live ones (prepare's and the loader's workers),
    the store's server and proxy left out."""
    import psutil

    total = common.cpu_seconds(children=True) - store.cpu_seconds_reaped()
    for child in psutil.Process().children(recursive=True):
        if child.pid in store.pids():
            continue
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def time_prepare(source: str, out: str, store: Store, io_threads: int, shard_samples: int | None = None) -> Run:
    from pipeline import PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset

    shutil.rmtree(out, ignore_errors=True)
    shards = ShardSpec(max_samples=shard_samples) if shard_samples else ShardSpec()
    spec = PrepareSpec(source=source, out=out, resize=ResizeSpec(size=SIZE), shards=shards)
    store.reset()

    def job() -> int:
        workers = common.available_processes()
        return prepare_dataset(spec, workers=workers, storage_options=store.options, io_threads=io_threads).samples

    before = common.cpu_seconds(children=False)
    run = measured(store, job)
    # the one process that lists, reads ahead and hands the bytes to the workers: what it spends per image
    # is what caps a machine with many more cores than this one, where the workers would keep up
    run.detail["parent_cpu_ms_per_image"] = round((common.cpu_seconds(children=False) - before) / max(1, run.images) * 1000, 3)
    if source.startswith("s3://"):
        run.detail["max_requests_in_flight"] = store.max_in_flight()
    return run



def time_epochs(source: str, store: Store, cache_dir: str | None, epochs: int) -> list[Run]:
    from pipeline import make_loader

    loader = make_loader(
        source, BATCH, device="cpu", shuffle_buffer=256, cache_dir=cache_dir,
        storage_options=store.options if source.startswith("s3://") else None,
    )  # fmt: skip
    runs = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        runs.append(measured(store, lambda: sum(len(labels) for _, labels in loader)))
    return runs


def ratio(row: Row, baseline: Row, handed_back: bool = False) -> float:
    """The best run of `row` against the best of `baseline`; `handed_back`: with the store's CPU share given back to both."""
    best, base = row.best, baseline.best
    if not best or not base or not base.images_per_s:
        return 0.0
    return whole_machine_rate(best, handed_back) / whole_machine_rate(base, handed_back)


def whole_machine_rate(run: Run, handed_back: bool) -> float:
    share = run.detail.get("store_cpu_share", 0.0) if handed_back else 0.0
    return run.images_per_s / max(1e-9, 1.0 - share)


ROW_NAMES = ("prepare_local", "prepare_s3", "prepare_s3_serial", "loader_local", "loader_epoch1", "loader_epoch2")
BASELINES = {
    "prepare_s3": "prepare_local",
    "prepare_s3_serial": "prepare_local",
    "loader_epoch1": "loader_local",
    "loader_epoch2": "loader_local",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1200, help="demo images (~1 MP) for the prepare rows")
    parser.add_argument("--loader-n", type=int, default=12000, help="images in the dataset the loader rows read")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-ms", type=int, default=20)
    parser.add_argument("--server", choices=("auto", "rclone", "moto"), default="auto")
    parser.add_argument("--loader-only", action="store_true", help="time the loader rows only")
    parser.add_argument("--serial-only", action="store_true", help="time prepare local->local and s3->local serial only")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("NO_PROXY", "127.0.0.1")
    from pipeline.demo import make_demo_dataset

    work = tempfile.mkdtemp(prefix="gpufeed-remote-")
    store = Store(work, args.latency_ms, args.server)
    try:
        raw, loader_raw, shards = (os.path.join(work, name) for name in ("raw", "loader-raw", "shards"))
        workers = common.available_processes()
        if not args.loader_only:
            make_demo_dataset(raw, args.n, min_side=DEMO_SIDES[0], max_side=DEMO_SIDES[1], workers=workers)
        names = [name for name in ROW_NAMES if not (args.loader_only and name.startswith("prepare"))]
        if args.serial_only:
            names = ["prepare_local", "prepare_s3_serial"]
        rows = {name: Row(name) for name in names}
        if "loader_local" in rows:
            make_demo_dataset(loader_raw, args.loader_n, min_side=LOADER_SIDES[0], max_side=LOADER_SIDES[1], workers=workers)
            # the dataset the loader rows read (and a warm page cache), in shards of LOADER_SHARD_SAMPLES
            time_prepare(loader_raw, shards, store, 0, LOADER_SHARD_SAMPLES)
            upload(store, shards, "s3://bench/shards")
        if not args.loader_only:
            upload(store, raw, "s3://bench/raw")
        out = os.path.join(work, "out")
        for round_ in range(max(2, args.rounds)):
            if "prepare_local" in rows:
                rows["prepare_local"].runs.append(time_prepare(raw, out, store, 32))
            if "prepare_s3" in rows:
                rows["prepare_s3"].runs.append(time_prepare("s3://bench/raw", out, store, 32))
            if "prepare_s3_serial" in rows:
                rows["prepare_s3_serial"].runs.append(time_prepare("s3://bench/raw", out, store, 0))
            if "loader_local" not in rows:
                continue
            rows["loader_local"].runs.extend(time_epochs(shards, store, None, 1))
            cache = os.path.join(work, f"cache-{round_}")
            first, second = time_epochs("s3://bench/shards", store, cache, 2)
            rows["loader_epoch1"].runs.append(first)
            rows["loader_epoch2"].runs.append(second)
            shutil.rmtree(cache, ignore_errors=True)  # each round fills a cache of its own; none piles up on disk
        report(rows, args, store.kind, fresh_write_cost(work, common.directory_bytes(shards)) if "loader_local" in rows else [])
    finally:
        store.stop()
        shutil.rmtree(work, ignore_errors=True)


def fresh_write_cost(work: str, size: int, times: int = 3) -> list[float]:
    """CPU ms per MB this process spends writing `size` bytes into new files, `times` over: what filling a cache costs here.

    Epoch 1 writes every shard into the cache, the local baseline writes
    nothing. On a virtual machine whose memory the host hands back when the
    guest frees it, each page the page cache takes anew can cost several
    microseconds, many times a plain copy: this says what it costs here.
    """
    block = os.urandom(1 << 20)
    costs = []
    for attempt in range(times):
        folder = os.path.join(work, f"fresh-{attempt}")
        os.makedirs(folder)
        before = common.cpu_seconds(children=False)
        for number in range(max(1, size >> 22)):
            with open(os.path.join(folder, f"{number}.bin"), "wb") as handle:
                for _ in range(4):
                    handle.write(block)
        costs.append((common.cpu_seconds(children=False) - before) / max(1, size >> 20) * 1000)
    for attempt in range(times):
        shutil.rmtree(os.path.join(work, f"fresh-{attempt}"), ignore_errors=True)
    return costs


def report(rows: dict[str, Row], args: argparse.Namespace, server: str, fresh_write: list[float]) -> None:
    baselines = {name: base for name, base in BASELINES.items() if name in rows}
    ratios = {name: ratio(rows[name], rows[base]) for name, base in baselines.items()}
    handed_back = {name: ratio(rows[name], rows[base], handed_back=True) for name, base in baselines.items()}
    print(
        f"prepare rows: {args.n} images (~1 MP); loader rows: {args.loader_n} images of 256 px; "
        f"{args.latency_ms} ms per request; S3 server: {server}; {common.available_processes()} processes"
    )
    if server == "moto":
        print("  (moto is pure Python and spends milliseconds of CPU per request: install rclone for fair figures)")
    for name, row in rows.items():
        best = row.best
        assert best is not None
        runs = ", ".join(f"{run.images_per_s:.1f}" for run in row.runs)
        noise = ", ".join("-" if run.noise is None else f"{run.noise:.0%}" for run in row.runs)
        store = ", ".join(f"{run.detail.get('store_cpu_share', 0.0):.0%}" for run in row.runs)
        extra = {key: value for key, value in best.detail.items() if key != "store_cpu_share"}
        print(
            f"  {name:<18} {best.images_per_s:8.1f} images/s  (runs {runs}; store {store} of the CPUs; "
            f"other load {noise}) {extra or ''}"
        )
    for name, value in ratios.items():
        target = TARGETS.get(name)
        verdict = "" if target is None else (f"  target >= {target:.0%}: " + ("met" if value >= target else "NOT met"))
        print(f"  {name:<18} {value:6.1%} of its local baseline{verdict}   (store's CPU handed back: {handed_back[name]:.1%})")
    if fresh_write:
        print(
        "  writing the shards' bytes into new files costs this process "
        + ", ".join(f"{cost:.2f}" for cost in fresh_write)
        + " ms of CPU per MB (epoch 1 does that filling its cache; the local baseline writes nothing)"
    )
    if args.json:
        data = {
            "fresh_write_ms_per_mb": [round(cost, 3) for cost in fresh_write],
            "server": server,
            "rows": {name: row.to_dict(name) for name, row in rows.items()},
            "ratios": ratios,
            "ratios_store_cpu_handed_back": handed_back,
            "targets": TARGETS,
        }
        with open(args.json, "w") as handle:
            json.dump(data, handle, indent=2)


if __name__ == "__main__":
    main()
