"""One call of one row-gather kernel on the standard problem, between profiler start and stop: a
harness for ``ncu --profile-from-start off`` (Nsight Compute's per-kernel sections and SASS
sampling).

    python bench/kernel_probe.py [--kernel spmm|sddmm|gated|transposed] [--path gather|portable]
                                 [--density 0.01] [--m 16384]

``spmm`` is the down projection (``--path`` picks its kernel), ``sddmm`` the up projection's
sampled product at the gate's pattern, ``gated`` the gated consumer (both row gathers),
``transposed`` the backward's paired transposed product ``(dZ.T @ x, dU.T @ x)`` on the CSR of
the pattern's transpose (its pattern built before the profiled call): it gathers token rows of
x (M x d_model, 64 MB at 16384 tokens, more than the L2) where the others gather weight rows.
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
    ap.add_argument("--kernel", default="spmm", choices=("spmm", "sddmm", "gated", "transposed"))
    ap.add_argument("--path", default="gather", help="gather or portable (spmm only)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--m", type=int, default=16384)
    args = ap.parse_args(argv)
    p = ffn_problem(args.m, 2048, 5632, args.density, "uniform", ts.bfloat16, 0, cp)
    h = ts.linear_to_twell(p["x"], p["w_gate"])
    wd_t = cp.ascontiguousarray(p["w_down"].T)
    out = cp.empty((args.m, 2048), dtype=h.dtype)
    if args.kernel == "transposed":  # the pattern and both outputs, outside the profiled call
        pattern = _gpu_ops.transposed_pattern(h.parts, h.tile_n, h.shape[1])
        outs = [cp.empty((h.shape[1], 2048), dtype=h.dtype) for _ in range(2)]

    def call() -> None:
        if args.kernel == "spmm":
            _gpu_ops.spmm(h.parts, h.tile_n, wd_t, out, path=args.path)
        elif args.kernel == "sddmm":
            _gpu_ops.sddmm(h.parts, h.tile_n, p["x"], p["w_up"], scale=False, path="gather")
        elif args.kernel == "gated":
            _gpu_ops.gated_consumer(h.parts, h.tile_n, p["x"], p["w_up"], wd_t, out=out)
        else:
            _gpu_ops.spmm_transposed(
                h.parts, h.tile_n, h.shape[1], p["x"], outs[0], lambda: pattern, second=(h.parts, outs[1])
            )

    call()  # compile and warm up
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    call()
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
