"""The traced step as a device holds it: the CPU's tensor bytes, or CUDA's caching allocator and context.

`DeviceMemory` answers for any batch from the traces (`trace`): the
peak of live bytes, and on CUDA the same allocations and frees replayed
through `CachingAllocator`, a model of PyTorch's allocator with its default
settings, plus the memory the CUDA context holds outside it. The largest
batch that fits is found from the traced ``c + s·B`` bound and checked
against the device's own rounding.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from typing import Any

from ...errors import ConfigError
from .trace import TRACE_BATCHES, NotAffineError, StepModel

MEMORY_DEVICES = ("auto", "cuda", "cpu")
# What a CUDA 12 context with lazy module loading holds outside PyTorch's allocator on a recent GPU
# (the driver's state, kernels, cuBLAS/cuDNN handles); measured instead wherever a CUDA device is here.
ASSUMED_CUDA_CONTEXT = 512 << 20
MAX_BATCH = 1 << 24  # the search stops here: a model whose memory hardly grows with the batch


class DeviceMemory:
    """The traced step at any batch, as the device sees it.

    On the CPU that is the peak of live tensor bytes; on CUDA the same events
    replayed through the caching allocator (`CachingAllocator`),
    plus the CUDA context. When the traces do not line up as ``c + s·B`` per
    storage (`affine` False, `reason` says why), every batch asked for is
    traced on its own.
    """

    def __init__(self, tracer: Callable[[int], Any], device: str, context_bytes: int) -> None:
        self.device = device
        self.context_bytes = context_bytes
        self._tracer = tracer
        self._models: dict[int, StepModel] = {}
        self._cache: dict[tuple[str, int], int] = {}
        traces = [tracer(batch) for batch in TRACE_BATCHES]
        self.reason = ""
        try:
            self.model: StepModel | None = StepModel.fit(traces)
        except NotAffineError as exc:
            self.model = None
            self.reason = str(exc)
            self._models = {trace.batch: StepModel.single(trace) for trace in traces}

    @property
    def affine(self) -> bool:
        return self.model is not None

    def at(self, batch: int) -> StepModel:
        """The step model that holds at `batch`."""
        if self.model is not None:
            return self.model
        if batch not in self._models:
            self._models[batch] = StepModel.single(self._tracer(batch))
        return self._models[batch]

    def peak(self, batch: int) -> int:
        """The peak of live tensor bytes."""
        return self._cached("peak", batch, lambda: self.at(batch).peak(batch))

    def allocated(self, batch: int) -> int:
        if self.device != "cuda":
            return self.peak(batch)
        return self._cached("allocated", batch, lambda: self._allocator(batch)[0])

    def reserved(self, batch: int) -> int:
        if self.device != "cuda":
            return self.peak(batch)
        return self._cached("reserved", batch, lambda: self._allocator(batch)[1])

    def need(self, batch: int) -> int:
        """What must be free on the device: reserved segments and the CUDA context, or the CPU's peak."""
        return self.context_bytes + self.reserved(batch)

    def largest_batch(self, usable: int) -> int:
        """The largest batch whose `need` is at most `usable` bytes."""
        if self.model is not None:  # the traced bytes bound it from above; rounding only adds
            upper = min(MAX_BATCH, self.model.largest_batch(usable - self.context_bytes))
        else:
            upper = 1
            while upper < MAX_BATCH and self.need(upper) <= usable:
                upper *= 2
        return largest_fitting(self.need, usable, upper)

    def _allocator(self, batch: int) -> tuple[int, int]:
        peak = replay(self.at(batch), batch)
        self._cache[("allocated", batch)] = peak.allocated
        self._cache[("reserved", batch)] = peak.reserved
        return peak.allocated, peak.reserved

    def _cached(self, what: str, batch: int, compute: Callable[[], int]) -> int:
        key = (what, batch)
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]


def context_bytes(given: int | str | None, device: str) -> tuple[int, str]:
    """(bytes, "given" / "measured" / "assumed") of the memory the CUDA context takes."""
    from ...units import parse_bytes

    if device != "cuda":
        return 0, ""
    if given is not None:
        return parse_bytes(given), "given"
    import torch

    if torch.cuda.is_available():
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info()
        return max(0, total - free - torch.cuda.memory_reserved()), "measured"
    return ASSUMED_CUDA_CONTEXT, "assumed"


def parse_vram(vram: int | str | None) -> int | None:
    """Bytes of `vram`: a size ("16GiB", 80e9), "device" (the CUDA device's total), or None (no limit).

    Raises:
        ConfigError: a malformed size, or "device" without a CUDA device.
    """
    from ...units import parse_bytes

    if vram is None:
        return None
    if vram == "device":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("vram=device needs a CUDA device here; give a size such as 16GiB")
        return int(torch.cuda.mem_get_info()[1])
    return parse_bytes(vram)


def choose_memory_device(for_device: str, vram: int | str | None) -> str:
    """The memory to estimate, "cuda" or "cpu"; "auto" is CUDA when a VRAM is given or a CUDA device is here.

    Raises:
        ConfigError: an unknown choice.
    """
    if for_device not in MEMORY_DEVICES:
        raise ConfigError(f"for_device must be one of {', '.join(MEMORY_DEVICES)}, got {for_device!r}")
    if for_device != "auto":
        return for_device
    import torch

    return "cuda" if vram is not None or torch.cuda.is_available() else "cpu"


def trace_device(memory_device: str) -> str:
    """The fake tensors' device: CUDA's kernels and autocast rules where CUDA is here, else the CPU's."""
    import torch

    return "cuda" if memory_device == "cuda" and torch.cuda.is_available() else "cpu"


