"""gpufeed: keep GPUs fed.

The library behind the `gpufeed` command. Importing it is cheap: torch and
celery are imported only by the parts that use them.
"""

from __future__ import annotations

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
from .prepare import PrepareResult, prepare_dataset
from .specs import AugmentSpec, EncodeSpec, PrepareSpec, ResizeSpec, ShardSpec

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
    "VerifyResult",
    "prepare_dataset",
    "read_manifest",
    "verify_dataset",
]
