"""The truth for the memory estimate: live tensor bytes over a real training step on the CPU.

`LiveBytes` is a TorchDispatchMode that counts each storage once, from the
operator that returns it until its last reference goes (a finalizer on the
storage), so a view or an in-place result adds nothing and a freed
temporary stops counting at once. What exists before the step starts is held
explicitly: parameters, buffers, kept gradients, optimizer state, the batch,
its labels, and the previous step's output and loss (a loop's variables,
replaced only when the new ones are computed).

`measure_step` runs a plain training loop, written here without gpufeed's
code, for two steps and counts the second. `allocator_peak` is the CPU
allocator's own record of the same step (the profiler's memory events),
which also sees the scratch buffers kernels allocate inside themselves.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of every storage held or returned by an operator while active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._bytes: dict[int, int] = {}

    def hold(self, tensors: Iterable[Any]) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())

    def _count(self, storage: Any) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if key not in self._bytes:
            weakref.finalize(storage, self._gone, key)
            self._bytes[key] = 0
        self.live += nbytes - self._bytes[key]  # a resize counts its difference
        self._bytes[key] = nbytes
        self.peak = max(self.peak, self.live)

    def _gone(self, key: int) -> None:
        self.live -= self._bytes.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.hold(tree_leaves(out))
        return out


def optimizer_for(model: nn.Module, name: str, foreach: bool | None = False) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=foreach)
    if name == "momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=foreach)
    return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)


def _state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def measure_step(
    model: nn.Module,
    shape: tuple[int, ...],
    batch: int,
    *,
    optimizer: str = "adam",
    autocast: str | None = None,
    foreach: bool = False,
    channels_last: bool = False,
    set_to_none: bool = True,
    training: bool = True,
    loss: Callable[[Any, Any], Any] | None = None,
    counter: Callable[[], Any] | None = None,
) -> int:
    """Peak live bytes of the second of two real training steps (or of one inference pass).

    `counter` makes what counts the step (default `LiveBytes`); `allocator_peak` passes its own.
    """
    torch.manual_seed(0)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train(training)
    opt = optimizer_for(model, optimizer, foreach) if training else None
    x = torch.randn(batch, *shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    labels = torch.zeros(batch, dtype=torch.long)
    criterion = loss or (lambda output, _: nn.functional.cross_entropy(output, labels))
    precision = (
        (lambda: torch.autocast("cpu", dtype=getattr(torch, autocast))) if autocast else contextlib.nullcontext
    )
    out = value = None
    steps = 2 if training else 1
    for step in range(steps):
        if step == steps - 1:
            count = (counter or LiveBytes)()
            held = [*model.parameters(), *model.buffers(), x, labels, out, value, *_state_tensors(opt)]
            count.hold(held + [p.grad for p in model.parameters()])
            del held
            count.peak = count.live
            count.__enter__()
        if opt is None:
            with torch.no_grad(), precision():
                out = model(x)
            continue
        with precision():
            out = model(x)
            value = criterion(out, x)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    count.__exit__(None, None, None)
    return int(count.peak)


def cuda_step_peaks(
    model: nn.Module, shape: tuple[int, ...], batch: int, *, optimizer: str = "adam", autocast: str | None = None
) -> tuple[int, int]:
    """``max_memory_allocated`` and ``max_memory_reserved`` of the second of two steps on the GPU.

    Less what the process held before the model came (so other tensors do
    not count), after the CUDA libraries' workspaces exist (they come with the
    first matrix product and stay: not the step's). The optimizer runs with
    CUDA's default (foreach).
    """
    device = torch.device("cuda")
    _warm_cuda_libraries(device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    torch.manual_seed(0)
    model = model.to(device)
    opt = optimizer_for(model, optimizer, foreach=None)
    x = torch.randn(batch, *shape, device=device)
    labels = torch.zeros(batch, dtype=torch.long, device=device)
    precision = (lambda: torch.autocast("cuda", dtype=getattr(torch, autocast))) if autocast else contextlib.nullcontext
    for step in range(2):
        if step == 1:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        with precision():
            out = model(x)
            value = nn.functional.cross_entropy(out, labels)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    peaks = (
        torch.cuda.max_memory_allocated(device) - allocated,
        torch.cuda.max_memory_reserved(device) - reserved,
    )
    del model, opt, x, labels, out, value
    torch.cuda.empty_cache()
    return peaks


def _warm_cuda_libraries(device: torch.device) -> None:
    layer = nn.Linear(64, 64).to(device)
    for precision in (torch.float32, torch.bfloat16):
        with torch.autocast("cuda", dtype=precision, enabled=precision != torch.float32):
            layer(torch.randn(64, 64, device=device)).sum().backward()
    del layer


class AllocatorRecord:
    """The CPU allocator's allocations and frees during the step (profiler memory events) on top of what is held."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._held: dict[int, int] = {}
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.peak = self.live = 0

    def hold(self, tensors: Iterable[Any]) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self._held[id(storage)] = storage.nbytes()
        self.live = sum(self._held.values())

    def __enter__(self) -> AllocatorRecord:
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._profile.__exit__(None, None, None)
        events = [
            (event.start_ns(), event.nbytes())
            for event in self._profile.profiler.kineto_results.events()  # type: ignore[union-attr]
            if event.name() == "[memory]" and str(event.device_type()).endswith("CPU")
        ]
        live = self.peak = self.live
        for _, nbytes in sorted(events):
            live += nbytes
            self.peak = max(self.peak, live)


