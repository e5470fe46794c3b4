"""ctypes bindings of the native library: each exported function's signature
(as gpufeed.h declares it), the status codes, and `RegionDecoder`, the
Python face of the loader's region decoder and resizer.

Nothing here finds or builds the library: `pipeline.native.library()` does,
and hands the loaded `ctypes.CDLL` to `RegionDecoder`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

_MESSAGE_SIZE = 200
_WARNINGS_SIZE = 2048  # gf_jpeg_warnings: room for some 35 distinct messages


def load(path: Path) -> ctypes.CDLL:
    """Load the library at `path` and declare its functions' signatures.

    Args:
        path: a build of the native library (installed or cached).

    Returns:
        The library, its functions ready to call.

    Raises:
        OSError: the file does not load (not a library, a missing libjpeg), or it
            lacks a function this version calls (a build of older sources).
    """
    lib = ctypes.CDLL(str(path))
    try:
        _declare(lib)
    except AttributeError as exc:  # a build of older sources: a function this version calls is not in it
        raise OSError(f"{path.name} was built from other sources: {exc}") from None
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    lib.gf_header.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.gf_header.restype = ctypes.c_int
    lib.gf_jpeg_warnings.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_int]
    lib.gf_jpeg_warnings.restype = ctypes.c_int
    lib.gf_decode_region.argtypes = [
        ctypes.c_char_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int,
    ]  # fmt: skip
    lib.gf_decode_region.restype = ctypes.c_int
    lib.gf_region_jpeg.argtypes = [
        ctypes.c_char_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p,
    ]  # fmt: skip
    lib.gf_region_jpeg.restype = ctypes.c_long
    lib.gf_header_many.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.gf_header_many.restype = None
    lib.gf_decode_region_many.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int,
    ]  # fmt: skip
    lib.gf_decode_region_many.restype = None
    lib.gf_store_rgbx.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
        ctypes.c_long,
    ]  # fmt: skip
    lib.gf_store_rgbx.restype = None
    lib.gf_store_rgbx_f32.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
        ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    lib.gf_store_rgbx_f32.restype = None
    lib.gf_resize_store.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int,
    ]  # fmt: skip
    lib.gf_resize_store.restype = ctypes.c_int
    lib.gf_crop_many.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_long,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int,
    ]  # fmt: skip
    lib.gf_crop_many.restype = None
    lib.gf_plan_many.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 8
    lib.gf_plan_many.restype = None
    lib.gf_plane_resize.argtypes = [
        ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.gf_plane_resize.restype = ctypes.c_int
    lib.gf_plane_orient.argtypes = [
        ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long,
    ]  # fmt: skip
    lib.gf_plane_orient.restype = ctypes.c_int
    lib.gf_ycc_transcode.argtypes = [
        ctypes.c_char_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_char_p,
        ctypes.c_int,
    ]  # fmt: skip
    lib.gf_ycc_transcode.restype = ctypes.c_long
    lib.gf_hsv.argtypes = [
        ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
        ctypes.c_char_p, ctypes.c_int,
    ]  # fmt: skip
    lib.gf_hsv.restype = None


def built_from(lib: ctypes.CDLL) -> str | None:
    """The source digest baked into an installed build (see build.py), or None for a first-use build.

    Args:
        lib: a loaded build of the native library.

    Returns:
        The digest of the sources it was compiled from, where it records one.
    """
    try:
        function = lib.gf_source_digest
    except AttributeError:  # only the extension module's shell defines it
        return None
    function.argtypes = []
    function.restype = ctypes.c_char_p
    value = function()
    return value.decode() if value is not None else None


def jpeg_warnings(lib: ctypes.CDLL, data: bytes) -> list[str] | None:
    """Every distinct warning libjpeg gives while decoding the whole JPEG, in the order it gives them.

    For a file that a fast decoder refused on a warning and Pillow read
    (Pillow keeps libjpeg's warnings to itself).

    Args:
        lib: the loaded native library.
        data: the whole file.

    Returns:
        The warnings ([] when libjpeg gives none), or None when libjpeg
        fails on the data (an error, not a warning) or runs out of memory.
    """
    text = ctypes.create_string_buffer(_WARNINGS_SIZE)
    if lib.gf_jpeg_warnings(data, len(data), text, _WARNINGS_SIZE) < 0:
        return None
    return [line for line in text.value.decode(errors="replace").split("\n") if line]


def _planar(array: Any) -> bool:
    return bool(array.shape[0] == 3 and array.shape[2] != 3)


def _size(array: Any) -> tuple[int, int]:
    """(width, height) of a 3xHxW or HxWx3 array."""
    return (array.shape[2], array.shape[1]) if _planar(array) else (array.shape[1], array.shape[0])


def channel_strides(array: Any) -> tuple[int, int, int]:
    """(channel, row, column) strides in bytes of a 3xHxW or HxWx3 array."""
    if _planar(array):
        return array.strides[0], array.strides[1], array.strides[2]
    return array.strides[2], array.strides[0], array.strides[1]


PILLOW, PILLOW_SIMD = 0, 1  # resample arithmetic: GF_PILLOW, GF_PILLOW_SIMD in gpufeed.h
FILTERS = {"bilinear": 0, "bicubic": 1, "lanczos": 2}  # GF_BILINEAR, GF_BICUBIC, GF_LANCZOS in gpufeed.h
# How far gpufeed's resize (always the 16-bit arithmetic, the fastest) may sit from the active PIL's
# `Image.resize`: the least PSNR per filter, and for bilinear the largest difference in levels. Pillow-SIMD
# keeps the same weights (equal pixels but for its own pass order); plain Pillow keeps 22-bit weights, and
# bicubic and Lanczos, whose overshoots both clip between the passes, part most on noise.
# tests/native/test_kernel_agreement.py holds every resize path to these with each PIL active.
MIN_PSNR_DB = {"bilinear": 50.0, "bicubic": 40.0, "lanczos": 40.0}
BILINEAR_MAX_LEVELS = 1


def _layout(out: Any, affine: tuple[int, int] | None) -> tuple[int, int, int, int | None, int | None]:
    """(channel, row, column strides in elements, scale and shift addresses) of a uint8 or float32 output."""
    stride_c, stride_y, stride_x = channel_strides(out)
    kind = out.dtype.char
    if kind == "B":
        return stride_c, stride_y, stride_x, None, None
    if kind == "f" and affine is not None:
        return stride_c // 4, stride_y // 4, stride_x // 4, affine[0], affine[1]
    raise ValueError("store writes uint8, or float32 with an affine")


def _messages(raw: bytes, status: Any) -> list[str]:
    """Each image's libjpeg message where its status is an error, else ''."""
    return [
        raw[i * _MESSAGE_SIZE : (i + 1) * _MESSAGE_SIZE].split(b"\0", 1)[0].decode(errors="replace")
        if status[i] < 0 else ""
        for i in range(len(status))
    ]  # fmt: skip


class RegionError(Exception):
    """libjpeg refused the data (corrupt, truncated, region outside the image)."""


class RegionUnsupported(RegionError):
    """A JPEG the region decoder does not convert (CMYK/YCCK): another decoder must."""


# Status codes, as gpufeed.h defines them.
UNSUPPORTED = -2  # GF_UNSUPPORTED: CMYK/YCCK
OUT_OF_MEMORY = -3  # GF_OUT_OF_MEMORY (gf_crop_many, gf_jpeg_warnings): the decode or resize buffers
OVER_LIMITS = 2  # GF_OVER_LIMITS (gf_crop_many): the image is empty or over max_pixels


class RegionDecoder:
    """One thread's decoder state: scratch arrays reused for every call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._info = (ctypes.c_int * 4)()
        self._message = ctypes.create_string_buffer(_MESSAGE_SIZE)

    def store(
        self, address: int, width: int, height: int, flip: bool, out: Any, affine: tuple[int, int] | None = None
    ) -> None:
        """Packed RGBX pixels (width x height at `address`) -> `out`, 3 channels in any layout.

        `out` is uint8, or float32 with `affine` = the addresses of two
        contiguous float32 arrays of 3, scale and shift: out = pixel * scale +
        shift per channel. The caller keeps the pixels alive and sizes `out`
        to match.
        """
        stride_c, stride_y, stride_x, scale, shift = _layout(out, affine)
        if scale is None:
            self._lib.gf_store_rgbx(address, width, height, int(flip), out.ctypes.data, stride_c, stride_y, stride_x)
        else:
            self._lib.gf_store_rgbx_f32(
                address, width, height, int(flip), out.ctypes.data, stride_c, stride_y, stride_x, scale, shift
            )

    def resize_store(
        self,
        address: int,
        size: tuple[int, int],
        box: tuple[float, float, float, float],
        out: Any,
        mode: int,
        *,
        flip: bool = False,
        affine: tuple[int, int] | None = None,
        resample: str = "bilinear",
        simd: bool = True,
    ) -> None:
        """`box` of the packed RGBX image (size = width, height) at `address`, resized into `out`.

        The pixels equal PIL's `resize(out size, resample, box)` in `mode`
        (PILLOW or PILLOW_SIMD arithmetic); `resample` is one of FILTERS;
        `out` and `affine` as for `store`. `simd=False` forces the scalar
        kernels (for tests).
        """
        stride_c, stride_y, stride_x, scale, shift = _layout(out, affine)
        width, height = _size(out)
        boxes = (ctypes.c_double * 4)(*box)
        status = self._lib.gf_resize_store(
            address, size[0], size[1], boxes, width, height, mode, FILTERS[resample], int(flip), out.ctypes.data,
            stride_c, stride_y, stride_x, scale, shift, int(simd),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("cannot allocate the resize buffers")

    def crop_many(
        self,
        data: list[bytes],
        seeds: Any,
        shape: tuple[int, int, int, int],
        spec: tuple[float, ...],
        max_pixels: int,
        targets: list[Any],
        flips: Any,
        mode: int,
        affine: tuple[int, int] | None = None,
    ) -> tuple[Any, list[str]]:
        """For each JPEG: header, crop plan (as `plan_many`), region decode, and the
        crop resized into its target (all targets of one shape and layout), in
        one call (one release of the GIL).

        Returns status (n,) and the messages: 0 done, -1 libjpeg refused it
        (its message), UNSUPPORTED (CMYK), OUT_OF_MEMORY, OVER_LIMITS (empty
        or over `max_pixels`: `header` and the caller's checks say which).
        """
        import numpy as np

        count = len(data)
        first = targets[0]
        stride_c, stride_y, stride_x, scale, shift = _layout(first, affine)
        pointers = (ctypes.c_char_p * count)(*data)
        sizes = np.fromiter((len(d) for d in data), np.uint64, count)
        addresses = np.fromiter((t.ctypes.data for t in targets), np.uint64, count)
        status = np.zeros(count, np.int32)
        messages = ctypes.create_string_buffer(count * _MESSAGE_SIZE)
        self._lib.gf_crop_many(
            count, pointers, sizes.ctypes.data, seeds.ctypes.data, (ctypes.c_int * 4)(*map(int, shape)),
            (ctypes.c_double * 7)(*spec), float(max_pixels), addresses.ctypes.data, flips.ctypes.data, mode,
            stride_c, stride_y, stride_x, scale, shift, status.ctypes.data, messages, _MESSAGE_SIZE,
        )  # fmt: skip
        return status, _messages(messages.raw, status)

    def plan_many(
        self, info: Any, usable: Any, seeds: Any, shape: tuple[int, int, int, int], spec: tuple[float, ...]
    ) -> tuple[Any, Any, Any]:
        """Crop plans for many images (crops.region_plan in C, with crops.CropRandom's numbers):
        what `crop_many` plans, exposed so tests hold the C and Python planners to one answer.

        info: header_many's (n, 4); usable: bool (n,), the images to plan;
        seeds: uint64 (n,); shape: train, output width, height, the spec's
        size; spec: scale lo/hi, log ratio lo/hi, ratio lo/hi, eval fraction.
        Returns params (n, 5) for decode_many, boxes (n, 4) and the RGBX
        bytes each region needs (0 where not planned).
        """
        import numpy as np

        count = len(seeds)
        params = np.zeros((count, 5), np.int32)
        boxes = np.zeros((count, 4), np.float64)
        sizes = np.zeros(count, np.uint64)
        status = np.where(usable, 0, 1).astype(np.int32)
        self._lib.gf_plan_many(
            count, info.ctypes.data, status.ctypes.data, seeds.ctypes.data, (ctypes.c_int * 4)(*map(int, shape)),
            (ctypes.c_double * 7)(*spec), params.ctypes.data, boxes.ctypes.data, sizes.ctypes.data,
        )  # fmt: skip
        return params, boxes, sizes

    def header(self, data: bytes) -> tuple[int, int]:
        """(width, height) of a JPEG."""
        if self._lib.gf_header(data, len(data), self._info, self._message, _MESSAGE_SIZE) != 0:
            raise RegionError(self._message.value.decode(errors="replace") or "not a JPEG")
        return self._info[0], self._info[1]

    def decode(
        self,
        data: bytes,
        scale_num: int,
        region: tuple[int, int, int, int],
        out_address: int,
        out_size: int,
    ) -> tuple[int, int]:
        """Decode `region` (x, y, w, h of the image scaled by scale_num/8) as RGBX rows at out_address.

        Returns (first decoded column, decoded width): whole iMCU columns around the region.
        """
        x, y, w, h = region
        status = self._lib.gf_decode_region(
            data, len(data), scale_num, x, y, w, h, out_address, out_size, self._info, self._message, _MESSAGE_SIZE
        )
        if status != 0:
            error = RegionUnsupported if status == UNSUPPORTED else RegionError
            raise error(self._message.value.decode(errors="replace") or "cannot decode")
        return self._info[0], self._info[1]

    def header_many(self, data: list[bytes]) -> tuple[Any, Any, Any]:
        """(info, status, pointers) for several JPEGs in one call: info[i] = width, height, components,
        colour space where status[i] == 0 (else `header` says why); pointers (to the bytes) are
        reused by `decode_many`, and valid while `data` lives."""
        import numpy as np

        count = len(data)
        pointers = (ctypes.c_char_p * count)(*data)
        sizes = np.fromiter((len(d) for d in data), np.uint64, count)
        info = np.zeros((count, 4), np.int32)
        status = np.zeros(count, np.int32)
        self._lib.gf_header_many(count, pointers, sizes.ctypes.data, info.ctypes.data, status.ctypes.data)
        return info, status, (pointers, sizes)

    def decode_many(self, pointers: tuple[Any, Any], params: Any, outs: Any, out_sizes: Any) -> tuple[Any, Any, list[str]]:
        """`decode` for several JPEGs in one call.

        params: int32 (n, 5) of scale_num, x, y, w, h; outs: uint64 addresses
        (0 skips that image); out_sizes: uint64. Returns info (n, 2) = first
        decoded column, decoded width; status (n,) as `decode`'s C status
        (0 ok, -1 error, -2 unsupported, 1 skipped); and the messages.
        """
        import numpy as np

        count = len(params)
        info = np.zeros((count, 2), np.int32)
        status = np.zeros(count, np.int32)
        messages = ctypes.create_string_buffer(count * _MESSAGE_SIZE)
        self._lib.gf_decode_region_many(
            count, pointers[0], pointers[1].ctypes.data, params.ctypes.data, outs.ctypes.data, out_sizes.ctypes.data,
            info.ctypes.data, status.ctypes.data, messages, _MESSAGE_SIZE,
        )  # fmt: skip
        return info, status, _messages(messages.raw, status)

    def region_jpeg(self, data: bytes, scale_num: int, region: tuple[int, int, int, int]) -> tuple[bytes, int, int] | None:
        """The smaller JPEG that `decode` reads for `region` when restart markers allow one.

        Returns (its bytes, x, y of its top-left pixel in the scaled image), or
        None when `decode` reads the whole JPEG (no usable restart markers,
        or the region needs every block anyway).
        """
        out = ctypes.create_string_buffer(len(data) + 16)  # never larger than the source + EOI
        size = self._lib.gf_region_jpeg(data, len(data), scale_num, *region, out, len(out), self._info)
        if size <= 0:
            return None
        return out.raw[:size], self._info[0], self._info[1]
