"""Shard planning (seeded permutation), sample keys, crash-safe reproducible tars."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import tarfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import StorageError
from pipeline.prepare.sample import sample_key
from pipeline.io.tar import TAR_MTIME, TarShardWriter, iter_tar_samples
from pipeline.manifest import ShardInfo
from pipeline.prepare.plan import ShardPlan, permute, plan_shards, shard_name
from pipeline.io.fs import file_sha256

# ---------------------------------------------------------------------------
# permute: a seeded bijection of range(n)


def _permutation(n: int, seed: int) -> np.ndarray:
    return permute(np.arange(n, dtype=np.uint64), n, seed)


def _assert_bijection(n: int, seed: int) -> np.ndarray:
    out = _permutation(n, seed)
    assert out.shape == (n,)
    assert out.dtype == np.int64
    assert np.array_equal(np.sort(out), np.arange(n))
    return out


@pytest.mark.parametrize(
    "n",
    [0, 1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 64, 97, 127, 128, 255, 256, 257, 1000, 1024, 4096, 4097, 65521, 65536],
)
@pytest.mark.parametrize("seed", [0, 1, 12345, 2**63 - 1])
def test_permute_is_a_bijection(n, seed):
    _assert_bijection(n, seed)


@pytest.mark.parametrize("n", [99_991, 100_000, 2**17])
def test_permute_is_a_bijection_large(n):
    _assert_bijection(n, seed=7)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 2**63 - 1))
def test_permute_is_a_bijection_hypothesis(n, seed):
    _assert_bijection(n, seed)


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 3000), st.integers(0, 2**63 - 1), st.data())
def test_permute_of_a_subset_agrees_with_the_whole(n, seed, data):
    whole = _permutation(n, seed)
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start, n))
    part = permute(np.arange(start, stop, dtype=np.uint64), n, seed)
    assert np.array_equal(part, whole[start:stop])


def test_permute_is_deterministic():
    assert np.array_equal(_permutation(1000, 42), _permutation(1000, 42))


@pytest.mark.parametrize("n", [10, 100, 1000, 4096, 100_000])
def test_different_seeds_give_different_orders(n):
    orders = {tuple(_permutation(n, seed)) for seed in range(8)}
    assert len(orders) == 8


def test_permute_actually_shuffles():
    out = _permutation(10_000, 3)
    # Not the identity and not a shift: few fixed points, and neighbours land far apart.
    assert np.count_nonzero(out == np.arange(10_000)) < 50
    assert np.median(np.abs(np.diff(out))) > 100


# ---------------------------------------------------------------------------
# ShardPlan


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3000), st.integers(1, 500), st.integers(0, 2**32))
def test_plan_covers_every_index_exactly_once(items, per_shard, seed):
    plan = plan_shards(items, per_shard, seed)
    expected_shards = -(-items // per_shard)
    assert plan.shards == expected_shards
    seen = []
    for shard in range(plan.shards):
        positions = plan.positions(shard)
        assert positions.start == shard * per_shard
        assert len(positions) == (per_shard if shard < plan.shards - 1 else items - per_shard * (plan.shards - 1))
        indices = plan.indices(shard)
        assert len(indices) == len(positions)
        seen.extend(indices.tolist())
    assert sorted(seen) == list(range(items))


def test_plan_shapes():
    plan = plan_shards(10, 4, seed=1)
    assert plan.shards == 3
    assert [list(plan.positions(i)) for i in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [len(plan.indices(i)) for i in range(3)] == [4, 4, 2]
    assert plan_shards(0, 4, seed=1).shards == 0
    assert plan_shards(1, 4, seed=1).shards == 1
    assert plan_shards(8, 4, seed=1).shards == 2
    assert plan_shards(5, 0, seed=1).samples_per_shard == 1  # clamped, never a division by zero
    assert plan_shards(5, 0, seed=1).shards == 5


def test_plan_shuffles_across_shards_and_depends_on_seed():
    a, b = plan_shards(1000, 100, seed=1), plan_shards(1000, 100, seed=2)
    assert sorted(a.indices(0).tolist()) != list(range(100))
    assert a.indices(0).tolist() != b.indices(0).tolist()
    assert a.indices(3).tolist() == plan_shards(1000, 100, seed=1).indices(3).tolist()


def test_plan_to_dict_round_trips():
    plan = plan_shards(123, 10, seed=9)
    assert ShardPlan(**json.loads(json.dumps(plan.to_dict()))) == plan


def test_shard_name():
    assert shard_name(0) == "shard-000000.tar"
    assert shard_name(123456) == "shard-123456.tar"


# ---------------------------------------------------------------------------
# sample_key


def test_sample_key_is_readable_and_safe():
    key = sample_key("dogs/My Dog.2.jpg")
    assert key.startswith("dogs_My_Dog_2_jpg-")
    assert "." not in key and "/" not in key


@pytest.mark.parametrize(
    "paths",
    [
        ["a.b.jpg", "a_b.jpg", "a/b.jpg", "a b.jpg", "a__b.jpg", "a-b.jpg", "a_b_jpg"],
        ["été.jpg", "ete.jpg", "été.jpg", "日本.jpg", "中国.jpg", "..jpg", "...", ""],
        ["cat/1.jpg", "Cat/1.jpg", "cat/1.JPG", "cat/01.jpg"],
        ["x" * 100 + "1.jpg", "x" * 100 + "2.jpg"],  # same truncated slug
    ],
)
def test_sample_key_unique_for_paths_that_slug_the_same(paths):
    keys = [sample_key(p) for p in paths]
    assert len(set(keys)) == len(set(paths))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_sample_key_has_no_dots_or_slashes(path):
    key = sample_key(path)
    assert key
    assert "." not in key and "/" not in key and "\\" not in key
    assert key.isascii() and key.isprintable() and " " not in key
    assert key == sample_key(path)
    assert len(key) <= 48 + 1 + 16  # tar USTAR names stay well under 100 chars


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=30), min_size=2, max_size=30, unique=True))
def test_sample_key_unique_for_distinct_paths(paths):
    assert len({sample_key(p) for p in paths}) == len(paths)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="ab./_- é", max_size=12), st.text(alphabet="ab./_- é", max_size=12))
def test_sample_key_collides_only_for_equal_paths(a, b):
    assert (sample_key(a) == sample_key(b)) == (a == b)


def test_sample_key_handles_undecodable_file_names():
    name = b"caf\xe9.jpg".decode("utf-8", "surrogateescape")  # a latin-1 name on a UTF-8 system
    key = sample_key(name)
    assert "." not in key and "/" not in key
    assert key != sample_key("caf_.jpg")


# ---------------------------------------------------------------------------
# TarShardWriter


def _members(i: int) -> dict[str, bytes]:
    return {"jpg": bytes([i]) * (100 + 37 * i), "cls": str(i % 2).encode(), "json": json.dumps({"i": i}).encode()}


SAMPLES = [(sample_key(f"class{i % 2}/img.{i}.jpg"), _members(i)) for i in range(5)]


def _write(path: str, samples=SAMPLES, variant=None) -> ShardInfo:
    with TarShardWriter(path) as writer:
        for key, members in samples:
            writer.write_sample(key, members)
        return writer.commit(os.path.basename(path), variant)


def test_commit_gives_a_readable_tar(tmp_path):
    path = str(tmp_path / "sub" / shard_name(0))
    info = _write(path)
    assert os.path.exists(path)
    assert os.listdir(tmp_path / "sub") == [shard_name(0)]  # no temp file left
    with tarfile.open(path) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [f"{k}.{ext}" for k, m in SAMPLES for ext in sorted(m)]
        for member in members:
            assert member.isfile()
            assert member.mtime == TAR_MTIME
            assert member.uid == member.gid == 0
            assert member.uname == member.gname == ""
            assert member.mode == 0o644
        first = tar.extractfile(members[0])
        assert first is not None
    assert list(iter_tar_samples(path)) == SAMPLES
    assert info.samples == len(SAMPLES)


def test_commit_gives_a_webdataset_readable_tar(tmp_path):
    import webdataset as wds

    path = str(tmp_path / shard_name(0))
    _write(path)
    rows = list(wds.WebDataset([path], shardshuffle=False))
    assert [row["__key__"] for row in rows] == [key for key, _ in SAMPLES]
    for row, (_, members) in zip(rows, SAMPLES):
        assert row["jpg"] == members["jpg"]
        assert row["cls"] == members["cls"]
        assert json.loads(row["json"]) == json.loads(members["json"])


def test_webdataset_decodes_keys_and_classes(tmp_path):
    import webdataset as wds

    path = str(tmp_path / shard_name(0))
    _write(path)
    rows = list(wds.WebDataset([path], shardshuffle=False).decode().to_tuple("__key__", "cls", "json"))
    assert [(k, c, j["i"]) for k, c, j in rows] == [(k, i % 2, i) for i, (k, _) in enumerate(SAMPLES)]


def test_two_writes_are_byte_identical(tmp_path):
    a, b = str(tmp_path / "a" / shard_name(0)), str(tmp_path / "b" / shard_name(0))
    info_a = _write(a)
    info_b = _write(b)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()
    assert info_a.sha256 == info_b.sha256


def test_member_order_is_independent_of_dict_order(tmp_path):
    a, b = str(tmp_path / "a.tar"), str(tmp_path / "b.tar")
    members = {"jpg": b"x", "cls": b"1", "json": b"{}"}
    _write(a, [("k", members)])
    _write(b, [("k", dict(reversed(list(members.items()))))])
    assert file_sha256(a) == file_sha256(b)


def test_shard_info_matches_the_file(tmp_path):
    path = str(tmp_path / shard_name(3))
    info = _write(path, variant=2)
    with open(path, "rb") as handle:
        data = handle.read()
    assert info.bytes == len(data) == os.path.getsize(path)
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert (info.sha256, info.bytes) == file_sha256(path)
    assert len(data) % tarfile.RECORDSIZE == 0
    assert info.path == shard_name(3)
    assert info.variant == 2
    assert info.to_dict() == {"path": shard_name(3), "samples": 5, "bytes": len(data), "sha256": info.sha256,
                              "variant": 2}
    assert "variant" not in _write(str(tmp_path / "x.tar")).to_dict()


def test_empty_shard_is_a_valid_tar(tmp_path):
    path = str(tmp_path / "empty.tar")
    info = _write(path, samples=[])
    assert info.samples == 0
    with tarfile.open(path) as tar:
        assert tar.getmembers() == []


def test_exception_leaves_no_temp_and_no_final_file(tmp_path):
    path = str(tmp_path / shard_name(0))
    with pytest.raises(RuntimeError, match="cancelled"):
        with TarShardWriter(path) as writer:
            writer.write_sample(*SAMPLES[0])
            assert os.path.exists(writer.temp_path)
            raise RuntimeError("cancelled")
    assert os.listdir(tmp_path) == []


def test_leaving_without_commit_leaves_nothing(tmp_path):
    path = str(tmp_path / shard_name(0))
    with TarShardWriter(path) as writer:
        writer.write_sample(*SAMPLES[0])
    assert os.listdir(tmp_path) == []


def test_temp_file_is_hidden_in_the_same_folder(tmp_path):
    path = str(tmp_path / shard_name(0))
    writer = TarShardWriter(path)
    assert os.path.dirname(writer.temp_path) == str(tmp_path)
    assert os.path.basename(writer.temp_path).startswith(".")
    assert not os.path.basename(writer.temp_path).endswith(".tar")  # never mistaken for a shard


def test_commit_replaces_a_stale_shard(tmp_path):
    path = tmp_path / shard_name(0)
    path.write_bytes(b"partial garbage")
    info = _write(str(path))
    assert info.bytes == path.stat().st_size
    assert list(iter_tar_samples(str(path))) == SAMPLES


class _FullDisk:
    """A file object whose writes fail like a full disk after `budget` bytes."""

    def __init__(self, raw, budget: int) -> None:
        self.raw = raw
        self.budget = budget

    def write(self, data: bytes) -> int:
        if len(data) > self.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget -= len(data)
        return self.raw.write(data)

    def __getattr__(self, name):
        return getattr(self.raw, name)


def _patch_open_full_disk(monkeypatch, budget: int) -> None:
    """Make the shard writer's temp file fail like a full disk after `budget` bytes."""
    import builtins

    import pipeline.io.tar as shards_module

    def opener(path, mode="r", *args, **kwargs):
        handle = builtins.open(path, mode, *args, **kwargs)
        return _FullDisk(handle, budget) if "w" in mode else handle

    monkeypatch.setattr(shards_module, "open", opener, raising=False)


