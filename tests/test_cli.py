"""The `gpufeed` command as a user runs it: in a subprocess, judged by exit code and output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

GPUFEED_SCRIPT = Path(sys.executable).with_name("gpufeed")


def run(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m pipeline ARGS` with this interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], check=False, capture_output=True, text=True, cwd=cwd, timeout=timeout
    )


def test_help_lists_the_commands() -> None:
    result = run("--help")
    assert result.returncode == 0, result.stderr
    for command in ("prepare", "inspect", "doctor", "demo-data"):
        assert command in result.stdout


def test_console_script_is_installed() -> None:
    assert GPUFEED_SCRIPT.exists(), f"{GPUFEED_SCRIPT} missing: install the package (pip install -e .)"
    result = subprocess.run([str(GPUFEED_SCRIPT), "--version"], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "version" in result.stdout


def test_doctor_json_parses(get_free_port: Callable[[], int]) -> None:
    env = {**os.environ, "GPUFEED_BROKER_URL": f"redis://127.0.0.1:{get_free_port()}/0"}
    result = subprocess.run(
        [str(GPUFEED_SCRIPT), "doctor", "--json"], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["pil"]["formats"]["JPEG"] is True
    assert report["redis"]["reachable"] is False
    assert report["redis"]["url"] == env["GPUFEED_BROKER_URL"]


def test_doctor_text_report(redis_url: str) -> None:
    result = run("doctor", "--redis-url", redis_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("gpufeed ")
    assert "reachable (Redis " in result.stdout


def test_demo_data_writes_photo_like_jpegs(tmp_path: Path) -> None:
    count, classes = 5, 2
    result = run("demo-data", str(tmp_path / "raw"), "--n", str(count), "--classes", str(classes), "--workers", "0")
    assert result.returncode == 0, result.stderr
    assert f"wrote {count} images in {classes} classes" in result.stdout
    files = sorted((tmp_path / "raw").rglob("*.jpg"))
    assert len(files) == count
    assert len({path.parent.name for path in files}) == classes
    for path in files:
        with Image.open(path) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
            width, height = image.size
            image.load()
        # Defaults: 800-1600 px a side, i.e. a real photo, not a thumbnail.
        assert 800 <= width <= 1600 and 800 <= height <= 1600
        # Flat synthetic images compress to almost nothing and decode unrealistically fast;
        # photos at quality 90 take well over 0.1 byte per pixel.
        assert path.stat().st_size / (width * height) > 0.1, f"{path.name} compresses like a flat image"


@pytest.fixture(scope="module")
def small_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "raw"
    result = run("demo-data", str(root), "--n", "4", "--min-side", "64", "--max-side", "96", "--workers", "0")
    assert result.returncode == 0, result.stderr
    return root


@pytest.mark.parametrize(
    ("source", "flags"),
    [
        pytest.param("demo", ["--quality", "500"], id="quality-out-of-range"),
        pytest.param("demo", ["--mode", "bogus"], id="unknown-mode"),
        pytest.param("demo", ["--shard-size", "lots"], id="shard-size-not-a-size"),
        pytest.param("missing", [], id="nonexistent-source"),
    ],
)
def test_prepare_rejects_bad_input_with_one_line(
    source: str, flags: list[str], small_source: Path, tmp_path: Path
) -> None:
    src = small_source if source == "demo" else tmp_path / "no-such-folder"
    result = run("prepare", str(src), str(tmp_path / "out"), "--quiet", "--workers", "0", *flags)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpufeed: error: "), result.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


# ---------------------------------------------------------------------------
# The service's commands come through entry points; the library never imports the service

ROOT = Path(__file__).resolve().parents[1]
SERVICE_COMMANDS = ("beat", "cancel", "jobs", "schedule", "status", "submit", "worker")


def run_with_path(*args: str, path: list[Path], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m pipeline ARGS` with `path` in front of this checkout on sys.path (run in path[0], not here)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in [*path, ROOT])}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        check=False, capture_output=True, text=True, env=env, cwd=path[0], timeout=timeout,
    )


def fake_distribution(site: Path, name: str, entry_points: str) -> None:
    """Installed metadata for `name` (version 0.1.0) with `entry_points` as its entry_points.txt."""
    info = site / f"{name}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_help_lists_the_service_commands() -> None:
    result = run("--help")
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines() if line.strip()}
    assert set(SERVICE_COMMANDS) | {"prepare", "inspect", "reshard", "bench", "advise", "estimate-memory"} <= listed
    worker = run("worker", "--help")
    assert worker.returncode == 0 and "--concurrency" in worker.stdout, worker.stderr


def test_the_entry_point_table_and_its_fallback_name_the_same_commands() -> None:
    tomllib = pytest.importorskip("tomllib")
    from pipeline.cli.plugins import ENTRY_POINT_GROUP, OWN_COMMANDS

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert declared == OWN_COMMANDS
    assert sorted(declared) == list(SERVICE_COMMANDS)


def test_the_library_imports_no_service_and_no_charts() -> None:
    code = (
        "import sys, pipeline, pipeline.cli\n"
        "from pipeline.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = ('celery', 'kombu', 'redis', 'redbeat', 'matplotlib')\n"
        "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "submit" in result.stdout  # the service's commands were listed ...
    assert result.stdout.splitlines()[-1] == "LOADED []"  # ... without importing Celery or Redis


def test_installed_entry_points_add_commands_and_a_broken_one_only_warns(tmp_path: Path) -> None:
    (tmp_path / "hello_plugin.py").write_text(
        "import click\n\n@click.command()\n@click.argument('name')\ndef hello(name):\n"
        "    '''Say hello.'''\n    click.echo(f'hello {name}')\n"
    )
    fake_distribution(tmp_path, "hello_plugin", "[gpufeed.commands]\nhello = hello_plugin:hello\n")
    fake_distribution(tmp_path, "broken_plugin", "[gpufeed.commands]\nbroken = no_such_module:command\n")

    hello = run_with_path("hello", "world", path=[tmp_path])
    assert hello.returncode == 0 and hello.stdout == "hello world\n", hello.stderr
    listing = run_with_path("--help", path=[tmp_path])
    assert listing.returncode == 0 and "hello" in listing.stdout and "Say hello." in listing.stdout
    assert "cannot load the broken command (no_such_module:command)" in listing.stderr
    assert "submit" in listing.stdout  # gpufeed's own commands are still there
    broken = run_with_path("broken", path=[tmp_path])
    assert broken.returncode == 2 and "No such command 'broken'" in broken.stderr


def test_metadata_that_declares_the_commands_is_used_and_metadata_without_them_falls_back(tmp_path: Path) -> None:
    # gpufeed's metadata with no entry points (an editable install older than them): the fallback.
    old = tmp_path / "old"
    fake_distribution(old, "gpufeed", "[console_scripts]\ngpufeed = pipeline.cli:main\n")
    result = run_with_path("--help", path=[old])
    assert result.returncode == 0 and all(f"  {name} " in result.stdout for name in SERVICE_COMMANDS), result.stdout

    # Metadata that declares them: exactly those (here one of them, so the fallback is visibly off).
    new = tmp_path / "new"
    fake_distribution(new, "gpufeed", "[gpufeed.commands]\nstatus = worker.cli:status\n")
    result = run_with_path("--help", path=[new])
    assert result.returncode == 0, result.stderr
    assert "  status " in result.stdout and "  submit " not in result.stdout and "  worker " not in result.stdout


def test_the_fallback_never_takes_commands_from_another_worker_package(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    (other / "worker").mkdir(parents=True)
    (other / "worker" / "__init__.py").write_text("")
    (other / "worker" / "cli.py").write_text("raise SystemExit('foreign code ran')\n")
    fake_distribution(other, "gpufeed", "[console_scripts]\ngpufeed = pipeline.cli:main\n")
    result = run_with_path("--help", path=[other])
    assert result.returncode == 0, result.stderr
    assert "foreign code ran" not in result.stdout + result.stderr
    assert "  submit " not in result.stdout and "  prepare " in result.stdout


# ---------------------------------------------------------------------------
# A missing extra is named by the command that needs it, with the install line

HIDE_MODULES = """
import sys

