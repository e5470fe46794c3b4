"""Damaged data in `make_loader`: full, equal batches whatever is damaged, the counts, the warnings, and on_error="raise".

Each test damages a copy of one small prepared dataset the way real disks and
copies do (a shard cut short, a shard gone, flipped bytes, an image that does
not decode, a sample without an image) and checks that every epoch still has
`len(loader)` batches of `batch_size`, what was lost and what stood in for it
(labels name samples here), and what the stats and the log say. The DDP tests
run two ranks under torchrun with a collective per batch, so a rank with one
batch more or less would show.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from loader_data import cut_inside_sample, flip_bytes, prepare_labelled, rewrite_shard, shard_samples

from pipeline import AugmentSpec, ConfigError, SampleError
from pipeline.loader import make_loader
from pipeline.loader.dataset import resolve_dataset
from pipeline.loader.epoch import plan_epoch

N = 96
PER_SHARD = 12  # 8 shards; two ranks get 4 whole shards each
BATCH = 8
CROP = 56
GARBAGE = b"\xff\xd8\xff\xe0" + b"not a jpeg at all " * 8

Epoch = list[tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_labelled(tmp_path_factory.mktemp("damage"), "ds", N, shard_samples=PER_SHARD)


@pytest.fixture
def copy(dataset: Path, tmp_path: Path) -> Path:
    """A copy of the dataset this test may damage."""
    root = tmp_path / "copy"
    shutil.copytree(dataset, root)
    return root


def loader_for(root: Path | str, **options: object):
    options.setdefault("device", "cpu")
    options.setdefault("num_workers", 2)
    options.setdefault("shuffle_buffer", 32)
    return make_loader(str(root), options.pop("batch_size", BATCH), crop=CROP, **options)  # type: ignore[arg-type]


def run_epochs(loader, epochs: tuple[int, ...] = (0, 1)) -> list[Epoch]:
    got = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        got.append([(images.clone(), labels.clone()) for images, labels in loader])
    return got


def labels_of(batches: Epoch) -> list[int]:
    return [int(v) for _, labels in batches for v in labels]


def assert_full(loader, epochs: list[Epoch], batch_size: int = BATCH) -> None:
    for batches in epochs:
        assert len(batches) == len(loader)
        for images, labels in batches:
            assert images.shape == (batch_size, 3, CROP, CROP) and labels.shape == (batch_size,)


def shard_labels(root: Path, name: str) -> list[int]:
    return [int(sample["cls"]) for sample in shard_samples(root, name)]


def damage_warnings(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpufeed.loader" and name in r.getMessage()]


def break_samples(root: Path, name: str, garbage: tuple[int, ...] = (), imageless: tuple[int, ...] = ()) -> list[str]:
    """Rewrite a shard with undecodable images at `garbage` and no image at `imageless`; their keys."""
    keys = [sample["__key__"] for sample in shard_samples(root, name)]

    def damage(index: int, members: dict[str, bytes]) -> dict[str, bytes]:
        if index in garbage:
            members["jpg"] = GARBAGE
        if index in imageless:
            del members["jpg"]
        return members

    rewrite_shard(root, name, damage)
    return [keys[i] for i in (*garbage, *imageless)]


# ---------------------------------------------------------------------------
# Damaged shards


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_truncated_shard_every_batch_full_loss_counted_and_replaced(
    copy: Path, worker_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = "shard-000002.tar"
    lost = shard_labels(copy, name)[5:]
    cut_inside_sample(copy / name, 5)  # samples 0-4 still read; 7 lost
    loader = loader_for(copy, worker_type=worker_type)
    with caplog.at_level(logging.WARNING, logger="gpufeed.loader"):
        epochs = run_epochs(loader)
    assert len(loader) == N // BATCH
    assert_full(loader, epochs)
    for batches in epochs:
        labels = labels_of(batches)
        assert set(labels) == set(range(N)) - set(lost)  # everything else, the lost ones never
        assert len(labels) - len(set(labels)) == len(lost)  # stand-ins: samples of the epoch read again
    assert loader.stats.skipped == loader.stats.replaced == 2 * len(lost)
    assert loader.stats.bad_shards == 2 and loader.stats.batches == 2 * len(loader)
    warnings = damage_warnings(caplog, name)
    assert len(warnings) == 1, warnings  # once for the loader's life, naming the shard once
    assert warnings[0].count(name) == 1 and "truncated tar member" in warnings[0] and "7 " in warnings[0]


def test_shard_cut_at_a_member_boundary_is_short_by_the_manifest(copy: Path) -> None:
    # A file cut exactly between members has no end-of-archive blocks: a truncated tar. The sample before
    # the cut may be missing members the cut took, so it goes with the rest: 9, 10 and 11, and 8.
    import tarfile

    name = "shard-000004.tar"
    with tarfile.open(copy / name) as tar:
        tenth = [m for m in tar.getmembers() if m.name.endswith(".cls")][9]  # a sample's first member
    (copy / name).write_bytes((copy / name).read_bytes()[: tenth.offset])  # samples 0-8 whole
    loader = loader_for(copy, train=False)
    (batches,) = run_epochs(loader, (0,))
    assert_full(loader, [batches])
    assert loader.stats.skipped == loader.stats.replaced == 4 and loader.stats.bad_shards == 1


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_deleted_shard_is_made_up_from_the_ranks_own_samples(
    copy: Path, worker_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = "shard-000005.tar"
    lost = shard_labels(copy, name)
    (copy / name).unlink()
    loader = loader_for(copy, worker_type=worker_type)
    with caplog.at_level(logging.WARNING, logger="gpufeed.loader"):
        epochs = run_epochs(loader)
    assert_full(loader, epochs)
    for batches in epochs:
        assert set(labels_of(batches)) == set(range(N)) - set(lost)
    assert loader.stats.skipped == loader.stats.replaced == 2 * PER_SHARD and loader.stats.bad_shards == 2
    warnings = damage_warnings(caplog, name)
    assert len(warnings) == 1 and warnings[0].count(name) == 1 and "No such file" in warnings[0]


def test_flipped_bytes_only_verify_sees_and_nothing_delivered_is_taken_back(
    copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    name = "shard-000003.tar"
    clean = labels_of(run_epochs(loader_for(copy), (0,))[0])
    flip_bytes(copy / name)  # inside a .json member: every sample still reads and decodes
    unverified = loader_for(copy)
    assert labels_of(run_epochs(unverified, (0,))[0]) == clean
    assert (unverified.stats.skipped, unverified.stats.bad_shards) == (0, 0)  # nothing to see without a hash
    verified = loader_for(copy, verify=True)
    with caplog.at_level(logging.WARNING, logger="gpufeed.loader"):
        epochs = run_epochs(verified)
    assert_full(verified, epochs)
    assert labels_of(epochs[0]) == clean  # its samples were read before the hash could say: they stay
    assert verified.stats.bad_shards == 2 and verified.stats.skipped == verified.stats.replaced == 0
    warnings = damage_warnings(caplog, name)
    assert len(warnings) == 1 and "sha256" in warnings[0] and warnings[0].count(name) == 1


def test_verify_hashes_the_whole_shard_when_a_rank_reads_only_part_of_it(copy: Path) -> None:
    # Three ranks of 32: rank 0 reads shards 0, 1 and the first 8 samples of shard 2, whose last
    # sample (rank 1's) is damaged. Rank 0 reads the rest of the shard for the hash, and notices.
    flip_bytes(copy / "shard-000002.tar", ".json", -1)
    for rank in (0, 1):
        loader = loader_for(copy, train=False, verify=True, rank=rank, world_size=3)
        (batches,) = run_epochs(loader, (0,))
        assert_full(loader, [batches])
        assert loader.stats.bad_shards == 1 and loader.stats.skipped == 0, rank
    untouched = loader_for(copy, train=False, verify=True, rank=2, world_size=3)
    run_epochs(untouched, (0,))
    assert untouched.stats.bad_shards == 0


def test_verify_on_clean_shards_changes_nothing(dataset: Path) -> None:
    plain = run_epochs(loader_for(dataset), (1,))[0]
    verified_loader = loader_for(dataset, verify=True)
    verified = run_epochs(verified_loader, (1,))[0]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(plain, verified))
    assert verified_loader.stats.bad_shards == verified_loader.stats.skipped == 0


def test_a_rank_whose_every_shard_is_gone_reads_the_others(copy: Path) -> None:
    # Two ranks in eval mode: rank 1 reads shards 4-7; all gone, it takes the epoch's other shards.
    for index in range(4, 8):
        (copy / f"shard-{index:06d}.tar").unlink()
    loader = loader_for(copy, train=False, rank=1, world_size=2)
    (batches,) = run_epochs(loader, (0,))
    assert_full(loader, [batches])
    assert set(labels_of(batches)) <= set(shard_labels(copy, "shard-00000[0-3].tar"))
    assert loader.stats.skipped == loader.stats.replaced == N // 2 and loader.stats.bad_shards == 4


def test_nothing_readable_at_all_is_a_clear_error(copy: Path) -> None:
    for shard in copy.glob("shard-*.tar"):
        shard.unlink()
    with pytest.raises(SampleError, match="none of its shards can be read"):
        run_epochs(loader_for(copy), (0,))


# ---------------------------------------------------------------------------
# Damaged samples


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_undecodable_and_imageless_samples_are_replaced(
    copy: Path, worker_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = "shard-000001.tar"
    bad_labels = [shard_labels(copy, name)[i] for i in (3, 7)]
    keys = break_samples(copy, name, garbage=(3,), imageless=(7,))
    loader = loader_for(copy, worker_type=worker_type)
    with caplog.at_level(logging.WARNING, logger="gpufeed.loader"):
        epochs = run_epochs(loader)
    assert_full(loader, epochs)
    for batches in epochs:
        labels = labels_of(batches)
        assert set(labels) == set(range(N)) - set(bad_labels) and len(labels) - len(set(labels)) == 2
    assert loader.stats.skipped == loader.stats.replaced == 4 and loader.stats.bad_shards == 0
    for key, words in zip(keys, ("corrupt or truncated", "no image member")):
        warnings = damage_warnings(caplog, key)
        assert len(warnings) == 1 and words in warnings[0], warnings  # once, over both epochs


def test_an_undecodable_sample_takes_a_batch_mates_place(copy: Path) -> None:
    # Eval mode (centre crops, no flips): the stand-in is the same pixels as the batch mate it copies.
    name = "shard-000000.tar"
    bad_label = shard_labels(copy, name)[2]
    break_samples(copy, name, garbage=(2,))
    loader = loader_for(copy, train=False)
    (batches,) = run_epochs(loader, (0,))
    assert_full(loader, [batches])
    images, labels = batches[0]  # the first batch holds samples 0-7 of shard 0
    assert bad_label not in labels.tolist()
    twins = [i for i in range(BATCH) if labels.tolist().count(int(labels[i])) == 2]
    assert len(twins) == 2 and twins[0] != twins[1] and 2 in twins
    assert torch.equal(images[twins[0]], images[twins[1]])
    assert loader.stats.skipped == loader.stats.replaced == 1


def test_a_batch_with_no_decodable_sample_borrows_from_the_next(copy: Path) -> None:
    name = "shard-000000.tar"
    break_samples(copy, name, garbage=(0, 1, 2, 3))
    loader = loader_for(copy, train=False, batch_size=4)
    (batches,) = run_epochs(loader, (0,))
    assert_full(loader, [batches], batch_size=4)
    (first_images, first_labels), (next_images, next_labels) = batches[0], batches[1]
    for image, label in zip(first_images, first_labels.tolist()):
        assert label in next_labels.tolist()
        assert torch.equal(image, next_images[next_labels.tolist().index(label)])
    assert loader.stats.skipped == loader.stats.replaced == 4


def test_an_epoch_left_after_borrowing_gives_every_buffer_back(copy: Path) -> None:
    break_samples(copy, "shard-000000.tar", garbage=(0, 1, 2, 3))
    loader = loader_for(copy, train=False, batch_size=4)
    iterator = iter(loader)
    images, _ = next(iterator)  # borrowed from the next batch, which was looked at but not delivered
    assert images.shape[0] == 4
    iterator.close()
    loader.close()
    assert not loader._finish.outputs._busy  # every output buffer can be used again


def test_no_decodable_sample_anywhere_is_a_clear_error(copy: Path) -> None:
    for index in range(N // PER_SHARD):
        break_samples(copy, f"shard-{index:06d}.tar", garbage=tuple(range(PER_SHARD)))
    with pytest.raises(SampleError, match="no sample of its batch or of the batches behind it decodes"):
        run_epochs(loader_for(copy), (0,))


BAD_LABELS = [b"abc", b"1.5", b"", b"9" * 30, b"-5", str(N).encode(), b"\xd9\xa3", b"0x1f"]  # N: one past the classes


def break_labels(root: Path, name: str, labels: dict[int, bytes]) -> list[str]:
    """Rewrite a shard with the `cls` of sample i replaced by labels[i]; their keys."""
    keys = [sample["__key__"] for sample in shard_samples(root, name)]

    def damage(index: int, members: dict[str, bytes]) -> dict[str, bytes]:
        if index in labels:
            members["cls"] = labels[index]
        return members

    rewrite_shard(root, name, damage)
    return [keys[i] for i in labels]


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_a_label_that_is_no_class_index_is_sample_damage_replaced_and_counted(
    copy: Path, worker_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = "shard-000002.tar"
    lost = [shard_labels(copy, name)[i] for i in range(len(BAD_LABELS))]
    keys = break_labels(copy, name, dict(enumerate(BAD_LABELS)))
    loader = loader_for(copy, worker_type=worker_type)
    with caplog.at_level(logging.WARNING, logger="gpufeed.loader"):
        epochs = run_epochs(loader)
    assert_full(loader, epochs)
    for batches in epochs:
        labels = labels_of(batches)
        assert set(labels) == set(range(N)) - set(lost)  # never -1, -5 or a label past the classes
    assert loader.stats.skipped == loader.stats.replaced == 2 * len(BAD_LABELS) and loader.stats.bad_shards == 0
    for key, label in zip(keys, BAD_LABELS):
        warnings = damage_warnings(caplog, key)
        assert len(warnings) == 1 and "label" in warnings[0], (label, warnings)
    assert "out of range (the dataset has 96 classes)" in damage_warnings(caplog, keys[5])[0]


def test_raise_stops_at_a_bad_label_naming_the_sample(copy: Path) -> None:
    (key,) = break_labels(copy, "shard-000001.tar", {4: b"9" * 30})
    with pytest.raises(SampleError) as caught:
        run_epochs(loader_for(copy, on_error="raise"), (0,))
    assert caught.value.sample == key and "label" in caught.value.reason and key in str(caught.value)


def test_a_shard_pattern_bounds_labels_by_int64(copy: Path) -> None:
    big = str(2**63 - 1).encode()
    break_labels(copy, "shard-000003.tar", {0: big, 1: str(2**63).encode(), 2: b"-1"})
    loader = loader_for(str(copy / "shard-{000000..000007}.tar"), train=False)
    (batches,) = run_epochs(loader, (0,))
    assert_full(loader, [batches])
    labels = labels_of(batches)
    assert 2**63 - 1 in labels and min(labels) >= 0  # no classes list: any int64 >= 0 is a label
    assert loader.stats.skipped == loader.stats.replaced == 2


def test_re_draws_are_bounded_when_far_more_is_lost_than_read_well(dataset: Path) -> None:
    # One readable shard of 12 and shards that claim 12 x 70 samples but are not there: the stand-ins
    # would read the 12 over and over, 70 times; past MAX_REDRAW_PASSES the epoch says so instead.
    from pipeline.loader.damage import DamageLog
    from pipeline.loader.dataset import ShardRef
    from pipeline.loader.epoch import MAX_REDRAW_PASSES, epoch_records
    from pipeline.specs import LoaderSpec

    good = ShardRef(str(dataset / "shard-000000.tar"), PER_SHARD)
    missing = [ShardRef(str(dataset / f"gone-{i}.tar"), PER_SHARD * 10) for i in range(7)]
    spec = LoaderSpec(batch_size=BATCH, train=False)
    records = epoch_records([good, *missing], spec, 0, 0, 1, DamageLog("skip"))
    with pytest.raises(SampleError, match=f"over {MAX_REDRAW_PASSES} times the 12 that read well"):
        for _ in records:
            pass


# ---------------------------------------------------------------------------
# Same answers every way: worker kinds, resume, variant sets


def test_thread_and_process_workers_and_the_calling_thread_replace_alike(copy: Path) -> None:
    cut_inside_sample(copy / "shard-000006.tar", 4)
    break_samples(copy, "shard-000001.tar", garbage=(3,))
    threads = run_epochs(loader_for(copy), (1,))[0]
    for options in ({"worker_type": "process"}, {"num_workers": 0}):
        other = run_epochs(loader_for(copy, **options), (1,))[0]
        assert len(other) == len(threads)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(threads, other)), options


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_resume_mid_epoch_with_damage_continues_exactly(copy: Path, worker_type: str) -> None:
    cut_inside_sample(copy / "shard-000006.tar", 4)
    break_samples(copy, "shard-000001.tar", garbage=(3, 9))
    full = loader_for(copy, worker_type=worker_type)
    (uninterrupted,) = run_epochs(full, (1,))
    partial = loader_for(copy, worker_type=worker_type)
    partial.set_epoch(1)
    iterator = iter(partial)
    for _ in range(5):
        next(iterator)
    state = json.loads(json.dumps(partial.state_dict()))
    del iterator
    resumed = loader_for(copy, worker_type=worker_type)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    rest = [(images.clone(), labels.clone()) for images, labels in resumed]
    assert len(rest) == len(uninterrupted) - 5
    for (a_images, a_labels), (b_images, b_labels) in zip(uninterrupted[5:], rest):
        assert torch.equal(a_labels, b_labels) and torch.equal(a_images, b_images)
        assert b_labels.shape == (BATCH,)
    # 8 lost with the shard, 2 that do not decode, and any stand-in that is one of those 2 read again.
    assert full.stats.skipped == full.stats.replaced >= PER_SHARD - 4 + 2


def test_damage_in_one_variant_set_counts_in_its_epochs_only(tmp_path: Path) -> None:
    root = prepare_labelled(
        tmp_path, "variants", 48, min_side=240, shard_samples=PER_SHARD, augment=AugmentSpec(variants=2)
    )
    cut_inside_sample(root / "v1" / "shard-000001.tar", 6)  # 6 lost in the epochs reading set 1
    loader = loader_for(root)
    assert len(loader) == 48 // BATCH
    counts = []
    for epochs in ((0,), (1,), (2,), (3,)):
        before = loader.stats.skipped
        assert_full(loader, run_epochs(loader, epochs))
        counts.append(loader.stats.skipped - before)
    assert counts == [0, 6, 0, 6] and loader.stats.replaced == 12


def test_damage_warnings_are_one_per_shard_or_sample_and_bounded(
    dataset: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from pipeline.loader.damage import Damage
    from pipeline.loader.iteration import WARNINGS_LIMIT

    loader = loader_for(dataset)
    with caplog.at_level(logging.WARNING, logger="gpufeed.loader"):
        for key in [f"k{i}" for i in range(WARNINGS_LIMIT + 50)] + ["k0", "k1"]:
            loader._report(Damage(f"sample {key}: bad", lost=1, replaced=1, sample=key, reason="bad"))
        loader._report(Damage("damaged shard s.tar: gone", lost=12, shard="s.tar", reason="gone"))
    messages = [r.getMessage() for r in caplog.records if r.name == "gpufeed.loader"]
    assert len(messages) == WARNINGS_LIMIT + 1 and "not logged" in messages[-1]
    assert len(set(messages)) == len(messages)
    stats = loader.stats
    assert (stats.skipped, stats.replaced, stats.bad_shards) == (WARNINGS_LIMIT + 52 + 12, WARNINGS_LIMIT + 52, 1)


# ---------------------------------------------------------------------------
# on_error="raise" and the settings


def test_raise_stops_at_a_truncated_shard_naming_it(copy: Path) -> None:
    name = "shard-000002.tar"
    cut_inside_sample(copy / name, 5)
    loader = loader_for(copy, on_error="raise")
    delivered = 0
    with pytest.raises(SampleError) as caught:
        for _ in loader:
            delivered += 1
    error = caught.value
    assert error.shard == str(copy / name) and error.reason == "truncated tar member" and error.sample == ""
    assert str(error).count(name) == 1 and delivered < len(loader)


def test_raise_stops_at_a_missing_shard_and_at_a_verify_mismatch(dataset: Path, copy: Path) -> None:
    (copy / "shard-000005.tar").unlink()
    with pytest.raises(SampleError, match="shard-000005.tar: cannot read it") as caught:
        run_epochs(loader_for(copy, on_error="raise"), (0,))
    assert caught.value.shard == str(copy / "shard-000005.tar")
    shutil.copy(dataset / "shard-000005.tar", copy / "shard-000005.tar")
    flip_bytes(copy / "shard-000003.tar")
    with pytest.raises(SampleError, match="sha256") as caught:
        run_epochs(loader_for(copy, on_error="raise", verify=True), (0,))
    assert caught.value.shard == str(copy / "shard-000003.tar")


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_raise_stops_at_an_undecodable_sample_naming_it(copy: Path, worker_type: str) -> None:
    (key,) = break_samples(copy, "shard-000001.tar", garbage=(3,))
    with pytest.raises(SampleError) as caught:
        run_epochs(loader_for(copy, on_error="raise", worker_type=worker_type), (0,))
    assert caught.value.sample == key and "corrupt or truncated" in caught.value.reason and key in str(caught.value)


def test_raise_on_clean_data_changes_nothing(dataset: Path) -> None:
    strict = run_epochs(loader_for(dataset, on_error="raise"), (0,))[0]
    default = run_epochs(loader_for(dataset), (0,))[0]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(strict, default))


def test_error_policy_settings_are_checked(dataset: Path) -> None:
    with pytest.raises(ConfigError, match="on_error must be 'skip'"):
        loader_for(dataset, on_error="ignore")
    with pytest.raises(ConfigError, match="verify must be True or False"):
        loader_for(dataset, verify="yes")
    count = len(list(dataset.glob("shard-*.tar")))
    pattern = str(dataset / f"shard-{{000000..{count - 1:06d}}}.tar")
    with pytest.raises(ConfigError, match="verify=True checks shards against their manifest's sha256"):
        loader_for(pattern, verify=True)
    assert loader_for(pattern).spec.on_error == "skip"


# ---------------------------------------------------------------------------
# Two ranks under torchrun: equal batches, nothing hangs

DDP_SCRIPT = r"""
import json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
from pipeline import SampleError
from pipeline.loader import make_loader

