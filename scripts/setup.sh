#!/usr/bin/env bash
# Set up gpufeed on this machine, from nothing to ready:
#   .venv (python3) <- torch (CPU build, pinned first) <- gpufeed[test,service,s3,plots,docs] (editable)
#   <- Pillow-SIMD built against the system's libjpeg-turbo, zlib, libwebp, libtiff, openjpeg
#   (falls back to the Pillow wheel, loudly, where it cannot be built with them),
#   and redis-server for the tests.
# Another package that depends on `pillow` (torchvision, ultralytics, timm) installs plain Pillow over
# Pillow-SIMD: gpufeed's JPEG paths keep their speed (its native code resizes, whichever PIL is active);
# what PIL does itself (PNG/WebP decoding, prepare's variant warps) slows down. docs/install.md says how
# to get Pillow-SIMD back; `rm .venv/.gpufeed-setup-stamp; bash scripts/setup.sh` does it for this venv.
# A first run takes 2 to 5 minutes on 2 cores (about 2 when the machine is otherwise idle: torch 30 s,
# the other packages 1 min, the Pillow-SIMD build 30 s; up to 1.5 min each on a busy one) and says what
# it is doing at least every 10 s; each long step's output is in
# .venv/.gpufeed-logs/ (the Pillow-SIMD build's in .venv/.gpufeed-wheels/*/build.log).
# Idempotent: when nothing changed since the last run it returns in about a second.
# Environment: PYTHON (default python3) picks the interpreter for a new .venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.gpufeed-setup-stamp"
TORCH_VERSION="2.13.0"
PILLOW_SIMD_VERSION="12.1.1.post0"
# Debian packages with the headers Pillow-SIMD needs for each codec.
PILLOW_BUILD_DEPS=(libwebp-dev libtiff-dev liblcms2-dev libopenjp2-7-dev libfreetype-dev libjpeg62-turbo-dev zlib1g-dev)

# SAY_AS names the script in every line (demo.sh, which sources this file, sets it).
say() { printf '%s: %s\n' "${SAY_AS:-setup}" "$*"; }
shout() {
    printf '\n%s\n' "************************************************************************" >&2
    printf 'setup: WARNING: %s\n' "$@" >&2
    printf '%s\n\n' "************************************************************************" >&2
}
pip() { "$PY" -m pip --disable-pip-version-check "$@"; }

# Every long step (pip installs, apt-get, the Pillow-SIMD build) runs through `progress`, which says what
# it is doing every GPUFEED_SETUP_PROGRESS_S seconds (default 8, so that a line comes at least every 10 s).
PROGRESS_S="${GPUFEED_SETUP_PROGRESS_S:-8}"
LOGS="$VENV/.gpufeed-logs"

