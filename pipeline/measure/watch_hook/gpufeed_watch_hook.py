"""The recorder of `gpufeed watch`: how long each training loop waits for its next batch.

Standard library only, imported at start-up of every watched Python process. It patches, when
they are imported (or at once when they already are):

- torch's `_BaseDataLoaderIter.__next__`: the wait inside `next()` and the time between batches;
- torch's dataset fetchers (`_MapDatasetFetcher.fetch`, `_IterableDatasetFetcher.fetch`): the wall
  and CPU seconds the Dataset and collate take per batch, in the DataLoader workers (or in the
  main process with num_workers=0);
- gpufeed's `Loader.__iter__`: the same wait and step times for each iteration.

The first batch of each iteration is counted apart (`first_s`): it holds the workers' start.
Each process appends its running totals as one JSON line to `DIR/<pid>.jsonl` at most every
half second and at exit; the watching process reads the last line of each file.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

if False:  # for type checkers only: importing typing costs every watched process 2 ms at start-up
    from typing import IO

FLUSH_S = 0.5
_TARGETS = ("torch.utils.data.dataloader", "torch.utils.data._utils.fetch", "pipeline.loader.loader")

_perf = time.perf_counter
_thread_time = time.thread_time


class _Loop:
    """Counters of one kind of loop (torch DataLoader or gpufeed Loader) in this process."""

    __slots__ = ("batches", "samples", "wait_s", "step_s", "first_s", "iterations", "num_workers", "batch_size")

    def __init__(self) -> None:
        self.batches = 0
        self.samples = 0
        self.wait_s = 0.0
        self.step_s = 0.0
        self.first_s = 0.0
        self.iterations = 0
        self.num_workers = 0
        self.batch_size = 0

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


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


class Recorder:
    """This process's counters and its report file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._reset()

    def _reset(self) -> None:
        self.pid = os.getpid()
        self.torch = _Loop()
        self.gpufeed = _Loop()
        self.fetch = _Fetch()
        self.worker = False
        self.checked = False  # whether this process is a DataLoader worker is known (at its first fetch)
        self.next_flush = _perf() + FLUSH_S
        self.file: IO[str] | None = None
        self.dirty = False
        self.schedstat = -2  # /proc/thread-self/schedstat, opened at the first fetch (-1: not available)

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
        self._reset()

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
            "argv": sys.argv[:8],
            "torch": self.torch.to_dict(),
            "gpufeed": self.gpufeed.to_dict(),
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
            _patch_torch_iterator(module._BaseDataLoaderIter)
        elif name == "torch.utils.data._utils.fetch":
            for cls in (module._MapDatasetFetcher, module._IterableDatasetFetcher):
                _patch_fetch(cls)
        elif name == "pipeline.loader.loader":
            _patch_gpufeed_loader(module.Loader)
    except AttributeError as exc:  # another torch or gpufeed version: watch without this loop
        sys.stderr.write(f"gpufeed watch: cannot time {name} in this version ({exc})\n")


def _patch_torch_iterator(cls) -> None:
    original = cls.__next__
    if getattr(original, "_gpufeed_watch", False):
        return

    def __next__(self):
        recorder = _recorder
        if recorder is None:
            return original(self)
        started = _perf()
        try:
            data = original(self)
        except StopIteration:
            last = getattr(self, "_gpufeed_last", None)
            if last is not None:
                recorder.torch.step_s += started - last
            self._gpufeed_last = None
            recorder.dirty = True
            recorder.flush()
            raise
        now = _perf()
        loop = recorder.torch
        last = getattr(self, "_gpufeed_last", None)
        if last is None:
            loop.first_s += now - started
            loop.iterations += 1
            loop.num_workers = self._num_workers
            loop.batch_size = getattr(self._index_sampler, "batch_size", None) or 1
            self._gpufeed_samples = loop.batch_size
        else:
            loop.step_s += started - last
            loop.wait_s += now - started
        loop.batches += 1
        loop.samples += self._gpufeed_samples
        recorder.dirty = True
        if now >= recorder.next_flush:
            recorder.flush()
        self._gpufeed_last = _perf()
        return data

    __next__._gpufeed_watch = True  # type: ignore[attr-defined]
    cls.__next__ = __next__


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
            counts = recorder.fetch
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
        batches = original(self)
        if _recorder is None:
            return batches
        return _timed(batches, getattr(self, "batch_size", 1), getattr(self, "num_workers", 0))

    __iter__._gpufeed_watch = True  # type: ignore[attr-defined]
    cls.__iter__ = __iter__


def _timed(batches, batch_size, num_workers):
    """The batches of one gpufeed Loader iteration, timed like a DataLoader's."""
    last = None
    try:
        while True:
            started = _perf()
            try:
                batch = next(batches)
            except StopIteration:
                if last is not None and _recorder is not None:
                    _recorder.gpufeed.step_s += started - last
                return
            now = _perf()
            recorder = _recorder
            if recorder is not None:
                loop = recorder.gpufeed
                if last is None:
                    loop.first_s += now - started
                    loop.iterations += 1
                    loop.batch_size = batch_size
                    loop.num_workers = num_workers
                else:
                    loop.step_s += started - last
                    loop.wait_s += now - started
                loop.batches += 1
                loop.samples += batch_size
                recorder.dirty = True
                if now >= recorder.next_flush:
                    recorder.flush()
            last = _perf()
            yield batch
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
        if _recorder is not None:
            _recorder.dirty = True
            _recorder.flush()
