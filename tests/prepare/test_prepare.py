"""End-to-end behaviour of `prepare_dataset` and `gpufeed prepare` on real files."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from pipeline import (
    AugmentSpec,
    ConfigError,
    EncodeSpec,
    JobConflictError,
    NoImagesError,
    PrepareSpec,
    ResizeSpec,
    ShardSpec,
    SourceError,
    StorageError,
    prepare_dataset,
)
from pipeline.demo import make_demo_dataset
from pipeline.io.output import Output
from pipeline.manifest import read_manifest, verify_dataset


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("raw")
    make_demo_dataset(root, 60, classes=3, min_side=120, max_side=260, workers=1)
    return root


def spec_for(src: str | Path, out: str | Path, **changes: object) -> PrepareSpec:
    values: dict[str, object] = {
        "resize": ResizeSpec(size=64),
        "shards": ShardSpec(max_bytes=None, max_samples=16),
    }
    values.update(changes)
    return PrepareSpec(source=str(src), out=str(out), **values)  # type: ignore[arg-type]


def read_samples(out: Path, pattern: str = "shard-*.tar") -> list[dict]:
    urls = sorted(str(p) for p in out.glob(pattern))
    return list(wds.WebDataset(urls, shardshuffle=False).decode("pil"))


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*.tar"))}


def test_imagefolder_to_shards_round_trip(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = prepare_dataset(spec_for(raw, out), workers=2)
    assert (result.listed, result.samples, result.rejected) == (60, 60, 0)
    manifest = read_manifest(Output(str(out)))
    assert manifest.format == "gpufeed-manifest/1"
    assert manifest.classes == ["aurora", "canyon", "harbour"]
    assert [s.samples for s in manifest.shards] == [16, 16, 16, 12]
    samples = read_samples(out)
    assert len(samples) == 60 and len({s["__key__"] for s in samples}) == 60
    for sample in samples:
        meta = sample["json"]
        assert manifest.classes[int(sample["cls"])] == meta["label"]
        assert Path(meta["source"]).parent.name == meta["label"]
        assert min(sample["jpg"].size) == 64
        assert "." not in sample["__key__"]
    assert verify_dataset(Output(str(out)), manifest).ok


def test_jpeg_restart_markers_change_the_coding_not_the_pixels(raw: Path, tmp_path: Path) -> None:
    """Default JPEGs carry a restart marker every MCU (DRI = 1); --jpeg-restart 0 writes none, same pixels."""
    marked, plain = tmp_path / "marked", tmp_path / "plain"
    prepare_dataset(spec_for(raw, marked), workers=0)
    cli = [sys.executable, "-m", "pipeline", "prepare", str(raw), str(plain), "--size", "64", "--shard-samples", "16"]
    subprocess.run([*cli, "--quiet", "--jpeg-restart", "0"], check=True, capture_output=True)
    urls = {name: sorted(str(p) for p in out.glob("shard-*.tar")) for name, out in (("m", marked), ("p", plain))}
    coded = {name: {s["__key__"]: s["jpg"] for s in wds.WebDataset(u, shardshuffle=False)} for name, u in urls.items()}
    assert coded["m"].keys() == coded["p"].keys() and len(coded["m"]) == 60
    for key, data in coded["m"].items():
        assert b"\xff\xdd\x00\x04\x00\x01" in data and b"\xff\xdd" not in coded["p"][key]
        assert len(data) > len(coded["p"][key])
        assert np.array_equal(np.asarray(wds.autodecode.imagehandler("rgb8")("jpg", data)),
                              np.asarray(wds.autodecode.imagehandler("rgb8")("jpg", coded["p"][key])))
    bad = subprocess.run([*cli[:5], str(tmp_path / "bad"), "--jpeg-restart", "-1"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--jpeg-restart" in bad.stderr and "Traceback" not in bad.stderr


def test_samples_are_shuffled_across_shards_by_seed(raw: Path, tmp_path: Path) -> None:
    first = [s["__key__"] for s in (prepare_dataset(spec_for(raw, tmp_path / "a"), workers=0) and read_samples(tmp_path / "a"))]
    other = [s["__key__"] for s in (prepare_dataset(spec_for(raw, tmp_path / "b", seed=7), workers=0) and read_samples(tmp_path / "b"))]
    assert sorted(first) == sorted(other) and first != other
    # Listing order is class by class; a shuffled first shard holds several classes.
    first_shard = read_samples(tmp_path / "a", "shard-000000.tar")
    assert len({s["json"]["label"] for s in first_shard}) >= 2


def test_identical_jobs_give_byte_identical_shards(raw: Path, tmp_path: Path) -> None:
    prepare_dataset(spec_for(raw, tmp_path / "one"), workers=2)
    prepare_dataset(spec_for(raw, tmp_path / "two"), workers=0)
    assert shard_bytes(tmp_path / "one") == shard_bytes(tmp_path / "two")
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert one["shards"] == two["shards"]


def test_shard_size_bound_in_bytes(raw: Path, tmp_path: Path) -> None:
    bound = 96 * 1024
    out = tmp_path / "out"
    prepare_dataset(spec_for(raw, out, shards=ShardSpec(max_bytes=bound)), workers=2)
    manifest = read_manifest(Output(str(out)))
    assert len(manifest.shards) >= 3
    assert all(shard.bytes <= bound * 1.1 for shard in manifest.shards)
    assert sum(s.samples for s in manifest.shards) == 60


@pytest.mark.parametrize(
    ("fmt", "extension"), [("webp", "webp"), ("png", "png"), ("npy", "npy")]
)
def test_other_encodings_read_back(raw: Path, tmp_path: Path, fmt: str, extension: str) -> None:
    out = tmp_path / "out"
    prepare_dataset(spec_for(raw, out, encode=EncodeSpec(format=fmt, quality=80)), workers=0)
    samples = read_samples(out)
    assert len(samples) == 60
    for sample in samples[:5]:
        image = sample[extension]
        array = image if fmt == "npy" else np.asarray(image)
        assert array.dtype == np.uint8 and array.ndim == 3 and array.shape[2] == 3
        assert min(array.shape[:2]) == 64


def test_variant_sets_are_complete_and_deterministic(raw: Path, tmp_path: Path) -> None:
    spec = spec_for(raw, tmp_path / "a", augment=AugmentSpec(variants=2), resize=ResizeSpec(size=48, mode="center-crop"))
    prepare_dataset(spec, workers=2)
    manifest = read_manifest(Output(str(tmp_path / "a")))
    assert manifest.variants == 2 and manifest.samples == 60
    assert {s.variant for s in manifest.shards} == {0, 1}
    assert all(s.path.startswith(f"v{s.variant}/") for s in manifest.shards)
    v0 = {s["__key__"]: s for s in read_samples(tmp_path / "a", "v0/*.tar")}
    v1 = {s["__key__"]: s for s in read_samples(tmp_path / "a", "v1/*.tar")}
    assert v0.keys() == v1.keys() and len(v0) == 60
    differing = sum(np.asarray(v0[k]["jpg"]).tobytes() != np.asarray(v1[k]["jpg"]).tobytes() for k in v0)
    assert differing == 60
    meta = v1[next(iter(v1))]["json"]
    assert meta["variant"] == 1 and meta["seed"] == 0
    assert meta["ops"][0]["op"] == "random_resized_crop"
    assert all(v0[k]["jpg"].size == (48, 48) for k in v0)
    prepare_dataset(PrepareSpec.from_dict({**spec.to_dict(), "out": str(tmp_path / "b")}), workers=0)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")


def test_memory_and_file_urls(raw: Path, tmp_path: Path) -> None:
    import fsspec

    memory = fsspec.filesystem("memory")
    for path in sorted(raw.rglob("*.jpg"))[:10]:
        memory.pipe(f"/gpufeed-test-src/{path.parent.name}/{path.name}", path.read_bytes())
    try:
        result = prepare_dataset(spec_for("memory://gpufeed-test-src", "memory://gpufeed-test-out"), workers=0)
        assert result.samples == 10
        output = Output("memory://gpufeed-test-out")
        manifest = read_manifest(output)
        assert verify_dataset(output, manifest).ok
        assert sorted(manifest.classes) == sorted({p.parent.name for p in sorted(raw.rglob("*.jpg"))[:10]})
        assert not any(".tmp-" in name for name in output.listdir())
    finally:
        memory.rm("/gpufeed-test-src", recursive=True)
        memory.rm("/gpufeed-test-out", recursive=True)
    result = prepare_dataset(spec_for(f"file://{raw}", f"file://{tmp_path / 'out'}"), workers=0)
    assert result.samples == 60 and (tmp_path / "out" / "manifest.json").exists()


def test_csv_and_jsonl_lists(raw: Path, tmp_path: Path) -> None:
    files = sorted(raw.rglob("*.jpg"))[:12]
    with open(tmp_path / "list.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label"])
        for i, path in enumerate(files):
            writer.writerow([str(path), "cat" if i % 2 else "dog"])
    result = prepare_dataset(spec_for(tmp_path / "list.csv", tmp_path / "csv-out"), workers=0)
    assert result.samples == 12 and result.classes == ["cat", "dog"]
    lines = [json.dumps({"path": str(p.relative_to(raw)), "label": i % 3}) for i, p in enumerate(files)]
    (raw / "list.jsonl").write_text("\n".join(lines) + "\n")
    try:
        result = prepare_dataset(spec_for(raw / "list.jsonl", tmp_path / "jsonl-out"), workers=0)
    finally:
        (raw / "list.jsonl").unlink()
    assert result.classes == ["0", "1", "2"]
    labels = sorted(int(s["cls"]) for s in read_samples(tmp_path / "jsonl-out"))
    assert labels == sorted(i % 3 for i in range(12))


def test_flat_folder_has_no_labels(raw: Path, tmp_path: Path) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in sorted(raw.rglob("*.jpg"))[:5]:
        (flat / path.name).write_bytes(path.read_bytes())
    prepare_dataset(spec_for(flat, tmp_path / "out"), workers=0)
    samples = read_samples(tmp_path / "out")
    assert len(samples) == 5 and all("cls" not in s for s in samples)
    assert read_manifest(Output(str(tmp_path / "out"))).classes == []


def test_rerun_of_finished_job_does_nothing_and_other_settings_conflict(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_dataset(spec_for(raw, out), workers=0)
    before = shard_bytes(out)
    again = prepare_dataset(spec_for(raw, out), workers=0)
    assert again.already_complete and again.processed == 0
    with pytest.raises(JobConflictError, match="different settings"):
        prepare_dataset(spec_for(raw, out, resize=ResizeSpec(size=32)), workers=0)
    assert shard_bytes(out) == before
    replaced = prepare_dataset(spec_for(raw, out, resize=ResizeSpec(size=32)), workers=0, overwrite=True)
    assert replaced.samples == 60 and shard_bytes(out) != before


def test_bad_sources_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="not found"):
        prepare_dataset(spec_for(tmp_path / "missing", tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("hello")
    with pytest.raises(NoImagesError, match="no images found"):
        prepare_dataset(spec_for(tmp_path / "empty", tmp_path / "out"))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_free_space_check_refuses_unless_forced(raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.prepare.opening.free_bytes", lambda path: 1000)
    with pytest.raises(StorageError, match="free"):
        prepare_dataset(spec_for(raw, tmp_path / "out"), workers=0)
    assert not (tmp_path / "out" / "manifest.json").exists()
    result = prepare_dataset(spec_for(raw, tmp_path / "out2"), workers=0, force=True)
    assert result.samples == 60 and any("writing anyway (force=True)" in w for w in result.warnings)


class _FullDisk:
    """A file object whose writes fail with ENOSPC once `budget` bytes are written."""

    def __init__(self, real, budget: int) -> None:
        self.real, self.budget = real, budget

    def write(self, data: bytes) -> int:
        import errno

        self.budget -= len(data)
        if self.budget < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real.write(data)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def test_full_disk_mid_write_is_a_clear_error_without_manifest(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    def failing_open(path, mode="r", *args, **kwargs):
        handle = builtins.open(path, mode, *args, **kwargs)
        return _FullDisk(handle, 40_000) if "w" in mode and ".tmp-" in str(path) else handle

    monkeypatch.setattr("pipeline.io.tar_write.open", failing_open, raising=False)
    out = tmp_path / "out"
    with pytest.raises(StorageError, match="no space left"):
        prepare_dataset(spec_for(raw, out), workers=0)
    assert not (out / "manifest.json").exists()
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    monkeypatch.undo()
    result = prepare_dataset(spec_for(raw, out), workers=0)  # space freed: the same command resumes
    assert result.samples == 60 and verify_dataset(Output(str(out)), read_manifest(Output(str(out)))).ok


def test_full_tmpfs_gives_clear_error(raw: Path, tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}); the injected test covers it")
    try:
        cmd = [sys.executable, "-m", "pipeline", "prepare", str(raw), str(mount / "out"), "--size", "128", "--shard-samples", "8"]
        refused = subprocess.run(cmd + ["--quiet"], capture_output=True, text=True)
        assert refused.returncode == 1 and "free" in refused.stderr and "Traceback" not in refused.stderr
        assert "pass --force" in refused.stderr and "force=True" not in refused.stderr
        forced = subprocess.run(cmd + ["--quiet", "--force"], capture_output=True, text=True)
        assert forced.returncode == 1, forced.stderr
        assert "no space left" in forced.stderr and "Traceback" not in forced.stderr
        assert not (mount / "out" / "manifest.json").exists()
        assert not [p for p in (mount / "out").rglob("*") if ".tmp-" in p.name]
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_flipped_byte_fails_verify(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_dataset(spec_for(raw, out), workers=0)
    ok = subprocess.run([sys.executable, "-m", "pipeline", "inspect", str(out), "--verify"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    shard = out / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = subprocess.run([sys.executable, "-m", "pipeline", "inspect", str(out), "--verify", "--json"], capture_output=True, text=True)
    assert bad.returncode != 0
    report = json.loads(bad.stdout)
    assert report["verified"] is False and any("shard-000001.tar" in p and "sha256" in p for p in report["problems"])


def test_sigkill_midway_then_rerun_completes_exactly(raw: Path, tmp_path: Path) -> None:
    """Kill a CLI prepare with SIGKILL once some shards exist; the re-run keeps them and finishes."""
    import signal
    import time

    big = tmp_path / "big"
    make_demo_dataset(big, 160, classes=4, min_side=400, max_side=700, workers=2)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pipeline", "prepare", str(big), str(out), "--size", "96", "--shard-samples", "10", "--quiet", "--workers", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    seen_partial_names = set()
    while time.monotonic() < deadline and len(list(out.glob("shard-*.tar"))) < 5:
        for visible in out.glob("shard-*.tar"):
            with tarfile.open(visible) as tar:  # a visible shard is always a complete tar
                assert len({m.name.split(".")[0] for m in tar.getmembers()}) == 10
        seen_partial_names |= {p.name for p in out.glob(".shard-*")}
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    complete_before = len(list(out.glob("shard-*.tar")))
    assert 0 < complete_before < 16, "the kill must land mid-job"
    assert not (out / "manifest.json").exists()
    rerun = subprocess.run(cmd[:-2] + ["--json"], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    assert summary["resumed_shards"] >= complete_before - 1
    assert summary["samples"] == 160 and summary["rejected"] == 0
    keys = [s["__key__"] for s in read_samples(out)]
    assert len(keys) == 160 and len(set(keys)) == 160
    check = subprocess.run([sys.executable, "-m", "pipeline", "inspect", str(out), "--verify"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    fresh = tmp_path / "fresh"
    subprocess.run(cmd[:5] + [str(fresh)] + cmd[6:], check=True, capture_output=True)
    assert shard_bytes(out) == shard_bytes(fresh)


def test_error_mid_job_stops_the_pool_promptly(raw: Path, tmp_path: Path) -> None:
    """An error while the worker processes are sending results (here: the progress callback) ends the job.

    Killing a worker mid-send used to leave the pool's result pipe waiting
    forever for the rest of a message: the job, and interpreter exit, hung.
    """
    out = tmp_path / "out"
    script = f"""
