"""The `gpufeed` command as a user runs it: in a subprocess, judged by exit code and output."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
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
    as_json = run("prepare", str(src), str(tmp_path / "out"), "--quiet", "--workers", "0", "--json", *flags)
    assert as_json.returncode == result.returncode and as_json.stderr == ""
    assert json.loads(as_json.stdout) == {"error": lines[0].removeprefix("gpufeed: error: ")}


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--shard-samples", "0"], "--shard-samples must be at least 1"),
        (["--size", "7"], "--size must be between 8"),
        (["--crop-scale", "0.9,0.1"], "--crop-scale must be two numbers"),
        (["--jpeg-restart", "-1"], "--jpeg-restart must be"),
    ],
)
def test_prepare_errors_name_the_option_the_library_names_the_setting(
    flags: list[str], expected: str, small_source: Path, tmp_path: Path
) -> None:
    result = run("prepare", str(small_source), str(tmp_path / "out"), "--quiet", "--workers", "0", *flags)
    assert result.returncode == 1
    assert result.stderr.startswith(f"gpufeed: error: {expected}"), result.stderr


# ---------------------------------------------------------------------------
# The service's commands come through entry points; the library never imports the service

ROOT = Path(__file__).resolve().parents[2]
SERVICE_COMMANDS = ("beat", "cancel", "flower", "jobs", "schedule", "status", "submit", "worker")


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
        ["flower", "--port", "5556", "--basic-auth=user:password"],
        ["submit", "prepare", "/data/raw", "/data/out", "--size", "128"],
        ["submit", "reshard", "/data/out", "--shard-samples", "4"],
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


def test_flower_without_flower_installed_prints_the_install_line() -> None:
    result = run_without(("flower",), "flower", "--port", "5556")
    assert result.returncode == 1
    assert result.stderr == "gpufeed: error: gpufeed flower needs the service extra: pip install 'gpufeed[service]'\n"
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
        ["bench", "disk", "{tmp}/disk", "--file-size", "1MiB"],
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
    flags = ("--size", "64", "--shard-samples", "1", "--workers", "0", "--quiet")
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
    assert "pass --overwrite" in lines[0] and "overwrite=True" not in lines[0], lines[0]
    other = run("prepare", "raw", "shards", "--upscale", "--no-flip", "--shard-samples", "2", *flags[:2], *flags[4:], "--json", cwd=work)
    error = json.loads(other.stdout)["error"]  # the library names the spec's fields; the command, its options
    assert other.returncode == 1 and "--upscale: given here, not given in shards/manifest.json" in error, error
    assert "--no-flip: given here, not given in" in error and "--shard-samples: 2 here, 1 in" in error, error
    assert "resize." not in error and "shards.max_samples" not in error and "True" not in error, error
    (work / "shards" / "shard-000002.tar").unlink()
    repaired = run("prepare", "raw", "shards", *flags, cwd=work)
    assert repaired.returncode == 0, repaired.stderr
    assert "rewrote 1 of 4 shards: shard-000002.tar was missing" in repaired.stdout
    assert run("inspect", "shards", "--verify", cwd=work).returncode == 0


def test_prepare_in_aspect_order_records_it_and_a_run_in_another_order_is_refused(small_source: Path, tmp_path: Path) -> None:
    flags = ("--size", "48", "--shard-samples", "2", "--workers", "0", "--quiet")
    first = run("prepare", str(small_source), str(tmp_path / "shards"), "--order", "aspect", *flags)
    assert first.returncode == 0, first.stderr
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["params"]["order"] == "aspect"
    refused = run("prepare", str(small_source), str(tmp_path / "shards"), *flags)
    assert refused.returncode == 1 and "--order: nothing recorded here, aspect in" in refused.stderr, refused.stderr
    wrong = run("prepare", str(small_source), str(tmp_path / "other"), "--order", "size", *flags)
    assert wrong.returncode == 2 and "'size' is not one of 'shuffle', 'aspect'" in wrong.stderr, wrong.stderr


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


# One vocabulary: every option documented, renamed options keep their old spelling as hidden aliases


def all_commands() -> list[tuple[str, click.Command]]:
    """(`gpufeed …` path, command) for the group and every command under it, the service's included."""
    from pipeline.cli import main

    found: list[tuple[str, click.Command]] = []

    def walk(path: str, command: click.Command) -> None:
        found.append((path, command))
        if isinstance(command, click.Group):
            ctx = click.Context(command, info_name=path)
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None, f"{path} {name} cannot be loaded"
                walk(f"{path} {name}", sub)

    walk("gpufeed", main)
    return found


