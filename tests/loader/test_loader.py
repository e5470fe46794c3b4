"""`make_loader` over real prepared shards: correctness, determinism, resume, DDP (damaged data: test_loader_damage.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from loader_data import prepare_labelled, shard_samples
from PIL import Image

import pipeline.loader.workers as workers_module
from pipeline import AugmentSpec, ConfigError
from pipeline.io.output import Output
from pipeline.loader import Loader, LoaderStats, make_loader
from pipeline.manifest import read_manifest
from pipeline.specs import IMAGENET_MEAN

N = 150
CROP = 56  # 56 / 64 = 0.875: eval mode is an exact centre crop of the prepared image
MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_labelled(tmp_path_factory.mktemp("loader"), "ds", N)


def loader_for(source: Path | str, batch_size: int = 16, **options: object):
    options.setdefault("device", "cpu")
    options.setdefault("num_workers", 2)
    options.setdefault("shuffle_buffer", 64)
    return make_loader(str(source), batch_size, crop=CROP, **options)  # type: ignore[arg-type]


def all_labels(loader) -> list[int]:
    return [int(v) for _, labels in loader for v in labels]


def reference_eval(jpeg: bytes) -> np.ndarray:
    """What eval mode must produce: PIL decode, centre crop, normalise (CHW float)."""
    image = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=np.float64)
    height, width = image.shape[:2]
    top, left = round((height - CROP) / 2), round((width - CROP) / 2)
    crop = image[top : top + CROP, left : left + CROP]
    return ((crop - MEAN) / STD).transpose(2, 0, 1)


def test_shapes_dtypes_and_memory_format(dataset: Path) -> None:
    loader = loader_for(dataset)
    images, labels = next(iter(loader))
    assert images.shape == (16, 3, CROP, CROP) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.shape == (16,)
    assert len(loader) == N // 16  # train mode drops the incomplete batch
    for dtype in ("float16", "bfloat16"):
        images, _ = next(iter(loader_for(dataset, dtype=dtype)))
        assert images.dtype == getattr(torch, dtype)
    images, _ = next(iter(loader_for(dataset, channels_last=True)))
    assert images.is_contiguous(memory_format=torch.channels_last)
    # uint8: the same crops and flips, not normalised; normalising them gives the float batch.
    for worker_type in ("thread", "process"):
        pixels, _ = next(iter(loader_for(dataset, dtype="uint8", worker_type=worker_type)))
        floats, _ = next(iter(loader_for(dataset, worker_type=worker_type)))
        assert pixels.dtype == torch.uint8 and pixels.shape == (16, 3, CROP, CROP)
        mean = torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1)
        assert torch.allclose((pixels.float() - mean) / std, floats, atol=1e-4)
    # Normalised with ImageNet statistics: roughly zero-centred, unit-scaled.
    assert -3.0 < float(images.float().mean()) < 3.0 and float(images.float().std()) > 0.2


def test_eval_mode_equals_reference_decode_and_crop_with_right_labels(dataset: Path) -> None:
    loader = loader_for(dataset, train=False, batch_size=32)
    assert len(loader) == -(-N // 32)
    expected = shard_samples(dataset)
    got_images = torch.cat([images for images, _ in loader]).numpy()
    got_labels = all_labels(loader)
    assert got_labels == [int(s["cls"]) for s in expected]
    manifest = read_manifest(Output(str(dataset)))
    for sample, label in zip(expected, got_labels):
        meta = json.loads(sample["json"])
        assert manifest.classes[label] == meta["label"] == str(label)
    reference = np.stack([reference_eval(s["jpg"]) for s in expected])
    assert got_images.shape == reference.shape
    assert np.abs(got_images - reference).max() < 1.01 / 255 / 0.224  # at most one grey level


def test_every_sample_exactly_once_per_epoch(dataset: Path) -> None:
    loader = loader_for(dataset, drop_last=False)
    assert sorted(all_labels(loader)) == list(range(N))
    dropping = loader_for(dataset)
    labels = all_labels(dropping)
    assert len(labels) == (N // 16) * 16 and len(set(labels)) == len(labels)


def test_set_epoch_reshuffles_deterministically(dataset: Path) -> None:
    first = loader_for(dataset, drop_last=False)
    first.set_epoch(0)
    epoch0 = all_labels(first)
    first.set_epoch(1)
    epoch1 = all_labels(first)
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    again = loader_for(dataset, drop_last=False, num_workers=1)
    again.set_epoch(1)
    assert all_labels(again) == epoch1


def test_batches_identical_across_worker_counts_and_kinds(dataset: Path) -> None:
    def batches(**options: object) -> list[torch.Tensor]:
        loader = loader_for(dataset, **options)
        loader.set_epoch(2)
        return [images for images, _ in loader][:3]

    reference = batches(num_workers=2)
    for options in ({"num_workers": 1}, {"worker_type": "process", "num_workers": 2}):
        other = batches(**options)
        assert all(torch.equal(a, b) for a, b in zip(reference, other)), options


def test_resume_mid_epoch_continues_exactly(dataset: Path) -> None:
    full = loader_for(dataset)
    full.set_epoch(3)
    uninterrupted = [(images, labels) for images, labels in full]
    partial = loader_for(dataset)
    partial.set_epoch(3)
    iterator = iter(partial)
    for _ in range(4):
        next(iterator)
    state = partial.state_dict()
    assert state["epoch"] == 3 and state["batches"] == 4
    resumed = loader_for(dataset)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a checkpoint file
    resumed.set_epoch(3)  # the usual training loop calls this again: it must not restart
    rest = [(images, labels) for images, labels in resumed]
    assert len(rest) == len(uninterrupted) - 4
    for (a_images, a_labels), (b_images, b_labels) in zip(uninterrupted[4:], rest):
        assert torch.equal(a_labels, b_labels) and torch.equal(a_images, b_images)
    assert resumed.epoch == 4  # a finished epoch moves on


def test_variant_sets_switch_with_epoch(tmp_path: Path) -> None:
    # Raw images large enough that every random crop still yields a 64 px shorter side.
    root = prepare_labelled(tmp_path, "variants", 40, min_side=240, augment=AugmentSpec(variants=2))
    loader = loader_for(root, train=False, batch_size=8)
    for epoch in (0, 1, 2):
        loader.set_epoch(epoch)
        images = torch.cat([batch for batch, _ in loader]).numpy()
        expected = shard_samples(root, f"v{epoch % 2}/shard-*.tar")
        reference = np.stack([reference_eval(s["jpg"]) for s in expected])
        assert np.abs(images - reference).max() < 1.01 / 255 / 0.224, f"epoch {epoch}"


def test_sources_manifest_directory_and_brace_pattern(dataset: Path) -> None:
    by_dir = all_labels(loader_for(dataset, train=False))
    by_manifest = all_labels(loader_for(dataset / "manifest.json", train=False))
    count = len(list(dataset.glob("shard-*.tar")))
    pattern = str(dataset / f"shard-{{000000..{count - 1:06d}}}.tar")
    by_pattern = all_labels(loader_for(pattern, train=False))
    assert by_dir == by_manifest == by_pattern and len(by_dir) == N
    # A pathlib.Path as it is, not made a str first; lists where the spec holds tuples (as JSON gives them).
    for source in (dataset, dataset / "manifest.json"):
        loader = make_loader(source, 16, device="cpu", crop=CROP, num_workers=2, train=False, mean=list(IMAGENET_MEAN))
        assert isinstance(loader, Loader) and isinstance(loader.stats, LoaderStats)
        assert loader.spec.mean == IMAGENET_MEAN  # a tuple again
        assert all_labels(loader) == by_dir


def test_make_loader_lists_every_loader_spec_setting_with_its_default() -> None:
    import dataclasses
    import inspect
    import typing

    from pipeline import LoaderSpec

    parameters = inspect.signature(make_loader).parameters
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    own = {  # besides its settings (augment names the recipe and its settings)
        "source", "device", "rank", "world_size", "storage_options", "links_outside", "sample_transform", "batch_transform",
        "augment",
    }  # fmt: skip
    given_as = {"hyp": None}  # a mapping here (None: none), (name, value) pairs in the spec
    settings = {name: p for name, p in parameters.items() if p.kind in named and name not in own}
    fields = dataclasses.fields(LoaderSpec)
    assert list(settings) == [field.name for field in fields]
    for field in fields:
        wanted = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        assert settings[field.name].default == given_as.get(field.name, wanted), field.name
    hints = typing.get_type_hints(make_loader)
    assert set(hints) == set(parameters) | {"return"}  # every parameter typed, every type resolvable
    assert hints["return"] is Loader


def test_stats_report_the_stall(dataset: Path) -> None:
    import time

    loader = loader_for(dataset)
    for _ in loader:
        time.sleep(0.02)  # the "GPU step": counted as step time, not as waiting
    stats = loader.stats
    assert stats.batches == len(loader) and stats.samples == len(loader) * 16
    assert stats.stall_fraction == pytest.approx(stats.wait_s / (stats.wait_s + stats.step_s))
    assert stats.images_per_s == pytest.approx(stats.samples / (stats.wait_s + stats.step_s))
    assert stats.step_s >= 0.02 * (stats.batches - 1)
    assert set(stats.to_dict()) >= {"images_per_s", "stall_fraction", "wait_s", "step_s", "batches", "samples"}
    # Printed with its meaning, not as a bare percentage.
    assert f"stall fraction {stats.stall_fraction:.1%} (share of the loop's time spent waiting for data)" in str(stats)


def test_bad_settings_are_clear_errors(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        make_loader(str(dataset), 0)
    with pytest.raises(ConfigError, match="unknown option"):
        make_loader(str(dataset), 8, num_wrokers=2)
    with pytest.raises(ConfigError, match="dtype"):
        make_loader(str(dataset), 8, dtype="float64")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            make_loader(str(dataset), 8, device="cuda")
    from pipeline import ManifestError

    with pytest.raises(ManifestError):
        make_loader(str(tmp_path), 8)


def test_errors_point_at_the_fix(dataset: Path, tmp_path: Path) -> None:
    from pipeline import ManifestError

    with pytest.raises(ManifestError, match="nope does not exist"):
        make_loader(str(tmp_path / "nope"), 8)
    # torch DataLoader's arguments name gpufeed's equivalent; a misspelt setting its close spelling.
    with pytest.raises(ConfigError, match="shuffle is a torch DataLoader argument: use shuffle_buffer=N .*train=False"):
        make_loader(str(dataset), 8, shuffle=True)
    with pytest.raises(ConfigError, match="pin_memory .*not needed"):
        make_loader(str(dataset), 8, pin_memory=True)
    with pytest.raises(ConfigError, match="num_wrokers: did you mean num_workers"):
        make_loader(str(dataset), 8, num_wrokers=2)


DDP_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from pipeline.loader import make_loader


def build():
    return make_loader(sys.argv[1], 16, device="cpu", crop=56, num_workers=1, drop_last=sys.argv[3] == "drop")


if sys.argv[4] == "before":  # as Accelerate and Lightning scripts often do
    loader = build()
dist.init_process_group("gloo")
if sys.argv[4] == "after":
    loader = build()
loader.set_epoch(1)
labels = [int(v) for _, batch in loader for v in batch]
with open(os.path.join(sys.argv[2], f"rank{dist.get_rank()}.json"), "w") as handle:
    json.dump({"labels": labels, "batches": loader.stats.batches, "len": len(loader)}, handle)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize(("policy", "built"), [("pad", "after"), ("drop", "after"), ("pad", "before")])
def test_ddp_two_ranks_disjoint_equal_and_complete(dataset: Path, tmp_path: Path, policy: str, built: str) -> None:
    # built="before": the loader is made before init_process_group; its epochs still split the data.
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(_free_port()), str(script), str(dataset), str(tmp_path), policy, built],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["batches"] == ranks[1]["batches"] == ranks[0]["len"]
    first, second = set(ranks[0]["labels"]), set(ranks[1]["labels"])
    if policy == "drop":
        assert not first & second
        assert len(ranks[0]["labels"]) == len(ranks[1]["labels"]) == (N // 2 // 16) * 16
    else:
        # Padding: N = 150 splits evenly, so ranks are disjoint and together hold everything.
        assert len(ranks[0]["labels"]) == len(ranks[1]["labels"]) == N // 2
        assert not first & second and first | second == set(range(N))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.cuda
def test_cuda_batches_equal_cpu_batches(dataset: Path) -> None:
    cpu = [images for images, _ in loader_for(dataset, device="cpu")]
    gpu = [images for images, _ in loader_for(dataset, device="cuda")]
    assert all(g.is_cuda for g in gpu)
    for a, b in zip(cpu, gpu):
        assert torch.allclose(a, b.cpu(), atol=1e-5)


def test_batches_kept_by_the_training_loop_are_never_overwritten(dataset: Path) -> None:
    """CPU output buffers are recycled only once the loop lets go of a batch (views included)."""
    loader = loader_for(dataset, batch_size=8, prefetch=2)
    kept, copies, views = [], [], []
    for index, (images, _) in enumerate(loader):
        if index % 3 == 0:
            kept.append(images)
            copies.append(images.clone())
        elif index % 3 == 1:
            views.append(images[2:4])  # a view alone must also keep its buffer
            copies.append(images[2:4].clone())
    for held, copy in zip(kept + views, copies[0::2] + copies[1::2]):
        assert torch.equal(held, copy)
    # Batches the loop drops are recycled: the pool stays bounded by the prefetch depth.
    before = len(loader._finish.outputs)
    for _ in loader:
        pass
    assert len(loader._finish.outputs) == before <= loader._ring_slots + loader.spec.prefetch + 2


def test_next_epoch_is_prestarted_and_a_dropped_loader_stops_its_workers(dataset: Path) -> None:
    import gc
    import threading
    import weakref

    baseline = threading.active_count()
    loader = loader_for(dataset, batch_size=8)
    for _ in loader:
        pass
    assert loader._next_run is not None and loader._next_run.epoch == 1  # decoding ahead
    second = [labels for _, labels in loader]
    assert len(second) == len(loader) and loader.epoch == 2
    ref = weakref.ref(loader)
    del loader, second
    for _ in range(50):  # a producer holds it only for the moment it submits a batch
        gc.collect()
        if ref() is None:
            break
        time.sleep(0.1)
    assert ref() is None, "the pre-started producer must not keep the loader alive"
    for _ in range(50):
        if threading.active_count() <= baseline:
            break
        time.sleep(0.1)
    assert threading.active_count() <= baseline


def test_next_epoch_starts_while_the_last_batches_are_in_use(dataset: Path) -> None:
    # Once the producer has queued an epoch's last batch, the next epoch is
    # already decoding: the training loop does not wait at the epoch boundary.
    # Its batches go into slots given back by this epoch, never into ones in use.
    loader = loader_for(dataset, batch_size=8, drop_last=False)
    epoch0, seen_ahead = [], False
    for index, (images, labels) in enumerate(loader):
        epoch0.append((images.clone(), labels.clone()))
        if index == len(loader) - 1:  # still inside epoch 0: its producer has queued everything
            for _ in range(100):
                seen_ahead = loader._next_run is not None and loader._next_run.epoch == 1
                if seen_ahead:
                    break
                time.sleep(0.05)
    assert seen_ahead
    epoch1 = [labels for _, labels in loader]
    assert sorted(torch.cat(epoch1).tolist()) == list(range(N))
    again = loader_for(dataset, batch_size=8, drop_last=False)
    reference = [(images, labels) for images, labels in again]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(epoch0, reference))
    again.set_epoch(1)
    assert [labels.tolist() for _, labels in again] == [labels.tolist() for labels in epoch1]


def test_set_epoch_elsewhere_discards_the_prestarted_epoch(dataset: Path) -> None:
    loader = loader_for(dataset, batch_size=8, drop_last=False)
    for _ in loader:
        pass
    loader.set_epoch(5)
    got = [labels for _, labels in loader]
    fresh = loader_for(dataset, batch_size=8, drop_last=False)
    fresh.set_epoch(5)
    assert [labels.tolist() for labels in got] == [labels.tolist() for _, labels in fresh]
    assert sorted(torch.cat(got).tolist()) == list(range(N))


def test_program_exits_cleanly_with_a_prestarted_epoch_running(dataset: Path) -> None:
    # The next epoch starts decoding as soon as one ends; a program that just
    # returns must not abort on the way out with those threads still busy.
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
import pipeline.loader.loader as loader_module
from pipeline.loader import make_loader
loader = make_loader({str(dataset)!r}, 8, device="cpu", crop={CROP}, num_workers=2, dtype="float32")
for epoch in range(2):
    for images, labels in loader:
        pass
other = make_loader({str(dataset)!r}, 8, device="cpu", crop={CROP}, num_workers=2, dtype="uint8")
next(iter(other))
print("done")
"""
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr[-2000:]
        assert "terminate called" not in result.stderr


