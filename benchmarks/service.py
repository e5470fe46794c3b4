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

--store: the same rows with SRC and OUT on an S3-compatible store instead
(benchmarks/s3store.py: rclone's `serve s3`, or moto's server without
rclone, on a free loopback port behind a proxy that delays every request
--latency-ms, 20 by default), in place of the local rows:

  local s3 x0     prepare_dataset(s3 spec, workers=0, storage_options=endpoint + credentials):
                  no pool, one process, as a worker runs each shard (no target; printed
                  as the 1-worker row's overhead against it)
  local s3 x1     prepare_dataset(s3 spec, workers=1, storage_options=endpoint + credentials)
  service s3 x1   the spec submitted with storage_options {"endpoint_url": ...} only (what
                  `gpufeed submit prepare --storage-option endpoint_url=...` records), one worker
  local s3 x2     prepare_dataset(..., workers=2)
  service s3 x2   two workers

Each worker is a machine of its own: its own TMPDIR, HOME and GPUFEED_CACHE
(no folder shared with the submitter or the other worker), the store's
credentials in its environment (AWS_ACCESS_KEY_ID ...), and nothing but the
store and Redis in common. The warm-up job goes through the real
`gpufeed submit prepare ... --storage-option endpoint_url=...` command line.
Every run writes to a fresh prefix of the bucket, whose manifest is then
read back (it must exist and count every image) before the prefix is
removed. Each run also reports the store's CPU seconds (server and proxy,
from /proc/PID/stat): on a small machine the store competes with prepare
for the same cores, so its CPU counts neither as ours nor as noise. Beside
one worker the store runs on the core that worker leaves idle, beside two it
takes time from both: the scaling is also printed with the store's CPU share
handed back to each row (seconds x (1 - share)). The verdicts are on the
plain ratios.

Usage:
    python benchmarks/service.py [--data DIR] [--shard-samples 100] [--rounds 2] [--json FILE]
    python benchmarks/service.py --store [--latency-ms 20] [--rounds 2] [--json FILE]
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
    from .s3store import Store, upload
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import common  # type: ignore[no-redef]
    from s3store import Store, upload  # type: ignore[no-redef]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(REPO, "benchmarks", "results", "data")
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "service-out")
TARGETS = {"max_overhead": 0.10, "min_scaling": 1.7}
POLL_S = 0.02
STORE_ROWS = ("local s3 x0", "local s3 x1", "service s3 x1", "local s3 x2", "service s3 x2")
BUCKET = "bench"


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

    def start(self, name: str, env: dict[str, str] | None = None) -> None:
        """Start worker `name`; `env` is added to the common environment (a machine's own folders)."""
        log = os.path.join(self.logs, f"{name}.log")
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                [sys.executable, "-m", "pipeline", "worker", "-n", f"{name}@%h", "--concurrency", "1",
                 "--pool", "prefork", "--without-mingle", "--without-gossip"],
                env={**self.env, **(env or {})}, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
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


def run_local(spec: Any, processes: int, storage_options: dict[str, Any] | None = None) -> float:
    from pipeline.prepare.job import prepare_dataset

    started = time.perf_counter()
    result = prepare_dataset(spec, workers=processes, storage_options=storage_options)
    seconds = time.perf_counter() - started
    assert result.samples + result.rejected == result.listed
    return seconds


def run_service(
    spec: Any, settings: Any, store: Any, storage_options: dict[str, Any] | None = None, phases: dict[str, float] | None = None
) -> float:
    """Submit the spec (with the job's non-secret store settings, if any) and wait until it succeeded.

    `phases`, when given, receives the seconds from submit to the plan's end
    (`planned_s`) and to the last shard's (`shards_done_s`), as the polling saw them.
    """
    from worker.client import submit_job

    payload: dict[str, Any] = {"spec": spec.to_dict()}
    if storage_options:
        payload["storage_options"] = storage_options
    started = time.perf_counter()
    job = submit_job("prepare", payload, settings, store)
    wait_succeeded(job, store, started, phases)
    return time.perf_counter() - started


def wait_succeeded(job: str, store: Any, started: float = 0.0, phases: dict[str, float] | None = None) -> Any:
    """Poll the job record until it is finished; its record, or SystemExit unless it succeeded."""
    while (record := store.require(job)).state not in ("succeeded", "failed", "cancelled"):
        if phases is not None and record.shards_total:
            phases.setdefault("planned_s", time.perf_counter() - started)
            if record.shards_done >= record.shards_total:
                phases.setdefault("shards_done_s", time.perf_counter() - started)
        time.sleep(POLL_S)
    if record.state != "succeeded":
        raise SystemExit(f"service job {job} ended {record.state}: {record.error}")
    return record


