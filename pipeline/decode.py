"""Decode any image file into an upright RGB picture, or say why not.

`decode_image` is the single entry for hostile input: it applies EXIF
orientation, converts every PIL mode to RGB (alpha composited on a
background), refuses decompression bombs before decoding, opens only the
raster formats in DECODE_FORMATS (never EPS/Ghostscript and the like), and
turns every failure into a `DecodeError` whose reason ends up in
rejected.jsonl ("corrupt or truncated PNG data", "unsupported image format:
HEIC", ...).

JPEGs are decoded already scaled down in the DCT domain when the target is
smaller (libjpeg-turbo's M/8 scaling through simplejpeg when installed, else
PIL's draft mode), which is most of gpufeed's prepare speed.

The rule for what is accepted is Pillow's: a file is decoded exactly when the
active PIL can open, fully load and convert it. A fast decoder (simplejpeg
here, the native YCbCr path in prepare) refuses a JPEG on any libjpeg
warning, since libjpeg would paper over the damage with grey; such a file
goes to Pillow, which decides, and when Pillow reads it the warnings are
kept (`DecodedImage.warnings`) instead of the file being lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import native
from .errors import DecodeError

try:  # optional fast path: libjpeg-turbo with M/8 DCT scaling
    import simplejpeg
except ImportError:  # pragma: no cover - depends on the install
    simplejpeg = None

_ORIENTATION_TAG = 0x0112
_PIL_READY = False

# The raster formats gpufeed decodes (PIL names). PIL identifies files by their
# content, not their name, and some of its plugins hand the bytes to external
# programs (EPS runs Ghostscript) or parse rarely audited formats: a hostile
# `photo.jpg` must not reach those. MPO (camera multi-picture JPEG) opens as JPEG.
DECODE_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "TIFF", "BMP", "DIB", "PPM", "JPEG2000", "TGA", "ICO", "AVIF", "HEIF")
_DCT_FORMATS = ("JPEG", "MPO")

# Leading bytes of formats a user may meet in an image folder, so a file PIL
# cannot open is reported as "truncated PNG" or "unsupported HEIC" rather than
# "not an image". (offset, magic, name); checked in order.
_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\xff\xd8\xff", "JPEG"),
    (0, b"\x89PNG\r\n\x1a\n", "PNG"),
    (0, b"GIF87a", "GIF"),
    (0, b"GIF89a", "GIF"),
    (0, b"II*\x00", "TIFF"),
    (0, b"MM\x00*", "TIFF"),
    (0, b"II+\x00", "TIFF"),
    (0, b"MM\x00+", "TIFF"),
    (0, b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG2000"),
    (0, b"\xffO\xffQ", "JPEG2000"),
    (0, b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"),
    (0, b"\xff\x0a", "JPEG XL"),
    (4, b"ftypavif", "AVIF"),
    (4, b"ftypavis", "AVIF"),
    (4, b"ftyphei", "HEIC"),
    (4, b"ftyphev", "HEIC"),
    (4, b"ftypmif1", "HEIF"),
    (4, b"ftypmsf1", "HEIF"),
    (0, b"8BPS", "PSD (Photoshop)"),
    (0, b"%!PS", "PostScript/EPS"),
    (0, b"\xc5\xd0\xd3\xc6", "PostScript/EPS"),
    (0, b"%PDF", "PDF"),
)


def pil_image() -> Any:
    """Import PIL once per process with gpufeed's safety settings."""
    global _PIL_READY
    from PIL import Image, ImageFile

    if not _PIL_READY:
        # gpufeed checks pixel counts itself (with a clear reason) before decoding.
        Image.MAX_IMAGE_PIXELS = None
        ImageFile.LOAD_TRUNCATED_IMAGES = False
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        # Keep a few freed image blocks for reuse. With Pillow's default (none)
        # every image is fresh memory from the kernel, and its page faults cost
        # more than the resize itself (measured: 0.80 -> 0.45 ms per 224 px crop).
        Image.core.set_blocks_max(max(Image.core.get_blocks_max(), 16))
        _PIL_READY = True
    return Image


