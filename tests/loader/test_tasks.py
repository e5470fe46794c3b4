"""The loader for every task: targets follow their pixels through crops and flips, fields, transforms, damage, resume."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from pipeline import make_loader
from pipeline.errors import ConfigError
from pipeline.io.tar import TarShardWriter
from pipeline.loader.crops import CropRandom, CropSpec, random_resized_crop_box
from pipeline.loader.tasks import TaskPlan, sample_targets
from pipeline.targets import SampleTargets, target_members

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from task_data import PALETTE, box_picture, boxes_on_their_colours, encoded, write_task_dataset  # noqa: E402

CROP = 48


def loader(root: Path, **settings: object):
    options = {"device": "cpu", "crop": CROP, "num_workers": 2, "dtype": "uint8", "seed": 3}
    options.update(settings)
    return make_loader(root, 4, **options)


def assert_boxes_on_their_colours(batch) -> int:
    """Every delivered box covers pixels of its class's colour; returns how many boxes were checked."""
    checked, wrong = boxes_on_their_colours(batch, CROP)
    assert wrong == 0
    return checked


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("train", [True, False])
def test_detection_boxes_sit_on_their_colour_after_the_crop_and_flip(tmp_path: Path, fmt: str, train: bool) -> None:
    root = write_task_dataset(tmp_path / "det", "detection", 32, fmt=fmt)
    checked = 0
    flipped_any = False
    for batch in loader(root, train=train):
        images, targets = batch
        assert images.shape == (4, 3, CROP, CROP)
        assert [set(t) for t in targets] == [{"boxes", "labels", "iscrowd"}] * 4
        checked += assert_boxes_on_their_colours(batch)
        flipped_any |= train
    assert checked >= 20


def mask_pixel_disagreements(images: torch.Tensor, masks: torch.Tensor, fill: int = 114) -> tuple[int, int]:
    """(pixels checked, pixels whose colour is not their mask class's) over a segmentation batch.

    Checked: pixels whose 5x5 neighbourhood has one class (nearest-neighbour
    masks sit half a pixel from bilinear pixels, as transforms.v2's do). No
    class (255) is the black background or the recipe's fill.
    """
    checked = wrong = 0
    for image, mask in zip(images, masks):
        m = mask.numpy()
        centre = m[2:-2, 2:-2]
        same = np.ones_like(centre, bool)
        for dy in range(5):
            for dx in range(5):
                same &= m[dy : m.shape[0] - 4 + dy, dx : m.shape[1] - 4 + dx] == centre
        ys, xs = np.nonzero(same)
        pixels = image.numpy().transpose(1, 2, 0)[2:-2, 2:-2][ys, xs].astype(int)
        classes = centre[ys, xs]
        expected = PALETTE[np.minimum(classes, 4)].astype(int)
        off = np.abs(pixels - expected).max(axis=1)
        nothing = classes == 255
        off[nothing] = np.minimum(np.abs(pixels[nothing]).max(axis=1), np.abs(pixels[nothing] - fill).max(axis=1))
        checked += len(ys)
        wrong += int((off >= 40).sum())
    return checked, wrong


def test_segmentation_masks_agree_with_their_pixels(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "seg", "segmentation", 24)
    seen = 0
    for train in (True, False):
        for batch in loader(root, train=train):
            images, masks = batch
            assert masks.shape == (4, CROP, CROP) and masks.dtype == torch.int64
            checked, wrong = mask_pixel_disagreements(images, masks)
            assert wrong == 0
            seen += checked
    assert seen > 30_000


@pytest.mark.parametrize("recipe", ["letterbox", "scale_jitter", "iou_crop"])
@pytest.mark.parametrize("train", [True, False])
def test_detection_recipes_keep_boxes_and_masks_on_their_pixels(tmp_path: Path, recipe: str, train: bool) -> None:
    det = write_task_dataset(tmp_path / "det", "detection", 24, fmt="JPEG")
    checked = 0
    for worker_type in ("thread", "process"):
        for batch in loader(det, recipe=recipe, train=train, worker_type=worker_type):
            checked += assert_boxes_on_their_colours(batch)
    assert checked > 40
    if recipe == "iou_crop":
        return
    seg = write_task_dataset(tmp_path / "seg", "segmentation", 16)
    seen = 0
    for batch in loader(seg, recipe=recipe, train=train):
        count, wrong = mask_pixel_disagreements(batch.images, batch.masks)
        assert wrong == 0
        seen += count


