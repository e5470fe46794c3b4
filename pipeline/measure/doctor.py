"""`gpufeed doctor`: what this machine offers for feeding a GPU, and what is missing.

Every probe is defensive: a missing or broken package is reported, never raised,
so the report is most useful exactly when something is wrong. torch, PIL and
the other decoders are imported here, inside the probes, never at package import.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Any

from ..io.fs import redact_url
from ..units import format_bytes, format_count

# The service's Redis: doctor checks it, and the service's settings (worker/settings.py) take these from here.
DEFAULT_BROKER_URL = "redis://localhost:6379/0"
BROKER_URL_ENV = "GPUFEED_BROKER_URL"
REDIS_CLIENT_MISSING = "redis-py is not installed, so Redis was not checked: pip install 'gpufeed[service]'"
REDIS_TIMEOUT_S = 1.0

# (name shown, PIL format, image mode, extra save arguments, check on the image read back)
_FORMAT_PROBES: tuple[tuple[str, str, str, dict[str, Any], str], ...] = (
    ("JPEG", "JPEG", "RGB", {}, ""),
    ("PNG", "PNG", "RGB", {}, ""),
    ("WebP", "WEBP", "RGB", {}, ""),
    ("WebP alpha", "WEBP", "RGBA", {"lossless": True}, "alpha"),
    ("WebP animation", "WEBP", "RGB", {"save_all": True}, "frames"),
    ("TIFF compressed (libtiff)", "TIFF", "RGB", {"compression": "tiff_adobe_deflate"}, ""),
    ("JPEG 2000", "JPEG2000", "RGB", {}, ""),
    ("GIF", "GIF", "RGB", {}, ""),
    ("BMP", "BMP", "RGB", {}, ""),
)

# PIL.features names -> what the report calls them.
_PIL_LIBRARIES = {
    "jpg": ("codec", "libjpeg_api"),
    "zlib": ("codec", "zlib"),
    "webp": ("module", "libwebp"),
    "libtiff": ("codec", "libtiff"),
    "jpg_2000": ("codec", "openjpeg"),
    "littlecms2": ("module", "littlecms2"),
    "freetype2": ("module", "freetype2"),
}


def collect_report(redis_url: str | None = None) -> dict[str, Any]:
    """Probe the machine and return a JSON-serialisable report.

    Args:
        redis_url: the Redis to check; default ``$GPUFEED_BROKER_URL`` or
            ``redis://localhost:6379/0``.

    Returns:
        A dict with the sections ``gpufeed``, ``python``, ``platform``, ``torch``,
        ``pil``, ``decoders``, ``cpu``, ``memory``, ``redis`` and ``warnings``
        (a list of sentences). Never raises for a missing or broken component.
    """
    torch_info = probe_torch()
    report: dict[str, Any] = {
        "gpufeed": {"version": _dist_version("gpufeed") or "unknown"},
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": {"system": platform.system(), "machine": platform.machine(), "description": platform.platform()},
        "torch": torch_info,
        "pil": probe_pil(),
        "decoders": probe_decoders(cuda_available=bool(torch_info.get("cuda_available"))),
        "cpu": probe_cpu(),
        "memory": probe_memory(),
        "redis": check_redis(redis_url or os.environ.get(BROKER_URL_ENV) or DEFAULT_BROKER_URL),
    }
    report["warnings"] = find_warnings(report)
    return report


# ---------------------------------------------------------------------------
# Probes


def probe_torch() -> dict[str, Any]:
    """torch version, the CUDA it was built for, and the CUDA devices visible now."""
    if importlib.util.find_spec("torch") is None:
        return {"installed": False}
    try:
        import torch
    except Exception as exc:  # a broken install is worth reporting, not dying on
        return {"installed": True, "error": f"import failed: {_describe(exc)}"}
    info: dict[str, Any] = {
        "installed": True,
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": False,
        "devices": [],
    }
    try:
        info["cuda_available"] = bool(torch.cuda.is_available())
        for index in range(torch.cuda.device_count() if info["cuda_available"] else 0):
            props = torch.cuda.get_device_properties(index)
            info["devices"].append(
                {
                    "index": index,
                    "name": props.name,
                    "memory_bytes": int(props.total_memory),
                    "capability": f"{props.major}.{props.minor}",
                }
            )
    except Exception as exc:
        info["cuda_error"] = _describe(exc)
    return info


def probe_pil() -> dict[str, Any]:
    """Which PIL is active (Pillow-SIMD or Pillow), its SIMD level, codecs and formats."""
    try:
        import PIL
        from PIL import features
    except Exception as exc:
        return {"installed": False, "error": _describe(exc)}
    version = PIL.__version__
    distributions = {"Pillow-SIMD": _dist_version("Pillow-SIMD"), "Pillow": _dist_version("Pillow")}
    # Both distributions install the `PIL` package; the one whose version matches is active.
    flavour = "Pillow-SIMD" if distributions["Pillow-SIMD"] == version else "Pillow"
    info: dict[str, Any] = {
        "installed": True,
        "flavour": flavour,
        "version": version,
        "distributions": distributions,
        "path": os.path.dirname(PIL.__file__),
    }
    info.update(_simd_level(flavour))
    turbo = bool(_quiet(features.check_feature, "libjpeg_turbo"))
    info["libjpeg_turbo"] = turbo
    info["libjpeg_turbo_version"] = _quiet(features.version_feature, "libjpeg_turbo") if turbo else None
    info["libraries"] = {
        name: _pil_library_version(features, kind, key) for key, (kind, name) in _PIL_LIBRARIES.items()
    }
    info["formats"] = {name: _roundtrips(fmt, mode, save, check) for name, fmt, mode, save, check in _FORMAT_PROBES}
    return info


def probe_decoders(cuda_available: bool = False) -> dict[str, dict[str, Any]]:
    """JPEG decoders besides PIL: region (gpufeed's own), simplejpeg, PyTurboJPEG, OpenCV, torchvision (nvjpeg)."""
    return {
        "region": probe_region_decoder(),
        "simplejpeg": _probe_module("simplejpeg", "simplejpeg", lambda mod: mod.decode_jpeg(_tiny_jpeg())),
        "PyTurboJPEG": _probe_module("turbojpeg", "PyTurboJPEG", lambda mod: mod.TurboJPEG()),
        "opencv": _probe_module("cv2", None, lambda mod: None),
        "torchvision": _probe_torchvision(cuda_available),
    }


def probe_region_decoder() -> dict[str, Any]:
    """gpufeed's native library (the loader's region decoder and resizer, prepare's YCbCr path): where it was
    loaded from (``library``: "installed extension at PATH", "built on first use at PATH" or "missing: REASON"),
    and does it decode?"""
    from .. import native

    where = native.library_info()  # loads it without the missing-library warning: this report says it
    info: dict[str, Any] = {
        "installed": False,
        "version": "libjpeg-turbo",
        "library": where.summary,
        "origin": where.origin,
        "path": str(where.path) if where.path is not None else None,
    }
    lib = native.library(warn=False)
    if lib is None:
        info["error"] = where.problem
        return info
    info["installed"] = True
    try:
        native.RegionDecoder(lib).header(_tiny_jpeg())
        kernels = "AVX2" if platform.machine() == "x86_64" and probe_cpu().get("avx2") else "scalar"
        info["resize"] = (
            f"in C (16-bit weights, {kernels} kernels) whichever PIL is active, "
            f"within one level of its pixels (PSNR >= {native.bindings.MIN_PSNR_DB['bilinear']:.0f} dB)"
        )
        info["prepare"] = _probe_ycc_path()
        built = "installed" if where.origin == "extension" else "built on first use"
        info["version"] = (
            f"(libjpeg-turbo, {built}; the loader's JPEG decoder, resizing {info['resize']}; "
            f"prepare's JPEG-to-JPEG path: {info['prepare']})"
        )
    except Exception as exc:  # a broken build is reported, not raised
        info["error"] = str(exc)[:200]
    return info


def probe_cpu() -> dict[str, Any]:
    """Cores this process may use (affinity, cgroup quota) against the machine's total."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        available = os.cpu_count() or 1
    cpuinfo = _read_text("/proc/cpuinfo") or ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    flag_set = set(flags.group(1).split()) if flags else set()
    return {
        "available": available,
        "total": os.cpu_count() or available,
        "quota": _cgroup_cpu_quota(),
        "model": model.group(1).strip() if model else platform.processor() or None,
        "avx2": ("avx2" in flag_set) if flags else None,
    }


def probe_memory() -> dict[str, Any]:
    """Total and available RAM, and the cgroup memory limit when there is one."""
    info: dict[str, Any] = {"total_bytes": None, "available_bytes": None, "limit_bytes": _cgroup_memory_limit()}
    try:
        import psutil

        memory = psutil.virtual_memory()
        info["total_bytes"], info["available_bytes"] = int(memory.total), int(memory.available)
    except Exception:
        meminfo = _read_text("/proc/meminfo") or ""
        for key, field in (("MemTotal", "total_bytes"), ("MemAvailable", "available_bytes")):
            found = re.search(rf"^{key}:\s*(\d+) kB", meminfo, re.MULTILINE)
            if found:
                info[field] = int(found.group(1)) * 1024
    return info


def check_redis(url: str, timeout: float = REDIS_TIMEOUT_S) -> dict[str, Any]:
    """Whether a Redis answers at `url` within `timeout` seconds; never raises.

    Returns:
        ``{"url": <password hidden>, "reachable": bool, "version": str | None, "error": str | None}``;
        a server that answers but refuses us (wrong password) counts as reachable, with the error.
    """
    info: dict[str, Any] = {"url": redact_url(url), "reachable": False, "version": None, "error": None}
    try:
        import redis
    except ImportError:  # the service extra is not installed: nothing here needs Redis
        info["error"] = REDIS_CLIENT_MISSING
        return info
    try:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis.from_url(
            url, socket_connect_timeout=timeout, socket_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )
        try:
            info["version"] = client.info("server").get("redis_version")
            info["reachable"] = True
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            raise
        except redis.exceptions.RedisError as exc:
            info["reachable"] = True
            info["error"] = _describe(exc)
        finally:
            client.close()
    except Exception as exc:
        info["error"] = _describe(exc)
    return info


# ---------------------------------------------------------------------------
# Warnings and the text report


def find_warnings(report: dict[str, Any]) -> list[str]:
    """The problems in `report` that cost speed or features, one sentence each."""
    warnings: list[str] = []
    pil = report.get("pil", {})
    if not pil.get("installed"):
        return [f"PIL cannot be imported ({pil.get('error')}): gpufeed cannot decode images"]
    native_here = report.get("decoders", {}).get("region", {}).get("installed")
    if pil.get("flavour") != "Pillow-SIMD" and not native_here:
        warnings.append(
            "Pillow is active, not Pillow-SIMD, and gpufeed's native library is missing: resizing and colour "
            "conversion are several times slower (install the native library, or Pillow-SIMD as the README describes)"
        )
    elif pil.get("simd") == "none":
        warnings.append('Pillow-SIMD was compiled without SIMD instructions (build it with CC="cc -mavx2")')
    formats = pil.get("formats", {})
    if not formats.get("JPEG"):
        warnings.append("PIL cannot read JPEG: nearly every dataset will be rejected")
    elif not pil.get("libjpeg_turbo"):
        warnings.append("PIL's JPEG library is not libjpeg-turbo: JPEG decoding is slower")
    if not formats.get("WebP"):
        warnings.append("PIL has no WebP support: WebP sources are rejected and --format webp fails")
    if pil.get("distributions", {}).get("Pillow") and pil.get("distributions", {}).get("Pillow-SIMD"):
        warnings.append("both Pillow and Pillow-SIMD are installed; they overwrite each other's files")
    region = report.get("decoders", {}).get("region", {})
    if region and not region.get("installed"):
        from .. import native

        if region.get("error") != native.DISABLED:  # turned off on purpose
            warnings.append(
                f"gpufeed's native library is missing ({region.get('error')}): {native.MISSING_COST}; "
                f"to fix it, {native.MISSING_FIX}"
            )
    return warnings


def format_report(report: dict[str, Any]) -> str:
    """The report as aligned text lines for a terminal."""
    python, system = report["python"], report["platform"]["description"]
    lines = [
        f"gpufeed {report['gpufeed']['version']} on Python {python['version']} ({python['implementation']}), {system}"
    ]

    def row(name: str, text: str) -> None:
        lines.append(f"{name:<13}{text}")

    _format_torch(report["torch"], row)
    _format_pil(report["pil"], row)
    row("decoders", "; ".join(_format_decoder(name, d) for name, d in report["decoders"].items()))
    if "library" in report["decoders"].get("region", {}):
        row("native", report["decoders"]["region"]["library"])
    cpu = report["cpu"]
    quota = f", cgroup quota {cpu['quota']:g} cores" if cpu.get("quota") else ""
    avx2 = {True: ", AVX2", False: ", no AVX2", None: ""}[cpu.get("avx2")]
    row(
        "cores",
        f"{cpu['available']} available of {cpu['total']}{quota}{avx2}"
        + (f" ({cpu['model']})" if cpu.get("model") else ""),
    )
    memory = report["memory"]
    limit = f", cgroup limit {_gib(memory['limit_bytes'])}" if memory.get("limit_bytes") else ""
    row("memory", f"{_gib(memory['total_bytes'])} total, {_gib(memory['available_bytes'])} available{limit}")
    redis_info = report["redis"]
    if redis_info["reachable"]:
        state = f"reachable (Redis {redis_info['version']})" if redis_info["version"] else "reachable"
        state += f", but {redis_info['error']}" if redis_info["error"] else ""
    elif redis_info["error"] == REDIS_CLIENT_MISSING:
        state = f"{REDIS_CLIENT_MISSING} (only the service needs it)"
    else:
        state = f"not reachable ({redis_info['error']}); only the service needs it, `gpufeed prepare` does not"
    row("redis", f"{redis_info['url']}: {state}")
    lines.extend(f"warning: {warning}" for warning in report["warnings"])
    return "\n".join(lines)


def _format_torch(torch_info: dict[str, Any], row: Any) -> None:
    if not torch_info.get("installed"):
        row("torch", "not installed")
        return
    if "error" in torch_info:
        row("torch", torch_info["error"])
        return
    if torch_info["cuda_available"]:
        cuda = f"CUDA {torch_info['cuda_build']}, {format_count(len(torch_info['devices']), 'device')}"
    elif torch_info["cuda_build"]:
        cuda = f"built for CUDA {torch_info['cuda_build']} but no GPU is usable" + (
            f" ({torch_info['cuda_error']})" if torch_info.get("cuda_error") else ""
        )
    else:
        cuda = "CPU-only build, no CUDA"
    row("torch", f"{torch_info['version']}, {cuda}")
    for device in torch_info["devices"]:
        row(
            f"  cuda:{device['index']}",
            f"{device['name']}, {_gib(device['memory_bytes'])}, compute {device['capability']}",
        )


def _format_pil(pil: dict[str, Any], row: Any) -> None:
    if not pil.get("installed"):
        row("PIL", f"not importable ({pil.get('error')})")
        return
    simd = {"avx2": "SIMD: AVX2", "sse4": "SIMD: SSE4", "none": "no SIMD"}.get(pil.get("simd") or "", "SIMD: unknown")
    detail = f" ({pil['simd_detail']})" if pil.get("simd_detail") else ""
    row("PIL", f"{pil['flavour']} {pil['version']}, {simd}{detail}")
    libs = pil["libraries"]
    if pil["libjpeg_turbo"]:
        jpeg = f"libjpeg-turbo {pil['libjpeg_turbo_version']} (libjpeg API {libs['libjpeg_api']})"
    elif libs["libjpeg_api"]:
        jpeg = f"libjpeg {libs['libjpeg_api']} (not libjpeg-turbo)"
    else:
        jpeg = "no JPEG library"
    row("  jpeg", jpeg)
    readable = [name for name, ok in pil["formats"].items() if ok]
    missing = [name for name, ok in pil["formats"].items() if not ok]
    row("  formats", ", ".join(readable) or "none")
    if missing:
        row("  missing", ", ".join(missing))
    versions = ", ".join(f"{name} {version}" for name, version in libs.items() if version and name != "libjpeg_api")
    row("  libraries", versions or "none")


def _format_decoder(name: str, decoder: dict[str, Any]) -> str:
    if not decoder["installed"]:
        return f"{name}: not available ({decoder['error']})" if decoder.get("error") else f"{name}: not installed"
    text = f"{name} {decoder.get('version') or '?'}"
    if decoder.get("error"):
        text += f" (broken: {decoder['error']})"
    if "nvjpeg" in decoder:
        text += {True: " with nvjpeg", False: " without nvjpeg", None: " (nvjpeg: needs CUDA)"}[decoder["nvjpeg"]]
    return text


# ---------------------------------------------------------------------------
# Helpers


def _simd_level(flavour: str) -> dict[str, Any]:
    """The SIMD instruction set compiled into PIL's core module.

    Pillow-SIMD exposes no flag for it: its SSE4/AVX2 paths exist only when it was
    compiled with those instructions enabled, so look for them in the machine code.
    """
    if flavour != "Pillow-SIMD":
        return {"simd": "none", "simd_detail": "Pillow has no SIMD code paths"}
    objdump = shutil.which("objdump")
    spec = importlib.util.find_spec("PIL._imaging")
    if objdump is None or spec is None or not spec.origin:
        return {"simd": None, "simd_detail": "objdump not found, cannot inspect the build"}
    try:
        found = _scan_disassembly([objdump, "-d", "--no-show-raw-insn", spec.origin])
    except (OSError, subprocess.SubprocessError) as exc:
        return {"simd": None, "simd_detail": f"objdump failed: {_describe(exc)}"}
    return {"simd": found, "simd_detail": "from the instructions in PIL._imaging"}


def _scan_disassembly(command: list[str]) -> str:
    # ymm registers mean AVX2 code; pmulld/ptest/pextrd/pinsrd are SSE4.1, which plain x86-64 never emits.
    sse4 = re.compile(rb"\b(pmulld|ptest|pextrd|pinsrd|pmaxud|pminud|packusdw|pblendw)\b")
    found = "none"
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as process:
        assert process.stdout is not None
        tail = b""
        try:
            while chunk := process.stdout.read(1 << 20):
                text = tail + chunk
                if b"%ymm" in text:
                    return "avx2"
                if found == "none" and sse4.search(text):
                    found = "sse4"
                tail = chunk[-16:]
        finally:
            process.kill()
    return found


def _roundtrips(fmt: str, mode: str, save: dict[str, Any], check: str) -> bool:
    """Whether PIL writes and reads back a small image in `fmt` (with alpha / frames if asked)."""
    try:
        from PIL import Image

        color = (200, 30, 90, 128)[: len(mode)]
        frames = [Image.new(mode, (16, 16), color), Image.new(mode, (16, 16), (10, 120, 240, 255)[: len(mode)])]
        buffer = io.BytesIO()
        if check == "frames":
            frames[0].save(buffer, fmt, append_images=frames[1:], **save)
        else:
            frames[0].save(buffer, fmt, **save)
        buffer.seek(0)
        with Image.open(buffer) as image:
            image.load()
            if check == "alpha":
                return "A" in image.getbands()
            if check == "frames":
                return getattr(image, "n_frames", 1) == 2
            return image.size == (16, 16)
    except Exception:
        return False


def _pil_library_version(features: Any, kind: str, key: str) -> str | None:
    check = features.check_codec if kind == "codec" else features.check_module
    version = features.version_codec if kind == "codec" else features.version_module
    return _quiet(version, key) if _quiet(check, key) else None


def _probe_module(module: str, distribution: str | None, smoke: Any) -> dict[str, Any]:
    if importlib.util.find_spec(module) is None:
        return {"installed": False}
    info: dict[str, Any] = {"installed": True, "version": _dist_version(distribution) if distribution else None}
    try:
        imported = importlib.import_module(module)
        info["version"] = info["version"] or getattr(imported, "__version__", None)
        smoke(imported)
    except Exception as exc:
        info["error"] = _describe(exc)
    return info


def _probe_torchvision(cuda_available: bool) -> dict[str, Any]:
    info = _probe_module("torchvision", "torchvision", lambda mod: None)
    if not info["installed"] or "error" in info:
        return info
    info["nvjpeg"] = None
    if cuda_available:
        try:
            import torch
            import torchvision.io

            data = torch.frombuffer(bytearray(_tiny_jpeg()), dtype=torch.uint8)
            info["nvjpeg"] = torchvision.io.decode_jpeg(data, device="cuda").is_cuda
        except Exception as exc:
            info["nvjpeg"] = False
            info["nvjpeg_error"] = _describe(exc)
    return info


def _probe_ycc_path() -> str:
    """Whether prepare's YCbCr path (transcode.py) turns a 4:2:0 JPEG into one here."""
    from ..prepare.transcode import transcode_jpeg
    from ..specs import PrepareSpec, ResizeSpec

    made = transcode_jpeg(_tiny_jpeg(), PrepareSpec(source="-", out="-", resize=ResizeSpec(size=8)))
    return "YCbCr planes in C" if made is not None and made[2] == (8, 8) else "RGB through PIL (the C path failed)"


def _tiny_jpeg() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 140, 200)).save(buffer, "JPEG")
    return buffer.getvalue()


def _cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2, then v1), None when unlimited."""
    text = _read_text("/sys/fs/cgroup/cpu.max")
    if text:
        quota, _, period = text.partition(" ")
    else:
        quota = _read_text("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") or "max"
        period = _read_text("/sys/fs/cgroup/cpu/cpu.cfs_period_us") or ""
    try:
        return int(quota) / int(period) if int(quota) > 0 else None
    except ValueError:  # "max", or nothing to read
        return None


def _cgroup_memory_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = _read_text(path)
        if text and text.isdigit() and int(text) < 1 << 60:  # cgroup v1 says "no limit" with a huge number
            return int(text)
    return None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except (OSError, ValueError):
        return None


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _quiet(func: Any, *args: Any) -> Any:
    try:
        return func(*args)
    except Exception:
        return None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _gib(value: int | None) -> str:
    return format_bytes(value) if value else "unknown"
