"""`make_loader(augment=[...])`: the augmentation as a list of ops, and the loader settings it comes to.

Each op says what it does to the pixels and to the boxes, masks and
polygons that go with them:

    RandomResizedCrop(scale, ratio)  a random part of the image (area fraction `scale`, aspect `ratio`),
                                     resized to the output: boxes cropped and scaled (cut below
                                     `min_visible` of their area: dropped), masks and polygons likewise
    Letterbox()                      the whole image, its ratio kept, centred and padded with `fill`
    ScaleJitter(low, high)           the letterboxed size times a random scale, then a random window or padding
    IoUCrop()                        SSD's random crop with a minimum IoU with the boxes
    Mosaic(p, n)                     four images in a 2S x 2S canvas around a random centre (probability p),
                                     or nine in a grid (n=9): boxes, masks and polygons placed with their
                                     image, boxes cut and polygons' points clamped to the canvas
    RandomAffine(degrees, translate, scale, shear, perspective)
                                     ultralytics' random perspective of the (mosaic) canvas into the output;
                                     boxes, polygons and masks (nearest) through the same matrix, cut to the
                                     output, a box with polygons the box around them; filtered as its
                                     `box_candidates`
    Flip(horizontal, vertical)       mirrors, each with its probability: boxes, masks and polygons mirrored
    HSV(hue, saturation, value)      ultralytics' colour gains (OpenCV's 8-bit HSV arithmetic)
    ColorJitter(brightness, contrast, saturation, hue)
                                     torchvision's colour jitter, factors and order drawn per image;
                                     with either kind of recipe, after its own colours (boxes unchanged)
    MixUp(p)                         blend with another output of the batch (r ~ Beta(32, 32)), boxes, box
                                     masks and polygons joined; a class mask keeps what both agree on
    CutMix(p)                        another output's patch pasted where the image has no box, its boxes,
                                     masks and polygons there

The geometric ops of one output are one matrix per source image, rendered
once (`pipeline.augment.render`); the photometric and mixing ops run per
batch (on a CPU device the photometric ones per image, in the decode
workers). Not every list is a recipe the loader runs: one placement
(RandomResizedCrop, Letterbox, ScaleJitter, IoUCrop) with a horizontal
Flip(0.5), or ultralytics' family (Mosaic, RandomAffine, Flip, HSV,
MixUp, CutMix, in that order; a missing op is off), either with at most
one ColorJitter. Anything else is refused with the reason, never run
another way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from .affine import RandomAffine
from .color import ColorJitter
from .hsv import HSV
from .mosaic import Mosaic


@dataclasses.dataclass(frozen=True)
class RandomResizedCrop:
    """A random part of the image (area fraction in `scale`, aspect ratio in `ratio`), resized to the output."""

    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)


@dataclasses.dataclass(frozen=True)
class Letterbox:
    """The whole image, its ratio kept, centred in the output and padded with `fill` (YOLO's)."""


@dataclasses.dataclass(frozen=True)
class ScaleJitter:
    """Large-scale jitter: the letterboxed size times a random scale in [low, high], then a random window."""

    low: float = 0.1
    high: float = 2.0


@dataclasses.dataclass(frozen=True)
class IoUCrop:
    """SSD's random crop: a window whose IoU with the boxes is at least a drawn minimum."""


@dataclasses.dataclass(frozen=True)
class Flip:
    """Mirrors: left-right with probability `horizontal`, upside down with probability `vertical`."""

    horizontal: float = 0.5
    vertical: float = 0.0


@dataclasses.dataclass(frozen=True)
class MixUp:
    """With probability `p`, blended with another output of the batch by r ~ Beta(32, 32); boxes joined."""

    p: float = 0.1


@dataclasses.dataclass(frozen=True)
class CutMix:
    """With probability `p`, given another output's patch where it has no box, and that output's boxes there."""

    p: float = 0.1


PLACEMENTS = (RandomResizedCrop, Letterbox, ScaleJitter, IoUCrop)
YOLO_FAMILY = (Mosaic, RandomAffine, Flip, HSV, MixUp, CutMix)  # ultralytics' order


def loader_settings(ops: Sequence[Any]) -> dict[str, Any]:
    """The `make_loader` settings an op list comes to: `recipe` and its parameters (`scale`, `ratio`, `flip`,
    `jitter`, or recipe="yolo"'s `hyp`), and `color_jitter` where a ColorJitter is in it.

    Raises:
        ConfigError: an op the loader does not know, or a list that is no recipe it runs (the reason).
    """
    ops = list(ops)
    for op in ops:
        if not isinstance(op, PLACEMENTS + YOLO_FAMILY + (ColorJitter,)):
            known = ", ".join(kind.__name__ for kind in PLACEMENTS + YOLO_FAMILY + (ColorJitter,))
            raise ConfigError(f"augment: {op!r} is not an op of pipeline.augment (they are {known})")
    jitters = [op for op in ops if isinstance(op, ColorJitter)]
    if len(jitters) > 1:
        raise ConfigError(f"augment: {_names(ops)}: at most one ColorJitter")
    ops = [op for op in ops if not isinstance(op, ColorJitter)]
    if not ops:
        raise ConfigError("augment: give at least one op besides ColorJitter (a placement such as Letterbox(), "
                          "or Mosaic() ...)")  # fmt: skip
    placements = [op for op in ops if isinstance(op, PLACEMENTS)]
    settings = _placement_settings(ops, placements) if placements else _yolo_settings(ops)
    if jitters:
        jitter = jitters[0]
        settings["color_jitter"] = (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue)
    return settings


def _placement_settings(ops: list[Any], placements: list[Any]) -> dict[str, Any]:
    others = [op for op in ops if not isinstance(op, PLACEMENTS + (Flip,))]  # ColorJitter is taken out already
    flips = [op for op in ops if isinstance(op, Flip)]
    if len(placements) > 1 or others or len(flips) > 1:
        raise ConfigError(
            f"augment: {_names(ops)} is not a recipe the loader runs: one placement (RandomResizedCrop, Letterbox, "
            "ScaleJitter or IoUCrop) with at most a Flip; Mosaic, RandomAffine, HSV, MixUp and CutMix go together "
            "without a placement (ultralytics' recipe)"
        )
    flip = flips[0] if flips else Flip(horizontal=0.0)
    if flip.vertical or flip.horizontal not in (0.0, 0.5):
        raise ConfigError(f"augment: with {type(placements[0]).__name__}, Flip mirrors left-right with probability "
                          f"0.5 or not at all (vertical=0), not {flip}")  # fmt: skip
    placement = placements[0]
    settings: dict[str, Any] = {"flip": flip.horizontal > 0}
    if isinstance(placement, RandomResizedCrop):
        settings.update(recipe="crop", scale=tuple(placement.scale), ratio=tuple(placement.ratio))
    elif isinstance(placement, Letterbox):
        settings.update(recipe="letterbox")
    elif isinstance(placement, ScaleJitter):
        settings.update(recipe="scale_jitter", jitter=(placement.low, placement.high))
    else:
        settings.update(recipe="iou_crop")
    return settings


def _yolo_settings(ops: list[Any]) -> dict[str, Any]:
    order = [YOLO_FAMILY.index(type(op)) for op in ops]
    if order != sorted(set(order)):
        raise ConfigError(
            f"augment: {_names(ops)}: ultralytics' recipe runs Mosaic, RandomAffine, Flip, HSV, MixUp, CutMix in "
            "that order, each at most once; list them so"
        )
    found = {type(op): op for op in ops}
    mosaic = found.get(Mosaic)
    affine = found.get(RandomAffine, RandomAffine(degrees=0.0, translate=0.0, scale=0.0))
    flip = found.get(Flip, Flip(horizontal=0.0))
    hsv = found.get(HSV, HSV(0.0, 0.0, 0.0))
    hyp = {
        "mosaic": mosaic.p if mosaic is not None else 0.0, "mosaic_n": mosaic.n if mosaic is not None else 4,
        "degrees": affine.degrees, "translate": affine.translate,
        "scale": affine.scale, "shear": affine.shear, "perspective": affine.perspective, "fliplr": flip.horizontal,
        "flipud": flip.vertical, "hsv_h": hsv.hue, "hsv_s": hsv.saturation, "hsv_v": hsv.value,
        "mixup": found[MixUp].p if MixUp in found else 0.0, "cutmix": found[CutMix].p if CutMix in found else 0.0,
    }  # fmt: skip
    return {"recipe": "yolo", "hyp": hyp}


def _names(ops: list[Any]) -> str:
    return "[" + ", ".join(type(op).__name__ for op in ops) + "]"
