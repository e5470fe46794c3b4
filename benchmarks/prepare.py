"""How fast is `gpufeed prepare` next to what a user would otherwise run?

One job, four rows, measured in the same run on the same files (page cache
warm) with the same number of processes:

  gpufeed      pipeline.prepare_dataset(PrepareSpec(...), workers=N) into a fresh
               folder: the whole job (listing, size estimate, pool, shards,
               fsync, manifest) is timed.
  naive        the loop a user writes: a process pool of N doing PIL open ->
               convert("RGB") -> resize LANCZOS -> save JPEG, the parent feeding
               wds.ShardWriter (same PIL build as gpufeed).
  img2dataset  img2dataset's Resizer (keep_ratio, 256, JPEG q90) in the same
               pool + wds.ShardWriter loop, run as a subprocess with the
               baselines venv's python (benchmarks/setup_baselines.sh).
  installed    the gpufeed row as a user installs gpufeed: the wheel built now
               (scripts/build_wheel.sh), torch 2.13 and plain Pillow (what torchvision,
               ultralytics and timm install over Pillow-SIMD) in a venv of its own
               (--installed-venv, made on first use), run as a subprocess; it must
               reach >= 90 % of the gpufeed row.
  floor        no I/O, no tar, bytes in memory: one process's per-image cost of
               the fastest decode + resize + encode path among the candidates
               (floor_candidates: simplejpeg or PIL decodes + PIL resize + save,
               and gpufeed's own two paths), times N. No prepare can beat it
               on this machine.

Every row runs --rounds times (>= 2), alternating, and the best run counts:
the machine is shared and noisy, and noise only ever slows a run down.

Usage:
    python benchmarks/prepare.py [--data DIR] [--n 1000] [--json FILE]
    bash benchmarks/setup_baselines.sh   # once, for the img2dataset row
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

try:
    from . import common
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import common  # type: ignore[no-redef]

Run, Row = common.Run, common.Row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(REPO, "benchmarks", "results", "data")
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "out")
DEFAULT_BASELINES = os.path.join(REPO, ".venv-baselines")
DATA_MARKER = ".benchmark-data.json"  # dot-name: gpufeed's listing skips it

SIZE = 256  # shorter side
QUALITY = 90  # JPEG quality
DEMO_SIDES = (800, 1250)  # ~1 MP photo-like JPEGs
TARGETS = {"vs_naive": 1.6, "vs_img2dataset": 2.5, "of_floor": 0.85, "installed_of_development": 0.9}
DEFAULT_INSTALLED_VENV = os.path.join(REPO, ".venv-installed")
FLOOR_BATCH = 25  # images per turn when the floor candidates alternate
SKIPPED = "skipped (run benchmarks/setup_baselines.sh)"

ROW_TITLES = {
    "gpufeed": "gpufeed prepare",
    "naive": "naive PIL loop + wds.ShardWriter",
    "img2dataset": "img2dataset Resizer + wds.ShardWriter",
    "installed": "installed: wheel + plain Pillow",
    "floor": "floor",
}


# ---------------------------------------------------------------------------
# The rows


def run_gpufeed(data: str, out: str, processes: int, expected: int, mode: str = "shorter") -> Run:
    """The real job through the library API; the progress callback gives the phases."""
    from pipeline import EncodeSpec, PrepareSpec, ResizeSpec

    prepare = _gpufeed_prepare()
    spec = PrepareSpec(
        source=data,
        out=common.fresh_dir(out),
        resize=ResizeSpec(size=SIZE, mode=mode, resample="lanczos"),
        encode=EncodeSpec(format="jpeg", quality=QUALITY),
    )
    marks: list[tuple[float, int]] = []

    def progress(state: Any) -> None:
        marks.append((time.perf_counter(), state.done))

    start = time.perf_counter()
    result = prepare(spec, workers=processes, progress=progress)
    seconds = time.perf_counter() - start
    if result.samples != expected or result.rejected:
        raise RuntimeError(f"gpufeed wrote {result.samples} samples, {result.rejected} rejected; expected {expected}")
    return Run(result.samples, seconds, _phases(start, seconds, marks), bytes=result.bytes)


def _gpufeed_prepare() -> Callable[..., Any]:
    import importlib

    import pipeline

    function = getattr(pipeline, "prepare_dataset", None)
    if function is None:  # older layouts: pipeline.prepare.prepare
        function = importlib.import_module("pipeline.prepare").prepare_dataset
    return function  # type: ignore[no-any-return]


def _phases(start: float, seconds: float, marks: list[tuple[float, int]]) -> dict[str, Any]:
    """Where the job's wall time went, from the progress callback's timestamps.

    until_first_chunk: listing + size estimate + pool start + the first chunk;
    steady: images/s between the first and the last chunk; after_last_chunk:
    commit (fsync, rename), manifest, clean-up.
    """
    if not marks:
        return {}
    (first_t, first_done), (last_t, last_done) = marks[0], marks[-1]
    steady = (last_done - first_done) / (last_t - first_t) if last_t > first_t else 0.0
    return {
        "until_first_chunk_s": round(first_t - start, 4),
        "steady_images_per_s": round(steady, 2),
        "after_last_chunk_s": round(start + seconds - last_t, 4),
    }


_WORKER: dict[str, Any] = {}


def _naive_init() -> None:
    from PIL import Image

    _WORKER["Image"] = Image


def _naive_one(item: tuple[str, str]) -> tuple[str, bytes, dict[str, Any]] | None:
    Image = _WORKER["Image"]
    path, label = item
    try:
        with Image.open(path) as opened:
            img = opened.convert("RGB")
        original = img.size
        img = img.resize(common.shorter_side_size(original[0], original[1], SIZE), Image.LANCZOS)
        buffer = io.BytesIO()
        img.save(buffer, format="JPEG", quality=QUALITY)
    except (OSError, ValueError):
        return None
    meta = {"source": path, "original_size": list(original), "size": list(img.size)}
    return common.sample_key(path, label), buffer.getvalue(), meta


def _img2dataset_init() -> None:
    from img2dataset.resizer import Resizer

    _WORKER["resizer"] = Resizer(
        image_size=SIZE,
        resize_mode="keep_ratio",
        resize_only_if_bigger=False,
        encode_quality=QUALITY,
        encode_format="jpg",
    )


def _img2dataset_one(item: tuple[str, str]) -> tuple[str, bytes, dict[str, Any]] | None:
    path, label = item
    with open(path, "rb") as handle:  # img2dataset hands its resizer a BytesIO of the download
        stream = io.BytesIO(handle.read())
    jpeg, width, height, original_width, original_height, error = _WORKER["resizer"](stream)
    if error is not None:
        return None
    meta = {
        "source": path,
        "original_size": [original_width, original_height],
        "size": [width, height],
    }
    return common.sample_key(path, label), jpeg, meta


_POOL_ROWS = {"naive": (_naive_init, _naive_one), "img2dataset": (_img2dataset_init, _img2dataset_one)}


def run_pool_row(name: str, data: str, out: str, processes: int) -> Run:
    """A baseline loop, timed from listing to the closed tar (imports excluded, as for gpufeed)."""
    initializer, work = _POOL_ROWS[name]
    initializer()  # import in the parent first: the forked workers inherit the modules
    common.fresh_dir(out)
    with common.Stopwatch() as watch:
        items = common.list_jpegs(data)
        written = common.write_with_pool(items, out, processes, work, initializer=initializer)
    return Run(written, watch.seconds, bytes=common.directory_bytes(out))


def run_img2dataset_subprocess(python: str, data: str, out: str, processes: int, expected: int) -> Run:
    """The img2dataset row, run by the baselines venv's python."""
    command = [python, os.path.abspath(__file__), "--row", "img2dataset", "--data", data, "--out", out]
    command += ["--processes", str(processes)]
    answer = _run_json(command)
    if answer["images"] != expected:
        raise RuntimeError(f"img2dataset wrote {answer['images']} samples; expected {expected}")
    return Run(answer["images"], answer["seconds"], bytes=answer["bytes"])


