"""The native code, called through ctypes: the loader's region JPEG decoder
(`jpegregion.c`, `resample.c`), prepare's YCbCr JPEG path (`ycc.c`) and the
augmentation's HSV gains (`colour.c`).

`pip install` builds it as the optional extension module
`pipeline.native._libgpufeed` (build.py), which needs a C compiler and
libjpeg-turbo's headers (`libjpeg62-turbo-dev` or `libjpeg-turbo8-dev`) at
install time only; a wheel carries it built. `library()` loads, in order:

1. nothing when GPUFEED_NO_NATIVE is set;
2. the installed extension, unless it was built from other sources (an
   editable checkout keeps an in-place build from before a C change);
3. in a source checkout only, the first-use build into the user cache
   ($GPUFEED_CACHE, else $XDG_CACHE_HOME/gpufeed, else ~/.cache/gpufeed).

Without it the loader decodes whole images with simplejpeg or Pillow and
prepare takes its RGB path (Pillow decodes, resizes and encodes); the first
caller that wants the library logs one warning saying so, and `gpufeed
doctor` (which calls `library_info()`) reports where the library came from.

    __init__.py    library() and library_info(): which build is loaded, and from where
    build.py       compiling it: the setuptools extension and the first-use build
    bindings.py    ctypes signatures of every exported function
    gpufeed.h      the exported prototypes, the one place the C and Python sides agree on
    _libgpufeed.c  the extension module's shell; it records the digest of the sources it was built from
    jpegcommon.h   libjpeg-turbo error handling shared by the decoders
    jpegregion.c   decode only the region of a JPEG a crop reads, at the DCT scale it needs
    resample.c     the resampling filters into a batch slot
    ycc.c          prepare's JPEG-to-JPEG resize in YCbCr, without RGB
    colour.c       ultralytics' HSV gains on a planar uint8 image, in OpenCV's 8-bit arithmetic
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from . import bindings, build
from .bindings import (
    OUT_OF_MEMORY,
    OVER_LIMITS,
    PILLOW,
    PILLOW_SIMD,
    UNSUPPORTED,
    RegionDecoder,
    RegionError,
    RegionUnsupported,
    channel_strides,
)

__all__ = [
    "DISABLED",
    "MISSING_COST",
    "MISSING_FIX",
    "OUT_OF_MEMORY",
    "OVER_LIMITS",
    "PILLOW",
    "PILLOW_SIMD",
    "UNSUPPORTED",
    "LibraryInfo",
    "RegionDecoder",
    "RegionError",
    "RegionUnsupported",
    "channel_strides",
    "installed_library",
    "jpeg_warnings",
    "library",
    "library_info",
    "problem",
]

log = logging.getLogger("gpufeed.native")

DISABLED = "disabled by GPUFEED_NO_NATIVE"
# What a missing library costs (measured) and how to get it: the warning below and `gpufeed doctor` say both.
MISSING_COST = (
    "the loader decodes whole images with simplejpeg or Pillow instead of only each crop's region with a C "
    "resize (up to 2x slower), and prepare takes its RGB path (about 20% slower per image)"
)
MISSING_FIX = (
    "install a C compiler and libjpeg-turbo's headers (e.g. apt-get install gcc libjpeg62-turbo-dev), "
    "then reinstall gpufeed"
)


@dataclass(frozen=True)
class LibraryInfo:
    """Which native library this process uses.

    Attributes:
        origin: "extension" (built by `pip install`), "cache" (built on first
            use), or None when there is none.
        path: the loaded file, or None.
        problem: why there is none (None when loaded).
    """

    origin: str | None
    path: Path | None
    problem: str | None

    @property
    def summary(self) -> str:
        """One line: "installed extension at PATH", "built on first use at PATH" or "missing: REASON"."""
        if self.origin == "extension":
            return f"installed extension at {self.path}"
        if self.origin == "cache":
            return f"built on first use at {self.path}"
        return f"missing: {self.problem}"


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_info: LibraryInfo | None = None
_warned = False


def library(*, warn: bool = True) -> ctypes.CDLL | None:
    """The loaded native library, or None when there is none here (see `problem()`).

    Args:
        warn: log the one warning of this process that the library is
            missing (never when GPUFEED_NO_NATIVE turned it off).

    Returns:
        The library, with its functions' signatures declared (bindings.py).
    """
    global _warned
    if _library is not None:  # the common case, once per image on some paths: no lock, no lookup
        return _library
    info = library_info()
    if info.origin is None and warn and info.problem != DISABLED and not _warned:
        with _lock:
            if _warned:
                return _library
            _warned = True
        log.warning(
            "gpufeed's native library is missing (%s): %s. To fix it, %s; `gpufeed doctor` shows the details, "
            "and GPUFEED_NO_NATIVE=1 turns the library off without this warning.",
            info.problem, MISSING_COST, MISSING_FIX,
        )  # fmt: skip
    return _library


def jpeg_warnings(data: bytes) -> list[str] | None:
    """libjpeg's warnings for a whole JPEG (see `bindings.jpeg_warnings`), or None without the library.

    Args:
        data: the whole file.

    Returns:
        Every distinct warning in the order met ([] for none), or None when
        there is no library here or libjpeg fails on the data.
    """
    lib = library(warn=False)  # an extra for a rare file: no warning about a missing library for it
    return None if lib is None else bindings.jpeg_warnings(lib, data)


def problem() -> str | None:
    """Why there is no native library (None when it is loaded)."""
    return library_info().problem


def library_info() -> LibraryInfo:
    """Where this process's native library comes from, loading it on the first call (without warning).

    Returns:
        Its origin and path, or why there is none.
    """
    global _library, _info
    if _info is None:
        with _lock:
            if _info is None:
                _library, _info = _find()
    return _info


def installed_library() -> Path | None:
    """The file of the extension module `pip install` built (in place, for an editable checkout), if any."""
    name = build.EXTENSION.rsplit(".", 1)[-1]
    candidates = (Path(__file__).resolve().parent / f"{name}{suffix}" for suffix in EXTENSION_SUFFIXES)
    return next((path for path in candidates if path.is_file()), None)


def _find() -> tuple[ctypes.CDLL | None, LibraryInfo]:
    if os.environ.get("GPUFEED_NO_NATIVE"):
        return None, LibraryInfo(None, None, DISABLED)
    reasons: list[str] = []
    path = installed_library()
    if path is not None:
        try:
            lib = bindings.load(path)
        except OSError as exc:
            reasons.append(f"the installed library does not load ({exc})")
        else:
            digest = _source_digest()
            if digest is None or bindings.built_from(lib) == digest:
                return lib, LibraryInfo("extension", path, None)
            reasons.append(f"the installed library {path.name} was built from other sources")
    if not _source_checkout():  # an installed gpufeed compiles nothing at run time
        reasons = reasons or ["not built when gpufeed was installed: no C compiler or no libjpeg headers then"]
        return None, LibraryInfo(None, None, "; ".join(reasons))
    try:
        path = build.build_cached()
        return bindings.load(path), LibraryInfo("cache", path, None)
    except (OSError, build.BuildError) as exc:
        return None, LibraryInfo(None, None, "; ".join([*reasons, str(exc)]))


def _source_digest() -> str | None:
    """The digest of the C sources beside this file (None where an install left them out: nothing to compare)."""
    try:
        return build.source_digest()
    except OSError:
        return None


def _source_checkout() -> bool:
    """Whether this package runs from a source tree (an editable install, a checkout on the path), not an install."""
    root = Path(__file__).resolve().parents[2]
    return (root / "setup.py").is_file() and (root / "pyproject.toml").is_file()
