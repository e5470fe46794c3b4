"""Check every internal link of a built documentation site, offline.

Usage: python scripts/check_site_links.py SITE_DIR

Reads every .html file under SITE_DIR and checks each relative `href` and `src`:
the file it names must exist under SITE_DIR (a path starting with / is taken from
SITE_DIR, where the site is served at the root), and a `#fragment` must be an `id`
(or an `<a name=...>`) of that page. Links with a scheme (https:, mailto: ...) or
starting with `//` are left alone: there is no network here. Prints one line
per broken link and exits 1 when there is any, 0 otherwise.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.anchors: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for name in ("href", "src"):
            if values.get(name) is not None and not (tag == "link" and values.get("rel") in ("preconnect", "dns-prefetch")):
                self.links.append(str(values[name]))
        for name in ("id",) + (("name",) if tag == "a" else ()):
            if values.get(name):
                self.anchors.add(str(values[name]))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def broken_links(site: Path) -> list[str]:
    """Every broken internal link of the site, as `PAGE: LINK (why)`, in page order."""
    site = site.resolve()
    pages = {path: _parse(path) for path in sorted(site.rglob("*.html"))}
    problems = []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith("//") or not (parts.path or parts.fragment):
                continue
            if parts.path.startswith("/"):  # from the site's root, as the 404 page links (it is served at any path)
                target = (site / unquote(parts.path).lstrip("/")).resolve()
            else:
                target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if site != target and site not in target.parents:
                problems.append(f"{path.relative_to(site)}: {link} (outside the site)")
            elif not target.is_file():
                problems.append(f"{path.relative_to(site)}: {link} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                anchors = (pages.get(target) or _parse(target)).anchors
                if unquote(parts.fragment) not in anchors:
                    problems.append(f"{path.relative_to(site)}: {link} (no such anchor in {target.relative_to(site)})")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python scripts/check_site_links.py SITE_DIR", file=sys.stderr)
        return 2
    site = Path(argv[0])
    problems = broken_links(site)
    for problem in problems:
        print(f"check_site_links: broken link: {problem}")
    pages = len(list(site.rglob("*.html")))
    print(f"check_site_links: {pages} pages, {len(problems)} broken internal links")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
