"""One training step traced on fake tensors: every allocation and free, in order.

The step is the one a training loop runs, on ``FakeTensorMode`` tensors
(shapes, dtypes and strides, no data and no memory), so a model of any size
traces on a laptop::

    for step in range(2):
        output = model(x)              # under torch.autocast when asked
        loss = loss_fn(output, x)      # the previous output and loss go only now
        loss.backward()
        optimizer.step()               # foreach or per-tensor, as asked
        optimizer.zero_grad(set_to_none=…)

A ``TorchDispatchMode`` sees every operator's outputs: a storage it has not
seen yet is an allocation, and a ``weakref.finalize`` on the storage records
its free, so views and in-place results count once and a tensor lives exactly
as long as something refers to it (the autograd graph, the optimizer, the
loop's variables). Of the two steps, the first creates the optimizer state;
the second is the steady state of every later step, and its maximum of live
bytes is the peak.

What is counted is every parameter, buffer and tensor an operator makes;
a plain tensor attribute of a module that is neither (a constant mask kept as
``self.mask``) is taken as a constant and not counted. The garbage collector
is off while tracing: a tensor in a reference cycle counts until the trace
ends, as it may on the device until a collection happens to run.

Traced at three batch sizes, each storage's size is affine in the batch,
``c + s·B`` (checked exactly on the third trace). `StepModel` then knows the
live bytes after every event for any batch without tracing again
(`device` replays the same events through CUDA's caching allocator).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ...errors import ConfigError

PARAMETERS = "parameters"
BUFFERS = "buffers"
GRADIENTS = "gradients"
STATE = "optimizer state"
INPUTS = "input batch"
ACTIVATIONS = "activations"
TEMPORARIES = "temporaries"
# Storages by what keeps them alive; ACTIVATIONS are what the forward pass leaves for the backward one.
CATEGORIES = (PARAMETERS, BUFFERS, GRADIENTS, STATE, INPUTS, ACTIVATIONS, TEMPORARIES)
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
PRECISIONS = ("float16", "bfloat16")
TRACE_BATCHES = (2, 4, 7)  # two to fit c + s·B per storage, one to check it; 2: BatchNorm needs more than 1


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What one traced step does.

    Attributes:
        optimizer: sgd, momentum (SGD with momentum 0.9), adam or adamw.
        foreach: the optimizer's foreach implementation (all parameters per kernel, with
            temporaries the size of all of them) instead of its per-parameter loop.
        training: False traces one forward pass under ``torch.no_grad()`` in eval mode.
        autocast: "float16" or "bfloat16" for ``torch.autocast`` (the parameters stay as they are).
        dtype: cast floating-point parameters, buffers and the input to this dtype (None: as built).
        channels_last: 4-D parameters and the input in ``torch.channels_last`` memory format.
        set_to_none: ``zero_grad(set_to_none=…)``; False keeps zeroed gradients between steps.
        loss: ``loss(output, inputs)`` returning a scalar; None is `CrossEntropy`.
        device: the fake tensors' device type ("cpu" or "cuda"): its kernels and autocast rules.
    """

    optimizer: str = "adam"
    foreach: bool = False
    training: bool = True
    autocast: str | None = None
    dtype: str | None = None
    channels_last: bool = False
    set_to_none: bool = True
    loss: Callable[[Any, Any], Any] | None = None
    device: str = "cpu"


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """The allocations and frees of a traced run at one batch size.

    Attributes:
        batch: the batch size traced.
        sizes: bytes of every storage, in the order of allocation.
        categories: what each storage is (one of CATEGORIES).
        events: in order, ``i`` for the allocation of storage i, ``~i`` for its free.
        start: index in `events` where the measured (second) step begins.
        phases: (name, index in `events`) where each part of the measured step begins.
    """

    batch: int
    sizes: tuple[int, ...]
    categories: tuple[str, ...]
    events: tuple[int, ...]
    start: int
    phases: tuple[tuple[str, int], ...]


class NotAffineError(Exception):
    """The traces at different batch sizes do not line up as c + s·B per storage."""


