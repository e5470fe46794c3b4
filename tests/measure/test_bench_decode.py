"""`gpufeed bench decode`: per-core decode speed on a sample, raw vs prepared, for each decoder."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline import native
from pipeline.decode import open_image
from pipeline.demo import render_photo_like
from pipeline.errors import ConfigError
from pipeline.measure.decode import (
    DECODERS,
    JPEG_ONLY,
    available_decoders,
    benchmark_decode,
    decode_npy,
    decoder_name,
    prepare_in_memory,
    read_sample,
    sample_sources,
)
from pipeline.specs import EncodeSpec


@pytest.fixture(scope="module")
def raw_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six photo-like JPEGs (~0.3 MP) in two classes, one PNG, and one file that is not an image."""
    root = tmp_path_factory.mktemp("raw")
    for index in range(6):
        folder = root / ("a" if index % 2 else "b")
        folder.mkdir(exist_ok=True)
        pixels = render_photo_like(index, 480, 640, seed=3)
        Image.fromarray(pixels).save(folder / f"img{index}.jpg", quality=90)
    Image.fromarray(render_photo_like(9, 480, 640)).save(root / "a" / "drawing.png")
    (root / "b" / "broken.jpg").write_bytes(b"not a jpeg at all")
    return root


def test_every_decoder_has_a_row_raw_vs_prepared(raw_images: Path) -> None:
    result = benchmark_decode(str(raw_images), sample=16, target=224, size=256, min_seconds=0.2)  # many passes: the fastest counts
    names = [row.decoder for row in result.rows]
    assert names[: len(available_decoders())] == list(available_decoders())
    assert names[-1] == "npy (no decode)"
    assert result.samples == 7  # the broken file is left out
    assert result.raw_mean_pixels > 3 * result.prepared_mean_pixels
    assert result.prepared_mean_bytes < result.raw_mean_bytes
    assert result.npy_mean_bytes == pytest.approx(3 * result.prepared_mean_pixels, abs=200)  # uint8 RGB + header
    pil = next(row for row in result.rows if row.decoder == "PIL")
    assert pil.raw_images_per_s and pil.prepared_images_per_s
    # ~0.3 MP raw vs ~0.09 MP prepared: decoding the prepared copy must be clearly faster.
    assert pil.prepared_images_per_s > 1.5 * pil.raw_images_per_s
    assert pil.speedup == pytest.approx(pil.prepared_images_per_s / pil.raw_images_per_s)
    npy = result.rows[-1]
    assert npy.raw_images_per_s is None and npy.prepared_images_per_s and npy.prepared_images_per_s > 0
    data = result.to_dict()
    json.dumps(data)
    assert data["rows"][0]["speedup"] == pytest.approx(result.rows[0].speedup)


def test_decoders_resize_to_the_target(raw_images: Path) -> None:
    blobs = read_sample(sample_sources(str(raw_images), 3)[0])
    for name, decoder in available_decoders().items():
        for data in blobs:
            try:
                out = decoder(data, 100)
            except Exception:
                assert name in JPEG_ONLY, f"{name} failed on a readable image"
                continue
            if name == "region":  # the loader's crop: 3 x target x target, planar
                assert out.shape == (3, 100, 100), out.shape
                continue
            width, height = (out.shape[1], out.shape[0]) if isinstance(out, np.ndarray) else out.size
            assert min(width, height) == 100, name
    npy = prepare_in_memory(blobs[:1], 128, EncodeSpec(format="npy"))[0]
    assert np.load(io.BytesIO(npy)).shape[2] == 3
    assert min(decode_npy(npy, 64).size) == 64


def test_only_requested_decoders_run(raw_images: Path) -> None:
    result = benchmark_decode(str(raw_images), sample=4, decoders=["PIL + draft"], min_seconds=0.01)
    assert [row.decoder for row in result.rows] == ["PIL + draft", "npy (no decode)"]
    by_option = benchmark_decode(str(raw_images), sample=4, decoders=["pil-draft", "PIL"], min_seconds=0.01)
    assert [row.decoder for row in by_option.rows] == ["PIL + draft", "PIL", "npy (no decode)"]
    with pytest.raises(ConfigError, match="unknown decoder 'nvjpeg-on-a-toaster'; choose from region, pil, pil-draft"):
        benchmark_decode(str(raw_images), sample=4, decoders=["nvjpeg-on-a-toaster"], min_seconds=0.01)


