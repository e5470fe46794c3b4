"""`make_loader` over a dataset in an S3 bucket (moto on loopback): read ahead, through the local cache or not.

The server counts the body bytes it sends per object, so "epoch 2 reads the
cache" means the store sent no shard bytes during epoch 2. Labels are each
image's own index, so a batch names its samples.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from loader_data import damage_cached_shard, prepare_labelled

from pipeline.errors import ConfigError, ManifestError
from pipeline.io.tar import ShardInfo
from pipeline.loader import make_loader
from pipeline.loader.dataset import resolve_dataset
from pipeline.loader.epoch import plan_epoch
from pipeline.manifest import read_manifest

if TYPE_CHECKING:
    from s3_fixtures import Bucket, S3Server

pytest_plugins = ["s3_fixtures"]

ROOT = Path(__file__).resolve().parents[2]

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


TWO_LOADERS = textwrap.dedent(
    """
    import hashlib, json, os, sys, time
    from pipeline.loader import make_loader
    url, cache_dir, rank, world, go_file, out_file = sys.argv[1:7]
    loader = make_loader(
        url, int(os.environ["TEST_BATCH"]), crop=int(os.environ["TEST_CROP"]), device="cpu", num_workers=1,
        shuffle_buffer=16, cache_dir=cache_dir, rank=int(rank), world_size=int(world),
        storage_options=json.loads(os.environ["TEST_STORAGE_OPTIONS"]),
    )
    while not os.path.exists(go_file):
        time.sleep(0.001)
    epochs = []
    for epoch in json.loads(os.environ.get("TEST_EPOCHS", "[0, 1]")):
        loader.set_epoch(epoch)
        epochs.append([[labels.tolist(), hashlib.sha256(images.numpy().tobytes()).hexdigest()] for images, labels in loader])
    loader.close()
    json.dump(epochs, open(out_file, "w"))
    """
)


def delivered(loader, epochs_read: tuple[int, ...] = (0, 1)) -> list[list[object]]:
    """Each epoch's batches as the child processes write them: labels and the images' sha256."""
    epochs = []
    for epoch in epochs_read:
        loader.set_epoch(epoch)
        epochs.append([[labels.tolist(), hashlib.sha256(images.numpy().tobytes()).hexdigest()] for images, labels in loader])
    return epochs


def run_loaders(
    server: S3Server, bucket: Bucket, cache: Path, ranks: list[int], world: int, tmp_path: Path, epochs: tuple[int, ...] = (0, 1)
) -> list[list[list[object]]]:
    """What loaders of `ranks`, one process each, all started at once over one cache, delivered in `epochs`."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TEST_STORAGE_OPTIONS": json.dumps(server.storage_options),
        "TEST_BATCH": str(BATCH),
        "TEST_CROP": str(CROP),
        "TEST_EPOCHS": json.dumps(list(epochs)),
    }
    go = tmp_path / "go"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_LOADERS, bucket.url, str(cache), str(rank), str(world), str(go), str(tmp_path / f"out{i}.json")],
            env=env,
        )
        for i, rank in enumerate(ranks)
    ]
    try:
        time.sleep(1.0)  # both have built their loaders and wait for the start
        go.touch()
        for process in processes:
            assert process.wait(timeout=300) == 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(len(ranks))]


