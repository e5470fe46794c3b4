"""`transport_for(fs)`: the storage transport for a filesystem, one per filesystem and process."""

from __future__ import annotations

import os
import threading
from typing import Any

from ..errors import GpufeedError
from .s3.transport import S3Transport
from .transport import FsspecTransport, Transport

_TRANSPORTS: dict[tuple[int, str], Transport] = {}
_LOCK = threading.Lock()


def transport_for(fs: Any) -> Transport:
    """The fast S3 transport where `fs` is a plain s3fs filesystem, else the fsspec one (see `transport.py`).

    Raises:
        ConfigError: $GPUFEED_S3_DEADLINE_S is set to something that is not a positive number.
    """
    key = (os.getpid(), str(getattr(fs, "_fs_token", id(fs))))  # the token: the filesystem's class and options
    with _LOCK:
        transport = _TRANSPORTS.get(key)
        if transport is None:
            transport = _TRANSPORTS[key] = _make(fs)
        return transport


def _make(fs: Any) -> Transport:
    try:
        fast = S3Transport.for_filesystem(fs)
    except GpufeedError:  # a setting of gpufeed's own that is wrong ($GPUFEED_S3_DEADLINE_S): said, not passed over
        raise
    except Exception:  # noqa: BLE001 - anything unexpected in the client's make-up: s3fs serves
        fast = None
    return FsspecTransport(fs) if fast is None else fast