# ---------------------------------------------------------------------------
# Recording


def _recorder_class() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Recorder(TorchDispatchMode):
        """Every new storage an operator returns is an allocation; its finalizer, the free."""

        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []
            self.categories: list[str] = []
            self.events: list[int] = []
            self.marks: list[tuple[str, int]] = []
            self.live: set[int] = set()
            self._index: dict[int, int] = {}  # id(storage) -> its allocation; a storage's id outlives it by nothing
            self._finalizers: list[Any] = []
            self._open = True

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                if hasattr(leaf, "untyped_storage"):
                    self.see(leaf)
            return out

        def see(self, tensor: Any, category: str = TEMPORARIES) -> int:
            storage = tensor.untyped_storage()
            key, nbytes = id(storage), storage.nbytes()
            index = self._index.get(key)
            if index is not None and self.sizes[index] == nbytes:
                return index
            if index is None:
                self._finalizers.append(weakref.finalize(storage, self._released, key))
            else:  # resized in place: the old block goes, a new one comes
                self.events.append(~index)
                self.live.discard(index)
            index = len(self.sizes)
            self.sizes.append(nbytes)
            self.categories.append(category)
            self.events.append(index)
            self.live.add(index)
            self._index[key] = index
            return index

        def label(self, tensor: Any, category: str) -> None:
            self.categories[self.see(tensor)] = category

        def label_alive_since(self, first: int, category: str) -> None:
            for index in self.live:
                if index >= first:
                    self.categories[index] = category

        def mark(self, name: str) -> int:
            self.marks.append((name, len(self.events)))
            return len(self.events)

        def _released(self, key: int) -> None:
            index = self._index.pop(key, None)
            if index is not None and self._open:
                self.events.append(~index)
                self.live.discard(index)

        def close(self) -> None:
            self._open = False
            for finalizer in self._finalizers:
                finalizer.detach()

    return Recorder


# ---------------------------------------------------------------------------
# The fake model


@contextlib.contextmanager
def fake_model(model: Any, spec: StepSpec, recorder: Any = None) -> Iterator[Any]:
    """Swap fake tensors in for the model's parameters and buffers; the model is restored after.

    Yields the FakeTensorMode (entered). Only shapes, strides and dtypes are
    read from the real tensors, so meta-device models work as well.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    originals: list[tuple[Any, str, str, Any]] = []
    replaced: dict[int, Any] = {}
    was_training = model.training
    with mode, recorder if recorder is not None else contextlib.nullcontext():
        try:
            for module in model.modules():
                for kind in ("_parameters", "_buffers"):
                    table = getattr(module, kind)
                    for name, tensor in list(table.items()):
                        if tensor is None:
                            continue
                        if id(tensor) not in replaced:
                            replaced[id(tensor)] = _fake_like(tensor, spec, kind == "_parameters", recorder)
                        originals.append((module, kind, name, tensor))
                        table[name] = replaced[id(tensor)]
            model.train(spec.training)
            yield mode
        finally:
            for module, kind, name, tensor in originals:
                getattr(module, kind)[name] = tensor
            model.train(was_training)
            del replaced


def _fake_like(tensor: Any, spec: StepSpec, parameter: bool, recorder: Any) -> Any:
    import torch

    dtype = tensor.dtype
    if spec.dtype and tensor.is_floating_point():
        dtype = getattr(torch, spec.dtype)
    if spec.channels_last and tensor.dim() == 4:
        fake = torch.empty(tensor.shape, dtype=dtype, device=spec.device, memory_format=torch.channels_last)
    else:
        fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=dtype, device=spec.device)
    if parameter:
        fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
    if recorder is not None:
        recorder.label(fake, PARAMETERS if parameter else BUFFERS)
    return fake


def fake_input(shape: Sequence[int], batch: int, spec: StepSpec) -> Any:
    """The input batch as a fake tensor (inside `fake_model`)."""
    import torch

    dtype = getattr(torch, spec.dtype) if spec.dtype else torch.float32
    if spec.channels_last and len(shape) == 3:
        return torch.empty((batch, *shape), dtype=dtype, device=spec.device, memory_format=torch.channels_last)
    return torch.empty((batch, *shape), dtype=dtype, device=spec.device)


def make_optimizer(parameters: Sequence[Any], name: str, foreach: bool | None = None) -> Any:
    """The optimizer of `name` as a training loop would build it (lr 1e-3, momentum 0.9).

    Raises:
        ConfigError: an unknown optimizer.
    """
    import torch

    params = [p for p in parameters if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=foreach)
    if name == "momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=foreach)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


class CrossEntropy:
    """The default loss: cross-entropy of the first output tensor over dimension 1.

    Its labels are made on the first call and kept, like the labels of a batch
    in a training loop: they live through every step.
    """

    def __init__(self) -> None:
        self.labels: Any = None

    def __call__(self, output: Any, inputs: Any) -> Any:
        """The loss of `output` against the batch's labels (class 0).

        Raises:
            ConfigError: the output has no class dimension (give a loss of your own).
        """
        import torch

        logits = first_tensor(output)
        if logits is None or logits.dim() < 2 or not logits.is_floating_point():
            got = "no tensor" if logits is None else f"{tuple(logits.shape)} {logits.dtype}"
            raise ConfigError(
                f"the default loss is cross-entropy over dimension 1, and the model returns {got}: "
                "give a loss of your own (loss=module:fn, called as fn(output, inputs))"
            )
        shape = (logits.shape[0], *logits.shape[2:])
        if self.labels is None or tuple(self.labels.shape) != shape:
            self.labels = torch.zeros(shape, dtype=torch.long, device=logits.device)
        return torch.nn.functional.cross_entropy(logits, self.labels)


def first_tensor(value: Any) -> Any:
    """The first tensor in a model's output (a tensor, or lists, tuples and dicts of them)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------
