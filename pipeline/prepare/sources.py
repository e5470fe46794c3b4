"""List the images of a source dataset, streaming.

A source is a directory (ImageFolder layout: one sub-folder per class; or a
flat folder without labels), a CSV/JSONL list with `path` and optional
`label` (formats/lists.py), or any fsspec URL to either. Sources with more than a class per
image are told apart by their path and layout (formats/layouts.py): a list's
`labels` (several class names: a JSON list or `a;b`), `caption`/`text` and
other columns; a COCO JSON; YOLO, Pascal VOC and segmentation folders;
WebDataset shards (a .tar, a brace pattern, a folder of them). Their
items carry `SourceItem.targets`. Listing yields one `SourceItem` at a
time in a deterministic order so millions of files never sit in memory at once.

No image file is passed over in silence: an image at the top of a folder
that has class folders belongs to no class, so it is listed already
rejected (`SourceItem.rejected`), and the job records it in rejected.jsonl.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ..errors import ConfigError, SourceError
from ..io.fs import forget_listings, is_url, local_path, open_fs, store_errors
from ..io.transport import Transport
from ..io.transports import transport_for
from .formats.common import IMAGE_EXTENSIONS, ListingInfo, SourceItem, is_image_name, present, printable
from .formats.detection import list_coco, read_json_source, yolo_names
from .formats.layouts import detect_folder
from .formats.lists import list_rows
from .formats.tar import expand_braces, is_shard_pattern, list_shards
from .formats.yolo_splits import YoloLayout, is_split_folder, is_yaml, list_yolo_split, yolo_layout

LIST_EXTENSIONS = (".csv", ".jsonl", ".ndjson")
FILE_EXTENSIONS = (*LIST_EXTENSIONS, ".json", ".tar")  # a SRC ending so is a file: no folder listing is tried
LIST_THREADS = 16  # class folders of a store listed at once: each LIST is a round trip, not CPU work
__all__ = ["IMAGE_EXTENSIONS", "ListingInfo", "SourceItem", "list_images"]

NOT_IN_A_CLASS_FOLDER = (
    "not in a class folder: SRC has class sub-folders, and the ImageFolder layout takes "
    "each image's label from the sub-folder it is in"
)


def list_images(
    source: str, info: ListingInfo | None = None, *, threads: int = LIST_THREADS, split: str | None = None
) -> Iterator[SourceItem]:
    """Yield every image of `source` in a stable order.

    Args:
        source: directory, CSV/JSONL list, COCO JSON, YOLO data.yaml,
            WebDataset .tar or brace pattern of them, or fsspec URL of one.
        info: filled in while listing (kind, task, class names, files ignored).
        threads: class folders of a remote folder listed at once (the top level is
            listed first, then each class folder on a thread); 1 lists them one after
            another. The listing is the same either way; a local folder is always
            listed in line.
        split: a YOLO dataset's split (data.yaml's train/val/test, or an
            images/<split> folder); None where the source has one dataset
            (several splits are then refused: they are never merged).

    Yields:
        SourceItem for each file with an image extension (or each list row);
        an image beside class folders comes first, already rejected.

    Raises:
        SourceError: when the source does not exist or cannot be read.
        ConfigError: when a list file lacks a `path` column, a JSON file is
            not COCO, or a layout is almost one the formats know.
    """
    info = info if info is not None else ListingInfo()
    local = local_path(source)
    yolo = _yolo_split(local, source, info, split) if local is not None else None
    if yolo is not None:
        yield from yolo
        return
    if split is not None:
        raise ConfigError(f"split={split!r} is for a YOLO dataset with splits (a data.yaml, images/<split>/), not {source}")
    if local is not None:
        if os.path.isdir(local):
            root = local.rstrip("/") or "/"
            layout = detect_folder(root, info, functools.partial(_walk_local_folder, root))
            yield from layout if layout is not None else _list_local_dir(root, info)
            return
        if os.path.isfile(local):
            yield from _list_file(source, info)
            return
        if is_shard_pattern(local) and "{" in local:
            yield from list_shards(expand_braces(source), info)
            return
        if os.path.exists(local):  # a FIFO, a socket, a device: never opened to be read
            raise SourceError(f"{source} is neither a folder nor a regular file")
        raise SourceError(f"source not found: {source}")
    if is_shard_pattern(source):  # shards on a store: a .tar or a brace pattern of them
        yield from list_shards(expand_braces(source) if "{" in source else [source], info)
        return
    fs, root = open_fs(source)
    forget_listings(fs, root)  # what the store holds now, not what this process listed before
    top = None if _without_query(root).lower().endswith(FILE_EXTENSIONS) else _listed_top(fs, root)  # a file: s3fs looks
    if top is not None and (top.dirs or top.files):
        yield from _list_fs_dir(fs, root, info, threads, top)
        return
    try:
        is_dir = fs.isdir(root)
        exists = is_dir or fs.exists(root)
    except store_errors() as exc:
        raise SourceError(f"cannot reach {source}: {exc}") from exc
    if not exists:
        raise SourceError(f"source not found: {source}")
    if is_dir:
        yield from _list_fs_dir(fs, root, info, threads)
    else:
        yield from _list_file(source, info)


def _yolo_split(local: str, source: str, info: ListingInfo, split: str | None) -> Iterator[SourceItem] | None:
    """One split of a YOLO dataset given by its data.yaml, its folder or a split folder; None for any other source."""
    if os.path.isdir(local) and split is None:
        root = is_split_folder(local)
        if root is not None:  # ROOT/images/train as SRC: that split, with ROOT's labels and names
            one = YoloLayout(root, {"": [os.path.normpath(local)]}, yolo_names(root))
            return list_yolo_split(one, "", info, _folder_walker(info))
    if not (os.path.isdir(local) or (present(local) and is_yaml(local))):
        return None
    layout = yolo_layout(local)
    if layout is None:
        return None
    return list_yolo_split(layout, layout.choose(split, source), info, _folder_walker(info))


def _folder_walker(info: ListingInfo) -> Callable[[str], Iterator[SourceItem]]:
    return lambda folder: _walk_local_folder(os.path.dirname(folder), os.path.basename(folder), info)


def _scan_sorted(path: str, info: ListingInfo) -> tuple[list[str], list[str]]:
    """Sub-folders and listable files of `path`, sorted; other entries count as ignored.

    A dangling symlink is listed as a file so it is rejected with a reason
    rather than silently missing; FIFOs and devices are never listed (reading
    one would block or never end).
    """
    dirs, files = [], []
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir():
                    dirs.append(entry.name)
                elif entry.is_file() or (entry.is_symlink() and not os.path.exists(entry.path)):
                    files.append(entry.name)
                else:
                    info.ignored += 1
    except OSError as exc:
        raise SourceError(f"cannot list {path}: {exc.strerror or exc}") from exc
    return sorted(dirs), sorted(files)


def _dir_id(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _list_local_dir(root: str, info: ListingInfo) -> Iterator[SourceItem]:
    top_dirs, top_files = _scan_sorted(root, info)
    ancestors = frozenset(filter(None, [_dir_id(root)]))
    if not top_dirs:
        info.kind = "flat"
        yield from _walk_local(root, "", None, top_files, [], info, ancestors)
        return
    info.kind = "imagefolder"
    info.classes = [printable(name) for name in top_dirs]
    for name in top_files:  # beside the class folders: no class to take a label from
        if not is_image_name(name):
            info.ignored += 1
            continue
        yield SourceItem(os.path.join(root, name), name, None, NOT_IN_A_CLASS_FOLDER)
    for name in top_dirs:
        yield from _walk_dir(root, name, printable(name), info, ancestors)


def _walk_local_folder(root: str, rel_dir: str, info: ListingInfo) -> Iterator[SourceItem]:
    """The images under root/rel_dir (rel relative to `root`), without labels: the walk a format reader pairs files on."""
    yield from _walk_dir(root, rel_dir, None, info, frozenset(filter(None, [_dir_id(root)])))


def _walk_dir(
    root: str, rel_dir: str, label: str | None, info: ListingInfo, ancestors: frozenset[tuple[int, int]]
) -> Iterator[SourceItem]:
    path = os.path.join(root, rel_dir)
    ident = _dir_id(path)
    if ident is None or ident in ancestors:
        info.ignored += 1  # a symlink back into its own tree would never end
        return
    sub_dirs, sub_files = _scan_sorted(path, info)
    yield from _walk_local(root, rel_dir, label, sub_files, sub_dirs, info, ancestors | {ident})


def _walk_local(
    root: str,
    rel_dir: str,
    label: str | None,
    files: list[str],
    dirs: list[str],
    info: ListingInfo,
    ancestors: frozenset[tuple[int, int]],
) -> Iterator[SourceItem]:
    base = os.path.join(root, rel_dir) if rel_dir else root
    for name in files:
        if not is_image_name(name):
            info.ignored += 1
            continue
        rel = f"{rel_dir}/{name}" if rel_dir else name
        yield SourceItem(os.path.join(base, name), rel, label)
    for name in dirs:
        yield from _walk_dir(root, f"{rel_dir}/{name}" if rel_dir else name, label, info, ancestors)


@dataclasses.dataclass(frozen=True)
class _Top:
    """A store folder's first level, listed by the fast S3 path: sub-folder and file names."""

    lister: Transport
    dirs: list[str]
    files: list[str]


