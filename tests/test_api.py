"""The public API: one curated `__all__`, typed lazy exports, a cheap import, functions that take what the docs show."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import pipeline

# The public API. Adding a name is a decision: change it here and in pipeline/__init__.py together.
PUBLIC_API = [
    "AugmentSpec",
    "ConfigError",
    "DecodeError",
    "EncodeSpec",
    "GpufeedError",
    "HookError",
    "JobConflictError",
    "Loader",
    "LoaderSpec",
    "LoaderStats",
    "Manifest",
    "ManifestError",
    "NoImagesError",
    "PrepareResult",
    "PrepareSpec",
    "ReshardResult",
    "ReshardSpec",
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
    "reshard_dataset",
    "verify_dataset",
]

# Imported on first use: they need torch.
LAZY = {
    "Loader", "LoaderStats", "estimate_memory", "make_loader", "Manifest", "VerifyResult", "read_manifest", "verify_dataset",
    "PrepareResult", "prepare_dataset", "ReshardResult", "ReshardSpec", "reshard_dataset",
}

HEAVY_MODULES = ("torch", "torchvision", "celery", "kombu", "redis", "redbeat", "matplotlib")


def test_all_is_exactly_the_curated_list() -> None:
    assert pipeline.__all__ == PUBLIC_API
    assert pipeline.__all__ == sorted(pipeline.__all__)


def test_every_public_name_resolves() -> None:
    for name in PUBLIC_API:
        value = getattr(pipeline, name)
        assert getattr(value, "__name__", name) == name, f"pipeline.{name} is {value!r}"
        assert value.__module__.startswith("pipeline."), f"pipeline.{name} comes from {value.__module__}"


def test_lazy_names_are_the_library_objects() -> None:
    from pipeline.loader.loader import Loader, LoaderStats, make_loader
    from pipeline.measure.memory.estimate import estimate_memory

    assert pipeline.Loader is Loader
    assert pipeline.LoaderStats is LoaderStats
    assert pipeline.make_loader is make_loader
    assert pipeline.estimate_memory is estimate_memory
    from pipeline.manifest import Manifest, read_manifest
    from pipeline.prepare.job import prepare_dataset
    from pipeline.prepare.reshard import reshard_dataset

    assert pipeline.Manifest is Manifest and pipeline.read_manifest is read_manifest
    assert pipeline.prepare_dataset is prepare_dataset and pipeline.reshard_dataset is reshard_dataset


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="no attribute 'make_laoder'"):
        pipeline.make_laoder  # noqa: B018
    assert not hasattr(pipeline, "iter_tar_samples")


def test_dir_shows_the_lazy_names() -> None:
    listed = dir(pipeline)
    assert set(PUBLIC_API) <= set(listed)
    assert listed == sorted(listed)


def test_lazy_names_are_typed() -> None:
    # A type checker sees the lazy names through `if TYPE_CHECKING:` imports of the same objects.
    tree = ast.parse(pathlib.Path(pipeline.__file__).read_text(encoding="utf-8"))
    typed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            typed |= {alias.asname or alias.name for child in node.body if isinstance(child, ast.ImportFrom) for alias in child.names}
    assert typed == LAZY
    assert LAZY <= set(PUBLIC_API)


def test_errors_form_one_tree() -> None:
    errors = [getattr(pipeline, name) for name in PUBLIC_API if name.endswith("Error")]
    assert all(issubclass(error, pipeline.GpufeedError) for error in errors)
    assert issubclass(pipeline.DecodeError, pipeline.SampleError)


def test_import_does_not_load_torch_celery_or_matplotlib() -> None:
    code = (
        "import json, sys, pipeline; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY_MODULES!r})))"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_import_loads_numpy_only_when_a_name_needs_it() -> None:
    # `gpufeed watch` and `--help` start at once: NumPy and the prepare job come with the first name that needs them.
    code = "import sys, pipeline; print('numpy' in sys.modules); pipeline.read_manifest; print('numpy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


# ---------------------------------------------------------------------------
# read_manifest and verify_dataset take a path, a PathLike or a URL, as the docs show


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("api")
    for index in range(6):
        folder = root / "src" / ("cat" if index % 2 else "dog")
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40 + index, 32), (index * 40, 90, 200 - index * 30)).save(folder / f"{index}.jpg", quality=90)
    spec = pipeline.PrepareSpec(source=str(root / "src"), out=str(root / "shards"), resize=pipeline.ResizeSpec(size=24))
    pipeline.prepare_dataset(spec, workers=0)
    return root / "shards"


@pytest.mark.parametrize("form", ["str", "path", "file_url"])
def test_read_manifest_and_verify_dataset_take_a_path_or_url(prepared: pathlib.Path, form: str) -> None:
    where = {"str": str(prepared), "path": prepared, "file_url": f"file://{prepared}"}[form]
    manifest = pipeline.read_manifest(where)
    assert isinstance(manifest, pipeline.Manifest)
    assert manifest.samples == 6 and manifest.classes == ["cat", "dog"]
    result = pipeline.verify_dataset(where)
    assert isinstance(result, pipeline.VerifyResult)
    assert result.ok, result.problems
    assert result.samples_checked == 6
    assert pipeline.verify_dataset(where, manifest).ok


def test_read_manifest_of_a_folder_that_is_no_dataset_is_a_manifest_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(pipeline.ManifestError, match="not a prepared dataset"):
        pipeline.read_manifest(str(tmp_path))
    with pytest.raises(pipeline.ManifestError, match="not a prepared dataset"):
        pipeline.verify_dataset(tmp_path)