def run_installed_subprocess(
    installed: common.Installed, data: str, out: str, processes: int, expected: int, mode: str
) -> Run:
    """The gpufeed row in the installed venv: this script, with that venv's python and its gpufeed."""
    command = [installed.python, os.path.abspath(__file__), "--row", "installed", "--data", data, "--out", out]
    answer = _run_json([*command, "--processes", str(processes), "--n", str(expected), "--resize-mode", mode])
    return Run(answer["images"], answer["seconds"], answer["detail"], bytes=answer["bytes"])


def _run_json(command: list[str]) -> dict[str, Any]:
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1", PYTHONPATH="")
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{os.path.basename(command[0])} {' '.join(command[2:4])} failed: {tail}")
    data: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return data


# ---------------------------------------------------------------------------
# The floor: decode + resize + encode alone, bytes in memory, one process


def floor_candidates() -> dict[str, Callable[[bytes], tuple[int, int]]]:
    """Every decode + resize + encode path worth trying; each returns the output size."""
    import simplejpeg
    from PIL import Image

    from pipeline.decode import decode_image
    from pipeline.prepare.encode import encode_image
    from pipeline.prepare.transcode import applies, transcode_jpeg
    from pipeline.prepare.transforms import required_scale, resize_image
    from pipeline.specs import AugmentSpec, EncodeSpec, PrepareSpec, ResizeSpec

    lanczos = Image.Resampling.LANCZOS

    def save(img: Any) -> None:
        img.save(io.BytesIO(), format="JPEG", quality=QUALITY)

    def pil_full(data: bytes) -> tuple[int, int]:
        with Image.open(io.BytesIO(data)) as opened:
            img = opened.convert("RGB")
        img = img.resize(common.shorter_side_size(*img.size, SIZE), lanczos)
        save(img)
        return img.size

    def pil_draft(data: bytes) -> tuple[int, int]:
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size
            scale = SIZE / min(width, height)
            opened.draft("RGB", (math.ceil(width * scale), math.ceil(height * scale)))
            img = opened.convert("RGB")
        img = img.resize(common.shorter_side_size(width, height, SIZE), lanczos)
        save(img)
        return img.size

    def simplejpeg_scaled(data: bytes) -> tuple[int, int]:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        scale = SIZE / min(width, height)
        pixels = simplejpeg.decode_jpeg(
            data, colorspace="RGB", min_width=math.ceil(width * scale), min_height=math.ceil(height * scale)
        )
        img = Image.fromarray(pixels).resize(common.shorter_side_size(width, height, SIZE), lanczos)
        save(img)
        return img.size

    def simplejpeg_rgbx(data: bytes) -> tuple[int, int]:
        # libjpeg-turbo writes 4 bytes a pixel, PIL's own RGB layout: frombuffer maps the
        # array without the zero-fill + unpack copy that fromarray(RGB array) costs.
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        scale = SIZE / min(width, height)
        pixels = simplejpeg.decode_jpeg(
            data, colorspace="RGBX", min_width=math.ceil(width * scale), min_height=math.ceil(height * scale)
        )
        mapped = Image.frombuffer("RGBX", (pixels.shape[1], pixels.shape[0]), pixels, "raw", "RGBX", 0, 1)
        img = mapped.resize(common.shorter_side_size(width, height, SIZE), lanczos).convert("RGB")
        save(img)
        return img.size  # type: ignore[no-any-return]

    resize_spec, augment_spec = ResizeSpec(size=SIZE, mode="shorter", resample="lanczos"), AugmentSpec()
    encode_spec = EncodeSpec(format="jpeg", quality=QUALITY)

    def gpufeed_functions(data: bytes) -> tuple[int, int]:
        decoded = decode_image(data, scale_for=lambda w, h: required_scale(resize_spec, augment_spec, w, h))
        img, _ = resize_image(decoded.image, decoded.original_size, resize_spec, orientation=decoded.orientation)
        encode_image(img, encode_spec)
        return img.size  # type: ignore[no-any-return]

    prepare_spec = PrepareSpec(source="-", out="-", resize=resize_spec, encode=encode_spec)

    def gpufeed_ycc(data: bytes) -> tuple[int, int]:
        made = transcode_jpeg(data, prepare_spec)
        if made is None:
            raise RuntimeError("pipeline.prepare.transcode did not take a demo JPEG")
        return made[2]

    candidates = {
        "simplejpeg scaled decode + PIL resize + save": simplejpeg_scaled,
        "simplejpeg scaled decode to RGBX (no copy) + PIL resize + save": simplejpeg_rgbx,
        "PIL draft + resize + save": pil_draft,
        "gpufeed decode_image + resize_image + encode_image": gpufeed_functions,
        "PIL full decode + resize + save": pil_full,
    }
    if applies(prepare_spec):  # it needs the native library (a C compiler and libjpeg headers)
        candidates["gpufeed YCbCr path: 4:2:0 planes decoded, resized and encoded in C (pipeline.prepare.transcode)"] = (
            gpufeed_ycc
        )
    return candidates