def _listed_top(fs: Any, root: str) -> _Top | None:
    """`root`'s sub-folders and files in one signed LIST (S3 only); None where s3fs lists it.

    s3fs parses each key of a listing with botocore's machinery, 70-130
    microseconds of CPU a key: a million-image bucket spends minutes there.
    Names the fast path cannot place in a folder tree as s3fs would (an empty
    part, as in ``a//b.jpg``) leave the whole listing to s3fs.
    """
    lister = transport_for(fs)
    root = root.rstrip("/")
    listed = lister.list(f"{root}/", delimiter="/")
    if listed is None:
        return None
    keys, prefixes = listed
    dirs = [prefix[len(root) + 1 :].rstrip("/") for prefix in prefixes]
    files = [key[len(root) + 1 :] for key in keys if key != f"{root}/"]  # the folder's own marker is no file
    if any(not name or "/" in name for name in dirs + files):
        return None
    return _Top(lister, dirs, files)


def _walk_listed(
    lister: Transport, root: str, base: str, label: str | None, url_of: Callable[[str], str]
) -> tuple[list[SourceItem], int] | None:
    """The images under `base` and the files ignored, from one recursive LIST, in `_walk_fs`'s order; None: s3fs walks it."""
    listed = lister.list(f"{base}/")
    if listed is None:
        return None
    folders: dict[str, tuple[set[str], list[str]]] = {"": (set(), [])}  # folder (relative to base) -> sub-folders, files
    for key in listed[0]:
        rel = key[len(base) + 1 :]
        if not rel:
            continue  # base's own marker
        parts = rel.split("/")
        marker = rel.endswith("/")  # an empty object standing for a folder
        folder_parts = parts[:-1]
        if any(not part for part in folder_parts) or (not marker and not parts[-1]):
            return None
        for depth, name in enumerate(folder_parts):
            folders.setdefault("/".join(folder_parts[:depth]), (set(), []))[0].add(name)
            folders.setdefault("/".join(folder_parts[: depth + 1]), (set(), []))
        if not marker:
            folders["/".join(folder_parts)][1].append(parts[-1])
    items: list[SourceItem] = []
    ignored = 0

    def visit(rel: str) -> None:
        nonlocal ignored
        subfolders, files = folders[rel]
        path = f"{base}/{rel}" if rel else base
        for name in sorted(files):
            if name.startswith("."):
                continue
            if not is_image_name(name):
                ignored += 1
                continue
            full = f"{path}/{name}"
            items.append(SourceItem(url_of(full), full[len(root) + 1 :], label))
        for name in sorted(folder for folder in subfolders if not folder.startswith(".")):
            visit(f"{rel}/{name}" if rel else name)

    visit("")
    return items, ignored


