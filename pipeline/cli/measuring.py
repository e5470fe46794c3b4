"""What the measuring commands share: option parsers, the tables and notes they print, `--json` and `--plot`.

Used by `bench`, `advise`, `memory` and `watch`; parsing and printing only.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click

from ..errors import ConfigError
from ..units import parse_bytes, parse_rate
from .common import exit_on_user_errors, require_extra

# Ctrl-C: the benchmarks have removed their test files by the time this prints.
measure_errors = exit_on_user_errors("interrupted; temporary test files were removed")


def say_progress(text: str) -> None:
    if sys.stderr.isatty():
        click.echo(f"gpufeed: {text} …", err=True)


def print_note(text: str) -> None:
    click.echo(f"gpufeed: note: {text}", err=True)


def parse_sizes(text: str, name: str) -> list[int]:
    try:
        return [parse_bytes(part) for part in text.split(",") if part.strip()]
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=name) from None


def parse_size(text: str, name: str) -> int:
    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=name) from None


def parse_counts(text: str, name: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected numbers like 1,2,4, got {text!r}", param_hint=name) from None
    if not values or min(values) < 1:
        raise click.BadParameter("expected positive numbers", param_hint=name)
    return values


def parse_rate_option(text: str, name: str = "--device-flops") -> float:
    try:
        return parse_rate(text, name)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=name) from None


def number_cell(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def text_table(rows: Sequence[tuple[str, ...]], header: tuple[str, ...] | None = None, align: str = "") -> str:
    """Columns padded to their widest cell; `align` has one l or r per column (default: l then r)."""
    lines = ([header] if header else []) + list(rows)
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    align = align or "l" + "r" * (len(widths) - 1)
    out = []
    for index, line in enumerate(lines):
        cells = [cell.ljust(width) if side == "l" else cell.rjust(width) for cell, width, side in zip(line, widths, align)]
        out.append("  ".join(cells).rstrip())
        if header and index == 0:
            out.append("  ".join("-" * width for width in widths))
    return "\n".join(out)


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _plots_available(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value:  # checked before measuring, not after minutes of it
        require_extra("plots", ("matplotlib",), "--plot")
    return value


def plot_option(text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--plot FILE.png` with help `text`; refused at once, with the install line, where matplotlib is missing."""
    return click.option("--plot", default=None, callback=_plots_available, help=text)


def write_plot(kind: str, plot: str | None, result: Any, **extra: Any) -> None:
    if not plot:
        return
    from ..measure import plots

    path = getattr(plots, f"plot_{kind}")(result, plot, **extra)
    click.echo(f"plot: {path}", err=True)


__all__ = [
    "measure_errors", "number_cell", "parse_counts", "parse_rate_option", "parse_size", "parse_sizes", "plot_option",
    "print_json", "print_note", "say_progress", "text_table", "write_plot",
]
