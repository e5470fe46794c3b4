"""`compose.yaml` and the Dockerfile: valid against the Compose specification, and wired as the service needs.

There is no Docker engine on the development machines: the file is checked
against the Compose JSON schema (../shared/schemas/compose-spec.json, present
in CI), and with `docker compose config` where Docker is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
SCHEMA = ROOT.parent / "shared" / "schemas" / "compose-spec.json"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read compose.yaml (pip install pyyaml)")
    document = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(document, dict)
    return document


def test_compose_file_matches_the_compose_specification(compose: dict[str, Any]) -> None:
    if not SCHEMA.exists():
        pytest.skip(f"the Compose schema is not here ({SCHEMA}); CI has it")
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is needed to validate compose.yaml")
    import json

    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)  # the schema is draft-07
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def _docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=60, check=False)
    return probe.returncode == 0


def test_docker_compose_config_accepts_it() -> None:
    if not _docker_compose():
        pytest.skip("no `docker compose` on this machine (the schema test checks the file instead)")
    result = subprocess.run(  # pragma: no cover - needs Docker
        ["docker", "compose", "--file", str(COMPOSE), "config", "--quiet"],
        env={"GPUFEED_REDIS_PASSWORD": "test", "PATH": "/usr/bin:/bin:/usr/local/bin"},
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr  # pragma: no cover


def test_redis_is_persistent_password_protected_and_health_checked(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--requirepass" in command
    assert redis["healthcheck"]["test"] and "ping" in " ".join(redis["healthcheck"]["test"])
    assert any(str(v).endswith(":/data") for v in redis["volumes"]) and "redis-data" in compose["volumes"]


def test_workers_beat_and_flower(compose: dict[str, Any]) -> None:
    services = compose["services"]
    worker, beat, flower = services["worker"], services["beat"], services["flower"]
    assert worker["command"][:2] == ["gpufeed", "worker"] and beat["command"] == ["gpufeed", "beat"]
    assert "container_name" not in worker and worker["deploy"]["replicas"] >= 1  # scalable: --scale worker=N
    assert not worker.get("ports")  # replicas on one machine would fight over a host port
    for service in (worker, beat):
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        env = service["environment"]
        assert env["GPUFEED_ALLOWED_ROOTS"] == "/data:/shards"
        assert env["GPUFEED_BROKER_URL"].startswith("redis://:${GPUFEED_REDIS_PASSWORD") and "@redis:6379/0" in env["GPUFEED_BROKER_URL"]
        mounts = {volume["target"]: volume for volume in service["volumes"]}
        assert mounts["/data"]["read_only"] is True and "/shards" in mounts  # raw data in, shards out
    assert flower["command"][:2] == ["gpufeed", "flower"] and flower["image"] == worker["image"]  # the same app and broker
    assert flower["environment"]["GPUFEED_BROKER_URL"] == worker["environment"]["GPUFEED_BROKER_URL"]
    assert flower["ports"] == ["127.0.0.1:5555:5555"] and "5555" in flower["command"]  # published on loopback only


def test_dockerfile_builds_the_gpufeed_command() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    # The wheel is built from the whole tree and installed; no instruction names a file of the tree.
    assert "COPY . /src" in dockerfile and "pip wheel --no-deps --no-cache-dir /src" in dockerfile
    copies = [line.split()[1:] for line in dockerfile.splitlines() if line.startswith("COPY ")]
    assert all(source[0] == "." or source[0].startswith("--from=") for source in copies)
    assert "gpufeed-*.whl" in dockerfile
    assert "pillow-simd" in dockerfile and "USER gpufeed" in dockerfile
    assert 'CMD ["gpufeed", "worker"]' in dockerfile
