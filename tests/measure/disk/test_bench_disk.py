"""`gpufeed bench disk`: real reads and writes on small files, the cache bypass, and cleanup on Ctrl-C."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import ConfigError, StorageError
from pipeline.measure.disk import bench as disk_bench
from pipeline.measure.disk.bench import WORK_PREFIX, benchmark_disk, mean_file_bytes
from pipeline.measure.disk.result import LATENCY_FLOOR_MS, SPREAD_MARGIN, Spread, check_trust, remembered_results
from pipeline.measure.disk.runner import DiskRunner, aligned_buffer, block_walk

MiB = 1 << 20
SMALL = dict(file_bytes=8 * MiB, block_sizes=(MiB, 2 * MiB), duration_s=0.15, threads=4, small_files=24, small_file_bytes=20_000)
REQUIRED_KEYS = (
    "seq_read_mb_s",
    "seq_write_mb_s",
    "randread_4k_iops_qd1",
    "randread_4k_iops_qdn",
    "randread_4k_p99_ms_qd1",
    "small_file_reads_per_s",
    "direct_io",
    "device_kind",
)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench disk` keeps its result for `gpufeed watch` in the user cache: these small runs keep theirs here."""
    monkeypatch.setenv("GPUFEED_CACHE", str(tmp_path_factory.mktemp("cache")))


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir()]


def test_measures_every_figure_and_removes_its_files(tmp_path: Path) -> None:
    result = benchmark_disk(str(tmp_path), **SMALL)
    data = result.to_dict()
    for key in REQUIRED_KEYS:
        assert key in data, key
    for key in REQUIRED_KEYS[:-2]:
        assert data[key] > 0, key
    assert isinstance(result.direct_io, bool)
    assert result.device_kind in ("nvme", "ssd", "rotational", "network", "tmpfs", "ramfs", "unknown")
    assert result.free_bytes and result.free_bytes > 0
    assert sorted(result.seq_read_by_block) == [MiB, 2 * MiB]
    assert result.seq_read_mb_s == max(result.seq_read_by_block.values())
    assert [p.threads for p in result.randread_sweep] == [1, 4]
    for point in result.randread_sweep:
        assert 0 < point.p50_ms <= point.p99_ms
        assert point.reads > 0
        assert point.mb_s == pytest.approx(point.iops * 4096 / 1e6)
    assert result.randread_4k_iops_qd1 == result.randread_sweep[0].iops
    assert result.small_file_bytes == 20_000 and result.small_files == 24
    assert result.small_file_reads_per_s_qd1 and result.small_file_reads_per_s_qd1 > 0
    json.dumps(data)
    assert _leftovers(tmp_path) == []


def test_reads_with_o_direct_into_aligned_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = disk_bench.device_info(str(tmp_path))
    if info.fstype not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"O_DIRECT behaviour is only asserted on ext4/xfs/btrfs, not {info.fstype}")
    opened: list[tuple[str, int]] = []
    real_open = os.open

    def recording_open(path: str, flags: int, *args: int) -> int:
        opened.append((os.path.basename(path), flags))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", recording_open)
    result = benchmark_disk(str(tmp_path), **SMALL)
    assert result.direct_io is True and result.cache_bypass == "O_DIRECT"
    data_reads = [flags for name, flags in opened if name == "data" and not flags & (os.O_WRONLY | os.O_RDWR)]
    small_reads = [flags for name, flags in opened if name.endswith(".bin")]
    assert data_reads and all(flags & os.O_DIRECT for flags in data_reads)
    assert small_reads and all(flags & os.O_DIRECT for flags in small_reads)
    buffer = aligned_buffer(3 * 4096)
    try:
        assert ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % 4096 == 0
    finally:
        buffer.close()


def test_without_o_direct_files_are_evicted_with_fadvise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    advice: list[int] = []
    real_fadvise = os.posix_fadvise

    def recording_fadvise(fd: int, offset: int, length: int, flag: int) -> None:
        advice.append(flag)
        real_fadvise(fd, offset, length, flag)

    monkeypatch.setattr(os, "posix_fadvise", recording_fadvise)
    result = benchmark_disk(str(tmp_path), direct=False, **SMALL)
    assert result.direct_io is False
    assert "fadvise" in result.cache_bypass
    assert advice.count(os.POSIX_FADV_DONTNEED) > 10
    assert result.seq_read_mb_s and result.randread_4k_iops_qd1 and result.small_file_reads_per_s
    assert _leftovers(tmp_path) == []


