"""A data.yaml's splits prepared once into the cache, and batches in ultralytics' contract (no ultralytics here).

The validation batches' boxes, taken back to the original photo with their
`ratio_pad` as ultralytics' `scale_boxes` does ((box - pad) / gain), must
land on the label files' boxes; `cls`, `bboxes` and `batch_idx` must have
the shapes and order ultralytics' loss reads; the dataset's `labels` must be
the label files' without decoding; a split is prepared once, and again after
its files change; ultralytics' hyperparameters become the recipe's, and those it
does not draw yet are refused. A validation split is prepared in aspect-ratio
order, so its rect batches are ultralytics' batch shapes (but for its extra
half stride) and hold fewer pixels than a shuffled split's.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import ConfigError, PrepareSpec, ResizeSpec, ShardSpec, make_loader, prepare_dataset
from pipeline.demo import make_yolo_dataset
from pipeline.integrations.yolo_batches import recipe_hyp, resolved_yaml, split_shards, yolo_loader
from pipeline.io.output import Output
from pipeline.io.tar import iter_tar_samples
from pipeline.manifest import read_manifest

SIZE = 128


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(make_yolo_dataset(tmp_path_factory.mktemp("yolo") / "data", 24, min_side=90, max_side=300))
    yaml = (root / "data.yaml").read_text().replace("path: .", f"path: {root}")
    (root / "data.yaml").write_text(yaml)
    return root


def label_boxes(root: Path, source: str) -> np.ndarray:
    """The label file's boxes of image `source`, in its pixels (XYXY)."""
    width, height = Image.open(source).size
    path = root / "labels" / Path(source).parent.name / (Path(source).stem + ".txt")
    rows = [[float(v) for v in line.split()[1:]] for line in path.read_text().splitlines()] if path.exists() else []
    boxes = np.array(rows, np.float64).reshape(-1, 4) * [width, height, width, height]
    return np.stack([boxes[:, 0] - boxes[:, 2] / 2, boxes[:, 1] - boxes[:, 3] / 2,
                     boxes[:, 0] + boxes[:, 2] / 2, boxes[:, 1] + boxes[:, 3] / 2], 1)  # fmt: skip


