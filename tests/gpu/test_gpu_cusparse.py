"""The cuSPARSE bindings against dense float64 products on the GPU: CSR SpMM with each
algorithm, Blocked-ELL SpMM and SDDMM, for every dtype cuSPARSE accepts. A combination cuSPARSE
itself refuses (CUSPARSE_STATUS_NOT_SUPPORTED) is reported as a skip naming it."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import twellsparse as ts
from twellsparse.testing import rel_error

cusparse = pytest.importorskip("twellsparse.bindings.cusparse")

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16, np.float32, np.float64]
TOL = {"float16": 5e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}


def _refused(exc: Exception) -> bool:
    return "NOT_SUPPORTED" in str(exc)


def _csr(rng, m, n, density, dtype):
    a = sp.random(m, n, density=density, format="csr", random_state=rng, data_rvs=rng.standard_normal)
    a.data = a.data.astype(dtype)
    return a


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alg", ["default", "csr_alg1", "csr_alg2", "csr_alg3"])
def test_csr_spmm(cp, rng, dtype, alg):
    m, n, k = 300, 700, 64
    a = _csr(rng, m, n, 0.02, dtype)
    b = rng.standard_normal((n, k)).astype(dtype)
    out = cp.full((m, k), np.nan, dtype=dtype)
    desc = cusparse.csr_descriptor(cp.asarray(a.indptr), cp.asarray(a.indices), cp.asarray(a.data), (m, n))
    try:
        got = cusparse.SpMM(desc, cp.asarray(b), out, alg)()
    except cusparse.CuSparseError as exc:
        if _refused(exc):
            pytest.skip(f"cuSPARSE refuses {alg} for {np.dtype(dtype).name} row-major: {exc}")
        raise
    expected = a.astype(np.float64) @ b.astype(np.float64)
    assert rel_error(got, expected) <= TOL[np.dtype(dtype).name]


@pytest.mark.parametrize("dtype", [np.float16, ts.bfloat16, np.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_blocked_ell_spmm(cp, rng, dtype, block_size):
    m, n, k = 8 * block_size, 12 * block_size, 64
    mask = np.kron(rng.random((m // block_size, n // block_size)) < 0.2, np.ones((block_size, block_size)))
    mask[:block_size, :block_size] = 1  # never all zero
    x = (rng.standard_normal((m, n)) * mask).astype(dtype)
    block_cols, values = cusparse.blocked_ell_from_dense(cp.asarray(x), block_size)
    desc = cusparse.blocked_ell_descriptor(block_cols, values, (m, n), block_size)
    b = rng.standard_normal((n, k)).astype(dtype)
    out = cp.full((m, k), np.nan, dtype=dtype)
    try:
        got = cusparse.SpMM(desc, cp.asarray(b), out, "blocked_ell_alg1")()
    except cusparse.CuSparseError as exc:
        if _refused(exc):
            pytest.skip(f"cuSPARSE refuses Blocked-ELL for {np.dtype(dtype).name}: {exc}")
        raise
    expected = x.astype(np.float64) @ b.astype(np.float64)
    # cuSPARSE runs float32 Blocked-ELL on TF32 tensor cores (2.9e-4 measured on the H200).
    tol = 1e-3 if np.dtype(dtype) == np.float32 else TOL[np.dtype(dtype).name]
    assert rel_error(got, expected) <= tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_sddmm(cp, rng, dtype):
    m, n, k = 200, 500, 48
    pattern = _csr(rng, m, n, 0.03, dtype)
    x = rng.standard_normal((m, k)).astype(dtype)
    y = rng.standard_normal((n, k)).astype(dtype)
    vals = cp.full(pattern.nnz, np.nan, dtype=dtype)
    desc = cusparse.csr_descriptor(cp.asarray(pattern.indptr), cp.asarray(pattern.indices), vals, (m, n))
    try:
        cusparse.sddmm(cp.asarray(x), cp.asarray(y), desc, vals)
    except cusparse.CuSparseError as exc:
        if _refused(exc):
            pytest.skip(f"cuSPARSE refuses SDDMM for {np.dtype(dtype).name}: {exc}")
        raise
    rows = np.repeat(np.arange(m), np.diff(pattern.indptr))
    dots = (x.astype(np.float64) @ y.astype(np.float64).T)[rows, pattern.indices]
    assert rel_error(vals, dots) <= TOL[np.dtype(dtype).name]


def test_bad_operands_raise_before_any_call(cp):
    with pytest.raises(ValueError, match="indptr: expected shape"):
        cusparse.csr_descriptor(cp.zeros(3, dtype=cp.int32), cp.zeros(0, dtype=cp.int32), cp.zeros(0), (5, 5))
    with pytest.raises(ValueError, match="b: expected a 2-D array with unit column stride"):
        desc = cusparse.csr_descriptor(cp.zeros(6, dtype=cp.int32), cp.zeros(0, dtype=cp.int32), cp.zeros(0), (5, 5))
        cusparse.SpMM(desc, cp.zeros((5, 4)).T, cp.zeros((5, 5)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_to_csr(cp, rng, dtype):
    a = _csr(rng, 150, 400, 0.05, dtype)
    dense = a.astype(np.float64).toarray().astype(dtype)  # scipy has no float16/bf16 toarray
    indptr, cols, vals = cusparse.dense_to_csr(cp.asarray(dense))
    np.testing.assert_array_equal(indptr.get(), a.indptr)
    # cuSPARSE leaves the columns within a row unsorted: compare row by row in column order.
    cols_h, vals_h = cols.get(), vals.get().astype(np.float64)
    for r in range(a.shape[0]):
        lo, hi = a.indptr[r], a.indptr[r + 1]
        order = np.argsort(cols_h[lo:hi], kind="stable")
        np.testing.assert_array_equal(cols_h[lo:hi][order], a.indices[lo:hi])
        np.testing.assert_array_equal(vals_h[lo:hi][order], a.data[lo:hi].astype(np.float64))
