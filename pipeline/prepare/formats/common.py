"""What a listing gives: one `SourceItem` per input, and the `ListingInfo` it fills in.

Kept apart from the readers (sources.py, formats*.py) so every one of them
builds the same items.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import reprlib
from typing import Any

from ...io.fs import open_regular_stat

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


def printable(name: str) -> str:
    """A class folder name as valid Unicode: bytes that are not UTF-8 become U+FFFD.

    Paths keep such bytes (surrogate-escaped, so the file can still be opened
    and SourceItem.to_json escapes them); a label is a name shown to people
    and written to the manifest as UTF-8, so it must be printable.
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return name


# -- helpers every format reader shares -----------------------------------------

ANNOTATION_MAX_BYTES = 16 << 20  # one sample's annotation file (YOLO .txt, VOC .xml): far above any real one
MAX_JSON_DEPTH = 32
"""How deep a value a source carries into a sample may nest (a column, a shape): far past any real one,
and shallow enough for every later step (the listing's JSON, the pool's pickles, the sample's json)."""
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 3, 40, 40, 40
_BRIEF.maxlist = _BRIEF.maxdict = _BRIEF.maxtuple = _BRIEF.maxset = 6


def safe_relative(name: str) -> bool:
    """Whether `name` is a relative path that stays inside its folder: not absolute, no `..`, no NUL, no drive, no scheme."""
    if not name or "\0" in name or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":") or has_scheme(name):
        return False
    return ".." not in name.replace("\\", "/").split("/")


def has_scheme(name: str) -> bool:
    """Whether a name is a URL rather than a path: it starts with a scheme (`http:`, `s3:`, `data:`) or holds `://`."""
    return "://" in name or _SCHEME.match(name) is not None


def inside(root_real: str, path: str) -> bool:
    """Whether `path`, its symlinks resolved, lies under `root_real` (an already resolved folder)."""
    real = os.path.realpath(path)
    return real == root_real or real.startswith(root_real.rstrip("/") + "/")


def read_small(path: str, bound: int = ANNOTATION_MAX_BYTES) -> bytes | str:
    """A local file's bytes, or why not (the reason a rejected item records): missing, unreadable, over `bound`,
    not a regular file (a FIFO, a device: never opened to be read)."""
    try:
        data = read_regular(path, bound)
    except OSError as exc:
        return f"cannot read {os.path.basename(path)}: {exc.strerror or exc}"
    if len(data) > bound:
        return f"{os.path.basename(path)} is over {bound} bytes, the bound on one annotation file"
    return data


def present(path: str) -> bool:
    """Whether a file of any kind but a folder is at `path` (a FIFO too: refused when read, not passed over)."""
    return os.path.lexists(path) and not os.path.isdir(path)


def read_regular(path: str, bound: int) -> bytes:
    """A local regular file's bytes, at most `bound` + 1 of them (more than `bound`: the file is over it).

    Read by the size the file states, not `bound`: a read of n bytes takes n bytes of memory at once.

    Raises:
        OSError: the file cannot be read, or is not a regular file (`open_regular_stat`).
    """
    handle, status = open_regular_stat(path)
    with handle:
        size = min(status.st_size, bound)
        data: bytes = handle.read(size + 1)
        if len(data) > size and size < bound:  # it grew since: the rest, up to the bound
            data += handle.read(bound - size)
    return data


def finite_number(value: Any) -> bool:
    """A JSON number (not a bool) that is finite as a float (an integer of 400 digits is not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the float range
        return False


def whole_number(text: str, digits: int = 9) -> int | None:
    """`text` as an int where it is a non-negative whole number of at most `digits` ASCII digits, else None.

    Not `str.isdigit` + `int`: `"²"` is a digit to the one and not to the other, and a number of
    thousands of digits is past Python's int-string limit.
    """
    if not text or len(text) > digits or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def brief(value: Any) -> str:
    """A value as a message shows it: a short repr, whatever its size or depth (nested parts elided)."""
    try:
        return _BRIEF.repr(value)
    except (ValueError, RecursionError):  # an int past Python's digit limit; nothing else reprlib cannot bound
        return f"<a {type(value).__name__}>"
