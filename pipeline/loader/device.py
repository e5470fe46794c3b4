"""The device side of the loader: flip, float, normalise and memory format; prefetch on a CUDA side stream.

The decode workers (`workers.py`) leave uint8 NCHW pixels in a ring slot;
here they become the batch the training loop gets. Flips are applied to
the uint8 pixels, then one pass converts to float and one more scales and
shifts in place. On CUDA the next `prefetch` batches are copied and
finished on a side stream while the current one is used; the training
stream waits for its own batch's event only. On the CPU the same code
runs with the stream context replaced by a no-op, so outputs are
identical; with thread workers the decode threads even write each image
already mirrored and normalised into the batch's output tensor
(`cpu_finish`), and the batch is only handed out here. ColorJitter runs
here, per batch, on CUDA; on a CPU device the decode workers run it on each
image as they write it (`worker_jitter`), with the same draws
(`color_draws`). With decoder="nvjpeg" the JPEGs are decoded on the GPU
here (`gpu_decode.py`).
The "yolo" recipe's batch ops run here too: its HSV gains where the workers
left them to the device (on CUDA), its MixUp and CutMix.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ..augment.color import ColorJitter, Draw, jitter_batch
from ..augment.hsv import apply_hsv
from ..augment.mixup import Mixed, cutmix_batch, mixup_batch
from ..specs import LoaderSpec
from .crops import Affine, CropSpec, flip_mask
from .damage import Extras, Item, Report
from .executors import failed_samples
from .hooks import run_batch_transform
from .mosaic_piece import HSV_GAINS, stand_in_mosaic
from .pacing import RunSlots
from .pieces import CpuFinish, Jitter
from .runs import Run, Upcoming
from .tasks import Batch, TaskPlan, make_batch, tensors_in
from .workers import DecodePool, HostBatch

MIXUP_STREAM = 0x6D69787570  # the MixUp draws' own stream of each batch's seed
COLOR_STREAM = 0x636F6C6F72  # the ColorJitter draws' own stream of each batch's seed

BatchOnDevice = tuple[torch.Tensor, torch.Tensor, Any]  # images, labels, and the side stream's event (None off CUDA)


def color_draws(jitter: ColorJitter, seed: int, epoch: int, rank: int, index: int, count: int) -> list[Draw]:
    """Batch `index`'s ColorJitter draws, by position: the one source of them, on the device or in the workers."""
    rng = np.random.default_rng([seed, epoch, rank, index, COLOR_STREAM])
    return [jitter.draw(rng) for _ in range(count)]


class OutputBuffers:
    """The CPU device's output batches: a recycled one the training loop no longer holds, else a new one.

    A fresh 38 MB tensor per batch costs more in page faults than the
    normalisation written into it. Batches are handed out as views, so a
    buffer is reused only when no view of it is alive (the training loop
    let go of that batch) and it is not waiting in the prefetch queue.

    Args:
        limit: buffers kept for reuse at most.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._pool: list[torch.Tensor] = []
        self._busy: set[int] = set()
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, memory_format: torch.memory_format) -> torch.Tensor:
        """A buffer of `shape` to decode a batch into; busy until `release`."""
        with self._lock:
            for buffer in self._pool:
                if buffer.shape == shape and id(buffer) not in self._busy and _only_reference(buffer):
                    self._busy.add(id(buffer))
                    return buffer
            buffer = torch.empty(shape, dtype=dtype, memory_format=memory_format)
            if len(self._pool) < self._limit:
                self._pool.append(buffer)
                self._busy.add(id(buffer))
            return buffer

    def release(self, buffer: torch.Tensor) -> None:
        """The batch was handed out (or dropped): from now on its views' life says when the buffer is free."""
        with self._lock:
            self._busy.discard(id(buffer))

    def __len__(self) -> int:
        return len(self._pool)