def test_producer_reads_ahead_only_a_batch_beyond_what_threads_decode(dataset: Path, monkeypatch) -> None:
    # Slow decoding: without pacing the producer would fill every ring slot before the
    # first batch is done; with it, at most one batch waits beyond the ones being decoded.
    submitted: list[int] = []
    original_submit, original_chunk = workers_module.DecodePool.submit, workers_module.decode_chunk

    def submit(self, index, *args, **kwargs):
        submitted.append(index)
        return original_submit(self, index, *args, **kwargs)

    def slow_chunk(*args, **kwargs):
        time.sleep(0.2)
        return original_chunk(*args, **kwargs)

    monkeypatch.setattr(workers_module.DecodePool, "submit", submit)
    monkeypatch.setattr(workers_module, "decode_chunk", slow_chunk)
    loader = loader_for(dataset, batch_size=8, num_workers=2, prefetch=2)
    try:
        assert loader._ring_slots >= 4
        iterator = iter(loader)
        next(iterator)
        time.sleep(0.1)  # the producer had time to run ahead, if it would
        assert 1 <= len(submitted) <= 3, submitted  # batch 0 decoding, batch 1 waiting, batch 2 at most
        labels = [int(v) for v in next(iterator)[1]] + [int(v) for _, lab in iterator for v in lab]
        assert len(labels) + 8 == loader.spec.batch_size * len(loader)  # and the epoch still completes
    finally:
        loader.close()


