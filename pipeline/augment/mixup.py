"""Ultralytics' MixUp on a batch: an output blended with another output, their boxes together.

Ultralytics blends a training image, with probability `mixup`, with a
second one made by the same recipe (its own mosaic and affine), by a ratio
r drawn from Beta(32, 32): r x own + (1 - r) x other, truncated to uint8;
the boxes and classes of both are kept. On a batch the second image is
another output of the same batch (made by the same recipe, from other
sources), drawn for each mixed image; every blend reads the outputs as they
were before any was mixed. The images may be uint8 (truncated as
ultralytics) or floats (normalised: the blend is linear, so it commutes
with the normalisation).
"""

from __future__ import annotations

import numpy as np
import torch


def mixup_batch(
    images: torch.Tensor, boxes: list[torch.Tensor], labels: list[torch.Tensor], p: float, rng: np.random.Generator
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The batch with each image, with probability `p`, blended with a drawn other one of it.

    Args:
        images: [B, 3, H, W] uint8 or float, on any device.
        boxes: per image, [N_i, 4] XYXY in its pixels.
        labels: per image, [N_i] class indices.
        p: ultralytics' `mixup` hyperparameter.
        rng: the draws (which images, their partners, their ratios).

    Returns:
        (images, boxes, labels): new tensors where an image was mixed, the given ones elsewhere.
    """
    count = images.shape[0]
    if count < 2 or p <= 0:
        return images, boxes, labels
    chosen = [i for i in range(count) if rng.uniform() < p]
    if not chosen:
        return images, boxes, labels
    partners = [(i + 1 + int(rng.integers(count - 1))) % count for i in chosen]  # any other image of the batch
    ratios = rng.beta(32.0, 32.0, len(chosen))
    mixed, mixed_boxes, mixed_labels = images.clone(), list(boxes), list(labels)
    for i, j, r in zip(chosen, partners, ratios):  # each reads the batch as it came: no blend of a blend
        blend = images[i].float() * float(r) + images[j].float() * float(1 - r)
        mixed[i] = blend.to(images.dtype) if images.dtype == torch.uint8 else blend  # uint8: truncated, as theirs
        mixed_boxes[i] = torch.cat([boxes[i], boxes[j]])
        mixed_labels[i] = torch.cat([labels[i], labels[j]])
    return mixed, mixed_boxes, mixed_labels
