"""One short check on a CUDA machine: the GPU path of make_loader, end to end.

    python benchmarks/gpu_check.py [--images 1500] [--json FILE]

1. equality: CUDA batches equal CPU batches (same seed, same epoch), eval and train;
2. stall: a synthetic GPU step that consumes more slowly than the loader
   produces must see a stall fraction under 2 %;
3. throughput: images/s of the CPU-decode path and of nvjpeg decoding on the
   GPU (when torchvision with CUDA is installed), with the GPU doing nothing else;
4. memory: `estimate_memory`'s traced step (CUDA's allocator included)
   against `torch.cuda.max_memory_allocated()` / `max_memory_reserved()` of
   the same step (Adam, foreach) for the test suite's conv net, MLP and
   transformer and a ResNet-50-sized conv net, float32 and bf16 autocast:
   allocated within 10 %; the CUDA context as measured is printed;
5. watch: `gpufeed watch` over a DataLoader loop with CUDA matmul steps must
   read the GPU through NVML (nvidia-ml-py, the [gpu] extra): a busy GPU, its
   memory in use, and the loop timed (skipped, and said, without nvidia-ml-py).
6. yolo: recipe="yolo" (mosaic, affine, flips, HSV) at 640, batch 16, 2
   workers, on a generated YOLO set of 640-1280 px photos prepared at 640:
   images/s and CPU ms per image (this process's threads) with the workers
   rendering each mosaic (HSV on the GPU), and with decoder="nvjpeg" (the
   workers only plan; the GPU decodes each picture once and renders the
   batch); the same boxes on both, the pixels within 28 dB (HSV off for the
   comparison). Ultralytics' own loader costs about 6-10 CPU ms per image on
   2 cores (benchmarks/yolo.py); the target is a third of that.

Prints one line per check and exits non-zero when a check fails. Needs a few
minutes including data generation; everything lives under --data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # memory_truth: the memory tests' models and their CUDA step

from pipeline import PrepareSpec, ResizeSpec, prepare_dataset  # noqa: E402
from pipeline.demo import make_demo_dataset  # noqa: E402
from pipeline.loader.loader import make_loader  # noqa: E402
from pipeline.measure.memory.estimate import estimate_memory  # noqa: E402


def ensure_dataset(data: Path, images: int) -> Path:
    raw, shards = data / "raw", data / "shards"
    if not (shards / "manifest.json").exists():
        if not raw.exists():
            make_demo_dataset(raw, images, min_side=800, max_side=1250)
        prepare_dataset(PrepareSpec(str(raw), str(shards), resize=ResizeSpec(size=256)))
    return shards


def check_equality(shards: Path) -> dict[str, object]:
    result: dict[str, object] = {}
    for train in (False, True):
        cpu = make_loader(str(shards), 64, device="cpu", train=train, seed=3)
        gpu = make_loader(str(shards), 64, device="cuda", train=train, seed=3)
        worst = 0.0
        batches = 0
        for (a, la), (b, lb) in zip(cpu, gpu):
            assert b.is_cuda and lb.is_cuda
            if not torch.equal(la, lb.cpu()):
                raise AssertionError("labels differ between CPU and CUDA")
            worst = max(worst, float((a - b.cpu()).abs().max()))
            batches += 1
            if batches == 8:
                break
        result["eval" if not train else "train"] = worst
    result["ok"] = all(float(v) <= 1e-5 for k, v in result.items() if k in ("eval", "train"))
    return result


def measure(shards: Path, **options: object) -> float:
    loader = make_loader(str(shards), 64, device="cuda", **options)  # type: ignore[arg-type]
    for count, (images, _) in enumerate(loader):  # warm-up: page cache, pools, CUDA context
        if count == 3:
            break
    torch.cuda.synchronize()
    started = time.perf_counter()
    samples = 0
    for images, _ in loader:
        images.sum()  # the GPU touches every batch
        samples += images.shape[0]
    torch.cuda.synchronize()
    return samples / (time.perf_counter() - started)


def check_stall(shards: Path, loader_rate: float) -> dict[str, float]:
    """A synthetic GPU step at 80 % of the loader's rate: the loader must keep it fed."""
    loader = make_loader(str(shards), 64, device="cuda")
    step_s = 64 / (0.8 * loader_rate)
    weights = torch.randn(3 * 224 * 224, 256, device="cuda")
    for images, _ in loader:
        started = time.perf_counter()
        work = images.flatten(1).float() @ weights  # real GPU work on the batch
        work.sum().item()
        remaining = step_s - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
    return {"stall_fraction": loader.stats.stall_fraction, "step_s": step_s, "batches": loader.stats.batches}


MEMORY_TOLERANCE = 0.10