def test_every_option_of_every_command_has_help() -> None:
    commands = dict(all_commands())
    assert {"gpufeed submit prepare", "gpufeed schedule add", "gpufeed bench loader", "gpufeed worker"} <= set(commands)
    missing = [
        f"{path} {param.opts[0]}"
        for path, command in commands.items()
        for param in command.params
        if isinstance(param, click.Option) and not param.hidden and not (param.help or "").strip()
    ]
    assert missing == []


def test_old_spellings_stay_out_of_the_help() -> None:
    from pipeline.cli.common import RenamedOption

    for path, command in all_commands():
        renamed = [param for param in command.params if isinstance(param, RenamedOption)]
        if not renamed:
            continue
        text = command.get_help(click.Context(command, info_name=path))
        names = {name for param in command.params if isinstance(param, click.Option) for name in param.opts}
        for param in renamed:
            for old in param.old_names:
                if old not in names:  # the same word may be another option's (bench decode --size)
                    assert f"{old} " not in text and f"{old}," not in text, (path, old)


def parsed(path: str, *args: str) -> dict[str, Any]:
    """The parameters `gpufeed PATH ARGS` parses to (nothing runs)."""
    command = dict(all_commands())[path]
    return dict(command.make_context(path, list(args)).params)


RENAMES = [
    # (command, new spelling, old spelling, value, parameter, parsed value)
    ("gpufeed prepare", "--shard-samples", "--shard-count", "100", "shard_samples", 100),
    ("gpufeed submit prepare", "--shard-samples", "--shard-count", "100", "shard_samples", 100),
    ("gpufeed reshard", "--shard-samples", "--shard-count", "50", "shard_samples", 50),
    ("gpufeed submit reshard", "--shard-samples", "--shard-count", "50", "shard_samples", 50),
    ("gpufeed bench disk", "--file-size", "--size", "64MiB", "file_size", "64MiB"),
    ("gpufeed bench decode", "--crop", "--target", "160", "crop", 160),
    ("gpufeed bench decode", "--duration", "--seconds", "0.25", "duration", 0.25),
    ("gpufeed bench loader", "--num-workers", "--workers", "1,2", "num_workers", "1,2"),
    ("gpufeed bench loader", "--duration", "--seconds", "3", "duration", 3.0),
    ("gpufeed advise", "--duration", "--seconds", "1m", "duration", 60.0),
    ("gpufeed demo-data", "-n", "--n", "12", "count", 12),
]
ARGUMENTS = {"gpufeed advise": ["raw", "--target", "t"], "gpufeed submit prepare": ["raw", "out"], "gpufeed prepare": ["raw", "out"]}


