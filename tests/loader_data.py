"""Small prepared datasets for the loader tests, and ways to damage their shards as disks and copies do.

Every dataset is labelled by each image's own index, so a label names a
sample: which samples a batch holds can be read off its labels.
"""

from __future__ import annotations

import json
import os
import random
import tarfile
from collections.abc import Callable
from pathlib import Path

import webdataset as wds

from pipeline import PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset
from pipeline.demo import make_demo_dataset
from pipeline.io.output import Output
from pipeline.io.tar import TarShardWriter
from pipeline.manifest import read_manifest, write_manifest

SIZE = 64  # prepared shorter side


def prepare_labelled(
    tmp: Path, name: str, count: int, min_side: int = 90, shard_samples: int = 20, **changes: object
) -> Path:
    """A prepared dataset of `count` demo images whose label is each image's own index."""
    raw = tmp / f"{name}-raw"
    make_demo_dataset(raw, count, classes=3, min_side=min_side, max_side=min_side + 70, workers=1)
    files = sorted(raw.rglob("*.jpg"))
    (tmp / f"{name}.jsonl").write_text(
        "".join(json.dumps({"path": str(p), "label": i}) + "\n" for i, p in enumerate(files))
    )
    out = tmp / name
    spec = PrepareSpec(
        source=str(tmp / f"{name}.jsonl"),
        out=str(out),
        resize=ResizeSpec(size=SIZE),
        shards=ShardSpec(max_bytes=None, max_samples=shard_samples),
        **changes,  # type: ignore[arg-type]
    )
    prepare_dataset(spec, workers=2)
    return out


def shard_samples(root: Path, pattern: str = "shard-*.tar") -> list[dict]:
    """The samples of the shards matching `pattern`, read with plain webdataset, in order."""
    urls = sorted(str(p) for p in root.glob(pattern))
    return list(wds.WebDataset(urls, shardshuffle=False))


def rewrite_shard(root: Path, shard_path: str, damage: Callable[[int, dict[str, bytes]], dict[str, bytes]]) -> None:
    """Write the shard again with `damage(index, members)` applied to each sample; the manifest follows.

    The shard is then valid as a tar and matches its manifest entry (sha256,
    bytes, samples): only its samples' contents are bad.
    """
    output = Output(str(root))
    manifest = read_manifest(output)
    target = root / shard_path
    samples = shard_samples(root, shard_path)
    with TarShardWriter(str(target)) as writer:
        for index, sample in enumerate(samples):
            members = {k: v for k, v in sample.items() if not k.startswith("__")}
            writer.write_sample(sample["__key__"], damage(index, members))
        info = writer.commit(shard_path)
    manifest.shards = [info if s.path == shard_path else s for s in manifest.shards]
    write_manifest(output, manifest)


def cut_inside_sample(shard: Path, index: int) -> None:
    """Truncate the shard in the middle of sample `index`'s image: samples 0..index-1 stay readable."""
    with tarfile.open(shard) as tar:
        images = [m for m in tar.getmembers() if m.name.endswith(".jpg")]
    member = images[index]
    data = shard.read_bytes()
    shard.write_bytes(data[: member.offset_data + member.size // 2])


def flip_bytes(shard: Path, member_suffix: str = ".json", which: int = -1) -> None:
    """Flip a few bytes inside one member's data (the last `member_suffix` one by default), size unchanged.

    In a .json member the loader never reads, only a hash check can notice.
    """
    with tarfile.open(shard) as tar:
        members = [m for m in tar.getmembers() if m.name.endswith(member_suffix)]
    member = members[which]
    data = bytearray(shard.read_bytes())
    for offset in range(member.offset_data + 1, member.offset_data + min(member.size, 9)):
        data[offset] ^= 0xFF
    with open(shard, "r+b") as handle:
        handle.write(bytes(data))
        handle.flush()
        os.fsync(handle.fileno())


def damage_cached_shard(cached: Path, how: str, other: bytes) -> None:
    """Change a cached shard on disk, its size kept, as a careless tool or a failing disk would.

    "swapped": another file put in its place, `other` (a valid tar of other samples) padded
    with zeros to the shard's size; "flipped": 64 bytes inverted in place, at a random
    offset inside one of its images.
    """
    size = cached.stat().st_size
    if how == "swapped":
        assert len(other) <= size
        replacement = cached.parent / f"{cached.name}.other"
        replacement.write_bytes(other + bytes(size - len(other)))
        os.replace(replacement, cached)
    else:
        with tarfile.open(cached) as tar:
            images = [m for m in tar.getmembers() if m.size >= 64 and not m.name.endswith((".cls", ".json"))]
        rng = random.Random(size)
        member = rng.choice(images)
        offset = member.offset_data + rng.randrange(member.size - 64 + 1)
        with open(cached, "r+b") as handle:
            handle.seek(offset)
            flipped = bytes(b ^ 0xFF for b in handle.read(64))
            handle.seek(offset)
            handle.write(flipped)
    assert cached.stat().st_size == size