def measured(
    run: Callable[[], float], workers: Workers, s3: Store | None = None
) -> tuple[float, float | None, dict[str, float | None]]:
    """(seconds, noise share, CPU seconds) of one run.

    The workers' CPU counts as ours, not as noise, and so does the S3 server's
    (reported apart, as `store_cpu_s`).
    """
    own = common.cpu_seconds
    cpu_before, own_before = workers.cpu_seconds(), own()
    store_before = s3.cpu_seconds() if s3 is not None else None
    with common.NoiseMeter() as meter:
        seconds = run()
    workers_spent, own_spent = workers.cpu_seconds() - cpu_before, own() - own_before
    store_after = s3.cpu_seconds() if s3 is not None else None
    store_spent = store_after - store_before if store_after is not None and store_before is not None else None
    noise = meter.share
    if noise is not None:
        spent = workers_spent + (store_spent or 0.0)
        noise = max(0.0, noise - spent / (seconds * (os.cpu_count() or 1)))
    return seconds, noise, {"gpufeed_cpu_s": own_spent + workers_spent, "store_cpu_s": store_spent}


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
    parser.add_argument("--store", action="store_true", help="SRC and OUT on an S3 server (benchmarks/s3store.py) instead of local folders")
    parser.add_argument("--latency-ms", type=int, default=20, help="with --store: the delay of every store request")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM still stops Redis, the store and the workers

    data = os.path.abspath(ensure_data(args.data, args.n))
    images = len(common.list_jpegs(data))
    if args.store:
        report = main_store(args, data, images)
        if args.json_path:
            with open(args.json_path, "w") as handle:
                json.dump(report, handle, indent=2)
        if args.check and not all(report["targets_met"].values()):
            sys.exit(1)
        return
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
            seconds, noise, _ = measured(lambda: run_local(spec, processes), workers)
        else:
            seconds, noise, _ = measured(lambda: run_service(spec, settings, store), workers)
        rows[name]["runs_s"].append(round(seconds, 3))
        rows[name]["runs_noise"].append(None if noise is None else round(noise, 3))
        print(f"  {name:<11} {seconds:6.2f} s  (noise {noise if noise is None else f'{noise:.0%}'})", file=sys.stderr)


def ratios_and_verdicts(best: dict[str, float], local: str, service: str) -> tuple[dict[str, float], dict[str, bool]]:
    """The overheads and the scaling from the best seconds of rows named "<local> x1" ... "<service> x2", and the targets' verdicts."""
    ratios = {
        "overhead_x1": round(best[f"{service} x1"] / best[f"{local} x1"] - 1, 4),
        "overhead_x2": round(best[f"{service} x2"] / best[f"{local} x2"] - 1, 4),
        "scaling_2_workers": round(best[f"{service} x1"] / best[f"{service} x2"], 3),
        "local_scaling_2_processes": round(best[f"{local} x1"] / best[f"{local} x2"], 3),
    }
    met = {
        "overhead_x1 <= 10%": ratios["overhead_x1"] <= TARGETS["max_overhead"],
        "overhead_x2 <= 10%": ratios["overhead_x2"] <= TARGETS["max_overhead"],
        "scaling >= 1.7x": ratios["scaling_2_workers"] >= TARGETS["min_scaling"],
    }
    return ratios, met


