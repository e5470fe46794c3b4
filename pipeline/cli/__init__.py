"""The `gpufeed` command: parsing and printing only; the work happens in the library."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

from ..errors import GpufeedError
from ..specs import AugmentSpec, EncodeSpec, PrepareSpec, ResizeSpec, ShardSpec
from ..units import parse_bytes

SUCCESS, FAILURE, MISMATCH = 0, 1, 3


def fail(message: str, code: int = FAILURE) -> NoReturn:
    click.echo(f"gpufeed: error: {message}", err=True)
    sys.exit(code)


def exit_on_user_errors(interrupted: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: gpufeed errors become one line and exit 1; Ctrl-C prints `interrupted`, exit 130."""
    import functools

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except GpufeedError as exc:
                fail(str(exc))
            except KeyboardInterrupt:
                fail(interrupted, 130)

        return wrapper

    return decorate


user_errors = exit_on_user_errors("interrupted; complete shards are kept, run the same command again to resume")


class _Gpufeed(click.Group):
    """The `gpufeed` group: a usage error is one `gpufeed: error:` line, like every other error."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            _usage_error(exc)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            _usage_error(exc)


def _usage_error(exc: click.UsageError) -> NoReturn:
    if isinstance(exc, getattr(click.exceptions, "NoArgsIsHelpError", ())):
        raise exc  # `gpufeed` alone: click prints the help
    hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
    fail(exc.format_message() + hint, 2)


def _pair(text: str, name: str) -> tuple[float, float]:
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected two numbers LOW,HIGH, got {text!r}", param_hint=name) from None
    return low, high


@click.group(cls=_Gpufeed, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="gpufeed")
def main() -> None:
    """gpufeed keeps GPUs fed: prepare image datasets into fast shards, measure, advise."""


def prepare_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The options that make a PrepareSpec (shared by `prepare` and `submit prepare`); see `spec_from_options`."""
    options = [
        click.option("--size", default=256, show_default=True, help="Target size S in pixels."),
        click.option(
            "--mode",
            type=click.Choice(["shorter", "longer", "center-crop", "pad", "none"]),
            default="shorter",
            show_default=True,
            help="shorter: shorter side S; longer: fit in SxS; center-crop: SxS; pad: fit and pad to SxS.",
        ),
        click.option("--upscale", is_flag=True, help="Enlarge images smaller than the target."),
        click.option("--resample", type=click.Choice(["lanczos", "bicubic", "bilinear"]), default="lanczos", show_default=True),
        click.option("--format", "fmt", type=click.Choice(["jpeg", "webp", "png", "npy"]), default="jpeg", show_default=True),
        click.option("--quality", default=90, show_default=True, help="JPEG/WebP quality."),
        click.option(
            "--jpeg-restart",
            default=1,
            show_default=True,
            help="JPEG restart marker every N MCUs (0: none); 1 lets the loader decode only a crop's blocks.",
        ),
        click.option("--variants", default=0, show_default=True, help="Write K pre-augmented copies OUT/v0..v{K-1}."),
        click.option("--crop-scale", default="0.35,1.0", show_default=True, help="Random crop area range (variants)."),
        click.option("--crop-ratio", default="0.75,1.333", show_default=True, help="Random crop aspect range (variants)."),
        click.option("--rotate", default=10.0, show_default=True, help="Max rotation in degrees (variants)."),
        click.option("--jitter", default=0.2, show_default=True, help="Colour jitter strength (variants)."),
        click.option("--no-flip", is_flag=True, help="No horizontal flips in variants."),
        click.option("--shard-size", default="256MiB", show_default=True, help="Target bytes per shard (e.g. 256MB, 1GiB)."),
        click.option("--shard-count", type=int, default=None, help="Max samples per shard."),
        click.option("--seed", default=0, show_default=True, help="Seed for the shuffle and the augmentations."),
        click.option("--max-pixels", default=89_478_485, show_default=True, help="Refuse larger images (bombs)."),
        click.option("--force", is_flag=True, help="Write even if the free-space check fails."),
        click.option("--overwrite", is_flag=True, help="Replace an OUT prepared with other settings."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def spec_from_options(src: str, out: str, options: dict[str, Any]) -> PrepareSpec:
    """A PrepareSpec from the values of `prepare_options` (validated; errors are ConfigError)."""
    o = options  # the option values by parameter name
    return PrepareSpec(
        source=src,
        out=out,
        resize=ResizeSpec(size=o["size"], mode=o["mode"], upscale=o["upscale"], resample=o["resample"]),
        augment=AugmentSpec(
            variants=o["variants"],
            scale=_pair(o["crop_scale"], "--crop-scale"),
            ratio=_pair(o["crop_ratio"], "--crop-ratio"),
            flip=not o["no_flip"],
            jitter=o["jitter"],
            rotate=o["rotate"],
        ),
        encode=EncodeSpec(format=o["fmt"], quality=o["quality"], restart=o["jpeg_restart"]),
        shards=ShardSpec(max_bytes=parse_bytes(o["shard_size"]), max_samples=o["shard_count"]),
        seed=o["seed"],
        max_pixels=o["max_pixels"],
    )


@main.command()
@click.argument("src")
@click.argument("out")
@prepare_options
@click.option("--workers", type=int, default=None, help="Processes (default: available cores; 0: in-process).")
@click.option("--json", "as_json", is_flag=True, help="Print the final summary as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@user_errors
def prepare(
    src: str, out: str, workers: int | None, force: bool, overwrite: bool, as_json: bool, quiet: bool, **options: Any
) -> None:
    """Prepare SRC (folder, CSV/JSONL list or URL) into WebDataset shards at OUT."""
    from ..prepare.job import prepare_dataset

    spec = spec_from_options(src, out, options)
    from .progress import prepare_progress

    with prepare_progress(enabled=not quiet) as callback:
        result = prepare_dataset(spec, workers=workers, force=force, overwrite=overwrite, progress=callback)
    for warning in result.warnings:
        click.echo(f"gpufeed: warning: {warning}", err=True)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    from .progress import print_prepare_summary

    print_prepare_summary(result)


@main.command()
@click.argument("dataset")
@click.option("--verify", is_flag=True, help="Re-read every shard: sha256, sizes and sample counts.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@user_errors
def inspect(dataset: str, verify: bool, as_json: bool) -> None:
    """Summarise a prepared DATASET (folder, URL or manifest.json); --verify checks every byte."""
    from ..manifest import read_manifest, verify_dataset
    from ..io.output import Output

    root = dataset[: -len("/manifest.json")] if dataset.endswith("/manifest.json") else dataset
    output = Output(root)
    manifest = read_manifest(output)
    summary: dict[str, Any] = {
        "dataset": root,
        "samples": manifest.samples,
        "classes": len(manifest.classes),
        "variants": manifest.variants,
        "shards": len(manifest.shards),
        "bytes": sum(s.bytes for s in manifest.shards),
        "rejected": manifest.rejected,
        "format": manifest.params.get("encode", {}).get("format"),
        "size": manifest.params.get("resize", {}).get("size"),
        "mode": manifest.params.get("resize", {}).get("mode"),
        "created": manifest.created,
    }
    result = verify_dataset(output, manifest) if verify else None
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


@main.command("demo-data")
@click.argument("directory")
@click.option("--n", "count", default=1000, show_default=True, help="Number of images.")
@click.option("--classes", default=4, show_default=True, help="Number of class folders (1-6).")
@click.option("--min-side", default=800, show_default=True)
@click.option("--max-side", default=1600, show_default=True)
@click.option("--seed", default=0, show_default=True)
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


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--redis-url", default=None, help="Redis to check (default: GPUFEED_BROKER_URL or localhost).")
def doctor(as_json: bool, redis_url: str | None) -> None:
    """Report Python, torch, the PIL build and its codecs, decoders, cores and Redis."""
    from ..measure.doctor import collect_report, format_report

    report = collect_report(redis_url=redis_url)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))


# Command groups that live in their own modules register themselves on `main`.
from . import bench as cli_bench
from worker import cli as cli_service  # noqa: E402,F401


if __name__ == "__main__":  # pragma: no cover
    main()
