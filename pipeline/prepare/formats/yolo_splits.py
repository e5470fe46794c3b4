"""YOLO datasets as ultralytics reads them: data.yaml's splits, split folders, image lists.

A YOLO dataset is usually several datasets: `train`, `val` (and `test`),
which must never be merged. They are given either by a data.yaml:

    path: ../datasets/coco8     # the dataset's folder (relative to the yaml's), default the yaml's folder
    train: images/train         # a folder of images, a .txt list of images, or a list of either
    val: [images/val, extra/val]
    nc: 80                      # the class count (checked against names)
    names: {0: person, ...}

or by the folder layout `images/<split>/` beside `labels/<split>/`. Each
image's label file is found by ultralytics' rule: the last `/images/` of
its path becomes `/labels/`, the extension `.txt`. A list file holds one
image path a line, relative to the list's own folder (`./images/x.jpg`) or
absolute.

`yolo_layout` reads either form into a `YoloLayout`; `list_yolo_split`
yields one split's images with the boxes of their label files (the
listing, sources.py, picks the split: `PrepareSpec.split`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import ConfigError, SourceError
from .common import ListingInfo, SourceItem, is_image_name, present, read_small
from .detection import YOLO_YAML_NAMES, dataset_homes, read_data_yaml, yolo_item, yolo_names_of

SPLITS = ("train", "val", "valid", "test")
"""The split names a folder layout is read for (data.yaml may name any)."""
YAML_EXTENSIONS = (".yaml", ".yml")
LIST_MAX_BYTES = 256 << 20  # an image list read whole: some 4 million paths


@dataclasses.dataclass(frozen=True)
class YoloLayout:
    """A YOLO dataset's splits.

    Attributes:
        root: the dataset's folder (data.yaml's `path`, or the folder given).
        splits: split name -> the folders and list files its images come from (absolute paths).
        names: the class names (data.yaml's `names` / `nc`, else classes.txt), None without any.
    """

    root: str
    splits: dict[str, list[str]]
    names: list[str] | None

    def choose(self, split: str | None, source: str) -> str:
        """The split a job prepares: `split`, or the only one there is.

        Raises:
            ConfigError: `split` is not one of them, or None where there are several.
        """
        if split is not None:
            if split not in self.splits:
                raise ConfigError(f"{source} has no split {split!r}; its splits: {', '.join(self.splits)}")
            return split
        if len(self.splits) == 1:
            return next(iter(self.splits))
        raise ConfigError(
            f"{source} holds the splits {', '.join(self.splits)}, which are separate datasets: prepare each apart "
            f"(`gpufeed prepare SRC OUT` writes OUT/<split> for each; `--split NAME`, or split= in the spec, one)"
        )


def splits_of(source: str) -> list[str]:
    """The splits of a local YOLO source that has more than one (each a dataset of its own), else []."""
    from ...io.fs import local_path

    local = local_path(source)
    if local is None or not (os.path.isdir(local) or is_yaml(local)):
        return []
    layout = yolo_layout(local)
    return list(layout.splits) if layout is not None and len(layout.splits) > 1 else []


def is_yaml(path: str) -> bool:
    return path.lower().endswith(YAML_EXTENSIONS)


def yolo_layout(source: str) -> YoloLayout | None:
    """The splits of a YOLO source: a data.yaml, or a folder with data.yaml split keys or `images/<split>/` folders.

    Returns:
        The layout, or None where `source` is not a YOLO dataset with splits
        (a folder without split folders or split keys: one dataset, listed as before).

    Raises:
        ConfigError: a data.yaml that is not YAML, has no split, or names a split that does not exist.
    """
    if is_yaml(source):
        return _from_yaml(source)
    if not os.path.isdir(source):
        return None
    for name in YOLO_YAML_NAMES:
        path = os.path.join(source, name)
        if present(path):
            document = read_data_yaml(path)
            if _split_keys(document):
                return _from_yaml(path, document)
    images, labels = os.path.join(source, "images"), os.path.join(source, "labels")
    if not (os.path.isdir(images) and os.path.isdir(labels)):
        return None
    found = [name for name in SPLITS if os.path.isdir(os.path.join(images, name))]
    if not found:
        return None
    names = yolo_names_of(source)
    return YoloLayout(source, {name: [os.path.join(images, name)] for name in found}, names)


def _from_yaml(path: str, document: dict[str, Any] | None = None) -> YoloLayout:
    document = read_data_yaml(path) if document is None else document
    here = os.path.dirname(os.path.abspath(path))
    given = document.get("path")
    root = here if not isinstance(given, str) or not given.strip() else os.path.normpath(os.path.join(here, given))
    splits: dict[str, list[str]] = {}
    for name, value in _split_keys(document).items():
        entries = value if isinstance(value, list) else [value]
        if not entries or not all(isinstance(entry, str) and entry.strip() for entry in entries):
            raise ConfigError(f"{path}: '{name}' must be a folder or list file of images, or a list of them")
        places = [os.path.normpath(os.path.join(root, entry.strip())) for entry in entries]
        for place in places:
            if not os.path.exists(place):
                raise SourceError(f"{path}: '{name}' names {place}, which does not exist")
        splits[name] = places
    if not splits:
        raise ConfigError(f"{path} names no split: a data.yaml needs 'train', 'val' or 'test' (a folder or list of images)")
    return YoloLayout(root, splits, yolo_names_of(root, path, document))


def _split_keys(document: dict[str, Any]) -> dict[str, Any]:
    """data.yaml's split entries: train, val, test (ultralytics' keys), in that order, where given."""
    return {name: document[name] for name in ("train", "val", "test") if document.get(name) not in (None, "")}


def _list_file_images(path: str) -> Iterator[str]:
    data = read_small(path, LIST_MAX_BYTES)
    if isinstance(data, str):
        raise SourceError(data)
    parent = os.path.dirname(os.path.abspath(path))
    for line in data.decode("utf-8", "replace").splitlines():
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        yield os.path.normpath(entry if os.path.isabs(entry) else os.path.join(parent, entry))


def label_path(image: str) -> str:
    """ultralytics' images -> labels rule: the last `/images/` of the path becomes `/labels/`, the extension `.txt`."""
    head, marker, tail = image.rpartition(f"{os.sep}images{os.sep}")
    swapped = f"{head}{os.sep}labels{os.sep}{tail}" if marker else image
    return os.path.splitext(swapped)[0] + ".txt"