@pytest.mark.parametrize(("path", "new", "old", "value", "name", "expected"), RENAMES, ids=lambda v: str(v))
def test_a_renamed_option_and_its_old_spelling_mean_the_same(
    path: str, new: str, old: str, value: str, name: str, expected: object, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ARGUMENTS.get(path, ["x"])
    assert parsed(path, *args, new, value)[name] == expected
    assert capsys.readouterr().err == ""
    assert parsed(path, *args, old, value)[name] == expected
    spelled = "/".join(next(p for p in dict(all_commands())[path].params if p.name == name).opts)
    assert capsys.readouterr().err == f"gpufeed: note: {old} is deprecated; use {spelled}\n"
    with pytest.raises(click.UsageError, match=f"give .* once: {old} is its old name"):
        parsed(path, *args, new, value, old, value)


def test_format_jpg_is_jpeg_and_durations_take_units() -> None:
    assert parsed("gpufeed prepare", "raw", "out", "--format", "jpg")["fmt"] == "jpeg"
    assert parsed("gpufeed submit prepare", "raw", "out", "--format", "JPG")["fmt"] == "jpeg"
    assert parsed("gpufeed bench disk", "x", "--duration", "2s")["duration"] == 2.0
    assert parsed("gpufeed submit bench-disk", "x", "--duration", "1m")["duration"] == 60.0
    with pytest.raises(click.BadParameter, match="not a duration: 'soon'"):
        parsed("gpufeed bench disk", "x", "--duration", "soon")


def test_renamed_options_work_end_to_end(small_source: Path, tmp_path: Path) -> None:
    made = run("demo-data", str(tmp_path / "raw"), "-n", "3", "--min-side", "32", "--max-side", "48", "--workers", "0")
    assert made.returncode == 0 and "wrote 3 images" in made.stdout, made.stderr
    new = run("prepare", str(small_source), str(tmp_path / "new"), "--shard-samples", "1", "--format", "jpg", "-q", "--workers", "0")
    assert new.returncode == 0 and new.stderr == "", new.stderr
    old = run("prepare", str(small_source), str(tmp_path / "old"), "--shard-count", "1", "--format", "jpg", "-q", "--workers", "0")
    assert old.returncode == 0, old.stderr
    assert old.stderr == "gpufeed: note: --shard-count is deprecated; use --shard-samples\n"
    for out in ("new", "old"):
        manifest = json.loads((tmp_path / out / "manifest.json").read_text())
        assert len(manifest["shards"]) == 4 and manifest["params"]["encode"]["format"] == "jpeg"  # 4 images, 1 a shard


def test_reshard_shards_sets_the_number_of_shards(small_source: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    assert run("prepare", str(small_source), str(dataset), "-q", "--workers", "0").returncode == 0
    result = run("reshard", str(dataset), "--shards", "3", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["shards_before"], summary["shards_after"], summary["samples"]) == (1, 3, 4)
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert sorted(shard["samples"] for shard in manifest["shards"]) == [1, 1, 2]
    for extra in (["--multiple-of", "2"], ["--shard-samples", "2"]):
        refused = run("reshard", str(dataset), "--shards", "2", *extra)
        assert refused.returncode == 2 and f"--shards sets the layout on its own; give it without {extra[0]}" in refused.stderr


def test_reshard_errors_name_the_options_the_library_names_the_settings(tmp_path: Path) -> None:
    dataset = str(tmp_path / "ds")
    for flags, expected in (
        ([], "give --shard-samples, --shards, --shard-size or --multiple-of (or --reaugment with --seed S)"),
        (["--multiple-of", "2", "--seed", "3"], "--seed only applies with --reaugment (re-packing"),
        (["--reaugment"], "--reaugment needs --seed S"),
        (["--shard-samples", "0"], "--shard-samples must be at least 1"),
        (["--multiple-of", "2", "--out", dataset], "--out must differ from DATASET"),
    ):
        refused = run("reshard", dataset, *flags)
        assert refused.returncode == 1 and f"gpufeed: error: {expected}" in refused.stderr, (flags, refused.stderr)


# ---------------------------------------------------------------------------
# Errors are one line (or, with --json, one JSON object on stdout), never a traceback


def json_commands() -> set[str]:
    return {path for path, command in all_commands() if any(param.name == "as_json" for param in command.params)}


@pytest.fixture
def no_redis(get_free_port: Callable[[], int]) -> dict[str, str]:
    return {**os.environ, "GPUFEED_BROKER_URL": f"redis://127.0.0.1:{get_free_port()}/0", "GPUFEED_ALLOWED_ROOTS": "/"}


JSON_ERRORS = {
    "gpufeed prepare": ["prepare", "{tmp}/missing", "{tmp}/out", "-q"],
    "gpufeed inspect": ["inspect", "{tmp}/missing"],
    "gpufeed reshard": ["reshard", "{tmp}/missing", "--shards", "2"],
    "gpufeed bench disk": ["bench", "disk", "{tmp}/disk", "--file-size", "lots"],
    "gpufeed bench decode": ["bench", "decode", "{tmp}/missing"],
    "gpufeed bench loader": ["bench", "loader", "{tmp}/missing"],
    "gpufeed advise": ["advise", "{tmp}/missing", "--target", "{tmp}/t"],
    "gpufeed estimate-memory": ["estimate-memory", "--model", "no_such_module:make"],
    "gpufeed submit prepare": ["submit", "prepare", "{tmp}/raw", "{tmp}/out"],
    "gpufeed submit reshard": ["submit", "reshard", "{tmp}/ds", "--shards", "2"],
    "gpufeed submit bench-disk": ["submit", "bench-disk", "{tmp}"],
    "gpufeed status": ["status", "abc"],
    "gpufeed jobs": ["jobs"],
    "gpufeed cancel": ["cancel", "abc"],
    "gpufeed schedule add": ["schedule", "add", "nightly", "--every", "1d", "<json>", "reshard", "{tmp}/ds", "--shards", "2"],
    "gpufeed schedule list": ["schedule", "list"],
    "gpufeed stage": ["stage", "{tmp}/missing", "{tmp}/dest"],
}


def test_every_command_with_json_is_checked_below() -> None:
    # doctor reports what it finds (Redis down included) as its result, and succeeds.
    assert json_commands() == set(JSON_ERRORS) | {"gpufeed doctor"}


@pytest.mark.parametrize("path", sorted(JSON_ERRORS))
def test_with_json_an_error_is_one_json_object_on_stdout(path: str, tmp_path: Path, no_redis: dict[str, str]) -> None:
    args = [arg.format(tmp=tmp_path) for arg in JSON_ERRORS[path]]
    if "<json>" not in args:
        args.append("<json>")
    command = [sys.executable, "-m", "pipeline"]
    plain = subprocess.run(
        [*command, *(a for a in args if a != "<json>")], capture_output=True, text=True, env=no_redis, timeout=120
    )
    assert plain.returncode != 0 and plain.stdout == ""
    assert plain.stderr.startswith("gpufeed: error: ") and len(plain.stderr.splitlines()) == 1, plain.stderr
    as_json = subprocess.run(
        [*command, *("--json" if a == "<json>" else a for a in args)], capture_output=True, text=True, env=no_redis,
        timeout=120,
    )  # fmt: skip
    assert as_json.returncode == plain.returncode, as_json.stderr
    assert "Traceback" not in as_json.stderr
    assert json.loads(as_json.stdout) == {"error": plain.stderr.removeprefix("gpufeed: error: ").rstrip("\n")}


@pytest.fixture
def read_only_out(tmp_path: Path) -> Iterator[Path]:
    """An existing OUT that cannot be written: a read-only tmpfs (as root), else a folder without write permission."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if os.geteuid() != 0:
        (mount / "out").mkdir()
        (mount / "out").chmod(0o555)
        yield mount / "out"
        (mount / "out").chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("root here cannot mount a read-only tmpfs (and permission bits do not stop root)")
    try:
        (mount / "out").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, capture_output=True)
        yield mount / "out"
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_read_only_out_is_one_line_that_says_what_to_do(small_source: Path, read_only_out: Path) -> None:
    result = run("prepare", str(small_source), str(read_only_out), "-q", "--workers", "0")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpufeed: error: {read_only_out}"), result.stderr
    assert "read-only file system: choose a folder on a disk you can write to" in lines[0] or (
        "no permission to use" in lines[0] and "change its permissions or choose another folder" in lines[0]
    )


def test_summaries_are_whole_lines_and_paths_are_never_markup(small_source: Path, tmp_path: Path) -> None:
    # Printed into a pipe: no line broken at 80 columns; a path with brackets printed as it is (rich markup
    # would raise on `[/]` and swallow `[red]`).
    for name in ("data[/]", "[red]x"):
        out = tmp_path / ("a-folder-with-a-name-long-enough-to-pass-eighty-columns-" + name) / name
        first = run("prepare", str(small_source), str(out), "-q", "--workers", "0", "--shard-samples", "2")
        assert first.returncode == 0, first.stderr
        assert f"manifest: {out}/manifest.json\n" in first.stdout
        shard = out / "shard-000001.tar"
        size = shard.stat().st_size
        os.truncate(shard, 1024)
        # -q hides the progress bar only: the repair is reported.
        again = run("prepare", str(small_source), str(out), "-q", "--workers", "0", "--shard-samples", "2")
        assert again.returncode == 0, again.stderr
        assert again.stdout.startswith(
            f"rewrote 1 of 2 shards: shard-000001.tar had 1024 bytes, the manifest says {size}\n"
        ), again.stdout
        assert f"manifest: {out}/manifest.json\n" in again.stdout
        inspected = run("inspect", str(out))
        assert inspected.returncode == 0, inspected.stderr
        assert any(line.split() == ["dataset", str(out)] for line in inspected.stdout.splitlines()), inspected.stdout


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a disk too small for a prepare (needs root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_the_free_space_refusal_says_sizes_people_read_and_leaves_nothing(tmp_path: Path, small_disk: Path) -> None:
    source = tmp_path / "big"
    made = run("demo-data", str(source), "-n", "12", "--min-side", "600", "--max-side", "700", "--workers", "0")
    assert made.returncode == 0, made.stderr
    result = run("prepare", str(source), str(small_disk / "out"), "--size", "512", "--format", "png", "--workers", "0")
    assert result.returncode == 1
    line = result.stderr.strip()
    assert re.fullmatch(
        rf"gpufeed: error: {small_disk}/out has \d+(\.\d+)? (KiB|MiB) free but the shards need about \d+(\.\d+)? MiB "
        r"\(\+10 % margin\); free some space, pick another OUT, or pass --force",
        line,
    ), line
    out = small_disk / "out"
    assert not out.exists() or list(out.iterdir()) == []  # no OUT/.gpufeed (nor the OUT this run made) left behind


# ---------------------------------------------------------------------------
# The README and the demo script speak the same vocabulary


def command_lines(text: str) -> list[list[str]]:
    """Every `gpufeed …` command line in a text (README code blocks, a shell script), as arguments."""
    lines = []
    joined: list[str] = []
    for raw in text.splitlines():  # a line ending in a backslash goes on on the next one, as in a shell
        if raw.rstrip().endswith("\\"):
            joined.append(raw.rstrip()[:-1])
            continue
        raw, joined = " ".join([*joined, raw]), []
        line = raw.strip().removeprefix("docker compose exec worker ")
        if line.startswith("gpufeed ") and "<<" not in line:
            words = shlex.split(line, comments=True)
            lines.append([word for word in words[1:] if word != "&"])
    return lines


def test_the_readme_and_the_demo_use_no_old_spelling() -> None:
    from pipeline.cli.common import RenamedOption

    commands = dict(all_commands())
    docs = [path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))]  # the detail the README links to
    texts = [(ROOT / "README.md").read_text(), *docs, (ROOT / "scripts" / "demo.sh").read_text()]
    checked = 0
    for text in texts:
        for words in command_lines(text):
            path, rest = "gpufeed", list(words)
            while rest and f"{path} {rest[0]}" in commands:
                path = f"{path} {rest.pop(0)}"
            if path == "gpufeed schedule add" and "reshard" in rest:
                path, rest = "gpufeed reshard", rest[rest.index("reshard") + 1 :]
            if "--" in rest:  # `gpufeed watch … -- COMMAND`: the rest is the watched command's
                rest = rest[: rest.index("--")]
            old = {name for p in commands[path].params if isinstance(p, RenamedOption) for name in p.old_names}
            valid = {name for p in commands[path].params if isinstance(p, click.Option) for name in p.opts}
            used = {word.split("=")[0] for word in rest if word.startswith("-")}
            assert not (used & (old - valid)), (path, words)
            assert used <= valid | {"-h", "--help"}, (path, words, used - valid)
            checked += 1
    assert checked >= 20
    readme = "\n".join(texts[:-1])
    for retired in ("`--shard-count N`", "demo-data demo/raw --n", "`--size` sets the test file", "`--target 224`", "`--workers 1,2"):
        assert retired not in readme, retired


def test_prepare_and_inspect_say_the_task_a_coco_source_makes(tmp_path: Path) -> None:
    from pipeline.demo import make_coco_dataset

    instances = make_coco_dataset(str(tmp_path / "coco"), images=12, segmentation=None)  # boxes only
    out = tmp_path / "shards"
    done = run("prepare", instances, str(out), "--size", "64", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "task: detection" in done.stdout
    shown = run("inspect", str(out), "--json")
    summary = json.loads(shown.stdout)
    assert summary["task"] == "detection" and summary["fields"] == "boxes.npy, box_labels.npy, iscrowd.npy"
    assert "detection" in run("inspect", str(out)).stdout


def test_prepare_writes_each_yolo_split_apart(tmp_path: Path) -> None:
    from pipeline import demo

    root = demo.make_yolo_dataset(tmp_path / "yolo", 12)
    result = run("prepare", root, str(tmp_path / "out"), "--size", "64", "--quiet", "--json")
    assert result.returncode == 0, result.stderr
    splits = json.loads(result.stdout)["splits"]
    assert sorted(splits) == ["train", "val"] and all(s["samples"] == 6 and s["rejected"] == 0 for s in splits.values())
    keys = {}
    for name in ("train", "val"):
        manifest = json.loads((tmp_path / "out" / name / "manifest.json").read_text())
        assert manifest["task"] == "detection" and manifest["classes"] == ["cat", "dog", "bird"]
        assert manifest["params"]["split"] == name
        keys[name] = {json.loads(m)["source"] for m in _shard_jsons(tmp_path / "out" / name)}
    assert keys["train"].isdisjoint(keys["val"]) and all("/images/val/" in k for k in keys["val"])
    one = run("prepare", f"{root}/data.yaml", str(tmp_path / "val"), "--split", "val", "--size", "64", "--quiet")
    assert one.returncode == 0, one.stderr
    assert json.loads((tmp_path / "val" / "manifest.json").read_text())["samples"] == 6
    wrong = run("prepare", root, str(tmp_path / "x"), "--split", "nope", "--quiet")
    assert wrong.returncode != 0 and "has no split 'nope'; its splits: train, val" in wrong.stderr
    assert "Traceback" not in wrong.stderr


def _shard_jsons(folder: Path) -> list[bytes]:
    import tarfile

    found = []
    for shard in sorted(folder.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            found += [tar.extractfile(m).read() for m in tar if m.name.endswith(".json")]  # type: ignore[union-attr]
    return found
