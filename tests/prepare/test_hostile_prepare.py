"""`gpufeed prepare` over a hostile ImageFolder: nothing crashes, every file is accounted for.

One dataset (tests/hostile_data.py) is prepared once per output format, by
the library and once through the real CLI in a subprocess; each test then
checks one promise of SPEC section 1 on every run: accepted + rejected ==
listed, reasons, keys, labels, orientation, colours, and that plain
webdataset reads every sample back.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds
from hostile_data import HostileDataset, HostileFile, make_hostile_dataset
from PIL import Image

from pipeline import EncodeSpec, PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset
from pipeline.io.output import Output
from pipeline.manifest import Manifest, read_manifest, verify_dataset
from pipeline.prepare.sources import ListingInfo, SourceItem, list_images

pytestmark = pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")

SIZE = 64  # shorter side; most hostile images are larger, a few are smaller (never upscaled)
SHARD_SAMPLES = 9  # several shards, so the seeded shuffle across shards is exercised
EXTENSIONS = {"jpeg": "jpg", "webp": "webp", "png": "png", "npy": "npy"}


@dataclasses.dataclass
class Run:
    """One prepare of the hostile dataset and everything read back from OUT."""

    name: str
    fmt: str
    out: Path
    summary: dict[str, Any]
    manifest: Manifest
    rejected: list[dict[str, Any]]
    samples: list[dict[str, Any]]


def _spec(src: Path, out: Path, fmt: str) -> PrepareSpec:
    return PrepareSpec(
        source=str(src),
        out=str(out),
        resize=ResizeSpec(size=SIZE),
        encode=EncodeSpec(format=fmt),
        shards=ShardSpec(max_bytes=None, max_samples=SHARD_SAMPLES),
    )


def _prepare_in_process(dataset: HostileDataset, out: Path, fmt: str, workers: int) -> dict[str, Any]:
    return prepare_dataset(_spec(dataset.root, out, fmt), workers=workers).to_dict()


def _prepare_with_cli(dataset: HostileDataset, out: Path, fmt: str) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "pipeline", "prepare", str(dataset.root), str(out),
        "--json", "--quiet", "--format", fmt, "--size", str(SIZE),
        "--shard-samples", str(SHARD_SAMPLES), "--workers", "2",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"gpufeed prepare failed ({done.returncode}):\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def _read_back(name: str, fmt: str, out: Path, summary: dict[str, Any]) -> Run:
    manifest = read_manifest(Output(str(out)))
    lines = (out / "rejected.jsonl").read_text(encoding="utf-8").splitlines()
    rejected = [json.loads(line) for line in lines if line.strip()]
    urls = [str(out / shard.path) for shard in manifest.shards]
    samples = list(wds.WebDataset(urls, shardshuffle=False).decode("pil"))
    return Run(name, fmt, out, summary, manifest, rejected, samples)


RUNS: dict[str, tuple[str, str, int]] = {
    # name: (how, format, workers)
    "jpeg": ("library", "jpeg", 2),  # a real process pool
    "webp": ("library", "webp", 0),
    "png": ("library", "png", 0),
    "npy": ("library", "npy", 0),
    "cli-jpeg": ("cli", "jpeg", 2),
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> HostileDataset:
    return make_hostile_dataset(tmp_path_factory.mktemp("hostile") / "src")


@pytest.fixture(scope="module")
def prepared(hostile: HostileDataset, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """Each run is prepared once per module, when a test first needs it."""
    done: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in done:
            how, fmt, workers = RUNS[name]
            out = tmp_path_factory.mktemp(f"out-{name}")
            if how == "cli":
                summary = _prepare_with_cli(hostile, out, fmt)
            else:
                summary = _prepare_in_process(hostile, out, fmt, workers)
            done[name] = _read_back(name, fmt, out, summary)
        return done[name]

    return get


@pytest.fixture(params=list(RUNS))
def run(request: pytest.FixtureRequest, prepared: Callable[[str], Run]) -> Run:
    return prepared(request.param)


def sample_file(sample: dict[str, Any], hostile: HostileDataset) -> HostileFile:
    return hostile.file(hostile.rel_of(sample["json"]["source"]))


def sample_pixels(sample: dict[str, Any], fmt: str) -> np.ndarray:
    """The sample's picture as uint8 HxWx3, checking the type webdataset decoded it to."""
    value = sample[EXTENSIONS[fmt]]
    if fmt == "npy":
        assert isinstance(value, np.ndarray), type(value)
        assert value.dtype == np.uint8 and value.ndim == 3 and value.shape[2] == 3, (value.dtype, value.shape)
        return value
    assert isinstance(value, Image.Image), type(value)
    assert value.mode == "RGB", value.mode
    return np.asarray(value)


def expected_size(original: tuple[int, int]) -> tuple[int, int]:
    """`--mode shorter --size SIZE`, never upscaled: the shorter side SIZE, the longer truncated (v2.Resize's rule)."""
    width, height = original
    shorter, longer = min(width, height), max(width, height)
    if shorter <= SIZE:
        return width, height
    other = max(1, int(SIZE * longer / shorter))
    return (SIZE, other) if width <= height else (other, SIZE)


