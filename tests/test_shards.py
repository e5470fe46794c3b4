"""Shard planning (seeded permutation, shard names) and sample keys; the tar format is tests/io/test_tar.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.io.tar import member_name, split_key
from pipeline.prepare.plan import ShardPlan, permute, plan_shards, shard_name
from pipeline.prepare.sample.make import sample_key

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
    assert "shuffle" not in plan.to_dict()  # a shuffled plan is recorded as plans were before order="aspect"
    unshuffled = plan_shards(123, 10, seed=9, shuffle=False)
    assert ShardPlan(**json.loads(json.dumps(unshuffled.to_dict()))) == unshuffled


def test_an_unshuffled_plan_keeps_the_listing_order():
    plan = plan_shards(10, 4, seed=1, shuffle=False)
    assert [plan.indices(i).tolist() for i in range(plan.shards)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


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


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80), st.sampled_from(["jpg", "cls", "json", "seg.png"]))
def test_sample_keys_are_keys_the_tar_writer_accepts(path, extension):
    key = sample_key(path)
    name = member_name(key, extension)
    assert split_key(name) == (key, extension)
    assert len(name.encode("utf-8")) <= 100  # a plain ustar name


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
