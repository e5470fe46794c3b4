"""`gpufeed bench disk|decode|loader`: storage, decoders and the loader measured on this machine (SPEC §3).

Parsing and printing only: the measurements live in pipeline.measure (disk, decode, loader, plots).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..errors import ConfigError
from ..units import format_bytes, format_count, parse_bytes
from .common import Duration, option_errors, renamed_option
from .measuring import (
    measure_errors,
    number_cell,
    parse_counts,
    parse_size,
    parse_sizes,
    plot_option,
    print_json,
    say_progress,
    text_table,
    write_plot,
)

if TYPE_CHECKING:
    from ..measure.disk.result import DiskBenchResult


@click.group()
def bench() -> None:
    """Measure storage, decoders and the loader on this machine."""


@bench.command("disk")
@click.argument("path")
@renamed_option(
    "--file-size", default="1GiB", show_default=True, old=("--size",), help="Test file size (larger than any device cache)."
)
@click.option("--block-sizes", default="1MiB,2MiB,4MiB", show_default=True, help="Sequential block sizes.")
@click.option(
    "--duration", type=Duration(), default="2s", show_default=True,
    help="How long each read test runs in all, split between its repeats (2, 0.5s, 1m).",
)
@click.option("--repeats", default=3, show_default=True, help="Runs of each read figure: the median is shown, with the spread.")
@click.option("--threads", default=16, show_default=True, help="Reads in flight for the queue-depth-N figures.")
@click.option("--small-file-size", default=None, help="Small-file size (default: the --dataset mean, else 110kB).")
@click.option("--dataset", default=None, help="Take the small-file size from this dataset's mean file size.")
@click.option("--small-files", default=512, show_default=True, help="How many small files to read.")
@click.option("--no-direct", is_flag=True, help="Do not try O_DIRECT; evict files with posix_fadvise instead.")
@click.option("--keep-cache", is_flag=True, help="Read through the page cache (no O_DIRECT, no eviction): the cache's figures.")
@click.option(
    "--tests",
    default="seq_write,seq_read,randread,small_files",
    show_default=True,
    help="Which tests to run, comma-separated: seq_write, seq_read, randread, small_files.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@plot_option("Write a PNG chart (IOPS vs threads, MB/s vs block size).")
@measure_errors
def bench_disk(
    path: str,
    file_size: str,
    block_sizes: str,
    duration: float,
    repeats: int,
    threads: int,
    small_file_size: str | None,
    dataset: str | None,
    small_files: int,
    no_direct: bool,
    keep_cache: bool,
    tests: str,
    as_json: bool,
    plot: str | None,
) -> None:
    """Sequential and random read speed, latency and small-file reads of the storage under PATH."""
    from ..measure.disk.bench import benchmark_disk, mean_file_bytes, remember_result

    small = parse_bytes(small_file_size) if small_file_size else (mean_file_bytes(dataset) if dataset else None)
    say_progress(f"measuring {path}")
    result = benchmark_disk(
        path,
        file_bytes=parse_size(file_size, "--file-size"),
        block_sizes=parse_sizes(block_sizes, "--block-sizes"),
        duration_s=duration,
        threads=threads,
        small_file_bytes=small,
        small_files=small_files,
        tests=[name.strip() for name in tests.split(",") if name.strip()],
        direct=False if no_direct else None,
        repeats=repeats,
        keep_cache=keep_cache,
    )
    remember_result(result)  # the ceiling `gpufeed watch` compares a run's reads with
    write_plot("disk", plot, result)
    if as_json:
        print_json(result.to_dict())
        return
    free = format_bytes(result.free_bytes)
    click.echo(f"{result.path}: {result.device_kind} ({result.fstype}{', ' + result.device if result.device else ''}), {free} free")
    if result.kind_note:
        click.echo(f"note: {result.kind_note}")
    click.echo(
        f"page cache bypass: {result.cache_bypass}; test file {format_bytes(result.file_bytes)}, {duration:g} s per test "
        f"in {format_count(result.repeats, 'run')}: medians, with the runs' range"
    )
    click.echo(text_table(_disk_rows(result), ("test", "median", "", "range", "p50 ms", "p99 ms"), "lrllrr"))
    if result.seq_read_block:
        click.echo(
            f"sequential read: {number_cell(result.seq_read_mb_s)} MB/s "
            f"(median at {format_bytes(result.seq_read_block)} blocks, the block size with the highest median)"
        )
    for warning in result.warnings:
        click.echo(f"gpufeed: warning: {warning}", err=True)


def _disk_rows(result: DiskBenchResult) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    if result.seq_write_mb_s is not None:
        rows.append(("sequential write (fsync included)", number_cell(result.seq_write_mb_s), "MB/s", "1 run", "", ""))
    for block, rate in sorted(result.seq_read_by_block.items()):
        spread = _range_cell(result, f"seq_read_mb_s:{block}")
        rows.append((f"sequential read, {format_bytes(block)} blocks", number_cell(rate), "MB/s", spread, "", ""))
    for point in result.randread_sweep:
        rows.append(
            (f"random 4 KiB read, {format_count(point.threads, 'thread')}", number_cell(point.iops), "IOPS",
             _range_cell(result, f"randread_4k_iops:{point.threads}"), f"{point.p50_ms:.3f}", f"{point.p99_ms:.3f}")
        )
    small_size = format_bytes(result.small_file_bytes)
    if result.small_file_reads_per_s is not None:
        for count, files in ((1, result.small_file_reads_per_s_qd1), (result.threads, result.small_file_reads_per_s)):
            name = f"small files ({small_size}), {format_count(count, 'thread')}"
            rows.append((name, number_cell(files), "files/s", _range_cell(result, f"small_file_reads_per_s:{count}"), "", ""))
    return rows


def _range_cell(result: DiskBenchResult, name: str) -> str:
    """The runs' lowest and highest, and a mark when they disagree by more than the margin."""
    figure = result.figures.get(name)
    if figure is None or len(figure.runs) < 2:
        return ""
    mark = " unsteady" if name in result.unsteady else ""
    return f"{number_cell(figure.low)}-{number_cell(figure.high)}{mark}"


