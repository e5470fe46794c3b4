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