def run_floor(paths: list[str], processes: int) -> Run:
    """Time every candidate over the same images; the fastest one, times `processes`, is the floor.

    Also runs the fastest path in `processes` processes at once: whether this
    machine really scales N-fold tells a slow prepare from a small machine.
    """
    blobs = []
    for path in paths:
        with open(path, "rb") as handle:
            blobs.append(handle.read())
    expected = _output_size(blobs[0])
    candidates = floor_candidates()
    for name, candidate in candidates.items():
        made = candidate(blobs[0])  # also warms the candidate's code path up
        if made != expected:  # the same job as the rows, or it is no floor
            raise RuntimeError(f"floor candidate {name!r} made {made}, expected {expected}")
    # Candidates take turns on batches of the same images: a machine whose speed
    # drifts (shared host) then shifts every candidate alike instead of one.
    spent = dict.fromkeys(candidates, 0.0)
    for start in range(0, len(blobs), FLOOR_BATCH):
        batch = blobs[start : start + FLOOR_BATCH]
        for name, candidate in candidates.items():
            began = time.perf_counter()
            for data in batch:
                candidate(data)
            spent[name] += time.perf_counter() - began
    per_image = {name: seconds / len(blobs) for name, seconds in spent.items()}
    fastest = min(per_image, key=per_image.__getitem__)
    detail = {
        "fastest": fastest,
        "ms_per_image": {k: round(v * 1e3, 3) for k, v in per_image.items()},
        "parallel_images_per_s": round(_run_in_parallel(fastest, blobs, processes), 2),
    }
    # As a job: these images on `processes` perfectly parallel processes.
    return Run(len(blobs), len(blobs) * per_image[fastest] / processes, detail, bytes=0)


