"""Shared fixtures: real Redis servers on loopback ports, and the `cuda` marker.

Redis for tests comes from GPUFEED_TEST_REDIS_URL (scripts/test.sh sets it) or
from a `redis-server` this session starts on a free 127.0.0.1 port. Tests never
talk to a non-loopback address.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest

if TYPE_CHECKING:
    import redis

REDIS_URL_ENV = "GPUFEED_TEST_REDIS_URL"
LOOPBACK = "127.0.0.1"
REDIS_START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def start_server(
    command: Callable[[int], list[str]],
    log: Path,
    ready: Callable[[int], bool],
    *,
    port: int = 0,
    timeout_s: float,
    what: str,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a server process on a loopback port and poll until it answers; returns (process, port).

    Args:
        command: the command line for a port.
        log: the file its output is appended to (its end is shown when it does not start).
        ready: whether the server on that port answers yet (never raises).
        port: the port; 0 picks a free one, and another after a failed start (it may
            be taken between choosing and binding it), up to five times.
        timeout_s: how long one start may take.
        what: the server, as the error names it.

    Raises:
        RuntimeError: the server did not start.
    """
    attempts = 1 if port else 5
    chosen = port
    for _ in range(attempts):
        chosen = port or free_port()
        with open(log, "ab") as output:  # the process keeps its own copy of the file
            process = subprocess.Popen(
                command(chosen),
                stdout=output,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and process.poll() is None:
            if ready(chosen):
                return process, chosen
            time.sleep(0.05)
        end_process(process, kill=True)
    tail = log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{what} did not start on {LOOPBACK}:{chosen}:\n{tail}")


def end_process(process: subprocess.Popen[bytes] | None, *, kill: bool = False) -> None:
    """Stop a server process (SIGTERM, or SIGKILL as a crash would) and wait; SIGKILL after 10 s."""
    if process is None or process.poll() is not None:
        return
    if kill:
        process.kill()
    else:
        process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def is_loopback_url(url: str) -> bool:
    """Whether `url` names this machine only: a unix socket, localhost or a loopback IP."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return True
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RedisServer:
    """A `redis-server` process on a loopback port, owned by the tests.

    Without persistence unless `extra_args` turn it on (e.g. ``"--appendonly", "yes"``).
    `stop()` / `kill()` / `start()` keep the port and the data directory, so a
    test can restart the same server.
    """

    def __init__(self, directory: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.extra_args = extra_args
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A `redis.Redis` client for this server."""
        import redis

        return redis.Redis.from_url(self.url, socket_connect_timeout=2, socket_timeout=5, **kwargs)

    def start(self) -> RedisServer:
        """Start the server (on a fresh free port the first time, the same port after)."""
        server = redis_server_path()

        def command(port: int) -> list[str]:
            options = {"bind": LOOPBACK, "port": str(port), "save": "", "appendonly": "no", "dir": str(self.directory)}
            return [server, *(part for name, value in options.items() for part in (f"--{name}", value)), *self.extra_args]

        self.process, self.port = start_server(
            command, self.directory / "redis.log", _pings, port=self.port, timeout_s=REDIS_START_TIMEOUT_S, what="redis-server"
        )
        return self

    def stop(self) -> None:
        """Shut down gracefully (SIGTERM) and wait."""
        self._end(kill=False)

    def kill(self) -> None:
        """Kill abruptly (SIGKILL), as a crash would."""
        self._end(kill=True)

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def _end(self, kill: bool) -> None:
        process, self.process = self.process, None
        end_process(process, kill=kill)


def _pings(port: int) -> bool:
    """Whether the Redis on `port` answers (not while it loads its data after a restart)."""
    import redis

    client = redis.Redis(host=LOOPBACK, port=port, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
        return False
    finally:
        client.close()


def _die_with_parent() -> None:
    # Runs in the child before exec: if pytest dies, even by SIGKILL, the kernel stops
    # redis-server too (PR_SET_PDEATHSIG), so no test run leaves a server behind.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except Exception:
        pass


def redis_server_path() -> str:
    """The `redis-server` executable, or skip the test with the way to get one."""
    path = shutil.which("redis-server")
    if path is None:
        pytest.skip(
            f"redis-server is not installed: install it (as root on Debian/Ubuntu: apt-get install redis-server) "
            f"or set {REDIS_URL_ENV} to a Redis on this machine"
        )
    return path


@pytest.fixture(scope="session")
def get_free_port() -> Callable[[], int]:
    """`get_free_port()` -> a loopback port nothing listens on right now."""
    return free_port


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis shared by the session: GPUFEED_TEST_REDIS_URL, or one started here."""
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        if not is_loopback_url(url):
            pytest.fail(
                f"{REDIS_URL_ENV}={url!r} is not a loopback address; tests only use this machine", pytrace=False
            )
        yield url
        return
    redis_server_path()
    server = RedisServer(tmp_path_factory.mktemp("redis-session")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RedisServer]]:
    """Start private redis-servers with extra arguments: ``factory("--appendonly", "yes")``."""
    servers: list[RedisServer] = []

    def start(*extra_args: str) -> RedisServer:
        redis_server_path()
        server = RedisServer(tmp_path_factory.mktemp("redis-private"), tuple(extra_args))
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def private_redis(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh redis-server of this test's own, free to stop, restart, kill or fill."""
    return redis_server_factory()


# ---------------------------------------------------------------------------
# Markers


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if cuda_items and not _cuda_available():  # torch is imported only when a cuda test is collected
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in cuda_items:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> list[str]:
    where = f"${REDIS_URL_ENV}" if os.environ.get(REDIS_URL_ENV) else "a redis-server started on a free loopback port"
    return [f"gpufeed tests: Redis from {where}"]
