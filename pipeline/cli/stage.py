"""`gpufeed stage DATASET DEST`: copy a prepared dataset to local disk, in parallel, verified, resumable.

Parsing and printing only: the work happens in `pipeline.stage`.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator

import click

from ..stage import STAGE_WORKERS, StageProgress, StageResult
from ..units import format_bytes, format_duration, format_rate
from .common import exit_on_user_errors, parse_storage_options, storage_option


@click.command()
@click.argument("dataset")
@click.argument("dest")
@click.option(
    "--workers", default=STAGE_WORKERS, show_default=True, help="Shards copied at once (I/O threads: set by latency, not cores)."
)
@click.option("--no-verify", is_flag=True, help="Keep shards already at DEST when their size is right, without re-hashing them.")
@storage_option("An fsspec option for the source's store, e.g. endpoint_url=http://… or anon=true (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@exit_on_user_errors("interrupted; the shards copied so far are kept, run the same command again to resume")
def stage(
    dataset: str, dest: str, workers: int, no_verify: bool, storage_option: tuple[str, ...], as_json: bool, quiet: bool
) -> None:
    """Copy DATASET (folder or URL) to the local folder DEST: every shard checked, the manifest last.

    Run it again after an interruption: shards already there and correct are kept.
    """
    from ..stage import stage_dataset

    options = parse_storage_options(storage_option)
    with _progress(enabled=not quiet and not as_json) as callback:
        result = stage_dataset(
            dataset, dest, workers=workers, verify=not no_verify, storage_options=options, progress=callback
        )
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    click.echo(summary_line(result))
    click.echo(f"dataset: {result.dest}")


def summary_line(result: StageResult) -> str:
    """`staged 12 shards, 3.1 GiB in 8.2 s = 405 MB/s; 4 already there`."""
    return (
        f"staged {result.copied} shards, {format_bytes(result.bytes_copied)} in {format_duration(result.seconds)} "
        f"= {format_rate(result.mb_per_s, 'MB/s')}; {result.already} already there"
    )


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[StageProgress], None] | None]:
    """A progress line on stderr (shards, bytes, MB/s) while the copy runs, on a terminal only."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn("[bold]stage"),
        BarColumn(),
        TextColumn("{task.fields[shards]} shards"),
        DownloadColumn(binary_units=True),
        TextColumn("{task.fields[rate]:>7.1f} MB/s"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("stage", total=None, shards="", rate=0.0)

        def update(state: StageProgress) -> None:
            rate = state.bytes_copied / state.seconds / 1e6 if state.seconds else 0.0
            bar.update(
                task,
                total=state.bytes_to_copy,
                completed=state.bytes_copied,
                shards=f"{state.shards_done}/{state.shards}",
                rate=rate,
            )

        yield update
