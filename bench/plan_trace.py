"""The kernels of one call of the sparse FFN plans, in launch order, with their GPU times and the
idle gaps between them (torch.profiler's CUDA activity, which records CuPy's launches too).

    python bench/plan_trace.py [--m 16384] [--density 0.005] [--pattern uniform] [--calls 3]
                               [--stages "bwd 3 transposed products;bwd 3 transposed products, rows whole"]

Prints, for the gated and the non-gated plan (``dispatch="sparse"``, exact spill), or for the
stages of ``bench/stage_times.py`` named by ``--stages`` (whole names, separated by semicolons),
each kernel of the last of ``--calls`` back-to-back calls: start offset, duration and the gap
before it (us), then the call's span, kernel time and gap total. A gap is time the GPU waits
for the host (a read-back, a launch the host had not issued yet); the stages' sum is what fusing
launches saves.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def trace(call: Callable[[], Any], calls: int) -> list[tuple[str, float, float]]:
    """``(name, start us, end us)`` of the GPU kernels and copies of the last of ``calls`` calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    events = sorted(
        (
            (e.name, float(e.time_range.start), float(e.time_range.end))
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
        ),
        key=lambda e: e[1],
    )
    # The last call's kernels: calls launch the same sequence (the warm-up call above took the
    # first-call work), so the last len(events) / calls events belong to the last call.
    per_call = len(events) // calls
    return events[-per_call:]


def report(title: str, events: list[tuple[str, float, float]]) -> None:
    """Print ``events`` (``(name, start us, end us)``, in launch order): start from the first,
    duration and the idle gap before each, then the call's span, busy time and idle total
    (``host_profile``'s accounting: overlapping kernels count once)."""
    from host_profile import _busy_and_gaps  # bench/ is the script's first path entry

    print(f"\n{title}")
    t0 = prev_end = events[0][1]
    for name, start, end in events:
        print(f"  {start - t0:9.1f} {end - start:9.1f} {max(0.0, start - prev_end):8.1f}  {name[:110]}")
        prev_end = max(prev_end, end)
    span, busy, gaps = _busy_and_gaps([(start, end, name) for name, start, end in events])
    idle = sum(gap[0] for gap in gaps)
    print(f"  span {span:.1f} us, kernels {busy:.1f} us, gaps {idle:.1f} us, {len(events)} launches")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--pattern", default="uniform")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--stages", default="", help="stage_times stage names (separated by ;) to trace instead")
    args = ap.parse_args(argv)
    shape = f"m {args.m}, d_model {args.d_model}, d_ff {args.d_ff}, {args.pattern} {args.density:.3%}"
    if args.stages:
        from stage_times import stages  # bench/ is the script's first path entry

        calls = stages(args.density, args.m, args.pattern, args.d_model, args.d_ff)[1]
        for name in args.stages.split(";"):
            report(f"{name} ({shape})", trace(calls[name], args.calls))
        return 0

    import cupy as cp

    import twellsparse as ts
    from twellsparse.testing import ffn_problem

    p = ffn_problem(args.m, args.d_model, args.d_ff, args.density, args.pattern, ts.bfloat16, 0, cp)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    gated = ts.GatedFFN(wg, wu, wd, dispatch="sparse")
    plain = ts.FFN(wg, wd, dispatch="sparse")
    report(f"gated plan ({shape}): start, duration, gap before (us)", trace(lambda: gated(x), args.calls))
    report(f"non-gated plan ({shape})", trace(lambda: plain(x), args.calls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
