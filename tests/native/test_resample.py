"""The C crop-and-resize (resample.c): either PIL's arithmetic exactly, every output layout, the loader's decode path.

The loader always runs the 16-bit arithmetic (`resample_mode`); the C keeps
plain Pillow's 22-bit one too, so each can be checked bit for bit against the
PIL that computes it. How far the fast one sits from plain Pillow:
test_kernel_agreement.py.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipeline import native
from pipeline.loader import crops, slot_pixels
from pipeline.loader.cpu_decode import decode_many
from pipeline.loader.crops import Affine, CropSpec

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
    """The C arithmetic that equals the active PIL's bit for bit: Pillow-SIMD's 16-bit weights, or Pillow's 22-bit."""
    from kernel_agreement import active_pil

    return native.PILLOW_SIMD if active_pil() == "Pillow-SIMD" else native.PILLOW


@needs_native
def test_the_loader_runs_the_fast_arithmetic_whichever_pil():
    # No calibration against the active PIL: plain Pillow must not make the loader take its slower arithmetic.
    assert slot_pixels.resample_mode() == native.PILLOW_SIMD


@needs_native
@pytest.mark.parametrize("simd", [True, False])
def test_resize_equals_pil_bit_for_bit(mode: int, simd: bool):
    decoder = slot_pixels.region_decoder()
    for source, box, size in cases(120, 3):
        ours = np.zeros((size[1], size[0], 3), np.uint8)
        decoder.resize_store(source.ctypes.data, source.shape[1::-1], box, ours, mode, simd=simd)
        assert np.array_equal(ours, pil_resize(source, box, size)), (source.shape, box, size)


@needs_native
def test_other_mode_is_not_silently_equal(mode: int):
    # The calibration can tell the two roundings apart: the other one differs somewhere.
    decoder = slot_pixels.region_decoder()
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
    decoder = slot_pixels.region_decoder()
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
    decoder = slot_pixels.region_decoder()
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


def pillow_rgbx_into(slot, pixels, width, height, box, flip, affine):
    """The reference for slot_pixels.rgbx_into: PIL resizes the decoded region in the C's 16-bit arithmetic's
    PIL (Pillow-SIMD) or, under plain Pillow, in its own; then the same store."""
    image = Image.frombuffer("RGBX", (width, height), np.ascontiguousarray(pixels), "raw", "RGBX", 0, 1)
    slot_pixels._write_pixels(slot, image.resize(crops.slot_size(slot), Image.Resampling.BILINEAR, box), flip, affine)


@needs_native
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_loader_decode_path_equals_decode_then_pil_resize(mode: int, dtype, monkeypatch: pytest.MonkeyPatch):
    # One C call per batch piece (decode, resize, store) gives the pixels of the region decode followed by PIL's
    # resize, for train and eval crops, flips and float output: equal under Pillow-SIMD, within one level under Pillow.
    from pipeline.loader import region_decode

    items = [("jpg", jpeg(i, w, h, restart_marker_blocks=i % 2), i) for i, (w, h) in
             enumerate([(256, 341), (300, 256), (256, 256), (517, 389), (97, 130), (256, 280)])]  # fmt: skip
    flips = [i % 3 == 0 for i in range(len(items))]
    scale = [1 / 58.0, 1 / 57.0, 1 / 57.5]
    affine = Affine.of(scale, [-2.1, -2.0, -1.8]) if dtype == np.float32 else None
    for train in (True, False):
        spec = CropSpec(112, train, decoder="region")
        fused = np.zeros((len(items), 3, 112, 112), dtype)
        assert decode_many(list(fused), items, spec, flips=flips, affine=affine) == []
        with monkeypatch.context() as patch:  # C decodes the regions, PIL resizes them
            patch.setattr(region_decode, "resample_mode", lambda: None)
            patch.setattr(region_decode, "rgbx_into", pillow_rgbx_into)
            pillow = np.zeros_like(fused)
            assert decode_many(list(pillow), items, spec, flips=flips, affine=affine) == []
        levels = np.abs(fused.astype(np.float64) - pillow.astype(np.float64))
        if dtype == np.float32:
            levels *= 57.0  # back to pixel levels (1 / 57 is the largest of the three scales)
        assert levels.max() <= (0 if mode == native.PILLOW_SIMD else native.bindings.BILINEAR_MAX_LEVELS) + 1e-3