def test_letterbox_pads_with_fill_and_scales_boxes_by_the_longer_side(tmp_path: Path) -> None:
    pixels, boxes, labels, mask = box_picture(np.random.default_rng(1), 96, 60, 2)
    members = target_members(SampleTargets(boxes=boxes, box_labels=labels, mask=mask))
    data = encoded(pixels, "PNG")
    crop = CropSpec(CROP, False, recipe="letterbox", fill=114)
    det = sample_targets(TaskPlan("detection", min_visible=0.0), "png", data, 0, members, crop, False)
    scale, top = CROP / 96, (CROP - round(60 * CROP / 96)) // 2
    np.testing.assert_allclose(det["boxes"], boxes * scale + np.array([0, top, 0, top], np.float32), atol=1e-4)
    seg = sample_targets(TaskPlan("segmentation"), "png", data, 0, members, crop, False)
    assert (seg["mask"][:top] == 255).all() and (seg["mask"][top + 30 :] == 255).all()
    inside = torch.nn.functional.interpolate(torch.from_numpy(mask)[None, None].float(), size=(30, CROP), mode="nearest")
    np.testing.assert_array_equal(seg["mask"][top : top + 30], inside[0, 0].numpy().astype(np.uint8))
    root = tmp_path / "one"
    with TarShardWriter(str(root / "shard-000000.tar")) as writer:
        writer.write_sample("only", {"png": data, **members})
        writer.commit("shard-000000.tar")
    images = next(iter(make_loader(str(root / "shard-000000.tar"), 1, device="cpu", crop=CROP, num_workers=0,
                                   dtype="uint8", train=False, recipe="letterbox", task="detection")))[0]  # fmt: skip
    assert (images[0, :, :top] == 114).all() and (images[0, :, top + 30 :] == 114).all()
    assert not (images[0, :, top : top + 30] == 114).all()


def v2_reference(boxes: np.ndarray, mask: np.ndarray, box: tuple[float, float, float, float], flip: bool):
    """What torchvision.transforms.v2's resized_crop then horizontal_flip give for the same crop (its formulas, in torch)."""
    left, top, width, height = (int(v) for v in box)
    scale = torch.tensor([CROP / width, CROP / height] * 2)
    moved = (torch.from_numpy(boxes) - torch.tensor([left, top, left, top], dtype=torch.float32)) * scale
    moved = moved.clamp(min=0).minimum(torch.tensor([CROP] * 4, dtype=torch.float32))
    cropped = torch.from_numpy(mask.astype(np.int64))[top : top + height, left : left + width][None, None].float()
    resized = torch.nn.functional.interpolate(cropped, size=(CROP, CROP), mode="nearest")[0, 0].long()
    if flip:
        moved = torch.stack([CROP - moved[:, 2], moved[:, 1], CROP - moved[:, 0], moved[:, 3]], dim=1)
        resized = resized.flip(1)
    return moved.numpy(), resized.numpy()


@pytest.mark.parametrize("seed", range(40))
def test_random_crops_and_flips_give_what_transforms_v2_gives(seed: int) -> None:
    rng = np.random.default_rng(seed)
    width, height = int(rng.integers(60, 200)), int(rng.integers(60, 200))
    pixels, boxes, labels, mask = box_picture(rng, width, height, 3)
    members = target_members(SampleTargets(boxes=boxes, box_labels=labels, mask=mask))
    data = encoded(pixels, "PNG")
    crop = CropSpec(CROP, True)
    flip = bool(seed % 2)
    box = random_resized_crop_box(CropRandom(seed), width, height, crop)
    want_boxes, want_mask = v2_reference(boxes, mask, box, flip)
    detection = sample_targets(TaskPlan("detection", min_visible=0.0), "png", data, seed, members, crop, flip)
    area = (want_boxes[:, 2] - want_boxes[:, 0]) * (want_boxes[:, 3] - want_boxes[:, 1])
    np.testing.assert_allclose(detection["boxes"], want_boxes[area > 0], atol=1e-4)
    segmentation = sample_targets(TaskPlan("segmentation"), "png", data, seed, members, crop, flip)
    np.testing.assert_array_equal(segmentation["mask"], want_mask)


