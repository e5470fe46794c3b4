"""gpufeed: keep GPUs fed.

The library behind the `gpufeed` command: prepare a dataset into WebDataset
shards (`prepare_dataset`), re-pack it (`reshard_dataset`), check it
(`read_manifest`, `verify_dataset`) and load it onto the GPU for training
(`make_loader`).

Importing it is cheap: the names that need torch (`make_loader`, `Loader`,
`LoaderStats`, `estimate_memory`) are imported on first use, and nothing here
imports Celery or matplotlib.

The package map (the layers, highest first, are import-linter contracts in
pyproject.toml):

    cli/          the `gpufeed` command: parsing and printing only
    integrations/ other libraries' training loops fed by gpufeed (ultralytics' own YOLO trainer)
    measure/      bench disk|decode|loader, advise, estimate-memory, doctor, watch
    prepare/      the offline flow: raw images in, shards and a manifest out
    loader/       the online flow: shards in, batches on the training device out
    augment/      detection augmentation (ultralytics' recipe) as one matrix per source image, and its CPU renderer
    demo.py       generated demo datasets (photo-like folders, detection, segmentation, captions)
    decode.py     the one gate for hostile image bytes: any image file -> upright RGB, or why not
    manifest.py   manifest.json, the contract between prepare, the loader and the service
    specs.py      the frozen, validated settings objects (PrepareSpec, LoaderSpec, ...)
    stage.py      copy a prepared dataset to local disk, verified and resumable
    targets.py    what a sample holds besides its image (boxes, masks, labels, captions) and its geometry
    polygons.py   instance polygons in a shard: their member, moved with their image, clipped to a window
    io/           storage: fsspec paths, the S3 transport, atomic output, the tar format, devices, the cache
    errors.py     the one exception tree
    units.py      sizes, durations, rates and counts: one parser and one formatter each
    lazy.py       names a package offers from its modules, imported on first use
    redact.py     secrets out of text (a URL's user information and signatures as ***)
    native/       the C code (region JPEG decoder, resampler, YCbCr path), reached through ctypes
    __main__.py   `python -m pipeline` is the `gpufeed` command
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import (
    ConfigError,
    DecodeError,
    GpufeedError,
    HookError,
    JobConflictError,
    ManifestError,
    NoImagesError,
    SampleError,
    SourceError,
    StorageError,
)
from .lazy import lazy_attributes
from .specs import AugmentSpec, EncodeSpec, LoaderSpec, PrepareSpec, ResizeSpec, ShardSpec

if TYPE_CHECKING:
    from .loader.loader import Loader, LoaderStats, make_loader
    from .manifest import Manifest, VerifyResult, read_manifest, verify_dataset
    from .measure.memory.estimate import estimate_memory
    from .prepare.job import PrepareResult, prepare_dataset
    from .prepare.reshard import ReshardResult, ReshardSpec, reshard_dataset

__all__ = [
    "AugmentSpec",
    "ConfigError",
    "DecodeError",
    "EncodeSpec",
    "GpufeedError",
    "HookError",
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

# Names of the heavier modules (torch, NumPy, the prepare job), and the module each comes from: imported on
# first use, so that a command that needs none of them (`gpufeed watch`, `--help`) starts at once.
_LAZY = {
    "Manifest": "pipeline.manifest",
    "VerifyResult": "pipeline.manifest",
    "read_manifest": "pipeline.manifest",
    "verify_dataset": "pipeline.manifest",
    "PrepareResult": "pipeline.prepare.job",
    "prepare_dataset": "pipeline.prepare.job",
    "ReshardResult": "pipeline.prepare.reshard",
    "ReshardSpec": "pipeline.prepare.reshard",
    "reshard_dataset": "pipeline.prepare.reshard",
    "Loader": "pipeline.loader.loader",
    "LoaderStats": "pipeline.loader.loader",
    "make_loader": "pipeline.loader.loader",
    "estimate_memory": "pipeline.measure.memory.estimate",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
