"""`decode_image`: every mode to RGB, upright, scaled for the target, or a DecodeError with a reason."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from hostile_data import (  # shared with the prepare tests: one place for each kind of hostile file
    BLUE,
    EPS,
    FAKE_HEIC,
    GREEN,
    HTML,
    RED,
    TEXT,
    WHITE,
    encode,
    exif_with_orientation,
    gif_claiming,
    gradient16,
    halves,
    jpeg_claiming,
    marker,
    noise_jpeg,
    png_bomb,
    png_header_only,
    stored_for_orientation,
)
from PIL import Image

import pipeline.decode as decode_module
from pipeline.decode import decode_image, to_rgb
from pipeline.errors import DecodeError

SIMPLEJPEG = decode_module.simplejpeg
pytestmark = pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")  # PIL, on the cut TIFF


@pytest.fixture(params=["simplejpeg", "pil"])
def jpeg_decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a JPEG test through libjpeg-turbo's scaled decode and through PIL's draft mode."""
    if request.param == "simplejpeg":
        if SIMPLEJPEG is None:
            pytest.skip("simplejpeg is not installed")
    else:
        monkeypatch.setattr(decode_module, "simplejpeg", None)
    return str(request.param)


def pixels(img: Image.Image) -> np.ndarray:
    assert img.mode == "RGB"
    return np.asarray(img).astype(np.int16)


def mean(img: Image.Image, box: tuple[float, float, float, float]) -> np.ndarray:
    array = pixels(img)
    h, w = array.shape[:2]
    left, top, right, bottom = box
    return array[int(top * h) : math.ceil(bottom * h), int(left * w) : math.ceil(right * w)].reshape(-1, 3).mean(0)


def assert_colour(
    img: Image.Image, box: tuple[float, float, float, float], rgb: tuple[int, int, int], tol: int = 30
) -> None:
    found = mean(img, box)
    assert np.abs(found - rgb).max() <= tol, f"mean colour {found.round()} in {box}, expected {rgb}"


LEFT, RIGHT = (0.05, 0.1, 0.4, 0.9), (0.6, 0.1, 0.95, 0.9)


# ---------------------------------------------------------------------------
# Modes


def _file_in_mode(mode: str) -> bytes:
    size = (64, 48)
    if mode == "I;16":
        return encode(gradient16(size), "PNG")
    if mode == "I":
        array = np.tile(np.linspace(0, 65535, size[0]).astype(np.int32), (size[1], 1))
        return encode(Image.fromarray(array, "I"), "TIFF")
    if mode == "F":
        array = np.tile(np.linspace(-1.0, 1.0, size[0]).astype(np.float32), (size[1], 1))
        return encode(Image.fromarray(array, "F"), "TIFF")
    fmt = {"CMYK": "JPEG", "LAB": "TIFF"}.get(mode, "PNG")
    return encode(halves(size, RED, BLUE, mode), fmt)


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "LAB", "I;16", "I", "F"])
def test_every_file_mode_decodes_to_rgb(mode: str) -> None:
    data = _file_in_mode(mode)
    assert Image.open(io.BytesIO(data)).mode == mode, "the file must really be in that mode"
    decoded = decode_image(data)
    assert decoded.image.mode == "RGB"
    assert decoded.image.size == decoded.original_size == (64, 48)


@pytest.mark.parametrize(
    "mode",
    ["1", "L", "LA", "La", "P", "PA", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV", "I;16", "I;16B", "I", "F"],
)
def test_to_rgb_handles_every_in_memory_mode(mode: str) -> None:
    img = Image.new(mode, (8, 8))
    assert to_rgb(img, WHITE).mode == "RGB"


def test_cmyk_colours_come_out_right() -> None:
    decoded = decode_image(encode(halves((64, 48), RED, BLUE, "CMYK"), "JPEG", quality=95))
    assert_colour(decoded.image, LEFT, RED)
    assert_colour(decoded.image, RIGHT, BLUE)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "TIFF"])