_FLOOR: dict[str, Any] = {}


def _floor_slice(part: int) -> None:
    candidate = floor_candidates()[_FLOOR["name"]]
    for data in _FLOOR["blobs"][part :: _FLOOR["parts"]]:
        candidate(data)


def _run_in_parallel(name: str, blobs: list[bytes], processes: int) -> float:
    """images/s of one path run by `processes` processes at once (bytes shared through fork)."""
    import multiprocessing

    _FLOOR.update(name=name, blobs=blobs, parts=processes)
    try:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            pool.map(abs, range(processes))  # the workers exist before the clock starts
            start = time.perf_counter()
            pool.map(_floor_slice, range(processes), chunksize=1)
            return len(blobs) / (time.perf_counter() - start)
    finally:
        _FLOOR.clear()


def _output_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as opened:
        return common.shorter_side_size(*opened.size, SIZE)


# ---------------------------------------------------------------------------
# Data, versions, report


def ensure_data(data: str, n: int) -> list[tuple[str, str]]:
    """The JPEGs under `data`, generating `n` demo images when it holds fewer."""
    items = common.list_jpegs(data) if os.path.isdir(data) else []
    if len(items) >= n:
        return items
    marker = os.path.join(data, DATA_MARKER)
    if items and not os.path.exists(marker):
        raise SystemExit(
            f"{data} holds {len(items)} JPEGs (fewer than --n {n}) that this benchmark did not generate; "
            "pass --n or another --data"
        )
    from pipeline.demo import make_demo_dataset

    print(f"generating {n} demo JPEGs ({DEMO_SIDES[0]}-{DEMO_SIDES[1]} px sides) in {data} ...", file=sys.stderr)
    make_demo_dataset(data, n, min_side=DEMO_SIDES[0], max_side=DEMO_SIDES[1])
    with open(marker, "w") as handle:
        json.dump({"n": n, "min_side": DEMO_SIDES[0], "max_side": DEMO_SIDES[1]}, handle)
    return common.list_jpegs(data)


