"""The weight-stationary SpMM (``cuda/twell_stationary.cu``): ``out = A @ B`` with a 16-column
slice of all of B held in one block's shared memory while A's entries stream past it.

It serves 2-byte value types when a slice of B fits in shared memory (``N * 32`` bytes) and
every column index fits 16 bits; :func:`applies` says whether it does. A TwELL matrix is first
compacted to CSR on the device (no host read), since every slice reads all of A's entries.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from . import _kernels as K
from ._gpu_convert import parts_to_csr, row_stride
from ._gpu_ops import rows_aligned
from ._parts import TwELLParts

#: Output columns per block (STATIONARY_COLS in the kernel) and bytes of each B row it holds.
SLICE_COLS = 16
#: Threads per block (STATIONARY_WARPS warps of 32).
THREADS = 1024
#: Whether ``matmul`` takes this kernel where it applies (``TWELL_STATIONARY=1``); off until it
#: has been measured against the row gathers on the GPU.
PREFERRED = os.environ.get("TWELL_STATIONARY", "0") == "1"


def _cp() -> Any:
    import cupy

    return cupy


@functools.cache
def _shared_limit(device_id: int) -> int:
    return int(_cp().cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


def slice_bytes(n: int, itemsize: int) -> int:
    """Shared memory one block needs: a ``SLICE_COLS``-wide slice of every one of B's ``n`` rows."""
    return n * SLICE_COLS * itemsize


def applies(n: int, b: Any, out: Any) -> bool:
    """Whether the stationary kernel serves ``(M x n) @ b -> out`` on the current device."""
    if b.dtype.itemsize != 2 or out.dtype != b.dtype or n >= 1 << 16:
        return False
    _, ldb = row_stride(b)
    ldo = max(out.strides[0] // out.itemsize, out.shape[1], 1)
    if not rows_aligned((b, ldb), (out, ldo)):
        return False
    return slice_bytes(n, 2) <= _shared_limit(_cp().cuda.Device().id)


def csr_spmm(indptr: Any, cols: Any, vals: Any, n: int, b: Any, out: Any) -> Any:
    """``out = A @ b`` for a CSR ``A`` (``indptr`` int32, ``cols`` int32, ``vals`` of b's dtype;
    ``n`` columns); the caller has checked :func:`applies`."""
    m = indptr.shape[0] - 1
    b, ldb = row_stride(b)
    k = b.shape[1]
    ldo = max(out.strides[0] // out.itemsize, k, 1)
    slices = -(-k // SLICE_COLS)
    # Enough row parts that slices x parts fills the machine once (one block per SM).
    parts = max(1, min(K.sm_count() // slices, -(-m // THREADS)))
    rows_per_part = -(-m // parts)
    expr = f"twell_stationary_spmm<{K.CXX_TYPE[b.dtype]}>"
    args = (indptr, cols, vals, np.int32(m), np.int32(n), b, np.int64(ldb), np.int32(k), out, np.int64(ldo))
    K.launch_grid(expr, (slices, parts), (THREADS,), (*args, np.int32(rows_per_part)), slice_bytes(n, b.itemsize))
    return out


def spmm(parts: TwELLParts, shape: tuple[int, int], tile_n: int, b: Any, out: Any) -> Any:
    """``out = A @ b`` for a TwELL ``A`` of ``shape``: device-side CSR, then :func:`csr_spmm`."""
    vals, cols, indptr = parts_to_csr(parts, shape, tile_n, bounded=True)
    return csr_spmm(indptr, cols, vals, shape[1], b, out)
