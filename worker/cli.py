"""`gpufeed worker|beat|flower|submit|status|jobs|cancel|schedule`: the Celery service (SPEC §4).

Parsing and printing only: the service lives in `worker/`. Each command is a
`gpufeed.commands` entry point (pyproject.toml), so `gpufeed` finds it without
the library importing the service. Celery and Redis are imported inside the
commands, so `gpufeed --help` and the local commands stay fast, and a command
run without them says which extra to install.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from pipeline.cli.common import (
    Duration,
    exit_on_user_errors,
    fail,
    parse_storage_options,
    prepare_options,
    require_extra,
    reshard_options,
    reshard_spec,
    spec_from_options,
    top_command_name,
    with_prepare_option_names,
)
from pipeline.units import format_count, format_duration, format_rate, parse_bytes

PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True}
WAIT_POLL_S = 0.5
# A job still queued this long under `--wait` has the workers asked whether anyone consumes its queue
# (again every NO_WORKER_RECHECK_S until one does).
NO_WORKER_AFTER_S = 3.0
NO_WORKER_RECHECK_S = 10.0
LOGLEVEL_HELP = "Log level: DEBUG, INFO, WARNING, ERROR."

# The service's commands: errors as one line; Ctrl-C only stops this command, never a job.
user_errors = exit_on_user_errors("interrupted")
# What `pip install 'gpufeed[service]'` brings (pyproject.toml) and the commands import.
SERVICE_MODULES = ("celery", "redbeat", "redis")


def needs_service(func: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator: without the service extra the command exits 1 with the install line, not a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        name = top_command_name(click.get_current_context())
        require_extra("service", SERVICE_MODULES, f"gpufeed {name}")
        return func(*args, **kwargs)

    return wrapper


def _settings() -> Any:
    from .settings import get_settings

    return get_settings()


# ---------------------------------------------------------------------------
# Processes: worker, beat and flower


@click.command(context_settings=PASS_THROUGH)
@click.option("--concurrency", "-c", type=int, default=None, help="Processes (default: the cores of this machine).")
@click.option("-n", "--hostname", "name", default=None, help="Worker name, e.g. w1@%h (unique per worker on a machine).")
@click.option("--queues", "-Q", default=None, help="Queues to consume, comma-separated (default: GPUFEED_QUEUE).")
@click.option("--loglevel", "-l", default="INFO", show_default=True, help=LOGLEVEL_HELP)
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
@user_errors
@needs_service
def worker(concurrency: int | None, name: str | None, queues: str | None, loglevel: str, celery_args: tuple[str, ...]) -> None:
    """Run a Celery worker for gpufeed jobs; other options go to `celery worker` (e.g. --pool solo)."""
    settings = _settings()
    if not settings.allowed_roots:
        click.echo("gpufeed: warning: GPUFEED_ALLOWED_ROOTS is not set; this worker will refuse every job", err=True)
    from .app import app

    argv = ["worker", "--loglevel", loglevel, "--queues", queues or settings.queue]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    if name:
        argv += ["--hostname", name]
    sys.exit(app.worker_main(argv + list(celery_args)) or 0)


@click.command(context_settings=PASS_THROUGH)
@click.option("--loglevel", "-l", default="INFO", show_default=True, help=LOGLEVEL_HELP)
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
@user_errors
@needs_service
def beat(loglevel: str, celery_args: tuple[str, ...]) -> None:
    """Run the scheduler that fires `gpufeed schedule` entries (several beats are safe: one ticks at a time)."""
    _settings()
    from .app import app

    sys.exit(app.start(["beat", "--scheduler", "redbeat.RedBeatScheduler", "--loglevel", loglevel, *celery_args]) or 0)


@click.command(context_settings=PASS_THROUGH)
@click.option("--address", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(1, 65535), default=5555, show_default=True, help="Port of the web page and HTTP API.")
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
@user_errors
@needs_service
def flower(address: str, port: int, flower_args: tuple[str, ...]) -> None:
    """Run Flower on the service's broker: every worker and task, live; other options go to Flower (e.g. --basic-auth=USER:PASSWORD)."""
    require_extra("service", ("flower",), "gpufeed flower")
    _settings()
    from .app import app

    # Flower reads its own options in the --name=value form only.
    sys.exit(app.start(["flower", f"--address={address}", f"--port={port}", *flower_args]) or 0)


# ---------------------------------------------------------------------------
# Submitting jobs


def _wait_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--quiet", "-q", is_flag=True, help="No progress bar while waiting.")(func)
    func = click.option("--json", "as_json", is_flag=True, help='Print {"job": ID, ...} (with --wait: the final status).')(func)
    return click.option("--wait", is_flag=True, help="Wait for the job to finish, with a progress bar.")(func)


