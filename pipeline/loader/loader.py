"""`make_loader`: batches from prepared shards, decoded by a worker pool, finished on the device.

    loader = make_loader("shards/manifest.json", batch_size=256, device="cuda")
    for epoch in range(90):
        loader.set_epoch(epoch)
        for images, labels in loader:   # on the GPU, normalised, ready
            ...
    print(loader.stats)

The host side decodes and crops into preallocated (pinned on CUDA) uint8
NCHW batch buffers; the device side converts to float, flips, normalises and
sets the memory format. On CUDA the next batches are copied and normalised on
a side stream while the current one is used. On the CPU the same code runs
with the stream context replaced by a no-op, so outputs are identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .cpu_decode import decode_many, default_decoder
from .crops import Affine, CropSpec
from ..errors import ConfigError
from .dataset import DatasetInfo, resolve_dataset
from .epoch import Record, pick_image, plan_epoch, read_segments, shuffle_buffer
from ..specs import LoaderSpec

log = logging.getLogger("gpufeed.loader")
_END = object()
_LIVE_LOADERS: weakref.WeakSet[Loader] = weakref.WeakSet()


def _stop_all_loaders() -> None:
    """At interpreter exit, stop every loader's threads before the runtime goes away.

    A pre-started epoch keeps a producer thread and decode threads busy; were
    they still inside torch or a decoder while Python finalizes, the process
    could abort on the way out.
    """
    for loader in list(_LIVE_LOADERS):
        with contextlib.suppress(Exception):
            loader.close()


try:  # before concurrent.futures joins its threads (its hook was registered first, runs last)
    threading._register_atexit(_stop_all_loaders)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - other Pythons
    import atexit

    atexit.register(_stop_all_loaders)


@dataclasses.dataclass
class LoaderStats:
    """Where the time of a training loop goes.

    Attributes:
        batches: batches delivered.
        samples: samples delivered.
        wait_s: seconds the training loop waited for data inside `next()`.
        step_s: seconds the training loop spent between batches (its own work).
        skipped: corrupt samples or shard parts skipped.
    """

    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    step_s: float = 0.0
    skipped: int = 0

    @property
    def stall_fraction(self) -> float:
        """Share of the loop's time spent waiting for data (0 = never stalled)."""
        total = self.wait_s + self.step_s
        return self.wait_s / total if total > 0 else 0.0

    @property
    def images_per_s(self) -> float:
        total = self.wait_s + self.step_s
        return self.samples / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        data = dataclasses.asdict(self)
        data["stall_fraction"] = self.stall_fraction
        data["images_per_s"] = self.images_per_s
        return data

    def __str__(self) -> str:
        return (
            f"{self.batches} batches, {self.samples} samples, {self.images_per_s:.0f} images/s, "
            f"waited {self.wait_s:.2f} s for data, stall fraction {self.stall_fraction:.1%}, {self.skipped} skipped"
        )


# ---------------------------------------------------------------------------
# Decode workers: threads (default) or processes writing into shared buffers

_SHARED_RING: np.ndarray | None = None  # set before forking process workers


@dataclasses.dataclass
class _CpuFinish:
    """The device side, done by the decode threads as they write each image.

    On a CPU device there is no device to overlap with: the decoder writes
    each image straight into the batch's output tensor, mirrored when its
    flip says so, converted and normalised in the same write (or as uint8).
    """

    out: np.ndarray  # view of the batch's NCHW (or channels-last) output, float32 or uint8
    flips: np.ndarray | None
    affine: Affine | None  # (1/std, -mean/std) per channel in 0-255 units; None for uint8

    def flip(self, position: int) -> bool:
        return self.flips is not None and bool(self.flips[position])


