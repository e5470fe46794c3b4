"""A local S3-compatible server (moto) for the tests, and prepared datasets in its buckets.

`pytest_plugins = ["s3_fixtures"]` in a test module makes the fixtures available:

- `s3_server` (session): an `S3Server` on a free 127.0.0.1 port, with dummy
  credentials in the environment (so child processes reach it too);
- `s3_dataset` (session): a small prepared dataset on local disk;
- `s3_variant_dataset` (session): one with two variant sets (``v0/``, ``v1/``);
- `s3_bucket`: a fresh bucket of this test's own holding a copy of `s3_dataset`;
- `s3_upload`: ``s3_upload(folder)`` -> a fresh `Bucket` holding a copy of any local folder;
- `small_tmpfs`: a 2 MiB tmpfs of this test's own, for full-disk cases (needs the
  right to mount; skipped where it is missing).

Tests never talk to a non-loopback address: the server binds 127.0.0.1 and every
client gets its endpoint through fsspec storage options.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LOOPBACK, end_process, start_server

S3_START_TIMEOUT_S = 30.0
SERVER_SCRIPT = Path(__file__).with_name("s3_server.py")
DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _moto_available() -> bool:
    try:
        import moto.moto_server.werkzeug_app  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


class S3Server:
    """moto's S3 on a loopback port, with a per-object read counter (see s3_server.py).

    `stop()` and `start()` keep the port (moto keeps its objects in memory, so a
    restarted server is empty).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """What fsspec's s3 filesystem needs to use this server (and nothing else)."""
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing", "token": "testing"}

    def filesystem(self) -> Any:
        """A fresh s3fs filesystem on this server (no listing cache shared with others)."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def start(self) -> S3Server:
        self.process, self.port = start_server(
            lambda port: [sys.executable, str(SERVER_SCRIPT), str(port)],
            self.directory / "s3.log",
            self._answers,
            port=self.port,
            timeout_s=S3_START_TIMEOUT_S,
            what="the test S3 server",
        )
        return self

    def stop(self) -> None:
        process, self.process = self.process, None
        end_process(process)

    def _answers(self, port: int) -> bool:
        try:
            self._call("GET", "reads", port)
        except (urllib.error.URLError, ConnectionError):
            return False
        return True

    def _call(self, method: str, route: str, port: int | None = None) -> Any:
        endpoint = self.endpoint if port is None else f"http://{LOOPBACK}:{port}"
        request = urllib.request.Request(f"{endpoint}/_test/{route}", method=method, data=b"" if method == "POST" else None)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
        with opener.open(request, timeout=5) as response:
            return json.loads(response.read())

    def reads(self) -> dict[str, dict[str, int]]:
        """Object GETs since the last reset: ``{"bucket/key": {"gets": n, "bytes": b}}``."""
        return dict(self._call("GET", "reads"))

    def bytes_read(self, bucket: str, key: str) -> int:
        """Body bytes served for one object since the last reset (all processes together)."""
        return int(self.reads().get(f"{bucket}/{key}", {}).get("bytes", 0))

    def reset_reads(self) -> None:
        self._call("POST", "reset")

    def throttle(self, bytes_per_s: int) -> None:
        """Serve object bodies at about `bytes_per_s` (0: full speed)."""
        self._call("POST", f"throttle?bytes_per_s={int(bytes_per_s)}")

    def throttle_uploads(self, bytes_per_s: int) -> None:
        """Take in upload bodies (PUT, POST) at about `bytes_per_s` (0: full speed)."""
        self._call("POST", f"throttle?upload_bytes_per_s={int(bytes_per_s)}")

    def uploading(self) -> list[str]:
        """The ``bucket/key`` of every object whose body the server is receiving now."""
        return list(self._call("GET", "uploading")["keys"])

    def refuse_writes(self, refuse: bool) -> None:
        """Answer every write (PUT, POST, DELETE) 403 AccessDenied while `refuse`, as a store that took the right away."""
        self._call("POST", f"refuse?writes={int(refuse)}")

    def reset_faults(self) -> None:
        """Full speed both ways, no latency, writes accepted: the state every test starts from."""
        self.throttle(0)
        self.throttle_uploads(0)
        self.delay(0)
        self.refuse_writes(False)

    def delay(self, ms: int) -> None:
        """Answer every request `ms` milliseconds late (0: at once)."""
        self._call("POST", f"latency?ms={int(ms)}")

    def requests(self) -> dict[str, int]:
        """Requests since the last reset, by HTTP method (``{"GET": n, "HEAD": n}``)."""
        return {method: int(count) for method, count in self._call("GET", "requests").items()}

    def listings(self) -> dict[str, int]:
        """LIST requests since the last reset, by ``bucket/prefix`` (every page counts)."""
        return {prefix: int(count) for prefix, count in self._call("GET", "listings").items()}

    def max_in_flight(self, bucket: str | None = None) -> int:
        """The most object GETs the server served at once since the last reset (of `bucket` only, if given)."""
        return self._most_in_flight("max", bucket)

    def max_writes_in_flight(self, bucket: str | None = None) -> int:
        """The most object writes (PUT, POST, DELETE) the server took at once since the last reset (of `bucket` only, if given)."""
        return self._most_in_flight("puts", bucket)

    def max_lists_in_flight(self, bucket: str | None = None) -> int:
        """The most LIST requests (bucket listings) served at once since the last reset (of `bucket` only, if given)."""
        return self._most_in_flight("lists", bucket)

    def _most_in_flight(self, kind: str, bucket: str | None) -> int:
        return int(self._call("GET", "in_flight" + (f"?bucket={bucket}" if bucket else ""))[kind])


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server on a free loopback port, for the whole session; dummy credentials in the environment."""
    if not _moto_available():
        pytest.skip("the S3 tests need moto's server and s3fs: pip install 'moto[server]>=5' s3fs")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in DUMMY_CREDENTIALS.items():
            patch.setenv(name, value)
        patch.setenv("NO_PROXY", LOOPBACK)
        patch.setenv("no_proxy", LOOPBACK)
        server = S3Server(tmp_path_factory.mktemp("s3-server")).start()
        try:
            yield server
        finally:
            server.stop()


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A bucket of one test, holding a copy of a local dataset under `prefix`."""

    server: S3Server
    name: str
    prefix: str
    local: Path

    @property
    def url(self) -> str:
        return f"s3://{self.name}/{self.prefix}"

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def put(self, rel: str, data: bytes) -> None:
        """Replace one object of the dataset."""
        self.server.filesystem().pipe_file(f"{self.name}/{self.key(rel)}", data)


@pytest.fixture(scope="session")
def s3_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset on local disk: 24 small images in 6 shards of 4 samples."""
    return make_dataset(tmp_path_factory.mktemp("s3-data"), images=24, per_shard=4)


