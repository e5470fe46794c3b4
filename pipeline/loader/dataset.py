"""What a loader reads: a manifest, a dataset folder or a shard brace pattern, resolved to shards."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from ..errors import ConfigError, ManifestError
from ..io.output import Output
from ..io.tar import iter_tar_samples
from ..manifest import MANIFEST_NAME, read_manifest, shard_location
from ..targets import TEXT_MEMBER


@dataclasses.dataclass(frozen=True)
class ShardRef:
    """One shard the loader can read: where, how many samples, and (from a manifest) its size, sha256 and classes.

    `classes` bounds its samples' labels (0 to classes-1: the manifest's
    class names); None where no list says (a brace pattern: any int64 >= 0).
    """

    url: str
    samples: int
    bytes: int | None = None
    sha256: str | None = None
    classes: int | None = None


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """A resolved loader source: shards per variant set, class names, sample count.

    `len()` is `samples`: one epoch's samples (one variant set), all ranks
    together, as `len(dataset)` is for a DataLoader's dataset.

    Attributes:
        sets: the shards of each variant set (one set without variants).
        classes: class names, index = label (empty for a brace pattern).
        samples: samples per epoch (per variant set).
        root: the dataset's folder or URL.
        prepared_size: the side `gpufeed prepare` resized to (`--size`, from
            the manifest's params); None when not known (a brace pattern) or
            not resized (`--mode none`).
        task: what the samples hold (`pipeline.targets.TASKS`), from the
            manifest; for shards without one, `pattern_task`.
        fields: the members the manifest says its samples may hold besides image and json.
        ignore_index: a segmentation mask's value of no class, from the manifest.
    """

    sets: list[list[ShardRef]]
    classes: list[str]
    samples: int
    root: str
    prepared_size: int | None = None
    task: str = "classification"
    fields: list[str] = dataclasses.field(default_factory=list)
    ignore_index: int | None = None

    def __len__(self) -> int:
        return self.samples

    @property
    def variants(self) -> int:
        return len(self.sets)

    @property
    def hashed(self) -> bool:
        """Whether every shard has a sha256 to check (a manifest's shards do, a brace pattern's not)."""
        return all(shard.sha256 for shards in self.sets for shard in shards)


def resolve_dataset(source: str | os.PathLike[str], *, links_outside: bool = False) -> DatasetInfo:
    """Resolve a manifest path/URL, a dataset directory, a shard brace pattern, or one shard (a `.tar`).

    Args:
        source: what `make_loader` was given, a str or a path.
        links_outside: accept a manifest's local shards that are links to
            files outside the dataset's folder (refused by default).

    Returns:
        The dataset's shards per variant set, class names and sample count.

    Raises:
        ConfigError: the source is none of those.
        ManifestError: the manifest is missing or malformed, or names a shard
            outside the dataset.
    """
    source = os.fspath(source)
    if ("{" in source and ".." in source) or source.split("?", 1)[0].endswith(".tar"):  # a pattern, or one shard
        return _from_pattern(source)
    root = source[: -len(MANIFEST_NAME)].rstrip("/") if source.endswith(MANIFEST_NAME) else source.rstrip("/")
    output = Output(root or ".")
    manifest = read_manifest(output)
    sets: dict[int | None, list[ShardRef]] = {}
    for shard in manifest.shards:
        url = shard_location(output, shard.path, links_outside=links_outside)
        sets.setdefault(shard.variant, []).append(ShardRef(url, shard.samples, shard.bytes, shard.sha256, len(manifest.classes)))
    ordered = [sets[key] for key in sorted(sets, key=lambda v: -1 if v is None else v)]
    return DatasetInfo(
        ordered, manifest.classes, manifest.samples, root, _prepared_size(manifest.params), manifest.task,
        list(manifest.fields), manifest.ignore_index,
    )  # fmt: skip


def _prepared_size(params: dict[str, Any]) -> int | None:
    """The `--size` a manifest's params record, unless its images were not resized (`--mode none`)."""
    resize = params.get("resize")
    if not isinstance(resize, dict) or resize.get("mode") == "none":
        return None
    size = resize.get("size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def expand_braces(pattern: str) -> list[str]:
    """`shard-{000000..000003}.tar` -> the four names (zero padding kept)."""
    match = _BRACE.search(pattern)
    if not match:
        return [pattern]
    low, high = match.group(1), match.group(2)
    width = len(low) if low.startswith("0") else 0
    names = []
    for number in range(int(low), int(high) + 1):
        names.extend(expand_braces(pattern[: match.start()] + str(number).zfill(width) + pattern[match.end() :]))
    return names


def _from_pattern(pattern: str) -> DatasetInfo:
    urls = expand_braces(pattern)
    refs = []
    members: set[str] = set()  # the first sample's, which say the task (`pattern_task`)
    for url in urls:
        with open_shard(url) as handle:
            count = 0
            for _, sample in iter_tar_samples(handle, url):
                if not members:
                    members = set(sample)
                count += 1
            refs.append(ShardRef(url, count))
    if not refs:
        raise ConfigError(f"{pattern} matches no shards")
    return DatasetInfo([refs], [], sum(r.samples for r in refs), os.path.dirname(urls[0]), task=pattern_task(members))


def pattern_task(members: set[str]) -> str:
    """The task of shards without a manifest, from a sample's members: an image with a caption (`txt`) and no
    class (`cls`), as img2dataset writes them, is a captions dataset; anything else is classification."""
    return "captions" if TEXT_MEMBER in members and "cls" not in members else "classification"


def open_shard(url: str) -> Any:
    """A binary file object over the shard at `url`, local or remote.

    Raises:
        ManifestError: a local shard that cannot be opened (missing, no permission).
        OSError: a remote one that cannot be opened.
    """
    from ..io.fs import local_path, open_fs

    local = local_path(url)
    if local is not None:
        try:
            return open(local, "rb", buffering=1 << 20)
        except OSError as exc:
            raise ManifestError(f"cannot open shard {url}: {exc.strerror or exc}") from exc
    fs, path = open_fs(url)
    return fs.open(path, "rb", block_size=1 << 22)
