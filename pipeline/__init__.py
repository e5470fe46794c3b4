"""gpufeed: keep GPUs fed.

The library behind the `gpufeed` command: prepare a dataset into WebDataset
shards (`prepare_dataset`), re-pack it (`reshard_dataset`), check it
(`read_manifest`, `verify_dataset`) and load it onto the GPU for training
(`make_loader`).

Importing it is cheap: the names that need torch (`make_loader`, `Loader`,
`LoaderStats`, `estimate_memory`) are imported on first use, and nothing here
imports Celery or matplotlib.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    ConfigError,
    DecodeError,
    GpufeedError,
    JobConflictError,
    ManifestError,
    NoImagesError,
    SampleError,
    SourceError,
    StorageError,
)
from .manifest import Manifest, VerifyResult, read_manifest, verify_dataset
from .prepare.job import PrepareResult, prepare_dataset
from .prepare.reshard import ReshardResult, ReshardSpec, reshard_dataset
from .specs import AugmentSpec, EncodeSpec, LoaderSpec, PrepareSpec, ResizeSpec, ShardSpec

if TYPE_CHECKING:
    from .loader.loader import Loader, LoaderStats, make_loader
    from .measure.memory import estimate_memory

__all__ = [
    "AugmentSpec",
    "ConfigError",
    "DecodeError",
    "EncodeSpec",
    "GpufeedError",
    "JobConflictError",
    "Loader",
    "LoaderSpec",
    "LoaderStats",
    "Manifest",
    "ManifestError",
    "NoImagesError",
    "PrepareResult",
    "PrepareSpec",
    "ReshardResult",
    "ReshardSpec",
    "ResizeSpec",
    "SampleError",
    "ShardSpec",
    "SourceError",
    "StorageError",
    "VerifyResult",
    "estimate_memory",
    "make_loader",
    "prepare_dataset",
    "read_manifest",
    "reshard_dataset",
    "verify_dataset",
]

# Names that need torch, and the module each comes from: imported on first use.
_LAZY = {
    "Loader": "pipeline.loader.loader",
    "LoaderStats": "pipeline.loader.loader",
    "make_loader": "pipeline.loader.loader",
    "estimate_memory": "pipeline.measure.memory",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
