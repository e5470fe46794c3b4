"""decode_into with every JPEG decoder: region decoding, layouts, flips, bad data, and the native build."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline import native
from pipeline.errors import DecodeError
from pipeline.loader.cpu_decode import decode_into, decode_many, default_decoder
from pipeline.loader.crops import Affine, CropSpec

REPO = Path(__file__).resolve().parents[2]
needs_region = pytest.mark.skipif(native.library() is None, reason=f"region decoder unavailable: {native.problem()}")


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise: JPEG blocks with real detail, chroma that varies."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height) + 60], axis=2)
    return np.clip(base + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)


def jpeg(array: np.ndarray, **options: object) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, "JPEG", quality=90, **options)
    return out.getvalue()


SAMPLES = [jpeg(photo(w, h, seed)) for seed, (w, h) in enumerate([(256, 341), (300, 256), (256, 256), (517, 389)])]


def decoded(
    decoder: str, data: bytes, train: bool, seed: int, planar: bool = True, flip: bool = False, size: int = 224
):
    slot = np.zeros((3, size, size) if planar else (size, size, 3), np.uint8)
    decode_into(slot, "jpg", data, CropSpec(size, train, decoder=decoder), seed, flip=flip)
    return slot


@needs_region
def test_region_decoder_is_exact_in_eval_and_within_a_level_in_train():
    for index, data in enumerate(SAMPLES):
        reference = decoded("simplejpeg", data, False, index)
        if index < 3:  # eval crops of images at the prepared size: no DCT scaling, bit-exact
            assert np.array_equal(decoded("region", data, False, index), reference)
        else:  # DCT-scaled: only rounding at the region's iMCU edges differs
            assert np.abs(decoded("region", data, False, index).astype(int) - reference).max() <= 1
        for seed in range(index * 10, index * 10 + 10):
            difference = np.abs(
                decoded("region", data, True, seed).astype(int) - decoded("simplejpeg", data, True, seed)
            )
            assert difference.max() <= 2, seed


@needs_region
def test_region_decoder_matches_pillow_crop_and_resize():
    # The same crop box through Pillow alone (decode, RGB, resize with the box) agrees closely.
    data = SAMPLES[0]
    for seed in range(8):
        ours = decoded("region", data, True, seed).astype(int)
        pil = decoded("pil", data, True, seed).astype(int)
        assert np.abs(ours - pil).mean() < 1.0


@pytest.mark.parametrize("decoder", ["region", "simplejpeg", "pil"])
def test_layouts_and_flips_agree(decoder: str):
    if decoder == "region" and native.library() is None:
        pytest.skip("region decoder unavailable")
    data = SAMPLES[1]
    for seed, size in ((3, 224), (4, 13), (5, 61)):  # odd sizes take the store's remainder paths
        planar = decoded(decoder, data, True, seed, size=size)
        interleaved = decoded(decoder, data, True, seed, planar=False, size=size)
        assert np.array_equal(planar, interleaved.transpose(2, 0, 1))
        assert np.array_equal(decoded(decoder, data, True, seed, flip=True, size=size), planar[:, :, ::-1])
        assert np.array_equal(
            decoded(decoder, data, True, seed, planar=False, flip=True, size=size), interleaved[:, ::-1]
        )


def test_npy_samples_flip_and_lay_out_like_images():
    array = photo(70, 90, 7)
    data = io.BytesIO()
    np.save(data, array)
    planar = np.empty((3, 64, 64), np.uint8)
    flipped = np.empty((3, 64, 64), np.uint8)
    decode_into(planar, "npy", data.getvalue(), CropSpec(64, False), 0)
    decode_into(flipped, "npy", data.getvalue(), CropSpec(64, False), 0, flip=True)
    assert np.array_equal(flipped, planar[:, :, ::-1])


@needs_region
@pytest.mark.parametrize(
    "data, reason",
    [
        (SAMPLES[0][: len(SAMPLES[0]) // 3], "truncated"),  # libjpeg refuses it, and so does Pillow
        (b"\xff\xd8\xff\xe0not a jpeg at all" * 10, "JPEG|marker|not"),
        (b"", "empty|JPEG|not"),
    ],
)
def test_region_decoder_refuses_bad_data_with_a_reason(data: bytes, reason: str):
    with pytest.raises(DecodeError, match=f"(?i){reason}"):
        decoded("region", data, False, 0)


@needs_region
def test_region_decoder_hands_cmyk_to_pillow():
    cmyk = Image.fromarray(photo(200, 180, 9)).convert("CMYK")
    out = io.BytesIO()
    cmyk.save(out, "JPEG", quality=90)
    ours = decoded("region", out.getvalue(), False, 0, size=150)
    pil = decoded("pil", out.getvalue(), False, 0, size=150)
    assert np.array_equal(ours, pil)


@needs_region
def test_grayscale_and_progressive_jpegs_decode_by_region():
    gray = jpeg(photo(240, 260, 11)[:, :, 0])
    progressive = jpeg(photo(260, 240, 12), progressive=True)
    for data in (gray, progressive):
        for seed in range(4):
            difference = np.abs(
                decoded("region", data, True, seed).astype(int) - decoded("simplejpeg", data, True, seed)
            )
            assert difference.max() <= 2


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
        check=False,
    )


def test_region_decoder_builds_once_into_the_cache(tmp_path: Path):
    if native.library() is None:
        pytest.skip(f"no compiler or libjpeg headers here: {native.problem()}")
    code = """
        from pipeline import native
        from pipeline.loader.cpu_decode import default_decoder
        native.installed_library = lambda: None  # the first-use build, even beside an in-place one
        print(native.library()._name, default_decoder())
    """
    first = run_python(code, GPUFEED_CACHE=str(tmp_path))
    assert first.returncode == 0, first.stderr
    path, decoder = first.stdout.split()
    assert decoder == "region" and Path(path).parent == tmp_path / "native"
    built = Path(path).stat().st_mtime_ns
    again = run_python(code, GPUFEED_CACHE=str(tmp_path))
    assert again.stdout.split()[0] == path and Path(path).stat().st_mtime_ns == built
    assert [p.name for p in (tmp_path / "native").iterdir()] == [Path(path).name]  # no partial files left


def test_without_a_compiler_the_loader_falls_back_and_doctor_says_why(tmp_path: Path):
    code = """
        from pipeline import native
        from pipeline.loader.cpu_decode import default_decoder
        from pipeline.measure.doctor import probe_region_decoder
        native.installed_library = lambda: None  # as in a checkout that pip never built
        print(default_decoder())
        print(probe_region_decoder()["error"])
    """
    result = run_python(code, GPUFEED_CACHE=str(tmp_path), CC="/nonexistent/cc")
    assert result.returncode == 0, result.stderr
    decoder, reason = result.stdout.splitlines()
    assert decoder in ("simplejpeg", "pil")
    assert "no C compiler" in reason
    assert default_decoder() in ("region", "simplejpeg", "pil")


# Restart markers (gpufeed prepare writes one every MCU): the region decoder
# then decodes only the MCUs a crop covers, from a smaller JPEG it builds.
RESTART_IMAGES = [
    (photo(256, 341, 20), {}),  # 4:2:0, 16x16 MCUs, 16 x 22 of them
    (photo(341, 256, 21), {"subsampling": 0}),  # 4:4:4, 8x8 MCUs, a partial last column
    (photo(250, 262, 22)[:, :, 0], {}),  # grayscale: one 8x8 block per MCU
    (photo(517, 389, 23), {}),  # large enough for DCT scaling
]


def region(data: bytes, scale: int, box: tuple[int, int, int, int]) -> np.ndarray:
    decoder = native.RegionDecoder(native.library())
    buffer = np.zeros(4 << 20, np.uint8)
    first, width = decoder.decode(data, scale, box, buffer.ctypes.data, buffer.nbytes)
    rows = buffer[: width * 4 * box[3]].reshape(box[3], width, 4)
    return rows[:, box[0] - first : box[0] - first + box[2], :3]


@needs_region
@pytest.mark.parametrize("interval", [1, 2, 3])
def test_restart_markers_give_the_same_pixels_from_less_data(interval: int):
    for array, options in RESTART_IMAGES:
        plain, restarts = jpeg(array, **options), jpeg(array, restart_marker_blocks=interval, **options)
        decoder = native.RegionDecoder(native.library())
        height, width = array.shape[:2]
        rng = np.random.default_rng(interval)
        for scale in (8, 5, 3):
            scaled_width, scaled_height = -(-width * scale // 8), -(-height * scale // 8)
            for _ in range(12):
                w, h = (int(rng.integers(8, side + 1)) for side in (scaled_width, scaled_height))
                x, y = int(rng.integers(0, scaled_width - w + 1)), int(rng.integers(0, scaled_height - h + 1))
                box = (x, y, w, h)
                ours = region(restarts, scale, box)
                # Inside the box, identical to decoding the whole image (2 px in from
                # the rectangle's edges, where chroma upsampling has no neighbours).
                assert np.array_equal(ours[2:-2, 2:-2], region(plain, scale, box)[2:-2, 2:-2]), (scale, box)
                built = decoder.region_jpeg(restarts, scale, box)
                if built is not None:
                    assert len(built[0]) < len(restarts)
        # A small crop at the bottom right reads a JPEG of only its blocks, which any decoder opens.
        scale = 8
        box = (width - 40, height - 40, 24, 24)
        built = decoder.region_jpeg(restarts, scale, box)
        columns = -(-width // (8 if array.ndim == 2 or options else 16))
        if columns % interval:
            assert built is None  # intervals that do not divide a row: the whole JPEG is decoded
            continue
        assert built is not None
        small, left, top = built
        assert len(small) < len(restarts) / 4
        opened = np.asarray(Image.open(io.BytesIO(small)).convert("RGB"))
        full = np.asarray(Image.open(io.BytesIO(plain)).convert("RGB"))
        assert left <= box[0] and top <= box[1]
        assert left + opened.shape[1] >= box[0] + box[2] and top + opened.shape[0] >= box[1] + box[3]
        window = full[top : top + opened.shape[0], left : left + opened.shape[1]]
        assert np.array_equal(opened[2:-2, 2:-2], window[2:-2, 2:-2])


@needs_region
def test_restart_crops_match_the_plain_decode_in_train_and_eval():
    for index, (array, options) in enumerate(RESTART_IMAGES):
        plain, restarts = jpeg(array, **options), jpeg(array, restart_marker_blocks=1, **options)
        assert np.array_equal(decoded("region", restarts, False, index), decoded("region", plain, False, index))
        for seed in range(10):
            assert np.array_equal(decoded("region", restarts, True, seed), decoded("region", plain, True, seed))


@needs_region
def test_damaged_restart_data_goes_to_pillow_not_misplaced():
    # The region decoder refuses damage libjpeg only warns about; Pillow decodes that sample, and its verdict stands.
    array, _ = RESTART_IMAGES[0]
    restarts = bytearray(jpeg(array, restart_marker_blocks=1))
    markers = [i for i in range(len(restarts) - 1) if restarts[i] == 0xFF and 0xD0 <= restarts[i + 1] <= 0xD7]
    restarts[markers[len(markers) // 2] + 1] ^= 0x01  # one restart marker out of sequence
    decoder = native.RegionDecoder(native.library())
    width, height = decoder.header(bytes(restarts))
    rows = np.empty(width * height * 4, np.uint8)
    with pytest.raises(native.RegionError, match="Corrupt JPEG data"):
        decoder.decode(bytes(restarts), 8, (0, 0, width, height), rows.ctypes.data, rows.size)
    for train, seed in ((False, 0), (True, 3)):  # eval: the centre crop crosses the damage
        assert np.array_equal(decoded("region", bytes(restarts), train, seed), decoded("pil", bytes(restarts), train, seed))
    truncated = jpeg(array, restart_marker_blocks=1)[: len(restarts) // 2]
    with pytest.raises(DecodeError, match="truncated"):
        decoded("region", truncated, False, 0)


@pytest.mark.parametrize("decoder", ["region", "simplejpeg"])
def test_decode_many_equals_one_decode_into_per_sample(decoder: str):
    if decoder == "region" and native.library() is None:
        pytest.skip("region decoder unavailable")
    cmyk = io.BytesIO()
    Image.fromarray(photo(200, 180, 9)).convert("CMYK").save(cmyk, "JPEG", quality=90)
    npy = io.BytesIO()
    np.save(npy, photo(70, 90, 7))
    items = [
        ("jpg", SAMPLES[0], 1),
        ("jpg", SAMPLES[0][: len(SAMPLES[0]) // 3], 2),  # truncated
        ("jpg", jpeg(photo(256, 300, 30), restart_marker_blocks=1), 3),
        ("jpeg", cmyk.getvalue(), 4),
        ("npy", npy.getvalue(), 5),
        ("jpg", b"not a jpeg", 6),
        ("jpg", SAMPLES[3], 7),
    ]
    flips = [False, False, True, True, False, False, True]
    affine = Affine.of([1 / 58.0, 1 / 57.0, 1 / 57.5], [-2.1, -2.0, -1.8])
    for train in (True, False):
        spec = CropSpec(64, train, decoder=decoder)
        many = np.full((len(items), 3, 64, 64), np.nan, np.float32)
        failures = decode_many(list(many), items, spec, flips=flips, affine=affine)
        assert [index for index, _ in failures] == [1, 5]
        assert all(reason for _, reason in failures)
        for index, (extension, data, seed) in enumerate(items):
            if index in (1, 5):
                with pytest.raises(DecodeError):
                    decode_into(np.empty((3, 64, 64), np.float32), extension, data, spec, seed, affine=affine)
                continue
            one = np.empty((3, 64, 64), np.float32)
            decode_into(one, extension, data, spec, seed, flip=flips[index], affine=affine)
            assert np.array_equal(many[index], one), (train, index)