def test_boxes_under_min_visible_are_dropped_and_counted() -> None:
    crop = CropSpec(CROP, False, eval_fraction=1.0)  # the centre square of a 100x50 picture: x 25..75
    boxes = np.array([[0, 10, 30, 40], [20, 10, 60, 40], [80, 0, 100, 50]], np.float32)  # 1/6 visible, 7/8, none
    members = target_members(SampleTargets(boxes=boxes, box_labels=np.array([0, 1, 2])))
    data = encoded(np.zeros((50, 100, 3), np.uint8), "PNG")
    kept = sample_targets(TaskPlan("detection", min_visible=0.25), "png", data, 0, members, crop, False)
    assert kept["box_labels"].tolist() == [1] and kept["boxes_dropped"] == 2
    np.testing.assert_allclose(kept["boxes"], [[0, 10 * CROP / 50, 35 * CROP / 50, 40 * CROP / 50]], atol=1e-4)
    loose = sample_targets(TaskPlan("detection", min_visible=0.1), "png", data, 0, members, crop, False)
    assert loose["box_labels"].tolist() == [0, 1] and loose["boxes_dropped"] == 1


def test_multilabel_batches_are_multi_hot(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "ml", "multilabel", 16)
    stored = {s["__key__"]: s["labels.json"] for s in wds.WebDataset(sorted(map(str, root.glob("*.tar"))), shardshuffle=False)}
    for batch in loader(root):
        images, labels = batch
        assert labels.shape == (4, 5) and labels.dtype == torch.float32
        for key, row in zip(batch.keys, labels):
            assert torch.nonzero(row).flatten().tolist() == sorted(set(json.loads(stored[key])))


