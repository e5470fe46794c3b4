"""Detection sources: a COCO instances JSON, a YOLO folder (Pascal VOC: voc.py).

Each yields one `SourceItem` per image with targets {"boxes", "box_labels",
...} (see `SourceItem`), boxes in pixels of the image as stored, XYXY:

- COCO: `bbox` [x, y, w, h] becomes [x, y, x + w, y + h]; the category ids,
  sorted, become class indices 0..K-1 (`ListingInfo.classes` keeps their
  names, a box's label is its category's name); `iscrowd` and the raw
  `segmentation` (polygons or RLE) of each box are kept: where any
  annotation of the file has one, every image carries its list (prepare
  paints them into the image's `mask.png`, `sample/coco_masks.py`; past 254
  categories the mask's ignore index is 65535). An image without
  annotations is listed with no boxes. A bad annotation (a bbox that is not
  four finite numbers, a negative width or height, a box outside the image,
  an unknown category) rejects its image with the reason: the image's other
  boxes would be a lie about what it shows; so does a number past the float
  range (an integer of 400 digits), a shape nested over `MAX_JSON_DEPTH`
  levels, and a `file_name` that is a URL (`http:`, `s3:`, `data:`) or leads
  out of the image folder (`..`, an absolute path). An annotation of an image
  id the JSON does not list is dropped and counted in `ListingInfo.ignored`.
  The JSON is read whole, so its size is bounded (`coco_max_bytes`), and a
  file that does not fit in memory is a `ConfigError` naming it.
- YOLO: `labels/<split>/<stem>.txt` beside `images/<split>/<stem>.jpg`, one
  `class cx cy w h` line per box, normalised: boxes are listed normalised
  XYXY ("normalized": true), the image's size being unknown here. A polygon
  line (YOLO segmentation: `class x1 y1 x2 y2 ...`) gives its bounds, and
  its polygon (normalised, upright) is kept as the box's `segmentation`, painted
  into the sample's mask as COCO's shapes are. The
  names come from data.yaml (`names:` a list or {id: name}) or classes.txt;
  without either, a box's label is its class id as text. An image without a
  label file has no boxes; a malformed line (a class that is not an ASCII
  whole number below `MAX_CLASSES`, a coordinate outside 0..1) rejects the
  image (line number).

Every file is opened only where it is a regular file (`read_regular`): a
FIFO, socket or device label file rejects its image, a data.yaml or
classes.txt that is one is a `SourceError` naming it.

Pascal VOC's XML is read in voc.py.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import ConfigError, SourceError
from ...io.fs import byte_bound, local_path, open_fs, store_errors
from ...manifest import nested_deeper
from ...targets import DEFAULT_IGNORE_INDEX, MAX_BOXES
from .common import (
    MAX_JSON_DEPTH,
    ListingInfo,
    SourceItem,
    brief,
    finite_number,
    has_scheme,
    inside,
    present,
    read_regular,
    read_small,
    safe_relative,
    whole_number,
)

COCO_MAX_BYTES = 512 << 20
"""The default bound on a COCO JSON read whole: COCO's own train2017 instances file is 448 MB; parsed, a
file takes several times its size in memory, so a larger one (LVIS's 1.1 GB) needs the bound raised
($GPUFEED_MAX_JSON_BYTES) on a machine with the memory for it."""
COCO_MAX_ENV = "GPUFEED_MAX_JSON_BYTES"
BOX_SLACK = 1.0  # pixels a box may pass the image's edge by (rounding in the tools that wrote it)


# -- COCO ----------------------------------------------------------------------


def coco_max_bytes() -> int:
    """The bound on a COCO JSON: $GPUFEED_MAX_JSON_BYTES, else `COCO_MAX_BYTES`.

    Raises:
        ConfigError: the variable is set to something that is not a positive integer.
    """
    return byte_bound(COCO_MAX_ENV, COCO_MAX_BYTES, "JSON file")


def read_json_source(source: str) -> dict[str, Any] | None:
    """A `.json` SRC read whole: the COCO object, or None where it is a JSON-lines list (one object a line).

    Raises:
        SourceError: the file cannot be read, or is not a regular file (a FIFO, a device).
        ConfigError: it is over `coco_max_bytes()`, does not fit in memory,
            is not JSON (nested too deep, a number past Python's digit limit,
            not UTF-8), or JSON that is neither COCO (an object with "images",
            "annotations" and "categories") nor a list of rows.
    """
    bound = coco_max_bytes()
    data = _read_bounded(source, bound)
    try:
        value = json.loads(data)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # one object a line: a JSONL list named .json
            return None
        raise ConfigError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    except (RecursionError, UnicodeDecodeError, ValueError) as exc:  # ValueError: an integer of over 4300 digits
        raise ConfigError(f"{source} is not valid JSON ({type(exc).__name__}: {str(exc)[:80]})") from exc
    except MemoryError:
        del data
        raise _out_of_memory(source) from None
    if isinstance(value, dict) and "path" in value and "images" not in value:
        return None  # a one-row list
    if not isinstance(value, dict) or not all(isinstance(value.get(k), list) for k in ("images", "annotations", "categories")):
        raise ConfigError(
            f"{source} is a JSON file but not a COCO annotation file (an object with 'images', 'annotations' "
            "and 'categories' lists) nor a JSON-lines list of rows with 'path'"
        )
    return value


def _read_bounded(source: str, bound: int) -> bytes:
    local = local_path(source)
    data: bytes
    try:
        if local is not None:
            size = os.stat(local).st_size
            if size > bound:
                raise ConfigError(f"{source} is {size} bytes, over the bound of {bound} on a JSON file read whole (set {COCO_MAX_ENV})")
            data = read_regular(local, bound)
        else:
            fs, path = open_fs(source)
            with fs.open(path, "rb") as handle:
                data = handle.read(bound + 1)
    except OSError as exc:
        raise SourceError(f"cannot read {source}: {exc.strerror or exc}") from exc
    except MemoryError:
        raise _out_of_memory(source) from None
    except store_errors() as exc:
        raise SourceError(f"cannot read {source}: {exc}") from exc
    if len(data) > bound:
        raise ConfigError(f"{source} is over the bound of {bound} bytes (set {COCO_MAX_ENV})")
    return data


def _out_of_memory(source: str) -> ConfigError:
    return ConfigError(
        f"{source} does not fit in this process's memory to be read whole: give the job more memory, or split "
        f"the annotations into smaller files ({COCO_MAX_ENV} bounds the size of a JSON file read whole)"
    )


def list_coco(source: str, coco: dict[str, Any], info: ListingInfo) -> Iterator[SourceItem]:
    """Yield one item per image of a COCO object (`read_json_source`), in the JSON's order.

    Raises:
        ConfigError: the categories are not a list of {"id": int, "name": str}
            with distinct ids and names.
        SourceError: no folder beside the JSON holds its images.
    """
    info.kind, info.task = "coco", "detection"
    names = _coco_categories(source, coco["categories"])
    info.classes = [names[i] for i in sorted(names)]
    by_image: dict[Any, list[tuple[int, Any]]] = {}
    known = {image.get("id") for image in coco["images"] if isinstance(image, dict) and _hashable(image.get("id"))}
    for number, annotation in enumerate(coco["annotations"]):
        image_id = annotation.get("image_id") if isinstance(annotation, dict) else None
        if not _hashable(image_id) or image_id not in known:
            info.ignored += 1  # no image to give it to
            continue
        by_image.setdefault(image_id, []).append((number, annotation))
    base = _coco_image_folder(source, coco["images"])
    # Any shape in the file: then every image gets a mask (one without shapes is all background).
    shaped = any(annotation.get("segmentation") for group in by_image.values() for _, annotation in group)
    if shaped and len(names) >= DEFAULT_IGNORE_INDEX:
        info.ignore_index = 65535  # class c paints c + 1: 255 must stay free for the crowds
    seen: set[Any] = set()
    for number, image in enumerate(coco["images"]):
        yield _coco_item(base, number, image, by_image, names, seen, shaped)


def _hashable(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _coco_categories(source: str, categories: list[Any]) -> dict[int, str]:
    names: dict[int, str] = {}
    for category in categories:
        if not (isinstance(category, dict) and _hashable(category.get("id")) and isinstance(category.get("id"), int)
                and isinstance(category.get("name"), str) and category["name"]):
            raise ConfigError(f"{source}: every category needs an integer 'id' and a non-empty 'name', not {brief(category)}")
        if category["id"] in names:
            raise ConfigError(f"{source}: category id {category['id']} appears twice")
        names[category["id"]] = category["name"]
    if len(set(names.values())) != len(names):
        raise ConfigError(f"{source}: two categories share a name; class names must be distinct")
    return names


def _coco_image_folder(source: str, images: list[Any]) -> str:
    """The folder the images' file names are relative to: the first of COCO's usual places that holds the first one."""
    folder = source.split("?", 1)[0].rsplit("/", 1)[0] if "/" in source else "."
    candidates = [folder, f"{folder}/images"]
    stem = os.path.splitext(os.path.basename(source.split("?", 1)[0]))[0]
    if os.path.basename(folder) == "annotations" and "_" in stem:
        parent = folder.rsplit("/", 1)[0] if "/" in folder else "."
        split = stem.rsplit("_", 1)[1]  # instances_train2017 -> train2017, COCO's own layout
        candidates = [f"{parent}/{split}", f"{parent}/images/{split}", f"{parent}/images", *candidates]
    probe = next((image["file_name"] for image in images if isinstance(image, dict)
                  and isinstance(image.get("file_name"), str) and safe_relative(image["file_name"])), None)
    if probe is None:
        return candidates[0]
    for candidate in candidates:
        if _exists(f"{candidate}/{probe}"):
            return candidate
    raise SourceError(f"cannot find the images of {source}: {probe} is in none of {', '.join(candidates)}")


def _exists(url: str) -> bool:
    local = local_path(url)
    if local is not None:
        return os.path.exists(local)
    fs, path = open_fs(url)
    try:
        return bool(fs.exists(path))
    except store_errors():
        return False


def _coco_item(
    base: str,
    number: int,
    image: Any,
    by_image: dict[Any, list[tuple[int, Any]]],
    names: dict[int, str],
    seen: set[Any],
    shaped: bool = False,
) -> SourceItem:
    name = image.get("file_name") if isinstance(image, dict) else None
    if isinstance(name, str) and has_scheme(name):
        return SourceItem(name, name, None, f"COCO image {number}: file_name {brief(name)} is a URL, not a path inside the dataset folder")
    if not isinstance(name, str) or not safe_relative(name):
        shown = name if isinstance(name, str) and name else f"images[{number}]"
        return SourceItem(shown, shown, None, f"COCO image {number}: file_name {brief(name)} is not a path inside the dataset folder")
    url = f"{base}/{name}"
    image_id = image.get("id")
    if not _hashable(image_id):
        return SourceItem(url, name, None, f"COCO image {name}: its id {brief(image_id)} is not an integer or a string")
    if image_id in seen:
        return SourceItem(url, name, None, f"COCO image id {image_id} appears twice in the JSON")
    seen.add(image_id)
    annotations = by_image.get(image_id, [])
    if len(annotations) > MAX_BOXES:
        return SourceItem(url, name, None, f"{len(annotations)} annotations, over the {MAX_BOXES} one image may have")
    size = (image.get("width"), image.get("height"))
    boxes, labels, crowd, shapes = [], [], [], []
    for at, annotation in annotations:
        box = _coco_box(annotation, names, size)
        if isinstance(box, str):
            return SourceItem(url, name, None, f"annotation {brief(annotation.get('id', at))}: {box}")
        boxes.append(box)
        labels.append(names[annotation["category_id"]])
        crowd.append(int(annotation.get("iscrowd", 0) or 0))
        shapes.append(annotation.get("segmentation"))
    targets: dict[str, Any] = {"boxes": boxes, "box_labels": labels, "iscrowd": crowd, "columns": {"image_id": image_id}}
    targets["frame"] = "declared"  # stored or upright pixels: the sample decides, knowing the file's orientation
    declared = declared_size(*size)
    if declared is not None:
        targets["declared_size"] = declared
    if shaped:
        targets["segmentation"] = shapes
    return SourceItem(url, name, None, targets=targets)


def declared_size(width: Any, height: Any) -> list[int] | None:
    """An annotation's declared image size as two positive whole numbers of pixels, or None (absent, or not that)."""
    values = []
    for value in (width, height):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite_number(value):
            return None
        if value != int(value) or not 0 < value < 1 << 31:
            return None
        values.append(int(value))
    return values


def _coco_box(annotation: dict[str, Any], names: dict[int, str], size: tuple[Any, Any]) -> list[float] | str:
    """One annotation's XYXY box, or why it is refused."""
    bbox = annotation.get("bbox")
    if not isinstance(bbox, list) or len(bbox) != 4 or not all(finite_number(v) for v in bbox):
        return f"bbox {brief(bbox)} is not four finite numbers [x, y, w, h]"
    x, y, w, h = (float(v) for v in bbox)
    if w < 0 or h < 0 or x < -BOX_SLACK or y < -BOX_SLACK:
        return f"bbox {brief(bbox)} has a negative width, height or corner"
    width, height = size
    if finite_number(width) and finite_number(height) and (x + w > width + BOX_SLACK or y + h > height + BOX_SLACK):
        return f"bbox {brief(bbox)} passes the edge of the {brief(width)}x{brief(height)} image"
    category = annotation.get("category_id")
    if not isinstance(category, int) or isinstance(category, bool) or category not in names:
        return f"category_id {brief(category)} is not one of the categories"
    if annotation.get("iscrowd", 0) not in (0, 1, None, False, True):
        return f"iscrowd {brief(annotation.get('iscrowd'))} is not 0 or 1"
    shape = annotation.get("segmentation")
    if shape is not None and not isinstance(shape, (list, dict)):
        return "segmentation is neither polygons (a list) nor RLE (an object)"
    if nested_deeper(shape, MAX_JSON_DEPTH):
        return f"segmentation nests over {MAX_JSON_DEPTH} levels deep (polygons are a list of lists of numbers)"
    return [x, y, x + w, y + h]


# -- YOLO ----------------------------------------------------------------------

YOLO_YAML_NAMES = ("data.yaml", "dataset.yaml", "data.yml", "dataset.yml")
YAML_MAX_BYTES = 1 << 20
MAX_CLASSES = 65535  # a class index must leave a mask's ignore index free


def yolo_names(root: str) -> list[str] | None:
    """A YOLO folder's class names (see `yolo_names_of`)."""
    return yolo_names_of(root)


def yolo_names_of(root: str, yaml_path: str | None = None, document: dict[str, Any] | None = None) -> list[str] | None:
    """A YOLO dataset's class names: data.yaml's `names` (a list, or {id: name} with ids 0..K-1), else classes.txt.

    `yaml_path` is the data.yaml to read (a YOLO source given by its yaml;
    `document`, its mapping where the caller has read it already); without
    it, the data.yaml in `root`. data.yaml's `nc`, where given, is the class
    count: without `names` the classes are named by their ids 0..nc-1 (as
    ultralytics names them), so splits prepared apart agree on the count
    whatever ids their labels use.

    Returns:
        The names in id order, or None where the folder has neither file.

    Raises:
        ConfigError: a data.yaml that is not YAML, whose `names` is neither
            form, or whose `nc` is not a count or disagrees with `names`.
    """
    if yaml_path is None:
        yaml_path = next((p for p in (os.path.join(root, n) for n in YOLO_YAML_NAMES) if present(p)), None)
    if yaml_path is not None:
        return _yaml_names(yaml_path, read_data_yaml(yaml_path) if document is None else document)
    for path in (os.path.join(root, "classes.txt"), os.path.join(root, "labels", "classes.txt")):
        if present(path):
            return _lines_of(path)
    return None


def read_data_yaml(path: str) -> dict[str, Any]:
    """A data.yaml's top-level mapping ({} where it is none): PyYAML's, else the keys gpufeed reads, parsed by hand.

    Raises:
        SourceError: the file cannot be read, or is not a regular file (a FIFO, a device).
        ConfigError: it is over `YAML_MAX_BYTES`, or not YAML.
    """
    text = _read_text(path)
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        return _data_yaml_by_hand(text)
    try:
        document = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:  # ValueError: an integer of over 4300 digits
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path} is not valid YAML ({first})") from exc
    return document if isinstance(document, dict) else {}


