"""prepare's one-call JPEG path (transcode.py): the general path's bytes, or no answer at all."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from hostile_data import exif_with_orientation, make_hostile_dataset
from PIL import Image

from pipeline import EncodeSpec, PrepareSpec, ResizeSpec, ShardSpec, crops, native, prepare_dataset, transcode
from pipeline.demo import make_demo_dataset
from pipeline.specs import AugmentSpec

pytestmark = pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")
needs_native = pytest.mark.skipif(native.library() is None, reason=f"native library unavailable: {native.problem()}")


def spec(**changes: object) -> PrepareSpec:
    values: dict[str, object] = {"resize": ResizeSpec(size=96), "encode": EncodeSpec()}
    values.update(changes)
    return PrepareSpec(source="/nowhere", out="/nowhere-out", **values)  # type: ignore[arg-type]


def photo(size: tuple[int, int], seed: int = 0, mode: str = "RGB", **save: object) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0 : size[1], 0 : size[0]]
    pixels = np.clip((x + y)[..., None] % 256 + rng.integers(-30, 30, (size[1], size[0], 3)), 0, 255)
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).convert(mode).save(buffer, "JPEG", quality=92, **save)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    root = tmp_path_factory.mktemp("demo")
    make_demo_dataset(root, 24, classes=2, min_side=150, max_side=420, workers=1)
    return [path.read_bytes() for path in sorted(root.rglob("*.jpg"))]


@needs_native
def test_the_fast_path_is_on_here():
    # The machine setup builds (native library, simplejpeg, Pillow-SIMD) all agree: the check passes.
    assert transcode.transcoder(spec()) is not None


@needs_native
@pytest.mark.parametrize("mode", ["shorter", "longer", "center-crop"])
@pytest.mark.parametrize("resample", sorted(native.FILTERS))
def test_same_bytes_as_the_general_path(demo: list[bytes], mode: str, resample: str):
    job = spec(resize=ResizeSpec(size=96, mode=mode, resample=resample))
    fast = transcode.transcoder(job)
    assert fast is not None
    for data in demo:
        made = fast(data)
        assert made is not None
        assert made[0] == transcode.general_path(data, job)
        with Image.open(io.BytesIO(made[0])) as image:
            assert image.size == made[2]
        with Image.open(io.BytesIO(data)) as source:
            assert made[1] == source.size


@needs_native
@pytest.mark.parametrize(
    "encode", [EncodeSpec(quality=75, restart=0), EncodeSpec(quality=100, restart=4), EncodeSpec(quality=30)]
)
def test_same_bytes_for_other_encode_settings(demo: list[bytes], encode: EncodeSpec):
    job = spec(encode=encode)
    fast = transcode.transcoder(job)
    assert fast is not None
    for data in demo[:6]:
        made = fast(data)
        assert made is not None and made[0] == transcode.general_path(data, job)


@needs_native
@pytest.mark.parametrize(
    "data",
    [
        photo((333, 251), mode="L"),  # greyscale
        photo((301, 199), subsampling=0),  # 4:4:4
        photo((257, 403), subsampling=1),  # 4:2:2
        photo((97, 80)),  # smaller than the target: kept as it is (no upscale)
        photo((1200, 64)),  # a strip: the shorter side is already below the target
        photo((640, 480), progressive=True),
    ],
    ids=["grey", "444", "422", "small", "strip", "progressive"],
)
def test_same_bytes_for_other_kinds_of_jpeg(data: bytes):
    job = spec()
    made = transcode.transcoder(job)(data)  # type: ignore[misc]
    assert made is not None and made[0] == transcode.general_path(data, job)


@needs_native
@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("mode", ["shorter", "longer", "center-crop"])
def test_exif_rotated_jpegs_are_turned_as_pil_turns_them(orientation: int, mode: str):
    job = spec(resize=ResizeSpec(size=96, mode=mode))
    data = photo((333, 203), exif=exif_with_orientation(orientation))
    made = transcode.transcoder(job)(data)  # type: ignore[misc]
    assert made is not None and made[0] == transcode.general_path(data, job)
    assert made[1] == ((203, 333) if orientation >= 5 else (333, 203))  # the upright original size


def cmyk_jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("CMYK", (200, 150), (10, 200, 30, 0)).save(buffer, "JPEG")
    return buffer.getvalue()


def with_app1(data: bytes, payload: bytes) -> bytes:
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + data[2:]


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (200, 150)).save(buffer, "PNG")
    return buffer.getvalue()


@needs_native
@pytest.mark.parametrize(
    "data",
    [
        with_app1(photo((300, 200)), b'http://ns.adobe.com/xap/1.0/\0<x:xmpmeta tiff:Orientation="3"/>'),
        with_app1(photo((300, 200), exif=exif_with_orientation(1)), b"Exif\0\0MM\0*garbage"),  # two Exif blocks
        with_app1(photo((300, 200)), b"Exif\0\0II*\0\xff\xff\xff\x7f"),  # IFD0 outside the block
        cmyk_jpeg(),
        png(),
        photo((300, 200))[:3000],  # truncated
        b"",
        b"\xff\xd8\xff\xe0 not really a jpeg",
    ],
    ids=["xmp", "two-exif", "bad-exif", "cmyk", "png", "truncated", "empty", "garbage"],
)
def test_declines_what_the_general_path_must_handle(data: bytes):
    assert transcode.transcoder(spec())(data) is None  # type: ignore[misc]


@needs_native
def test_declines_images_over_the_pixel_limit():
    data = photo((300, 200))
    assert transcode.transcoder(spec(max_pixels=300 * 200))(data) is not None  # type: ignore[misc]
    assert transcode.transcoder(spec(max_pixels=300 * 200 - 1))(data) is None  # type: ignore[misc]


@needs_native
@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("byte_order", ["little", "big"])
def test_exif_orientation_reads_as_pil_reads_it(orientation: int, byte_order: str):
    exif = Image.Exif()
    exif[0x0112] = orientation
    exif[0x010F] = "camera"  # another IFD0 entry around the one looked for
    exif.endian = "<" if byte_order == "little" else ">"
    data = photo((120, 90), exif=exif.tobytes())
    with Image.open(io.BytesIO(data)) as image:
        assert image.getexif().get(0x0112) == orientation
    info = crops._region_decoder().jpeg_info(data)  # type: ignore[union-attr]
    assert info is not None and info[4] == orientation


@needs_native
def test_exif_without_orientation_is_upright():
    exif = Image.Exif()
    exif[0x010F] = "camera"
    info = crops._region_decoder().jpeg_info(photo((120, 90), exif=exif.tobytes()))  # type: ignore[union-attr]
    assert info is not None and info[4] == 1


def test_jobs_it_does_not_do():
    for job in (
        spec(encode=EncodeSpec(format="webp")),
        spec(encode=EncodeSpec(format="png")),
        spec(resize=ResizeSpec(size=96, mode="pad")),
        spec(resize=ResizeSpec(size=96, mode="none")),
        spec(augment=AugmentSpec(variants=2)),
    ):
        assert not transcode.eligible(job)
        assert transcode.transcoder(job) is None


@needs_native
def test_a_build_that_differs_is_not_used(monkeypatch: pytest.MonkeyPatch):
    # Another PIL or libjpeg that writes other bytes: every image takes the general path.
    real = transcode.general_path
    monkeypatch.setattr(transcode, "general_path", lambda data, job: real(data, job) + b"\0")
    monkeypatch.setattr(transcode, "_checked", {})
    assert transcode.transcoder(spec(resize=ResizeSpec(size=77))) is None


@needs_native
def test_prepare_writes_the_same_shards_either_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The hostile dataset (rotated, CMYK, PNG, broken files ...) and demo photos, fast path on and off."""
    src = tmp_path / "src"
    make_hostile_dataset(src, filesystem_tricks=False)
    make_demo_dataset(src, 12, classes=2, min_side=150, max_side=300, workers=1)
    used = []
    real = transcode.Transcoder.__call__

    def counting(self, data: bytes):  # type: ignore[no-untyped-def]
        made = real(self, data)
        used.append(made is not None)
        return made

    monkeypatch.setattr(transcode.Transcoder, "__call__", counting)

    def run(name: str) -> dict[str, bytes]:
        job = PrepareSpec(
            source=str(src), out=str(tmp_path / name), resize=ResizeSpec(size=64), shards=ShardSpec(max_samples=10)
        )
        prepare_dataset(job, workers=0)
        return {
            str(path.relative_to(tmp_path / name)): path.read_bytes()
            for path in sorted((tmp_path / name).rglob("*"))
            if path.is_file() and path.name != "manifest.json"
        }

    fast = run("fast")
    assert sum(used) >= 12 + 7 and not all(used)  # demo photos and rotated JPEGs took it, the oddities did not
    monkeypatch.setattr("pipeline.prepare.transcoder", lambda job: None)
    assert run("general") == fast


