"""The job's listing, spilled to OUT/.gpufeed: one JSON line per source plus a uint64 offset index.

A source can hold millions of files; holding a `SourceItem` for each costs
hundreds of bytes apiece and grows with the source. On disk, memory stays flat
however many there are, every worker process reads the same listing, and an
item is one `pread` away by index.

For an OUT on a store the listing is written to this machine's staging folder
and uploaded to OUT/.gpufeed (`share_listing`); a worker on another machine
downloads it once into its own staging folder (`fetch_listing`) and checks it
against the hash the plan records. So the machines of a job share the store,
never a folder.
"""

from __future__ import annotations

import array
import functools
import hashlib
import os
from collections.abc import Iterable, Iterator
from typing import IO, Any

import numpy as np

from ..errors import ConfigError, StorageError, write_failure
from ..io.fs import at_once, file_sha256
from ..io.output import Output
from .formats.common import whole_number
from .formats.detection import MAX_CLASSES
from .sources import ListingInfo, SourceItem

LINES_NAME = "listing.jsonl"
INDEX_NAME = "listing.idx"
FETCHED_NAME = "listing.fetched"  # local only: the hash of the listing this staging folder holds
_INDEX_BLOCK = 65536  # offsets kept in memory before they are appended to the index file


class Listing:
    """The job's sources on disk: random access by index without holding them in memory.

    `offsets[i]` is where line i starts in the JSONL file and `offsets[i + 1]`
    where it ends, so the index holds one more entry than there are sources.
    """

    def __init__(self, directory: str) -> None:
        self.lines_path = os.path.join(directory, LINES_NAME)
        self.index_path = os.path.join(directory, INDEX_NAME)
        self._fd: int | None = None
        self._offsets: np.ndarray | None = None

    def write(self, items: Iterator[SourceItem]) -> tuple[int, str, set[str]]:
        """Spill `items` to the listing files, replacing what they held.

        Args:
            items: the sources, in listing order.

        Returns:
            (count, sha256 of the listing lines, label names seen: items' labels
            and the names in their targets' "labels" and "box_labels").

        Raises:
            StorageError: the work folder cannot be written (e.g. a full disk).
        """
        try:
            with open(self.lines_path, "wb") as lines, open(self.index_path, "wb") as index:
                return _spill(items, lines, index)
        except OSError as exc:
            raise write_failure(self.lines_path, exc) from exc

    def __len__(self) -> int:
        return max(0, os.path.getsize(self.index_path) // 8 - 1)

    def get(self, index: int) -> SourceItem:
        """The source at listing position `index` (opens the files on first use)."""
        return SourceItem.from_json(self._line(index))

    def _line(self, index: int) -> bytes:
        if self._fd is None:
            self._fd = os.open(self.lines_path, os.O_RDONLY)
            self._offsets = np.memmap(self.index_path, dtype=np.uint64, mode="r")
        assert self._offsets is not None
        start, stop = int(self._offsets[index]), int(self._offsets[index + 1])
        return os.pread(self._fd, stop - start, start)

    def reorder(self, order: np.ndarray) -> str:
        """Write the listing again with its lines in `order` (listing indices, each once), replacing the files.

        The lines are copied as they are, so the new listing's items are the
        old ones, only their positions change.

        Returns:
            The sha256 of the new listing's lines.

        Raises:
            StorageError: the work folder cannot be written.
        """
        lines_temp, index_temp = f"{self.lines_path}.reordered", f"{self.index_path}.reordered"
        try:
            with open(lines_temp, "wb") as lines, open(index_temp, "wb") as index:
                _, digest = _write_lines((self._line(int(listed)) for listed in order), lines, index)
            self.close()
            os.replace(lines_temp, self.lines_path)
            os.replace(index_temp, self.index_path)
        except OSError as exc:
            raise write_failure(self.lines_path, exc) from exc
        return digest

    def close(self) -> None:
        """Close the files; a later `get` opens them again."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._offsets = None


def share_listing(output: Output, work_dir: str, digest: str) -> None:
    """Upload a just written listing to a remote OUT's work folder, keeping the local copy (no-op locally).

    Args:
        output: the job's OUT.
        work_dir: the work folder, relative to OUT.
        digest: the listing's sha256, as the plan records it.

    Raises:
        StorageError: the upload failed (retryable).
    """
    if output.is_local:
        return
    at_once(*(functools.partial(output.publish, f"{work_dir}/{name}", keep_local=True) for name in (LINES_NAME, INDEX_NAME)))
    _mark_fetched(output.local(work_dir), digest)


def fetch_listing(output: Output, work_dir: str, digest: str) -> Listing:
    """The planned listing of `output`, downloaded into this machine's staging folder unless already there.

    Args:
        output: the job's OUT.
        work_dir: the work folder, relative to OUT.
        digest: the listing's sha256, as the plan records it.

    Returns:
        The listing, ready to read.

    Raises:
        StorageError: the listing cannot be downloaded, or what came down is not the planned one.
    """
    directory = output.local(work_dir)
    listing = Listing(directory)
    if output.is_local or _fetched(directory) == digest:
        return listing
    at_once(*(functools.partial(output.fetch, f"{work_dir}/{name}") for name in (LINES_NAME, INDEX_NAME)))
    got, _ = file_sha256(listing.lines_path)
    if got != digest:
        raise StorageError(f"the listing in {output.url}/{work_dir} is not the one its plan records; plan the job again")
    _mark_fetched(directory, digest)
    return listing


def _fetched(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, FETCHED_NAME), encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return None


def _mark_fetched(directory: str, digest: str) -> None:
    path = os.path.join(directory, FETCHED_NAME)
    temp = f"{path}.tmp-{os.getpid()}"
    with open(temp, "w", encoding="ascii") as handle:
        handle.write(digest)
    os.replace(temp, path)


def _spill(items: Iterator[SourceItem], lines: IO[bytes], index: IO[bytes]) -> tuple[int, str, set[str]]:
    labels: set[str] = set()

    def encoded() -> Iterator[bytes]:
        for item in items:
            yield item.to_json().encode("utf-8") + b"\n"
            if item.label is not None:
                labels.add(item.label)
            if item.targets is not None and not item.rejected:
                _add_target_labels(item.targets, labels)

    count, digest = _write_lines(encoded(), lines, index)
    return count, digest, labels


def _write_lines(encoded: Iterable[bytes], lines: IO[bytes], index: IO[bytes]) -> tuple[int, str]:
    """Write listing lines and their offset index; (count, sha256 of the lines)."""
    digest = hashlib.sha256()
    offsets = array.array("Q", [0])
    count = position = 0
    for line in encoded:
        lines.write(line)
        digest.update(line)
        position += len(line)
        offsets.append(position)
        count += 1
        if len(offsets) >= _INDEX_BLOCK:  # flush the index in blocks: memory stays flat
            offsets.tofile(index)
            offsets = array.array("Q")
    offsets.tofile(index)
    return count, digest.hexdigest()


def _add_target_labels(targets: dict[str, Any], labels: set[str]) -> None:
    """The class names a sample's targets use: a multi-label sample's labels, its boxes' labels."""
    for field in ("labels", "box_labels"):
        names = targets.get(field)
        if isinstance(names, list):
            labels.update(name for name in names if isinstance(name, str))


FIXED_CLASS_KINDS = frozenset({"coco", "yolo", "segmentation"})
"""Listing kinds whose class list the format gives (`ListingInfo.classes`), where it gives one."""


def class_names(info: ListingInfo, labels: set[str]) -> list[str]:
    """The class names of a listing, in label-index order.

    Args:
        info: what listing the source found (its kind; an image folder's class
            folders, the classes a format fixes).
        labels: the label names seen: a list's labels, a multi-label sample's
            labels and boxes' labels (`Listing.write`).

    Returns:
        An image folder's classes as listed; the classes a format fixes (COCO's
        categories by id, YOLO's names, a segmentation folder's classes.txt);
        otherwise integer labels as the indices they already are (`"0"` ..
        max, ASCII digits only), other names sorted.

    Raises:
        ConfigError: integer labels up to an index past `MAX_CLASSES`: that many classes is no dataset's.
    """
    if info.kind == "imagefolder" or (info.kind in FIXED_CLASS_KINDS and info.classes):
        return info.classes
    if labels and all(label.isascii() and label.isdigit() for label in labels):  # not "²": a digit, but no int
        numbers = [whole_number(label.lstrip("0") or "0") for label in labels]  # None: 10 digits or more
        highest = max(MAX_CLASSES if number is None else number for number in numbers)
        if highest >= MAX_CLASSES:
            raise ConfigError(
                f"the labels are class indices, up to one of {MAX_CLASSES} or more: more classes than a dataset may "
                "have (name the classes, or number them from 0)"
            )
        return [str(i) for i in range(highest + 1)]
    return sorted(labels)
