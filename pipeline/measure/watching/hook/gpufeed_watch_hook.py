"""The recorder of `gpufeed watch`: how long each training loop waits for its next batch.

Standard library only, imported at start-up of every watched Python process. It patches, when
they are imported (or at once when they already are):

- torch's `DataLoader.__init__` (where each loader is created: its `site`), `_BaseDataLoaderIter`'s
  `__init__` (worker start-up) and `__next__` (the wait inside `next()`);
- torch's dataset fetchers (`_MapDatasetFetcher.fetch`, `_IterableDatasetFetcher.fetch`): the wall
  and CPU seconds the Dataset and collate take per batch, in the DataLoader workers (or in the
  main process with num_workers=0);
- gpufeed's `Loader.__iter__`: the same wait and step times for each iteration;
- at the first batch: `torch.autograd.backward` and a global optimizer step hook (a loader whose
  batches are followed by neither evaluates), and `nn.Module.train` (`model.eval()`).

Each loader (one per creation site) has its own figures. A batch's step runs from that batch to the
process's next batch from ANY loader, so a validation pass between training batches lands in the
validation loader's figures, not in the training loop's steps. The first batch of each iteration
is counted apart (`first_s`, with the iterator's start-up: forking the workers).

A daemon thread of the training process samples its main thread's stack `SAMPLE_HZ` times a second
between batches: inside the model step (nn.Module calls, backward, optimizer, CUDA) or outside it
(augmentation, collate, host copies in the loop), with the main thread's CPU time meanwhile.

Each process appends its running totals as one JSON line to `DIR/<pid>.jsonl` at most every
half second and at exit; the watching process reads the last line of each file.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

if False:  # for type checkers only: importing typing costs every watched process 2 ms at start-up
    from typing import IO, Any

FLUSH_S = 0.5
MAX_LOADERS = 32  # creation sites kept per process; later ones share the last entry
MAX_TENSORS = 100_000  # tensors counted in a first batch, at most
_TARGETS = ("torch.utils.data.dataloader", "torch.utils.data._utils.fetch", "pipeline.loader.loader")
_LIBRARY_DIRS = ("/site-packages/", "/dist-packages/", "/lib/python3")

_WAIT_CODES: set = set()  # the code of the patched next(): a main thread inside it waits for a batch
_perf = time.perf_counter
_thread_time = time.thread_time


class _Fetch:
    """Dataset + collate time per batch, where it runs (a DataLoader worker, or the main process)."""

    __slots__ = ("batches", "seconds", "cpu_s", "runq_s")

    def __init__(self) -> None:
        self.batches = 0
        self.seconds = 0.0
        self.cpu_s = 0.0
        self.runq_s = 0.0  # runnable but waiting for a core: CPU work too, on a crowded machine

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class _Loop:
    """Counters of one loader (one creation site) in this process."""

    __slots__ = (
        "site", "kind", "batches", "samples", "wait_s", "step_s", "first_s", "iterations", "num_workers",
        "batch_size", "tensors", "nograd", "eval_mode", "updated", "model_s", "outside_s", "outside_cpu_s", "fetch",
    )  # fmt: skip

    def __init__(self, site: str, kind: str) -> None:
        self.site, self.kind = site, kind
        self.batches = self.samples = self.iterations = self.num_workers = self.batch_size = self.tensors = 0
        self.nograd = self.eval_mode = self.updated = 0  # batches under no_grad / after model.eval() / followed by an update
        self.wait_s = self.step_s = self.first_s = 0.0
        self.model_s = self.outside_s = self.outside_cpu_s = 0.0  # its steps, sampled: in the model, outside it
        self.fetch = _Fetch()  # num_workers=0: the Dataset's time in this process

    def to_dict(self) -> dict:
        data = {name: getattr(self, name) for name in self.__slots__}
        data["fetch"] = self.fetch.to_dict()
        return data


class Recorder:
    """This process's counters and its report file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.site: str | None = None  # in a DataLoader worker: the site of its loader
        self.creating: str | None = None  # the site of the iterator being created (its workers fork now)
        self._reset()

    def _reset(self) -> None:
        self.pid = os.getpid()
        self.loops: dict[str, _Loop] = {}
        self.fetch = _Fetch()
        self.worker = False
        self.checked = False  # whether this process is a DataLoader worker is known (at its first fetch)
        self.next_flush = _perf() + FLUSH_S
        self.file: IO[str] | None = None
        self.dirty = False
        self.schedstat = -2  # /proc/thread-self/schedstat, opened at the first fetch (-1: not available)
        self.last: _Loop | None = None  # the loader of the process's last batch: its step is in progress
        self.last_end = 0.0
        self.updates = 0  # backward passes and optimizer steps seen
        self.updates_at_last = 0
        self.training = True  # the last nn.Module.train(mode)
        self.current: _Loop | None = None  # inside its next(): the main-process fetches are its
        self.sampler_cpu_s = 0.0
        self.sampler: threading.Thread | None = None

    def loop(self, site: str, kind: str) -> _Loop:
        loop = self.loops.get(site)
        if loop is None:
            if len(self.loops) >= MAX_LOADERS:
                site = "(other loaders)"
                loop = self.loops.get(site)
            if loop is None:
                loop = self.loops[site] = _Loop(site, kind)
        return loop

    def runq_ns(self) -> int:
        """Nanoseconds the calling thread has waited for a core (0 where the kernel does not say)."""
        if self.schedstat == -2:
            try:
                self.schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            except OSError:
                self.schedstat = -1
        if self.schedstat < 0:
            return 0
        try:
            return int(os.pread(self.schedstat, 64, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    def after_fork(self) -> None:
        """A forked child (a DataLoader worker) starts its own counters and file (the parent's stay open there)."""
        self.site = self.creating
        self._reset()

    def close_step(self, now: float) -> None:
        """The step of the last batch ends now (a batch is asked for, an iteration starts or ends)."""
        last = self.last
        if last is not None:
            last.step_s += now - self.last_end
            if self.updates != self.updates_at_last:
                last.updated += 1
            self.last = None
        self.updates_at_last = self.updates

    def batch(self, loop: _Loop, started: float, now: float, first: bool) -> None:
        """One batch of `loop` asked for at `started`, delivered at `now`."""
        if first:
            loop.first_s += now - started
        else:
            loop.wait_s += now - started
        loop.batches += 1
        loop.samples += loop.batch_size
        grad = _grad_enabled()
        if grad is False:
            loop.nograd += 1
        if not self.training:
            loop.eval_mode += 1
        self.dirty = True
        if now >= self.next_flush:
            self.flush()
        if self.sampler is None and not self.worker:
            _start_sampler(self)
        self.last, self.last_end = loop, _perf()

    def flush(self) -> None:
        self.next_flush = _perf() + FLUSH_S
        if not self.dirty:
            return
        self.dirty = False
        line = {
            "pid": self.pid,
            "ppid": os.getppid(),
            "time": time.time(),
            "rank": _env_int("RANK"),
            "local_rank": _env_int("LOCAL_RANK"),
            "world_size": _env_int("WORLD_SIZE"),
            "worker": self.worker,
            "site": self.site if self.worker else None,
            "argv": sys.argv[:8],
            "updates": self.updates,
            "sampler_cpu_s": self.sampler_cpu_s,
            "loaders": [loop.to_dict() for loop in list(self.loops.values())],
            "fetch": self.fetch.to_dict(),
        }
        import json  # at the first write: not every process writes

        try:
            if self.file is None:
                self.file = open(os.path.join(self.directory, f"{self.pid}.jsonl"), "a", encoding="utf-8")
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()
        except OSError:
            pass  # the watching process went away: never disturb the training


_recorder: Recorder | None = None
_is_grad_enabled = None


def _grad_enabled():
    """torch.is_grad_enabled() (False under no_grad and inference_mode), None before torch is there."""
    check = _is_grad_enabled
    return None if check is None else check()


def _env_int(name: str):
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def active():
    """The recorder of this process, or None when nothing watches it."""
    return _recorder


def start(directory: str) -> Recorder:
    """Record into `directory` from now on; patch what is imported and what will be."""
    global _recorder
    if _recorder is None or _recorder.directory != directory:
        _recorder = Recorder(directory)
    if not getattr(start, "installed", False):
        start.installed = True  # type: ignore[attr-defined]
        atexit.register(_flush_at_exit)
        os.register_at_fork(after_in_child=_after_fork)
        for name in _TARGETS:
            if name in sys.modules:
                _patch(name, sys.modules[name])
        sys.meta_path.insert(0, _PostImportFinder())
    return _recorder


def stop() -> None:
    """Write the last totals and stop recording (the patches stay, and cost nothing more than a check)."""
    global _recorder
    recorder, _recorder = _recorder, None
    if recorder is not None:
        recorder.dirty = True
        recorder.flush()
        if recorder.file is not None:
            recorder.file.close()


def start_from_env() -> None:
    directory = os.environ.get("GPUFEED_WATCH_DIR")
    if directory and os.path.isdir(directory):
        start(directory)


def _flush_at_exit() -> None:
    if _recorder is not None:
        _recorder.flush()  # the totals not written yet, if any


def _after_fork() -> None:
    if _recorder is not None:
        _recorder.after_fork()


class _PostImportFinder:
    """Patches the target modules right after they execute; every other import passes untouched."""

    def find_spec(self, name, path=None, target=None):
        if name not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _patch(name, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _patch(name: str, module) -> None:
    try:
        if name == "torch.utils.data.dataloader":
            _patch_torch_loader(module.DataLoader)
            _patch_torch_iterator(module._BaseDataLoaderIter)
            for cls in (module._SingleProcessDataLoaderIter, module._MultiProcessingDataLoaderIter):
                _patch_iterator_start(cls)  # their __init__ forks the workers after the base class's
        elif name == "torch.utils.data._utils.fetch":
            for cls in (module._MapDatasetFetcher, module._IterableDatasetFetcher):
                _patch_fetch(cls)
        elif name == "pipeline.loader.loader":
            _patch_gpufeed_loader(module.Loader)
    except AttributeError as exc:  # another torch or gpufeed version: watch without this loop
        sys.stderr.write(f"gpufeed watch: cannot time {name} in this version ({exc})\n")


def _site(what: str) -> str:
    """`what` and the first line of the program outside the libraries that led here (where the loader is made)."""
    frame: Any = sys._getframe(2)
    fallback = None
    for _ in range(64):
        if frame is None:
            break
        name = frame.f_code.co_filename
        if not any(part in name for part in _LIBRARY_DIRS) and os.path.basename(name) != "gpufeed_watch_hook.py":
            return f"{what} at {os.path.basename(name)}:{frame.f_lineno}"
        if fallback is None and "/torch/" not in name and "/pipeline/" not in name:
            fallback = f"{what} at {os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or what


def _patch_torch_loader(cls) -> None:
    original = cls.__init__
    if getattr(original, "_gpufeed_watch", False):
        return

    def __init__(self, dataset, *args, **kwargs):
        original(self, dataset, *args, **kwargs)
        if _recorder is not None:
            try:
                self._gpufeed_site = _site(type(dataset).__name__)
            except (AttributeError, ValueError):
                pass

    __init__._gpufeed_watch = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def _on_first_batch() -> None:
    """Once torch is imported: see grad mode, updates (backward, optimizer steps) and model.eval()."""
    global _is_grad_enabled
    torch = sys.modules.get("torch")
    if torch is None or _is_grad_enabled is not None:
        return
    _is_grad_enabled = torch.is_grad_enabled
    try:
        autograd = torch.autograd
        backward = autograd.backward
        module = torch.nn.Module
        train = module.train
    except AttributeError:  # another torch version: no evaluation evidence but grad mode
        return

    def counted_backward(*args, **kwargs):
        _count_update()
        return backward(*args, **kwargs)

    def counted_train(self, mode=True):
        if _recorder is not None:
            _recorder.training = bool(mode)
        return train(self, mode)

    autograd.backward, module.train = counted_backward, counted_train
    optimizer = sys.modules.get("torch.optim.optimizer")
    register = getattr(optimizer, "register_optimizer_step_post_hook", None)
    if register is not None:
        register(_count_update)


def _start_sampler(recorder: Recorder) -> None:
    """The stack sampler of the training process's main thread (started at its first batch)."""
    main = threading.main_thread()
    if threading.current_thread() is not main or not hasattr(time, "pthread_getcpuclockid"):
        recorder.sampler = main  # not sampled: marks it as decided
        return
    if __package__:  # imported as part of gpufeed (`watch()` in this process)
        from . import gpufeed_watch_stacks
    else:  # the module beside this file, first on the watched command's PYTHONPATH
        import gpufeed_watch_stacks  # type: ignore[import-not-found,no-redef]

    wait_codes = {_timed.__code__, *_WAIT_CODES}
    alive = lambda: _recorder is recorder  # noqa: E731
    recorder.sampler = threading.Thread(
        target=gpufeed_watch_stacks.sample_stacks, args=(recorder, main.ident, wait_codes, alive),
        name="gpufeed-watch-stacks", daemon=True,
    )  # fmt: skip
    recorder.sampler.start()


def _count_update(*args) -> None:
    if _recorder is not None:
        _recorder.updates += 1


def _patch_iterator_start(cls) -> None:
    init = cls.__init__
    if getattr(init, "_gpufeed_watch", False):
        return

    def __init__(self, loader, *args, **kwargs):
        recorder = _recorder
        if recorder is None:
            return init(self, loader, *args, **kwargs)
        started = _perf()
        recorder.close_step(started)
        site = getattr(loader, "_gpufeed_site", None) or type(getattr(loader, "dataset", None)).__name__
        loop = recorder.loop(site, "torch")
        recorder.creating = site
        try:
            return init(self, loader, *args, **kwargs)
        finally:
            self._gpufeed_loop = loop
            loop.first_s += _perf() - started  # forking the workers: part of the first batch's wait

    __init__._gpufeed_watch = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def _patch_torch_iterator(cls) -> None:
    original = cls.__next__
    if getattr(original, "_gpufeed_watch", False):
        return

    def __next__(self):
        recorder = _recorder
        if recorder is None:
            return original(self)
        started = _perf()
        recorder.close_step(started)
        loop: _Loop = getattr(self, "_gpufeed_loop", None) or recorder.loop(type(self._dataset).__name__, "torch")
        if recorder.loops.get(loop.site) is not loop:  # recorded by an earlier recorder (`watch()` restarted)
            loop = recorder.loop(loop.site, "torch")
        self._gpufeed_loop = loop
        first = not getattr(self, "_gpufeed_started", False)
        recorder.current = loop
        try:
            data = original(self)
        except StopIteration:  # its time (the workers' shut-down) is the loop's wait too, like their start
            loop.first_s += _perf() - started
            self._gpufeed_started = False
            recorder.current = None
            recorder.dirty = True
            recorder.flush()
            raise
        recorder.current = None
        if first:
            _on_first_batch()
            self._gpufeed_started = True
            loop.iterations += 1
            loop.num_workers = max(loop.num_workers, self._num_workers)
            loop.batch_size = getattr(self._index_sampler, "batch_size", None) or 1
            if not loop.tensors:
                loop.tensors = _count_tensors(data)
        recorder.batch(loop, started, _perf(), first)
        return data

    __next__._gpufeed_watch = True  # type: ignore[attr-defined]
    _WAIT_CODES.add(__next__.__code__)
    cls.__next__ = __next__


def _count_tensors(data) -> int:
    """Tensors in a batch (lists, tuples and dicts opened; at most MAX_TENSORS)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    tensor, count, todo = torch.Tensor, 0, [data]
    while todo and count < MAX_TENSORS and len(todo) < MAX_TENSORS:
        item = todo.pop()
        if isinstance(item, tensor):
            count += 1
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
    return count


def _patch_fetch(cls) -> None:
    original = cls.fetch
    if getattr(original, "_gpufeed_watch", False):
        return

    def fetch(self, possibly_batched_index):
        recorder = _recorder
        if recorder is None:
            return original(self, possibly_batched_index)
        if not recorder.checked:
            _first_fetch(recorder)
        # The wait for a core is read in the workers only: two /proc reads per batch are not for the training loop.
        worker = recorder.worker
        started, cpu, runq = _perf(), _thread_time(), recorder.runq_ns() if worker else 0
        try:
            return original(self, possibly_batched_index)
        finally:
            now = _perf()
            current = recorder.current
            counts = current.fetch if current is not None and not worker else recorder.fetch
            counts.batches += 1
            counts.seconds += now - started
            counts.cpu_s += _thread_time() - cpu
            if worker:
                counts.runq_s += (recorder.runq_ns() - runq) / 1e9
            recorder.dirty = True
            if now >= recorder.next_flush:
                recorder.flush()

    fetch._gpufeed_watch = True  # type: ignore[attr-defined]
    cls.fetch = fetch


def _first_fetch(recorder: Recorder) -> None:
    """In a DataLoader worker, the last totals are written when the worker ends (multiprocessing skips atexit)."""
    recorder.checked = True
    worker = sys.modules.get("torch.utils.data._utils.worker")
    recorder.worker = getattr(worker, "_worker_info", None) is not None
    util = sys.modules.get("multiprocessing.util")
    if recorder.worker and util is not None:
        util.Finalize(recorder, _flush_at_exit, exitpriority=10)


def _patch_gpufeed_loader(cls) -> None:
    original = cls.__iter__
    if getattr(original, "_gpufeed_watch", False):
        return

    def __iter__(self):
        recorder = _recorder
        if recorder is None:
            return original(self)
        started = _perf()
        recorder.close_step(started)
        site = getattr(self, "_gpufeed_site", None)
        if site is None:
            site = _site("gpufeed Loader")
            try:
                self._gpufeed_site = site
            except AttributeError:
                pass
        loop = recorder.loop(site, "gpufeed")
        batches = original(self)
        loop.first_s += _perf() - started
        loop.batch_size, loop.num_workers = getattr(self, "batch_size", 1), getattr(self, "num_workers", 0)
        return _timed(batches, loop)

    __iter__._gpufeed_watch = True  # type: ignore[attr-defined]
    cls.__iter__ = __iter__


def _timed(batches, loop: _Loop):
    """The batches of one gpufeed Loader iteration, timed like a DataLoader's."""
    first = True
    try:
        while True:
            started = _perf()
            recorder = _recorder
            if recorder is not None:
                recorder.close_step(started)
            try:
                batch = next(batches)
            except StopIteration:
                loop.first_s += _perf() - started
                return
            recorder = _recorder
            if recorder is not None:
                if first:
                    _on_first_batch()
                    loop.iterations += 1
                recorder.batch(loop, started, _perf(), first)
            first = False
            yield batch
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
        if _recorder is not None:
            _recorder.dirty = True
            _recorder.flush()
