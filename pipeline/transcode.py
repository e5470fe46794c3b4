"""prepare's fast path for its most common job: a JPEG in, a resized JPEG out, in one C call.

The general path (`decode_image`, `resize_image`, `encode_image`) reads the
header and EXIF in Python through PIL, and wraps, resizes, converts and
encodes the pixels in separate calls. Here `gf_jpeg_info` (jpegregion.c)
reads the header and EXIF orientation in C, simplejpeg decodes at the same
M/8 DCT scale into a reused buffer, and `gf_resize_encode` resizes with PIL's
own coefficients and rounding (resample.c) and encodes with PIL's default
JPEG settings in one more call.

Its bytes are the general path's bytes. `transcoder()` checks that once per
process on probe images for the job's settings, and leaves every image to
the general path where they differ (another PIL or libjpeg build). EXIF-rotated
JPEGs are turned upright as PIL turns them. Images the fast path does not
take (not JPEG, CMYK, an orientation PIL may read from XMP, over the pixel
limit, corrupt) return None: the general path handles them and gives the
reasons.
"""

from __future__ import annotations

import io
import math
import threading
from typing import Any

from . import native
from .specs import PrepareSpec
from .transforms import required_scale, resize_box

_JCS_GRAYSCALE, _JCS_YCBCR = 1, 3  # J_COLOR_SPACE values the fast path takes (libjpeg converts them to RGB)
_MODES = ("shorter", "longer", "center-crop")

_lock = threading.Lock()
_checked: dict[tuple[Any, ...], Transcoder | None] = {}


class Transcoder:
    """The fast path for one job's resize and encode settings."""

    def __init__(self, spec: PrepareSpec, mode: int) -> None:
        self.spec = spec
        self._mode = mode

    def __call__(self, data: bytes) -> tuple[bytes, tuple[int, int], tuple[int, int]] | None:
        """(JPEG bytes, original size, output size), or None: the general path takes this image."""
        from .crops import _region_decoder

        decoder = _region_decoder()  # per thread: it holds scratch buffers
        if decoder is None or data[:3] != b"\xff\xd8\xff":
            return None
        info = decoder.jpeg_info(data)
        if info is None:
            return None
        width, height, _, colour_space, orientation = info
        if orientation == native.ORIENTATION_UNKNOWN or colour_space not in (_JCS_GRAYSCALE, _JCS_YCBCR):
            return None
        if width < 1 or height < 1 or width * height > self.spec.max_pixels:
            return None
        scale = required_scale(self.spec.resize, self.spec.augment, width, height)
        pixels = _decode(data, width, height, scale)
        if pixels is None:
            return None
        if orientation != 1:
            pixels = _upright(pixels, orientation)
            width, height = (height, width) if orientation >= 5 else (width, height)
        decoded = (pixels.shape[1], pixels.shape[0])
        size, box = resize_box(decoded, (width, height), self.spec.resize)
        try:
            jpeg = decoder.resize_encode(
                pixels.ctypes.data, decoded, box or (0.0, 0.0, float(decoded[0]), float(decoded[1])), size,
                self._mode, self.spec.resize.resample, self.spec.encode.quality, self.spec.encode.restart,
            )  # fmt: skip
        except MemoryError:
            return None
        return jpeg, (width, height), size


_buffers = threading.local()


def _upright(pixels: Any, orientation: int) -> Any:
    """RGBX pixels turned as PIL turns them for EXIF `orientation` 2..8 (decode._apply_orientation), contiguous."""
    import numpy as np

    grid = pixels.view(np.uint32)[:, :, 0]  # one 32-bit word per pixel: the turns move whole pixels
    turned = {
        2: grid[:, ::-1],  # FLIP_LEFT_RIGHT
        3: grid[::-1, ::-1],  # ROTATE_180
        4: grid[::-1, :],  # FLIP_TOP_BOTTOM
        5: grid.T,  # TRANSPOSE
        6: grid[::-1, :].T,  # ROTATE_270
        7: grid[::-1, ::-1].T,  # TRANSVERSE
        8: grid[:, ::-1].T,  # ROTATE_90
    }[orientation]
    return np.ascontiguousarray(turned).view(np.uint8).reshape(turned.shape[0], turned.shape[1], 4)