def _decode_chunk(
    ring: np.ndarray | None,
    slot: int,
    start: int,
    items: list[tuple[str, bytes, int]],
    crop: CropSpec,
    finish: _CpuFinish | None = None,
) -> list[tuple[int, str]]:
    """Decode items into ring[slot, start:...] (or the finished output); returns (position, reason) of failures."""
    target = ring if ring is not None else _SHARED_RING
    assert target is not None
    positions = range(start, start + len(items))
    if finish is None:
        failures = decode_many([target[slot, p] for p in positions], items, crop)
    else:
        slots = [finish.out[p] for p in positions]
        failures = decode_many(slots, items, crop, flips=[finish.flip(p) for p in positions], affine=finish.affine)
    return [(start + index, reason) for index, reason in failures]


class _ProcessExecutor:
    """A fork pool whose workers decode into the shared ring (no pixels through pipes)."""

    def __init__(self, workers: int, ring: np.ndarray) -> None:
        import multiprocessing

        global _SHARED_RING
        _SHARED_RING = ring
        self._pool = multiprocessing.get_context("fork").Pool(workers)

    def submit(self, func: Any, ring: Any, slot: int, start: int, items: Any, crop: CropSpec, finish: Any) -> Any:
        return self._pool.apply_async(func, (None, slot, start, items, crop))

    def shutdown(self) -> None:
        self._pool.terminate()
        self._pool.join()


def _result(pending: Any) -> Any:
    return pending.result() if isinstance(pending, Future) else pending.get()


class _RunSlots:
    """A run's view of the loader's ring slots.

    The slots are shared by every run of a loader, so the next epoch can
    start decoding into slots the current one has given back while its last
    batches are still being used. A run remembers the slots it holds and
    returns them all when it is stopped.
    """

    def __init__(self, pool: queue.Queue[int]) -> None:
        self._pool = pool
        self._held: set[int] = set()

    def get(self, stop: threading.Event) -> int | None:
        slot = _get(self._pool, stop)
        if slot is not None:
            self._held.add(slot)
        return slot

    def put(self, slot: int) -> None:
        """A batch was delivered: its slot may be refilled."""
        self._held.discard(slot)
        self._pool.put(slot)

    def release_all(self) -> None:
        while self._held:
            self._pool.put(self._held.pop())


