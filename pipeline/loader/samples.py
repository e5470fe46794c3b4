"""`loader.dataset[i]`: one sample of a prepared dataset by its index, as a torchvision dataset gives it.

For looking at a dataset (the image of a label, where a sample came from),
not for training: an index is found by reading its shard from the start up
to the sample, so one look costs up to one shard's read. Index order is the
manifest's: its shards in order (the first variant set's), the samples of
each as its tar holds them; the loader's epochs read the same samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..decode import decode_image, pil_image
from ..errors import DecodeError, SampleError
from ..io.tar import TarFormatError, iter_tar_samples
from ..targets import DEFAULT_IGNORE_INDEX, TargetError, read_json
from .cpu_decode import npy_pixels
from .dataset import DatasetInfo, ShardRef
from .epoch import label_bound, pick_image, sample_label
from .slot_pixels import DATA_ERRORS
from .streaming import ShardOpener
from .tasks import stored_targets


@dataclasses.dataclass(frozen=True)
class DatasetSample:
    """One sample: unpacks as `image, label`, like a torchvision dataset's item.

    Attributes:
        image: the prepared image, upright RGB (a PIL image), before the
            loader's crop.
        label: its class index (-1 when the dataset has no labels).
        key: its key in the shards (trace a batch back to its files).
        shard: the shard it was read from.
        info: what prepare recorded of it (its `.json`: source path,
            original size, label name, variant), {} when it has none.
        targets: what it holds besides its image and class, in pixels of
            `image` (before the loader's crop): "boxes" (float32 [N, 4]
            XYXY), "box_labels", "iscrowd", "mask" ([H, W] class indices),
            "labels" (a multi-label sample's), "caption"; {} for a plain
            classification sample.
    """

    image: Any
    label: int
    key: str
    shard: str
    info: dict[str, Any]
    targets: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.image, self.label))


@dataclasses.dataclass(frozen=True)
class LoaderDataset(DatasetInfo):
    """A loader's dataset: what `DatasetInfo` says, indexable, with torchvision's `classes` and `class_to_idx`."""

    opener: ShardOpener | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, info: DatasetInfo, opener: ShardOpener) -> LoaderDataset:
        fields = {field.name: getattr(info, field.name) for field in dataclasses.fields(DatasetInfo)}
        return cls(**fields, opener=opener)

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class name -> label, as torchvision's ImageFolder has it (empty without class names)."""
        return {name: index for index, name in enumerate(self.classes)}

    def __getitem__(self, index: int) -> DatasetSample:
        """The sample at `index` (negative counts from the end), read from its shard.

        Raises:
            IndexError: outside the dataset.
            SampleError: its shard cannot be read that far, or it does not decode.
        """
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"dataset indices are integers, not {type(index).__name__}")
        position = int(index) + (self.samples if index < 0 else 0)
        if not 0 <= position < self.samples:
            raise IndexError(f"index {index} is outside the dataset's {self.samples} samples")
        for shard in self.sets[0]:
            if position < shard.samples:
                return self._read(shard, position)
            position -= shard.samples
        raise IndexError(f"index {index}: the shards hold fewer samples than the manifest says")

    def _read(self, shard: ShardRef, position: int) -> DatasetSample:
        opener = self.opener or ShardOpener()
        try:
            with opener.open(shard) as handle:
                for number, (key, members) in enumerate(iter_tar_samples(handle, shard.url)):
                    if number == position:
                        return _sample(shard.url, key, members, label_bound([shard]), self._reading())
        except (TarFormatError, OSError) as exc:
            raise SampleError(f"cannot read sample {position} of {shard.url}: {exc}", shard=shard.url) from exc
        raise SampleError(f"{shard.url} holds fewer samples than the manifest says ({shard.samples})", shard=shard.url)

    def _reading(self) -> dict[str, Any]:
        """How its targets read: the class count that bounds them, the task, the ignore index (`stored_targets`)."""
        ignore = DEFAULT_IGNORE_INDEX if self.ignore_index is None else self.ignore_index
        return {"classes": len(self.classes) or None, "task": self.task, "ignore_index": ignore}


def _sample(shard: str, key: str, members: dict[str, bytes], bound: int, reading: dict[str, Any]) -> DatasetSample:
    picked = pick_image(members)
    if picked is None:
        raise SampleError(f"sample {key} of {shard} has no image", shard=shard, sample=key)
    extension, data = picked
    label, damage = sample_label(members, bound)
    if damage:
        raise SampleError(f"sample {key} of {shard}: {damage}", shard=shard, sample=key, reason=damage)
    try:
        image = _image(extension, data)
        info = read_json(members["json"], "json") if "json" in members else {}
        targets = stored_targets(members, size=image.size, **reading)
    except (DecodeError, TargetError) as exc:
        raise SampleError(f"sample {key} of {shard}: {exc}", shard=shard, sample=key, reason=str(exc)) from exc
    return DatasetSample(image, label, key, shard, info if isinstance(info, dict) else {}, targets)


def _image(extension: str, data: bytes) -> Any:
    try:
        if extension != "npy":
            return decode_image(data).image
        return pil_image().fromarray(npy_pixels(data)).convert("RGB")
    except DATA_ERRORS as exc:  # what Pillow and NumPy raise on bad bytes
        raise DecodeError(f"cannot decode .{extension} sample: {str(exc)[:160] or type(exc).__name__}") from None