def _decode(data: bytes, width: int, height: int, scale: float) -> Any:
    """RGBX pixels decoded as decode_image does (simplejpeg, the same M/8 scale), in this thread's reused buffer.

    None when simplejpeg refuses the data (decode_image then gives the reason).
    """
    import numpy as np

    from .decode import simplejpeg

    scale_num = _scale_num(width, height, scale)
    needed = -(-width * scale_num // 8) * -(-height * scale_num // 8) * 4
    buffer = getattr(_buffers, "pixels", None)
    if buffer is None or buffer.nbytes < needed:
        buffer = _buffers.pixels = np.empty(max(needed, 1 << 20), np.uint8)
    sizes = {"min_width": math.ceil(width * scale), "min_height": math.ceil(height * scale)} if scale < 1 else {}
    try:
        return simplejpeg.decode_jpeg(data, colorspace="RGBX", buffer=buffer, **sizes)
    except ValueError:
        return None


def _scale_num(width: int, height: int, scale: float) -> int:
    """The M of the smallest M/8 DCT scale that keeps ceil(side * scale) pixels (simplejpeg's choice)."""
    if scale >= 1:
        return 8
    need_w, need_h = math.ceil(width * scale), math.ceil(height * scale)
    return next(m for m in range(1, 9) if -(-width * m // 8) >= need_w and -(-height * m // 8) >= need_h)


def eligible(spec: PrepareSpec) -> bool:
    """Whether the job is one the fast path does: JPEG out, one resize, no pre-augmented variants."""
    return (
        spec.encode.format == "jpeg"
        and not spec.augment.variants
        and spec.resize.mode in _MODES
        and spec.resize.resample in native.FILTERS
    )


def transcoder(spec: PrepareSpec) -> Transcoder | None:
    """The fast path for this job, or None: not eligible, no native library or simplejpeg, or bytes not
    the general path's.

    The first call for a job's settings builds and checks it (some 20 ms);
    later calls, and processes forked after it, reuse the answer.
    """
    if not eligible(spec):
        return None
    key = (spec.resize, spec.encode, spec.max_pixels)
    if key not in _checked:
        with _lock:
            if key not in _checked:
                _checked[key] = _checked_transcoder(spec)
    return _checked[key]


def _checked_transcoder(spec: PrepareSpec) -> Transcoder | None:
    from .crops import _region_decoder, resample_mode
    from .decode import simplejpeg

    mode = resample_mode()
    if simplejpeg is None or _region_decoder() is None or mode is None:
        return None
    candidate = Transcoder(spec, mode)
    for data in _probes(spec.resize.size):
        made = candidate(data)
        if made is None or made[0] != general_path(data, spec):
            return None
    return candidate


def decode_source(data: bytes, spec: PrepareSpec) -> Any:
    """A source file decoded as prepare's general path decodes it (a DecodedImage; raises DecodeError)."""
    from .decode import decode_image

    return decode_image(
        data,
        scale_for=lambda w, h: required_scale(spec.resize, spec.augment, w, h),
        max_pixels=spec.max_pixels,
        background=spec.background,
        padded=True,
    )


def general_path(data: bytes, spec: PrepareSpec) -> bytes:
    """The stored bytes of one sample as prepare's general path makes them (no variants)."""
    from .encode import encode_image
    from .transforms import resize_image

    decoded = decode_source(data, spec)
    image, _ = resize_image(decoded.image, decoded.original_size, spec.resize)
    return encode_image(image, spec.encode)


def _probes(size: int) -> list[bytes]:
    """JPEGs that exercise the decode scales, both aspect ratios, 4:2:0 and 4:4:4 colour and grey."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(7)
    side = min(max(64, int(size * 2.3) + 13), 1600)  # larger than the target where affordable: a real downscale
    probes = []
    for width, height, mode, subsampling in (
        (side, side * 3 // 4 + 5, "RGB", 2),
        (side * 2 // 3 + 3, side, "RGB", 0),
        (side * 5 // 8 + 1, side * 5 // 8 + 7, "L", -1),
    ):
        y, x = np.mgrid[0:height, 0:width]
        base = (x * 255 // max(1, width - 1) + y * 128 // max(1, height - 1)).astype(np.int32)
        noise = rng.integers(-40, 40, (height, width, 3))
        pixels = np.clip(base[..., None] + noise + np.array([0, 60, 120]), 0, 255).astype(np.uint8)
        image = Image.fromarray(pixels).convert(mode)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=88, subsampling=subsampling)
        probes.append(buffer.getvalue())
    return probes