@needs_native
def test_c_crop_plans_equal_python_plans():
    # The loader plans crops in C; the other decoders plan them in Python: the same crop for the same seed.
    decoder = slot_pixels.region_decoder()
    rs = np.random.RandomState(11)
    specs = [CropSpec(224, True), CropSpec(112, True, scale=(0.35, 1.0), ratio=(0.5, 2.0)), CropSpec(224, False),
             CropSpec(13, False), CropSpec(61, True, scale=(0.9, 1.0))]  # fmt: skip
    sizes = [(256, 341), (341, 256), (256, 256), (517, 389), (3, 900), (1200, 800), (1, 1), (97, 130)]
    sizes += [(int(rs.randint(1, 2000)), int(rs.randint(1, 2000))) for _ in range(40)]
    for spec in specs:
        count = len(sizes)
        info = np.zeros((count, 4), np.int32)
        info[:, :2] = sizes
        seeds = rs.randint(0, 2**63, count, dtype=np.uint64) * 2 + rs.randint(0, 2, count, dtype=np.uint64)
        usable = np.ones(count, bool)
        shape = (spec.train, spec.size, spec.size, spec.size)
        params, boxes, needed = decoder.plan_many(info, usable, seeds, shape, crops.plan_numbers(spec))
        slot = np.empty((3, spec.size, spec.size), np.uint8)
        for k, (w, h) in enumerate(sizes):
            rng = crops.CropRandom(int(seeds[k])) if spec.train else None
            box, eighths, region = crops.region_plan(slot, w, h, rng, spec)
            assert tuple(boxes[k]) == box, (spec, w, h)
            assert tuple(params[k]) == (eighths, *region[:4]), (spec, w, h)
            assert needed[k] == region[4]


def test_crop_random_draws_in_range_and_spreads():
    rng = crops.CropRandom(2**64 - 1)
    values = [rng.random() for _ in range(4000)]
    assert 0.0 <= min(values) < 0.01 and 0.99 < max(values) < 1.0
    assert abs(sum(values) / len(values) - 0.5) < 0.02
    draws = [rng.randint(3, 7) for _ in range(2000)]
    assert set(draws) == {3, 4, 5, 6, 7}
    boxes = {crops.random_resized_crop_box(crops.CropRandom(seed), 256, 341, CropSpec(224)) for seed in range(200)}
    assert len(boxes) > 190  # different seeds, different crops
    areas = [w * h / (256 * 341) for _, _, w, h in boxes]
    assert min(areas) < 0.2 and max(areas) > 0.8  # the scale range (0.08, 1) is covered


@needs_native
def test_one_call_piece_reports_each_bad_sample_and_decodes_the_rest():
    cmyk = io.BytesIO()
    Image.new("CMYK", (120, 90), (10, 200, 30, 5)).save(cmyk, "JPEG", quality=90)
    big = jpeg(1, 400, 300)
    items = [("jpg", jpeg(0, 256, 300), 1), ("jpg", big, 2), ("jpg", big[:200], 3), ("jpg", cmyk.getvalue(), 4),
             ("jpg", b"\xff\xd8 not really", 5), ("jpg", jpeg(2, 256, 256, restart_marker_blocks=1), 6)]  # fmt: skip
    spec = CropSpec(64, True, decoder="region", max_pixels=100_000)
    out = np.zeros((len(items), 3, 64, 64), np.uint8)
    failures = dict(decode_many(list(out), items, spec))
    assert sorted(failures) == [1, 2, 4]
    assert "decompression bomb" in failures[1] and "400x300" in failures[1]
    # libjpeg refuses the cut header and the junk, and hands them to Pillow, whose reasons they get
    assert "truncated" in failures[2].lower() and failures[4].startswith("not an image"), failures
    for index in (0, 3, 5):  # decoded (CMYK through Pillow): real pixels, not the zeros they started as
        assert out[index].std() > 0 or index == 3 and out[index].mean() > 0


