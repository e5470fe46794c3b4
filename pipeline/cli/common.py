"""What every `gpufeed` command shares: one-line errors, the group, missing extras, renamed options, the prepare and reshard options.

Command modules (here and in other packages, e.g. `worker/cli.py`) import from
this module; it imports none of them.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import importlib.metadata
import json
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ..errors import ConfigError, GpufeedError
from ..specs import (
    MAX_SHARDS,
    ORDERS,
    PREPARE_FLAG_VALUES,
    PREPARE_OPTION_NAMES,
    AugmentSpec,
    EncodeSpec,
    PrepareSpec,
    ResizeSpec,
    ShardSpec,
)
from ..units import parse_bytes, parse_duration
from .plugins import command_entry_points

if TYPE_CHECKING:
    from click.decorators import FC

    from ..prepare.reshard import ReshardSpec

SUCCESS, FAILURE, MISMATCH = 0, 1, 3


def fail(message: str, code: int = FAILURE, *, as_json: bool | None = None) -> NoReturn:
    """Print `gpufeed: error: MESSAGE` on stderr and exit with `code`.

    A command run with `--json` prints ``{"error": MESSAGE}`` on stdout
    instead, so a script reads one JSON object whatever happened.

    Args:
        message: what went wrong and what to do about it.
        code: the exit status.
        as_json: print the JSON object (None: when the running command was given `--json`).
    """
    from ..io.fs import redact_urls

    message = with_flag_options(redact_urls(message))  # a URL's password or signature is never printed
    if as_json is None:
        ctx = click.get_current_context(silent=True)
        as_json = bool(ctx is not None and ctx.params.get("as_json"))
    if as_json:
        click.echo(json.dumps({"error": message}))
    else:
        click.echo(f"gpufeed: error: {message}", err=True)
    sys.exit(code)


def exit_on_user_errors(interrupted: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: gpufeed errors and failed file operations become one line and exit 1; Ctrl-C prints `interrupted`, exit 130."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except GpufeedError as exc:
                fail(str(exc))
            except OSError as exc:  # what the file system refused, said as what to do
                fail(describe_os_error(exc))
            except KeyboardInterrupt:
                fail(interrupted, 130)

        return wrapper

    return decorate


def describe_os_error(exc: OSError) -> str:
    """One line for a failed file operation: what was refused, where, and what to do.

    Args:
        exc: the error, with its `filename` where the operation named one.
    """
    path = exc.filename if exc.filename is not None else "a file"
    what = {
        errno.EROFS: f"{path} is on a read-only file system: choose a folder on a disk you can write to",
        errno.EACCES: f"no permission to use {path}: change its permissions or choose another folder",
        errno.EPERM: f"no permission to use {path}: change its permissions or choose another folder",
        errno.ENOSPC: f"no space left on the device while writing {path}: free some space and run the same command again",
        errno.EEXIST: f"{path} is a file, not a folder: give a folder",
        errno.ENOTDIR: f"{path}: part of this path is a file, not a folder",
        errno.EISDIR: f"{path} is a folder, not a file",
        errno.ENOENT: f"not found: {path}",
    }
    return what.get(exc.errno or 0, f"{path}: {exc.strerror or exc}")


user_errors = exit_on_user_errors("interrupted; complete shards are kept, run the same command again to resume")


def require_extra(extra: str, modules: tuple[str, ...], what: str) -> None:
    """Exit 1 with the install line when `what` needs an extra whose packages cannot be imported.

    Args:
        extra: the name in `pip install 'gpufeed[EXTRA]'`, e.g. ``"service"``.
        modules: the modules that extra provides, e.g. ``("celery", "redis")``.
        what: what needs it, as the message names it: ``"gpufeed worker"``, ``"--plot"``.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            fail(f"{what} needs the {extra} extra: pip install 'gpufeed[{extra}]'")


