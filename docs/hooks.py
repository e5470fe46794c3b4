"""mkdocs hooks of the documentation site (mkdocs.yml `hooks:`)."""

from __future__ import annotations

from typing import Any

import click


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
    return config
