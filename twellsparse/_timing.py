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
    ``host_bound_reps``); :meth:`interleaved` times several functions in rounds."""

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
        return self.interleaved({"fn": fn})["fn"]

    def interleaved(
        self, fns: dict[str, Callable[[], Any]], keep: bool = True
    ) -> dict[str, tuple[Any, dict[str, float]]]:
        """Each function timed as :meth:`__call__` times one, its repetitions taken in rounds (one
        of each function per round, in the order given) after every function's warm-up: a drift
        of the clocks or the card's temperature during the run then reaches every function alike
        (timed one after the other, paths doing the same GPU work read up to ~6% apart in one run,
        bench/NOTES.md, fortieth session). ``{name: (last result, times)}``; ``keep=False`` drops
        each result at once (None in its place), so that large outputs are not all held at once."""
        last: dict[str, Any] = dict.fromkeys(fns)
        for name, fn in fns.items():
            for _ in range(self.warmup):
                result = fn()
                last[name] = result if keep else None
        times: dict[str, list[float]] = {name: [] for name in fns}
        late = dict.fromkeys(fns, 0)
        for i in range(self.reps):
            for name, fn in fns.items():
                result, ms, host_bound = self._one(fn, i)
                last[name] = result if keep else None
                times[name].append(ms)
                late[name] += host_bound
        return {name: (last[name], self._stats(times[name], late[name])) for name in fns}

    def _one(self, fn: Callable[[], Any], i: int) -> tuple[Any, float, bool]:
        """``(result, ms, whether the GPU reached the call before its launches all came)`` of
        repetition ``i`` of ``fn``."""
        if self._flush is not None:
            self._flush.fill(i)
        if self._cp is None:
            t0 = time.perf_counter()
            result = fn()
            return result, (time.perf_counter() - t0) * 1e3, False
        start, stop = self._cp.cuda.Event(), self._cp.cuda.Event()
        if self._spin is not None:
            self._spin((1,), (1,), (np.int64(SPIN_NS),))
        start.record()
        result = fn()
        late = self._spin is not None and start.done
        stop.record()
        stop.synchronize()
        return result, self._cp.cuda.get_elapsed_time(start, stop), late

    def _stats(self, times: list[float], host_bound: int) -> dict[str, float]:
        t = np.asarray(times)
        stats = {
            "median": float(np.median(t)),
            "p10": float(np.percentile(t, 10)),
            "p90": float(np.percentile(t, 90)),
        }
        if self._spin is not None:
            stats["host_bound_reps"] = host_bound
        return stats
