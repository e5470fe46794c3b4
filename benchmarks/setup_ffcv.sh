#!/usr/bin/env bash
# Install FFCV into its own virtualenv for the FFCV row of benchmarks/loader.py.
#
# FFCV builds a C extension against the system's OpenCV and libturbojpeg
# (found with pkg-config), and JIT-compiles its pipeline with numba; none of
# that belongs in gpufeed's own environment, so it lives in .venv-ffcv and
# benchmarks/loader.py runs the FFCV row as a subprocess with this venv's
# python. gpufeed is not installed there.
#
# Usage: bash benchmarks/setup_ffcv.sh [VENV]    (default: .venv-ffcv)
#        PYTHON=python3.11 bash benchmarks/setup_ffcv.sh
#        SKIP_APT=1 bash benchmarks/setup_ffcv.sh   (system packages already there)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-.venv-ffcv}"
PYTHON="${PYTHON:-python3}"
FFCV="ffcv==1.0.2"
# torch first, pinned to gpufeed's version, so that ffcv's dependencies cannot
# pull another (CUDA) build. Here pip's find-links hold the +cpu wheel; elsewhere
# point PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index before running this.
TORCH_PIN="torch==2.13.0"
# ffcv 1.0.2 (2023) was released and tested against NumPy 1; stay there.
NUMPY_PIN="numpy<2"

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 8) or sys.version_info >= (3, 12))' || {
    echo "setup_ffcv.sh: need Python 3.8-3.11 (ffcv 1.0.2's setup.py imports distutils); set PYTHON=" >&2
    exit 2
}

if [ -z "${SKIP_APT:-}" ]; then
    missing=()
    command -v pkg-config >/dev/null || missing+=(pkg-config)
    command -v g++ >/dev/null || missing+=(g++)
    pkg-config --exists opencv4 2>/dev/null || missing+=(libopencv-dev)
    pkg-config --exists libturbojpeg 2>/dev/null || missing+=(libturbojpeg0-dev)
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "setup_ffcv.sh: installing ${missing[*]} (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
fi
for package in opencv4 libturbojpeg; do
    pkg-config --exists "$package" || {
        echo "setup_ffcv.sh: pkg-config cannot find $package (install libopencv-dev / libturbojpeg0-dev)" >&2
        exit 3
    }
done

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip wheel setuptools
"${PIP[@]}" install -q "$TORCH_PIN"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
printf '%s\n' "$TORCH_PIN" "$NUMPY_PIN" >"$constraints"
# ffcv imports PIL but does not declare it. Its C extension needs no numpy
# headers; the build runs without isolation so that it uses this venv's
# setuptools (ffcv's setup.py imports distutils: stdlib up to 3.11, else the
# setuptools shim) and pip does not fetch a second toolchain.
"${PIP[@]}" install -q -c "$constraints" "$NUMPY_PIN" numba opencv-python pillow
"${PIP[@]}" install -q -c "$constraints" --no-build-isolation "$FFCV"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
from ffcv.fields import IntField, RGBImageField  # noqa: F401  (what the row writes)
from ffcv.fields.decoders import RandomResizedCropRGBImageDecoder  # noqa: F401
from ffcv.loader import Loader  # noqa: F401
from ffcv.writer import DatasetWriter  # noqa: F401
import torch
print("ffcv ready:", ", ".join(f"{name} {md.version(name)}" for name in ("ffcv", "numba", "numpy", "torch")),
      f"(cuda build: {torch.version.cuda is not None})")
EOF
