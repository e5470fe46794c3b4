"""prepare's fast path for its most common job: a YCbCr JPEG in, a smaller JPEG out.

The RGB path decodes to RGB, resizes and encodes (`decode_image`,
`resize_image`, `encode_image`). For an 8-bit YCbCr source (4:2:0, 4:2:2 or
4:4:4 chroma) and JPEG output, `ycc.c` does the same job without leaving the
planes the two JPEGs share: luma decoded at M/8 and chroma at M/8 of its own
resolution (no chroma upsampling, no colour conversion), each plane resized
with the same filter (luma to the output size, chroma straight to the
output's 4:2:0 chroma size, which the encoder would otherwise average down
2x2), turned upright, and encoded with Pillow's settings. No RGB image exists
at any point, so there is nothing to convert back and forth.

The pixels are not bit-identical to the RGB path's but the same picture
(37-47 dB PSNR between the two on demo photos, the difference of two
equally valid resamplings); the output's size, orientation and metadata are
the same. Everything else (other formats, grey and CMYK JPEGs, pad mode,
variants, WebP/PNG/npy output, a missing C compiler) takes the RGB path.
So does a file libjpeg refuses here, with an error or only a warning (data
it would paper over with grey): `TranscodeRefused` carries libjpeg's message
and the RGB path hands the file to Pillow, whose verdict stands.
"""

from __future__ import annotations

import ctypes
import math
import threading
from typing import Any, NamedTuple

import numpy as np

from .. import native
from ..decode import exif_orientation, open_image, pillow_warnings
from ..errors import DecodeError
from ..specs import PrepareSpec
from ..targets import orient_boxes
from .transforms import center_crop_box, output_size, required_scale

_MODES = ("shorter", "longer", "center-crop", "none")
# Stored axes that end up reversed once the image is upright (see gf_plane_orient).
_REVERSED_X = (2, 3, 7, 8)
_REVERSED_Y = (3, 4, 6, 7)
_local = threading.local()


class Transcoded(NamedTuple):
    """What the YCbCr path made of a JPEG.

    Attributes:
        payload: the output JPEG.
        original_size: the source's upright (width, height).
        size: the output's upright (width, height).
        warnings: what Pillow said about a broken Exif block (the pixels
            came through libjpeg without a warning).
    """

    payload: bytes
    original_size: tuple[int, int]
    size: tuple[int, int]
    warnings: tuple[str, ...] = ()


class TranscodeRefused(Exception):
    """libjpeg refused the data on this path (an error, or a warning): the RGB path hands it to Pillow.

    Attributes:
        message: libjpeg's message.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def applies(spec: PrepareSpec) -> bool:
    """Whether this job's settings can use the fast path at all (each file is still checked)."""
    return (
        spec.encode.format == "jpeg"
        and not spec.augment.variants
        and spec.resize.mode in _MODES
        and native.library() is not None
    )