@needs_native
def test_doctor_reports_how_the_loader_resizes():
    from pipeline.measure.doctor import probe_region_decoder

    info = probe_region_decoder()
    assert info["resize"].startswith("in C (16-bit weights") and "whichever PIL is active" in info["resize"]
    assert info["resize"] in info["version"]


@needs_native
def test_portable_build_without_simd_gives_the_same_pixels(tmp_path, mode: int):
    # What a machine without x86 SIMD compiles (-DGF_NO_SIMD): the scalar kernels only, the same pixels.
    import shutil
    import subprocess

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    built = tmp_path / "portable.so"
    command = ["cc", "-O2", "-DGF_NO_SIMD", "-shared", "-fPIC", "-o", str(built), *map(str, native.build.SOURCES)]
    subprocess.run([*command, "-ljpeg", "-lm"], check=True, capture_output=True)
    portable = native.RegionDecoder(native.bindings.load(built))
    scale = np.array([0.5, 1.0, 2.0], np.float32)
    shift = np.array([1.0, 0.0, -1.0], np.float32)
    for source, box, size in cases(40, 13):
        if size[0] == 3:
            continue  # a 3-pixel-wide planar slot reads as interleaved
        reference = pil_resize(source, box, size)[:, ::-1].transpose(2, 0, 1)
        out = np.zeros((3, size[1], size[0]), np.float32)
        portable.resize_store(
            source.ctypes.data, source.shape[1::-1], box, out, mode, flip=True, affine=(scale.ctypes.data, shift.ctypes.data)
        )
        assert np.array_equal(out, reference * scale[:, None, None] + shift[:, None, None])


@needs_native
def test_damaged_jpegs_are_refused_with_reasons_never_crash():
    # Flipped bits, cut files, scribbled headers and spliced halves through the one-call path:
    # every sample either decodes or comes back with a reason; the process survives.
    import random

    rng = random.Random(3)
    sources = [jpeg(i, w, h, restart_marker_blocks=i % 2) for i, (w, h) in enumerate([(256, 300), (300, 256), (97, 130)])]
    out = np.zeros((16, 3, 64, 64), np.float32)
    affine = Affine.of([1 / 58.0, 1 / 57.0, 1 / 57.5], [-2.1, -2.0, -1.8])
    refused = 0
    for round_ in range(40):
        items = []
        for i in range(16):
            data = bytearray(rng.choice(sources))
            kind = (round_ * 16 + i) % 4
            if kind == 0:
                for _ in range(rng.randint(1, 8)):
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            elif kind == 1:
                data = data[: rng.randrange(len(data))]
            elif kind == 2:
                for _ in range(rng.randint(1, 4)):
                    data[rng.randrange(min(len(data), 600))] = rng.randrange(256)
            else:
                other = rng.choice(sources)
                data = data[: rng.randrange(len(data))] + other[rng.randrange(len(other)) :]
            items.append(("jpg", bytes(data), rng.getrandbits(64)))
        spec = CropSpec(64, round_ % 2 == 0, decoder="region")
        failures = decode_many(list(out), items, spec, flips=[i % 2 == 0 for i in range(16)], affine=affine)
        assert all(reason and reason.strip() for _, reason in failures)
        assert np.isfinite(out).all()
        refused += len(failures)
    assert 0 < refused < 40 * 16  # some damage is fatal, some is not