# ---------------------------------------------------------------------------
# What a DataLoader user expects


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
def test_dtype_may_be_a_torch_dtype(dataset: Path, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    by_dtype, by_name = loader_for(dataset, dtype=dtype), loader_for(dataset, dtype=name)
    assert by_dtype.spec.dtype == name  # the settings stay plain JSON
    images, _ = next(iter(by_dtype))
    assert images.dtype == dtype and torch.equal(images, next(iter(by_name))[0])


def test_a_torch_dtype_it_cannot_deliver_is_a_clear_error(dataset: Path) -> None:
    with pytest.raises(ConfigError, match=r"dtype must be .*torch.float16.*got torch.float64"):
        loader_for(dataset, dtype=torch.float64)


def test_batch_size_and_dataset_as_on_a_dataloader(dataset: Path) -> None:
    loader = loader_for(dataset, batch_size=16, rank=1, world_size=2)
    assert loader.batch_size == 16
    # len(loader.dataset): the whole dataset, as with a DataLoader over a DistributedSampler;
    # this rank reads len(loader) batches of it.
    assert len(loader.dataset) == N
    assert len(loader) == N // 2 // 16


def _epoch_order(dataset: Path, epoch: int) -> list[int]:
    fresh = loader_for(dataset, batch_size=8, drop_last=False)
    fresh.set_epoch(epoch)
    try:
        return all_labels(fresh)
    finally:
        fresh.close()


def test_a_new_iteration_ends_the_one_before_and_moves_on_as_a_dataloader_does(dataset: Path) -> None:
    # A torch DataLoader's iter() starts a new pass whatever the last one did;
    # Lightning, accelerate and `zip(range(len(loader)), loader)` stop after
    # len(loader) batches and never ask for the StopIteration.
    loader = loader_for(dataset, batch_size=8, drop_last=False)
    orders = {epoch: _epoch_order(dataset, epoch) for epoch in range(6)}
    assert len({tuple(order) for order in orders.values()}) == 6  # each epoch its own shuffle
    for epoch in range(3):
        seen = [int(v) for _, (_, labels) in zip(range(len(loader)), loader) for v in labels]
        assert seen == orders[epoch] and sorted(seen) == list(range(N))
        assert (loader.epoch, loader.state_dict()["batches"]) == (epoch, len(loader))  # moves on at the next iter()
    # Broken off early: the state says where it stopped, and the next iteration is the next epoch.
    for _ in loader:
        break
    assert loader.epoch == 3 and loader.state_dict()["batches"] == 1
    first = iter(loader)  # epoch 4
    next(first)
    assert all_labels(loader) == orders[5] and loader.epoch == 6  # first ended, its epoch over
    assert list(first) == []
    # Created and never started, an iteration moves nothing on.
    unstarted = iter(loader)
    del unstarted
    assert loader.epoch == 6
    # set_epoch while an iteration is left half-way: the next epoch is the one set.
    half = iter(loader)
    next(half)
    loader.set_epoch(2)
    assert all_labels(loader) == orders[2] and loader.epoch == 3
    # loader.close() ends an iteration; the stale one yields nothing more.
    stale = iter(loader)
    next(stale)
    loader.close()
    assert list(stale) == [] and loader.epoch == 3
    assert all_labels(loader) == orders[4] and loader.epoch == 5
    loader.close()


def test_an_iteration_left_after_its_last_batch_resumes_as_the_next_epoch(dataset: Path) -> None:
    # state_dict after a loop that stopped at len(loader) batches: a new loader
    # loading it starts the next epoch, as the old one would have.
    loader = loader_for(dataset, batch_size=8, drop_last=False)
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)
    assert loader.state_dict()["batches"] == len(loader)
    iter(loader).close()
    assert loader.state_dict() == {**loader.state_dict(), "epoch": 1, "batches": 0}
    loader.close()
    # Broken off mid-epoch, the state is where it stopped: a new loader continues there.
    loader = loader_for(dataset, batch_size=8, drop_last=False)
    seen = []
    for index, (_, labels) in enumerate(loader):
        seen += labels.tolist()
        if index == 2:
            break
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (0, 3)
    resumed = loader_for(dataset, batch_size=8, drop_last=False)
    resumed.load_state_dict(state)
    assert seen + all_labels(resumed) == _epoch_order(dataset, 0)
    loader.close()
    resumed.close()


