"""The offline flow: a source of raw images in, sharded WebDataset tar files and a manifest out.

    job.py         prepare_dataset(): one whole job in this process (re-exports the step API)
    steps.py       the step API the service calls: plan, write a shard, finish, discard
    options.py     RunOptions (how a run goes: workers, force, overwrite, strict, verify ...) and PrepareProgress
    results.py     PrepareResult, and the steps' PreparePlanInfo and ShardRecord
    opening.py     a job opened: what OUT holds read, SRC listed, the shards planned or a saved plan kept
    writing.py     a job's shards written (chunks to the pool, one tar per variant set, commit, record); strict stops
    finishing.py   rejected.jsonl, then the manifest (the switch), then the work folder goes
    repair.py      a finished dataset's damaged shard files written again, byte for byte, each checked
    resume.py      WorkFolder: what OUT already holds (plan and shard records, temp files, damaged files)
    lock.py        OUT's lock: one prepare at a time per OUT, across the service's processes
    task_info.py   what a job's samples hold (task, target members, ignore index), seen as SRC is listed
    listing.py     the listing spilled to OUT/.gpufeed: JSON lines plus a uint64 offset index
    plan.py        which listing index lands in which shard (a seeded permutation, nothing in memory)
    aspect.py      order="aspect": the listing sorted by each picture's stored aspect ratio, read from its header
    pool.py        the process pool over a shard's samples (warm start, survives a crashing decoder)
    sample/        one source -> one sample: read, decode or the YCbCr path, its targets moved with it, encoded
    sources.py     list the images of a folder, a CSV/JSONL list or an fsspec URL, streaming
    formats/       the source layouts: YOLO, COCO, VOC, segmentation folders, CSV/JSONL lists, shards
    reads.py       how remote source files are read ahead, many at once, for the store's latency
    handoff.py     source bytes from the parent to its forked workers through shared memory, not a pipe
    transforms.py  resize modes and the pre-augmented variant sets
    encode.py      JPEG, WebP, PNG or raw .npy bytes of one image
    transcode.py   JPEG in, resized JPEG out without RGB (the native YCbCr path)
    reshard.py     re-pack or re-augment a prepared dataset into a new version or a new OUT
    versions.py    a dataset's versions in place and the atomic swap that makes one current
"""

from __future__ import annotations

from .job import (
    PreparePlanInfo,
    PrepareProgress,
    PrepareResult,
    ShardRecord,
    discard_prepare,
    finish_prepare,
    plan_prepare,
    prepare_dataset,
    write_prepare_shard,
)

__all__ = [
    "PreparePlanInfo",
    "PrepareProgress",
    "PrepareResult",
    "ShardRecord",
    "discard_prepare",
    "finish_prepare",
    "plan_prepare",
    "prepare_dataset",
    "write_prepare_shard",
]