def _yaml_names(path: str, document: dict[str, Any]) -> list[str] | None:
    names, count = _names_of(path, document.get("names")), document.get("nc")
    if count is None:
        return names
    if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= MAX_CLASSES:
        raise ConfigError(f"{path}: 'nc' must be the number of classes, a whole number 1 to {MAX_CLASSES}, not {brief(count)}")
    if names is None:  # ultralytics names them by their ids
        return [str(i) for i in range(count)]
    if len(names) != count:
        raise ConfigError(
            f"{path}: 'nc' is {count} but 'names' lists {len(names)} classes; make them agree (or drop 'nc')"
        )
    return names


def _names_of(path: str, names: Any) -> list[str] | None:
    """data.yaml's `names` in id order: a list, or {id: name} with ids 0..K-1; None where it has none."""
    if names is None:
        return None
    if isinstance(names, list) and all(isinstance(n, (str, int)) and not isinstance(n, bool) for n in names):
        return [str(n) for n in names]
    if isinstance(names, dict) and all(isinstance(k, int) and isinstance(v, (str, int)) for k, v in names.items()):
        if sorted(names) != list(range(len(names))):
            raise ConfigError(f"{path}: the ids of 'names' must be 0 to {len(names) - 1}, not {sorted(names)[:10]}")
        return [str(names[i]) for i in range(len(names))]
    raise ConfigError(f"{path}: 'names' must be a list of class names or a mapping of class id to name")


