"""The package as installed: typed, and the wheel carries what it needs (the public API is tests/test_api.py)."""

from __future__ import annotations


def test_package_is_typed() -> None:
    from importlib.resources import files

    assert files("pipeline").joinpath("py.typed").is_file()


def test_wheel_carries_the_native_sources(tmp_path) -> None:
    # An installed gpufeed checks its compiled library against the C sources
    # beside it (pipeline/native/__init__.py), and setup.py builds from them:
    # every one must ship. tests/test_install.py checks the compiled library.
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
    native = ("__init__.py", "bindings.py", "build.py", "gpufeed.h", "jpegcommon.h", "_libgpufeed.c", "jpegregion.c")
    assert {f"pipeline/native/{name}" for name in (*native, "resample.c", "ycc.c")} | {"pipeline/py.typed"} <= names
