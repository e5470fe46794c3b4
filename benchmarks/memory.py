"""How close is `gpufeed estimate-memory` to the memory a training step really holds?

For every model, optimizer, precision and batch of the test matrix
(tests/measure/test_memory.py: a small ResNet with BatchNorm and in-place ReLU, an
MLP, a small ViT; SGD, momentum, Adam; float32 and bf16 autocast; batches 4
and 16), plus a ResNet-50-sized conv net (bottleneck blocks 3-4-6-3, 25.6 M
parameters, 3x224x224 input, float32, batches 8 and 16; built in
tests/memory_truth.py, as torchvision is not needed), three estimates are set
against the measured peak:

  gpufeed         estimate_memory(..., for_device="cpu"): the traced step
  textbook rule   parameters + gradients + optimizer state (x2 SGD, x3
                  momentum, x4 Adam) + module outputs x2 + the input
                  (the seed's arithmetic, RuleOfThumb)
  accelerate-style  parameters + gradients + optimizer state only, no
                  activations (accelerate's estimate-memory: 4x the
                  parameters for Adam)

The measured peak is the test suite's own truth (tests/memory_truth.py):
live tensor bytes over the second of two real training steps on the CPU,
counted by a TorchDispatchMode with storage finalizers. Each estimate is
printed with its ratio to the measured peak; the last lines give the worst
error of each.

Usage:
    python benchmarks/memory.py [--skip-resnet50] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the truth the tests use, so both measure the same thing

from memory_truth import (  # noqa: E402
    BATCHES,
    MODELS,
    OPTIMIZERS,
    PRECISIONS,
    RESNET50_BATCHES,
    RESNET50_SHAPE,
    SHAPE,
    measure_step,
    resnet50_sized,
)

from pipeline.measure.memory.estimate import STATE_MULTIPLIER, estimate_memory  # noqa: E402


def cases(skip_resnet50: bool) -> list[tuple[str, Any, tuple[int, ...], str, str | None, tuple[int, ...]]]:
    """(model name, factory, input shape, optimizer, autocast, batches) of every row group."""
    matrix = [
        (name, make, SHAPE, optimizer, precision, BATCHES)
        for name, make in MODELS.items()
        for optimizer in OPTIMIZERS
        for precision in PRECISIONS
    ]
    if not skip_resnet50:
        matrix += [
            ("resnet50-sized", resnet50_sized, RESNET50_SHAPE, optimizer, None, RESNET50_BATCHES)
            for optimizer in OPTIMIZERS
        ]
    return matrix


def run(skip_resnet50: bool) -> list[dict[str, Any]]:
    rows = []
    for name, make, shape, optimizer, precision, batches in cases(skip_resnet50):
        started = time.perf_counter()
        estimate = estimate_memory(make(), shape, optimizer=optimizer, autocast=precision, for_device="cpu")
        traced_s = time.perf_counter() - started
        model_state = STATE_MULTIPLIER[optimizer] * estimate.rule.parameter_bytes
        for batch in batches:
            measured = measure_step(make(), shape, batch, optimizer=optimizer, autocast=precision)
            rows.append({
                "model": name, "optimizer": optimizer, "precision": precision or "float32", "batch": batch,
                "measured_bytes": measured,
                "gpufeed_bytes": estimate.memory_for_batch(batch),
                "rule_bytes": estimate.rule.memory_for_batch(batch),
                "accelerate_bytes": model_state,
                "peak_phase": estimate.peak_phase_for_batch(batch),
                "trace_seconds": traced_s,
            })
            print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    measured = row["measured_bytes"]
    cells = [row["model"], row["optimizer"], row["precision"], str(row["batch"]), f"{measured / 2**20:,.2f}"]
    for key in ("gpufeed_bytes", "rule_bytes", "accelerate_bytes"):
        cells.append(f"{row[key] / 2**20:,.2f} ({row[key] / measured:.3f}x, {row[key] / measured - 1:+.2%})")
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-resnet50", action="store_true", help="only the test matrix (a minute instead of a few)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; MiB, and each estimate / measured")
    print("| model | optimizer | precision | batch | measured | gpufeed | textbook rule | accelerate-style |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    rows = run(args.skip_resnet50)
    for key, label in (("gpufeed_bytes", "gpufeed"), ("rule_bytes", "textbook rule"), ("accelerate_bytes", "accelerate-style")):
        errors = [row[key] / row["measured_bytes"] - 1 for row in rows]
        worst = max(errors, key=abs)
        print(f"{label}: worst error {worst:+.2%}, from {min(errors):+.2%} to {max(errors):+.2%} over {len(rows)} rows")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
