"""Property-based round trips: any shape, density, tile width, capacity and value dtype.

Conversions must be exact (bit-for-bit values, canonical structure); products must match a
float64 dense computation.
"""

from __future__ import annotations

import warnings

import numpy as np
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twellsparse as ts
from twellsparse.testing import assert_twell_equal

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TILE_NS = [32, 64, 128, 256, 512, 1024]
DTYPES = [np.float32, np.float64, np.float16]


@st.composite
def cases(draw):
    """(dense x, tile_n, capacity): x has no -0.0 and no NaN, so value equality is exact equality."""
    m = draw(st.integers(0, 40))
    n = draw(st.integers(0, 600))
    density = draw(st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.5, 1.0]) | st.floats(0.0, 1.0))
    tile_n = draw(st.sampled_from(TILE_NS))
    capacity = draw(st.integers(1, tile_n) | st.sampled_from([1, tile_n // 8, tile_n]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, n)) * 4
    x[rng.random((m, n)) >= density] = 0
    x = x.astype(dtype)
    x[x == 0] = 0  # float16 underflow can leave -0.0
    return x, tile_n, capacity


def _row_tile_counts(x, tile_n):
    m, n = x.shape
    nt = -(-n // tile_n)
    padded = np.zeros((m, nt * tile_n), dtype=bool)
    padded[:, :n] = x != 0
    return padded.reshape(m, nt, tile_n).sum(axis=2)


def _expected_csr(x):
    rows, cols = np.nonzero(x)
    indptr = np.zeros(x.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=x.shape[0]), out=indptr[1:])
    return x[rows, cols], cols, indptr


def _assert_parts_equal(a, b):
    for name in ("data", "indices", "counts", "spill_data", "spill_indices", "spill_indptr"):
        pa, pb = getattr(a, name), getattr(b, name)
        assert pa.shape == pb.shape and pa.dtype == pb.dtype, name
        np.testing.assert_array_equal(pa, pb, err_msg=name)


@SETTINGS
@given(cases())
def test_dense_roundtrip(case):
    x, tile_n, capacity = case
    a = ts.twell_array(x, tile_n=tile_n, capacity=capacity)
    assert a.shape == x.shape and a.dtype == x.dtype
    assert (a.tile_n, a.capacity) == (tile_n, capacity)
    assert a.nnz == np.count_nonzero(x)
    counts = _row_tile_counts(x, tile_n)
    assert a.n_spilled == int(np.maximum(counts - capacity, 0).sum())
    np.testing.assert_array_equal(a.counts, np.minimum(counts, capacity))
    d = a.toarray()
    assert d.dtype == x.dtype and d.shape == x.shape
    np.testing.assert_array_equal(d.view(np.uint8), x.view(np.uint8))
    a.check_format(full_check=True)
    assert a.has_canonical_format
    b = ts.from_dense(x, tile_n=tile_n, capacity=capacity)
    _assert_parts_equal(a, b)


@SETTINGS
@given(cases())
def test_tocsr_matches_scipy(case):
    x, tile_n, capacity = case
    a = ts.twell_array(x, tile_n=tile_n, capacity=capacity)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.TwELLFallbackWarning)  # 16-bit values come back as float32
        c = a.tocsr()
        coo = a.tocoo()
    wide = np.float32 if x.dtype.itemsize == 2 else x.dtype
    assert sp.issparse(c) and c.format == "csr" and c.shape == x.shape and c.dtype == wide
    data, cols, indptr = _expected_csr(x)
    np.testing.assert_array_equal(c.indptr, indptr)
    np.testing.assert_array_equal(c.indices, cols)
    np.testing.assert_array_equal(c.data, data)
    s = sp.csr_array(x.astype(wide))
    assert c.nnz == s.nnz
    np.testing.assert_array_equal(c.toarray(), s.toarray())
    np.testing.assert_array_equal(coo.toarray(), s.tocoo().toarray())
    b = ts.twell_array(s, tile_n=tile_n, capacity=capacity, dtype=x.dtype)  # the round trip
    _assert_parts_equal(a, b)


@SETTINGS
@given(cases(), st.integers(0, 3))
def test_ell_roundtrip(case, extra_width):
    x, tile_n, capacity = case
    a = ts.twell_array(x, tile_n=tile_n, capacity=capacity)
    vals, idx = a.toell()
    row_nnz = np.count_nonzero(x, axis=1)
    width = int(row_nnz.max(initial=0))
    assert vals.shape == idx.shape == (x.shape[0], width)
    assert vals.dtype == x.dtype and idx.dtype == np.int32
    np.testing.assert_array_equal((idx >= 0).sum(axis=1), row_nnz)
    b = ts.from_ell(vals, idx, shape=x.shape, tile_n=tile_n, capacity=capacity)
    np.testing.assert_array_equal(b.toarray(), x)
    _assert_parts_equal(a, b)
    # wider padding and shuffled slots within each row describe the same matrix
    vals_w, idx_w = a.toell(width=width + extra_width)
    assert idx_w.shape == (x.shape[0], width + extra_width)
    assert (idx_w[:, width:] == -1).all()
    rng = np.random.default_rng(width)
    for r in range(x.shape[0]):
        k = row_nnz[r]
        perm = rng.permutation(k)
        vals_w[r, :k], idx_w[r, :k] = vals_w[r, :k][perm], idx_w[r, :k][perm]
    c = ts.from_ell(vals_w, idx_w, shape=x.shape, tile_n=tile_n, capacity=capacity)
    _assert_parts_equal(a, c)


@SETTINGS
@given(cases())
def test_parts_constructor_roundtrip(case):
    x, tile_n, capacity = case
    a = ts.twell_array(x, tile_n=tile_n, capacity=capacity)
    b = ts.twell_array(tuple(a.parts), shape=a.shape, tile_n=tile_n)
    assert (b.tile_n, b.capacity) == (a.tile_n, a.capacity)
    assert_twell_equal(a, b)
    _assert_parts_equal(a, b)
    b.check_format(full_check=True)
    c = ts.twell_array(tuple(a.parts), shape=a.shape, tile_n=tile_n, capacity=capacity)
    assert_twell_equal(a, c)
    if a.n_spilled == 0:
        d = ts.twell_array((a.data, a.indices, a.counts), shape=a.shape, tile_n=tile_n)
        assert_twell_equal(a, d)
        _assert_parts_equal(a, d)


@SETTINGS
@given(cases(), st.integers(1, 5))
def test_matmul_vs_dense(case, k):
    x, tile_n, capacity = case
    a = ts.twell_array(x, tile_n=tile_n, capacity=capacity)
    m, n = x.shape
    rng = np.random.default_rng(m * 1000 + n)
    x64 = x.astype(np.float64)
    b, g = rng.standard_normal((n, k)), rng.standard_normal((m, k))

    def check(out, want, bound, dtype):
        assert out.shape == want.shape and out.dtype == dtype
        np.testing.assert_array_less(np.abs(out.astype(np.float64) - want), bound)

    # float64 operand: float64 result, correct to rounding
    tol64 = 1e-12 * (np.abs(x64) @ np.abs(b)) + 1e-300
    check(a @ b, x64 @ b, tol64, np.float64)
    check(ts.matmul(a.T, g), x64.T @ g, 1e-12 * (np.abs(x64.T) @ np.abs(g)) + 1e-300, np.float64)
    check(a @ b[:, 0], x64 @ b[:, 0], tol64[:, 0], np.float64)

    # same-dtype operand: result in x's dtype, within a few units of its rounding (absolute
    # rounding of results in the subnormal range: float16 reaches it easily), plus the float64
    # accumulation's own error, up to terms x 2**-53 of the absolute sum (Higham's gamma_n),
    # which a float64 x's 2 eps alone does not cover (2.4 eps seen over 37 terms)
    eps, tiny = float(np.finfo(x.dtype).eps), float(np.finfo(x.dtype).smallest_subnormal)
    rel = 2 * eps + max(m, n) * 2.0**-53
    bl, gl = b.astype(x.dtype), g.astype(x.dtype)
    want = x64 @ bl.astype(np.float64)
    check(a @ bl, want, rel * (np.abs(x64) @ np.abs(bl.astype(np.float64))) + tiny, np.dtype(x.dtype))
    want_t = x64.T @ gl.astype(np.float64)
    check(a.T @ gl, want_t, rel * (np.abs(x64.T) @ np.abs(gl.astype(np.float64))) + tiny, np.dtype(x.dtype))
