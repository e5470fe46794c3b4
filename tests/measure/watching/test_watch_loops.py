"""`gpufeed watch` on training scripts with more than one loader, per-epoch workers reading the disk and CPU work
in the loop: each verdict and cause, and the stall within 5 points of the one the script measures itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

# Each script times its own waits on iter() and next() of the training loader, and prints {"stall": …}.
TRAIN_AND_VALIDATE = """
import json, time
import torch
from torch.utils.data import DataLoader, Dataset

class Decoded(Dataset):
    def __len__(self):
        return 36

    def __getitem__(self, index):
        deadline = time.thread_time() + 0.02  # a decode: CPU in the worker
        while time.thread_time() < deadline:
            pass
        return torch.rand(8), index % 2

model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
train = DataLoader(Decoded(), batch_size=2, num_workers=2)
val = DataLoader(Decoded(), batch_size=6, num_workers=1)
waited = looped = 0.0
started = asked = time.perf_counter()
for step, (images, labels) in enumerate(train):
    waited += time.perf_counter() - asked
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(0.01)
    if step % 6 == 5:  # a validation pass: not the training loop's time
        paused = time.perf_counter()
        model.eval()
        with torch.no_grad():
            for images, labels in val:
                model(images)
        model.train()
        started += time.perf_counter() - paused
    asked = time.perf_counter()
waited += time.perf_counter() - asked
print(json.dumps({"stall": waited / (time.perf_counter() - started)}))
"""

# Per-epoch workers reading files from the disk (O_DIRECT: past the page cache), 4 KiB at a time in a random order:
# each read waits on the device far longer than the Python around it runs.
READ_FILES = """
import json, mmap, os, random, sys, time
import torch
from torch.utils.data import DataLoader, Dataset

FILES = sorted(os.path.join(sys.argv[1], name) for name in os.listdir(sys.argv[1]))

class Files(Dataset):
    def __len__(self):
        return len(FILES)

    def __getitem__(self, index):
        block = mmap.mmap(-1, 4096)
        fd = os.open(FILES[index], os.O_RDONLY | os.O_DIRECT)
        offsets = list(range(0, os.fstat(fd).st_size, 4096))
        random.Random(index).shuffle(offsets)
        try:
            for offset in offsets:
                os.preadv(fd, [block], offset)
        finally:
            os.close(fd)
        return torch.zeros(4)

waited = 0.0
started = time.perf_counter()
for epoch in range(3):
    asked = time.perf_counter()
    for batch in DataLoader(Files(), batch_size=2, num_workers=2):
        waited += time.perf_counter() - asked
        time.sleep(0.005)
        asked = time.perf_counter()
    waited += time.perf_counter() - asked
size = sum(os.path.getsize(name) for name in FILES)
print(json.dumps({"stall": waited / (time.perf_counter() - started), "bytes": 3 * size}))
"""

# Augmentation on the CPU in the training process, between next() and the model step.
AUGMENT_IN_LOOP = """
import json, time
import torch
from torch.utils.data import DataLoader, TensorDataset

def augment(images):
    deadline = time.thread_time() + 0.03
    while time.thread_time() < deadline:
        images = images.flip(-1) * 1.0001
    return images

model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.rand(96, 3, 16, 16), torch.zeros(96, dtype=torch.long))
waited = 0.0
started = asked = time.perf_counter()
for images, labels in DataLoader(data, batch_size=4):
    waited += time.perf_counter() - asked
    images = augment(images)
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
    optimizer.zero_grad()
    asked = time.perf_counter()
waited += time.perf_counter() - asked
print(json.dumps({"stall": waited / (time.perf_counter() - started)}))
"""


def watch(tmp_path: Path, script: str, *args: str, interval: str = "0.5") -> tuple[dict[str, Any], dict[str, Any], str]:
    """Run `script` under `gpufeed watch --json`: the report, the script's own figures and watch's stderr."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    report = tmp_path / f"report-{interval}.json"
    env = {**os.environ, "GPUFEED_CACHE": str(tmp_path / "cache")}  # no `gpufeed bench disk` result to lean on
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "watch", "--interval", interval, "--json", str(report), "--",
         sys.executable, str(path), *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(report.read_text()), json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_training_and_validation_loaders_are_apart(tmp_path: Path) -> None:
    report, measured, stderr = watch(tmp_path, TRAIN_AND_VALIDATE)
    train, val = sorted(report["loops"], key=lambda loop: loop["site"])
    assert (train["role"], val["role"]) == ("training", "evaluation"), stderr
    assert train["site"] == "Decoded at train.py:18" and val["site"] == "Decoded at train.py:19"
    assert (train["batches"], train["num_workers"], train["workers"]) == (18, 2, 2)  # no validation batch folded in
    assert (val["batches"], val["num_workers"]) == (18, 1)
    assert abs(report["stall_fraction"] - measured["stall"]) < 0.05, (report["stall_fraction"], measured)
    assert report["verdict"]["bound"] == "data-bound" and report["verdict"]["cause"] == "cpu", stderr
    assert report["validation_share"] > 0.05 and report["verdict"]["figures"]["validation_share"] > 0.05
    assert report["version"] == 2 and report["cost"]["startup_s"] > 0
    assert all(len(line) <= 100 for line in stderr.splitlines()), stderr


@pytest.mark.slow
def test_per_epoch_workers_reads_count_once_and_name_the_disk_at_any_interval(tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    for index in range(12):
        (files / f"{index}.bin").write_bytes(os.urandom(2 << 20))
    os.sync()  # the files' writeback is not the watched run's traffic
    verdicts = set()
    for interval in ("1", "2", "5"):
        report, measured, stderr = watch(tmp_path, READ_FILES, str(files), interval=interval)
        if report["read_bytes"] == 0:
            pytest.skip("this filesystem counts no storage reads (tmpfs or overlay)")
        # each byte once: the workers' reads, not again in their parent's counters once they are reaped
        assert measured["bytes"] <= report["read_bytes"] < 1.1 * measured["bytes"], (interval, report["read_bytes"])
        assert abs(report["stall_fraction"] - measured["stall"]) < 0.05, (interval, report["stall_fraction"], measured)
        verdicts.add((report["verdict"]["bound"], report["verdict"]["cause"]))
        assert report["disk_ceiling_mb_s"] is None  # named from the counters, without a benchmark
    assert verdicts == {("data-bound", "disk")}, verdicts


def test_augmentation_in_the_loop_is_its_own_cause(tmp_path: Path) -> None:
    report, measured, stderr = watch(tmp_path, AUGMENT_IN_LOOP)
    verdict = report["verdict"]
    assert verdict["cause"] == "loop-cpu" and verdict["bound"] in ("data-bound", "partly data-bound"), stderr
    assert "into the Dataset" in verdict["next_step"]
    assert verdict["figures"]["outside_share"] > 0.15
    assert abs(report["stall_fraction"] - measured["stall"]) < 0.05
