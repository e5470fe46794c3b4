"""Extra virtual environments some tests run code in: another PIL, another torch.

Each is built once into gpufeed's user cache, outside the checkout
($GPUFEED_CACHE, else $XDG_CACHE_HOME/gpufeed, else ~/.cache/gpufeed, under
test-venvs/), in a folder named by its pins, and rebuilt only when that folder
is absent: a fresh clone's CI builds it once, later runs find it. A build goes
into a temporary folder renamed when complete, so an interrupted build is never
taken for a finished one. A test skips, with the reason, only where the venv
cannot be built here (no pip, a package the registry does not have).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from pipeline.native.build import cache_root

BUILD_TIMEOUT_S = 900
VISION = ("torch==2.14.1", "torchvision==0.29.1", "ultralytics==8.4.190", "simplejpeg==1.9.0", "click==8.5.1",
          "rich==15.0.0")  # fmt: skip
"""The real torchvision (transforms.v2) and ultralytics, in one venv ("vision"): ultralytics needs that torch
anyway, and one 5.5 GB CUDA build of torch (which runs on the CPU) is enough. It brings OpenCV and plain Pillow.
With gpufeed's own dependencies too, gpufeed runs there from the checkout (PYTHONPATH), beside ultralytics."""


def venv_python(name: str, pins: Sequence[str]) -> Path:
    """The python of the cached venv `name` with exactly `pins` installed (built now when absent).

    Args:
        name: what the venv is for, in its folder's name.
        pins: pip requirement strings, installed in one `pip install`.

    Returns:
        Its interpreter.

    Raises:
        pytest.skip.Exception: the venv cannot be built here (the reason, and pip's last lines).
    """
    key = hashlib.sha256("\n".join([sys.version, *pins]).encode()).hexdigest()[:12]
    root = cache_root() / "test-venvs"
    target = root / f"{name}-{key}"
    python = target / "bin" / "python"
    if python.exists():
        return python
    root.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name, then renamed: only `python -m` is used, which a renamed venv still runs.
    partial = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        for step in ([sys.executable, "-m", "venv", "--clear", str(partial)],
                     [str(partial / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                      *pins]):  # fmt: skip
            failure = _run(step)
            if failure is not None:
                pytest.skip(f"cannot build the {name} venv ({' '.join(pins)}): {failure}")
        try:
            os.replace(partial, target)
        except OSError:  # another process published it first: use that one
            pass
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return python


def _run(command: list[str]) -> str | None:
    """None when `command` succeeds, else the last lines of what it said."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return None
    lines = [line for line in (done.stderr or done.stdout).splitlines() if not line.startswith("WARNING: Location")]
    return " / ".join(lines[-3:]) or f"exit status {done.returncode}"
