"""Module-level constructors: ``from_dense`` and ``from_ell``."""

from __future__ import annotations

from typing import Any

from . import _convert as conv
from ._backend import as_array, device_name, value_dtype
from ._twell import twell_array
from ._validation import check_layout, check_ndim, check_shape, check_threshold


def from_dense(
    x: Any,
    *,
    tile_n: int = 256,
    capacity: int | None = None,
    threshold: float | None = None,
    overflow: str = "spill",
) -> twell_array:
    """Pack a dense matrix, keeping entries with ``x != 0`` or, given ``threshold``, ``|x| > threshold``.

    Parameters
    ----------
    x : array_like
        2-D NumPy or CuPy array, or any DLPack producer; the result lives on its device.
    tile_n, capacity, overflow
        As for :class:`twell_array`.
    threshold : float, optional
        Keep only entries whose magnitude exceeds it (NaN entries are then dropped).

    Returns
    -------
    twell_array
    """
    tile_n, capacity, overflow = check_layout(tile_n, capacity, overflow)
    thr = check_threshold(threshold)
    arr = as_array(x, "x")
    check_ndim(arr, 2, "x")
    check_shape(arr.shape, "x.shape")
    value_dtype(arr.dtype, "x.dtype")
    parts, dropped = conv.dense_to_twell(arr, tile_n, capacity, overflow, thr)
    return twell_array._from_parts(parts, arr.shape, tile_n, dropped)


def from_ell(
    values: Any,
    indices: Any,
    shape: tuple[int, int] | None = None,
    *,
    tile_n: int = 256,
    capacity: int | None = None,
    overflow: str = "spill",
) -> twell_array:
    """Build from ELLPACK arrays.

    Parameters
    ----------
    values, indices : array_like, shape (M, K)
        Values and column indices; each row's entries come first, the padding slots after them
        are marked by index -1. Columns need not be sorted; a column may appear once per row.
    shape : tuple of int, optional
        ``(M, N)``; N defaults to the largest column index plus one.

    Returns
    -------
    twell_array
    """
    tile_n, capacity, overflow = check_layout(tile_n, capacity, overflow)
    vals = as_array(values, "values")
    idx = as_array(indices, "indices")
    check_ndim(vals, 2, "values")
    if device_name(idx) != device_name(vals):
        raise ValueError(
            f"indices: expected an array on {device_name(vals)} like values, got one on {device_name(idx)}"
        )
    if tuple(idx.shape) != tuple(vals.shape):
        raise ValueError(f"indices: expected shape {tuple(vals.shape)} like values, got {tuple(idx.shape)}")
    if idx.dtype.kind not in "iu":
        raise TypeError(f"indices: expected an integer array, got {idx.dtype}")
    value_dtype(vals.dtype, "values.dtype")
    m = vals.shape[0]
    if shape is None:
        n = int(idx.max()) + 1 if idx.size else 0
        shape = (m, max(n, 0))
    shape = check_shape(shape)
    if shape[0] != m:
        raise ValueError(f"shape: expected {m} rows like values, got {shape[0]}")
    rows, cols, v = conv.ell_to_coo(vals, idx, shape[1])
    parts, dropped = conv.coo_to_twell(rows, cols, v, shape, tile_n, capacity, overflow)
    return twell_array._from_parts(parts, shape, tile_n, dropped)