def test_loader_dataset_is_indexable_as_a_torchvision_dataset(dataset: Path) -> None:
    from loader_data import SIZE

    loader = loader_for(dataset, batch_size=8)
    data = loader.dataset
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert data.classes == manifest["classes"]
    assert data.class_to_idx == {name: index for index, name in enumerate(manifest["classes"])}
    samples = [data[i] for i in range(0, len(data), 7)]
    assert all(min(s.image.size) == SIZE and s.image.mode == "RGB" for s in samples)
    image, label = data[-1]  # unpacks as image, label; negative indices count from the end
    assert (image.size, label) == (data[len(data) - 1].image.size, data[len(data) - 1].label)
    # The same samples as an epoch reads: every label once, each sample traced to its source file.
    labels = [data[i].label for i in range(len(data))]
    assert sorted(labels) == sorted(all_labels(loader_for(dataset, batch_size=10, drop_last=False)))
    first = data[0]
    assert first.key and first.shard.endswith(".tar") and Path(first.info["source"]).name.endswith(".jpg")
    with pytest.raises(IndexError):
        data[len(data)]
    with pytest.raises(TypeError):
        data["0"]  # type: ignore[index]
    loader.close()


def test_a_crop_larger_than_the_prepared_size_warns_once(dataset: Path, caplog: pytest.LogCaptureFixture) -> None:
    from loader_data import SIZE

    def upsampling(records: list) -> list[str]:
        return [r.getMessage() for r in records if r.name == "gpufeed.loader" and "upsampled" in r.getMessage()]

    with caplog.at_level("WARNING", logger="gpufeed.loader"):
        loader = make_loader(dataset, 8, device="cpu", crop=SIZE + 16, num_workers=1)
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            next(iter(loader))
    (message,) = upsampling(caplog.records)
    assert f"crop={SIZE + 16}" in message and f"{SIZE} px" in message
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpufeed.loader"):
        next(iter(make_loader(dataset, 8, device="cpu", crop=SIZE, num_workers=1)))
    assert upsampling(caplog.records) == []


