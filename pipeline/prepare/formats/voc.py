"""Pascal VOC detection folders: `Annotations/<stem>.xml` for `JPEGImages/<stem>.jpg`.

VOC's pixel coordinates are 1-based and inclusive, so a box is [xmin - 1,
ymin - 1, xmax, ymax] (the edges of the pixels it covers, as torchvision's
XYXY has them). `difficult` flags go in columns["difficult"]. XML with a
DOCTYPE or an entity is refused (no entity expansion, no external files). A
bad XML (not XML, a box that is not four finite numbers) rejects its image
with the reason; images without an annotation are ignored (counted).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

from ...errors import SourceError
from ...targets import MAX_BOXES
from .common import ANNOTATION_MAX_BYTES, ListingInfo, SourceItem, finite_number, inside, is_image_name, read_small
from .detection import declared_size

_XML_REFUSED = re.compile(rb"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)


def list_voc(root: str, info: ListingInfo) -> Iterator[SourceItem]:
    """Yield one item per `Annotations/*.xml` (sorted) with the boxes it holds; images without one are ignored.

    Raises:
        SourceError: a folder cannot be listed.
    """
    info.kind, info.task = "voc", "detection"
    images = _stems(os.path.join(root, "JPEGImages"))
    xmls = [name for name in _names(os.path.join(root, "Annotations")) if name.lower().endswith(".xml")]
    annotated = set()
    root_real = os.path.realpath(root)
    for name in xmls:
        stem = name[: -len(".xml")]
        annotated.add(stem)
        image = images.get(stem)
        if image is None:
            where = os.path.join(root, "JPEGImages", f"{stem}.jpg")
            yield SourceItem(where, f"JPEGImages/{stem}.jpg", None, f"Annotations/{name} has no image in JPEGImages/")
            continue
        xml_path = os.path.join(root, "Annotations", name)
        url, rel = os.path.join(root, "JPEGImages", image), f"JPEGImages/{image}"
        if not inside(root_real, xml_path):
            yield SourceItem(url, rel, None, f"Annotations/{name} leads outside the dataset folder")
            continue
        yield voc_item(url, rel, xml_path)
    info.ignored += sum(1 for stem in images if stem not in annotated)


def _names(folder: str) -> list[str]:
    try:
        return sorted(name for name in os.listdir(folder) if not name.startswith("."))
    except OSError as exc:
        raise SourceError(f"cannot list {folder}: {exc.strerror or exc}") from exc


def _stems(folder: str) -> dict[str, str]:
    """Image file name by stem, for the images of one folder (the first name in sorted order where stems repeat)."""
    stems: dict[str, str] = {}
    for name in _names(folder):
        if is_image_name(name):
            stems.setdefault(os.path.splitext(name)[0], name)
    return stems


def voc_item(url: str, rel: str, xml_path: str) -> SourceItem:
    """The item of one VOC image from its annotation XML (rejected with the reason where the XML is bad)."""
    data = read_small(xml_path, ANNOTATION_MAX_BYTES)
    if isinstance(data, str):
        return SourceItem(url, rel, None, data)
    parsed = parse_voc_xml(data)
    if isinstance(parsed, str):
        return SourceItem(url, rel, None, f"{os.path.basename(xml_path)}: {parsed}")
    return SourceItem(url, rel, None, targets=parsed)


def parse_voc_xml(data: bytes) -> dict[str, Any] | str:
    """The targets of one VOC annotation, or why it is refused (DOCTYPE/entities, not XML, a bad box)."""
    import xml.etree.ElementTree as ET

    if _XML_REFUSED.search(data):
        return "XML with a DOCTYPE or an entity declaration is refused"
    if b"\0" in data:  # UTF-16 or UTF-32, where the check above would not see a DOCTYPE
        return "XML that is not UTF-8 (it holds NUL bytes) is refused"
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        return f"not well-formed XML ({exc})"
    boxes, labels, difficult = [], [], []
    for number, obj in enumerate(root.iter("object")):
        name = (obj.findtext("name") or "").strip()
        if not name:
            return f"object {number} has no <name>"
        bndbox = obj.find("bndbox")
        try:
            values = [float((bndbox.findtext(k) or "").strip()) for k in ("xmin", "ymin", "xmax", "ymax")] if bndbox is not None else []
        except ValueError:
            values = []
        if len(values) != 4 or not all(finite_number(v) for v in values):
            return f"object {number} ({name}) has no <bndbox> of four finite numbers"
        xmin, ymin, xmax, ymax = values
        if xmax < xmin or ymax < ymin or xmin < 0 or ymin < 0:
            return f"object {number} ({name}): box {values} has xmax < xmin, ymax < ymin or a negative corner"
        boxes.append([max(0.0, xmin - 1), max(0.0, ymin - 1), xmax, ymax])
        labels.append(name)
        flag = (obj.findtext("difficult") or "0").strip()
        difficult.append(1 if flag in ("1", "true") else 0)
        if len(boxes) > MAX_BOXES:
            return f"over the {MAX_BOXES} boxes one image may have"
    found: dict[str, Any] = {"boxes": boxes, "box_labels": labels, "columns": {"difficult": difficult}, "frame": "declared"}
    size = root.find("size")
    declared = None
    if size is not None:
        try:
            declared = declared_size(float(size.findtext("width") or "x"), float(size.findtext("height") or "x"))
        except ValueError:
            declared = None
    if declared is not None:
        found["declared_size"] = declared
    return found
