"""`order="aspect"`: a prepared dataset's samples in the aspect-ratio order of their stored pictures.

The order comes from each image's header (EXIF orientation included, no
pixel decoded), is the same for a whole run, an interrupted one resumed and
the service's steps (the shards are byte for byte equal), and is never
computed for a plain prepare.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from pipeline import ConfigError, JobConflictError, PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset
from pipeline.demo import make_yolo_dataset
from pipeline.io.output import Output
from pipeline.io.tar import iter_tar_samples
from pipeline.manifest import read_manifest
from pipeline.prepare import aspect, opening
from pipeline.prepare.aspect import HEAD_BYTES, stored_aspect
from pipeline.prepare.job import finish_prepare, plan_prepare, write_prepare_shard
from pipeline.prepare.sources import SourceItem


@pytest.fixture(scope="module")
def yolo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A YOLO dataset of 24 validation images of every shape, from 40 x 200 to 200 x 40."""
    root = Path(make_yolo_dataset(tmp_path_factory.mktemp("yolo") / "data", 48, min_side=40, max_side=200))
    return root / "data.yaml"


def spec_for(source: Path, out: Path, **changes: object) -> PrepareSpec:
    values: dict[str, object] = {
        "split": "val",
        "resize": ResizeSpec(size=64, mode="longer", upscale=True),
        "shards": ShardSpec(max_bytes=None, max_samples=5),
        "order": "aspect",
    }
    values.update(changes)
    return PrepareSpec(source=str(source), out=str(out), **values)  # type: ignore[arg-type]


def samples_in_order(out: Path) -> list[tuple[str, float]]:
    """(key, stored height / width) of every sample, shard after shard as the manifest lists them."""
    found = []
    for shard in read_manifest(Output(str(out))).shards:
        for key, members in iter_tar_samples(str(out / shard.path)):
            width, height = json.loads(members["json"])["size"]
            found.append((key, height / width))
    return found


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*.tar"))}


def test_the_shards_hold_the_samples_in_aspect_order(yolo: Path, tmp_path: Path) -> None:
    result = prepare_dataset(spec_for(yolo, tmp_path / "sorted"), workers=2)
    ordered = samples_in_order(tmp_path / "sorted")
    aspects = [ratio for _, ratio in ordered]
    assert result.samples == len(ordered) == 24 and result.shards == 5
    assert aspects == sorted(aspects) and aspects[0] < 0.5 and aspects[-1] > 2
    assert read_manifest(Output(str(tmp_path / "sorted"))).params["order"] == "aspect"
    prepare_dataset(spec_for(yolo, tmp_path / "shuffled", order="shuffle"), workers=2)
    shuffled = samples_in_order(tmp_path / "shuffled")
    assert sorted(shuffled) == sorted(ordered)  # the same samples, byte for byte the same pictures' sizes
    assert [ratio for _, ratio in shuffled] != aspects
    assert "order" not in read_manifest(Output(str(tmp_path / "shuffled"))).params  # as before orders existed


def test_the_upright_picture_decides_and_an_unreadable_file_goes_last(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 300 x 100, a quarter turn: upright 100 x 300, the tallest
    Image.new("RGB", (300, 100), (200, 30, 30)).save(src / "a_turned.jpg", exif=exif)
    Image.new("RGB", (100, 200), (30, 200, 30)).save(src / "b_tall.jpg")
    Image.new("RGB", (150, 150), (30, 30, 200)).save(src / "c_square.png")
    (src / "d_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a JPEG after all")
    Image.new("RGB", (200, 100), (200, 200, 30)).save(src / "e_wide.jpg")
    out = tmp_path / "out"
    result = prepare_dataset(spec_for(src, out, split=None), workers=0)
    assert (result.samples, result.rejected) == (4, 1)
    ordered = samples_in_order(out)
    assert [key.split("-")[0] for key, _ in ordered] == ["e_wide_jpg", "c_square_png", "b_tall_jpg", "a_turned_jpg"]
    assert [ratio for _, ratio in ordered] == [32 / 64, 1.0, 2.0, 64 / 21]  # longer side 64: 100 x 300 is 21 x 64


def test_a_header_that_reaches_past_the_head_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "profiled.jpg"
    Image.new("RGB", (120, 90), (90, 90, 90)).save(path, icc_profile=bytes(100_000))
    data = path.read_bytes()
    assert data.find(b"\xff\xc0") > HEAD_BYTES  # the frame header (SOF0) lies after the first HEAD_BYTES
    spec = spec_for(tmp_path, tmp_path / "out", split=None, resize=ResizeSpec(size=64, mode="none"))
    assert stored_aspect(SourceItem(str(path), path.name, None), spec) == 90 / 120
    assert stored_aspect(SourceItem(str(tmp_path / "missing.jpg"), "missing.jpg", None), spec) == aspect.UNKNOWN


def test_an_interrupted_or_stepped_prepare_in_aspect_order_writes_the_same_shards(yolo: Path, tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    prepare_dataset(spec_for(yolo, whole), workers=2)
    # interrupted after one shard (its plan and listing in OUT/.gpufeed), then run again: resumed
    resumed = tmp_path / "resumed"
    assert plan_prepare(spec_for(yolo, resumed)).pending == [0, 1, 2, 3, 4]
    write_prepare_shard(spec_for(yolo, resumed), 3)
    result = prepare_dataset(spec_for(yolo, resumed), workers=0)
    assert result.resumed_shards == 1 and shard_bytes(resumed) == shard_bytes(whole)
    # the service's steps: a plan, shards in any order (one twice), a finish
    steps = tmp_path / "steps"
    plan_prepare(spec_for(yolo, steps))
    for shard in (4, 0, 2, 1, 3, 0):
        write_prepare_shard(spec_for(yolo, steps), shard)
    finish_prepare(spec_for(yolo, steps))
    assert shard_bytes(steps) == shard_bytes(whole)


def test_the_order_is_a_setting_of_the_job(yolo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_dataset(spec_for(yolo, out), workers=0)
    assert prepare_dataset(spec_for(yolo, out), workers=0).already_complete
    with pytest.raises(JobConflictError, match="order: nothing recorded here, aspect in"):
        prepare_dataset(spec_for(yolo, out, order="shuffle"), workers=0)
    with pytest.raises(ConfigError, match="order must be one of shuffle, aspect"):
        spec_for(yolo, out, order="size")


def test_a_plain_prepare_reads_no_header(yolo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> str:
        raise AssertionError("headers read for a shuffled prepare")

    monkeypatch.setattr(opening, "sort_listing", refuse)
    result = prepare_dataset(spec_for(yolo, tmp_path / "out", order="shuffle"), workers=0)
    assert result.samples == 24
