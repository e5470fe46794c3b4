"""`gpufeed watch -- COMMAND…`: is a training run waiting for data, and on what (SPEC §3).

Parsing and printing only: the sampling and the verdict live in pipeline.measure.watcher.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import TYPE_CHECKING

import click

from ..units import format_bytes
from .common import Duration, exit_on_user_errors, fail
from .measuring import plot_option

if TYPE_CHECKING:
    from ..measure.watcher import WatchReport, WatchSample


def _live(s: WatchSample) -> None:
    stall = "stall   n/a" if s.stall_fraction is None else f"stall {100 * s.stall_fraction:3.0f} %"
    gpu = ""
    if s.gpu_util is not None:
        gpu = f"  GPU {s.gpu_util:3.0f} % {format_bytes(s.gpu_memory or 0)}"
    click.echo(
        f"gpufeed watch: {s.elapsed_s:6.0f} s  {stall}  {s.batches_per_s:6.1f} batches/s  "
        f"{s.images_per_s:7.0f} images/s{gpu}  CPU {s.cores_busy:.1f} cores "
        f"(training {s.loop_cores:.1f}, workers {s.worker_cores:.1f})  "
        f"disk {s.read_mb_s:.1f} MB/s {s.reads_per_s:.0f} read calls/s"
        + (f" ({s.device}: {s.device_iops:.0f} IOPS)" if s.device and s.device_iops is not None else ""),
        err=True,
    )


def _print_report(r: WatchReport) -> None:
    echo = lambda text="": click.echo(text, err=True)  # noqa: E731
    echo()
    echo(f"gpufeed watch: {shlex.join(r.command)} ran {r.seconds:.1f} s, exit code {r.exit_code}")
    for loop in r.loops:
        rank = f"rank {loop.rank}" if loop.rank is not None else "process"
        echo(
            f"  {rank} (pid {loop.pid}, {loop.kind}, {loop.num_workers} workers): {loop.batches} batches, "
            f"stall {loop.stall_fraction:.1%}, waited {loop.wait_s:.2f} s, steps {loop.step_s:.2f} s, "
            f"first batch {loop.first_s:.2f} s"
        )
    if r.records_dropped:
        echo(f"  {r.records_dropped} records from the command were not valid records and were dropped (the figures use the rest)")
    if r.per_core_busy:
        echo("  machine cores busy: " + " ".join(f"{busy:.0f} %" for busy in r.per_core_busy))
    verdict = r.verdict
    cause = f" ({verdict.cause})" if verdict.cause else ""
    echo(f"verdict: {verdict.bound}{cause}")
    for line in verdict.evidence:
        echo(f"  measured: {line}")
    for line in verdict.undetermined:
        echo(f"  cannot tell: {line}")
    echo(f"next step: {verdict.next_step}")
    if verdict.predicted_speedup is not None and verdict.predicted_speedup != float("inf"):
        echo(f"predicted: up to {verdict.predicted_speedup:.1f}x the loop's speed")


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--interval", type=Duration(), default="5s", show_default=True, help="Seconds between live lines.")
@click.option(
    "--json", "json_file", type=click.Path(dir_okay=False, writable=True), default=None, metavar="FILE",
    help="Write the report as JSON to FILE.",
)  # fmt: skip
@plot_option("Draw stall, GPU and CPU over time into FILE.png.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@exit_on_user_errors("interrupted")
def watch(interval: float, json_file: str | None, plot: str | None, command: tuple[str, ...]) -> None:
    """Run COMMAND unchanged and tell whether its training loop waits for data, and on what.

    Every torch DataLoader and gpufeed Loader the command iterates is timed (all ranks of torchrun,
    python -m, accelerate launch), beside CPU per process, disk reads and, through NVML, the GPUs.
    The exit code is COMMAND's; Ctrl-C reaches it.

    Example: gpufeed watch --interval 10 -- python train.py --epochs 1
    """
    from ..measure.watcher import run_watched

    if not command:
        fail("give the command to watch after --, e.g. gpufeed watch -- python train.py")
    for option, path in (("--json", json_file), ("--plot", plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if folder and not os.path.isdir(folder):
            fail(f"{option} {path}: the folder {folder} does not exist (checked before the run, not after it)")
    report = run_watched(list(command), interval_s=interval, on_sample=_live)
    _print_report(report)
    if json_file:
        with open(json_file, "w", encoding="utf-8") as file:
            json.dump(report.to_dict(), file, indent=2, default=str)
    if plot:
        from ..measure import plots

        click.echo(f"plot: {plots.plot_watch(report, plot)}", err=True)
    sys.exit(report.exit_code or 0)


COMMANDS = (watch,)
