"""Hostile source datasets of every format `gpufeed prepare` reads, each with one thing wrong.

Each builder writes a small real dataset (the demo generators' COCO, YOLO,
VOC, segmentation folder, CSV/JSONL list or img2dataset shard, 3 images)
under a folder, spoils one file or field of it the way an attacker would
(numbers of hundreds of digits, deep nesting, FIFOs, bytes that are not
UTF-8, URLs for file names) and returns the SRC to give prepare.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image

from pipeline import demo
from pipeline.io.tar import sample_tar_bytes

DIGITS_400 = "1" + "0" * 400  # a JSON number past the float range: `int` to json, no float
DIGITS_5000 = "1" * 5000  # past Python's int-string limit (4300 digits)


def nested(depth: int, core: str = "1") -> str:
    """JSON (or YAML flow) text of `depth` nested lists around `core`."""
    return "[" * depth + core + "]" * depth


# -- COCO ---------------------------------------------------------------------------


def coco(root: Path, edit: Callable[[dict[str, Any]], None] | None = None, raw: str | None = None) -> str:
    """A COCO dataset (3 images, polygons; image 0 has annotation 0); `edit` changes its JSON, where a
    value set to "@RAW@" becomes the text `raw` as written (what json.dumps cannot write)."""
    path = Path(demo.make_coco_dataset(root, 3, segmentation="polygon"))
    document = json.loads(path.read_text())
    if edit is not None:
        edit(document)
    text = json.dumps(document)
    if raw is not None:
        text = text.replace('"@RAW@"', raw, 1)
    path.write_text(text)
    return str(path)


def annotation(**fields: Any) -> Callable[[dict[str, Any]], None]:
    """An edit setting fields of annotation 0 (of image 0)."""
    return lambda document: document["annotations"][0].update(fields)


def bbox_width(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(document: dict[str, Any]) -> None:
        document["annotations"][0]["bbox"][2] = value

    return edit


def image_0(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda document: document["images"][0].update(fields)


def rle(counts: Any) -> Callable[[dict[str, Any]], None]:
    """Annotation 0's shape made an RLE of the image's size with these counts."""

    def edit(document: dict[str, Any]) -> None:
        image = document["images"][0]
        size = [image["height"], image["width"]]
        pixels = size[0] * size[1]
        given = counts(pixels) if callable(counts) else counts
        document["annotations"][0]["segmentation"] = {"counts": given, "size": size}

    return edit


def wrapping_counts(pixels: int) -> list[int]:
    """Counts whose int64 sum wraps round to the image's pixels: 2**63 - 1 twice is -2."""
    return [2**63 - 1, 2**63 - 1, pixels + 2]


def wrapping_string(pixels: int) -> str:
    """A compressed RLE whose runs (32 of 2**59) add to 2**64 more than the image's pixels."""
    return demo.rle_string([pixels] + [2**59, 0] * 32)


def coco_fifo_image(root: Path) -> str:
    def edit(document: dict[str, Any]) -> None:
        document["images"].append({"id": 99, "file_name": "fifo.jpg", "width": 10, "height": 10})

    source = coco(root, edit)
    os.mkfifo(root / "train" / "fifo.jpg")
    return source


def coco_outside(name: str) -> Callable[[Path], str]:
    """Image 0's file_name leads to a real image outside the image folder (root/train): `../secret.jpg`,
    or its absolute path ("absolute")."""

    def build(root: Path) -> str:
        given = str(root / "secret.jpg") if name == "absolute" else name
        source = coco(root, image_0(file_name=given))
        (root / "secret.jpg").write_bytes((root / "train" / "000001.jpg").read_bytes())
        return source

    return build


def coco_of_a_gigabyte(root: Path) -> str:
    """A COCO JSON of 1 GB, over the default bound (sparse: nothing written but its end)."""
    source = coco(root)
    with open(source, "r+b") as handle:
        handle.seek(10**9 - 1)
        handle.write(b" ")
    return source


def coco_too_big_to_parse(root: Path) -> str:
    """A 24 MB COCO JSON (well within the bound) whose 8 million empty lists take 512 MB once parsed."""
    source = coco(root)
    text = Path(source).read_text()
    with open(source, "w") as handle:
        handle.write(text[:-1] + ', "padding": [' + "[]," * 8_000_000 + "[]]}")
    return source


# -- YOLO ---------------------------------------------------------------------------


def yolo(root: Path, label: str | None = None, yaml: str | None = None) -> str:
    """A YOLO folder (3 images, no splits); image 0's label file or data.yaml replaced by the text given."""
    base = Path(demo.make_yolo_dataset(root / "yolo", 3, splits=()))
    if label is not None:
        (base / "labels" / "000000.txt").write_text(label, encoding="utf-8")
    if yaml is not None:
        (base / "data.yaml").write_text(yaml, encoding="utf-8")
    return str(base)


