"""The two-launch device scans (cuda/twell_scan.cuh): the fixed spill's layout against its NumPy
oracle and the transposed pattern's scan, across many chunks, with the boundary of the kept
prefix in the first, a middle and the last chunk."""

from __future__ import annotations

import numpy as np
import pytest

from twellsparse import _gpu_convert, _kernels
from twellsparse._reference import fixed_spill_layout

pytestmark = pytest.mark.gpu


def _check_layout(cp, counts, capacity, spill_capacity):
    got = _gpu_convert.spill_layout(cp.asarray(counts), capacity, spill_capacity)
    want = fixed_spill_layout(counts, capacity, spill_capacity)
    names = ("offsets", "indptr", "pass_counts", "left_out")
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(cp.asnumpy(g), w, err_msg=f"{name} (spill_capacity={spill_capacity})")


def _counts(rng, m, nt, capacity, spill_rate):
    """Counts at most `capacity` except a `spill_rate` share of row-tiles that exceed it."""
    counts = rng.integers(0, capacity + 1, size=(m, nt))
    over = rng.random((m, nt)) < spill_rate
    counts[over] = capacity + rng.integers(1, 40, size=int(over.sum()))
    return counts.astype(np.int32)


@pytest.mark.parametrize(
    "m, nt, spill_rate",
    [(1, 1, 1.0), (7, 3, 0.5), (300, 22, 0.05), (3000, 22, 0.01), (70_001, 1, 0.2), (16_384, 22, 0.002)],
)
def test_spill_layout_matches_the_reference(cp, m, nt, spill_rate):
    rng = np.random.default_rng(m * 31 + nt)
    capacity = 8
    counts = _counts(rng, m, nt, capacity, spill_rate)
    excess = np.maximum(counts.astype(np.int64) - capacity, 0).reshape(-1)
    ends = np.cumsum(excess)
    total = int(ends[-1])
    # No room, all of it, more than all, and a boundary in the first, a middle and the last
    # chunk, both exactly at a row-tile's end and one short of it.
    capacities = {0, total, total + 10, int(rng.integers(0, total + 1))}
    n_chunks = -(-excess.size // _kernels.SCAN_CHUNK)
    for chunk in {0, n_chunks // 2, n_chunks - 1}:
        inside = ends[chunk * _kernels.SCAN_CHUNK : (chunk + 1) * _kernels.SCAN_CHUNK]
        inside = inside[inside > 0]
        if inside.size:
            at = int(inside[inside.size // 2])
            capacities |= {at, at - 1}
    for spill_capacity in sorted(capacities):
        _check_layout(cp, counts, capacity, spill_capacity)


@pytest.mark.parametrize("shape", [(0, 5), (4, 0), (0, 0)])
def test_spill_layout_of_nothing(cp, shape):
    _check_layout(cp, np.zeros(shape, dtype=np.int32), 4, 3)


def test_spill_layout_when_nothing_exceeds(cp):
    rng = np.random.default_rng(5)
    counts = rng.integers(0, 5, size=(9000, 3)).astype(np.int32)
    for spill_capacity in (0, 1, 100):
        _check_layout(cp, counts, 4, spill_capacity)


@pytest.mark.parametrize("m, n_cols", [(1, 1), (33, 7), (3000, 1000), (65, 70_000)])
def test_transposed_pattern_scan(cp, m, n_cols):
    """The pattern of a random CSR-like structure: per (column, 32-row block) counts, scanned."""
    from twellsparse._parts import TwELLParts

    rng = np.random.default_rng(m + n_cols)
    tile_n = 64
    nt = -(-n_cols // tile_n)
    dense = (rng.random((m, nt * tile_n)) < 0.03) & (np.arange(nt * tile_n) < n_cols)
    capacity = 4
    data = np.zeros((m, nt, capacity), np.float32)
    indices = np.full((m, nt, capacity), -1, np.int16)
    counts = np.zeros((m, nt), np.int32)
    spill_rows, spill_cols = [], []
    for r, c in zip(*np.nonzero(dense), strict=True):
        t = c // tile_n
        if counts[r, t] < capacity:
            data[r, t, counts[r, t]] = 1.0 + c
            indices[r, t, counts[r, t]] = c % tile_n
            counts[r, t] += 1
        else:
            spill_rows.append(r)
            spill_cols.append(c)
    spill_indptr = np.zeros(m + 1, np.int32)
    np.add.at(spill_indptr, np.asarray(spill_rows, dtype=np.int64) + 1, 1)
    spill_indptr = np.cumsum(spill_indptr).astype(np.int32)
    spill_cols_arr = np.asarray(spill_cols, dtype=np.int32)
    parts = TwELLParts(
        *(cp.asarray(a) for a in (data, indices, counts)),
        cp.asarray(spill_cols_arr.astype(np.float32) + 1),
        cp.asarray(spill_cols_arr),
        cp.asarray(spill_indptr),
    )
    t = _gpu_convert.transposed_pattern(parts, tile_n, n_cols)
    want_indptr = np.concatenate([[0], np.cumsum(dense[:, :n_cols].sum(axis=0))])
    np.testing.assert_array_equal(t.indptr.get(), want_indptr)
    nnz = int(want_indptr[-1])
    rows = t.rows[:nnz].get()
    want_rows = np.concatenate([np.flatnonzero(dense[:, c]) for c in range(n_cols)] or [np.zeros(0, int)])
    np.testing.assert_array_equal(rows, want_rows)


@pytest.mark.parametrize("m, nt, spill_rate", [(1, 1, 1.0), (7, 3, 0.5), (3000, 22, 0.01), (70_001, 1, 0.2)])
def test_entry_totals(cp, m, nt, spill_rate):
    """The pack's (entries, entries beyond capacity) pair across many chunks, from one launch."""
    rng = np.random.default_rng(m * 7 + nt)
    capacity = 8
    counts = _counts(rng, m, nt, capacity, spill_rate)
    got = cp.asnumpy(_gpu_convert.entry_totals(cp.asarray(counts), capacity))
    want = [counts.astype(np.int64).sum(), np.maximum(counts.astype(np.int64) - capacity, 0).sum()]
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int64


def test_entry_totals_of_nothing(cp):
    np.testing.assert_array_equal(cp.asnumpy(_gpu_convert.entry_totals(cp.zeros((0, 4), cp.int32), 4)), [0, 0])


def test_posted_count_reads_scaled(cp):
    """A raw int64 count posted with a scale reads back as the fraction, and a host number too;
    pop() carries the scale with the value."""
    from twellsparse._posted import PostedScalar

    posted = PostedScalar()
    totals = cp.asarray([7, 3], dtype=cp.int64)
    posted.post(totals[0], scale=0.5)
    totals.fill(-1)  # queued after the copy: the posted value is the one that stood before
    assert posted.value() == 3.5
    posted.post(cp.asarray(5.0), scale=2.0)
    popped = posted.pop()
    assert posted.value() is None and popped.take() == 10.0
    posted.post(4, scale=0.25)
    assert posted.value() == 1.0


def test_posted_latest_never_waits(cp):
    """latest() gives the value before one whose copy is still queued (behind a spin kernel),
    and the new one once it has landed."""
    from twellsparse._posted import PostedScalar

    posted = PostedScalar()
    assert posted.latest() is None
    posted.post(cp.asarray(2.0))
    cp.cuda.Device().synchronize()
    assert posted.latest() == 2.0
    _kernels.get_kernel("twell_spin")((1,), (1,), (np.int64(200_000_000),))  # 0.2 s
    posted.post(cp.asarray(3.0))
    assert posted.latest() == 2.0  # still queued: the previous value, no wait
    cp.cuda.Device().synchronize()
    assert posted.latest() == 3.0
