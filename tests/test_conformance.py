"""API conformance with scipy.sparse (``csr_array``) for the API the two share.

Every check builds the same random matrix as a ``twell_array`` and as a ``scipy.sparse.csr_array``
and compares the answers (densified where the result types differ).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import twellsparse as ts

# (M, N, density, tile_n, capacity): no spill, heavy spill, odd shapes, a single partial tile.
CASES = [
    (37, 301, 0.05, 32, None),
    (37, 301, 0.4, 32, 2),
    (20, 512, 0.1, 256, 4),
    (9, 70, 0.3, 1024, 1),
    (64, 33, 0.6, 64, 64),
    (1, 1, 1.0, 32, 1),
]
IDS = [f"{m}x{n}-d{d}-t{t}-c{c}" for m, n, d, t, c in CASES]


def _rtol(dtype):
    return 1e-12 if np.dtype(dtype) == np.float64 else 1e-5


def _close(actual, desired, dtype=np.float64):
    """Dense comparison, tolerance scaled to the result's magnitude (sums over many terms)."""
    actual, desired = np.asarray(actual, dtype=np.float64), np.asarray(desired, dtype=np.float64)
    assert actual.shape == desired.shape, (actual.shape, desired.shape)
    scale = max(float(np.abs(desired).max(initial=0.0)), 1.0)
    np.testing.assert_allclose(actual, desired, rtol=_rtol(dtype), atol=_rtol(dtype) * scale)


def _random(rng, m, n, density):
    x = rng.standard_normal((m, n))
    x[rng.random((m, n)) >= density] = 0
    return x


@pytest.fixture(params=CASES, ids=IDS)
def pair(request, rng):
    m, n, density, tile_n, capacity = request.param
    x = _random(rng, m, n, density)
    if not x.any():
        x[0, 0] = 1.5
    a = ts.twell_array(x, tile_n=tile_n, capacity=capacity)
    return x, a, sp.csr_array(x)


@pytest.fixture(params=[np.float64, np.float32], ids=["f64", "f32"])
def typed_pair(request, pair):
    x, _, _ = pair
    xt = x.astype(request.param)
    a = ts.twell_array(xt, tile_n=32, capacity=3)
    return xt, a, sp.csr_array(xt)


def test_attributes(pair):
    x, a, s = pair
    assert a.shape == s.shape == x.shape
    assert isinstance(a.shape, tuple) and all(type(d) is int for d in a.shape)
    assert a.ndim == s.ndim == 2
    assert a.nnz == s.nnz
    assert a.dtype == s.dtype
    assert a.format == "twell"
    assert isinstance(a.nnz, int)


