"""Commands that other packages add to `gpufeed`, found through the `gpufeed.commands` entry points.

The service's commands (`gpufeed worker`, `submit`, `status` …) live in
`worker/cli.py` and reach the `gpufeed` group this way, so the library never
imports the service. A package adds a command by naming a `click.Command` in
its pyproject.toml::

    [project.entry-points."gpufeed.commands"]
    mycommand = "mypackage.cli:mycommand"

A command is imported only when it runs or `gpufeed --help` lists it.

One fallback, for gpufeed's own commands only: the installed metadata of
gpufeed may predate the entry points (an editable install made before they
were declared, until `pip install -e .` runs again) or be missing (a source
checkout run as `python -m pipeline`). Then the commands in `OWN_COMMANDS`
are taken from the `worker` package that sits beside this `pipeline` package
in the same tree, never from another package of that name.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

ENTRY_POINT_GROUP = "gpufeed.commands"
DISTRIBUTION = "gpufeed"

# The table [project.entry-points."gpufeed.commands"] of pyproject.toml, for the fallback
# (tests/cli/test_cli.py checks that both say the same).
OWN_COMMANDS = {
    "beat": "worker.cli:beat",
    "cancel": "worker.cli:cancel",
    "flower": "worker.cli:flower",
    "jobs": "worker.cli:jobs",
    "schedule": "worker.cli:schedule",
    "status": "worker.cli:status",
    "submit": "worker.cli:submit",
    "worker": "worker.cli:worker",
}
_OWN_PACKAGE = "worker"


def command_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The commands declared for `gpufeed`, by name (nothing is imported).

    Returns:
        Every installed `gpufeed.commands` entry point (the first one wins a
        name), plus `OWN_COMMANDS` when gpufeed's own metadata declares none and
        the `worker` package beside `pipeline` is present.
    """
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(point.name, point)
    if not _metadata_declares_commands() and _own_package_beside_pipeline():
        for name, value in OWN_COMMANDS.items():
            found.setdefault(name, importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP))
    return found


def _metadata_declares_commands() -> bool:
    try:
        points = importlib.metadata.distribution(DISTRIBUTION).entry_points
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(point.group == ENTRY_POINT_GROUP for point in points)


def _own_package_beside_pipeline() -> bool:
    try:
        spec = importlib.util.find_spec(_OWN_PACKAGE)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    tree = Path(__file__).resolve().parents[2]  # pipeline/cli/plugins.py -> the folder holding pipeline/
    return any(Path(location).resolve().parent == tree for location in spec.submodule_search_locations)
