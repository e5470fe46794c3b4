"""The online flow: shards in, batches on the training device out (`make_loader`).

    loader.py      make_loader() and Loader: settings, epochs and the runs over them, state, stats
    dataset.py     what a source names: a manifest, a dataset folder or a brace pattern -> shards
    streaming.py   opening shards: local as they are, remote ones read ahead, through the local cache
    epoch.py       each epoch's order (seed, epoch, rank), segments of shards, the shuffle buffer
    damage.py      the error policy: damaged shards and samples counted, named once, replaced
    workers.py     the host side of a run: ring slots, the producer thread, the decode pool
    device.py      the device side: flip, float, normalise; the CPU finish; CUDA side-stream prefetch
    crops.py       the crop plan: each sample's random-resized or centre crop box, from its seed and size
    placement.py   detection recipes: letterbox, scale jitter, IoU crop (which part of an image goes where)
    tasks.py       targets on their way to a batch (boxes, masks, labels, captions, fields) and `Batch`
    cpu_decode.py  decode on the CPU straight into batch slots (region decoder, simplejpeg, Pillow)
    gpu_decode.py  JPEG decode on the GPU (nvjpeg through torchvision)

Importing this package is cheap; torch is imported with `loader.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .loader import Loader, LoaderStats, make_loader, merge_states


def __getattr__(name: str) -> Any:
    if name in ("Loader", "LoaderStats", "make_loader", "merge_states"):
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'pipeline.loader' has no attribute {name!r}")


__all__ = ["Loader", "LoaderStats", "make_loader", "merge_states"]
