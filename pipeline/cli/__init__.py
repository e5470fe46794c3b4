"""The `gpufeed` command: parsing and printing only; the work happens in the library.

The group is assembled here from its modules, none of which imports this one:

- `common`: one-line errors, the group class, missing extras, shared options;
- `data`: prepare, inspect, reshard, demo-data, doctor;
- `bench`: bench disk|decode|loader;
- `advise`: advise (the bottleneck, and the prepare that fixes it);
- `memory`: estimate-memory;
- `measuring`: what the measuring commands share: option parsers, tables, --json, --plot;
- `stage`: stage (copy a dataset to local disk);
- `watch`: watch (is a training command waiting for data, and on what);
- `progress`: the progress bar and the summaries;
- `plugins`: commands of other packages (the `gpufeed.commands` entry points),
  among them the service's `worker`, `beat`, `submit`, `status`, `jobs`,
  `cancel` and `schedule` from `worker/cli.py`.
"""

from __future__ import annotations

import click

from . import advise, bench, data, memory, stage, watch
from .common import GpufeedGroup

__all__ = ["main"]


@click.group(cls=GpufeedGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="gpufeed")
def main() -> None:
    """gpufeed keeps GPUs fed: prepare image datasets into fast shards, measure, advise."""


for _command in (*data.COMMANDS, *bench.COMMANDS, *advise.COMMANDS, *memory.COMMANDS, *watch.COMMANDS):
    main.add_command(_command)
main.add_command(stage.stage)


if __name__ == "__main__":  # pragma: no cover
    main()
