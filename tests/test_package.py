"""The package as installed: typed, and the wheel carries what it needs (the public API is tests/test_api.py)."""

from __future__ import annotations


def test_package_is_typed() -> None:
    from importlib.resources import files

    assert files("pipeline").joinpath("py.typed").is_file()


def test_service_package_is_typed() -> None:
    from importlib.resources import files

    assert files("worker").joinpath("py.typed").is_file()


def test_license_and_extras_are_declared_as_users_install_them() -> None:
    import re
    from pathlib import Path

    import pytest

    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    # The SPDX form (setuptools >= 77), and the file it names: the Apache License 2.0 itself.
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (root / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text and "9. Accepting Warranty or Additional Liability." in text
    # s3:// paths need s3fs: its own extra, not only the test one.
    assert any(re.match(r"s3fs\b", need) for need in project["optional-dependencies"]["s3"])
    # The version comes from git tags, with a fallback for copies without them.
    assert "version" in project["dynamic"] and "version" not in project
    assert tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools_scm"]["fallback_version"]


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
    assert {f"pipeline/native/{name}" for name in (*native, "resample.c", "ycc.c")} | {"pipeline/py.typed", "worker/py.typed"} <= names
