"""What a job's samples hold (task, target members, a mask's ignore index), seen as its listing streams by."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..errors import SourceError
from ..polygons import POLYGONS_MEMBER
from ..targets import (
    BOX_LABELS_MEMBER,
    BOXES_MEMBER,
    DEFAULT_IGNORE_INDEX,
    INSTANCES_MEMBER,
    ISCROWD_MEMBER,
    LABELS_MEMBER,
    MASK_MEMBER,
    TASKS,
    TEXT_MEMBER,
)
from .listing import class_names
from .sources import ListingInfo, SourceItem


@dataclasses.dataclass
class TaskInfo:
    """What a job's samples hold, as the manifest records it: the task, the members besides image and json,
    a mask's value of no class. Decided from the listing, kept in the plan (the shard steps and the finish
    of a distributed job read it there)."""

    task: str = "classification"
    fields: list[str] = dataclasses.field(default_factory=list)
    ignore_index: int | None = None
    painted: bool = False  # the masks are painted from COCO's shapes: box class c is c + 1, 0 background

    def to_record(self) -> dict[str, Any]:
        record = {"task": self.task, "fields": list(self.fields), "ignore_index": self.ignore_index}
        return {**record, "painted_masks": True} if self.painted else record

    @classmethod
    def from_record(cls, saved: Mapping[str, Any]) -> TaskInfo:
        """From a saved plan; one saved before tasks were recorded is a classification (with labels if it has classes)."""
        if "task" not in saved:
            return cls("classification", ["cls"] if saved.get("classes") else [])
        return cls(saved["task"], list(saved.get("fields") or []), saved.get("ignore_index"), bool(saved.get("painted_masks")))

    def mask_classes(self, classes: list[str]) -> list[str] | None:
        """What the values of masks painted from COCO's shapes mean (None for any other dataset)."""
        return ["background", *classes] if self.painted else None

    @property
    def mask_fill(self) -> int:
        """What padding and the outside of a rotated crop become in a mask."""
        return DEFAULT_IGNORE_INDEX if self.ignore_index is None else self.ignore_index


# The members a listed target becomes (`pipeline.targets`), in the manifest's order.
_TARGET_FIELDS = (
    ("labels", (LABELS_MEMBER,)),
    ("boxes", (BOXES_MEMBER, BOX_LABELS_MEMBER)),
    ("iscrowd", (ISCROWD_MEMBER,)),
    ("mask", (MASK_MEMBER,)),
    ("segmentation", (MASK_MEMBER, INSTANCES_MEMBER, POLYGONS_MEMBER)),  # COCO's and YOLO-seg's shapes: painted, and polygons kept
    ("caption", (TEXT_MEMBER,)),
)
# A listing that does not say its task: the first target it has decides.
_TASK_OF_FIELD = ((MASK_MEMBER, "segmentation"), (BOXES_MEMBER, "detection"), (LABELS_MEMBER, "multilabel"), (TEXT_MEMBER, "captions"))


class SeenTargets:
    """What a listing's items hold, gathered as they stream into the listing file: target keys, class names."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.names: set[str] = set()
        self.labelled = False

    def watch(self, items: Iterable[SourceItem]) -> Iterator[SourceItem]:
        for item in items:
            self.labelled = self.labelled or item.label is not None
            targets = item.targets
            if isinstance(targets, dict) and not item.rejected:
                self.keys.update(key for key, value in targets.items() if value is not None)
                for key in ("labels", "box_labels"):
                    values = targets.get(key)
                    if isinstance(values, list):  # a malformed entry rejects its sample later, with the reason
                        self.names.update(str(v) for v in values if isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)))
            yield item

    def classes(self, info: ListingInfo, labels: set[str]) -> list[str]:
        """The job's class names: those the source declares (COCO's categories, YOLO's names), else
        those its items name, as `class_names` orders them."""
        if info.classes and info.kind != "imagefolder":
            return list(info.classes)
        if self.names and info.kind != "imagefolder":
            return class_names(ListingInfo(kind=info.kind), labels | self.names)
        return class_names(info, labels)

    def task_info(self, info: ListingInfo) -> TaskInfo:
        fields = (["cls"] if self.labelled else []) + list(dict.fromkeys(
            member for key, members in _TARGET_FIELDS if key in self.keys for member in members
        ))  # fmt: skip
        task = info.task if info.task in TASKS else "classification"
        if task == "classification" and not self.labelled:
            task = next((name for member, name in _TASK_OF_FIELD if member in fields), task)
        ignore = info.ignore_index
        if ignore is not None and (isinstance(ignore, bool) or not isinstance(ignore, int) or not 0 <= ignore <= 65535):
            raise SourceError(f"the ignore index of {info.kind or 'the source'} must be a whole number 0 to 65535, not {ignore!r}")
        if ignore is None and MASK_MEMBER in fields:
            ignore = DEFAULT_IGNORE_INDEX
        painted = "segmentation" in self.keys and "mask" not in self.keys
        return TaskInfo(task, fields, ignore, painted)