def test_tmpfs_is_reported_and_not_claimed_as_bypassed() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or disk_bench.device_info(str(shm)).fstype != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    folder = shm / f"gpufeed-test-{os.getpid()}"
    try:
        result = benchmark_disk(str(folder), tests=("seq_read",), **{**SMALL, "small_files": 1})
        assert result.device_kind == "tmpfs"
        assert result.direct_io is False
        assert result.cache_bypass.startswith("none")
        assert any("memory" in warning for warning in result.warnings)
        assert _leftovers(folder) == []
    finally:
        for child in folder.glob("*"):
            child.unlink()
        if folder.exists():
            folder.rmdir()


def test_only_the_tests_asked_for_run(tmp_path: Path) -> None:
    result = benchmark_disk(str(tmp_path), tests=("seq_read",), **SMALL)
    assert result.seq_read_mb_s and result.seq_write_mb_s is None
    assert result.randread_4k_iops_qd1 is None and result.small_file_reads_per_s is None


def test_refuses_when_the_disk_is_too_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_bench, "free_bytes", lambda path: 4 * MiB)
    with pytest.raises(StorageError, match="smaller --file-size"):
        benchmark_disk(str(tmp_path), **SMALL)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "settings",
    [
        {"block_sizes": (1000,)},
        {"tests": ("seq_read", "bogus")},
        {"file_bytes": 4096},
        {"duration_s": 0},
        {"repeats": 0},
    ],
)
def test_bad_settings_are_refused(tmp_path: Path, settings: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        benchmark_disk(str(tmp_path), **{**SMALL, **settings})  # type: ignore[arg-type]


def test_remote_paths_are_refused() -> None:
    with pytest.raises(ConfigError, match="local folder"):
        benchmark_disk("s3://bucket/data")


def test_a_file_is_refused_as_a_folder_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a folder")
    with pytest.raises(ConfigError, match="is a file; bench disk measures a folder"):
        benchmark_disk(str(path), **SMALL)
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "bench", "disk", str(path), "--file-size", "8MiB"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr == f"gpufeed: error: {path} is a file; bench disk measures a folder on the disk: give one, e.g. {tmp_path}\n"


def _measured(kernel_kind: str, iops: float, p50_ms: float) -> disk_bench.DiskBenchResult:
    result = disk_bench.DiskBenchResult(
        path="/data", device_kind=kernel_kind, kernel_kind=kernel_kind, fstype="ext4", device="vda", free_bytes=None,
        direct_io=True, cache_bypass="O_DIRECT", file_bytes=MiB, threads=16,
    )  # fmt: skip
    result.randread_4k_iops_qd1, result.randread_4k_p50_ms_qd1 = iops, p50_ms
    return result


def test_a_disk_the_kernel_calls_rotational_is_classified_by_its_random_reads() -> None:
    virtio = _measured("rotational", 65_000.0, 0.06)  # a virtual disk: the kernel's flag says rotational
    disk_bench.classify_measured(virtio)
    assert (virtio.device_kind, virtio.kernel_kind) == ("ssd", "rotational")
    assert "the kernel marks vda as rotational" in virtio.kind_note and "0.06 ms" in virtio.kind_note
    assert "65,000 IOPS" in virtio.kind_note and virtio.kind_note.endswith("counted as ssd")
    assert virtio.to_dict()["kernel_kind"] == "rotational"
    spinning = _measured("rotational", 150.0, 6.5)  # a real hard disk stays one
    disk_bench.classify_measured(spinning)
    assert (spinning.device_kind, spinning.kind_note) == ("rotational", "")
    nvme = _measured("nvme", 90_000.0, 0.05)  # nothing to correct
    disk_bench.classify_measured(nvme)
    assert (nvme.device_kind, nvme.kind_note) == ("nvme", "")


def test_the_kind_is_measured_when_the_kernel_says_rotational(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = disk_bench.device_info(str(tmp_path))
    monkeypatch.setattr(disk_bench, "device_info", lambda path: dataclasses.replace(kernel, kind="rotational"))
    result = benchmark_disk(str(tmp_path), tests=("randread",), **SMALL)
    assert result.kernel_kind == "rotational"
    p50 = result.randread_4k_p50_ms_qd1
    assert p50 is not None
    if p50 < disk_bench.FLASH_P50_MS and (result.randread_4k_iops_qd1 or 0) > disk_bench.ROTATIONAL_MAX_IOPS:
        assert result.device_kind == "ssd" and "rotational" in result.kind_note
    else:
        assert result.device_kind == "rotational" and result.kind_note == ""


def test_mean_file_bytes_of_a_dataset(tmp_path: Path) -> None:
    for index, size in enumerate((1000, 2000, 6000)):
        (tmp_path / f"img{index}.jpg").write_bytes(b"x" * size)
    (tmp_path / "notes.txt").write_bytes(b"y" * 99999)  # not an image: ignored
    assert mean_file_bytes(str(tmp_path)) == 3000


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_removes_its_files(tmp_path: Path, signum: int) -> None:
    command = [
        sys.executable, "-m", "pipeline", "bench", "disk", str(tmp_path),
        "--file-size", "64MiB", "--duration", "20", "--threads", "2", "--small-files", "8",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any((d / "data").exists() for d in tmp_path.glob(f"{WORK_PREFIX}*")):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the benchmark never wrote its test file"
            time.sleep(0.05)
        time.sleep(0.5)  # well inside the (20 s) read tests
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr
    assert _leftovers(tmp_path) == []


def test_cli_json(tmp_path: Path) -> None:
    target = tmp_path / "disk"
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "bench", "disk", str(target), "--file-size", "8MiB", "--block-sizes", "1MiB",
         "--duration", "0.1", "--threads", "2", "--small-files", "8", "--small-file-size", "16kB", "--repeats", "2",
         "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in REQUIRED_KEYS:
        assert key in data
    assert data["small_file_bytes"] == 16_000
    assert data["seq_read_by_block"] == {str(MiB): data["seq_read_mb_s"]}
    assert data["repeats"] == 2 and data["seq_read_block"] == MiB
    assert len(data["figures"][f"seq_read_mb_s:{MiB}"]["runs"]) == 2
    for key in ("unsteady", "cache_suspected", "spread_margin", "latency_floor_ms", "warnings"):
        assert key in data, key
    assert _leftovers(target) == []


def test_each_figure_is_the_median_of_its_repeats_with_their_spread(tmp_path: Path) -> None:
    result = benchmark_disk(str(tmp_path), repeats=3, **SMALL)
    assert result.repeats == 3
    names = {f"seq_read_mb_s:{MiB}", f"seq_read_mb_s:{2 * MiB}", "small_file_reads_per_s:1", "small_file_reads_per_s:4"}
    names |= {f"randread_4k_{kind}:{threads}" for kind in ("iops", "p50_ms", "p99_ms") for threads in (1, 4)}
    assert set(result.figures) == names
    for figure in result.figures.values():
        assert len(figure.runs) == 3
        assert figure.median == statistics.median(figure.runs)
        assert figure.low == min(figure.runs) <= figure.median <= figure.high == max(figure.runs)
        assert figure.spread == pytest.approx((figure.high - figure.low) / figure.median)
    for block in (MiB, 2 * MiB):
        assert result.seq_read_by_block[block] == result.figures[f"seq_read_mb_s:{block}"].median
    # the headline is a median, at the block size whose median is highest: never a single run's best
    assert result.seq_read_block == max(result.seq_read_by_block, key=result.seq_read_by_block.__getitem__)
    assert result.seq_read_mb_s == result.figures[f"seq_read_mb_s:{result.seq_read_block}"].median
    qd1 = result.randread_sweep[0]
    assert qd1.iops == result.randread_4k_iops_qd1 == result.figures["randread_4k_iops:1"].median
    assert qd1.p50_ms == result.randread_4k_p50_ms_qd1 == result.figures["randread_4k_p50_ms:1"].median
    assert result.small_file_reads_per_s == result.figures["small_file_reads_per_s:4"].median
    assert result.unsteady == [
        name for name, figure in result.figures.items() if "_ms:" not in name and figure.spread > SPREAD_MARGIN
    ]
    assert any("test file (8 MiB) is small enough" in warning for warning in result.warnings)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["figures"][f"seq_read_mb_s:{MiB}"]["runs"] == result.figures[f"seq_read_mb_s:{MiB}"].runs


def _checked(kind: str, p50_ms: float, runs: dict[str, list[float]] | None = None, direct: bool = True) -> disk_bench.DiskBenchResult:
    result = _measured(kind, 20_000.0, p50_ms)
    result.direct_io, result.file_bytes = direct, 1 << 30
    result.figures = {name: Spread.of(values) for name, values in (runs or {}).items()}
    check_trust(result, memory=False, kept_cache=False)
    return result


def test_repeats_that_disagree_are_flagged_in_words_and_fields() -> None:
    steady = _checked("ssd", 0.08, {f"seq_read_mb_s:{MiB}": [600.0, 640.0, 700.0], "randread_4k_iops:1": [9e3, 1e4, 1.1e4]})
    assert steady.unsteady == [] and steady.warnings == [] and not steady.cache_suspected
    shaky = _checked(
        "ssd", 0.08,
        {f"seq_read_mb_s:{2 * MiB}": [596.0, 1902.0, 976.0], "randread_4k_iops:1": [9e3, 1e4, 1.1e4],
         "randread_4k_p99_ms:1": [0.1, 0.9, 0.3]},  # latencies' spread alone does not count
    )  # fmt: skip
    assert shaky.unsteady == [f"seq_read_mb_s:{2 * MiB}"]
    assert shaky.figures[f"seq_read_mb_s:{2 * MiB}"].median == 976.0
    (warning,) = shaky.warnings
    assert "repeats disagree by more than 25 %" in warning and "sequential read 2 MiB: 596/1,902/976 MB/s" in warning


def test_reads_faster_than_the_device_kind_are_flagged_as_a_cache() -> None:
    cached = _checked("ssd", 0.025)  # the 25 us a virtual disk's host cache answers in
    assert cached.cache_suspected and cached.latency_floor_ms == LATENCY_FLOOR_MS["ssd"]
    (warning,) = cached.warnings
    assert "random 4 KiB reads took 25 us" in warning and "faster than a ssd device answers" in warning
    assert "although O_DIRECT was in effect" in warning
    evicted = _checked("rotational", 0.01, direct=False)
    assert evicted.cache_suspected and "O_DIRECT not in effect" in evicted.warnings[0]
    assert not _checked("ssd", 0.06).cache_suspected  # flash behind a virtual disk: plausible
    assert not _checked("nvme", 0.025).cache_suspected  # a fast NVMe drive can answer in 25 us


def test_a_page_cache_served_run_is_flagged(tmp_path: Path) -> None:
    result = benchmark_disk(str(tmp_path), keep_cache=True, tests=("randread",), **SMALL)
    assert result.direct_io is False and result.cache_bypass.startswith("none")
    assert result.cache_suspected
    assert any("page cache was kept" in warning for warning in result.warnings)
    p50 = result.randread_4k_p50_ms_qd1
    assert p50 is not None
    floor = LATENCY_FLOOR_MS.get(result.device_kind)
    if floor is not None and p50 < floor:  # reads from memory: the latency check sees it too
        assert any("a cache in between" in warning for warning in result.warnings)
    disk_bench.remember_result(result)
    (entry,) = remembered_results().values()
    assert entry["cache_suspected"] is True and entry["direct_io"] is False and entry["repeats"] == 3


def test_every_page_of_the_test_files_differs(tmp_path: Path) -> None:
    runner = DiskRunner(str(tmp_path), direct=False, duration_s=0.1, seed=0)
    runner.write_file(8 * MiB, MiB)
    runner.write_small_files(4, 10_000)
    data = (tmp_path / "data").read_bytes()
    pages = {hashlib.sha1(data[start:start + 4096]).digest() for start in range(0, len(data), 4096)}
    assert len(pages) == len(data) // 4096  # no page a deduplicating layer could serve from another
    small = [Path(path).read_bytes() for path in runner.small_paths]
    assert len({hashlib.sha1(body[:4096]).digest() for body in small}) == len(small)


@pytest.mark.parametrize("blocks", [1, 2, 5, 1000, 4097])
def test_random_reads_visit_every_block_once_per_pass(blocks: int) -> None:
    walk = block_walk(blocks, random.Random(blocks))
    first = [next(walk) for _ in range(blocks)]
    second = [next(walk) for _ in range(blocks)]
    assert sorted(first) == sorted(second) == list(range(blocks))
    if blocks > 100:
        steps = {b - a for a, b in zip(first, first[1:])}
        assert len(steps) > blocks // 4  # not a fixed stride through the file