def img2dataset_shards(root: Path, count: int = 12) -> str:
    """Shards as img2dataset writes them: jpg + txt + json, no cls, no manifest; their brace pattern."""
    rng = np.random.default_rng(5)
    for shard in range(2):
        with TarShardWriter(str(root / f"{shard:05d}.tar")) as writer:
            for i in range(count // 2):
                index = shard * (count // 2) + i
                pixels, *_ = box_picture(rng, 80, 64, 1)
                members = {
                    "jpg": encoded(pixels, "JPEG"),
                    "txt": f"caption number {index} é".encode(),
                    "json": f'{{"url": "http://example.com/{index}.jpg", "key": "{index:09d}"}}'.encode(),
                }
                writer.write_sample(f"{index:09d}", members)
            writer.commit(f"{shard:05d}.tar")
    return str(root / "{00000..00001}.tar")


def test_img2dataset_shards_give_their_captions_through_fields(tmp_path: Path) -> None:
    pattern = img2dataset_shards(tmp_path)
    captions: dict[str, str] = {}
    for batch in make_loader(pattern, 3, device="cpu", crop=32, num_workers=1, train=False, fields=("txt", "json")):
        images, targets = batch  # jpg + txt without cls: a captions dataset, no task= needed
        assert batch.task == "captions" and targets == batch.captions == batch["txt"]
        for key, text, meta in zip(batch.keys, batch["txt"], batch.fields["json"]):
            assert meta["key"] == key
            captions[key] = text
    assert captions == {f"{i:09d}": f"caption number {i} é" for i in range(12)}
    as_task = make_loader(pattern, 3, device="cpu", crop=32, num_workers=1, train=False, task="captions")
    first = next(iter(as_task))
    assert first.captions == ["caption number 0 é", "caption number 1 é", "caption number 2 é"]
    assert first.targets == first.captions


def test_a_field_is_delivered_under_the_name_asked_for(tmp_path: Path) -> None:
    pattern = img2dataset_shards(tmp_path)
    batch = next(iter(make_loader(pattern, 3, device="cpu", crop=32, num_workers=1, train=False, fields=("caption",))))
    expected = ["caption number 0 é", "caption number 1 é", "caption number 2 é"]
    assert list(batch.fields) == ["caption"] and batch.fields["caption"] == expected and batch["caption"] == expected
    both = next(iter(make_loader(pattern, 3, device="cpu", crop=32, num_workers=1, train=False, fields=("txt", "caption"))))
    assert list(both.fields) == ["txt"] and both["caption"] == expected  # one member, delivered once, by its first name


def test_detection_loads_letterboxed_by_default_and_a_crop_recipe_counts_what_it_cuts(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "det", "detection", 24)
    stored = sum(len(loader(root).dataset[i].targets["boxes"]) for i in range(24))
    default = loader(root, scale=(0.08, 0.2))  # the crop's scale, were it cropping: it is not
    delivered = sum(len(b) for batch in default for b in batch.boxes)
    assert default.spec.recipe == "letterbox" and delivered == stored
    assert default.stats.boxes_dropped == 0 and default.stats.images_emptied == 0
    cropped = loader(root, recipe="crop", scale=(0.08, 0.2))
    for batch in cropped:
        assert_boxes_on_their_colours(batch)
    stats = cropped.stats
    assert stats.boxes_dropped > 0 and 0 < stats.images_emptied <= stats.samples
    assert "boxes dropped by crops" in str(stats) and stats.to_dict()["images_emptied"] == stats.images_emptied
    # Other tasks keep the crop.
    assert loader(write_task_dataset(tmp_path / "seg", "segmentation", 8)).spec.recipe == "crop"


def test_classification_without_fields_still_yields_tuples(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "det", "detection", 8)
    batch = next(iter(loader(root, task="classification")))
    assert type(batch) is tuple and len(batch) == 2
    keyed = next(iter(loader(root, task="classification", fields=["key"])))
    images, labels = keyed
    assert labels.dtype == torch.int64 and len(keyed.keys) == 4


def damage_boxes(root: Path, key: str) -> None:
    """Rewrite the shard holding `key` with its boxes.npy cut short (a valid tar, a damaged sample)."""
    from pipeline.io.output import Output
    from pipeline.manifest import read_manifest, write_manifest

    manifest = read_manifest(root)
    for info in manifest.shards:
        samples = list(wds.WebDataset(str(root / info.path), shardshuffle=False))
        if not any(s["__key__"] == key for s in samples):
            continue
        with TarShardWriter(str(root / info.path)) as writer:
            for sample in samples:
                members = {k: v for k, v in sample.items() if not k.startswith("__")}
                if sample["__key__"] == key:
                    members["boxes.npy"] = members["boxes.npy"][:20]
                writer.write_sample(sample["__key__"], members)
            new = writer.commit(info.path)
        manifest.shards = [new if s.path == info.path else s for s in manifest.shards]
    write_manifest(Output(str(root)), manifest)


def test_a_sample_with_damaged_boxes_is_replaced_by_one_that_brings_its_own(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "det", "detection", 16, fmt="JPEG")
    damage_boxes(root, "sample00005")
    data = loader(root)
    keys = []
    for batch in data:
        assert len(batch.keys) == 4 and len(batch.boxes) == 4
        assert_boxes_on_their_colours(batch)
        keys += batch.keys
    assert "sample00005" not in keys and len(keys) == 16
    assert data.stats.replaced == 1 and data.stats.skipped == 1
    with pytest.raises(Exception, match="boxes.npy"):
        list(loader(root, on_error="raise"))


def batches_of(data) -> list[tuple[list[str], list[list[float]]]]:
    return [(batch.keys, [b.tolist() for b in batch.boxes]) for batch in data]


def test_resume_mid_epoch_delivers_the_same_targets(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "det", "detection", 32)
    whole = batches_of(loader(root))
    first = loader(root)
    seen = []
    for number, batch in enumerate(first):
        seen.append((batch.keys, [b.tolist() for b in batch.boxes]))
        if number == 2:
            state = first.state_dict()
            break
    resumed = loader(root)
    resumed.load_state_dict(state)
    assert seen + batches_of(resumed) == whole


def test_process_workers_give_what_threads_give(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "seg", "segmentation", 16)
    threads = [(b.keys, b.masks.clone(), b.images.clone()) for b in loader(root)]
    processes = [(b.keys, b.masks, b.images) for b in loader(root, worker_type="process")]
    inline = [(b.keys, b.masks, b.images) for b in loader(root, num_workers=0)]
    for other in (processes, inline):
        for (keys, masks, images), (k2, m2, i2) in zip(threads, other):
            assert keys == k2 and torch.equal(masks, m2) and torch.equal(images, i2)


def blank_and_keep_left(sample: dict) -> dict:
    """A sample_transform: black pixels, only the boxes on the left half (their labels and crowd flags with them)."""
    sample["image"] = np.zeros_like(sample["image"])
    left = sample["boxes"][:, 0] < CROP / 2
    for name in ("boxes", "box_labels", "iscrowd"):
        sample[name] = sample[name][left]
    return sample


def test_sample_transform_edits_pixels_and_targets_in_the_workers(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "det", "detection", 16)
    for worker_type in ("thread", "process"):
        for batch in loader(root, sample_transform=blank_and_keep_left, worker_type=worker_type, dtype="float32"):
            assert torch.allclose(batch.images, batch.images[0, :, :1, :1].expand_as(batch.images[0]))
            assert all((boxes[:, 0] < CROP / 2).all() for boxes in batch.boxes)
    with pytest.raises(ConfigError, match="pickle"):
        loader(root, sample_transform=lambda s: s, worker_type="process")
    with pytest.raises(ConfigError, match="sample_transform"):
        loader(root, sample_transform="not callable")


def test_sample_transform_sees_the_flipped_sample_its_targets_follow(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "det", "detection", 16)
    for batch in loader(root, sample_transform=lambda s: s):
        assert_boxes_on_their_colours(batch)


def test_batch_transform_runs_on_each_batch(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "det", "detection", 8)

    def mixup(batch):
        images, labels = batch
        return images.flip(0), torch.nn.functional.one_hot(labels.clamp(min=0), 5).float()

    plain = [b for b in loader(root, task="classification")]
    mixed = [b for b in loader(root, task="classification", batch_transform=mixup)]
    assert torch.equal(mixed[0][0], plain[0][0].flip(0)) and mixed[0][1].shape == (4, 5)
    with pytest.raises(ConfigError, match="batch_transform"):
        loader(root, batch_transform=3)


def test_bad_task_and_field_names_are_refused(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "det", "detection", 8)
    with pytest.raises(ConfigError, match="task must be one of"):
        loader(root, task="keypoints")
    with pytest.raises(ConfigError, match="fields"):
        loader(root, fields=("../x",))
    with pytest.raises(ConfigError, match="min_visible"):
        loader(root, min_visible=2)
    with pytest.raises(ConfigError, match="recipe"):
        loader(root, recipe="mosaic")
    with pytest.raises(ConfigError, match="iou_crop"):
        loader(root, recipe="iou_crop", task="segmentation")


def test_a_batch_pickles_and_names_its_fields(tmp_path: Path) -> None:
    root = write_task_dataset(tmp_path / "cap", "captions", 8)
    batch = next(iter(loader(root, fields=("json",))))
    again = pickle.loads(pickle.dumps(batch))
    assert again.captions == batch.captions == batch["caption"] and again["json"] == batch.fields["json"]
    assert batch[0] is batch.images and batch["keys"] == batch.keys
    with pytest.raises(KeyError):
        batch["nothing"]


DDP_SCRIPT = r"""
import json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
sys.path.insert(0, sys.argv[3])
from task_data import boxes_on_their_colours
from pipeline import make_loader

rank = dist.get_rank()
loader = make_loader(sys.argv[1], 4, device="cpu", crop=48, num_workers=1, dtype="uint8", shuffle_buffer=16)
result = {"batches": [], "sizes": [], "synced": True, "checked": 0, "wrong": 0, "keys": []}
for epoch in (0, 1):
    count = 0
    for batch in loader:
        result["sizes"].append(len(batch.keys))
        assert len(batch.boxes) == len(batch.keys) == batch.images.shape[0]
        checked, wrong = boxes_on_their_colours(batch, 48)
        result["checked"] += checked
        result["wrong"] += wrong
        result["keys"] += batch.keys
        both = torch.tensor([epoch * 1000 + count, -(epoch * 1000 + count)], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        result["synced"] &= both[0].item() == -both[1].item()
        count += 1
    result["batches"].append(count)
result["len"] = len(loader)
result["replaced"] = loader.stats.replaced
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as handle:
    json.dump(result, handle)
dist.barrier()
dist.destroy_process_group()
"""


def test_ddp_detection_with_a_damaged_shard_gives_equal_batches_whose_boxes_fit(tmp_path: Path, get_free_port) -> None:
    import os
    import subprocess

    root = write_task_dataset(tmp_path / "det", "detection", 48, fmt="JPEG")
    damage_boxes(root, "sample00030")  # one sample whose boxes do not read
    (root / "shard-000002.tar").unlink()  # and a whole shard lost: its 8 samples are made up from the rank's others
    script = tmp_path / "ranks.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(get_free_port()), str(script), str(root), str(out), str(Path(__file__).resolve().parents[1])]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["batches"] == ranks[1]["batches"] == [ranks[0]["len"]] * 2 == [6, 6]
    assert all(size == 4 for rank in ranks for size in rank["sizes"]) and ranks[0]["synced"] and ranks[1]["synced"]
    assert sum(rank["checked"] for rank in ranks) > 50 and sum(rank["wrong"] for rank in ranks) == 0
    keys = {key for rank in ranks for key in rank["keys"]}
    assert not keys & {f"sample{i:05d}" for i in (16, 17, 18, 19, 20, 21, 22, 23, 30)}


def test_a_look_at_one_sample_brings_its_stored_targets(tmp_path: Path) -> None:
    det = write_task_dataset(tmp_path / "det", "detection", 8)
    stored = {s["__key__"]: s for s in wds.WebDataset(str(det / "shard-000000.tar"), shardshuffle=False)}
    sample = loader(det).dataset[3]
    want = np.load(__import__("io").BytesIO(stored[sample.key]["boxes.npy"]))
    np.testing.assert_array_equal(sample.targets["boxes"], want)
    assert sample.targets["box_labels"].dtype == np.int64 and sample.image.size == tuple(sample.info["size"])
    seg = loader(write_task_dataset(tmp_path / "seg", "segmentation", 8)).dataset[0]
    assert seg.targets["mask"].shape == (seg.image.size[1], seg.image.size[0])
    assert loader(write_task_dataset(tmp_path / "cap", "captions", 8)).dataset[0].targets["caption"].startswith("a picture")


def test_elastic_resume_of_a_detection_epoch_on_fewer_ranks_delivers_the_rest_with_their_boxes(tmp_path: Path) -> None:
    from pipeline.loader import merge_states

    root = write_task_dataset(tmp_path / "det", "detection", 32, fmt="JPEG")
    seen: list[str] = []
    states = []
    for rank in (0, 1):  # two ranks, each two batches into the epoch
        ranked = loader(root, rank=rank, world_size=2)
        for number, batch in enumerate(ranked):
            seen += batch.keys
            if number == 1:
                break
        states.append(ranked.state_dict())
    one = loader(root, rank=0, world_size=1)
    one.load_state_dict(merge_states(states))
    rest: list[str] = []
    for batch in one:
        assert_boxes_on_their_colours(batch)
        rest += batch.keys
    assert len(seen) == 16 and not set(seen) & set(rest) and len(set(seen) | set(rest)) == 32


def test_prepare_from_img2dataset_shards_keeps_every_caption(tmp_path: Path) -> None:
    from pipeline import PrepareSpec, ResizeSpec, prepare_dataset
    from pipeline.demo import make_caption_shards

    pattern = make_caption_shards(str(tmp_path / "src"), images=30, per_shard=10)
    source = sorted(s["txt"].decode() for s in wds.WebDataset(sorted(map(str, (tmp_path / "src").glob("*.tar"))), shardshuffle=False))
    result = prepare_dataset(PrepareSpec(source=pattern, out=str(tmp_path / "out"), resize=ResizeSpec(size=64)), workers=1)
    assert result.samples == 30 and result.rejected == 0 and result.task == "captions"
    prepared = [s for s in wds.WebDataset(sorted(map(str, (tmp_path / "out").glob("*.tar"))), shardshuffle=False)]
    assert sorted(s["txt"].decode() for s in prepared) == source
    captions = [c for batch in loader(tmp_path / "out", train=False) for c in batch.captions]  # eval: every sample
    assert sorted(captions) == source


def test_the_geometry_field_maps_predictions_back_to_the_original(tmp_path: Path) -> None:
    # COCO boxes in the original upright pixels -> prepare (shorter side 96, the YCbCr path) -> letterbox with
    # flips and scale_jitter crops -> the delivered boxes, mapped back with the geometry field, are the originals.
    from pipeline import PrepareSpec, ResizeSpec, prepare_dataset
    from pipeline.demo import make_coco_dataset
    from pipeline.targets import boxes_to_source

    annotations = make_coco_dataset(tmp_path / "coco", 12, min_side=150, max_side=260)
    coco = json.loads(Path(annotations).read_text())
    truth: dict[str, list[list[float]]] = {}
    names = {image["id"]: image["file_name"] for image in coco["images"]}
    for annotation in coco["annotations"]:
        x, y, w, h = annotation["bbox"]
        truth.setdefault(names[annotation["image_id"]], []).append([x, y, x + w, y + h])
    prepare_dataset(PrepareSpec(annotations, str(tmp_path / "out"), resize=ResizeSpec(size=96)), workers=0)
    checked = 0
    for recipe in ("letterbox", "scale_jitter"):
        for batch in loader(tmp_path / "out", recipe=recipe, fields=("geometry", "json"), crop=64, dtype="float32"):
            for boxes, geometry, meta in zip(batch.boxes, batch.fields["geometry"], batch.fields["json"]):
                assert geometry["output_size"] == 64 and "prepare" in geometry
                back = boxes_to_source(boxes.numpy(), geometry)
                source = np.array(truth.get(meta["source"].rsplit("/", 1)[-1], [[np.nan] * 4]))  # none: no box
                for box in back:
                    if recipe == "letterbox":  # nothing cut: each delivered box is one the annotator drew
                        assert np.abs(source - box).max(axis=1).min() < 0.5, (box, source)
                    else:  # a jitter window may cut a box: what is delivered lies within one the annotator drew
                        inside = (box[:2] >= source[:, :2] - 0.5).all(axis=1) & (box[2:] <= source[:, 2:] + 0.5).all(axis=1)
                        assert inside.any(), (box, source)
                    checked += 1
    assert checked > 20


def test_the_geometry_field_replays_a_classification_crop(tmp_path: Path) -> None:
    # The crop the C planner drew is the one the field says: cutting it out of the stored image gives the pixels.
    from PIL import Image

    root = write_task_dataset(tmp_path / "cls", "classification", 8, fmt="JPEG")
    batch = next(iter(loader(root, fields=("geometry",), dtype="uint8", decoder="region")))
    dataset = loader(root).dataset
    by_key = {sample.key: sample for sample in (dataset[i] for i in range(len(dataset)))}
    for index, geometry in enumerate(batch.fields["geometry"]):
        sample = by_key[batch.keys[index]]
        assert geometry["output_box"] == [0, 0, CROP, CROP] and geometry["sample_size"] == list(sample.image.size)
        x0, y0, x1, y1 = geometry["source_box"]
        replay = sample.image.convert("RGB").resize((CROP, CROP), Image.Resampling.BILINEAR, box=(x0, y0, x1, y1))
        if geometry["flip"]:
            replay = replay.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        got = batch.images[index].numpy().transpose(1, 2, 0).astype(int)
        assert np.abs(got - np.asarray(replay).astype(int)).mean() < 3