def _nc_by_hand(text: str) -> Any:
    """`nc:` of a data.yaml without PyYAML: a whole number, the text as it is otherwise, None without one."""
    match = re.search(r"^nc\s*:\s*([^#\n]*)", text, re.MULTILINE)
    if match is None:
        return None
    value = match.group(1).strip()
    number = whole_number(value)
    return value if number is None else number


def _data_yaml_by_hand(text: str) -> dict[str, Any]:
    """A data.yaml's `path`, `train`, `val`, `test`, `names` and `nc` without PyYAML.

    A value is inline (`key: value`, `key: [a, b]`; `nc` a whole number), or
    a block of indented `- a` lines (a list) or `0: a` lines (a mapping).
    """
    found: dict[str, Any] = {}
    lines = text.splitlines()
    for at, line in enumerate(lines):
        match = re.match(r"(path|train|val|test|names|nc)\s*:\s*(.*)$", line)
        if not match:
            continue
        key, inline = match.group(1), match.group(2).split("#", 1)[0].strip()
        if inline.startswith("["):
            found[key] = [part.strip().strip("'\"") for part in inline.strip("[]").split(",") if part.strip()]
        elif inline:
            number = whole_number(inline) if key == "nc" else None
            found[key] = inline.strip("'\"") if number is None else number
        else:
            found[key] = _block_by_hand(lines[at + 1 :])
    return found