rank = dist.get_rank()
mode, out, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])


def step(value):
    # One collective per batch: both ranks must be at the same (case, epoch, batch), or it shows.
    both = torch.tensor([value, -value], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both[0].item() == -both[1].item() == value


def save(result):
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)


results = {}
for number, case in enumerate(cases):
    loader = make_loader(case["root"], 8, device="cpu", crop=56, num_workers=1, shuffle_buffer=32,
                         verify=case["verify"], on_error=mode)
    epochs, synced, sizes = [], True, set()
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        count = 0
        try:
            for images, labels in loader:
                sizes.add(int(labels.shape[0]))
                synced &= step(number * 10000 + epoch * 1000 + count)
                count += 1
        except SampleError as exc:  # on_error="raise": this rank met the damage
            save({"raised": type(exc).__name__, "shard": exc.shard, "reason": exc.reason, "epoch": epoch, "batches": count})
            os._exit(0)  # without taking part in another collective: the other rank's next one fails
        except Exception as exc:  # the other rank: its collective fails once this one is gone
            save({"failed": type(exc).__name__, "message": str(exc)[:500], "epoch": epoch, "batches": count})
            os._exit(0)
        epochs.append(count)
    stats = loader.stats
    results[case["name"]] = {"batches": epochs, "len": len(loader), "sizes": sorted(sizes), "synced": synced,
                             "skipped": stats.skipped, "replaced": stats.replaced, "bad_shards": stats.bad_shards}
    loader.close()
