"""This machine's copies of a job's work files on a remote OUT, removed once the job is over.

The machines that plan a job or write its shards keep its listing in a folder
of their own temp folder (`pipeline.prepare.job.local_copies_folder`), so each
downloads it once however many shards it writes. Only the machine that
finishes the job removes its copy in the library; every other machine's would
stay. So a task marks the folder with its job's id before it uses it, and each
worker's watchdog tick removes the folders whose every marked job is over
(succeeded, failed, cancelled or gone): no task of theirs runs any more.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.specs import PrepareSpec

MARK = ".gpufeed-job-"  # a marker per job: `<folder>/.gpufeed-job-<job id>`
_FOLDERS = "gpufeed-staging-*"  # how `pipeline.io.output.Output` names them


def mark_copies(spec: PrepareSpec, job_id: str) -> None:
    """Mark this machine's copies folder of `spec`'s OUT as used by `job_id` (a no-op for a local OUT)."""
    from pipeline.prepare.job import local_copies_folder  # on first use: a worker starts without the library loaded

    folder = local_copies_folder(spec)
    if folder is None:
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{MARK}{job_id}"), "a", encoding="ascii"):
        pass


def remove_finished_copies(is_over: Callable[[str], bool], temp_dir: str | None = None) -> list[str]:
    """Remove the copies folders of this machine whose every marked job is over; returns the folders removed.

    Args:
        is_over: whether a job (by id) is over: no task of it runs any more.
        temp_dir: where the folders are (this process's temp folder by default).
    """
    removed = []
    for folder in sorted(glob.glob(os.path.join(temp_dir or tempfile.gettempdir(), _FOLDERS))):
        marks = _marks(folder)
        if not marks:
            continue  # not a job's (a prepare run by hand): not ours to remove
        for job_id in marks:
            if is_over(job_id):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, f"{MARK}{job_id}"))
        if not _marks(folder):  # looked at again: a task of a new job may have marked it meanwhile
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _marks(folder: str) -> list[str]:
    try:
        return sorted(name[len(MARK) :] for name in os.listdir(folder) if name.startswith(MARK))
    except OSError:
        return []
