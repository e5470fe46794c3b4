"""`gpufeed watch -- COMMAND`: real training scripts run under watch, judged by its JSON report and exit code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from loader_data import prepare_labelled

# A DataLoader loop: DATASET and STEP are filled in by each test.
LOOP = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset

class Items(Dataset):
    def __len__(self):
        return {items}

    def __getitem__(self, index):
        {dataset}
        return torch.zeros(4), index

for images, labels in DataLoader(Items(), batch_size=4, num_workers={workers}):
    {step}
"""


def write_loop(tmp_path: Path, *, items: int = 48, dataset: str = "pass", step: str = "pass", workers: int = 0) -> Path:
    script = tmp_path / "train.py"
    script.write_text(LOOP.format(items=items, dataset=dataset, step=step, workers=workers))
    return script


def watch(tmp_path: Path, *command: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run `gpufeed watch --json` on `command`; the finished process and its report."""
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "watch", "--interval", "0.5", "--json", str(report), "--", *command],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert report.exists(), result.stderr
    return result, json.loads(report.read_text())


def test_slow_dataset_is_data_bound_on_the_dataset(tmp_path: Path) -> None:
    script = write_loop(tmp_path, dataset="time.sleep(0.025)", workers=2)
    result, report = watch(tmp_path, sys.executable, str(script))
    assert result.returncode == 0, result.stderr
    verdict = report["verdict"]
    assert verdict["bound"] == "data-bound", result.stderr
    assert report["stall_fraction"] > 0.8
    assert verdict["cause"] == "dataset", result.stderr
    (loop,) = report["loops"]
    assert loop["kind"] == "torch" and loop["batches"] == 12 and loop["num_workers"] == 2
    assert loop["fetch_batches"] == 12  # every batch fetched in the workers was counted, the last ones included
    assert "verdict: data-bound (dataset)" in result.stderr and "next step:" in result.stderr


def test_slow_step_is_compute_bound(tmp_path: Path) -> None:
    script = write_loop(tmp_path, step="time.sleep(0.03)")
    result, report = watch(tmp_path, sys.executable, str(script))
    assert result.returncode == 0, result.stderr
    assert report["verdict"]["bound"] == "compute-bound", result.stderr
    assert report["stall_fraction"] < 0.05
    assert report["verdict"]["cause"] is None


def test_busy_workers_are_cpu_bound(tmp_path: Path) -> None:
    busy = "deadline = time.thread_time() + 0.02\n        while time.thread_time() < deadline: pass"
    script = write_loop(tmp_path, items=40, dataset=busy, workers=2)
    result, report = watch(tmp_path, sys.executable, str(script))
    assert result.returncode == 0, result.stderr
    assert report["verdict"]["bound"] == "data-bound", result.stderr
    assert report["verdict"]["cause"] == "cpu", result.stderr


def test_gpufeed_loader_is_timed(tmp_path: Path) -> None:
    dataset = prepare_labelled(tmp_path, "ds", 24, shard_samples=12)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from pipeline import make_loader
        loader = make_loader({str(dataset)!r}, batch_size=4, device="cpu", crop=32, num_workers=1)
        for images, labels in loader:
            time.sleep(0.02)
        print(len(loader))
    """))
    result, report = watch(tmp_path, sys.executable, str(script))
    assert result.returncode == 0, result.stderr
    (loop,) = report["loops"]
    assert loop["kind"] == "gpufeed"
    assert str(loop["batches"]) == result.stdout.strip()
    assert loop["samples"] == 4 * loop["batches"]
    assert loop["step_s"] > 0 and report["verdict"]["bound"] != "unknown"