# ---------------------------------------------------------------------------
# Rank and world size: read when an epoch starts, and an epoch never empty


def test_a_batch_larger_than_what_a_rank_reads_is_refused_at_construction(dataset: Path) -> None:
    # drop_last (train mode) would leave every epoch empty: len() 0, nothing yielded.
    with pytest.raises(ConfigError, match=rf"batch_size 512 .*this rank's {N} samples per epoch"):
        loader_for(dataset, batch_size=512)
    # Per rank, after the split: N = 150 over 2 ranks is 75 each.
    with pytest.raises(ConfigError, match=r"batch_size 76 .*this rank's 75 samples per epoch \(150 samples over 2"):
        loader_for(dataset, batch_size=76, rank=1, world_size=2)
    assert len(loader_for(dataset, batch_size=75, rank=1, world_size=2)) == 1
    # Without drop_last the one partial batch is an epoch.
    eval_loader = loader_for(dataset, batch_size=512, train=False)
    assert len(eval_loader) == 1 and sorted(all_labels(eval_loader)) == list(range(N))


def test_rank_and_world_size_follow_torch_distributed_from_epoch_to_epoch(dataset: Path, monkeypatch) -> None:
    import torch.distributed as dist

    loader = loader_for(dataset, batch_size=8, drop_last=False)  # built before the process group
    assert (loader.rank, loader.world_size) == (0, 1)
    assert sorted(all_labels(loader)) == list(range(N))  # alone: everything
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *args, **kwargs: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 2)
    assert (loader.rank, loader.world_size) == (1, 2) and len(loader) == -(-N // 2 // 8)
    loader.set_epoch(1)
    mine = all_labels(loader)  # the epoch decoded ahead for one rank is not used for two
    other = loader_for(dataset, batch_size=8, drop_last=False, rank=0, world_size=2)
    other.set_epoch(1)
    theirs = all_labels(other)
    assert len(mine) == len(theirs) == N // 2
    assert not set(mine) & set(theirs) and set(mine) | set(theirs) == set(range(N))
    same = loader_for(dataset, batch_size=8, drop_last=False, rank=1, world_size=2)
    same.set_epoch(1)
    assert all_labels(same) == mine


def test_a_process_group_too_large_for_the_batch_is_refused_when_the_epoch_starts(dataset: Path, monkeypatch) -> None:
    import torch.distributed as dist

    loader = loader_for(dataset, batch_size=100)  # alone: one batch of 150 samples
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *args, **kwargs: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 2)
    with pytest.raises(ConfigError, match=r"batch_size 100 .*this rank's 75 samples per epoch \(150 samples over 2"):
        iter(loader)


