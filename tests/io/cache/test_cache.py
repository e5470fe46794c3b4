"""The local shard cache (pipeline.io.cache.shards) against a real S3 server on loopback (moto).

Downloads are counted by the server (body bytes per object, all processes together), so
"one download per shard" means the server sent each shard's bytes exactly once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from loader_data import damage_cached_shard

from pipeline.errors import ConfigError, ManifestError, SourceError
from pipeline.io.cache.shards import ShardCache
from pipeline.io.tar import iter_tar_samples
from pipeline.manifest import read_manifest

if TYPE_CHECKING:
    from s3_fixtures import Bucket, S3Server

pytest_plugins = ["s3_fixtures"]

ROOT = Path(__file__).resolve().parents[3]


def addresses(bucket: Bucket) -> list[tuple[str, str, int, str]]:
    """(url, sha256, size, manifest path) of every shard of the bucket's dataset."""
    manifest = read_manifest(bucket.local)
    return [(f"{bucket.url}/{s.path}", s.sha256, s.bytes, s.path) for s in manifest.shards]


def read_shard(cache: ShardCache, url: str, sha256: str, size: int) -> bytes:
    with cache.open(url, sha256, size) as handle:
        return handle.read()


def downloads(server: S3Server, bucket: Bucket, rel: str, size: int) -> float:
    """How many times the server sent the whole of one shard."""
    return server.bytes_read(bucket.name, bucket.key(rel)) / size