def test_alpha_is_composited_on_the_background(fmt: str) -> None:
    img = Image.new("RGBA", (64, 48), (0, 0, 0, 0))  # transparent *black*: a plain convert shows black
    img.paste((0, 0, 0, 128), (22, 0, 42, 48))
    img.paste((255, 0, 0, 255), (42, 0, 64, 48))
    options = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(img, fmt, **options)
    on_white = decode_image(data).image
    assert_colour(on_white, (0.02, 0.1, 0.3, 0.9), WHITE, 2)
    assert_colour(on_white, (0.38, 0.1, 0.62, 0.9), (127, 127, 127), 3)
    assert_colour(on_white, (0.7, 0.1, 0.98, 0.9), RED, 2)
    on_grey = decode_image(data, background=(10, 200, 30)).image
    assert_colour(on_grey, (0.02, 0.1, 0.3, 0.9), (10, 200, 30), 2)


def _palette(transparency: int | bytes) -> tuple[Image.Image, dict[str, object]]:
    img = Image.new("P", (64, 48), 0)
    img.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)  # index 0 black, 1 blue
    img.paste(1, (32, 0, 64, 48))
    return img, {"transparency": transparency}


@pytest.mark.parametrize(
    "image_and_options",
    [_palette(0), _palette(bytes([0, 255])), (Image.new("LA", (64, 48), (0, 0)), {})],
    ids=["palette-index", "palette-alpha-table", "LA"],
)
def test_transparent_palette_and_la_become_background(image_and_options: tuple[Image.Image, dict]) -> None:
    img, options = image_and_options
    decoded = decode_image(encode(img, "PNG", **options))
    assert_colour(decoded.image, LEFT, WHITE, 2)


def test_16_bit_grey_is_scaled_not_clipped() -> None:
    decoded = decode_image(encode(gradient16((256, 16)), "PNG"))
    row = pixels(decoded.image)[8, :, 0]
    assert row[0] <= 2 and row[-1] >= 253, "the full 16-bit range must map onto 0..255"
    assert np.all(np.diff(row) >= 0), "a gradient must stay monotonic"
    assert 120 <= row.mean() <= 135, f"mean {row.mean()}: mostly white means 16-bit values were clipped at 255"


def test_dark_16_bit_image_stays_dark() -> None:
    # A 16-bit image whose values all fit in 8 bits is dark, not a full-range 8-bit image.
    decoded = decode_image(encode(gradient16((256, 16), high=255), "PNG"))
    assert pixels(decoded.image).max() <= 2


def test_float_image_with_nan_and_inf_decodes_to_finite_grey() -> None:
    array = np.tile(np.linspace(0.0, 1.0, 32, dtype=np.float32), (8, 1))
    array[0, :4] = np.nan
    array[1, :4] = np.inf
    grey = pixels(to_rgb(Image.fromarray(array, "F"), WHITE))[:, :, 0]
    assert grey[4, 0] == 0 and grey[4, -1] == 255  # the finite values span the range
    assert np.all(grey[:2, :4] == 0)  # NaN and inf become a defined value, not garbage


def test_one_bit_png_keeps_black_and_white() -> None:
    decoded = decode_image(encode(halves((64, 48), (0, 0, 0), WHITE, "1"), "PNG"))
    assert_colour(decoded.image, LEFT, (0, 0, 0), 0)
    assert_colour(decoded.image, RIGHT, WHITE, 0)


def test_animated_gif_gives_its_first_frame() -> None:
    first = halves((64, 48), RED, BLUE, "P")
    later = Image.new("RGB", (64, 48), GREEN).convert("P")
    decoded = decode_image(encode(first, "GIF", save_all=True, append_images=[later, later], duration=50))
    assert decoded.format == "GIF"
    assert_colour(decoded.image, LEFT, RED, 5)
    assert_colour(decoded.image, RIGHT, BLUE, 5)


# ---------------------------------------------------------------------------
# Orientation


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_gives_an_upright_jpeg(orientation: int, jpeg_decoder: str) -> None:
    stored = stored_for_orientation(marker(), orientation)
    data = encode(stored, "JPEG", quality=95, exif=exif_with_orientation(orientation))
    for scale_for in (None, lambda w, h: 0.5):
        decoded = decode_image(data, scale_for=scale_for)
        assert decoded.original_size == (160, 96)
        assert decoded.image.width > decoded.image.height, "upright picture is landscape"
        assert_colour(decoded.image, (0.03, 0.06, 0.22, 0.28), RED)
        assert_colour(decoded.image, (0.78, 0.06, 0.97, 0.28), BLUE)
        assert_colour(decoded.image, (0.1, 0.62, 0.9, 0.94), GREEN)