def _block_by_hand(lines: list[str]) -> list[str] | dict[int, str]:
    """The indented lines under a key: `- a` items (a list) or `0: a` pairs (a mapping)."""
    pairs: dict[int, str] = {}
    items: list[str] = []
    for entry in lines:
        if entry and not entry[0].isspace():
            break
        entry = entry.split("#", 1)[0].strip()
        pair = re.match(r"([0-9]{1,9})\s*:\s*(.+)$", entry)
        if pair:
            pairs[int(pair.group(1))] = pair.group(2).strip().strip("'\"")
        elif entry.startswith("-"):
            items.append(entry[1:].strip().strip("'\""))
    return pairs or items


def _lines_of(path: str) -> list[str]:
    return [line.strip() for line in _read_text(path).splitlines() if line.strip()]


def _read_text(path: str) -> str:
    """A data.yaml or classes.txt as text (bytes that are not UTF-8 replaced).

    Raises:
        SourceError: it cannot be read, or is not a regular file.
        ConfigError: it is over `YAML_MAX_BYTES`.
    """
    try:
        data = read_regular(path, YAML_MAX_BYTES)
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(data) > YAML_MAX_BYTES:
        raise ConfigError(f"{path} is over {YAML_MAX_BYTES} bytes, the bound on a data.yaml or classes.txt")
    return data.decode("utf-8", "replace")


