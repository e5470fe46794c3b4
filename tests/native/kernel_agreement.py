"""How far gpufeed's native resize kernels sit from the active PIL's `Image.resize`, on every resize path.

gpufeed resizes with its own fastest arithmetic (16-bit weights) whichever PIL
is installed. This measures, per path, the largest difference in levels and
the PSNR against the PIL that is active in the interpreter running it:

  loader crop (bilinear)    RegionDecoder.resize_store, the loader's crop of a decoded RGBX region
  prepare RGB (FILTER)      the kernel of transforms.resized under plain Pillow: prepare's RGB path (pad,
                            variants, PNG/WebP/npy output); "prepare_resized_by" says which resize it ran
  prepare YCbCr (FILTER)    gf_plane_resize, prepare's JPEG-to-JPEG path, one 8-bit plane

test_kernel_agreement.py runs it in the test process (the test venv's PIL,
Pillow-SIMD after setup) and as a script under a plain-Pillow interpreter
(what torchvision, ultralytics and timm install), and checks each path's
figures against the tolerance gpufeed states. It needs only NumPy, PIL and
the checkout on sys.path:

    PYTHONPATH=. python tests/native/kernel_agreement.py     # prints JSON
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import math
from collections.abc import Iterator

import numpy as np
from PIL import Image

from pipeline import native
from pipeline.prepare.transforms import resized
from pipeline.specs import ResizeSpec

FILTERS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS}


def active_pil() -> str:
    """"Pillow-SIMD" or "Pillow": whichever distribution the imported PIL belongs to."""
    import PIL

    try:
        simd = importlib.metadata.version("Pillow-SIMD")
    except importlib.metadata.PackageNotFoundError:
        return "Pillow"
    return "Pillow-SIMD" if simd == PIL.__version__ else "Pillow"


def images(count: int, seed: int, channels: int) -> Iterator[tuple[np.ndarray, tuple[float, ...], tuple[int, int]]]:
    """(pixels, box inside them, output size): noise (the worst case) and smooth photo-like gradients, odd sizes,
    up- and downscaling, boxes touching the edges."""
    rs = np.random.RandomState(seed)
    for index in range(count):
        w, h = int(rs.randint(2, 320)), int(rs.randint(2, 320))
        if index % 2:
            pixels = rs.randint(0, 256, (h, w, channels))
        else:
            y, x = np.mgrid[0:h, 0:w]
            base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h) + 60, x * 0 + 99][:channels], axis=2)
            pixels = np.clip(base + rs.normal(0, 12, base.shape), 0, 255)
        x0, y0 = rs.uniform(0, w - 1), rs.uniform(0, h - 1)
        box = (x0, y0, rs.uniform(x0 + 0.5, w), rs.uniform(y0 + 0.5, h))
        if index % 5 == 0:
            box = (0.0, 0.0, float(w), float(h))
        yield pixels.astype(np.uint8), box, (int(rs.randint(1, 260)), int(rs.randint(1, 260)))


class Tally:
    """The largest difference and the pooled PSNR of one path."""

    def __init__(self) -> None:
        self.max_levels, self.squares, self.count = 0, 0.0, 0

    def add(self, ours: np.ndarray, theirs: np.ndarray) -> None:
        diff = ours.astype(np.int64) - theirs.astype(np.int64)
        self.max_levels = max(self.max_levels, int(np.abs(diff).max(initial=0)))
        self.squares += float((diff * diff).sum())
        self.count += diff.size

    def result(self) -> dict[str, float | int]:
        mse = self.squares / max(self.count, 1)
        return {"max_levels": self.max_levels, "psnr_db": math.inf if mse == 0 else 10 * math.log10(255**2 / mse)}


def loader_crop(count: int = 120, seed: int = 3) -> dict[str, float | int]:
    decoder = native.RegionDecoder(native.library())
    tally = Tally()
    for pixels, box, size in images(count, seed, 4):
        ours = np.zeros((size[1], size[0], 3), np.uint8)
        decoder.resize_store(pixels.ctypes.data, pixels.shape[1::-1], box, ours, native.PILLOW_SIMD)
        image = Image.frombuffer("RGBX", pixels.shape[1::-1], pixels.tobytes(), "raw", "RGBX", 0, 1)
        tally.add(ours, np.asarray(image.resize(size, Image.Resampling.BILINEAR, box))[:, :, :3])
    return tally.result()


def native_rgb(image: Image.Image, size: tuple[int, int], box: tuple[float, ...], resample: str) -> np.ndarray:
    """The native kernel prepare's RGB path resizes with under plain Pillow (transforms.resized)."""
    rgbx = np.frombuffer(image.tobytes("raw", "RGBX"), np.uint8)
    out = np.empty((size[1], size[0], 3), np.uint8)
    decoder = native.RegionDecoder(native.library())
    decoder.resize_store(rgbx.ctypes.data, image.size, box, out, native.PILLOW_SIMD, resample=resample)
    return out


def prepare_rgb(resample: str, count: int = 60, seed: int = 5) -> dict[str, float | int]:
    tally = Tally()
    for pixels, box, size in images(count, seed, 3):
        image = Image.fromarray(pixels)
        tally.add(native_rgb(image, size, box, resample), np.asarray(image.resize(size, FILTERS[resample], box)))
    return tally.result()


def resized_path(count: int = 20, seed: int = 9) -> str:
    """Which resize transforms.resized ran: "native", "pil", or "either" where both gave the same pixels."""
    native_equal = pil_equal = True
    spec = ResizeSpec(size=64, resample="lanczos")
    for pixels, box, size in images(count, seed, 3):
        image = Image.fromarray(pixels)
        got = np.asarray(resized(image, size, spec, box).convert("RGB"))
        native_equal &= np.array_equal(got, native_rgb(image, size, box, "lanczos"))
        pil_equal &= np.array_equal(got, np.asarray(image.resize(size, Image.Resampling.LANCZOS, box)))
    return "either" if native_equal and pil_equal else "native" if native_equal else "pil" if pil_equal else "neither"


def prepare_planes(resample: str, count: int = 60, seed: int = 7) -> dict[str, float | int]:
    lib = native.library()
    code = native.bindings.FILTERS[resample]
    tally = Tally()
    for pixels, box, size in images(count, seed, 1):
        plane = np.ascontiguousarray(pixels[:, :, 0])
        ours = np.zeros((size[1], size[0]), np.uint8)
        status = lib.gf_plane_resize(
            plane.ctypes.data, plane.strides[0], plane.shape[1], plane.shape[0], (ctypes.c_double * 4)(*box),
            ours.ctypes.data, size[0], size[0], size[1], code, 1,
        )  # fmt: skip
        assert status == 0
        tally.add(ours, np.asarray(Image.fromarray(plane).resize(size, FILTERS[resample], box)))
    return tally.result()


def agreement() -> dict[str, object]:
    """Every path's figures against the active PIL, and which PIL that is."""
    paths: dict[str, dict[str, float | int]] = {"loader crop (bilinear)": loader_crop()}
    for name in FILTERS:
        paths[f"prepare RGB ({name})"] = prepare_rgb(name)
        paths[f"prepare YCbCr ({name})"] = prepare_planes(name)
    return {"pil": active_pil(), "paths": paths, "prepare_resized_by": resized_path()}


if __name__ == "__main__":
    print(json.dumps(agreement()))