@pytest.fixture(scope="session")
def s3_variant_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset with two variant sets of 16 images, 4 samples a shard (8 shards)."""
    return make_dataset(tmp_path_factory.mktemp("s3-variants"), images=16, per_shard=4, variants=2)


def make_dataset(root: Path, *, images: int, per_shard: int, variants: int = 0) -> Path:
    """Generate images and prepare them under `root`; returns the dataset folder."""
    from pipeline import PrepareSpec, ResizeSpec, ShardSpec, prepare_dataset
    from pipeline.demo import make_demo_dataset
    from pipeline.specs import AugmentSpec

    raw, out = root / "raw", root / "shards"
    make_demo_dataset(str(raw), images, min_side=96, max_side=160, workers=1)
    spec = PrepareSpec(
        source=str(raw),
        out=str(out),
        resize=ResizeSpec(size=64),
        augment=AugmentSpec(variants=variants),
        shards=ShardSpec(max_samples=per_shard),
    )
    prepare_dataset(spec, workers=0)
    return out


_bucket_numbers = itertools.count()


def upload(server: S3Server, local: Path, name: str | None = None, prefix: str = "data") -> Bucket:
    """A new bucket holding a copy of the dataset folder `local` under `prefix`."""
    name = name or f"gpufeed-test-{os.getpid()}-{next(_bucket_numbers)}"
    fs = server.filesystem()
    fs.mkdir(name)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{name}/{prefix}/{path.relative_to(local).as_posix()}")
    return Bucket(server, name, prefix, local)


@pytest.fixture
def s3_upload(s3_server: S3Server) -> Callable[[Path], Bucket]:
    """``s3_upload(folder)``: a fresh bucket holding a copy of `folder`; the read counts start at zero."""

    def make(local: Path) -> Bucket:
        s3_server.reset_faults()
        bucket = upload(s3_server, local)
        s3_server.reset_reads()
        return bucket

    return make


@pytest.fixture
def s3_bucket(s3_server: S3Server, s3_dataset: Path) -> Bucket:
    """A fresh bucket of this test's own with a copy of `s3_dataset`; the read counts start at zero."""
    s3_server.reset_faults()
    bucket = upload(s3_server, s3_dataset)
    s3_server.reset_reads()
    return bucket


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted for this test: a disk that really fills up (ENOSPC)."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    try:
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a small tmpfs for the full-disk case ({exc}): it needs root or CAP_SYS_ADMIN")
    if result.returncode != 0:
        reason = result.stderr.strip() or f"mount exited with {result.returncode}"
        pytest.skip(f"cannot mount a small tmpfs for the full-disk case ({reason}): it needs root or CAP_SYS_ADMIN")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30, check=False)