def cache_warnings(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpufeed.cache" and words in r.getMessage()]


def files_under(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_fill_then_hits_from_disk(s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path) -> None:
    shards = addresses(s3_bucket)
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options) as cache:
        for url, sha256, size, rel in shards:
            with cache.open(url, sha256, size) as handle:
                samples = sum(1 for _ in iter_tar_samples(handle, url))  # the tar reader stops before the end padding
            assert samples == 4
            cache.wait()  # the reader had the fill's verdict; the rename to the final name may come a moment later
            assert cache.contains(sha256, size)
            assert Path(cache.path_for(sha256)).read_bytes() == (s3_bucket.local / rel).read_bytes()
            assert downloads(s3_server, s3_bucket, rel, size) == 1
        first = cache.stats()
        assert (first.fills, first.hits, first.bypassed, first.rejected) == (len(shards), 0, 0, 0)

        s3_server.reset_reads()
        for url, sha256, size, rel in shards:
            assert read_shard(cache, url, sha256, size) == (s3_bucket.local / rel).read_bytes()
        assert s3_server.reads() == {}  # the second epoch came from disk
        assert cache.stats().hits == len(shards)
        usage = cache.usage()
    assert (usage.shards, usage.filling, usage.used_bytes) == (len(shards), 0, sum(s[2] for s in shards))
    assert files_under(tmp_path / "cache" / "partial") == []


def test_a_cache_made_again_serves_what_an_earlier_one_filled(s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path) -> None:
    url, sha256, size, rel = addresses(s3_bucket)[0]
    with ShardCache(tmp_path / "cache", 10**9, storage_options=s3_server.storage_options) as cache:
        read_shard(cache, url, sha256, size)
    s3_server.reset_reads()
    with ShardCache(str(tmp_path / "cache"), "1GB", storage_options=s3_server.storage_options) as again:
        assert read_shard(again, url, sha256, size) == (s3_bucket.local / rel).read_bytes()
        assert again.stats().hits == 1
    assert s3_server.reads() == {}


def test_a_shard_that_does_not_match_the_manifest_is_not_cached(
    s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, sha256, size, rel = addresses(s3_bucket)[0]
    damaged = bytearray((s3_bucket.local / rel).read_bytes())
    damaged[size // 2] ^= 0xFF  # same size, other bytes
    s3_bucket.put(rel, bytes(damaged))
    caplog.set_level(logging.WARNING, logger="gpufeed.cache")
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options) as cache:
        with pytest.raises(ManifestError, match="does not match its manifest entry"):
            read_shard(cache, url, sha256, size)
        with pytest.raises(ManifestError):  # through the tar reader, which stops early: close() checks the rest
            with cache.open(url, sha256, size) as handle:
                for _ in iter_tar_samples(handle, url):
                    pass
        cache.wait()
        assert not cache.contains(sha256, size)
        assert cache.stats().rejected == 2
    assert files_under(tmp_path / "cache" / "shards") == []
    assert files_under(tmp_path / "cache" / "partial") == []
    # nothing cached: each open went to the store. The second open's reader follows its fill; a fill this small
    # can be downloaded and rejected before the reader reads a byte of it, and the reader then reads the shard
    # from the store itself (follow.py): a third download, by design.
    assert downloads(s3_server, s3_bucket, rel, size) in (2.0, 3.0)
    assert cache_warnings(caplog, "does not match its manifest entry")


def test_a_shorter_object_than_the_manifest_says_is_an_error(s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path) -> None:
    url, sha256, size, rel = addresses(s3_bucket)[1]
    s3_bucket.put(rel, (s3_bucket.local / rel).read_bytes()[: size // 2])
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options) as cache:
        with pytest.raises(ManifestError):
            read_shard(cache, url, sha256, size)
        assert not cache.contains(sha256, size)
    assert files_under(tmp_path / "cache" / "partial") == []


FILL_ALL = textwrap.dedent(
    """
    import hashlib, json, os, sys, time
    from pipeline.io.cache.shards import ShardCache
    directory, shards_file, go_file, out_file = sys.argv[1:5]
    shards = json.load(open(shards_file))
    options = json.loads(os.environ["TEST_STORAGE_OPTIONS"])
    cache = ShardCache(directory, "1GiB", storage_options=options)
    while not os.path.exists(go_file):
        time.sleep(0.001)
    digests = []
    for url, sha256, size in shards:
        with cache.open(url, sha256, size) as handle:
            digests.append(hashlib.sha256(handle.read()).hexdigest())
    cache.close()
    stats = cache.stats()
    json.dump({"digests": digests, "fills": stats.fills, "hits": stats.hits, "followed": stats.followed}, open(out_file, "w"))
    """
)


def child_env(server: S3Server) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TEST_STORAGE_OPTIONS": json.dumps(server.storage_options),
    }


def victim_and_other(shards: list[tuple[str, str, int, str]]) -> tuple[tuple[str, str, int, str], tuple[str, str, int, str]]:
    """The largest shard and the smallest other one: the other's bytes fit in the largest's size."""
    victim = max(shards, key=lambda s: s[2])
    return victim, min((s for s in shards if s is not victim), key=lambda s: s[2])


def gets(server: S3Server, bucket: Bucket, rel: str) -> int:
    """The GET requests the server answered for one shard."""
    return server.reads().get(f"{bucket.name}/{bucket.key(rel)}", {}).get("gets", 0)


@pytest.mark.parametrize("verify", [False, True], ids=["checked", "verify"])
@pytest.mark.parametrize("how", ["swapped", "flipped"])
def test_a_cached_shard_changed_on_disk_is_never_served_and_is_fetched_again_once(
    s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, verify: bool
) -> None:
    shards = addresses(s3_bucket)
    (url, sha256, size, rel), other = victim_and_other(shards)
    options = s3_server.storage_options
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=options, verify=verify) as cache:
        for address in shards:
            read_shard(cache, *address[:3])
    damage_cached_shard(Path(cache.path_for(sha256)), how, (s3_bucket.local / other[3]).read_bytes())
    s3_server.reset_reads()
    caplog.set_level(logging.WARNING, logger="gpufeed.cache")
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=options, verify=verify) as cache:
        for address in shards:  # the first bytes of the changed one already come from the store
            with cache.open(*address[:3]) as handle:
                assert handle.read(512) == (s3_bucket.local / address[3]).read_bytes()[:512]
        cache.wait()
        assert read_shard(cache, url, sha256, size) == (s3_bucket.local / rel).read_bytes()  # cached again
        stats = cache.stats()
    assert (stats.dropped, stats.fills, stats.hits) == (1, 1, len(shards))
    assert (gets(s3_server, s3_bucket, rel), downloads(s3_server, s3_bucket, rel, size)) == (1, 1)  # fetched once more
    assert sum(count["gets"] for count in s3_server.reads().values()) == 1  # and nothing else
    assert hashlib.sha256(Path(cache.path_for(sha256)).read_bytes()).hexdigest() == sha256
    assert len(cache_warnings(caplog, "no longer matches its manifest entry")) == 1


