"""The YOLO recipe's decode piece: each output a mosaic of its sample and three partners, rendered once per source.

With `recipe="yolo"` in train mode, each position of a decode piece draws,
from its own seed, three partners among the piece's samples (ultralytics
draws them from the images it read last), plans its output
(`pipeline.augment.yolo.plan`: mosaic, random affine, flips, HSV gains),
renders it (`render_jpegs`, from the piece's pictures, each decoded whole
once for all the mosaics that show it) into its slot, applies the HSV
gains (native code; on CUDA they go with the targets to the device) and
takes the plan's boxes (and, where the dataset has them, each box's
polygons) as its targets. A dataset's masks (`mask.png`, `instances.png`)
are sampled nearest through the same matrices (`pipeline.augment.masks`):
"mask" the output's classes, "masks" each kept box's own. A sample or
partner whose file or targets are damaged fails the position, which the
damage policy replaces.

The flips are the plan's (`fliplr`), so the device mirrors nothing; the
partners are the piece's, so a batch's mosaics depend on how many workers
split it (the same worker count gives the same epoch).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import native
from ..augment.affine import RandomAffine
from ..augment.hsv import HSV, hsv_in_place
from ..augment.masks import class_mask, instance_masks
from ..augment.mosaic import Mosaic
from ..augment.render import decode_whole, render, render_jpegs
from ..augment.yolo import Plan, YoloRecipe, plan
from ..decode import open_image
from ..errors import DecodeError
from ..polygons import Polygons
from ..targets import INSTANCES_MEMBER, MASK_MEMBER, TargetError, read_boxes
from .cpu_decode import image_size
from .crops import Affine, CropSpec, is_planar
from .damage import Extras
from .hooks import run_sample_transform
from .slot_pixels import region_decoder
from .tasks import TaskPlan, decode_mask, field_value, read_polygons

DEFAULT_RECIPE = YoloRecipe()
HSV_GAINS = "hsv_gains"  # a target's key: the gains the device applies to the batch (`hsv_in_workers=False`)
MOSAIC_PLAN = "mosaic_plan"  # a target's key: (Plan, piece positions of its tiles' pictures) the device renders


def yolo_recipe(crop: CropSpec) -> YoloRecipe:
    """Ultralytics' recipe with the loader's hyperparameters (`crop.hyp`, else its defaults) at the loader's
    output size and fill; no horizontal flips without `crop.flip`, no mosaic where `crop.mosaic` is off, and no
    copy-paste then either (ultralytics' `close_mosaic` turns both off)."""
    hyp = {name: float(value) for name, value in crop.hyp}
    defaults = DEFAULT_RECIPE
    mosaic = hyp.get("mosaic", 1.0)
    affine = RandomAffine(
        degrees=hyp.get("degrees", defaults.affine.degrees), translate=hyp.get("translate", defaults.affine.translate),
        scale=hyp.get("scale", defaults.affine.scale), shear=hyp.get("shear", defaults.affine.shear),
        perspective=hyp.get("perspective", defaults.affine.perspective),
    )  # fmt: skip
    assert defaults.hsv is not None
    gains = (hyp.get("hsv_h", defaults.hsv.hue), hyp.get("hsv_s", defaults.hsv.saturation),
             hyp.get("hsv_v", defaults.hsv.value))  # fmt: skip
    return YoloRecipe(
        size=crop.size, fill=crop.fill, mosaic=Mosaic(p=mosaic, n=int(hyp.get("mosaic_n", 4))) if crop.mosaic and mosaic > 0 else None, affine=affine,
        fliplr=hyp.get("fliplr", defaults.fliplr) if crop.flip else 0.0, flipud=hyp.get("flipud", defaults.flipud),
        hsv=HSV(*gains) if any(gains) else None, copy_paste=hyp.get("copy_paste", defaults.copy_paste) if crop.mosaic else 0.0,
    )  # fmt: skip


def mosaic_decoder(crop: CropSpec) -> Any:
    """The region decoder the mosaics read their JPEGs with (None: decode with PIL, as decoder="pil" asks)."""
    return region_decoder() if crop.decoder == "region" else None


@dataclasses.dataclass
class PieceMemo:
    """What the mosaics of one decode piece share, by position: each picture decoded whole once (ultralytics'
    buffer of recent images, kept decoded, does the same), each sample's size and boxes read once."""

    pictures: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    facts: dict[int, tuple[tuple[int, int], np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    polygons: dict[int, Polygons] = dataclasses.field(default_factory=dict)
    masks: dict[int, np.ndarray | None] = dataclasses.field(default_factory=dict)
    instances: dict[int, np.ndarray | None] = dataclasses.field(default_factory=dict)


def mosaic_into(
    plan_of: TaskPlan,
    crop: CropSpec,
    recipe: YoloRecipe,
    items: Sequence[tuple[str, bytes, int]],
    extras: Sequence[Extras],
    position: int,
    key: str,
    slot: np.ndarray,
    affine: Affine | None,
    decoder: Any,
    memo: PieceMemo | None = None,
) -> dict[str, Any]:
    """`yolo_sample` of `position`, written into its batch `slot` (`write_slot`): its targets.

    Raises:
        TargetError, DecodeError: its sample or a partner is damaged (the slot is left as it was).
    """
    size = crop.size
    if affine is None and slot.dtype == np.uint8 and slot.shape == (3, size, size) and slot.flags.c_contiguous:
        # every picture is decoded before the first pixel is written: a damaged one leaves the slot as it was
        return yolo_sample(plan_of, recipe, items, extras, position, key, slot, decoder, memo, crop.hsv_in_workers)
    pixels = np.empty((3, size, size), np.uint8)
    targets = yolo_sample(plan_of, recipe, items, extras, position, key, pixels, decoder, memo, crop.hsv_in_workers)
    write_slot(pixels, slot, affine)
    return targets


def yolo_sample(
    plan_of: TaskPlan,
    recipe: YoloRecipe,
    items: Sequence[tuple[str, bytes, int]],
    extras: Sequence[Extras],
    position: int,
    key: str,
    out: np.ndarray | None,
    decoder: Any = None,
    memo: PieceMemo | None = None,
    hsv_in_workers: bool = True,
) -> dict[str, Any]:
    """Position `position`'s output rendered into `out` (uint8 [3, S, S]) and its targets.

    `memo` keeps what the piece's outputs share (`PieceMemo`): a picture is decoded once however many
    mosaics of the piece show it. Every picture is decoded before `out` is written. `hsv_in_workers=False`
    leaves the HSV gains to the device: they go with the targets (`HSV_GAINS`). `out=None` decodes and
    renders nothing: the plan and the piece positions of its tiles' pictures go with the targets
    (`MOSAIC_PLAN`), for the device to decode and render (decoder="nvjpeg"), and so do the HSV gains.

    Raises:
        TargetError, DecodeError: its sample or a partner is damaged.
    """
    memo = memo if memo is not None else PieceMemo()
    extension, data, seed = items[position]
    rng = random.Random(seed)
    chosen = [position] + [rng.randrange(len(items)) for _ in range(recipe.sources - 1)]
    sizes, boxes, labels = [], [], []
    for index in chosen:
        facts = memo.facts.get(index)
        if facts is None:
            found, found_labels, _ = read_boxes(extras[index] or {}, plan_of.classes)
            if plan_of.polygons:  # each box's polygons, checked against the boxes, read once too
                memo.polygons[index] = read_polygons(extras[index] or {}, len(found))
            facts = memo.facts[index] = (image_size(items[index][0], items[index][1]), found.astype(np.float64),
                                         found_labels)  # fmt: skip
        sizes.append(facts[0])
        boxes.append(facts[1])
        labels.append(facts[2])
    shapes = [memo.polygons[index] for index in chosen] if plan_of.polygons else None
    made = plan(recipe, rng, sizes, boxes, labels, polygons=shapes)
    shown = chosen[: len(made.tiles)]
    masks = _masks(plan_of, made, items, extras, shown, [len(b) for b in boxes], memo)  # read before a pixel is written
    if out is not None:
        _render_into(made, items, shown, out, decoder, memo)
    total = sum(len(b) for b in boxes[: len(made.tiles)])
    targets: dict[str, Any] = {"boxes": made.boxes, "box_labels": made.labels, "boxes_dropped": total - len(made.boxes)}
    if made.polygons is not None:
        targets["polygons"] = made.polygons
    targets.update(masks)
    if out is None:
        targets[MOSAIC_PLAN] = (made, shown)
    if made.hsv_gains is not None and hsv_in_workers and out is not None:
        hsv_in_place(out, made.hsv_gains)
    elif made.hsv_gains is not None:
        targets[HSV_GAINS] = made.hsv_gains  # the device applies them to the batch
    for name in plan_of.fields:
        if name != "key":
            targets.setdefault("fields", {})[name] = field_value(name, (extras[position] or {}).get(name))
    if plan_of.sample_transform is not None and out is not None:
        run_sample_transform(plan_of, out, key, targets)
    return targets


def _render_into(made: Plan, items: Sequence[tuple[str, bytes, int]], shown: list[int], out: np.ndarray, decoder: Any,
                 memo: PieceMemo) -> None:  # fmt: skip
    """The plan's pixels into `out`: its JPEGs decoded whole once per piece (`memo`) by the region decoder, other
    pictures by PIL.

    Raises:
        DecodeError: a picture does not decode.
    """
    try:
        if decoder is not None and all(items[index][0] in ("jpg", "jpeg") for index in shown):
            for index in shown:
                if index not in memo.pictures:
                    memo.pictures[index] = decode_whole(decoder, items[index][1])
            render_jpegs(made, [items[index][1] for index in shown], out=out, decoder=decoder,
                         decoded=[memo.pictures[index] for index in shown])  # fmt: skip
        else:
            render(made, [np.asarray(rgb_picture(items[index][0], items[index][1])) for index in shown], out=out)
    except native.RegionError as exc:
        raise DecodeError(f"cannot decode .jpg sample: {exc}") from None


def _masks(
    plan_of: TaskPlan,
    made: Plan,
    items: Sequence[tuple[str, bytes, int]],
    extras: Sequence[Extras],
    shown: list[int],
    counts: list[int],
    memo: PieceMemo,
) -> dict[str, np.ndarray]:
    """The output's "mask" (class indices, `TaskPlan.masks`) and "masks" (one per kept box, `TaskPlan.instances`),
    each source's sampled through the plan (`pipeline.augment.masks`); a source without its member gives the
    ignore index (class) or empty masks (its boxes'), as the letterbox path does."""
    found: dict[str, np.ndarray] = {}
    if plan_of.masks:
        bound = plan_of.classes + 1 if plan_of.classes is not None else None  # box class c is c + 1, 0 background
        maps = [
            _member_map(memo.masks, index, items, extras, MASK_MEMBER, bound, plan_of.ignore_index) for index in shown
        ]
        found["mask"] = class_mask(made, maps, plan_of.ignore_index)
    if plan_of.instances:
        maps = [_member_map(memo.instances, index, items, extras, INSTANCES_MEMBER, counts[tile] + 1, None)
                for tile, index in enumerate(shown)]  # fmt: skip
        found["masks"] = instance_masks(made, maps, counts[: len(shown)])
    return found


def _member_map(
    kept: dict[int, np.ndarray | None],
    index: int,
    items: Sequence[tuple[str, bytes, int]],
    extras: Sequence[Extras],
    member: str,
    bound: int | None,
    ignore: int | None,
) -> np.ndarray | None:
    """Sample `index`'s mask member decoded and checked once per piece (None: the sample has none)."""
    if index not in kept:
        members = extras[index] or {}
        extension, data, _ = items[index]
        kept[index] = (
            decode_mask(members[member], image_size(extension, data), member, bound, ignore)
            if member in members
            else None
        )
    return kept[index]


def stand_in_mosaic(
    plan_of: TaskPlan, crop: CropSpec, item: tuple[str, bytes, int], extras: Extras, key: str, into: np.ndarray,
    affine: Affine | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """The error policy's stand-in for a failed output: a mosaic of the stand-in alone (its own partners), written
    into `into` (`mosaic_into`); its targets, or None where it is damaged too."""
    try:
        return mosaic_into(plan_of, crop, yolo_recipe(crop), [item], [extras or {}], 0, key, into, affine,
                           mosaic_decoder(crop))  # fmt: skip
    except (TargetError, DecodeError):
        return None


def rgb_picture(extension: str, data: bytes) -> Any:
    """A picture decoded by PIL, upright RGB (a PIL image).

    Raises:
        DecodeError: it does not decode.
    """
    try:
        image = open_image(data)
        return image.convert("RGB")
    except DecodeError:
        raise
    except Exception as exc:  # PIL raises many types for broken data
        raise DecodeError(f"cannot decode .{extension} sample: {str(exc)[:160] or type(exc).__name__}") from None


def write_slot(pixels: np.ndarray, slot: np.ndarray, affine: Affine | None) -> None:
    """A rendered uint8 [3, S, S] output into its slot: the ring's uint8, or the CPU finish's (float, any layout)."""
    view = pixels if is_planar(slot) else pixels.transpose(1, 2, 0)
    if affine is None:
        slot[...] = view
        return
    shape = (3, 1, 1) if is_planar(slot) else (3,)
    slot[...] = view * affine.scale.reshape(shape) + affine.shift.reshape(shape)
