"""The user's own code: `sample_transform` and `batch_transform` called, and what they return checked.

A hook that raises raises its own exception, as it is: the loader does not
hide it as damage. What a hook returns is checked as soon as it returns,
before anything is made of it, by type, dtype and shape (never a pass over
pixels): something a batch cannot take is a `HookError` naming the hook, the
sample, the field, what was expected and what came, not a TypeError deep in
torch, a mask beside images of another size, or an epoch ended early.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import HookError
from .tasks import TaskPlan, tensors_in

TARGET_FIELDS = ("boxes", "box_labels", "iscrowd", "mask", "masks", "polygons", "labels", "caption")
"""The targets a sample_transform may return changed (those its sample had)."""


def run_sample_transform(plan: TaskPlan, pixels: np.ndarray, key: str, targets: dict[str, Any]) -> None:
    """The user's sample_transform on one decoded sample, written back in place (pixels) and into `targets`.

    The callable gets {"image": uint8 (H, W, 3) array, "key": str, and the
    sample's targets ("boxes", "box_labels", "mask", "labels", "caption")} and
    returns a dict: its "image" (same shape, uint8) replaces the pixels, its
    other entries the targets.

    Raises:
        HookError: it returned something else (the message says what).
    """
    assert plan.sample_transform is not None
    image = np.ascontiguousarray(pixels.transpose(1, 2, 0))
    sample = {"image": image, "key": key, **{k: v for k, v in targets.items() if k not in ("fields", "boxes_dropped")}}
    result = plan.sample_transform(sample)
    if not isinstance(result, dict) or "image" not in result:
        got = "a dict without 'image'" if isinstance(result, dict) else _described(result)
        raise HookError(f"sample_transform returned {got} for sample {key}; expected the sample dict, with its 'image'")
    new = _array(result["image"])
    if new is None or new.shape != image.shape or new.dtype != np.uint8:
        raise _returned(key, "image", f"a uint8 array of shape {image.shape}", result["image"])
    changed = {name: result[name] for name in TARGET_FIELDS if name in result and name in targets}
    merged = {**targets, **changed}
    for name in changed:
        merged[name] = _checked(plan, key, name, merged, image.shape[:2])
    pixels[...] = new.transpose(2, 0, 1)
    targets.update((name, merged[name]) for name in changed)


def run_batch_transform(transform: Any, delivered: Any) -> Any:
    """The user's batch_transform on a batch; what it returns is what the training loop gets.

    Raises:
        HookError: it returned None, or nothing that holds a tensor.
    """
    result = transform(delivered)
    if result is None or next(tensors_in(result), None) is None:
        raise HookError(
            f"batch_transform returned {_described(result)}; expected the batch to deliver: a tensor, a tuple, "
            "list or dict of tensors, or a Batch"
        )
    return result


def _checked(plan: TaskPlan, key: str, name: str, merged: dict[str, Any], size: tuple[int, int]) -> Any:
    """A target the sample_transform returned, as the batch takes it, once its type, dtype and shape are right.

    `merged` holds the sample's targets with the returned ones in place: the
    boxes, their labels, crowd flags, instance masks and polygons must agree
    on the number of boxes.
    """
    value = merged[name]
    count = _rows(merged.get("boxes"))
    if name == "caption":
        if not isinstance(value, str):
            raise _returned(key, name, "a str", value)
        return value
    if name == "polygons":
        if not isinstance(value, (list, tuple)) or len(value) != count:
            raise _returned(key, name, f"a list of {count} entries (one list of polygons per box)", value)
        return value
    expected, kinds, shape = _EXPECTED[name](count, size)
    array = _array(value)
    if array is not None and array.size == 0 and shape[0] in (None, 0):  # [] for none: the empty array of its kind
        array = np.zeros(tuple(0 if want is None else want for want in shape), _EMPTY[kinds[0]])
    if array is None or array.dtype.kind not in kinds or not _fits(array.shape, shape):
        raise _returned(key, name, expected, value)
    if name in ("box_labels", "labels") and len(array) and plan.classes is not None:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= plan.classes:
            raise _returned(key, name, f"{expected} of class indices 0 to {plan.classes - 1}", value, low if low < 0 else high)
    return [int(v) for v in array] if name == "labels" else array


_EXPECTED = {
    "boxes": lambda n, size: ("a float array of shape (N, 4)", "fiu", (None, 4)),
    "box_labels": lambda n, size: (f"an integer array of shape ({n},), one per box", "iu", (n,)),
    "iscrowd": lambda n, size: (f"an integer or bool array of shape ({n},), one per box", "biu", (n,)),
    "mask": lambda n, size: (f"an integer array of shape {tuple(size)} (the image's)", "biu", tuple(size)),
    "masks": lambda n, size: (f"an integer or bool array of shape ({n}, {size[0]}, {size[1]}), one per box", "biu", (n, *size)),
    "labels": lambda n, size: ("a list of class indices", "iu", (None,)),
}


_EMPTY = {"f": np.float32, "i": np.int64, "b": np.uint8}


def _rows(boxes: Any) -> int:
    shape = getattr(boxes, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else 0


def _fits(shape: tuple[int, ...], expected: tuple[int | None, ...]) -> bool:
    return len(shape) == len(expected) and all(want is None or have == want for have, want in zip(shape, expected))


def _array(value: Any) -> np.ndarray | None:
    """`value` as an array without a copy where it is one already (an ndarray, a CPU tensor); None: it is no array."""
    if isinstance(value, (str, bytes)) or value is None:
        return None
    try:
        return np.asarray(value)
    except (TypeError, ValueError, RuntimeError):  # ragged lists, GPU tensors, objects NumPy cannot take
        return None


def _described(value: Any) -> str:
    """What came, for a message: a type, with an array's dtype and shape."""
    if value is None:
        return "None"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"a {type(value).__name__} of {dtype} with shape {tuple(shape)}"
    if isinstance(value, (list, tuple)):
        array = _array(value)
        inner = f" ({array.dtype}, shape {array.shape})" if array is not None else ""
        return f"a {type(value).__name__} of {len(value)}{inner}"
    return f"a {type(value).__name__}"


def _returned(key: str, name: str, expected: str, value: Any, bad: int | None = None) -> HookError:
    value_said = f" holding {bad}" if bad is not None else ""
    return HookError(
        f"sample_transform returned {name!r} for sample {key} as {_described(value)}{value_said}; expected {expected}"
    )
