"""`gpufeed watch`: is a training run waiting for data, and on what (SPEC §3).

The watched command runs unchanged. The recorder in `hook/` (put first on its PYTHONPATH)
times every DataLoader and gpufeed Loader it iterates and each DataLoader fetch in the workers;
`sampler` samples the process tree, its reads and the GPUs every interval, and at the end
`verdict.judge` reasons the verdict from those figures (`report` holds them): data-bound
or compute-bound, the resource that limits the data, the next step and the speed-up the figures predict.
This module runs the command (or the block) under watch:

    run_watched(command) -> WatchReport   run a command under watch (signals and exit code pass through)
    watch()                               the same for code in this process: `with watch() as w: ...`

The report's classes and `judge` are importable from here as well.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ...errors import ConfigError
from .hook import ENV_DIR, HOOK_DIR
from .report import GpuFigures, LoopFigures, Verdict, WatchReport, WatchSample
from .sampler import Sampler
from .verdict import judge

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def hook_environment(directory: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a watched command: the hook first on PYTHONPATH, the records' folder named."""
    env = dict(os.environ if base is None else base)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = HOOK_DIR + (os.pathsep + rest if rest else "")
    env[ENV_DIR] = directory
    return env


def run_watched(
    command: Sequence[str],
    *,
    interval_s: float = 5.0,
    on_sample: Callable[[WatchSample], None] | None = None,
    disk_ceiling_mb_s: float | None = None,
    startup_s: float | None = None,
) -> WatchReport:
    """Run `command` under watch until it exits; signals sent to this process are passed to it.

    Args:
        command: the program and its arguments, run unchanged (own process group).
        interval_s: seconds between samples.
        on_sample: called with each interval's figures (the live line).
        disk_ceiling_mb_s: the read ceiling of the dataset's disk, if measured.
        startup_s: watch's own start-up before the command (reported as part of its cost).

    Returns:
        the report; its `exit_code` is the command's (128 + N when a signal N ended it).

    Raises:
        ConfigError: the command is empty or cannot be started.
    """
    if not command:
        raise ConfigError("give the command to watch after --, e.g. gpufeed watch -- python train.py")
    if interval_s <= 0:
        raise ConfigError(f"the interval must be positive, got {interval_s}")
    with tempfile.TemporaryDirectory(prefix="gpufeed-watch-") as directory:
        try:
            child = subprocess.Popen(list(command), env=hook_environment(directory), **_own_process_group())
        except OSError as exc:
            raise ConfigError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from exc
        with _forward_signals(child), _foreground_to(child):
            sampler = Sampler(child.pid, directory, command, disk_ceiling_mb_s, startup_s)
            while not _ended(child, interval_s):
                sample = sampler.sample()
                if on_sample is not None:
                    on_sample(sample)
            sampler.tree.sample()  # before it is reaped: its counters hold its workers' reads and CPU
            code = child.wait()
        return sampler.report(128 - code if code < 0 else code)


def _ended(child: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the command ended within `timeout_s`, left unreaped (its /proc figures stay readable) where
    the system allows."""
    if not hasattr(os, "waitid"):  # pragma: no cover - not Linux
        try:
            child.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:  # reaped already
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(0.05, remaining))


def _own_process_group() -> dict[str, Any]:
    # Its own process group, so a signal reaches it once: from us, to the whole group, as a terminal sends it.
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.10


@contextlib.contextmanager
def _foreground_to(child: subprocess.Popen[bytes]) -> Iterator[None]:
    """On a terminal, the command's group takes the foreground (it reads stdin, a debugger works, Ctrl-C goes to it
    straight), and it comes back to ours at the end, as a shell does for a job."""
    try:
        ours = os.getpgrp()
        handed = os.isatty(0) and os.tcgetpgrp(0) == ours
    except OSError:
        handed = False
    if handed:
        with _ttou_ignored(), contextlib.suppress(OSError):
            os.tcsetpgrp(0, child.pid)
    try:
        yield
    finally:
        if handed:
            with _ttou_ignored(), contextlib.suppress(OSError):
                os.tcsetpgrp(0, ours)


@contextlib.contextmanager
def _ttou_ignored() -> Iterator[None]:
    # A process not in the foreground group that sets the foreground group gets SIGTTOU, which would stop it.
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTTOU, previous)


@contextlib.contextmanager
def _forward_signals(child: subprocess.Popen[bytes]) -> Iterator[None]:
    """Ctrl-C and kill go to the watched command's process group (as the terminal would send them)."""

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _FORWARDED_SIGNALS:
            previous[signum] = signal.signal(signum, forward)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class Watch:
    """`with watch() as w:` — the loaders iterated inside are timed; `w.report()` after the block."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._report: WatchReport | None = None
        self._stop = threading.Event()

    def __enter__(self) -> Watch:
        from .hook import gpufeed_watch_hook as hook

        self._hook = hook
        self._dir = tempfile.TemporaryDirectory(prefix="gpufeed-watch-")
        hook.start(self._dir.name)
        self._sampler = Sampler(os.getpid(), self._dir.name, sys.argv)
        self._thread = threading.Thread(target=self._sample, name="gpufeed-watch", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            recorder = self._hook.active()
            if recorder is not None:
                recorder.flush()
            self._sampler.sample()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._hook.stop()
        self._report = self._sampler.report(None)
        self._dir.cleanup()

    def report(self) -> WatchReport:
        """The figures and the verdict of the block (after it ended)."""
        if self._report is None:
            raise RuntimeError("the report is ready once the `with watch()` block has ended")
        return self._report


def watch(interval_s: float = 1.0) -> Watch:
    """Watch the loaders this process iterates inside a `with` block.

    Example:
        with pipeline.measure.watch() as w:
            for images, labels in loader:
                ...
        print(w.report().verdict.bound)
    """
    return Watch(interval_s)


__all__ = [
    "GpuFigures", "LoopFigures", "Sampler", "Verdict", "Watch", "WatchReport", "WatchSample", "hook_environment",
    "judge", "run_watched", "watch",
]
