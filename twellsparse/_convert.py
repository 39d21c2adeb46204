"""Conversions between TwELL parts and dense, COO/CSR and ELLPACK data, on either device.

Each function takes NumPy or CuPy arrays and dispatches on the array module: the CPU path is
``_reference``, the GPU path ``_gpu_convert``'s kernels. Inputs are validated by the callers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _reference as ref
from ._backend import array_module, is_cupy_array
from ._parts import TwELLParts


def dense_to_twell(
    x: Any, tile_n: int, capacity: int, overflow: str, threshold: float | None = None, activation: str = "identity"
) -> tuple[TwELLParts, int]:
    """Pack the entries of ``act(x)`` that are nonzero (or above ``threshold``)."""
    if is_cupy_array(x):
        from . import _gpu_convert

        return _gpu_convert.dense_to_parts(x, tile_n, capacity, overflow, threshold, activation)
    if activation != "identity":
        x = ref.activation(x.astype(np.float64), activation).astype(x.dtype)
    return ref.pack_dense(x, tile_n, capacity, overflow, threshold)


def coo_to_twell(
    rows: Any, cols: Any, vals: Any, shape: tuple[int, int], tile_n: int, capacity: int, overflow: str
) -> tuple[TwELLParts, int]:
    """Pack canonical COO entries (sorted by row, then column; no duplicates)."""
    xp = array_module(vals)
    if xp is np:
        return ref.pack_coo(rows, cols, vals, shape, tile_n, capacity, overflow)
    from . import _gpu_convert

    indptr = ref.indptr_from_rows(rows, shape[0], xp)
    return _gpu_convert.csr_to_parts(indptr, cols, vals, shape, tile_n, capacity, overflow)


def csr_to_twell(
    indptr: Any, cols: Any, vals: Any, shape: tuple[int, int], tile_n: int, capacity: int, overflow: str
) -> tuple[TwELLParts, int]:
    """Pack a canonical CSR matrix (sorted columns, no duplicates)."""
    xp = array_module(vals)
    if xp is np:
        rows = np.repeat(np.arange(shape[0]), np.diff(indptr))
        return ref.pack_coo(rows, cols, vals, shape, tile_n, capacity, overflow)
    from . import _gpu_convert

    return _gpu_convert.csr_to_parts(indptr, cols, vals, shape, tile_n, capacity, overflow)


def twell_to_dense(parts: TwELLParts, shape: tuple[int, int], tile_n: int) -> Any:
    if is_cupy_array(parts.data):
        from . import _gpu_convert

        return _gpu_convert.parts_to_dense(parts, shape, tile_n)
    return ref.to_dense(parts, shape, tile_n)


def twell_to_csr_arrays(parts: TwELLParts, shape: tuple[int, int], tile_n: int) -> tuple[Any, Any, Any]:
    """(data, indices, indptr) with int32 indices, columns sorted within rows."""
    xp = array_module(parts.data)
    if xp is np:
        rows, cols, vals = ref.unpack_coo(parts, tile_n)
        return vals, cols.astype(np.int32), ref.indptr_from_rows(rows, shape[0])
    from . import _gpu_convert

    vals, cols, indptr = _gpu_convert.parts_to_csr(parts, shape, tile_n)
    rows = csr_rows(indptr, cols.size)
    key = rows.astype(xp.int64) * max(shape[1], 1) + cols
    if key.size > 1 and not bool((key[1:] > key[:-1]).all()):  # slots a user left unsorted
        order = xp.argsort(key)
        vals, cols = vals[order], cols[order]
    return vals, cols, indptr


def twell_to_coo(parts: TwELLParts, shape: tuple[int, int], tile_n: int) -> tuple[Any, Any, Any]:
    """(rows, cols, vals), sorted by row then column."""
    vals, cols, indptr = twell_to_csr_arrays(parts, shape, tile_n)
    return csr_rows(indptr, cols.size), cols, vals


def csr_rows(indptr: Any, nnz: int) -> Any:
    """Row index of each of the ``nnz`` entries of a CSR matrix."""
    xp = array_module(indptr)
    return (xp.searchsorted(indptr, xp.arange(nnz), side="right") - 1).astype(xp.int32)


# ----------------------------------------------------------------------------- ELLPACK


def ell_to_coo(values: Any, indices: Any, n_cols: int) -> tuple[Any, Any, Any]:
    """Validate ELLPACK arrays (padding -1 after each row's entries, columns < n_cols, no
    duplicate column in a row) and return canonical COO (rows, cols, vals)."""
    xp = array_module(values)
    valid = indices >= 0
    bad = (indices < -1) | (indices >= n_cols)
    if bool(bad.any()):
        r, s = (int(v[0]) for v in xp.nonzero(bad))
        raise ValueError(
            f"indices: expected column indices in [0, {n_cols}) or -1 for padding, got {int(indices[r, s])} "
            f"at row {r}, slot {s}"
        )
    if indices.shape[1] > 1:
        late = valid[:, 1:] & ~valid[:, :-1]
        if bool(late.any()):
            r = int(xp.nonzero(late)[0][0])
            raise ValueError(f"indices: expected each row's entries before its -1 padding, row {r} has one after")
    rows, slots = xp.nonzero(valid)
    cols = indices[rows, slots].astype(xp.int64)
    vals = values[rows, slots]
    key = rows.astype(xp.int64) * max(n_cols, 1) + cols
    order = xp.argsort(key)
    key = key[order]
    if key.size > 1:
        dup = key[1:] == key[:-1]
        if bool(dup.any()):
            k = int(key[1:][dup][0])
            raise ValueError(
                f"indices: expected distinct columns in each row, row {k // n_cols} repeats column {k % n_cols}"
            )
    return rows[order].astype(xp.int32), cols[order].astype(xp.int32), vals[order]


def coo_to_ell(rows: Any, cols: Any, vals: Any, n_rows: int, width: int | None) -> tuple[Any, Any]:
    """ELLPACK (values, int32 indices with -1 padding) of sorted COO, ``width`` slots per row."""
    xp = array_module(vals)
    row_nnz = xp.bincount(rows, minlength=n_rows) if rows.size else xp.zeros(n_rows, dtype=xp.int64)
    need = int(row_nnz.max()) if n_rows else 0
    if width is None:
        width = need
    elif width < need:
        raise ValueError(f"width: expected at least the largest row's nonzero count {need}, got {width}")
    out_vals = xp.zeros((n_rows, width), dtype=vals.dtype)
    out_cols = xp.full((n_rows, width), -1, dtype=xp.int32)
    starts = xp.zeros(n_rows + 1, dtype=xp.int64)
    starts[1:] = xp.cumsum(row_nnz)
    slot = xp.arange(rows.size) - starts[rows]
    out_vals[rows, slot] = vals
    out_cols[rows, slot] = cols
    return out_vals, out_cols