def list_yolo(root: str, info: ListingInfo, walk: Callable[[str, ListingInfo], Iterator[SourceItem]]) -> Iterator[SourceItem]:
    """Yield the images under `root/images`, each with the boxes of its `labels/` file.

    Args:
        root: the dataset folder (holding images/ and labels/).
        info: filled in: kind "yolo", task "detection", the names.
        walk: `walk(rel_folder, info)` yielding the image items under a
            folder of `root` in the listing's order (the plain folder walk).
    """
    names = yolo_names(root)
    info.kind, info.task = "yolo", "detection"
    info.classes = list(names or [])
    homes = dataset_homes(root)
    for item in walk("images", info):
        stem = os.path.splitext(item.rel[len("images/") :])[0]
        yield yolo_item(item, os.path.join(root, "labels", f"{stem}.txt"), f"labels/{stem}.txt", names, homes)


def dataset_homes(root: str) -> tuple[str, ...]:
    """Where a YOLO dataset's files may resolve to: the folder, and its images/ and labels/ wherever they lead.

    A folder linked in whole (`labels -> /mnt/nas/ds/labels`) is how datasets
    are shared, and is followed for images and labels alike; a single file
    linking elsewhere is refused, for images and labels alike.
    """
    return tuple(dict.fromkeys(os.path.realpath(os.path.join(root, sub)) for sub in ("", "images", "labels")))


