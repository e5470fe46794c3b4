"""The one exception tree of gpufeed.

Every error a user can cause is a `GpufeedError`; the CLI prints its message
and exits non-zero instead of showing a traceback. Errors from other libraries
are converted at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

from .redact import redact_urls


class GpufeedError(Exception):
    """Base class of every error gpufeed raises on purpose.

    Attributes:
        retryable: whether the same work may succeed when simply tried again
            later (a full disk freed, a network store back), so a service
            retries it instead of failing the job; False unless a subclass
            says otherwise.
    """

    retryable: bool = False

    def __str__(self) -> str:
        # Messages name sources, outputs and stores: never with a URL's credentials or signature.
        return redact_urls(super().__str__())


class ConfigError(GpufeedError, ValueError):
    """A setting, flag or job spec is invalid; the message says which and why."""


class HookError(ConfigError):
    """A sample_transform or batch_transform returned what the loader cannot deliver; the message says what."""


class SourceError(GpufeedError):
    """The source dataset cannot be listed or read."""


class NoImagesError(SourceError):
    """SRC gave no usable image: nothing was listed, or every listed file was rejected.

    No manifest is written (a dataset without samples is no dataset); when
    files were rejected, OUT/rejected.jsonl says why each one was.
    """


class SampleError(GpufeedError):
    """One sample, or a shard of them, cannot be used.

    Prepare goes on without it; the loader too, unless `on_error="raise"`
    asks it to stop there.

    Attributes:
        shard: the shard it was read from, when known ("" otherwise).
        sample: the sample's key ("" for a whole shard, or when not known).
        reason: what is wrong, without those names.
    """

    def __init__(self, message: str, *, shard: str = "", sample: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.shard = shard
        self.sample = sample
        self.reason = reason or message


class DecodeError(SampleError):
    """An input file is not a usable image; ``reason`` is recorded in rejected.jsonl."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StorageError(GpufeedError):
    """Writing or reading the output failed (full disk, permissions, network).

    Retryable: the job can be re-run once the cause is fixed; complete shards
    are kept and reused.
    """

    retryable = True


class ManifestError(GpufeedError):
    """A dataset's manifest or shards do not match (missing, corrupted, wrong format)."""


class JobConflictError(GpufeedError):
    """OUT already holds a different job's output."""


def write_failure(path: str, exc: OSError) -> StorageError:
    """A StorageError for a failed write, saying what to do about a full disk."""
    import errno

    if exc.errno == errno.ENOSPC:
        return StorageError(
            f"no space left on the device while writing {path}; "
            "free some space and run the same command again to resume"
        )
    return StorageError(f"cannot write {path}: {exc.strerror or exc}")