def test_every_torchrun_rank_is_reported(tmp_path: Path) -> None:
    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent("""
        import time
        import torch
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        dist.init_process_group("gloo")
        data = TensorDataset(torch.zeros(32, 4))
        for (batch,) in DataLoader(data, batch_size=4, sampler=DistributedSampler(data)):
            time.sleep(0.01)
        dist.destroy_process_group()
    """))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    result, report = watch(tmp_path, *command)
    assert result.returncode == 0, result.stderr
    assert sorted(loop["rank"] for loop in report["loops"]) == [0, 1]
    assert all(loop["batches"] == 4 for loop in report["loops"])
    assert "rank 0" in result.stderr and "rank 1" in result.stderr


def test_accelerate_launch_is_followed(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="the test extra brings accelerate")
    script = write_loop(tmp_path, items=32, step="time.sleep(0.01)")
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", "--cpu", "--num_processes", "1", "--num_machines", "1"]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no", str(script)]
    result, report = watch(tmp_path, *command)
    assert result.returncode == 0, result.stderr
    assert [loop["batches"] for loop in report["loops"]] == [8]


def test_exit_code_passes_through_and_site_customisation_still_runs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nopen(os.environ['MARK'], 'w').write('ran')\n")
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "MARK": str(tmp_path / "mark")}
    result, report = watch(tmp_path, sys.executable, str(script), env=env)
    assert result.returncode == 3 and report["exit_code"] == 3
    assert (tmp_path / "mark").read_text() == "ran"
    assert report["verdict"]["bound"] == "unknown"  # no loader was iterated: it says so


def test_a_missing_command_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "watch", "--", str(tmp_path / "no-such-program")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.startswith("gpufeed: error: cannot run") and "Traceback" not in result.stderr


def test_ctrl_c_reaches_the_command(tmp_path: Path) -> None:
    script = tmp_path / "long.py"
    mark = tmp_path / "interrupted"
    script.write_text(textwrap.dedent(f"""
        import time
        from torch.utils.data import DataLoader
        print("ready", flush=True)
        try:
            while True:
                for batch in DataLoader(range(64), batch_size=4):
                    time.sleep(0.01)
        except KeyboardInterrupt:
            open({str(mark)!r}, "w").write("yes")
            raise
    """))
    report = tmp_path / "report.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "watch", "--interval", "0.5", "--json", str(report), "--", sys.executable, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert mark.read_text() == "yes"
    assert json.loads(report.read_text())["loops"][0]["batches"] > 0


FAKE_NVML = '''
"""A stand-in for nvidia-ml-py: one GPU, 37 % busy, 3 of 16 GiB used."""
class _Util:
    gpu, memory = 37, 10

class _Memory:
    used, total, free = 3 * 2**30, 16 * 2**30, 13 * 2**30

def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(index): return ("gpu", index)
def nvmlDeviceGetName(handle): return "Fake GPU"
def nvmlDeviceGetUtilizationRates(handle): return _Util()
def nvmlDeviceGetMemoryInfo(handle): return _Memory()
'''


def test_gpus_are_read_through_nvml(tmp_path: Path) -> None:
    fake = tmp_path / "nvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(FAKE_NVML)
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    script = write_loop(tmp_path, items=64, step="time.sleep(0.05)")
    result, report = watch(tmp_path, sys.executable, str(script), env=env)
    assert result.returncode == 0, result.stderr
    (gpu,) = report["gpus"]
    assert gpu["name"] == "Fake GPU" and gpu["util_mean"] == 37 and gpu["memory_used_max"] == 3 * 2**30
    assert any("GPU 0 (Fake GPU): 37 % busy" in line for line in report["verdict"]["evidence"])
    # the loop does not wait for data, yet the GPU idles: watch says what it cannot tell apart
    assert report["verdict"]["bound"] == "compute-bound" and report["verdict"]["undetermined"]
    assert "GPU  37%" in result.stderr


