"""Pure image transforms: the five resize modes and seeded pre-augmentation.

Every output size is computed from the image's *original* upright size, never
from the (possibly DCT-reduced) decoded size, so the output does not depend on
which decoder happened to run. Augmentation is a pure function of
(seed, key, variant): re-running a job writes the same pixels.

Each transform also says where its output's pixels come from (`Geometry`,
in the original's upright pixels), so that a sample's boxes and masks go
through exactly what its image went through (`sample/targets.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any

import numpy as np

from .. import native
from ..decode import decoded_extent
from ..specs import AugmentSpec, ResizeSpec

_FILTERS = {"lanczos": "LANCZOS", "bicubic": "BICUBIC", "bilinear": "BILINEAR"}
PAD_FILL = (0, 0, 0)


def _filter(resize: ResizeSpec) -> Any:
    from PIL import Image

    return getattr(Image.Resampling, _FILTERS[resize.resample])


def required_scale(resize: ResizeSpec, augment: AugmentSpec, width: int, height: int) -> float:
    """The smallest decode scale (<= 1) that still gives the transform enough pixels."""
    if resize.mode == "none":
        return 1.0
    reference = min(width, height) if resize.mode in ("shorter", "center-crop") else max(width, height)
    needed = resize.size / reference
    if augment.variants:
        # A random crop keeps as little as sqrt(scale_min) of each side; decode enough for it.
        needed *= 1.15 / math.sqrt(augment.scale[0])
    return min(1.0, needed)


def output_size(resize: ResizeSpec, width: int, height: int) -> tuple[int, int]:
    """Size of the resized (uncropped, unpadded) picture for an original of width x height.

    transforms.v2's integer rule: the side given is S exactly and the other
    is truncated, as `v2.Resize(S)` (shorter, center-crop) and
    `v2.Resize(None, max_size=S)` (longer, pad) compute it (641x479 at 224:
    299x224).
    """
    if resize.mode == "none":
        return width, height
    short, long = min(width, height), max(width, height)
    by_shorter = resize.mode in ("shorter", "center-crop")
    if (resize.size >= (short if by_shorter else long)) and not resize.upscale:
        return width, height
    if by_shorter:
        new_short, new_long = resize.size, int(resize.size * long / short)
    else:
        new_short, new_long = int(resize.size * short / long), resize.size
    new_short, new_long = max(1, new_short), max(1, new_long)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def center_crop_box(resize: ResizeSpec, width: int, height: int) -> tuple[tuple[float, float, float, float], int]:
    """The part of a width x height original that `--mode center-crop` keeps, and the output's side.

    transforms.v2's `Resize(S)` then `CenterCrop(S)` as one box of the
    original: the resize's integer size (`output_size`), the crop's anchor
    rounded (`int(round((W' - S) / 2))`), mapped back by each axis's own scale.
    """
    new_w, new_h = output_size(resize, width, height)
    side = min(new_w, new_h)
    left, top = round((new_w - side) / 2), round((new_h - side) / 2)
    sx, sy = width / new_w, height / new_h
    return (left * sx, top * sy, (left + side) * sx, (top + side) * sy), side


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where an output picture's pixels come from: the map its sample's boxes and masks go through.

    Attributes:
        matrix: (a, b, c, d, e, f): the point (u, v) of the sampled picture
            comes from (a u + b v + c, d u + e v + f) of the original,
            upright, at full size (PIL's AFFINE convention).
        size: (width, height) of the sampled picture.
        flip: the sampled picture was then mirrored left to right.
        offset: (left, top) where it then sits on the output (padding).
        canvas: (width, height) of the output.
    """

    matrix: tuple[float, float, float, float, float, float]
    size: tuple[int, int]
    flip: bool = False
    offset: tuple[int, int] = (0, 0)
    canvas: tuple[int, int] = (0, 0)

    @property
    def axis_aligned(self) -> bool:
        """No rotation: a crop and a resize, which a mask takes as `targets.crop_mask` samples them."""
        return self.matrix[1] == 0 and self.matrix[3] == 0

    def to_dict(self) -> dict[str, Any]:
        """The geometry as a sample's json records it (the matrix at full precision: it reproduces the mask exactly)."""
        return {
            "matrix": list(self.matrix),
            "size": list(self.size),
            "flip": self.flip,
            "offset": list(self.offset),
            "canvas": list(self.canvas),
        }


