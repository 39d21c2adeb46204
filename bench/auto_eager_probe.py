"""Why an ``auto`` plan that runs dense can read slower than the ``dense`` plan in eager timing.

``ffn_bench.py`` times every row eagerly (the GPU idle before each call, the L2 flushed) and with
the host hidden (a spin kernel ahead). At d_model 4096, 16384 tokens, skewed 1-2% (H200,
f8b4e95) the non-gated ``auto`` plan ran dense at 0.83-0.89x torch eagerly but 1.04x in GPU
time, where the ``dense`` plan, doing the same GPU work, lost no such time. This probe builds the
same plans as ``ffn_bench.py`` and, per eager repetition, records both the GPU time (events) and
the host time of the call itself and how many blocks CuPy's memory pool had to add for it,
then profiles one eager ``auto`` call with ``cProfile``: host time near the GPU time means the
host queues too slowly or waits inside the call, and pool growth points at an allocation (a
cudaMalloc of the call's pre-activation) on the host path. ``--bench-state`` first builds what
``ffn_bench.py`` holds when it times these rows (its other plans, their outputs and the dense
reference arrays), where the loss was seen.

    python bench/auto_eager_probe.py [--m 16384] [--d-model 4096] [--d-ff 14336]
        [--density 0.015] [--pattern skewed] [--reps 10] [--bench-state] [--interleave] [--reverse]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np

import twellsparse as ts
from twellsparse._timing import FLUSH_BYTES
from twellsparse.testing import ffn_problem


def eager_reps(fn: Callable[[], Any], reps: int, flush: Any) -> list[tuple[float, float, float]]:
    """``(gpu ms, host ms of the call, MiB the memory pool grew by in it)`` of ``reps`` eager
    calls, each after an L2 flush and with the GPU idle before it, as
    ``twellsparse._timing.Timer`` times them (three warm-ups)."""
    pool = cp.get_default_memory_pool()
    for _ in range(3):
        fn()
    out = []
    for i in range(reps):
        flush.fill(i)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        held = pool.total_bytes()
        start.record()
        t0 = time.perf_counter()
        fn()
        host = (time.perf_counter() - t0) * 1e3
        stop.record()
        stop.synchronize()
        out.append((cp.cuda.get_elapsed_time(start, stop), host, (pool.total_bytes() - held) / 2**20))
    return out


def bench_state(x: Any, wg: Any, wu: Any, wd: Any) -> list[Any]:
    """What ``ffn_bench.py`` keeps alive while it times the auto rows: its other plans (sparse,
    dense, fp8) after a call each, their outputs, and the dense arrays of its checks."""
    from twellsparse._gpu_ops import gemm_nt

    plans = [
        ts.GatedFFN(wg, wu, wd, dispatch="sparse"),
        ts.FFN(wg, wd, dispatch="sparse"),
        ts.GatedFFN(wg, wu, wd, dispatch="sparse", down_format="e4m3", up_format="e4m3"),
        ts.FFN(wg, wd, dispatch="sparse", down_format="e4m3"),
    ]
    held: list[Any] = [plan(x) for plan in plans] + plans
    h = ts.linear_to_twell(x, wg)
    held += [h, h.toarray(), gemm_nt(x, wg), cp.ascontiguousarray(wd.T)]
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--d-ff", type=int, default=14336)
    ap.add_argument("--density", type=float, default=0.015)
    ap.add_argument("--pattern", default="skewed")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--bench-state", action="store_true", help="hold what ffn_bench.py holds first")
    ap.add_argument("--interleave", action="store_true", help="one call of each plan per round")
    ap.add_argument("--reverse", action="store_true", help="time the plans in the reverse order")
    args = ap.parse_args()
    p = ffn_problem(args.m, args.d_model, args.d_ff, args.density, args.pattern, ts.bfloat16, 0, cp)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    plans = {
        "ffn dense": ts.FFN(wg, wd, dispatch="dense"),
        "ffn auto": ts.FFN(wg, wd, dispatch="auto"),
        "gated dense": ts.GatedFFN(wg, wu, wd, dispatch="dense"),
        "gated auto": ts.GatedFFN(wg, wu, wd, dispatch="auto"),
    }
    flush = cp.empty(FLUSH_BYTES // 4, dtype=cp.int32)
    pool = cp.get_default_memory_pool()
    held = bench_state(x, wg, wu, wd) if args.bench_state else []
    order = list(plans.items())
    if args.reverse:
        order.reverse()
    per_plan: dict[str, list[tuple[float, float, float]]] = {name: [] for name in plans}
    if args.interleave:  # one call of each plan per round: a drift of the clocks hits all alike
        for _ in range(args.reps):
            for name, plan in order:
                per_plan[name] += eager_reps(lambda plan=plan: plan(x), 1, flush)
    else:
        for name, plan in order:
            per_plan[name] = eager_reps(lambda plan=plan: plan(x), args.reps, flush)
    for name, plan in order:
        times = np.asarray(per_plan[name])
        gpu, host, grown = np.median(times, axis=0)
        print(
            f"{name:12s} eager gpu {gpu:7.3f} ms (max {times[:, 0].max():.3f}), host {host:7.3f} ms "
            f"(max {times[:, 1].max():.3f}), pool grew {grown:.0f} MiB a call (max {times[:, 2].max():.0f}); "
            f"path {plan.last_stats['path']}, sampled {plan.last_stats['sampled_density']:.4f}; "
            f"pool used {pool.used_bytes() / 2**30:.1f} / held {pool.total_bytes() / 2**30:.1f} GiB",
            flush=True,
        )
    for name in ("ffn auto", "ffn dense"):
        plan = plans[name]
        cp.cuda.Device().synchronize()
        flush.fill(0)
        prof = cProfile.Profile()
        prof.enable()
        plan(x)
        prof.disable()
        cp.cuda.Device().synchronize()
        print(f"--- one eager call of {name}: the functions with the most own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    del held


if __name__ == "__main__":
    main()
