"""How one run of a prepare goes (`RunOptions`), and what it reports as it goes (`PrepareProgress`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..errors import ConfigError
from .pool import IO_THREADS, available_cores

ProgressCallback = Callable[["PrepareProgress"], None]
SourceCheck = Callable[[str], None]
"""Called with the URL of every file SRC lists, as it is listed; what it raises stops the plan."""


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