def top_command_name(ctx: click.Context) -> str:
    """`gpufeed NAME …` -> NAME: the command right under `gpufeed`, however deep `ctx` is."""
    while ctx.parent is not None and ctx.parent.parent is not None:
        ctx = ctx.parent
    return ctx.info_name or ""


class GpufeedGroup(click.Group):
    """The `gpufeed` group: one `gpufeed: error:` line for a usage error, and commands from entry points.

    The commands added with `add_command` come first; the `gpufeed.commands`
    entry points (see `pipeline.cli.plugins`) add the others, each imported
    only when it is run or listed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._entry_points: dict[str, importlib.metadata.EntryPoint] | None = None

    def _declared(self) -> dict[str, importlib.metadata.EntryPoint]:
        if self._entry_points is None:
            self._entry_points = {name: p for name, p in command_entry_points().items() if name not in self.commands}
        return self._entry_points

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(self.commands) | set(self._declared()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        point = None if cmd_name in self.commands else self._declared().pop(cmd_name, None)
        if point is not None:
            try:
                command = point.load()
                if not isinstance(command, click.Command):
                    raise TypeError(f"{point.value} is a {type(command).__name__}, not a click command")
            except Exception as exc:  # a broken plugin must not take `gpufeed prepare` down with it
                click.echo(f"gpufeed: warning: cannot load the {cmd_name} command ({point.value}): {exc}", err=True)
            else:
                self.add_command(command, cmd_name)
        return self.commands.get(cmd_name)

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            _usage_error(exc)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[_ARGS] = list(args)  # for a usage error under --json: the command's params are not parsed then
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            _usage_error(exc)


_ARGS = "gpufeed.args"


def _usage_error(exc: click.UsageError) -> NoReturn:
    if isinstance(exc, getattr(click.exceptions, "NoArgsIsHelpError", ())):
        raise exc  # `gpufeed` alone: click prints the help
    hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
    fail(exc.format_message() + hint, 2, as_json=_json_asked(exc.ctx))


def _json_asked(ctx: click.Context | None) -> bool:
    """Whether a command that has `--json` was given it (read from the command line: parsing failed)."""
    if ctx is None or not any(param.name == "as_json" for param in ctx.command.params):
        return False
    args = ctx.meta.get(_ARGS, [])
    return "--json" in (args[: args.index("--")] if "--" in args else args)


# ---------------------------------------------------------------------------
# One word for one thing: renamed options keep their old spelling, hidden, with a note


class RenamedOption(click.Option):
    """An option that still accepts its old spellings: hidden from the help, each use prints a one-line note.

    Made by `renamed_option(..., old=("--old-name",))`.
    """

    def __init__(self, *args: Any, old: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.old_names = tuple(old)

    @property
    def _old_dest(self) -> str:
        return f"{self.name}:old"

    def add_to_parser(self, parser: Any, ctx: click.Context) -> None:
        super().add_to_parser(parser, ctx)
        if self.old_names:
            parser.add_option(obj=self, opts=self.old_names, dest=self._old_dest, action="store", nargs=self.nargs)

    def consume_value(self, ctx: click.Context, opts: Any) -> Any:
        if self._old_dest in opts:
            new = "/".join(self.opts)
            if self.name in opts:
                raise click.UsageError(f"give {new} once: {'/'.join(self.old_names)} is its old name", ctx)
            click.echo(f"gpufeed: note: {'/'.join(self.old_names)} is deprecated; use {new}", err=True)
            opts = {**opts, self.name: opts[self._old_dest]}
        return super().consume_value(ctx, opts)


def renamed_option(*decls: str, old: tuple[str, ...] = (), **attrs: Any) -> Callable[[FC], FC]:
    """`click.option`, also accepting the deprecated spellings `old` (see RenamedOption)."""
    if not old:
        return click.option(*decls, **attrs)
    return click.option(*decls, cls=RenamedOption, old=old, **attrs)


class Duration(click.ParamType):
    """Seconds, as `pipeline.units.parse_duration` reads them: `2`, `0.5s`, `10m`."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return parse_duration(value, "duration")
        except GpufeedError as exc:
            self.fail(str(exc).removeprefix("duration: "), param, ctx)


