"""ColorJitter: brightness, contrast, saturation and hue, each image its own factors and order, on a uint8 batch.

The arithmetic of torchvision's `transforms.v2.ColorJitter` on uint8
images, per image: a random order of the four adjustments; brightness
scales the pixels, contrast blends them with their grey mean, saturation
with their own grey, each in floats and truncated back to uint8; hue moves
the hue of the float HSV picture and converts back (x 255.999, truncated).
An adjustment whose range is 0 is not drawn and not run (torchvision's
None). The draws come from the loader's generator, per image; the pixels
change on the training device, a batch at a time (`jitter_batch`), or on a
CPU device in the decode workers, an image at a time (`jitter_image`): the
same arithmetic, so the same pixels. The contrast's grey mean is summed
exactly (whole grey levels in float64), whatever the order of the sum.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

GREY = (0.2989, 0.587, 0.114)  # ITU-R 601-2 luma, as torchvision's rgb_to_grayscale
ADJUSTMENTS = ("brightness", "contrast", "saturation", "hue")

Draw = tuple[tuple[int, ...], tuple[float | None, ...]]  # one image's order and factors (`ColorJitter.draw`)


@dataclasses.dataclass(frozen=True)
class ColorJitter:
    """Factors drawn per image: brightness, contrast and saturation in [max(0, 1 - x), 1 + x], hue in [-h, h]
    (h at most 0.5), in a random order (torchvision's `ColorJitter`). Boxes, masks and polygons: unchanged."""

    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    hue: float = 0.0

    def __post_init__(self) -> None:
        for name in ADJUSTMENTS:
            value = getattr(self, name)
            top = 0.5 if name == "hue" else 1e6
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= top:
                raise ValueError(f"ColorJitter({name}={value!r}): a number from 0 to {top:g}")

    @property
    def active(self) -> bool:
        return any(getattr(self, name) for name in ADJUSTMENTS)

    def draw(self, rng: np.random.Generator) -> Draw:
        """One image's order (a permutation of the four adjustments) and factors (None: not run)."""
        order = tuple(int(i) for i in rng.permutation(4))
        factors: list[float | None] = []
        for name in ADJUSTMENTS:
            spread = float(getattr(self, name))
            if not spread:
                factors.append(None)
            elif name == "hue":
                factors.append(float(rng.uniform(-spread, spread)))
            else:
                factors.append(float(rng.uniform(max(0.0, 1.0 - spread), 1.0 + spread)))
        return order, tuple(factors)


def jitter_batch(images: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
    """uint8 images [B, 3, H, W], each with its draw (`ColorJitter.draw`) applied: a new uint8 tensor."""
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3 or len(draws) != images.shape[0]:
        raise ValueError(f"jitter_batch takes uint8 [B, 3, H, W] images and B draws, not {images.dtype} "
                         f"{tuple(images.shape)} and {len(draws)}")  # fmt: skip
    out = images.clone()
    for step in range(4):
        for adjustment in range(4):
            chosen = [i for i, (order, factors) in enumerate(draws) if order[step] == adjustment and factors[adjustment] is not None]
            if not chosen:
                continue
            index = torch.tensor(chosen, device=images.device)
            factor = torch.tensor([draws[i][1][adjustment] for i in chosen], dtype=torch.float32, device=images.device)
            out[index] = _ADJUST[adjustment](out[index], factor.view(-1, 1, 1, 1))
    return out


def jitter_image(image: torch.Tensor, draw: Draw) -> torch.Tensor:
    """One uint8 image [3, H, W] with its draw applied: what `jitter_batch` makes of it, a new uint8 tensor
    (the image itself where the draw runs nothing)."""
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"jitter_image takes a uint8 [3, H, W] image, not {image.dtype} {tuple(image.shape)}")
    order, factors = draw
    out = image.unsqueeze(0)
    for adjustment in order:
        factor = factors[adjustment]
        if factor is not None:
            out = _ADJUST[adjustment](out, torch.tensor(factor, dtype=torch.float32).view(1, 1, 1, 1))
    return out[0]


def _blend(image: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    return image.mul(ratio).add_(other * (1.0 - ratio)).clamp_(0, 255).to(torch.uint8)


def _grey(image: torch.Tensor) -> torch.Tensor:
    red, green, blue = image.unbind(dim=-3)
    return red.mul(GREY[0]).add_(green, alpha=GREY[1]).add_(blue, alpha=GREY[2]).floor_().unsqueeze(dim=-3)


def _brightness(image: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return image.mul(factor).clamp_(0, 255).to(torch.uint8)


def _contrast(image: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    grey = _grey(image)  # whole levels: their float64 sum is exact, so the mean is one rounding of the true one
    total = grey.sum(dim=(-3, -2, -1), keepdim=True, dtype=torch.float64)
    return _blend(image, total.div_(grey[0].numel()).to(torch.float32), factor)


def _saturation(image: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(image, _grey(image), factor)


def _hue(image: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    hue, saturation, value = _to_hsv(image.to(torch.float32).mul_(1.0 / 255))
    hue = hue.add_(shift.view(-1, 1, 1)).remainder_(1.0)
    return _to_rgb(hue, saturation, value).mul_(255.0 + 1.0 - 1e-3).to(torch.uint8)


def _to_hsv(rgb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float RGB in [0, 1] -> hue in [0, 1), saturation, value (Pillow's formulas, as torchvision's)."""
    red, green, _ = rgb.unbind(dim=-3)
    low, high = torch.aminmax(rgb, dim=-3)
    grey = high == low
    spread = high - low
    ones = torch.ones_like(high)
    saturation = spread / torch.where(grey, ones, high)
    # each channel's distance from the top, in units of the spread (any value where all three are equal)
    rc, gc, bc = ((high.unsqueeze(dim=-3) - rgb) / torch.where(grey, ones, spread).unsqueeze(dim=-3)).unbind(dim=-3)
    not_red, is_green = high != red, high == green
    hue = bc.sub(gc).mul_(~not_red)
    hue = hue.add_(rc.add(2.0).sub_(bc).mul_(is_green & not_red))
    hue = hue.add_(gc.add(4.0).sub_(rc).mul_(not_red & ~is_green))
    return hue.mul_(1.0 / 6.0).add_(1.0).fmod_(1.0), saturation, high


def _to_rgb(hue: torch.Tensor, saturation: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    sixths = hue.mul(6)
    sector = torch.floor(sixths)
    frac = sixths.sub_(sector)
    sector = sector.to(torch.int64).remainder_(6)
    sf = saturation * frac
    q = (1.0 - sf).mul_(value).clamp_(0.0, 1.0)
    t = sf.add_(1.0 - saturation).mul_(value).clamp_(0.0, 1.0)
    p = (1.0 - saturation).mul_(value).clamp_(0.0, 1.0)
    vpqt = torch.stack((value, p, q, t), dim=-3)  # which of them each channel takes in each sector:
    pick = torch.tensor([[0, 2, 1, 1, 3, 0], [3, 0, 0, 2, 1, 1], [1, 1, 3, 0, 0, 2]], device=hue.device)[:, sector]
    return vpqt.gather(-3, pick.movedim(0, -3))


_ADJUST = (_brightness, _contrast, _saturation, _hue)