class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide())
sys.argv = ["gpufeed", *ARGS]
from pipeline.cli import main
main()
"""


def run_without(hidden: tuple[str, ...], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The `gpufeed` command in an interpreter where the `hidden` packages cannot be imported."""
    code = f"HIDDEN = {hidden!r}\nARGS = {list(args)!r}\n" + HIDE_MODULES
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "args",
    [
        ["worker"],
        ["worker", "--concurrency", "2", "--pool", "solo"],
        ["beat"],
        ["submit", "prepare", "/data/raw", "/data/out", "--size", "128"],
        ["submit", "reshard", "/data/out", "--shard-count", "4"],
        ["submit", "bench-disk", "/data"],
        ["status", "abc123"],
        ["jobs"],
        ["cancel", "abc123"],
        ["schedule", "add", "nightly", "--every", "1d", "reshard", "/data/out", "--multiple-of", "8"],
        ["schedule", "list"],
        ["schedule", "remove", "nightly"],
    ],
    ids=lambda args: "-".join(a for a in args if not a.startswith(("/", "-")) and not a[0].isdigit())[:40],
)
def test_service_commands_without_the_service_extra_print_the_install_line(args: list[str]) -> None:
    result = run_without(("celery", "kombu", "redbeat"), *args)
    assert result.returncode == 1
    assert result.stderr == f"gpufeed: error: gpufeed {args[0]} needs the service extra: pip install 'gpufeed[service]'\n"
    assert result.stdout == ""


