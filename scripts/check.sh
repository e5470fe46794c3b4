#!/usr/bin/env bash
# Static checks, as CI runs them (scripts/test.sh runs this before the full suite):
#   ruff (lint rules in pyproject.toml; the scripts and docs hooks too), mypy on pipeline/ and worker/, and the import
#   contracts (lint-imports: the library never imports the service, prepare and the loader
#   are independent, native code imports nothing of gpufeed, no cycles).
# Needs the environment from scripts/setup.sh.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BIN="$ROOT/.venv/bin"

status=0
run() {
    printf 'check: %s\n' "$*"
    "$@" || status=1
}
run "$BIN/ruff" check pipeline worker tests benchmarks scripts docs
run "$BIN/mypy" pipeline worker
run "$BIN/lint-imports" --no-cache
if [[ "$status" != 0 ]]; then
    echo "check: FAILED (see above)" >&2
fi
exit "$status"