@pytest.mark.parametrize(("rect", "batch_size"), [(False, 5), (True, 1), (True, 4)], ids=["square", "rect-1", "rect-4"])
def test_validation_boxes_go_back_to_the_label_files_through_ratio_pad(
    dataset: Path, tmp_path: Path, rect: bool, batch_size: int
) -> None:
    shards = split_shards(dataset / "data.yaml", "val", SIZE, dataset, cache=tmp_path)  # in aspect order
    loader = yolo_loader(shards, batch_size, False, SIZE, workers=2, rect=rect)
    square = iter(yolo_loader(shards, batch_size, False, SIZE, workers=2))
    seen, cut = 0, 0
    for batch in loader:
        images = batch["img"]
        height, width = images.shape[2:]
        assert images.dtype == torch.uint8 and images.shape[1] == 3 and height % 32 == 0 and width % 32 == 0
        assert all(shape == (height, width) for shape in batch["resized_shape"])
        whole = next(square)["img"]  # a rect batch is the square one's centre
        top, left = (SIZE - height) // 2, (SIZE - width) // 2
        assert torch.equal(images, whole[:, :, top : top + height, left : left + width])
        assert rect or (height, width) == (SIZE, SIZE)
        cut += (height, width) != (SIZE, SIZE)
        assert batch["cls"].shape[1:] == (1,) and batch["bboxes"].shape[1:] == (4,)
        assert (np.diff(batch["batch_idx"].numpy()) >= 0).all()  # grouped, ascending: ultralytics' loss needs it
        for index, source in enumerate(batch["im_file"]):
            (gain_y, gain_x), (pad_x, pad_y) = batch["ratio_pad"][index]
            mine = batch["bboxes"][batch["batch_idx"] == index].numpy().astype(np.float64) * [width, height, width, height]
            xyxy = np.concatenate([mine[:, :2] - mine[:, 2:] / 2, mine[:, :2] + mine[:, 2:] / 2], 1)
            back = (xyxy - [pad_x, pad_y, pad_x, pad_y]) / [gain_x, gain_y, gain_x, gain_y]
            expected = label_boxes(dataset, source)
            assert batch["ori_shape"][index] == Image.open(source).size[::-1]
            assert len(back) == len(expected)
            order = np.lexsort(back.T[::-1])
            errors = np.abs(back[order] - expected[np.lexsort(expected.T[::-1])])
            assert errors.size == 0 or errors.max() < 0.01, errors
            seen += 1
    assert seen == len(loader.dataset) == 12 and len(loader) == -(-12 // batch_size)
    assert cut >= (3 if batch_size == 1 else 1) if rect else cut == 0  # at 128 px, a stride is a quarter of a side


def ultralytics_batch_shapes(aspects: list[float], batch_size: int, imgsz: int, pad: float, stride: int = 32) -> list[tuple[int, int]]:
    """(height, width) of each batch by ultralytics' rule (`BaseDataset.set_rectangle`, ultralytics/data/base.py) for
    images whose aspect ratios (h / w) are `aspects`, sorted; its validation takes `pad` 0.5."""
    ratios, shapes = np.array(aspects), []
    for start in range(0, len(ratios), batch_size):
        low, high = ratios[start : start + batch_size].min(), ratios[start : start + batch_size].max()
        shape = [high, 1] if high < 1 else [1, 1 / low] if low > 1 else [1, 1]
        height, width = np.ceil(np.array(shape) * imgsz / stride + pad).astype(int) * stride
        shapes.append((int(height), int(width)))
    return shapes


def test_rect_validation_batches_are_sorted_by_aspect_and_have_ultralytics_batch_shapes(dataset: Path, tmp_path: Path) -> None:
    shards = split_shards(dataset / "data.yaml", "val", SIZE, dataset, cache=tmp_path)
    loader = yolo_loader(shards, 4, False, SIZE, workers=2, rect=True)
    labels = loader.dataset.labels  # the stored pictures' (h, w), in the shards' order
    aspects = [height / width for height, width in (label["shape"] for label in labels)]
    assert aspects == sorted(aspects) and aspects[0] < 1 < aspects[-1]
    batches = list(loader)
    assert [name for batch in batches for name in batch["im_file"]] == [label["im_file"] for label in labels]
    ours = [tuple(batch["img"].shape[2:]) for batch in batches]
    # ultralytics' rule without its extra half stride: a cut of the S x S letterbox is never larger than S
    assert ours == ultralytics_batch_shapes(aspects, 4, SIZE, pad=0.0)
    theirs = ultralytics_batch_shapes(aspects, 4, SIZE, pad=0.5)
    assert all(0 <= t - o <= 32 for mine, their in zip(ours, theirs) for o, t in zip(mine, their))
    unsorted = split_shards(dataset / "data.yaml", "val", SIZE, dataset, cache=tmp_path, order="shuffle")
    before = [batch["img"].shape for batch in yolo_loader(unsorted, 4, False, SIZE, workers=2, rect=True)]
    after = [batch["img"].shape for batch in batches]
    assert sum(int(np.prod(shape)) for shape in after) < sum(int(np.prod(shape)) for shape in before)


def test_a_split_prepared_in_another_order_is_never_taken_for_this_one(dataset: Path, tmp_path: Path) -> None:
    shuffled = split_shards(dataset / "data.yaml", "val", SIZE, dataset, cache=tmp_path, order="shuffle")
    assert shuffled.name == "val"  # the folder an earlier gpufeed prepared the split into, shuffled
    ordered = split_shards(dataset / "data.yaml", "val", SIZE, dataset, cache=tmp_path)
    assert ordered == shuffled.parent / "val.aspect" and (ordered / "manifest.json").exists()
    assert split_shards(dataset / "data.yaml", "train", SIZE, dataset, cache=tmp_path) == shuffled.parent / "train"
    assert read_manifest(Output(str(ordered))).params["order"] == "aspect"
    assert "order" not in read_manifest(Output(str(shuffled))).params


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_the_eval_loader_delivers_a_sorted_dataset_in_its_order_with_two_workers(
    dataset: Path, tmp_path: Path, worker_type: str
) -> None:
    out = tmp_path / "sorted"
    prepare_dataset(PrepareSpec(str(dataset / "data.yaml"), str(out), split="val", order="aspect",
                                resize=ResizeSpec(size=SIZE, mode="longer", upscale=True),
                                shards=ShardSpec(max_bytes=None, max_samples=3)), workers=0)  # fmt: skip
    shards = read_manifest(Output(str(out))).shards
    assert len(shards) == 4
    expected = [key for shard in shards for key, _ in iter_tar_samples(str(out / shard.path))]
    loader = make_loader(str(out), 5, crop=SIZE, num_workers=2, worker_type=worker_type, dtype="uint8", train=False,
                         drop_last=False)  # fmt: skip
    try:
        for _ in range(2):  # every epoch
            assert [key for batch in loader for key in batch.keys] == expected
    finally:
        loader.close()


def test_training_batches_have_the_mosaics_in_ultralytics_shapes(dataset: Path, tmp_path: Path) -> None:
    shards = split_shards(dataset / "data.yaml", "train", SIZE, dataset, cache=tmp_path)
    loader = yolo_loader(shards, 4, True, SIZE, workers=2, epochs=3, close_mosaic=1, epoch_of=lambda: 2)
    batches = list(loader)
    assert len(batches) == len(loader) == 3 and loader.loader.epoch == 3  # the trainer's epoch 2 ran
    for batch in batches:
        boxes = batch["bboxes"].numpy()
        assert ((boxes >= 0) & (boxes <= 1)).all() and batch["cls"].shape == (len(boxes), 1)
        assert len(batch["batch_idx"]) == len(boxes) and batch["img"].shape == (4, 3, SIZE, SIZE)
    # epoch 2 of 3 with close_mosaic=1: single images, at most the boxes one picture has
    most = max(len(label_boxes(dataset, label["im_file"])) for label in loader.dataset.labels)
    assert max(int((b["batch_idx"] == i).sum()) for b in batches for i in range(4)) <= most


def test_the_datasets_labels_are_the_label_files(dataset: Path, tmp_path: Path) -> None:
    shards = split_shards(dataset / "data.yaml", "val", SIZE, dataset, cache=tmp_path)
    labels = yolo_loader(shards, 4, False, SIZE, workers=1).dataset.labels
    assert len(labels) == 12
    for label in labels:
        height, width = label["shape"]
        expected = label_boxes(dataset, label["im_file"])
        original = Image.open(label["im_file"]).size
        centres = label["bboxes"][:, :2] * [original[0], original[1]]
        assert label["cls"].shape == (len(expected), 1) and max(width, height) == SIZE
        if len(expected):
            assert np.abs(np.sort(centres, 0) - np.sort((expected[:, :2] + expected[:, 2:]) / 2, 0)).max() < 0.01


def test_a_split_is_prepared_once_and_again_when_its_files_change(dataset: Path, tmp_path: Path) -> None:
    first = split_shards(dataset / "data.yaml", "val", SIZE, dataset, cache=tmp_path)
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert split_shards(dataset / "data.yaml", "val", SIZE, dataset, cache=tmp_path) == first
    assert (first / "manifest.json").stat().st_mtime_ns == stamp
    assert split_shards(dataset / "data.yaml", "val", 96, dataset, cache=tmp_path) != first
    label = next((dataset / "labels" / "val").iterdir())
    os.utime(label, ns=(stamp, stamp + 10**9))
    changed = split_shards(dataset / "data.yaml", "val", SIZE, dataset, cache=tmp_path)
    assert changed != first and (changed / "manifest.json").exists()
    assert not [p for p in changed.parent.iterdir() if p.name.startswith(".")]  # no partial folder left


def test_ultralytics_hyperparameters_become_the_recipes_and_what_it_does_not_draw_is_refused() -> None:
    args = {"mosaic": 0.5, "fliplr": 0.0, "degrees": 10.0, "hsv_h": 0.015, "mixup": 0.1, "lr0": 0.01, "cutmix": None}
    assert recipe_hyp(args) == {"mosaic": 0.5, "fliplr": 0.0, "degrees": 10.0, "hsv_h": 0.015, "mixup": 0.1}
    for on in ({"bgr": 0.1}, {"fraction": 0.5}, {"classes": [0]}, {"rect": True},
               {"copy_paste": 0.5, "copy_paste_mode": "mixup"}):  # fmt: skip
        with pytest.raises(ConfigError, match=list(on)[-1]):
            recipe_hyp(on)
    assert recipe_hyp({"copy_paste": 0.5, "copy_paste_mode": "flip"}) == {"copy_paste": 0.5}  # drawn: its mode "flip"
    assert recipe_hyp({"copy_paste": 0.0, "copy_paste_mode": "mixup"}) == {"copy_paste": 0.0}  # off: no mode to refuse
    assert recipe_hyp({"fraction": 1.0, "classes": None, "rect": False}) == {}


def test_single_class_training_sees_every_box_as_class_0(dataset: Path, tmp_path: Path) -> None:
    shards = split_shards(dataset / "data.yaml", "val", SIZE, dataset, cache=tmp_path)
    several = yolo_loader(shards, 6, False, SIZE, workers=1)
    single = yolo_loader(shards, 6, False, SIZE, workers=1, single_class=True)
    assert any(len(set(label["cls"].ravel().tolist())) > 1 for label in several.dataset.labels)
    assert all(not label["cls"].any() for label in single.dataset.labels)
    for a, b in zip(several, single):
        assert torch.equal(a["bboxes"], b["bboxes"]) and not b["cls"].any() and a["cls"].any()


def test_the_yaml_as_ultralytics_resolved_it_prepares_the_same_split(dataset: Path, tmp_path: Path) -> None:
    # check_det_dataset's dict: absolute paths, names as a dict (a relative `path` resolved its own way)
    data = {"path": dataset, "train": str(dataset / "images" / "train"), "val": str(dataset / "images" / "val"),
            "names": {0: "cat", 1: "dog", 2: "bird"}, "nc": 3, "yaml_file": str(dataset / "data.yaml")}  # fmt: skip
    resolved = resolved_yaml(data, cache=tmp_path)
    assert resolved.parent.parent == tmp_path and resolved_yaml(data, cache=tmp_path) == resolved
    ours = yolo_loader(split_shards(resolved, "val", SIZE, dataset, cache=tmp_path), 4, False, SIZE, workers=1)
    theirs = yolo_loader(split_shards(dataset / "data.yaml", "val", SIZE, dataset, cache=tmp_path), 4, False, SIZE,
                         workers=1)  # fmt: skip
    assert sorted(label["im_file"] for label in ours.dataset.labels) == sorted(
        label["im_file"] for label in theirs.dataset.labels
    )
    assert ours.loader.dataset.classes == ["cat", "dog", "bird"]


def test_a_cache_inside_the_dataset_folder_is_not_taken_for_a_change_of_it(tmp_path: Path) -> None:
    root = Path(make_yolo_dataset(tmp_path / "data", 8, min_side=60, max_side=90))
    (root / "data.yaml").write_text((root / "data.yaml").read_text().replace("path: .", f"path: {root}"))
    cache = root / ".gpufeed"
    first = split_shards(root / "data.yaml", "val", 64, root, cache=cache)
    assert split_shards(root / "data.yaml", "val", 64, root, cache=cache) == first
    assert split_shards(root / "data.yaml", "train", 64, root, cache=cache).parent == first.parent
    small = yolo_loader(split_shards(root / "data.yaml", "train", 64, root, cache=cache), 16, True, 64, workers=1)
    batches = list(small)  # fewer images than a batch still train, as with ultralytics' loader
    assert len(small) == len(batches) == 1 and batches[0]["img"].shape[0] == 4