def outside(homes: tuple[str, ...], path: str) -> bool:
    """Whether `path`, its links resolved, lies under none of `homes` (resolved folders)."""
    return not any(inside(home, path) for home in homes)


def yolo_item(
    item: SourceItem, label_path: str, label_rel: str, names: list[str] | None, homes: tuple[str, ...]
) -> SourceItem:
    """An image's item with the boxes of its label file (`label_rel`: how messages name it), or rejected with why."""
    if item.rejected:
        return item
    local = local_path(item.url)
    if local is not None and outside(homes, local):
        return SourceItem(item.url, item.rel, None, f"its image file {item.rel} leads outside the dataset folder")
    if not os.path.lexists(label_path):
        return SourceItem(item.url, item.rel, None, targets=_yolo_targets([], []))
    where = label_rel
    if outside(homes, label_path):
        return SourceItem(item.url, item.rel, None, f"its label file {where} leads outside the dataset folder")
    data = read_small(label_path)
    if isinstance(data, str):
        return SourceItem(item.url, item.rel, None, data)
    boxes, labels, shapes = [], [], []
    for line_no, line in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        parsed = _yolo_box(fields, names)
        if isinstance(parsed, str):
            return SourceItem(item.url, item.rel, None, f"{where}:{line_no}: {parsed}")
        class_id, box = parsed
        boxes.append(box)
        labels.append(names[class_id] if names is not None else str(class_id))
        shapes.append([[float(v) for v in fields[1:]]] if len(fields) > 5 else None)  # YOLO-seg: the polygon
        if len(boxes) > MAX_BOXES:
            return SourceItem(item.url, item.rel, None, f"{where}: over the {MAX_BOXES} boxes one image may have")
    return SourceItem(item.url, item.rel, None, targets=_yolo_targets(boxes, labels, shapes))


def _yolo_targets(boxes: list[list[float]], labels: list[str], shapes: list[Any] | None = None) -> dict[str, Any]:
    """YOLO's boxes (and YOLO-seg's polygons): fractions of the upright image (ultralytics reads them after
    the EXIF rotation). Polygons are painted into the sample's mask as COCO's are (`sample/coco_masks.py`)."""
    found: dict[str, Any] = {"boxes": boxes, "box_labels": labels, "normalized": True, "frame": "upright"}
    if shapes and any(shape is not None for shape in shapes):
        found["segmentation"] = shapes
    return found


def _yolo_box(fields: list[str], names: list[str] | None) -> tuple[int, list[float]] | str:
    """A label line's class id and normalised XYXY box, or why it is refused."""
    class_id = whole_number(fields[0], len(str(MAX_CLASSES)))
    if class_id is None or class_id >= MAX_CLASSES:
        return f"class {fields[0][:20]!r} is not a class id (a whole number from 0 to {MAX_CLASSES - 1})"
    if names is not None and class_id >= len(names):
        return f"box label {fields[0]!r} is not one of the {len(names)} classes in data.yaml"
    try:
        values = [float(v) for v in fields[1:]]
    except ValueError:
        return "a coordinate is not a number"
    if not all(0.0 <= v <= 1.0 for v in values):  # also refuses nan and inf
        return "coordinates must be normalised: finite numbers from 0 to 1"
    if len(values) == 4:
        cx, cy, w, h = values
        return class_id, [max(0.0, cx - w / 2), max(0.0, cy - h / 2), min(1.0, cx + w / 2), min(1.0, cy + h / 2)]
    if len(values) >= 6 and len(values) % 2 == 0:  # a polygon (YOLO segmentation): its bounds
        xs, ys = values[0::2], values[1::2]
        return class_id, [min(xs), min(ys), max(xs), max(ys)]
    return f"{len(fields)} fields: a line is 'class cx cy w h' (or 'class x1 y1 x2 y2 ...' for a polygon)"
