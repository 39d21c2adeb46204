"""``python -m twellsparse demo``: pack FFN-like activations, multiply, check against dense."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _reference as ref
from ._backend import gpu_available, to_host
from ._environment import environment
from ._ops import linear_to_twell, matmul
from ._timing import Timer
from .testing import ffn_problem, rel_error


def _nbytes(*arrays: Any) -> int:
    return int(sum(a.nbytes for a in arrays))


def run_demo(force_cpu: bool = False, seed: int = 0, json_path: str | None = None) -> list[tuple[str, str]]:
    """Run the demo and return the table rows (also printed); ``json_path`` appends a JSON line."""
    on_gpu = gpu_available() and not force_cpu
    if on_gpu:
        import cupy as xp

        m, d_model, d_ff, dtype, where = 4096, 2048, 5632, "bfloat16", "GPU (CuPy kernels)"
    else:
        xp = np
        m, d_model, d_ff, dtype, where = 512, 256, 1024, "float32", "CPU (NumPy reference path; no GPU found)"
    p = ffn_problem(m, d_model, d_ff, 0.01, "skewed", dtype, seed, xp)
    x, w_gate, w_down = p["x"], p["w_gate"], p["w_down"]
    timer = Timer(reps=5, on_gpu=on_gpu, warmup=1)

    def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
        result, ms = timer(fn)
        return result, ms["median"]

    h, t_pack = timed(lambda: linear_to_twell(x, w_gate, activation="relu"))
    w_down_t = xp.ascontiguousarray(w_down.T)
    out, t_spmm = timed(lambda: matmul(h, w_down_t))
    h_dense = h.toarray()
    if on_gpu:  # the same product dense, in the same precision, through cuBLAS
        from ._gpu_ops import gemm_nt

        dense_out, t_dense = timed(lambda: gemm_nt(h_dense, w_down))
    else:
        dense_out, t_dense = timed(lambda: h_dense @ w_down_t)
    csr = h.astype(np.float32).tocsr() if on_gpu else h.tocsr()

    exact = ref.matmul(h.get().parts, h.shape, h.tile_n, to_host(w_down_t), np.float64)
    nnz_per_token = np.diff(to_host(csr.indptr))
    rows = [
        ("device", where),
        ("hidden activations", f"{m} tokens x {d_ff} units, {dtype}, relu(x @ W_gate.T), skewed firing"),
        (
            "density",
            f"{h.nnz / (m * d_ff):.4%} ({h.nnz} nonzeros; per token min/median/max "
            f"{nnz_per_token.min()}/{int(np.median(nnz_per_token))}/{nnz_per_token.max()})",
        ),
        ("TwELL layout", f"tile_n={h.tile_n}, capacity={h.capacity}, {h.n_spilled} entries spilled"),
        ("bytes: TwELL", f"{_nbytes(*h.parts):,}"),
        ("bytes: CSR (same values, int32 indices)", f"{h.nnz * (h.dtype.itemsize + 4) + (m + 1) * 4:,}"),
        ("bytes: dense", f"{m * d_ff * h.dtype.itemsize:,}"),
        ("time: GEMM + relu + pack (linear_to_twell)", f"{t_pack:.3f} ms"),
        ("time: TwELL @ W_down.T", f"{t_spmm:.3f} ms"),
        (f"time: dense {dtype} hidden @ W_down.T", f"{t_dense:.3f} ms"),
        ("max |error| vs float64 (TwELL path)", f"{np.abs(to_host(out).astype(np.float64) - exact).max():.3e}"),
        ("relative error vs float64", f"{rel_error(out, exact):.3e}"),
        ("relative error of dense path", f"{rel_error(dense_out, exact):.3e}"),
    ]
    if json_path:
        record = {
            "kind": "demo",
            **environment(),
            "device_path": "gpu" if on_gpu else "cpu",
            "shape": [m, d_model, d_ff],
            "dtype": dtype,
            "density": h.nnz / (m * d_ff),
            "ms": {"linear_to_twell": t_pack, "twell_matmul": t_spmm, "dense_matmul": t_dense},
            "rel_error": {"twell": rel_error(out, exact), "dense": rel_error(dense_out, exact)},
        }
        with open(json_path, "a") as f:
            f.write(json.dumps(record) + "\n")
    width = max(len(k) for k, _ in rows)
    print("twellsparse demo: FFN-like activations through the TwELL format")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    return rows
