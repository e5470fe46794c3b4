"""The online flow: shards in, batches on the training device out (`make_loader`).

    loader.py         make_loader(): the settings checked, the dataset resolved, the Loader built over it
    iteration.py      Loader: epochs and the runs over them, placement, state_dict/load_state_dict, close
    stats.py          LoaderStats: where the training loop's time goes, what damage cost it
    ranks.py          rank and world size (given, or torch.distributed's), each rank's epoch size, merge_states
    elastic.py        elastic resume: an epoch continued at another world size, no sample twice, none skipped
    dataset.py        what a source names: a manifest, a dataset folder or a brace pattern -> shards
    samples.py        `loader.dataset[i]`: one sample by its index, as a torchvision dataset gives it
    streaming.py      opening shards: local as they are, remote ones read ahead, through the local cache
    epoch.py          each epoch's order (seed, epoch, rank), segments of shards, the shuffle buffer
    damage.py         the error policy: damaged shards and samples counted, named once, replaced
    runs.py           a run over one epoch: its producer thread, its queue of batches, stopping it
    pacing.py         what paces a run: the ring slots it holds, the decode pieces not yet started
    workers.py        the decode pool: the ring of uint8 batch slots and the workers that decode into it
    executors.py      where the pool's pieces run (inline, threads, a fork pool) and waiting for them
    pieces.py         a worker's piece of a batch: pixels into its ring slot, a task's targets
    device.py         the device side: flip, float, normalise; the CPU finish; CUDA side-stream prefetch
    crops.py          the crop plan: each sample's random-resized or centre crop box, from its seed and size
    placement.py      detection recipes: letterbox, scale jitter, IoU crop (which part of an image goes where)
    mosaic_piece.py   the "yolo" recipe's piece: each output a mosaic of its sample and three partners (pipeline.augment)
    tasks.py          targets on their way to a batch (boxes, masks, labels, captions, fields) and `Batch`
    hooks.py          the user's sample_transform and batch_transform called, what they return checked
    cpu_decode.py     decode on the CPU straight into batch slots: decode_into, decode_many, the decoder chosen
    region_decode.py  the region decoder (libjpeg-turbo in pipeline.native) over a piece's JPEGs, one C call
    slot_pixels.py    decoded pixels into a slot: crop box resized (Pillow or C), flipped, normalised; Pillow's decode
    gpu_decode.py     JPEG decode on the GPU (nvjpeg through torchvision)
    gpu_mosaic.py     recipe="yolo" with nvjpeg: the workers plan, the device decodes each picture once and renders

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