@pytest.mark.parametrize(
    "fmt, options",
    [("PNG", {}), ("WEBP", {"lossless": True}), ("TIFF", {}), ("TIFF", {"compression": "tiff_lzw"})],
    ids=["png", "webp", "tiff", "tiff-lzw"],
)
@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_in_other_formats_is_applied_once(fmt: str, options: dict, orientation: int) -> None:
    # PIL's TIFF loader (Pillow >= 11) rotates by itself; rotating again turns the picture.
    stored = stored_for_orientation(marker(), orientation)
    decoded = decode_image(encode(stored, fmt, exif=exif_with_orientation(orientation), **options))
    assert decoded.original_size == decoded.image.size == (160, 96)
    assert_colour(decoded.image, (0.03, 0.06, 0.22, 0.28), RED, 5)
    assert_colour(decoded.image, (0.78, 0.06, 0.97, 0.28), BLUE, 5)


@pytest.mark.parametrize("value", [0, 9, 65535])
def test_invalid_orientation_values_are_ignored(value: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = value
    decoded = decode_image(encode(marker(), "JPEG", exif=exif.tobytes()))
    assert decoded.image.size == decoded.original_size == (160, 96)
    assert_colour(decoded.image, (0.03, 0.06, 0.22, 0.28), RED)


# ---------------------------------------------------------------------------
# Scaled (DCT-domain) decode


@pytest.mark.parametrize("scale", [1.0, 0.9, 0.5, 0.3, 0.13, 0.01])
@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_scaled_jpeg_decode_gives_at_least_the_requested_size(scale: float, mode: str, jpeg_decoder: str) -> None:
    data = encode(halves((800, 600), RED, BLUE, mode), "JPEG")
    asked: list[tuple[int, int]] = []

    def scale_for(width: int, height: int) -> float:
        asked.append((width, height))
        return scale

    decoded = decode_image(data, scale_for=scale_for)
    width, height = decoded.image.size
    assert asked == [(800, 600)]
    assert decoded.original_size == (800, 600)
    assert width >= math.ceil(800 * scale) and height >= math.ceil(600 * scale)
    if scale <= 0.5:
        assert width <= 400 and height <= 300, "a target half the size or less must be DCT-scaled"
        assert width * 3 == height * 4, "scaling keeps the aspect ratio"
    if mode != "L":
        assert_colour(decoded.image, LEFT, RED)


def test_full_size_decode_without_scale_for(jpeg_decoder: str) -> None:
    decoded = decode_image(encode(halves((800, 600), RED, BLUE), "JPEG"))
    assert decoded.image.size == (800, 600)


def test_scaled_decode_of_oriented_jpeg_reports_upright_original_size(jpeg_decoder: str) -> None:
    stored = stored_for_orientation(marker((800, 480)), 6)
    decoded = decode_image(encode(stored, "JPEG", exif=exif_with_orientation(6)), scale_for=lambda w, h: 0.25)
    assert decoded.original_size == (800, 480)
    assert 200 <= decoded.image.width <= 400 and decoded.image.width > decoded.image.height


def test_camera_mpo_is_scaled_like_a_jpeg(jpeg_decoder: str) -> None:
    buffer = io.BytesIO()
    second = Image.new("RGB", (800, 600), BLUE)
    Image.new("RGB", (800, 600), RED).save(buffer, "MPO", save_all=True, append_images=[second])
    decoded = decode_image(buffer.getvalue(), scale_for=lambda w, h: 0.2)
    assert decoded.original_size == (800, 600)
    assert 160 <= decoded.image.width <= 400
    assert_colour(decoded.image, (0.1, 0.1, 0.9, 0.9), RED)


# ---------------------------------------------------------------------------
# Bad files


_noise_jpeg = noise_jpeg()
_noise_png = encode(Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 96, 3), dtype=np.uint8)), "PNG")
_lzw_tiff = encode(halves((96, 64), RED, BLUE), "TIFF", compression="tiff_lzw")
_webp = encode(halves((96, 64), RED, BLUE), "WEBP")


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", ("empty",)),
        (TEXT, ("not an image",)),
        (HTML, ("not an image", "html")),
        (b"\x00" * 300, ("not an image",)),
        (_noise_jpeg[: len(_noise_jpeg) // 2], ("jpeg", "truncated")),
        (_noise_jpeg[:200], ("jpeg", "truncated")),
        (_noise_png[: len(_noise_png) // 2], ("png", "truncated")),
        (_lzw_tiff[: len(_lzw_tiff) // 2], ("tiff", "truncated")),
        (_webp[: len(_webp) // 2], ("webp", "truncated")),
        (png_header_only(0, 0), ("png",)),
        (FAKE_HEIC, ("unsupported", "heic")),
        (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1miaf" + bytes(64), ("avif",)),
        (b"\xff\x0a" + bytes(64), ("unsupported", "jpeg xl")),
        (b"8BPS\x00\x01" + bytes(64), ("unsupported", "psd")),
        (b"%PDF-1.4\n" + bytes(64), ("unsupported", "pdf")),
        (b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>', ("unsupported", "svg")),
        (EPS, ("unsupported", "eps")),
    ],
    ids=[
        "empty", "text", "html", "zeros", "jpeg-cut-in-scan", "jpeg-cut-in-header", "png-cut", "tiff-cut",
        "webp-cut", "png-0x0", "heic", "avif", "jpeg-xl", "psd", "pdf", "svg", "eps",
    ],
)
def test_bad_files_are_rejected_with_a_reason(data: bytes, words: tuple[str, ...], jpeg_decoder: str) -> None:
    with pytest.raises(DecodeError) as caught:
        decode_image(data, scale_for=lambda w, h: 0.5)
    reason = caught.value.reason
    assert reason and str(caught.value) == reason
    for word in words:
        assert word in reason.lower(), f"{reason!r} should mention {word!r}"


def test_postscript_never_reaches_ghostscript(monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import EpsImagePlugin

    def ghostscript(*args: object, **kwargs: object) -> None:
        raise AssertionError("decode_image handed user bytes to Ghostscript")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", ghostscript)
    monkeypatch.setattr(EpsImagePlugin, "has_ghostscript", lambda: True)
    with pytest.raises(DecodeError, match="unsupported"):
        decode_image(EPS)


# ---------------------------------------------------------------------------
# Decompression bombs


@pytest.fixture
def no_pixel_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail loudly if anything decodes pixel data."""
    from PIL import ImageFile

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pixels were decoded before the bomb check")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    if SIMPLEJPEG is not None:
        monkeypatch.setattr(SIMPLEJPEG, "decode_jpeg", refuse)


@pytest.mark.parametrize(
    "data, size",
    [
        (png_header_only(20000, 20000), "20000x20000"),
        (png_bomb(12000, 12000), "12000x12000"),
        (jpeg_claiming(65000, 65000), "65000x65000"),
        (gif_claiming(60000, 60000), "60000x60000"),
    ],
    ids=["png-header", "png-valid", "jpeg-sof", "gif-screen"],
)
def test_bombs_are_refused_before_decoding(data: bytes, size: str, no_pixel_decoding: None) -> None:
    with pytest.raises(DecodeError) as caught:
        decode_image(data, scale_for=lambda w, h: 0.01)
    reason = caught.value.reason
    assert "pixel" in reason and "limit" in reason and size in reason, reason


def test_pixel_limit_is_exact_and_configurable() -> None:
    data = encode(Image.new("RGB", (100, 50), RED), "PNG")
    assert decode_image(data, max_pixels=5000).image.size == (100, 50)
    with pytest.raises(DecodeError, match="5,000 pixels is over the 4,999 limit"):
        decode_image(data, max_pixels=4999)


def test_open_image_applies_the_same_checks_without_decoding(no_pixel_decoding: None) -> None:
    from pipeline.decode import open_image

    img = open_image(encode(Image.new("RGB", (64, 48), RED), "PNG"))
    assert img.size == (64, 48) and img.format == "PNG"
    with pytest.raises(DecodeError, match="pixels is over the"):
        open_image(png_bomb(12000, 12000))
    with pytest.raises(DecodeError, match="unsupported"):
        open_image(EPS)
    with pytest.raises(DecodeError, match="empty"):
        open_image(b"")