@dataclasses.dataclass
class DecodedImage:
    """An upright RGB image and what it was before decoding.

    Attributes:
        image: PIL RGB image, possibly already reduced by DCT scaling.
        original_size: (width, height) upright, before any scaling.
        format: the detected file format (JPEG, PNG, ...).
        warnings: what the decoders said about damage they read past
            (libjpeg's "Corrupt JPEG data: 5 extraneous bytes before marker
            0xdb", Pillow's "Corrupt EXIF data"); empty for a clean file.
        orientation: the EXIF orientation (1..8) the decoder turned the
            pixels upright by; 1 when they were stored upright. What a
            sample's boxes and masks, given in the stored file's pixels,
            must go through to stay on the picture (`targets.orient_boxes`).
        pixels: the decoder's HxWx4 RGBX array that `image` maps without a
            copy (a padded decode of a JPEG stored upright), or None: what
            gpufeed's native resampler reads instead of copying the image out.
    """

    image: Any
    original_size: tuple[int, int]
    format: str
    warnings: list[str] = dataclasses.field(default_factory=list)
    orientation: int = 1
    pixels: np.ndarray | None = None


def open_image(data: bytes, *, max_pixels: int = 89_478_485, formats: tuple[str, ...] | None = None) -> Any:
    """Open image bytes with PIL after the checks every decoder needs, without decoding pixels.

    Only DECODE_FORMATS are tried, and images over `max_pixels` are refused
    from their header alone (gpufeed turns PIL's own bomb check off to give
    this clear reason instead, so every PIL decode must come through here).

    Args:
        data: the whole file.
        max_pixels: refuse images with more pixels than this (bombs).
        formats: try only these PIL formats (default: every one gpufeed
            decodes, which imports all of Pillow's plugins on first use).

    Returns:
        A lazily loaded PIL image (call ``load()`` to decode).

    Raises:
        DecodeError: empty, not an image, unsupported format, broken header or too many pixels.
    """
    if not data:
        raise DecodeError("empty file (0 bytes)")
    Image = pil_image()
    try:
        img = Image.open(io.BytesIO(data), formats=formats or _decode_formats(Image))
    except Image.UnidentifiedImageError:
        raise DecodeError(_unidentified_reason(data, Image)) from None
    except Exception as exc:  # PIL raises many types for broken headers
        kind = _sniff(data) or "image"
        raise DecodeError(f"corrupt or truncated {kind} header: {_describe(exc)}") from None
    width, height = img.size
    if width < 1 or height < 1:
        raise DecodeError(f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise DecodeError(
            f"decompression bomb refused: {width}x{height} = {width * height:,} pixels is over the {max_pixels:,} limit"
        )
    return img


def decode_image(
    data: bytes,
    *,
    scale_for: Callable[[int, int], float] | None = None,
    max_pixels: int = 89_478_485,
    background: tuple[int, int, int] = (255, 255, 255),
    padded: bool = False,
    refused: str | None = None,
) -> DecodedImage:
    """Decode bytes into an upright RGB image.

    Args:
        data: the whole file.
        scale_for: given the stored (width, height), the smallest scale the
            caller can use; JPEGs are DCT-scaled down to just above it. None
            decodes at full size.
        max_pixels: refuse images with more pixels than this (bombs).
        background: colour that transparent pixels are composited onto.
        padded: JPEGs may come back in mode RGBX (RGB plus a padding byte),
            the decoder's own buffer without a copy; ~3 % faster for callers
            that resize and then convert or encode (`encode_image` accepts it).
        refused: libjpeg's message when a fast path already refused these
            bytes (prepare's YCbCr path): Pillow decodes the file, and the
            message becomes a warning of the result if Pillow reads it.

    Returns:
        A DecodedImage.

    Raises:
        DecodeError: the file is empty, not an image, truncated, too large
            or otherwise unusable; ``reason`` says which.
    """
    found: list[str] = []
    with pillow_warnings(found):
        img = open_image(data, max_pixels=max_pixels)
        Image = pil_image()
        width, height = img.size
        scale = min(1.0, scale_for(width, height)) if scale_for else 1.0
        try:
            array = None
            if refused is None and img.format in _DCT_FORMATS and simplejpeg is not None and img.mode in ("RGB", "L"):
                array, refused = _decode_jpeg_scaled(data, width, height, scale, "RGBX" if padded else "RGB")
            if array is not None:
                orientation = exif_orientation(img)
                if padded:
                    # The decoder's RGBX buffer becomes the image itself: no copy.
                    rgb = Image.frombuffer("RGBX", (array.shape[1], array.shape[0]), array, "raw", "RGBX", 0, 1)
                else:
                    rgb = Image.fromarray(array)
            else:  # Pillow: every other file, and a JPEG a fast decoder refused
                img = _load_with_pil(img, scale)
                # Read after loading: some PIL loaders (TIFF in current Pillow) apply the
                # orientation themselves, report the upright size and drop the tag.
                orientation = exif_orientation(img)
                rgb = to_rgb(img, background, Image)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"corrupt or truncated {img.format or 'image'} data: {_describe(exc)}") from None
    if refused is not None:
        found[:0] = _refusal_warnings(data, refused)
    mapped = array if array is not None and padded and orientation == 1 else None
    rgb = _apply_orientation(rgb, orientation)
    upright = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
    return DecodedImage(rgb, upright, img.format or "unknown", found, orientation, mapped)


