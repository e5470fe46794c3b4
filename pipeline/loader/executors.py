"""Where the decode pool's pieces run, and waiting for them: inline, a thread pool, or a fork pool.

Thread workers (the default: the decoders release the GIL) are a
`ThreadPoolExecutor`; process workers are a fork pool writing into the
shared ring (`pieces.share_ring`), so no pixels go through pipes. They
ignore Ctrl-C: it is the training loop's to handle, and the loader stops
them when it stops. Each runs torch (ColorJitter on a CPU device, the
user's sample_transform) on one thread: the parent's OpenMP pool does not
survive the fork (a parallel op would wait for it forever), and the
workers share the cores already. With num_workers=0 each piece is
decoded at once, in the thread that hands it out.
"""

from __future__ import annotations

import signal
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from .crops import CropSpec
from .pieces import PieceResult, share_ring


class InlineExecutor:
    """num_workers=0: each piece is decoded at once, in the thread that hands it out."""

    def submit(self, func: Any, *args: Any) -> Future[Any]:
        done: Future[Any] = Future()
        try:
            done.set_result(func(*args))
        except Exception as exc:  # raised where the batch is collected, as a worker thread's would be
            done.set_exception(exc)
        return done

    def shutdown(self) -> None:
        pass


def _start_worker() -> None:
    """In each process worker: Ctrl-C is for the training loop, which stops the pool; torch on one thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)


class ProcessExecutor:
    """A fork pool whose workers decode into the shared ring (no pixels through pipes).

    A terminal's Ctrl-C signals every process of the foreground group. The
    workers ignore it, so they finish the piece in hand instead of dying
    with a traceback each (and with the results the loader waits for);
    SIGINT stays blocked from the fork until each has said so, and in the
    pool's own threads, which fork the replacements.
    """

    def __init__(self, workers: int, ring: np.ndarray) -> None:
        import multiprocessing

        share_ring(ring)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._pool = multiprocessing.get_context("fork").Pool(workers, initializer=_start_worker)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def submit(self, func: Any, ring: Any, slot: int, start: int, items: Any, crop: CropSpec, finish: Any) -> Any:
        return self._pool.apply_async(func, (None, slot, start, items, crop))

    def shutdown(self) -> None:
        self._pool.terminate()
        self._pool.join()


def piece_result(pending: Any) -> Any:
    """Wait for a batch piece handed to the workers (a thread's Future or a process's AsyncResult)."""
    return pending.result() if isinstance(pending, Future) else pending.get()


def failed_samples(batch: Any) -> list[tuple[int, str]]:
    """Wait for the batch's pieces: (position, reason) of each sample that did not decode.

    A task's pieces also bring each decoded sample's targets: they go into `batch.targets`.
    """
    failures: list[tuple[int, str]] = []
    for pending in batch.pending:
        result = piece_result(pending)
        if isinstance(result, PieceResult):
            batch.targets.update(result.targets)
            failures.extend(result.failures)
        else:
            failures.extend(result)
    return sorted(failures)