def test_without_the_service_extra_help_and_local_commands_still_work(tmp_path: Path) -> None:
    hidden = ("celery", "kombu", "redbeat", "redis")
    listing = run_without(hidden, "--help")
    assert listing.returncode == 0 and "  worker " in listing.stdout, listing.stderr
    usage = run_without(hidden, "submit", "prepare", "--help")
    assert usage.returncode == 0 and "--shard-size" in usage.stdout, usage.stderr
    demo = run_without(hidden, "demo-data", str(tmp_path / "raw"), "--n", "2", "--min-side", "32", "--max-side", "48", "--workers", "0")
    assert demo.returncode == 0 and "wrote 2 images" in demo.stdout, demo.stderr


def test_doctor_without_redis_py_says_so_and_succeeds() -> None:
    from pipeline.measure.doctor import REDIS_CLIENT_MISSING

    result = run_without(("redis",), "doctor", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["redis"]["reachable"] is False and report["redis"]["error"] == REDIS_CLIENT_MISSING
    assert "pip install 'gpufeed[service]'" in REDIS_CLIENT_MISSING


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "disk", "{tmp}/disk", "--size", "1MiB"],
        ["bench", "decode", "{tmp}/raw"],
        ["bench", "loader", "{tmp}/shards"],
        ["advise", "{tmp}/raw", "--target", "{tmp}/target"],
        ["estimate-memory", "--model", "torchvision.models:resnet18"],
    ],
    ids=lambda args: "-".join(a for a in args if not a.startswith(("{", "-")))[:30],
)
def test_plot_without_matplotlib_prints_the_install_line_before_measuring(args: list[str], tmp_path: Path) -> None:
    args = [arg.format(tmp=tmp_path) for arg in args] + ["--plot", str(tmp_path / "chart.png")]
    result = run_without(("matplotlib",), *args)
    assert result.returncode == 1
    assert result.stderr == "gpufeed: error: --plot needs the plots extra: pip install 'gpufeed[plots]'\n"
    assert list(tmp_path.iterdir()) == []  # refused before anything was measured or written


# ---------------------------------------------------------------------------
# Re-running prepare: SRC however it is spelled, repairs, counts in words


def test_prepare_rerun_from_anywhere_resumes_names_differences_and_repairs(small_source: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "raw").symlink_to(small_source, target_is_directory=True)
    flags = ("--size", "64", "--shard-count", "1", "--workers", "0", "--quiet")
    first = run("prepare", "raw", "shards", *flags, cwd=work)
    assert first.returncode == 0, first.stderr
    assert "done: 4 samples, 0 rejected (of 4 listed), 4 shards" in first.stdout
    assert "4 images in" in first.stdout and "with 1 worker process" in first.stdout
    (work / "sub").mkdir()
    for src, out, cwd in (("raw/", "shards", work), ("./raw", "shards", work), (str(work / "raw"), "../shards", work / "sub")):
        again = run("prepare", src, out, *flags, cwd=cwd)
        assert again.returncode == 0, again.stderr
        assert "already prepared with these settings" in again.stdout and "nothing to do" in again.stdout, src
    refused = run("prepare", "raw", "shards", "--size", "32", *flags[2:], cwd=work)
    assert refused.returncode == 1
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--size: 32 here, 64 in shards/manifest.json" in lines[0], refused.stderr
    (work / "shards" / "shard-000002.tar").unlink()
    repaired = run("prepare", "raw", "shards", *flags, cwd=work)
    assert repaired.returncode == 0, repaired.stderr
    assert "rewrote 1 of 4 shards: shard-000002.tar was missing" in repaired.stdout
    assert run("inspect", "shards", "--verify", cwd=work).returncode == 0


def test_prepare_of_a_source_without_usable_images_fails_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "broken.jpg").write_bytes(b"not an image")
    result = run("prepare", str(tmp_path / "raw"), "out", "--workers", "0", "--quiet", cwd=tmp_path)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        f"gpufeed: error: no usable images in {tmp_path / 'raw'}: 1 file listed, 1 rejected (see out/rejected.jsonl)"
    ], result.stderr
    assert not (tmp_path / "out" / "manifest.json").exists() and (tmp_path / "out" / "rejected.jsonl").exists()
    Image.new("RGB", (40, 30), (10, 200, 30)).save(tmp_path / "raw" / "good.jpg")
    fixed = run("prepare", "raw", "out", "--size", "16", "--workers", "0", "--quiet", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert "done: 1 sample, 1 rejected (of 2 listed), 1 shard, " in fixed.stdout
    assert "2 images in" in fixed.stdout
