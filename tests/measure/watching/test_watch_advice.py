"""`gpufeed watch`'s advice agrees with its evidence: a busy machine, nearly a free core, a disk, many tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from loader_data import prepare_labelled

from pipeline.measure.watching.run import LoopFigures, Verdict, WatchReport, WatchSample, judge

BURN = "import sys, time\nopen(sys.argv[1], 'w').close()\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass\n"

LOADER_ON_A_BUSY_MACHINE = """
import os, time
from pipeline import make_loader
loader = make_loader({dataset!r}, batch_size=4, device="cpu", crop=32, num_workers=1)
open("ready", "w").close()
while not os.path.exists("go"):  # the CPU burners start once the imports are done
    time.sleep(0.01)
for epoch in range(16):  # a loop that outlasts a sampling interval or two
    for images, labels in loader:
        time.sleep(0.002)
"""

MANY_TENSORS = """
import torch
from torch.utils.data import DataLoader, Dataset

class Items(Dataset):
    def __len__(self): return 20
    def __getitem__(self, index): return index

def collate(indices):
    return [torch.full((4,), float(i)) for i in range(1200)]

if __name__ == "__main__":
    for batch in DataLoader(Items(), batch_size=4, num_workers=2, collate_fn=collate):
        pass
"""


def _watch(tmp_path: Path, script: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "GPUFEED_CACHE": str(tmp_path / "cache")}  # no `gpufeed bench disk` result to lean on
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", "watch", "--interval", "0.5", "--json", str(tmp_path / "report.json"),
         "--", sys.executable, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.timeout(90)
def test_gpufeed_loader_on_a_busy_machine_is_cpu_bound(tmp_path: Path) -> None:
    dataset = prepare_labelled(tmp_path, "ds", 48, shard_samples=12)
    os.sync()  # the shards just written reach the disk now, not as writeback while the watched loop runs
    script = tmp_path / "train.py"
    script.write_text(LOADER_ON_A_BUSY_MACHINE.format(dataset=str(dataset)))
    watched = _watch(tmp_path, script)
    burners: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists() and watched.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        count = (os.cpu_count() or 1) + 1
        burners = [subprocess.Popen([sys.executable, "-c", BURN, str(tmp_path / f"burning-{n}")]) for n in range(count)]
        while sum((tmp_path / f"burning-{n}").exists() for n in range(count)) < count and time.monotonic() < deadline:
            time.sleep(0.01)  # every burner at work before the loop starts
        (tmp_path / "go").touch()
        _, stderr = watched.communicate(timeout=60)
    finally:
        watched.kill()
        for burner in burners:
            burner.kill()
            burner.wait()
    assert watched.returncode == 0, stderr
    verdict = json.loads((tmp_path / "report.json").read_text())["verdict"]
    assert verdict["cause"] == "cpu", stderr
    assert "not saturated" not in stderr and "undetermined" not in stderr, stderr
    assert verdict["figures"]["cores_free"] < 0.5, verdict["figures"]
    # the process's CPU is shared over the run, not over the loop alone: at most every core
    assert verdict["figures"]["loader_cores"] <= verdict["figures"]["cores"] + 0.1, verdict["figures"]


@pytest.mark.timeout(60)
def test_thousands_of_tensors_per_batch_are_told_to_stack(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(MANY_TENSORS))
    watched = _watch(tmp_path, script)
    _, stderr = watched.communicate(timeout=50)
    assert watched.returncode == 0, stderr
    verdict = json.loads((tmp_path / "report.json").read_text())["verdict"]
    assert verdict["cause"] == "main-process" and verdict["figures"]["tensors_per_batch"] == 1200, stderr
    assert "fewer, stacked tensors per sample" in verdict["next_step"]


def _report(loop: dict[str, Any], *, cores_busy: float = 0.0, cores: int = 2, **report: Any) -> Verdict:
    """The verdict on one training loader's figures, the machine's cores `cores_busy` busy throughout."""
    samples = [WatchSample(float(t), None, 0.0, 0.0, None, None, cores_busy, 0.0, 0.0, 0.0, 0.0) for t in range(10)]
    figures = LoopFigures(pid=1, rank=None, **{"kind": "torch", **loop})
    report = {"read_bytes": 0, "read_mb_s": 0.0, **report}
    watched = WatchReport(
        ["train.py"], 0, 10.0, cores, [figures], [], "no NVML", disk_ceiling_mb_s=None, disk_measured="",
        samples=samples, verdict=Verdict("", None, [], "", None, []), **report,
    )  # fmt: skip
    return judge(watched)


CPU_BOUND_WORKERS = dict(batches=41, iterations=1, wait_s=2.0, step_s=2.0, num_workers=1, fetch_s=8.2,
                         fetch_cpu_s=8.0, fetch_batches=41)  # fmt: skip


def test_nearly_a_free_core_is_advised_as_one_more_worker() -> None:
    verdict = _report(CPU_BOUND_WORKERS, cores_busy=1.1)  # 0.9 of 2 cores free
    assert verdict.cause == "cpu" and abs(verdict.figures["cores_free"] - 0.9) < 1e-9
    assert "num_workers=2" in verdict.next_step and "less than half a core" not in verdict.next_step
    assert "about 0.9 cores are free" in verdict.next_step


def test_less_than_half_a_free_core_is_advised_offline_preparation() -> None:
    verdict = _report(CPU_BOUND_WORKERS, cores_busy=1.6)
    assert verdict.cause == "cpu" and "num_workers" not in verdict.next_step
    assert "less than half a core is free (about 0.4)" in verdict.next_step


def test_gpufeed_loader_waiting_for_a_core_is_cpu_bound() -> None:
    # The loader's process used half a core of 2 over the run, yet the machine's cores were all busy.
    loop = dict(kind="gpufeed", batches=40, iterations=1, wait_s=4.0, step_s=4.0, num_workers=1, cpu_s=5.0, runq_s=3.0)
    verdict = _report(loop, cores_busy=2.0)
    assert verdict.cause == "cpu" and not any("not saturated" in line for line in verdict.undetermined)
    idle = _report(dict(loop, runq_s=0.0), cores_busy=0.6)  # cores free, no wait for one: not the CPU
    assert idle.cause == "undetermined"


def test_a_busy_disk_is_not_advised_more_workers() -> None:
    # Workers spend their time off the CPU (waiting on reads) while the device is busy 90 % of the run.
    loop = dict(batches=41, iterations=1, wait_s=6.0, step_s=2.0, num_workers=2, fetch_s=8.2, fetch_cpu_s=0.5,
                fetch_batches=41)  # fmt: skip
    verdict = _report(loop, read_bytes=400 << 20, read_mb_s=40.0, read_chars=400 << 20, disk_busy=0.9, disk_device="sda")
    assert verdict.cause == "disk"
    assert "num_workers" not in verdict.next_step and "more workers would queue" in verdict.next_step
    assert verdict.predicted_speedup is None


def test_a_device_kept_busy_by_another_processs_traffic_is_not_the_loops_disk() -> None:
    # The same loop and device busy share, but the run's reads are 5 % of the bytes the device moved (another
    # process writes beside it): the busy time is not the loop's, and the cause is the workers' CPU.
    loop = dict(CPU_BOUND_WORKERS, wait_s=6.0, step_s=2.0)
    busy = dict(read_bytes=400 << 20, read_mb_s=40.0, read_chars=400 << 20, disk_busy=0.9, disk_device="sda")
    assert _report(loop, cores_busy=2.0, **busy, disk_own_share=1.0).cause == "disk"
    verdict = _report(loop, cores_busy=2.0, **busy, disk_own_share=0.05)
    assert verdict.cause != "disk", verdict
    assert abs(verdict.figures["disk_busy_own"] - 0.045) < 1e-9
    assert any("the run's reads 5% of its traffic" in line for line in verdict.evidence), verdict.evidence


def test_the_workers_cores_agree_with_what_they_timed_of_the_dataset() -> None:
    # Per-epoch workers that ended between two samples leave their process counters stale (0.3 CPU s here);
    # their own records timed 7 CPU s of the Dataset over the loop's 8 s: about 0.9 cores, as the line above says.
    loop = dict(CPU_BOUND_WORKERS, wait_s=6.0, step_s=2.0, workers=1, workers_cpu_s=0.3, fetch_cpu_s=7.0)
    verdict = _report(loop, cores_busy=1.1)
    (line,) = [line for line in verdict.evidence if "worker processes kept" in line]
    assert "kept 0.88 cores busy" in line, line


def test_free_cores_are_those_of_the_loops_time_not_of_the_imports() -> None:
    # 4 intervals of imports on an idle machine, then 6 of the loop with every core busy: no core is free for a worker.
    samples = [WatchSample(float(t), None, 0.0, 0.0, None, None, 0.2, 0.0, 0.0, 0.0, 0.0) for t in range(4)]
    samples += [WatchSample(float(t), 0.6, 5.0, 20.0, None, None, 2.0, 0.0, 0.0, 0.0, 0.0) for t in range(4, 10)]
    figures = LoopFigures(pid=1, rank=None, **{"kind": "torch", **CPU_BOUND_WORKERS})
    watched = WatchReport(
        ["train.py"], 0, 10.0, 2, [figures], [], "no NVML", disk_ceiling_mb_s=None, disk_measured="",
        samples=samples, verdict=Verdict("", None, [], "", None, []), read_bytes=0, read_mb_s=0.0,
    )  # fmt: skip
    verdict = judge(watched)
    assert verdict.figures["cores_free"] == 0.0 and "num_workers" not in verdict.next_step, verdict