def test_spill_is_exercised():
    """The fixture set contains a case that spills (the rest of the file relies on it)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 301))
    x[rng.random(x.shape) >= 0.4] = 0
    assert ts.twell_array(x, tile_n=32, capacity=2).n_spilled > 0


def test_toarray(pair):
    x, a, s = pair
    d = a.toarray()
    assert isinstance(d, np.ndarray) and d.dtype == s.dtype and d.shape == s.shape
    np.testing.assert_array_equal(d, s.toarray())
    np.testing.assert_array_equal(a.toarray(order="F"), x)
    out = np.full(x.shape, np.nan)
    assert a.toarray(out=out) is out
    np.testing.assert_array_equal(out, x)


def test_tocsr_tocoo(pair):
    _, a, s = pair
    c = a.tocsr()
    assert sp.issparse(c) and c.format == "csr" and c.shape == s.shape and c.nnz == s.nnz
    np.testing.assert_array_equal(c.toarray(), s.toarray())
    c.sort_indices()
    np.testing.assert_array_equal(c.indptr, s.indptr)
    np.testing.assert_array_equal(c.indices, s.indices)
    np.testing.assert_array_equal(c.data, s.data)
    o = a.tocoo()
    assert sp.issparse(o) and o.format == "coo" and o.nnz == s.nnz
    np.testing.assert_array_equal(o.toarray(), s.tocoo().toarray())


@pytest.mark.parametrize("axis", [None, 0, 1, -1, -2])
def test_sum(typed_pair, axis):
    x, a, s = typed_pair
    got, want = a.sum(axis=axis), s.sum(axis=axis)
    assert np.shape(got) == np.shape(want)
    np.testing.assert_allclose(
        np.asarray(got, np.float64),
        np.asarray(want, np.float64),
        rtol=_rtol(x.dtype),
        atol=_rtol(x.dtype) * np.abs(x).sum(),
    )


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_sum_float64_tight(pair, axis):
    _, a, s = pair
    np.testing.assert_allclose(a.sum(axis=axis), s.sum(axis=axis), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scalar", [2.5, -1, 0.0, np.float64(3.0), 7])
def test_multiply_scalar(pair, scalar):
    _, a, s = pair
    want = s.multiply(scalar).toarray()
    r = a.multiply(scalar)
    assert ts.is_twell(r) and r.shape == a.shape
    np.testing.assert_array_equal(r.toarray(), want)
    np.testing.assert_array_equal((a * scalar).toarray(), (s * scalar).toarray())
    np.testing.assert_array_equal((scalar * a).toarray(), (scalar * s).toarray())


def test_neg_and_div(pair):
    _, a, s = pair
    np.testing.assert_array_equal((-a).toarray(), (-s).toarray())
    np.testing.assert_allclose((a / 4.0).toarray(), (s / 4.0).toarray(), rtol=1e-15)


@pytest.mark.parametrize("bshape", ["full", "row", "col", "1d"])
def test_multiply_dense(pair, rng, bshape):
    x, a, s = pair
    m, n = x.shape
    shape = {"full": (m, n), "row": (1, n), "col": (m, 1), "1d": (n,)}[bshape]
    d = rng.standard_normal(shape)
    want = s.multiply(d)
    want = want.toarray() if sp.issparse(want) else np.asarray(want)
    r = a.multiply(d)
    assert ts.is_twell(r) and r.shape == a.shape
    _close(r.toarray(), want)
    # ``*`` is elementwise (sparray semantics), from either side
    _close((a * d).toarray(), (s * d).toarray())
    _close((d * a).toarray(), np.asarray((d * s).toarray()))


def test_multiply_sparse(pair):
    x, a, s = pair
    _close((a * a).toarray(), (s * s).toarray())
    _close(a.multiply(s).toarray(), s.multiply(s).toarray())
    _close(a.multiply(a).toarray(), x * x)


@pytest.mark.parametrize("k", [1, 7])
def test_matmul_2d(typed_pair, rng, k):
    x, a, s = typed_pair
    b = rng.standard_normal((x.shape[1], k)).astype(x.dtype)
    want = s @ b
    for got in (a @ b, a.dot(b), ts.matmul(a, b)):
        assert isinstance(got, np.ndarray) and got.shape == want.shape and got.dtype == want.dtype
        _close(got, want, x.dtype)


def test_matmul_1d(typed_pair, rng):
    x, a, s = typed_pair
    v = rng.standard_normal(x.shape[1]).astype(x.dtype)
    want = s @ v
    for got in (a @ v, a.dot(v), ts.matmul(a, v)):
        assert got.shape == want.shape == (x.shape[0],) and got.dtype == want.dtype
        _close(got, want, x.dtype)


def test_rmatmul(typed_pair, rng):
    x, a, s = typed_pair
    g = rng.standard_normal((5, x.shape[0])).astype(x.dtype)
    got, want = g @ a, g @ s
    assert isinstance(got, np.ndarray) and got.shape == want.shape == (5, x.shape[1])
    _close(got, want, x.dtype)
    w = g[0]
    got, want = w @ a, w @ s
    assert got.shape == want.shape == (x.shape[1],)
    _close(got, want, x.dtype)


def test_matmul_sparse_operand(pair):
    x, a, s = pair
    other = sp.csr_array(x.T)
    got = a @ other
    want = s @ other
    _close(got.toarray() if sp.issparse(got) else got, want.toarray())


def test_matmul_twell_operand(pair):
    """Two TwELL operands (either one transposed) multiply as two scipy.sparse ones do: into a
    sparse CSR result, from either side."""
    x, a, s = pair
    b = ts.twell_array(x.T)
    for got, want in ((a @ b, s @ s.T), (a @ a.T, s @ s.T), (a.T @ a, s.T @ s), (b.T @ a.T, s @ s.T)):
        assert sp.issparse(got) and got.shape == want.shape
        _close(got.toarray(), want.toarray())
    assert sp.issparse(a.__rmatmul__(b)) and a.__rmatmul__(b).shape == (x.shape[1], x.shape[1])


def test_transpose(pair, rng):
    x, a, s = pair
    for t in (a.T, a.transpose()):
        assert t.shape == s.T.shape == (x.shape[1], x.shape[0])
        assert t.ndim == 2 and t.nnz == s.nnz and t.dtype == s.dtype
        np.testing.assert_array_equal(t.toarray(), x.T)
        np.testing.assert_array_equal(t.tocsr().toarray(), s.T.toarray())
        np.testing.assert_array_equal(t.tocoo().toarray(), s.T.tocoo().toarray())
    assert a.T.T is a
    assert a.transpose().transpose() is a
    g = rng.standard_normal((x.shape[0], 4))
    _close(a.T @ g, s.T @ g)
    _close(a.T.dot(g), s.T @ g)
    _close(ts.matmul(a.T, g), s.T @ g)
    _close(a.T @ g[:, 0], s.T @ g[:, 0])
    h = rng.standard_normal((3, x.shape[1]))
    _close(h @ a.T, h @ s.T)
    _close(h[0] @ a.T, h[0] @ s.T)


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_transpose_sum(pair, axis):
    _, a, s = pair
    np.testing.assert_allclose(a.T.sum(axis=axis), s.T.sum(axis=axis), rtol=1e-12, atol=1e-12)


def test_transpose_multiply(pair, rng):
    x, a, s = pair
    d = rng.standard_normal((x.shape[1], x.shape[0]))
    _close(a.T.multiply(d).toarray(), s.T.multiply(d).toarray())
    _close((a.T * 3.0).toarray(), (s.T * 3.0).toarray())


def test_transpose_asformat(pair):
    x, a, s = pair
    t = a.T.asformat("twell")
    assert isinstance(t, ts.twell_array) and t.shape == s.T.shape
    np.testing.assert_array_equal(t.toarray(), x.T)
    for fmt in ("csr", "coo", "csc"):
        r = a.T.asformat(fmt)
        assert r.format == fmt
        np.testing.assert_array_equal(r.toarray(), x.T)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, "bfloat16"])
def test_astype(pair, dtype):
    x, a, s = pair
    r = a.astype(dtype)
    want_dtype = ts.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    assert isinstance(r, ts.twell_array) and r.dtype == want_dtype and r.shape == a.shape
    np.testing.assert_array_equal(r.toarray(), x.astype(want_dtype))
    if dtype in (np.float32, np.float64):  # scipy.sparse has no 16-bit floats
        assert s.astype(dtype).dtype == r.dtype
        np.testing.assert_array_equal(r.toarray(), s.astype(dtype).toarray())
    assert a.dtype == np.float64  # the original is untouched
    np.testing.assert_array_equal(a.toarray(), x)


def test_astype_copy(pair):
    x, a, _ = pair
    assert a.astype(a.dtype, copy=False) is a
    c = a.astype(a.dtype)
    assert c is not a
    c.data[...] = 0
    c.spill_data[...] = 0
    np.testing.assert_array_equal(a.toarray(), x)


def test_copy(pair):
    x, a, _ = pair
    c = a.copy()
    assert c is not a and isinstance(c, ts.twell_array)
    assert (c.shape, c.dtype, c.nnz, c.tile_n, c.capacity) == (a.shape, a.dtype, a.nnz, a.tile_n, a.capacity)
    np.testing.assert_array_equal(c.toarray(), x)
    c.data[...] = 7.0
    c.spill_data[...] = 7.0
    np.testing.assert_array_equal(a.toarray(), x)


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc"])
def test_asformat_scipy(pair, fmt):
    _, a, s = pair
    r = a.asformat(fmt)
    want = s.asformat(fmt)
    assert sp.issparse(r) and r.format == want.format == fmt
    np.testing.assert_array_equal(r.toarray(), want.toarray())


def test_asformat_twell(pair):
    x, a, _ = pair
    assert a.asformat("twell") is a
    assert a.asformat(None) is a
    c = a.asformat("twell", copy=True)
    assert c is not a and ts.is_twell(c)
    np.testing.assert_array_equal(c.toarray(), x)


def test_issparse_is_twell(pair):
    x, a, s = pair
    assert ts.issparse(a) and ts.is_twell(a)
    assert ts.issparse(a.T) and ts.is_twell(a.T)
    for m in (s, sp.csr_matrix(x), sp.coo_array(x), sp.csc_matrix(x)):
        assert ts.issparse(m) and not ts.is_twell(m)
    for d in (x, x.tolist(), 3.0, None):
        assert not ts.issparse(d) and not ts.is_twell(d)
    assert not sp.issparse(a)  # scipy does not claim it


def test_construct_from_scipy(pair):
    x, a, s = pair
    for m in (s, s.tocoo(), s.tocsc(), sp.csr_matrix(x)):
        b = ts.twell_array(m, tile_n=a.tile_n, capacity=a.capacity)
        assert b.shape == s.shape and b.nnz == s.nnz and b.dtype == s.dtype
        np.testing.assert_array_equal(b.toarray(), x)


def test_construct_from_twell_retiles(pair):
    x, a, _ = pair
    b = ts.twell_array(a, tile_n=64, capacity=1)
    assert (b.tile_n, b.capacity) == (64, 1)
    np.testing.assert_array_equal(b.toarray(), x)


def test_duplicates_in_scipy_input_are_summed():
    s = sp.coo_array((np.array([1.0, 2.0, 4.0]), (np.array([0, 0, 1]), np.array([3, 3, 0]))), shape=(2, 40))
    b = ts.twell_array(s, tile_n=32)
    np.testing.assert_array_equal(b.toarray(), s.toarray())
    assert b.nnz == s.tocsr().nnz == 2


@pytest.mark.parametrize("shape", [(0, 5), (4, 0), (0, 0), (3, 300)])
def test_empty(shape):
    x = np.zeros(shape)
    a, s = ts.twell_array(x), sp.csr_array(x)
    assert a.shape == s.shape and a.nnz == s.nnz == 0
    np.testing.assert_array_equal(a.toarray(), s.toarray())
    np.testing.assert_array_equal(a.tocsr().toarray(), s.toarray())
    for axis in (None, 0, 1):
        np.testing.assert_array_equal(a.sum(axis=axis), s.sum(axis=axis))
    b = np.ones((shape[1], 2))
    np.testing.assert_array_equal(a @ b, s @ b)
    g = np.ones((shape[0], 2))
    np.testing.assert_array_equal(a.T @ g, s.T @ g)


def test_empty_from_shape_tuple():
    a, s = ts.twell_array((3, 40)), sp.csr_array((3, 40))
    assert a.shape == s.shape and a.nnz == s.nnz == 0 and a.dtype == s.dtype
    np.testing.assert_array_equal(a.toarray(), s.toarray())


def test_len_is_ambiguous(pair):
    _, a, s = pair
    with pytest.raises(TypeError):
        len(s)
    with pytest.raises(TypeError):
        len(a)


def test_result_dtypes_follow_scipy(typed_pair, rng):
    x, a, s = typed_pair
    for other in (np.float32, np.float64):
        d = rng.standard_normal(x.shape).astype(other)
        assert a.multiply(d).dtype == s.multiply(d).dtype
        b = rng.standard_normal((x.shape[1], 2)).astype(other)
        assert (a @ b).dtype == (s @ b).dtype
        g = rng.standard_normal((3, x.shape[0])).astype(other)
        assert (g @ a).dtype == (g @ s).dtype


@pytest.mark.parametrize("scalar", [2.5, 3, -1.0])
def test_multiply_python_scalar_keeps_dtype(typed_pair, scalar):
    _, a, s = typed_pair
    assert (a * scalar).dtype == (s * scalar).dtype == a.dtype
    assert a.multiply(scalar).dtype == s.multiply(scalar).dtype


def test_multiply_numpy_scalar_dtype(rng):
    """NumPy scalars are not "weak" (NEP 50): float32 * np.float64(2.5) is float64 in scipy and NumPy."""
    x = _random(rng, 37, 301, 0.1).astype(np.float32)
    a, s = ts.twell_array(x, tile_n=32, capacity=2), sp.csr_array(x)
    for scalar in (np.float32(2.5), np.float64(2.5), np.int64(3)):
        r, want = a * scalar, s * scalar
        assert r.dtype == want.dtype == (x * scalar).dtype, (repr(scalar), r.dtype, want.dtype)
        _close(r.toarray(), want.toarray(), np.float32)


@pytest.mark.parametrize("bshape", ["full", "row", "col"])
def test_transpose_multiply_broadcast(pair, rng, bshape):
    """a.T is (N, M): an (N, M) array, a (1, M) row or an (N, 1) column broadcast against it."""
    x, a, s = pair
    m, n = x.shape
    shape = {"full": (n, m), "row": (1, m), "col": (n, 1)}[bshape]
    d = rng.standard_normal(shape)
    r = a.T.multiply(d)
    assert r.shape == (n, m)
    _close(r.toarray(), s.T.multiply(d).toarray())
    _close((a.T * d).toarray(), x.T * d)


def test_transpose_multiply_1d(rng):
    """A 1-D (M,) operand broadcasts as a row of a.T (N x M), as in scipy and NumPy."""
    x = _random(rng, 37, 301, 0.1)
    a, s = ts.twell_array(x, tile_n=32), sp.csr_array(x)
    d = rng.standard_normal(37)
    _close(a.T.multiply(d).toarray(), s.T.multiply(d).toarray())


def test_transpose_multiply_square_1d(rng):
    """Square case: a 1-D operand must scale the columns of a.T, not those of a."""
    x = _random(rng, 40, 40, 0.5)
    a, s = ts.twell_array(x, tile_n=32), sp.csr_array(x)
    d = rng.standard_normal(40)
    _close(a.T.multiply(d).toarray(), s.T.multiply(d).toarray())


def test_multiply_by_transposed_view(rng):
    """``*`` with another sparse operand, including a transposed TwELL view (square matrices)."""
    x = _random(rng, 40, 40, 0.5)
    a, s = ts.twell_array(x, tile_n=32, capacity=2), sp.csr_array(x)
    _close((a.T * a.T).toarray(), (s.T * s.T).toarray())
    _close((a * a.T).toarray(), (s * s.T).toarray())
    _close(a.multiply(a.T).toarray(), s.multiply(s.T).toarray())
    _close(a.T.multiply(a).toarray(), s.T.multiply(s).toarray())