@pytest.mark.parametrize("world", [2, 1], ids=["two-ranks", "two-full-passes"])
def test_two_processes_filling_one_cache_through_make_loader_download_each_shard_once(
    s3_server: S3Server, bucket: Bucket, labelled: Path, tmp_path: Path, world: int
) -> None:
    ranks = list(range(world)) if world == 2 else [0, 0]  # two ranks of one job, or two jobs reading it all at once
    expected = []
    for rank in ranks:
        local = loader_for(labelled, rank=rank, world_size=world)
        expected.append(delivered(local))
        local.close()
    shards = read_manifest(labelled).shards
    s3_server.throttle(sum(s.bytes for s in shards) // 2)  # about 0.2 s a shard: the two fills overlap
    cache = tmp_path / "cache"
    got = run_loaders(s3_server, bucket, cache, ranks, world, tmp_path)
    assert got == expected  # each process delivered what a loader on local disk delivers
    for shard in shards:
        assert s3_server.bytes_read(bucket.name, bucket.key(shard.path)) == shard.bytes  # sent once, to one of them
        cached = cache / "shards" / f"{shard.sha256}.tar"
        assert hashlib.sha256(cached.read_bytes()).hexdigest() == shard.sha256
    assert sorted(p.name for p in (cache / "partial").iterdir()) == []
    if world == 2:
        labels = sorted(label for epochs in got for batch in epochs[0] for label in batch[0])
        assert labels == list(range(N))  # epoch 0: the two ranks share the dataset out between them


@pytest.mark.parametrize("rel", ["s3://another-bucket/ds/shard-000000.tar", "file:///etc/passwd", "../other/shard-000000.tar"])
def test_a_remote_manifest_naming_another_bucket_scheme_or_prefix_is_refused(
    s3_server: S3Server, bucket: Bucket, labelled: Path, rel: str
) -> None:
    manifest = json.loads((labelled / "manifest.json").read_text())
    manifest["shards"][0]["path"] = rel
    bucket.put("manifest.json", json.dumps(manifest).encode())
    with pytest.raises(ManifestError, match=r"names a shard outside the dataset"):
        loader_for(bucket.url, s3_server)
    shard_reads = [key for key in s3_server.reads() if key.startswith(f"{bucket.name}/") and key.endswith(".tar")]
    assert shard_reads == []  # refused before a byte of a shard was read


def test_a_remote_dataset_is_indexable_through_the_loaders_store_options(
    s3_server: S3Server, bucket: Bucket, labelled: Path
) -> None:
    local, remote = loader_for(labelled), loader_for(bucket.url, s3_server)
    for index in (0, PER_SHARD + 3, -1):
        here, there = local.dataset[index], remote.dataset[index]
        assert (here.key, here.label, here.info) == (there.key, there.label, there.info)
        assert here.image.tobytes() == there.image.tobytes()
    local.close()
    remote.close()


def changed_in_the_cache(labelled: Path, cache: Path, how: str) -> ShardInfo:
    """Change the largest shard's cached copy on disk (see test_cache.damage_cached_shard); returns its entry."""
    shards = read_manifest(labelled).shards
    victim = max(shards, key=lambda s: s.bytes)
    other = min((s for s in shards if s is not victim), key=lambda s: s.bytes)
    damage_cached_shard(cache / "shards" / f"{victim.sha256}.tar", how, (labelled / other.path).read_bytes())
    return victim


def gets(server: S3Server) -> dict[str, int]:
    """The GET requests the server answered for shards, by shard, for the shards it answered any."""
    return {key: count["gets"] for key, count in server.reads().items() if count["gets"] and key.endswith(".tar")}


@pytest.mark.parametrize("verify", [False, True], ids=["checked", "verify"])
@pytest.mark.parametrize("how", ["swapped", "flipped"])
def test_a_shard_changed_in_the_cache_between_epochs_is_fetched_again_before_its_samples_are_delivered(
    s3_server: S3Server, bucket: Bucket, labelled: Path, tmp_path: Path, how: str, verify: bool
) -> None:
    local = loader_for(labelled)
    expected = [run_epoch(local, epoch) for epoch in (0, 1, 2)]
    local.close()
    loader = loader_for(bucket.url, s3_server, num_workers=0, cache_dir=tmp_path / "cache", verify=verify)
    assert_same(run_epoch(loader, 0), expected[0])
    loader.close()  # waits for the fills in flight
    victim = changed_in_the_cache(labelled, tmp_path / "cache", how)
    s3_server.reset_reads()
    assert_same(run_epoch(loader, 1), expected[1])  # not one sample of the changed copy
    loader.close()
    assert loader.stats.bad_shards == 0
    assert gets(s3_server) == {f"{bucket.name}/{bucket.key(victim.path)}": 1}  # that shard once more, nothing else
    assert shard_bytes_sent(s3_server, bucket) == victim.bytes
    s3_server.reset_reads()
    assert_same(run_epoch(loader, 2), expected[2])
    assert s3_server.reads() == {}  # cached good again
    loader.close()


def test_two_loaders_sharing_a_cache_with_a_changed_shard_both_deliver_good_samples_fetching_it_once(
    s3_server: S3Server, bucket: Bucket, labelled: Path, tmp_path: Path
) -> None:
    local = loader_for(labelled)
    expected = delivered(local, (1,))
    local.close()
    cache = tmp_path / "cache"
    loader = loader_for(bucket.url, s3_server, num_workers=0, cache_dir=cache)
    run_epoch(loader, 0)
    loader.close()
    victim = changed_in_the_cache(labelled, cache, "swapped")
    s3_server.reset_reads()
    s3_server.throttle(victim.bytes * 5)  # its fetch takes 0.2 s: the other process finds it under way or done
    got = run_loaders(s3_server, bucket, cache, [0, 0], 1, tmp_path, epochs=(1,))
    assert got == [expected, expected]
    assert gets(s3_server) == {f"{bucket.name}/{bucket.key(victim.path)}": 1}
    assert hashlib.sha256((cache / "shards" / f"{victim.sha256}.tar").read_bytes()).hexdigest() == victim.sha256


def test_a_detection_dataset_from_the_store_through_the_cache_gives_what_local_disk_gives(
    s3_server: S3Server, s3_upload: Callable[[Path], Bucket], tmp_path: Path
) -> None:
    from task_data import write_task_dataset

    local = write_task_dataset(tmp_path / "det", "detection", 24, fmt="JPEG")
    bucket = s3_upload(local)

    def epochs(source: str, **options: object) -> list[list[tuple[list[str], list[list[float]]]]]:
        loader = loader_for(source, **options)
        runs = []
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            runs.append([(batch.keys, [b.tolist() for b in batch.boxes]) for batch in loader])
        loader.close()
        return runs

    expected = epochs(str(local))
    assert epochs(bucket.url, server=s3_server, cache_dir=tmp_path / "cache") == expected
    s3_server.reset_reads()
    assert epochs(bucket.url, server=s3_server, cache_dir=tmp_path / "cache") == expected  # from the cache now
    assert shard_bytes_sent(s3_server, bucket) == 0
