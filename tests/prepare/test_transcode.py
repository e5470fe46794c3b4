"""prepare's YCbCr path (transcode.py, ycc.c): the same picture as the ordinary path, or no answer at all."""

from __future__ import annotations

import ctypes
import io
import math
import threading

import numpy as np
import pytest
from hostile_data import exif_with_orientation
from PIL import Image

from pipeline import EncodeSpec, PrepareSpec, ResizeSpec, native
from pipeline.decode import decode_image, transpose_method
from pipeline.demo import render_photo_like
from pipeline.prepare import transcode
from pipeline.prepare.encode import encode_image
from pipeline.prepare.sample.make import process_item
from pipeline.prepare.sources import SourceItem
from pipeline.prepare.transforms import required_scale, resize_image
from pipeline.specs import AugmentSpec

needs_native = pytest.mark.skipif(native.library() is None, reason=f"native library unavailable: {native.problem()}")
FILTERS = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
TRANSPOSE = {orientation: transpose_method(orientation) for orientation in range(2, 9)}
# Stored pixels whose upright view (EXIF orientation applied) is the original picture.
TO_STORED = {1: None, **{o: TRANSPOSE[{6: 8, 8: 6}.get(o, o)] for o in TRANSPOSE}}


def spec(**changes: object) -> PrepareSpec:
    values: dict[str, object] = {"resize": ResizeSpec(size=96), "encode": EncodeSpec()}
    values.update(changes)
    return PrepareSpec(source="/nowhere", out="/nowhere-out", **values)  # type: ignore[arg-type]


def photo(seed: int = 0, low: int = 300, high: int = 520) -> Image.Image:
    return Image.fromarray(render_photo_like(seed, low, high, seed=seed))


def jpeg(img: Image.Image, **options: object) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", **{"quality": 92, **options})
    return buffer.getvalue()


def ordinary_bytes(data: bytes, job: PrepareSpec) -> bytes:
    decoded = decode_image(data, scale_for=lambda w, h: required_scale(job.resize, AugmentSpec(), w, h), padded=True)
    image, _ = resize_image(decoded.image, decoded.original_size, job.resize, orientation=decoded.orientation)
    return encode_image(image, job.encode)


def ordinary(data: bytes, job: PrepareSpec) -> Image.Image:
    return Image.open(io.BytesIO(ordinary_bytes(data, job)))


def psnr(a: Image.Image, b: Image.Image) -> float:
    mse = ((np.asarray(a.convert("RGB"), float) - np.asarray(b.convert("RGB"), float)) ** 2).mean()
    return 10 * math.log10(255**2 / max(mse, 1e-9))


@pytest.fixture(scope="module")
def photos() -> list[Image.Image]:
    return [photo(seed) for seed in range(6)]


@needs_native
@pytest.mark.parametrize("mode", ["shorter", "longer", "center-crop", "none"])
@pytest.mark.parametrize("resample", sorted(FILTERS))
@pytest.mark.parametrize("subsampling", ["4:2:0", "4:2:2", "4:4:4"])
def test_the_same_picture_as_the_rgb_path(photos: list[Image.Image], mode: str, resample: str, subsampling: str):
    job = spec(resize=ResizeSpec(size=96, mode=mode, resample=resample))
    for img in photos:
        data = jpeg(img, subsampling=subsampling)
        made = transcode.transcode_jpeg(data, job)
        assert made is not None
        payload, original, size, _ = made
        ours, theirs = Image.open(io.BytesIO(payload)), ordinary(data, job)
        assert (ours.size, original) == (theirs.size, img.size) and size == ours.size
        assert ours.mode == "RGB" and [layer[1:3] for layer in ours.layer] == [(2, 2), (1, 1), (1, 1)]
        assert psnr(ours, theirs) > 30, (mode, resample, img.size)


@needs_native
def test_at_least_as_close_to_a_full_resolution_resize(photos: list[Image.Image]):
    # Reference: the photo itself (no JPEG, no DCT scaling) resized in floating point by PIL.
    job = spec(resize=ResizeSpec(size=128))
    for img in photos:
        data = jpeg(img, quality=95)
        ours = Image.open(io.BytesIO(transcode.transcode_jpeg(data, job)[0]))
        reference = img.resize(ours.size, Image.Resampling.LANCZOS)
        assert psnr(ours, reference) > psnr(ordinary(data, job), reference) - 0.5


@needs_native
@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("size", [96, 97])
@pytest.mark.parametrize("subsampling", ["4:2:0", "4:2:2"])
def test_every_exif_orientation_comes_out_upright(orientation: int, size: int, subsampling: str):
    # Odd output sizes too: the output's chroma then reaches past one edge, which must be the upright image's.
    upright = photo(7, 300, 360).crop((0, 0, 301, 233))
    stored = upright.transpose(TO_STORED[orientation]) if TO_STORED[orientation] is not None else upright
    job = spec(resize=ResizeSpec(size=size))
    data = jpeg(stored, exif=exif_with_orientation(orientation), subsampling=subsampling)
    payload, original, shape, _ = transcode.transcode_jpeg(data, job)
    plain, _, plain_shape, _ = transcode.transcode_jpeg(jpeg(upright, subsampling=subsampling), job)
    ours = Image.open(io.BytesIO(payload))
    assert original == upright.size and ours.size == shape == plain_shape
    assert psnr(ours, Image.open(io.BytesIO(plain))) > 33, orientation