class _Backlog:
    """Batch pieces handed to the decode threads that none has started yet.

    The producer reads the next batch only while fewer than a batch's worth
    of pieces wait. Otherwise, at the start of an epoch, it reads several
    batches ahead on the same cores while the first batch is still being
    decoded, and the first batch arrives late; in steady state the decode
    threads still always find a piece waiting.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting = 0

    def add(self, count: int) -> None:
        with self._cond:
            self._waiting += count

    def started(self) -> None:
        with self._cond:
            self._waiting -= 1
            self._cond.notify_all()

    def wait_below(self, limit: int, stop: threading.Event) -> None:
        with self._cond:
            while self._waiting >= limit and not stop.is_set():
                self._cond.wait(0.1)


def _run_piece(backlog: _Backlog, *args: Any) -> list[tuple[int, str]]:
    backlog.started()
    return _decode_chunk(*args)


@dataclasses.dataclass(eq=False)
class _Run:
    """One pass over an epoch: its producer thread, queues and in-flight decodes."""

    epoch: int
    skip: int
    out: queue.Queue[Any]
    free: _RunSlots
    stop: threading.Event
    inflight: list[Any]
    producer: threading.Thread | None = None
    backlog: _Backlog | None = None  # thread workers only

    def matches(self, epoch: int, skip: int) -> bool:
        return self.epoch == epoch and self.skip == skip


@dataclasses.dataclass
class _HostBatch:
    index: int
    slot: int
    count: int
    labels: np.ndarray
    pending: list[Any]
    keys: list[str]
    items: list[tuple[str, bytes, int]]
    finished: torch.Tensor | None = None


class Loader:
    """Iterable of (images, labels) batches on a device; build it with `make_loader`."""

    def __init__(
        self, dataset: DatasetInfo, spec: LoaderSpec, device: torch.device, rank: int = 0, world_size: int = 1
    ) -> None:
        self.dataset = dataset
        self.spec = spec
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.stats = LoaderStats()
        self._skip_batches = 0
        self._delivered = 0
        self._workers = _resolve_workers(spec.num_workers)
        decoder = default_decoder() if spec.decoder in ("auto", "nvjpeg") else spec.decoder
        self._crop = CropSpec(spec.crop, spec.train, spec.scale, spec.ratio, spec.eval_fraction, decoder)
        self._ring_slots = spec.prefetch + 2
        self._ring: torch.Tensor | None = None
        self._executor: Any = None
        self._gpu_decode = spec.decoder == "nvjpeg"
        self._mean = torch.tensor(spec.mean, dtype=torch.float32).view(1, 3, 1, 1) * 255.0
        self._std = torch.tensor(spec.std, dtype=torch.float32).view(1, 3, 1, 1) * 255.0
        self._dtype = getattr(torch, spec.dtype)
        self._affine_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._host_affine_cache: Affine | None = None
        self._out_pool: list[torch.Tensor] = []
        self._out_busy: set[int] = set()
        self._out_lock = threading.Lock()
        self._next_run: _Run | None = None
        self._runs: set[_Run] = set()  # started and not yet stopped
        self._run_lock = threading.Lock()
        self._free_slots: queue.Queue[int] | None = None
        self._closed = False
        self._warned: set[str] = set()
        _LIVE_LOADERS.add(self)

    # -- sizes and epochs -------------------------------------------------

    def _shards(self, epoch: int) -> list[Any]:
        return self.dataset.sets[epoch % self.dataset.variants]

    def _per_rank(self) -> int:
        total = sum(s.samples for s in self._shards(0))
        return total // self.world_size if self.spec.effective_drop_last else -(-total // self.world_size)

    def __len__(self) -> int:
        per_rank = self._per_rank()
        if self.spec.effective_drop_last:
            return per_rank // self.spec.batch_size
        return math.ceil(per_rank / self.spec.batch_size)

    @property
    def num_workers(self) -> int:
        return self._workers

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch`; with variant sets, read set `epoch mod K`."""
        if epoch < 0:
            raise ConfigError("epoch must be 0 or more")
        if epoch != self.epoch:
            self._skip_batches = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: restore with `load_state_dict` to continue exactly here."""
        return {
            "epoch": self.epoch,
            "batches": self._delivered,
            "seed": self.spec.seed,
            "batch_size": self.spec.batch_size,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue mid-epoch: the next iteration skips the batches already delivered."""
        for name in ("seed", "batch_size", "world_size"):
            if state.get(name) != getattr(self.spec, name, getattr(self, name, None)):
                raise ConfigError(
                    f"state was saved with {name}={state.get(name)!r}; this loader has "
                    f"{getattr(self.spec, name, getattr(self, name, None))!r}"
                )
        self.epoch = int(state["epoch"])
        self._skip_batches = int(state["batches"])
        self._delivered = self._skip_batches

    # -- host side ----------------------------------------------------------

    def _ensure_workers(self) -> None:
        if self._ring is not None:
            return
        shape = (self._ring_slots, self.spec.batch_size, 3, self.spec.crop, self.spec.crop)
        pin = self.device.type == "cuda" and self.spec.worker_type == "thread"
        ring = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
        if self.spec.worker_type == "process":
            ring.share_memory_()
            self._executor = _ProcessExecutor(self._workers, ring.numpy())
        else:
            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="gpufeed-decode")
        self._closed = False
        self._free_slots = queue.Queue()
        for slot in range(self._ring_slots):
            self._free_slots.put(slot)
        self._ring = ring

    def _records(self, epoch: int, errors: list[str]) -> Iterator[Record]:
        return _epoch_records(
            self._shards(epoch), self.spec, epoch, self.rank, self.world_size, errors
        )

    def _sample_seed(self, epoch: int, ordinal: int) -> int:
        return (self.spec.seed * 0x9E3779B97F4A7C15 ^ (epoch << 40) ^ (self.rank << 32) ^ ordinal) & (2**64 - 1)

    def _submit(
        self, index: int, slot: int, chunk: list[Record], epoch: int, backlog: _Backlog | None = None
    ) -> _HostBatch:
        assert self._ring is not None
        ring = self._ring.numpy() if self.spec.worker_type == "thread" else None
        items = [(r.extension, r.data, self._sample_seed(epoch, r.ordinal)) for r in chunk]
        per_worker = max(1, math.ceil(len(items) / self._workers))
        finished, finish = self._cpu_finish(epoch, index, len(items))
        pending = []
        decode = _decode_chunk if backlog is None else functools.partial(_run_piece, backlog)
        for start in range(0, 0 if self._gpu_decode else len(items), per_worker):
            if backlog is not None:
                backlog.add(1)
            piece = items[start : start + per_worker]
            pending.append(self._executor.submit(decode, ring, slot, start, piece, self._crop, finish))
        labels = np.array([r.label for r in chunk], dtype=np.int64)
        keys = [r.key for r in chunk]
        return _HostBatch(index, slot, len(chunk), labels, pending, keys, items, finished)

    def _output_buffer(self, count: int) -> torch.Tensor:
        """A CPU output batch: a recycled one the training loop no longer holds, else a new one.

        A fresh 38 MB tensor per batch costs more in page faults than the
        normalisation written into it. Batches are handed out as views, so a
        buffer is reused only when no view of it is alive (the training loop
        let go of that batch) and it is not waiting in the prefetch queue.
        """
        memory_format = torch.channels_last if self.spec.channels_last else torch.contiguous_format
        dtype = torch.uint8 if self._dtype == torch.uint8 else torch.float32
        shape = (count, 3, self.spec.crop, self.spec.crop)
        with self._out_lock:
            for buffer in self._out_pool:
                if buffer.shape == shape and id(buffer) not in self._out_busy and _only_reference(buffer):
                    self._out_busy.add(id(buffer))
                    return buffer
            buffer = torch.empty(shape, dtype=dtype, memory_format=memory_format)
            if len(self._out_pool) < self._ring_slots + self.spec.prefetch + 2:
                self._out_pool.append(buffer)
                self._out_busy.add(id(buffer))
            return buffer

    def _cpu_finish(self, epoch: int, index: int, count: int) -> tuple[torch.Tensor | None, _CpuFinish | None]:
        """On a CPU device with thread workers: the batch's output tensor and the per-image finisher."""
        if not (self.device.type == "cpu" and self.spec.worker_type == "thread" and not self._gpu_decode):
            return None, None
        out = self._output_buffer(count)
        flips = self._flip_mask(epoch, index, count)
        view = out.numpy() if not self.spec.channels_last else out.permute(0, 2, 3, 1).numpy().transpose(0, 3, 1, 2)
        affine = None if out.dtype == torch.uint8 else self._host_affine()
        return out, _CpuFinish(view, flips, affine)

    # -- device side --------------------------------------------------------

    def _finish_on_device(self, pixels: torch.Tensor, flips: torch.Tensor | None) -> torch.Tensor:
        """uint8 NCHW already on the device -> normalised NCHW `dtype` (flip, channels_last).

        Flips are applied to the uint8 pixels (a quarter of the bytes of
        floats); conversion and transpose are one pass into a preallocated
        output, scale and shift one more, in place.
        """
        if flips is not None and bool(flips.any()):
            chosen = flips.nonzero().flatten().to(self.device)
            pixels[chosen] = pixels[chosen].flip(3)
        return self._scale_shift(pixels)

    def _scale_shift(self, nchw: torch.Tensor) -> torch.Tensor:
        scale, shift = self._affine()
        memory_format = torch.channels_last if self.spec.channels_last else torch.contiguous_format
        if self._dtype == torch.uint8:
            pixels = torch.empty(nchw.shape, dtype=torch.uint8, device=self.device, memory_format=memory_format)
            if nchw.is_floating_point():  # GPU-decoded and resized: back to whole pixel values
                nchw = nchw.round().clamp_(0, 255)
            return pixels.copy_(nchw)
        out = torch.empty(nchw.shape, dtype=torch.float32, device=self.device, memory_format=memory_format)
        out.copy_(nchw)
        out.mul_(scale).add_(shift)
        return out if self._dtype == torch.float32 else out.to(self._dtype)

    def _host_affine(self) -> Affine:
        if self._host_affine_cache is None:
            scale, shift = self._affine()
            self._host_affine_cache = Affine.of(scale.cpu().reshape(3).numpy(), shift.cpu().reshape(3).numpy())
        return self._host_affine_cache

    def _affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(1/std, -mean/std) per channel, in 0-255 units, cached on the device."""
        if self._affine_cache is None:
            scale = (1.0 / self._std).to(self.device)
            shift = (-self._mean / self._std).to(self.device)
            self._affine_cache = (scale, shift)
        return self._affine_cache

    def _normalise(self, x: torch.Tensor, flips: torch.Tensor | None) -> torch.Tensor:
        """float NCHW in 0-255 on the device (GPU decode) -> flipped, normalised, `dtype`."""
        if flips is not None and bool(flips.any()):
            chosen = flips.nonzero().flatten().to(self.device)
            x[chosen] = x[chosen].flip(3)
        return self._scale_shift(x)

    def _flip_mask(self, epoch: int, index: int, count: int) -> np.ndarray | None:
        if not (self.spec.train and self.spec.flip):
            return None
        rng = np.random.default_rng([self.spec.seed, epoch, self.rank, index, 0xF1])
        return rng.random(count) < 0.5

    def _flips(self, epoch: int, batch: _HostBatch, keep: np.ndarray | None) -> torch.Tensor | None:
        mask = self._flip_mask(epoch, batch.index, batch.count)
        if mask is None:
            return None
        return torch.from_numpy(mask if keep is None else mask[keep])

    def _host_tensors(self, batch: _HostBatch) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None]:
        assert self._ring is not None
        failures = [failure for pending in batch.pending for failure in _result(pending)]
        images = self._ring[batch.slot, : batch.count]
        labels = torch.from_numpy(batch.labels)
        keep = None
        if failures:
            bad = {position for position, _ in failures}
            for position, reason in failures:
                self._warn(f"skipping sample {batch.keys[position]}: {reason}")
            keep = np.array([i for i in range(batch.count) if i not in bad], dtype=np.int64)
            images = images[torch.from_numpy(keep)]
            labels = labels[torch.from_numpy(keep)]
        return images, labels, keep

    def _warn(self, message: str) -> None:
        self.stats.skipped += 1
        if message not in self._warned and len(self._warned) < 100:
            self._warned.add(message)
            log.warning(message)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._ensure_workers()
        epoch, skip = self.epoch, self._skip_batches
        with self._run_lock:
            ahead, self._next_run = self._next_run, None
        run = ahead if ahead is not None and ahead.matches(epoch, skip) else None
        for other in list(self._runs):  # one iteration at a time: this one ends any earlier one, and a
            if other is not run:  # run started ahead for another epoch
                self._stop_run(other)
        run = run or self._start_run(epoch, skip)
        self._skip_batches = 0
        self._delivered = skip
        finished = False
        try:
            yield from self._deliver(epoch, run.out, run.free)
            finished = not run.stop.is_set()  # else a newer iteration took over: this one moves nothing on
        finally:
            self._stop_run(run)
            if finished:
                self.epoch = epoch + 1  # a finished epoch moves on unless set_epoch says otherwise
                self._delivered = 0
                self._prestart(self.epoch)

    def _prestart(self, epoch: int) -> None:
        """Persistent workers: start decoding `epoch` (from its first batch) ahead of time.

        Called by a run's producer once it has queued its last batch, so the
        decode workers go straight on with the next epoch while the training
        loop is still busy with this one; and when the epoch is over, in case
        the producer could not (it was stopped). Set_epoch to anything else
        discards this run.
        """
        with self._run_lock:
            if self._next_run is None and not self._closed and self._ring is not None:
                self._next_run = self._start_run(epoch, 0)

    def _start_run(self, epoch: int, skip: int) -> _Run:
        assert self._free_slots is not None
        out: queue.Queue[Any] = queue.Queue(maxsize=self.spec.prefetch)
        run = _Run(epoch, skip, out, _RunSlots(self._free_slots), threading.Event(), [])
        run.backlog = _Backlog() if self.spec.worker_type == "thread" else None
        run.producer = threading.Thread(target=_produce, args=(weakref.ref(self), run), daemon=True)
        self._runs.add(run)
        run.producer.start()
        return run

    def _stop_run(self, run: _Run) -> None:
        self._runs.discard(run)
        run.stop.set()
        if run.producer is not None and run.producer is not threading.current_thread():
            run.producer.join(timeout=30)
        for pending in run.inflight:  # no decode may still write into a slot another run reuses
            with contextlib.suppress(Exception):
                _result(pending)
        while True:  # batches never delivered give their output buffers back
            try:
                item = run.out.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _HostBatch) and item.finished is not None:
                with self._out_lock:
                    self._out_busy.discard(id(item.finished))
        run.free.release_all()
        with contextlib.suppress(queue.Full):  # an iterator still holding this run ends instead of waiting
            run.out.put_nowait(_END)

    def _discard_next_run(self) -> None:
        with self._run_lock:
            run, self._next_run = self._next_run, None
        if run is not None:
            self._stop_run(run)

    def _next_host_batch(self, out: queue.Queue[Any]) -> _HostBatch | None:
        while True:
            item = out.get()
            if item is _END:
                return None
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, tuple):
                self._warn(item[1])
                continue
            return item  # type: ignore[no-any-return]

    def _deliver(self, epoch: int, out: queue.Queue[Any], free: _RunSlots) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None
        ready: deque[tuple[torch.Tensor, torch.Tensor, int, Any]] = deque()
        exhausted = False
        step_started: float | None = None
        while True:
            waited_from = time.perf_counter()
            if step_started is not None:
                self.stats.step_s += waited_from - step_started
            while not exhausted and len(ready) < (self.spec.prefetch if cuda else 1):
                batch = self._next_host_batch(out)
                if batch is None:
                    exhausted = True
                    break
                ready.append(self._to_device(epoch, batch, free, side))
            if not ready:
                return
            images, labels, count, done = ready.popleft()
            if done is not None:
                # The training stream waits for this batch only, not for later ones
                # already queued on the side stream; the caching allocator must know
                # the tensors are used there.
                current = torch.cuda.current_stream(self.device)
                current.wait_event(done)
                images.record_stream(current)
                labels.record_stream(current)
            self.stats.wait_s += time.perf_counter() - waited_from
            self.stats.batches += 1
            self.stats.samples += count
            self._delivered += 1
            step_started = time.perf_counter()
            yield images, labels

    def _to_device(
        self, epoch: int, batch: _HostBatch, free: _RunSlots, side: Any
    ) -> tuple[torch.Tensor, torch.Tensor, int, Any]:
        if self._gpu_decode:
            return self._gpu_decoded(epoch, batch, free, side)
        if batch.finished is not None:
            return self._cpu_finished(batch, free)
        host_images, host_labels, keep = self._host_tensors(batch)
        flips = self._flips(epoch, batch, keep)
        if side is None:
            images = self._finish_on_device(host_images, flips)
            free.put(batch.slot)
            return images, host_labels, int(host_labels.shape[0]), None
        with torch.cuda.stream(side):
            if self.spec.worker_type == "process":
                host_images = host_images.pin_memory()
            pixels = host_images.to(self.device, non_blocking=True)
            labels = host_labels.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
            images = self._finish_on_device(pixels, flips)
            done = torch.cuda.Event()
            done.record(side)
        copied.synchronize()  # the pinned slot may be refilled once its copy has landed
        free.put(batch.slot)
        return images, labels, int(labels.shape[0]), done

    def _cpu_finished(self, batch: _HostBatch, free: _RunSlots) -> tuple[torch.Tensor, torch.Tensor, int, Any]:
        _, labels, keep = self._host_tensors(batch)
        free.put(batch.slot)
        assert batch.finished is not None
        images = batch.finished[:] if keep is None else batch.finished[torch.from_numpy(keep)]
        with self._out_lock:  # from now on the view's life tells whether the buffer is free
            self._out_busy.discard(id(batch.finished))
        if self._dtype not in (torch.float32, torch.uint8):
            images = images.to(self._dtype)
        return images, labels, int(labels.shape[0]), None

    def _gpu_decoded(
        self, epoch: int, batch: _HostBatch, free: _RunSlots, side: Any
    ) -> tuple[torch.Tensor, torch.Tensor, int, Any]:
        """nvjpeg: decode the batch's JPEGs on the GPU, crop and resize there too."""
        from .gpu_decode import decode_batch_on_gpu

        with torch.cuda.stream(side):
            pixels, failures = decode_batch_on_gpu(batch.items, self._crop, self.device)
            keep = None
            labels = torch.from_numpy(batch.labels)
            if failures:
                for position, reason in failures:
                    self._warn(f"skipping sample {batch.keys[position]}: {reason}")
                bad = {position for position, _ in failures}
                keep = np.array([i for i in range(batch.count) if i not in bad], dtype=np.int64)
                pixels = pixels[torch.from_numpy(keep).to(self.device)]
                labels = labels[torch.from_numpy(keep)]
            images = self._normalise(pixels, self._flips(epoch, batch, keep))
            labels = labels.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        free.put(batch.slot)
        return images, labels, int(labels.shape[0]), done

    def close(self) -> None:
        """Stop the worker pool (also done when the loader is garbage collected or at exit)."""
        self._closed = True
        self._discard_next_run()
        for run in list(self._runs):
            self._stop_run(run)
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
            self._ring = None

    def __del__(self) -> None:
        try:  # also at interpreter teardown, when module globals may already be gone
            self.close()
        except Exception:
            pass