def region_mean(array: np.ndarray, box: tuple[float, float, float, float]) -> np.ndarray:
    height, width = array.shape[:2]
    left, top, right, bottom = box
    x0, y0 = int(left * width), int(top * height)
    x1, y1 = max(x0 + 1, math.ceil(right * width)), max(y0 + 1, math.ceil(bottom * height))
    return array[y0:y1, x0:x1].reshape(-1, 3).astype(np.float64).mean(0)


# ---------------------------------------------------------------------------
# The dataset itself


def test_the_dataset_covers_what_it_promises(hostile: HostileDataset) -> None:
    whats = " | ".join(f.what for f in hostile.files)
    for needed in ("orientation 3", "orientation 6", "orientation 8", "CMYK", "palette", "LA", "RGBA", "16-bit",
                   "1-bit", "animated GIF", "TIFF (tiff_lzw)", "WebP with alpha", "greyscale JPEG", "several dots",
                   "same stem", "non-ASCII", "upper-case", "zero-byte", "cut in half", "text", "HTML", "20000x20000"):
        assert needed in whats, needed
    assert len(hostile.classes) == 3
    assert {"readme.txt", "dogs/readme.txt"} <= set(hostile.ignored)
    assert len({f.rel for f in hostile.files}) == len(hostile.files)


def test_listing_lists_exactly_the_image_files(hostile: HostileDataset) -> None:
    info = ListingInfo()
    items = list(list_images(str(hostile.root), info))
    assert Counter(item.rel for item in items) == Counter(f.rel for f in hostile.files)
    assert {item.rel: item.label for item in items} == {f.rel: f.label for f in hostile.files}
    assert info.kind == "imagefolder" and info.classes == hostile.classes
    assert info.ignored == len(hostile.ignored)
    for item in items:
        assert hostile.rel_of(item.url) == item.rel
        item.to_json().encode("utf-8")  # every listed name can be written to the listing, manifest, rejects
        assert SourceItem.from_json(item.to_json()) == item


def test_listing_through_fsspec_matches_local(hostile: HostileDataset, tmp_path: Path) -> None:
    import fsspec

    plain = make_hostile_dataset(tmp_path / "plain", filesystem_tricks=False)
    fs = fsspec.filesystem("memory")
    base = f"/hostile-{os.getpid()}"
    for dirpath, _, filenames in os.walk(plain.root):
        for name in filenames:
            path = Path(dirpath) / name
            fs.pipe(f"{base}/{path.relative_to(plain.root).as_posix()}", path.read_bytes())
    try:
        local_info, remote_info = ListingInfo(), ListingInfo()
        local = [(i.rel, i.label) for i in list_images(str(plain.root), local_info)]
        remote = [(i.rel, i.label) for i in list_images(f"memory://{base}", remote_info)]
        assert remote == local
        assert remote_info.classes == local_info.classes == plain.classes
        assert remote_info.ignored == local_info.ignored == len(plain.ignored)
    finally:
        fs.rm(base, recursive=True)


# ---------------------------------------------------------------------------
# Every prepare run


def test_prepare_accounts_for_every_listed_file(run: Run, hostile: HostileDataset) -> None:
    listed, accepted, rejected = len(hostile.files), len(hostile.accepted), len(hostile.rejected)
    summary = run.summary
    assert (summary["listed"], summary["samples"], summary["rejected"]) == (listed, accepted, rejected)
    assert summary["samples"] + summary["rejected"] == summary["listed"]
    assert summary["ignored"] == len(hostile.ignored)
    assert run.manifest.samples == accepted and run.manifest.rejected == rejected
    assert run.manifest.classes == hostile.classes
    assert len(run.samples) == accepted
    assert len(run.rejected) == rejected
    assert verify_dataset(Output(str(run.out)), run.manifest).ok


def test_the_right_files_are_rejected_with_reasons(run: Run, hostile: HostileDataset) -> None:
    by_rel = Counter(hostile.rel_of(entry["source"]) for entry in run.rejected)
    assert by_rel == Counter(f.rel for f in hostile.rejected), "each bad file rejected exactly once, no good one"
    for entry in run.rejected:
        assert set(entry) == {"source", "reason"}
        item = hostile.file(hostile.rel_of(entry["source"]))
        reason = entry["reason"]
        assert isinstance(reason, str) and reason.strip(), f"{item.rel}: empty reason"
        for word in item.reason:
            assert word in reason.lower(), f"{item.rel} ({item.what}): reason {reason!r} should mention {word!r}"


def test_every_accepted_file_is_one_sample_with_a_safe_unique_key(run: Run, hostile: HostileDataset) -> None:
    keys = [sample["__key__"] for sample in run.samples]
    assert len(set(keys)) == len(keys), "duplicate keys"
    for key in keys:
        assert key and "." not in key and "/" not in key, key
        assert key.isascii(), key
    sources = Counter(hostile.rel_of(sample["json"]["source"]) for sample in run.samples)
    assert sources == Counter(f.rel for f in hostile.accepted)
    extension = EXTENSIONS[run.fmt]
    for sample in run.samples:
        members = {name for name in sample if not name.startswith("__")}
        assert members == {extension, "cls", "json"}, (sample["__key__"], members)
        assert sample["json"]["key"] == sample["__key__"]