def check_memory() -> dict[str, object]:
    """The traced step's allocator peaks against the CUDA allocator's own, model by model."""
    from memory_truth import MODELS, RESNET50_SHAPE, SHAPE, cuda_step_peaks, resnet50_sized

    cases = [(name, make, SHAPE, 256) for name, make in MODELS.items()]
    cases.append(("resnet50-sized", resnet50_sized, RESNET50_SHAPE, 64))
    rows: list[dict[str, object]] = []
    for name, make, shape, batch in cases:
        for precision in (None, "bfloat16"):
            estimate = estimate_memory(make(), shape, optimizer="adam", autocast=precision, for_device="cuda")
            allocated, reserved = cuda_step_peaks(make(), shape, batch, optimizer="adam", autocast=precision)
            traced_allocated = estimate.allocated_for_batch(batch)
            traced_reserved = estimate.reserved_for_batch(batch)
            rule = estimate.rule.memory_for_batch(batch)
            row = {
                "model": name, "precision": precision or "float32", "batch": batch, "traced_on": estimate.traced_on,
                "allocated": allocated, "estimated_allocated": traced_allocated,
                "reserved": reserved, "estimated_reserved": traced_reserved, "rule": rule,
                "context": estimate.cuda_context_bytes, "context_source": estimate.cuda_context_source,
                "allocated_error": traced_allocated / allocated - 1,
                "reserved_error": traced_reserved / reserved - 1,
                "rule_error": rule / allocated - 1,
                "ok": abs(traced_allocated / allocated - 1) <= MEMORY_TOLERANCE,
            }
            rows.append(row)
            print(
                f"memory {name} {row['precision']} batch {batch}: allocated {allocated / 2**20:,.1f} MiB, "
                f"estimate {row['allocated_error']:+.1%}; reserved {reserved / 2**20:,.1f} MiB, estimate "
                f"{row['reserved_error']:+.1%}; rule of thumb {row['rule_error']:+.1%} -> {'ok' if row['ok'] else 'FAIL'}",
                flush=True,
            )
    print(f"memory: CUDA context {estimate.cuda_context_bytes / 2**20:,.0f} MiB ({estimate.cuda_context_source})")
    return {"rows": rows, "ok": all(row["ok"] for row in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1500)
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "results" / "gpu-data")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; run this on a machine with an NVIDIA GPU")
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  cores {len(os.sched_getaffinity(0))}")
    shards = ensure_dataset(args.data, args.images)
    report: dict[str, object] = {}
    equality = check_equality(shards)
    report["equality"] = equality
    print(f"equality CPU vs CUDA: max |diff| eval {equality['eval']:.2e}, train {equality['train']:.2e} -> {'ok' if equality['ok'] else 'FAIL'}")
    rate = measure(shards)
    report["cpu_decode_images_per_s"] = rate
    print(f"throughput, CPU decode -> GPU: {rate:.0f} images/s")
    stall = check_stall(shards, rate)
    report["stall"] = stall
    stall_ok = stall["stall_fraction"] < 0.02
    print(f"stall with a GPU step at 80 % of the loader's rate: {stall['stall_fraction']:.2%} -> {'ok' if stall_ok else 'FAIL'}")
    try:
        nvjpeg = measure(shards, decoder="nvjpeg")
        report["nvjpeg_images_per_s"] = nvjpeg
        print(f"throughput, nvjpeg decode on the GPU: {nvjpeg:.0f} images/s ({nvjpeg / rate:.2f}x the CPU path)")
    except Exception as exc:  # torchvision missing or without CUDA: report, don't fail the rest
        report["nvjpeg_images_per_s"] = None
        print(f"nvjpeg: skipped ({exc})")
    memory = check_memory()
    report["memory"] = memory
    watched = check_watch(args.data)
    report["watch"] = watched
    yolo = check_yolo(args.data)
    report["yolo"] = yolo
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if equality["ok"] and stall_ok and memory["ok"] and watched["ok"] and yolo["ok"] else 1


def yolo_rate(shards: Path, **options: object) -> tuple[float, float]:
    """(images/s, CPU ms per image) of recipe="yolo" training batches on the GPU, after a warm-up epoch."""
    loader = make_loader(str(shards), 16, device="cuda", crop=640, num_workers=2, dtype="uint8", recipe="yolo",
                         **options)  # type: ignore[arg-type]  # fmt: skip
    for batch in loader:  # warm-up: page cache, workers, CUDA context, nvjpeg
        pass
    torch.cuda.synchronize()
    started, cpu = time.perf_counter(), time.process_time()
    images = 0
    for _ in range(2):
        for batch in loader:
            batch.images.float().mean()  # the GPU touches every batch
            images += batch.images.shape[0]
    torch.cuda.synchronize()
    return images / (time.perf_counter() - started), (time.process_time() - cpu) * 1000 / images