@pytest.mark.parametrize("budget", [0, 1500, 4000])
def test_enospc_while_writing_is_storage_error(tmp_path, monkeypatch, budget):
    path = str(tmp_path / shard_name(0))
    _patch_open_full_disk(monkeypatch, budget)
    with pytest.raises(StorageError, match="no space left") as caught:
        with TarShardWriter(path) as writer:
            for key, members in SAMPLES:
                writer.write_sample(key, members)
            writer.commit(shard_name(0))
    cause = caught.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
    assert path in str(caught.value)
    assert "run the same command again" in str(caught.value)
    assert os.listdir(tmp_path) == []


def test_enospc_in_the_end_of_archive_is_storage_error(tmp_path, monkeypatch):
    path = str(tmp_path / shard_name(0))
    sample_bytes = 3 * (512 + 512)  # one small sample: three members, each a header and a data block
    _patch_open_full_disk(monkeypatch, sample_bytes + 100)
    with pytest.raises(StorageError, match="no space left"):
        with TarShardWriter(path) as writer:
            writer.write_sample("k", {"jpg": b"x" * 10, "cls": b"1", "json": b"{}"})
            assert writer.samples == 1  # the sample fitted; the end-of-archive blocks do not
            writer.commit(shard_name(0))
    assert os.listdir(tmp_path) == []