import sys
from pipeline import PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset
def progress(state):
    raise RuntimeError("callback failed")
spec = PrepareSpec(source={str(raw)!r}, out={str(out)!r}, resize=ResizeSpec(size=64),
                   shards=ShardSpec(max_bytes=None, max_samples=16))
try:
    prepare_dataset(spec, workers=2, progress=progress)
except RuntimeError as exc:
    print("raised:", exc)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "raised: callback failed" in result.stdout
    assert not (out / "manifest.json").exists()
    resumed = prepare_dataset(spec_for(raw, out), workers=2)
    assert resumed.samples == 60 and verify_dataset(Output(str(out)), read_manifest(Output(str(out)))).ok


def test_peak_memory_does_not_grow_with_image_count(tmp_path: Path) -> None:
    """Main-process peak RSS for 1,500 vs 12,000 tiny images: listing and planning stream."""
    from PIL import Image

    def make(root: Path, count: int) -> None:
        pixels = np.random.default_rng(0).integers(0, 255, (24, 24, 3), dtype=np.uint8)
        for c in range(3):
            (root / f"class{c}").mkdir(parents=True)
        Image.fromarray(pixels).save(tmp_path / "tile.jpg", quality=80)
        data = (tmp_path / "tile.jpg").read_bytes()
        for i in range(count):
            (root / f"class{i % 3}" / f"image_{i:06d}_with_a_fairly_long_name.jpg").write_bytes(data)

    script = (
        "import sys\n"
        "from pipeline import prepare_dataset, PrepareSpec, ResizeSpec, ShardSpec\n"
        "r = prepare_dataset(PrepareSpec(sys.argv[1], sys.argv[2], resize=ResizeSpec(size=16),"
        " shards=ShardSpec(max_bytes=None, max_samples=500)), workers=1)\n"
        "assert r.samples == int(sys.argv[3]), r\n"
        # VmHWM, not ru_maxrss: the latter carries the parent's peak across fork+exec.
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))\n"
    )
    peaks = {}
    for count in (1500, 12000):
        make(tmp_path / f"src{count}", count)
        done = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / f"src{count}"), str(tmp_path / f"out{count}"), str(count)],
            capture_output=True, text=True, check=True,
        )
        peaks[count] = int(done.stdout.strip()) / 1024  # MiB
    growth = peaks[12000] - peaks[1500]
    print(f"peak RSS MiB: {peaks}")
    # Holding per-image records in memory would cost ~5+ MiB for 10,500 more images.
    assert growth < 2.0, f"peak RSS grew {growth:.1f} MiB: {peaks}"


