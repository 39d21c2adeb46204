"""The transposed products with their long rows cut into runs (twell_segment_plan in
cuda/twell_convert.cu, twell_gather_csr_spmm's runs in cuda/twell_gather.cu) against the float64
reference: the plan equals its NumPy oracle, cut rows sum right in every dtype, single and
paired, with spill and several column passes, under every column split, and repeat bit for bit;
rows that are not cut keep the bits of the plain kernel."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import product_bound, row_pointers

import twellsparse as ts
from twellsparse import _gpu_convert, _gpu_ops
from twellsparse import _kernels as K
from twellsparse._reference import run_length_candidates, segment_plan
from twellsparse.testing import rel_error

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16, np.float32, np.float64]


def _hot_units(rng, m, n, density, hot, dtype, hot_rates=None):
    """m tokens x n units at `density`, except `hot` units spread over the columns that fire for
    60-95% of the tokens (rows of A.T far longer than one run of 256 from 700 tokens on), or at
    `hot_rates`; one token fires nowhere."""
    rates = np.full(n, density)
    rates[rng.choice(n, hot, replace=False)] = rng.uniform(0.6, 0.95, hot) if hot_rates is None else hot_rates
    fires = rng.random((m, n)) < rates
    h = np.where(fires, rng.standard_normal((m, n)), 0.0).astype(dtype)
    h[m // 3] = 0
    return h


# (rows, shortest run, longest row as runs of the shortest, slots, the run length the plan
# should choose): the shortest, a longer one, and none fitting (the row-order prefix).
PLANS = [
    (5000, 256, 20, 4000, "shortest"),
    (5000, 256, 6, 600, "longer"),
    (400, 300, 20, 60, "longer"),
    (3000, 1000, 60, 64, "none fits"),
]


@pytest.mark.parametrize("n_rows, shortest, longest, slots, choice", PLANS)
def test_plan_matches_the_oracle(cp, rng, n_rows, shortest, longest, slots, choice):
    long_rows = rng.random(n_rows) < 0.05
    lengths = np.where(
        long_rows, rng.integers(shortest + 1, longest * shortest, n_rows), rng.integers(0, shortest + 1, n_rows)
    )
    indptr = row_pointers(lengths)
    split_base = cp.full(n_rows, -7, dtype=cp.int32)
    slot_row = cp.full(slots, -7, dtype=cp.int32)
    run_length = cp.full(1, -7, dtype=cp.int32)
    args = (cp.asarray(indptr), np.int32(n_rows), np.int32(shortest), np.int32(slots), split_base, slot_row, run_length)
    K.launch_grid("twell_segment_plan", (1,), (K.SCAN_THREADS,), args)
    want_base, want_rows, want_length = segment_plan(indptr, shortest, slots)
    np.testing.assert_array_equal(split_base.get(), want_base)
    np.testing.assert_array_equal(slot_row.get(), want_rows)
    assert int(run_length.get()[0]) == want_length
    candidates = run_length_candidates(shortest)
    fits = np.count_nonzero(want_rows >= 0) == sum(-(-n // want_length) for n in lengths if n > want_length)
    assert {"shortest": want_length == shortest, "longer": shortest < want_length and fits}.get(
        choice, want_length == candidates[-1] and not fits
    ), (choice, want_length)
    assert np.any(want_base >= 0)


# (m, n, k, tile_n, capacity, hot): m tokens give runs of max(256, m / 32) entries; k spans
# several column passes for some variants; small capacities spill.
SHAPES = [
    (1500, 700, 2048, 256, None, 6),
    (2100, 1000, 1040, 64, 4, 9),  # heavy spill, two passes
    (700, 300, 264, 128, 2, 3),  # runs of 256 entries (the shortest), a short last run
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, hot", SHAPES)
def test_cut_rows_sum_right_and_repeat_bitwise(cp, rng, dtype, m, n, k, tile_n, capacity, hot):
    from twellsparse._ops import with_values

    h = _hot_units(rng, m, n, 0.01, hot, dtype)
    a = ts.twell_array(cp.asarray(h), tile_n=tile_n, capacity=capacity)
    a2 = with_values(a, *(cp.asarray(rng.standard_normal(v.shape).astype(dtype)) for v in (a.data, a.spill_data)))
    g = rng.standard_normal((m, k)).astype(dtype)
    gd = cp.asarray(g)
    expected = h.astype(np.float64).T @ g.astype(np.float64)
    expected2 = a2.toarray().get().astype(np.float64).T @ g.astype(np.float64)
    plain = _gpu_convert.transposed_pattern(a.parts, tile_n, n, slots=0)
    tp = _gpu_convert.transposed_pattern(a.parts, tile_n, n, slots=4 * hot * 32)
    assert plain.segments is None and tp.segments is not None
    split_base = tp.segments.split_base.get()
    assert np.count_nonzero(split_base >= 0) == hot  # every hot unit cut, no other
    base = cp.empty((n, k), dtype=dtype)
    _gpu_ops.spmm_transposed(a.parts, tile_n, n, gd, base, pattern=lambda: plain)
    whole = split_base < 0
    first: dict[bool, list] = {}  # per form, the first call's bits
    for split in (1, 2, 3):
        for paired in (False, True):
            for _ in range(2):  # a second call gives the same bits
                out, out2 = cp.full((n, k), np.nan, dtype=dtype), cp.full((n, k), np.nan, dtype=dtype)
                second = (a2.parts, out2) if paired else None
                _gpu_ops.spmm_transposed(
                    a.parts, tile_n, n, gd, out, pattern=lambda: tp, second=second, column_split=split
                )
                bits = [out.view(cp.uint8).get()] + ([out2.view(cp.uint8).get()] if paired else [])
                # The column split changes which warps sum which columns, not the sums.
                for got, want in zip(bits, first.setdefault(paired, bits), strict=True):
                    np.testing.assert_array_equal(got, want)
            assert rel_error(out, expected) <= product_bound(dtype, expected), (split, paired)
            if paired:
                assert rel_error(out2, expected2) <= product_bound(dtype, expected2), split
    # Rows that were not cut are the plain kernel's, bit for bit.
    np.testing.assert_array_equal(first[False][0].reshape(n, -1)[whole], base.view(cp.uint8).get()[whole])


def test_few_slots_lengthen_the_runs(cp, rng):
    m, n, k, tile_n = 1200, 400, 256, 128
    # ~720-1140 entries: 9 slots hold the runs of 1024 entries (the two or three rows above
    # 1024, two runs each) and of no shorter candidate.
    h = _hot_units(rng, m, n, 0.02, 8, np.float32, hot_rates=np.linspace(0.6, 0.95, 8))
    a = ts.twell_array(cp.asarray(h), tile_n=tile_n, capacity=4)
    g = rng.standard_normal((m, k)).astype(np.float32)
    tp = _gpu_convert.transposed_pattern(a.parts, tile_n, n, slots=9)
    split_base = tp.segments.split_base.get()
    lengths = np.count_nonzero(h, axis=0)
    shortest = _gpu_convert.segment_length(m)
    want_base, _, want_length = segment_plan(row_pointers(lengths), shortest, 9)
    np.testing.assert_array_equal(split_base, want_base)
    assert int(tp.segments.run_length.get()[0]) == want_length > shortest
    assert np.count_nonzero(split_base >= 0) > 0
    out = cp.empty((n, k), dtype=np.float32)
    _gpu_ops.spmm_transposed(a.parts, tile_n, n, cp.asarray(g), out, pattern=lambda: tp)
    expected = h.astype(np.float64).T @ g.astype(np.float64)
    assert rel_error(out, expected) <= product_bound(np.float32, expected)


def test_when_no_run_length_fits_a_prefix_of_the_rows_is_cut(cp, rng):
    """8192 tokens: runs of at least 256 entries, the longest tried 3072 (12 x 256) and the last
    candidate 3584. Hot units of 4900-7800 entries need two or three runs each even at 3584, so
    3 slots take the first hot row's runs and leave the rest whole, and the product is still
    right."""
    m, n, k, tile_n = 8192, 300, 64, 256
    h = _hot_units(rng, m, n, 0.005, 6, np.float32)
    a = ts.twell_array(cp.asarray(h), tile_n=tile_n, capacity=8)
    g = rng.standard_normal((m, k)).astype(np.float32)
    tp = _gpu_convert.transposed_pattern(a.parts, tile_n, n, slots=3)
    lengths = np.count_nonzero(h, axis=0)
    shortest = _gpu_convert.segment_length(m)
    want_base, want_rows, want_length = segment_plan(row_pointers(lengths), shortest, 3)
    assert want_length == run_length_candidates(shortest)[-1]
    np.testing.assert_array_equal(tp.segments.split_base.get(), want_base)
    np.testing.assert_array_equal(tp.segments.slot_row.get(), want_rows)
    assert int(tp.segments.run_length.get()[0]) == want_length
    assert np.count_nonzero(want_base >= 0) == 1
    out = cp.full((n, k), np.nan, dtype=np.float32)
    _gpu_ops.spmm_transposed(a.parts, tile_n, n, cp.asarray(g), out, pattern=lambda: tp)
    expected = h.astype(np.float64).T @ g.astype(np.float64)
    assert rel_error(out, expected) <= product_bound(np.float32, expected)


def test_a_plan_without_long_rows_changes_nothing(cp, rng):
    """Uniform 1% at 2000 tokens: no row reaches 256 entries, so the plan cuts nothing and the
    product is the plain kernel's, bit for bit, at the cost of the grid's idle slot warps."""
    m, n, k, tile_n = 2000, 900, 512, 256
    h = _hot_units(rng, m, n, 0.01, 0, ts.bfloat16)
    a = ts.twell_array(cp.asarray(h), tile_n=tile_n)
    gd = cp.asarray(rng.standard_normal((m, k)).astype(ts.bfloat16))
    tp = _gpu_convert.transposed_pattern(a.parts, tile_n, n, slots=512)
    assert np.all(tp.segments.split_base.get() == -1) and np.all(tp.segments.slot_row.get() == -1)
    plain = _gpu_convert.transposed_pattern(a.parts, tile_n, n, slots=0)
    outs = [cp.empty((n, k), dtype=ts.bfloat16) for _ in range(2)]
    for out, pattern in zip(outs, (tp, plain), strict=True):
        _gpu_ops.spmm_transposed(a.parts, tile_n, n, gd, out, pattern=lambda p=pattern: p)
    np.testing.assert_array_equal(outs[0].view(cp.uint8).get(), outs[1].view(cp.uint8).get())
