"""The relu producer through cuBLASLt's ReLU bit-mask epilogue.

One GEMM writes ``relu(x @ w.T)`` and a mask with one bit per entry (set where the result was
positive); the pack then reads the mask (1/16 of the bf16 output's bytes) and only the values
whose bit is set, instead of scanning the whole output. Serves ``activation="relu"`` without a
threshold, in float16, bfloat16 and float32, when the cuBLASLt library loads.

On by default (:data:`ENABLED`) where the fused Hopper producer (``_hopper_producer``, which
packs in its own GEMM's epilogue) does not serve the call: float32, tiles wider than 256
columns, other capacities, other GPUs. On the H200 it brought the standard problem's producer from
1.52-1.67x a plain GEMM's time to 1.30-1.41x (bench/results/2026-12-02-ffn.jsonl, the
``producer_relu_mask`` rows of commit 72f5ef8; bench/ffn_bench.py times the dense-scan producer
beside it as ``producer_dense_scan``). Where cuBLASLt does not load, the dense scan serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._backend import bfloat16
from ._parts import TwELLParts

if TYPE_CHECKING:
    from ._gpu_convert import Finish

#: Whether linear_to_twell and the FFN plans use this producer where it applies.
ENABLED = True

#: Whether the FFN plans' sparse tail reads this producer's mask directly (``twell_mask_gated``
#: / ``twell_mask_spmm``: no TwELL pack, no capacity, no overflow read-back). Off: on the H200
#: the plans' calls are slower with it at 0.5-1% density (gated 1.30 against 1.24 ms, non-gated
#: 1.10 against 0.89 at 0.5%, bench/results/2026-12-03-ffn.jsonl, commit 98e75d0): walking the
#: mask words costs more than the pack it saves.
MASK_CONSUMER = False

_DTYPES = (np.dtype(np.float16), bfloat16, np.dtype(np.float32))


def applies(x: Any, w: Any, activation: str, threshold: float | None) -> bool:
    """Whether this producer can serve the call (it also needs the library to load)."""
    if not ENABLED or activation != "relu" or threshold is not None or x.dtype != w.dtype:
        return False
    if min(x.shape[0], x.shape[1], w.shape[0]) == 0:  # empty products stay with CuPy's matmul
        return False
    if np.dtype(x.dtype) not in _DTYPES:
        return False
    import cupy as cp

    shape = (x.shape[0], w.shape[0], x.shape[1], np.dtype(x.dtype).name, cp.cuda.Device().id)
    return _plan(*shape) is not None


def _plan(m: int, f: int, k: int, dtype_name: str, device: int) -> Any:
    """The cuBLASLt ReLU-mask GEMM for one shape, or None where the library does not load or
    offers no algorithm for it (the call then takes the dense-scan producer)."""
    from ._gpu_ops import lt_gemm

    return lt_gemm("ReluMaskGemm", m, f, k, dtype_name, device)


def relu_linear(x: Any, w: Any) -> tuple[Any, Any, int]:
    """``(relu(x @ w.T), mask, words per mask row)`` on the GPU, one cuBLASLt call."""
    import cupy as cp

    from .bindings import cublaslt

    x, w = cp.ascontiguousarray(x), cp.ascontiguousarray(w)
    (m, k), f = x.shape, w.shape[0]
    words = cublaslt.mask_ld(f) // 32
    out = cp.empty((m, f), dtype=x.dtype)
    mask = cp.empty(m * words, dtype=cp.uint32)
    if m and f:
        plan = _plan(m, f, k, np.dtype(x.dtype).name, cp.cuda.Device().id)
        if plan is None:
            raise RuntimeError(f"cuBLASLt: no ReLU-mask GEMM for x {tuple(x.shape)}, w {tuple(w.shape)} ({x.dtype})")
        plan(x, w, out, mask)
    return out, mask, words


def relu_linear_to_parts_deferred(x: Any, w: Any, tile_n: int, capacity: int) -> tuple[Any, TwELLParts, Finish]:
    """``(relu(x @ w.T), first, finish)`` as ``_gpu_convert.dense_to_parts_deferred`` gives them."""
    from ._gpu_convert import relu_mask_to_parts_deferred

    h, mask, words = relu_linear(x, w)
    first, finish = relu_mask_to_parts_deferred(h, mask, words, tile_n, capacity)
    return h, first, finish
