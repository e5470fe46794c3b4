"""`make_loader` over a dataset in an S3 bucket (moto on loopback): read ahead, through the local cache or not.

The server counts the body bytes it sends per object, so "epoch 2 reads the
cache" means the store sent no shard bytes during epoch 2. Labels are each
image's own index, so a batch names its samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from loader_data import prepare_labelled

from pipeline.errors import ConfigError
from pipeline.loader import make_loader
from pipeline.loader.dataset import resolve_dataset
from pipeline.loader.epoch import plan_epoch
from pipeline.manifest import read_manifest

if TYPE_CHECKING:
    from s3_fixtures import Bucket, S3Server

pytest_plugins = ["s3_fixtures"]

N = 48
PER_SHARD = 8  # 6 shards
BATCH = 4
CROP = 32

Epoch = list[tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_labelled(tmp_path_factory.mktemp("remote"), "ds", N, shard_samples=PER_SHARD)


@pytest.fixture
def bucket(s3_upload: Callable[[Path], Bucket], labelled: Path) -> Bucket:
    return s3_upload(labelled)


def loader_for(source: str | Path, server: S3Server | None = None, **options: object):
    options.setdefault("device", "cpu")
    options.setdefault("num_workers", 1)
    options.setdefault("shuffle_buffer", 16)
    if server is not None:
        options["storage_options"] = server.storage_options
    return make_loader(str(source), BATCH, crop=CROP, **options)  # type: ignore[arg-type]


def run_epoch(loader, epoch: int) -> Epoch:
    loader.set_epoch(epoch)
    return [(images.clone(), labels.clone()) for images, labels in loader]


def assert_same(first: Epoch, second: Epoch) -> None:
    assert len(first) == len(second)
    for (images, labels), (other_images, other_labels) in zip(first, second, strict=True):
        assert torch.equal(labels, other_labels)
        assert torch.equal(images, other_images)


def shard_bytes_sent(server: S3Server, bucket: Bucket) -> int:
    return sum(count["bytes"] for key, count in server.reads().items() if key.endswith(".tar"))


def test_from_the_store_with_and_without_the_cache_equals_local_disk(
    s3_server: S3Server, bucket: Bucket, labelled: Path, tmp_path: Path
) -> None:
    local = loader_for(labelled)
    expected = [run_epoch(local, epoch) for epoch in (0, 1)]
    local.close()
    streamed = loader_for(bucket.url, s3_server)
    cached = loader_for(bucket.url, s3_server, cache_dir=tmp_path / "cache", cache_size="1GiB")
    for loader in (streamed, cached):
        for epoch in (0, 1):
            assert_same(run_epoch(loader, epoch), expected[epoch])
        loader.close()
    labels = sorted(int(v) for _, batch in expected[0] for v in batch)
    assert labels == list(range(N))  # one rank: the epoch is the dataset
    assert len(list((tmp_path / "cache" / "shards").iterdir())) == N // PER_SHARD


def test_epoch_two_reads_the_cache_and_not_the_store(s3_server: S3Server, bucket: Bucket, tmp_path: Path) -> None:
    loader = loader_for(bucket.url, s3_server, num_workers=0, cache_dir=tmp_path / "cache")  # nothing decodes ahead
    first = run_epoch(loader, 0)
    assert shard_bytes_sent(s3_server, bucket) == sum(s.bytes for s in read_manifest(bucket.local).shards)
    loader.close()  # waits for the fills in flight
    s3_server.reset_reads()
    second = run_epoch(loader, 1)
    assert shard_bytes_sent(s3_server, bucket) == 0
    assert len(second) == len(first) == N // BATCH
    assert sorted(int(v) for _, labels in second for v in labels) == list(range(N))


def test_a_cache_too_small_keeps_training_from_the_store(
    s3_server: S3Server, bucket: Bucket, labelled: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shards = read_manifest(labelled).shards
    room = shards[0].bytes + shards[1].bytes  # two shards' worth at most
    local = loader_for(labelled)
    expected = [run_epoch(local, epoch) for epoch in (0, 1)]
    local.close()
    caplog.set_level(logging.WARNING, logger="gpufeed.cache")
    loader = loader_for(bucket.url, s3_server, num_workers=0, cache_dir=tmp_path / "cache", cache_size=room)
    assert_same(run_epoch(loader, 0), expected[0])
    loader.close()
    cached = list((tmp_path / "cache" / "shards").iterdir())
    assert 1 <= len(cached) <= 2 and sum(p.stat().st_size for p in cached) <= room
    s3_server.reset_reads()
    assert_same(run_epoch(loader, 1), expected[1])
    loader.close()
    sent = shard_bytes_sent(s3_server, bucket)
    total = sum(s.bytes for s in shards)
    assert sent == total - sum(p.stat().st_size for p in cached)  # the others once each, the cached ones not again
    full = [r for r in caplog.records if r.name == "gpufeed.cache" and "is full" in r.getMessage()]
    assert len(full) == 1


@pytest.mark.parametrize("cached", [False, True], ids=["read-ahead", "cache"])
def test_a_shard_deleted_from_the_bucket_mid_epoch_is_damage(
    s3_server: S3Server, bucket: Bucket, labelled: Path, tmp_path: Path, cached: bool
) -> None:
    options: dict[str, object] = {"cache_dir": tmp_path / "cache"} if cached else {}
    # One shard at a time, no shuffle buffer, no worker ahead: the first batch reads only the first shard.
    loader = loader_for(bucket.url, s3_server, num_workers=0, shuffle_buffer=0, interleave=1, **options)
    shards = resolve_dataset(labelled).sets[0]
    segments, _ = plan_epoch(shards, seed=0, epoch=0, rank=0, world=1, shuffle=True, drop_last=True)
    last = Path(shards[segments[-1].shard].url).name
    batches = iter(loader)
    got = [next(batches)]
    s3_server.filesystem().rm_file(f"{bucket.name}/{bucket.key(last)}")
    got += [(images.clone(), labels.clone()) for images, labels in batches]
    assert len(got) == len(loader) == N // BATCH
    assert all(labels.shape == (BATCH,) for _, labels in got)
    assert (loader.stats.bad_shards, loader.stats.skipped, loader.stats.replaced) == (1, PER_SHARD, PER_SHARD)
    lost = {int(v) for v in range(N)} - {int(v) for _, labels in got for v in labels}
    assert len(lost) == PER_SHARD  # the deleted shard's samples, each stood in for by another
    loader.close()


def test_a_cache_needs_a_manifest_and_a_size_needs_a_folder(s3_server: S3Server, bucket: Bucket, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cache_size bounds the shard cache"):
        loader_for(bucket.url, s3_server, cache_size="1GiB")
    with pytest.raises(ConfigError, match="cache_size must be a size"):
        loader_for(bucket.url, s3_server, cache_dir=tmp_path / "c", cache_size=0)
    pattern = f"{bucket.url}/shard-{{000000..000001}}.tar"
    with pytest.raises(ConfigError, match="has none"):
        loader_for(pattern, s3_server, cache_dir=tmp_path / "c")