def _epoch_records(
    shards: list[Any], spec: LoaderSpec, epoch: int, rank: int, world_size: int, errors: list[str]
) -> Iterator[Record]:
    """This rank's samples of an epoch, in their deterministic order."""
    segments, per_rank = plan_epoch(
        shards,
        seed=spec.seed,
        epoch=epoch,
        rank=rank,
        world=world_size,
        shuffle=spec.train,
        drop_last=spec.effective_drop_last,
    )
    samples = read_segments(shards, segments, spec.interleave if spec.train else 1, errors.append)
    if spec.train:
        rng = np.random.default_rng([spec.seed, epoch, rank, 0x5B])
        samples = shuffle_buffer(samples, spec.shuffle_buffer, rng)
    ordinal = 0
    for key, members in samples:
        picked = pick_image(members)
        if picked is None:
            errors.append(f"sample {key} has no image member ({', '.join(sorted(members))})")
            continue
        label = int(members["cls"]) if members.get("cls", b"").strip().lstrip(b"-").isdigit() else -1
        yield Record(key, picked[1], picked[0], label, ordinal)
        ordinal += 1
        if ordinal >= per_rank:
            return


def _produce(loader_ref: Any, run: _Run) -> None:
    """The producer thread: records -> batches submitted to the decode workers -> run.out.

    It holds the Loader only while submitting a batch, never while it waits,
    so a loader the program drops is collected (and its workers stopped) even
    with a pre-started epoch waiting in its queue.
    """
    errors: list[str] = []
    try:
        loader = loader_ref()
        if loader is None:
            return
        records = loader._records(run.epoch, errors)
        batch_size, drop_last = loader.spec.batch_size, loader.spec.effective_drop_last
        pieces = loader.num_workers
        del loader
        for _ in range(run.skip * batch_size):  # resume: replay the order without decoding
            if next(records, None) is None:
                break
        index = run.skip
        while not run.stop.is_set():
            if run.backlog is not None:
                run.backlog.wait_below(pieces, run.stop)
            chunk = [r for _, r in zip(range(batch_size), records)]
            _flush_errors(errors, run)
            if not chunk or (len(chunk) < batch_size and drop_last):
                break
            slot = run.free.get(run.stop)
            loader = loader_ref()
            if slot is None or loader is None:
                return
            batch = loader._submit(index, slot, chunk, run.epoch, run.backlog)
            del loader
            run.inflight.extend(batch.pending)
            _put(run.out, batch, run.stop)
            time.sleep(0)  # let go of the GIL: the decode threads start on this batch now, not at the next switch
            index += 1
        _flush_errors(errors, run)
        _put(run.out, _END, run.stop)
        loader = loader_ref()
        if loader is not None and not run.stop.is_set():
            loader._prestart(run.epoch + 1)
        del loader
    except BaseException as exc:  # surfaced in the training loop, never lost in a thread
        _put(run.out, exc, run.stop)


