"""What a listing gives: one `SourceItem` per input, and the `ListingInfo` it fills in.

Kept apart from the readers (sources.py, formats*.py) so every one of them
builds the same items.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

IMAGE_EXTENSIONS = frozenset(
    ".jpg .jpeg .jpe .jfif .png .gif .bmp .dib .tif .tiff .webp .ppm .pgm .pbm .pnm "
    ".jp2 .j2k .jpx .tga .ico .avif .heic".split()
)


@dataclasses.dataclass(frozen=True)
class SourceItem:
    """One listed input: where to read it, its path relative to the source, its label name.

    `rejected`, when set, is why the listing already rejects it (the file is
    not read): the reason rejected.jsonl records.

    `targets`, for a source with more than a class per image, is what the
    listing found of the sample besides its image, JSON-able and in the
    pixels of the file as stored (before EXIF transposition), any of:

    - "labels": a multi-label sample's class names;
    - "boxes": [x0, y0, x1, y1] per box, in pixels; with "normalized": true
      fractions of the image's width and height (YOLO: the listing does not
      know the image's size);
    - "box_labels": the class name of each box;
    - "iscrowd": COCO's crowd flag of each box;
    - "segmentation": COCO's polygons or RLE of each box, as the JSON has
      them (a list of polygons, or an RLE {"size", "counts"}), for a later
      step to rasterise;
    - "mask": the URL or path of the sample's class-index mask image;
    - "caption": its caption or text;
    - "columns": the source's other columns (JSON values), e.g. a VOC
      box's "difficult" flags, a COCO image's "image_id";
    - "tar": {"offset": o, "size": n}, where the image's bytes sit in the
      WebDataset shard `url` names (a sample of a shard given as SRC).

    `targets` is None for an image with nothing but a class (ImageFolder, a
    path + label list): the classification listing is what it always was.
    """

    url: str
    rel: str
    label: str | None
    rejected: str = ""
    targets: dict[str, Any] | None = None

    def to_json(self) -> str:
        # ASCII escapes keep names that are not valid UTF-8 (surrogate-escaped) intact.
        fields: list[Any] = [self.url, self.rel, self.label]
        if self.rejected or self.targets is not None:
            fields.append(self.rejected)
        if self.targets is not None:
            fields.append(self.targets)
        return json.dumps(fields)

    @classmethod
    def from_json(cls, line: str | bytes) -> SourceItem:
        return cls(*json.loads(line))


@dataclasses.dataclass
class ListingInfo:
    """Counts kept while listing: classes seen and entries passed over.

    `ignored` counts files without an image extension, special files (FIFOs,
    sockets, devices) and symlinks that lead back into a folder being
    listed. Hidden entries (``.name``) are skipped without counting. Images
    beside class folders are not ignored: they are listed, rejected.

    `task` is one of `pipeline.targets.TASKS`, from what the source holds;
    `classes` is the class list where the format fixes one (an image
    folder's class folders, COCO's categories, YOLO's names, a segmentation
    folder's classes.txt); `ignore_index` is the mask value of no class
    (segmentation).
    """

    kind: str = ""  # imagefolder, flat, list, coco, yolo, voc, segmentation, webdataset
    classes: list[str] = dataclasses.field(default_factory=list)
    ignored: int = 0
    task: str = "classification"
    ignore_index: int | None = None


def is_image_name(name: str) -> bool:
    """Whether a file name has one of the image extensions (`IMAGE_EXTENSIONS`), in any case."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


# -- helpers every format reader shares -----------------------------------------

ANNOTATION_MAX_BYTES = 16 << 20  # one sample's annotation file (YOLO .txt, VOC .xml): far above any real one


def safe_relative(name: str) -> bool:
    """Whether `name` is a relative path that stays inside its folder: not absolute, no `..`, no NUL, no drive."""
    if not name or "\0" in name or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return False
    return ".." not in name.replace("\\", "/").split("/")


def inside(root_real: str, path: str) -> bool:
    """Whether `path`, its symlinks resolved, lies under `root_real` (an already resolved folder)."""
    real = os.path.realpath(path)
    return real == root_real or real.startswith(root_real.rstrip("/") + "/")


def read_small(path: str, bound: int = ANNOTATION_MAX_BYTES) -> bytes | str:
    """A local file's bytes, or why not (the reason a rejected item records): missing, unreadable, over `bound`."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(bound + 1)
    except OSError as exc:
        return f"cannot read {os.path.basename(path)}: {exc.strerror or exc}"
    if len(data) > bound:
        return f"{os.path.basename(path)} is over {bound} bytes, the bound on one annotation file"
    return data


def finite_number(value: Any) -> bool:
    """A JSON number (not a bool) that is finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
