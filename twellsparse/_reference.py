"""NumPy/SciPy implementation of every TwELL operation.

This module is both the oracle of the test-suite (everything can run in float64) and the CPU
execution path. It is written for clarity over speed, but fully vectorised: no Python loops over
rows or tiles, so it stays usable at the sizes of the demo and tests.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.sparse as sp

from ._errors import TwELLCapacityError, TwELLDroppedEntriesWarning, warn
from ._parts import TwELLParts
from ._validation import MAX_DIM, n_tiles

# ----------------------------------------------------------------------------- activations


def activation(z: np.ndarray, name: str) -> np.ndarray:
    """Apply an activation in the precision of ``z`` (the oracle passes float64)."""
    if name == "identity":
        return z
    if name == "relu":
        return np.maximum(z, 0)
    if name == "relu2":
        r = np.maximum(z, 0)
        return r * r
    if name == "silu":
        with np.errstate(over="ignore"):
            return z / (1 + np.exp(-z))
    if name == "gelu":  # tanh approximation, the form most LLM checkpoints use
        c = math.sqrt(2 / math.pi)
        return 0.5 * z * (1 + np.tanh(c * (z + 0.044715 * z**3)))
    raise ValueError(f"activation: unknown {name!r}")


def keep_mask(h: np.ndarray, threshold: float | None) -> np.ndarray:
    """Entries a producer stores: nonzero (NaN included), or ``|h| > threshold``."""
    if threshold is None:
        return h != 0
    # Compare in float64: NumPy would otherwise round the threshold to h's dtype first.
    return np.abs(h.astype(np.float64)) > threshold


# ----------------------------------------------------------------------------- packing


def indptr_from_rows(rows, n_rows: int, xp=np):
    """int32 CSR row pointers of entries sorted by row (NumPy or CuPy)."""
    indptr = xp.zeros(n_rows + 1, dtype=xp.int32)
    if rows.size:
        indptr[1:] = xp.cumsum(xp.bincount(rows, minlength=n_rows))
    return indptr


def fixed_spill_layout(row_tile_nnz, capacity: int, spill_capacity: int, xp=np):
    """Where a spill of fixed length goes, computed without leaving the device (NumPy or CuPy).

    The row-tiles' excess over ``capacity``, in row-major order, fills ``spill_capacity`` slots;
    the row-tiles up to the first that does not fit spill (a prefix: the running total only
    grows), the others are left out whole. Returns ``(offsets, indptr, pass_counts, left_out)``:
    each row-tile's first spill slot (int64, flattened), the spill's row pointers (int32, M + 1)
    counting only what is written, the counts to hand pass 2 (a left-out row-tile holds exactly
    ``capacity``, so the pass skips it), and the entries left out (0-d int64).
    """
    m, nt = row_tile_nnz.shape
    excess = xp.maximum(row_tile_nnz.astype(xp.int64) - capacity, 0).reshape(-1)
    ends = xp.cumsum(excess)
    fits = ends <= spill_capacity
    indptr = xp.zeros(m + 1, dtype=xp.int32)
    indptr[1:] = xp.cumsum(xp.where(fits, excess, 0).reshape(m, nt).sum(axis=1))
    pass_counts = xp.where(fits.reshape(m, nt), row_tile_nnz, capacity).astype(xp.int32)
    total = ends[-1] if excess.size else xp.zeros((), dtype=xp.int64)
    return ends - excess, indptr, pass_counts, total - indptr[-1]


#: How many run lengths the segment plan chooses from (cuda/twell_rows.cuh, RUN_CANDIDATES).
RUN_CANDIDATES = 16


def run_length_candidates(shortest: int) -> list[int]:
    """The run lengths the segment plan chooses from, shortest first: ``shortest`` times 1,
    1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, ... 14 (cuda/twell_rows.cuh,
    ``run_length_candidate``)."""
    shortest = int(shortest)  # Python ints: no wrap-around before the clamp
    return [min(((4 + k % 4) * shortest << (k // 4)) // 4, 2**31 - 1) for k in range(RUN_CANDIDATES)]


def segment_plan(indptr, shortest: int, slots: int):
    """Where the transposed products cut their long rows (the oracle of cuda/twell_convert.cu,
    ``twell_segment_plan``), in NumPy.

    With run length L, a row of more than L entries is cut into ``ceil(length / L)`` runs. L
    is the first of :func:`run_length_candidates` whose runs fit in ``slots``, else the last;
    the runs take consecutive slots in row order for as long as they fit: from the first row
    whose runs do not fit on, every row stays whole. Returns ``(split_base, slot_row, L)``:
    each row's first slot or -1 (int32, one per row), each slot's row or -1 (int32, ``slots``
    of them), and the run length.
    """
    lengths = np.diff(np.asarray(indptr, dtype=np.int64))

    def runs_of(length: int):
        return np.where(lengths > length, -(-lengths // length), 0)

    candidates = run_length_candidates(shortest)
    segment = next((c for c in candidates[:-1] if runs_of(c).sum() <= slots), candidates[-1])
    need = runs_of(segment)
    base = np.cumsum(need) - need
    cut = (need > 0) & (base + need <= slots)
    split_base = np.where(cut, base, -1).astype(np.int32)
    slot_row = np.full(slots, -1, dtype=np.int32)
    for row in np.flatnonzero(cut):
        slot_row[base[row] : base[row] + need[row]] = row
    return split_base, slot_row, segment


def excess_entries(row_tile_nnz, capacity: int, xp=np):
    """The entries beyond ``capacity`` over all row-tiles, as a 0-d array (no read-back)."""
    return xp.maximum(row_tile_nnz - capacity, 0).sum(dtype=np.int64)


def overflow_excess(row_tile_nnz, capacity: int, overflow: str, xp=np, excess: int | None = None) -> int:
    """Apply the overflow policy to the per-row-tile counts; return the number of excess entries
    (``excess``, when the caller counted them already).

    Raises TwELLCapacityError under ``"error"`` and warns under ``"drop"``. Works on NumPy and
    CuPy arrays (one scalar read-back on the GPU unless ``excess`` is given).
    """
    if excess is None:
        excess = int(excess_entries(row_tile_nnz, capacity, xp))
    if excess == 0:
        return 0
    if overflow == "spill" and excess > MAX_DIM:
        raise ValueError(  # named by the one argument every producer has that cures it
            f"capacity: expected at most 2**31 - 1 entries beyond capacity {capacity} (int32 spill row "
            f"pointers), got {excess}; raise capacity or split the rows"
        )
    if overflow == "error":
        flat = row_tile_nnz.reshape(-1)
        worst = int(xp.argmax(flat))
        row, tile = divmod(worst, row_tile_nnz.shape[1])
        n_over = int((flat > capacity).sum())
        raise TwELLCapacityError(row, tile, int(flat[worst]), capacity, n_over)
    if overflow == "drop":
        warn(
            f'overflow="drop" discarded {excess} entries beyond capacity {capacity}',
            TwELLDroppedEntriesWarning,
        )
    return excess


def pack_coo(
    rows: np.ndarray,
    cols: np.ndarray,
    vals: np.ndarray,
    shape: tuple[int, int],
    tile_n: int,
    capacity: int,
    overflow: str,
) -> tuple[TwELLParts, int]:
    """Pack canonical COO entries (sorted by row then column, no duplicates) into TwELL parts.

    Each row-tile keeps its ``capacity`` smallest columns in the slots; the rest spill (or raise,
    or are dropped, per ``overflow``). Returns the parts and the number of dropped entries.
    """
    m, n = shape
    nt = n_tiles(n, tile_n)
    rows = rows.astype(np.int64, copy=False)
    cols = cols.astype(np.int64, copy=False)
    key = rows * nt + cols // tile_n
    row_tile_nnz = np.bincount(key, minlength=m * nt).reshape(m, nt)
    excess = overflow_excess(row_tile_nnz, capacity, overflow)
    pos = np.arange(key.size) - np.searchsorted(key, key, side="left")
    in_slot = pos < capacity

    data = np.zeros((m, nt, capacity), dtype=vals.dtype)
    indices = np.full((m, nt, capacity), -1, dtype=np.int16)
    flat = key[in_slot] * capacity + pos[in_slot]
    data.reshape(-1)[flat] = vals[in_slot]
    indices.reshape(-1)[flat] = (cols[in_slot] % tile_n).astype(np.int16)
    counts = np.minimum(row_tile_nnz, capacity).astype(np.int32)

    spilled = ~in_slot if overflow == "spill" else np.zeros_like(in_slot)
    spill_indptr = indptr_from_rows(rows[spilled], m)
    parts = TwELLParts(
        data,
        indices,
        counts,
        vals[spilled],
        cols[spilled].astype(np.int32),
        spill_indptr,
    )
    return parts, (excess if overflow == "drop" else 0)


def pack_dense(
    x: np.ndarray,
    tile_n: int,
    capacity: int,
    overflow: str,
    threshold: float | None = None,
) -> tuple[TwELLParts, int]:
    """Pack the entries of a dense matrix that :func:`keep_mask` keeps."""
    rows, cols = np.nonzero(keep_mask(x, threshold))
    return pack_coo(rows, cols, x[rows, cols], x.shape, tile_n, capacity, overflow)


def unpack_coo(parts: TwELLParts, tile_n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All stored entries as COO (rows, global columns, values), sorted by row then column."""
    m, _nt, cap = parts.data.shape
    used = np.arange(cap) < parts.counts[..., None]
    r, t, s = np.nonzero(used)
    cols = t.astype(np.int64) * tile_n + parts.indices[r, t, s]
    vals = parts.data[r, t, s]
    spill_rows = np.repeat(np.arange(m), np.diff(parts.spill_indptr))
    rows = np.concatenate([r.astype(np.int64), spill_rows])
    cols = np.concatenate([cols, parts.spill_indices.astype(np.int64)])
    vals = np.concatenate([vals, parts.spill_data])
    order = np.lexsort((cols, rows))
    return rows[order], cols[order], vals[order]


