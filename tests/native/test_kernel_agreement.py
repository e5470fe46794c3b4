"""gpufeed's native resize kernels against the active PIL, on every resize path, with each PIL a user may have.

gpufeed always runs its fastest arithmetic, so its pixels do not depend on which
PIL is installed; what does is how far they sit from that PIL's own
`Image.resize`. The tolerance is stated in `pipeline.native.bindings`
(MIN_PSNR_DB per filter, BILINEAR_MAX_LEVELS); kernel_agreement.py measures it
here with this venv's PIL (Pillow-SIMD after setup) and in a cached venv with
plain Pillow, the one torchvision, ultralytics and timm install.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from extra_venvs import venv_python
from kernel_agreement import agreement

from pipeline import native
from pipeline.native.bindings import BILINEAR_MAX_LEVELS, MIN_PSNR_DB

needs_native = pytest.mark.skipif(native.library() is None, reason=f"native library unavailable: {native.problem()}")
ROOT = Path(__file__).resolve().parents[2]
PLAIN_PILLOW = ("pillow==13.0.0", f"numpy=={np.__version__}")


def within_tolerance(result: dict) -> list[str]:
    """Each path whose figures break the stated tolerance, with them."""
    broken = []
    for path, figures in result["paths"].items():
        resample = path[path.index("(") + 1 : path.index(")")]
        levels_ok = resample != "bilinear" or figures["max_levels"] <= BILINEAR_MAX_LEVELS
        if figures["psnr_db"] < MIN_PSNR_DB[resample] or not levels_ok:
            broken.append(f"{path}: {figures} (PIL: {result['pil']})")
    return broken


@needs_native
def test_every_resize_path_within_tolerance_of_this_venvs_pil():
    result = agreement()
    assert set(result["paths"]) == {"loader crop (bilinear)"} | {
        f"prepare {kind} ({name})" for kind in ("RGB", "YCbCr") for name in MIN_PSNR_DB
    }
    assert within_tolerance(result) == []
    # prepare's RGB path: Pillow-SIMD's own resize (the same arithmetic, its Lanczos a little faster), else ours
    assert result["prepare_resized_by"] in (("pil", "either") if result["pil"] == "Pillow-SIMD" else ("native",))
    if result["pil"] == "Pillow-SIMD":  # the same 16-bit arithmetic: the loader's crops are its pixels exactly
        assert result["paths"]["loader crop (bilinear)"] == {"max_levels": 0, "psnr_db": float("inf")}


@needs_native
def test_every_resize_path_within_tolerance_of_plain_pillow():
    python = venv_python("plain-pillow", PLAIN_PILLOW)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [str(python), str(ROOT / "tests" / "native" / "kernel_agreement.py")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["pil"] == "Pillow"
    assert within_tolerance(result) == []
    # Plain Pillow's 22-bit weights really round otherwise: the test compares two arithmetics, not one with itself.
    assert result["paths"]["loader crop (bilinear)"]["max_levels"] == 1
    assert result["prepare_resized_by"] == "native"  # never plain Pillow's slower resize


def test_the_tolerance_check_catches_a_path_out_of_it():
    result = {"pil": "Pillow", "paths": {"loader crop (bilinear)": {"max_levels": 2, "psnr_db": 55.0},
                                         "prepare RGB (lanczos)": {"max_levels": 60, "psnr_db": 39.0},
                                         "prepare RGB (bicubic)": {"max_levels": 60, "psnr_db": 41.0}}}  # fmt: skip
    broken = within_tolerance(result)
    assert len(broken) == 2 and broken[0].startswith("loader crop") and broken[1].startswith("prepare RGB (lanczos)")
