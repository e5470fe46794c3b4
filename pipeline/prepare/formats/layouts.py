"""Which layout a source folder has, and the segmentation folders.

A local folder is read as the first of these its top level matches, else as
an ImageFolder (class sub-folders) or a flat folder, as always:

- `Annotations/` and `JPEGImages/`: Pascal VOC detection (voc.py);
- `JPEGImages/` and `SegmentationClass/`: VOC segmentation;
- `images/` and `labels/` holding .txt files (or a data.yaml): YOLO;
- `images/` and `masks/` (or `annotations/` or `labels/` holding mask
  images): segmentation;
- only .tar files (and files that are not images: img2dataset's .parquet and
  _stats.json are ignored): WebDataset shards (tar.py).

A folder with `annotations/*.json` beside `images/` is COCO: it is refused
with the JSON to give as SRC instead (which of several files is meant is the
user's choice).

Segmentation: each image is paired with the mask of the same path and stem
under the mask folder (`images/a/b.jpg` with `masks/a/b.png`); targets
{"mask": its path}, task "segmentation", `ignore_index` 255 (VOC's border
value). An image without a mask is listed rejected ("no mask"), except in
VOC's layout, where only some images are segmented: there the masks are
listed and the other images ignored (counted). A mask that leads outside
the dataset folder (a symlink out) rejects its image. Class names come from
`classes.txt` (one a line, index = line) where there is one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from ...errors import ConfigError, SourceError
from ...targets import DEFAULT_IGNORE_INDEX
from .common import ListingInfo, SourceItem, inside, is_image_name, present, read_small
from .detection import YOLO_YAML_NAMES, list_yolo
from .tar import list_shards
from .voc import list_voc

Walk = Callable[[str, ListingInfo], Iterator[SourceItem]]
"""`walk(rel_folder, info)`: the image items under a folder of the source, in the listing's order."""

MASK_EXTENSIONS = (".png", ".bmp", ".tif", ".tiff", ".pgm")  # lossless: a mask is class indices
MASK_FOLDERS = ("masks", "annotations", "labels")
_PEEK = 256  # entries looked at to tell a folder of label .txt files from one of mask images


def detect_folder(root: str, info: ListingInfo, walk: Walk) -> Iterator[SourceItem] | None:
    """The listing of `root` where its layout is one of the formats above; None for an image folder.

    Raises:
        SourceError: the folder cannot be listed.
        ConfigError: a layout that is almost one of them (COCO annotations without the JSON as SRC).
    """
    try:
        entries = [entry for entry in os.scandir(root) if not entry.name.startswith(".")]
    except OSError as exc:
        raise SourceError(f"cannot list {root}: {exc.strerror or exc}") from exc
    dirs = {entry.name for entry in entries if entry.is_dir()}
    files = sorted(entry.name for entry in entries if not entry.is_dir())
    if {"Annotations", "JPEGImages"} <= dirs:
        return list_voc(root, info)
    if {"JPEGImages", "SegmentationClass"} <= dirs:
        return list_voc_segmentation(root, info)
    if "images" in dirs:
        if "labels" in dirs and (any(name in files for name in YOLO_YAML_NAMES) or _holds(root, "labels", (".txt",))):
            return list_yolo(root, info, walk)
        for folder in MASK_FOLDERS:
            if folder in dirs and _holds(root, folder, MASK_EXTENSIONS):
                return list_segmentation(root, "images", folder, info, walk)
        if "annotations" in dirs and _holds(root, "annotations", (".json",)):
            jsons = sorted(name for name in os.listdir(os.path.join(root, "annotations")) if name.endswith(".json"))
            raise ConfigError(
                f"{root} looks like a COCO dataset: give its annotation file as SRC, e.g. "
                f"{os.path.join(root, 'annotations', jsons[0])}"
            )
    if not dirs and files and any(name.lower().endswith(".tar") for name in files) and not any(is_image_name(n) for n in files):
        info.ignored += sum(1 for name in files if not name.lower().endswith(".tar"))
        return list_shards([os.path.join(root, name) for name in files if name.lower().endswith(".tar")], info)
    return None


