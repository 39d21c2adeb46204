"""The down projection's kernels side by side over token counts and densities: the row gathers
(``path="gather"``), the weight-stationary SpMM with its pack (``_stationary.spmm``) and, on
Hopper, the tiled tensor-core SpMM with its pack (``_tiled_spmm.spmm``), each against the dense
GEMM of the same product, on the standard widths (or ``--d-model`` / ``--d-ff``). The data
behind ``_stationary.MIN_ROWS`` and the tiled kernel's break-even.

    python bench/down_choice.py --out results.jsonl
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from twellsparse._environment import append_records, environment
from twellsparse._timing import Timer
from twellsparse.testing import ffn_problem


def case(m: int, d_model: int, d_ff: int, density: float, pattern: str, timer: Timer) -> dict[str, Any]:
    import cupy as cp

    import twellsparse as ts
    from twellsparse import _gpu_ops, _stationary, _tiled_spmm
    from twellsparse.testing import rel_error

    p = ffn_problem(m, d_model, d_ff, density, pattern, ts.bfloat16, 0, cp)
    x, wg, wd = p["x"], p["w_gate"], p["w_down"]
    wd_t = cp.ascontiguousarray(wd.T)
    h = ts.linear_to_twell(x, wg)
    h_dense = h.toarray()
    out = cp.empty((m, d_model), dtype=x.dtype)
    gathered = cp.asnumpy(_gpu_ops.spmm(h.parts, h.tile_n, wd_t, out, path="gather"))
    kernels = {
        "dense": lambda: _gpu_ops.gemm_nt(h_dense, wd),
        "gather": lambda: _gpu_ops.spmm(h.parts, h.tile_n, wd_t, out, path="gather"),
    }
    if _stationary.applies(d_ff, wd_t, out, tile_n=h.tile_n):  # in column bands where b is tall
        kernels["stationary"] = lambda: _stationary.spmm(h.parts, h.tile_n, wd_t, out)
    if _tiled_spmm.applies(wd_t, out):
        kernels["tiled"] = lambda: _tiled_spmm.spmm(h.parts, h.tile_n, wd_t, out)
    for name in ("stationary", "tiled"):  # each checked against the gathers before it is timed
        if name in kernels:
            err = rel_error(cp.asnumpy(kernels[name]()).astype("float64"), gathered.astype("float64"))
            if not err < 1e-2:
                raise SystemExit(f"{name} differs from the gathers by {err:.3e} at m={m}, {density}")
    # Timed in rounds (Timer.interleaved): a drift of the clocks reaches every kernel alike.
    rows = {name: stats["median"] for name, (_, stats) in timer.interleaved(kernels, keep=False).items()}
    return {
        "kind": "down_choice",
        "shape": [m, d_model, d_ff],
        "dtype": "bfloat16",
        "pattern": pattern,
        "density_target": density,
        "density": h.nnz / (m * d_ff),
        "ms": rows,
        **environment(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="4096,8192,16384,65536", help="comma-separated token counts")
    ap.add_argument("--densities", default="0.0025,0.005,0.01,0.02")
    ap.add_argument("--pattern", default="uniform")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args(argv)
    timer = Timer(args.reps, on_gpu=True, flush_l2=True)
    records = []
    for m in (int(v) for v in args.m.split(",")):
        for density in (float(v) for v in args.densities.split(",")):
            rec = case(m, args.d_model, args.d_ff, density, args.pattern, timer)
            ms = rec["ms"]
            line = " ".join(f"{k} {v:.3f}" for k, v in ms.items())
            print(f"m={m:6d} density {rec['density']:.4f}: {line} ms", flush=True)
            records.append(rec)
    if args.out:
        append_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