def test_decoder_names_are_what_the_option_takes_or_what_the_rows_say() -> None:
    assert [decoder_name(name) for name in DECODERS] == list(DECODERS.values())
    assert decoder_name("PIL + draft") == decoder_name("pil-draft") == "PIL + draft"
    assert decoder_name("PyTurboJPEG") == decoder_name("pyturbojpeg") == "PyTurboJPEG"


@pytest.mark.skipif(native.library(warn=False) is None, reason="gpufeed's native library is not built here")
def test_the_loaders_region_decoder_is_measured(raw_images: Path) -> None:
    result = benchmark_decode(str(raw_images), sample=4, decoders=["region", "pil"], min_seconds=0.2)  # many passes: the fastest counts
    region = result.rows[0]
    assert region.decoder == "region" and "the loader's" in region.note
    assert ("JPEG files only" in region.note) == (region.images < result.samples)
    assert region.raw_images_per_s and region.prepared_images_per_s  # the JPEGs of the sample decode
    assert result.rows[1].decoder == "PIL" and result.rows[1].raw_images_per_s  # measured beside it, in the same run
    # How much faster it is than a full decode is a benchmark's to show (benchmarks/loader.py), not a timed test's:
    # 4 images timed for 0.2 s beside another test process on 2 cores can put either one ahead.


def test_raw_and_prepared_figures_cover_the_same_images(raw_images: Path, tmp_path: Path) -> None:
    # A top-level image beside class folders is what prepare rejects: it is not sampled.
    Image.fromarray(render_photo_like(5, 480, 640)).save(raw_images / "beside-the-classes.jpg")
    try:
        result = benchmark_decode(str(raw_images), sample=16, min_seconds=0.01)
        items, listed = sample_sources(str(raw_images), 16)
    finally:
        (raw_images / "beside-the-classes.jpg").unlink()
    assert listed == 8 and "beside-the-classes.jpg" not in {item.rel for item in items}
    assert result.samples == 7  # 6 JPEGs and the PNG; the broken file and the top-level image left out
    for row in result.rows:
        readable = sum(1 for data in read_sample(items) if _reads(row.decoder, data))
        assert row.images == (7 if row.decoder in ("npy (no decode)",) else readable), row
        if row.images < result.samples:  # a JPEG-only decoder: both its figures over the 6 JPEGs only
            assert f"JPEG files only: {row.images} of 7 images" in row.note


def _reads(name: str, data: bytes) -> bool:
    decoders = available_decoders()
    try:
        open_image(data)
        decoders[name](data, 224)
    except Exception:
        return False
    return True


def test_sample_is_even_deterministic_and_in_listing_order(tmp_path: Path) -> None:
    for cls in ("a", "b", "c", "d"):
        (tmp_path / cls).mkdir()
        for index in range(25):
            (tmp_path / cls / f"{index:03d}.jpg").write_bytes(b"x")
    items, listed = sample_sources(str(tmp_path), 20, seed=1)
    again, _ = sample_sources(str(tmp_path), 20, seed=1)
    other, _ = sample_sources(str(tmp_path), 20, seed=2)
    assert listed == 100 and len(items) == 20
    assert [i.url for i in items] == [i.url for i in again]
    assert [i.url for i in items] != [i.url for i in other]
    assert [i.rel for i in items] == sorted(i.rel for i in items)
    assert {i.label for i in items} == {"a", "b", "c", "d"}


def test_no_images_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "x.jpg").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="no decodable images"):
        benchmark_decode(str(tmp_path), sample=2, min_seconds=0.01)


def test_cli_table_and_json(raw_images: Path) -> None:
    base = [sys.executable, "-m", "pipeline", "bench", "decode", str(raw_images), "--sample", "3", "--duration", "0.02"]
    table = subprocess.run(base, capture_output=True, text=True, timeout=120, check=False)
    assert table.returncode == 0, table.stderr
    assert "decoder" in table.stdout and "PIL + draft" in table.stdout and "npy (no decode)" in table.stdout
    result = subprocess.run([*base, "--crop", "200", "--json"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["samples"] == 3 and data["prepared_size"] == 256 and data["target"] == 200


def test_cli_decoder_names_are_listed_and_checked(raw_images: Path) -> None:
    usage = subprocess.run(
        [sys.executable, "-m", "pipeline", "bench", "decode", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert usage.returncode == 0, usage.stderr
    helped = " ".join(usage.stdout.split())
    assert "region (the loader's), pil, pil-draft, simplejpeg, pyturbojpeg, opencv" in helped
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline", "bench", "decode", str(raw_images), "--decoder", "turbo"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert bad.returncode == 2 and "unknown decoder 'turbo'; choose from region, pil" in bad.stderr, bad.stderr
