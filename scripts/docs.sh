#!/usr/bin/env bash
# Build the documentation site and check its links, as CI does (scripts/test.sh runs this before the
# suite): `mkdocs build --strict` (mkdocs.yml: every warning fails, unresolved links and anchors
# included), then scripts/check_site_links.py over the built pages (every relative link and
# #anchor, offline). Needs the environment from scripts/setup.sh (the docs extra).
#   bash scripts/docs.sh [SITE_DIR]       # default site/
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
SITE="${1:-$ROOT/site}"

echo "docs: mkdocs build --strict -> $SITE"
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --site-dir "$SITE"
"$PY" scripts/check_site_links.py "$SITE"
