"""`Loader`: the epochs and the runs over them, the placement, the state and the stats (`make_loader` builds it).

Each iteration is a run over one epoch: a producer thread batches the
epoch's records (`epoch.py`, `runs.py`) and hands them to the decode
workers (`workers.py`), which crop and decode into preallocated (pinned on
CUDA) uint8 NCHW batch buffers; the device side converts to float, flips,
normalises and sets the memory format, on CUDA on a side stream a few
batches ahead (`device.py`). Once an epoch's last batch is queued the next
epoch starts decoding, so the training loop does not wait at the boundary.
Damaged shards and samples are handled by the error policy (`damage.py`):
every rank still yields `len(loader)` full batches, or the first damage
raises.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch

from ..errors import ConfigError
from ..specs import LoaderSpec
from .cpu_decode import default_decoder
from .crops import CropSpec
from .damage import Damage, DamageLog
from .dataset import DatasetInfo
from .device import DeviceFinish
from .elastic import Progress, check_progress, elastic_records, progress_from_state, saved_progress
from .epoch import epoch_records
from .ranks import check_epoch_size, check_resumed_world, distributed_placement, epoch_size, process_group_ready
from .runs import Run, new_run, stop_run
from .samples import LoaderDataset
from .stats import LoaderStats
from .streaming import ShardOpener
from .tasks import Batch, TaskPlan, batch_size_of
from .workers import DecodePool

log = logging.getLogger("gpufeed.loader")
WARNINGS_LIMIT = 100  # damage warnings a loader logs at most (one per shard, one per sample)
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


class Loader:
    """Iterable of (images, labels) batches on a device; build it with `make_loader`.

    Each iteration is one pass over an epoch, and one runs at a time: as with
    a torch DataLoader, `iter()` ends any iteration still going (a loop that
    stopped after `len(loader)` batches, as Lightning's and accelerate's do,
    or broke off early), and every iteration is a new, reshuffled pass: the
    next epoch, unless `set_epoch` or `load_state_dict` said otherwise since.
    An iteration run to its end moves `epoch` on at once; one that ended
    before (broken off, replaced, or ended by `close()`) leaves `epoch` and
    `state_dict()` where it stopped, so it can be saved and resumed, and the
    next `iter()` moves on.

    Attributes:
        dataset: the prepared dataset it reads: shards, class names
            (`classes`, `class_to_idx`) and sample count. `len(loader.dataset)`
            is one epoch's samples over all ranks together, as with a
            DataLoader over a DistributedSampler; this rank reads `len(loader)`
            batches of them. `loader.dataset[i]` is one sample (`image, label`,
            with its `key` and `info`), for a look at the data.
        spec: the validated settings.
        device: where batches are delivered.
        epoch: the epoch the next iteration runs.
        stats: where the time of the training loop goes (`LoaderStats`).
    """

    def __init__(
        self,
        dataset: DatasetInfo,
        spec: LoaderSpec,
        device: torch.device,
        placement: tuple[int, int] | None = None,
        opener: ShardOpener | None = None,
        plan: TaskPlan | None = None,
        batch_transform: Callable[[Any], Any] | None = None,
    ) -> None:
        self._owner = os.getpid()  # a forked worker's copy of the loader owns none of its threads and workers
        self.spec = spec
        self.plan = plan
        self._batch_transform = batch_transform
        self.device = device
        self._opener = opener or ShardOpener()
        self.dataset = LoaderDataset.of(dataset, self._opener)
        self._given_placement = placement  # (rank, world size) as given; None: torch.distributed's when an epoch starts
        self._workers_placement = self._placement()  # what the workers are built for
        self.epoch = 0
        self._epoch_set = 0  # counts set_epoch and load_state_dict calls: an iteration ending after one leaves epoch be
        self._ended_at: int | None = None  # _epoch_set when an iteration ended before its end: the next one moves on
        self.stats = LoaderStats()
        self._skip_batches = 0
        self._delivered = 0
        self._resume_world: int | None = None  # a loaded state's world size, checked when its epoch starts
        self._elastic: Progress | None = None  # the epoch was resumed at another world size: what had been delivered
        self._workers = _resolve_workers(spec.num_workers)
        decoder = default_decoder() if spec.decoder in ("auto", "nvjpeg") else spec.decoder
        self._crop = CropSpec(
            spec.crop, spec.train, spec.scale, spec.ratio, spec.eval_fraction, decoder, recipe=spec.recipe or "crop",
            jitter=spec.jitter, fill=spec.fill, flip=spec.flip, hyp=spec.hyp,
            hsv_in_workers=device.type != "cuda" or (plan is not None and plan.sample_transform is not None),
        )  # fmt: skip
        self._ring_slots = spec.prefetch + 2
        self._pool: DecodePool | None = None
        self._mosaic_closed_at: int | None = None  # the epoch close_mosaic() was called in
        self._finish = self._new_finish()
        self._next_run: Run | None = None
        self._runs: set[Run] = set()  # started and not yet stopped
        self._run_lock = threading.Lock()
        self._closed = False
        self._iteration: weakref.ref[Generator[Any, None, None]] | None = None  # the latest iteration
        self._warned: set[str] = set()  # the shards and samples whose damage was logged
        self._silenced = False  # WARNINGS_LIMIT reached
        _LIVE_LOADERS.add(self)

    # -- sizes, placement and epochs ------------------------------------------

    def _shards(self, epoch: int) -> list[Any]:
        return self.dataset.sets[epoch % self.dataset.variants]

    def __len__(self) -> int:
        """Batches per epoch on this rank (at the world size an epoch starting now would have)."""
        return epoch_size(self.dataset, self.spec, self.world_size)[1]

    @property
    def batch_size(self) -> int:
        """Samples per batch (on this rank)."""
        return self.spec.batch_size

    @property
    def num_workers(self) -> int:
        """Decode workers in use ("auto" resolved to the available cores; 0: the calling thread decodes)."""
        return self._workers

    @property
    def rank(self) -> int:
        """This process's rank: as given to make_loader, else what torch.distributed reports now (0 without it)."""
        return self._placement()[0]

    @property
    def world_size(self) -> int:
        """The number of ranks: as given to make_loader, else what torch.distributed reports now (1 without it)."""
        return self._placement()[1]

    def _placement(self) -> tuple[int, int]:
        return self._given_placement if self._given_placement is not None else distributed_placement()

    def _place(self) -> None:
        """When an epoch starts: the rank and world size now, checked; workers built for others are replaced.

        A loader made before `torch.distributed.init_process_group` reads
        the process group once it is there, instead of every sample on
        every rank.
        """
        placement = self._placement()
        check_epoch_size(self.dataset, self.spec, placement[1])
        check_resumed_world(self._resume_world, placement[1])
        if placement == self._workers_placement:
            return
        self._stop_workers()
        self._workers_placement = placement
        self._finish = self._new_finish()

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for `epoch`; with variant sets, read set `epoch mod K`."""
        if epoch < 0:
            raise ConfigError("epoch must be 0 or more")
        if epoch != self.epoch:  # a loaded state's place in its epoch no longer applies, nor the last one's
            self._skip_batches = self._delivered = 0
            self._resume_world = None
            self._elastic = None
        self.epoch = epoch
        self._epoch_set += 1

    def close_mosaic(self) -> None:
        """recipe="yolo": no mosaic from the current epoch on (ultralytics' trainer calls this `close_mosaic`
        epochs before the end). Batches already decoding ahead keep theirs; `close_mosaic=` with
        `epochs=` in `make_loader` turns it off on time instead."""
        if self.spec.recipe != "yolo":
            raise ConfigError(f"close_mosaic() turns off recipe='yolo''s mosaic: it has none with recipe={self.spec.recipe!r}")
        self._mosaic_closed_at = self.epoch
        self._close_pools_mosaic()

    def _close_pools_mosaic(self) -> None:
        """The pool's first epoch without the mosaic: `close_mosaic()`'s, where it comes before the spec's."""
        if self._pool is not None and self._mosaic_closed_at is not None:
            planned = self._pool.mosaic_off_from
            self._pool.mosaic_off_from = min(self._mosaic_closed_at, self._mosaic_closed_at if planned is None else planned)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands: restore with `load_state_dict` to continue exactly here.

        To continue at another world size, gather every rank's state and
        merge them (`merge_states`); see `load_state_dict`.
        """
        rank, world_size = self._placement()
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "batches": self._delivered,
            "seed": self.spec.seed,
            "batch_size": self.spec.batch_size,
            "world_size": world_size,
            "rank": rank,
        }
        if self._elastic is not None:
            state["resumed"] = self._elastic.to_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue mid-epoch: the next iteration skips the batches already delivered.

        Two kinds of state:

        - one rank's `state_dict()`: at the same world size, this rank
          continues its own epoch. The state's world size must be the
          loader's: checked here when the loader knows it (given, or
          torch.distributed is initialised), else when the next epoch starts;
        - every rank's states merged by `merge_states` (elastic resume): at
          any world size, every rank loads the same merged state and the
          rest of the epoch (what no saved rank had delivered) is dealt out
          to the ranks (`pipeline.loader.elastic`). Every rank yields the
          same number of batches of it, so DDP stays in step. With
          drop_last=False nothing is skipped and nothing repeated, except
          where floor(R/W) or ceil(R/W) records of the R left over W ranks
          would give the ranks different batch counts: then the last ranks
          repeat the first few of the records left (W - R mod W of them,
          fewer than W, like the padding of a whole epoch); a rank's last
          batch may be partial. With drop_last=True every rank gets the same
          full batches and fewer than W x batch size records are left out,
          as an epoch leaves out its uneven tail. An epoch resumed so can be
          saved, merged and resumed again (4 -> 2 -> 3 ranks ...), with the
          same guarantee. That epoch on this rank yields those batches
          (`len()` stays a full epoch's); the epochs after it are whole.

        Raises:
            ConfigError: the state was saved with another seed or batch
                size, for another dataset or drop_last (elastic), in an
                epoch resumed at another world size by an older gpufeed, or
                it is one rank's state at another world size (merge every
                rank's first).
        """
        for name in ("seed", "batch_size"):
            if state.get(name) != getattr(self.spec, name):
                raise ConfigError(
                    f"state was saved with {name}={state.get(name)!r}; this loader has {getattr(self.spec, name)!r}"
                )
        epoch = int(state["epoch"])
        self._epoch_set += 1
        resumed = None if state.get("resumed") is None else progress_from_state(state["resumed"])
        if resumed is not None:
            check_progress(self._shards(epoch), self.spec, resumed)
        self.epoch = epoch
        if "rank_batches" in state:  # merged: any world size
            batches = [int(b) for b in state["rank_batches"]]
            self._elastic = saved_progress(self._shards(epoch), self.spec, epoch, resumed, batches)
            self._resume_world = None
            self._skip_batches = self._delivered = 0
            return
        self._elastic = resumed
        saved_world = state.get("world_size")
        if self._given_placement is not None or process_group_ready():
            check_resumed_world(saved_world, self.world_size)
        self._resume_world = saved_world
        self._skip_batches = int(state["batches"])
        self._delivered = self._skip_batches

    # -- runs ---------------------------------------------------------------

    def _new_finish(self) -> DeviceFinish:
        buffers = self._ring_slots + self.spec.prefetch + 2
        return DeviceFinish(
            self.spec, self.device, self._workers_placement[0], self._crop, buffers=buffers, plan=self.plan,
            batch_transform=self._batch_transform,
        )  # fmt: skip

    def _ensure_workers(self) -> None:
        if self._pool is not None:
            return
        pin = self.device.type == "cuda" and self.spec.worker_type == "thread"
        self._pool = DecodePool(
            self.spec, self._workers, self._ring_slots, self._crop, self._workers_placement[0], pin,
            self._finish.cpu_finish, self.plan, self._finish.worker_jitter,
        )
        self._close_pools_mosaic()
        self._closed = False

    def _report(self, damage: Damage) -> None:
        """Count damage in the stats; log it once per shard or sample, WARNINGS_LIMIT times at most."""
        self.stats.skipped += damage.lost
        self.stats.replaced += damage.replaced
        self.stats.bad_shards += bool(damage.shard)
        if not damage.message:  # the stand-ins for what reading lost: the shards' warnings said why
            log.info("%d samples lost this epoch re-drawn from this rank's own samples", damage.replaced)
            return
        name = damage.shard or damage.sample
        if name in self._warned or self._silenced:
            return
        if len(self._warned) < WARNINGS_LIMIT:
            log.warning(damage.message)
            self._warned.add(name)
        else:
            log.warning("more damaged shards or samples than this: not logged, loader.stats counts them")
            self._silenced = True

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of epoch `self.epoch` (from where a loaded state left it); nothing starts before the first.

        An iteration of this loader still going is ended first (its epoch is over).

        Raises:
            RuntimeError: another thread is inside an iteration of this loader now.
            ConfigError: at the rank and world size of now, this rank gets
                no batch, or a loaded state was saved at another world size.
        """
        running = self._iteration() if self._iteration is not None else None
        if running is not None and inspect.getgeneratorstate(running) == inspect.GEN_RUNNING:
            raise RuntimeError(
                "this loader is being iterated right now, in another thread: one iteration at a time"
            )
        if running is not None:  # as a torch DataLoader does: a new iteration ends the one before
            running.close()
        if self._ended_at == self._epoch_set:  # one ended before its end, nothing set since: the next epoch
            self.set_epoch(self.epoch + 1)
        self._place()
        batches = self._batches()
        self._iteration = weakref.ref(batches)
        return batches

    def _batches(self) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        self._ensure_workers()
        assert self._pool is not None
        epoch, skip, elastic = self.epoch, self._skip_batches, self._elastic
        epoch_set = self._epoch_set
        with self._run_lock:
            ahead, self._next_run = self._next_run, None
        usable = ahead is not None and elastic is None and ahead.matches(epoch, skip) and not ahead.stop.is_set()
        run = ahead if usable else None
        for other in list(self._runs):  # a run started ahead for another epoch, or one ended by close()
            if other is not run:
                self._stop_run(other)
        run = run or self._start_run(epoch, skip, elastic)
        self._skip_batches = 0
        self._resume_world = None
        self._delivered = skip
        finished = False
        try:
            yield from self._timed(self._finish.deliver(epoch, run, self._pool, self._report))
            finished = not run.stop.is_set()  # else loader.close() ended it
        finally:
            self._stop_run(run)
            if self._epoch_set != epoch_set:  # set_epoch or load_state_dict meanwhile: they say what is next
                pass
            elif finished:
                self.epoch = epoch + 1
                self._delivered = 0
                self._elastic = None
                self._start_next_ahead(self.epoch)
            else:  # broken off, replaced or closed: state_dict() still says where it stopped
                self._ended_at = epoch_set

    def _timed(
        self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches, counted, with the loop's time split into waiting for data and its own steps."""
        step_started: float | None = None
        while True:
            waited_from = time.perf_counter()
            if step_started is not None:
                self.stats.step_s += waited_from - step_started
            batch = next(batches, None)
            if batch is None:
                return
            self.stats.wait_s += time.perf_counter() - waited_from
            self.stats.batches += 1
            self.stats.samples += batch_size_of(batch)
            if isinstance(batch, Batch) and batch.boxes_dropped:
                self.stats.boxes_dropped += batch.boxes_dropped
                self.stats.images_emptied += batch.images_emptied
            self._delivered += 1
            step_started = time.perf_counter()
            yield batch

    def _start_next_ahead(self, epoch: int) -> None:
        """Persistent workers: start decoding `epoch` (from its first batch) ahead of time.

        Called by a run's producer once it has queued its last batch, so the
        decode workers go straight on with the next epoch while the training
        loop is still busy with this one; and when the epoch is over, in case
        the producer could not (it was stopped). Set_epoch to anything else
        discards this run. With num_workers=0 nothing decodes ahead.
        """
        with self._run_lock:
            if self._next_run is None and not self._closed and self._pool is not None and not self._pool.inline:
                self._next_run = self._start_run(epoch, 0)

    def _start_run(self, epoch: int, skip: int, elastic: Progress | None = None) -> Run:
        assert self._pool is not None
        damage = DamageLog(self.spec.on_error)
        rank, world_size = self._workers_placement
        shards = self._shards(epoch)
        if elastic is None:
            records = epoch_records(shards, self.spec, epoch, rank, world_size, damage, self._opener)
        else:
            records = elastic_records(shards, self.spec, epoch, elastic, rank, world_size, damage, self._opener)
        run = new_run(epoch, skip, records, damage, self._pool, self.spec, weakref.WeakMethod(self._start_next_ahead))
        self._runs.add(run)
        if run.producer is not None:
            run.producer.start()
        return run

    def _stop_run(self, run: Run) -> None:
        self._runs.discard(run)
        stop_run(run, self._finish.outputs.release)

    def _stop_workers(self) -> None:
        """Stop every run (the next one prepared too) and the worker pool; the next iteration starts them again."""
        self._discard_next_run()
        for run in list(self._runs):
            self._stop_run(run)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _discard_next_run(self) -> None:
        with self._run_lock:
            run, self._next_run = self._next_run, None
        if run is not None:
            self._stop_run(run)

    def close(self) -> None:
        """Stop the worker pool and end any iteration (also done when the loader is garbage collected or at exit).

        An iterator of it used again after this ends at once; the next
        iteration starts the workers again.
        """
        self._closed = True
        self._iteration = None
        self._stop_workers()
        self._opener.close()

    def __del__(self) -> None:
        try:  # also at interpreter teardown, when module globals may already be gone
            if getattr(self, "_owner", None) == os.getpid():  # not a forked process worker's copy: its pool is not there
                self.close()
        except Exception:
            pass


def _resolve_workers(num_workers: int | str) -> int:
    if num_workers == "auto":
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover
            return max(1, os.cpu_count() or 1)
    return int(num_workers)
