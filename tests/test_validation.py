"""Bad input: the right error type, a one-line message naming the argument, and untouched inputs.

Every failing call goes through :func:`expect_error`, which snapshots every array (and every
``twell_array``'s component arrays) reachable from the call's arguments, checks the exception
and its message, then checks that nothing the caller passed was modified.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import scipy.sparse as sp

import twellsparse as ts
from twellsparse import TwELLFormatError

M, N, K, F = 7, 70, 5, 40  # F: hidden units (linear_to_twell / ffn)
TILE = 32


# ----------------------------------------------------------------------------- helpers


def _arrays_in(obj, out):
    """Collect every ndarray reachable from ``obj`` (tuples, lists, dicts, twell matrices)."""
    if isinstance(obj, np.ndarray):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _arrays_in(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _arrays_in(o, out)
    elif ts.is_twell(obj):
        base = obj.T if isinstance(obj, ts.twell_transpose) else obj
        _arrays_in(tuple(base.parts), out)
    elif sp.issparse(obj):
        _arrays_in([obj.data, getattr(obj, "indices", None), getattr(obj, "indptr", None)], out)
    return out


def _snapshot(arrays):
    return [(a.shape, a.dtype, a.copy()) for a in arrays]


def _assert_untouched(arrays, snap):
    for a, (shape, dtype, saved) in zip(arrays, snap, strict=True):
        assert a.shape == shape and a.dtype == dtype
        assert a.tobytes() == saved.tobytes(), "an input array was modified"


def expect_error(exc_type, name, fn, *args, **kwargs):
    """Call ``fn`` expecting ``exc_type``; check the message and that the inputs are unchanged."""
    arrays = _arrays_in((args, kwargs), [])
    snap = _snapshot(arrays)
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, f"multi-line message: {msg!r}"
    assert re.search(rf"(^|\W){re.escape(name)}(\W|$)", msg), f"message does not name {name!r}: {msg!r}"
    _assert_untouched(arrays, snap)
    return info.value


def _sparse_dense(rng, m=M, n=N, density=0.3, dtype=np.float64):
    x = rng.standard_normal((m, n)).astype(dtype)
    x[rng.random((m, n)) >= density] = 0
    return x


@pytest.fixture
def x(rng):
    return _sparse_dense(rng)


@pytest.fixture
def a(x):
    return ts.twell_array(x, tile_n=TILE)


@pytest.fixture
def spilled(rng):
    """A matrix whose spill part holds several entries in several rows (capacity 2)."""
    x = _sparse_dense(rng, density=0.6)
    mat = ts.twell_array(x, tile_n=TILE, capacity=2)
    assert mat.n_spilled > 4
    assert np.count_nonzero(np.diff(mat.spill_indptr)) >= 2
    return mat


def _parts(mat):
    """Copies of the component arrays, as a dict for easy surgery."""
    return {k: v.copy() for k, v in mat.parts._asdict().items()}


def _build(p, mat, **kwargs):
    return ts.twell_array(tuple(p.values()), shape=mat.shape, tile_n=mat.tile_n, **kwargs)


# ----------------------------------------------------------------------------- wrong ndim


@pytest.mark.parametrize("shape", [(N,), (2, M, N)])
def test_ndim_twell_array(rng, shape):
    expect_error(ValueError, "arg", ts.twell_array, rng.standard_normal(shape))


@pytest.mark.parametrize("shape", [(N,), (2, M, N)])
def test_ndim_from_dense(rng, shape):
    expect_error(ValueError, "x", ts.from_dense, rng.standard_normal(shape))


@pytest.mark.parametrize("shape", [(N, K, 2), (2, N, K, 1)])
def test_ndim_matmul_b(rng, a, shape):
    b = rng.standard_normal(shape)
    expect_error(ValueError, "b", ts.matmul, a, b)
    expect_error(ValueError, "b", a.__matmul__, b)
    expect_error(ValueError, "b", ts.matmul, a.T, rng.standard_normal((M, K, 2)))


def test_ndim_matmul_b_scalar(a):
    expect_error(ValueError, "b", ts.matmul, a, np.float64(2.0))


@pytest.mark.parametrize("shape", [(M * K,), (1, M, K)])
def test_ndim_sddmm(rng, a, shape):
    y = rng.standard_normal((N, K))
    expect_error(ValueError, "x", ts.sddmm, rng.standard_normal(shape), y, a)
    x = rng.standard_normal((M, K))
    expect_error(ValueError, "y", ts.sddmm, x, rng.standard_normal((N * K,)), a)
    expect_error(ValueError, "y", ts.sddmm, x, rng.standard_normal((1, N, K)), a)


def test_ndim_linear_and_ffn(rng):
    x = rng.standard_normal((M, K))
    w_up, w_down = rng.standard_normal((F, K)), rng.standard_normal((K, F))
    expect_error(ValueError, "x", ts.linear_to_twell, x[0], w_up)
    expect_error(ValueError, "weight", ts.linear_to_twell, x, w_up[None])
    expect_error(ValueError, "x", ts.ffn, x[None], w_up, w_down)
    expect_error(ValueError, "w_up", ts.ffn, x, w_up[0], w_down)
    expect_error(ValueError, "w_down", ts.ffn, x, w_up, w_down[None])
    expect_error(ValueError, "w_gate", ts.gated_ffn, x, w_up[None], w_up, w_down)
    expect_error(ValueError, "w_down", ts.gated_ffn, x, w_up, w_up, w_down[0])


def test_ndim_from_ell(rng):
    vals = rng.standard_normal(5)
    expect_error(ValueError, "values", ts.from_ell, vals, np.arange(5, dtype=np.int32))


# ----------------------------------------------------------------------------- mismatched shapes


def test_matmul_inner_dims(rng, a):
    expect_error(ValueError, "b", ts.matmul, a, rng.standard_normal((N + 1, K)))
    expect_error(ValueError, "b", ts.matmul, a, rng.standard_normal(N - 1))
    expect_error(ValueError, "b", ts.matmul, a.T, rng.standard_normal((N, K)))  # a.T needs M rows
    expect_error(ValueError, "b", ts.matmul, a.T, rng.standard_normal(M + 1))
    expect_error(ValueError, "b", lambda: a @ rng.standard_normal((M, K)))


def test_rmatmul_inner_dims(rng, a):
    g = rng.standard_normal((K, N))  # dense @ a needs M columns
    expect_error(ValueError, "other", lambda: g @ a)


def test_matmul_out_mismatch(rng, a):
    b = rng.standard_normal((N, K))
    expect_error(ValueError, "out", ts.matmul, a, b, out=np.zeros((M, K + 1)))
    expect_error(ValueError, "out", ts.matmul, a, b, out=np.zeros((M, K), dtype=np.float32))
    expect_error(ValueError, "out", ts.matmul, a, b[:, 0], out=np.zeros((M, 1)))


def test_sddmm_shapes(rng, a):
    x, y = rng.standard_normal((M, K)), rng.standard_normal((N, K))
    expect_error(ValueError, "x", ts.sddmm, x[:-1], y, a)
    expect_error(ValueError, "y", ts.sddmm, x, y[:-1], a)
    expect_error(ValueError, "y", ts.sddmm, x, y[:, :-1], a)
    expect_error(ValueError, "y", ts.sddmm, x, rng.standard_normal((N, K + 1)), a)


def test_linear_to_twell_shapes(rng):
    x = rng.standard_normal((M, K))
    expect_error(ValueError, "weight", ts.linear_to_twell, x, rng.standard_normal((F, K + 1)))
    expect_error(ValueError, "weight", ts.linear_to_twell, x, rng.standard_normal((K, F)))


def test_ffn_shapes(rng):
    x = rng.standard_normal((M, K))
    w_up, w_down = rng.standard_normal((F, K)), rng.standard_normal((K, F))
    expect_error(ValueError, "w_up", ts.ffn, x, rng.standard_normal((F, K + 1)), w_down)
    expect_error(ValueError, "w_down", ts.ffn, x, w_up, rng.standard_normal((K, F + 1)))
    expect_error(ValueError, "w_down", ts.ffn, x, w_up, rng.standard_normal((F, K)))


def test_gated_ffn_shapes(rng):
    x = rng.standard_normal((M, K))
    w, w_down = rng.standard_normal((F, K)), rng.standard_normal((K, F))
    expect_error(ValueError, "w_gate", ts.gated_ffn, x, rng.standard_normal((F, K + 1)), w, w_down)
    expect_error(ValueError, "w_up", ts.gated_ffn, x, w, rng.standard_normal((F, K + 1)), w_down)
    expect_error(ValueError, "w_up", ts.gated_ffn, x, w, rng.standard_normal((F + 1, K)), w_down)
    expect_error(ValueError, "w_down", ts.gated_ffn, x, w, w, rng.standard_normal((K, F - 1)))


def test_shape_kw_mismatch(x, a):
    expect_error(ValueError, "shape", ts.twell_array, x, shape=(M + 1, N))
    expect_error(ValueError, "shape", ts.twell_array, x, shape=(M, N - 1))
    expect_error(ValueError, "shape", ts.twell_array, sp.csr_array(x), shape=(M, N + 1))
    expect_error(ValueError, "shape", ts.twell_array, a, shape=(N, M))
    expect_error(ValueError, "shape", ts.twell_array, (M, N), shape=(M, N + 1))


def test_shape_kw_invalid(x):
    expect_error(ValueError, "shape", ts.twell_array, x, shape=(-1, N))
    expect_error(TypeError, "shape", ts.twell_array, x, shape=(M, N, 1))
    expect_error(TypeError, "shape", ts.twell_array, x, shape="ab")


def test_from_ell_shapes(rng):
    vals = rng.standard_normal((M, 3))
    idx = np.tile(np.arange(3, dtype=np.int32), (M, 1))
    expect_error(ValueError, "indices", ts.from_ell, vals, idx[:, :2])
    expect_error(ValueError, "indices", ts.from_ell, vals, idx[:-1])
    expect_error(ValueError, "shape", ts.from_ell, vals, idx, shape=(M + 1, 10))


def test_multiply_not_broadcastable(rng, a):
    expect_error(ValueError, "other", a.multiply, rng.standard_normal((M, N + 1)))
    expect_error(ValueError, "other", a.multiply, rng.standard_normal((2, N)))
    expect_error(ValueError, "other", a.multiply, rng.standard_normal(M))


# ----------------------------------------------------------------------------- dtypes


BAD_DTYPES = [np.int64, np.bool_, np.complex128, np.int8]


def _cast(x, dtype):
    return (x != 0).astype(dtype) if dtype == np.bool_ else (x * 10).astype(dtype)


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_dtype_constructors(x, dtype):
    bad = _cast(x, dtype)
    expect_error(TypeError, "arg", ts.twell_array, bad)
    expect_error(TypeError, "x", ts.from_dense, bad)
    if dtype != np.bool_:  # scipy.sparse itself refuses some of these
        expect_error(TypeError, "arg", ts.twell_array, sp.csr_array(bad))
    vals, idx = _cast(np.ones((M, 2)), dtype), np.zeros((M, 2), dtype=np.int32) - 1
    expect_error(TypeError, "values", ts.from_ell, vals, idx, shape=(M, N))


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_dtype_ops(rng, a, dtype):
    b = _cast(rng.standard_normal((N, K)), dtype)
    expect_error(TypeError, "b", ts.matmul, a, b)
    xk = _cast(rng.standard_normal((M, K)), dtype)
    y = rng.standard_normal((N, K))
    expect_error(TypeError, "x", ts.sddmm, xk, y, a)
    expect_error(TypeError, "y", ts.sddmm, rng.standard_normal((M, K)), _cast(y, dtype), a)
    w = rng.standard_normal((F, K))
    expect_error(TypeError, "x", ts.linear_to_twell, xk, w)
    expect_error(TypeError, "weight", ts.linear_to_twell, rng.standard_normal((M, K)), _cast(w, dtype))
    expect_error(TypeError, "x", ts.ffn, xk, w, rng.standard_normal((K, F)))
    expect_error(TypeError, "w_down", ts.gated_ffn, rng.standard_normal((M, K)), w, w, _cast(w.T, dtype))


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64, "foo"])
def test_dtype_keyword(x, a, dtype):
    expect_error(TypeError, "dtype", ts.twell_array, x, dtype=dtype)
    expect_error(TypeError, "dtype", a.astype, dtype)


def test_ell_indices_dtype(rng):
    vals = rng.standard_normal((M, 2))
    expect_error(TypeError, "indices", ts.from_ell, vals, np.zeros((M, 2), dtype=np.float64), shape=(M, N))


# ----------------------------------------------------------------------------- parts constructor


def test_parts_valid_roundtrip(spilled):
    b = _build(_parts(spilled), spilled)
    np.testing.assert_array_equal(b.toarray(), spilled.toarray())
    b.check_format(full_check=True)


def _surgery_cases(p, mat):
    bad = {}
    bad["data-2d"] = ("data", dict(p, data=p["data"][:, :, 0]))
    bad["data-rows"] = ("data", dict(p, data=p["data"][:-1]))
    bad["data-tiles"] = ("data", dict(p, data=np.concatenate([p["data"], p["data"][:, :1]], axis=1)))
    bad["indices-int32"] = ("indices", dict(p, indices=p["indices"].astype(np.int32)))
    bad["indices-uint16"] = ("indices", dict(p, indices=p["indices"].astype(np.uint16)))
    bad["indices-shape"] = ("indices", dict(p, indices=p["indices"][:, :, :-1]))
    bad["counts-int64"] = ("counts", dict(p, counts=p["counts"].astype(np.int64)))
    bad["counts-shape"] = ("counts", dict(p, counts=p["counts"][:-1]))
    bad["counts-3d"] = ("counts", dict(p, counts=p["counts"][..., None]))
    bad["spill_data-2d"] = ("spill_data", dict(p, spill_data=p["spill_data"][:, None]))
    bad["spill_indices-int64"] = ("spill_indices", dict(p, spill_indices=p["spill_indices"].astype(np.int64)))
    bad["spill_indices-short"] = ("spill_indices", dict(p, spill_indices=p["spill_indices"][:-1]))
    bad["spill_indptr-int64"] = ("spill_indptr", dict(p, spill_indptr=p["spill_indptr"].astype(np.int64)))
    bad["spill_indptr-length"] = ("spill_indptr", dict(p, spill_indptr=p["spill_indptr"][:-1]))
    end = p["spill_indptr"].copy()
    end[-1] -= 1
    bad["spill_indptr-end"] = ("spill_indptr", dict(p, spill_indptr=end))
    over = p["spill_indptr"].copy()
    over[-1] += 1
    bad["spill_indptr-end-over"] = ("spill_indptr", dict(p, spill_indptr=over))
    start = p["spill_indptr"].copy()
    start[0] = 1
    bad["spill_indptr-start"] = ("spill_indptr", dict(p, spill_indptr=start))
    dec = p["spill_indptr"].copy()
    row = int(np.flatnonzero(np.diff(dec))[0])  # a row with spilled entries: make indptr dip
    dec[row + 1] = dec[-1] + 1
    bad["spill_indptr-decreasing"] = ("spill_indptr", dict(p, spill_indptr=dec))
    unsorted = p["spill_indices"].copy()
    # pick a row with at least two spilled entries and swap its first two columns
    counts = np.diff(p["spill_indptr"])
    r2 = int(np.flatnonzero(counts >= 2)[0])
    s0 = int(p["spill_indptr"][r2])
    unsorted[[s0, s0 + 1]] = unsorted[[s0 + 1, s0]]
    bad["spill_indices-unsorted"] = ("spill_indices", dict(p, spill_indices=unsorted))
    dup = p["spill_indices"].copy()
    dup[s0 + 1] = dup[s0]
    bad["spill_indices-repeated"] = ("spill_indices", dict(p, spill_indices=dup))
    oob = p["spill_indices"].copy()
    oob[-1] = mat.shape[1]
    bad["spill_indices-out-of-range"] = ("spill_indices", dict(p, spill_indices=oob))
    neg = p["spill_indices"].copy()
    neg[0] = -1
    bad["spill_indices-negative"] = ("spill_indices", dict(p, spill_indices=neg))
    return bad


CASES = [
    "data-2d", "data-rows", "data-tiles", "indices-int32", "indices-uint16", "indices-shape",
    "counts-int64", "counts-shape", "counts-3d", "spill_data-2d", "spill_indices-int64",
    "spill_indices-short", "spill_indptr-int64", "spill_indptr-length", "spill_indptr-end",
    "spill_indptr-end-over", "spill_indptr-start", "spill_indptr-decreasing",
    "spill_indices-unsorted", "spill_indices-repeated", "spill_indices-out-of-range",
    "spill_indices-negative",
]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_parts_malformed(spilled, case):
    name, p = _surgery_cases(_parts(spilled), spilled)[case]
    err = expect_error(TwELLFormatError, name, _build, p, spilled)
    assert isinstance(err, ValueError)


def test_parts_data_capacity_above_tile_n(rng):
    m, nt = 3, 2
    data = rng.standard_normal((m, nt, 2 * TILE))
    idx = np.full(data.shape, -1, dtype=np.int16)
    counts = np.zeros((m, nt), dtype=np.int32)
    expect_error(TwELLFormatError, "data", ts.twell_array, (data, idx, counts), shape=(m, 2 * TILE), tile_n=TILE)


def test_parts_three_tuple_shape_checks(spilled):
    p = _parts(spilled)
    three = (p["data"], p["indices"], p["counts"])
    b = ts.twell_array(three, shape=spilled.shape, tile_n=TILE)
    assert b.n_spilled == 0
    expect_error(
        TwELLFormatError,
        "counts",
        ts.twell_array,
        (p["data"], p["indices"], p["counts"][:, :-1]),
        shape=spilled.shape,
        tile_n=TILE,
    )
    expect_error(TwELLFormatError, "data", ts.twell_array, three, shape=spilled.shape, tile_n=2 * TILE)


@pytest.mark.parametrize("length", [1, 2, 4, 5, 7])
def test_parts_tuple_length(spilled, length):
    p = tuple(_parts(spilled).values())
    arg = (p * 2)[:length]
    expect_error(TypeError, "arg", ts.twell_array, arg, shape=spilled.shape, tile_n=TILE)


def test_parts_missing_shape(spilled):
    expect_error(TypeError, "shape", ts.twell_array, tuple(_parts(spilled).values()), tile_n=TILE)
    p = _parts(spilled)
    expect_error(TypeError, "shape", ts.twell_array, (p["data"], p["indices"], p["counts"]), tile_n=TILE)


def test_parts_bad_value_dtype(spilled):
    p = _parts(spilled)
    p["data"] = (p["data"] * 10).astype(np.int32)
    expect_error(TypeError, "data", _build, p, spilled)


def test_parts_capacity_keyword_mismatch(spilled):
    expect_error(ValueError, "capacity", _build, _parts(spilled), spilled, capacity=spilled.capacity + 1)


def test_parts_zero_rows_with_spill_entries():
    """M = 0: the spill CSR of a 0-row matrix must be empty; spill_indptr [0] does not end at 3."""
    data = np.zeros((0, 1, 4))
    idx = np.full((0, 1, 4), -1, dtype=np.int16)
    counts = np.zeros((0, 1), dtype=np.int32)
    sdata, sind, sptr = np.ones(3), np.array([0, 1, 2], np.int32), np.zeros(1, np.int32)
    expect_error(
        TwELLFormatError,
        "spill_indptr",
        ts.twell_array,
        (data, idx, counts, sdata, sind, sptr),
        shape=(0, 10),
        tile_n=TILE,
    )


# ----------------------------------------------------------------------------- check_format(full_check=True)


def _full_check_cases(mat):
    p = _parts(mat)
    data, idx, counts = p["data"], p["indices"], p["counts"]
    cap = data.shape[2]
    used = np.arange(cap) < counts[..., None]
    cases = {}

    c = counts.copy()
    c[0, 0] = cap + 1
    cases["counts-over-capacity"] = ("counts", dict(p, counts=c))
    c = counts.copy()
    c[-1, -1] = -1
    cases["counts-negative"] = ("counts", dict(p, counts=c))

    r, t, s = (int(v[0]) for v in np.nonzero(used))
    i = idx.copy()
    i[r, t, s] = TILE
    cases["index-tile_n"] = ("indices", dict(p, indices=i))
    i = idx.copy()
    i[r, t, s] = -2
    cases["index-negative"] = ("indices", dict(p, indices=i))
    i = idx.copy()
    i[r, t, s] = -1
    cases["index-minus-one-in-used-slot"] = ("indices", dict(p, indices=i))
    # the last tile is partial (N = 70, tile_n = 32): local column 6 is global column 70 = N
    last = mat.n_tiles - 1
    rl, sl = (int(v[0]) for v in np.nonzero(used[:, last]))
    i = idx.copy()
    i[rl, last, sl] = mat.shape[1] - last * TILE
    cases["index-beyond-N"] = ("indices", dict(p, indices=i))

    rd, td = (int(v[0]) for v in np.nonzero(counts >= 2))
    i = idx.copy()
    i[rd, td, 1] = i[rd, td, 0]
    cases["duplicate-column"] = ("indices", dict(p, indices=i))

    ru, tu, su = (int(v[0]) for v in np.nonzero(~used))
    i = idx.copy()
    i[ru, tu, su] = 0
    cases["padding-not-minus-one"] = ("indices", dict(p, indices=i))
    d = p["data"].copy()
    d[ru, tu, su] = np.nan  # what 0 * inf would leave there
    cases["padding-value-not-zero"] = ("data", dict(p, data=d))
    sp_ptr = p["spill_indptr"].copy()
    sp_ptr[1:-1] = sp_ptr[-1] + 1 - np.arange(1, sp_ptr.size - 1)  # decreasing between valid ends
    cases["spill-indptr-decreasing"] = ("spill_indptr", dict(p, spill_indptr=sp_ptr))

    # a spilled column that is also in its row-tile's slots
    row = int(np.flatnonzero(np.diff(p["spill_indptr"]))[0])
    k = int(p["spill_indptr"][row])
    col = int(p["spill_indices"][k])
    tile = col // TILE
    assert counts[row, tile] == cap
    i = idx.copy()
    i[row, tile, cap - 1] = col % TILE  # the slot's largest column becomes the spilled one
    cases["spill-clash"] = ("spill_indices", dict(p, indices=i))
    return cases


FULL_CASES = ["duplicate-column", "padding-not-minus-one", "padding-value-not-zero", "spill-clash"]
#: Caught by every constructor: nnz and the kernels trust the counts and spill_indptr, and the
#: kernels read and write at the used slots' columns unclamped.
CHEAP_CASES = [
    "counts-over-capacity", "counts-negative", "spill-indptr-decreasing",
    "index-tile_n", "index-negative", "index-minus-one-in-used-slot", "index-beyond-N",
]  # fmt: skip


@pytest.mark.parametrize("case", FULL_CASES)
def test_check_format_full(rng, case):
    x = _sparse_dense(rng, m=12, density=0.25)
    x[:, :TILE][rng.random((12, TILE)) < 0.5] = 1.0  # row-tiles of the first tile overflow capacity 4
    mat = ts.twell_array(x, tile_n=TILE, capacity=4)
    assert mat.n_spilled > 0 and (mat.counts < mat.capacity).any()
    mat.check_format(full_check=True)
    name, p = _full_check_cases(mat)[case]
    bad = _build(p, mat)  # the cheap structural check lets it through
    bad.check_format(full_check=False)
    err = expect_error(TwELLFormatError, name, bad.check_format, full_check=True)
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("case", CHEAP_CASES)
def test_constructor_checks_counts_and_spill_pointers(rng, case):
    x = _sparse_dense(rng, m=12, density=0.25)
    x[:, :TILE][rng.random((12, TILE)) < 0.5] = 1.0
    mat = ts.twell_array(x, tile_n=TILE, capacity=4)
    name, p = _full_check_cases(mat)[case]
    expect_error(TwELLFormatError, name, _build, p, mat)


def test_empty_spill_with_decreasing_pointers_is_caught(rng):
    mat = ts.twell_array(np.eye(3, 40), tile_n=TILE, capacity=2)
    p = mat.parts._asdict()
    p["spill_indptr"] = np.array([0, 1, 0, 0], np.int32)
    expect_error(TwELLFormatError, "spill_indptr", _build, p, mat)


def test_spill_dtype_must_match_unless_asked(rng):
    x = np.zeros((1, 64))
    x[0, :5] = [1, 2, 3, 4, 1 / 3]
    mat = ts.twell_array(x, tile_n=TILE, capacity=2)
    p = mat.parts._asdict()
    p["data"] = p["data"].astype(np.float16)
    expect_error(TwELLFormatError, "spill_data", _build, p, mat)  # float64 spill: no silent rounding
    asked = _build(p, mat, dtype=np.float16)  # a conversion the caller asked for
    assert asked.spill_data.dtype == np.float16
    p["spill_data"], p["spill_indices"] = np.empty(0), np.empty(0, np.int32)  # an empty spill of any dtype
    p["spill_indptr"] = np.zeros(2, np.int32)
    assert _build(p, mat).spill_data.dtype == np.float16


# ----------------------------------------------------------------------------- unknown options


@pytest.mark.parametrize("tile_n", [0, 16, 48, 100, 513, 2048, -32])
def test_bad_tile_n(rng, x, tile_n):
    expect_error(ValueError, "tile_n", ts.twell_array, x, tile_n=tile_n)
    expect_error(ValueError, "tile_n", ts.from_dense, x, tile_n=tile_n)
    expect_error(ValueError, "tile_n", ts.from_ell, x[:, :2], np.full((M, 2), -1, np.int32), tile_n=tile_n)
    w = rng.standard_normal((F, K))
    expect_error(ValueError, "tile_n", ts.linear_to_twell, rng.standard_normal((M, K)), w, tile_n=tile_n)
    expect_error(ValueError, "tile_n", ts.ffn, rng.standard_normal((M, K)), w, w.T.copy(), tile_n=tile_n)


@pytest.mark.parametrize("tile_n", [64.0, "64", None])
def test_tile_n_not_int(x, tile_n):
    expect_error(TypeError, "tile_n", ts.twell_array, x, tile_n=tile_n)


@pytest.mark.parametrize("capacity", [0, -1, TILE + 1, 10 * TILE])
def test_bad_capacity(rng, x, capacity):
    expect_error(ValueError, "capacity", ts.twell_array, x, tile_n=TILE, capacity=capacity)
    expect_error(ValueError, "capacity", ts.from_dense, x, tile_n=TILE, capacity=capacity)
    expect_error(
        ValueError, "capacity", ts.from_ell, x[:, :2], np.full((M, 2), -1, np.int32), tile_n=TILE, capacity=capacity
    )
    w = rng.standard_normal((F, K))
    expect_error(
        ValueError, "capacity", ts.linear_to_twell, rng.standard_normal((M, K)), w, tile_n=TILE, capacity=capacity
    )


def test_capacity_not_int(x):
    expect_error(TypeError, "capacity", ts.twell_array, x, capacity=2.5)


@pytest.mark.parametrize("overflow", ["foo", "", None, "SPILL"])
def test_bad_overflow(rng, x, overflow):
    expect_error(ValueError, "overflow", ts.twell_array, x, overflow=overflow)
    expect_error(ValueError, "overflow", ts.from_dense, x, overflow=overflow)
    expect_error(ValueError, "overflow", ts.from_ell, x[:, :2], np.full((M, 2), -1, np.int32), overflow=overflow)
    w = rng.standard_normal((F, K))
    expect_error(ValueError, "overflow", ts.linear_to_twell, rng.standard_normal((M, K)), w, overflow=overflow)


@pytest.mark.parametrize("activation", ["tanh", "RELU", "", "gelu_new"])
def test_bad_activation(rng, activation):
    xk, w = rng.standard_normal((M, K)), rng.standard_normal((F, K))
    wd = rng.standard_normal((K, F))
    expect_error(ValueError, "activation", ts.linear_to_twell, xk, w, activation=activation)
    expect_error(ValueError, "activation", ts.ffn, xk, w, wd, activation=activation)
    expect_error(ValueError, "activation", ts.gated_ffn, xk, w, w, wd, activation=activation)


@pytest.mark.parametrize("threshold", [-0.1, -1, float("nan"), float("inf")])
def test_bad_threshold(rng, x, threshold):
    xk, w = rng.standard_normal((M, K)), rng.standard_normal((F, K))
    wd = rng.standard_normal((K, F))
    expect_error(ValueError, "threshold", ts.from_dense, x, threshold=threshold)
    expect_error(ValueError, "threshold", ts.linear_to_twell, xk, w, threshold=threshold)
    expect_error(ValueError, "threshold", ts.ffn, xk, w, wd, threshold=threshold)
    expect_error(ValueError, "threshold", ts.gated_ffn, xk, w, w, wd, threshold=threshold)


def test_threshold_not_a_number(x):
    expect_error(TypeError, "threshold", ts.from_dense, x, threshold="high")


def test_toell_width_too_small(spilled):
    need = int(np.count_nonzero(spilled.toarray(), axis=1).max())
    expect_error(ValueError, "width", spilled.toell, width=need - 1)
    expect_error(ValueError, "width", spilled.toell, width=0)
    vals, idx = spilled.toell(width=need)
    assert vals.shape == idx.shape == (M, need)


@pytest.mark.parametrize("fmt", ["xyz", "dense", "CSR", "ell"])
def test_asformat_unknown(a, fmt):
    expect_error(ValueError, "format", a.asformat, fmt)


@pytest.mark.parametrize("axis", [2, -3, 5])
def test_sum_bad_axis(a, axis):
    expect_error(ValueError, "axis", a.sum, axis=axis)


def test_transpose_bad_axes(a):
    expect_error(ValueError, "axes", a.transpose, axes=(0, 1))


def test_matmul_a_not_twell(rng, x):
    expect_error(TypeError, "a", ts.matmul, x, rng.standard_normal((N, K)))
    expect_error(TypeError, "a", ts.matmul, sp.csr_array(x), rng.standard_normal((N, K)))


def test_sddmm_pattern_not_twell(rng, x):
    expect_error(TypeError, "pattern", ts.sddmm, rng.standard_normal((M, K)), rng.standard_normal((N, K)), x)


def test_not_an_array():
    expect_error(TypeError, "x", ts.from_dense, object())
    expect_error(TypeError, "arg", ts.twell_array, object())


# ----------------------------------------------------------------------------- overflow="error"


def test_capacity_error(rng):
    x = _sparse_dense(rng, density=0.1)
    x[3, TILE : TILE + 9] = np.arange(1, 10)  # row 3, tile 1 holds at least 9 entries
    err = expect_error(ts.TwELLCapacityError, "capacity", ts.twell_array, x, tile_n=TILE, capacity=2, overflow="error")
    assert isinstance(err, ValueError)
    counts = np.add.reduceat((x != 0).astype(int), np.arange(0, N, TILE), axis=1)
    assert err.count == counts.max() and err.capacity == 2
    assert counts[err.row, err.tile] == counts.max()
    assert err.n_overflowing == int((counts > 2).sum())
    expect_error(ts.TwELLCapacityError, "capacity", ts.from_dense, x, tile_n=TILE, capacity=2, overflow="error")


# ----------------------------------------------------------------------------- ELLPACK input


def _ell(rng):
    vals = rng.standard_normal((M, 4))
    idx = np.full((M, 4), -1, dtype=np.int32)
    for r in range(M):
        k = r % 5  # 0 to 4 entries per row
        idx[r, :k] = rng.choice(N, size=k, replace=False)
    return vals, idx


def test_ell_valid(rng):
    vals, idx = _ell(rng)
    mat = ts.from_ell(vals, idx, shape=(M, N), tile_n=TILE)
    dense = np.zeros((M, N))
    for r in range(M):
        for s in range(4):
            if idx[r, s] >= 0:
                dense[r, idx[r, s]] = vals[r, s]
    np.testing.assert_array_equal(mat.toarray(), dense)


def test_ell_entry_after_padding(rng):
    vals, idx = _ell(rng)
    idx[1] = [5, -1, 7, -1]
    expect_error(ValueError, "indices", ts.from_ell, vals, idx, shape=(M, N))
    expect_error(ValueError, "indices", ts.from_ell, vals, idx)


@pytest.mark.parametrize("bad", [-2, -100])
def test_ell_index_below_minus_one(rng, bad):
    vals, idx = _ell(rng)
    idx[2, 0] = bad
    expect_error(ValueError, "indices", ts.from_ell, vals, idx, shape=(M, N))


@pytest.mark.parametrize("bad", [N, N + 1, 10 * N])
def test_ell_index_at_or_beyond_n(rng, bad):
    vals, idx = _ell(rng)
    idx[2, 0] = bad
    expect_error(ValueError, "indices", ts.from_ell, vals, idx, shape=(M, N))


def test_ell_duplicate_column(rng):
    vals, idx = _ell(rng)
    idx[4, :3] = [9, 3, 9]
    expect_error(ValueError, "indices", ts.from_ell, vals, idx, shape=(M, N))
    expect_error(ValueError, "indices", ts.from_ell, vals, idx)


def test_columns_beyond_int32_tile_bounds():
    # The kernels compute a tile's column bounds in int32: the last tile of a 2**31 - 1 column
    # matrix would wrap. Refused before anything is allocated, for every producer.
    wide = sp.csr_array((np.ones(1), np.array([5], np.int32), np.array([0, 1], np.int32)), shape=(1, 2**31 - 1))
    expect_error(ValueError, "shape", ts.twell_array, wide)
    expect_error(ValueError, "shape", ts.twell_array, (1, 2**31 - 1))
    assert ts.twell_array((0, 2**31 - 2048)).shape == (0, 2**31 - 2048)  # the largest width allowed


def test_spill_beyond_int32_row_pointers():
    from twellsparse._reference import overflow_excess

    nnz = np.array([[40]], np.int64)
    expect_error(ValueError, "capacity", overflow_excess, nnz, 32, "spill", excess=2**31)
    assert overflow_excess(nnz, 32, "spill", excess=2**31 - 1) == 2**31 - 1  # the largest spill a row pointer holds
    w = np.ones((4, 3))
    expect_error(ValueError, "spill_capacity", ts.GatedFFN, w, w, w.T, spill_capacity=2**31)
