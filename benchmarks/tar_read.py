"""How much faster is gpufeed's streaming tar reader than `tarfile`?

Reads the same shards from the page cache three ways, each giving the same
samples (consecutive members grouped by the WebDataset key rule, every
member's bytes in memory):

  streaming reader   pipeline.io.tar.iter_tar_samples: the loader's reader
                     (one sequential pass through a reused 1 MB buffer)
  tarfile r|         tarfile's stream mode, extractfile().read() per member
  tarfile random     tarfile.open(path) (reads every header first), then
                     extractfile().read() per member: tarfile's usual use

The shards are written once by gpufeed's own writer (TarShardWriter) into a
temporary folder: --mb of samples shaped like a prepared dataset's (a JPEG-
sized member of random bytes, median --sample-kb, plus `cls` and `json`),
--shard-mb per shard. Every file is read once before the rounds, so all
three read from memory. A run is whole passes over every shard until
--min-seconds have gone by. Each way runs --rounds times, the order rotating
every round, each run after waiting up to --settle seconds for the other
processes to quieten; the best run counts (noise only ever slows a run down),
and every run's noise (the share of the CPUs other processes used meanwhile)
is printed next to it. The three ways must agree on samples and bytes.

The last line is the one to quote:
    streaming reader vs tarfile: X.XXx (vs r| X.XXx, vs random access Y.YYx)
X is against the faster tarfile way; --check exits 1 when it is under --min-ratio.

Usage:
    python benchmarks/tar_read.py [--mb 300] [--shard-mb 64] [--rounds 4] [--min-seconds 0.5] [--settle 1.5] [--dir DIR] [--json FILE] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

try:
    from . import common
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import common  # type: ignore[no-redef]

from pipeline.io.tar import TarShardWriter, group_samples, iter_tar_samples

Samples = Iterator[tuple[str, dict[str, bytes]]]


def write_shards(folder: str, total_bytes: int, shard_bytes: int, sample_bytes: int, seed: int = 0) -> list[str]:
    """Shards of random-bytes samples, sized like prepared ones, written with gpufeed's writer."""
    rng = random.Random(seed)
    paths: list[str] = []
    written = index = 0
    while written < total_bytes:
        path = os.path.join(folder, f"shard-{len(paths):06d}.tar")
        with TarShardWriter(path) as writer:
            while writer.bytes < shard_bytes and written + writer.bytes < total_bytes:
                # JPEG sizes spread around the median like a prepared dataset's (about 4x either way).
                size = int(min(max(sample_bytes * rng.lognormvariate(0.0, 0.7), 2000), 16 * sample_bytes))
                members = {"jpg": os.urandom(size), "cls": str(index % 1000).encode(), "json": json.dumps({"i": index}).encode()}
                writer.write_sample(f"sample_{index:09d}", members)
                index += 1
            written += writer.commit(os.path.basename(path)).bytes
        paths.append(path)
    return paths


def streaming_reader(path: str) -> Samples:
    return iter_tar_samples(path)


def tarfile_stream(path: str) -> Samples:
    def members() -> Iterator[tuple[str, bytes]]:
        with tarfile.open(path, mode="r|") as tar:
            for info in tar:
                if info.isfile():
                    handle = tar.extractfile(info)
                    assert handle is not None
                    yield info.name, handle.read()

    return group_samples(members())


def tarfile_random(path: str) -> Samples:
    def members() -> Iterator[tuple[str, bytes]]:
        with tarfile.open(path, mode="r:") as tar:
            for info in tar.getmembers():
                if info.isfile():
                    handle = tar.extractfile(info)
                    assert handle is not None
                    yield info.name, handle.read()

    return group_samples(members())


WAYS: dict[str, Callable[[str], Samples]] = {
    "streaming reader": streaming_reader,
    "tarfile r|": tarfile_stream,
    "tarfile random": tarfile_random,
}


def read_all(way: Callable[[str], Samples], paths: list[str]) -> tuple[int, int]:
    """(samples, member bytes) read from every shard."""
    samples = member_bytes = 0
    for path in paths:
        for _, members in way(path):
            samples += 1
            member_bytes += sum(len(data) for data in members.values())
    return samples, member_bytes


