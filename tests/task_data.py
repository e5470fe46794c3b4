"""Shards of every task written directly (no prepare): pictures whose colours say where their targets are.

Each box is a filled rectangle of its class's colour on black, and each
mask pixel is the class whose colour its picture pixel has, so a test can
check after any crop and flip that the targets a loader delivers still sit
on the pixels they describe.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from pipeline.io.output import Output
from pipeline.io.tar import TarShardWriter
from pipeline.manifest import Manifest, write_manifest
from pipeline.targets import SampleTargets, target_members

PALETTE = np.array([(230, 30, 30), (30, 220, 40), (40, 60, 235), (235, 225, 40), (220, 40, 220)], np.uint8)
CLASSES = ["red", "green", "blue", "yellow", "magenta"]


def encoded(pixels: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def box_picture(rng: np.random.Generator, width: int, height: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A black picture with `count` non-overlapping rectangles: pixels, boxes (XYXY), their classes, the class mask."""
    pixels = np.zeros((height, width, 3), np.uint8)
    mask = np.full((height, width), 255, np.uint8)
    boxes, labels = [], []
    for _ in range(count * 20):
        if len(boxes) == count:
            break
        w, h = int(rng.integers(12, width // 2)), int(rng.integers(12, height // 2))
        x0, y0 = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
        if (mask[max(0, y0 - 3) : y0 + h + 3, max(0, x0 - 3) : x0 + w + 3] != 255).any():
            continue
        label = int(rng.integers(len(PALETTE)))
        pixels[y0 : y0 + h, x0 : x0 + w] = PALETTE[label]
        mask[y0 : y0 + h, x0 : x0 + w] = label
        boxes.append((x0, y0, x0 + w, y0 + h))
        labels.append(label)
    return pixels, np.array(boxes, np.float32).reshape(-1, 4), np.array(labels, np.int64), mask


def boxes_on_their_colours(batch, crop: int) -> tuple[int, int]:
    """(boxes checked, boxes whose pixels are not their class's colour) in a detection batch of `crop`-pixel images.

    A box counts as checked when its inside, 1.5 pixels in from its edges, is
    at least 2 pixels wide and high; a box past the image is wrong.
    """
    checked = wrong = 0
    for image, boxes, labels in zip(batch.images, batch.boxes, batch.box_labels):
        for box, label in zip(boxes.tolist(), labels.tolist()):
            x0, y0, x1, y1 = box
            if min(box) < 0 or max(box) > crop:
                wrong += 1
                continue
            inner = (int(np.ceil(x0 + 1.5)), int(np.ceil(y0 + 1.5)), int(np.floor(x1 - 1.5)), int(np.floor(y1 - 1.5)))
            if inner[2] - inner[0] < 2 or inner[3] - inner[1] < 2:
                continue
            mean = image[:, inner[1] : inner[3], inner[0] : inner[2]].float().mean(dim=(1, 2)).numpy()
            checked += 1
            wrong += int(np.abs(mean - PALETTE[label]).max() >= 40)
    return checked, wrong


def write_task_dataset(
    root: Path,
    task: str,
    count: int = 24,
    *,
    shard_samples: int = 8,
    fmt: str = "PNG",
    seed: int = 0,
    size: tuple[int, int] = (96, 72),
) -> Path:
    """A dataset of `count` samples for `task` under `root` (shards + manifest.json); returns `root`.

    detection: boxes + box labels (+ crowd flags); segmentation: a mask;
    multilabel: the classes of its rectangles; captions: a text naming
    them. Every sample has a `json` with its index and a `cls` (its first
    rectangle's class).
    """
    rng = np.random.default_rng(seed)
    output = Output(str(root))
    infos = []
    members_of: list[dict[str, bytes]] = []
    for index in range(count):
        width = int(rng.integers(size[0] - 16, size[0] + 16))
        height = int(rng.integers(size[1] - 12, size[1] + 12))
        pixels, boxes, labels, mask = box_picture(rng, width, height, int(rng.integers(1, 4)))
        targets = SampleTargets()
        if task == "detection":
            targets.boxes, targets.box_labels = boxes, labels
            targets.iscrowd = np.zeros(len(boxes), np.uint8)
        elif task == "segmentation":
            targets.mask = mask
        elif task == "multilabel":
            targets.labels = [int(v) for v in labels]
        elif task == "captions":
            targets.caption = "a picture of " + " and ".join(CLASSES[int(v)] for v in labels)
        members = {
            ("jpg" if fmt == "JPEG" else "png"): encoded(pixels, fmt),
            "json": json.dumps({"index": index, "size": [width, height]}).encode(),
            "cls": str(int(labels[0])).encode(),
            **target_members(targets),
        }
        members_of.append(members)
    fields = sorted({name for members in members_of for name in members} - {"jpg", "png", "json"})
    for start in range(0, count, shard_samples):
        path = f"shard-{start // shard_samples:06d}.tar"
        with TarShardWriter(str(root / path)) as writer:
            for index in range(start, min(count, start + shard_samples)):
                writer.write_sample(f"sample{index:05d}", members_of[index])
            infos.append(writer.commit(path))
    manifest = Manifest(
        samples=count, classes=list(CLASSES), shards=infos, params={}, source="generated", rejected=0,
        task=task, fields=fields, ignore_index=255 if task == "segmentation" else None,
    )  # fmt: skip
    write_manifest(output, manifest)
    return root
