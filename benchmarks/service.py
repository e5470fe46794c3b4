"""What does running a prepare through the service cost, and does it scale with workers?

One job (the same PrepareSpec every row), four rows, measured in the same run
on the same files (page cache warm):

  local x1     pipeline.prepare_dataset(spec, workers=1): one decoding process
  service x1   the spec submitted to the service, one `gpufeed worker --concurrency 1`
  local x2     prepare_dataset(spec, workers=2)
  service x2   two workers (`-n w1`, `-n w2`), each `--concurrency 1`, as on two machines

A service row is timed from submit to the job record saying `succeeded`
(plan, one task per shard, finalize with its sha256 checks, and a 20 ms
polling delay); Redis and the workers are started, and warmed up with a small
job, before any timing. A local row times the whole `prepare_dataset`.
Every row runs --rounds times, rows alternating, and the best run counts: the
machine is shared and noise only ever slows a run down. Each run's noise (the
share of the CPUs other processes used meanwhile, the workers counted as ours)
is printed next to it.

Targets (2-core development machine): service overhead <= 10 % at equal
processes; 2 workers >= 1.7x one worker.

Usage:
    python benchmarks/service.py [--data DIR] [--shard-samples 100] [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

try:
    from . import common
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import common  # type: ignore[no-redef]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(REPO, "benchmarks", "results", "data")
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "service-out")
TARGETS = {"max_overhead": 0.10, "min_scaling": 1.7}
POLL_S = 0.02


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def private_redis(directory: str) -> Iterator[str]:
    """A redis-server on a free loopback port for this run only."""
    import redis

    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", directory],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise SystemExit("redis-server did not start (is it installed? apt-get install redis-server)") from None
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=10)


class Workers:
    """`gpufeed worker` processes (each --concurrency 1) in their own process groups."""

    def __init__(self, env: dict[str, str], logs: str) -> None:
        self.env = env
        self.logs = logs
        self.processes: list[tuple[subprocess.Popen[bytes], str]] = []

    def start(self, name: str) -> None:
        log = os.path.join(self.logs, f"{name}.log")
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                [sys.executable, "-m", "pipeline", "worker", "-n", f"{name}@%h", "--concurrency", "1",
                 "--pool", "prefork", "--without-mingle", "--without-gossip"],
                env=self.env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.processes.append((process, log))
        deadline = time.monotonic() + 60
        while " ready." not in open(log, errors="replace").read():
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"worker {name} did not start:\n{open(log, errors='replace').read()[-2000:]}")
            time.sleep(0.1)

    def stop_all(self) -> None:
        for process, _ in self.processes:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=15)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.processes.clear()

    def cpu_seconds(self) -> float:
        """CPU time used so far by the workers and their pool children."""
        import psutil

        total = 0.0
        for process, _ in self.processes:
            try:
                parent = psutil.Process(process.pid)
                for proc in [parent, *parent.children(recursive=True)]:
                    times = proc.cpu_times()
                    total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
        return total


def make_spec(src: str, out: str, shard_count: int) -> Any:
    from pipeline.specs import PrepareSpec, ShardSpec

    return PrepareSpec(source=src, out=out, shards=ShardSpec(max_samples=shard_count))


def run_local(spec: Any, processes: int) -> float:
    from pipeline.prepare.job import prepare_dataset

    started = time.perf_counter()
    result = prepare_dataset(spec, workers=processes)
    seconds = time.perf_counter() - started
    assert result.samples + result.rejected == result.listed
    return seconds


def run_service(spec: Any, settings: Any, store: Any) -> float:
    from worker.client import submit_job

    started = time.perf_counter()
    job = submit_job("prepare", {"spec": spec.to_dict()}, settings, store)
    while (record := store.require(job)).state not in ("succeeded", "failed", "cancelled"):
        time.sleep(POLL_S)
    seconds = time.perf_counter() - started
    if record.state != "succeeded":
        raise SystemExit(f"service job {job} ended {record.state}: {record.error}")
    return seconds


def measured(run: Callable[[], float], workers: Workers) -> tuple[float, float | None]:
    """(seconds, noise share) of one run; the workers' CPU counts as ours, not as noise."""
    cpu_before = workers.cpu_seconds()
    with common.NoiseMeter() as meter:
        seconds = run()
    noise = meter.share
    if noise is not None:
        spent = workers.cpu_seconds() - cpu_before
        noise = max(0.0, noise - spent / (seconds * (os.cpu_count() or 1)))
    return seconds, noise


