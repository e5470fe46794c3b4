"""make_loader(recipe="yolo"): ultralytics' training recipe, each output a mosaic rendered once per source.

A YOLO dataset of step pictures (`step_edges`: a bright rectangle whose
label is its exact box) is prepared without a resize and loaded with the
recipe: every delivered box must sit on its rectangle's edges in the
delivered pixels (mosaic, random scale and shift, flips, HSV gains, all in
one render per source), the same with threads and processes, the same
again for the same seed; eval mode letterboxes; the recipe is refused where
it cannot apply.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from step_edges import edge_errors, halo, step_picture

from pipeline import ConfigError, PrepareSpec, ResizeSpec, make_loader, prepare_dataset
from pipeline.demo import make_demo_dataset

CROP = 192


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("yolo") / "source"
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    rng = np.random.default_rng(0)
    for number in range(24):
        width, height = int(rng.integers(200, 420)), int(rng.integers(200, 420))
        w, h = int(width * rng.uniform(0.3, 0.45)), int(height * rng.uniform(0.3, 0.45))
        x0, y0 = (width - w) // 2, (height - h) // 2
        Image.fromarray(step_picture(width, height, (x0, y0, x0 + w, y0 + h), number)).save(
            root / "images" / f"{number:03d}.jpg", quality=95
        )
        cx, cy = (x0 + w / 2) / width, (y0 + h / 2) / height
        (root / "labels" / f"{number:03d}.txt").write_text(f"{number % 3} {cx} {cy} {w / width} {h / height}\n")
    (root / "data.yaml").write_text("names: [a, b, c]\n")
    out = root.parent / "out"
    prepare_dataset(PrepareSpec(str(root), str(out), resize=ResizeSpec(mode="none")), workers=0)
    return out


def batches(prepared: Path, **options: object) -> list[tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]]:
    named = {} if "augment" in options else {"recipe": "yolo"}  # an op list names its own recipe
    loader = make_loader(str(prepared), 8, device="cpu", crop=CROP, num_workers=2, dtype="uint8", seed=3,
                         **named, **options)  # fmt: skip
    return [(b.images.numpy(), [x.numpy() for x in b.boxes], [x.numpy() for x in b.box_labels]) for b in loader]


@pytest.mark.parametrize("mosaic_n", [4, 9])
def test_every_box_sits_on_its_rectangles_edges_in_the_mosaic(prepared: Path, mosaic_n: int) -> None:
    errors: list[float] = []
    boxes = 0
    for images, batch_boxes, labels in batches(prepared, hyp={"mosaic_n": mosaic_n}):
        assert images.shape[1:] == (3, CROP, CROP)
        for image, found, classes in zip(images, batch_boxes, labels):
            assert ((found >= 0) & (found <= CROP)).all() and set(classes.tolist()) <= {0, 1, 2}
            for box in found:
                boxes += 1
                # zoom: at most 1.5x the longer side at CROP; the halo is 12 % of the picture's longer side
                found_edges = edge_errors(image, tuple(box), (0, 0, CROP, CROP), 1.0, halo(400, 400) * CROP / 420 * 0.5)
                errors += [abs(v) for v in found_edges.values()]
    assert boxes >= 40 and len(errors) >= 30, (boxes, len(errors))
    # nine images fill the canvas to its edges: a rectangle cut there ends at the pixel row where the output's
    # window of the canvas ends, its clipped box up to half a pixel further
    largest = 0.35 if mosaic_n == 4 else 0.5
    assert float(np.mean(errors)) < 0.15 and max(errors) < largest, (float(np.mean(errors)), max(errors))


def test_threads_and_processes_give_the_same_mosaics_and_the_same_seed_the_same_epoch(prepared: Path) -> None:
    threads = batches(prepared)
    for other in (batches(prepared, worker_type="process"), batches(prepared)):
        for (images, boxes, labels), (images2, boxes2, labels2) in zip(threads, other):
            assert np.array_equal(images, images2)
            assert all(np.array_equal(a, b) for a, b in zip(boxes, boxes2))
            assert all(np.array_equal(a, b) for a, b in zip(labels, labels2))


def test_eval_mode_letterboxes_as_the_letterbox_recipe(prepared: Path) -> None:
    evaluated = batches(prepared, train=False)
    letterboxed = make_loader(str(prepared), 8, device="cpu", crop=CROP, num_workers=2, dtype="uint8",
                              recipe="letterbox", seed=3, train=False)  # fmt: skip
    for (images, boxes, _), batch in zip(evaluated, letterboxed):
        assert np.array_equal(images, batch.images.numpy())
        assert all(np.array_equal(a, b.numpy()) for a, b in zip(boxes, batch.boxes))


def test_the_recipe_is_refused_where_it_cannot_apply(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="geometry"):
        make_loader(str(prepared), 8, device="cpu", crop=CROP, recipe="yolo", fields=("geometry",))
    make_demo_dataset(tmp_path / "cls", 8, min_side=64, max_side=96, workers=1)
    prepare_dataset(PrepareSpec(str(tmp_path / "cls"), str(tmp_path / "out"), resize=ResizeSpec(mode="none")),
                    workers=0)  # fmt: skip
    with pytest.raises(ConfigError, match="detection"):
        make_loader(str(tmp_path / "out"), 4, device="cpu", crop=64, recipe="yolo")


def test_close_mosaic_trains_the_last_epochs_on_single_images(prepared: Path) -> None:
    def most_boxes(epoch: list[tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]]) -> int:
        return max(len(found) for _, boxes, _ in epoch for found in boxes)

    loader = make_loader(str(prepared), 8, device="cpu", crop=CROP, num_workers=2, dtype="uint8", recipe="yolo",
                         seed=3, epochs=3, close_mosaic=2)  # fmt: skip
    epochs = [[(b.images.numpy(), [x.numpy() for x in b.boxes], None) for b in loader] for _ in range(3)]
    assert most_boxes(epochs[0]) >= 2  # a mosaic shows its partners' rectangles too
    assert most_boxes(epochs[1]) == most_boxes(epochs[2]) == 1  # each picture holds one rectangle
    inline = make_loader(str(prepared), 8, device="cpu", crop=CROP, num_workers=0, dtype="uint8", recipe="yolo",
                         seed=3)  # fmt: skip
    first = [[x.numpy() for x in b.boxes] for b in inline]
    inline.close_mosaic()
    second = [[x.numpy() for x in b.boxes] for b in inline]
    assert max(len(found) for boxes in first for found in boxes) >= 2
    assert max(len(found) for boxes in second for found in boxes) == 1
    with pytest.raises(ConfigError, match="epochs="):
        make_loader(str(prepared), 8, device="cpu", crop=CROP, recipe="yolo", close_mosaic=2)
    with pytest.raises(ConfigError, match="close_mosaic"):
        make_loader(str(prepared), 8, device="cpu", crop=CROP, recipe="letterbox", epochs=3, close_mosaic=2)


def test_hyperparameters_by_ultralytics_names_change_the_recipe(prepared: Path) -> None:
    single = batches(prepared, hyp={"mosaic": 0.0})
    assert max(len(found) for _, boxes, _ in single for found in boxes) == 1  # no partners: one rectangle each
    plain = batches(prepared, hyp={"mosaic": 0.0, "translate": 0.0, "scale": 0.0, "fliplr": 0.0, "hsv_h": 0.0,
                                   "hsv_s": 0.0, "hsv_v": 0.0})  # fmt: skip
    for images, boxes, _ in plain:  # each picture fitted in the output, centred, its colours untouched
        for image, found in zip(images, boxes):
            x0, y0, x1, y1 = found[0]
            assert abs((x0 + x1) / 2 - CROP / 2) < 2 and abs((y0 + y1) / 2 - CROP / 2) < 2
    rotated = batches(prepared, hyp={"degrees": 30.0})
    assert any(not np.array_equal(a[0], b[0]) for a, b in zip(rotated, batches(prepared)))
    for bad, message in (({"bgr": 0.1}, "not a hyperparameter"), ({"degrees": -1.0}, "degrees"),
                         ({"hsv_h": 2.0}, "hsv_h"), ({"mosaic_n": 6}, "4 or 9")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            make_loader(str(prepared), 8, device="cpu", crop=CROP, recipe="yolo", hyp=bad)
    with pytest.raises(ConfigError, match="recipe='yolo'"):
        make_loader(str(prepared), 8, device="cpu", crop=CROP, recipe="letterbox", hyp={"degrees": 5.0})


def test_mixup_blends_outputs_of_the_batch_and_joins_their_boxes(prepared: Path) -> None:
    plain, mixed = batches(prepared), batches(prepared, hyp={"mixup": 1.0})
    for (images, boxes, labels), (mixed_images, mixed_boxes, mixed_labels) in zip(plain, mixed):
        for i in range(len(images)):
            # the same mosaics underneath (MixUp draws from its own stream): own boxes first, then a partner's
            own = len(boxes[i])
            assert np.array_equal(mixed_boxes[i][:own], boxes[i])
            partners = [j for j in range(len(images)) if j != i and np.array_equal(mixed_boxes[i][own:], boxes[j])]
            blend = mixed_images[i].astype(np.float64)

            def between(j: int) -> bool:  # the blend lies between the two, pixel by pixel (truncated: 1 level under)
                low = np.minimum(images[i], images[j]).astype(np.float64) - 1
                return bool(((blend >= low) & (blend <= np.maximum(images[i], images[j]))).all())

            found = [j for j in partners if between(j)]
            assert found, (i, partners)
            assert np.array_equal(mixed_labels[i], np.concatenate([labels[i], labels[found[0]]]))
            assert not np.array_equal(mixed_images[i], images[i])


def test_hsv_left_to_the_device_gives_the_workers_pixels(prepared: Path) -> None:
    import dataclasses

    def epoch(on_device: bool) -> list[tuple[np.ndarray, list[np.ndarray]]]:
        loader = make_loader(str(prepared), 8, device="cpu", crop=CROP, num_workers=2, dtype="uint8", recipe="yolo",
                             seed=3, worker_type="process")  # fmt: skip
        if on_device:  # what a CUDA device gets: the gains go with the targets, the batch gets them on the device
            loader._crop = dataclasses.replace(loader._crop, hsv_in_workers=False)
        return [(b.images.numpy(), [x.numpy() for x in b.boxes]) for b in loader]

    in_workers, on_device = epoch(False), epoch(True)
    unchanged = batches(prepared, hyp={"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0})
    for (a, boxes_a), (b, boxes_b), (c, _, _) in zip(in_workers, on_device, unchanged):
        assert all(np.array_equal(x, y) for x, y in zip(boxes_a, boxes_b))
        difference = np.abs(a.astype(int) - b.astype(int))
        assert difference.max() <= 1 and (difference == 0).mean() > 0.9  # native code vs torch: OpenCV's steps
        assert np.abs(b.astype(int) - c.astype(int)).mean() > 1  # and the gains were applied


def test_cutmix_keeps_each_outputs_boxes_and_adds_the_pasted_ones(prepared: Path) -> None:
    plain, cut = batches(prepared), batches(prepared, hyp={"cutmix": 1.0})
    added = 0
    for (images, boxes, _), (cut_images, cut_boxes, _) in zip(plain, cut):
        for i in range(len(images)):
            assert np.array_equal(cut_boxes[i][: len(boxes[i])], boxes[i])
            added += len(cut_boxes[i]) - len(boxes[i])
            if len(cut_boxes[i]) > len(boxes[i]):
                assert not np.array_equal(cut_images[i], images[i])
    assert added > 0


@pytest.mark.cuda
def test_cuda_batches_of_the_recipe_equal_the_cpus_but_for_the_hsv_arithmetic(prepared: Path) -> None:
    # on CUDA the workers leave the HSV gains to the device (torch on the GPU): a level apart at most
    def epoch(device: str) -> list[tuple[np.ndarray, list[np.ndarray]]]:
        loader = make_loader(str(prepared), 8, device=device, crop=CROP, num_workers=2, dtype="uint8", recipe="yolo",
                             seed=3, hyp={"mixup": 0.5, "cutmix": 0.5})  # fmt: skip
        found = []
        for batch in loader:
            assert batch.images.device.type == device and all(b.device.type == device for b in batch.boxes)
            found.append((batch.images.cpu().numpy(), [b.cpu().numpy() for b in batch.boxes]))
        return found

    for (a, boxes_a), (b, boxes_b) in zip(epoch("cpu"), epoch("cuda")):
        assert all(np.array_equal(x, y) for x, y in zip(boxes_a, boxes_b))
        difference = np.abs(a.astype(int) - b.astype(int))
        assert difference.max() <= 1 and (difference == 0).mean() > 0.9


def test_an_op_list_is_the_recipe_it_names(prepared: Path) -> None:
    from pipeline.augment.ops import HSV, Flip, Letterbox, Mosaic, RandomAffine

    for ops, named in (([Mosaic(), RandomAffine(), Flip(), HSV()], {}),
                       ([Mosaic(), RandomAffine(degrees=15), Flip()], {"hyp": {
                           "degrees": 15, "hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0}})):  # fmt: skip
        for (a, boxes_a, _), (b, boxes_b, _) in zip(batches(prepared, augment=ops), batches(prepared, **named)):
            assert np.array_equal(a, b) and all(np.array_equal(x, y) for x, y in zip(boxes_a, boxes_b))
    letterboxed = make_loader(str(prepared), 8, device="cpu", crop=CROP, num_workers=2, dtype="uint8", seed=3,
                              augment=[Letterbox(), Flip()])  # fmt: skip
    named_loader = make_loader(str(prepared), 8, device="cpu", crop=CROP, num_workers=2, dtype="uint8", seed=3,
                               recipe="letterbox")  # fmt: skip
    for x, y in zip(letterboxed, named_loader):
        assert torch.equal(x.images, y.images)
    with pytest.raises(ConfigError, match="not both"):
        make_loader(str(prepared), 8, device="cpu", crop=CROP, recipe="letterbox", augment=[Letterbox()])
