"""scripts/setup.sh says what it is doing during its long steps (pip installs, the Pillow-SIMD build).

The script, sourced, only defines its functions; these tests run its `progress` function on
a fake slow step with a short interval, so they take a few seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "scripts" / "setup.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")


def _source_and_run(script: str, tmp_path: Path, interval: str) -> subprocess.Popen[str]:
    env = {**os.environ, "GPUFEED_SETUP_PROGRESS_S": interval}
    return subprocess.Popen(
        ["bash", "-c", f"source {SETUP}; {script}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_a_long_step_prints_the_time_so_far_and_its_last_log_line_at_every_interval(tmp_path: Path) -> None:
    # A step of about 4 s that writes a line every 0.3 s, as a compiler does; ticks every second.
    step = 'for i in $(seq 1 13); do echo "gcc -c src/file$i.c"; sleep 0.3; done'
    script = f"progress 'building the fake wheel' {tmp_path}/build.log bash -c '{step}'; echo exit=$?"
    process = _source_and_run(script, tmp_path, "1")
    assert process.stdout is not None
    lines: list[tuple[float, str]] = []
    for line in process.stdout:
        lines.append((time.monotonic(), line.rstrip("\n")))
    assert process.wait(timeout=60) == 0
    texts = [text for _, text in lines]
    assert texts[0] == "setup: building the fake wheel"
    assert texts[-1] == "exit=0"
    assert re.fullmatch(r"setup:   done in \d+ s", texts[-2])
    ticks = [text for text in texts if text.startswith("setup:   ... building the fake wheel: ")]
    assert len(ticks) >= 2, texts
    for tick in ticks:
        assert re.fullmatch(r"setup:   \.\.\. building the fake wheel: \d+ s: gcc -c src/file\d+\.c", tick), tick
    # Never silent for longer than the 10 s the script promises (here it ticks every second).
    times = [at for at, _ in lines]
    assert max(later - earlier for earlier, later in zip(times, times[1:])) <= 10
    assert (tmp_path / "build.log").read_text().splitlines()[-1] == "gcc -c src/file13.c"


def test_a_failing_step_returns_its_status_and_shows_the_end_of_its_log(tmp_path: Path) -> None:
    script = f"progress 'installing x' {tmp_path}/x.log bash -c 'echo resolving; echo ERROR: no such package; exit 3' || echo exit=$?"
    result = _source_and_run(script, tmp_path, "1")
    stdout, _ = result.communicate(timeout=60)
    lines = stdout.splitlines()
    assert f"setup: installing x failed after 0 s (exit status 3); the end of {tmp_path}/x.log:" in lines
    assert lines[-3:] == ["resolving", "ERROR: no such package", "exit=3"]


def test_the_ticker_stops_with_the_step(tmp_path: Path) -> None:
    # Nothing keeps printing once the step is over: the output ends with the step's own lines.
    script = f"progress 'quick' {tmp_path}/q.log true; sleep 1.5; echo end"
    stdout, _ = _source_and_run(script, tmp_path, "0.5").communicate(timeout=60)
    assert stdout.splitlines() == ["setup: quick", "setup:   done in 0 s", "end"]


def test_every_long_step_of_setup_and_the_demo_goes_through_progress_which_ticks_within_10_s() -> None:
    text = SETUP.read_text()
    # The interval, with room for the time a tick itself takes: never more than 10 s between lines.
    (default,) = re.findall(r'^PROGRESS_S="\$\{GPUFEED_SETUP_PROGRESS_S:-([0-9.]+)\}"$', text, flags=re.M)
    assert float(default) <= 8
    # Every pip install, wheel build and apt-get run in the script is a `progress` (or `pip_install`) call.
    joined = text.replace("\\\n", " ")  # continuation lines: one command per line
    long_step = r"\b(pip (install|wheel)|apt-get (install|update)) "
    # The commands, not the messages that name them: comments and quoted strings left out.
    code = [re.sub(r'"(\\.|[^"\\])*"', '""', line).strip() for line in joined.splitlines()]
    commands = [line for line in code if re.search(long_step, line) and not line.startswith("#")]
    assert len(commands) >= 5, commands  # pip_install's own pip install, three apt-get runs, the wheel build
    unwrapped = [line for line in commands if not re.search(r"(^|\s)(progress|pip_install) ", line)]
    assert unwrapped == [], unwrapped
    # torch, gpufeed, the Pillow-SIMD wheel and the Pillow fallback all install through pip_install.
    assert len(re.findall(r"^\s*pip_install ", text, flags=re.M)) >= 4
    assert "-qq -e" not in text
    # The demo's one silent command (gpufeed demo-data prints only when done) ticks the same way.
    demo = (REPO / "scripts" / "demo.sh").read_text()
    assert "source scripts/setup.sh" in demo
    assert re.search(r"^progress .* gpufeed demo-data demo/raw -n 300$", demo, flags=re.M) and 'pip install -qq "torch' not in text
