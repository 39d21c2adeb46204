"""A dense matrix's transpose as a new C-contiguous array (``cuda/twell_dense_transpose.cu``).

The torch adapter hands the kernels the down projection's weight one row per hidden unit
(``W_down.T`` of torch's ``d_model x d_ff`` parameter) and returns ``dW_down`` in torch's layout,
so it transposes a weight-sized matrix once a forward and three times a training step. Torch's
strided copy does that at ~0.6 TB/s on an H200 (bench/NOTES.md, thirty-first session); this
kernel moves 32 x 32 tiles through shared memory with coalesced reads and writes. On the CPU it
is NumPy's copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernels as K
from ._backend import cupy_module, is_cupy_array

#: Tile edge and thread rows of a block (TRANSPOSE_TILE, TRANSPOSE_ROWS in the kernel).
TILE, ROWS = 32, 8
#: Blocks along the grid's y dimension at most (CUDA's limit; the kernel strides past it).
MAX_GRID_Y = 65535
#: Whether the torch adapter transposes its weights with :func:`transpose` (unset or ``1``) rather
#: than with torch's copy (``TWELL_DENSE_TRANSPOSE=0``). Measured on an H100 (68d2ff0, bench/NOTES.md,
#: thirty-second session): the standard widths' bf16 W_down (2048 x 5632) in 0.033 ms against
#: torch's 0.088 ms.
PREFERRED: bool = K.env_switch("TWELL_DENSE_TRANSPOSE") is not False


def transpose(a: Any) -> Any:
    """``a.T`` (``a`` 2-D, rows of unit stride) as a new C-contiguous array of ``a``'s dtype;
    ``a`` is left untouched. CuPy arrays of the library's value types take the kernel; others
    (NumPy, or CuPy with another dtype or a column stride) NumPy's or CuPy's own copy."""
    if a.ndim != 2:
        raise ValueError(f"a: expected a 2-D array, got {a.ndim}-D with shape {tuple(a.shape)}")
    if not is_cupy_array(a):
        return np.array(a.T, order="C", copy=True)  # a copy even where a.T is C-contiguous
    cp = cupy_module()
    assert cp is not None
    item = a.dtype.itemsize
    rows, cols = a.shape
    unit_columns = cols < 2 or a.strides[1] == item
    if a.dtype not in K.CXX_TYPE or not unit_columns or a.strides[0] % item:
        return cp.array(a.T, order="C", copy=True)
    out = cp.empty((cols, rows), dtype=a.dtype)
    if rows and cols:
        lda = a.strides[0] // item if rows > 1 else cols
        grid = (-(-cols // TILE), min(-(-rows // TILE), MAX_GRID_Y))
        args = (a, np.int64(lda), np.int64(rows), np.int64(cols), out, np.int64(rows))
        K.launch_grid(f"dense_transpose<{K.CXX_TYPE[a.dtype]}>", grid, (TILE, ROWS), args)
    return out


def contiguous_transpose(a: Any) -> Any:
    """``a.T`` as a C-contiguous array: ``a.T`` itself where it already is one (no copy), else
    :func:`transpose`'s new array."""
    return a.T if a.T.flags.c_contiguous else transpose(a)