def largest_fitting(need: Callable[[int], int], usable: int, upper: int) -> int:
    """The largest batch in [1, upper] with need(batch) ≤ usable (need grows with the batch); 0 if none."""
    if upper < 1 or need(1) > usable:
        return 0
    low, high = 1, upper
    if need(high) <= usable:
        return high
    while high - low > 1:  # need(low) fits, need(high) does not
        middle = (low + high) // 2
        if need(middle) <= usable:
            low = middle
        else:
            high = middle
    return low


@dataclasses.dataclass(frozen=True)
class AllocatorPeak:
    """The caching allocator's view of a step: what ``max_memory_allocated`` / ``max_memory_reserved`` report.

    Attributes:
        allocated: the largest sum of allocated blocks (512-byte multiples, or the whole block left unsplit).
        reserved: the largest sum of segments taken from the driver (2 MiB for small blocks, 20 MiB or a
            multiple of 2 MiB for large ones), cached for reuse and never given back.
    """

    allocated: int
    reserved: int


def replay(model: StepModel, batch: int) -> AllocatorPeak:
    """Replay every allocation and free of the traced run through `CachingAllocator`; its peaks in the measured step."""
    allocator = CachingAllocator()
    storages, signs, sizes = model.events(batch)
    addresses: dict[int, int | None] = {}
    allocated = reserved = 0
    for position, (storage, sign) in enumerate(zip(storages, signs)):
        if sign > 0:
            addresses[storage] = allocator.malloc(sizes[storage])
        else:
            allocator.free(addresses.pop(storage))
        if position >= model.start - 1:  # from the state the measured step starts in
            allocated = max(allocated, allocator.allocated)
            reserved = max(reserved, allocator.reserved)
    return AllocatorPeak(allocated, reserved)


class CachingAllocator:
    """PyTorch's CUDA caching allocator with its default settings, as far as sizes go.

    Requests are rounded up to 512-byte blocks. Blocks up to 1 MiB come from
    2 MiB segments, larger ones from 20 MiB segments (requests under 10 MiB)
    or from a segment of their own rounded up to 2 MiB. A free block is cached
    and reused by best fit; a block is split when the rest is at least 512
    bytes (small pool) or more than 1 MiB (large pool), and neighbours merge
    again when freed. Segments are never given back (no ``empty_cache``).
    """

    BLOCK = 512
    SMALL = 1 << 20
    SMALL_SEGMENT = 2 << 20
    LARGE_SEGMENT = 20 << 20
    MIN_LARGE_ALLOC = 10 << 20
    ROUND_LARGE = 2 << 20

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self._pools: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # small? -> sorted (size, address)
        self._blocks: dict[int, list[Any]] = {}  # address -> [size, free, small, segment start, segment end]
        self._ends: dict[int, int] = {}  # end address -> start address of the block ending there
        self._next_segment = 0

    @classmethod
    def block_size(cls, nbytes: int) -> int:
        """A request rounded up to the allocator's 512-byte granularity."""
        return max(cls.BLOCK, -(-nbytes // cls.BLOCK) * cls.BLOCK)

    @classmethod
    def segment_size(cls, block: int) -> int:
        """The size of a new segment for a block of `block` bytes."""
        if block <= cls.SMALL:
            return cls.SMALL_SEGMENT
        if block < cls.MIN_LARGE_ALLOC:
            return cls.LARGE_SEGMENT
        return -(-block // cls.ROUND_LARGE) * cls.ROUND_LARGE

    def malloc(self, nbytes: int) -> int | None:
        """Allocate `nbytes`; returns the block's address (None for an empty storage)."""
        if nbytes <= 0:
            return None
        size = self.block_size(nbytes)
        small = size <= self.SMALL
        pool = self._pools[small]
        found = bisect.bisect_left(pool, (size, -1))
        if found < len(pool):
            _, address = pool.pop(found)
        else:
            segment = self.segment_size(size)
            address = self._next_segment
            self._next_segment += segment + self.BLOCK  # segments never touch, so never merge
            self.reserved += segment
            self._blocks[address] = [segment, True, small, address, address + segment]
            self._ends[address + segment] = address
        block = self._blocks[address]
        rest = block[0] - size
        if (rest >= self.BLOCK) if small else (rest > self.SMALL):
            del self._ends[address + block[0]]
            block[0] = size
            self._ends[address + size] = address
            self._add_free(address + size, rest, small, block[3], block[4])
        block[1] = False
        self.allocated += block[0]
        return address

    def free(self, address: int | None) -> None:
        """Return a block to the cache, merged with free neighbours in its segment."""
        if address is None:
            return
        size, _, small, start, end = self._blocks.pop(address)
        del self._ends[address + size]
        self.allocated -= size
        following = address + size
        if following < end and self._blocks[following][1]:
            size += self._take_free(following)
        if address > start:
            previous = self._ends[address]
            if self._blocks[previous][1]:
                size += self._take_free(previous)
                address = previous
        self._add_free(address, size, small, start, end)

    def _add_free(self, address: int, size: int, small: bool, start: int, end: int) -> None:
        self._blocks[address] = [size, True, small, start, end]
        self._ends[address + size] = address
        bisect.insort(self._pools[small], (size, address))

    def _take_free(self, address: int) -> int:
        size, _, small, _, _ = self._blocks.pop(address)
        del self._ends[address + size]
        pool = self._pools[small]
        del pool[bisect.bisect_left(pool, (size, address))]
        return size