# One traced run


def trace_step(model: Any, input_shape: Sequence[int], batch: int, spec: StepSpec) -> StepTrace:
    """Trace a training step (or an inference forward pass) of `model` at `batch` on fake tensors.

    Returns:
        The StepTrace; the model is left as it was.

    Raises:
        ConfigError: the optimizer or loss is unusable; other errors of the model's own code propagate.
    """
    recorder = _recorder_class()()
    collecting = gc.isenabled()
    gc.disable()  # a free happens when the last reference goes, never at a collector's whim
    try:
        with fake_model(model, spec, recorder):
            parameters = list(model.parameters())
            x = fake_input(input_shape, batch, spec)
            recorder.label(x, INPUTS)
            optimizer = make_optimizer(parameters, spec.optimizer, spec.foreach) if spec.training else None
            loss = spec.loss or CrossEntropy()
            steps = 2 if spec.training else 1
            held: list[Any] = [None, None]  # a loop's `output` and `loss`: the next step replaces them
            start = 0
            phases: list[tuple[str, int]] = []
            for _ in range(steps):
                first_mark = len(recorder.marks)
                start = recorder.mark("forward")
                _run_step(model, x, parameters, optimizer, loss, spec, recorder, held)
                recorder.mark("end")
                if isinstance(loss, CrossEntropy) and loss.labels is not None:
                    recorder.label(loss.labels, INPUTS)
                phases = recorder.marks[first_mark:]
            del x, optimizer, parameters, loss, held
    finally:
        recorder.close()
        if collecting:
            gc.enable()
    return StepTrace(
        batch=batch,
        sizes=tuple(recorder.sizes),
        categories=tuple(recorder.categories),
        events=_frees_in_order(recorder.events[: phases[-1][1]], [position for _, position in recorder.marks]),
        start=start,
        phases=tuple(phases[:-1]),
    )


