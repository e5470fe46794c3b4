"""Each package's docstring is its map: every module in it is named there, with what it holds."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = sorted(
    path.parent for base in ("pipeline", "worker") for path in (ROOT / base).rglob("__init__.py")
)


def _entries(package: pathlib.Path) -> list[str]:
    """The package's modules and sub-packages (and, in native/, its C sources)."""
    names = []
    for child in sorted(package.iterdir()):
        if child.name.startswith(("_", ".")) and child.name != "_libgpufeed.c":
            continue
        if child.suffix == ".py" or (child.suffix in (".c", ".h") and package.name == "native"):
            names.append(child.name)
        elif child.is_dir() and (child / "__init__.py").exists():
            names.append(child.name + "/")
        elif child.is_dir() and any(child.glob("*.py")):
            names.append(child.name + "/")
    return names


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_package_docstring_names_every_module(package: pathlib.Path) -> None:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    words = {word.strip("`,;:()") for line in doc.splitlines() for word in line.split()}
    missing = [name for name in _entries(package) if name not in words and name.removesuffix(".py") not in words]
    assert not missing, f"{package.relative_to(ROOT)}/__init__.py's map lacks {missing}"
