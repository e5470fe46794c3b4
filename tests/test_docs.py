"""The documentation: the site builds with every warning an error, and no internal link is broken.

scripts/docs.sh (which scripts/test.sh runs before the suite) builds the site; here the
link checker it ends with is run on small sites made in tmp_path, and the README's
relative links are checked against the repository.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import click
import pytest

REPO = Path(__file__).resolve().parents[1]
CHECKER = REPO / "scripts" / "check_site_links.py"


def _check(site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECKER), str(site)], capture_output=True, text=True, timeout=60)


def _page(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<!doctype html><html><body>{body}</body></html>")


def test_the_link_checker_names_every_missing_page_and_anchor_and_ignores_external_links(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _page(site / "index.html", '<h1 id="top">x</h1><a href="guide/a.html#usage">ok</a> <a href="#top">ok</a>'
          ' <a href="https://example.org/missing.html">external</a> <a href="mailto:x@y">mail</a>'
          ' <a href="gone.html">broken</a> <a href="guide/a.html#nowhere">broken anchor</a>'
          ' <img src="assets/logo.png">')  # fmt: skip
    _page(site / "guide" / "a.html", '<h2 id="usage">u</h2><a href="../index.html#top">ok</a> <a href="../../out.html">out</a>'
          ' <a href="/index.html">root</a> <a name="old-anchor"></a><a href="#old-anchor">ok</a>')  # fmt: skip
    result = _check(site)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "check_site_links: broken link: guide/a.html: ../../out.html (outside the site)",
        "check_site_links: broken link: index.html: gone.html (no such file)",
        "check_site_links: broken link: index.html: guide/a.html#nowhere (no such anchor in guide/a.html)",
        "check_site_links: broken link: index.html: assets/logo.png (no such file)",
        "check_site_links: 2 pages, 4 broken internal links",
    ]


def test_the_link_checker_passes_a_site_whose_links_all_resolve(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _page(site / "index.html", '<a href="b.html#part-2">b</a> <a href="b.html">b</a> <a href="sub/">sub</a>')
    _page(site / "b.html", '<h2 id="part-2">2</h2>')
    _page(site / "sub" / "index.html", '<a href="../index.html">up</a>')
    result = _check(site)
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines() == ["check_site_links: 3 pages, 0 broken internal links"]


def test_the_readmes_relative_links_point_at_files_of_the_repository() -> None:
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    relative = [link for link in links if not re.match(r"[a-z][a-z0-9+.-]*:", link) and not link.startswith("#")]
    missing = [link for link in relative if not (REPO / link.split("#")[0]).exists()]
    assert missing == []


def test_the_docs_site_builds_strictly_with_no_broken_link(tmp_path: Path) -> None:
    # What scripts/test.sh runs (scripts/docs.sh), where the docs extra is installed.
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("the docs extra is not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "docs.sh"), str(site)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable}, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr
    for page in ("index", "install", "prepare", "loader", "measure", "service", "guarantees", "benchmarks", "cli", "api"):
        assert (site / f"{page}.html").is_file(), page
    cli = (site / "cli.html").read_text()
    for command in ("gpufeed-prepare", "gpufeed-advise", "gpufeed-submit-prepare", "gpufeed-worker", "gpufeed-schedule-add"):
        assert f'id="{command}"' in cli, command
    assert "Sentinel" not in cli  # every "Default" cell states a value (click 8.3+ leaves a sentinel)
    assert re.search(r"<td><code>--json</code></td>\s*<td>boolean</td>\s*<td>[^<]*</td>\s*<td><code>False</code></td>", cli)
    assert re.search(r"<td><code>--target</code></td>\s*<td>text</td>\s*<td>[^<]*</td>\s*<td>_required</td>", cli)
    assert 'id="pipeline.loader.loader.make_loader"' in (site / "api.html").read_text()


def test_the_docs_build_fails_on_a_page_that_shows_a_placeholder_instead_of_a_value() -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("the docs extra is not installed (pip install -e '.[docs]')")
    from mkdocs.exceptions import PluginError

    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="cli.md"))
    with pytest.raises(PluginError, match=r"cli.md shows 'Sentinel.UNSET'"):
        hooks.on_page_content("<td><code>Sentinel.UNSET</code></td>", page=page)
    assert hooks.on_page_content("<td><code>False</code></td>", page=page) == "<td><code>False</code></td>"


def python_blocks(text: str) -> list[str]:
    """The ```python code blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def section(text: str, heading: str) -> str:
    """A Markdown text's section under `heading`, up to the next heading of its level."""
    start = text.index(heading)
    level = heading.split(" ")[0]
    end = text.find(f"\n{level} ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


RUN_BLOCKS = """
import sys, traceback
blocks = {blocks!r}
for number, code in enumerate(blocks, 1):
    try:
        exec(compile(code, f"<{{sys.argv[1]}} block {{number}}>", "exec"), {{"__name__": "__main__"}})
    except BaseException:
        traceback.print_exc()
        print(f"block {{number}} of {{sys.argv[1]}} failed:\\n{{code}}")
        sys.exit(1)
    print(f"block {{number}} ran")
"""


@pytest.mark.parametrize("page", ["docs/tasks.md", "README.md"])
def test_the_tasks_examples_run_on_the_data_they_generate(tmp_path: Path, page: str) -> None:
    text = (REPO / page).read_text()
    if page == "README.md":
        text = section(text, "## Every kind of dataset")
    blocks = python_blocks(text)
    assert len(blocks) >= (8 if page == "docs/tasks.md" else 1)
    script = tmp_path / "run_blocks.py"
    script.write_text(RUN_BLOCKS.format(blocks=blocks))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(script), page], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.count(" ran\n") == len(blocks)


def test_the_install_page_and_the_readme_name_every_user_extra_and_every_command() -> None:
    import tomllib

    from pipeline.cli import main

    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]) - {"docs", "test"}
    install, readme = (REPO / "docs" / "install.md").read_text(), (REPO / "README.md").read_text()
    for extra in sorted(extras):
        assert f"gpufeed[{extra}]" in install, extra
        assert f"gpufeed[{extra}]" in readme, extra

    def commands_in_row(install_line: str) -> set[str]:
        row = install.split(f"| `{install_line}` |")[1].split("\n")[0]
        return set(re.findall(r"`(?:gpufeed )?([a-z-]+)`", row))

    core, service = commands_in_row("pip install gpufeed"), commands_in_row("pip install 'gpufeed[service]'")
    every = set(main.list_commands(click.Context(main)))
    assert every - service <= core, f"gpufeed commands missing from docs/install.md: {sorted(every - service - core)}"
