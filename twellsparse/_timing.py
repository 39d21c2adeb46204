"""One timer for the demo and the benchmarks: warm-up, repetitions, median and spread.

On the GPU it times with CUDA events on CuPy's current stream (work that torch queues on the
default stream is timed too) and can overwrite a buffer larger than the L2 cache before every
repetition, untimed, so no repetition finds its inputs cached by the previous one. On the CPU it
uses the wall clock.

``hide_host=True`` queues a short spin kernel (:data:`SPIN_NS`) before each start event: the
host then queues the whole timed call while the GPU spins, and the events measure the GPU's
work alone, as a CUDA graph or a host running ahead would see it. Host synchronisations inside
the call still show (they wait for the spin too, then expose the launches after them): the
result then says in how many repetitions the spin had ended before the host finished queueing
the call (``host_bound_reps``; those repetitions' times may include host gaps).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._backend import cupy_module

#: Bytes overwritten between repetitions to flush the L2 (several times the H200's 60 MB).
FLUSH_BYTES = 256 << 20

#: Nanoseconds the spin kernel of ``hide_host`` keeps the GPU busy (more than any timed call's
#: host time for its launches).
SPIN_NS = 2_000_000


class Timer:
    """``Timer(reps, on_gpu, warmup=3, flush_l2=False, hide_host=False)(fn)`` returns (last
    result, times in ms: ``{"median", "p10", "p90"}``, and with ``hide_host`` the
    ``host_bound_reps``)."""

    def __init__(
        self, reps: int, on_gpu: bool, warmup: int = 3, flush_l2: bool = False, hide_host: bool = False
    ) -> None:
        self.reps, self.on_gpu, self.warmup = reps, on_gpu, warmup
        self.hide_host = hide_host and on_gpu
        cp = cupy_module() if on_gpu else None
        self._cp = cp
        self._flush = cp.empty(FLUSH_BYTES // 4, dtype=cp.int32) if cp is not None and flush_l2 else None
        self._spin = None
        if cp is not None and self.hide_host:
            from . import _kernels as K

            self._spin = K.get_kernel("twell_spin")

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
        result = None
        for _ in range(self.warmup):
            result = fn()
        times = []
        host_bound = 0
        for i in range(self.reps):
            if self._flush is not None:
                self._flush.fill(i)
            if self._cp is not None:
                start, stop = self._cp.cuda.Event(), self._cp.cuda.Event()
                if self._spin is not None:
                    self._spin((1,), (1,), (np.int64(SPIN_NS),))
                start.record()
                result = fn()
                if self._spin is not None and start.done:  # the GPU reached the call before its launches all came
                    host_bound += 1
                stop.record()
                stop.synchronize()
                times.append(self._cp.cuda.get_elapsed_time(start, stop))
            else:
                t0 = time.perf_counter()
                result = fn()
                times.append((time.perf_counter() - t0) * 1e3)
        t = np.asarray(times)
        stats = {
            "median": float(np.median(t)),
            "p10": float(np.percentile(t, 10)),
            "p90": float(np.percentile(t, 90)),
        }
        if self._spin is not None:
            stats["host_bound_reps"] = host_bound
        return result, stats