def alias_bomb(levels: int = 9, width: int = 10) -> str:
    """YAML whose `nc` is `width` aliases of `width` aliases ... `levels` deep: tiny, and width**levels
    leaves once expanded (PyYAML shares them; a repr or a walk of it would not end)."""
    lines = ["l0: &l0 [a, a, a, a, a, a, a, a, a, a]"]
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    return "\n".join(lines) + f"\ntrain: images\nnc: *l{levels - 1}\n"


def yolo_fifo(relative: str) -> Callable[[Path], str]:
    def build(root: Path) -> str:
        base = Path(yolo(root))
        target = base / relative
        target.unlink(missing_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(target)
        return str(base)

    return build


def yolo_list_fifo(root: Path) -> str:
    base = Path(yolo(root, yaml="train: train.txt\nnames: [cat, dog, bird]\n"))
    os.mkfifo(base / "train.txt")
    return str(base / "data.yaml")


# -- Pascal VOC, segmentation folders ------------------------------------------------


def voc(root: Path, xml: str | None = None, fifo: bool = False) -> str:
    base = Path(demo.make_voc_dataset(root / "voc", 3))
    target = base / "Annotations" / "000000.xml"
    if xml is not None:
        target.write_text(xml, encoding="utf-8")
    if fifo:
        target.unlink()
        os.mkfifo(target)
    return str(base)


def voc_box(xmax: str) -> str:
    return (
        "<annotation><size><width>64</width><height>64</height></size><object><name>cat</name>"
        f"<bndbox><xmin>1</xmin><ymin>1</ymin><xmax>{xmax}</xmax><ymax>9</ymax></bndbox></object></annotation>"
    )


def segmentation_fifo(name: str) -> Callable[[Path], str]:
    def build(root: Path) -> str:
        base = Path(demo.make_segmentation_dataset(root / "seg", 3))
        (base / name).unlink()
        os.mkfifo(base / name)
        return str(base)

    return build


# -- CSV / JSONL lists ----------------------------------------------------------------


def listed(root: Path, first: bytes, name: str = "list.csv", header: bytes = b"path,caption\n") -> str:
    """A list of the 3 demo images: `first` is row 1 as written (bytes), rows 2 and 3 are good."""
    demo.make_coco_dataset(root, 3, segmentation=None)
    if name.endswith(".csv"):
        rest = b"train/000001.jpg,a dog\ntrain/000002.jpg,a bird\n"
    else:
        rest = b'{"path": "train/000001.jpg", "caption": "a dog"}\n{"path": "train/000002.jpg", "caption": "a bird"}\n'
    (root / name).write_bytes((header if name.endswith(".csv") else b"") + first + rest)
    return str(root / name)


def csv_row(path: str = "train/000000.jpg", caption: str = "a cat") -> Callable[[Path], str]:
    return lambda root: listed(root, f"{path},{caption}\n".encode())


def csv_label(label: str) -> Callable[[Path], str]:
    """A classification list: image 0 labelled `label`, the others 0 and 1."""

    def build(root: Path) -> str:
        demo.make_coco_dataset(root, 3, segmentation=None)
        rows = f"path,label\ntrain/000000.jpg,{label}\ntrain/000001.jpg,0\ntrain/000002.jpg,1\n"
        (root / "list.csv").write_text(rows, encoding="utf-8")
        return str(root / "list.csv")

    return build


def jsonl_row(text: bytes) -> Callable[[Path], str]:
    return lambda root: listed(root, text + b"\n", name="list.jsonl")


def csv_fifo_image(root: Path) -> str:
    source = listed(root, b"fifo.jpg,a pipe\n")
    os.mkfifo(root / "fifo.jpg")
    return source


def csv_is_fifo(root: Path) -> str:
    root.mkdir(parents=True)
    os.mkfifo(root / "list.csv")
    return str(root / "list.csv")


def csv_non_utf8_path(root: Path) -> str:
    """A path whose name is not UTF-8 (Latin-1 é), naming a real file of that name: a file name is bytes."""
    source = listed(root, b"caf\xe9.jpg,a cafe\n")
    os.link(root / "train" / "000000.jpg", os.path.join(os.fsencode(root), b"caf\xe9.jpg"))
    return source


# -- img2dataset shards ---------------------------------------------------------------


def shard(root: Path, **first: bytes) -> str:
    """One img2dataset-style shard of 3 samples (jpg, txt, json); sample 0's members replaced or added."""
    parts = []
    for index in range(3):
        buffer = io.BytesIO()
        Image.new("RGB", (48, 32), (40 * index, 90, 150)).save(buffer, "JPEG")
        members = {"jpg": buffer.getvalue(), "txt": f"picture {index}".encode(), "json": b'{"key": "%d"}' % index}
        if index == 0:
            members.update(first)
        parts.append(sample_tar_bytes(f"{index:09d}", members))
    blob = b"".join(parts) + bytes(1024)
    root.mkdir(parents=True, exist_ok=True)
    (root / "00000.tar").write_bytes(blob + bytes(-len(blob) % 10240))
    return str(root / "00000.tar")


def shard_fifo(root: Path) -> str:
    shard(root / "shards")
    os.mkfifo(root / "shards" / "00001.tar")
    return str(root / "shards")
