"""How one run of a prepare goes (`RunOptions`), what it reports as it goes (`PrepareProgress`), and the
check of the files it may read (`SourceCheck`, applied again by a shard step: `CheckedListing`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from ..errors import ConfigError
from .formats.common import SourceItem
from .listing import Listing
from .pool import IO_THREADS, available_cores

ProgressCallback = Callable[["PrepareProgress"], None]
SourceCheck = Callable[[str], None]
"""Called with the URL of every file SRC lists, as it is listed; the ConfigError it raises stops the plan
(in a shard step, it rejects the file instead: `CheckedListing`)."""


@dataclasses.dataclass
class PrepareProgress:
    """Handed to the progress callback after every chunk of images."""

    done: int
    total: int
    rejected: int
    seconds: float
    stage: str = "prepare"
    warned: int = 0  # samples decoded with warnings
    boxes_dropped: int = 0  # boxes that fell (mostly) out of their pictures
    frames_unclear: int = 0  # samples whose annotation's declared size matched neither frame


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a run goes, apart from what it makes (the spec): see `prepare_dataset` for each.

    Attributes:
        workers: processes; None: every available core, 0: in-process; a plan alone (None) starts none.
        force: write even when the free-space check says it will not fit.
        overwrite: replace an OUT prepared (or being prepared) with different settings.
        strict: stop at the first rejected file and publish nothing.
        verify: check a finished dataset's shards by sha256, not only by size.
        io_threads: reads of a remote SRC kept in flight while the workers decode.
        progress: called with a PrepareProgress after every chunk.
        check_source: called with the URL of every file SRC lists (the service's allowed roots).
    """

    workers: int | None = None
    force: bool = False
    overwrite: bool = False
    strict: bool = False
    verify: bool = False
    io_threads: int = IO_THREADS
    progress: ProgressCallback | None = None
    check_source: SourceCheck | None = None

    def with_workers(self) -> RunOptions:
        """These options with `workers` decided (None: every available core), checked.

        Raises:
            ConfigError: a negative `workers` or `io_threads`.
        """
        workers = available_cores() if self.workers is None else self.workers
        if workers < 0:
            raise ConfigError("--workers must be 0 or more")
        if self.io_threads < 0:
            raise ConfigError("io_threads must be 0 or more")
        return dataclasses.replace(self, workers=workers)


def checked_item(item: SourceItem, check: SourceCheck) -> SourceItem:
    """`item` as a shard step may read it: rejected, so never opened, when `check` refuses its file or its mask.

    The reject's reason is the check's message (e.g. the path is outside the service's allowed roots).
    """
    if item.rejected:
        return item  # never read
    mask = item.targets.get("mask") if isinstance(item.targets, dict) else None
    for path in (item.url, *([mask] if isinstance(mask, str) else [])):
        try:
            check(path)
        except ConfigError as exc:
            return dataclasses.replace(item, rejected=str(exc))
    return item


class CheckedListing(Listing):
    """A planned job's listing whose every item passes `check` as it is read (`checked_item`).

    The plan checked what SRC listed, but a shard step reads the listing from OUT, and OUT may
    have changed since (a line added, a path edited, a link put in place of a file): so each
    file the step would open is checked again, where it opens it, links resolved by the check.
    """

    def __init__(self, listing: Listing, check: SourceCheck) -> None:
        super().__init__(os.path.dirname(listing.lines_path))
        self.check = check

    def get(self, index: int) -> SourceItem:
        return checked_item(super().get(index), self.check)


def checked_listing(listing: Listing, check: SourceCheck | None) -> Listing:
    """The listing a shard step reads: each item checked by `check` as it is read (`CheckedListing`), if given."""
    return listing if check is None else CheckedListing(listing, check)