def _frees_in_order(events: list[int], marks: Sequence[int]) -> tuple[int, ...]:
    """Sort every run of frees between two allocations (or phase marks) by storage.

    Frees between two allocations do not change any peak, and some come in an
    order of their own: autocast's cast weights go when the autocast region
    ends, in the order of a hash table keyed by address.
    """
    ordered: list[int] = []
    run: list[int] = []
    boundaries = set(marks)
    for position, event in enumerate(events):
        if event >= 0 or position in boundaries:
            ordered += sorted(run, reverse=True)  # ~0 > ~1 > …: by storage index
            run = []
        if event < 0:
            run.append(event)
        else:
            ordered.append(event)
    return tuple(ordered + sorted(run, reverse=True))


def _run_step(
    model: Any, x: Any, parameters: list[Any], optimizer: Any, loss_fn: Any, spec: StepSpec, recorder: Any,
    held: list[Any],
) -> None:
    """One step; `held` is the loop's (output, loss), which let the previous step's go only when replaced."""
    import torch

    first = len(recorder.sizes)
    precision = (
        torch.autocast(spec.device, dtype=getattr(torch, spec.autocast)) if spec.autocast else contextlib.nullcontext()
    )
    if optimizer is None:
        with torch.no_grad(), precision:
            held[0] = model(x)
        recorder.label_alive_since(first, ACTIVATIONS)
        return
    with precision:
        held[0] = model(x)
        held[1] = loss_fn(held[0], x)
    loss = held[1]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(f"the loss must return a scalar tensor, got {type(loss).__name__}")
    recorder.label_alive_since(first, ACTIVATIONS)  # what the graph saved, the output and the loss
    recorder.mark("backward")
    loss.backward()
    del loss
    for parameter in parameters:
        if parameter.grad is not None:
            recorder.label(parameter.grad, GRADIENTS)
    recorder.mark("optimizer step")
    optimizer.step()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                recorder.label(value, STATE)
    recorder.mark("zero_grad")
    optimizer.zero_grad(set_to_none=spec.set_to_none)


# ---------------------------------------------------------------------------
# Any batch from a few traced ones


