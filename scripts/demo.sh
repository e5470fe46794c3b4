#!/usr/bin/env bash
# gpufeed end to end on a generated sample dataset, with no service (the embedded default):
#   sets up .venv, generates 300 photo-like JPEGs in demo/raw, prepares them into WebDataset
#   shards in demo/shards (256 px, shorter side), verifies every shard, and reads the shards
#   back with plain webdataset and through make_loader. Everything it writes is under demo/
# Every long step prints what it is doing at least every 10 s (a first run: 2 to 5 minutes on 2 cores).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
# setup.sh's `progress`: a line at least every 10 s while a silent step runs.
source scripts/setup.sh
SAY_AS=demo

step() { printf '\n==> %s\n' "$*"; }

step "gpufeed demo-data demo/raw -n 300"
progress "generating 300 photo-like JPEGs" demo/demo-data.log gpufeed demo-data demo/raw -n 300
cat demo/demo-data.log

step "gpufeed prepare demo/raw demo/shards --size 256"
rm -rf demo/shards  # a fresh run each time; a re-run over complete shards would only resume
gpufeed prepare demo/raw demo/shards --size 256

step "gpufeed inspect demo/shards --verify"
gpufeed inspect demo/shards --verify

step "reading the shards back with plain webdataset"
python - <<'PYEOF'
import json
from collections import Counter

import webdataset as wds

manifest = json.load(open("demo/shards/manifest.json"))
urls = [f"demo/shards/{shard['path']}" for shard in manifest["shards"]]
dataset = wds.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple("__key__", "jpg", "cls", "json")
labels, sizes = Counter(), Counter()
for key, image, label, meta in dataset:
    assert manifest["classes"][label] == meta["label"], (key, label, meta)
    labels[meta["label"]] += 1
    sizes[min(image.size)] += 1
total = sum(labels.values())
assert total == manifest["samples"], (total, manifest["samples"])
print(f"{total} samples from {len(urls)} shard(s), as many as the manifest lists")
print("per class:", dict(sorted(labels.items())))
print("shorter side of every image:", dict(sizes))
print(f"last sample: {key} -> class {label} ({meta['label']}), {image.size[0]}x{image.size[1]}, from {meta['source']}")
PYEOF

step "one epoch through make_loader (batch 32, random-resized crops to 224)"
python - <<'PYEOF'
from pipeline import make_loader

loader = make_loader("demo/shards/manifest.json", batch_size=32)
for images, labels in loader:
    pass
print(f"{len(loader)} batches of {tuple(images.shape)} {images.dtype} on {images.device}")
print(f"loader stats: {loader.stats}")
print("(stall fraction: the share of the loop's time spent waiting for data; this loop does nothing with")
print(" the batches, so it waits nearly all the time: in training, the GPU's work fills that time)")
PYEOF