def ensure_data(path: str, n: int) -> str:
    if len(common.list_jpegs(path)) >= n:
        return path
    from pipeline.demo import make_demo_dataset

    print(f"generating {n} demo images in {path} …", file=sys.stderr)
    make_demo_dataset(path, n, min_side=800, max_side=1250, workers=common.available_processes())
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=DEFAULT_DATA, help="ImageFolder of JPEGs (generated when missing)")
    parser.add_argument("--n", type=int, default=1000, help="images to generate when --data has fewer")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument(
        "--shard-samples", "--shard-count", dest="shard_count", type=int, default=100,
        help="samples per shard (the job's --shard-samples)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", dest="json_path", default=None, help="write every figure here")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()

    data = os.path.abspath(ensure_data(args.data, args.n))
    images = len(common.list_jpegs(data))
    out_root = os.path.abspath(args.out)
    os.makedirs(out_root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="gpufeed-service-bench-")
    rows: dict[str, dict[str, Any]] = {name: {"runs_s": [], "runs_noise": []} for name in ("local x1", "service x1", "local x2", "service x2")}
    try:
        with private_redis(scratch) as url:
            roots = f"{data}:{out_root}:{scratch}"
            env = {**os.environ, "GPUFEED_BROKER_URL": url, "GPUFEED_ALLOWED_ROOTS": roots}
            os.environ.update({"GPUFEED_BROKER_URL": url, "GPUFEED_ALLOWED_ROOTS": roots})
            from worker.jobs import JobStore
            from worker.settings import get_settings

            settings = get_settings()
            store = JobStore(settings)
            workers = Workers(env, scratch)
            warmup = _warmup_job(scratch)
            try:
                workers.start("w1")
                warmup(settings, store)
                for round_ in range(args.rounds):
                    order = ["local x1", "service x1"] if round_ % 2 == 0 else ["service x1", "local x1"]
                    _round(order, rows, data, out_root, args.shard_count, settings, store, workers)
                workers.start("w2")
                warmup(settings, store)
                for round_ in range(args.rounds):
                    order = ["local x2", "service x2"] if round_ % 2 == 0 else ["service x2", "local x2"]
                    _round(order, rows, data, out_root, args.shard_count, settings, store, workers)
                jobs = [r.to_status() for r in store.list_jobs(100) if r.state == "succeeded"]
                workers_used = [sorted(doc["workers"].items()) for doc in jobs[:1]]
            finally:
                workers.stop_all()
                store.client.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = _report(rows, images, args, data, workers_used)
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump(report, handle, indent=2)
    if args.check and not all(report["targets_met"].values()):
        sys.exit(1)


def _warmup_job(scratch: str) -> Callable[[Any, Any], float]:
    """A tiny job of one-image shards: every worker's pool imports and opens everything before timing."""
    from pipeline.demo import make_demo_dataset

    raw = os.path.join(scratch, "warmup-raw")
    make_demo_dataset(raw, 8, min_side=96, max_side=160, workers=1)

    def run(settings: Any, store: Any) -> float:
        return run_service(make_spec(raw, common.fresh_dir(os.path.join(scratch, "warmup-out")), 1), settings, store)

    return run


def _round(order: list[str], rows: dict[str, dict[str, Any]], data: str, out_root: str, shard_count: int,
           settings: Any, store: Any, workers: Workers) -> None:
    for name in order:
        common.wait_for_quiet(10)
        common.warm_page_cache(path for path, _ in common.list_jpegs(data))
        out = common.fresh_dir(os.path.join(out_root, name.replace(" ", "-")))
        spec = make_spec(data, out, shard_count)
        processes = int(name[-1])
        if name.startswith("local"):
            seconds, noise = measured(lambda: run_local(spec, processes), workers)
        else:
            seconds, noise = measured(lambda: run_service(spec, settings, store), workers)
        rows[name]["runs_s"].append(round(seconds, 3))
        rows[name]["runs_noise"].append(None if noise is None else round(noise, 3))
        print(f"  {name:<11} {seconds:6.2f} s  (noise {noise if noise is None else f'{noise:.0%}'})", file=sys.stderr)


def _report(rows: dict[str, dict[str, Any]], images: int, args: Any, data: str, workers_used: Any) -> dict[str, Any]:
    best = {name: min(row["runs_s"]) for name, row in rows.items()}
    for name, row in rows.items():
        row["seconds"] = best[name]
        row["images_per_s"] = round(images / best[name], 1)
    ratios = {
        "overhead_x1": round(best["service x1"] / best["local x1"] - 1, 4),
        "overhead_x2": round(best["service x2"] / best["local x2"] - 1, 4),
        "scaling_2_workers": round(best["service x1"] / best["service x2"], 3),
        "local_scaling_2_processes": round(best["local x1"] / best["local x2"], 3),
    }
    met = {
        "overhead_x1 <= 10%": ratios["overhead_x1"] <= TARGETS["max_overhead"],
        "overhead_x2 <= 10%": ratios["overhead_x2"] <= TARGETS["max_overhead"],
        "scaling >= 1.7x": ratios["scaling_2_workers"] >= TARGETS["min_scaling"],
    }
    for name, row in rows.items():
        print(f"{name:<11} {row['seconds']:6.2f} s  {row['images_per_s']:7.1f} images/s  runs {row['runs_s']} noise {row['runs_noise']}")
    print("targets: " + "; ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in met.items()))
    print(
        f"service: overhead {ratios['overhead_x1']:+.1%} (1 process), {ratios['overhead_x2']:+.1%} (2 processes); "
        f"2 workers {ratios['scaling_2_workers']:.2f}x one worker (local 2 processes: {ratios['local_scaling_2_processes']:.2f}x)"
    )
    return {
        "data": {"path": data, "images": images},
        "shard_count": args.shard_count,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "available_processes": common.available_processes(),
        "load_average": os.getloadavg(),
        "rows": rows,
        "ratios": ratios,
        "targets": TARGETS,
        "targets_met": met,
        "shards_per_worker_last_job": workers_used,
    }


if __name__ == "__main__":
    main()