class AliasedChoice(click.Choice):
    """A choice that also takes other spellings of its values (`jpg` for `jpeg`); the help lists the values."""

    def __init__(self, choices: list[str], aliases: dict[str, str]) -> None:
        super().__init__(choices)
        self.aliases = aliases

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            value = self.aliases.get(value.lower(), value)
        return super().convert(value, param, ctx)


# ---------------------------------------------------------------------------
# Options shared by a local command and its service counterpart


def _pair(text: str, name: str) -> tuple[float, float]:
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected two numbers LOW,HIGH, got {text!r}", param_hint=name) from None
    return low, high


def parse_storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``("endpoint_url=http://…", "anon=true")`` -> fsspec storage options; values are JSON when they parse as JSON.

    A malformed pair is refused without being echoed: it may hold a credential.
    """
    options: dict[str, Any] = {}
    for number, pair in enumerate(pairs, 1):
        key, equals, text = pair.partition("=")
        if not equals or not key.strip():
            raise click.BadParameter(f"option {number} is not KEY=VALUE (its text is not shown)", param_hint="--storage-option")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        options[key.strip()] = value
    return options


def storage_option(help_text: str) -> Callable[[FC], FC]:
    """The repeatable ``--storage-option KEY=VALUE`` (parameter ``storage_option``; see `parse_storage_options`)."""
    return click.option("--storage-option", "storage_option", multiple=True, metavar="KEY=VALUE", help=help_text)


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
        click.option(
            "--resample",
            type=click.Choice(["lanczos", "bicubic", "bilinear"]),
            default="lanczos",
            show_default=True,
            help="The resize filter.",
        ),
        click.option(
            "--format",
            "fmt",
            type=AliasedChoice(["jpeg", "webp", "png", "npy"], {"jpg": "jpeg"}),
            default="jpeg",
            show_default=True,
            help="Encoding of the stored images (jpg: jpeg); npy is raw uint8, no decode when loading.",
        ),
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
        renamed_option(
            "--shard-samples",
            type=int,
            default=None,
            old=("--shard-count",),
            help="At most N samples per shard. (The number of shards follows from the listing; "
            "`gpufeed reshard --shards N` sets it afterwards.)",
        ),
        click.option("--seed", default=0, show_default=True, help="Seed for the shuffle and the augmentations."),
        click.option("--max-pixels", default=89_478_485, show_default=True, help="Refuse larger images (bombs)."),
        click.option(
            "--min-visible",
            default=0.25,
            show_default=True,
            help="Drop a box that keeps less than this fraction of its area after a crop (detection).",
        ),
        click.option(
            "--split",
            default=None,
            help="One split of a YOLO dataset (train, val, test): SRC its data.yaml or folder. Without it, "
            "`prepare` writes each split into OUT/<split>; splits are never merged.",
        ),
        click.option(
            "--label-frame",
            type=click.Choice(["upright", "stored"]),
            default="upright",
            show_default=True,
            help="COCO/VOC boxes whose declared image size cannot tell: in the EXIF-rotated (upright) image, "
            "or in the stored raster. YOLO labels are always upright.",
        ),
        click.option(
            "--order",
            type=click.Choice(list(ORDERS)),
            default="shuffle",
            show_default=True,
            help="shuffle: samples shuffled across the shards (--seed); aspect: sorted by each stored picture's "
            "aspect ratio (height/width), so an eval loader's batches hold like shapes (rectangular validation).",
        ),
        click.option("--force", is_flag=True, help="Write even if the free-space check fails."),
        click.option("--overwrite", is_flag=True, help="Replace an OUT prepared with other settings."),
        storage_option(
            "An fsspec option for the stores of SRC and OUT, e.g. endpoint_url=http://…, profile=NAME, anon=true "
            "(repeatable; credentials otherwise come from AWS_* variables or ~/.aws)."
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def with_option_names(message: str, names: dict[str, str]) -> str:
    """A library message with each Python setting it names spelt as the command's option.

    `batch_size` becomes `--batch-size`, and `batch_size=64` becomes `--batch-size 64`.

    Args:
        message: the text of a ConfigError (or a note) written for Python callers.
        names: setting name -> the option (or argument) that sets it in this command. A name
            that is also a plain word (`sample`) is given as `sample=`: only `sample=128`
            becomes `--sample 128`, "the sample" stays as it is.
    """
    for name, option in sorted(names.items(), key=lambda item: -len(item[0])):
        setting = re.escape(name.removesuffix("="))
        if name.endswith("="):
            pattern = rf"(?<![\w.-]){setting}=(?=\S)"
        else:
            pattern = rf"(?<![\w.-]){setting}(?:=(?=\S)|(?![\w=-]))"
        message = re.sub(pattern, functools.partial(_spelt, option), message)
    return message


def _spelt(option: str, match: re.Match[str]) -> str:
    return option + (" " if match.group(0).endswith("=") else "")


class option_errors(contextlib.ContextDecorator):  # noqa: N801 - used like contextlib's own lower-case helpers
    """A context (or a decorator) in which a ConfigError is re-raised with its settings spelt as options.

    Args:
        names: as `with_option_names` takes them.
    """

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, trace: object) -> None:
        if isinstance(exc, ConfigError):
            raise ConfigError(with_option_names(str(exc), self.names)) from exc


# One setting in which two prepares differ, as `setting_differences` writes it: `resize.size: 32 here, 64 in …`.
_SETTING_DIFFERENCE = re.compile(r"(?:(?<=\()|(?<=; ))(?P<key>[a-z_]+(?:\.[a-z_]+)?): (?P<here>.*?) here, (?P<there>.*?) in ")


# The library's switches that every command which has them spells as a flag of the same name.
_FLAG_SETTINGS = re.compile(r"(?<![\w.-])(overwrite|force|strict)=True\b")


def with_flag_options(message: str) -> str:
    """A library message's `overwrite=True`, `force=True`, `strict=True` spelt as the flags (`--overwrite` …)."""
    return _FLAG_SETTINGS.sub(lambda match: f"--{match.group(1)}", message)


