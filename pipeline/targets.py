"""What a sample holds besides its image, and the geometry that keeps it in step with the pixels.

A sample is an image plus the fields its source has. How they sit in a
shard (every member readable by plain `webdataset`: it decodes `.npy`,
`.json`, `.txt`, `.png` and `.cls` by their extension):

    <key>.jpg              the image (or .png, .webp, .npy, ...), as before
    <key>.cls              one class index (classification), ASCII decimal
    <key>.labels.json      several class indices (multi-label), a JSON list: [3, 17]
    <key>.boxes.npy        boxes, float32 (N, 4): x0, y0, x1, y1 in pixels of the stored image
    <key>.box_labels.npy   their class indices, int64 (N,)
    <key>.iscrowd.npy      COCO's crowd flags, uint8 (N,), when the source has them
    <key>.mask.png         class index per pixel (segmentation): 8-bit grey PNG, 16-bit past 255 classes;
                           in a detection dataset painted from COCO's polygons/RLE, box class c
                           is c + 1, 0 background, the ignore index (255) a crowd: the manifest's
                           `mask_classes` = ["background", *classes] names them
    <key>.instances.png    box n's own pixels as n + 1 (COCO's and YOLO-seg's shapes, one per box)
    <key>.polygons.json    each box's polygons, where the source has them (`pipeline.polygons`)
    <key>.txt              a caption or text, UTF-8 (img2dataset's convention)
    <key>.json             what prepare recorded (source, sizes, ops) and the source's other
                           columns, under "columns"

The manifest records the task (`TASKS`), the class names and the fields present.
Everything read here comes from shards a user may not have made: each
member is checked (shape, dtype, range, size) and a bad one is a
`TargetError` with the reason, which the loader treats as a damaged sample.

Geometry is written once, for prepare (resize, EXIF, variants) and the
loader (crops, flips, letterbox) alike, with torchvision.transforms.v2's
conventions: boxes are XYXY in pixels, a crop moves and scales them and
then they are clipped to the output, a box whose visible area falls under
`min_visible` of what it had is dropped (and counted); masks are sampled
nearest-neighbour only, as `torch.nn.functional.interpolate(mode="nearest")`
samples (the source pixel of output pixel u is floor(u * in / out)).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
from typing import Any

import numpy as np

from .errors import GpufeedError
from .polygons import POLYGONS_MEMBER, Polygons
from .polygons import encode as polygons_json

TASKS = ("classification", "multilabel", "detection", "segmentation", "captions")

LABELS_MEMBER = "labels.json"
BOXES_MEMBER = "boxes.npy"
BOX_LABELS_MEMBER = "box_labels.npy"
ISCROWD_MEMBER = "iscrowd.npy"
MASK_MEMBER = "mask.png"
INSTANCES_MEMBER = "instances.png"  # box n's own pixels as n + 1 (COCO's and YOLO-seg's shapes, one per box)
TEXT_MEMBER = "txt"
TARGET_MEMBERS = (
    LABELS_MEMBER, BOXES_MEMBER, BOX_LABELS_MEMBER, ISCROWD_MEMBER, MASK_MEMBER, INSTANCES_MEMBER, POLYGONS_MEMBER,
    TEXT_MEMBER,
)  # fmt: skip

TASK_MEMBERS = {
    "classification": (),
    "multilabel": (LABELS_MEMBER,),
    "detection": (BOXES_MEMBER, BOX_LABELS_MEMBER, ISCROWD_MEMBER, MASK_MEMBER, INSTANCES_MEMBER, POLYGONS_MEMBER),
    "segmentation": (MASK_MEMBER,),
    "captions": (TEXT_MEMBER,),
}
FIELD_ALIASES = {"caption": TEXT_MEMBER, "text": TEXT_MEMBER, "keys": "key"}  # fields= names -> member names


def task_members(task: str, fields: tuple[str, ...] | list[str] = ()) -> frozenset[str]:
    """The members a loader keeps of each sample besides its image and `cls`: its task's targets and the fields asked for.

    "key" (the sample's key, always known) is not a member.
    """
    named = {FIELD_ALIASES.get(name, name) for name in fields} - {"key", GEOMETRY_FIELD}
    if GEOMETRY_FIELD in fields:
        named.add("json")  # where prepare recorded the sample's own geometry
    return frozenset(TASK_MEMBERS.get(task, ())) | named


GEOMETRY_FIELD = "geometry"
"""The field (`fields=("geometry",)`) that says where each output image came from: see `boxes_to_source`."""


def boxes_to_source(boxes: np.ndarray, geometry: dict[str, Any], *, original: bool = True) -> np.ndarray:
    """Boxes in a loader output's pixels (a model's predictions) mapped back to the image they came from.

    Args:
        boxes: (N, 4) XYXY in the `output_size` x `output_size` output.
        geometry: the sample's `batch.fields["geometry"]`: `source_box` (the
            part of the stored sample image the output shows, XYXY),
            `output_box` (where it lies in the output, XYXY), `flip`, and
            `prepare` (what prepare recorded: the stored sample's pixels
            from the upright original), if any.
        original: also undo prepare's resize, crop and padding, giving the
            upright original's pixels (where there is a `prepare` record);
            False stops at the stored sample's pixels.

    Returns:
        (N, 4) float64 XYXY boxes.
    """
    out = np.array(boxes, np.float64).reshape(-1, 4)
    if geometry["flip"]:
        out[:, [0, 2]] = geometry["output_size"] - out[:, [2, 0]]
    (sx0, sy0, sx1, sy1), (ox0, oy0, ox1, oy1) = geometry["source_box"], geometry["output_box"]
    scale_x, scale_y = (sx1 - sx0) / (ox1 - ox0), (sy1 - sy0) / (oy1 - oy0)
    out[:, 0::2] = (out[:, 0::2] - ox0) * scale_x + sx0
    out[:, 1::2] = (out[:, 1::2] - oy0) * scale_y + sy0
    prepared = geometry.get("prepare")
    if not original or not prepared:
        return out
    out[:, 0::2] -= prepared["offset"][0]
    out[:, 1::2] -= prepared["offset"][1]
    if prepared["flip"]:
        out[:, [0, 2]] = prepared["size"][0] - out[:, [2, 0]]
    a, b, c, d, e, f = prepared["matrix"]
    corners = [(out[:, i], out[:, j]) for i, j in ((0, 1), (2, 1), (0, 3), (2, 3))]
    xs = np.stack([a * u + b * v + c for u, v in corners])
    ys = np.stack([d * u + e * v + f for u, v in corners])
    return np.stack([xs.min(0), ys.min(0), xs.max(0), ys.max(0)], axis=1)


DEFAULT_IGNORE_INDEX = 255  # a mask pixel of no class (VOC's border), left out of the loss
DEFAULT_MIN_VISIBLE = 0.25  # a box keeps at least this fraction of its area after a crop, or is dropped
MAX_BOXES = 1 << 16  # per sample: a hostile .npy cannot ask for gigabytes
MAX_CAPTION_BYTES = 1 << 20
MAX_JSON_BYTES = 32 << 20
"""The bound on a JSON member the loader parses (a sample's `json`, `labels.json`, a field asked for): a
million polygon points fit; 250 MB of numbers would take gigabytes as Python objects."""


class TargetError(GpufeedError):
    """A sample's target member is not what the format says (shape, dtype, range): sample damage."""


@dataclasses.dataclass
class SampleTargets:
    """A sample's fields besides its image, in pixels of the image they belong to.

    Attributes:
        labels: class indices of a multi-label sample.
        boxes: float32 (N, 4) XYXY pixel boxes.
        box_labels: int64 (N,) class index of each box.
        iscrowd: uint8 (N,) COCO crowd flags, when the source has them.
        mask: (H, W) uint8 or uint16 class index per pixel, the image's size.
        instances: (H, W) uint8 or uint16: box n's own pixels are n + 1 (0: none).
        polygons: per box, its polygons ((K, 2) float arrays of pixel points), where the source has them.
        caption: a caption or text.
        columns: the source's other columns (kept in the sample's json).
    """

    labels: list[int] | None = None
    boxes: np.ndarray | None = None
    box_labels: np.ndarray | None = None
    iscrowd: np.ndarray | None = None
    mask: np.ndarray | None = None
    caption: str | None = None
    columns: dict[str, Any] | None = None
    instances: np.ndarray | None = None
    polygons: Polygons | None = None


# -- members: write and read ---------------------------------------------------


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def mask_png(mask: np.ndarray) -> bytes:
    """A class-index mask as a grey PNG: 8-bit while every index fits, else 16-bit."""
    from PIL import Image

    if mask.ndim != 2:
        raise ValueError(f"a mask is (H, W), not {mask.shape}")
    if int(mask.max(initial=0)) <= 255:
        image = Image.fromarray(np.ascontiguousarray(mask, dtype=np.uint8), mode="L")
    else:
        image = Image.fromarray(np.ascontiguousarray(mask, dtype=np.uint16))  # mode I;16
    buffer = io.BytesIO()
    image.save(buffer, "PNG", compress_level=1)
    return buffer.getvalue()


def target_members(targets: SampleTargets) -> dict[str, bytes]:
    """The shard members of a sample's targets (not `columns`: they go in its json)."""
    members: dict[str, bytes] = {}
    if targets.labels is not None:
        members[LABELS_MEMBER] = json.dumps(sorted(set(int(v) for v in targets.labels))).encode("ascii")
    if targets.boxes is not None:
        boxes = np.asarray(targets.boxes, np.float32).reshape(-1, 4)
        labels = np.asarray(targets.box_labels if targets.box_labels is not None else [], np.int64).reshape(-1)
        if len(labels) != len(boxes):
            raise ValueError(f"{len(boxes)} boxes but {len(labels)} box labels")
        members[BOXES_MEMBER] = npy_bytes(boxes)
        members[BOX_LABELS_MEMBER] = npy_bytes(labels)
        if targets.iscrowd is not None:
            members[ISCROWD_MEMBER] = npy_bytes(np.asarray(targets.iscrowd, np.uint8).reshape(-1))
    if targets.mask is not None:
        members[MASK_MEMBER] = mask_png(targets.mask)
    if targets.instances is not None:
        members[INSTANCES_MEMBER] = mask_png(targets.instances)
    if targets.polygons is not None:
        members[POLYGONS_MEMBER] = polygons_json(targets.polygons)
    if targets.caption is not None:
        members[TEXT_MEMBER] = targets.caption.encode("utf-8")
    return members


_NPY_MAGIC = b"\x93NUMPY"
_NPY_HEADER = re.compile(
    rb"\{\s*'descr':\s*'([<>|=]?[biuf?][0-9]{0,2})',\s*'fortran_order':\s*(True|False),\s*"
    rb"'shape':\s*\(((?:\s*[0-9]{1,12}\s*,)*\s*(?:[0-9]{1,12})?\s*)\),?\s*\}\s*"
)


def read_npy(data: bytes, name: str) -> np.ndarray:
    """A `.npy` member's array, from its header as NumPy writes it, read without NumPy's parser.

    A hostile header can claim any shape and dtype, and NumPy's own parser
    (an `ast.literal_eval`, 0.1 ms a member) raises many kinds of errors on
    garbage. Here only the header NumPy writes for a plain numeric array is
    accepted (descr, fortran_order, shape), the claimed size must be the
    bytes there are, and the array is a view of them: no pickle, no
    allocation a header could ask for.

    Raises:
        TargetError: not such a .npy array, or one its bytes do not hold.
    """
    if data[:6] != _NPY_MAGIC or len(data) < 10:
        raise TargetError(f"{name} is not a .npy array (no NUMPY magic)")
    major = data[6]
    if major == 1:
        length, start = int.from_bytes(data[8:10], "little"), 10
    elif major in (2, 3):
        length, start = int.from_bytes(data[8:12], "little"), 12
    else:
        raise TargetError(f"{name} is a .npy array of an unknown version {major}")
    match = _NPY_HEADER.fullmatch(data[start : start + length])
    if match is None:
        raise TargetError(f"{name} is not a plain numeric .npy array (its header is not NumPy's for one)")
    try:
        dtype = np.dtype(match.group(1).decode("ascii"))
    except TypeError as exc:
        raise TargetError(f"{name} has an unknown dtype {match.group(1)!r}") from exc
    shape = tuple(int(part) for part in match.group(3).split(b",") if part.strip())
    count = math.prod(shape)
    if count * dtype.itemsize != len(data) - start - length:
        raise TargetError(f"{name} holds {len(data) - start - length} bytes of data, its header says {count * dtype.itemsize}")
    array = np.frombuffer(data, dtype, count, start + length)
    order = "F" if match.group(2) == b"True" else "C"
    return array.reshape(shape[::-1]).T if order == "F" else array.reshape(shape)


_DTYPE_NAMES = {np.dtype(name).str[1:]: name for name in (
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
)}  # fmt: skip


def _dtype_name(dtype: np.dtype) -> str:
    """`dtype.name` for the plain numeric dtypes, without its cost (a few microseconds a call)."""
    return _DTYPE_NAMES.get(dtype.str[1:]) or dtype.name


def load_npy(data: bytes, name: str, dtypes: tuple[str, ...], ndim: int) -> np.ndarray:
    """A checked `.npy` member: no pickles, one of `dtypes`, `ndim` dimensions, at most MAX_BOXES rows."""
    array = read_npy(data, name)
    if array.ndim != ndim or _dtype_name(array.dtype) not in dtypes:
        shape = getattr(array, "shape", None)
        raise TargetError(f"{name} must be {'/'.join(dtypes)} with {ndim} dimensions, not {getattr(array, 'dtype', '?')} {shape}")
    if len(array) > MAX_BOXES:
        raise TargetError(f"{name} has {len(array)} rows, over the {MAX_BOXES} a sample may have")
    return array


def read_boxes(members: dict[str, bytes], classes: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A sample's boxes (float32 (N, 4)), box labels (int64 (N,)) and crowd flags, checked.

    A sample without `boxes.npy` has no boxes (N = 0).

    Raises:
        TargetError: a member that is not what the format says, labels out of
            range, boxes that are not finite or have x1 < x0 or y1 < y0.
    """
    if BOXES_MEMBER not in members:
        return np.zeros((0, 4), np.float32), np.zeros((0,), np.int64), None
    boxes = load_npy(members[BOXES_MEMBER], BOXES_MEMBER, ("float32", "float64", "float16"), 2).astype(np.float32)
    if boxes.shape[1:] != (4,):
        raise TargetError(f"{BOXES_MEMBER} must be (N, 4), not {boxes.shape}")
    if not np.isfinite(boxes).all() or (boxes[:, 2:] < boxes[:, :2]).any():
        raise TargetError(f"{BOXES_MEMBER} holds a box that is not finite or has x1 < x0 or y1 < y0")
    data = members.get(BOX_LABELS_MEMBER)
    if data is None:
        raise TargetError(f"{BOXES_MEMBER} without {BOX_LABELS_MEMBER}")
    labels = load_npy(data, BOX_LABELS_MEMBER, ("int64", "int32", "int16", "uint8", "uint16", "uint32"), 1).astype(np.int64)
    if len(labels) != len(boxes):
        raise TargetError(f"{len(boxes)} boxes but {len(labels)} box labels")
    _check_indices(labels, classes, BOX_LABELS_MEMBER)
    crowd = None
    if ISCROWD_MEMBER in members:
        crowd = load_npy(members[ISCROWD_MEMBER], ISCROWD_MEMBER, ("uint8", "bool", "int64", "int32"), 1).astype(np.uint8)
        if len(crowd) != len(boxes):
            raise TargetError(f"{len(boxes)} boxes but {len(crowd)} crowd flags")
    return boxes, labels, crowd


def read_labels(members: dict[str, bytes], classes: int | None) -> list[int]:
    """A multi-label sample's class indices (empty without `labels.json`), checked."""
    data = members.get(LABELS_MEMBER)
    if data is None:
        return []
    values = read_json(data, LABELS_MEMBER)
    if not isinstance(values, list) or len(values) > MAX_BOXES or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise TargetError(f"{LABELS_MEMBER} must be a list of class indices")
    _check_indices(np.asarray(values, np.int64) if values else np.zeros(0, np.int64), classes, LABELS_MEMBER)
    return values


def read_json(data: bytes, name: str) -> Any:
    """A JSON member parsed, at most MAX_JSON_BYTES long and nested no deeper than Python's recursion allows.

    Raises:
        TargetError: too long, not JSON, or nested too deep.
    """
    if len(data) > MAX_JSON_BYTES:
        raise TargetError(f"{name} is {len(data)} bytes, over the {MAX_JSON_BYTES} bytes a JSON member may have")
    try:
        return json.loads(data)
    except RecursionError:
        raise TargetError(f"{name} is not JSON that can be read: it nests too deep") from None
    except ValueError as exc:  # UnicodeDecodeError too
        raise TargetError(f"{name} is not JSON ({str(exc)[:100]})") from None


def read_caption(members: dict[str, bytes], name: str = TEXT_MEMBER) -> str:
    """A sample's text member as a str ("" when it has none); bytes that are not UTF-8 become U+FFFD."""
    data = members.get(name)
    if data is None:
        return ""
    if len(data) > MAX_CAPTION_BYTES:
        raise TargetError(f"{name} is {len(data)} bytes, over the {MAX_CAPTION_BYTES} a text may have")
    return data.decode("utf-8", "replace")


def _check_indices(values: np.ndarray, classes: int | None, name: str) -> None:
    if len(values) and (int(values.min()) < 0 or (classes is not None and int(values.max()) >= classes)):
        bound = f"0 to {classes - 1}" if classes is not None else "non-negative"
        raise TargetError(f"{name} holds a class index outside {bound}")


# -- geometry: boxes -----------------------------------------------------------


def place_boxes(
    boxes: np.ndarray,
    box: tuple[float, float, float, float],
    dest: tuple[int, int, int, int],
    size: int,
    min_visible: float,
    flip: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Boxes after the part `box` (left, top, width, height) of their image is resized into `dest`
    (x, y, width, height) of a `size` x `size` output, clipped to it, then flipped: (boxes, keep mask).

    What `scale_boxes`, `clip_boxes` and `flip_boxes` do one after the other (prepare's
    geometry), in one pass over the boxes: the loader does it for every sample.
    """
    left, top, width, height = box
    x, y, dest_w, dest_h = dest
    sx, sy = dest_w / width, dest_h / height
    dx, dy = x - left * sx, y - top * sy
    moved = boxes * np.array([sx, sy, sx, sy], np.float32) + np.array([dx, dy, dx, dy], np.float32)
    before = np.maximum(moved[:, 2] - moved[:, 0], 0) * np.maximum(moved[:, 3] - moved[:, 1], 0)
    np.clip(moved, 0, size, out=moved)
    after = (moved[:, 2] - moved[:, 0]) * (moved[:, 3] - moved[:, 1])
    keep = (after > 0) & (after >= min_visible * before - 1e-6)
    if flip:
        moved[:, [0, 2]] = size - moved[:, [2, 0]]
    return moved, keep


def scale_boxes(boxes: np.ndarray, sx: float, sy: float, dx: float = 0.0, dy: float = 0.0) -> np.ndarray:
    """Boxes after x -> x * sx + dx, y -> y * sy + dy (a resize, then a shift such as letterbox padding)."""
    moved = boxes.astype(np.float32, copy=True)
    moved[:, 0::2] = moved[:, 0::2] * sx + dx
    moved[:, 1::2] = moved[:, 1::2] * sy + dy
    return moved


def flip_boxes(boxes: np.ndarray, width: int) -> np.ndarray:
    """Boxes of a horizontally flipped image `width` pixels wide: x -> width - x."""
    flipped = boxes.astype(np.float32, copy=True)
    flipped[:, 0] = width - boxes[:, 2]
    flipped[:, 2] = width - boxes[:, 0]
    return flipped


def box_areas(boxes: np.ndarray) -> np.ndarray:
    return np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(boxes[:, 3] - boxes[:, 1], 0, None)


def clip_boxes(
    moved: np.ndarray, out_size: tuple[int, int], before: np.ndarray, min_visible: float = DEFAULT_MIN_VISIBLE
) -> tuple[np.ndarray, np.ndarray]:
    """Boxes clipped to the output, and which to keep: those with at least `min_visible` of their area left.

    Args:
        moved: boxes in output pixels, not yet clipped (`scale_boxes`, `affine_boxes`).
        out_size: (width, height) of the output.
        before: the area each box had, in the same (output) pixel units, before clipping.
        min_visible: the fraction of its area a box must keep; a box with no
            area left is always dropped.

    Returns:
        (clipped boxes, keep mask).
    """
    clipped = moved.copy()
    clipped[:, 0::2] = np.clip(clipped[:, 0::2], 0, out_size[0])
    clipped[:, 1::2] = np.clip(clipped[:, 1::2], 0, out_size[1])
    area = box_areas(clipped)
    keep = (area > 0) & (area >= min_visible * before - 1e-6)
    return clipped, keep


def orient_boxes(boxes: np.ndarray, orientation: int, width: int, height: int) -> np.ndarray:
    """Boxes of a stored (width x height) image after its EXIF `orientation` (1..8) is made upright.

    The eight orientations are the flips and quarter turns of the TIFF/EXIF
    tag, as PIL's `ImageOps.exif_transpose` applies them.
    """
    if orientation in (0, 1):
        return boxes.astype(np.float32, copy=True)
    x0, y0, x1, y1 = (boxes[:, i].astype(np.float32) for i in range(4))
    w, h = float(width), float(height)
    corners = {
        2: (w - x1, y0, w - x0, y1),  # mirror
        3: (w - x1, h - y1, w - x0, h - y0),  # rotate 180
        4: (x0, h - y1, x1, h - y0),  # flip top-bottom
        5: (y0, x0, y1, x1),  # transpose
        6: (h - y1, x0, h - y0, x1),  # rotate 270 (clockwise 90)
        7: (h - y1, w - x1, h - y0, w - x0),  # transverse
        8: (y0, w - x1, y1, w - x0),  # rotate 90
    }[orientation]
    return np.stack(corners, axis=1).astype(np.float32)


# -- geometry: masks -----------------------------------------------------------


def crop_mask(
    mask: np.ndarray, box: tuple[float, float, float, float], out_size: tuple[int, int], fill: int = DEFAULT_IGNORE_INDEX
) -> np.ndarray:
    """The mask after cropping `box` = (left, top, width, height) and resizing to `out_size`, nearest-neighbour.

    Output pixels whose source falls outside the mask (a crop past its edge)
    get `fill`.
    """
    left, top, width, height = box
    out_w, out_h = out_size
    rows = np.floor(top + np.arange(out_h) * (height / out_h) + 1e-9).astype(np.int64)
    cols = np.floor(left + np.arange(out_w) * (width / out_w) + 1e-9).astype(np.int64)
    inside_r = (rows >= 0) & (rows < mask.shape[0])
    inside_c = (cols >= 0) & (cols < mask.shape[1])
    out = mask[np.clip(rows, 0, mask.shape[0] - 1)][:, np.clip(cols, 0, mask.shape[1] - 1)]
    if not (inside_r.all() and inside_c.all()):
        out = out.copy()
        out[~inside_r, :] = fill
        out[:, ~inside_c] = fill
    return out


def orient_mask(mask: np.ndarray, orientation: int) -> np.ndarray:
    """A stored mask made upright like its image (EXIF `orientation` 1..8)."""
    ops = {
        2: lambda m: m[:, ::-1],
        3: lambda m: m[::-1, ::-1],
        4: lambda m: m[::-1, :],
        5: lambda m: m.T,
        6: lambda m: np.rot90(m, -1),
        7: lambda m: m[::-1, ::-1].T,
        8: lambda m: np.rot90(m, 1),
    }
    op = ops.get(orientation)
    return mask if op is None else np.ascontiguousarray(op(mask))


def affine_boxes(boxes: np.ndarray, matrix: tuple[float, ...]) -> np.ndarray:
    """Boxes of the source in the output of an affine resampling, not clipped.

    `matrix` = (a, b, c, d, e, f) maps an output point (u, v) to the source
    point (a u + b v + c, d u + e v + f), as PIL's `Image.transform(AFFINE)`
    takes it. Each box's four corners go through the inverse and the box
    becomes the axis-aligned box around them, as torchvision.transforms.v2
    does for a rotation (exact for a crop and resize without one).

    Raises:
        ValueError: the matrix cannot be inverted.
    """
    a, b, c, d, e, f = (float(v) for v in matrix)
    det = a * e - b * d
    if not math.isfinite(det) or abs(det) < 1e-12:
        raise ValueError(f"the affine matrix {matrix} cannot be inverted")
    x = boxes[:, [0, 2, 2, 0]].astype(np.float64) - c  # corners: (x0,y0) (x1,y0) (x1,y1) (x0,y1)
    y = boxes[:, [1, 1, 3, 3]].astype(np.float64) - f
    u = (e * x - b * y) / det
    v = (a * y - d * x) / det
    return np.stack([u.min(axis=1), v.min(axis=1), u.max(axis=1), v.max(axis=1)], axis=1).astype(np.float32)


def affine_mask(
    mask: np.ndarray, matrix: tuple[float, ...], out_size: tuple[int, int], fill: int = DEFAULT_IGNORE_INDEX
) -> np.ndarray:
    """The mask resampled through `matrix` (see `affine_boxes`), nearest-neighbour, never interpolated.

    Output pixel (u, v) takes the source pixel under the point its centre
    maps to, floor(matrix (u + 0.5, v + 0.5)), as PIL's NEAREST transform and
    torch's `grid_sample(mode="nearest", align_corners=False)` sample; pixels
    that map outside the mask get `fill`.
    """
    a, b, c, d, e, f = (float(v) for v in matrix)
    out_w, out_h = out_size
    u = np.arange(out_w, dtype=np.float64) + 0.5
    v = np.arange(out_h, dtype=np.float64)[:, None] + 0.5
    cols = np.floor(a * u + b * v + c).astype(np.int64)
    rows = np.floor(d * u + e * v + f).astype(np.int64)
    inside = (rows >= 0) & (rows < mask.shape[0]) & (cols >= 0) & (cols < mask.shape[1])
    out = mask[np.clip(rows, 0, mask.shape[0] - 1), np.clip(cols, 0, mask.shape[1] - 1)]
    out[~inside] = fill
    return out


def pad_mask(
    mask: np.ndarray, offset: tuple[int, int], canvas: tuple[int, int], fill: int = DEFAULT_IGNORE_INDEX
) -> np.ndarray:
    """The mask placed at `offset` = (left, top) on a `canvas` = (width, height) of `fill` (letterbox padding)."""
    left, top = offset
    out = np.full((canvas[1], canvas[0]), fill, dtype=mask.dtype)
    out[top : top + mask.shape[0], left : left + mask.shape[1]] = mask
    return out


def flip_mask(mask: np.ndarray) -> np.ndarray:
    """The mask of a horizontally flipped image."""
    return np.ascontiguousarray(mask[:, ::-1])