@needs_native
def test_doctor_says_how_prepare_transcodes(monkeypatch: pytest.MonkeyPatch):
    from pipeline.doctor import probe_region_decoder

    info = probe_region_decoder()
    assert info["prepare"] == "one C call, the same bytes as PIL's"
    assert info["prepare"] in info["version"]
    monkeypatch.setattr(transcode, "transcoder", lambda job: None)
    assert probe_region_decoder()["prepare"].startswith("through PIL")


@needs_native
def test_damaged_exif_never_crashes_the_header_reader():
    # Random bytes and damaged copies of a real Exif block: an orientation PIL would also find, or "unknown".
    rng = np.random.default_rng(11)
    base = photo((64, 48))
    real = exif_with_orientation(6)  # "Exif\0\0" + a big-endian TIFF block
    decoder = crops._region_decoder()
    assert decoder is not None
    for trial in range(400):
        if trial % 2:
            block = bytearray(real)
            for _ in range(int(rng.integers(1, 6))):
                block[int(rng.integers(6, len(block)))] = int(rng.integers(0, 256))
            block = bytes(block[: int(rng.integers(6, len(block) + 1))])
        else:
            block = b"Exif\0\0" + (b"II*\0" if trial % 4 == 0 else b"MM\0*") + rng.bytes(int(rng.integers(0, 80)))
        info = decoder.jpeg_info(with_app1(base, block))
        assert info is not None and info[4] in (native.ORIENTATION_UNKNOWN, *range(1, 9)), block
