"""`gpufeed watch`'s channel from the watched command is untrusted: garbage records are dropped and counted.

A real child process writes into the recorder's folder what a hostile or broken command could:
the watch runs to the end with the child's exit code and a report, in bounded time and memory.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.measure.watching.records import MAX_LINE_BYTES, READ_WINDOW, RecorderFiles

# Written by the watched child into $GPUFEED_WATCH_DIR, as the recorder would (one JSON line per flush).
GARBAGE_CHILD = """
import json, os, sys, time
folder = os.environ["GPUFEED_WATCH_DIR"]
pid = os.getpid()
good = {"pid": pid, "ppid": os.getppid(), "rank": None, "worker": False,
        "torch": {"batches": 10, "samples": 40, "wait_s": 0.5, "step_s": 1.5, "first_s": 0.1,
                  "iterations": 1, "num_workers": 0},
        "gpufeed": {}, "fetch": {"batches": 10, "seconds": 0.4, "cpu_s": 0.3, "runq_s": 0.0}}
bad = [
    [1, 2, 3],                                   # a list where an object is expected
    {"pid": "x"},                                # a pid of another type
    {**good, "torch": [1]},                      # a part of another type
    {**good, "torch": {"batches": "10"}},        # a counter of another type
    {**good, "torch": {"batches": -5}},          # a negative counter
    {**good, "torch": {"batches": 10 ** 400}},   # a counter past any count
    {**good, "fetch": {"seconds": float("nan")}},
    {**good, "fetch": {"seconds": float("inf")}},
    {**good, "worker": "yes"},
    {**good, "pid": pid + 1},                    # another process's record in this one's file
]
with open(os.path.join(folder, f"{pid}.jsonl"), "w") as out:
    out.write(json.dumps(good) + "\\n")
    for record in bad:
        out.write(json.dumps(record) + "\\n")
    out.write("{not json\\n")
    out.write("[" * 200000 + "\\n")                       # nesting deeper than the parser's stack
    out.write('{"pid": %d, "argv": "%s"}\\n' % (pid, "x" * (2 * MAX_LINE)))  # a huge string
    out.flush()
    time.sleep(0.5)                                       # sampled meanwhile
    out.write("y" * (3 * WINDOW) + "\\n")                 # one line longer than a read
    out.write(json.dumps(good) + "\\n")
    out.write("[1, 2]\\n")                                # the newest line is garbage too
os.mkfifo(os.path.join(folder, "1.jsonl"))                # opened, it would wait for a writer for ever
os.symlink("/dev/zero", os.path.join(folder, "2.jsonl"))  # endless bytes
with open(os.path.join(folder, "notes.txt"), "w") as other:
    other.write("not a record file")
time.sleep(0.5)
sys.exit(7)
"""


def _limited_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.mark.timeout(60)
def test_garbage_records_from_the_command_are_dropped_counted_and_the_watch_goes_on(tmp_path: Path) -> None:
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(GARBAGE_CHILD).replace("MAX_LINE", str(MAX_LINE_BYTES)).replace("WINDOW", str(READ_WINDOW)))
    report_path = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "watch", "--interval", "0.2", "--json", str(report_path), "--", sys.executable, str(child)],
        capture_output=True, text=True, timeout=30, cwd=tmp_path, preexec_fn=_limited_memory,
    )  # fmt: skip
    assert result.returncode == 7, result.stderr  # the command's own exit code
    assert "Traceback" not in result.stderr, result.stderr
    report = json.loads(report_path.read_text())
    # 10 bad records, invalid JSON, deep nesting, a huge string, "[1, 2]", a FIFO, a link and a file that is
    # no process's: each dropped and counted (the line longer than a read is skipped with the older lines,
    # or dropped when a read catches it half written)
    assert report["records_dropped"] >= 17, result.stderr
    assert f"{report['records_dropped']} records from the command were not valid records" in result.stderr
    (loop,) = report["loops"]  # the valid records still count
    assert loop["batches"] == 10 and loop["fetch_batches"] == 10


def test_a_flood_of_records_is_read_in_bounded_windows(tmp_path: Path) -> None:
    good = {"pid": 42, "torch": {"batches": 1, "wait_s": 0.1}}
    path = tmp_path / "42.jsonl"
    with path.open("w") as out:
        for batches in range(1, 200_001):  # about 10 MB of records
            out.write(json.dumps({**good, "torch": {"batches": batches, "wait_s": 0.1}}) + "\n")
    files = RecorderFiles(str(tmp_path))
    last = files.read()
    assert last[42]["torch"]["batches"] == 200_000  # the newest totals, read from the last window only
    assert files.files["42.jsonl"].offset == path.stat().st_size
    assert files.dropped == 0
