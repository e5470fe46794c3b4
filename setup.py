"""The native library as an optional extension module; the project's metadata is in pyproject.toml."""

import importlib.util
from pathlib import Path

from setuptools import setup  # type: ignore[import-untyped,unused-ignore]

# build.py by path: importing the pipeline package would need its dependencies, absent while building.
_spec = importlib.util.spec_from_file_location(
    "_gpufeed_build", Path(__file__).parent / "pipeline" / "native" / "build.py"
)
assert _spec is not None and _spec.loader is not None
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

setup(ext_modules=[build.extension()], cmdclass={"build_ext": build.build_ext_command()})