def test_labels_follow_the_class_folders(run: Run, hostile: HostileDataset) -> None:
    for sample in run.samples:
        item = sample_file(sample, hostile)
        assert isinstance(sample["cls"], int)
        assert run.manifest.classes[sample["cls"]] == item.label, item.rel
        assert sample["json"]["label"] == item.label


def test_samples_are_rgb_and_sized_from_the_upright_original(run: Run, hostile: HostileDataset) -> None:
    for sample in run.samples:
        item = sample_file(sample, hostile)
        array = sample_pixels(sample, run.fmt)
        assert item.size is not None
        assert tuple(sample["json"]["original_size"]) == item.size, item.rel
        height, width = array.shape[:2]
        assert (width, height) == expected_size(item.size), f"{item.rel}: {width}x{height}"
        assert list(sample["json"]["size"]) == [width, height]


def test_exif_orientation_is_applied(run: Run, hostile: HostileDataset) -> None:
    oriented = [s for s in run.samples if sample_file(s, hostile).orientation is not None]
    assert len(oriented) >= 10
    for sample in oriented:
        item = sample_file(sample, hostile)
        array = sample_pixels(sample, run.fmt)
        assert array.shape[1] > array.shape[0], f"{item.rel}: upright picture is landscape"
        top_left = region_mean(array, (0.03, 0.06, 0.22, 0.28))
        top_right = region_mean(array, (0.78, 0.06, 0.97, 0.28))
        assert top_left[0] > 200 and top_left[1:].max() < 60, f"{item.rel}: red marker not top-left ({top_left})"
        assert top_right[2] > 200 and top_right[:2].max() < 60, f"{item.rel}: blue marker not top-right ({top_right})"


def test_colours_survive_mode_conversion(run: Run, hostile: HostileDataset) -> None:
    failures = []
    for sample in run.samples:
        item = sample_file(sample, hostile)
        array = sample_pixels(sample, run.fmt)
        assert item.regions, f"{item.rel}: nothing to check"
        for region in item.regions:
            found = region_mean(array, region.box)
            if np.abs(found - region.rgb).max() > region.tolerance:
                failures.append(f"{item.rel} ({item.what}): {region.box} is {found.round()}, expected {region.rgb}")
    assert not failures, "\n".join(failures)


def test_sixteen_bit_gradient_is_not_white(run: Run, hostile: HostileDataset) -> None:
    (sample,) = [s for s in run.samples if hostile.rel_of(s["json"]["source"]) == "dogs/gray16.png"]
    grey = sample_pixels(sample, run.fmt)[:, :, 0].astype(int)
    assert grey[:, :3].mean() < 20 and grey[:, -3:].mean() > 235
    assert 110 < grey.mean() < 145, "clipping 16-bit values at 255 gives an almost white picture"


def test_plain_webdataset_tar_members_are_well_formed(run: Run) -> None:
    import tarfile

    names = []
    for shard in run.manifest.shards:
        with tarfile.open(run.out / shard.path) as tar:
            names += [member.name for member in tar.getmembers() if member.isfile()]
    assert len(names) == len(set(names)) == 3 * run.manifest.samples
    for name in names:
        key, extension = name.split(".", 1)
        assert "/" not in name and extension in (EXTENSIONS[run.fmt], "cls", "json"), name


def test_npy_samples_load_without_pickle(prepared: Callable[[str], Run]) -> None:
    import tarfile

    run = prepared("npy")
    shard = run.manifest.shards[0]
    with tarfile.open(run.out / shard.path) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".npy"))
        array = np.load(io.BytesIO(tar.extractfile(member).read()), allow_pickle=False)  # type: ignore[union-attr]
    assert array.dtype == np.uint8 and array.ndim == 3 and array.shape[2] == 3


def test_class_folder_name_that_is_not_utf8(tmp_path: Path) -> None:
    src = tmp_path / "src"
    bad_class = os.path.join(os.fsencode(src), b"k\xe4fer")  # Latin-1 ä: not UTF-8
    good_class = src / "ants"
    os.makedirs(bad_class)
    good_class.mkdir()
    Image.new("RGB", (32, 32), (255, 0, 0)).save(os.path.join(bad_class, b"one.png"))
    Image.new("RGB", (32, 32), (0, 0, 255)).save(good_class / "two.png")
    out = tmp_path / "out"
    result = prepare_dataset(_spec(src, out, "png"), workers=0)
    assert (result.listed, result.samples, result.rejected) == (2, 2, 0)
    manifest = read_manifest(Output(str(out)))
    assert manifest.classes == ["ants", "k\ufffdfer"], "labels are printable; the bad byte is shown as U+FFFD"
    samples = list(wds.WebDataset([str(out / s.path) for s in manifest.shards], shardshuffle=False).decode("pil"))
    labels = {manifest.classes[s["cls"]]: np.asarray(s["png"])[16, 16].tolist() for s in samples}
    assert labels == {"ants": [0, 0, 255], "k\ufffdfer": [255, 0, 0]}
