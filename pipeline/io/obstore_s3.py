"""The S3 transport on obstore (the Python binding of Rust's object_store).

One `obstore.store.S3Store` per bucket, built from the s3fs filesystem's
`S3Settings` (the endpoint as configured, path style except on AWS's plain
regional endpoint; credentials through a provider that asks botocore's
public API). Reads ahead run as ``get_async`` / ``get_range_async`` on one
asyncio loop in a background thread, up to `in_flight` at once; object_store
retries transient failures with backoff itself. A request it cannot serve
(anything but the bytes or a missing object) is read through s3fs instead,
and a bucket that refuses or redirects is left to s3fs from then on.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from .s3config import S3Settings
from .transport import Body, FsspecTransport, Into, Transport

TIMEOUT = "60s"


class ObstoreS3Transport(Transport):
    """S3 through obstore, s3fs (`fallback`) for what it cannot do (see the module)."""

    reads_ahead = True

    def __init__(self, settings: S3Settings, fallback: FsspecTransport) -> None:
        self.settings = settings
        self.fallback = fallback
        self._stores: dict[str, Any] = {}
        self._refused: set[str] = set()  # buckets left to s3fs
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._limit: asyncio.Semaphore | None = None
        self._in_flight = 1

    def _store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                from obstore.store import S3Store

                settings = self.settings
                config: dict[str, Any] = {"region": settings.region_of(bucket)}
                if settings.virtual_host:
                    config["virtual_hosted_style_request"] = True
                    config["endpoint"] = settings.bucket_url(bucket)
                else:
                    config["endpoint"] = settings.endpoint
                    config["virtual_hosted_style_request"] = False
                provider = None
                if settings.credentials is None:
                    config["skip_signature"] = True
                else:
                    provider = _Provider(settings)
                client: Any = {"allow_http": settings.scheme == "http", "timeout": TIMEOUT, "connect_timeout": "30s"}
                store = self._stores[bucket] = S3Store(
                    bucket, client_options=client, credential_provider=provider, **config
                )
            return store

    def _usable(self, bucket: str, key: str) -> bool:
        return bool(key) and bucket not in self._refused and self.settings.bucket_url(bucket) is not None

    def _failed(self, bucket: str, exc: BaseException) -> None:
        from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

        text = str(exc)
        if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or "301" in text or "PermanentRedirect" in text:
            self._refused.add(bucket)

    def read_range(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        import obstore
        from obstore.exceptions import NotFoundError

        bucket, _, key = path.partition("/")
        if self._usable(bucket, key) and (end is None or end > start):
            try:
                store = self._store(bucket)
                if start == 0 and end is None:
                    return bytes(obstore.get(store, key).bytes())
                if end is None:
                    return bytes(obstore.get(store, key, options={"range": {"offset": start}}).bytes())
                return bytes(obstore.get_range(store, key, start=start, end=end))
            except NotFoundError as exc:
                raise FileNotFoundError(f"no such object: s3://{path}") from exc
            except Exception as exc:  # noqa: BLE001 - s3fs reads it and says what is wrong
                self._failed(bucket, exc)
        return self.fallback.read_range(path, start, end)

    def read_ahead(self, path: str, end: int | None = None, into: Into | None = None, in_flight: int = 1) -> Future[Body | None]:
        bucket, _, key = path.partition("/")
        if not self._usable(bucket, key):
            return super().read_ahead(path, end, into, in_flight)
        loop = self._running_loop(in_flight)
        return asyncio.run_coroutine_threadsafe(self._get(bucket, key, end, into), loop)

    def _running_loop(self, in_flight: int) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="gpufeed-obstore", daemon=True).start()
                self._loop = loop
            if in_flight > self._in_flight or self._limit is None:
                self._in_flight = max(in_flight, self._in_flight)
                self._limit = None  # made anew on the loop (below) with the larger count
            return self._loop

    async def _get(self, bucket: str, key: str, end: int | None, into: Into | None) -> Body | None:
        import obstore
        from obstore.exceptions import NotFoundError

        if self._limit is None:
            self._limit = asyncio.Semaphore(self._in_flight)
        async with self._limit:
            try:
                store = self._store(bucket)
                # a whole GET, its size looked at before the body is read: object_store refuses the 200 with a
                # Content-Range that some S3 servers (rclone's) answer a range with
                result = await obstore.get_async(store, key)
                if end is not None and int(result.meta["size"]) > end:
                    return None  # over the caller's bound: it reads what it needs its way
                data: Any = await result.bytes_async()
            except NotFoundError as exc:
                raise FileNotFoundError(f"no such object: s3://{bucket}/{key}") from exc
            except Exception as exc:  # noqa: BLE001 - the caller reads it its way
                self._failed(bucket, exc)
                return None
        view = memoryview(data)
        if into is not None:
            target = into(len(view))
            if target is not None and len(target) == len(view):
                target[:] = view
                return target
        return bytes(view)

    def list(self, path: str, delimiter: str | None = None) -> tuple[list[str], list[str]] | None:
        import obstore

        bucket, _, prefix = path.partition("/")
        if not bucket or bucket in self._refused or self.settings.bucket_url(bucket) is None:
            return None
        if prefix and not prefix.endswith("/"):
            return None  # object_store lists whole path segments only
        try:
            store = self._store(bucket)
            if delimiter == "/":
                listed = obstore.list_with_delimiter(store, prefix or None)
                keys = [f"{bucket}/{meta['path']}" for meta in listed["objects"]]
                prefixes = [f"{bucket}/{name}/" for name in listed["common_prefixes"]]
                return keys, prefixes
            if delimiter:
                return None
            keys = []
            for chunk in obstore.list(store, prefix or None, chunk_size=1000):
                keys += [f"{bucket}/{meta['path']}" for meta in chunk]
            return keys, []
        except Exception as exc:  # noqa: BLE001 - s3fs lists it
            self._failed(bucket, exc)
            return None

    def write(self, path: str, data: bytes) -> None:
        import obstore

        bucket, _, key = path.partition("/")
        if not self._usable(bucket, key):
            self.fallback.write(path, data)
            return
        obstore.put(self._store(bucket), key, data)

    def remove(self, paths: Sequence[str]) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        for path in paths:
            bucket, _, key = path.partition("/")
            if not self._usable(bucket, key):
                self.fallback.remove([path])
                continue
            try:
                obstore.delete(self._store(bucket), key)
            except NotFoundError:
                pass

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)


class _Provider:
    """obstore's credential provider: botocore's frozen credentials, kept for a minute."""

    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings

    def __call__(self) -> Any:
        assert self.settings.credentials is not None
        frozen = self.settings.credentials.get()
        if frozen is None:
            raise PermissionError("no AWS credentials")
        expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60)
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": expires,
        }