@click.group()
def submit() -> None:
    """Submit a job to the service (GPUFEED_BROKER_URL); prints its id."""


@submit.command("prepare")
@click.argument("src")
@click.argument("out")
@prepare_options
@_wait_options
@user_errors
@needs_service
def submit_prepare(
    src: str, out: str, force: bool, overwrite: bool, wait: bool, as_json: bool, quiet: bool, **options: Any
) -> None:
    """Prepare SRC into shards at OUT on the service's workers (same options as `gpufeed prepare`)."""
    from .security import absolute, check_storage_options

    spec = spec_from_options(absolute(src, "SRC"), absolute(out, "OUT"), options)
    payload: dict[str, Any] = {"spec": spec.to_dict(), "force": force, "overwrite": overwrite}
    store = parse_storage_options(options["storage_option"])
    if store:  # non-secret settings only (endpoint, profile …): a credential is refused, never recorded
        payload["storage_options"] = check_storage_options(store)
    _submit("prepare", payload, wait, as_json, quiet)


@submit.command("reshard")
@click.argument("dataset")
@reshard_options
@_wait_options
@user_errors
@needs_service
def submit_reshard(dataset: str, wait: bool, as_json: bool, quiet: bool, **options: Any) -> None:
    """Re-pack DATASET into new shards (no decoding), or re-augment it with a new seed, on the service."""
    from .security import absolute

    _submit("reshard", {"spec": reshard_spec(dataset, options, absolute).to_dict()}, wait, as_json, quiet)


@submit.command("bench-disk")
@click.argument("path")
@click.option("--file-size", default=None, help="Size of the test file (default 1GiB; larger than any cache).")
@click.option("--duration", type=Duration(), default=None, help="How long each read test runs (default 2s).")
@click.option("--threads", type=int, default=None, help="Reads in flight for the queue-depth-N figures (default 16).")
@_wait_options
@user_errors
@needs_service
def submit_bench_disk(
    path: str, file_size: str | None, duration: float | None, threads: int | None, wait: bool, as_json: bool, quiet: bool
) -> None:
    """Benchmark the disk behind PATH on a worker (like `gpufeed bench disk`, run where the data lives)."""
    from .security import absolute

    options = {"file_bytes": parse_bytes(file_size) if file_size else None, "duration_s": duration, "threads": threads}
    payload = {"path": absolute(path, "PATH"), "options": {k: v for k, v in options.items() if v is not None}}
    _submit("bench-disk", payload, wait, as_json, quiet)


def _submit(kind: str, payload: dict[str, Any], wait: bool, as_json: bool, quiet: bool) -> None:
    from .client import submit_job
    from .jobs import JobStore, redis_errors

    settings = _settings()
    with redis_errors(settings):
        store = JobStore(settings)
        job_id = submit_job(kind, payload, settings, store)
        if not wait:
            if as_json:
                click.echo(json.dumps({"job": job_id, "kind": kind, "state": "queued"}))
            else:
                click.echo(f"job {job_id} queued ({kind}); follow it with: gpufeed status {job_id}")
            return
        if not as_json:
            click.echo(f"job {job_id} queued ({kind})", err=True)
        try:
            record = _wait_for(store, job_id, show_bar=not quiet and not as_json)
        except KeyboardInterrupt:  # the job is the service's now: it goes on without us
            fail(
                f"stopped waiting; job {job_id} continues on the service: follow it with gpufeed status {job_id}, "
                f"stop it with gpufeed cancel {job_id}",
                130,
            )
    _print_status(record.to_status(), as_json)
    if record.state != "succeeded":
        sys.exit(1)


def no_worker_line(queue: str) -> str:
    """What to say when nobody consumes `queue`."""
    return (
        f"no worker is listening on queue {queue!r}, so the job waits: start one with gpufeed worker "
        "(with the same GPUFEED_BROKER_URL and GPUFEED_QUEUE)"
    )