class StepModel:
    """The live bytes of a traced step for any batch: storage i holds ``intercept[i] + slope[i]·B`` bytes.

    Built from traces at several batch sizes (`fit`), which must run the same
    allocations and frees in the same order, or from one trace, which holds at
    its own batch only (`single`).
    """

    def __init__(self, trace: StepTrace, intercepts: Any, slopes: Any, batches: tuple[int, ...]) -> None:
        import numpy as np

        self.batches = batches
        self.categories = trace.categories
        self.start = trace.start
        self.phases = trace.phases
        events = np.asarray(trace.events, dtype=np.int64)
        allocation = events >= 0
        self._storage = np.where(allocation, events, ~events)
        self._sign = np.where(allocation, 1, -1)
        self._intercepts = np.asarray(intercepts, dtype=np.int64)
        self._slopes = np.asarray(slopes, dtype=np.int64)
        never = len(events) + 1
        self._born = np.full(len(trace.sizes), never, dtype=np.int64)
        self._born[self._storage[allocation]] = np.nonzero(allocation)[0]
        self._dies = np.full(len(trace.sizes), never, dtype=np.int64)
        self._dies[self._storage[~allocation]] = np.nonzero(~allocation)[0]
        self._category_index = np.asarray([CATEGORIES.index(c) for c in trace.categories], dtype=np.int64)

    @classmethod
    def fit(cls, traces: Sequence[StepTrace]) -> StepModel:
        """Fit ``c + s·B`` per storage on the first two traces and check it exactly on the others.

        Raises:
            NotAffineError: the traces differ in their events, or a storage's size is not affine in the batch.
        """
        import numpy as np

        ordered = sorted(traces, key=lambda t: t.batch)
        if len(ordered) < 2 or ordered[0].batch == ordered[1].batch:
            raise NotAffineError("two different batch sizes are needed")
        first, second = ordered[0], ordered[1]
        for other in ordered[1:]:
            same = (first.events, first.categories, first.start, first.phases) == (
                other.events, other.categories, other.start, other.phases,
            )
            if not same:
                raise NotAffineError(
                    f"the step allocates differently at batch {first.batch} and {other.batch} "
                    f"({len(first.events)} and {len(other.events)} allocations and frees)"
                )
        low = np.asarray(first.sizes, dtype=np.int64)
        step = second.batch - first.batch
        growth = np.asarray(second.sizes, dtype=np.int64) - low
        if (growth % step).any():
            raise NotAffineError(f"{int((growth % step != 0).sum())} storages grow by fractions of a byte per sample")
        slopes = growth // step
        intercepts = low - slopes * first.batch
        for other in ordered[2:]:
            wrong = int((intercepts + slopes * other.batch != np.asarray(other.sizes, dtype=np.int64)).sum())
            if wrong:
                raise NotAffineError(f"{wrong} storages are not c + s·B bytes at batch {other.batch}")
        return cls(first, intercepts, slopes, tuple(t.batch for t in ordered))

    @classmethod
    def single(cls, trace: StepTrace) -> StepModel:
        """A model valid at `trace.batch` only."""
        return cls(trace, list(trace.sizes), [0] * len(trace.sizes), (trace.batch,))

    def sizes(self, batch: int) -> Any:
        """Bytes of every storage at `batch` (a numpy array)."""
        import numpy as np

        return np.maximum(self._intercepts + self._slopes * batch, 0)

    def live(self, batch: int) -> Any:
        """Live bytes after each event (entry k: after k events; entry 0: nothing yet)."""
        import numpy as np

        deltas = self._sign * self.sizes(batch)[self._storage]
        return np.concatenate(([0], np.cumsum(deltas)))

    def peak(self, batch: int) -> int:
        """The largest live bytes of the measured step at `batch`."""
        return int(self.live(batch)[self.start :].max())

    def peak_position(self, batch: int) -> int:
        """How many events have happened at the peak of the measured step."""
        return self.start + int(self.live(batch)[self.start :].argmax())

    def breakdown(self, batch: int, position: int | None = None) -> dict[str, int]:
        """Live bytes by category at the peak (or after `position` events)."""
        import numpy as np

        at = self.peak_position(batch) if position is None else position
        alive = (self._born < at) & (self._dies >= at)
        totals = np.bincount(self._category_index[alive], weights=self.sizes(batch)[alive], minlength=len(CATEGORIES))
        return {name: int(round(value)) for name, value in zip(CATEGORIES, totals)}

    def affine_peak(self, batch: int) -> tuple[int, int]:
        """(c, s) of the storages alive at the peak at `batch`: the peak is c + s·B around this batch."""
        at = self.peak_position(batch)
        alive = (self._born < at) & (self._dies >= at)
        return int(self._intercepts[alive].sum()), int(self._slopes[alive].sum())

    def phase_peaks(self, batch: int) -> dict[str, int]:
        """The largest live bytes within each phase of the measured step (forward, backward …)."""
        live = self.live(batch)
        bounds = [position for _, position in self.phases[1:]] + [len(live) - 1]
        return {name: int(live[begin : end + 1].max()) for (name, begin), end in zip(self.phases, bounds)}

    def largest_batch(self, limit: int) -> int:
        """The largest batch whose peak (live bytes, no rounding) is at most `limit`; 0 if none.

        Every point of the step is c_k + s_k·B, so the batch is the smallest
        (limit − c_k) / s_k over the points that grow with the batch.
        """
        import numpy as np

        growing = self._sign * self._slopes[self._storage]
        fixed = self._sign * self._intercepts[self._storage]
        c = np.concatenate(([0], np.cumsum(fixed)))[self.start :]
        s = np.concatenate(([0], np.cumsum(growing)))[self.start :]
        if (c[s <= 0] > limit).any() or (c > limit).all():
            return 0
        rising = s > 0
        if not rising.any():
            return 2**62
        return max(0, int(((limit - c[rising]) // s[rising]).min()))

    def events(self, batch: int) -> tuple[list[int], list[int], list[int]]:
        """(storage, +1 allocation / −1 free) of every event in order, and every storage's bytes at `batch`."""
        return self._storage.tolist(), self._sign.tolist(), self.sizes(batch).tolist()
