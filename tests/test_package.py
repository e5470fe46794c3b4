"""The package surface: cheap to import, one curated `__all__`."""

from __future__ import annotations

import json
import subprocess
import sys

import pipeline

# The public API. Adding a name is a decision: change it here and in pipeline/__init__.py together.
PUBLIC_API = [
    "AugmentSpec",
    "ConfigError",
    "DecodeError",
    "EncodeSpec",
    "GpufeedError",
    "JobConflictError",
    "LoaderSpec",
    "Manifest",
    "ManifestError",
    "PrepareResult",
    "PrepareSpec",
    "ResizeSpec",
    "SampleError",
    "ShardSpec",
    "SourceError",
    "StorageError",
    "VerifyResult",
    "estimate_memory",
    "make_loader",
    "prepare_dataset",
    "read_manifest",
    "verify_dataset",
]

HEAVY_MODULES = ("torch", "torchvision", "celery", "kombu")


def test_import_does_not_load_torch_or_celery() -> None:
    code = (
        "import json, sys, pipeline; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY_MODULES!r})))"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_all_is_exactly_the_curated_list() -> None:
    assert sorted(pipeline.__all__) == sorted(PUBLIC_API)
    assert len(set(pipeline.__all__)) == len(pipeline.__all__)


def test_every_public_name_resolves() -> None:
    for name in PUBLIC_API:
        value = getattr(pipeline, name)
        assert getattr(value, "__name__", name) == name, f"pipeline.{name} is {value!r}"


def test_errors_form_one_tree() -> None:
    errors = [getattr(pipeline, name) for name in PUBLIC_API if name.endswith("Error")]
    assert all(issubclass(error, pipeline.GpufeedError) for error in errors)
    assert issubclass(pipeline.DecodeError, pipeline.SampleError)


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