def test_enospc_at_commit_is_storage_error(tmp_path, monkeypatch):
    path = str(tmp_path / shard_name(0))

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StorageError, match="no space left"):
        with TarShardWriter(path) as writer:
            writer.write_sample(*SAMPLES[0])
            monkeypatch.setattr(os, "fsync", no_space)
            writer.commit(shard_name(0))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_other_os_errors_are_storage_errors(tmp_path, monkeypatch):
    path = str(tmp_path / shard_name(0))

    def denied(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(StorageError, match="cannot write.*Permission denied"):
        with TarShardWriter(path) as writer:
            writer.write_sample(*SAMPLES[0])
            monkeypatch.setattr(os, "replace", denied)
            writer.commit(shard_name(0))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_cannot_create_temp_is_storage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StorageError, match="cannot create"):
        with TarShardWriter(str(blocker / shard_name(0))):
            pass


def test_iter_tar_samples_groups_members_by_key(tmp_path):
    path = str(tmp_path / "x.tar")
    with tarfile.open(path, "w") as tar:
        for name, data in [("a.jpg", b"1"), ("a.cls", b"0"), ("dir/b.jpg", b"2"), ("b.seg.png", b"3")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    # WebDataset's rule: the key is the member's path up to the first dot of its base name.
    assert list(iter_tar_samples(path)) == [
        ("a", {"jpg": b"1", "cls": b"0"}),
        ("dir/b", {"jpg": b"2"}),
        ("b", {"seg.png": b"3"}),
    ]


# ---------------------------------------------------------------------------
# The loader's streaming tar reader (pipeline.io.tar): what tarfile reads, or a clear error


def _tar_bytes(members: list[tuple[str, bytes]], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
@pytest.mark.parametrize("chunk", [512, 1536, 1 << 22])
def test_reader_reads_what_tarfile_reads(monkeypatch, fmt, chunk):
    from pipeline.io import tar as reader

    monkeypatch.setattr(reader, "_CHUNK", chunk)  # members and headers across every chunk boundary
    long_name = "deep/" * 30 + "long.jpg" if fmt != tarfile.USTAR_FORMAT else "deep/long.jpg"
    members = [("a.jpg", os.urandom(1000)), ("a.cls", b"3"), (long_name, os.urandom(5000)), ("e.json", b"")]
    members += [(f"k{i}.jpg", os.urandom(i * 37)) for i in range(20)]
    read = list(reader.iter_tar_members(io.BytesIO(_tar_bytes(members, fmt))))
    assert read == members


def test_reader_refuses_a_damaged_header_and_a_truncated_member():
    from pipeline.io import tar as reader

    data = bytearray(_tar_bytes([("a.jpg", b"x" * 3000), ("b.jpg", b"y" * 100)]))
    damaged = bytes(data[:100]) + bytes([data[100] ^ 0x20]) + bytes(data[101:])  # a flipped bit in the mode field
    with pytest.raises(reader.TarFormatError, match="checksum"):
        list(reader.iter_tar_members(io.BytesIO(damaged)))
    with pytest.raises(reader.TarFormatError, match="truncated"):
        list(reader.iter_tar_members(io.BytesIO(bytes(data[:2048]))))