def describe_data(paths: list[str]) -> dict[str, Any]:
    from PIL import Image

    pixels = 0
    for path in paths:
        with Image.open(path) as opened:
            pixels += opened.width * opened.height
    total = sum(os.path.getsize(path) for path in paths)
    return {
        "images": len(paths),
        "mean_megapixels": round(pixels / len(paths) / 1e6, 3),
        "mean_kb": round(total / len(paths) / 1e3, 1),
    }


def local_versions() -> dict[str, Any]:
    import PIL
    from PIL import features

    simd = common.dist_version("Pillow-SIMD", "pillow-simd")
    flavour = f"Pillow-SIMD {simd}" if simd else f"Pillow {PIL.__version__}"
    if simd:
        flavour += f" ({_pil_simd_level()})"
    return {
        "python": sys.version.split()[0],
        "pil": flavour,
        "libjpeg_turbo": features.version("libjpeg_turbo") if features.check_feature("libjpeg_turbo") else None,
        "simplejpeg": common.dist_version("simplejpeg"),
        "webdataset": common.dist_version("webdataset"),
        "gpufeed": common.dist_version("gpufeed"),
    }


def _pil_simd_level() -> str:
    # Pillow-SIMD has no runtime flag for it; the compiler flags are in the binary's debug info.
    from PIL import _imaging

    try:
        with open(_imaging.__file__, "rb") as handle:
            binary = handle.read()
    except OSError:
        return "SIMD level unknown"
    for flag, name in ((b"-mavx2", "AVX2"), (b"-msse4", "SSE4")):
        if flag in binary:
            return name
    return "SIMD level unknown"


def baselines_versions(python: str) -> dict[str, Any] | None:
    if not os.path.exists(python):
        return None
    try:
        return _run_json([python, os.path.abspath(__file__), "--row", "versions"])
    except (RuntimeError, ValueError, IndexError) as exc:
        return {"error": str(exc)}


def _versions_for_row() -> dict[str, Any]:
    import cv2

    return {
        "python": sys.version.split()[0],
        "img2dataset": common.dist_version("img2dataset"),
        "opencv": cv2.__version__,
        "albumentations": common.dist_version("albumentations"),
        "webdataset": common.dist_version("webdataset"),
    }


def _run_text(run: Run) -> str:
    noise = "" if run.noise is None else f" ({run.noise:.0%})"
    return f"{run.images_per_s:.1f}{noise}"


def _best_costs(row: Row) -> dict[str, float]:
    """Per candidate, its lowest ms/image over the rounds."""
    costs: dict[str, float] = {}
    for run in row.runs:
        for name, value in run.detail["ms_per_image"].items():
            costs[name] = min(value, costs.get(name, value))
    return costs


