"""Targets on their way to a batch: what a task keeps of each sample, its geometry, the `Batch` it makes.

A loader over classification shards without `fields` never comes here: its
records carry the image and the class, and its batches are `(images,
labels)` tuples as always. Any other task (multi-label, detection,
segmentation, captions) or any `fields=` makes each record keep the members
it needs (`TaskPlan.keep`), and each decode piece of a batch, once its
pixels are in their slots, works out the targets of the same samples
(`task_piece`): a sample's crop box is a pure function of its seed and its
image's header size (`crops.py`), and its flip of the batch position
(`crops.flip_mask`), so the boxes and masks follow exactly the crop and flip
its pixels got, whichever decoder read them. Boxes are moved, scaled,
clipped and dropped under `min_visible` of their area; masks are sampled
nearest-neighbour (`pipeline.targets`). A sample whose targets are damaged
fails like one whose pixels do not decode, and is replaced (bringing its
own targets).

`Batch` is what such a loader yields: tensors where shapes agree (images,
masks `[B, H, W]`, multi-hot labels `[B, C]`), lists where they do not
(boxes per image, captions). It unpacks as `images, targets`. A detection
dataset painted from COCO's shapes (its manifest lists `mask.png`) also
gives `Batch.masks`, cropped and flipped with its boxes.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ..decode import open_image
from ..errors import ConfigError, DecodeError
from ..polygons import POLYGONS_MEMBER, Polygons, place_polygons
from ..polygons import decode as decode_polygons
from ..targets import (
    BOXES_MEMBER,
    DEFAULT_IGNORE_INDEX,
    FIELD_ALIASES,
    GEOMETRY_FIELD,
    INSTANCES_MEMBER,
    LABELS_MEMBER,
    MASK_MEMBER,
    TEXT_MEMBER,
    TargetError,
    crop_mask,
    place_boxes,
    read_boxes,
    read_caption,
    read_json,
    read_labels,
    read_npy,
    task_members,
)
from .cpu_decode import image_size
from .crops import CropRandom, CropSpec
from .placement import Placement, place
from .slot_pixels import DATA_ERRORS


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    """What a loader keeps of each sample besides its image and class, and what it makes of it.

    Attributes:
        task: one of `pipeline.targets.TASKS`.
        fields: the extra members asked for (`fields=`), by member name; "key" for the keys.
        field_names: member name -> the name `fields=` asked for it by (`fields=("caption",)`
            reads member "txt" and delivers it as `batch.fields["caption"]`).
        classes: the dataset's class count (bounds box and multi-label indices), None without names.
        ignore_index: a mask's value of no class; also what a crop past a mask's edge gets.
        min_visible: a box keeps at least this fraction of its area after the crop, or is dropped.
        sample_transform: the user's callable on each decoded sample, in the decode workers.
        masks: detection: the dataset's samples have a `mask.png` (painted from
            COCO's shapes) and batches carry it as `Batch.masks`, cropped and
            flipped with the boxes.
        instances: detection: the samples have an `instances.png` (each box's
            own pixels, from COCO's or YOLO-seg's shapes), and each image's
            target dict carries "masks", [N_i, H, W] uint8 (Mask R-CNN's form).
        polygons: detection: the samples have a `polygons.json` (YOLO-seg's and
            COCO's polygons, `pipeline.polygons`), and each image's target
            dict carries "polygons": per box, its polygons as float32 [K, 2]
            tensors of output pixels, moved and clipped with the box.
    """

    task: str
    fields: tuple[str, ...] = ()
    classes: int | None = None
    ignore_index: int = DEFAULT_IGNORE_INDEX
    min_visible: float = 0.25
    sample_transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    masks: bool = False
    instances: bool = False
    polygons: bool = False
    field_names: dict[str, str] = dataclasses.field(default_factory=dict, hash=False)

    @property
    def keep(self) -> frozenset[str]:
        """The members each record keeps besides its image (and `cls`, which every record reads)."""
        return task_members(self.task, self.fields)


def task_plan(
    task: str | None,
    fields: Sequence[str],
    manifest_task: str,
    classes: int | None,
    ignore_index: int | None,
    min_visible: float,
    sample_transform: Callable[..., Any] | None,
    worker_type: str,
    manifest_fields: Sequence[str] = (),
) -> TaskPlan | None:
    """The plan of a loader's targets; None for plain classification (the tuple path, unchanged).

    A detection dataset whose manifest lists `mask.png` among its fields
    (`manifest_fields`) delivers its masks too (`TaskPlan.masks`).

    `task` and `fields` are a LoaderSpec's, `manifest_task` a manifest's: all already checked.

    Raises:
        ConfigError: a sample_transform that is not callable, or that process
            workers cannot be handed (it does not pickle).
    """
    chosen = task or manifest_task
    names = tuple(dict.fromkeys(FIELD_ALIASES.get(name, name) for name in fields))
    if sample_transform is not None and not callable(sample_transform):
        raise ConfigError("sample_transform must be a callable taking and returning a sample dict")
    if sample_transform is not None and worker_type == "process":
        try:
            pickle.dumps(sample_transform)
        except Exception as exc:  # what pickling a closure or lambda raises varies
            raise ConfigError(
                f"sample_transform cannot be sent to process workers: it does not pickle ({exc}); define it at "
                "the top level of a module, or use worker_type='thread'"
            ) from exc
    if chosen == "classification" and not names and sample_transform is None:
        return None
    asked: dict[str, str] = {}
    for name in fields:
        asked.setdefault(FIELD_ALIASES.get(name, name), name)
    return TaskPlan(
        chosen, names, classes, DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index, min_visible,
        sample_transform, masks=chosen == "detection" and MASK_MEMBER in manifest_fields, field_names=asked,
        instances=chosen == "detection" and INSTANCES_MEMBER in manifest_fields,
        polygons=chosen == "detection" and POLYGONS_MEMBER in manifest_fields,
    )  # fmt: skip


# -- one sample ----------------------------------------------------------------


def decode_mask(
    data: bytes, size: tuple[int, int], name: str = MASK_MEMBER, bound: int | None = None, ignore: int | None = None
) -> np.ndarray:
    """A stored class-index mask (8- or 16-bit grey PNG, or a palette PNG's indices), the image's size, its values checked.

    Args:
        data: the member's bytes.
        size: its image's (width, height).
        name: the member, as messages name it.
        bound: its values are below this (the classes it may name), None: any non-negative value.
        ignore: a value allowed beside them (the ignore index), None: none.

    Raises:
        TargetError: it does not decode, its size is not the image's, or it holds
            a value outside [0, bound) that is not `ignore`.
    """
    try:
        image = open_image(data)
        image.load()
        if image.size != size:
            raise TargetError(f"{name} is {image.size[0]}x{image.size[1]}, its image {size[0]}x{size[1]}")
        if image.mode not in ("L", "P", "I;16", "I", "1"):
            raise TargetError(f"{name} must be a grey or palette PNG of class indices, not mode {image.mode}")
        mask = np.asarray(image)
    except DecodeError as exc:
        raise TargetError(f"{name} does not decode ({exc})") from None
    except DATA_ERRORS as exc:  # what Pillow raises on broken data (SyntaxError for a broken PNG chunk)
        raise TargetError(f"{name} does not decode ({str(exc)[:160] or type(exc).__name__})") from None
    if mask.dtype == np.bool_:
        mask = mask.view(np.uint8)
    check_mask_values(mask, name, bound, ignore)
    return mask


def check_mask_values(mask: np.ndarray, name: str, bound: int | None, ignore: int | None) -> None:
    """Every value of the mask is in [0, bound) or is `ignore`: two vector passes (three where it holds `ignore`).

    Raises:
        TargetError: a value that is neither, named.
    """
    high = int(mask.max(initial=0))
    low = int(mask.min(initial=0)) if mask.dtype.kind == "i" else 0
    if low < 0:
        bad = low
    elif bound is None or high < bound:
        return
    elif high != ignore:
        bad = high
    else:
        bad = int(mask.max(where=mask != ignore, initial=0))
        if bad < bound:
            return
    allowed = "negative" if bound is None else f"outside 0 to {bound - 1}"
    also = f" and not the ignore index {ignore}" if ignore is not None else ""
    raise TargetError(f"{name} holds the value {bad}, {allowed}{also}")


def placement_of(
    plan: TaskPlan | None, extension: str, data: bytes, seed: int, members: dict[str, bytes], crop: CropSpec
) -> Placement:
    """Where the sample's image goes in its output (`placement.py`): what its pixels and its targets both follow.

    Raises:
        TargetError: iou_crop needs the sample's boxes, and they are damaged.
        DecodeError: the image's header does not read.
    """
    width, height = image_size(extension, data)
    boxes = None
    if crop.recipe == "iou_crop" and crop.train:
        boxes = read_boxes(members, plan.classes if plan is not None else None)[0]
    rng = CropRandom(seed) if crop.train else None
    return place(rng, width, height, crop, boxes)


def sample_targets(
    plan: TaskPlan,
    extension: str,
    data: bytes,
    seed: int,
    members: dict[str, bytes],
    crop: CropSpec,
    flip: bool,
    placement: Placement | None = None,
) -> dict[str, Any]:
    """One sample's targets after its placement (the one its pixels got) and flip, as the batch takes them.

    Raises:
        TargetError: a target member is damaged (sample damage).
        DecodeError: the image's header does not read (its pixels would not decode either).
    """
    out: dict[str, Any] = {}
    task = plan.task
    if task in ("detection", "segmentation"):
        placed = placement if placement is not None else placement_of(plan, extension, data, seed, members, crop)
        box, (dx, dy, dw, dh) = placed
    if task == "detection":
        boxes, labels, crowd = read_boxes(members, plan.classes)
        clipped, keep = place_boxes(boxes, box, (dx, dy, dw, dh), crop.size, plan.min_visible, flip)
        out["boxes"], out["box_labels"] = clipped[keep], labels[keep]
        if crowd is not None:
            out["iscrowd"] = crowd[keep]
        out["boxes_dropped"] = int(len(keep) - keep.sum())
        if plan.masks:  # a sample without one (prepared apart) has a mask of the ignore index: no loss from it
            mask = None
            if MASK_MEMBER in members:  # box class c is c + 1, 0 background (`targets.py`)
                bound = plan.classes + 1 if plan.classes is not None else None
                mask = decode_mask(members[MASK_MEMBER], image_size(extension, data), MASK_MEMBER, bound, plan.ignore_index)
            out["mask"] = _placed_mask(mask, placed, crop.size, flip, plan.ignore_index)
        if plan.instances:  # one mask per kept box; a sample without a map has empty ones
            found = None
            if INSTANCES_MEMBER in members:  # box n's pixels are n + 1, 0 none
                found = decode_mask(members[INSTANCES_MEMBER], image_size(extension, data), INSTANCES_MEMBER, len(boxes) + 1)
            own = _placed_mask(found, placed, crop.size, flip, 0)
            ids = (np.flatnonzero(keep) + 1).astype(own.dtype)
            out["masks"] = (own[None, :, :] == ids[:, None, None]).astype(np.uint8)
        if plan.polygons:  # each kept box's polygons; a sample without the member has none
            found_polygons = read_polygons(members, len(boxes))
            kept_polygons = [parts for parts, kept in zip(found_polygons, keep) if kept]
            out["polygons"] = place_polygons(kept_polygons, box, (dx, dy, dw, dh), crop.size, flip)
    elif task == "segmentation":
        if MASK_MEMBER not in members:
            raise TargetError(f"no {MASK_MEMBER}")
        mask = decode_mask(members[MASK_MEMBER], image_size(extension, data), MASK_MEMBER, plan.classes, plan.ignore_index)
        out["mask"] = _placed_mask(mask, placed, crop.size, flip, plan.ignore_index)
    elif task == "multilabel":
        out["labels"] = read_labels(members, plan.classes)
    elif task == "captions":
        out["caption"] = read_caption(members)
    for name in plan.fields:
        if name == GEOMETRY_FIELD:
            how = placed if task in ("detection", "segmentation") else placement_of(plan, extension, data, seed, members, crop)
            out.setdefault("fields", {})[name] = _geometry(how, flip, crop.size, image_size(extension, data), members)
        elif name != "key":
            out.setdefault("fields", {})[name] = field_value(name, members.get(name))
    return out


def read_polygons(members: dict[str, bytes], boxes: int) -> Polygons:
    """A sample's polygons, one entry per box (each empty without the member).

    Raises:
        TargetError: the member is not what the format says.
    """
    data = members.get(POLYGONS_MEMBER)
    if data is None:
        return [[] for _ in range(boxes)]
    try:
        return decode_polygons(data, boxes)
    except ValueError as exc:
        raise TargetError(str(exc)) from None


def _geometry(
    placed: Placement, flip: bool, size: int, sample_size: tuple[int, int], members: dict[str, bytes]
) -> dict[str, Any]:
    """Where a sample's output came from (`targets.boxes_to_source` maps predictions back with it).

    `placed` is the placement its pixels got: the C planner and `placement_of`
    draw the same crop from the same seed (tests/native/test_resample.py).
    """
    (left, top, width, height), (x, y, w, h) = placed
    record: dict[str, Any] = {
        "source_box": [left, top, left + width, top + height],
        "output_box": [x, y, x + w, y + h],
        "flip": bool(flip),
        "output_size": size,
        "sample_size": list(sample_size),
    }
    meta = field_value("json", members.get("json")) if "json" in members else None
    prepared = meta.get("geometry") if isinstance(meta, dict) else None
    if isinstance(prepared, dict):
        record["prepare"] = prepared
    return record


def stored_targets(
    members: dict[str, bytes],
    classes: int | None,
    size: tuple[int, int],
    task: str = "segmentation",
    ignore_index: int = DEFAULT_IGNORE_INDEX,
) -> dict[str, Any]:
    """What a stored sample holds besides its image and class, as the shard has it (no crop): for a look at it.

    `task` says what a mask's values are: class indices (segmentation), or
    a detection dataset's box class + 1 (0 background).

    Raises:
        TargetError: a target member is damaged.
    """
    found: dict[str, Any] = {}
    if BOXES_MEMBER in members:
        found["boxes"], found["box_labels"], crowd = read_boxes(members, classes)
        if crowd is not None:
            found["iscrowd"] = crowd
    if MASK_MEMBER in members:
        bound = classes + 1 if classes is not None and task == "detection" else classes
        found["mask"] = decode_mask(members[MASK_MEMBER], size, MASK_MEMBER, bound, ignore_index)
    if LABELS_MEMBER in members:
        found["labels"] = read_labels(members, classes)
    if TEXT_MEMBER in members:
        found["caption"] = read_caption(members)
    return found


def _placed_mask(mask: np.ndarray | None, placement: Placement, size: int, flip: bool, fill: int) -> np.ndarray:
    """A sample's mask after its placement in the `size` x `size` output, then its flip (all `fill` without a mask).

    The placement's box is resized nearest-neighbour into its destination;
    the rest of the output (letterbox padding) is `fill`, the ignore index.
    """
    dtype = np.uint16 if fill > 255 or (mask is not None and mask.dtype != np.uint8) else np.uint8
    if mask is None:
        return np.full((size, size), fill, dtype)
    box, (x, y, width, height) = placement
    cropped = crop_mask(mask, box, (width, height), fill)
    if (width, height) != (size, size):
        canvas = np.full((size, size), fill, dtype)
        canvas[y : y + height, x : x + width] = cropped
        cropped = canvas
    return np.ascontiguousarray(cropped[:, ::-1] if flip else cropped)


def field_value(name: str, data: bytes | None) -> Any:
    """An asked-for member as a batch gives it: text as str, json parsed, .npy an array, .cls an int, else bytes."""
    if data is None:
        return None
    if name == TEXT_MEMBER or name.endswith(".txt"):
        return read_caption({name: data}, name)
    if name == "json" or name.endswith(".json"):
        return read_json(data, name)  # bounded in size and depth, or TargetError
    if name.endswith("npy"):
        return read_npy(data, name)  # a plain numeric array, or TargetError
    if name == "cls" or name.endswith(".cls"):
        text = data.strip()
        return int(text) if len(text) <= MAX_CLS_DIGITS and text.isdigit() else text.decode("utf-8", "replace")
    return data


MAX_CLS_DIGITS = 19  # an int64: a longer run of digits is given as the text it is


# -- a batch -------------------------------------------------------------------


@dataclasses.dataclass
class Batch:
    """A batch of any task: `images, targets = batch`, or its fields by name.

    Attributes:
        images: [B, 3, H, W] on the loader's device, as a classification batch's.
        labels: [B] int64 class indices (-1 without a class); multi-label:
            [B, C] float32 multi-hot (C = the dataset's classes).
        keys: each sample's key in the shards (trace a batch back to its files).
        boxes: detection: per image, float32 [N_i, 4] XYXY pixel boxes in the crop.
        box_labels: detection: per image, int64 [N_i] class indices.
        iscrowd: detection, when the dataset has crowd flags: per image, uint8 [N_i].
        masks: segmentation: [B, H, W] int64 class indices (the ignore index where no class);
            detection, where the dataset has masks (`TaskPlan.masks`: painted
            from COCO's polygons/RLE): the same, box class c as c + 1, 0
            background, the ignore index for crowds (the manifest's
            `mask_classes` names them). One class mask per image, not one per
            instance, so it stays here and out of the `targets` dicts (which
            torchvision's Mask R-CNN would read as per-instance masks).
        captions: captions: per image, its text.
        fields: the members asked for with `fields=`, by name: a list with
            one value per sample (str, parsed json, an array, or bytes; None
            where a sample has none).
        task: which of `pipeline.targets.TASKS` this is.
        instance_masks: detection with instance maps: per image, [N_i, H, W] uint8, one per box (also in `targets`).
        polygons: detection with polygons: per image, per box, its polygons as float32 [K, 2]
            tensors of output pixels (also in `targets`). They stay on the CPU: many
            small arrays, rasterised or moved as a loss needs them.
        boxes_dropped: boxes of this batch dropped by the crop (under `min_visible` of their area left).
        images_emptied: images of this batch that had boxes and were left with none by the crop.
    """

    images: torch.Tensor
    labels: torch.Tensor
    keys: list[str]
    task: str = "classification"
    boxes: list[torch.Tensor] | None = None
    box_labels: list[torch.Tensor] | None = None
    iscrowd: list[torch.Tensor] | None = None
    masks: torch.Tensor | None = None
    captions: list[str] | None = None
    fields: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    boxes_dropped: int = 0
    images_emptied: int = 0
    instance_masks: list[torch.Tensor] | None = None
    polygons: list[list[list[torch.Tensor]]] | None = None

    @property
    def targets(self) -> Any:
        """What the task trains on: labels (classification, multi-label); a dict per image with
        "boxes" and "labels" (detection, as torchvision's detection models take them); masks
        (segmentation); captions."""
        if self.task == "detection":
            assert self.boxes is not None and self.box_labels is not None
            dicts: list[dict[str, Any]] = [{"boxes": b, "labels": lab} for b, lab in zip(self.boxes, self.box_labels)]
            if self.iscrowd is not None:
                for entry, crowd in zip(dicts, self.iscrowd):
                    entry["iscrowd"] = crowd
            if self.instance_masks is not None:
                for entry, masks in zip(dicts, self.instance_masks):
                    entry["masks"] = masks
            if self.polygons is not None:
                for entry, polygons in zip(dicts, self.polygons):
                    entry["polygons"] = polygons
            return dicts
        if self.task == "segmentation":
            return self.masks
        if self.task == "captions":
            return self.captions
        return self.labels

    def __iter__(self) -> Any:
        return iter((self.images, self.targets))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int | str) -> Any:
        if isinstance(index, str):
            if index in self.fields:
                return self.fields[index]
            name = {"txt": "captions", "caption": "captions", "key": "keys"}.get(index, index)
            if name in {f.name for f in dataclasses.fields(self)}:
                return getattr(self, name)
            raise KeyError(index)
        return (self.images, self.targets)[index]


def make_batch(
    plan: TaskPlan, images: torch.Tensor, labels: torch.Tensor, keys: list[str], targets: list[dict[str, Any]]
) -> Batch:
    """The batch the training loop gets, its targets on the images' device."""
    device = images.device
    batch = Batch(images, labels, list(keys), plan.task)
    if plan.task == "multilabel":
        count = plan.classes or 1 + max((max(t["labels"], default=-1) for t in targets), default=0)
        hot = torch.zeros((len(targets), count), dtype=torch.float32)
        for row, entry in enumerate(targets):
            if entry["labels"]:
                hot[row, torch.as_tensor(entry["labels"], dtype=torch.int64)] = 1.0
        batch.labels = hot.to(device)
    elif plan.task == "detection":
        batch.boxes = [torch.as_tensor(t["boxes"], dtype=torch.float32).to(device) for t in targets]
        batch.box_labels = [torch.as_tensor(t["box_labels"], dtype=torch.int64).to(device) for t in targets]
        if any("iscrowd" in t for t in targets):
            batch.iscrowd = [torch.as_tensor(t.get("iscrowd", np.zeros(len(t["boxes"]), np.uint8))).to(device) for t in targets]
        batch.boxes_dropped = sum(int(t.get("boxes_dropped", 0)) for t in targets)
        batch.images_emptied = sum(1 for t in targets if t.get("boxes_dropped") and not len(t["boxes"]))
        if plan.masks:
            batch.masks = torch.from_numpy(np.stack([np.asarray(t["mask"], dtype=np.int64) for t in targets])).to(device)
        if plan.instances:
            batch.instance_masks = [torch.from_numpy(np.ascontiguousarray(t["masks"])).to(device) for t in targets]
        if plan.polygons:
            batch.polygons = [
                [[torch.as_tensor(np.asarray(points, np.float32)).reshape(-1, 2) for points in parts] for parts in t["polygons"]]
                for t in targets
            ]
    elif plan.task == "segmentation":
        batch.masks = torch.from_numpy(np.stack([np.asarray(t["mask"], dtype=np.int64) for t in targets])).to(device)
    elif plan.task == "captions":
        batch.captions = [str(t["caption"]) for t in targets]
    for name in plan.fields:
        if name == "key":
            continue
        batch.fields[plan.field_names.get(name, name)] = [t.get("fields", {}).get(name) for t in targets]
    return batch


def tensors_in(delivered: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a delivered batch: a tensor, a tuple, list or dict of them, a `Batch` (a transform's output too)."""
    stack = [delivered]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, Batch):
            stack.extend(getattr(item, field.name) for field in dataclasses.fields(item))


def batch_size_of(delivered: Any) -> int:
    """The samples of a delivered batch: the first dimension of its first tensor (0 when it has none)."""
    if isinstance(delivered, tuple) and delivered and isinstance(delivered[0], torch.Tensor):
        return int(delivered[0].shape[0])  # (images, labels): no walk
    if isinstance(delivered, Batch):
        return int(delivered.images.shape[0])
    return next((int(t.shape[0]) for t in tensors_in(delivered) if t.dim()), 0)