def is_split_folder(folder: str) -> str | None:
    """The YOLO dataset root of a split folder given as SRC (`ROOT/images/train` beside `ROOT/labels/train`), else None."""
    parent, name = os.path.split(os.path.normpath(folder))
    root, images = os.path.split(parent)
    if images != "images" or not os.path.isdir(os.path.join(root, "labels", name)):
        return None
    return root


def list_yolo_split(
    layout: YoloLayout, split: str, info: ListingInfo, walk: Callable[[str], Iterator[SourceItem]]
) -> Iterator[SourceItem]:
    """Yield one split's images, each with the boxes of its label file (ultralytics' images -> labels rule).

    Args:
        layout: the dataset (`yolo_layout`).
        split: which of its splits.
        info: filled in: kind "yolo", task "detection", the names.
        walk: `walk(folder)`: the image items under a folder (absolute `url`), in the listing's order.
    """
    info.kind, info.task = "yolo", "detection"
    info.classes = list(layout.names or [])
    places = layout.splits[split]
    base = os.path.commonpath([layout.root, *(p if os.path.isdir(p) else os.path.dirname(p) for p in places)])
    homes = dataset_homes(layout.root)
    for place in places:  # a folder the yaml names, or a list file's folder, is the dataset's too
        folder = place if os.path.isdir(place) else os.path.dirname(place)
        homes += (os.path.realpath(folder), os.path.realpath(os.path.dirname(label_path(os.path.join(folder, "x")))))
    for place in places:
        if os.path.isdir(place):
            for item in walk(place):
                yield _paired(item, base, layout.names, homes)
            continue
        for image in _list_file_images(place):
            if not is_image_name(image):
                info.ignored += 1
                continue
            explicit = (os.path.realpath(os.path.dirname(image)), os.path.realpath(os.path.dirname(label_path(image))))
            yield _paired(SourceItem(image, "", None), base, layout.names, homes + explicit)


def _paired(item: SourceItem, base: str, names: list[str] | None, homes: tuple[str, ...]) -> SourceItem:
    image = item.url
    rel = os.path.relpath(image, base).replace(os.sep, "/")
    if rel.startswith("../"):  # a list file's entry outside the dataset's folder: named from its own
        rel = image.lstrip("/").replace(os.sep, "/")
    labels = label_path(image)
    label_rel = os.path.relpath(labels, base).replace(os.sep, "/")
    return yolo_item(SourceItem(image, rel, None, item.rejected), labels, label_rel, names, tuple(dict.fromkeys(homes)))
