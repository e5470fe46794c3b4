"""Accept what Pillow reads: JPEGs libjpeg decodes with only a warning are kept, with the warning.

Each damaged file is made here from a clean JPEG that Pillow wrote: junk bytes
before a marker, FF00 padding between header segments, an ICC marker after
the frame header, a truncated Adobe (APP14) segment, a broken Photoshop
(APP13) block, a broken Exif (APP1) block, a scan cut short and closed with
an EOI. libjpeg decodes all of them, warning about some; the fast decoders
(prepare's YCbCr path, simplejpeg, the loader's region decoder) refuse a
file on a warning, and Pillow then decides. A file cut short is still
rejected, as Pillow rejects it. `strict` stops at the first reject.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline import EncodeSpec, PrepareSpec, ResizeSpec, ShardSpec, native, prepare_dataset
from pipeline import decode as gate
from pipeline.errors import DecodeError, NoImagesError, SampleError
from pipeline.loader.cpu_decode import decode_into
from pipeline.loader.crops import CropSpec
from pipeline.prepare import transcode
from pipeline.prepare.job import PrepareProgress

pytestmark = pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")  # plain Pillow's, in these tests
needs_native = pytest.mark.skipif(native.library() is None, reason=f"native library unavailable: {native.problem()}")

WIDTH, HEIGHT = 96, 64
SIZE = 60  # shorter side 64 -> 60: no DCT scaling on any decoder (none reduces by less than 1/8), so every
OUT_SIZE = (90, 60)  # decoder starts from the same full-size pixels and Pillow's resize makes the rest
EXTRANEOUS_DQT = "Corrupt JPEG data: 5 extraneous bytes before marker 0xdb"
EXTRANEOUS_SOF = "Corrupt JPEG data: 4 extraneous bytes before marker 0xc0"
EXTRANEOUS_SOS = "Corrupt JPEG data: 3 extraneous bytes before marker 0xda"
PREMATURE_END = "Corrupt JPEG data: premature end of data segment"


# ---------------------------------------------------------------------------
# Making the files


def picture(width: int = WIDTH, height: int = HEIGHT, seed: int = 0) -> np.ndarray:
    """Gradients and noise: blocks with detail, chroma that varies."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x * 3 + y * 2) % 256], axis=-1)
    return np.clip(base + rng.integers(-24, 24, base.shape), 0, 255).astype(np.uint8)


def clean_jpeg(**options: Any) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(picture()).save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()


def header_segments(data: bytes) -> Iterator[tuple[int, int, int]]:
    """(offset, marker, length with the marker) of each segment from after SOI up to and including SOS."""
    at = 2
    while True:
        assert data[at] == 0xFF, f"no marker at {at}"
        marker, length = data[at + 1], struct.unpack(">H", data[at + 2 : at + 4])[0] + 2
        yield at, marker, length
        if marker == 0xDA:
            return
        at += length


def before(data: bytes, marker: int, extra: bytes) -> bytes:
    at = next(offset for offset, found, _ in header_segments(data) if found == marker)
    return data[:at] + extra + data[at:]


def after(data: bytes, marker: int, extra: bytes) -> bytes:
    at = next(offset + length for offset, found, length in header_segments(data) if found == marker)
    return data[:at] + extra + data[at:]


def segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def cut_scan(data: bytes) -> bytes:
    """The scan cut at two thirds and closed with an EOI: libjpeg fills the rest with grey and warns."""
    return data[: len(data) * 2 // 3] + b"\xff\xd9"


JPEG = clean_jpeg()
# name -> (bytes, the warnings the native library's libjpeg gives: the YCbCr path's and the region decoder's)
WARNING_CASES: dict[str, tuple[bytes, list[str]]] = {
    "junk-before-dqt": (before(JPEG, 0xDB, b"\x01\x02\x03\x04\x05"), [EXTRANEOUS_DQT]),
    "ff00-padding-before-sof": (before(JPEG, 0xC0, b"\xff\x00\xff\x00"), [EXTRANEOUS_SOF]),
    "junk-before-sos": (before(JPEG, 0xDA, b"\x00\x7f\x00"), [EXTRANEOUS_SOS]),
    "junk-twice": (before(before(JPEG, 0xDA, b"\x00\x7f\x00"), 0xDB, b"\x01\x02\x03\x04\x05"), [EXTRANEOUS_DQT, EXTRANEOUS_SOS]),
    "icc-after-sof": (after(JPEG, 0xC0, segment(0xE2, b"ICC_PROFILE\x00\x01\x01" + bytes(64))), []),
    "icc-bad-sequence": (after(JPEG, 0xC0, segment(0xE2, b"ICC_PROFILE\x00\x00\x00" + bytes(64))), []),
    "app14-truncated": (before(JPEG, 0xDB, segment(0xEE, b"Adobe\x00\x64")), []),
    "app13-broken": (before(JPEG, 0xDB, segment(0xED, b"Photoshop 3.0\x008BIM\x04\x04\x00\x00\xff\xff\xff\xf0")), []),
    "exif-broken": (before(JPEG, 0xDB, segment(0xE1, b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\x00\x05\x01\x12\x00\x03")), []),
    "fill-bytes-before-sof": (before(JPEG, 0xC0, b"\xff\xff\xff"), []),  # legal: no warning at all
    "scan-cut-then-eoi": (cut_scan(JPEG), [PREMATURE_END]),
}
CUT_SHORT = JPEG[: len(JPEG) * 2 // 3]  # no EOI: Pillow runs out of data and refuses it
PILLOW_EXIF = "(?i)corrupt exif"  # Pillow's own warning about the broken Exif block


def simplejpeg_message(data: bytes) -> str:
    """What simplejpeg says when it refuses the file ('' when it decodes it)."""
    try:
        simplejpeg.decode_jpeg(data)
    except ValueError as exc:
        return str(exc)
    return ""


def simplejpeg_refuses(data: bytes) -> bool:
    return bool(simplejpeg_message(data))


def pillow_pixels(data: bytes, size: tuple[int, int] = OUT_SIZE) -> np.ndarray:
    """What plain Pillow makes of the file: decoded, converted, resized as prepare resizes (Lanczos)."""
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        return np.asarray(img.convert("RGB").resize(size, Image.Resampling.LANCZOS))


def pillow_jpeg(data: bytes) -> bytes:
    """Pillow's decode and resize of the file, encoded as prepare encodes (quality 90, a restart every MCU)."""
    buffer = io.BytesIO()
    Image.fromarray(pillow_pixels(data)).save(buffer, "JPEG", quality=90, restart_marker_blocks=1)
    return buffer.getvalue()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(float) - b.astype(float)) ** 2).mean())
    return 10 * np.log10(255**2 / max(mse, 1e-9))


# ---------------------------------------------------------------------------
# The fast decoders refuse the warning files; Pillow reads them


def test_pillow_reads_every_case_and_refuses_the_cut_file() -> None:
    for name, (data, _) in WARNING_CASES.items():
        assert pillow_pixels(data).shape == (60, 90, 3), name
    with pytest.raises(OSError, match="truncated"), Image.open(io.BytesIO(CUT_SHORT)) as img:
        img.load()


@needs_native
def test_the_native_decoders_refuse_exactly_the_files_libjpeg_warns_about() -> None:
    job = PrepareSpec(source="/nowhere", out="/nowhere-out", resize=ResizeSpec(size=SIZE))
    for name, (data, warned) in WARNING_CASES.items():
        assert native.jpeg_warnings(data) == warned, name
        if warned:
            with pytest.raises(transcode.TranscodeRefused) as refused:
                transcode.transcode_jpeg(data, job)
            assert refused.value.message == warned[0], name
        else:
            assert transcode.transcode_jpeg(data, job) is not None, name
    assert native.jpeg_warnings(JPEG) == []
    assert native.jpeg_warnings(b"\xff\xd8\xff\xe0 not a JPEG") is None  # an error, not a warning


@needs_native
def test_the_warning_list_keeps_what_fits_each_message_whole() -> None:
    # 80 copies of the Huffman tables (redefining tables is legal), each after k junk bytes: 80 distinct warnings.
    offset, _, length = next(found for found in header_segments(JPEG) if found[1] == 0xC4)
    tables = b"".join(bytes(range(1, k + 1)) + JPEG[offset : offset + length] for k in range(1, 81))
    warned = native.jpeg_warnings(JPEG[:offset] + tables + JPEG[offset:])
    assert warned is not None and 20 < len(warned) < 80 and sum(map(len, warned)) + len(warned) <= 2048
    assert warned == [f"Corrupt JPEG data: {k} extraneous bytes before marker 0xc4" for k in range(1, len(warned) + 1)]


@pytest.mark.parametrize("name", sorted(WARNING_CASES))
def test_decode_image_hands_a_file_simplejpeg_refuses_to_pillow(name: str) -> None:
    data, native_warnings = WARNING_CASES[name]
    decoded = gate.decode_image(data, scale_for=lambda w, h: SIZE / HEIGHT)
    assert np.array_equal(np.asarray(decoded.image), pillow_pixels(data, (WIDTH, HEIGHT)))
    refused = simplejpeg_message(data)
    if refused:  # Pillow decoded it: simplejpeg's message first, then what the native scan adds
        assert decoded.warnings[0] == refused
        assert set(native_warnings) <= set(decoded.warnings) or native.library() is None
    elif name == "exif-broken":
        assert len(decoded.warnings) == 1 and "exif" in decoded.warnings[0].lower()
    else:
        assert decoded.warnings == []


def test_a_refusal_from_another_path_goes_straight_to_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    data, _ = WARNING_CASES["junk-before-dqt"]
    monkeypatch.setattr(gate, "simplejpeg", None)  # Pillow alone: it says nothing about libjpeg's warnings
    assert gate.decode_image(data).warnings == []
    decoded = gate.decode_image(data, refused="the message of the path that refused it")
    assert decoded.warnings[0] == "the message of the path that refused it"
    assert np.array_equal(np.asarray(decoded.image), pillow_pixels(data, (WIDTH, HEIGHT)))


def test_pillows_warnings_about_the_file_are_kept_and_others_pass_through() -> None:
    kept: list[str] = []
    with pytest.warns(DeprecationWarning, match="an old call"), gate.pillow_warnings(kept):
        warnings.warn("Corrupt EXIF data.  Expecting to read 12 bytes but only got 4. ", UserWarning, stacklevel=1)
        warnings.warn("Corrupt EXIF data.  Expecting to read 12 bytes but only got 4. ", UserWarning, stacklevel=1)
        warnings.warn("an old call", DeprecationWarning, stacklevel=1)
    assert kept == ["Corrupt EXIF data. Expecting to read 12 bytes but only got 4."]


def test_a_file_cut_short_is_still_rejected_with_pillows_reason() -> None:
    with pytest.raises(DecodeError, match="corrupt or truncated JPEG data: image file is truncated"):
        gate.decode_image(CUT_SHORT)
    with pytest.raises(DecodeError, match="corrupt or truncated JPEG data: image file is truncated"):
        gate.decode_image(CUT_SHORT, refused="Premature end of JPEG file")


# ---------------------------------------------------------------------------
# prepare: accepted, Pillow's pixels, decode_warnings recorded, counted


def _write_source(root: Path) -> Path:
    src = root / "src"
    src.mkdir()
    for name, (data, _) in WARNING_CASES.items():
        (src / f"{name}.jpg").write_bytes(data)
    (src / "clean.jpg").write_bytes(JPEG)
    (src / "cut-short.jpg").write_bytes(CUT_SHORT)
    return src


def _read_samples(out: Path, extension: str) -> dict[str, dict[str, Any]]:
    """Stem of the source -> {"json": …, extension: bytes}, read back with plain webdataset."""
    shards = sorted(str(path) for path in out.glob("shard-*.tar"))
    found = {}
    for sample in wds.WebDataset(shards, shardshuffle=False, empty_check=False):
        meta = json.loads(sample["json"])
        found[Path(meta["source"]).stem] = {"json": meta, extension: sample[extension]}
    return found


def _decoded(payload: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(payload)) as img:
        return np.asarray(img.convert("RGB"))


PATHS = {
    # name -> (output format, environment): the YCbCr path (JPEG out), the RGB path (PNG out), and the RGB
    # path without the native library (simplejpeg's message only, no scan for the rest)
    "ycbcr": ("jpeg", {}),
    "rgb": ("png", {}),
    "rgb-no-native": ("png", {"GPUFEED_NO_NATIVE": "1"}),
}


@pytest.fixture(scope="module", params=sorted(PATHS))
def prepared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The warning cases prepared once per path, through the library in a fresh process."""
    name = request.param
    fmt, env = PATHS[name]
    if name == "ycbcr" and native.library() is None:
        pytest.skip("the YCbCr path needs the native library")
    root = tmp_path_factory.mktemp(name)
    src, out = _write_source(root), root / "out"
    code = (
        "import json, sys; from pipeline import PrepareSpec, ResizeSpec, EncodeSpec, prepare_dataset;"
        f"r = prepare_dataset(PrepareSpec(source={str(src)!r}, out={str(out)!r}, resize=ResizeSpec(size={SIZE}),"
        f" encode=EncodeSpec(format={fmt!r})), workers=0); print(json.dumps(r.to_dict()))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    extension = "jpg" if fmt == "jpeg" else fmt
    return {"name": name, "summary": summary, "rejected": rejected, "samples": _read_samples(out, extension), "ext": extension}


def test_prepare_accepts_every_warning_case_and_rejects_the_cut_file(prepared: dict[str, Any]) -> None:
    summary = prepared["summary"]
    assert summary["listed"] == len(WARNING_CASES) + 2
    assert (summary["samples"], summary["rejected"]) == (len(WARNING_CASES) + 1, 1)
    assert set(prepared["samples"]) == {*WARNING_CASES, "clean"}
    [reject] = prepared["rejected"]
    assert reject["source"].endswith("cut-short.jpg")
    assert reject["reason"].startswith("corrupt or truncated JPEG data: image file is truncated")


def test_prepare_records_what_libjpeg_and_pillow_warned_about(prepared: dict[str, Any]) -> None:
    warned_samples = 0
    for name, sample in prepared["samples"].items():
        got = sample["json"].get("decode_warnings")
        assert got is None or got, "an empty list is left out"
        expected = _expected_warnings(prepared["name"], name)
        if name == "exif-broken":
            assert got is not None and len(got) == 1 and "exif" in got[0].lower(), got
        else:
            assert (got or []) == expected, (name, got)
        warned_samples += got is not None
    assert prepared["summary"]["decoded_with_warnings"] == warned_samples > 0


def _expected_warnings(path: str, name: str) -> list[str]:
    if name == "clean":
        return []
    data, native_warnings = WARNING_CASES[name]
    if path == "ycbcr":  # the YCbCr path refused it with libjpeg's first warning, and the scan found the rest
        return native_warnings
    if not simplejpeg_refuses(data):
        return []
    first = simplejpeg_message(data)
    return list(dict.fromkeys([first, *native_warnings])) if path == "rgb" else [first]


def test_prepare_writes_pillows_pixels_for_a_file_a_fast_path_refused(prepared: dict[str, Any]) -> None:
    for name, sample in prepared["samples"].items():
        payload = sample[prepared["ext"]]
        refused = bool(sample["json"].get("decode_warnings")) and name != "exif-broken"
        if prepared["ext"] == "png":  # every file: decoded at full size by simplejpeg or Pillow, resized by Pillow
            assert np.array_equal(_decoded(payload), pillow_pixels(sample_data(name))), name
        elif refused:  # the YCbCr path refused it: Pillow decoded it, the RGB path resized and encoded it
            assert payload == pillow_jpeg(sample_data(name)), name
        else:  # the YCbCr path's own resampling of a file libjpeg read without a warning
            assert psnr(_decoded(payload), pillow_pixels(sample_data(name))) > 30, name


def sample_data(name: str) -> bytes:
    return JPEG if name == "clean" else WARNING_CASES[name][0]


def test_the_cli_accepts_them_and_says_how_many_warned(tmp_path: Path) -> None:
    src, out = _write_source(tmp_path), tmp_path / "out"
    done = _cli("prepare", str(src), str(out), "--size", str(SIZE), "--workers", "0", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    warned = manifest["decoded_with_warnings"]
    assert warned >= sum(1 for _, (_, native_warnings) in WARNING_CASES.items() if native_warnings)
    assert f"{len(WARNING_CASES) + 1} samples, {warned} decoded with warnings, 1 rejected" in done.stdout
    inspected = _cli("inspect", str(out), "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["decoded_with_warnings"] == warned
    inspected = _cli("inspect", str(out))
    assert re.search(rf"decoded with warnings\s+{warned}\b", inspected.stdout), inspected.stdout


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


# ---------------------------------------------------------------------------
# The loader: a sample the region decoder or simplejpeg refuses is Pillow's


@pytest.mark.parametrize("decoder", ["region", "simplejpeg"])
@pytest.mark.parametrize("train", [False, True])
def test_the_loader_decodes_a_refused_sample_with_pillow(decoder: str, train: bool) -> None:
    if decoder == "region" and native.library() is None:
        pytest.skip("region decoder unavailable")
    for name, (data, warned) in WARNING_CASES.items():
        spec = CropSpec(48, train, decoder=decoder)
        ours, pillows = np.zeros((3, 48, 48), np.uint8), np.zeros((3, 48, 48), np.uint8)
        decode_into(ours, "jpg", data, spec, 11)
        decode_into(pillows, "jpg", data, CropSpec(48, train, decoder="pil"), 11)
        refused = bool(warned) if decoder == "region" else simplejpeg_refuses(data)
        if refused:
            assert np.array_equal(ours, pillows), name
        else:  # decoded by the fast path itself (DCT-scaled where the crop allows): the same crop
            assert psnr(ours, pillows) > 25, name
    with pytest.raises(DecodeError, match="truncated"):
        decode_into(np.zeros((3, 48, 48), np.uint8), "jpg", CUT_SHORT, CropSpec(48, False, decoder=decoder), 0)


# ---------------------------------------------------------------------------
# Random damage: gpufeed accepts exactly what Pillow reads


def _base_files() -> dict[str, bytes]:
    image = Image.fromarray(picture(72, 56, seed=3))
    files = {}
    for name, fmt, options in (
        ("baseline", "JPEG", {"quality": 85}),
        ("progressive", "JPEG", {"quality": 85, "progressive": True}),
        ("restarts", "JPEG", {"quality": 85, "restart_marker_blocks": 1, "subsampling": "4:4:4"}),
        ("png", "PNG", {}),
        ("webp", "WEBP", {"quality": 80}),
    ):
        buffer = io.BytesIO()
        image.save(buffer, fmt, **options)
        files[name] = buffer.getvalue()
    return files


BASES = _base_files()
MAX_PIXELS = 1_000_000  # a damaged header may claim any size: both sides refuse the same large ones, fast

Damage = tuple[str, float, int]
damages = st.tuples(
    st.sampled_from(["flip", "flip-header", "truncate", "insert", "remove"]),
    st.floats(0.0, 1.0),
    st.integers(0, 255),
)


def damaged(data: bytes, steps: list[Damage]) -> bytes:
    raw = bytearray(data)
    for kind, where, value in steps:
        span = min(len(raw), 400) if kind == "flip-header" else len(raw)  # headers and tables come first
        at = min(len(raw) - 1, 2 + int(where * max(0, span - 2)))
        if kind.startswith("flip"):
            raw[at] = value
        elif kind == "truncate":
            del raw[at:]
        elif kind == "insert":
            raw[at:at] = bytes([value]) * (1 + value % 7)
        else:
            del raw[at : at + 1 + value % 7]
        if len(raw) < 3:
            break
    return bytes(raw)


def pillow_reads(data: bytes) -> bool:
    """The rule, with plain PIL: open (the raster formats gpufeed decodes), within the pixel limit, load, convert."""
    try:
        with Image.open(io.BytesIO(data), formats=gate.DECODE_FORMATS) as img:
            if img.width < 1 or img.height < 1 or img.width * img.height > MAX_PIXELS:
                return False
            if getattr(img, "n_frames", 1) > 1:
                img.seek(0)
            img.load()
            img.convert("RGB")
    except Exception:
        return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    files=st.lists(st.tuples(st.sampled_from(sorted(BASES)), st.lists(damages, min_size=1, max_size=3)), min_size=1, max_size=6),
    fmt=st.sampled_from(["jpeg", "png"]),
)
def test_random_damage_is_accepted_exactly_when_pillow_reads_it(
    tmp_path_factory: pytest.TempPathFactory, files: list[tuple[str, list[Damage]]], fmt: str
) -> None:
    root = tmp_path_factory.mktemp("damage")
    src, out = root / "src", root / "out"
    src.mkdir()
    expected = {}
    for number, (base, steps) in enumerate(files):
        data = damaged(BASES[base], steps)
        name = f"{number:02d}-{base}.{'jpg' if base in ('baseline', 'progressive', 'restarts') else base}"
        (src / name).write_bytes(data)
        expected[name] = pillow_reads(data)
    spec = PrepareSpec(
        source=str(src), out=str(out), resize=ResizeSpec(size=40), encode=EncodeSpec(format=fmt), max_pixels=MAX_PIXELS
    )
    try:
        result = prepare_dataset(spec, workers=0)
        samples, rejects, listed = result.samples, result.rejected, result.listed
    except NoImagesError:  # every file rejected: no dataset, and rejected.jsonl says why
        assert not (out / "manifest.json").exists()
        samples, rejects, listed = 0, len(files), len(files)
    rejected = {Path(entry["source"]).name: entry["reason"] for entry in map(json.loads, (out / "rejected.jsonl").read_text().splitlines())}
    accepted = set(_read_samples(out, "jpg" if fmt == "jpeg" else fmt)) if samples else set()
    assert samples + rejects == listed == len(files)
    assert len(rejected) == rejects
    assert {Path(name).stem for name, ok in expected.items() if ok} == accepted, rejected
    assert {name for name, ok in expected.items() if not ok} == set(rejected)
    assert all(rejected.values())


NO_CHROMA_SCAN = [("insert", 0.013468177236857448, 66), ("truncate", 0.2259153961874819, 36), ("remove", 0.537556824225385, 101)]
"""Damage found by the property above: a progressive file whose chroma never gets a scan, so no quantisation
table (the DCT-scaled chroma IDCT read it through a null pointer and the process died)."""


def test_a_progressive_file_whose_chroma_has_no_scan_is_refused_as_pillow_refuses_it() -> None:
    data = damaged(BASES["progressive"], NO_CHROMA_SCAN)
    spec = PrepareSpec(source="src", out="out", resize=ResizeSpec(size=40), max_pixels=MAX_PIXELS)
    assert not pillow_reads(data)
    with pytest.raises(transcode.TranscodeRefused, match="Corrupt JPEG data"):
        transcode.transcode_jpeg(data, spec)


# ---------------------------------------------------------------------------
# strict: the first reject stops the job and nothing is published


def _mixed_source(root: Path, bad_at: int, count: int = 40) -> tuple[Path, Path]:
    """`count` good JPEGs and, at listing index `bad_at`, a file cut short."""
    src = root / "src"
    src.mkdir()
    for index in range(count):
        data = CUT_SHORT if index == bad_at else clean_jpeg()
        (src / f"img-{index:02d}.jpg").write_bytes(data)
    return src, src / f"img-{bad_at:02d}.jpg"


def _spec(src: Path, out: Path, per_shard: int = 2) -> PrepareSpec:
    return PrepareSpec(
        source=str(src), out=str(out), resize=ResizeSpec(size=SIZE), shards=ShardSpec(max_bytes=None, max_samples=per_shard)
    )


def _published(out: Path) -> list[str]:
    """What OUT holds, hidden files included (temp shards, the work folder)."""
    return sorted(str(path.relative_to(out)) for path in out.rglob("*")) if out.exists() else []


def test_strict_cli_exits_naming_the_file_publishes_nothing_and_a_plain_run_still_works(tmp_path: Path) -> None:
    src, bad = _mixed_source(tmp_path, bad_at=0, count=6)
    out = tmp_path / "out"
    done = _cli("prepare", str(src), str(out), "--size", str(SIZE), "--workers", "0", "--quiet", "--strict")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("gpufeed: error: strict prepare stopped at a rejected file: ")
    assert str(bad) in done.stderr and "image file is truncated" in done.stderr
    assert _published(out) == []
    again = _cli("prepare", str(src), str(out), "--size", str(SIZE), "--workers", "0", "--quiet")
    assert again.returncode == 0, again.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["samples"], manifest["rejected"]) == (5, 1)


def test_strict_stops_mid_job_and_takes_back_the_shards_it_wrote(tmp_path: Path) -> None:
    # Listing index 33 is not among the size estimate's samples (every second one of 40): the
    # reject is met while writing, after other shards were complete.
    src, bad = _mixed_source(tmp_path, bad_at=33)
    out = tmp_path / "out"
    seen: list[int] = []

    def watch(state: PrepareProgress) -> None:
        seen.append(len(list(out.glob("shard-*.tar"))))

    with pytest.raises(SampleError, match=f"{bad}: corrupt or truncated JPEG data: image file is truncated"):
        prepare_dataset(_spec(src, out), workers=0, strict=True, progress=watch)
    assert max(seen) > 0, "no shard was complete before the reject: pick another bad index"
    assert _published(out) == []
    result = prepare_dataset(_spec(src, out), workers=0)
    assert (result.samples, result.rejected, result.resumed_shards) == (39, 1, 0)


def test_strict_after_an_interrupted_run_keeps_that_runs_shards(tmp_path: Path) -> None:
    src, bad = _mixed_source(tmp_path, bad_at=33)
    out = tmp_path / "out"

    def interrupt_after_two_shards(state: PrepareProgress) -> None:
        if len(list(out.glob("shard-*.tar"))) >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(_spec(src, out), workers=0, progress=interrupt_after_two_shards)
    kept = sorted(path.name for path in out.glob("shard-*.tar"))
    assert len(kept) >= 2
    seen: list[int] = []
    with pytest.raises(SampleError, match=f"{bad}: .*truncated.*; nothing was published"):
        prepare_dataset(_spec(src, out), workers=0, strict=True, progress=lambda _: seen.append(len(list(out.glob("shard-*.tar")))))
    assert max(seen) > len(kept), "the strict run wrote no shard of its own before the reject"
    assert sorted(path.name for path in out.glob("shard-*.tar")) == kept  # its own shards went, the earlier ones stay
    assert not (out / "manifest.json").exists() and not list(out.rglob(".shard-*"))
    result = prepare_dataset(_spec(src, out), workers=0)
    assert (result.samples, result.rejected, result.resumed_shards) == (39, 1, len(kept))


def test_strict_stops_at_a_reject_an_earlier_run_kept(tmp_path: Path) -> None:
    src, bad = _mixed_source(tmp_path, bad_at=33)
    out = tmp_path / "out"
    reports_since_the_reject: list[int] = []

    def interrupt_once_the_rejects_shard_is_kept(state: PrepareProgress) -> None:
        reports_since_the_reject.extend([state.done] if state.rejected else [])
        if len(reports_since_the_reject) >= 2:  # a report from the next shard: the reject's shard is complete
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(_spec(src, out), workers=0, progress=interrupt_once_the_rejects_shard_is_kept)
    before_files = {path: path.read_bytes() for path in out.rglob("*") if path.is_file() and "listing" not in path.name}
    with pytest.raises(SampleError, match=f"{bad}: .*truncated.*rejected by an earlier run"):
        prepare_dataset(_spec(src, out), workers=0, strict=True)
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file() and "listing" not in path.name} == before_files
    result = prepare_dataset(_spec(src, out), workers=0)
    assert (result.samples, result.rejected) == (39, 1) and result.resumed_shards > 0


def test_strict_refuses_a_finished_dataset_with_rejects_and_leaves_it(tmp_path: Path) -> None:
    src, bad = _mixed_source(tmp_path, bad_at=4, count=8)
    out = tmp_path / "out"
    prepare_dataset(_spec(src, out), workers=0)
    before_files = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    with pytest.raises(SampleError, match=f"left out 1 rejected file.*{bad}"):
        prepare_dataset(_spec(src, out), workers=0, strict=True)
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before_files


def test_strict_with_nothing_to_reject_is_an_ordinary_prepare(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name, (data, _) in WARNING_CASES.items():  # warnings are not rejects
        (src / f"{name}.jpg").write_bytes(data)
    out = tmp_path / "out"
    result = prepare_dataset(_spec(src, out), workers=0, strict=True)
    assert (result.samples, result.rejected) == (len(WARNING_CASES), 0)
    assert prepare_dataset(_spec(src, out), workers=0, strict=True).already_complete


def test_strict_is_not_part_of_the_jobs_identity(tmp_path: Path) -> None:
    # A strict run and a plain one of the same settings are the same job: the plain run finds its dataset done.
    src, _ = _mixed_source(tmp_path, bad_at=5, count=8)
    out = tmp_path / "out"
    first = prepare_dataset(_spec(src, out), workers=0)
    with pytest.raises(SampleError):
        prepare_dataset(_spec(src, out), workers=0, strict=True)
    again = prepare_dataset(_spec(src, out), workers=0)
    assert again.already_complete and (again.samples, again.rejected) == (first.samples, first.rejected) == (7, 1)