def to_scipy_csr(parts: TwELLParts, shape: tuple[int, int], tile_n: int, dtype=None) -> sp.csr_array:
    """SciPy CSR copy (duplicates, if a hand-built matrix has any, are kept, as scipy does)."""
    rows, cols, vals = unpack_coo(parts, tile_n)
    if dtype is not None:
        vals = vals.astype(dtype)
    return sp.csr_array((vals, cols, indptr_from_rows(rows, shape[0])), shape=shape)


def to_dense(parts: TwELLParts, shape: tuple[int, int], tile_n: int) -> np.ndarray:
    rows, cols, vals = unpack_coo(parts, tile_n)
    out = np.zeros(shape, dtype=parts.data.dtype)
    if _has_duplicates(rows, cols):  # only hand-built (non-canonical) parts can have them
        np.add.at(out, (rows, cols), vals)
    else:
        out[rows, cols] = vals
    return out


def _has_duplicates(rows: np.ndarray, cols: np.ndarray) -> bool:
    if rows.size < 2:
        return False
    return bool(np.any((rows[1:] == rows[:-1]) & (cols[1:] == cols[:-1])))


# ----------------------------------------------------------------------------- products


def matmul(parts: TwELLParts, shape, tile_n: int, b: np.ndarray, out_dtype) -> np.ndarray:
    """``A @ b`` in float64, cast to ``out_dtype``."""
    a = to_scipy_csr(parts, shape, tile_n, np.float64)
    return np.asarray(a @ b.astype(np.float64)).astype(out_dtype)