class _WorkerWatch:
    """Under `--wait`: once a job has been queued a few seconds, ask whether any worker consumes its queue."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.started = time.monotonic()
        self.next_check = self.started + NO_WORKER_AFTER_S
        self.warned = False

    def check(self, record: Any) -> None:
        if record.state != "queued" or self.warned or time.monotonic() < self.next_check:
            return
        from .client import listening_workers

        if listening_workers(record.queue) == []:
            self.say(f"gpufeed: warning: {no_worker_line(record.queue)}")
            self.warned = True
        self.next_check = time.monotonic() + NO_WORKER_RECHECK_S


def _wait_for(store: Any, job_id: str, show_bar: bool) -> Any:
    from .jobs import FINAL

    if not show_bar or not sys.stderr.isatty():
        watch = _WorkerWatch(lambda line: click.echo(line, err=True))
        while (record := store.require(job_id)).state not in FINAL:
            watch.check(record)
            time.sleep(WAIT_POLL_S)
        return record
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]{task.fields[state]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("shards  {task.fields[samples]} samples  {task.fields[rate]:>6.0f} img/s"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(job_id, total=None, state="queued", samples=0, rate=0.0)
        watch = _WorkerWatch(lambda line: bar.console.print(line, markup=False, highlight=False))
        while True:
            record = store.require(job_id)
            watch.check(record)
            bar.update(
                task,
                total=record.shards_total or None,
                completed=record.shards_done,
                state=record.state,
                samples=record.samples,
                rate=record.images_per_s(),
            )
            if record.state in FINAL:
                return record
            time.sleep(WAIT_POLL_S)


# ---------------------------------------------------------------------------
# Following jobs


def _print_status(doc: dict[str, Any], as_json: bool) -> None:
    if doc["kind"] == "prepare" and doc.get("error"):  # a refused re-run names the settings that differ: as options
        doc = {**doc, "error": with_prepare_option_names(doc["error"])}
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"job {doc['job']}  {doc['kind']}  {doc['state']}")
    if doc.get("listening_workers") == []:
        click.echo(f"  {no_worker_line(doc['queue'])}")
    if doc.get("source") and doc.get("out") and doc["source"] != doc["out"]:
        click.echo(f"  {doc['source']} -> {doc['out']}")
    elif doc.get("out"):
        click.echo(f"  {doc['out']}")
    seconds = f", {format_duration(doc['seconds'])}" if doc.get("seconds") is not None else ""
    result = doc.get("result") or {}
    if doc["kind"] == "bench-disk":
        figures = {k: v for k, v in result.items() if isinstance(v, (int, float)) and k.endswith(("_mb_s", "_per_s", "_iops_qd1", "_iops_qdn"))}
        click.echo(f"  {result.get('device_kind', '')} {result.get('fstype', '')}{seconds}".rstrip())
        for name, value in figures.items():
            click.echo(f"  {name}: {value:.1f}")
    else:
        rate = f", {format_rate(doc['images_per_s'], digits=1)}" if doc["kind"] == "prepare" or result.get("reaugmented") else ""
        warned = f", decoded with warnings {doc['decoded_with_warnings']}" if doc.get("decoded_with_warnings") else ""
        click.echo(
            f"  shards {doc['shards_done']}/{doc['shards_total']}, samples {doc['samples']}, rejected {doc['rejected']}"
            f"{warned}{rate}{seconds}"
        )
    if doc["kind"] == "reshard" and result:
        click.echo(f"  {result['shards_before']} -> {result['shards_after']} shards per set, version {result['version'] or '(--out)'}")
    if doc.get("workers"):
        click.echo("  workers: " + ", ".join(f"{name} ({count})" for name, count in sorted(doc["workers"].items())))
    if doc.get("running"):
        click.echo("  running: " + ", ".join(f"{r['task']} on {r['worker']}" for r in doc["running"]))
    if doc.get("redispatched"):
        click.echo(f"  re-dispatched after a worker was lost: {format_count(doc['redispatched'], 'task')}")
    for warning in doc.get("warnings") or []:
        click.echo(f"  warning: {warning}")
    if doc.get("error") and doc["state"] != "cancelled":
        click.echo(f"  error: {doc['error']}")
    if doc["state"] == "succeeded" and result.get("manifest"):
        click.echo(f"  manifest: {result['manifest']}")


@click.command()
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@user_errors
@needs_service
def status(job: str, as_json: bool) -> None:
    """Show a job: state (queued, running, succeeded, failed, cancelled), shards, samples, rejects, images/s, error.

    JOB is a job id or its start, when that names one job. A queued job also
    says whether any worker is listening on its queue.
    """
    from .client import listening_workers
    from .jobs import JobStore, redis_errors

    settings = _settings()
    with redis_errors(settings):
        store = JobStore(settings)
        record = store.require(store.resolve(job))
    doc = record.to_status()
    if record.state == "queued":
        listening = listening_workers(record.queue)
        if listening is not None:
            doc["queue"], doc["listening_workers"] = record.queue, listening
    _print_status(doc, as_json)


@click.command()
@click.option("--limit", default=50, show_default=True, help="Most recent jobs shown.")
@click.option("--json", "as_json", is_flag=True, help="Print the jobs as JSON.")
@user_errors
@needs_service
def jobs(limit: int, as_json: bool) -> None:
    """List recent jobs, newest first."""
    from .jobs import JobStore, redis_errors

    settings = _settings()
    with redis_errors(settings):
        records = JobStore(settings).list_jobs(limit)
    docs = [record.to_status() for record in records]
    if as_json:
        click.echo(json.dumps(docs, indent=2))
        return
    if not docs:
        click.echo("no jobs")
        return
    click.echo(f"{'JOB':<12}  {'KIND':<10}  {'STATE':<9}  {'SHARDS':>9}  {'SAMPLES':>8}  {'CREATED':<25}  OUT")
    for doc in docs:
        shards = f"{doc['shards_done']}/{doc['shards_total']}"
        click.echo(
            f"{doc['job']:<12}  {doc['kind']:<10}  {doc['state']:<9}  {shards:>9}  {doc['samples']:>8}  "
            f"{doc['created'] or '':<25}  {doc['out'] or ''}"
        )


@click.command()
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print the job's status as JSON.")
@user_errors
@needs_service
def cancel(job: str, as_json: bool) -> None:
    """Cancel a job: no more of its shards start, running ones stop, partial shards are removed, no manifest.

    Finished shards are kept: submitting the same job again resumes it. JOB is
    a job id or its start, when that names one job.
    """
    from .client import cancel_job
    from .jobs import JobStore, redis_errors

    settings = _settings()
    with redis_errors(settings):
        store = JobStore(settings)
        job = store.resolve(job)
        record = cancel_job(job, settings, store)
    if as_json:
        click.echo(json.dumps(record.to_status(), indent=2))
    else:
        click.echo(f"job {job} cancelled; its partial shards are being removed (submit it again to resume)")


# ---------------------------------------------------------------------------
# Schedules


def _schedule_app() -> Any:
    """The Celery app for redbeat calls from the command line: fail fast instead of beat's patient retries."""
    from .app import app

    app.conf.redbeat_redis_options = {}
    return app


