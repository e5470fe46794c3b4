"""A job's listing put in aspect-ratio order (`PrepareSpec.order="aspect"`), from each image's header.

Rectangular eval batches (ultralytics' `rect=True`) are only tight when a
batch holds pictures of like shape. With `order="aspect"` the listing is
written again sorted by the aspect ratio (height / width) of each picture as
prepare will store it: upright (the header's EXIF orientation), through the
resize (`transforms.resize_geometry`: its picture, padding not counted);
ties keep the listing order. The plan then takes the listing as it is, so
shard after shard holds consecutive runs of that order.

Only the first `HEAD_BYTES` of a file are read (where its header and EXIF
are; a file whose header reaches further is read whole): no pixel is decoded.
An image whose header cannot be read (missing, not an image, over a limit)
sorts last; its shard rejects it as it would have. The order is a pure
function of the listing and the files' headers, and the sorted listing's
hash is what the plan records, so a resumed or repaired job that lists SRC
again gets the same order or is told that SRC changed.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..decode import exif_orientation, open_image, pillow_warnings
from ..errors import DecodeError, SourceError
from ..io.fs import read_source_head, store_errors
from ..specs import PrepareSpec
from .listing import Listing
from .sample.make import read_item
from .sample.targets import TargetError, read_tar_member, tar_range
from .sources import SourceItem
from .transforms import resize_geometry

HEAD_BYTES = 64 * 1024  # a JPEG's EXIF block is at most 64 KiB; its frame header follows it
HEADER_THREADS = 16  # headers read at once: on a store each is a round trip, not CPU work
_BLOCK = 32  # listing indices per task of the header threads (at most a few MiB of heads in flight)
UNKNOWN = math.inf  # the key of an image whose header cannot be read: it sorts last


def sort_listing(listing: Listing, count: int, spec: PrepareSpec, threads: int = HEADER_THREADS) -> str:
    """Write `listing` again in aspect-ratio order (see the module's docstring).

    Args:
        listing: the job's listing, as SRC listed it.
        count: its number of items.
        spec: the job (its resize, limits).
        threads: headers read at once.

    Returns:
        The sha256 of the sorted listing's lines (what the plan records).

    Raises:
        StorageError: the work folder cannot be written.
    """
    keys = aspect_keys(listing, count, spec, threads)
    return listing.reorder(np.argsort(keys, kind="stable"))


def aspect_keys(listing: Listing, count: int, spec: PrepareSpec, threads: int = HEADER_THREADS) -> np.ndarray:
    """Each listed image's stored aspect ratio (`stored_aspect`), in listing order, as float64.

    The heads are read `threads` at once; Pillow reads them in this thread (its warnings are caught
    per file, which only one thread at a time may do).
    """
    keys = np.full(count, UNKNOWN, np.float64)
    if not count:
        return keys
    listing.get(0)  # opens the listing's files here, not in several threads at once
    pending: deque[tuple[int, Future[list[tuple[SourceItem, bytes]]]]] = deque()

    def take_first() -> None:
        first, heads = pending.popleft()
        for offset, (item, head) in enumerate(heads.result()):
            keys[first + offset] = stored_aspect(item, spec, head)

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="gpufeed-aspect") as pool:
        for start in range(0, count, _BLOCK):
            pending.append((start, pool.submit(_read_heads, listing, range(start, min(count, start + _BLOCK)), spec)))
            if len(pending) > threads:
                take_first()
        while pending:
            take_first()
    return keys


def stored_aspect(item: SourceItem, spec: PrepareSpec, head: bytes | None = None) -> float:
    """Height / width of the picture `item` becomes (upright, resized, padding not counted); `UNKNOWN` when its
    header cannot be read.

    Args:
        item: the listed source.
        spec: the job (its resize and limits).
        head: what `read_head` gave for it already (b"": nothing could be read); None reads it now.
    """
    if item.rejected:
        return UNKNOWN
    head = read_head(item, spec) if head is None else head
    size = _upright_size(head, spec)
    if size is None and len(head) >= HEAD_BYTES:  # the header may go on past the head: the whole file
        whole = read_item(item, spec)
        size = _upright_size(whole, spec) if isinstance(whole, bytes) else None
    if size is None:
        return UNKNOWN
    width, height = resize_geometry(size, spec.resize).size
    return height / width


def _read_heads(listing: Listing, indices: range, spec: PrepareSpec) -> list[tuple[SourceItem, bytes]]:
    items = [listing.get(index) for index in indices]
    return [(item, b"" if item.rejected else read_head(item, spec)) for item in items]


def read_head(item: SourceItem, spec: PrepareSpec) -> bytes:
    """The first `HEAD_BYTES` of the source's file (of its byte range in a tar); b"" where it cannot be read."""
    unreadable: tuple[type[BaseException], ...] = (TargetError, SourceError, ValueError, *store_errors())
    try:
        tar = item.targets.get("tar") if isinstance(item.targets, dict) else None
        if tar is not None:  # an image inside a WebDataset shard given as SRC: its byte range's start
            offset, size = tar_range(tar, spec.max_file_bytes)
            return read_tar_member(item.url, offset, min(size, HEAD_BYTES))
        return read_source_head(item.url, HEAD_BYTES)
    except unreadable:  # what reading it would reject it for; its shard says why
        return b""


def _upright_size(data: bytes, spec: PrepareSpec) -> tuple[int, int] | None:
    """The upright (width, height) a file's header gives, or None where it gives none (a refused bomb too)."""
    try:
        with pillow_warnings([]):  # the file's damage is its shard's to report, not the header pass's
            img = open_image(data, max_pixels=spec.max_pixels)
            width, height = img.size
            turned = exif_orientation(img) in (5, 6, 7, 8)
    except DecodeError:
        return None
    return (height, width) if turned else (width, height)