def matmul_transposed(parts: TwELLParts, shape, tile_n: int, g: np.ndarray, out_dtype) -> np.ndarray:
    """``A.T @ g`` in float64, cast to ``out_dtype``."""
    a = to_scipy_csr(parts, shape, tile_n, np.float64)
    return np.asarray(a.T @ g.astype(np.float64)).astype(out_dtype)


def sddmm_values(
    parts: TwELLParts, tile_n: int, x: np.ndarray, y: np.ndarray, out_dtype, scale: bool = False
) -> TwELLParts:
    """Parts with the pattern of ``parts`` and values ``x[i] . y[j]`` (times the pattern's value
    when ``scale``), computed in float64. Unused slots stay zero."""
    m, _nt, cap = parts.data.shape
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    used = np.arange(cap) < parts.counts[..., None]
    r, t, s = np.nonzero(used)
    cols = t.astype(np.int64) * tile_n + parts.indices[r, t, s]
    data = np.zeros(parts.data.shape, dtype=np.float64)
    data[r, t, s] = np.einsum("ik,ik->i", x64[r], y64[cols])
    spill_rows = np.repeat(np.arange(m), np.diff(parts.spill_indptr))
    spill = np.einsum("ik,ik->i", x64[spill_rows], y64[parts.spill_indices])
    if scale:
        data *= parts.data.astype(np.float64)
        spill *= parts.spill_data.astype(np.float64)
    return parts._replace(data=data.astype(out_dtype), spill_data=spill.astype(out_dtype))


# ----------------------------------------------------------------------------- dense oracles


def linear_dense(x: np.ndarray, weight: np.ndarray, act: str) -> np.ndarray:
    """``act(x @ weight.T)`` in float64."""
    return activation(x.astype(np.float64) @ weight.astype(np.float64).T, act)


def ffn_dense(x, w_up, w_down, act: str, threshold: float | None = None) -> np.ndarray:
    """``act(x @ w_up.T) @ w_down.T`` in float64 (entries at or under the threshold zeroed)."""
    h = linear_dense(x, w_up, act)
    h = np.where(keep_mask(h, threshold), h, 0.0)
    return h @ w_down.astype(np.float64).T


def gated_ffn_dense(x, w_gate, w_up, w_down, act: str, threshold: float | None = None) -> np.ndarray:
    """``(act(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T`` in float64."""
    g = linear_dense(x, w_gate, act)
    g = np.where(keep_mask(g, threshold), g, 0.0)
    u = x.astype(np.float64) @ w_up.astype(np.float64).T
    return (g * u) @ w_down.astype(np.float64).T
