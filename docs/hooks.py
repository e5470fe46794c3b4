"""mkdocs hooks of the documentation site (mkdocs.yml `hooks:`)."""

from __future__ import annotations

import re
from typing import Any

import click
from mkdocs.exceptions import PluginError


def on_config(config: Any) -> Any:
    """Load every `gpufeed` command, the entry-point ones too, so the CLI reference lists them all.

    The `gpufeed` group imports the service's commands only when they run or are
    listed; mkdocs-click reads the commands already loaded.
    """
    from pipeline.cli import main

    context = click.Context(main, info_name="gpufeed")
    missing = [name for name in main.list_commands(context) if main.get_command(context, name) is None]
    if missing:
        raise click.ClickException(f"cannot load the commands {', '.join(missing)} for the CLI reference")
    _state_defaults(main, context)
    return config


def _state_defaults(command: click.Command, context: click.Context) -> None:
    """Give each option without a default the one it acts with, for the reference's "Default" column.

    click 8.3 and newer mark an option given no default with a sentinel, which
    mkdocs-click would print as `Sentinel.UNSET`: a flag acts as False, any
    other option as None (or, when required, mkdocs-click's "required").
    Only this build's copies of the commands change.
    """
    for param in command.get_params(context):
        if isinstance(param, click.Option) and _unset(param.default):
            param.default = False if param.is_flag and not param.multiple else None
    if isinstance(command, click.Group):
        for name in command.list_commands(context):
            sub = command.get_command(context, name)
            if sub is not None:
                _state_defaults(sub, click.Context(sub, info_name=name, parent=context))


def _unset(value: Any) -> bool:
    return type(value).__name__ == "Sentinel"


_LEAKED = re.compile(r"Sentinel\.\w+|<object object at 0x")


def on_page_content(html: str, page: Any, **_: Any) -> str:
    """Fail the build where a page shows a placeholder object instead of a value (a default never stated)."""
    leaked = _LEAKED.search(html)
    if leaked:
        raise PluginError(f"{page.file.src_path} shows {leaked.group(0)!r} where a value belongs")
    return html