def _walk(
    fs: Any, top: _Top | None, root: str, base: str, label: str | None, url_of: Callable[[str], str], info: ListingInfo
) -> Iterator[SourceItem]:
    """The images under `base`: from the fast S3 listing where `root`'s top came from it, else `_walk_fs`."""
    listed = _walk_listed(top.lister, root, base, label, url_of) if top is not None else None
    if listed is None:
        yield from _walk_fs(fs, root, base, label, url_of, info)
        return
    items, ignored = listed
    info.ignored += ignored
    yield from items


def _list_fs_dir(fs: Any, root: str, info: ListingInfo, threads: int, top: _Top | None = None) -> Iterator[SourceItem]:
    root = root.rstrip("/")
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    if top is not None:
        dir_names, file_names = top.dirs, top.files
    else:
        try:
            entries = fs.ls(root, detail=True)
        except store_errors() as exc:
            raise SourceError(f"cannot list {root}: {exc}") from exc
        dir_names = [_basename(e["name"]) for e in entries if e["type"] == "directory"]
        file_names = [_basename(e["name"]) for e in entries if e["type"] != "directory"]
    top_dirs = sorted(dir_names)
    top_dirs = [d for d in top_dirs if not d.startswith(".")]
    info.kind = "imagefolder" if top_dirs else "flat"
    info.classes = list(top_dirs)

    def url_of(path: str) -> str:
        return f"{protocol}://{path.lstrip('/')}" if protocol == "memory" else fs.unstrip_protocol(path)

    if not top_dirs:
        yield from _walk(fs, top, root, root, None, url_of, info)
        return
    beside = sorted(file_names)
    for name in (name for name in beside if not name.startswith(".")):
        if not is_image_name(name):
            info.ignored += 1
            continue
        yield SourceItem(url_of(f"{root}/{name}"), name, None, NOT_IN_A_CLASS_FOLDER)
    if threads <= 1:
        for name in top_dirs:
            yield from _walk(fs, top, root, f"{root}/{name}", name, url_of, info)
        return

    def list_class(name: str) -> tuple[list[SourceItem], int]:
        counts = ListingInfo()
        return list(_walk(fs, top, root, f"{root}/{name}", name, url_of, counts)), counts.ignored

    # Each LIST is a round trip to the store: the class folders are listed at once on
    # threads, their items yielded in class order (the listing is the sequential one).
    for items, ignored in _in_order([functools.partial(list_class, name) for name in top_dirs], threads):
        info.ignored += ignored
        yield from items