@contextlib.contextmanager
def pillow_warnings(into: list[str]) -> Iterator[None]:
    """Collect what Pillow warns about a file while decoding it ("Corrupt EXIF data ...") in `into`.

    UserWarnings are the file's (Pillow's words for damage it read past) and
    are collected instead of printed; other categories are issued again as
    usual. Python's warning filters are global to the process, so this is for
    one thread at a time: prepare's worker processes, the main thread.

    Args:
        into: where each distinct message is added, its whitespace tidied.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for warning in caught:
        if not issubclass(warning.category, UserWarning):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            continue
        text = " ".join(str(warning.message).split())
        if text not in into:
            into.append(text)


def _refusal_warnings(data: bytes, refused: str) -> list[str]:
    """A JPEG that a fast decoder refused and Pillow read (Pillow reports no warnings itself): the
    fast decoder's message, then every other warning libjpeg gives over the whole file, where the
    native library is here to list them."""
    return list(dict.fromkeys([refused, *(native.jpeg_warnings(data) or [])]))


# PIL registers some plugins even when the codec library behind them is missing.
_CODEC_FEATURES = {"WEBP": "webp", "JPEG2000": "jpg_2000", "AVIF": "avif"}
_PIL_NAMES = {"HEIC": "HEIF"}
_formats_cache: tuple[int, tuple[str, ...]] = (-1, ())


def _decode_formats(Image: Any) -> tuple[str, ...]:
    """The DECODE_FORMATS this PIL can actually decode (plugins added later count too)."""
    global _formats_cache
    Image.init()  # PIL loads most plugins lazily; the list must not depend on what was opened first
    if _formats_cache[0] != len(Image.OPEN):
        from PIL import features

        def usable(name: str) -> bool:
            if name not in Image.OPEN:
                return False
            feature = _CODEC_FEATURES.get(name)
            with warnings.catch_warnings():  # older PIL warns about feature names it does not know
                warnings.simplefilter("ignore")
                return feature is None or bool(features.check(feature))

        _formats_cache = (len(Image.OPEN), tuple(name for name in DECODE_FORMATS if usable(name)))
    return _formats_cache[1]


def _sniff(data: bytes) -> str | None:
    """The format named by the file's leading bytes, if it is one we know."""
    for offset, magic, name in _SIGNATURES:
        if data[offset : offset + len(magic)] == magic:
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _unidentified_reason(data: bytes, Image: Any) -> str:
    kind = _sniff(data)
    if kind is None:
        head = data[:512].lstrip().lower()
        if head.startswith((b"<!doctype html", b"<html")):
            return f"not an image: an HTML page (file starts with {data[:12]!r})"
        if b"<svg" in head:
            return "unsupported image format: SVG (vector graphics are not decoded)"
        return f"not an image: unknown format (file starts with {data[:12]!r})"
    if _PIL_NAMES.get(kind, kind) in _decode_formats(Image):
        return f"corrupt or truncated {kind} file: PIL cannot read its header"
    return f"unsupported image format: {kind} (this build of PIL or gpufeed cannot decode it)"


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text[:200]