def speedups(rows: dict[str, Row]) -> dict[str, float | None]:
    def rate(name: str) -> float | None:
        best = rows[name].best if name in rows else None
        return best.images_per_s if best is not None else None

    gpufeed = rate("gpufeed")

    def ratio(name: str) -> float | None:
        other = rate(name)
        return gpufeed / other if gpufeed and other else None

    installed = rate("installed")
    return {
        "vs_naive": ratio("naive"),
        "vs_img2dataset": ratio("img2dataset"),
        "of_floor": ratio("floor"),
        "installed_of_development": installed / gpufeed if installed and gpufeed else None,
    }


def print_report(header: dict[str, Any], rows: dict[str, Row], ratios: dict[str, float | None]) -> None:
    data, local, base = header["data"], header["versions"], header["baselines"]
    print(
        f"gpufeed prepare benchmark: {data['images']} JPEGs ({data['mean_megapixels']:.2f} MP, "
        f"{data['mean_kb']:.0f} KB mean) -> shorter side {SIZE}, LANCZOS, JPEG q{QUALITY}"
    )
    print(
        f"{header['processes']} processes for every row (os.sched_getaffinity), page cache warm, "
        f"best of {header['rounds']} alternating rounds"
    )
    print(
        f"PIL: {local['pil']}, libjpeg-turbo {local['libjpeg_turbo']} | simplejpeg {local['simplejpeg']} | "
        f"webdataset {local['webdataset']} | Python {local['python']}"
    )
    if header.get("installed"):
        print(f"installed row: {header['installed']}")
    if base is None:
        print("img2dataset: not installed (no baselines venv; run benchmarks/setup_baselines.sh)")
    elif "error" in base:
        print(f"img2dataset: baselines venv unusable: {base['error']}")
    else:
        print(
            f"img2dataset {base['img2dataset']}, opencv {base['opencv']}, albumentations {base['albumentations']}, "
            f"webdataset {base['webdataset']} (baselines venv, Python {base['python']})"
        )
    print(f"{'':40} {'images/s':>9} {'seconds':>8}  runs: images/s (CPU share other processes took)")
    for name, row in rows.items():
        title = ROW_TITLES[name]
        best = row.best
        if name == "floor" and best is not None:
            title = f"floor = {header['processes']} x fastest path"
        if best is None:
            print(f"{title:40} {row.skipped}")
            continue
        runs = ", ".join(_run_text(run) for run in row.runs)
        print(f"{title:40} {best.images_per_s:9.1f} {best.seconds:8.2f}  {runs}")
        if name in ("gpufeed", "installed") and best.detail:
            d = best.detail
            print(
                f"{'':4}phases: {d['until_first_chunk_s']:.2f} s to the first chunk, "
                f"{d['steady_images_per_s']:.0f} images/s steady, {d['after_last_chunk_s']:.2f} s after the last"
            )
        if name == "floor":
            print(f"{'':4}fastest path: {best.detail['fastest']}")
            costs = _best_costs(row)
            print(f"{'':4}ms per image, 1 process, best round: " + "; ".join(f"{k} {v:.2f}" for k, v in costs.items()))
            parallel = max(run.detail["parallel_images_per_s"] for run in row.runs)
            print(
                f"{'':4}that path in {header['processes']} processes at once: {parallel:.1f} images/s "
                f"({parallel / best.images_per_s:.0%} of the floor: how far this machine scales)"
            )
    for name, row in rows.items():
        best = row.best
        if best is not None and best.noise is not None and best.noise > header["max_noise"]:
            print(f"warning: the best {ROW_TITLES[name]} run was noisy ({best.noise:.0%}); the ratios are not reliable")
    marks = []
    for key, goal in TARGETS.items():
        value = ratios[key]
        shown = {"of_floor": f"{goal:.0%} of floor", "installed_of_development": f"installed >= {goal:.0%} of gpufeed"}.get(
            key, f">= {goal}x {key[3:]}"
        )
        state = "n/a" if value is None else ("met" if value >= goal else "MISSED")
        marks.append(f"{shown}: {state}")
    print("targets: " + "; ".join(marks))

    if ratios["installed_of_development"] is not None:
        print(f"installed (wheel + plain Pillow): {ratios['installed_of_development']:.0%} of the gpufeed row")
    floor = "n/a" if ratios["of_floor"] is None else f"{ratios['of_floor']:.0%}"
    print(
        f"prepare speedup: {common.ratio_text(ratios['vs_naive'])} vs naive, "
        f"{common.ratio_text(ratios['vs_img2dataset'])} vs img2dataset, {floor} of floor"
    )