def _only_reference(tensor: torch.Tensor) -> bool:
    """True when no other tensor (a view handed to the training loop) shares this storage."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:  # pragma: no cover - older torch: never recycle
        return False
    storage = tensor.untyped_storage()
    return int(counter(storage._cdata)) <= 2  # the tensor itself + this `storage` wrapper


class DeviceFinish:
    """What becomes of a decoded batch on the training device.

    Args:
        spec: the loader's settings (mean, std, dtype, channels_last, flip, prefetch).
        device: the training device.
        rank: this process's rank (it seeds the flips).
        crop: what each sample becomes (the GPU decoder crops with it).
        buffers: CPU output buffers kept for reuse at most.
        plan: a task's targets (`tasks.py`): batches are `Batch`es; None: (images, labels).
        batch_transform: the user's callable on each batch on the device (in the side stream on CUDA).
    """

    def __init__(
        self,
        spec: LoaderSpec,
        device: torch.device,
        rank: int,
        crop: CropSpec,
        buffers: int,
        plan: TaskPlan | None = None,
        batch_transform: Callable[[Any], Any] | None = None,
    ) -> None:
        self.spec = spec
        self.plan = plan
        self.batch_transform = batch_transform
        # The user's sample_transform sees each sample as the batch gets it: the workers flip it first.
        self.flips_in_workers = plan is not None and plan.sample_transform is not None
        self.device = device
        self.rank = rank
        self.outputs = OutputBuffers(buffers)
        self._crop = crop
        self._gpu_decode = spec.decoder == "nvjpeg"
        self._mean = torch.tensor(spec.mean, dtype=torch.float32).view(1, 3, 1, 1) * 255.0
        self._std = torch.tensor(spec.std, dtype=torch.float32).view(1, 3, 1, 1) * 255.0
        self._dtype = getattr(torch, spec.dtype)
        self._affine_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._host_affine_cache: Affine | None = None
        jitter = ColorJitter(*spec.color_jitter)
        self._jitter = jitter if jitter.active and spec.train else None
        # No device to overlap with on the CPU: the decode workers jitter each image and the CPU finish stays on.
        self.jitter_in_workers = self._jitter is not None and device.type == "cpu" and not self._gpu_decode

    # -- on the CPU, in the decode threads ----------------------------------

    def cpu_finish(self, epoch: int, index: int, count: int) -> tuple[torch.Tensor | None, CpuFinish | None]:
        """On a CPU device with thread workers: the batch's output tensor and the per-image finisher."""
        if not (self.device.type == "cpu" and self.spec.worker_type == "thread" and not self._gpu_decode):
            return None, None
        if self.flips_in_workers:  # uint8 pixels in the ring for the user's sample_transform
            return None, None
        out = self._output_buffer(count)
        flips = self._flip_mask(epoch, index, count)
        view = out.numpy() if not self.spec.channels_last else out.permute(0, 2, 3, 1).numpy().transpose(0, 3, 1, 2)
        affine = None if out.dtype == torch.uint8 else self._host_affine()
        return out, CpuFinish(view, flips, affine)

    def worker_jitter(self, epoch: int, index: int, count: int) -> Jitter | None:
        """On a CPU device with ColorJitter: the batch's draws, which the decode workers run; else None."""
        if not self.jitter_in_workers:
            return None
        assert self._jitter is not None
        return tuple(color_draws(self._jitter, self.spec.seed, epoch, self.rank, index, count))

    def _output_buffer(self, count: int) -> torch.Tensor:
        memory_format = torch.channels_last if self.spec.channels_last else torch.contiguous_format
        dtype = torch.uint8 if self._dtype == torch.uint8 else torch.float32
        return self.outputs.take((count, 3, self.spec.crop, self.spec.crop), dtype, memory_format)

    # -- handing batches to the training loop -------------------------------

    def deliver(
        self, epoch: int, run: Run, pool: DecodePool, report: Report
    ) -> Iterator[Any]:
        """The run's batches on the device, in order: `prefetch` of them in flight on CUDA.

        Args:
            epoch: the run's epoch (it seeds the flips).
            run: the run whose queue holds the decoded batches.
            pool: the decode pool whose ring holds their pixels.
            report: receives the damage met (shards, samples) and what replaced it.

        Yields:
            (images, labels) on the device, ready for the training stream, every batch full;
            a `Batch` for a task (`tasks.py`).
        """
        free = run.free
        upcoming = Upcoming(run.out, report, depth=pool.ring.shape[0] - 1)
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None
        ready: deque[tuple[Any, Any]] = deque()  # (what is delivered, the side stream's event or None)
        depth = self.spec.prefetch if cuda and not pool.inline else 1  # num_workers=0: decoded when asked for
        exhausted = False
        try:
            while True:
                while not exhausted and len(ready) < depth:
                    batch = upcoming.next()
                    if batch is None:
                        exhausted = True
                        break
                    ready.append(self._deliverable(self._to_device(epoch, batch, free, side, pool, report, upcoming), batch, side))
                if not ready or run.stop.is_set():  # the end, or the loader was closed: nothing more
                    return
                delivered, done = ready.popleft()
                if done is not None:
                    # The training stream waits for this batch only, not for later ones
                    # already queued on the side stream; the caching allocator must know
                    # the tensors are used there.
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(done)
                    for tensor in tensors_in(delivered):
                        tensor.record_stream(current)
                yield delivered
        finally:
            upcoming.close(self.outputs.release)

    def _deliverable(self, on_device: BatchOnDevice, host: HostBatch, side: Any) -> tuple[Any, Any]:
        """What the training loop gets for a batch on the device, and the event it waits for.

        (images, labels) for classification; a task's `Batch`, its targets
        copied to the device; then the user's batch_transform. On CUDA the
        targets' copies and the transform are queued on the side stream
        behind the batch's pixels, while the training stream still works on
        earlier batches.
        """
        images, labels, done = on_device
        if self.plan is None and self.batch_transform is None:
            return (images, labels), done
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            delivered: Any = (images, labels)
            if self.plan is not None:
                targets = [host.targets[position] for position in range(host.count)]
                delivered = make_batch(self.plan, images, labels, host.keys, targets)
                if self.spec.recipe == "yolo":
                    delivered = self._yolo_mixup(delivered, host)
            if self.batch_transform is not None:
                delivered = run_batch_transform(self.batch_transform, delivered)
            if side is not None:
                done = torch.cuda.Event()
                done.record(side)
        return delivered, done

    def _to_device(
        self,
        epoch: int,
        batch: HostBatch,
        free: RunSlots,
        side: Any,
        pool: DecodePool,
        report: Report,
        upcoming: Upcoming,
    ) -> BatchOnDevice:
        if self._gpu_decode:
            return self._gpu_decoded(epoch, batch, free, side, pool, report, upcoming)
        if batch.finished is not None:
            return self._cpu_finished(batch, free, pool, report, upcoming)
        host_images, host_labels = pool.collect(batch, report, upcoming.later())
        flips = self._flips(epoch, batch)
        if side is None:
            images = self._finish_on_device(host_images, flips, batch)
            free.put(batch.slot)
            return images, host_labels, None
        with torch.cuda.stream(side):
            if self.spec.worker_type == "process":
                host_images = host_images.pin_memory()
            pixels = host_images.to(self.device, non_blocking=True)
            labels = host_labels.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
            images = self._finish_on_device(pixels, flips, batch)
            done = torch.cuda.Event()
            done.record(side)
        copied.synchronize()  # the pinned slot may be refilled once its copy has landed
        free.put(batch.slot)
        return images, labels, done

    def _cpu_finished(
        self, batch: HostBatch, free: RunSlots, pool: DecodePool, report: Report, upcoming: Upcoming
    ) -> BatchOnDevice:
        _, labels = pool.collect(batch, report, upcoming.later())
        free.put(batch.slot)
        assert batch.finished is not None
        images = batch.finished[:]
        self.outputs.release(batch.finished)
        if self._dtype not in (torch.float32, torch.uint8):
            images = images.to(self._dtype)
        return images, labels, None

    def _gpu_decoded(
        self,
        epoch: int,
        batch: HostBatch,
        free: RunSlots,
        side: Any,
        pool: DecodePool,
        report: Report,
        upcoming: Upcoming,
    ) -> BatchOnDevice:
        """nvjpeg: decode the batch's JPEGs on the GPU, crop and resize there too."""
        from .gpu_decode import decode_batch_on_gpu

        if self._crop.mosaics and self.plan is not None:
            return self._gpu_mosaics(batch, free, side, pool, report, upcoming)
        with torch.cuda.stream(side):
            pixels, failures = decode_batch_on_gpu(batch.items, self._crop, self.device)
            if self.plan is not None:  # the targets, worked out by the decode workers meanwhile
                known = {position for position, _ in failures}
                failures = sorted(failures + [f for f in failed_samples(batch) if f[0] not in known])
            if failures:
                pool.replace(batch, failures, report, upcoming.later(), self._gpu_redecode(pixels))
            images = self._finish_on_device(pixels, self._flips(epoch, batch), batch)
            labels = torch.from_numpy(batch.labels).to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        free.put(batch.slot)
        return images, labels, done

    def _gpu_mosaics(
        self, batch: HostBatch, free: RunSlots, side: Any, pool: DecodePool, report: Report, upcoming: Upcoming
    ) -> BatchOnDevice:
        """recipe="yolo" with nvjpeg: the workers' plans rendered here, from the batch's pictures decoded on the
        device once each (`gpu_mosaic.py`)."""
        from .gpu_mosaic import render_mosaics

        with torch.cuda.stream(side):
            failures = failed_samples(batch)  # waits for the workers' plans
            free.put(batch.slot)  # the workers wrote no pixel into it
            pixels = torch.zeros((batch.count, 3, self.spec.crop, self.spec.crop), dtype=torch.uint8, device=self.device)
            failures = sorted(failures + render_mosaics(batch.items, batch.targets, pixels))
            if failures:
                pool.replace(batch, failures, report, upcoming.later(), self._mosaic_upload(batch, pixels, pool))
            images = self._finish_on_device(pixels, None, batch)
            labels = torch.from_numpy(batch.labels).to(self.device, non_blocking=True)
            done = None
            if side is not None:  # always on CUDA; None where the glue runs on the CPU (its tests)
                done = torch.cuda.Event()
                done.record(side)
        return images, labels, done

    def _mosaic_upload(self, batch: HostBatch, pixels: torch.Tensor, pool: DecodePool) -> Callable[[int, Item, Extras], bool]:
        """A stand-in's mosaic (of the stand-in alone), rendered on the CPU and uploaded into its position."""
        assert self.plan is not None
        plan, crop = self.plan, pool.crop_for(batch.epoch)

        def decode_at(position: int, item: Item, extras: Extras = None) -> bool:
            into = np.empty((3, crop.size, crop.size), np.uint8)
            targets = stand_in_mosaic(plan, crop, item, extras, batch.keys[position], into)
            if targets is None:
                return False
            batch.targets[position] = targets
            pixels[position] = torch.from_numpy(into).to(pixels.device)
            return True

        return decode_at

    # -- flip, float, normalise ---------------------------------------------

    def _finish_on_device(
        self, pixels: torch.Tensor, flips: torch.Tensor | None, host: HostBatch | None = None
    ) -> torch.Tensor:
        """NCHW pixels already on the device -> flipped, normalised NCHW `dtype` (channels_last).

        The pixels are uint8 from the decode workers, or float in 0-255 from
        the GPU decoder. Flips are applied to them as they are (for uint8, a
        quarter of the bytes of floats); conversion and transpose are one pass
        into a preallocated output, scale and shift one more, in place.
        """
        if flips is not None and bool(flips.any()):
            chosen = flips.nonzero().flatten().to(self.device)
            pixels[chosen] = pixels[chosen].flip(3)
        if host is not None and self.plan is not None and self.spec.recipe == "yolo":
            pixels = self._yolo_hsv(pixels, host)
        if host is not None and self._jitter is not None and not self.jitter_in_workers:
            pixels = self._color_jitter(pixels, host)
        return self._scale_shift(pixels)

    def _color_jitter(self, pixels: torch.Tensor, host: HostBatch) -> torch.Tensor:
        """ColorJitter on the batch's uint8 pixels, each image its own draw (`pipeline.augment.color`)."""
        assert self._jitter is not None
        if pixels.is_floating_point():  # GPU-decoded: whole pixel values first, as uint8 outputs get them
            pixels = pixels.round().clamp_(0, 255).to(torch.uint8)
        draws = color_draws(self._jitter, self.spec.seed, host.epoch, self.rank, host.index, pixels.shape[0])
        return jitter_batch(pixels, draws)

    def _yolo_hsv(self, pixels: torch.Tensor, host: HostBatch) -> torch.Tensor:
        """recipe="yolo" with the HSV gains left to the device: each output that drew gains gets them (uint8)."""
        gains = [(host.targets[position] or {}).get(HSV_GAINS) for position in range(host.count)]
        chosen = [position for position, gain in enumerate(gains) if gain is not None]
        if not chosen:
            return pixels
        table = torch.tensor([gains[position] for position in chosen], dtype=torch.float32)
        index = torch.tensor(chosen, device=pixels.device)
        pixels[index] = apply_hsv(pixels[index], table)
        return pixels

    def _yolo_mixup(self, batch: Batch, host: HostBatch) -> Batch:
        """recipe="yolo" with `mixup` or `cutmix` in its hyperparameters: the batch's MixUp, then its CutMix
        (`pipeline.augment.mixup`), both from the batch as the recipe made it."""
        hyp = dict(self.spec.hyp)
        mixup, cutmix = hyp.get("mixup", 0.0), hyp.get("cutmix", 0.0)
        if not (self.spec.train and (mixup > 0 or cutmix > 0) and batch.boxes is not None and batch.box_labels is not None):
            return batch
        rng = np.random.default_rng([self.spec.seed, host.epoch, self.rank, host.index, MIXUP_STREAM])
        made = Mixed(batch.images, batch.boxes, batch.box_labels, batch.polygons, batch.masks, batch.instance_masks)
        ignore = self.plan.ignore_index if self.plan is not None else 255
        cut = cutmix_batch(mixup_batch(made, mixup, rng, ignore), cutmix, rng, sources=made)
        batch.images, batch.boxes, batch.box_labels, batch.polygons, batch.masks, batch.instance_masks = cut
        return batch

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

    def _flip_mask(self, epoch: int, index: int, count: int) -> np.ndarray | None:
        if not (self.spec.train and self.spec.flip) or self.flips_in_workers or self.spec.recipe == "yolo":
            return None
        return flip_mask(self.spec.seed, epoch, self.rank, index, count)

    def _flips(self, epoch: int, batch: HostBatch) -> torch.Tensor | None:
        mask = self._flip_mask(epoch, batch.index, batch.count)
        return None if mask is None else torch.from_numpy(mask)

    def _gpu_redecode(self, pixels: torch.Tensor) -> Callable[[int, Item, Extras], bool]:
        """Decode one item on the GPU into a position of a batch's pixels: True when it decoded."""
        from .gpu_decode import decode_batch_on_gpu

        def decode_at(position: int, item: Item, extras: Extras = None) -> bool:
            decoded, failures = decode_batch_on_gpu([item], self._crop, self.device)
            if failures:
                return False
            pixels[position] = decoded[0]
            return True

        return decode_at