# The log's last line that says what the step does (not blank, not one of pip's warnings), shortened for
# one terminal line to its end (a compiler line ends with the file it builds).
last_line() {
    local line
    line="$(tr -d '\r' <"$1" 2>/dev/null | grep -v -e '^[[:space:]]*$' -e '^WARNING: ' | tail -n 1 | tr -s ' \t' ' ' || true)"
    line="${line# }"
    [[ ${#line} -gt 100 ]] && line="...${line: -97}"
    printf '%s' "${line:-(no output yet)}"
}

# progress LABEL LOG COMMAND...: runs COMMAND with its output in LOG; every PROGRESS_S seconds prints the
# time so far and LOG's last line. On failure prints LOG's last lines. Returns COMMAND's exit status.
progress() {
    local label="$1" log="$2" start parent="$$" ticker status=0
    shift 2
    mkdir -p "$(dirname "$log")"
    : >"$log"
    start="$(date +%s)"
    say "$label"
    (
        # Stops with the step, or when setup itself is gone (a background job does not get Ctrl-C).
        while sleep "$PROGRESS_S" && kill -0 "$parent" 2>/dev/null; do
            say "  ... $label: $(($(date +%s) - start)) s: $(last_line "$log")"
        done
    ) &
    ticker=$!
    "$@" >>"$log" 2>&1 || status=$?
    kill "$ticker" 2>/dev/null || true
    wait "$ticker" 2>/dev/null || true
    if [[ "$status" != 0 ]]; then
        say "$label failed after $(($(date +%s) - start)) s (exit status $status); the end of $log:" >&2
        tail -n 25 "$log" >&2 || true
    else
        say "  done in $(($(date +%s) - start)) s"
    fi
    return "$status"
}

# pip_install LABEL NAME ARGS...: `pip install ARGS` through `progress`, logged in $LOGS/NAME.log.
pip_install() {
    local label="$1" name="$2"
    shift 2
    progress "$label" "$LOGS/$name.log" pip install --progress-bar off "$@"
}

stamp_value() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1; }

can_apt() { [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; }

# apt-get install, refreshing the package lists only when the first attempt fails.
apt_install() {
    can_apt || return 1
    export DEBIAN_FRONTEND=noninteractive
    # Outside .venv, which may not exist yet (redis-server comes first).
    local log="${TMPDIR:-/tmp}/gpufeed-setup-apt.log"
    progress "apt-get install $*" "$log" apt-get install -y -qq --no-install-recommends "$@" && return 0
    progress "apt-get update (package lists may be stale)" "$log" apt-get update -qq || true
    progress "apt-get install $* (after the update)" "$log" apt-get install -y -qq --no-install-recommends "$@"
}

missing_debs() {
    command -v dpkg-query >/dev/null 2>&1 || return 0
    local pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || echo "$pkg"
    done
}

ensure_redis_server() {
    command -v redis-server >/dev/null 2>&1 && return 0
    say "redis-server not found; installing it"
    if apt_install redis-server && command -v redis-server >/dev/null 2>&1; then
        return 0
    fi
    shout "redis-server is not installed and could not be installed here." \
        "Tests that need Redis will be skipped unless GPUFEED_TEST_REDIS_URL points at one" \
        "(on Debian/Ubuntu, as root: apt-get install redis-server)."
}

ensure_venv() {
    if [[ -x "$PY" ]] && "$PY" -c 'import sys' >/dev/null 2>&1; then
        return 0
    fi
    say "creating $VENV with $(command -v "$PYTHON") ($("$PYTHON" --version 2>&1))"
    "$PYTHON" -m venv --clear "$VENV"
}

ensure_torch() {
    local have
    have="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
    if [[ "${have%%+*}" == "$TORCH_VERSION" ]]; then
        say "torch $have already installed"
        return 0
    fi
    # Pinned before gpufeed so that resolving gpufeed's "torch" keeps this (CPU) build
    # instead of pulling a multi-GB CUDA one.
    pip_install "installing torch==$TORCH_VERSION (a download of about 200 MB)" torch "torch==$TORCH_VERSION"
}

# Exits 0 when Pillow-SIMD is the active PIL and has every codec gpufeed relies on;
# otherwise prints why not.
pillow_simd_ok() {
    "$PY" - <<'EOF'
import importlib.metadata as md
import sys

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

simd, plain = version("pillow-simd"), version("pillow")
if simd is None:
    sys.exit("Pillow-SIMD is not installed")
if plain is not None:
    sys.exit(f"the Pillow {plain} distribution is installed too")
import PIL
from PIL import features

if PIL.__version__ != simd:
    sys.exit(f"the active PIL is {PIL.__version__}, not Pillow-SIMD {simd}")
needed = {
    "JPEG": features.check_codec("jpg"),
    "libjpeg-turbo": features.check_feature("libjpeg_turbo"),
    "PNG (zlib)": features.check_codec("zlib"),
    "WebP": features.check_module("webp"),
    "TIFF (libtiff)": features.check_codec("libtiff"),
    "JPEG 2000 (openjpeg)": features.check_codec("jpg_2000"),
}
missing = [name for name, ok in needed.items() if not ok]
if missing:
    sys.exit("Pillow-SIMD was built without " + ", ".join(missing))
print(f"Pillow-SIMD {simd} with JPEG (libjpeg-turbo), PNG, WebP, TIFF and JPEG 2000")
EOF
}

simd_cc() {
    local flags=""
    if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
        flags=" -mavx2"
    elif grep -qw sse4_2 /proc/cpuinfo 2>/dev/null; then
        flags=" -msse4"
    fi
    echo "${CC:-cc}$flags"
}

install_pillow_fallback() {
    shout "Pillow-SIMD could not be installed: $1" \
        "Falling back to the Pillow wheel: everything works; JPEG paths keep their speed in gpufeed's native code," \
        "what PIL does itself (PNG/WebP decoding, prepare's variant warps) is slower." \
        "Fix the cause, then: rm $STAMP; bash scripts/setup.sh"
    pip uninstall -y -qq pillow-simd >/dev/null 2>&1 || true
    pip_install "installing the Pillow wheel" pillow --force-reinstall pillow
    PILLOW_NOTE="Pillow-SIMD is not installed (fallback to Pillow: $1)"
}

# Prints the path of the Pillow-SIMD wheel in folder $1, if one is there.
find_wheel() {
    local wheel
    for wheel in "$1"/pillow_simd-"$PILLOW_SIMD_VERSION"-*.whl; do
        if [[ -f "$wheel" ]]; then
            echo "$wheel"
            return 0
        fi
    done
    return 1
}

# Builds the Pillow-SIMD wheel once per venv and compiler flags; prints its path.
build_pillow_simd() {
    local cc="$1" wheels="$2"
    find_wheel "$wheels" && return 0
    mkdir -p "$wheels"
    # --no-cache-dir: pip's wheel cache ignores CC, so a cached wheel could lack the SIMD flags.
    # -v: the compiler's lines go to the log, so the progress lines show which file it is at.
    CC="$cc" progress "building pillow-simd==$PILLOW_SIMD_VERSION with CC=\"$cc\" (30 s to 1.5 min on 2 cores)" \
        "$wheels/build.log" pip wheel -v --no-deps --no-cache-dir --no-binary pillow-simd \
        "pillow-simd==$PILLOW_SIMD_VERSION" -w "$wheels" >&2 || return 1
    find_wheel "$wheels"
}

install_pillow_simd() {
    local status
    if status="$(pillow_simd_ok 2>&1)"; then
        say "$status: already active"
        return 0
    fi
    say "installing Pillow-SIMD ($status)"
    local missing
    missing="$(missing_debs "${PILLOW_BUILD_DEPS[@]}" | tr '\n' ' ')"
    if [[ -n "${missing// /}" ]]; then
        say "installing codec headers: $missing"
        # shellcheck disable=SC2086
        if ! apt_install $missing; then
            install_pillow_fallback "the codec headers are missing and could not be installed; as root: apt-get install ${PILLOW_BUILD_DEPS[*]}"
            return 0
        fi
    fi
    local cc wheels wheel
    cc="$(simd_cc)"
    wheels="$VENV/.gpufeed-wheels/$(tr -c 'a-zA-Z0-9\n' _ <<<"$cc")"
    if ! wheel="$(build_pillow_simd "$cc" "$wheels")"; then
        install_pillow_fallback "the build failed (log: $wheels/build.log)"
        return 0
    fi
    # Both distributions install the `PIL` package: remove Pillow so exactly one owns it.
    pip uninstall -y -qq pillow >/dev/null 2>&1 || true
    pip_install "installing the Pillow-SIMD wheel" pillow-simd --force-reinstall --no-deps "$wheel"
    if status="$(pillow_simd_ok 2>&1)"; then
        say "$status"
    else
        rm -rf "$wheels"  # built without some codec: do not reuse it
        install_pillow_fallback "$status; install the headers (${PILLOW_BUILD_DEPS[*]})"
    fi
}

main() {
    ensure_redis_server
    if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_value)" ]] \
        && "$PY" -c 'import importlib.metadata as m; m.version("gpufeed")' >/dev/null 2>&1; then
        say "already set up in $VENV (delete $STAMP to force a full run)"
        if [[ -s "$STAMP.note" ]]; then
            shout "$(cat "$STAMP.note")"
        fi
        return 0
    fi
    PILLOW_NOTE=""
    ensure_venv
    ensure_torch
    pip_install "installing gpufeed (editable) with the service, S3, the charts, the docs and the test tools" \
        gpufeed -e '.[test,service,s3,plots,docs]'
    # Last, because installing anything that depends on Pillow puts Pillow's PIL back.
    install_pillow_simd
    printf '%s' "$PILLOW_NOTE" >"$STAMP.note"
    stamp_value >"$STAMP"
    "$VENV/bin/gpufeed" doctor || true
    say "ready: $VENV (gpufeed is $VENV/bin/gpufeed)"
}

# Sourced (the tests call `progress`), it only defines the functions.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
