"""Compiling the native library, for both ways it reaches a user.

`pip install` (and `pip wheel`) builds it as the optional extension module
`pipeline.native._libgpufeed` (setup.py takes `extension()` and
`build_ext_command()` from here); a checkout where that did not happen
builds it on first use into the user cache (`build_cached`). Both run the
same `compile_command`, so the installed library and the fallback are the
same machine code: `-O3` and nothing else of Python's own CFLAGS (`-fwrapv`,
a distribution's hardening flags), and no `-m` flags, because resample.c and
colour.c pick their AVX2 (and AVX-512) kernels at run time. `-ffp-contract=off`:
no multiply and add fused where a kernel's target allows FMA (AVX-512 does),
so every kernel rounds as the scalar loop it must equal.

This module imports nothing but the standard library (setuptools only inside
the two functions setup.py calls), so setup.py loads it by path, without
importing gpufeed.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCES = tuple(HERE / name for name in ("jpegregion.c", "resample.c", "ycc.c", "colour.c"))
HEADERS = (HERE / "gpufeed.h", HERE / "jpegcommon.h")
MODULE_SOURCE = HERE / "_libgpufeed.c"  # the extension module's shell (PyInit_, the source digest)
EXTENSION = "pipeline.native._libgpufeed"
CFLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")
LIBRARIES = ("-ljpeg", "-lm")
BUILD_TIMEOUT_S = 120


class BuildError(RuntimeError):
    """The library cannot be compiled here: no compiler, or a missing header or library."""


def source_digest() -> str:
    """The digest of the C sources, headers and flags: names the cached build, and is baked into the installed one."""
    flags = " ".join(CFLAGS).encode()
    return hashlib.sha256(flags + b"".join(path.read_bytes() for path in SOURCES + HEADERS)).hexdigest()[:16]


def compiler() -> list[str]:
    """The compiler command: $CC (which may carry flags, e.g. "gcc -march=native"), else `cc`."""
    return (os.environ.get("CC") or "cc").split()


def compile_command(output: Path, *, module: bool = False, include_dirs: Sequence[str] = ()) -> list[str]:
    """The one command that compiles the library into `output`.

    Args:
        output: the shared library to write.
        module: also compile the extension module's shell (needs Python's
            headers in `include_dirs`) with the source digest baked in.
        include_dirs: extra header directories.

    Returns:
        The command line, for `subprocess.run`.
    """
    sources = [*SOURCES, MODULE_SOURCE] if module else list(SOURCES)
    defines = [f'-DGF_SOURCE_DIGEST="{source_digest()}"'] if module else []
    includes = [f"-I{directory}" for directory in include_dirs]
    return [*compiler(), *CFLAGS, *includes, *defines, "-o", str(output), *map(str, sources), *LIBRARIES]


def compile_library(output: Path, *, module: bool = False, include_dirs: Sequence[str] = ()) -> None:
    """Compile the library into `output`, atomically: written under a temporary name, then renamed.

    Args:
        output: the shared library to write; its folder is created.
        module: build the extension module (see `compile_command`).
        include_dirs: extra header directories.

    Raises:
        BuildError: no compiler, or the compiler failed (its last line, with a
            hint when a header is missing).
    """
    command = compiler()
    if shutil.which(command[0]) is None:
        raise BuildError(f"no C compiler ({command[0]}) to build the region JPEG decoder")
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=output.name, suffix=".part", dir=output.parent)
    os.close(fd)
    try:
        try:
            result = subprocess.run(
                compile_command(Path(partial), module=module, include_dirs=include_dirs),
                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BuildError(f"cannot build the region JPEG decoder: {exc}") from exc
        if result.returncode != 0:
            raise BuildError(f"cannot build the region JPEG decoder{_hint(result.stderr)}: {_last_line(result)}")
        os.replace(partial, output)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _hint(stderr: str) -> str:
    if "jpeglib.h" in stderr:
        return " (install libjpeg62-turbo-dev or libjpeg-turbo8-dev)"
    if "Python.h" in stderr:
        return " (install Python's headers, e.g. python3-dev)"
    return ""


def _last_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {result.returncode}"


def cache_root() -> Path:
    """gpufeed's user cache: $GPUFEED_CACHE, else $XDG_CACHE_HOME/gpufeed, else ~/.cache/gpufeed."""
    root = os.environ.get("GPUFEED_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "gpufeed"
    )
    return Path(root)


def cache_dir() -> Path:
    """Where first-use builds go: native/ in `cache_root()`."""
    return cache_root() / "native"


def build_cached() -> Path:
    """The first-use build: the library for these sources in the user cache, compiled once.

    The file's name holds the machine and the source digest, so each source
    version is built once, and concurrent first uses do not clash (each
    compiles under its own temporary name; the renames are atomic).

    Returns:
        The library's path.

    Raises:
        BuildError: it is not built yet and cannot be built here.
    """
    target = cache_dir() / f"jpegregion-{platform.machine() or 'cpu'}-{source_digest()}.so"
    if not target.exists():
        compile_library(target)
    return target


def extension() -> Any:
    """The setuptools extension that `pip install` builds (optional: a failure leaves gpufeed installable).

    Returns:
        A `setuptools.Extension`, its paths relative to the project root, as setup.py needs them.
    """
    from setuptools import Extension  # type: ignore[import-untyped,unused-ignore]

    def relative(path: Path) -> str:
        return path.relative_to(HERE.parents[1]).as_posix()

    return Extension(
        EXTENSION,
        sources=[relative(path) for path in (*SOURCES, MODULE_SOURCE)],
        depends=[relative(path) for path in HEADERS],
        optional=True,
    )


def build_ext_command() -> type:
    """setuptools' `build_ext` that compiles the extension with `compile_command`, and warns instead of failing.

    Returns:
        The command class, for setup.py's `cmdclass={"build_ext": ...}`.
    """
    from setuptools.command.build_ext import build_ext  # type: ignore[import-untyped,unused-ignore]

    class BuildNative(build_ext):  # type: ignore[misc,unused-ignore]  # where setuptools is untyped
        def build_extension(self, ext: Any) -> None:
            if ext.name != EXTENSION:
                super().build_extension(ext)
                return
            try:
                compile_library(Path(self.get_ext_fullpath(ext.name)), module=True, include_dirs=self.include_dirs)
            except BuildError as exc:
                self.warn(
                    f"{exc}; gpufeed installs without its native library (a source checkout builds it on first use)"
                )

    return BuildNative