# ---------------------------------------------------------------------------
# Entry points


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", default=DEFAULT_DATA, help="folder of JPEGs (ImageFolder); demo data is generated and cached here"
    )
    parser.add_argument("--n", type=int, default=1000, help="images to generate when --data holds fewer (default 1000)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="scratch folder for the shards (emptied per run)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per row, alternating; the best counts (default 2)")
    parser.add_argument(
        "--processes",
        type=int,
        default=common.available_processes(),
        help="pool size for every row (default: available cores)",
    )
    parser.add_argument(
        "--baselines-venv", default=DEFAULT_BASELINES, help="venv made by benchmarks/setup_baselines.sh"
    )
    parser.add_argument("--floor-sample", type=int, default=0, help="images for the floor (default 0: all of them)")
    parser.add_argument(
        "--settle",
        type=float,
        default=15.0,
        help="before each run, wait up to this many seconds until other processes use < 10%% of the CPUs "
        "(default 15; 0: never wait)",
    )
    parser.add_argument(
        "--max-noise",
        type=float,
        default=0.10,
        help="a run during which other processes took more than this share of the CPUs is run again (default 0.10)",
    )
    parser.add_argument("--retries", type=int, default=2, help="extra runs per row and round when noisy (default 2)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    common.add_installed_arguments(parser, DEFAULT_INSTALLED_VENV)
    parser.add_argument(
        "--resize-mode",
        choices=["shorter", "pad"],
        default="shorter",
        help="the gpufeed and installed rows' resize mode: pad takes prepare's RGB path (Pillow decodes, gpufeed's "
        "resampler resizes, Pillow encodes) instead of the YCbCr one; the other rows always do shorter (default shorter)",
    )
    parser.add_argument("--row", choices=["naive", "img2dataset", "versions", "installed"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.processes < 1 or args.n < 1 or args.retries < 0:
        parser.error("--rounds, --processes and --n must be at least 1, --retries at least 0")
    return args


def run_single_row(args: argparse.Namespace) -> int:
    """`--row NAME`: one run, printed as a JSON line (how the baselines venv runs its row)."""
    if args.row == "versions":
        common.print_json_line(_versions_for_row())
        return 0
    if args.row == "installed":  # the installed venv: its own gpufeed, never the checkout's
        import pipeline

        if os.path.dirname(os.path.dirname(os.path.abspath(pipeline.__file__))) == REPO:
            raise SystemExit(f"the installed row imported the checkout's gpufeed ({pipeline.__file__})")
        run = run_gpufeed(os.path.abspath(args.data), os.path.abspath(args.out), args.processes, args.n, args.resize_mode)
        common.print_json_line({"images": run.images, "seconds": run.seconds, "detail": run.detail, "bytes": run.bytes})
        return 0
    run = run_pool_row(args.row, os.path.abspath(args.data), os.path.abspath(args.out), args.processes)
    common.print_json_line({"images": run.images, "seconds": run.seconds, "bytes": run.bytes})
    return 0


def measure_row(row: Row, runner: Callable[[], Run], args: argparse.Namespace, paths: list[str], label: str) -> None:
    """One round of one row: a run, run again (up to --retries times) while others took > --max-noise."""
    for attempt in range(1 + args.retries):
        common.warm_page_cache(paths)
        if args.settle > 0:
            common.wait_for_quiet(args.settle)
        try:
            with common.NoiseMeter() as noise:
                run = runner()
            run.noise = noise.share
        except RuntimeError as exc:
            row.skipped = f"failed: {exc}"
            print(f"{label}: {ROW_TITLES[row.name]}: {row.skipped}", file=sys.stderr)
            return
        finally:
            common.fresh_dir(os.path.join(args.out, row.name))
        row.runs.append(run)
        print(f"{label}: {ROW_TITLES[row.name]:40} {_run_text(run)}", file=sys.stderr)
        if run.noise is None or run.noise <= args.max_noise or attempt == args.retries:
            return
        print(f"{label}: other processes took {run.noise:.0%} of the CPUs; running it again", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.row:
        return run_single_row(args)
    data = os.path.abspath(args.data)
    items = ensure_data(data, args.n)
    paths = [path for path, _ in items]
    if len(paths) < 1000:
        print(f"warning: only {len(paths)} images; below 1,000 start-up costs dominate", file=sys.stderr)
    if args.rounds < 2:
        print("warning: --rounds 1 gives no protection against noise", file=sys.stderr)
    python = os.path.join(os.path.abspath(args.baselines_venv), "bin", "python")
    header = {
        "data": describe_data(paths) | {"path": data},
        "processes": args.processes,
        "rounds": args.rounds,
        "settle_s": args.settle,
        "max_noise": args.max_noise,
        "size": SIZE,
        "quality": QUALITY,
        "versions": local_versions(),
        "baselines": baselines_versions(python),
    }
    rows = {name: Row(name) for name in ("gpufeed", "installed", "naive", "img2dataset", "floor")}
    if header["baselines"] is None or "error" in header["baselines"]:
        rows["img2dataset"].skipped = SKIPPED
    installed = common.installed_for(args, REPO, rows, ["installed"])
    header["installed"] = installed.describe() if installed is not None else None
    floor_paths = paths
    if args.floor_sample:
        floor_paths = paths[:: max(1, len(paths) // args.floor_sample)][: args.floor_sample]
    runners: dict[str, Callable[[], Run]] = {
        "gpufeed": lambda: run_gpufeed(data, os.path.join(args.out, "gpufeed"), args.processes, len(paths), args.resize_mode),
        "naive": lambda: run_pool_row("naive", data, os.path.join(args.out, "naive"), args.processes),
        "img2dataset": lambda: run_img2dataset_subprocess(
            python, data, os.path.join(args.out, "img2dataset"), args.processes, len(paths)
        ),
        "floor": lambda: run_floor(floor_paths, args.processes),
        "installed": lambda: run_installed_subprocess(
            installed, data, os.path.join(args.out, "installed"), args.processes, len(paths), args.resize_mode  # type: ignore[arg-type]
        ),
    }
    common.warm_page_cache(paths)
    for round_index in range(args.rounds):
        order = list(rows) if round_index % 2 == 0 else list(rows)[::-1]
        for name in order:
            if not rows[name].skipped:
                measure_row(rows[name], runners[name], args, paths, f"round {round_index + 1}")
    ratios = speedups(rows)
    print_report(header, rows, ratios)
    if args.json:
        report = {
            **header,
            "rows": {name: row.to_dict(ROW_TITLES[name]) for name, row in rows.items()},
            "floor_ms_per_image_best": _best_costs(rows["floor"]) if rows["floor"].runs else None,
            "speedup": {k: (round(v, 4) if v is not None else None) for k, v in ratios.items()},
            "targets": TARGETS,
            "targets_met": {k: (v is not None and v >= TARGETS[k]) for k, v in ratios.items()},
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")
    missed = any(v is None or v < TARGETS[k] for k, v in ratios.items())
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