def allocator_peak(model: nn.Module, shape: tuple[int, ...], batch: int, **options: Any) -> int:
    """The CPU allocator's peak over the same step as `measure_step`."""
    return measure_step(model, shape, batch, counter=AllocatorRecord, **options)


# ---------------------------------------------------------------------------
# The models of the test matrix (small, so that the real steps are quick on a CPU)


def shortcut(inputs: int, outputs: int, stride: int) -> nn.Module:
    """A residual block's shortcut: the input itself, or a strided 1x1 projection with BatchNorm."""
    if stride == 1 and inputs == outputs:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))


class BasicBlock(nn.Module):
    """conv-BN-ReLU(inplace)-conv-BN + shortcut, ReLU(inplace): a ResNet basic block."""

    def __init__(self, inputs: int, outputs: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(inplace=True),
            nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False), nn.BatchNorm2d(outputs),
        )
        self.shortcut = shortcut(inputs, outputs, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def conv_net() -> nn.Module:
    """A small ResNet: stem, two stages of basic blocks (BatchNorm, in-place ReLU), pooling, classifier."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        BasicBlock(16, 16), BasicBlock(16, 32, stride=2), BasicBlock(32, 64, stride=2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


def mlp() -> nn.Module:
    """Three linear layers on a flattened 3x32x32 image: 4.2 M parameters, few activations."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(3 * 32 * 32, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


class Transformer(nn.Module):
    """A small ViT: 4 px patches (64 tokens), 3 pre-norm encoder layers of width 96, dropout, mean pooling."""

    def __init__(self, width: int = 96, layers: int = 3) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, width, 4, 4)
        self.position = nn.Parameter(torch.zeros(1, 64, width))
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2) + self.position
        return self.head(self.encoder(tokens).mean(1))


def transformer() -> nn.Module:
    return Transformer()


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), each with BatchNorm; in-place ReLUs; a projection shortcut where needed."""

    def __init__(self, inputs: int, width: int, stride: int = 1) -> None:
        super().__init__()
        outputs = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, outputs, 1, bias=False), nn.BatchNorm2d(outputs),
        )
        self.shortcut = shortcut(inputs, outputs, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def resnet50_sized() -> nn.Module:
    """ResNet-50's layout: a 7x7 stem, max pooling, stages of 3, 4, 6 and 3 bottlenecks, 1000 classes."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
    ]
    inputs = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for index in range(blocks):
            layers.append(Bottleneck(inputs, width, stride if index == 0 else 1))
            inputs = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, 1000)]
    return nn.Sequential(*layers)


SHAPE = (3, 32, 32)
MODELS = {"conv": conv_net, "mlp": mlp, "transformer": transformer}
OPTIMIZERS = ("sgd", "momentum", "adam")
PRECISIONS = (None, "bfloat16")
BATCHES = (4, 16)
RESNET50_SHAPE = (3, 224, 224)
RESNET50_BATCHES = (8, 16)