def _decoder_names(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    from ..measure.decode import decoder_name

    try:
        return tuple(decoder_name(value) for value in values)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


@bench.command("decode")
@click.argument("src")
@click.option("--sample", default=32, show_default=True, help="Images sampled from SRC.")
@click.option("--size", default=256, show_default=True, help="Shorter side of the prepared copy in pixels (prepare --size).")
@renamed_option(
    "--crop",
    default=224,
    show_default=True,
    old=("--target",),
    help="The training input in pixels: every decode is resized to this shorter side (region: a crop this size).",
)
@click.option("--quality", default=90, show_default=True, help="JPEG quality of the prepared copy.")
@renamed_option(
    "--duration",
    type=Duration(),
    default="0.5s",
    show_default=True,
    old=("--seconds",),
    help="Minimum time measured per decoder and sample (0.5, 2s).",
)
@click.option(
    "--decoder",
    "decoders",
    multiple=True,
    callback=_decoder_names,
    help="Only this decoder (repeatable): region (the loader's), pil, pil-draft, simplejpeg, pyturbojpeg, opencv.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@plot_option("Write a PNG chart (images/s per core by decoder).")
@measure_errors
def bench_decode(
    src: str, sample: int, size: int, crop: int, quality: int, duration: float, decoders: tuple[str, ...],
    as_json: bool, plot: str | None,
) -> None:
    """Per-core decode + resize images/s on a sample of SRC, raw vs prepared, for each decoder."""
    from ..measure.decode import benchmark_decode

    say_progress(f"decoding a sample of {src}")
    result = benchmark_decode(
        src, sample=sample, target=crop, size=size, quality=quality, min_seconds=duration, decoders=list(decoders) or None
    )
    write_plot("decode", plot, result)
    if as_json:
        print_json(result.to_dict())
        return
    click.echo(
        f"{result.samples} images of {src}: raw {result.raw_mean_pixels / 1e6:.2f} MP, {result.raw_mean_bytes / 1e3:.0f} kB; "
        f"prepared (shorter side {result.prepared_size}) {result.prepared_mean_pixels / 1e6:.2f} MP, "
        f"{result.prepared_mean_bytes / 1e3:.0f} kB JPEG q{result.quality}, {result.npy_mean_bytes / 1e3:.0f} kB .npy"
    )
    click.echo(f"images/s per core, decode + resize to shorter side {result.target}:")
    rows = [
        (row.decoder, number_cell(row.raw_images_per_s), number_cell(row.prepared_images_per_s),
         f"{row.speedup:.1f}x" if row.speedup else "", row.note)
        for row in result.rows
    ]
    click.echo(text_table(rows, ("decoder", "raw", "prepared", "speedup", "note"), "lrrrl"))


STALL_MEANING = "stall: the share of the training loop's time spent waiting for data"


@bench.command("loader")
@click.argument("dataset")
@renamed_option(
    "--num-workers",
    default=None,
    old=("--workers",),
    help="The loader's num_workers values to measure, e.g. 1,2,4 (default: 1,2,4 … 2 x cores).",
)
@click.option("--batch-size", default=64, show_default=True, help="Samples per batch.")
@click.option(
    "--gpu-images-per-s",
    type=float,
    default=None,
    help="Simulated consumer rate; without it the consumer is infinitely fast and there is no stall to measure.",
)
@renamed_option(
    "--duration",
    type=Duration(),
    default="2s",
    show_default=True,
    old=("--seconds",),
    help="Time measured per num_workers value (2, 0.5s, 1m).",
)
@click.option("--device", default="auto", show_default=True, help="The loader's device: auto, cpu, cuda.")
@click.option(
    "--worker-type",
    type=click.Choice(["thread", "process"]),
    default="thread",
    show_default=True,
    help="Decode in threads of this process or in worker processes.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@plot_option("Write a PNG chart (images/s, and the stall fraction against a consumer rate, vs num_workers).")
@measure_errors
def bench_loader(
    dataset: str, num_workers: str | None, batch_size: int, gpu_images_per_s: float | None, duration: float,
    device: str, worker_type: str, as_json: bool, plot: str | None,
) -> None:
    """The loader's images/s (and stall fraction, against --gpu-images-per-s) over DATASET for a range of num_workers."""
    from ..measure.loader import benchmark_loader

    say_progress(f"running the loader over {dataset}")
    with option_errors({"batch_size": "--batch-size", "num_workers": "--num-workers"}):
        result = benchmark_loader(
            dataset,
            workers=parse_counts(num_workers, "--num-workers") if num_workers else None,
            batch_size=batch_size,
            consumer_images_per_s=gpu_images_per_s,
            min_seconds=duration,
            device=device,
            worker_type=worker_type,
        )
    write_plot("loader", plot, result)
    if as_json:
        print_json(result.to_dict())
        return
    consumer = f"a consumer of {gpu_images_per_s:g} images/s" if gpu_images_per_s else "an infinitely fast consumer"
    click.echo(f"loader over {dataset}, batch {batch_size}, {worker_type} workers, against {consumer}:")
    rows: list[tuple[str, ...]] = []
    for p in result.points:
        busy = "n/a" if p.others_cpu_share is None else f"{p.others_cpu_share:.0%}"
        # Against an infinitely fast consumer the loop always waits for data: that says nothing, so no column.
        stall = (f"{p.stall_fraction:.1%}",) if gpu_images_per_s else ()
        rows.append((str(p.num_workers), number_cell(p.images_per_s), *stall, busy))
    header = ("num_workers", "images/s", *(("stall",) if gpu_images_per_s else ()), "CPU used by other processes")
    click.echo(text_table(rows, header))
    if gpu_images_per_s:
        click.echo(f"({STALL_MEANING})")
    click.echo(f"best: num_workers={result.best.num_workers} ({result.best.images_per_s:.0f} images/s)")


COMMANDS = (bench,)