def _walk_fs(
    fs: Any, root: str, base: str, label: str | None, url_of: Callable[[str], str], info: ListingInfo
) -> Iterator[SourceItem]:
    """The images under `base`, one folder at a time (fs.walk holds one folder's names), in sorted order."""
    try:
        for dirpath, dirnames, filenames in fs.walk(base, on_error="raise"):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if not name or name.startswith("."):  # "": the empty object standing for a folder ("dir/")
                    continue
                if not is_image_name(name):
                    info.ignored += 1
                    continue
                full = f"{dirpath.rstrip('/')}/{name}"
                yield SourceItem(url_of(full), full[len(root) + 1 :], label)
    except store_errors() as exc:
        raise SourceError(f"cannot list {base}: {exc}") from exc


_T = TypeVar("_T")


def _in_order(tasks: list[Callable[[], _T]], threads: int) -> Iterator[_T]:
    """The tasks' results in task order, run on up to `threads` threads; at most 2 x `threads` results held."""
    pool = ThreadPoolExecutor(min(threads, len(tasks)) or 1, thread_name_prefix="gpufeed-list")
    try:
        pending: deque[Future[_T]] = deque()
        for task in tasks:
            pending.append(pool.submit(task))
            if len(pending) >= 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _without_query(source: str) -> str:
    """A URL without its query string (a presigned URL's signature may hold `/`), a path as it is."""
    return source.split("?", 1)[0] if is_url(source) else source


def _list_file(source: str, info: ListingInfo) -> Iterator[SourceItem]:
    lower = _without_query(source).lower()
    if lower.endswith(".tar"):
        yield from list_shards([source], info)
        return
    if lower.endswith(".json"):
        coco = read_json_source(source)
        if coco is not None:
            yield from list_coco(source, coco, info)
            return
    elif lower.endswith((".yaml", ".yml")):
        raise SourceError(
            f"{source}: a YOLO data.yaml is read from a local folder (its splits name local folders and lists): "
            "copy the dataset to a local folder and give its data.yaml there"
        )
    elif not lower.endswith(LIST_EXTENSIONS):
        raise SourceError(
            f"{source} is a file but not a CSV or JSONL list, a COCO JSON or a WebDataset .tar; "
            "give a folder of images or a list with a 'path' column"
        )
    base = _without_query(source).rsplit("/", 1)[0] if "/" in source else "."
    yield from list_rows(source, base, info, is_csv=lower.endswith(".csv"))