def _flush_errors(errors: list[str], run: _Run) -> None:
    while errors:
        _put(run.out, ("error", errors.pop(0)), run.stop)


def _only_reference(tensor: torch.Tensor) -> bool:
    """True when no other tensor (a view handed to the training loop) shares this storage."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:  # pragma: no cover - older torch: never recycle
        return False
    storage = tensor.untyped_storage()
    return int(counter(storage._cdata)) <= 2  # the tensor itself + this `storage` wrapper


def _get(source: queue.Queue[int], stop: threading.Event) -> int | None:
    while not stop.is_set():
        try:
            return source.get(timeout=0.1)
        except queue.Empty:
            continue
    return None


def _put(target: queue.Queue[Any], item: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            target.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _resolve_workers(num_workers: int | str) -> int:
    if num_workers == "auto":
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover
            return max(1, os.cpu_count() or 1)
    return int(num_workers)


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" (CUDA when available), "cpu", "cuda[:N]" or a torch.device; ConfigError when unusable."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but CUDA is not available here; use device='auto' or 'cpu'")
    return resolved


def _distributed(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None or world_size is not None:
        rank, world_size = rank or 0, world_size or 1
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world_size = 0, 1
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}")
    return rank, world_size


def make_loader(
    source: str,
    batch_size: int,
    *,
    device: str | torch.device = "auto",
    train: bool = True,
    crop: int = 224,
    rank: int | None = None,
    world_size: int | None = None,
    **options: Any,
) -> Loader:
    """Build a loader over a prepared dataset.

    Args:
        source: a manifest path/URL, a dataset directory, or a shard brace
            pattern (`shards/shard-{000000..000099}.tar`).
        batch_size: samples per batch (per rank).
        device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1", or a torch.device.
        train: random-resized crops, flips and shuffling; False gives
            centre crops in a fixed order.
        crop: output side in pixels.
        rank, world_size: override what torch.distributed reports.
        **options: any other LoaderSpec field (num_workers, worker_type,
            mean, std, dtype, channels_last, drop_last, prefetch, seed,
            shuffle_buffer, scale, ratio, flip, decoder, ...).

    Returns:
        A Loader: iterate for (images, labels); `len()`, `set_epoch`,
        `stats`, `state_dict`, `load_state_dict`.

    Raises:
        ConfigError: invalid settings (checked before anything is built).
        ManifestError: the source is not a prepared dataset.
    """
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(LoaderSpec)})
    if unknown:
        raise ConfigError(f"make_loader got unknown option(s): {', '.join(unknown)}")
    for name in ("mean", "std", "scale", "ratio"):
        if name in options:
            options[name] = tuple(options[name])
    spec = LoaderSpec(batch_size=batch_size, train=train, crop=crop, **options)
    resolved = resolve_device(device)
    if spec.decoder == "nvjpeg":
        from .gpu_decode import check_gpu_decode

        check_gpu_decode(resolved)
    rank, world_size = _distributed(rank, world_size)
    dataset = resolve_dataset(source)
    if dataset.samples == 0:
        raise ConfigError(f"{source} holds no samples")
    return Loader(dataset, spec, resolved, rank, world_size)
