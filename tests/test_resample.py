"""The C crop-and-resize (resample.c): PIL's pixels exactly, in every output layout, and in the loader's decode path."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipeline import crops, native
from pipeline.crops import Affine, CropSpec, decode_many

needs_native = pytest.mark.skipif(native.library() is None, reason=f"native library unavailable: {native.problem()}")


def cases(count: int, seed: int):
    """(RGBX source, box, output size): random boxes, up- and downscaling, odd sizes, edges of the image."""
    rs = np.random.RandomState(seed)
    for _ in range(count):
        w, h = int(rs.randint(2, 300)), int(rs.randint(2, 300))
        x0, y0 = rs.uniform(0, w - 1), rs.uniform(0, h - 1)
        box = (x0, y0, rs.uniform(x0 + 0.5, w), rs.uniform(y0 + 0.5, h))
        yield rs.randint(0, 256, (h, w, 4)).astype(np.uint8), box, (int(rs.randint(1, 260)), int(rs.randint(1, 260)))


def pil_resize(source: np.ndarray, box, size) -> np.ndarray:
    image = Image.frombuffer("RGBX", (source.shape[1], source.shape[0]), source, "raw", "RGBX", 0, 1)
    return np.asarray(image.resize(size, Image.Resampling.BILINEAR, box))[:, :, :3]


@pytest.fixture(scope="module")
def mode() -> int:
    found = crops.resample_mode()
    if found is None:
        pytest.skip("no C resample mode matches this PIL")
    return found


@needs_native
def test_the_pil_in_use_has_a_matching_mode():
    # Pillow-SIMD and Pillow (the two PILs setup can install) both round in a way resample.c reproduces.
    assert crops.resample_mode() in (native.PILLOW, native.PILLOW_SIMD)


@needs_native
@pytest.mark.parametrize("simd", [True, False])
def test_resize_equals_pil_bit_for_bit(mode: int, simd: bool):
    decoder = crops._region_decoder()
    for source, box, size in cases(120, 3):
        ours = np.zeros((size[1], size[0], 3), np.uint8)
        decoder.resize_store(source.ctypes.data, source.shape[1::-1], box, ours, mode, simd=simd)
        assert np.array_equal(ours, pil_resize(source, box, size)), (source.shape, box, size)


@needs_native
def test_other_mode_is_not_silently_equal(mode: int):
    # The calibration can tell the two roundings apart: the other one differs somewhere.
    decoder = crops._region_decoder()
    other = native.PILLOW if mode == native.PILLOW_SIMD else native.PILLOW_SIMD
    differs = 0
    for source, box, size in cases(40, 5):
        ours = np.zeros((size[1], size[0], 3), np.uint8)
        decoder.resize_store(source.ctypes.data, source.shape[1::-1], box, ours, other)
        differs += not np.array_equal(ours, pil_resize(source, box, size))
    assert differs > 0


@needs_native
@pytest.mark.parametrize("simd", [True, False])
def test_layouts_flips_and_float_output_agree(mode: int, simd: bool):
    decoder = crops._region_decoder()
    scale = np.array([1 / 58.0, 1 / 57.0, 1 / 57.5], np.float32)
    shift = np.array([-2.1, -2.0, -1.8], np.float32)
    affine = Affine.of(scale, shift)
    for source, box, size in cases(30, 9):
        reference = pil_resize(source, box, size)
        planar = np.zeros((3, size[1], size[0]), np.uint8)
        flipped = np.zeros((3, size[1], size[0]), np.uint8)
        floats = np.zeros((3, size[1], size[0]), np.float32)
        flipped_floats = np.zeros((size[1], size[0], 3), np.float32)
        address, shape = source.ctypes.data, source.shape[1::-1]
        decoder.resize_store(address, shape, box, planar, mode, simd=simd)
        decoder.resize_store(address, shape, box, flipped, mode, flip=True, simd=simd)
        decoder.resize_store(address, shape, box, floats, mode, affine=affine.addresses, simd=simd)
        decoder.resize_store(address, shape, box, flipped_floats, mode, flip=True, affine=affine.addresses, simd=simd)
        assert np.array_equal(planar, reference.transpose(2, 0, 1))
        assert np.array_equal(flipped, planar[:, :, ::-1])
        expected = reference.transpose(2, 0, 1).astype(np.float32) * scale[:, None, None] + shift[:, None, None]
        assert np.array_equal(floats, expected)
        assert np.array_equal(flipped_floats, expected[:, :, ::-1].transpose(1, 2, 0))


@needs_native
def test_exact_integer_crop_copies_pixels(mode: int):
    decoder = crops._region_decoder()
    source = np.random.RandomState(1).randint(0, 256, (40, 50, 4)).astype(np.uint8)
    out = np.zeros((3, 20, 30), np.uint8)
    decoder.resize_store(source.ctypes.data, (50, 40), (7.0, 11.0, 37.0, 31.0), out, mode, flip=True)
    assert np.array_equal(out, source[11:31, 7:37, :3].transpose(2, 0, 1)[:, :, ::-1])


def jpeg(seed: int, width: int, height: int, **options: object) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height) + 60], axis=2)
    out = io.BytesIO()
    Image.fromarray(np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)).save(
        out, "JPEG", quality=90, **options
    )
    return out.getvalue()


@needs_native
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_loader_decode_path_equals_decode_then_pil_resize(mode: int, dtype, monkeypatch: pytest.MonkeyPatch):
    # One C call per batch piece (decode, resize, store) gives the pixels the
    # decode-then-Pillow path gives, for train and eval crops, flips and float output.
    items = [("jpg", jpeg(i, w, h, restart_marker_blocks=i % 2), i) for i, (w, h) in
             enumerate([(256, 341), (300, 256), (256, 256), (517, 389), (97, 130), (256, 280)])]  # fmt: skip
    flips = [i % 3 == 0 for i in range(len(items))]
    affine = Affine.of([1 / 58.0, 1 / 57.0, 1 / 57.5], [-2.1, -2.0, -1.8]) if dtype == np.float32 else None
    for train in (True, False):
        spec = CropSpec(112, train, decoder="region")
        fused = np.zeros((len(items), 3, 112, 112), dtype)
        assert decode_many(list(fused), items, spec, flips=flips, affine=affine) == []
        monkeypatch.setattr(crops, "_resample_mode", None)  # Pillow resizes the decoded regions
        pillow = np.zeros_like(fused)
        assert decode_many(list(pillow), items, spec, flips=flips, affine=affine) == []
        monkeypatch.setattr(crops, "_resample_mode", mode)
        assert np.array_equal(fused, pillow), train
