"""The measuring tools on WebDataset shards as the source: each image is its member's bytes, never the whole tar."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pipeline.demo import make_caption_shards
from pipeline.measure.advise import probes as advise_probes
from pipeline.measure.decode import benchmark_decode, item_bytes, item_size, read_sample, sample_sources
from pipeline.measure.disk.bench import mean_file_bytes
from pipeline.prepare.sources import list_images

IMAGES = 12


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[bytes]]:
    """img2dataset-style shards (jpg + txt + json) and their jpg members, read with tarfile."""
    root = tmp_path_factory.mktemp("shards")
    pattern = make_caption_shards(root, IMAGES, per_shard=5)
    members = []
    for path in sorted(root.glob("*.tar")):
        with tarfile.open(path) as tar:
            members += [tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".jpg")]  # type: ignore[union-attr]
    assert len(members) == IMAGES
    return pattern, members


def test_each_listed_image_reads_as_its_member(shards: tuple[str, list[bytes]]) -> None:
    pattern, members = shards
    items = [item for item in list_images(pattern) if not item.rejected]
    assert [item_bytes(item) for item in items] == members
    assert [item_size(item) for item in items] == [len(m) for m in members]
    assert read_sample(items) == members
    assert mean_file_bytes(pattern) == round(sum(map(len, members)) / IMAGES)


def test_bench_decode_on_shards_measures_their_images(shards: tuple[str, list[bytes]]) -> None:
    pattern, members = shards
    result = benchmark_decode(pattern, sample=IMAGES, target=32, size=48, min_seconds=0.05, decoders=["pil"])
    assert result.samples == IMAGES  # every member decodes: none is a whole tar
    assert result.raw_mean_bytes == pytest.approx(sum(map(len, members)) / IMAGES)
    pil = next(row for row in result.rows if row.decoder == "PIL")
    assert pil.images == IMAGES and pil.raw_images_per_s and pil.raw_images_per_s > 10


def test_cli_bench_decode_on_a_brace_pattern(shards: tuple[str, list[bytes]]) -> None:
    pattern, _ = shards
    command = [sys.executable, "-m", "pipeline", "bench", "decode", pattern, "--sample", "6", "--duration", "0.02", "--json"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["samples"] == 6
    raw = [row["raw_images_per_s"] for row in data["rows"] if row["decoder"] != "npy (no decode)"]
    assert raw and all(rate and rate > 0 for rate in raw)  # every decoder read the members


def test_advise_reads_and_prepares_the_members(shards: tuple[str, list[bytes]], tmp_path: Path) -> None:
    pattern, members = shards
    items, _ = sample_sources(pattern, 6)
    assert sum(advise_probes.read_size(item) for item in items) == sum(len(item_bytes(item)) for item in items)
    details: dict[str, object] = {}
    assert advise_probes.cold_read_rate(items, 2, details) > 0
    out, per_sample = advise_probes.prepare_sample(items, str(tmp_path), "jpeg", 48, 0)
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    assert (manifest["samples"], manifest["rejected"]) == (6, 0)
    assert 0 < per_sample < max(map(len, members)) * 2