def with_prepare_option_names(message: str) -> str:
    """A library message about a prepare's settings (a JobConflictError's) with each setting spelt as `gpufeed prepare`'s option.

    `resize.size: 32 here, 64 in …` becomes `--size: 32 here, 64 in …`, and a flag's
    values read as the option: `resize.upscale: True here, False in …` becomes
    `--upscale: given here, not given in …`.
    """

    def spelt(match: re.Match[str]) -> str:
        key = match.group("key")
        if key not in PREPARE_OPTION_NAMES:
            return match.group(0)

        def shown(value: str) -> str:
            if key in PREPARE_FLAG_VALUES and value in ("True", "False"):
                return "given" if value == str(PREPARE_FLAG_VALUES[key]) else "not given"
            return "not given" if value == "None" else value

        return f"{PREPARE_OPTION_NAMES[key]}: {shown(match.group('here'))} here, {shown(match.group('there'))} in "

    return with_flag_options(_SETTING_DIFFERENCE.sub(spelt, message))


def _spec_names(prefix: str) -> dict[str, str]:
    """`PREPARE_OPTION_NAMES` for the settings of one part of a PrepareSpec (`resize`; "" for its own)."""
    if not prefix:
        return {key: flag for key, flag in PREPARE_OPTION_NAMES.items() if "." not in key}
    return {key.split(".", 1)[1]: flag for key, flag in PREPARE_OPTION_NAMES.items() if key.startswith(prefix + ".")}


