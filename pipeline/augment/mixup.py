"""Ultralytics' MixUp and CutMix on a batch: an output blended with another, or a patch of another pasted in.

Ultralytics blends a training image, with probability `mixup`, with a
second one made by the same recipe (its own mosaic and affine), by a ratio
r drawn from Beta(32, 32): r x own + (1 - r) x other, truncated to uint8;
the boxes and classes of both are kept. On a batch the second image is
another output of the same batch (made by the same recipe, from other
sources), drawn for each mixed image; every blend reads the outputs as they
were before any was mixed. The images may be uint8 (truncated as
ultralytics) or floats (normalised: the blend is linear, so it commutes
with the normalisation).

CutMix (`cutmix_batch`), as ultralytics' 8.4: three candidate rectangles,
each (1 - lam)^0.5 of the image's sides with lam ~ Beta(1, 1) around a
random centre; one that covers none of the image's own boxes is drawn
(none: no cut), the other image's pixels there are pasted in, and the
other's boxes that have at least 10 % of their area in it join, clipped
to it.
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
    partners = [_partner(rng, i, count) for i in chosen]
    ratios = rng.beta(32.0, 32.0, len(chosen))
    mixed, mixed_boxes, mixed_labels = images.clone(), list(boxes), list(labels)
    for i, j, r in zip(chosen, partners, ratios):  # each reads the batch as it came: no blend of a blend
        blend = images[i].float() * float(r) + images[j].float() * float(1 - r)
        mixed[i] = blend.to(images.dtype) if images.dtype == torch.uint8 else blend  # uint8: truncated, as theirs
        mixed_boxes[i] = torch.cat([boxes[i], boxes[j]])
        mixed_labels[i] = torch.cat([labels[i], labels[j]])
    return mixed, mixed_boxes, mixed_labels


def _partner(rng: np.random.Generator, i: int, count: int) -> int:
    """Any other image of the batch than `i`, drawn."""
    return (i + 1 + int(rng.integers(count - 1))) % count


def _on_host(boxes: list[torch.Tensor]) -> list[np.ndarray]:
    """Each image's boxes as a NumPy array, copied from their device in one transfer (not one per image)."""
    flat = torch.cat(boxes).cpu().numpy()
    return np.split(flat, np.cumsum([len(b) for b in boxes])[:-1])


def _ioa(areas: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """Intersection of each area (A, 4) with each box (B, 4) over the box's own area: (A, B)."""
    if not len(boxes):
        return np.zeros((len(areas), 0))
    x0 = np.maximum(areas[:, None, 0], boxes[None, :, 0])
    y0 = np.maximum(areas[:, None, 1], boxes[None, :, 1])
    x1 = np.minimum(areas[:, None, 2], boxes[None, :, 2])
    y1 = np.minimum(areas[:, None, 3], boxes[None, :, 3])
    inter = (x1 - x0).clip(0) * (y1 - y0).clip(0)
    own = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    return inter / (own[None, :] + 1e-7)


def _cut_area(rng: np.random.Generator, width: int, height: int) -> tuple[int, int, int, int]:
    cut = np.sqrt(1.0 - rng.beta(1.0, 1.0))
    cut_w, cut_h = int(width * cut), int(height * cut)
    cx, cy = int(rng.integers(width)), int(rng.integers(height))
    return (int(np.clip(cx - cut_w // 2, 0, width)), int(np.clip(cy - cut_h // 2, 0, height)),
            int(np.clip(cx + cut_w // 2, 0, width)), int(np.clip(cy + cut_h // 2, 0, height)))  # fmt: skip


def cutmix_batch(
    images: torch.Tensor,
    boxes: list[torch.Tensor],
    labels: list[torch.Tensor],
    p: float,
    rng: np.random.Generator,
    sources: tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The batch with each image, with probability `p`, given a patch of a drawn other one and its boxes there.

    Args:
        images, boxes, labels, p, rng: as `mixup_batch` (p is ultralytics' `cutmix`).
        sources: where the patches come from (default the batch itself): the batch as it was before
            MixUp, so that a patch is another output as the recipe made it (ultralytics cuts from a fresh one).

    Returns:
        (images, boxes, labels): new tensors where an image was cut into, the given ones elsewhere.
    """
    count, height, width = images.shape[0], images.shape[2], images.shape[3]
    if count < 2 or p <= 0:
        return images, boxes, labels
    source_images, source_boxes, source_labels = sources if sources is not None else (images, boxes, labels)
    out, out_boxes, out_labels = None, list(boxes), list(labels)
    host: tuple[list[np.ndarray], list[np.ndarray]] | None = None  # (boxes, source boxes), copied once when needed
    for i in range(count):
        if rng.uniform() >= p:
            continue
        j = _partner(rng, i, count)
        if host is None:
            host = (_on_host(boxes), _on_host(source_boxes) if source_boxes is not boxes else [])
        ours, theirs = host[0][i], (host[1] or host[0])[j]
        areas = np.array([_cut_area(rng, width, height) for _ in range(3)], np.float32)
        free = np.nonzero(_ioa(areas, ours).sum(axis=1) <= 0)[0]
        if not len(free):
            continue
        x0, y0, x1, y1 = (int(v) for v in areas[int(rng.choice(free))])
        keep = np.nonzero(_ioa(np.array([[x0, y0, x1, y1]], np.float32), theirs)[0] >= 0.1)[0]
        if out is None:
            out = images.clone()
        out[i, :, y0:y1, x0:x1] = source_images[j, :, y0:y1, x0:x1]
        index = torch.as_tensor(keep, dtype=torch.long, device=source_boxes[j].device)
        kept = source_boxes[j][index]
        limits = torch.tensor([x0, y0, x0, y0], dtype=kept.dtype, device=kept.device)
        upper = torch.tensor([x1, y1, x1, y1], dtype=kept.dtype, device=kept.device)
        out_boxes[i] = torch.cat([boxes[i], torch.minimum(torch.maximum(kept, limits), upper)])
        out_labels[i] = torch.cat([labels[i], source_labels[j][index.to(source_labels[j].device)]])
    return (out if out is not None else images), out_boxes, out_labels