save(results)
dist.barrier()
dist.destroy_process_group()
"""


def run_ranks(tmp_path: Path, port: int, mode: str, cases: list[dict[str, object]]) -> tuple[list[dict], float]:
    script = tmp_path / "ranks.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "ranks"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), str(script), mode, str(out), json.dumps(cases)]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)], elapsed


def test_ddp_two_ranks_equal_full_batches_whatever_is_damaged(dataset: Path, tmp_path: Path, get_free_port) -> None:
    roots = {}
    for name in ("truncated", "deleted", "flipped", "undecodable"):
        roots[name] = tmp_path / name
        shutil.copytree(dataset, roots[name])
    lost = PER_SHARD - 5
    cut_inside_sample(roots["truncated"] / "shard-000002.tar", 5)
    (roots["deleted"] / "shard-000005.tar").unlink()
    flip_bytes(roots["flipped"] / "shard-000003.tar")
    break_samples(roots["undecodable"], "shard-000001.tar", garbage=(3,))
    cases = [{"name": name, "root": str(root), "verify": name == "flipped"} for name, root in roots.items()]
    ranks, _ = run_ranks(tmp_path, get_free_port(), "skip", cases)
    for name in roots:
        first, second = ranks[0][name], ranks[1][name]
        assert first["batches"] == second["batches"] == [first["len"]] * 2 == [N // 2 // BATCH] * 2, name
        assert first["sizes"] == second["sizes"] == [BATCH] and first["synced"] and second["synced"], name
    total = {
        key: {name: ranks[0][name][key] + ranks[1][name][key] for name in roots}
        for key in ("skipped", "replaced", "bad_shards")
    }
    # Two epochs; each epoch, whichever rank reads the damaged shard or sample counts it.
    assert total["skipped"] == {"truncated": 2 * lost, "deleted": 2 * PER_SHARD, "flipped": 0, "undecodable": 2}
    assert total["replaced"] == total["skipped"]
    assert total["bad_shards"] == {"truncated": 2, "deleted": 2, "flipped": 2, "undecodable": 0}


def test_ddp_raise_stops_the_rank_that_met_it_and_the_other_rank_sees_its_collective_fail(
    copy: Path, tmp_path: Path, get_free_port
) -> None:
    name = "shard-000002.tar"
    cut_inside_sample(copy / name, 11)  # late in the shard: the ranks take a step together before it shows
    shards = resolve_dataset(copy).sets[0]
    index = [shard.url for shard in shards].index(str(copy / name))
    owner = next(
        rank
        for rank in (0, 1)
        if index
        in {s.shard for s in plan_epoch(shards, seed=0, epoch=0, rank=rank, world=2, shuffle=True, drop_last=True)[0]}
    )
    ranks, elapsed = run_ranks(
        tmp_path, get_free_port(), "raise", [{"name": "truncated", "root": str(copy), "verify": False}]
    )
    met, other = ranks[owner], ranks[1 - owner]
    assert met["raised"] == "SampleError" and met["shard"] == str(copy / name) and met["epoch"] == 0
    assert met["reason"] == "truncated tar member" and met["batches"] < N // 2 // BATCH
    # The other rank went on in step with it, then its next collective failed (gloo: the peer closed the
    # connection), long before the 60 s collective timeout: no hang.
    assert other["failed"] in ("RuntimeError", "DistBackendError") and other["epoch"] == 0, other
    assert other["batches"] == met["batches"] >= 1
    assert elapsed < 45, elapsed
