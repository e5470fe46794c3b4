"""gpufeed: keep GPUs fed.

The library behind the `gpufeed` command. Importing it is cheap: torch and
celery are imported only by the parts that use them.
"""

from __future__ import annotations

from typing import Any

from .errors import (
    ConfigError,
    DecodeError,
    GpufeedError,
    JobConflictError,
    ManifestError,
    SampleError,
    SourceError,
    StorageError,
)
from .manifest import Manifest, VerifyResult, read_manifest, verify_dataset
from .prepare.job import PrepareResult, prepare_dataset
from .specs import AugmentSpec, EncodeSpec, LoaderSpec, PrepareSpec, ResizeSpec, ShardSpec


def __getattr__(name: str) -> Any:
    # make_loader and estimate_memory need torch: import them on first use so `import pipeline` stays light.
    if name == "make_loader":
        from .loader.loader import make_loader

        return make_loader
    if name == "estimate_memory":
        from .measure.memory import estimate_memory

        return estimate_memory
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")

__all__ = [
    "AugmentSpec",
    "ConfigError",
    "DecodeError",
    "EncodeSpec",
    "GpufeedError",
    "JobConflictError",
    "Manifest",
    "ManifestError",
    "PrepareResult",
    "PrepareSpec",
    "ResizeSpec",
    "SampleError",
    "ShardSpec",
    "SourceError",
    "StorageError",
    "LoaderSpec",
    "VerifyResult",
    "estimate_memory",
    "make_loader",
    "prepare_dataset",
    "read_manifest",
    "verify_dataset",
]
