"""One call of one SpMM path on the standard problem, between profiler start and stop: a harness
for ``ncu --profile-from-start off`` (Nsight Compute's per-kernel sections and SASS sampling).

    python bench/kernel_probe.py [--path gather|portable] [--density 0.01] [--m 16384]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    import cupy as cp

    import twellsparse as ts
    from twellsparse import _gpu_ops
    from twellsparse.testing import ffn_problem

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default="gather", help="gather or portable")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--m", type=int, default=16384)
    args = ap.parse_args(argv)
    p = ffn_problem(args.m, 2048, 5632, args.density, "uniform", ts.bfloat16, 0, cp)
    h = ts.linear_to_twell(p["x"], p["w_gate"])
    wd_t = cp.ascontiguousarray(p["w_down"].T)
    out = cp.empty((args.m, 2048), dtype=h.dtype)
    _gpu_ops.spmm(h.parts, h.tile_n, wd_t, out, path=args.path)  # compile and warm up
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    _gpu_ops.spmm(h.parts, h.tile_n, wd_t, out, path=args.path)
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