def test_a_changed_cached_shard_whose_store_copy_is_damaged_too_is_an_error_and_not_cached(
    s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path
) -> None:
    shards = addresses(s3_bucket)
    (url, sha256, size, rel), other = victim_and_other(shards)
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options) as cache:
        read_shard(cache, url, sha256, size)
    damage_cached_shard(Path(cache.path_for(sha256)), "flipped", b"")
    damaged = bytearray((s3_bucket.local / rel).read_bytes())
    damaged[size // 2] ^= 0xFF
    s3_bucket.put(rel, bytes(damaged))
    s3_server.reset_reads()
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options) as cache:
        with pytest.raises(ManifestError, match="does not match its manifest entry"):
            read_shard(cache, url, sha256, size)
        cache.wait()
        stats = cache.stats()
    assert (stats.dropped, stats.rejected, stats.hits) == (1, 1, 0)
    assert not cache.contains(sha256, size)
    assert gets(s3_server, s3_bucket, rel) == 1


def test_a_cached_shard_that_is_still_right_is_not_fetched_again(s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path) -> None:
    shards = addresses(s3_bucket)
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options) as cache:
        for address in shards:
            read_shard(cache, *address[:3])
    copied = Path(cache.path_for(shards[0][1]))  # copied into place again (a new file, the same bytes)
    (copied.parent / "copy").write_bytes(copied.read_bytes())
    os.replace(copied.parent / "copy", copied)
    for record in (tmp_path / "cache" / "checks").iterdir():  # as a cache an older version filled has none
        if record.name != f"{shards[0][1]}.json":
            record.unlink()
    s3_server.reset_reads()
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options) as cache:
        for _ in range(2):
            for _, sha256, size, rel in shards:
                assert read_shard(cache, s3_bucket.url, sha256, size) == (s3_bucket.local / rel).read_bytes()
        assert (cache.stats().hits, cache.stats().dropped) == (2 * len(shards), 0)
    assert s3_server.reads() == {}
    assert files_under(tmp_path / "cache" / "checks") == sorted(f"{s[1]}.json" for s in shards)


def fill_in_two_processes(s3_server: S3Server, tmp_path: Path) -> list[dict]:
    """Two processes fill one cache (tmp_path/cache) with the shards of tmp_path/shards.json, started together."""
    go = tmp_path / "go"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", FILL_ALL, str(tmp_path / "cache"), str(tmp_path / "shards.json"), str(go), str(tmp_path / f"out{i}.json")],
            env=child_env(s3_server),
        )
        for i in range(2)
    ]
    time.sleep(1.0)  # both are waiting for the start
    go.touch()
    for process in processes:
        assert process.wait(timeout=120) == 0
    return [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]


def test_two_processes_sharing_a_cache_with_a_changed_shard_both_read_good_bytes_fetched_once(
    s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path
) -> None:
    shards = addresses(s3_bucket)
    victim, other = victim_and_other(shards)
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options) as cache:
        for address in shards:
            read_shard(cache, *address[:3])
    damage_cached_shard(Path(cache.path_for(victim[1])), "swapped", (s3_bucket.local / other[3]).read_bytes())
    first = [victim] + [s for s in shards if s is not victim]  # both open the changed one at once
    (tmp_path / "shards.json").write_text(json.dumps([s[:3] for s in first]))
    s3_server.reset_reads()
    s3_server.throttle(victim[2] * 5)  # its fetch takes 0.2 s: the other process finds it under way
    results = fill_in_two_processes(s3_server, tmp_path)
    assert results[0]["digests"] == results[1]["digests"] == [s[1] for s in first]
    assert results[0]["fills"] + results[1]["fills"] == 1
    assert (gets(s3_server, s3_bucket, victim[3]), downloads(s3_server, s3_bucket, victim[3], victim[2])) == (1, 1)
    assert sum(count["gets"] for count in s3_server.reads().values()) == 1