@needs_native
def test_only_8_bit_ycbcr_jpegs_take_it():
    img, job = photo(1), spec()
    assert transcode.transcode_jpeg(jpeg(img, progressive=True), job) is not None
    for other in (
        jpeg(img.convert("L")),
        jpeg(img.convert("CMYK")),
        (buffer := io.BytesIO(), img.save(buffer, "PNG"), buffer.getvalue())[2],
    ):
        assert transcode.transcode_jpeg(other, job) is None


@needs_native
def test_corrupt_data_is_refused_and_pillow_gives_the_reason(tmp_path):
    data = jpeg(photo(2))
    cut = data[: len(data) // 2]
    with pytest.raises(transcode.TranscodeRefused, match="Premature end of JPEG file"):
        transcode.transcode_jpeg(cut, spec())
    path = tmp_path / "cut.jpg"
    path.write_bytes(cut)
    item = SourceItem(url=str(path), rel="cut.jpg", label=None)
    outcome = process_item(item, 0, spec(), {})
    assert outcome.tars is None and outcome.reason.startswith("corrupt or truncated JPEG data: image file is truncated")


@needs_native
@pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")  # Pillow's, when a flip lands in the Exif block
def test_damaged_bytes_never_crash_it():
    # Every layout the path takes, baseline and progressive; bytes flipped anywhere or in the headers, or cut.
    rng = np.random.default_rng(0)
    bases = [
        jpeg(photo(seed, 100, 180), subsampling=subsampling, progressive=progressive, exif=exif_with_orientation(seed))
        for seed, (subsampling, progressive) in enumerate(
            [(s, p) for s in ("4:2:0", "4:2:2", "4:4:4") for p in (False, True)], start=2
        )
    ]
    jobs = [spec(), spec(resize=ResizeSpec(size=40, mode="center-crop")), spec(resize=ResizeSpec(mode="none"))]
    for trial in range(360):
        data = bytearray(bases[trial % len(bases)])
        if trial % 3 == 0:
            for at in rng.integers(2, len(data), 1 + trial % 5):
                data[at] = int(rng.integers(0, 256))
        elif trial % 3 == 1:
            data = data[: int(rng.integers(4, len(data)))]
        else:  # quantisation, Huffman and frame headers sit in the first few hundred bytes
            data[int(rng.integers(2, 600))] = int(rng.integers(0, 256))
        try:
            made = transcode.transcode_jpeg(bytes(data), jobs[trial % len(jobs)])
        except transcode.TranscodeRefused as refused:
            assert refused.message  # libjpeg's words, for the warnings of the file if Pillow reads it
            continue
        assert made is None or Image.open(io.BytesIO(made[0])).size == made[2]


@needs_native
def test_prepare_writes_this_path_and_it_is_deterministic(tmp_path):
    path = tmp_path / "a.jpg"
    path.write_bytes(jpeg(photo(4), exif=exif_with_orientation(6)))
    item = SourceItem(url=str(path), rel="a.jpg", label=None)
    first, second = process_item(item, 0, spec(), {}), process_item(item, 0, spec(), {})
    assert first.tars == second.tars and first.tars is not None
    made = transcode.transcode_jpeg(path.read_bytes(), spec())
    assert made is not None and made[0] in first.tars[0]


@needs_native
def test_quality_and_restart_settings_reach_the_encoder():
    data, job = jpeg(photo(5)), spec(resize=ResizeSpec(size=160))
    low = transcode.transcode_jpeg(data, spec(resize=job.resize, encode=EncodeSpec(quality=40)))[0]
    high = transcode.transcode_jpeg(data, spec(resize=job.resize, encode=EncodeSpec(quality=95)))[0]
    assert len(low) < 0.6 * len(high)
    assert b"\xff\xdd" in high  # DRI: a restart interval, which the loader's region decoder needs
    plain = transcode.transcode_jpeg(data, spec(resize=job.resize, encode=EncodeSpec(restart=0)))[0]
    assert b"\xff\xdd" not in plain and len(plain) < len(high)


@needs_native
def test_job_settings_that_take_the_ordinary_path():
    assert transcode.applies(spec())
    assert not transcode.applies(spec(resize=ResizeSpec(mode="pad")))
    assert not transcode.applies(spec(encode=EncodeSpec(format="webp")))
    assert not transcode.applies(spec(augment=AugmentSpec(variants=2)))


def test_dct_scale_keeps_enough_pixels():
    for width, height, scale in [(1200, 900, 0.29), (1000, 1000, 0.25), (801, 1599, 0.32), (64, 64, 1.0), (9, 7, 0.5)]:
        m = transcode.dct_scale(width, height, scale)
        assert math.ceil(width * m / 8) >= math.ceil(width * scale)
        assert math.ceil(height * m / 8) >= math.ceil(height * scale)
        assert (
            m == 1
            or math.ceil(width * (m - 1) / 8) < math.ceil(width * scale)
            or math.ceil(height * (m - 1) / 8) < math.ceil(height * scale)
        )


# ---------------------------------------------------------------------------
# The plane kernels in resample.c


def plane_resize(plane: np.ndarray, box, size, filter_code: int, simd: bool) -> np.ndarray:
    out = np.zeros((size[1], size[0]), np.uint8)
    status = native.library().gf_plane_resize(
        plane.ctypes.data, plane.strides[0], plane.shape[1], plane.shape[0], (ctypes.c_double * 4)(*box),
        out.ctypes.data, size[0], size[0], size[1], filter_code, int(simd),
    )  # fmt: skip
    assert status == 0
    return out


@needs_native
@pytest.mark.parametrize("resample", sorted(FILTERS))
def test_plane_resize_matches_pil_and_its_vector_kernel_the_scalar_one(resample: str):
    rs = np.random.RandomState(1)
    code = {"bilinear": 0, "bicubic": 1, "lanczos": 2}[resample]
    for _ in range(40):
        w, h = int(rs.randint(2, 400)), int(rs.randint(2, 300))
        plane = np.asarray(photo(int(rs.randint(0, 50)), 400, 420).convert("L"))[:h, :w].copy()
        # A quarter of the boxes reach past the plane (as the chroma box of an odd output does).
        past = 2 if rs.rand() < 0.25 else 0
        x0, y0 = rs.uniform(-past, w / 3), rs.uniform(-past, h / 3)
        box = (x0, y0, rs.uniform(x0 + 1, w + past), rs.uniform(y0 + 1, h + past))
        size = (int(rs.randint(1, 300)), int(rs.randint(1, 300)))
        vector, scalar = plane_resize(plane, box, size, code, True), plane_resize(plane, box, size, code, False)
        assert np.array_equal(vector, scalar), (plane.shape, box, size)
        if not past:  # Pillow refuses boxes outside the image
            pil = np.asarray(Image.fromarray(plane).resize(size, FILTERS[resample], box))
            assert np.abs(vector.astype(int) - pil).max() <= 3, (plane.shape, box, size)


@needs_native
@pytest.mark.parametrize("orientation", range(1, 9))
def test_plane_orient_is_pils_transpose(orientation: int):
    plane = np.random.default_rng(orientation).integers(0, 256, (37, 53), dtype=np.uint8)
    turned = orientation >= 5
    out = np.zeros((53, 37) if turned else (37, 53), np.uint8)
    status = native.library().gf_plane_orient(plane.ctypes.data, 53, 53, 37, orientation, out.ctypes.data, out.shape[1])
    assert status == 0
    expected = Image.fromarray(plane)
    if orientation != 1:
        expected = expected.transpose(TRANSPOSE[orientation])
    assert np.array_equal(out, np.asarray(expected))


@needs_native
def test_the_constant_idct_tables_are_the_computed_ones():
    # ycc.c keeps the 2- and 3-point IDCT bases as constants for speed; they must equal its formula's.
    assert native.library().gf_ycc_basis_check() == 1


def test_without_the_native_library_prepare_takes_the_rgb_path(tmp_path, monkeypatch: pytest.MonkeyPatch):
    # A machine without a C compiler or libjpeg headers: the same samples, through Pillow.
    path = tmp_path / "a.jpg"
    path.write_bytes(jpeg(photo(6), exif=exif_with_orientation(8)))
    item = SourceItem(url=str(path), rel="a.jpg", label=None)
    monkeypatch.setattr(native, "library", lambda: None)
    assert not transcode.applies(spec())
    assert transcode.transcode_jpeg(path.read_bytes(), spec()) is None
    outcome = process_item(item, 0, spec(), {})
    assert outcome.tars is not None and ordinary_bytes(path.read_bytes(), spec()) in outcome.tars[0]


@needs_native
def test_an_output_over_the_first_buffer_gets_a_larger_one(monkeypatch: pytest.MonkeyPatch):
    # Incompressible pixels: when the first output buffer is too small, C says so and a larger one takes it.
    noise = Image.fromarray(np.random.default_rng(9).integers(0, 256, (400, 600, 3), dtype=np.uint8))
    job = spec(resize=ResizeSpec(mode="none"), encode=EncodeSpec(quality=100, restart=0))
    sizes: list[int] = []
    real = transcode._buffer
    monkeypatch.setattr(transcode, "_buffer", lambda size: (sizes.append(size), real(size))[1])
    monkeypatch.setattr(transcode, "_local", threading.local())
    monkeypatch.setattr(transcode, "_BYTES_PER_PIXEL", 0.1)  # about a twentieth of what it needs
    made = transcode.transcode_jpeg(jpeg(noise, quality=100), job)
    assert made is not None and made[2] == (600, 400) and len(sizes) == 3
    assert Image.open(io.BytesIO(made[0])).size == (600, 400)
    assert sizes[1] < len(made[0]) <= sizes[2]
