"""Terminal output for the CLI: the progress bar and the summaries (rich, on stderr/stdout)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..prepare.job import PrepareProgress, PrepareResult
from ..units import format_count, format_duration, format_rate


@contextlib.contextmanager
def prepare_progress(enabled: bool = True) -> Iterator[Callable[[PrepareProgress], None] | None]:
    """A progress bar on stderr (images/s, rejects, ETA) while a prepare runs."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn("[bold]prepare"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>8.0f} img/s"),
        TextColumn("{task.fields[rejected]} rejected"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("prepare", total=None, rate=0.0, rejected=0)

        def update(state: PrepareProgress) -> None:
            rate = state.done / state.seconds if state.seconds else 0.0
            bar.update(task, total=state.total, completed=state.done, rate=rate, rejected=state.rejected)

        yield update


def summary_console(stderr: bool = False) -> Any:
    """The rich Console of the summaries: lines never hard-wrapped, also into a pipe or a file.

    On a terminal the terminal wraps long lines itself (soft wrap); elsewhere
    rich would break them at 80 columns, inside numbers and paths, and `grep`
    would miss them: there the width is unbounded. User data printed through
    it must be escaped (`escape`) or printed with ``markup=False``.
    """
    from rich.console import Console

    console = Console(stderr=stderr, soft_wrap=True)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, soft_wrap=True, width=UNBOUNDED_WIDTH)


UNBOUNDED_WIDTH = 1 << 16  # "no wrapping" for rich's layout (tables), where a pipe has no width


def escape(text: object) -> str:
    """`text` as rich prints it literally: a path like ``out/data[/]`` or ``s3://b/[red]x`` is not markup."""
    from rich.markup import escape as rich_escape

    return rich_escape(str(text))


def print_prepare_summary(result: PrepareResult) -> None:
    console = summary_console()
    out = escape(result.out)
    if result.already_complete:
        checked = "sha256" if result.verified else "size"
        console.print(f"{out}: already prepared with these settings, every shard at its recorded {checked}; nothing to do")
    if result.repaired:
        damage = escape(", ".join(f"{path} {problem}" for path, problem in result.repaired.items()))
        console.print(f"rewrote {len(result.repaired)} of {format_count(result.shards, 'shard')}: {damage}")
    resumed = (
        f", {result.resumed_shards} kept from an earlier run"
        if result.resumed_shards and not result.already_complete and not result.repaired
        else ""
    )
    warned = f", {result.decoded_with_warnings} decoded with warnings" if result.decoded_with_warnings else ""
    console.print(
        f"[bold green]done[/]: {format_count(result.samples, 'sample')}{warned}, {result.rejected} rejected "
        f"(of {result.listed} listed), {format_count(result.shards, 'shard')}{resumed}, {result.bytes / 1e6:.1f} MB"
    )
    if result.processed:
        console.print(
            f"{format_count(result.processed, 'image')} in {format_duration(result.seconds)} = {format_rate(result.images_per_s)} "
            f"with {format_count(result.workers or 1, 'worker process', 'worker processes')}"
        )
    if result.task != "classification" or result.boxes_dropped:
        dropped = f", {format_count(result.boxes_dropped, 'box', 'boxes')} dropped by the geometry (under --min-visible)" if result.boxes_dropped else ""
        console.print(f"task: {escape(result.task)}{dropped}")
    if result.rejected:
        console.print(f"rejected files and reasons: {escape(result.out.rstrip('/'))}/rejected.jsonl")
    console.print(f"manifest: {escape(result.out.rstrip('/'))}/manifest.json")


def print_inspect(summary: dict[str, Any], manifest: Any) -> None:
    from rich.table import Table

    console = summary_console()
    table = Table(show_header=False, box=None)
    for name in ("dataset", "task", "samples", "classes", "fields", "variants", "shards", "bytes", "rejected", "format", "size", "mode", "created"):
        table.add_row(name, escape(summary[name]))
        if name == "rejected" and summary.get("decoded_with_warnings"):  # the samples' json say what was warned about
            table.add_row("decoded with warnings", str(summary["decoded_with_warnings"]))
    console.print(table)
    if manifest.classes:
        shown = ", ".join(manifest.classes[:10]) + (" ..." if len(manifest.classes) > 10 else "")
        console.print(f"classes: {escape(shown)}")
    if "verified" in summary:
        if summary["verified"]:
            console.print("[bold green]verified[/]: every shard matches its sha256, size and sample count")
        else:
            console.print(f"[bold red]verification failed[/]: {format_count(len(summary['problems']), 'problem')}")
            for problem in summary["problems"]:
                console.print(f"  {problem}", markup=False)