def test_a_resumed_state_is_checked_against_the_world_size_of_the_epoch(dataset: Path, monkeypatch) -> None:
    import torch.distributed as dist

    saved = loader_for(dataset, batch_size=8, rank=1, world_size=2).state_dict()
    loader = loader_for(dataset, batch_size=8)  # built, and its state loaded, before the process group
    loader.load_state_dict({**saved, "batches": 2})
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *args, **kwargs: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 3)
    with pytest.raises(ConfigError, match="state was saved with world_size=2; this loader has 3"):
        iter(loader)
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 2)
    assert len(all_labels(loader)) == (len(loader) - 2) * 8  # resumed where the state says
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 3)
    with pytest.raises(ConfigError, match="state was saved with world_size=2; this loader has 3"):
        loader.load_state_dict(saved)  # with the process group up, at once


# ---------------------------------------------------------------------------
# num_workers=0: the calling thread decodes


def test_num_workers_0_decodes_in_the_calling_thread(dataset: Path, monkeypatch) -> None:
    import threading

    threads: set[str] = set()
    original_submit, original_chunk = workers_module.DecodePool.submit, workers_module.decode_chunk

    def submit(self, *args, **kwargs):  # the producer's work: read records, hand out a batch
        threads.add(threading.current_thread().name)
        return original_submit(self, *args, **kwargs)

    def chunk(*args, **kwargs):  # the decode workers' work
        threads.add(threading.current_thread().name)
        return original_chunk(*args, **kwargs)

    monkeypatch.setattr(workers_module.DecodePool, "submit", submit)
    monkeypatch.setattr(workers_module, "decode_chunk", chunk)
    inline = loader_for(dataset, num_workers=0)
    assert inline.num_workers == 0
    inline.set_epoch(2)
    started = threading.active_count()
    got = [(images, labels) for images, labels in inline]
    assert threading.active_count() == started  # no producer thread, no pool
    assert threads == {threading.current_thread().name}
    threads.clear()
    one = loader_for(dataset, num_workers=1)
    one.set_epoch(2)
    reference = [(images, labels) for images, labels in one]
    assert threading.current_thread().name not in threads  # with workers, elsewhere
    assert len(got) == len(reference) == len(inline)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, reference))
    assert inline.epoch == 3 and inline._next_run is None  # nothing decodes ahead without workers
    # Resuming mid-epoch works alike.
    partial = loader_for(dataset, num_workers=0)
    partial.load_state_dict({**one.state_dict(), "epoch": 2, "batches": 3})
    rest = [labels for _, labels in partial]
    assert [labels.tolist() for labels in rest] == [labels.tolist() for _, labels in reference[3:]]


