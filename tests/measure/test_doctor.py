"""`gpufeed doctor`: the report must tell the truth about this machine."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import PIL
import pytest
from PIL import features

from pipeline.measure import doctor

if TYPE_CHECKING:
    from conftest import RedisServer

REPO = Path(__file__).resolve().parents[2]


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.fixture
def unused_redis_url(get_free_port: Callable[[], int]) -> str:
    return f"redis://127.0.0.1:{get_free_port()}/0"


@pytest.fixture(scope="module")
def report(get_free_port: Callable[[], int]) -> dict:
    # An unused port: fast, and keeps these checks independent of any Redis running here.
    return doctor.collect_report(redis_url=f"redis://127.0.0.1:{get_free_port()}/0")


def test_report_is_json_and_has_every_section(report: dict) -> None:
    assert json.loads(json.dumps(report)) == report
    for section in ("gpufeed", "python", "platform", "torch", "pil", "decoders", "cpu", "memory", "redis", "warnings"):
        assert section in report
    assert report["gpufeed"]["version"] == importlib.metadata.version("gpufeed")


def test_pil_flavour_matches_the_installed_distributions(report: dict) -> None:
    pil = report["pil"]
    simd_active = _installed("Pillow-SIMD") == PIL.__version__
    assert pil["version"] == PIL.__version__
    assert pil["flavour"] == ("Pillow-SIMD" if simd_active else "Pillow")
    assert pil["distributions"] == {"Pillow-SIMD": _installed("Pillow-SIMD"), "Pillow": _installed("Pillow")}
    if simd_active:
        assert PIL.__version__.split(".")[-1].startswith("post")
        assert not any("not Pillow-SIMD" in warning for warning in report["warnings"])
    else:
        assert pil["simd"] == "none"
        assert any("Pillow is active, not Pillow-SIMD" in warning for warning in report["warnings"])


def test_pil_codecs_agree_with_pil_features(report: dict) -> None:
    pil = report["pil"]
    assert pil["formats"]["JPEG"] is True
    assert pil["formats"]["PNG"] is True
    assert pil["formats"]["GIF"] is True and pil["formats"]["BMP"] is True
    assert pil["formats"]["WebP"] == bool(features.check_module("webp"))
    assert pil["formats"]["JPEG 2000"] == bool(features.check_codec("jpg_2000"))
    assert pil["libjpeg_turbo"] == bool(features.check_feature("libjpeg_turbo"))
    if pil["libjpeg_turbo"]:
        assert pil["libjpeg_turbo_version"] == features.version_feature("libjpeg_turbo")
    assert pil["libraries"]["libjpeg_api"] == features.version_codec("jpg")
    text = doctor.format_report(report)
    assert "JPEG" in text and pil["flavour"] in text


def test_torch_section_matches_torch(report: dict) -> None:
    torch = pytest.importorskip("torch")
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda_available"] == torch.cuda.is_available()
    assert len(report["torch"]["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_cores_and_memory_are_plausible(report: dict) -> None:
    cpu, memory = report["cpu"], report["memory"]
    assert cpu["available"] == len(os.sched_getaffinity(0))
    assert 1 <= cpu["available"] <= cpu["total"]
    assert 0 < memory["available_bytes"] <= memory["total_bytes"]


def test_reachable_redis_is_reported_reachable(redis_url: str) -> None:
    result = doctor.check_redis(redis_url)
    assert result["reachable"] is True, result
    assert result["version"]
    assert result["error"] is None


def test_unused_port_is_reported_unreachable_quickly(unused_redis_url: str) -> None:
    started = time.monotonic()
    result = doctor.check_redis(unused_redis_url)
    assert result["reachable"] is False
    assert result["error"]
    assert time.monotonic() - started < 3


def test_stopped_redis_becomes_unreachable(private_redis: RedisServer) -> None:
    assert doctor.check_redis(private_redis.url)["reachable"] is True
    private_redis.stop()
    assert doctor.check_redis(private_redis.url)["reachable"] is False


@pytest.mark.parametrize("url", ["not a url", "redis://127.0.0.1:notaport/0", "http://127.0.0.1:1/"])
def test_bad_redis_urls_never_raise(url: str) -> None:
    result = doctor.check_redis(url)
    assert result["reachable"] is False
    assert result["error"]


def test_passwords_never_appear_in_the_report(get_free_port: Callable[[], int]) -> None:
    url = f"redis://:s3cret@127.0.0.1:{get_free_port()}/0"
    result = doctor.check_redis(url)
    assert "s3cret" not in json.dumps(result)
    assert ":***@" in result["url"]


def test_broker_url_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, unused_redis_url: str) -> None:
    url = unused_redis_url.replace("/0", "/3")
    monkeypatch.setenv(doctor.BROKER_URL_ENV, url)
    assert doctor.collect_report()["redis"]["url"] == url


def test_warnings_name_plain_pillow_and_missing_webp(report: dict) -> None:
    degraded = json.loads(json.dumps(report))
    degraded["pil"]["flavour"] = "Pillow"
    degraded["pil"]["formats"]["WebP"] = False
    warnings = doctor.find_warnings(degraded)
    assert any("WebP" in warning for warning in warnings)
    # Plain Pillow costs nothing where gpufeed's native library resizes; only without it is it a warning.
    assert not any("not Pillow-SIMD" in warning for warning in warnings)
    degraded["decoders"]["region"] = {"installed": False, "error": "no compiler"}
    warnings = doctor.find_warnings(degraded)
    assert any("not Pillow-SIMD" in warning and "native library is missing" in warning for warning in warnings)
    degraded["warnings"] = warnings
    assert sum(line.startswith("warning: ") for line in doctor.format_report(degraded).splitlines()) == len(warnings)


def test_the_native_library_is_reported_with_where_it_came_from(report: dict) -> None:
    from pipeline import native

    region, where = report["decoders"]["region"], native.library_info()
    assert region["library"] == where.summary
    assert region["origin"] == where.origin and region["installed"] == (where.origin is not None)
    assert region["path"] == (str(where.path) if where.path is not None else None)
    assert f"native       {where.summary}" in doctor.format_report(report).splitlines()
    if where.origin is not None:
        assert {"extension": "installed", "cache": "built on first use"}[where.origin] in region["version"]


def _doctor_without_the_library(unused_redis_url: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # As in a checkout where pip built nothing and no compiler is at hand.
    code = (
        "from pipeline import native; native.installed_library = lambda: None; "
        f"from pipeline.cli import main; main(['doctor', '--redis-url', {unused_redis_url!r}])"
    )
    environment = {key: value for key, value in os.environ.items() if key != "GPUFEED_NO_NATIVE"}
    environment.update(PYTHONPATH=str(REPO), GPUFEED_CACHE=str(tmp_path), CC="/nonexistent/cc", **env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120, check=False
    )


def test_a_missing_native_library_is_reported_not_warned_about(unused_redis_url: str, tmp_path: Path) -> None:
    result = _doctor_without_the_library(unused_redis_url, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no log warning: the report says it
    lines = result.stdout.splitlines()
    assert "native       missing: no C compiler (/nonexistent/cc) to build the region JPEG decoder" in lines
    (warning,) = [line for line in lines if "native library is missing" in line]
    assert warning.startswith("warning: ") and "up to 2x slower" in warning and "apt-get install gcc" in warning


def test_a_native_library_turned_off_is_no_warning(unused_redis_url: str, tmp_path: Path) -> None:
    result = _doctor_without_the_library(unused_redis_url, tmp_path, GPUFEED_NO_NATIVE="1")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "native       missing: disabled by GPUFEED_NO_NATIVE" in result.stdout.splitlines()
    assert "native library is missing" not in result.stdout