@click.group()
def schedule() -> None:
    """Recurring jobs kept in Redis and fired by `gpufeed beat`."""


@click.command("reshard")
@click.argument("dataset")
@reshard_options
def _scheduled_reshard(dataset: str, **options: Any) -> None:
    """Parses the job part of `schedule add NAME … reshard DATASET [options]`."""


@schedule.command("add", context_settings=PASS_THROUGH)
@click.argument("name")
@click.option("--every", default=None, help="Interval: 30m, 6h, 1d …")
@click.option("--cron", default=None, help="Crontab (UTC): 'minute hour day-of-month month day-of-week'.")
@click.option("--json", "as_json", is_flag=True, help="Print the schedule as JSON.")
@click.argument("job", nargs=-1, type=click.UNPROCESSED)
@user_errors
@needs_service
def schedule_add(name: str, every: str | None, cron: str | None, as_json: bool, job: tuple[str, ...]) -> None:
    """Add schedule NAME that runs JOB (`reshard DATASET [reshard options]`) --every INTERVAL or on --cron."""
    from .jobs import redis_errors
    from .schedules import add_schedule
    from .security import validate_job

    if not job or job[0] != "reshard":
        fail("give the job to schedule after the options: reshard DATASET [--multiple-of W …]", 2)
    from .security import absolute

    context = _scheduled_reshard.make_context("gpufeed schedule add NAME … reshard", list(job[1:]))
    params = dict(context.params)
    payload = {"spec": reshard_spec(params.pop("dataset"), params, absolute).to_dict()}
    settings = _settings()
    payload = validate_job("reshard", payload, settings)
    with redis_errors(settings):
        info = add_schedule(_schedule_app(), settings, name, "reshard", payload, every=every, cron=cron)
    if as_json:
        click.echo(json.dumps(info.to_dict(), indent=2))
    else:
        click.echo(f"schedule {info.name}: reshard {payload['spec']['dataset']} {info.when}; next run {info.next_run}")


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the schedules as JSON.")
@user_errors
@needs_service
def schedule_list(as_json: bool) -> None:
    """List the schedules, their next run and the last job each submitted."""
    from .jobs import redis_errors
    from .schedules import list_schedules

    settings = _settings()
    with redis_errors(settings):
        infos = list_schedules(_schedule_app(), settings)
    if as_json:
        click.echo(json.dumps([info.to_dict() for info in infos], indent=2))
        return
    if not infos:
        click.echo("no schedules")
    for info in infos:
        target = info.spec.get("spec", {}).get("dataset", "")
        last = f"; last job {info.last_job}" if info.last_job else ""
        skipped = f"; last run skipped: {info.last_error}" if info.last_error else ""
        click.echo(f"{info.name}: {info.kind} {target} {info.when}; next run {info.next_run}{last}{skipped}")


@schedule.command("remove")
@click.argument("name")
@user_errors
@needs_service
def schedule_remove(name: str) -> None:
    """Remove schedule NAME (jobs it already submitted go on)."""
    from .jobs import redis_errors
    from .schedules import remove_schedule

    settings = _settings()
    with redis_errors(settings):
        remove_schedule(_schedule_app(), settings, name)
    click.echo(f"schedule {name} removed")
