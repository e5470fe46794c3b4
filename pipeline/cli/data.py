"""`gpufeed prepare|inspect|reshard|demo-data|doctor`: making, checking and reshaping datasets on this machine.

Parsing and printing only: the work happens in `pipeline.prepare`, `pipeline.manifest`,
`pipeline.demo` and `pipeline.measure.doctor`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import click

from ..errors import JobConflictError
from .common import (
    MISMATCH,
    parse_storage_options,
    prepare_options,
    renamed_option,
    reshard_options,
    reshard_spec,
    spec_from_options,
    user_errors,
    with_flag_options,
    with_prepare_option_names,
)


@click.command()
@click.argument("src")
@click.argument("out")
@prepare_options
@click.option("--workers", type=int, default=None, help="Processes (default: available cores; 0: in-process).")
@click.option("--strict", is_flag=True, help="Exit non-zero at the first rejected file, publishing nothing.")
@click.option(
    "--verify", is_flag=True, help="When OUT is already prepared, check every shard's sha256 (not only its size) and rewrite those that differ."
)
@click.option("--json", "as_json", is_flag=True, help="Print the final summary as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@user_errors
def prepare(
    src: str,
    out: str,
    workers: int | None,
    strict: bool,
    force: bool,
    overwrite: bool,
    verify: bool,
    as_json: bool,
    quiet: bool,
    **options: Any,
) -> None:
    """Prepare SRC into WebDataset shards at OUT.

    SRC is a folder (ImageFolder, COCO, YOLO, Pascal VOC, segmentation), a
    CSV/JSONL list, a COCO JSON, a YOLO data.yaml, WebDataset shards, or a
    URL of one. A YOLO dataset's splits are separate datasets: each goes
    into OUT/<split> (train, val, test), or --split NAME prepares one.

    Run again, it does what is left: an interrupted run resumes, and missing or
    damaged shards of a finished one are written again.
    """
    from ..prepare.formats.yolo_splits import splits_of
    from ..prepare.job import prepare_dataset

    spec = spec_from_options(src, out, options)
    store = parse_storage_options(options["storage_option"])
    from .progress import prepare_progress, print_prepare_summary

    jobs = [spec] if spec.split is not None else [
        dataclasses.replace(spec, split=name, out=f"{out.rstrip('/')}/{name}") for name in splits_of(src)
    ] or [spec]  # fmt: skip
    results = {}
    for job in jobs:
        if len(jobs) > 1 and not as_json:
            click.echo(f"split {job.split}: {job.out}")
        try:
            with prepare_progress(enabled=not quiet) as callback:
                result = prepare_dataset(
                    job,
                    workers=workers,
                    force=force,
                    overwrite=overwrite,
                    strict=strict,
                    verify=verify,
                    progress=callback,
                    storage_options=store,
                )
        except JobConflictError as exc:  # it names the settings that differ: here, as their options
            raise JobConflictError(with_prepare_option_names(str(exc))) from exc
        for warning in result.warnings:
            click.echo(f"gpufeed: warning: {with_flag_options(warning)}", err=True)
        if not as_json:
            print_prepare_summary(result)
        results[job.split] = result
    if as_json:
        only = results.get(spec.split) if len(jobs) == 1 else None
        payload = only.to_dict() if only is not None else {"splits": {name: r.to_dict() for name, r in results.items()}}
        click.echo(json.dumps(payload, indent=2))


@click.command()
@click.argument("dataset")
@click.option("--verify", is_flag=True, help="Re-read every shard: sha256, sizes and sample counts.")
@click.option(
    "--links-outside",
    is_flag=True,
    help="With --verify: read shards that are links to files outside the dataset's folder (refused by default).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@user_errors
def inspect(dataset: str, verify: bool, links_outside: bool, as_json: bool) -> None:
    """Summarise a prepared DATASET (folder, URL or manifest.json); --verify checks every byte."""
    from ..io.output import Output
    from ..manifest import read_manifest, verify_dataset

    root = dataset[: -len("/manifest.json")] if dataset.endswith("/manifest.json") else dataset
    output = Output(root)
    manifest = read_manifest(output)
    summary: dict[str, Any] = {
        "dataset": root,
        "task": manifest.task,
        "samples": manifest.samples,
        "classes": len(manifest.classes),
        "fields": ", ".join(manifest.fields),
        "variants": manifest.variants,
        "shards": len(manifest.shards),
        "bytes": sum(s.bytes for s in manifest.shards),
        "rejected": manifest.rejected,
        "decoded_with_warnings": manifest.decoded_with_warnings,
        "format": manifest.params.get("encode", {}).get("format"),
        "size": manifest.params.get("resize", {}).get("size"),
        "mode": manifest.params.get("resize", {}).get("mode"),
        "created": manifest.created,
    }
    result = verify_dataset(output, manifest, links_outside=links_outside) if verify else None
    if result is not None:
        summary["verified"] = result.ok
        summary["problems"] = result.problems
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        from .progress import print_inspect

        print_inspect(summary, manifest)
    if result is not None and not result.ok:
        sys.exit(MISMATCH)


@click.command()
@click.argument("dataset")
@reshard_options
@click.option("--workers", type=int, default=None, help="Prepare processes when re-augmenting (default: available cores).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@user_errors
def reshard(dataset: str, workers: int | None, as_json: bool, **options: Any) -> None:
    """Re-pack DATASET into new shards without decoding (or --reaugment it), here, without the service."""
    from ..prepare.reshard import reshard_dataset

    result = reshard_dataset(reshard_spec(dataset, options), workers=workers)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    where = f"version {result.version}" if result.version else result.out
    click.echo(
        f"{'re-augmented' if result.reaugmented else 're-packed'} {result.dataset}: {result.shards_before} -> "
        f"{result.shards_after} shards per set ({where}), {result.samples} samples, verified, in {result.seconds:.1f} s"
    )
    if result.removed:
        click.echo("removed old versions: " + ", ".join(v or "(original)" for v in result.removed))


@click.command("demo-data")
@click.argument("directory")
@renamed_option("-n", "--count", "count", default=1000, show_default=True, old=("--n",), help="Number of images.")
@click.option("--classes", default=4, show_default=True, help="Number of class folders (1-6).")
@click.option("--min-side", default=800, show_default=True, help="Smallest width or height of an image, in pixels.")
@click.option("--max-side", default=1600, show_default=True, help="Largest width or height of an image, in pixels.")
@click.option("--seed", default=0, show_default=True, help="Seed of the images (the same seed writes the same files).")
@click.option("--workers", type=int, default=None, help="Processes (default: available cores).")
@user_errors
def demo_data(directory: str, count: int, classes: int, min_side: int, max_side: int, seed: int, workers: int | None) -> None:
    """Generate a photo-like ImageFolder dataset of JPEGs in DIRECTORY."""
    from ..demo import make_demo_dataset

    result = make_demo_dataset(
        directory, count, classes=classes, min_side=min_side, max_side=max_side, seed=seed, workers=workers
    )
    click.echo(
        f"wrote {result.images} images in {len(result.classes)} classes to {result.root} "
        f"({result.bytes / 1e6:.1f} MB, {result.bytes / result.images / 1e3:.0f} KB per image)"
    )


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--redis-url", default=None, help="Redis to check (default: GPUFEED_BROKER_URL or localhost).")
def doctor(as_json: bool, redis_url: str | None) -> None:
    """Report Python, torch, the PIL build and its codecs, decoders, cores and Redis."""
    from ..measure.doctor import collect_report, format_report

    report = collect_report(redis_url=redis_url)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))


COMMANDS = (prepare, inspect, reshard, demo_data, doctor)
