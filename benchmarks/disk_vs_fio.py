"""Does `gpufeed bench disk` measure what fio measures?

Both tools run on the same folder with the page cache bypassed (fio
`--direct=1`, gpufeed O_DIRECT) and the same access pattern:

  sequential read   1 MiB blocks, one synchronous reader   fio --rw=read --bs=1M --ioengine=psync --iodepth=1
  random read       4 KiB blocks, queue depth 1             fio --rw=randread --bs=4k --ioengine=psync --iodepth=1

each time-based, `--runtime` seconds per test and tool, over a `--size` file
that each run writes afresh just before reading it, the same way for both
(O_DIRECT, 1 MiB blocks, fsync at the end: gpufeed writes its own, fio's is
deleted and written by `fio --rw=write --direct=1`), since a virtual disk's
host may still cache what was just written, and both should see the same. gpufeed runs as shipped: its
`--duration` is the same `--runtime`, split between its default 3 repeats, and
its figure is their median. The tools take turns for `--rounds` rounds (fio
first, then gpufeed first, …: a drift in the machine's load hits both alike);
each figure is printed as the median over the rounds with the rounds' range,
and the ratio gpufeed/fio of the medians. An untimed `--warmup` read spends
a cloud or virtual disk's burst allowance first. The target: the ratios within
±25 % where the disk is steady (the rounds' own spread says whether it is).

Setup: fio comes from the system packages (`apt-get install -y fio`); without
it the script prints "skipped (install fio)" and exits 0.

Usage:
    python benchmarks/disk_vs_fio.py [--path DIR] [--size 1GiB] [--runtime 4] [--rounds 3] [--warmup 10] [--json FILE] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from pipeline.units import parse_bytes  # noqa: E402  (fio reads "1GiB" as 10^9 bytes: it gets a byte count)

DEFAULT_PATH = os.path.join(REPO, "benchmarks", "results", "disk")
TOLERANCE = 0.25
FIO_FILE = "fio-test.bin"
ROWS = {
    "seq_read_mb_s": ("sequential read, 1 MiB, QD1", "MB/s", 0),
    "randread_4k_iops_qd1": ("random 4 KiB read, QD1", "IOPS", 0),
    "randread_4k_p50_us_qd1": ("random 4 KiB read, QD1, p50", "us", 1),
}
JUDGED = ("seq_read_mb_s", "randread_4k_iops_qd1")


def remove_fio_file(path: str) -> None:
    target = os.path.join(path, FIO_FILE)
    if os.path.exists(target):
        os.unlink(target)


def run_fio(fio: str, path: str, size: str, runtime: float, rw: str, block: str) -> dict[str, float]:
    timing = [f"--runtime={runtime:g}", "--time_based"] if runtime > 0 else ["--end_fsync=1"]
    command = [
        fio, "--name=gpufeed-vs-fio", f"--filename={os.path.join(path, FIO_FILE)}", f"--size={parse_bytes(size)}",
        "--direct=1", f"--rw={rw}", f"--bs={block}", "--ioengine=psync", "--iodepth=1", "--numjobs=1",
        *timing, "--randrepeat=0", "--output-format=json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]
    read = job["write" if rw == "write" else "read"]
    return {"mb_s": read["bw_bytes"] / 1e6, "iops": read["iops"], "p50_us": read["clat_ns"]["percentile"]["50.000000"] / 1e3}


def fio_round(fio: str, path: str, size: str, runtime: float) -> dict[str, Any]:
    remove_fio_file(path)  # written afresh as gpufeed writes its own: O_DIRECT, 1 MiB blocks, fsync at the end
    run_fio(fio, path, size, 0, "write", "1M")
    seq = run_fio(fio, path, size, runtime, "read", "1M")
    rand = run_fio(fio, path, size, runtime, "randread", "4k")
    return {"seq_read_mb_s": seq["mb_s"], "randread_4k_iops_qd1": rand["iops"], "randread_4k_p50_us_qd1": rand["p50_us"]}


def gpufeed_round(path: str, size: str, runtime: float) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "pipeline", "bench", "disk", path, "--file-size", size, "--block-sizes", "1MiB",
        "--duration", f"{runtime:g}", "--threads", "1", "--tests", "seq_read,randread", "--json",
    ]
    data = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO).stdout)
    return {
        "seq_read_mb_s": data["seq_read_mb_s"], "randread_4k_iops_qd1": data["randread_4k_iops_qd1"],
        "randread_4k_p50_us_qd1": data["randread_4k_p50_ms_qd1"] * 1000, "repeats": data["repeats"],
        "inner_runs": {name: figure["runs"] for name, figure in data["figures"].items()},
        "unsteady": data["unsteady"], "cache_suspected": data["cache_suspected"], "warnings": data["warnings"],
        "direct_io": data["direct_io"], "device_kind": data["device_kind"], "cache_bypass": data["cache_bypass"],
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default=DEFAULT_PATH, help="folder on the disk to measure")
    parser.add_argument("--size", default="1GiB", help="test file size (fio and gpufeed)")
    parser.add_argument("--runtime", type=float, default=4.0, help="seconds per test and tool in each round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the tools alternating which goes first")
    parser.add_argument("--warmup", type=float, default=10.0, help="untimed seconds of reading first (0: none)")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument("--check", action="store_true", help="exit 1 when a ratio is off by more than 25 %%")
    args = parser.parse_args()
    fio = shutil.which("fio")
    if fio is None:
        print("disk_vs_fio: skipped (install fio: apt-get install -y fio)")
        return 0
    version = subprocess.run([fio, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(args.path, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"fio": [], "gpufeed": []}
    started = time.perf_counter()
    try:
        if args.warmup > 0:  # spend a virtual disk's burst allowance before anything is timed
            run_fio(fio, args.path, args.size, args.warmup, "read", "1M")
        for turn in range(args.rounds):
            for tool in ("fio", "gpufeed") if turn % 2 == 0 else ("gpufeed", "fio"):
                if tool == "fio":
                    runs["fio"].append(fio_round(fio, args.path, args.size, args.runtime))
                else:
                    runs["gpufeed"].append(gpufeed_round(args.path, args.size, args.runtime))
    finally:
        remove_fio_file(args.path)
    report = summarise(runs)
    report.update(path=os.path.abspath(args.path), size=args.size, runtime_s=args.runtime, rounds=args.rounds,
                  fio_version=version, seconds=time.perf_counter() - started, runs=runs)
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 1 if args.check and not report["agree"] else 0


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows = {}
    for key in ROWS:
        figures = {tool: [run[key] for run in runs[tool]] for tool in ("fio", "gpufeed")}
        medians = {tool: statistics.median(values) for tool, values in figures.items()}
        ratio = medians["gpufeed"] / medians["fio"]
        rows[key] = {
            **medians,
            "ratio": ratio,
            "within": abs(ratio - 1) <= TOLERANCE,
            "fio_runs": figures["fio"],
            "gpufeed_runs": figures["gpufeed"],
            "fio_spread": _spread(figures["fio"]),
            "gpufeed_spread": _spread(figures["gpufeed"]),
        }
    last = runs["gpufeed"][-1]
    return {
        "rows": rows,
        "agree": all(rows[key]["within"] for key in JUDGED),
        "direct_io": last["direct_io"],
        "device_kind": last["device_kind"],
        "cache_bypass": last["cache_bypass"],
        "gpufeed_warnings": sorted({warning for run in runs["gpufeed"] for warning in run["warnings"]}),
    }


def _spread(values: list[float]) -> float:
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median else 0.0


def print_report(report: dict[str, Any]) -> None:
    print(f"{report['path']}: {report['device_kind']}, gpufeed cache bypass {report['cache_bypass']}, "
          f"fio --direct=1 ({report['fio_version']})")
    print(f"{report['size']} file, {report['runtime_s']:g} s per test and tool, {report['rounds']} alternating rounds: "
          "median over the rounds [lowest-highest]")
    print(f"{'':36}{'fio':>24}{'gpufeed':>24}{'ratio':>7}")
    for key, (name, unit, digits) in ROWS.items():
        row = report["rows"][key]
        cells = [f"{_number(row[tool], digits)} [{_range(row[tool + '_runs'], digits)}]" for tool in ("fio", "gpufeed")]
        verdict = ("ok" if row["within"] else "OFF by more than 25 %") if key in JUDGED else ""
        print(f"{name + ' (' + unit + ')':36}{cells[0]:>24}{cells[1]:>24}{row['ratio']:>7.2f}  {verdict}")
    for warning in report["gpufeed_warnings"]:
        print(f"gpufeed warned: {warning}")
    ratios = ", ".join(f"{report['rows'][key]['ratio']:.2f}" for key in JUDGED)
    print(f"disk agreement: gpufeed/fio = {ratios} (seq read MB/s, 4 KiB IOPS QD1); "
          f"{'within' if report['agree'] else 'NOT within'} ±25 %")


def _number(value: float, digits: int) -> str:
    return f"{value:,.{digits}f}"


def _range(values: list[float], digits: int) -> str:
    return f"{_number(min(values), digits)}-{_number(max(values), digits)}"


if __name__ == "__main__":
    sys.exit(main())