def spec_from_options(src: str, out: str, options: dict[str, Any]) -> PrepareSpec:
    """A PrepareSpec from the values of `prepare_options` (validated; errors are ConfigError naming the options)."""
    o = options  # the option values by parameter name
    with option_errors(_spec_names("resize")):
        resize = ResizeSpec(size=o["size"], mode=o["mode"], upscale=o["upscale"], resample=o["resample"])
    with option_errors(_spec_names("augment")):
        augment = AugmentSpec(
            variants=o["variants"],
            scale=_pair(o["crop_scale"], "--crop-scale"),
            ratio=_pair(o["crop_ratio"], "--crop-ratio"),
            flip=not o["no_flip"],
            jitter=o["jitter"],
            rotate=o["rotate"],
        )
    with option_errors(_spec_names("encode")):
        encode = EncodeSpec(format=o["fmt"], quality=o["quality"], restart=o["jpeg_restart"])
    with option_errors(_spec_names("shards")):
        shards = ShardSpec(max_bytes=parse_bytes(o["shard_size"]), max_samples=o["shard_samples"])
    with option_errors(_spec_names("")):
        return PrepareSpec(
            source=src, out=out, resize=resize, augment=augment, encode=encode, shards=shards,
            seed=o["seed"], max_pixels=o["max_pixels"], min_visible=o["min_visible"], split=o["split"],
            label_frame=o["label_frame"], order=o["order"],
        )


def reshard_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Options of a reshard (shared by `reshard`, `submit reshard` and `schedule add … reshard`)."""
    options = [
        click.option(
            "--shards",
            type=click.IntRange(1, MAX_SHARDS),
            default=None,
            help="Exactly N shards per set (e.g. GPUs x loader workers, so each worker reads whole shards).",
        ),
        renamed_option("--shard-samples", type=int, default=None, old=("--shard-count",), help="At most N samples per shard."),
        click.option("--shard-size", default=None, help="About S bytes per shard at most (e.g. 256MB)."),
        click.option(
            "--multiple-of",
            type=int,
            default=None,
            help="Make the number of shards a multiple of W (with --shard-samples/--shard-size, or of today's count).",
        ),
        click.option("--reaugment", is_flag=True, help="Re-augment from the source with --seed instead of re-packing."),
        click.option("--seed", type=int, default=None, help="The new augmentation seed (with --reaugment)."),
        click.option("--out", default=None, help="Write the result to NEW instead of a new version in place."),
        click.option("--keep", default=1, show_default=True, help="Older versions kept for readers still using them."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


RESHARD_OPTION_NAMES = {
    "dataset": "DATASET",
    "out": "--out",
    "shards": "--shards",
    "max_samples": "--shard-samples",
    "max_bytes": "--shard-size",
    "multiple_of": "--multiple-of",
    "reaugment": "--reaugment",
    "seed": "--seed",
    "keep": "--keep",
}
"""How `reshard_options` spell each ReshardSpec setting (as `with_option_names` takes them)."""


def reshard_spec(dataset: str, options: dict[str, Any], absolute: Callable[[str], str] = str) -> ReshardSpec:
    """A ReshardSpec from `reshard_options` values; `absolute` fixes paths for the service.

    Raises:
        ConfigError: a setting is refused (the message names the options); click.UsageError for `--shards`.
    """
    from ..prepare.reshard import ReshardSpec

    where, out = absolute(dataset), absolute(options["out"]) if options["out"] else None
    max_bytes = parse_bytes(options["shard_size"]) if options["shard_size"] else None
    try:
        with option_errors(RESHARD_OPTION_NAMES):
            return ReshardSpec(
                dataset=where,
                out=out,
                shards=options["shards"],
                max_samples=options["shard_samples"],
                max_bytes=max_bytes,
                multiple_of=options["multiple_of"],
                reaugment=options["reaugment"],
                seed=options["seed"],
                keep=options["keep"],
            )
    except ConfigError as exc:
        if options["shards"] is not None and "--shards" in str(exc):  # a usage error, as click reports one
            raise click.UsageError(str(exc)) from exc
        raise