def test_a_decoder_crash_rejects_only_that_file(raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker killed inside a C decoder (segfault, OOM kill) must not hang or fail the job."""
    import pipeline.decode
    import pipeline.prepare.transcode

    victim = sorted(raw.rglob("*.jpg"))[7]

    def crashing(real):  # both decode paths: the YCbCr one (JPEGs) and the ordinary one
        def decode(data: bytes, *args: object, **kwargs: object):
            if data == victim.read_bytes():
                os._exit(139)
            return real(data, *args, **kwargs)

        return decode

    monkeypatch.setattr("pipeline.prepare.sample.make.decode_image", crashing(pipeline.decode.decode_image))
    monkeypatch.setattr("pipeline.prepare.sample.make.transcode_jpeg", crashing(pipeline.prepare.transcode.transcode_jpeg))
    out = tmp_path / "out"
    result = prepare_dataset(spec_for(raw, out), workers=2)
    assert (result.samples, result.rejected) == (59, 1)
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert rejected == [{"source": str(victim), "reason": "the decoder process crashed on this file"}]
    assert verify_dataset(Output(str(out)), read_manifest(Output(str(out)))).ok


def test_out_inside_source_is_refused(raw: Path) -> None:
    with pytest.raises(ConfigError, match="inside SRC"):
        prepare_dataset(spec_for(raw, raw / "shards"))
    assert not (raw / "shards").exists()


def test_step_api_plan_shards_finish_equals_local_prepare(raw: Path, tmp_path: Path) -> None:
    """The service runs prepare in steps; shards in any order, twice, give the same dataset."""
    from pipeline.prepare.job import finish_prepare, plan_prepare, write_prepare_shard

    spec = spec_for(raw, tmp_path / "steps")
    plan = plan_prepare(spec)
    assert plan.shards == 4 and plan.pending == [0, 1, 2, 3] and plan.listed == 60
    with pytest.raises(StorageError, match="shards 0, 1, 2, 3 are missing or invalid"):
        finish_prepare(spec)
    for shard in (2, 0, 3):
        assert not write_prepare_shard(spec, shard).skipped
    with pytest.raises(StorageError, match="shard 1 is missing or invalid"):
        finish_prepare(spec)
    assert not write_prepare_shard(spec, 1).skipped
    assert write_prepare_shard(spec, 1).skipped  # a re-delivered task finds its shard done
    assert plan_prepare(spec).pending == []
    manifest = finish_prepare(spec)
    assert manifest.samples == 60
    prepare_dataset(spec_for(raw, tmp_path / "local"), workers=2)
    assert shard_bytes(tmp_path / "steps") == shard_bytes(tmp_path / "local")
    with pytest.raises(ConfigError, match="no planned prepare"):
        write_prepare_shard(spec_for(raw, tmp_path / "never"), 0)


def test_the_plan_checks_every_listed_file_as_it_lists_and_a_refusal_leaves_nothing(raw: Path, tmp_path: Path) -> None:
    """The service's allowed-roots check runs inside the plan's own listing: SRC is listed once."""
    from pipeline.prepare.job import plan_prepare

    seen: list[str] = []
    plan = plan_prepare(spec_for(raw, tmp_path / "checked"), check_source=seen.append)
    assert plan.listed == 60 and sorted(seen) == sorted(str(path) for path in raw.rglob("*.jpg"))
    victim = sorted(seen)[30]

    def refuse(url: str) -> None:
        if url == victim:
            raise ConfigError(f"{url} is not allowed")

    refused = tmp_path / "refused"
    with pytest.raises(ConfigError, match="is not allowed"):
        plan_prepare(spec_for(raw, refused), check_source=refuse)
    assert not (refused / ".gpufeed").exists()
    with pytest.raises(SourceError, match="source not found"):  # any failed listing of a new job leaves no work folder
        prepare_dataset(spec_for(tmp_path / "missing", tmp_path / "from-missing"))
    assert not (tmp_path / "from-missing" / ".gpufeed").exists()
    # a job resumed from its saved plan keeps its work folder when the listing is refused this time
    with pytest.raises(ConfigError, match="is not allowed"):
        plan_prepare(spec_for(raw, tmp_path / "checked"), check_source=refuse)
    assert (tmp_path / "checked" / ".gpufeed" / "plan.json").exists()


def test_finish_twice_gives_the_same_manifest_and_result(raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finish repeated after a crash right after the manifest (work folder still there) changes nothing."""
    from pipeline.prepare.job import finish_prepare, plan_prepare, write_prepare_shard
    from pipeline.prepare.resume import WorkFolder

    spec = spec_for(raw, tmp_path / "steps")
    for shard in range(plan_prepare(spec).shards):
        write_prepare_shard(spec, shard)

    def die(folder: WorkFolder) -> None:
        raise KeyboardInterrupt("the worker died")

    real_remove_work = WorkFolder.remove_work
    monkeypatch.setattr(WorkFolder, "remove_work", die)
    with pytest.raises(KeyboardInterrupt):
        finish_prepare(spec)
    monkeypatch.setattr(WorkFolder, "remove_work", real_remove_work)
    manifest = (tmp_path / "steps" / "manifest.json").read_bytes()
    rejected = (tmp_path / "steps" / "rejected.jsonl").read_bytes()
    assert (tmp_path / "steps" / ".gpufeed" / "plan.json").exists()

    first = finish_prepare(spec)
    assert (tmp_path / "steps" / "manifest.json").read_bytes() == manifest
    assert not (tmp_path / "steps" / ".gpufeed").exists()  # the leftovers went
    second = finish_prepare(spec)
    assert second == first
    assert (tmp_path / "steps" / "manifest.json").read_bytes() == manifest
    assert (tmp_path / "steps" / "rejected.jsonl").read_bytes() == rejected
    parsed = read_manifest(Output(str(tmp_path / "steps")))
    assert (first.samples, first.rejected, first.listed) == (60, 0, 60)
    assert (first.shards, first.bytes) == (len(parsed.shards), sum(s.bytes for s in parsed.shards))
    assert first.manifest == f"{tmp_path / 'steps'}/manifest.json" and not first.already_complete
    assert verify_dataset(Output(str(tmp_path / "steps")), parsed).ok


def test_finish_of_another_job_s_dataset_is_refused(raw: Path, tmp_path: Path) -> None:
    from pipeline.prepare.job import finish_prepare

    prepare_dataset(spec_for(raw, tmp_path / "out"), workers=0)
    manifest = (tmp_path / "out" / "manifest.json").read_bytes()
    with pytest.raises(ConfigError, match="no planned prepare"):
        finish_prepare(spec_for(raw, tmp_path / "out", seed=99))  # other settings: not this job's dataset
    assert (tmp_path / "out" / "manifest.json").read_bytes() == manifest


def test_a_process_pool_keeps_the_parent_s_objects_out_of_the_collector_while_it_runs(raw: Path, tmp_path: Path) -> None:
    import gc

    assert gc.get_freeze_count() == 0
    seen: list[int] = []
    result = prepare_dataset(spec_for(raw, tmp_path / "out"), workers=2, progress=lambda _: seen.append(gc.get_freeze_count()))
    assert result.samples and seen and min(seen) > 0  # frozen before the workers forked, for the whole job
    assert gc.get_freeze_count() == 0  # thawed when the pool closed: a long-lived process collects them again
    gc.freeze()  # a caller that froze its own objects keeps its freeze: the pool neither adds to it nor thaws it
    try:
        frozen = gc.get_freeze_count()
        prepare_dataset(spec_for(raw, tmp_path / "out2"), workers=2)
        assert 0 < gc.get_freeze_count() <= frozen  # (a frozen object freed since counts no more)
    finally:
        gc.unfreeze()


def test_pool_tasks_are_large_in_the_middle_and_small_at_the_end() -> None:
    from pipeline.prepare.pool import CHUNK_ITEMS, TAIL_CHUNK_ITEMS, chunk_sizes

    for total, workers in ((1000, 2), (12_345, 8), (7, 2), (1, 1)):
        sizes = chunk_sizes(total, workers)
        assert sum(sizes) == total and all(0 < size <= CHUNK_ITEMS for size in sizes)
        assert sizes == sorted(sizes, reverse=True)  # never a big task after a small one
        assert sizes[-1] <= TAIL_CHUNK_ITEMS
    assert chunk_sizes(0, 2) == [] == chunk_sizes(0, 0)
    assert chunk_sizes(10_000, 2)[0] == CHUNK_ITEMS
    # in this process (no pool): no small tasks at the end, since no other worker waits for the last one
    assert chunk_sizes(300, 0) == [CHUNK_ITEMS] * 4 + [300 - 4 * CHUNK_ITEMS]


# ---------------------------------------------------------------------------
# Re-runs: SRC however it is spelled, a damaged dataset repaired, a source without usable images


def test_the_same_source_spelled_otherwise_is_the_same_job(raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    monkeypatch.chdir(raw.parent)
    first = prepare_dataset(spec_for(raw.name, out), workers=0)
    manifest = read_manifest(out)
    assert manifest.source == str(raw) and manifest.params["source"] == str(raw)  # resolved, not as typed
    for spelling in (f"{raw.name}/", f"./{raw.name}", str(raw), f"file://{raw}/"):
        again = prepare_dataset(spec_for(spelling, out), workers=0)
        assert again.already_complete and again.processed == 0, spelling
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert prepare_dataset(spec_for(os.path.relpath(raw), out), workers=0).already_complete
    (tmp_path / "link").symlink_to(raw)
    assert prepare_dataset(spec_for(tmp_path / "link", out), workers=0).already_complete
    # Resolved, the shards are those of an absolute SRC, byte for byte (what the service writes).
    prepare_dataset(spec_for(raw, tmp_path / "absolute"), workers=0)
    assert shard_bytes(out) == shard_bytes(tmp_path / "absolute") and first.samples == 60


def test_an_interrupted_job_resumes_whatever_the_spelling(raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.prepare.job import plan_prepare, write_prepare_shard

    out = tmp_path / "out"
    monkeypatch.chdir(raw.parent)
    assert plan_prepare(spec_for(raw.name, out)).pending == [0, 1, 2, 3]
    write_prepare_shard(spec_for(f"./{raw.name}/", out), 1)
    monkeypatch.chdir(tmp_path)
    result = prepare_dataset(spec_for(raw, out), workers=0)
    assert result.resumed_shards == 1 and result.processed == 44


def test_other_settings_are_refused_naming_each_difference(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_dataset(spec_for(raw, out), workers=0)
    other = spec_for(raw, out, resize=ResizeSpec(size=32, upscale=True), seed=3)
    with pytest.raises(JobConflictError) as refused:
        prepare_dataset(other, workers=0)
    message = str(refused.value)
    where = f"{out}/manifest.json"
    # Named as the spec's fields, with their values (the CLI spells them as its options: see test_cli).
    assert f"resize.size: 32 here, 64 in {where}" in message
    assert f"resize.upscale: True here, False in {where}" in message
    assert f"seed: 3 here, 0 in {where}" in message
    assert "resize.mode" not in message and "--size" not in message
    assert "pass overwrite=True" in message and "--" not in message  # no flag to a Python caller
    (tmp_path / "other").mkdir()
    with pytest.raises(JobConflictError, match=f"source: {tmp_path / 'other'} here, {raw} in {where}"):
        prepare_dataset(spec_for(tmp_path / "other", out), workers=0)
    from pipeline.prepare.job import plan_prepare

    plan_prepare(spec_for(raw, tmp_path / "unfinished"))
    unfinished = spec_for(raw, tmp_path / "unfinished", shards=ShardSpec(max_bytes=None, max_samples=8))
    with pytest.raises(JobConflictError, match="unfinished prepare with different settings.*shards.max_samples: 8 here, 16 in") as refused:
        prepare_dataset(unfinished, workers=0)
    assert "shards.max_bytes" not in str(refused.value) and "--shard" not in str(refused.value)


def test_rerun_rewrites_a_missing_or_truncated_shard(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_dataset(spec_for(raw, out), workers=0)
    before, manifest_bytes = shard_bytes(out), (out / "manifest.json").read_bytes()
    untouched = (out / "shard-000000.tar").stat().st_mtime_ns
    (out / "shard-000002.tar").unlink()
    repaired = prepare_dataset(spec_for(raw, out), workers=0)
    assert repaired.repaired == {"shard-000002.tar": "was missing"}
    assert not repaired.already_complete and repaired.processed == 16 and repaired.shards == 4
    assert shard_bytes(out) == before and (out / "manifest.json").read_bytes() == manifest_bytes
    assert (out / "shard-000000.tar").stat().st_mtime_ns == untouched
    assert verify_dataset(out).ok and not (out / ".gpufeed").exists()
    shard = out / "shard-000003.tar"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:5000])
    repaired = prepare_dataset(spec_for(raw, out), workers=2)
    assert repaired.repaired == {"shard-000003.tar": f"had 5000 bytes, the manifest says {size}"}
    assert shard_bytes(out) == before and verify_dataset(out).ok


def test_rerun_with_verify_rewrites_a_shard_whose_bytes_changed(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_dataset(spec_for(raw, out), workers=0)
    before = shard_bytes(out)
    shard = out / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[3000] ^= 0x01  # same size: only a hash sees it
    shard.write_bytes(bytes(data))
    assert prepare_dataset(spec_for(raw, out), workers=0).already_complete
    repaired = prepare_dataset(spec_for(raw, out), workers=0, verify=True)
    assert repaired.repaired == {"shard-000001.tar": "did not match its sha256"}
    assert shard_bytes(out) == before
    checked = prepare_dataset(spec_for(raw, out), workers=0, verify=True)
    assert checked.already_complete and checked.verified


def test_rerun_rewrites_only_the_damaged_file_of_a_variant_set(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = spec_for(raw, out, augment=AugmentSpec(variants=2))
    prepare_dataset(spec, workers=0)
    before = shard_bytes(out)
    kept = (out / "v0" / "shard-000001.tar").stat().st_mtime_ns
    (out / "v1" / "shard-000001.tar").unlink()
    assert prepare_dataset(spec, workers=0).repaired == {"v1/shard-000001.tar": "was missing"}
    assert shard_bytes(out) == before
    assert (out / "v0" / "shard-000001.tar").stat().st_mtime_ns == kept


def test_a_repair_from_a_changed_source_is_refused(raw: Path, tmp_path: Path) -> None:
    import shutil

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(raw, src)
    prepare_dataset(spec_for(src, out), workers=0)
    victim = next(iter(read_samples(out, "shard-000002.tar")))["json"]["source"]
    other = next(p for p in sorted(src.rglob("*.jpg")) if str(p) != victim)
    Path(victim).write_bytes(other.read_bytes())  # the same number of files, one with other bytes
    (out / "shard-000002.tar").unlink()
    with pytest.raises(SourceError, match="shard-000002.tar made again from .* is not the file the manifest records"):
        prepare_dataset(spec_for(src, out), workers=0)
    assert not (out / "shard-000002.tar").exists() and not (out / ".gpufeed").exists()
    next(src.rglob("*.jpg")).unlink()
    with pytest.raises(SourceError, match="lists 59 files, 60 when"):
        prepare_dataset(spec_for(src, out), workers=0)


def test_step_api_repairs_a_damaged_dataset(raw: Path, tmp_path: Path) -> None:
    from pipeline.prepare.job import finish_prepare, plan_prepare, write_prepare_shard

    out = tmp_path / "out"
    spec = spec_for(raw, out)
    prepare_dataset(spec, workers=0)
    before = shard_bytes(out)
    (out / "shard-000001.tar").unlink()
    plan = plan_prepare(spec)
    assert not plan.already_complete and plan.pending == [1]
    with pytest.raises(StorageError, match="shard-000001.tar"):
        finish_prepare(spec)
    written = [write_prepare_shard(spec, shard) for shard in range(plan.shards)]
    assert [record.skipped for record in written] == [True, False, True, True]
    assert write_prepare_shard(spec, 1).skipped  # a re-delivered task finds it repaired
    assert finish_prepare(spec).samples == 60
    assert shard_bytes(out) == before and verify_dataset(out).ok and not (out / ".gpufeed").exists()
    assert plan_prepare(spec).already_complete


def test_a_source_whose_every_file_is_rejected_fails_without_a_manifest(tmp_path: Path) -> None:
    from pipeline.prepare.job import finish_prepare, plan_prepare, write_prepare_shard

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "broken.jpg").write_bytes(b"not a JPEG at all")
    out = tmp_path / "out"
    expected = rf"no usable images in {tmp_path / 'src'}: 1 file listed, 1 rejected \(see {out}/rejected.jsonl\)"
    with pytest.raises(NoImagesError, match=expected):
        prepare_dataset(spec_for(tmp_path / "src", out), workers=0)
    assert not (out / "manifest.json").exists() and not (out / ".gpufeed").exists()
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [entry["source"] for entry in rejected] == [str(tmp_path / "src" / "broken.jpg")]
    spec = spec_for(tmp_path / "src", tmp_path / "steps")
    for shard in range(plan_prepare(spec).shards):
        write_prepare_shard(spec, shard)
    with pytest.raises(NoImagesError):
        finish_prepare(spec)
    assert not (tmp_path / "steps" / "manifest.json").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoImagesError, match="no images found"):
        prepare_dataset(spec_for(tmp_path / "empty", tmp_path / "none"), workers=0)
    assert not (tmp_path / "none" / "manifest.json").exists() and not (tmp_path / "none" / ".gpufeed").exists()


def test_images_beside_class_folders_are_rejected_with_a_reason(raw: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    images = sorted(raw.rglob("*.jpg"))
    for i, path in enumerate(images[:7]):
        (src / ("cats" if i % 2 else "dogs")).mkdir(parents=True, exist_ok=True)
        (src / ("cats" if i % 2 else "dogs") / path.name).write_bytes(path.read_bytes())
    (src / "stray.jpg").write_bytes(images[7].read_bytes())
    (src / "notes.txt").write_text("not an image: ignored")
    result = prepare_dataset(spec_for(src, tmp_path / "out"), workers=0)
    assert (result.listed, result.samples, result.rejected, result.ignored) == (8, 7, 1, 1)
    assert result.classes == ["cats", "dogs"]
    rejected = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [entry["source"] for entry in rejected] == [str(src / "stray.jpg")]
    assert rejected[0]["reason"].startswith("not in a class folder")


def test_listing_through_fsspec_rejects_images_beside_class_folders_too(raw: Path, tmp_path: Path) -> None:
    import fsspec

    from pipeline.prepare.sources import NOT_IN_A_CLASS_FOLDER, ListingInfo, list_images

    image = next(raw.rglob("*.jpg")).read_bytes()
    memory = fsspec.filesystem("memory")
    base = f"/beside-{os.getpid()}"
    for rel in ("cats/a.jpg", "dogs/b.jpg", "stray.jpg", "notes.txt"):
        memory.pipe(f"{base}/{rel}", image)
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(image)
    try:
        listed = {}
        for source in (str(tmp_path), f"memory://{base}"):
            info = ListingInfo()
            listed[source] = [(item.rel, item.label, item.rejected) for item in list_images(source, info)]
            assert info.ignored == 1 and info.classes == ["cats", "dogs"]
        assert listed[str(tmp_path)] == listed[f"memory://{base}"] == [
            ("stray.jpg", None, NOT_IN_A_CLASS_FOLDER),
            ("cats/a.jpg", "cats", ""),
            ("dogs/b.jpg", "dogs", ""),
        ]
    finally:
        memory.rm(base, recursive=True)


def _tree(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_that_is_no_dataset_is_refused_and_left_as_it_was(raw: Path, tmp_path: Path, overwrite: bool) -> None:
    out = tmp_path / "mine"
    (out / "notes").mkdir(parents=True)
    (out / "shard-000000.tar").write_bytes(b"my own archive, not a gpufeed shard")
    (out / "notes" / "todo.txt").write_text("keep me")
    (out / "README").write_text("my folder")
    before = _tree(out)
    with pytest.raises(JobConflictError, match="not a gpufeed dataset") as refused:
        prepare_dataset(spec_for(raw, out), workers=0, overwrite=overwrite)
    assert "shard-000000.tar" in str(refused.value) and "README" in str(refused.value)
    assert _tree(out) == before

    cli = subprocess.run(
        [sys.executable, "-m", "pipeline", "prepare", str(raw), str(out), "--size", "64", "--overwrite"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert cli.returncode != 0 and "not a gpufeed dataset" in cli.stderr and "Traceback" not in cli.stderr
    assert _tree(out) == before


def test_an_out_with_only_hidden_files_or_the_rejects_of_a_failed_run_is_used(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".keep").write_text("")
    (out / "rejected.jsonl").write_text("")
    result = prepare_dataset(spec_for(raw, out), workers=0)
    assert result.samples == 60 and (out / ".keep").exists()


def test_a_second_prepare_into_the_same_out_is_refused_naming_the_first(raw: Path, tmp_path: Path) -> None:
    import socket
    import threading

    out = tmp_path / "out"
    first_waits, second_done = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def progress(state: object) -> None:  # the first run stops after its first chunk until the second was refused
        first_waits.set()
        assert second_done.wait(120)

    def first() -> None:
        try:
            outcome["result"] = prepare_dataset(spec_for(raw, out), workers=0, progress=progress)
        except BaseException as exc:  # noqa: BLE001 - shown by the assertion below
            outcome["error"] = exc
            first_waits.set()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert first_waits.wait(120)
        second = subprocess.run(
            [sys.executable, "-m", "pipeline", "prepare", str(raw), str(out), "--size", "64", "--shard-samples", "16"],
            capture_output=True, text=True, check=False, timeout=120,
        )  # fmt: skip
    finally:
        second_done.set()
        thread.join(120)
    assert "error" not in outcome, outcome
    assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr
    assert f"process {os.getpid()} on {socket.gethostname()}" in second.stderr and "one prepare at a time" in second.stderr
    assert outcome["result"].samples == 60  # type: ignore[attr-defined]
    assert verify_dataset(Output(str(out)), read_manifest(Output(str(out)))).ok
    assert not (out / ".gpufeed.lock").exists()


def test_the_lock_of_a_prepare_that_died_is_taken_over(raw: Path, tmp_path: Path) -> None:
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    out = tmp_path / "out"
    out.mkdir()
    record = {"pid": int(dead.stdout), "host": socket.gethostname(), "since": "2026-01-01T00:00:00+00:00", "job": None}
    (out / ".gpufeed.lock").write_text(json.dumps(record))
    assert prepare_dataset(spec_for(raw, out), workers=0).samples == 60
    assert not (out / ".gpufeed.lock").exists()


def test_the_lock_of_a_service_job_is_respected_whichever_of_its_workers_lives(raw: Path, tmp_path: Path) -> None:
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    out = tmp_path / "out"
    out.mkdir()
    record = {"pid": int(dead.stdout), "host": socket.gethostname(), "since": "2026-01-01T00:00:00+00:00", "job": "0123abcd"}
    (out / ".gpufeed.lock").write_text(json.dumps(record))
    with pytest.raises(JobConflictError, match=f"process {record['pid']} on .* for service job 0123abcd.*gpufeed status 0123abcd"):
        prepare_dataset(spec_for(raw, out), workers=0)
    assert json.loads((out / ".gpufeed.lock").read_text()) == record


def test_on_a_store_the_lock_is_a_marker_that_names_its_holder(raw: Path, tmp_path: Path) -> None:
    import socket

    import fsspec

    memory = fsspec.filesystem("memory")
    out = "memory://gpufeed-test-locked"
    live = {"pid": os.getppid(), "host": socket.gethostname(), "since": "2026-01-01T00:00:00+00:00", "job": None}
    memory.pipe("/gpufeed-test-locked/.gpufeed.lock", json.dumps(live).encode())
    try:
        with pytest.raises(JobConflictError, match=f"being prepared by process {os.getppid()} on "):
            prepare_dataset(spec_for(raw, out), workers=0)
        assert json.loads(memory.cat("/gpufeed-test-locked/.gpufeed.lock")) == live
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
        memory.pipe("/gpufeed-test-locked/.gpufeed.lock", json.dumps({**live, "pid": int(dead.stdout)}).encode())
        assert prepare_dataset(spec_for(raw, out), workers=0).samples == 60  # a dead process's marker is taken over
        assert not memory.exists("/gpufeed-test-locked/.gpufeed.lock")
    finally:
        memory.rm("/gpufeed-test-locked", recursive=True)
