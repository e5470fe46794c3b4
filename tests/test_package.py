"""The package as installed: typed, and the wheel carries what it needs (the public API is tests/test_api.py)."""

from __future__ import annotations


def test_package_is_typed() -> None:
    from importlib.resources import files

    assert files("pipeline").joinpath("py.typed").is_file()


def test_wheel_carries_the_region_decoder_source(tmp_path) -> None:
    # A non-editable install (the Docker image, `pip install .`) compiles the
    # region decoder from the installed package: its C source must ship.
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    import pytest

    pytest.importorskip("setuptools")  # the build backend, used without isolation (no network)
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(root), "-w", str(tmp_path)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("gpufeed-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"pipeline/native/jpegregion.c", "pipeline/native/resample.c", "pipeline/native/__init__.py", "pipeline/py.typed"} <= names