def _pad_offset(size: tuple[int, int], resize: ResizeSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """(offset, canvas) of a picture of `size` once `_pad` has placed it (as `_pad` decides)."""
    side = resize.size
    if resize.mode != "pad" or size == (side, side) or size[0] > side or size[1] > side:
        return (0, 0), size
    return ((side - size[0]) // 2, (side - size[1]) // 2), (side, side)


def resize_geometry(original_size: tuple[int, int], resize: ResizeSpec) -> Geometry:
    """Where `resize_image`'s output pixels come from (the same for the YCbCr path, `transcode.py`).

    Args:
        original_size: upright (width, height) of the source file.
        resize: the resize settings.
    """
    width, height = original_size
    target_w, target_h = output_size(resize, width, height)
    if resize.mode == "center-crop":
        (x0, y0, x1, y1), side = center_crop_box(resize, width, height)
        matrix = ((x1 - x0) / side, 0.0, x0, 0.0, (y1 - y0) / side, y0)
        return Geometry(matrix, (side, side), canvas=(side, side))
    matrix = (width / target_w, 0.0, 0.0, 0.0, height / target_h, 0.0)
    offset, canvas = _pad_offset((target_w, target_h), resize)
    return Geometry(matrix, (target_w, target_h), offset=offset, canvas=canvas)


def resize_op(resize: ResizeSpec) -> dict[str, Any]:
    """The provenance record of a resize, as a sample's json lists it in `ops`."""
    return {"op": "resize", "mode": resize.mode, "size": resize.size}


def resize_image(
    img: Any, original_size: tuple[int, int], resize: ResizeSpec, pixels: np.ndarray | None = None, orientation: int = 1
) -> tuple[Any, dict[str, Any]]:
    """Apply `resize.mode` to a decoded image.

    Args:
        img: upright RGB PIL image, possibly DCT-reduced from `original_size`.
        original_size: upright (width, height) of the source file.
        resize: the resize settings.
        pixels: the RGBX array `img` maps, if any (`DecodedImage.pixels`).
        orientation: the EXIF orientation the decoder turned it upright by (`decode.decoded_extent`).

    Returns:
        (image, op) where op records what was done, for provenance.
    """
    width, height = original_size
    target_w, target_h = output_size(resize, width, height)
    op = resize_op(resize)
    # A DCT-scaled decode maps by M/8 exactly, from past its slack on an axis the orientation reversed.
    ox, oy, sx, sy = decoded_extent(width, height, img.width, img.height, orientation)
    if resize.mode == "center-crop":
        (x0, y0, x1, y1), side = center_crop_box(resize, width, height)
        return resized(img, (side, side), resize, (ox + x0 * sx, oy + y0 * sy, ox + x1 * sx, oy + y1 * sy), pixels), op
    if img.size != (target_w, target_h):
        whole = (ox, oy, ox + width * sx, oy + height * sy)  # the original's extent in the decoded pixels
        img = resized(img, (target_w, target_h), resize, whole, pixels)
    if resize.mode == "pad":
        img = _pad(img, resize.size)
    return img, op


def resized(
    img: Any,
    size: tuple[int, int],
    resize: ResizeSpec,
    box: tuple[float, float, float, float] | None = None,
    pixels: np.ndarray | None = None,
) -> Any:
    """`img` (box of it, default all) resized to `size` with the job's filter: `Image.resize`'s result.

    Under plain Pillow, an RGB or RGBX image (the decoder's padded form)
    goes through gpufeed's native resampler where it is here, 16-bit weights
    and AVX2, within the tolerance native.bindings.MIN_PSNR_DB states
    (tests/native/test_kernel_agreement.py). Pillow-SIMD resizes with that
    same arithmetic, and its Lanczos kernels are a little faster than the
    native ones: with it active, and for anything else or without the
    native library, PIL resizes. `pixels`, the RGBX array `img` maps, saves
    copying the image out; the result is then an RGBX image over its own
    array (encode_image writes RGB).
    """
    lib = native.library() if img.mode in ("RGB", "RGBX") and not _pillow_simd_active() else None
    if lib is None:
        return img.resize(size, _filter(resize), box=box)
    from PIL import Image

    if pixels is None or pixels.shape != (img.height, img.width, 4) or not pixels.flags.c_contiguous:
        pixels = np.frombuffer(img.tobytes("raw", "RGBX"), np.uint8)
    out = np.empty((size[1], size[0], 4), np.uint8)  # RGBX: the layout PIL maps without a copy
    out[:, :, 3] = 255  # the padding byte, as Pillow fills it: the same bytes every run
    whole = (0.0, 0.0, float(img.width), float(img.height))
    decoder = native.RegionDecoder(lib)
    decoder.resize_store(
        pixels.ctypes.data, img.size, box or whole, out[:, :, :3], native.PILLOW_SIMD, resample=resize.resample
    )
    return Image.frombuffer("RGBX", size, out, "raw", "RGBX", 0, 1)


@functools.lru_cache(maxsize=1)
def _pillow_simd_active() -> bool:
    """Whether the imported PIL is Pillow-SIMD's (its own resize is the fast one)."""
    import importlib.metadata

    import PIL

    try:
        return importlib.metadata.version("Pillow-SIMD") == PIL.__version__
    except importlib.metadata.PackageNotFoundError:
        return False


def _pad(img: Any, size: int) -> Any:
    from PIL import Image

    if img.size == (size, size) or img.width > size or img.height > size:
        return img
    canvas = Image.new("RGB", (size, size), PAD_FILL)
    canvas.paste(img, ((size - img.width) // 2, (size - img.height) // 2))
    return canvas


def variant_rng(seed: int, key: str, variant: int) -> np.random.Generator:
    """The random stream for one (seed, key, variant): stable across runs and machines."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, *words, variant])


def augment_image(
    img: Any,
    original_size: tuple[int, int],
    resize: ResizeSpec,
    augment: AugmentSpec,
    rng: np.random.Generator,
) -> tuple[Any, list[dict[str, Any]]]:
    """One augmented view: random-resized crop with a small rotation, flip, colour jitter.

    The crop box is drawn in original-image coordinates; crop, rotation and
    resize are one affine resampling of the (pre-reduced) decoded image.

    Returns:
        (image, ops) with every parameter drawn, for provenance.
    """
    image, ops, _ = augment_sample(img, original_size, resize, augment, rng)
    return image, ops


def augment_sample(
    img: Any,
    original_size: tuple[int, int],
    resize: ResizeSpec,
    augment: AugmentSpec,
    rng: np.random.Generator,
    orientation: int = 1,
) -> tuple[Any, list[dict[str, Any]], Geometry]:
    """`augment_image`, and the geometry of the view (what its boxes and masks go through).

    `orientation` is the EXIF orientation the decoder applied (`resize_image`).

    Returns:
        (image, ops, geometry); the image and ops are `augment_image`'s.
    """
    width, height = original_size
    cw, ch = _draw_crop(rng, width, height, augment)
    angle = float(rng.uniform(-augment.rotate, augment.rotate)) if augment.rotate else 0.0
    cw, ch, cx, cy = _fit_rotated(rng, width, height, cw, ch, angle)
    out_w, out_h = _crop_output_size(resize, cw, ch)
    img = _affine_crop(img, original_size, (cx, cy, cw, ch), angle, (out_w, out_h), resize, orientation)
    ops: list[dict[str, Any]] = [
        {
            "op": "random_resized_crop",
            "center": [round(cx, 2), round(cy, 2)],
            "size": [round(cw, 2), round(ch, 2)],
            "angle": round(angle, 3),
            "output": [out_w, out_h],
        }
    ]
    flip = bool(augment.flip and rng.random() < 0.5)
    if flip:
        from PIL import Image

        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        ops.append({"op": "hflip"})
    if augment.jitter:
        img, jitter_op = _colour_jitter(img, augment.jitter, rng)
        ops.append(jitter_op)
    if resize.mode == "pad":
        img = _pad(img, resize.size)
    offset, canvas = _pad_offset((out_w, out_h), resize)
    geometry = Geometry(_crop_matrix((cx, cy, cw, ch), angle, (out_w, out_h)), (out_w, out_h), flip, offset, canvas)
    return img, ops, geometry


def _crop_matrix(
    box: tuple[float, float, float, float], angle: float, out_size: tuple[int, int]
) -> tuple[float, float, float, float, float, float]:
    """`_affine_crop`'s map in the original's full-size pixels: output (u, v) -> original (x, y)."""
    cx, cy, cw, ch = box
    out_w, out_h = out_size
    theta = math.radians(angle)
    cos, sin = math.cos(theta), math.sin(theta)
    ax, ay = cw / out_w, ch / out_h
    a, b, d, e = cos * ax, -sin * ay, sin * ax, cos * ay
    return (a, b, cx - a * out_w / 2 - b * out_h / 2, d, e, cy - d * out_w / 2 - e * out_h / 2)


def _draw_crop(rng: np.random.Generator, width: int, height: int, augment: AugmentSpec) -> tuple[float, float]:
    area = width * height
    log_low, log_high = math.log(augment.ratio[0]), math.log(augment.ratio[1])
    for _ in range(10):
        target = area * rng.uniform(*augment.scale)
        ratio = math.exp(rng.uniform(log_low, log_high))
        cw, ch = math.sqrt(target * ratio), math.sqrt(target / ratio)
        if cw <= width and ch <= height:
            return cw, ch
    side = min(width, height)  # like torchvision: fall back to a centred square
    return float(side), float(side)


def _fit_rotated(
    rng: np.random.Generator, width: int, height: int, cw: float, ch: float, angle: float
) -> tuple[float, float, float, float]:
    # Shrink the crop until its rotated corners stay inside the image, then
    # place its centre uniformly where it fits: no black corners.
    cos, sin = abs(math.cos(math.radians(angle))), abs(math.sin(math.radians(angle)))
    half_x = (cw * cos + ch * sin) / 2
    half_y = (cw * sin + ch * cos) / 2
    shrink = min(1.0, (width / 2) / half_x, (height / 2) / half_y)
    cw, ch, half_x, half_y = cw * shrink, ch * shrink, half_x * shrink, half_y * shrink
    cx = rng.uniform(half_x, width - half_x) if width - half_x > half_x else width / 2
    cy = rng.uniform(half_y, height - half_y) if height - half_y > half_y else height / 2
    return cw, ch, float(cx), float(cy)


def _crop_output_size(resize: ResizeSpec, cw: float, ch: float) -> tuple[int, int]:
    if resize.mode == "center-crop":
        side = resize.size if (resize.upscale or min(cw, ch) >= resize.size) else int(min(cw, ch))
        return max(1, side), max(1, side)
    width, height = output_size(resize, max(1, round(cw)), max(1, round(ch)))
    return width, height


def _affine_crop(
    img: Any,
    original_size: tuple[int, int],
    box: tuple[float, float, float, float],
    angle: float,
    out_size: tuple[int, int],
    resize: ResizeSpec,
    orientation: int = 1,
) -> Any:
    from PIL import Image

    cx, cy, cw, ch = box
    ox, oy, sx, sy = decoded_extent(*original_size, img.width, img.height, orientation)
    # Affine sampling does not anti-alias: first reduce so that the crop is at
    # most ~1.5x the output, with a proper filter.
    shrink = min(cw * sx / out_size[0], ch * sy / out_size[1]) / 1.5
    if shrink > 1:
        small = (max(1, round(img.width / shrink)), max(1, round(img.height / shrink)))
        img = resized(img, small, resize, (ox, oy, ox + original_size[0] * sx, oy + original_size[1] * sy))
        ox, oy, sx, sy = 0.0, 0.0, img.width / original_size[0], img.height / original_size[1]
    out_w, out_h = out_size
    theta = math.radians(angle)
    cos, sin = math.cos(theta), math.sin(theta)
    # Output pixel (u, v) -> crop-local offset -> rotate -> decoded-image coordinates.
    ax, ay = cw / out_w, ch / out_h
    a, b = cos * ax * sx, -sin * ay * sx
    d, e = sin * ax * sy, cos * ay * sy
    c = ox + cx * sx - a * out_w / 2 - b * out_h / 2
    f = oy + cy * sy - d * out_w / 2 - e * out_h / 2
    return img.transform((out_w, out_h), Image.Transform.AFFINE, (a, b, c, d, e, f), Image.Resampling.BICUBIC)


def _colour_jitter(img: Any, strength: float, rng: np.random.Generator) -> tuple[Any, dict[str, Any]]:
    from PIL import ImageEnhance

    factors = {name: float(rng.uniform(1 - strength, 1 + strength)) for name in ("brightness", "contrast", "saturation")}
    img = ImageEnhance.Brightness(img).enhance(factors["brightness"])
    img = ImageEnhance.Contrast(img).enhance(factors["contrast"])
    img = ImageEnhance.Color(img).enhance(factors["saturation"])
    return img, {"op": "colour_jitter", **{k: round(v, 4) for k, v in factors.items()}}