def check_yolo(data: Path) -> dict[str, object]:
    """recipe="yolo" with the workers rendering, and with decoder="nvjpeg" (the GPU renders): speed and agreement."""
    from pipeline.demo import make_yolo_dataset

    shards = data / "yolo-shards"
    if not (shards / "manifest.json").exists():
        raw = make_yolo_dataset(data / "yolo-raw", 400, min_side=640, max_side=1280, splits=())
        prepare_dataset(PrepareSpec(str(raw), str(shards), resize=ResizeSpec(size=640, mode="longer")))
    result: dict[str, object] = {"ok": False}
    try:
        rate, cpu_ms = yolo_rate(shards)
        result.update(workers_images_per_s=rate, workers_cpu_ms=cpu_ms)
        print(f"yolo, workers render: {rate:.0f} images/s, {cpu_ms:.2f} CPU ms/image")
        rate, cpu_ms = yolo_rate(shards, decoder="nvjpeg")
        result.update(nvjpeg_images_per_s=rate, nvjpeg_cpu_ms=cpu_ms)
        print(f"yolo, nvjpeg + GPU render: {rate:.0f} images/s, {cpu_ms:.2f} CPU ms/image")
        off = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0}
        worst, same = 99.0, True
        gpu = make_loader(str(shards), 16, device="cuda", crop=640, num_workers=2, dtype="uint8", recipe="yolo",
                          seed=5, hyp=off, decoder="nvjpeg")  # fmt: skip
        cpu = make_loader(str(shards), 16, device="cuda", crop=640, num_workers=2, dtype="uint8", recipe="yolo",
                          seed=5, hyp=off)  # fmt: skip
        for count, (ours, theirs) in enumerate(zip(gpu, cpu)):
            same = same and all(torch.equal(a, b) for a, b in zip(ours.boxes, theirs.boxes))
            error = (ours.images.float() - theirs.images.float()).pow(2).flatten(1).mean(1).clamp_min(1e-9)
            worst = min(worst, float((10 * torch.log10(255.0**2 / error)).min()))
            if count == 4:
                break
        result.update(same_boxes=same, min_psnr_db=worst, ok=same and worst >= 28.0)
        print(f"yolo, nvjpeg vs workers: same boxes {same}, PSNR min {worst:.1f} dB -> {'ok' if result['ok'] else 'FAIL'}")
    except Exception as exc:  # report it and go on: the other checks' lines still count
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"yolo: FAIL ({result['error']})")
    return result


WATCHED_STEP = """
import time, torch
from torch.utils.data import DataLoader, TensorDataset
weights = torch.randn(4096, 4096, device="cuda")
for (batch,) in DataLoader(TensorDataset(torch.randn(512, 4096)), batch_size=8):
    deadline = time.perf_counter() + 0.02
    while time.perf_counter() < deadline:  # a step that keeps the GPU busy for 20 ms, no queue left behind
        weights = (weights @ weights).clamp_(-1, 1)
        torch.cuda.synchronize()
"""


def check_watch(data: Path) -> dict[str, object]:
    """`gpufeed watch` reads the GPU through NVML while a CUDA loop runs."""
    try:
        import pynvml  # noqa: F401
    except ImportError:
        print("watch NVML: skipped (pip install nvidia-ml-py, the [gpu] extra)")
        return {"ok": True, "skipped": "nvidia-ml-py is not installed"}
    import subprocess

    data.mkdir(parents=True, exist_ok=True)
    script, out = data / "watched_step.py", data / "watch.json"
    script.write_text(WATCHED_STEP)
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "watch", "--interval", "0.5", "--json", str(out), "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    watched = json.loads(out.read_text()) if out.exists() else {}
    gpus = watched.get("gpus", [])
    ok = (
        result.returncode == 0 and bool(gpus) and gpus[0]["util_max"] > 0 and gpus[0]["memory_used_max"] > 0
        and bool(watched.get("loops")) and watched["verdict"]["bound"] == "compute-bound"
    )  # fmt: skip
    verdict = watched.get("verdict", {})
    shown = ", ".join(f"GPU {g['index']} {g['util_mean']:.0f} % (peak {g['util_max']:.0f} %) {g['memory_used_max'] / 2**30:.1f} GiB" for g in gpus)
    print(f"watch NVML: {shown or 'no GPU read'}; verdict {verdict.get('bound')}, stall {watched.get('stall_fraction', 0):.1%} -> {'ok' if ok else 'FAIL'}")
    if not ok:
        print(result.stderr[-2000:])
    return {"ok": ok, "gpus": gpus, "verdict": verdict, "stall_fraction": watched.get("stall_fraction")}


if __name__ == "__main__":
    sys.exit(main())