def timed_run(name: str, paths: list[str], file_bytes: int, min_seconds: float) -> tuple[common.Run, tuple[int, int]]:
    """Whole passes over every shard until `min_seconds` have gone by; returns the run and one pass's (samples, bytes)."""
    passes = 0
    with common.NoiseMeter() as meter, common.Stopwatch() as watch:
        started = time.perf_counter()
        while True:
            one_pass = read_all(WAYS[name], paths)
            passes += 1
            if time.perf_counter() - started >= min_seconds:
                break
    run = common.Run(images=one_pass[0] * passes, seconds=watch.seconds, noise=meter.share, bytes=file_bytes * passes)
    run.detail["passes"] = passes
    return run, one_pass


def mb_s(run: common.Run) -> float:
    return (run.bytes or 0) / run.seconds / 1e6 if run.seconds > 0 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=300, help="MB of shards to write and read (10^6 bytes)")
    parser.add_argument("--shard-mb", type=float, default=64, help="MB per shard")
    parser.add_argument("--sample-kb", type=float, default=40, help="median JPEG member size, kB")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--min-seconds", type=float, default=0.5, help="each run reads the shards again until this long")
    parser.add_argument("--settle", type=float, default=1.5, help="wait up to this long for other processes to quieten before each run")
    parser.add_argument("--dir", default=None, help="where the temporary shards go (default: the system temp folder)")
    parser.add_argument("--min-ratio", type=float, default=2.0, help="--check: the least streaming-vs-tarfile ratio")
    parser.add_argument("--json", dest="json_path", default=None, help="write every figure here")
    parser.add_argument("--check", action="store_true", help="exit 1 when the ratio is under --min-ratio")
    args = parser.parse_args()

    folder = tempfile.mkdtemp(prefix="gpufeed-tar-read-", dir=args.dir)
    try:
        print(f"writing {args.mb:g} MB of shards in {folder} …", file=sys.stderr)
        paths = write_shards(folder, int(args.mb * 1e6), int(args.shard_mb * 1e6), int(args.sample_kb * 1e3))
        file_bytes = common.warm_page_cache(paths)
        rows = {name: common.Row(name) for name in WAYS}
        agreed: dict[str, tuple[int, int]] = {}
        names = list(WAYS)
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                common.wait_for_quiet(args.settle)
                run, agreed[name] = timed_run(name, paths, file_bytes, args.min_seconds)
                rows[name].runs.append(run)
                noise = "n/a" if run.noise is None else f"{run.noise:.0%}"
                print(f"  round {round_ + 1} {name:<17} {mb_s(run):6.0f} MB/s  (noise {noise})", file=sys.stderr)
        if len(set(agreed.values())) != 1:
            sys.exit(f"the ways disagree on (samples, member bytes): {agreed}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    samples = agreed["streaming reader"][0]
    print(
        f"{len(paths)} shards, {file_bytes / 1e6:.0f} MB, {samples:,} samples "
        f"({file_bytes / samples / 1e3:.1f} kB a sample), page cache warm, best of {args.rounds} rounds"
    )
    best = {name: row.best for name, row in rows.items()}
    for name, run in best.items():
        assert run is not None
        runs = ", ".join(f"{mb_s(r):.0f}" for r in rows[name].runs)
        noise = ", ".join("n/a" if r.noise is None else f"{r.noise:.0%}" for r in rows[name].runs)
        print(f"{name:<17} {mb_s(run):7.0f} MB/s  {run.images_per_s:9,.0f} samples/s   runs {runs} MB/s, noise {noise}")
    streaming = best["streaming reader"]
    assert streaming is not None
    ratios = {name: streaming.images_per_s / run.images_per_s for name, run in best.items() if run and name != "streaming reader"}
    headline = min(ratios.values())
    if args.json_path:
        data: dict[str, Any] = {
            "shards": len(paths),
            "file_bytes": file_bytes,
            "samples": samples,
            "rounds": args.rounds,
            "rows": {name: {**row.to_dict(name), "mb_s": round(mb_s(best[name]), 1)} for name, row in rows.items()},  # type: ignore[arg-type]
            "ratio_vs_tarfile": round(headline, 3),
            "ratios": {name: round(value, 3) for name, value in ratios.items()},
            "host": _cpu_model(),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
    print(
        f"streaming reader vs tarfile: {common.ratio_text(headline)} "
        f"(vs r| {common.ratio_text(ratios['tarfile r|'])}, vs random access {common.ratio_text(ratios['tarfile random'])})"
    )
    if args.check and headline < args.min_ratio:
        sys.exit(1)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    main()
