"""The stack sampler of `gpufeed watch`'s recorder: where the training loop's steps spend their time.

Standard library only. A daemon thread of the training process reads its main thread's stack
`SAMPLE_HZ` times a second (`sys._current_frames`) while a step is in progress (between a batch and
the next request for one) and classifies it: inside the model step (nn.Module calls, backward, the
optimizer, CUDA), or outside it (augmentation, collate, host copies, any Python of the loop), with
the main thread's CPU time meanwhile. A stack is classified by its code objects, each classified once.
"""

from __future__ import annotations

import sys
import time

SAMPLE_HZ = 40
_STEP_DIRS = ("/torch/nn/", "/torch/autograd/", "/torch/optim/", "/torch/cuda/", "/torch/amp/", "/torch/_tensor.py")
_DATA_DIRS = ("/torchvision/transforms/", "/kornia/augmentation/", "/albumentations/", "/torch/utils/data/")


def sample_stacks(recorder, ident: int, wait_codes: set, alive) -> None:
    """Sample the thread `ident` until `alive()` is false: each interval's time goes to the step of `recorder.last`."""
    clock = time.pthread_getcpuclockid(ident)
    kinds: dict = {}  # code object -> "step", "data", "wait" or "" (cached: a stack is classified in a few µs)
    period = 1.0 / SAMPLE_HZ
    last, last_cpu = time.perf_counter(), time.clock_gettime(clock)
    while alive():
        time.sleep(period)
        try:
            frame = sys._current_frames().get(ident)
            cpu = time.clock_gettime(clock)
        except (OSError, RuntimeError):
            return  # the main thread ended
        now = time.perf_counter()
        loop = recorder.last
        if loop is not None and frame is not None:
            kind = _stack_kind(frame, kinds, wait_codes)
            if kind == "step":
                loop.model_s += now - last
            elif kind == "data":
                loop.outside_s += now - last
                loop.outside_cpu_s += cpu - last_cpu
        del frame
        last, last_cpu = now, cpu
        recorder.sampler_cpu_s = time.thread_time()


def _stack_kind(frame, kinds: dict, wait_codes: set) -> str:
    """"wait" (inside a loader's next()), "data" (augmentation, collate, any Python outside the model) or "step"."""
    seen = set()
    depth = 0
    while frame is not None and depth < 256:
        code = frame.f_code
        kind = kinds.get(code)
        if kind is None:
            kind = _code_kind(code, wait_codes)
            if len(kinds) < 100_000:
                kinds[code] = kind
        seen.add(kind)
        frame = frame.f_back
        depth += 1
    for kind in ("wait", "data", "step"):
        if kind in seen:
            return kind
    return "data"


def _code_kind(code, wait_codes: set) -> str:
    if code in wait_codes:
        return "wait"
    name = code.co_filename.replace("\\", "/")
    if any(part in name for part in _DATA_DIRS):
        return "data"
    return "step" if any(part in name for part in _STEP_DIRS) else ""