def _report(rows: dict[str, dict[str, Any]], images: int, args: Any, data: str, workers_used: Any) -> dict[str, Any]:
    best = {name: min(row["runs_s"]) for name, row in rows.items()}
    for name, row in rows.items():
        row["seconds"] = best[name]
        row["images_per_s"] = round(images / best[name], 1)
    ratios, met = ratios_and_verdicts(best, "local", "service")
    for name, row in rows.items():
        print(f"{name:<11} {row['seconds']:6.2f} s  {row['images_per_s']:7.1f} images/s  runs {row['runs_s']} noise {row['runs_noise']}")
    print("targets: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in met.items()))
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


# ---------------------------------------------------------------------------
# --store: SRC and OUT on an S3 server, workers that share nothing but the store


def machine_env(root: str, name: str) -> dict[str, str]:
    """What a machine of its own has: its own temp folder, home and shard cache."""
    folders = {kind: os.path.join(root, "machines", name, kind) for kind in ("tmp", "home", "cache")}
    for folder in folders.values():
        os.makedirs(folder)
    return {"TMPDIR": folders["tmp"], "HOME": folders["home"], "GPUFEED_CACHE": folders["cache"]}


def job_storage_options(s3: Store) -> dict[str, Any]:
    """The job's store settings as `gpufeed submit prepare --storage-option endpoint_url=...` records them."""
    from pipeline.cli.common import parse_storage_options
    from worker.security import check_storage_options

    return check_storage_options(parse_storage_options((f"endpoint_url={s3.endpoint}",)))


def check_output(s3: Store, out: str, images: int) -> dict[str, Any]:
    """The run's manifest must exist on the store and count every image; then its prefix is removed."""
    from pipeline.io.fs import storage_options_for
    from pipeline.manifest import read_manifest

    with storage_options_for([out], s3.options):
        manifest = read_manifest(out)
    if manifest.samples != images:
        raise SystemExit(f"{out}: the manifest counts {manifest.samples} samples, expected {images}")
    s3.filesystem().rm(out.removeprefix("s3://"), recursive=True)
    return {"manifest_samples": manifest.samples, "manifest_shards": len(manifest.shards)}


def main_store(args: Any, data: str, images: int) -> dict[str, Any]:
    """The four --store rows; returns the report."""
    rows: dict[str, dict[str, Any]] = {
        name: {"runs_s": [], "runs_noise": [], "runs_detail": []} for name in STORE_ROWS
    }
    scratch = tempfile.mkdtemp(prefix="gpufeed-service-bench-")
    os.environ.setdefault("NO_PROXY", common.LOOPBACK)
    s3 = Store(scratch, 0)
    try:
        print(f"uploading {images} images to s3://{BUCKET}/raw …", file=sys.stderr)
        upload(s3, data, f"s3://{BUCKET}/raw")
        from pipeline.demo import make_demo_dataset

        warm_raw = os.path.join(scratch, "warmup-raw")
        make_demo_dataset(warm_raw, 8, min_side=96, max_side=160, workers=1)
        upload(s3, warm_raw, f"s3://{BUCKET}/warmup-raw")
        s3.set_latency(args.latency_ms)
        with private_redis(scratch) as url:
            roots = f"s3://{BUCKET}/"
            os.environ.update({"GPUFEED_BROKER_URL": url, "GPUFEED_ALLOWED_ROOTS": roots})
            common_env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFEED_", "AWS_"))}
            common_env.update({"GPUFEED_BROKER_URL": url, "GPUFEED_ALLOWED_ROOTS": roots})
            from worker.jobs import JobStore
            from worker.settings import get_settings

            settings = get_settings()
            store = JobStore(settings)
            workers = Workers({**common_env, **common.S3_CREDENTIALS_ENV}, scratch)
            submitter = {**common_env, **machine_env(scratch, "submitter")}  # no credentials: submit needs none
            try:
                for count, name in enumerate(("w1", "w2"), 1):
                    workers.start(name, env=machine_env(scratch, name))
                    _cli_warmup(s3, submitter, store, f"s3://{BUCKET}/warmup-out-{count}")
                    for round_ in range(args.rounds):
                        pair = [f"local s3 x{count}", f"service s3 x{count}"] + (["local s3 x0"] if count == 1 else [])
                        _store_round(pair if round_ % 2 == 0 else pair[::-1], round_, rows, images, args, settings, store, workers, s3)
            finally:
                workers.stop_all()
                store.client.close()
    finally:
        s3.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return _store_report(rows, images, args, data)


def _cli_warmup(s3: Store, env: dict[str, str], store: Any, out: str) -> None:
    """A tiny job of one-image shards through `gpufeed submit prepare --storage-option endpoint_url=...`."""
    command = [sys.executable, "-m", "pipeline", "submit", "prepare", f"s3://{BUCKET}/warmup-raw", out,
               "--shard-samples", "1", "--storage-option", f"endpoint_url={s3.endpoint}", "--json"]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise SystemExit(f"gpufeed submit prepare failed:\n{result.stdout}{result.stderr}")
    wait_succeeded(json.loads(result.stdout)["job"], store)


def _store_round(order: list[str], round_: int, rows: dict[str, dict[str, Any]], images: int, args: Any,
                 settings: Any, store: Any, workers: Workers, s3: Store) -> None:  # fmt: skip
    for name in order:
        common.wait_for_quiet(10)
        out = f"s3://{BUCKET}/out/{name.replace(' ', '-')}-{round_}"
        spec = make_spec(f"s3://{BUCKET}/raw", out, args.shard_count)
        processes = int(name[-1])
        s3.reset()
        if name.startswith("local"):
            seconds, noise, cpu = measured(lambda: run_local(spec, processes, s3.options), workers, s3)
            used: dict[str, int] = {}
        else:
            phases: dict[str, float] = {}
            options = job_storage_options(s3)
            seconds, noise, cpu = measured(lambda: run_service(spec, settings, store, options, phases), workers, s3)
            used = next(r.workers for r in store.list_jobs(1))
            cpu.update(phases)
        detail = {**cpu, "seconds": seconds, "max_reads_in_flight": s3.max_in_flight(), "shards_per_worker": used, **check_output(s3, out, images)}
        if name.startswith("service") and len(used) != processes:
            raise SystemExit(f"{name}: shards written by {sorted(used)}, expected {processes} workers")
        store_cpu = detail["store_cpu_s"]
        detail["store_cpu_share"] = None if store_cpu is None else round(store_cpu / (seconds * (os.cpu_count() or 1)), 3)
        rows[name]["runs_s"].append(round(seconds, 3))
        rows[name]["runs_noise"].append(None if noise is None else round(noise, 3))
        rows[name]["runs_detail"].append({k: round(v, 3) if isinstance(v, float) else v for k, v in detail.items()})
        share = detail["store_cpu_share"]
        print(
            f"  {name:<14} {seconds:6.2f} s  (noise {noise if noise is None else f'{noise:.0%}'}; "
            f"store CPU {store_cpu if store_cpu is None else f'{store_cpu:.1f} s, {share:.0%} of the CPUs'}; "
            f"gpufeed CPU {detail['gpufeed_cpu_s']:.1f} s{_phases_text(detail)})",
            file=sys.stderr,
        )


def _phases_text(detail: dict[str, Any]) -> str:
    """"; plan 2.1 s, shards 25.0 s, finalize 3.0 s" for a service run whose phases were seen."""
    planned, done, total = detail.get("planned_s"), detail.get("shards_done_s"), detail.get("seconds")
    if planned is None or done is None or total is None:
        return ""
    return f"; plan {planned:.1f} s, shards {done - planned:.1f} s, finalize {total - done:.1f} s"


def _store_report(rows: dict[str, dict[str, Any]], images: int, args: Any, data: str) -> dict[str, Any]:
    best = {name: min(row["runs_s"]) for name, row in rows.items()}
    for name, row in rows.items():
        row["seconds"] = best[name]
        row["images_per_s"] = round(images / best[name], 1)
        row["best_detail"] = row["runs_detail"][row["runs_s"].index(best[name])]
    ratios, met = ratios_and_verdicts(best, "local s3", "service s3")
    ratios["overhead_x1_vs_in_process"] = round(best["service s3 x1"] / best["local s3 x0"] - 1, 4)
    # The store runs on the cores being measured: beside one worker it takes the core that worker leaves
    # idle, beside two it takes time from both. Handed back, each row runs as on a machine without it.
    handed_back = {name: row["seconds"] * (1 - (row["best_detail"]["store_cpu_share"] or 0.0)) for name, row in rows.items()}
    ratios["scaling_2_workers_store_handed_back"] = round(handed_back["service s3 x1"] / handed_back["service s3 x2"], 3)
    print(f"{images} images, s3 -> s3, {args.latency_ms} ms per request, {args.shard_count} samples per shard")
    for name, row in rows.items():
        detail = row["best_detail"]
        share = detail["store_cpu_share"]
        print(
            f"{name:<14} {row['seconds']:6.2f} s  {row['images_per_s']:7.1f} images/s  runs {row['runs_s']} "
            f"noise {row['runs_noise']}  store CPU {detail['store_cpu_s']} s ({'-' if share is None else f'{share:.0%}'}), "
            f"gpufeed CPU {detail['gpufeed_cpu_s']} s, reads in flight <= {detail['max_reads_in_flight']}{_phases_text(detail)}"
        )
    print("targets: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in met.items()))
    print(
        f"service s3: overhead {ratios['overhead_x1']:+.1%} (1 process), {ratios['overhead_x2']:+.1%} (2 processes); "
        f"2 workers {ratios['scaling_2_workers']:.2f}x one worker (local 2 processes: {ratios['local_scaling_2_processes']:.2f}x); "
        f"1 worker vs prepare_dataset in one process (workers=0): {ratios['overhead_x1_vs_in_process']:+.1%}"
    )
    print(f"with the store's CPU handed back to each row: 2 workers {ratios['scaling_2_workers_store_handed_back']:.2f}x one worker")
    return {
        "mode": "store",
        "data": {"path": data, "images": images, "source": f"s3://{BUCKET}/raw"},
        "latency_ms": args.latency_ms,
        "shard_count": args.shard_count,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "available_processes": common.available_processes(),
        "load_average": os.getloadavg(),
        "rows": rows,
        "ratios": ratios,
        "targets": TARGETS,
        "targets_met": met,
    }


if __name__ == "__main__":
    main()
