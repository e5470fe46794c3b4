"""`make_loader` and `Loader`: the settings, the epochs and the runs over them, the state and the stats.

    loader = make_loader("shards/manifest.json", batch_size=256, device="cuda")
    for epoch in range(90):
        loader.set_epoch(epoch)
        for images, labels in loader:   # on the GPU, normalised, ready
            ...
    print(loader.stats)

Each iteration is a run over one epoch: a producer thread batches the
epoch's records (`epoch.py`) and hands them to the decode workers, which
crop and decode into preallocated (pinned on CUDA) uint8 NCHW batch
buffers (`workers.py`); the device side converts to float, flips,
normalises and sets the memory format, on CUDA on a side stream a few
batches ahead (`device.py`). Once an epoch's last batch is queued the next
epoch starts decoding, so the training loop does not wait at the boundary.
Damaged shards and samples are handled by the error policy (`damage.py`):
every rank still yields `len(loader)` full batches, or the first damage
raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import torch

from ..errors import ConfigError
from ..io.cache import ShardCache
from ..io.fs import is_url, storage_options_for
from ..specs import DTYPES, IMAGENET_MEAN, IMAGENET_STD, LoaderSpec, check_bool
from ..units import wait_share
from .cpu_decode import default_decoder
from .crops import CropSpec
from .damage import Damage, DamageLog
from .dataset import DatasetInfo, resolve_dataset
from .device import DeviceFinish
from .elastic import Progress, check_progress, elastic_records, progress_from_state, saved_progress
from .epoch import epoch_records
from .runs import Run, new_run, stop_run
from .samples import LoaderDataset
from .streaming import ShardOpener
from .tasks import TaskPlan, batch_size_of, task_plan
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


@dataclasses.dataclass
class LoaderStats:
    """Where the time of a training loop goes.

    Attributes:
        batches: batches delivered.
        samples: samples delivered.
        wait_s: seconds the training loop waited for data inside `next()`.
        step_s: seconds the training loop spent between batches (its own work).
        skipped: samples lost to damage: in shards that are missing, unreadable
            or cut short (counted from the manifest's sample counts), without
            an image, or that did not decode.
        replaced: samples re-drawn in place of lost ones, so every batch is
            full (fewer than `skipped` when drop_last would have dropped as
            many samples anyway).
        bad_shards: damaged shards met (missing, unreadable, cut short, or
            failing verify=True), once per epoch that read them.
    """

    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    step_s: float = 0.0
    skipped: int = 0
    replaced: int = 0
    bad_shards: int = 0

    @property
    def stall_fraction(self) -> float:
        """Share of the loop's time spent waiting for data (0 = never stalled)."""
        return wait_share(self.wait_s, self.step_s)

    @property
    def images_per_s(self) -> float:
        """Samples delivered per second of the loop's time (waiting plus its own steps)."""
        total = self.wait_s + self.step_s
        return self.samples / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        """The counters and the two rates, for JSON."""
        data = dataclasses.asdict(self)
        data["stall_fraction"] = self.stall_fraction
        data["images_per_s"] = self.images_per_s
        return data

    def __str__(self) -> str:
        return (
            f"{self.batches} batches, {self.samples} samples, {self.images_per_s:.0f} images/s, "
            f"waited {self.wait_s:.2f} s for data, stall fraction {self.stall_fraction:.1%} "
            f"(share of the loop's time spent waiting for data), "
            f"{self.skipped} skipped, {self.replaced} replaced, {self.bad_shards} bad shards"
        )


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
        self.spec = spec
        self.plan = plan
        self._batch_transform = batch_transform
        self.device = device
        self._opener = opener or ShardOpener()
        self.dataset = LoaderDataset.of(dataset, self._opener)
        self._given = placement  # (rank, world size) as given; None: torch.distributed's when an epoch starts
        self._placed = self._placement()  # what the workers are built for
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
            spec.crop, spec.train, spec.scale, spec.ratio, spec.eval_fraction, decoder, recipe=spec.recipe,
            jitter=spec.jitter, fill=spec.fill,
        )  # fmt: skip
        self._ring_slots = spec.prefetch + 2
        self._pool: DecodePool | None = None
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
        return self._given if self._given is not None else distributed_placement()

    def _place(self) -> None:
        """When an epoch starts: the rank and world size now, checked; workers built for others are replaced.

        A loader made before `torch.distributed.init_process_group` reads
        the process group once it is there, instead of every sample on
        every rank.
        """
        placement = self._placement()
        check_epoch_size(self.dataset, self.spec, placement[1])
        _check_resumed_world(self._resume_world, placement[1])
        if placement == self._placed:
            return
        self._stop_workers()
        self._placed = placement
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
        if self._given is not None or _process_group_ready():
            _check_resumed_world(saved_world, self.world_size)
        self._resume_world = saved_world
        self._skip_batches = int(state["batches"])
        self._delivered = self._skip_batches

    # -- runs ---------------------------------------------------------------

    def _new_finish(self) -> DeviceFinish:
        buffers = self._ring_slots + self.spec.prefetch + 2
        return DeviceFinish(
            self.spec, self.device, self._placed[0], self._crop, buffers=buffers, plan=self.plan,
            batch_transform=self._batch_transform,
        )  # fmt: skip

    def _ensure_workers(self) -> None:
        if self._pool is not None:
            return
        pin = self.device.type == "cuda" and self.spec.worker_type == "thread"
        self._pool = DecodePool(
            self.spec, self._workers, self._ring_slots, self._crop, self._placed[0], pin, self._finish.cpu_finish,
            self.plan,
        )
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
                self._prestart(self.epoch)
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
            self._delivered += 1
            step_started = time.perf_counter()
            yield batch

    def _prestart(self, epoch: int) -> None:
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
        rank, world_size = self._placed
        shards = self._shards(epoch)
        if elastic is None:
            records = epoch_records(shards, self.spec, epoch, rank, world_size, damage, self._opener)
        else:
            records = elastic_records(shards, self.spec, epoch, elastic, rank, world_size, damage, self._opener)
        run = new_run(epoch, skip, records, damage, self._pool, self.spec, weakref.WeakMethod(self._prestart))
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


