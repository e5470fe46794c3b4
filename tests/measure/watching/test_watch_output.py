"""What `gpufeed watch` shows: live lines on a terminal beside a progress bar, and the --plot panels."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.measure.watching.run import Verdict, WatchReport, WatchSample

PROGRESS_BAR = """
import sys, time
for step in range(12):  # a bar redrawn in place, as tqdm and Lightning do: a carriage return, no newline
    sys.stderr.write(f"\\rprogress {step}/12 [####      ]")
    sys.stderr.flush()
    time.sleep(0.1)
sys.stderr.write("\\n")
"""


def _rows(output: bytes) -> list[str]:
    """The terminal's rows once `output` is drawn: a carriage return goes back to the row's start, erase-line
    clears the rest of it."""
    rows = []
    for raw in output.replace(b"\r\n", b"\n").split(b"\n"):
        row: list[str] = []
        column = 0
        text = raw.decode(errors="replace")
        index = 0
        while index < len(text):
            if text.startswith("\x1b[K", index):
                del row[column:]
                index += 3
                continue
            char = text[index]
            if char == "\r":
                column = 0
            else:
                row[column:column + 1] = [char]
                column += 1
            index += 1
        rows.append("".join(row))
    return rows


@pytest.mark.timeout(60)
def test_live_lines_on_a_terminal_are_not_glued_to_a_progress_bar(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(PROGRESS_BAR)
    main, secondary = pty.openpty()
    try:
        watched = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "watch", "--interval", "0.2", "--", sys.executable, str(script)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=secondary, cwd=tmp_path,
        )  # fmt: skip
        os.close(secondary)
        output = b""
        deadline = time.monotonic() + 50
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the terminal's other end closed: watch ended
                    break
                if not chunk:
                    break
                output += chunk
            elif watched.poll() is not None:
                break
        assert watched.wait(timeout=10) == 0, output
    finally:
        os.close(main)
    rows = _rows(output)
    live = [row for row in rows if row.startswith("watch ")]
    assert len(live) >= 3, rows
    assert not [row for row in rows if "progress" in row and "watch " in row], rows  # never on one row
    assert all(len(row) <= 100 for row in live)


def test_plain_output_has_no_terminal_controls(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import time\ntime.sleep(0.5)\n")
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "watch", "--interval", "0.1", "--", sys.executable, str(script)],
        capture_output=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0 and b"watch " in result.stderr, result.stderr
    assert b"\r" not in result.stderr and b"\x1b" not in result.stderr


def test_the_plot_shows_the_disk_and_the_whole_machines_cpu(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plots extra brings matplotlib")
    from pipeline.measure import plots

    samples = [
        WatchSample(float(t), 0.5, 3.0, 96.0, None, None, 1.5 + 0.05 * t, 0.3, 0.4, 20.0 * t, 100.0,
                    device="sda", device_busy=0.08 * t)  # fmt: skip
        for t in range(1, 9)
    ]
    report = WatchReport(["python", "train.py"], 0, 8.0, 2, [], [], "", 0, 80.0, None, "", samples,
                         Verdict("data-bound", "disk", [], "", None, []))  # fmt: skip
    figure = plots.watch_figure(report)
    labels = {line.get_label(): list(line.get_ydata()) for axes in figure.axes for line in axes.lines}
    assert labels["whole machine (cores)"] == [s.cores_busy for s in samples]
    assert labels["storage reads (MB/s)"] == [s.read_mb_s for s in samples]
    assert labels["sda busy (%)"] == pytest.approx([100 * s.device_busy for s in samples])
    units = {axes.get_ylabel() for axes in figure.axes}
    assert {"reads (MB/s)", "disk busy (%)", "CPU cores busy"} <= units
    path = Path(plots.plot_watch(report, tmp_path / "watch.png"))
    assert path.read_bytes().startswith(b"\x89PNG")
