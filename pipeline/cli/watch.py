"""`gpufeed watch -- COMMAND…`: is a training run waiting for data, and on what (SPEC §3).

Parsing and printing only: the sampling and the verdict live in pipeline.measure.watching.run.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
from typing import TYPE_CHECKING

import click

from ..units import format_bytes
from .common import Duration, exit_on_user_errors, fail
from .measuring import plot_option

if TYPE_CHECKING:
    from ..measure.watching.run import WatchReport, WatchSample


WIDTH = 100  # live and report lines fit 100 columns (terminals of 80 wrap the report's long sentences)


def _live(s: WatchSample) -> None:
    stall = "stall  n/a" if s.stall_fraction is None else f"stall {100 * s.stall_fraction:3.0f}%"
    gpu = f" GPU {s.gpu_util:3.0f}% {format_bytes(s.gpu_memory or 0)}" if s.gpu_util is not None else ""
    busy = f" disk {100 * s.device_busy:.0f}%" if s.device_busy is not None else ""
    line = (
        f"watch {s.elapsed_s:4.0f}s {stall} {s.batches_per_s:5.1f} batch/s {s.images_per_s:5.0f} img/s{gpu} "
        f"CPU {s.cores_busy:.1f} (loop {s.loop_cores:.1f}) read {s.read_mb_s:.{0 if s.read_mb_s >= 100 else 1}f} MB/s{busy}"
    )
    click.echo(_fresh_row() + line[:WIDTH], err=True)


def _fresh_row() -> str:
    """On a terminal, a live line takes the current row from its start, cleared (carriage return, erase-line),
    as tqdm.write does: a progress bar that the command redraws with a carriage return and no newline is not
    glued to it, and comes back on the next row at its next update. Elsewhere (a file, a pipe) lines are plain."""
    try:
        return "\r\x1b[K" if sys.stderr.isatty() else ""
    except (AttributeError, ValueError):  # replaced, or closed
        return ""


def _wrapped(text: str, first: str, rest: str = "    ") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)


def _print_report(r: WatchReport) -> None:
    echo = lambda text="": click.echo(text, err=True)  # noqa: E731
    echo()
    echo(_wrapped(f"{shlex.join(r.command)} ran {r.seconds:.1f} s, exit code {r.exit_code}", "gpufeed watch: "))
    for loop in r.loops:
        rank = f"rank {loop.rank}" if loop.rank is not None else f"pid {loop.pid}"
        echo(_wrapped(
            f"{loop.role} loader {loop.site or loop.kind} ({rank}, {loop.kind}, {loop.num_workers} workers): "
            f"{loop.batches} batches, stall {loop.stall_fraction:.1%}, waited {loop.wait_s + loop.first_s:.2f} s "
            f"(first batches {loop.first_s:.2f} s), steps {loop.step_s:.2f} s", "  ",
        ))  # fmt: skip
    if r.records_dropped:
        echo(_wrapped(
            f"{r.records_dropped} records from the command were not valid records and were dropped "
            "(the figures use the rest)", "  ",
        ))  # fmt: skip
    if r.per_core_busy:
        echo(_wrapped("machine cores busy: " + " ".join(f"{busy:.0f} %" for busy in r.per_core_busy), "  "))
    cost = r.cost
    if cost:
        startup = f"start-up {cost['startup_s']:.2f} s, " if "startup_s" in cost else ""
        echo(_wrapped(
            f"watch's own cost: {startup}sampling {cost.get('cpu_s', 0.0):.2f} CPU s, "
            f"in the training process {cost.get('hook_cpu_s', 0.0):.2f} CPU s", "  ",
        ))  # fmt: skip
    verdict = r.verdict
    cause = f" ({verdict.cause})" if verdict.cause else ""
    echo(f"verdict: {verdict.bound}{cause}")
    for line in verdict.evidence:
        echo(_wrapped(line, "  measured: "))
    for line in verdict.undetermined:
        echo(_wrapped(line, "  cannot tell: "))
    echo(_wrapped(verdict.next_step, "next step: ", "  "))
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
    from ..measure.watching.run import run_watched

    if not command:
        fail("give the command to watch after --, e.g. gpufeed watch -- python train.py")
    for option, path in (("--json", json_file), ("--plot", plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if folder and not os.path.isdir(folder):
            fail(f"{option} {path}: the folder {folder} does not exist (checked before the run, not after it)")
    report = run_watched(list(command), interval_s=interval, on_sample=_live, startup_s=_startup_s())
    _print_report(report)
    if json_file:
        with open(json_file, "w", encoding="utf-8") as file:
            json.dump(report.to_dict(), file, indent=2, default=str)
    if plot:
        from ..measure import plots

        click.echo(f"plot: {plots.plot_watch(report, plot)}", err=True)
    sys.exit(report.exit_code or 0)


def _startup_s() -> float | None:
    """Seconds since this process started (the interpreter and the CLI's imports): watch's own start-up."""
    try:
        with open("/proc/self/stat", "rb") as file:
            started_ticks = int(file.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as file:
            uptime = float(file.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


COMMANDS = (watch,)
