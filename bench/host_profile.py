"""Where a sparse FFN call spends its host time: ``cProfile`` over repeated calls of a plan, by
default gated with a fixed spill (no read-back, so the host runs ahead of the GPU and its own
cost shows), on the standard problem. Prints the functions with the most own time and the host
time per call. ``--exact`` profiles the default overflow policy (one read-back per call) instead,
``--plain`` the non-gated block.

    python bench/host_profile.py [--density 0.005] [--m 16384] [--exact] [--plain]
        [--dispatch sparse] [--calls 200] [--top 35]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time


def main(argv: list[str] | None = None) -> int:
    import cupy as cp

    import twellsparse as ts
    from twellsparse.testing import ffn_problem

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--exact", action="store_true", help="no spill_capacity: the exact read-back")
    ap.add_argument("--plain", action="store_true", help="the non-gated block")
    ap.add_argument("--dispatch", default="sparse", choices=("sparse", "auto", "dense"))
    args = ap.parse_args(argv)
    p = ffn_problem(args.m, 2048, 5632, args.density, "uniform", ts.bfloat16, 0, cp)
    spill = None if args.exact else args.m * 64

    def fresh_plan() -> ts.FFN | ts.GatedFFN:
        if args.plain:
            return ts.FFN(p["w_gate"], p["w_down"], dispatch=args.dispatch, spill_capacity=spill)
        return ts.GatedFFN(p["w_gate"], p["w_up"], p["w_down"], dispatch=args.dispatch, spill_capacity=spill)

    plan = fresh_plan()
    x = p["x"]
    for _ in range(5):
        plan(x)
    cp.cuda.Device().synchronize()
    for label, make in (("prebuilt plan", lambda: plan), ("plan built per call", fresh_plan)):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            make()(x)
        host = (time.perf_counter() - t0) * 1e3 / args.calls
        cp.cuda.Device().synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / args.calls
        print(f"{label}: host {host:.3f} ms per call (queued ahead), wall {wall:.3f} ms per call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        plan(x)
    prof.disable()
    cp.cuda.Device().synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats("twellsparse", args.top)  # where each call's time goes
    return 0


if __name__ == "__main__":
    sys.exit(main())
