#!/usr/bin/env bash
# Check a release wheel (scripts/build_wheel.sh) the way a bare machine sees it: a fresh venv, the wheel
# and its dependencies but torch (the native library does not need it), then, in a process that has no
# C compiler (CC=false, nothing but the venv on PATH), no libjpeg headers and no system libjpeg (both
# hidden in a private mount namespace where this runs as root and `unshare` is allowed), and an empty
# GPUFEED_CACHE:
#   - the native library is the installed extension from the wheel, not a first-use build;
#   - the libjpeg it runs on is the copy inside the wheel (gpufeed.libs/), read from /proc/self/maps;
#   - it decodes a JPEG; the cache is still empty afterwards.
# Usage: bash scripts/check_wheel.sh WHEEL       (exit 0 and "check_wheel: ok ..." when it holds)
# Environment: PYTHON (default .venv/bin/python) makes the venv; GPUFEED_CHECK_WHEEL_HIDE=0 skips hiding.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WHEEL="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"

say() { printf 'check_wheel: %s\n' "$*"; }

work="$(mktemp -d -t gpufeed-check-wheel.XXXXXX)"
trap 'rm -rf "$work"' EXIT
venv="$work/venv"

say "fresh venv, $(basename "$WHEEL") and its dependencies but torch"
"$PY" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
quiet() { "$@" >"$work/pip.log" 2>&1 || { cat "$work/pip.log" >&2; return 1; }; }
quiet "${pip[@]}" --no-deps "$WHEEL"
mapfile -t needs < <("$venv/bin/python" - <<'PYEOF'
import importlib.metadata as md
import re
for line in md.requires("gpufeed") or []:
    if "extra ==" not in line and re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower() != "torch":
        print(line)
PYEOF
)
# pip's note that torch is missing is expected here: the log is shown only when pip fails.
quiet "${pip[@]}" "${needs[@]}"

# What runs on the "bare machine".
cat >"$work/probe.py" <<'PYEOF'
import io, os, sys, sysconfig
from pathlib import Path

from pipeline import native

site = Path(sysconfig.get_paths()["platlib"]).resolve()
info = native.library_info()
if info.origin != "extension" or info.path is None or site not in info.path.resolve().parents:
    sys.exit(f"the native library is not the wheel's extension: {info.summary}")
lib = native.library()
assert lib is not None and lib.gf_ycc_basis_check() == 1
mapped = {line.split()[-1] for line in open("/proc/self/maps") if "libjpeg" in line and "/" in line}
ours = sorted(path for path in mapped if Path(path).resolve().parent == site / "gpufeed.libs")
others = sorted(path for path in mapped if site not in Path(path).resolve().parents)
if not ours or others:
    sys.exit(f"libjpeg is not the wheel's own copy: mapped {sorted(mapped)}")
from PIL import Image  # a JPEG to decode through the native library (Pillow's wheel has its own libjpeg)
buffer = io.BytesIO()
Image.new("RGB", (64, 48), (200, 30, 90)).save(buffer, "JPEG", quality=90)
assert native.jpeg_warnings(buffer.getvalue()) == [], "the native library cannot read a JPEG"
cache = Path(os.environ["GPUFEED_CACHE"])
if cache.exists() and any(cache.rglob("*")):
    sys.exit(f"something was built at run time: {sorted(cache.rglob('*'))}")
print(f"native library {info.path.relative_to(site)} on {Path(ours[0]).relative_to(site)}")
PYEOF

probe=(env -i HOME="$work" PATH="$venv/bin" CC=false GPUFEED_CACHE="$work/cache" "$venv/bin/python" "$work/probe.py")
hidden="no (GPUFEED_CHECK_WHEEL_HIDE=0)"
if [[ "${GPUFEED_CHECK_WHEEL_HIDE:-1}" != 0 ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v unshare >/dev/null 2>&1 && unshare -m true 2>/dev/null; then
        hidden="yes"
    else
        hidden="no (needs root and unshare)"
    fi
fi
if [[ "$hidden" == yes ]]; then
    # Inside a private mount namespace: the headers' folder emptied, every system libjpeg an empty file.
    mkdir -p "$work/empty" && : >"$work/empty-file"
    libs="$(ls /usr/lib/*/libjpeg.so* /usr/lib/libjpeg.so* /usr/lib64/libjpeg.so* /usr/local/lib/libjpeg.so* 2>/dev/null || true)"
    # shellcheck disable=SC2016
    result="$(unshare -m sh -c '
        set -e
        mount --bind "$1" /usr/include
        shift
        empty_file="$1"; libs="$2"; shift 2
        for lib in $libs; do mount --bind "$empty_file" "$lib"; done
        ! ls /usr/include/jpeglib.h >/dev/null 2>&1
        exec "$@"
    ' sh "$work/empty" "$work/empty-file" "$libs" "${probe[@]}")"
else
    result="$("${probe[@]}")"
fi
say "ok: $result (no compiler; libjpeg headers and system libjpeg hidden: $hidden)"