def test_two_processes_filling_one_cache_download_each_shard_once(
    s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path
) -> None:
    shards = addresses(s3_bucket)
    (tmp_path / "shards.json").write_text(json.dumps([s[:3] for s in shards]))
    s3_server.throttle(200_000)  # ~0.1 s a shard: the two readers overlap on every shard
    results = fill_in_two_processes(s3_server, tmp_path)
    assert results[0]["digests"] == results[1]["digests"] == [s[1] for s in shards]
    assert results[0]["fills"] + results[1]["fills"] == len(shards)
    assert results[0]["followed"] + results[1]["followed"] >= len(shards) + 1  # at least one read another's fill
    for _, _, size, rel in shards:
        assert downloads(s3_server, s3_bucket, rel, size) == 1
    assert files_under(tmp_path / "cache" / "partial") == []


def test_threads_opening_one_shard_at_once_share_one_download(s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path) -> None:
    url, sha256, size, rel = addresses(s3_bucket)[2]
    s3_server.throttle(100_000)
    got: list[bytes] = []
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options) as cache:
        threads = [threading.Thread(target=lambda: got.append(read_shard(cache, url, sha256, size))) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        cache.wait()
        stats = cache.stats()
    assert got == [(s3_bucket.local / rel).read_bytes()] * 4
    assert downloads(s3_server, s3_bucket, rel, size) == 1
    assert stats.fills == 1 and stats.followed + stats.hits == 4


def test_a_reader_following_a_fill_published_between_its_looks_reads_on_and_downloads_nothing_more(
    s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that caught up with the fill looks for the file at its names; the filler renames it meanwhile.

    The look at the final name is made to answer as of a moment before the
    filler published: the worst case of a rename between two looks. A reader
    that then concluded the fill had died read the rest of the shard from the
    store, a second download (seen in CI under load).
    """
    url, sha256, size, rel = addresses(s3_bucket)[1]
    s3_server.throttle(100_000)  # ~0.3 s: the reader catches up with the fill and looks again and again
    looked = threading.Event()
    identity = ShardCache._identity

    def stale(self: ShardCache, path: str) -> tuple[int, int] | None:
        answer = identity(self, path)
        if path == self.path_for(sha256) and answer is None and not looked.is_set():
            looked.set()
            deadline = time.monotonic() + 10
            while identity(self, path) is None and time.monotonic() < deadline:
                time.sleep(0.005)  # the filler publishes while this look's answer is on its way
        return answer

    monkeypatch.setattr(ShardCache, "_identity", stale)
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options) as cache:
        data = read_shard(cache, url, sha256, size)
        cache.wait()
        stats = cache.stats()
    assert data == (s3_bucket.local / rel).read_bytes()
    assert stats.fills == 1
    assert downloads(s3_server, s3_bucket, rel, size) == 1


def test_a_full_cache_keeps_a_stable_subset_and_reads_the_rest_from_the_store(
    s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shards = addresses(s3_bucket)
    room = sum(s[2] for s in shards[:3]) + shards[3][2] // 2  # three shards fit, the fourth does not
    caplog.set_level(logging.WARNING, logger="gpufeed.cache")
    with ShardCache(tmp_path / "cache", room, storage_options=s3_server.storage_options) as cache:
        for url, sha256, size, rel in shards:  # epoch 1
            assert read_shard(cache, url, sha256, size) == (s3_bucket.local / rel).read_bytes()
        cache.wait()
        cached = {sha256 for _, sha256, size, _ in shards if cache.contains(sha256, size)}
        assert cached == {s[1] for s in shards[:3]}
        inodes = {p.name: p.stat().st_ino for p in (tmp_path / "cache" / "shards").iterdir()}
        for url, sha256, size, rel in reversed(shards):  # epoch 2, another order
            assert read_shard(cache, url, sha256, size) == (s3_bucket.local / rel).read_bytes()
        assert cache.prefetch(s[:3] for s in shards) == 3  # queued, and refused for lack of room
        cache.close()
        stats = cache.stats()
        assert cache.usage().used_bytes <= room
    assert {p.name: p.stat().st_ino for p in (tmp_path / "cache" / "shards").iterdir()} == inodes  # nothing evicted
    for _, _, size, rel in shards[:3]:
        assert downloads(s3_server, s3_bucket, rel, size) == 1
    for _, _, size, rel in shards[3:]:
        assert downloads(s3_server, s3_bucket, rel, size) == 2  # straight from the store, each epoch
    assert (stats.fills, stats.hits, stats.bypassed) == (3, 3, 6)
    assert len(cache_warnings(caplog, "is full")) == 1


def test_a_fill_published_while_the_space_is_counted_is_counted_once(tmp_path: Path) -> None:
    # A fill moves its file from partial/ to shards/ when it publishes; a count that lists
    # partial/ just before and shards/ just after sees it twice, and refused a shard that fit.
    from pipeline.io.cache.shards import _lock, _unlock

    digest, size = "ab" * 32, 1000
    cache = ShardCache(tmp_path / "cache", 10_000)
    (tmp_path / "cache" / "partial" / f"{digest}-{size}.part").write_bytes(b"x" * 10)  # still filling, as listed first
    (tmp_path / "cache" / "shards" / f"{digest}.tar").write_bytes(b"x" * size)  # and published, as listed next
    held = _lock(str(tmp_path / "cache" / "locks" / f"{digest}.lock"))  # its filler is alive
    try:
        usage = cache.usage()
    finally:
        _unlock(held)
    assert usage.used_bytes == size
    cache.close()


def test_the_bound_holds_across_processes(s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path) -> None:
    shards = addresses(s3_bucket)
    room = sum(s[2] for s in shards[:2]) + 1
    (tmp_path / "shards.json").write_text(json.dumps([s[:3] for s in shards]))
    (tmp_path / "shards-reversed.json").write_text(json.dumps([s[:3] for s in reversed(shards)]))
    script = FILL_ALL.replace('"1GiB"', str(room))
    go = tmp_path / "go"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / "cache"), str(tmp_path / name), str(go), str(tmp_path / f"out{i}.json")],
            env=child_env(s3_server),
        )
        for i, name in enumerate(("shards.json", "shards-reversed.json"))
    ]
    time.sleep(1.0)
    go.touch()
    for process in processes:
        assert process.wait(timeout=120) == 0
    results = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert results[0]["digests"] == [s[1] for s in shards]
    with ShardCache(tmp_path / "cache", room) as cache:
        usage = cache.usage()
    assert usage.used_bytes <= room and usage.shards == 2


def test_a_cache_on_a_full_disk_reads_from_the_store_and_leaves_no_partial_file(
    s3_server: S3Server, s3_bucket: Bucket, small_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shards = addresses(s3_bucket)
    caplog.set_level(logging.WARNING, logger="gpufeed.cache")
    cache = ShardCache(small_tmpfs / "cache", "1GiB", storage_options=s3_server.storage_options)
    page = os.statvfs(small_tmpfs).f_frsize
    pages = [-(-size // page) for _, _, size, _ in shards]
    leave = (pages[0] + pages[1] // 2) * page  # the first shard fits, the second runs out of room half way
    with open(small_tmpfs / "ballast", "wb") as ballast:
        ballast.write(b"\0" * (shutil_free(small_tmpfs) - leave))
    with cache:
        for url, sha256, size, rel in shards:
            assert read_shard(cache, url, sha256, size) == (s3_bucket.local / rel).read_bytes()
        for url, sha256, size, rel in shards:  # and again: still from the store, said once
            assert read_shard(cache, url, sha256, size) == (s3_bucket.local / rel).read_bytes()
        stats = cache.stats()
    assert files_under(small_tmpfs / "cache" / "shards") == [f"{shards[0][1]}.tar"]
    assert files_under(small_tmpfs / "cache" / "partial") == []
    assert stats.fills == 1 and stats.hits == 1
    warnings = cache_warnings(caplog, "no space left")
    assert len(warnings) == 1, warnings
    assert downloads(s3_server, s3_bucket, shards[0][3], shards[0][2]) == 1


def shutil_free(path: Path) -> int:
    import shutil

    return shutil.disk_usage(path).free


KILLED_FILLER = textwrap.dedent(
    """
    import json, os, sys, time
    from pipeline.io.cache.shards import ShardCache
    directory, url, sha256, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    cache = ShardCache(directory, "1GiB", storage_options=json.loads(os.environ["TEST_STORAGE_OPTIONS"]))
    handle = cache.open(url, sha256, size)
    print("filling", flush=True)
    time.sleep(600)
    """
)


def test_a_filler_killed_mid_fill_leaves_nothing_complete_and_its_readers_go_on(
    s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path
) -> None:
    big = os.urandom(24 << 20)  # three of the cache's 8 MiB store reads
    sha256, size = hashlib.sha256(big).hexdigest(), len(big)
    s3_bucket.put("big.tar", big)
    url = f"{s3_bucket.url}/big.tar"
    s3_server.throttle(16 << 20)  # 1.5 s for the whole object
    directory = tmp_path / "cache"
    filler = subprocess.Popen(
        [sys.executable, "-c", KILLED_FILLER, str(directory), url, sha256, str(size)],
        env=child_env(s3_server),
        stdout=subprocess.PIPE,
    )
    try:
        assert filler.stdout is not None and filler.stdout.readline() == b"filling\n"
        part = directory / "partial" / f"{sha256}-{size}.part"
        deadline = time.monotonic() + 30
        while not (part.exists() and part.stat().st_size >= 8 << 20):
            assert time.monotonic() < deadline, "the fill did not start"
            time.sleep(0.01)
        cache = ShardCache(directory, "1GiB", storage_options=s3_server.storage_options)
        follower = cache.open(url, sha256, size)  # another process's fill in progress: this one follows it
        assert cache.stats().followed == 1
        filler.send_signal(signal.SIGKILL)
        filler.wait(timeout=10)
    finally:
        if filler.poll() is None:
            filler.kill()
            filler.wait()
    s3_server.throttle(0)
    assert not cache.contains(sha256, size)  # nothing complete-looking: only the dead fill's partial file
    assert follower.read() == big  # it went on from the store where the dead fill stopped
    follower.close()
    assert not cache.contains(sha256, size)  # a follower does not publish what it did not fill
    assert read_shard(cache, url, sha256, size) == big  # the next open fills it again
    cache.wait()
    assert cache.contains(sha256, size)
    assert files_under(directory / "partial") == []
    assert Path(cache.path_for(sha256)).read_bytes() == big
    cache.close()


def test_a_forked_child_does_not_keep_its_parents_fill_locked(s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path) -> None:
    import multiprocessing

    url, sha256, size, rel = addresses(s3_bucket)[3]
    damaged = bytearray((s3_bucket.local / rel).read_bytes())
    damaged[0] ^= 0xFF
    s3_bucket.put(rel, bytes(damaged))
    s3_server.throttle(60_000)  # the fill takes half a second: the fork happens while it holds the shard's lock
    cache = ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options)
    handle = cache.open(url, sha256, size)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    try:
        with pytest.raises(ManifestError):
            handle.read()
        handle.close()
        cache.wait()
        s3_server.throttle(0)
        outcome: list[BaseException] = []

        def open_again() -> None:
            try:
                read_shard(cache, url, sha256, size)
            except ManifestError as exc:
                outcome.append(exc)

        again = threading.Thread(target=open_again, daemon=True)
        again.start()
        again.join(timeout=20)
        assert not again.is_alive(), "the lock of the failed fill is still held by the forked child"
        assert len(outcome) == 1
    finally:
        child.kill()
        child.join()
    cache.close()


def test_leftovers_of_a_dead_fill_are_removed_when_the_space_is_counted(s3_server: S3Server, tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    cache = ShardCache(directory, "1MiB")
    digest = "ab" * 32
    (directory / "partial" / f"{digest}-1000.part").write_bytes(b"x" * 10)  # no live filler holds its lock
    usage = cache.usage()
    assert (usage.used_bytes, usage.filling) == (0, 0)
    assert files_under(directory / "partial") == []


def test_keyed_by_sha256_a_changed_shard_is_never_served_stale(s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path) -> None:
    shards = addresses(s3_bucket)
    url, old_sha, old_size, rel = shards[0]
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options) as cache:
        for address in shards:
            read_shard(cache, *address[:3])
        new = (s3_bucket.local / shards[1][3]).read_bytes() + b"\0" * 10240  # a reshard wrote other bytes under that name
        s3_bucket.put(rel, new)
        new_sha = hashlib.sha256(new).hexdigest()
        s3_server.reset_reads()
        assert read_shard(cache, url, new_sha, len(new)) == new
        assert downloads(s3_server, s3_bucket, rel, len(new)) == 1
        cache.wait()
        assert cache.contains(new_sha, len(new)) and cache.contains(old_sha, old_size)
        freed = cache.prune([new_sha] + [s[1] for s in shards[1:]])
        assert freed == old_size
        assert not cache.contains(old_sha, old_size) and cache.contains(new_sha, len(new))


def test_prefetch_fills_in_the_background(s3_server: S3Server, s3_bucket: Bucket, tmp_path: Path) -> None:
    shards = addresses(s3_bucket)
    s3_server.throttle(400_000)
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=s3_server.storage_options, prefetch_threads=4) as cache:
        assert cache.prefetch(s[:3] for s in shards) == len(shards)
        assert cache.prefetch(s[:3] for s in shards) == 0  # queued already
        url, sha256, size, rel = shards[0]
        assert read_shard(cache, url, sha256, size) == (s3_bucket.local / rel).read_bytes()  # it follows the prefetch
        cache.wait()  # for the fills queued and in flight
        assert all(cache.contains(s[1], s[2]) for s in shards)
        stats = cache.stats()
        s3_server.throttle(0)
        s3_server_reads_before = s3_server.reads()
        for url, sha256, size, rel in shards:
            assert read_shard(cache, url, sha256, size) == (s3_bucket.local / rel).read_bytes()
        assert s3_server.reads() == s3_server_reads_before
    assert stats.prefetched >= len(shards) - 1 and stats.fills == len(shards)
    for _, _, size, rel in shards:
        assert downloads(s3_server, s3_bucket, rel, size) == 1


def test_an_unreachable_store_is_a_source_error(s3_bucket: Bucket, tmp_path: Path, get_free_port) -> None:
    url, sha256, size, _ = addresses(s3_bucket)[0]
    options = {
        "endpoint_url": f"http://127.0.0.1:{get_free_port()}",
        "key": "testing",
        "secret": "testing",
        "retries": 1,
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
    }
    with ShardCache(tmp_path / "cache", "1GiB", storage_options=options) as cache:
        with pytest.raises(SourceError, match="cannot read"):
            read_shard(cache, url, sha256, size)
    assert files_under(tmp_path / "cache" / "partial") == []
    assert files_under(tmp_path / "cache" / "shards") == []


def test_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="local folder"):
        ShardCache("s3://bucket/cache", "1GiB")
    with pytest.raises(ConfigError, match="not a size"):
        ShardCache(tmp_path / "cache", "lots")
    cache = ShardCache(tmp_path / "cache", "1.5GiB")
    assert cache.max_bytes == 3 * 2**29
    with pytest.raises(ConfigError, match="sha256"):
        cache.open("s3://bucket/shard.tar", "../../etc/passwd", 10)
    with pytest.raises(ConfigError, match="size"):
        cache.open("s3://bucket/shard.tar", "0" * 64, -1)


def test_a_local_store_works_too(s3_dataset: Path, tmp_path: Path) -> None:
    manifest = read_manifest(s3_dataset)
    with ShardCache(tmp_path / "cache", "1GiB") as cache:
        for shard in manifest.shards:
            path = str(s3_dataset / shard.path)
            assert read_shard(cache, path, shard.sha256, shard.bytes) == Path(path).read_bytes()
        cache.wait()
        assert cache.stats().fills == len(manifest.shards)

