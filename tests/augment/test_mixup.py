"""MixUp on a batch: each chosen image blended with another of the batch by r ~ Beta(32, 32), boxes together."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.augment.mixup import Mixed, mixup_batch


def batch(count: int = 6) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (count, 3, 16, 16), dtype=torch.uint8, generator=generator)
    boxes = [torch.tensor([[i, i, i + 4.0, i + 5.0]] * (i % 3 + 1)) for i in range(count)]
    labels = [torch.full((i % 3 + 1,), i) for i in range(count)]
    return images, boxes, labels


def test_every_image_mixed_is_a_blend_of_two_of_the_batch_and_holds_both_their_boxes() -> None:
    images, boxes, labels = batch()
    mixed, mixed_boxes, mixed_labels, *_ = mixup_batch(Mixed(images, boxes, labels), 1.0, np.random.default_rng(3))
    for i in range(len(images)):
        partner = int(mixed_labels[i][-1])  # the labels tell which image joined
        assert partner != i and torch.equal(mixed_labels[i], torch.cat([labels[i], labels[partner]]))
        assert torch.equal(mixed_boxes[i], torch.cat([boxes[i], boxes[partner]]))
        own, other = images[i].double(), images[partner].double()
        # r from the blend itself (truncation takes half a level on average)
        blend = mixed[i].double() + 0.5
        r = float(((blend - other) * (own - other)).sum() / ((own - other) ** 2).sum())
        assert 0.25 < r < 0.75
        assert (blend - (own * r + other * (1 - r))).abs().max() <= 0.6
    assert torch.equal(images, batch()[0])  # the inputs are left as they were


def test_nothing_is_mixed_at_probability_zero_or_alone_and_floats_blend_linearly() -> None:
    images, boxes, labels = batch()
    assert mixup_batch(Mixed(images, boxes, labels), 0.0, np.random.default_rng(0))[0] is images
    alone = images[:1]
    assert mixup_batch(Mixed(alone, boxes[:1], labels[:1]), 1.0, np.random.default_rng(0))[0] is alone
    floats = images.float() / 255 - 0.5
    mixed, _, mixed_labels, *_ = mixup_batch(Mixed(floats, boxes, labels), 1.0, np.random.default_rng(3))
    uint8, *_ = mixup_batch(Mixed(images, boxes, labels), 1.0, np.random.default_rng(3))
    assert ((mixed + 0.5) * 255 - uint8.float()).abs().max() < 1.0  # the same draws, without the truncation


def test_cutmix_pastes_a_rectangle_clear_of_the_images_boxes_with_the_others_boxes_there() -> None:
    from pipeline.augment.mixup import cutmix_batch

    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (8, 3, 64, 64), dtype=torch.uint8, generator=generator)
    boxes = [torch.tensor([[4.0 * i, 4.0, 4.0 * i + 12, 20.0], [30.0, 36.0, 60.0, 62.0]]) for i in range(8)]
    labels = [torch.tensor([i, 10 + i]) for i in range(8)]
    cut, cut_boxes, cut_labels, *_ = cutmix_batch(Mixed(images, boxes, labels), 1.0, np.random.default_rng(4))
    changed = 0
    for i in range(8):
        differs = (cut[i] != images[i]).any(0)
        if not differs.any():
            assert torch.equal(cut_boxes[i], boxes[i]) and torch.equal(cut_labels[i], labels[i])
            continue
        changed += 1
        ys, xs = differs.nonzero(as_tuple=True)
        y0, y1, x0, x1 = int(ys.min()), int(ys.max()) + 1, int(xs.min()), int(xs.max()) + 1
        j = next(j for j in range(8) if j != i and torch.equal(cut[i, :, y0:y1, x0:x1], images[j, :, y0:y1, x0:x1]))
        for box in boxes[i]:  # the rectangle covers none of the image's own boxes
            assert box[2] <= x0 or box[0] >= x1 or box[3] <= y0 or box[1] >= y1
        assert torch.equal(cut_boxes[i][:2], boxes[i]) and torch.equal(cut_labels[i][:2], labels[i])
        joined = cut_boxes[i][2:]
        assert set(cut_labels[i][2:].tolist()) <= set(labels[j].tolist())  # the other's, clipped to the cut
        assert ((joined[:, 0] >= x0 - 1) & (joined[:, 2] <= x1 + 1) & (joined[:, 1] >= y0 - 1) & (joined[:, 3] <= y1 + 1)).all()
    assert changed >= 2
    assert torch.equal(cutmix_batch(Mixed(images, boxes, labels), 0.0, np.random.default_rng(4))[0], images)


def test_polygons_join_with_their_boxes_and_are_cut_to_the_pasted_rectangle() -> None:
    from pipeline.augment.mixup import cutmix_batch

    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (8, 3, 64, 64), dtype=torch.uint8, generator=generator)
    boxes = [torch.tensor([[4.0 * i, 4.0, 4.0 * i + 12, 20.0], [30.0, 36.0, 60.0, 62.0]]) for i in range(8)]
    labels = [torch.tensor([i, 10 + i]) for i in range(8)]
    diamonds = [[[torch.tensor([[(b[0] + b[2]) / 2, b[1]], [b[2], (b[1] + b[3]) / 2], [(b[0] + b[2]) / 2, b[3]],
                               [b[0], (b[1] + b[3]) / 2]])] for b in own.tolist()] for own in boxes]  # fmt: skip
    mixed = mixup_batch(Mixed(images, boxes, labels, diamonds), 1.0, np.random.default_rng(3))
    assert mixed.polygons is not None
    for i in range(8):
        partner = int(mixed.labels[i][-1]) - 10
        assert [p[0].tolist() for p in mixed.polygons[i]] == [p[0].tolist() for p in diamonds[i] + diamonds[partner]]
    cut = cutmix_batch(Mixed(images, boxes, labels, diamonds), 1.0, np.random.default_rng(4))
    assert cut.polygons is not None
    pasted = 0
    for i in range(8):
        assert len(cut.polygons[i]) == len(cut.boxes[i])
        for box, parts in zip(cut.boxes[i][2:], cut.polygons[i][2:]):  # the pasted ones: inside the clipped box
            for points in parts:
                assert (points.min(0).values >= box[:2] - 1e-4).all() and (points.max(0).values <= box[2:] + 1e-4).all()
                pasted += 1
    assert pasted > 0

