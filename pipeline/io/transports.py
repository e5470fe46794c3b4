"""`transport_for(fs)`: the storage transport for a filesystem, one per filesystem and process."""

from __future__ import annotations

import os
import threading
from typing import Any

from .transport import FsspecTransport, Transport

_TRANSPORTS: dict[tuple[int, str, str], Transport] = {}
_LOCK = threading.Lock()


def transport_for(fs: Any) -> Transport:
    """The fast S3 transport where `fs` is a plain s3fs filesystem, else the fsspec one (see `transport.py`)."""
    key = (os.getpid(), os.environ.get("GPUFEED_S3_TRANSPORT", ""), str(getattr(fs, "_fs_token", id(fs))))
    with _LOCK:
        transport = _TRANSPORTS.get(key)
        if transport is None:
            transport = _TRANSPORTS[key] = _make(fs)
        return transport


def _make(fs: Any) -> Transport:
    fallback = FsspecTransport(fs)
    try:
        if os.environ.get("GPUFEED_S3_TRANSPORT") == "obstore":
            from .obstore_s3 import ObstoreS3Transport
            from .s3config import S3Settings

            settings = S3Settings.for_filesystem(fs)
            return fallback if settings is None else ObstoreS3Transport(settings, fallback)
        from .s3get import S3Getter
        from .s3transport import S3Transport

        getter = S3Getter.for_filesystem(fs)
        return fallback if getter is None else S3Transport(getter, fallback)
    except Exception:  # noqa: BLE001 - anything unexpected in the client's make-up: s3fs serves
        return fallback
