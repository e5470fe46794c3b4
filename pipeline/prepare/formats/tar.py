"""WebDataset shards as a source: a .tar, a brace pattern of them, or a folder holding .tar files.

Only the tar headers are read (`pipeline.io.tar.iter_tar_index`), and the
small text members, never an image: listing a terabyte of shards reads
kilobytes per shard. Members are grouped into samples by WebDataset's key
rule (`split_key`: the member name up to the first dot of its base name).
Each sample with an image member becomes one `SourceItem`:

- url: the shard's path or URL; rel: f"{shard file name}/{key}";
- targets["tar"] = {"offset": o, "size": n}: the image member's bytes are
  shard[o : o + n] (a reader fetches that range, not the shard);
- its `txt` member inline as targets["caption"], its `json` member (an
  object) as targets["columns"] (another JSON value as {"json": value}), its
  `cls` member (text) as the label name.

img2dataset's output (jpg + txt + json, with .parquet and _stats.json files
beside the shards) lists as captions: task "captions" when some sample has a
`txt` and none a `cls`, else "classification". Text members over
`TEXT_MAX_BYTES` reject their sample, and so does a json member nested over
`MAX_JSON_DEPTH` levels; a key seen twice in one shard rejects
the second; a sample without an image member is ignored (counted). A shard
that is not a well-formed tar is listed as one rejected item naming the
damage (the samples before it are kept).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from ...errors import ConfigError, SourceError
from ...io.fs import local_path, open_fs, open_regular, store_errors
from ...io.tar import TarFormatError, iter_tar_index, split_key
from ...manifest import nested_deeper
from ...targets import MAX_CAPTION_BYTES
from .common import IMAGE_EXTENSIONS, MAX_JSON_DEPTH, ListingInfo, SourceItem

TEXT_MAX_BYTES = MAX_CAPTION_BYTES
TEXT_MEMBERS = ("txt", "json", "cls")
MAX_SHARDS = 1 << 20  # a brace pattern expands to at most this many shards
# the image members a sample may have, in the order one is picked where it has several
IMAGE_MEMBERS = tuple(
    ["jpg", "jpeg", "png", "webp"] + sorted(ext[1:] for ext in IMAGE_EXTENSIONS if ext[1:] not in ("jpg", "jpeg", "png", "webp"))
)
_BRACE = re.compile(r"\{([^{}]*)\}")


def is_shard_pattern(source: str) -> bool:
    """Whether `source` names tar shards: it ends in .tar, and may hold `{a..b}` / `{x,y}` braces."""
    return source.split("?", 1)[0].lower().endswith(".tar")


def expand_braces(pattern: str) -> list[str]:
    """The names of a brace pattern: `{000..009}` (zero-padded as written) and `{a,b}`, several multiplied.

    Raises:
        ConfigError: a range that is not two integers, or over `MAX_SHARDS` names.
    """
    parts: list[list[str]] = []
    position = 0
    for match in _BRACE.finditer(pattern):
        parts.append([pattern[position : match.start()]])
        parts.append(_brace_choices(match.group(1), pattern))
        position = match.end()
    parts.append([pattern[position:]])
    total = 1
    for choices in parts:
        total *= len(choices)
        if total > MAX_SHARDS:
            raise ConfigError(f"{pattern} expands to over {MAX_SHARDS} shards")
    return ["".join(names) for names in itertools.product(*parts)]


def _brace_choices(body: str, pattern: str) -> list[str]:
    if ".." in body:
        low, _, high = body.partition("..")
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise ConfigError(f"{pattern}: a brace range is {{first..last}} with integers first <= last, not {{{body}}}")
        if int(high) - int(low) >= MAX_SHARDS:
            raise ConfigError(f"{pattern} expands to over {MAX_SHARDS} shards")
        width = len(low) if low.startswith("0") else 0
        return [str(i).zfill(width) for i in range(int(low), int(high) + 1)]
    return body.split(",")


def list_shards(shards: list[str], info: ListingInfo) -> Iterator[SourceItem]:
    """Yield the samples of WebDataset shards, shard by shard in the order given.

    Args:
        shards: the shards' paths or URLs.
        info: filled in: kind "webdataset", the task, samples ignored.

    Raises:
        SourceError: a shard that does not exist or cannot be opened.
    """
    info.kind = "webdataset"
    seen = {"txt": False, "cls": False}
    for shard in shards:
        yield from _list_shard(shard, info, seen)
    info.task = "captions" if seen["txt"] and not seen["cls"] else "classification"


def _open(shard: str) -> Any:
    local = local_path(shard)
    try:
        if local is not None:
            return open_regular(local)  # a FIFO named .tar would never end
        fs, path = open_fs(shard)
        return fs.open(path, "rb")
    except FileNotFoundError as exc:
        raise SourceError(f"shard not found: {shard}") from exc
    except OSError as exc:
        raise SourceError(f"cannot read {shard}: {exc.strerror or exc}") from exc
    except store_errors() as exc:
        raise SourceError(f"cannot read {shard}: {exc}") from exc


def _wanted(name: str, size: int) -> bool:
    return split_key(name)[1] in TEXT_MEMBERS and size <= TEXT_MAX_BYTES


def _list_shard(shard: str, info: ListingInfo, seen: dict[str, bool]) -> Iterator[SourceItem]:
    tar_name = os.path.basename(shard.split("?", 1)[0])
    keys: set[str] = set()
    with _open(shard) as handle:
        sample: dict[str, tuple[int, int, bytes | None]] = {}
        key: str | None = None
        try:
            for name, offset, size, data in iter_tar_index(handle, shard, read=_wanted):
                this_key, extension = split_key(name)
                if this_key != key:
                    if key is not None:
                        yield from _sample_item(shard, tar_name, key, sample, keys, info, seen)
                    key, sample = this_key, {}
                sample[extension] = (offset, size, data)
        except TarFormatError as exc:
            damage: str | None = f"damaged shard: {exc.reason}"
        except OSError as exc:
            raise SourceError(f"cannot read {shard}: {exc.strerror or exc}") from exc
        else:
            damage = None
        if damage is not None:  # the last sample stands where its members lie whole inside the shard
            end = handle.seek(0, os.SEEK_END)
            if any(offset + size > end for offset, size, _ in sample.values()):
                key = None
        if key is not None:
            yield from _sample_item(shard, tar_name, key, sample, keys, info, seen)
        if damage is not None:
            yield SourceItem(shard, tar_name, None, damage)


def _sample_item(
    shard: str,
    tar_name: str,
    key: str,
    members: dict[str, tuple[int, int, bytes | None]],
    keys: set[str],
    info: ListingInfo,
    seen: dict[str, bool],
) -> Iterator[SourceItem]:
    image = next((ext for ext in IMAGE_MEMBERS if ext in members), None)
    if image is None:
        info.ignored += 1  # no image: nothing to prepare
        return
    rel = f"{tar_name}/{key}"
    if key in keys:
        yield SourceItem(shard, rel, None, f"sample key {key!r} appears twice in {tar_name}")
        return
    keys.add(key)
    offset, size, _ = members[image]
    targets: dict[str, Any] = {"tar": {"offset": offset, "size": size}}
    label = None
    for extension in TEXT_MEMBERS:
        if extension not in members:
            continue
        data = members[extension][2]
        if data is None:
            yield SourceItem(shard, rel, None, f"its {extension} member is over {TEXT_MAX_BYTES} bytes, the bound on a text member")
            return
        text = data.decode("utf-8", "replace")
        if extension == "txt":
            targets["caption"] = text
            seen["txt"] = True
        elif extension == "cls":
            label = text.strip() or None
            seen["cls"] = True
        else:
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):
                yield SourceItem(shard, rel, None, "its json member is not valid JSON")
                return
            if nested_deeper(value, MAX_JSON_DEPTH):
                yield SourceItem(shard, rel, None, f"its json member nests over {MAX_JSON_DEPTH} levels deep")
                return
            targets["columns"] = value if isinstance(value, dict) else {"json": value}
    yield SourceItem(shard, rel, label, targets=targets)