def test_library_form_times_this_process() -> None:
    import torch
    from torch.utils.data import DataLoader

    import pipeline.measure

    with pipeline.measure.watch(interval_s=0.2) as w:
        for _ in DataLoader(torch.zeros(40, 2), batch_size=4):
            time.sleep(0.02)
    report = w.report()
    (loop,) = report.loops
    assert loop.pid == os.getpid() and loop.batches == 10 and loop.kind == "torch"
    assert report.verdict.bound == "compute-bound"


def test_reads_near_the_disks_measured_ceiling_are_disk_bound(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "GPUFEED_CACHE": str(cache)}
    (tmp_path / "data").mkdir()
    bench = subprocess.run(
        [sys.executable, "-m", "pipeline", "bench", "disk", str(tmp_path / "data"), "--file-size", "8MiB",
         "--duration", "0.2", "--tests", "seq_read", "--block-sizes", "1MiB"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    (remembered,) = (cache / "disk").glob("*.json")
    entry = json.loads(remembered.read_text())
    assert entry["seq_read_mb_s"] > 0 and entry["st_dev"] == os.stat(tmp_path / "data").st_dev
    # The same filesystem, as if its disk delivered 1 MB/s: the run's reads are then at its ceiling.
    entry["seq_read_mb_s"] = 1.0
    remembered.write_text(json.dumps(entry))
    blob = tmp_path / "data" / "blob.bin"
    blob.write_bytes(os.urandom(2**21))
    os.sync()
    dataset = (
        f"fd = os.open({str(blob)!r}, os.O_RDONLY)\n"
        "        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not the page cache\n"
        "        while os.read(fd, 2**20): pass\n"
        "        time.sleep(0.01); os.close(fd)"
    )
    script = write_loop(tmp_path, items=32, dataset=dataset, workers=2)
    script.write_text("import os\n" + script.read_text())
    result, report = watch(tmp_path, sys.executable, str(script), env=env)
    assert result.returncode == 0, result.stderr
    if report["read_bytes"] == 0:
        pytest.skip("this filesystem counts no storage reads (tmpfs or overlay)")
    assert report["disk_ceiling_mb_s"] == 1.0 and report["disk_measured"] == str(tmp_path / "data")
    assert report["verdict"]["cause"] == "disk", result.stderr
    # A result whose reads a cache served is no ceiling of the device: left out, the disk named from its counters.
    remembered.write_text(json.dumps({**entry, "cache_suspected": True}))
    result, report = watch(tmp_path, sys.executable, str(script), env=env)
    assert result.returncode == 0, result.stderr
    assert report["disk_ceiling_mb_s"] is None and report["disk_measured"] == ""


def _report(**loop: Any) -> Any:
    from pipeline.measure.watching.run import LoopFigures, Verdict, WatchReport, judge

    figures = LoopFigures(pid=1, rank=None, kind="torch", **loop)
    report = WatchReport(["train.py"], 0, 10.0, 8, [figures], [], "no NVML", 0, 0.0, None, "", [], Verdict("", None, [], "", None, []))
    return judge(report)


def test_ready_batches_the_loop_still_waits_for_are_the_main_process() -> None:
    # Workers need 2 ms of Dataset time per batch, the loop takes 100 ms per batch and waits for 80 of them.
    verdict = _report(batches=21, iterations=1, wait_s=1.6, step_s=0.4, num_workers=4, fetch_s=0.168, fetch_cpu_s=0.16, fetch_batches=21)
    assert (verdict.bound, verdict.cause) == ("data-bound", "main-process")


def test_cpu_bound_workers_with_free_cores_are_told_how_many_workers() -> None:
    # 2 workers, each batch costs them 200 ms of CPU, the loop steps 50 ms and waits 50: twice as fast if fed.
    verdict = _report(batches=41, iterations=1, wait_s=2.0, step_s=2.0, num_workers=2, fetch_s=8.2, fetch_cpu_s=8.0, fetch_batches=41)
    assert (verdict.bound, verdict.cause) == ("data-bound", "cpu")
    assert "num_workers=4" in verdict.next_step and verdict.predicted_speedup == 2.0
