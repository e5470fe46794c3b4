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

Instance polygons, where the batch has them (per image, per box, its
polygons), go with their boxes: MixUp joins both images' lists; CutMix
takes the pasted boxes' polygons cut to the rectangle, and with polygons a
box joins with 1 % of its area there (ultralytics' rule with segments).

Masks, where the batch has them, go with their pixels: each box's own mask
(`instance_masks`) joins with its box, as the polygons do, and CutMix cuts
the pasted ones to its rectangle and clears the rectangle from the image's
own; a class mask (`masks`, one per image) takes the pasted rectangle's
classes under CutMix. Two class masks cannot be blended: under MixUp a
pixel keeps its class where both images' masks agree and gets the ignore
index where they differ (no loss where the blend is both).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..polygons import clip_polygon
from .warp import ioa

Shapes = list[list[list[torch.Tensor]]]
"""A batch's polygons: per image, per box, its polygons as (K, 2) tensors."""


class Mixed(NamedTuple):
    """A batch after MixUp or CutMix: its images, boxes, labels, polygons, class masks and each box's own
    mask (None where it has none)."""

    images: torch.Tensor
    boxes: list[torch.Tensor]
    labels: list[torch.Tensor]
    polygons: Shapes | None = None
    masks: torch.Tensor | None = None
    instance_masks: list[torch.Tensor] | None = None


def mixup_batch(batch: Mixed, p: float, rng: np.random.Generator, ignore_index: int = 255) -> Mixed:
    """The batch with each image, with probability `p`, blended with a drawn other one of it.

    Args:
        batch: images [B, 3, H, W] uint8 or float, on any device; per image its boxes [N_i, 4] XYXY in its
            pixels and labels [N_i]; where given, per image per box its polygons and its own mask [N_i, H, W]
            (both joined as the boxes are), and the class masks [B, H, W] (a mixed image's keeps the classes
            both agree on, and `ignore_index` elsewhere).
        p: ultralytics' `mixup` hyperparameter.
        rng: the draws (which images, their partners, their ratios).

    Returns:
        New tensors where an image was mixed, the given ones elsewhere.
    """
    images, boxes, labels, polygons, masks, instance_masks = batch
    count = images.shape[0]
    if count < 2 or p <= 0:
        return batch
    chosen = [i for i in range(count) if rng.uniform() < p]
    if not chosen:
        return batch
    partners = [_partner(rng, i, count) for i in chosen]
    ratios = rng.beta(32.0, 32.0, len(chosen))
    mixed, mixed_boxes, mixed_labels = images.clone(), list(boxes), list(labels)
    mixed_polygons = list(polygons) if polygons is not None else None
    mixed_instances = list(instance_masks) if instance_masks is not None else None
    mixed_masks = masks.clone() if masks is not None else None
    for i, j, r in zip(chosen, partners, ratios):  # each reads the batch as it came: no blend of a blend
        blend = images[i].float() * float(r) + images[j].float() * float(1 - r)
        mixed[i] = blend.to(images.dtype) if images.dtype == torch.uint8 else blend  # uint8: truncated, as theirs
        mixed_boxes[i] = torch.cat([boxes[i], boxes[j]])
        mixed_labels[i] = torch.cat([labels[i], labels[j]])
        if mixed_polygons is not None and polygons is not None:
            mixed_polygons[i] = [*polygons[i], *polygons[j]]
        if mixed_instances is not None and instance_masks is not None:
            mixed_instances[i] = torch.cat([instance_masks[i], instance_masks[j]])
        if mixed_masks is not None and masks is not None:
            mixed_masks[i][masks[i] != masks[j]] = ignore_index
    return Mixed(mixed, mixed_boxes, mixed_labels, mixed_polygons, mixed_masks, mixed_instances)


def _partner(rng: np.random.Generator, i: int, count: int) -> int:
    """Any other image of the batch than `i`, drawn."""
    return (i + 1 + int(rng.integers(count - 1))) % count


def _on_host(boxes: list[torch.Tensor]) -> list[np.ndarray]:
    """Each image's boxes as a NumPy array, copied from their device in one transfer (not one per image)."""
    flat = torch.cat(boxes).cpu().numpy()
    return np.split(flat, np.cumsum([len(b) for b in boxes])[:-1])


def _cut_area(rng: np.random.Generator, width: int, height: int) -> tuple[int, int, int, int]:
    cut = np.sqrt(1.0 - rng.beta(1.0, 1.0))
    cut_w, cut_h = int(width * cut), int(height * cut)
    cx, cy = int(rng.integers(width)), int(rng.integers(height))
    return (int(np.clip(cx - cut_w // 2, 0, width)), int(np.clip(cy - cut_h // 2, 0, height)),
            int(np.clip(cx + cut_w // 2, 0, width)), int(np.clip(cy + cut_h // 2, 0, height)))  # fmt: skip


def cutmix_batch(batch: Mixed, p: float, rng: np.random.Generator, sources: Mixed | None = None) -> Mixed:
    """The batch with each image, with probability `p`, given a patch of a drawn other one and its boxes there.

    Args:
        batch, rng: as `mixup_batch`; the class masks take the pasted rectangle's classes.
        p: ultralytics' `cutmix` hyperparameter.
        sources: where the patches come from (default the batch itself): the batch as it was before
            MixUp, so that a patch is another output as the recipe made it (ultralytics cuts from a fresh one).

    Returns:
        New tensors where an image was cut into, the given ones elsewhere.
    """
    images, boxes, labels, polygons, masks, instance_masks = batch
    count, height, width = images.shape[0], images.shape[2], images.shape[3]
    if count < 2 or p <= 0:
        return batch
    source_images, source_boxes, source_labels, source_polygons, source_masks, source_instances = sources or batch
    out, out_boxes, out_labels = None, list(boxes), list(labels)
    out_polygons = list(polygons) if polygons is not None else None
    out_masks = masks.clone() if masks is not None else None
    out_instances = list(instance_masks) if instance_masks is not None else None
    least = 0.01 if polygons is not None else 0.1  # a pasted box's share of its area in the cut (ultralytics')
    host: tuple[list[np.ndarray], list[np.ndarray]] | None = None  # (boxes, source boxes), copied once when needed
    for i in range(count):
        if rng.uniform() >= p:
            continue
        j = _partner(rng, i, count)
        if host is None:
            host = (_on_host(boxes), _on_host(source_boxes) if source_boxes is not boxes else [])
        ours, theirs = host[0][i], (host[1] or host[0])[j]
        areas = np.array([_cut_area(rng, width, height) for _ in range(3)], np.float32)
        free = np.nonzero(ioa(areas, ours).sum(axis=1) <= 0)[0]
        if not len(free):
            continue
        x0, y0, x1, y1 = (int(v) for v in areas[int(rng.choice(free))])
        keep = np.nonzero(ioa(np.array([[x0, y0, x1, y1]], np.float32), theirs)[0] >= least)[0]
        if out is None:
            out = images.clone()
        out[i, :, y0:y1, x0:x1] = source_images[j, :, y0:y1, x0:x1]
        index = torch.as_tensor(keep, dtype=torch.long, device=source_boxes[j].device)
        kept = source_boxes[j][index]
        limits = torch.tensor([x0, y0, x0, y0], dtype=kept.dtype, device=kept.device)
        upper = torch.tensor([x1, y1, x1, y1], dtype=kept.dtype, device=kept.device)
        out_boxes[i] = torch.cat([boxes[i], torch.minimum(torch.maximum(kept, limits), upper)])
        out_labels[i] = torch.cat([labels[i], source_labels[j][index.to(source_labels[j].device)]])
        if out_polygons is not None and polygons is not None:
            pasted = source_polygons[j] if source_polygons is not None else [[] for _ in source_boxes[j]]
            window = (float(x0), float(y0), float(x1), float(y1))
            out_polygons[i] = [*polygons[i], *(_cut_to(pasted[int(k)], window) for k in keep)]
        if out_masks is not None and source_masks is not None:
            out_masks[i, y0:y1, x0:x1] = source_masks[j, y0:y1, x0:x1]
        if out_instances is not None and instance_masks is not None:
            out_instances[i] = _cut_instances(instance_masks[i], (source_instances or instance_masks)[j], keep,
                                              (x0, y0, x1, y1))  # fmt: skip
    return Mixed(out if out is not None else images, out_boxes, out_labels, out_polygons, out_masks, out_instances)


def _cut_instances(
    own: torch.Tensor, theirs: torch.Tensor, keep: np.ndarray, window: tuple[int, int, int, int]
) -> torch.Tensor:
    """An image's own box masks with the pasted rectangle cleared, then the pasted boxes' masks inside it only."""
    x0, y0, x1, y1 = window
    own = own.clone()
    own[:, y0:y1, x0:x1] = 0
    index = torch.as_tensor(keep, dtype=torch.long, device=theirs.device)
    pasted = torch.zeros((len(keep), *theirs.shape[1:]), dtype=theirs.dtype, device=theirs.device)
    pasted[:, y0:y1, x0:x1] = theirs[index][:, y0:y1, x0:x1]
    return torch.cat([own, pasted.to(own.device)])


def _cut_to(parts: list[torch.Tensor], window: tuple[float, float, float, float]) -> list[torch.Tensor]:
    """A box's polygons cut to the pasted rectangle (those left with no area are gone)."""
    out = []
    for points in parts:
        clipped = clip_polygon(points.detach().cpu().double().numpy(), window)
        if clipped is not None:
            out.append(torch.as_tensor(clipped, dtype=points.dtype, device=points.device))
    return out
