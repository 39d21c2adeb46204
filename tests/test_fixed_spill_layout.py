"""The layout of a fixed-length spill (the plans' spill_capacity), checked on NumPy against a
plain walk over the row-tiles; the GPU computes it with the same function on CuPy."""

from __future__ import annotations

import numpy as np
import pytest

from twellsparse._reference import fixed_spill_layout


def _walk(counts, capacity, spill_capacity):
    """Row-tiles in row-major order fill the spill until one does not fit; it and all later
    ones are left out whole. Returns (kept mask, spilled per row, spilled, left out)."""
    m, nt = counts.shape
    per_row = np.zeros(m, dtype=np.int64)
    kept = np.zeros((m, nt), dtype=bool)
    used, full = 0, False
    for r in range(m):
        for t in range(nt):
            excess = max(int(counts[r, t]) - capacity, 0)
            if not full and used + excess <= spill_capacity:
                kept[r, t] = True
                used += excess
                per_row[r] += excess
            else:
                full = True
    total = int(np.maximum(counts.astype(np.int64) - capacity, 0).sum())
    return kept, per_row, used, total - used


@pytest.mark.parametrize("seed", range(20))
def test_layout_matches_a_walk(seed):
    rng = np.random.default_rng(seed)
    m, nt, capacity = rng.integers(1, 9), rng.integers(1, 6), int(rng.integers(1, 5))
    counts = rng.integers(0, 3 * capacity, size=(m, nt)).astype(np.int32)
    total = int(np.maximum(counts - capacity, 0).sum())
    spill_capacity = int(rng.integers(0, total + 3))
    offsets, indptr, pass_counts, left_out = fixed_spill_layout(counts, capacity, spill_capacity)
    kept, per_row, used, lost = _walk(counts, capacity, spill_capacity)
    np.testing.assert_array_equal(np.diff(indptr), per_row)
    assert indptr[-1] == used <= spill_capacity and int(left_out) == lost == total - used
    np.testing.assert_array_equal(pass_counts, np.where(kept, counts, capacity))
    excess = np.maximum(counts.astype(np.int64) - capacity, 0).reshape(-1)
    for i in np.flatnonzero(kept.reshape(-1) & (excess > 0)):  # written tiles: in order, in bounds
        assert offsets[i] == excess[:i].sum() and offsets[i] + excess[i] <= spill_capacity


def test_empty_and_everything_fits():
    offsets, indptr, pass_counts, left_out = fixed_spill_layout(np.zeros((0, 3), np.int32), 2, 5)
    assert offsets.size == 0 and indptr.tolist() == [0] and int(left_out) == 0
    counts = np.array([[5, 1], [0, 4]], dtype=np.int32)
    offsets, indptr, pass_counts, left_out = fixed_spill_layout(counts, 2, 100)
    assert indptr.tolist() == [0, 3, 5] and int(left_out) == 0 and offsets.tolist() == [0, 3, 3, 3]
    np.testing.assert_array_equal(pass_counts, counts)
