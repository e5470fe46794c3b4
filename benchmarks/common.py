"""Helpers shared by the comparative benchmarks.

Standard library only at import time: the baseline rows run this module from a
separate virtualenv (.venv-baselines) where gpufeed is not installed, so
anything heavier (webdataset, PIL, opencv) is imported inside the function
that needs it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

JPEG_EXTENSIONS = (".jpg", ".jpeg")
CHUNK = 16  # tasks per pool message for the baseline loops (a common imap chunksize)
SHARD_BYTES = 256 * 1024 * 1024  # gpufeed's default --shard-size, for the ShardWriter rows
LOOPBACK = "127.0.0.1"
S3_CREDENTIALS_ENV = {  # the benchmark store's credentials (s3store.py), as a worker of its own gets them
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def available_processes() -> int:
    """Cores this process may run on (affinity/cgroup aware), as gpufeed counts them."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def list_jpegs(root: str) -> list[tuple[str, str]]:
    """(path, label) of every JPEG under an ImageFolder root, in a stable order.

    Dot-names are skipped, like gpufeed's own listing, so every row processes
    exactly the files `gpufeed prepare` lists.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = os.path.relpath(dirpath, root)
        label = rel.split(os.sep)[0] if rel != "." else ""
        for name in sorted(filenames):
            if not name.startswith(".") and name.lower().endswith(JPEG_EXTENSIONS):
                found.append((os.path.join(dirpath, name), label))
    return found


def warm_page_cache(paths: Iterable[str]) -> int:
    """Read every file once so that each row reads from memory; returns bytes read."""
    total = 0
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(1 << 20):
                total += len(block)
    return total


def shorter_side_size(width: int, height: int, size: int) -> tuple[int, int]:
    """Output size for 'shorter side = size', never upscaling (gpufeed's `shorter` mode)."""
    scale = size / min(width, height)
    if scale >= 1:
        return width, height
    return max(1, round(width * scale)), max(1, round(height * scale))


def sample_key(path: str, label: str) -> str:
    """A WebDataset key without dots or slashes."""
    stem = os.path.splitext(os.path.basename(path))[0].replace(".", "_")
    return f"{label}_{stem}" if label else stem


def write_with_pool(
    items: Sequence[tuple[str, str]],
    out_dir: str,
    processes: int,
    work: Callable[[tuple[str, str]], tuple[str, bytes, dict[str, Any]] | None],
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
) -> int:
    """The loop a user writes: a process pool makes the JPEG bytes, the parent feeds wds.ShardWriter.

    Args:
        items: (path, label) pairs.
        out_dir: folder for shard-NNNNNN.tar (created).
        processes: pool size.
        work: top-level function (path, label) -> (key, jpeg bytes, metadata), or None for a reject.
        initializer: run once in each worker.
        initargs: its arguments.

    Returns:
        Samples written.
    """
    import webdataset as wds

    labels = {label: i for i, label in enumerate(sorted({label for _, label in items}))}
    os.makedirs(out_dir, exist_ok=True)
    pattern = os.path.join(out_dir, "shard-%06d.tar")
    written = 0
    context = multiprocessing.get_context("fork")
    with (
        context.Pool(processes, initializer=initializer, initargs=initargs) as pool,
        wds.ShardWriter(pattern, maxsize=SHARD_BYTES, maxcount=10**9, verbose=0) as sink,
    ):
        for (_, label), result in zip(items, pool.imap(work, items, chunksize=CHUNK)):
            if result is None:
                continue
            key, jpeg, meta = result
            sample: dict[str, Any] = {"__key__": key, "jpg": jpeg, "json": meta}
            if label:
                sample["cls"] = labels[label]
            sink.write(sample)
            written += 1
    return written


def directory_bytes(path: str) -> int:
    """Total size of the files under `path`."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        total += sum(os.path.getsize(os.path.join(dirpath, name)) for name in filenames)
    return total


def ratio_text(value: float | None) -> str:
    """A speedup as the headline lines print it: "2.47x", or "n/a" when a row did not run."""
    return "n/a" if value is None else f"{value:.2f}x"


def fresh_dir(path: str) -> str:
    """Remove `path` if it exists; its parent is created."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def dist_version(*names: str) -> str | None:
    """The installed version of the first distribution found among `names`."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.seconds`."""

    seconds = 0.0

    def __enter__(self) -> Self:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.seconds = time.perf_counter() - self._start


class NoiseMeter:
    """Share of the machine's CPU time that other processes used while the block ran.

    /proc/stat's busy time minus this process's and its reaped children's
    (getrusage), over wall time x CPUs. A run with high noise is not a fair
    figure; best-of-N keeps the quietest. None where /proc/stat is missing.
    """

    share: float | None = None

    def __enter__(self) -> Self:
        self._start = (_machine_busy_seconds(), _own_cpu_seconds(), time.perf_counter())
        return self

    def __exit__(self, *exc_info: object) -> None:
        busy0, own0, wall0 = self._start
        busy1, own1, wall1 = _machine_busy_seconds(), _own_cpu_seconds(), time.perf_counter()
        if busy0 is None or busy1 is None or wall1 <= wall0:
            return
        cpus = os.cpu_count() or 1
        self.share = max(0.0, min(1.0, ((busy1 - busy0) - (own1 - own0)) / ((wall1 - wall0) * cpus)))


def wait_for_quiet(max_seconds: float, threshold: float = 0.10, window: float = 1.0) -> float | None:
    """Wait (at most `max_seconds`) until other processes use under `threshold` of the CPUs.

    Returns the last share measured (None without /proc/stat). A shared
    machine is rarely quiet for long; this only avoids starting a run in the
    middle of someone else's burst.
    """
    deadline = time.monotonic() + max_seconds
    share = None
    while True:
        with NoiseMeter() as meter:
            time.sleep(window)
        share = meter.share
        if share is None or share < threshold or time.monotonic() >= deadline:
            return share


def _machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...
    values = [int(v) for v in fields[1:9]]
    busy = sum(values) - values[3] - values[4]
    return busy / os.sysconf("SC_CLK_TCK")


def cpu_seconds(children: bool = True) -> float:
    """CPU seconds this process (all its threads) has used, with its ended children's unless `children` is False."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) if children else (resource.RUSAGE_SELF,):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _own_cpu_seconds() -> float:
    return cpu_seconds()


def print_json_line(data: dict[str, Any]) -> None:
    """The last stdout line of a row run as a subprocess: what the parent parses."""
    print(json.dumps(data, sort_keys=True), flush=True)


@dataclasses.dataclass
class Run:
    """One timed run of one row."""

    images: int
    seconds: float
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)
    noise: float | None = None  # share of the CPUs other processes used meanwhile
    bytes: int | None = None  # what the run wrote, where that is a figure

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class Row:
    """Every run of a row; the best one is the row's figure."""

    name: str
    runs: list[Run] = dataclasses.field(default_factory=list)
    skipped: str = ""

    @property
    def best(self) -> Run | None:
        return max(self.runs, key=lambda run: run.images_per_s) if self.runs else None

    def to_dict(self, title: str) -> dict[str, Any]:
        best = self.best
        data: dict[str, Any] = {"title": title}
        if self.skipped:
            data["skipped"] = self.skipped
        if best is not None:
            data.update(images_per_s=round(best.images_per_s, 2), seconds=round(best.seconds, 4), images=best.images)
            if best.bytes is not None:
                data["bytes"] = best.bytes
            data.update(
                runs_images_per_s=[round(run.images_per_s, 2) for run in self.runs],
                runs_noise=[None if run.noise is None else round(run.noise, 3) for run in self.runs],
                detail=best.detail,
            )
        return data


# ---------------------------------------------------------------------------
# The "installed" rows: gpufeed as a user installs it

INSTALLED_PINS = ("torch==2.13.0", "pillow==13.0.0")  # CPU torch first; plain Pillow, as torchvision brings it
INSTALLED_SKIPPED = "skipped (--installed-venv none)"


def add_installed_arguments(parser: Any, default_venv: str) -> None:
    """--installed-venv and --wheel, the options of the installed rows (loader.py, prepare.py, tasks.py)."""
    parser.add_argument(
        "--installed-venv",
        default=default_venv,
        help="venv of the installed rows, made on first use; the wheel is rebuilt into it every run ('none': skip them)",
    )
    parser.add_argument(
        "--wheel",
        choices=["release", "plain"],
        default="release",
        help="the installed rows' wheel: scripts/build_wheel.sh's (default) or plain `pip wheel .`",
    )


def installed_for(args: Any, repo: str, rows: dict[str, Row], wanted: list[str]) -> Installed | None:
    """The installed rows' venv with this checkout's wheel in it, or None (then each of `wanted` says why it is skipped)."""
    import sys

    if not wanted:
        return None
    reason = INSTALLED_SKIPPED
    if args.installed_venv != "none":
        print(f"installed rows: building the {args.wheel} wheel into {args.installed_venv}", file=sys.stderr)
        try:
            return ensure_installed(repo, os.path.abspath(args.installed_venv), args.wheel)
        except RuntimeError as exc:
            reason = f"skipped (the installed venv: {exc})"
    for name in wanted:
        rows[name].skipped = reason
    return None


@dataclasses.dataclass
class Installed:
    """The venv of the "installed" rows: the built wheel, torch and plain Pillow, nothing of the checkout."""

    python: str
    wheel: str  # the wheel's file name
    build: str  # "release" (scripts/build_wheel.sh: auditwheel-repaired) or "plain" (`pip wheel .`)
    pil: str  # the active PIL there, e.g. "Pillow 13.0.0"

    def describe(self) -> str:
        return f"{self.wheel} ({self.build} build) + {self.pil} in {os.path.dirname(os.path.dirname(self.python))}"


def ensure_installed(repo: str, venv: str, build: str = "release") -> Installed:
    """Build the wheel from `repo` now and install it into `venv` (made once with INSTALLED_PINS).

    The wheel is rebuilt and reinstalled every run (a few seconds), so the row
    measures the code of this checkout; torch and Pillow stay installed.

    Args:
        repo: the checkout.
        venv: the venv's folder (made when absent).
        build: "release": scripts/build_wheel.sh (pip wheel + auditwheel
            repair, libjpeg bundled), or "plain": `pip wheel .` alone.

    Raises:
        RuntimeError: a step failed (its last line).
    """
    import subprocess
    import sys
    import tempfile

    def run(command: list[str], **options: Any) -> str:
        done = subprocess.run(command, capture_output=True, text=True, check=False, **options)
        if done.returncode != 0:
            lines = [line for line in (done.stderr or done.stdout).splitlines() if "is ignored" not in line]
            raise RuntimeError(f"{' '.join(command[:4])}: {(lines or ['failed'])[-1]}")
        return done.stdout

    python = os.path.join(venv, "bin", "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if not os.path.exists(python):
        run(["python3", "-m", "venv", venv])
        run([*pip, INSTALLED_PINS[0]])
    with tempfile.TemporaryDirectory() as scratch:
        if build == "release":
            builder = dict(os.environ, PYTHON=sys.executable)  # this venv has the build tools (the test extra)
            wheel = run(["bash", os.path.join(repo, "scripts", "build_wheel.sh"), scratch], cwd=repo, env=builder)
            wheel = wheel.split()[-1]
        else:
            run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", scratch, repo])  # as a user runs it
            wheel = next(os.path.join(scratch, n) for n in os.listdir(scratch) if n.endswith(".whl"))
        run([*pip, wheel, *INSTALLED_PINS[1:]])  # its dependencies, and plain Pillow over anything else
        run([*pip, "--force-reinstall", "--no-deps", wheel])  # this checkout's code, even under the same version
        name = os.path.basename(wheel)
    probe = "import PIL, importlib.metadata as m; print(m.distribution('pillow').metadata['Name'], PIL.__version__)"
    pil = run([python, "-c", probe], cwd=venv).strip()
    return Installed(python, name, build, pil)