def decoded_scale(width: int, height: int, decoded_width: int, decoded_height: int) -> tuple[float, float]:
    """How a decode of a width x height image into decoded_width x decoded_height maps its pixels: (sx, sy).

    libjpeg's scaled IDCT (Pillow's `draft`, simplejpeg's `min_width`, the
    region decoder) makes each 8x8 block M x M pixels: source x is scaled x
    times 8/M exactly, while the scaled size is rounded up (ceil(W M / 8)).
    So a decode whose size is that of some M/8 maps by M/8, not by the
    ratio of the sizes (off by up to 0.9 px at the far edge); any other
    decode by the ratio.
    """
    if (decoded_width, decoded_height) == (width, height):
        return 1.0, 1.0
    for m in range(1, 17):  # libjpeg-turbo's factors: 1/8 to 16/8
        if -(-width * m // 8) == decoded_width and -(-height * m // 8) == decoded_height:
            return m / 8, m / 8
    return decoded_width / width, decoded_height / height


def decoded_extent(
    width: int, height: int, decoded_width: int, decoded_height: int, orientation: int = 1
) -> tuple[float, float, float, float]:
    """Where the upright original lies in its upright decode: (x0, y0, sx, sy), pixel x at x0 + x * sx.

    A DCT-scaled decode rounds its size up (`decoded_scale`): the stored
    raster's last column and row hold the slack. An EXIF orientation that
    reverses an upright axis (mirror, half and quarter turns) brings that
    slack to the start of the axis, so the original begins past it there.
    """
    sx, sy = decoded_scale(width, height, decoded_width, decoded_height)
    x0 = decoded_width - width * sx if orientation in (2, 3, 6, 7) else 0.0
    y0 = decoded_height - height * sy if orientation in (3, 4, 7, 8) else 0.0
    return x0, y0, sx, sy


def _decode_jpeg_scaled(
    data: bytes, width: int, height: int, scale: float, colorspace: str = "RGB"
) -> tuple[np.ndarray | None, str | None]:
    """(pixels, None) from simplejpeg, or (None, libjpeg's message) when it refuses the data (then Pillow decides)."""
    kwargs: dict[str, int] = {}
    if scale < 1:
        kwargs = {"min_width": math.ceil(width * scale), "min_height": math.ceil(height * scale)}
    try:
        array: np.ndarray = simplejpeg.decode_jpeg(data, colorspace=colorspace, **kwargs)
    except ValueError as exc:  # corrupt data, or only a warning: simplejpeg stops on both
        return None, _describe(exc)
    return array, None


def _load_with_pil(img: Any, scale: float) -> Any:
    width, height = img.size
    if img.format in _DCT_FORMATS and scale < 1:
        img.draft(img.mode, (math.ceil(width * scale), math.ceil(height * scale)))
    if getattr(img, "n_frames", 1) > 1:
        img.seek(0)  # animated: the first frame stands for the file
    img.load()
    return img


def to_rgb(img: Any, background: tuple[int, int, int], Image: Any = None) -> Any:
    """Convert any PIL mode to RGB; alpha is composited onto `background`."""
    Image = Image or pil_image()
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        return _high_depth_to_rgb(img, Image)
    if mode == "P" or mode == "PA":
        img = img.convert("RGBA")
        mode = "RGBA"
    if mode == "La":  # premultiplied: PIL converts it only to LA
        img = img.convert("LA")
        mode = "LA"
    if mode == "LA":
        img = img.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "RGBa"):
        if mode == "RGBa":
            img = img.convert("RGBA")
        canvas = Image.new("RGB", img.size, background)
        canvas.paste(img, mask=img.getchannel("A"))
        return canvas
    return img.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV


def _high_depth_to_rgb(img: Any, Image: Any) -> Any:
    # PIL's convert("RGB") clips 16-bit values at 255 (almost all white);
    # scale by the type's range instead.
    array = np.asarray(img)
    scaled: np.ndarray
    if img.mode == "F":
        finite = np.isfinite(array)
        array = np.where(finite, array, 0.0)  # NaN and inf would cast to arbitrary bytes
        low, high = (float(array[finite].min()), float(array[finite].max())) if finite.any() else (0.0, 0.0)
        scaled = (array - low) / (high - low or 1.0) * 255.0
    else:
        full_scale = 65535.0 if array.max(initial=0) > 255 or img.mode.startswith("I;16") else 255.0
        scaled = array.astype(np.float32) * (255.0 / full_scale)
    gray = np.clip(scaled + 0.5, 0, 255).astype(np.uint8)
    return Image.fromarray(gray).convert("RGB")


# Where Pillow's getexif() finds an orientation besides a TIFF's own tags: an
# Exif block (PNG: as hex text), else XMP.
_ORIENTATION_SOURCES = ("exif", "Raw profile type exif", "xmp", "XML:com.adobe.xmp")


def exif_orientation(img: Any) -> int:
    if not hasattr(img, "tag_v2") and not any(key in img.info for key in _ORIENTATION_SOURCES):
        return 1  # nothing to read: skips getexif(), whose first call imports Pillow's TIFF code (~20 ms)
    try:
        value = img.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:  # broken EXIF must not lose an otherwise good image
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def transpose_method(orientation: int) -> Any:
    """The PIL transpose that turns a picture stored with EXIF `orientation` (2..8) upright."""
    Image = pil_image()
    return {
        2: Image.Transpose.FLIP_LEFT_RIGHT,
        3: Image.Transpose.ROTATE_180,
        4: Image.Transpose.FLIP_TOP_BOTTOM,
        5: Image.Transpose.TRANSPOSE,
        6: Image.Transpose.ROTATE_270,
        7: Image.Transpose.TRANSVERSE,
        8: Image.Transpose.ROTATE_90,
    }[orientation]


def _apply_orientation(img: Any, orientation: int) -> Any:
    if orientation == 1:
        return img
    return img.transpose(transpose_method(orientation))

