"""Exact conversions between TwELL and dense / scipy.sparse / ELLPACK data, with their edge cases
(CPU only): empty matrices, capacity overflow policies, partial tiles, N > 65536, odd memory
layouts, special values and every value dtype."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from helpers import DTYPE_IDS, DTYPES, SHAPE, assert_bit_equal, bits, random_dense

import twellsparse as ts
from twellsparse import TwELLCapacityError, TwELLDroppedEntriesWarning, from_dense, from_ell, twell_array

# ----------------------------------------------------------------------------- helpers


def assert_unchanged(array, copy):
    assert array.shape == copy.shape and array.dtype == copy.dtype
    np.testing.assert_array_equal(bits(array), bits(copy))


def assert_valid(a):
    a.check_format(full_check=True)
    assert a.has_canonical_format
    counts = a.counts
    assert (counts <= a.capacity).all()
    used = np.arange(a.capacity) < counts[..., None]
    assert (a.indices[~used] == -1).all()


def canonical_csr(m):
    c = sp.csr_array(m, copy=True)
    c.sum_duplicates()
    c.sort_indices()
    return c


def assert_csr_equal(actual, expected):
    """Exact equality of two CSR matrices (canonical structure, bit-exact values)."""
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual.indptr, expected.indptr)
    np.testing.assert_array_equal(actual.indices, expected.indices)
    assert actual.data.dtype == expected.data.dtype
    np.testing.assert_array_equal(bits(actual.data), bits(expected.data))


def sparse_snapshot(m):
    if m.format == "coo":
        return [m.row.copy(), m.col.copy(), m.data.copy()]
    return [m.indptr.copy(), m.indices.copy(), m.data.copy()]


def assert_sparse_unchanged(m, snap):
    now = [m.row, m.col, m.data] if m.format == "coo" else [m.indptr, m.indices, m.data]
    for a, b in zip(now, snap, strict=True):
        assert_unchanged(a, b)


def keep_smallest(dense, tile_n, capacity):
    """Dense matrix with only the ``capacity`` smallest-column nonzeros of every row-tile."""
    out = np.zeros_like(dense)
    m, n = dense.shape
    for i in range(m):
        for t0 in range(0, n, tile_n):
            cols = t0 + np.flatnonzero(dense[i, t0 : t0 + tile_n] != 0)[:capacity]
            out[i, cols] = dense[i, cols]
    return out


def tile_counts(dense, tile_n):
    m, n = dense.shape
    nt = -(-n // tile_n)
    padded = np.zeros((m, nt * tile_n), bool)
    padded[:, :n] = dense != 0
    return padded.reshape(m, nt, tile_n).sum(axis=2)


# ----------------------------------------------------------------------------- dense <-> TwELL


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("density", [0.01, 0.1, 0.3])
def test_dense_round_trip(rng, dtype, density):
    x = random_dense(rng, SHAPE, density=density, dtype=dtype)
    x0 = x.copy()
    for a in (twell_array(x, tile_n=32, capacity=2), from_dense(x, tile_n=64, capacity=3), twell_array(x)):
        assert_valid(a)
        assert a.dtype == dtype
        assert a.nnz == np.count_nonzero(x)
        assert_bit_equal(a.toarray(), x)
        assert_bit_equal(a.todense(), x)
    assert_unchanged(x, x0)


def test_from_dense_matches_constructor(rng):
    x = random_dense(rng, SHAPE, density=0.2)
    a = from_dense(x, tile_n=128, capacity=5)
    b = twell_array(x, tile_n=128, capacity=5)
    for pa, pb in zip(a.parts, b.parts, strict=True):
        assert pa.dtype == pb.dtype
        np.testing.assert_array_equal(bits(pa), bits(pb))


def test_toarray_order_and_out(rng):
    x = random_dense(rng, SHAPE, density=0.2)
    a = twell_array(x, tile_n=32, capacity=2)
    f = a.toarray(order="F")
    assert f.flags.f_contiguous
    assert_bit_equal(np.ascontiguousarray(f), x)
    out = np.full(SHAPE, 5.0, np.float32)
    res = a.toarray(out=out)
    assert res is out
    assert_bit_equal(out, x)
    with pytest.raises(ValueError):
        a.toarray(out=np.zeros(SHAPE, np.float64))


def test_list_input(rng):
    x = random_dense(rng, (5, 40), density=0.3, dtype=np.float64)
    a = twell_array(x.tolist(), tile_n=32, capacity=2)
    assert_bit_equal(a.toarray(), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["fortran", "strided", "reversed", "transposed"])
def test_non_contiguous_inputs(rng, dtype, layout):
    if layout == "transposed":
        base = random_dense(rng, (SHAPE[1], SHAPE[0]), density=0.2, dtype=dtype)
        x = base.T
    else:
        base = random_dense(rng, (2 * SHAPE[0], 3 * SHAPE[1]), density=0.2, dtype=dtype)
        if layout == "fortran":
            x = np.asfortranarray(base[: SHAPE[0], : SHAPE[1]])
        elif layout == "strided":
            x = base[::2, ::3]
        else:
            x = base[::-2, ::-3]
    assert x.shape == SHAPE
    assert not x.flags.c_contiguous
    x_copy = x.copy()
    base_copy = base.copy()
    expected = np.ascontiguousarray(x)
    above = np.where(np.abs(expected.astype(np.float64)) > 0.5, expected, np.zeros_like(expected))
    builds = [
        (twell_array(x, tile_n=32, capacity=3), expected),
        (from_dense(x, tile_n=32, capacity=3), expected),
        (from_dense(x, tile_n=32, capacity=3, threshold=0.5), above),
    ]
    for a, want in builds:
        assert_valid(a)
        assert_bit_equal(a.toarray(), want)
    assert_unchanged(x, x_copy)
    assert_unchanged(base, base_copy)


# ----------------------------------------------------------------------------- threshold


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("threshold", [0.0, 0.25, 0.5, 1.0, 2.0])
def test_from_dense_threshold_keeps_exactly_above(rng, dtype, threshold):
    x = random_dense(rng, SHAPE, density=0.3, dtype=dtype)
    # values sitting exactly on the threshold (representable in every dtype) must go
    x[0, :5] = np.array([threshold, -threshold, threshold, -threshold, threshold]).astype(dtype)
    x[1, 0], x[1, 1], x[1, 2], x[1, 3] = np.nan, np.inf, -np.inf, -0.0
    x0 = x.copy()
    a = from_dense(x, threshold=threshold, tile_n=32, capacity=4)
    assert_valid(a)
    keep = np.abs(x.astype(np.float64)) > threshold
    assert not keep[0, :5].any()
    expected = np.where(keep, x, np.zeros_like(x))
    assert_bit_equal(a.toarray(), expected)
    assert a.nnz == int(keep.sum())
    assert not np.isnan(a.toarray()).any()  # NaN is not above any threshold
    assert np.isposinf(a.toarray()[1, 1]) and np.isneginf(a.toarray()[1, 2])
    assert_unchanged(x, x0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_from_dense_threshold_not_representable_in_dtype(dtype):
    # A threshold between two neighbouring values of the matrix's dtype: |x| > t must be decided
    # on the exact values, not after rounding the threshold to the dtype.
    v = np.array([0.1, 1.3, 300.0]).astype(dtype)
    for value in v:
        exact = float(value)
        below = float(np.nextafter(exact, 0.0))  # a float64 just under the value
        above = float(np.nextafter(exact, np.inf))  # a float64 just over it
        x = np.array([[value, -value, 0]], dtype=dtype)
        kept = from_dense(x, threshold=below, tile_n=32)
        assert kept.nnz == 2, f"{dtype.name} value {exact!r} is above threshold {below!r} but was dropped"
        assert_bit_equal(kept.toarray(), x)
        dropped = from_dense(x, threshold=above, tile_n=32)
        assert dropped.nnz == 0, f"{dtype.name} value {exact!r} is below threshold {above!r} but was kept"


def test_threshold_none_and_zero(rng):
    x = random_dense(rng, SHAPE, density=0.2)
    x[3, 3] = np.nan
    a = from_dense(x, tile_n=32)
    b = from_dense(x, tile_n=32, threshold=0.0)
    assert a.nnz == np.count_nonzero(x)
    assert b.nnz == a.nnz - 1  # only the NaN differs
    assert np.isnan(a.toarray()[3, 3]) and b.toarray()[3, 3] == 0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_threshold_invalid(bad):
    with pytest.raises(ValueError):
        from_dense(np.ones((2, 2), np.float32), threshold=bad)


# ----------------------------------------------------------------------------- scipy.sparse -> TwELL


SCIPY_KINDS = [
    ("csr", sp.csr_array),
    ("csr", sp.csr_matrix),
    ("csc", sp.csc_array),
    ("csc", sp.csc_matrix),
    ("coo", sp.coo_array),
    ("coo", sp.coo_matrix),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fmt,ctor", SCIPY_KINDS, ids=[f"{c.__name__}" for _, c in SCIPY_KINDS])
def test_scipy_round_trip(rng, fmt, ctor, dtype):
    x = random_dense(rng, SHAPE, density=0.2, dtype=dtype)
    m = ctor(x)
    assert m.format == fmt
    snap = sparse_snapshot(m)
    a = twell_array(m, tile_n=32, capacity=2)
    assert_valid(a)
    assert a.dtype == dtype
    assert a.nnz == m.nnz
    assert_bit_equal(a.toarray(), x)
    ref = canonical_csr(m)
    c = a.tocsr()
    assert isinstance(c, sp.csr_array)
    assert c.has_sorted_indices
    assert_csr_equal(c, ref)
    coo = a.tocoo()
    assert coo.format == "coo"
    ref_coo = ref.tocoo()
    np.testing.assert_array_equal(coo.row, ref_coo.row)
    np.testing.assert_array_equal(coo.col, ref_coo.col)
    np.testing.assert_array_equal(bits(coo.data), bits(ref_coo.data))
    assert_bit_equal(coo.toarray(), x)
    assert_sparse_unchanged(m, snap)


@pytest.mark.parametrize("fmt", ["csc", "coo", "lil", "dok", "bsr"])
def test_asformat(rng, fmt):
    x = random_dense(rng, SHAPE, density=0.1, dtype=np.float64)
    a = twell_array(x, tile_n=32, capacity=2)
    out = a.asformat(fmt)
    assert out.format == fmt
    np.testing.assert_array_equal(out.toarray(), x)
    assert a.asformat("twell") is a
    assert a.asformat("csr").format == "csr"


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), ts.bfloat16], ids=["float16", "bfloat16"])
def test_scipy_to_16bit(rng, dtype):
    x = random_dense(rng, SHAPE, density=0.2, dtype=np.float32)
    m = sp.csr_array(x)
    a = twell_array(m, tile_n=64, capacity=3, dtype=dtype)
    assert_valid(a)
    assert a.dtype == dtype
    expected = x.astype(dtype)
    assert_bit_equal(a.toarray(), expected)
    # scipy.sparse holds no 16-bit values: float32 (exact) with a warning, and a usable matrix
    with pytest.warns(ts.TwELLFallbackWarning, match="float32 values"):
        c = a.tocsr()
    assert c.data.dtype == np.float32
    np.testing.assert_array_equal(c.indptr, m.indptr)
    np.testing.assert_array_equal(c.indices, m.indices)
    np.testing.assert_array_equal(bits(c.data.astype(dtype)), bits(m.data.astype(dtype)))
    assert_bit_equal(c.toarray().astype(dtype), expected)
    back = twell_array(c, tile_n=64, capacity=3, dtype=dtype)  # the round trip
    assert_bit_equal(back.toarray(), expected)
    with pytest.warns(ts.TwELLFallbackWarning):
        assert a.tocoo().dtype == np.float32
    t = a.T.asformat("twell")  # the real transpose keeps the dtype (no scipy detour)
    assert t.dtype == dtype
    assert_bit_equal(t.toarray(), expected.T.copy())


def test_scipy_noncanonical_csr_sums_duplicates_and_is_untouched(rng):
    m_rows, n = 9, 70
    indptr = np.array([0, 3, 3, 6, 8, 8, 9, 12, 12, 14])
    indices = np.array([5, 2, 5, 40, 1, 69, 3, 3, 0, 64, 33, 32, 7, 6])
    data = rng.uniform(1, 2, indices.size)
    m = sp.csr_array((data, indices, indptr), shape=(m_rows, n))
    assert not m.has_canonical_format
    snap = sparse_snapshot(m)
    a = twell_array(m, tile_n=32, capacity=1)
    assert_valid(a)
    ref = canonical_csr(m)
    assert a.nnz == ref.nnz == 12
    assert_csr_equal(a.tocsr(), ref)
    np.testing.assert_array_equal(a.toarray(), m.toarray())
    assert_sparse_unchanged(m, snap)
    assert not m.has_sorted_indices


def test_scipy_coo_duplicates(rng):
    rows = np.array([0, 0, 2, 2, 2, 1])
    cols = np.array([3, 3, 100, 0, 100, 50])
    vals = np.array([1.0, 2.0, 3.0, 4.0, -3.0, 5.0])
    m = sp.coo_array((vals, (rows, cols)), shape=(3, 101))
    snap = sparse_snapshot(m)
    a = twell_array(m, tile_n=32, capacity=1)
    ref = canonical_csr(m)
    assert_csr_equal(a.tocsr(), ref)  # the cancelling pair stays an explicit zero, as in scipy
    assert a.nnz == ref.nnz == 4
    assert_sparse_unchanged(m, snap)


def test_scipy_explicit_zeros_are_stored(rng):
    x = random_dense(rng, SHAPE, density=0.2, dtype=np.float64)
    m = sp.csr_array(x)
    m.data[::3] = 0.0
    m.data[1::3] = -0.0
    a = twell_array(m, tile_n=32, capacity=2)
    assert a.nnz == m.nnz
    assert_csr_equal(a.tocsr(), m)  # the signs of the stored zeros survive, bit for bit
    np.testing.assert_array_equal(a.toarray(), m.toarray())


def test_scipy_integer_input_rejected():
    with pytest.raises(TypeError):
        twell_array(sp.csr_array(np.eye(3, dtype=np.int64)))


# ----------------------------------------------------------------------------- ELLPACK


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_toell_from_ell_round_trip(rng, dtype):
    x = random_dense(rng, SHAPE, density=0.1, dtype=dtype)
    x[5] = 0  # an empty row
    a = twell_array(x, tile_n=32, capacity=2)
    vals, idx = a.toell()
    width = int((x != 0).sum(axis=1).max())
    assert vals.shape == idx.shape == (SHAPE[0], width)
    assert vals.dtype == dtype and idx.dtype == np.int32
    row_nnz = (x != 0).sum(axis=1)
    for i in range(SHAPE[0]):
        k = row_nnz[i]
        cols = np.flatnonzero(x[i])
        np.testing.assert_array_equal(idx[i, :k], cols)
        np.testing.assert_array_equal(idx[i, k:], -1)
        assert_bit_equal(vals[i, :k], x[i, cols])
        assert (bits(vals[i, k:]) == 0).all()
    vals0, idx0 = vals.copy(), idx.copy()
    b = from_ell(vals, idx, shape=SHAPE, tile_n=64, capacity=3)
    assert_valid(b)
    assert b.dtype == dtype
    assert_bit_equal(b.toarray(), x)
    assert_unchanged(vals, vals0)
    assert_unchanged(idx, idx0)


def test_toell_width(rng):
    x = random_dense(rng, SHAPE, density=0.1)
    a = twell_array(x, tile_n=32, capacity=2)
    need = int((x != 0).sum(axis=1).max())
    vals, idx = a.toell(width=need + 4)
    assert vals.shape == (SHAPE[0], need + 4)
    assert (idx[:, need:] == -1).all()
    v2, i2 = a.toell(width=need)
    v_def, i_def = a.toell()
    np.testing.assert_array_equal(i2, i_def)
    assert_bit_equal(v2, v_def)
    with pytest.raises(ValueError):
        a.toell(width=need - 1)
    b = from_ell(vals, idx, shape=SHAPE, tile_n=32)
    assert_bit_equal(b.toarray(), x)


def test_from_ell_unsorted_columns_and_default_shape(rng):
    m, n, k = 11, 203, 9
    idx = np.full((m, k), -1, np.int64)
    vals = np.zeros((m, k), np.float64)
    expected = np.zeros((m, n))
    for i in range(1, m):
        r = rng.integers(0, k + 1)
        cols = rng.choice(n - 1, size=r, replace=False)  # unsorted, all below n - 1
        idx[i, :r] = cols
        vals[i, :r] = rng.uniform(1, 2, r)
        expected[i, cols] = vals[i, :r]
    idx[0, :3], vals[0, :3] = [n - 1, 4, 0], [9.0, 8.0, 7.0]  # the largest index fixes the default N
    expected[0, [n - 1, 4, 0]] = [9.0, 8.0, 7.0]
    snap = (idx.copy(), vals.copy())
    a = from_ell(vals, idx, tile_n=32, capacity=2)
    assert a.shape == (m, n)
    assert_valid(a)
    assert_bit_equal(a.toarray(), expected)
    assert_unchanged(idx, snap[0])
    assert_unchanged(vals, snap[1])
    _, i = a.toell()
    for r in range(m):  # toell lists each row's columns in increasing order
        cols = i[r][i[r] >= 0]
        np.testing.assert_array_equal(cols, np.flatnonzero(expected[r]))


@pytest.mark.parametrize(
    "idx,msg",
    [
        ([[0, -1, 2]], "padding"),
        ([[0, 0, -1]], "distinct"),
        ([[0, 40, -1]], "column"),
        ([[-2, -1, -1]], "column"),
    ],
)
def test_from_ell_invalid(idx, msg):
    idx = np.array(idx)
    vals = np.ones(idx.shape, np.float32)
    with pytest.raises(ValueError, match=msg):
        from_ell(vals, idx, shape=(1, 40), tile_n=32)


def test_from_ell_shape_mismatch():
    with pytest.raises(ValueError):
        from_ell(np.ones((2, 3)), np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError):
        from_ell(np.ones((2, 1)), np.zeros((2, 1), np.int32), shape=(3, 5))


# ----------------------------------------------------------------------------- empty matrices


@pytest.mark.parametrize("shape", [(0, 301), (37, 0), (0, 0)])
def test_empty_matrix(shape):
    m, n = shape
    x = np.zeros(shape, np.float32)
    candidates = [
        twell_array(x, tile_n=32, capacity=2),
        from_dense(x, tile_n=32),
        from_dense(x, threshold=0.5),
        twell_array(sp.csr_array(x)),
        twell_array(sp.coo_matrix(x)),
        twell_array(shape),
        from_ell(np.zeros((m, 0), np.float32), np.zeros((m, 0), np.int32), shape=shape),
    ]
    for a in candidates:
        assert a.shape == shape
        assert a.nnz == 0 and a.n_spilled == 0
        assert_valid(a)
        assert a.data.shape[:2] == (m, -(-n // a.tile_n))
        out = a.toarray()
        assert out.shape == shape
        c = a.tocsr()
        assert c.shape == shape and c.nnz == 0
        assert a.tocoo().nnz == 0
        vals, idx = a.toell()
        assert vals.shape == idx.shape == (m, 0)
        vals, idx = a.toell(width=3)
        assert vals.shape == (m, 3) and (idx == -1).all()
        b = twell_array(a, tile_n=64, capacity=1)
        assert b.shape == shape and b.nnz == 0
        p = twell_array(a.parts, shape=shape, tile_n=a.tile_n)
        assert p.shape == shape and p.nnz == 0


def test_from_ell_default_shape_all_padding():
    a = from_ell(np.zeros((4, 3)), np.full((4, 3), -1))
    assert a.shape == (4, 0)
    assert a.nnz == 0


def test_shape_tuple_constructor():
    a = twell_array((5, 70), tile_n=32, capacity=3, dtype=np.float16)
    assert a.shape == (5, 70) and a.dtype == np.float16 and a.nnz == 0
    assert_valid(a)
    assert_bit_equal(a.toarray(), np.zeros((5, 70), np.float16))
    assert twell_array((5, 70)).dtype == np.float64


# ----------------------------------------------------------------------------- empty rows / zero tiles


def test_empty_rows(rng):
    x = random_dense(rng, SHAPE, density=0.2)
    empty = [0, 7, 8, 36]
    x[empty] = 0
    a = twell_array(x, tile_n=32, capacity=2)
    assert_valid(a)
    assert (a.counts[empty] == 0).all()
    assert (a.indices[empty] == -1).all()
    assert (np.diff(a.spill_indptr)[empty] == 0).all()
    assert_bit_equal(a.toarray(), x)
    _, idx = a.toell()
    assert (idx[empty] == -1).all()
    assert_csr_equal(a.tocsr(), sp.csr_array(x))


def test_all_zero_tiles(rng):
    x = random_dense(rng, SHAPE, density=0.3)
    x[:, 64:128] = 0  # tiles 2 and 3 of tile_n 32
    x[:, 288:] = 0  # the partial last tile
    a = twell_array(x, tile_n=32, capacity=3)
    assert_valid(a)
    assert (a.counts[:, [2, 3, 9]] == 0).all()
    assert (a.indices[:, [2, 3, 9]] == -1).all()
    assert (bits(a.data[:, [2, 3, 9]]) == 0).all()
    assert not ((a.spill_indices >= 64) & (a.spill_indices < 128)).any()
    assert_bit_equal(a.toarray(), x)


# ----------------------------------------------------------------------------- overflow policies


def _overflow_matrix(rng, extra):
    """(5, 100) float32 matrix, tile_n 32, capacity 4: row 2 tile 1 holds ``4 + extra`` nonzeros,
    every other row-tile at most 4."""
    x = np.zeros((5, 100), np.float32)
    for i in range(5):
        for t0 in range(0, 100, 32):
            width = min(32, 100 - t0)
            k = rng.integers(0, min(4, width) + 1)
            cols = t0 + rng.choice(width, k, replace=False)
            x[i, cols] = rng.uniform(1, 2, k)
    x[2, 32:64] = 0
    cols = 32 + rng.choice(32, 4 + extra, replace=False)
    x[2, cols] = rng.uniform(1, 2, cols.size)
    return x


def _builders(x, **kw):
    """Callables building the same matrix (tile_n 32, capacity 4) through every constructor path."""
    vals, idx = twell_array(x, tile_n=32, capacity=32).toell()
    wide = twell_array(x, tile_n=64, capacity=64)
    return [
        lambda: twell_array(x, tile_n=32, capacity=4, **kw),
        lambda: from_dense(x, tile_n=32, capacity=4, **kw),
        lambda: twell_array(sp.csr_array(x), tile_n=32, capacity=4, **kw),
        lambda: twell_array(sp.csc_matrix(x), tile_n=32, capacity=4, **kw),
        lambda: from_ell(vals, idx, shape=x.shape, tile_n=32, capacity=4, **kw),
        lambda: twell_array(wide, tile_n=32, capacity=4, **kw),
    ]


@pytest.mark.parametrize("overflow", ["spill", "error", "drop"])
def test_exactly_capacity_fits_under_every_policy(rng, overflow):
    x = _overflow_matrix(rng, extra=0)
    assert tile_counts(x, 32).max() == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for build in _builders(x, overflow=overflow):
            a = build()
            assert_valid(a)
            assert a.n_spilled == 0 and a.n_dropped == 0
            assert a.counts[2, 1] == 4
            assert_bit_equal(a.toarray(), x)


def test_capacity_plus_one_spill(rng):
    x = _overflow_matrix(rng, extra=1)
    largest = 32 + np.flatnonzero(x[2, 32:64]).max()
    for build in _builders(x, overflow="spill"):
        a = build()
        assert_valid(a)
        assert a.n_spilled == 1 and a.n_dropped == 0
        np.testing.assert_array_equal(a.spill_indices, [largest])
        np.testing.assert_array_equal(a.spill_indptr, [0, 0, 0, 1, 1, 1])
        assert_bit_equal(a.spill_data, x[2, [largest]])
        assert_bit_equal(a.toarray(), x)
        assert a.nnz == np.count_nonzero(x)


def test_default_overflow_is_spill(rng):
    x = _overflow_matrix(rng, extra=3)
    a = twell_array(x, tile_n=32, capacity=4)
    assert a.n_spilled == 3
    assert_bit_equal(a.toarray(), x)


@pytest.mark.parametrize("extra", [1, 5])
def test_capacity_plus_one_error(rng, extra):
    x = _overflow_matrix(rng, extra=extra)
    x0 = x.copy()
    for build in _builders(x, overflow="error"):
        with pytest.raises(TwELLCapacityError) as info:
            build()
        e = info.value
        assert isinstance(e, ValueError)
        assert (e.row, e.tile, e.count, e.capacity, e.n_overflowing) == (2, 1, 4 + extra, 4, 1)
        msg = str(e)
        assert "\n" not in msg
        assert "row 2" in msg and "tile 1" in msg and str(4 + extra) in msg
    assert_unchanged(x, x0)


def test_error_names_worst_row_tile(rng):
    x = np.zeros((6, 200), np.float64)
    x[0, 0:6] = 1  # 6 in (0, 0)
    x[1, 100:109] = 2  # 9 in (1, 3): the worst
    x[4, 130:135] = 3  # 5 in (4, 4)
    x[5, 192:200] = 4  # 8 in (5, 6), the partial tile
    x[3, 64:68] = 5  # exactly the capacity: not overflowing
    with pytest.raises(TwELLCapacityError) as info:
        twell_array(x, tile_n=32, capacity=4, overflow="error")
    e = info.value
    assert (e.row, e.tile, e.count, e.capacity, e.n_overflowing) == (1, 3, 9, 4, 4)
    assert "\n" not in str(e)


def test_error_ties_name_first_row_tile():
    x = np.zeros((4, 96), np.float32)
    x[3, 0:7] = 1
    x[1, 70:77] = 1
    x[1, 32:39] = 1
    with pytest.raises(TwELLCapacityError) as info:
        from_dense(x, tile_n=32, capacity=4, overflow="error")
    assert (info.value.row, info.value.tile, info.value.count, info.value.n_overflowing) == (1, 1, 7, 3)


@pytest.mark.parametrize("extra", [1, 6])
def test_capacity_plus_one_drop(rng, extra):
    x = _overflow_matrix(rng, extra=extra)
    expected = keep_smallest(x, 32, 4)
    assert np.count_nonzero(x) - np.count_nonzero(expected) == extra
    for build in _builders(x, overflow="drop"):
        with pytest.warns(TwELLDroppedEntriesWarning):
            a = build()
        assert_valid(a)
        assert a.n_dropped == extra
        assert a.n_spilled == 0
        assert a.nnz == np.count_nonzero(expected)
        assert_bit_equal(a.toarray(), expected)


@pytest.mark.parametrize("capacity", [1, 3])
def test_drop_keeps_smallest_columns_random(rng, capacity):
    x = random_dense(rng, SHAPE, density=0.3, dtype=np.float64)
    x0 = x.copy()
    expected = keep_smallest(x, 32, capacity)
    n_drop = np.count_nonzero(x) - np.count_nonzero(expected)
    assert n_drop > 0
    with pytest.warns(TwELLDroppedEntriesWarning, match=str(n_drop)):
        a = from_dense(x, tile_n=32, capacity=capacity, overflow="drop")
    assert a.n_dropped == n_drop
    assert_valid(a)
    assert_bit_equal(a.toarray(), expected)
    with pytest.warns(TwELLDroppedEntriesWarning):
        b = twell_array(sp.csr_array(x), tile_n=32, capacity=capacity, overflow="drop")
    assert b.n_dropped == n_drop
    assert_bit_equal(b.toarray(), expected)
    assert_unchanged(x, x0)


def test_spill_random_is_exact(rng):
    x = random_dense(rng, SHAPE, density=0.3, dtype=np.float64)
    a = twell_array(x, tile_n=32, capacity=2)
    assert a.n_spilled == int(np.maximum(tile_counts(x, 32) - 2, 0).sum()) > 0
    assert_bit_equal(a.toarray(), x)
    assert_csr_equal(a.tocsr(), sp.csr_array(x))


def test_invalid_overflow_policy():
    with pytest.raises(ValueError):
        twell_array(np.ones((2, 2)), overflow="wrap")


# ----------------------------------------------------------------------------- partial tiles


@pytest.mark.parametrize("n", [1, 31, 33, 100, 301, 1000, 1025, 2047])
@pytest.mark.parametrize("tile_n", [32, 256, 1024])
def test_n_not_multiple_of_tile(rng, n, tile_n):
    x = random_dense(rng, (13, n), density=0.2)
    x[:, -1] = 1.5  # an entry in the very last column
    a = twell_array(x, tile_n=tile_n, capacity=2)
    nt = -(-n // tile_n)
    assert a.n_tiles == nt and a.data.shape == (13, nt, 2)
    assert_valid(a)
    last_width = n - (nt - 1) * tile_n
    used = np.arange(2) < a.counts[:, -1, None]
    assert (a.indices[:, -1][used] < last_width).all()
    assert_bit_equal(a.toarray(), x)
    assert_csr_equal(a.tocsr(), sp.csr_array(x))


# ----------------------------------------------------------------------------- N > 65536


def _wide_matrix():
    x = np.zeros((3, 70000), np.float32)
    x[0, [0, 65535, 65536, 65537, 69999]] = [1, 2, 3, 4, 5]
    x[1, [1023, 1024, 66000, 66001, 66002]] = [-1, -2, -3, -4, -5]
    x[2, 68000] = 7
    return x


@pytest.mark.parametrize("tile_n,capacity", [(32, 1), (1024, 1), (1024, None), (256, 2)])
def test_wide_matrix_beyond_int16(tile_n, capacity):
    x = _wide_matrix()
    x0 = x.copy()
    ref = sp.csr_array(x)
    vals, idx = ref_ell = (np.zeros((3, 5), np.float32), np.full((3, 5), -1, np.int32))
    for i in range(3):
        cols = np.flatnonzero(x[i])
        idx[i, : cols.size] = cols
        vals[i, : cols.size] = x[i, cols]
    builds = [
        twell_array(x, tile_n=tile_n, capacity=capacity),
        from_dense(x, tile_n=tile_n, capacity=capacity),
        twell_array(ref, tile_n=tile_n, capacity=capacity),
        twell_array(sp.coo_matrix(x), tile_n=tile_n, capacity=capacity),
        from_ell(*ref_ell, shape=x.shape, tile_n=tile_n, capacity=capacity),
        from_ell(*ref_ell, tile_n=tile_n, capacity=capacity),  # N from the largest index + 1
    ]
    for a in builds:
        assert a.shape == x.shape
        assert_valid(a)
        assert a.nnz == 11
        assert_bit_equal(a.toarray(), x)
        assert_csr_equal(a.tocsr(), ref)
        assert a.tocsr().indices.max() == 69999
        v, i = a.toell()
        np.testing.assert_array_equal(i, idx)
        assert_bit_equal(v, vals)
    if capacity == 1 and tile_n == 1024:
        a = builds[0]
        # tile 64 holds 65536, 65537 in row 0 and 66000..66002 in row 1: 3 spill, all above 65536
        assert a.n_spilled == 3
        np.testing.assert_array_equal(a.spill_indices, [65537, 66001, 66002])
    assert_unchanged(x, x0)


def test_wide_matrix_retile():
    x = _wide_matrix()
    a = twell_array(x, tile_n=32, capacity=1)
    b = twell_array(a, tile_n=1024, capacity=2)
    assert_valid(b)
    assert_bit_equal(b.toarray(), x)


# ----------------------------------------------------------------------------- special values


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nan_inf_negative_zero(rng, dtype):
    x = random_dense(rng, SHAPE, density=0.1, dtype=dtype)
    specials = {(0, 0): np.nan, (0, 1): np.inf, (0, 2): -np.inf, (0, 3): -0.0, (4, 300): -0.0, (5, 200): np.nan}
    for (i, j), v in specials.items():
        x[i, j] = v
    x0 = x.copy()
    a = twell_array(x, tile_n=32, capacity=2)
    assert_valid(a)
    # NaN and +-Inf are stored, -0.0 is not (it compares equal to zero), like scipy
    assert a.nnz == np.count_nonzero(x) == sp.csr_array(x.astype(np.float32)).nnz
    out = a.toarray()
    assert np.isnan(out[0, 0]) and np.isnan(out[5, 200])
    assert np.isposinf(out[0, 1]) and np.isneginf(out[0, 2])
    assert bits(out)[0, 3] == 0 and bits(out)[4, 300] == 0  # +0.0, not -0.0
    expected = np.where(x == 0, np.zeros_like(x), x)  # -0.0 -> +0.0, NaN kept
    assert_bit_equal(out, expected)
    nan_bits = bits(x)[0, 0]
    assert bits(out)[0, 0] == nan_bits  # the NaN's payload is preserved
    assert_unchanged(x, x0)
    c = a.tocsr()
    assert c.nnz == a.nnz
    with pytest.warns(TwELLDroppedEntriesWarning):
        d = from_dense(x, tile_n=32, capacity=1, overflow="drop")
    assert np.isnan(d.toarray()[0, 0])


def test_negative_zero_from_scipy_is_an_explicit_entry():
    m = sp.csr_array((np.array([-0.0, 1.0]), np.array([2, 5]), np.array([0, 2])), shape=(1, 40))
    a = twell_array(m, tile_n=32, capacity=1)
    assert a.nnz == 2 and a.n_spilled == 1
    out = a.toarray()
    assert bits(out)[0, 2] == bits(np.array(-0.0))[()]
    assert_csr_equal(a.tocsr(), m)


# ----------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dst", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("src", DTYPES, ids=DTYPE_IDS)
def test_constructor_dtype_conversion(rng, src, dst):
    x = random_dense(rng, SHAPE, density=0.15, dtype=src)
    x0 = x.copy()
    a = twell_array(x, tile_n=64, capacity=4, dtype=dst)
    assert a.dtype == dst
    assert_valid(a)
    assert_bit_equal(a.toarray(), x.astype(dst))
    assert_unchanged(x, x0)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64])
def test_unsupported_dtypes_rejected(dtype):
    x = np.ones((3, 40), dtype=dtype)
    with pytest.raises(TypeError):
        twell_array(x)
    with pytest.raises(TypeError):
        from_dense(x)


def test_bfloat16_dense_round_trip_exact(rng):
    # every bfloat16 bit pattern of finite nonzero values in a small range, exactly
    raw = np.arange(0x3F80, 0x4000, dtype=np.uint16)  # [1, 2)
    vals = np.concatenate([raw, raw | 0x8000]).view(ts.bfloat16)
    x = np.zeros((4, vals.size), ts.bfloat16)
    x[1] = vals
    x[3, ::7] = vals[::7]
    a = from_dense(x, tile_n=64, capacity=8)
    assert_valid(a)
    assert a.nnz == np.count_nonzero(x)
    assert_bit_equal(a.toarray(), x)
    v, i = a.toell()
    b = from_ell(v, i, shape=x.shape, tile_n=32)
    assert_bit_equal(b.toarray(), x)