def _holds(root: str, folder: str, extensions: tuple[str, ...]) -> bool:
    """Whether one of the first files found under root/folder (a few levels down) has one of `extensions`."""
    stack, looked = [os.path.join(root, folder)], 0
    while stack and looked < _PEEK:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in sorted(entries, key=lambda e: e.name):
                    looked += 1
                    if entry.name.startswith("."):
                        continue
                    if entry.is_dir():
                        stack.append(entry.path)
                    elif os.path.splitext(entry.name)[1].lower() in extensions:
                        return True
                    if looked >= _PEEK:
                        break
        except OSError:
            continue
    return False


def segmentation_classes(root: str) -> list[str]:
    """The class names of a segmentation folder: classes.txt, one a line (index = line), else []."""
    path = os.path.join(root, "classes.txt")
    if not present(path):
        return []
    data = read_small(path)
    if isinstance(data, str):
        raise ConfigError(data)
    return [line.strip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()]


def list_segmentation(root: str, image_dir: str, mask_dir: str, info: ListingInfo, walk: Walk) -> Iterator[SourceItem]:
    """Yield each image under `root/image_dir` with the mask of the same stem under `root/mask_dir`."""
    _segmentation_info(root, info)
    root_real = os.path.realpath(root)
    for item in walk(image_dir, info):
        if item.rejected:
            yield item
            continue
        stem = os.path.splitext(item.rel[len(image_dir) + 1 :])[0]
        mask = next((f"{stem}{ext}" for ext in MASK_EXTENSIONS if os.path.lexists(os.path.join(root, mask_dir, f"{stem}{ext}"))), None)
        if mask is None:
            yield SourceItem(item.url, item.rel, None, f"no mask: expected {mask_dir}/{stem}.png")
            continue
        yield _with_mask(item, os.path.join(root, mask_dir, mask), root_real)


def list_voc_segmentation(root: str, info: ListingInfo) -> Iterator[SourceItem]:
    """Yield each mask of `SegmentationClass/` with its image in `JPEGImages/`; unsegmented images are ignored."""
    _segmentation_info(root, info)
    root_real = os.path.realpath(root)
    images = _by_stem(os.path.join(root, "JPEGImages"), is_image_name)
    masks = _by_stem(os.path.join(root, "SegmentationClass"), lambda n: os.path.splitext(n)[1].lower() in MASK_EXTENSIONS)
    for stem, mask in masks.items():
        image = images.get(stem)
        if image is None:
            yield SourceItem(os.path.join(root, "JPEGImages", f"{stem}.jpg"), f"JPEGImages/{stem}.jpg", None,
                             f"SegmentationClass/{mask} has no image in JPEGImages/")
            continue
        item = SourceItem(os.path.join(root, "JPEGImages", image), f"JPEGImages/{image}", None)
        yield _with_mask(item, os.path.join(root, "SegmentationClass", mask), root_real)
    info.ignored += sum(1 for stem in images if stem not in masks)


def _segmentation_info(root: str, info: ListingInfo) -> None:
    info.kind, info.task = "segmentation", "segmentation"
    info.ignore_index = DEFAULT_IGNORE_INDEX
    info.classes = segmentation_classes(root)


def _by_stem(folder: str, keep: Callable[[str], bool]) -> dict[str, str]:
    try:
        names = sorted(name for name in os.listdir(folder) if not name.startswith(".") and keep(name))
    except OSError as exc:
        raise SourceError(f"cannot list {folder}: {exc.strerror or exc}") from exc
    stems: dict[str, str] = {}
    for name in names:
        stems.setdefault(os.path.splitext(name)[0], name)
    return stems


def _with_mask(item: SourceItem, mask_path: str, root_real: str) -> SourceItem:
    if not inside(root_real, mask_path):
        return SourceItem(item.url, item.rel, None, f"its mask {os.path.basename(mask_path)} leads outside the dataset folder")
    return SourceItem(item.url, item.rel, None, targets={"mask": mask_path})