def given_placement(rank: int | None, world_size: int | None) -> tuple[int, int] | None:
    """(rank, world size) as given to make_loader, checked; None when neither is given."""
    if rank is None and world_size is None:
        return None
    placement = (rank or 0, world_size or 1)
    if not 0 <= placement[0] < placement[1]:
        raise ConfigError(f"rank {placement[0]} is outside world size {placement[1]}")
    return placement


def _process_group_ready() -> bool:
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def distributed_placement() -> tuple[int, int]:
    """(rank, world size) that torch.distributed reports now; (0, 1) when it is not initialised."""
    if _process_group_ready():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _check_resumed_world(saved: Any, world_size: int) -> None:
    """ConfigError when a loaded state (its world size `saved`; None: none loaded) was saved at another world size."""
    if saved is not None and saved != world_size:
        raise ConfigError(
            f"state was saved with world_size={saved!r}; this loader has {world_size!r}: to continue the epoch "
            "at another world size, gather every rank's state_dict() and load merge_states(them) on every rank"
        )


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's `Loader.state_dict()` as one state that `load_state_dict` continues at any world size.

    Gather them when saving a checkpoint, e.g. with torch.distributed::

        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, loader.state_dict())
        if dist.get_rank() == 0:
            torch.save({"loader": merge_states(states), ...}, path)

    and after a restart at another world size, every rank calls
    `loader.load_state_dict(checkpoint["loader"])`.

    States saved in an epoch that was itself resumed at another world size
    merge the same way (resume 4 -> 2, save, resume 3: still no sample twice
    and none skipped).

    Args:
        states: one state per rank of the run, in any order.

    Returns:
        A JSON-able state: the epoch, the seed, the batch size, the world size,
        the batches each rank had delivered and, for an epoch that was
        resumed, the runs of it delivered before (`resumed`): small, a few
        runs per resume, whatever the dataset's size.

    Raises:
        ConfigError: the states are not one of each rank of one run at one
            epoch (the same epoch, seed, batch size, world size and
            resumed runs).
    """
    if not states:
        raise ConfigError("merge_states needs the state_dict() of every rank, got none")
    first = states[0]
    for name in ("epoch", "seed", "batch_size", "world_size", "resumed"):
        values = sorted({repr(state.get(name)) for state in states})
        if len(values) > 1:
            raise ConfigError(f"the states to merge differ in {name}: {', '.join(values)}")
    world_size = int(first["world_size"])
    ranks = sorted(int(state["rank"]) for state in states)
    if ranks != list(range(world_size)):
        raise ConfigError(f"merge_states needs one state of each of the {world_size} ranks, got ranks {ranks}")
    batches = {int(state["rank"]): int(state["batches"]) for state in states}
    merged = {
        "epoch": int(first["epoch"]),
        "seed": first["seed"],
        "batch_size": first["batch_size"],
        "world_size": world_size,
        "rank_batches": [batches[rank] for rank in range(world_size)],
    }
    if first.get("resumed") is not None:
        merged["resumed"] = first["resumed"]
    return merged


def epoch_size(dataset: DatasetInfo, spec: LoaderSpec, world_size: int) -> tuple[int, int]:
    """(samples, batches) of one rank's epoch at `world_size`: its share of the dataset, after the split."""
    total = sum(shard.samples for shard in dataset.sets[0])
    if spec.effective_drop_last:
        per_rank = total // world_size
        return per_rank, per_rank // spec.batch_size
    per_rank = -(-total // world_size)
    return per_rank, -(-per_rank // spec.batch_size)


def check_epoch_size(dataset: DatasetInfo, spec: LoaderSpec, world_size: int) -> None:
    """ConfigError when a rank's epoch at `world_size` would hold no batch (drop_last, a batch too large)."""
    per_rank, batches = epoch_size(dataset, spec, world_size)
    if batches:
        return
    total = sum(shard.samples for shard in dataset.sets[0])
    ranks = "1 rank" if world_size == 1 else f"{world_size} ranks"
    fix = f"use batch_size <= {per_rank}" if per_rank else "use fewer ranks than samples"
    raise ConfigError(
        f"batch_size {spec.batch_size} is more than this rank's {per_rank} samples per epoch "
        f"({total} samples over {ranks}): fewer samples than one batch, so with drop_last=True every "
        f"epoch would be empty; {fix}, or drop_last=False for one partial batch"
    )


def warn_if_upsampling(dataset: DatasetInfo, spec: LoaderSpec) -> None:
    """Log once, when the loader is made, that a crop larger than the prepared images is upsampled."""
    size = dataset.prepared_size
    if size is not None and spec.crop > size:
        log.warning(
            "crop=%d is larger than the images of %s, prepared at %d px (--size %d in its manifest's params): "
            "every crop is upsampled to %d px; prepare it with --size %d or more, or use crop <= %d",
            spec.crop, dataset.root or ".", size, size, spec.crop, spec.crop, size,
        )  # fmt: skip


def dtype_name(dtype: str | torch.dtype) -> str:
    """The LoaderSpec name of an output dtype given as a torch.dtype (torch.float16 -> "float16") or a name."""
    if not isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        accepted = ", ".join(f"torch.{n}" for n in DTYPES)
        raise ConfigError(f"dtype must be one of {accepted} (or its name as a string), got {dtype}")
    return name


TORCH_DATALOADER_OPTIONS = {
    "shuffle": "use shuffle_buffer=N (a seeded shuffle buffer, on with train=True; train=False reads in a fixed order)",
    "sampler": "use rank= and world_size= (each rank reads disjoint samples; torch.distributed gives them when initialised)",
    "batch_sampler": "use batch_size= with rank= and world_size= (every rank gets the same number of batches)",
    "pin_memory": "not needed: batches are collated in pinned memory and copied to device= already",
    "pin_memory_device": "use device=",
    "persistent_workers": "not needed: the workers live as long as the loader (close() stops them)",
    "prefetch_factor": "use prefetch= (batches prepared ahead)",
    "collate_fn": "not needed: batches are (images, labels) tensors; change them in the training loop",
    "worker_init_fn": "use worker_type= and num_workers= (the workers run gpufeed's own decode)",
    "multiprocessing_context": "use worker_type='process'",
    "generator": "use seed=",
    "timeout": "not needed: a worker that fails raises in the training loop",
    "dataset": "use source (the first argument: a prepared dataset's folder or manifest.json)",
}
"""torch DataLoader arguments that make_loader does not take -> what to use instead."""


def unknown_options_message(unknown: Sequence[str]) -> str:
    """What `make_loader` says about options it does not take: the gpufeed equivalent of a torch
    DataLoader argument, or the close spelling of a misspelt setting."""
    import difflib

    known = [name for name in inspect.signature(make_loader).parameters if name not in ("source", "unknown")]
    hints = []
    for name in sorted(unknown):
        if name in TORCH_DATALOADER_OPTIONS:
            hints.append(f"{name} is a torch DataLoader argument: {TORCH_DATALOADER_OPTIONS[name]}")
            continue
        close = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
        hints.append(f"{name}: did you mean {' or '.join(close)}?" if close else f"{name} is not a make_loader setting")
    return f"make_loader got unknown option(s): {'; '.join(hints)}"


def make_loader(
    source: str | os.PathLike[str],
    batch_size: int,
    *,
    device: str | torch.device = "auto",
    train: bool = True,
    crop: int = 224,
    num_workers: int | str = "auto",
    worker_type: str = "thread",
    shuffle_buffer: int = 2048,
    interleave: int = 4,
    seed: int = 0,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: str | torch.dtype = "float32",
    channels_last: bool = False,
    drop_last: bool | None = None,
    prefetch: int = 2,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    flip: bool = True,
    eval_fraction: float = 0.875,
    decoder: str = "auto",
    on_error: str = "skip",
    verify: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    links_outside: bool = False,
    task: str | None = None,
    fields: Sequence[str] = (),
    min_visible: float = 0.25,
    recipe: str = "crop",
    jitter: Sequence[float] = (0.1, 2.0),
    fill: int = 114,
    sample_transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    batch_transform: Callable[[Any], Any] | None = None,
    **unknown: NoReturn,
) -> Loader:
    """Build a loader over a prepared dataset.

    Every setting but `source`, `device`, `rank`, `world_size`,
    `storage_options`, `links_outside`, `sample_transform` and
    `batch_transform` is a `LoaderSpec` field of the same name and default;
    they are validated there before anything is built.

    Args:
        source: a manifest path/URL, a dataset directory, a shard brace
            pattern (`shards/shard-{000000..000099}.tar`) or one shard
            (`shards/00000.tar`); a str or a path.
        batch_size: samples per batch (per rank).
        device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1", or a torch.device.
        train: random-resized crops, flips and shuffling; False gives
            centre crops in a fixed order.
        crop: output side in pixels.
        num_workers: decode workers, or "auto" (the available cores); 0
            decodes in the calling thread, as each batch is asked for (no
            producer thread, no pool, nothing ahead: for debugging).
        worker_type: "thread" (the decoders release the GIL) or "process"
            (a fork pool decoding into shared memory; num_workers >= 1).
            Process workers ignore Ctrl-C: the training loop gets the
            KeyboardInterrupt and the loader stops them.
        shuffle_buffer: samples mixed by the seeded shuffle buffer (train).
        interleave: shards read at once, taken in turn (train).
        seed: seed of every random choice (order, crops, flips).
        mean: per-channel (R, G, B) mean to subtract, in 0-1 units.
        std: per-channel (R, G, B) standard deviation to divide by, in 0-1 units.
        dtype: float32, float16 or bfloat16 output, normalised; or uint8:
            pixels as decoded and flipped, not normalised (for augmentation
            on the GPU). A torch.dtype (torch.float16) or its name ("float16").
        channels_last: NCHW tensors in channels-last memory format.
        drop_last: drop the incomplete last batch and the uneven tail across
            ranks; None: True in train mode, False in eval mode.
        prefetch: batches prepared ahead (2 to 64).
        scale: random-resized-crop area range (low, high), 0 < low <= high <= 1.
        ratio: random-resized-crop aspect range (low, high).
        flip: random horizontal flips in train mode.
        eval_fraction: centre-crop fraction in eval mode (0.875: 224 from 256).
        decoder: "auto" (the fastest present), "region" (libjpeg-turbo
            decoding only the crop's region), "simplejpeg", "pil", or
            "nvjpeg" (on the GPU; needs a CUDA device and torchvision with CUDA).
        on_error: what damage does: "skip" (warn once per shard or sample,
            count it in `stats.skipped`, and re-draw replacements, counted in
            `stats.replaced`, from this rank's own samples of the epoch, so
            every rank still yields `len(loader)` full batches) or "raise"
            (stop at the first damaged shard or sample with a SampleError
            naming it). Damage: a shard missing, unreadable or holding fewer
            samples than the manifest says; a sample without an image or
            whose bytes do not decode.
        verify: hash each shard with sha256 as it streams and compare with
            the manifest's at its end; a mismatch is a damaged shard (its
            samples, already read, stay delivered; under "raise" it raises).
            Needs a manifest: a brace pattern has no hashes.
        cache_dir: a local folder (ideally NVMe) for a remote dataset's
            shards (`pipeline.io.cache.ShardCache`): the first epoch streams
            each shard into it as it reads it (its sha256 checked against the
            manifest), the next few shards of this rank's order are fetched
            into it while the current ones decode, and later epochs read it
            instead of the store, each cached shard checked before any of
            its samples is read (against what its fill recorded; with
            verify=True, its whole sha256): one that changed on disk is
            fetched again. The ranks and processes of a machine may
            share one folder (one download per shard). A cache that is full
            keeps what it holds and the rest is read from the store (logged
            once). Without a cache, a remote shard is still read ahead (the
            next one, into memory). Ignored for a local dataset; needs a
            manifest (a brace pattern has no hashes).
        cache_size: the most the cache may hold: bytes or a size such as
            "500GiB"; None: the dataset's size (all of its shards).
        rank: this process's rank; None (with world_size None): what
            torch.distributed reports when each epoch starts (else 0), so a
            loader made before init_process_group splits the data too.
        world_size: the number of ranks; None (with rank None): what
            torch.distributed reports when each epoch starts (else 1).
        storage_options: fsspec options for a remote dataset's store
            (endpoint_url, profile, anon, ...); credentials otherwise come
            from the usual places. Never stored in the loader's spec or state.
        links_outside: read a local dataset's shards that are links to files
            outside its folder; by default a manifest whose shards resolve
            outside the dataset (links included) is refused.
        task: what the samples hold: "classification", "multilabel",
            "detection", "segmentation" or "captions"; None: what the
            manifest says (classification for a brace pattern). Any task
            but classification, or any `fields`, makes the loader yield a
            `Batch` (`pipeline.loader.tasks`), which unpacks as
            `images, targets`; classification without fields yields
            `(images, labels)` tuples as always.
        fields: members to deliver besides the task's targets, a list per
            batch in `batch.fields[name]`: "txt" (or "caption": also
            `batch.captions`), "json" (parsed), "key" (`batch.keys`), or
            any member the samples hold ("boxes.npy", "meta.cls", ...).
        min_visible: detection: a box keeps at least this fraction of its
            area after the crop, or it is dropped (`batch.boxes_dropped`).
        recipe: how each image becomes the `crop` x `crop` output: "crop"
            (random-resized crop in train mode, centre crop in eval), or a
            detection recipe (`pipeline.loader.placement`): "letterbox"
            (the whole image, its ratio kept, centred and padded with
            `fill`: YOLO's), "scale_jitter" (the letterboxed size times a
            random scale in `jitter`, then a random window or padding:
            large-scale jitter), "iou_crop" (SSD's random IoU crop around
            the boxes). In eval mode the detection recipes letterbox. Boxes
            and masks follow; the region decoder still decodes only what
            each placement reads.
        jitter: scale_jitter's range of scales (low, high).
        fill: the value (0-255) of output pixels the image does not cover
            (a mask's are the ignore index).
        sample_transform: a callable on each decoded sample, in the decode
            workers: it gets {"image": uint8 (H, W, 3) array, "key", and the
            sample's targets: "boxes", "box_labels", "mask", "labels",
            "caption"} after the crop and flip, and returns the dict with
            "image" (same shape, uint8) and the targets it changed. It costs
            its own time per sample on every decode worker, and turns off the
            CPU device's fused normalisation. With worker_type="process" it
            must pickle (a function at the top level of a module).
        batch_transform: a callable on each batch on the device (MixUp,
            CutMix, kornia or transforms.v2 on the GPU), returning the batch
            to deliver; on CUDA it runs in the prefetch stream, `prefetch`
            batches ahead, while the training stream works on earlier ones
            (on the CPU, in the training loop's thread as each batch is
            asked for: its time counts as waiting for data in `stats`).
        **unknown: refused: a misspelt setting is an error, never ignored.

    Returns:
        A Loader: iterate for (images, labels), one iteration at a time;
        `len()`, `batch_size`, `dataset`, `set_epoch`, `stats`,
        `state_dict`, `load_state_dict`, `close`. A crop larger than the
        dataset's prepared size logs one warning that it is upsampled.

    Raises:
        ConfigError: invalid settings (checked before anything is built),
            verify=True over a source without sha256s, or a batch_size
            larger than this rank's samples per epoch with drop_last (an
            empty epoch).
        ManifestError: the source is not a prepared dataset, or its manifest
            names a shard outside it.
    """
    if unknown:
        raise ConfigError(unknown_options_message(list(unknown)))
    spec = LoaderSpec(
        batch_size=batch_size,
        train=train,
        crop=crop,
        num_workers=num_workers,
        worker_type=worker_type,
        shuffle_buffer=shuffle_buffer,
        interleave=interleave,
        seed=seed,
        mean=_values(mean),
        std=_values(std),
        dtype=dtype_name(dtype),
        channels_last=channels_last,
        drop_last=drop_last,
        prefetch=prefetch,
        scale=_values(scale),
        ratio=_values(ratio),
        flip=flip,
        eval_fraction=eval_fraction,
        decoder=decoder,
        on_error=on_error,
        verify=verify,
        cache_dir=None if cache_dir is None else os.fspath(cache_dir),
        cache_size=cache_size,
        task=task,
        fields=_field_names(fields),
        min_visible=min_visible,
        recipe=recipe,
        jitter=_values(jitter),
        fill=fill,
    )
    resolved = resolve_device(device)
    if spec.decoder == "nvjpeg":
        from .gpu_decode import check_gpu_decode

        check_gpu_decode(resolved)
    placement = given_placement(rank, world_size)
    check_bool("links_outside", links_outside)
    with storage_options_for([os.fspath(source)], storage_options):
        dataset = resolve_dataset(source, links_outside=links_outside)
    if dataset.samples == 0:
        raise ConfigError(f"{os.fspath(source)} holds no samples")
    if spec.verify and not dataset.hashed:
        raise ConfigError(
            f"verify=True checks shards against their manifest's sha256, and {os.fspath(source)} has none "
            "(a brace pattern): give the dataset's folder or manifest.json"
        )
    check_epoch_size(dataset, spec, (placement or distributed_placement())[1])
    warn_if_upsampling(dataset, spec)
    plan = _task_plan(spec, dataset, sample_transform, batch_transform)
    if plan is not None and spec.task is None:  # the records keep what the manifest's task needs
        spec = dataclasses.replace(spec, task=plan.task)
    opener = shard_opener(dataset, spec, storage_options)
    return Loader(dataset, spec, resolved, placement, opener, plan, batch_transform)


def _task_plan(
    spec: LoaderSpec, dataset: DatasetInfo, sample_transform: Any, batch_transform: Any
) -> TaskPlan | None:
    """The loader's task plan (None: the classification tuple path), its transforms checked."""
    if batch_transform is not None and not callable(batch_transform):
        raise ConfigError("batch_transform must be a callable taking a batch and returning the batch to deliver")
    if spec.recipe != "crop" and spec.decoder == "nvjpeg":
        raise ConfigError(f"recipe={spec.recipe!r} places images on the CPU: decoder='nvjpeg' only crops; use a CPU decoder")
    if spec.recipe == "iou_crop" and (spec.task or dataset.task) != "detection":
        raise ConfigError("recipe='iou_crop' crops around each sample's boxes: it needs a detection dataset (task='detection')")
    if sample_transform is not None and spec.decoder == "nvjpeg":
        raise ConfigError(
            "sample_transform runs on each decoded sample in the decode workers, and decoder='nvjpeg' decodes "
            "on the GPU: use batch_transform there, or a CPU decoder"
        )
    classes = len(dataset.classes) or None
    return task_plan(
        spec.task, spec.fields, dataset.task, classes, dataset.ignore_index, spec.min_visible, sample_transform,
        spec.worker_type, dataset.fields,
    )  # fmt: skip


def _field_names(fields: Sequence[str]) -> tuple[str, ...]:
    """fields= as the spec holds it: a tuple of names (a lone string is one name, not its letters)."""
    if isinstance(fields, str):
        return (fields,)
    try:
        return tuple(fields)
    except TypeError:
        raise ConfigError(f"fields must be a sequence of member names, got {fields!r}") from None


def shard_opener(dataset: DatasetInfo, spec: LoaderSpec, storage_options: Mapping[str, Any] | None) -> ShardOpener:
    """How the loader opens the dataset's shards: through a ShardCache when `cache_dir` is given and they are remote."""
    if spec.cache_dir is None or not is_url(dataset.root):
        return ShardOpener(storage_options)
    if not dataset.hashed:
        raise ConfigError(
            f"cache_dir keys cached shards by their manifest's sha256, and {dataset.root} has none "
            "(a brace pattern): give the dataset's folder or manifest.json"
        )
    size = spec.cache_size
    if size is None:
        size = sum(shard.bytes or 0 for shards in dataset.sets for shard in shards)
    cache = ShardCache(spec.cache_dir, size, storage_options=storage_options, verify=spec.verify)
    return ShardOpener(storage_options, cache)


def _values(values: Sequence[float]) -> Any:
    """A list or tuple of numbers as the tuple LoaderSpec holds (LoaderSpec checks how many and which)."""
    return tuple(values)