def dct_scale(width: int, height: int, scale: float) -> int:
    """The smallest M of libjpeg's M/8 scaling that keeps at least `scale` of each side."""
    need_w, need_h = math.ceil(width * scale), math.ceil(height * scale)
    for m in range(1, 8):
        if -(-width * m // 8) >= need_w and -(-height * m // 8) >= need_h:
            return m
    return 8


def regions(
    spec: PrepareSpec, width: int, height: int, orientation: int
) -> tuple[tuple[float, ...], tuple[float, ...], int, int]:
    """(luma box, chroma box, out_w, out_h) in the stored image's pixels and orientation.

    The luma box is the part of the image the output shows. The output's
    chroma covers 2 * ceil(out / 2) luma pixels, half a chroma pixel past an
    odd edge, so its box reaches that far past the edge that ends up right
    or bottom once the image is upright.
    """
    resize = spec.resize
    out_w, out_h = output_size(resize, width, height)
    x0, y0, x1, y1 = 0.0, 0.0, float(width), float(height)
    if resize.mode == "center-crop":  # v2's anchors are rounded on the upright picture: its box, turned back
        turned = orientation in (5, 6, 7, 8)
        upright = (height, width) if turned else (width, height)
        box, out_w = center_crop_box(resize, *upright)
        back = {6: 8, 8: 6}.get(orientation, orientation)  # the inverse turn (the others are their own)
        x0, y0, x1, y1 = (float(v) for v in orient_boxes(np.array([box], np.float64), back, *upright)[0])
        out_h = out_w
    reach_x = (x1 - x0) * (2 * ((out_w + 1) // 2)) / out_w
    reach_y = (y1 - y0) * (2 * ((out_h + 1) // 2)) / out_h
    cx0, cx1 = (x1 - reach_x, x1) if orientation in _REVERSED_X else (x0, x0 + reach_x)
    cy0, cy1 = (y1 - reach_y, y1) if orientation in _REVERSED_Y else (y0, y0 + reach_y)
    return (x0, y0, x1, y1), (cx0, cy0, cx1, cy1), out_w, out_h


def transcode_jpeg(data: bytes, spec: PrepareSpec) -> Transcoded | None:
    """The resized JPEG and its sizes, or None when this file is not for this path.

    Anything that is not a YCbCr JPEG within the job's limits returns None,
    so that the RGB path decides and words the reason.

    Raises:
        TranscodeRefused: libjpeg refused the data (corrupt, or a warning):
            the RGB path gives the file to Pillow with the message.
    """
    if not data.startswith(b"\xff\xd8\xff"):
        return None
    warned: list[str] = []  # Pillow's, about a broken Exif block
    with pillow_warnings(warned):
        try:
            # JPEG only: the RGB path's open tries every format, importing all of Pillow's plugins.
            img = open_image(data, max_pixels=spec.max_pixels, formats=("JPEG",))
        except DecodeError:
            return None  # the RGB path words the reason
        if img.mode != "RGB" or [layer[1:3] for layer in img.layer][1:] != [(1, 1), (1, 1)]:
            return None  # grey, CMYK, or chroma sampled unlike 4:2:0, 4:2:2, 4:4:4 (ycc.c checks the luma)
        orientation = exif_orientation(img)
    lib = native.library()
    if lib is None:
        return None
    width, height = img.size
    m = dct_scale(width, height, required_scale(spec.resize, spec.augment, width, height))
    box, chroma_box, out_w, out_h = regions(spec, width, height, orientation)
    capacity = int(_BYTES_PER_PIXEL * out_w * out_h) + 65536
    message = _message_buffer()
    for _ in range(3):
        out = _buffer(capacity)
        length = lib.gf_ycc_transcode(
            data, len(data), m, (ctypes.c_double * 4)(*box), (ctypes.c_double * 4)(*chroma_box), out_w, out_h,
            native.bindings.FILTERS[spec.resize.resample], orientation, spec.encode.quality, spec.encode.restart, out, capacity,
            message, len(message),
        )  # fmt: skip
        if length != 0:
            break
        capacity *= 4  # the buffer was too small
    if length == -1:
        raise TranscodeRefused(message.value.decode(errors="replace") or "libjpeg refused the data")
    if length <= 0:
        return None  # not a layout ycc.c takes (GF_YCC_OTHER), or out of memory: the RGB path
    turned = orientation >= 5
    original = (height, width) if turned else (width, height)
    size = (out_h, out_w) if turned else (out_w, out_h)
    return Transcoded(ctypes.string_at(out, length), original, size, tuple(warned))


# 4:2:0 is 1.5 bytes a pixel raw; a JPEG of noise at quality 100 takes about 2.
_BYTES_PER_PIXEL = 2.0
_KEPT_BUFFER = 16 << 20  # a larger output buffer (a huge image with --mode none) is not kept


def _message_buffer() -> Any:
    """This thread's buffer for libjpeg's message."""
    message = getattr(_local, "message", None)
    if message is None:
        message = _local.message = ctypes.create_string_buffer(200)
    return message


def _buffer(size: int) -> Any:
    """An output buffer of at least `size` bytes, reused by the thread's next image when small."""
    buffer = getattr(_local, "buffer", None)
    if buffer is not None and len(buffer) >= size:
        return buffer
    buffer = ctypes.create_string_buffer(size)
    if size <= _KEPT_BUFFER:
        _local.buffer = buffer
    return buffer
