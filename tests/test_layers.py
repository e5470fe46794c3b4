"""The layering rules hold: the contracts in pyproject.toml, and no import cycle between any two modules.

`lint-imports` checks the contracts (the library never imports the service; prepare and the
loader are independent; the native code imports nothing of gpufeed; stages above the shared
gates, the gates above io; inside io, measure and prepare, their sub-packages layered; no
cycles between sibling packages). The cycle test below is
stricter than the sibling contract: it also sees a package's `__init__` and one of its own
modules importing each other, imports inside functions included.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports() -> str | None:
    found = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    return found if Path(found).exists() else None


@pytest.mark.skipif(_lint_imports() is None, reason="import-linter is not installed (pip install import-linter)")
def test_import_contracts_are_kept():
    result = subprocess.run(
        [_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Contracts: 8 kept, 0 broken." in result.stdout


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively: the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_cycle_finder_finds_a_cycle():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter")
    sys.path.insert(0, str(ROOT))
    try:
        graph = grimp.build_graph("pipeline", "worker", exclude_type_checking_imports=True, cache_dir=None)
    finally:
        sys.path.remove(str(ROOT))
    edges = {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    cycles = _strongly_connected(edges)
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)
