"""Where a detection recipe puts each image: which part of it, into which part of the output.

A placement is (source box, destination): the box (left, top, width,
height) of the image that is read, and the rectangle (x, y, width, height)
of the `size` x `size` output it is resized into; the rest of the output
is `fill` (a mask's: the ignore index). Like the crop plan (`crops.py`)
it is a pure function of the sample's seed and header size, so pixels and
targets (`tasks.py`) get the same one whichever decoder reads the pixels.

    crop          the crop plan: random-resized crop (train) or centre crop
                  (eval) filling the output
    letterbox     the whole image, resized keeping its ratio so the longer
                  side is `size`, centred (YOLO's letterbox); in eval mode
                  every recipe but crop letterboxes
    scale_jitter  the letterboxed size times a random scale in `jitter`
                  (large-scale jitter: 0.1 to 2.0), then a random
                  `size` x `size` window where it is larger, placed top-left
                  and padded where it is smaller
    iou_crop      SSD's random IoU crop (torchvision.transforms.v2's
                  RandomIoUCrop parameters: side scales 0.3 to 1, aspect 0.5
                  to 2, a minimum IoU with some box drawn from 0, 0.1, 0.3,
                  0.5, 0.7, 0.9 or no crop, 40 trials, box centres inside),
                  resized to fill the output
"""

from __future__ import annotations

import math

import numpy as np

from .crops import CropRandom, CropSpec, FixedBox, crop_box

Box = tuple[float, float, float, float]
Placement = tuple[Box, tuple[int, int, int, int]]
IOU_OPTIONS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)  # 1.0: no crop
IOU_TRIALS = 40
IOU_ROUNDS = 50  # option draws at most, then the whole image (transforms.v2 loops until one fits)


def place(
    rng: CropRandom | FixedBox | None, width: int, height: int, spec: CropSpec, boxes: np.ndarray | None = None
) -> Placement:
    """The sample's placement (see the module's table); `boxes` (XYXY) are what iou_crop crops around."""
    size = spec.size
    if spec.recipe == "crop":
        return crop_box(rng, width, height, spec), (0, 0, size, size)
    if spec.recipe == "letterbox" or not spec.train or not isinstance(rng, CropRandom):
        return letterbox(width, height, size)
    if spec.recipe == "scale_jitter":
        return scale_jitter(rng, width, height, size, spec.jitter)
    return iou_crop(rng, width, height, size, boxes)


def letterbox(width: int, height: int, size: int) -> Placement:
    """The whole image, its longer side `size`, centred."""
    scale = size / max(width, height)
    new_w, new_h = max(1, min(size, round(width * scale))), max(1, min(size, round(height * scale)))
    return (0.0, 0.0, float(width), float(height)), ((size - new_w) // 2, (size - new_h) // 2, new_w, new_h)


def scale_jitter(rng: CropRandom, width: int, height: int, size: int, scales: tuple[float, float]) -> Placement:
    """The letterboxed image scaled by a random factor in `scales`: a random window of it, or all of it padded."""
    scale = rng.uniform(*scales) * size / max(width, height)
    left, span, out_w = _window(rng, width, scale, size)
    top, rise, out_h = _window(rng, height, scale, size)
    return (left, top, span, rise), (0, 0, out_w, out_h)


def _window(rng: CropRandom, length: int, scale: float, size: int) -> tuple[float, float, int]:
    """Along one side: (start, length) read of the image and the output pixels they fill."""
    scaled = length * scale
    if scaled <= size:
        return 0.0, float(length), max(1, min(size, round(scaled)))
    offset = rng.uniform(0.0, scaled - size)
    return offset / scale, size / scale, size


def iou_crop(rng: CropRandom, width: int, height: int, size: int, boxes: np.ndarray | None) -> Placement:
    """SSD's random IoU crop around `boxes`; the whole image without boxes or when no trial fits."""
    whole: Placement = ((0.0, 0.0, float(width), float(height)), (0, 0, size, size))
    if boxes is None or len(boxes) == 0:
        return whole
    centres_x, centres_y = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    for _ in range(IOU_ROUNDS):
        least = IOU_OPTIONS[rng.randint(0, len(IOU_OPTIONS) - 1)]
        if least >= 1.0:
            return whole
        for _ in range(IOU_TRIALS):
            new_w = int(width * rng.uniform(0.3, 1.0))
            new_h = int(height * rng.uniform(0.3, 1.0))
            if new_h == 0 or not 0.5 <= new_w / new_h <= 2.0:
                continue
            left = int((width - new_w) * rng.random())
            top = int((height - new_h) * rng.random())
            right, bottom = left + new_w, top + new_h
            if left == right or top == bottom:
                continue
            inside = (left < centres_x) & (centres_x < right) & (top < centres_y) & (centres_y < bottom)
            if not inside.any():
                continue
            if _best_iou(boxes[inside], (left, top, right, bottom)) < least:
                continue
            return (float(left), float(top), float(new_w), float(new_h)), (0, 0, size, size)
    return whole


def _best_iou(boxes: np.ndarray, crop: tuple[int, int, int, int]) -> float:
    left, top, right, bottom = crop
    inter_w = np.clip(np.minimum(boxes[:, 2], right) - np.maximum(boxes[:, 0], left), 0, None)
    inter_h = np.clip(np.minimum(boxes[:, 3], bottom) - np.maximum(boxes[:, 1], top), 0, None)
    inter = inter_w * inter_h
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    union = areas + (right - left) * (bottom - top) - inter
    ious = np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)
    return float(ious.max()) if len(ious) else -math.inf