def test_num_workers_0_with_process_workers_is_refused(dataset: Path) -> None:
    with pytest.raises(ConfigError, match=r"num_workers=0 .*worker_type='process'"):
        loader_for(dataset, num_workers=0, worker_type="process")


# ---------------------------------------------------------------------------
# Ctrl-C in a training loop

TRAINING_SCRIPT = """
import sys, time
from pipeline.loader import make_loader
loader = make_loader(sys.argv[1], 8, device="cpu", crop=56, num_workers=2, worker_type=sys.argv[2])
print("training", flush=True)
try:
    for epoch in range(10000):
        loader.set_epoch(epoch)
        for images, labels in loader:
            time.sleep(0.005)  # the training step
except KeyboardInterrupt:
    if sys.argv[3] == "uncaught":
        raise
    print("interrupted", file=sys.stderr)
    sys.exit(130)
"""


def session_processes(session: int) -> list[int]:
    """The live (not zombie) processes of a session, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, _ppid, _group, sid = stat.rsplit(")", 1)[1].split()[:4]
        if int(sid) == session and state != "Z":
            found.append(int(entry))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("worker_type", "handling"), [("process", "caught"), ("process", "uncaught"), ("thread", "caught")])
def test_ctrl_c_stops_the_training_loop_at_once_and_leaves_no_process(
    dataset: Path, tmp_path: Path, worker_type: str, handling: str
) -> None:
    import signal

    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        # Its own session and process group: Ctrl-C in a terminal signals the whole foreground group.
        process = subprocess.Popen(
            [sys.executable, "-c", TRAINING_SCRIPT, str(dataset), worker_type, handling],
            stdout=stdout, stderr=stderr, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "training" not in out.read_text() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # well inside the loop, workers busy
        assert process.poll() is None, err.read_text()[-2000:]
        children = set(session_processes(process.pid)) - {process.pid}
        assert bool(children) == (worker_type == "process")
        interrupted = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 20 s after Ctrl-C:\n{err.read_text()[-3000:]}")
        elapsed = time.monotonic() - interrupted
        left = [pid for pid in session_processes(process.pid) if pid != process.pid]
        text = err.read_text()
        assert process.returncode in (130, -signal.SIGINT), text[-3000:]
        assert not left, f"processes left behind: {left}"
        if handling == "caught":
            assert text.splitlines() == ["interrupted"], text[-3000:]
        else:  # the training loop's own traceback, and no other
            assert text.count("Traceback") == 1 and text.rstrip().endswith("KeyboardInterrupt"), text[-3000:]
        assert elapsed < 2.5, f"{elapsed:.1f} s from Ctrl-C to exit"
    finally:
        for pid in session_processes(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait(timeout=10)
