"""pipeline/native: which library loads (installed extension, first-use build, none), and the one warning.

Each test runs a copy of the package in a fresh process, since what `library()`
finds is decided once per process. The copy sits under an empty `pipeline`
package: pipeline.native imports nothing else of gpufeed.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline import native

NATIVE = Path(native.__file__).resolve().parent
needs_compiler = pytest.mark.skipif(
    native.library() is None or shutil.which(native.build.compiler()[0]) is None,
    reason=f"no C compiler or libjpeg headers here: {native.problem()}",
)

WARNING = "gpufeed's native library is missing"


def make_tree(root: Path, *, checkout: bool) -> Path:
    """pipeline/native's files under an empty `pipeline` package; a source checkout has setup.py beside it."""
    package = root / "pipeline" / "native"
    package.mkdir(parents=True)
    (root / "pipeline" / "__init__.py").write_text("")
    for name in ("__init__.py", "bindings.py", "build.py", *(p.name for p in NATIVE.glob("*.[ch]"))):
        shutil.copy(NATIVE / name, package / name)
    if checkout:
        (root / "pyproject.toml").write_text("")
        (root / "setup.py").write_text("")
    return root


def run(root: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "GPUFEED_NO_NATIVE"}
    environment.update(PYTHONPATH=str(root), **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=root, capture_output=True, text=True, env=environment, timeout=300, check=False,
    )  # fmt: skip


def build_in_place(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """What `pip install -e .` runs for the extension: build.py's build_ext, in place."""
    code = """
        from setuptools import Distribution
        from pipeline.native import build

        dist = Distribution({"name": "gpufeed", "ext_modules": [build.extension()],
                             "cmdclass": {"build_ext": build.build_ext_command()}})
        command = dist.get_command_obj("build_ext")
        command.inplace = True
        dist.run_command("build_ext")
    """
    return run(root, code, **env)


SUMMARY = """
    from pipeline import native
    lib = native.library()
    print(native.library_info().summary)
    if lib is not None:
        native.RegionDecoder(lib).header(bytes.fromhex("{jpeg}"))
"""


def tiny_jpeg() -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (24, 16), (10, 200, 30)).save(out, "JPEG")
    return out.getvalue().hex()


@needs_compiler
def test_the_installed_extension_loads_first_and_not_once_its_sources_change(tmp_path: Path):
    pytest.importorskip("setuptools")
    root = make_tree(tmp_path / "src", checkout=True)
    built = build_in_place(root)
    assert built.returncode == 0, built.stderr
    (extension,) = (root / "pipeline" / "native").glob("_libgpufeed*.so")
    cache = tmp_path / "cache"
    code = SUMMARY.format(jpeg=tiny_jpeg())

    first = run(root, code, GPUFEED_CACHE=str(cache))
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == f"installed extension at {extension}"
    assert not cache.exists()  # nothing compiled at run time

    with (root / "pipeline" / "native" / "ycc.c").open("a") as source:
        source.write("/* a change after the in-place build */\n")
    stale = run(root, code, GPUFEED_CACHE=str(cache))
    assert stale.returncode == 0, stale.stderr
    assert stale.stdout.strip().startswith(f"built on first use at {cache / 'native'}")
    assert WARNING not in stale.stderr


def test_a_failed_extension_build_leaves_the_install_going(tmp_path: Path):
    pytest.importorskip("setuptools")
    root = make_tree(tmp_path / "src", checkout=True)
    built = build_in_place(root, CC="false")
    assert built.returncode == 0, built.stderr
    assert "installs without its native library" in built.stderr
    package = root / "pipeline" / "native"
    assert not list(package.glob("*.so")) and not list(package.glob("*.part"))  # nothing half-built left


def test_a_missing_library_warns_once_with_the_cost_and_the_fix(tmp_path: Path):
    root = make_tree(tmp_path / "src", checkout=True)
    code = """
        from pipeline import native
        for _ in range(3):
            assert native.library() is None
        print(native.problem())
    """
    result = run(root, code, GPUFEED_CACHE=str(tmp_path / "cache"), CC="/nonexistent/cc")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no C compiler (/nonexistent/cc) to build the region JPEG decoder"
    assert result.stderr.count(WARNING) == 1
    (line,) = [line for line in result.stderr.splitlines() if WARNING in line]
    for said in ("no C compiler", "whole images", "up to 2x slower", "RGB path", "20% slower", "apt-get install gcc"):
        assert said in line


def test_asking_quietly_then_loading_warns_once(tmp_path: Path):
    root = make_tree(tmp_path / "src", checkout=True)
    code = """
        from pipeline import native
        assert native.library(warn=False) is None and native.library_info().origin is None
        print("quiet")
        native.library()
        native.library()
    """
    result = run(root, code, GPUFEED_CACHE=str(tmp_path / "cache"), CC="/nonexistent/cc")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "quiet"
    assert result.stderr.count(WARNING) == 1


def test_turned_off_on_purpose_is_silent(tmp_path: Path):
    root = make_tree(tmp_path / "src", checkout=True)
    code = """
        from pipeline import native
        assert native.library() is None
        print(native.library_info().summary)
    """
    result = run(root, code, GPUFEED_NO_NATIVE="1", GPUFEED_CACHE=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "missing: disabled by GPUFEED_NO_NATIVE"
    assert result.stderr == ""
    assert not (tmp_path / "cache").exists()


def test_an_install_without_the_extension_compiles_nothing_at_run_time(tmp_path: Path):
    root = make_tree(tmp_path / "site", checkout=False)
    called = tmp_path / "compiler-called"
    compiler = tmp_path / "cc"
    compiler.write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    compiler.chmod(0o755)
    code = """
        from pipeline import native
        assert native.library() is None
        print(native.library_info().summary)
    """
    result = run(root, code, GPUFEED_CACHE=str(tmp_path / "cache"), CC=str(compiler))
    assert result.returncode == 0, result.stderr
    said = "missing: not built when gpufeed was installed: no C compiler or no libjpeg headers then"
    assert result.stdout.strip() == said
    assert not called.exists()
    assert result.stderr.count(WARNING) == 1 and "reinstall gpufeed" in result.stderr
