"""GPU conversions against the CPU reference: bit-exact component arrays and round trips."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import twellsparse as ts
from twellsparse import _reference as ref
from twellsparse.testing import sparse_activations

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16, np.float32, np.float64]


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.size else a


def assert_parts_equal(gpu, cpu):
    """Component arrays equal bit for bit (same canonical layout on both devices)."""
    for name, g, c in zip(ts.TwELLParts._fields, gpu.parts, cpu.parts, strict=False):
        np.testing.assert_array_equal(_bits(g.get()), _bits(c), err_msg=name)


def _random_dense(rng, m, n, density, dtype):
    x = rng.standard_normal((m, n)) * (rng.random((m, n)) < density)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, n, tile_n, capacity, density",
    [
        (37, 301, 32, 3, 0.2),
        (64, 1000, 256, None, 0.05),
        (5, 2049, 1024, 7, 0.02),
        (3, 70001, 256, 2, 0.01),
        (129, 96, 64, 64, 0.9),
        (1, 1, 32, 1, 1.0),
        (0, 40, 32, None, 0.1),
        (7, 0, 32, None, 0.1),
    ],
)
def test_dense_to_twell_matches_reference(cp, rng, dtype, m, n, tile_n, capacity, density):
    x = _random_dense(rng, m, n, density, dtype)
    cpu = ts.twell_array(x, tile_n=tile_n, capacity=capacity)
    gpu = ts.twell_array(cp.asarray(x), tile_n=tile_n, capacity=capacity)
    assert_parts_equal(gpu, cpu)
    np.testing.assert_array_equal(gpu.toarray().get(), x)  # values: x holds -0.0, which is not stored
    gpu.check_format(full_check=True)


def test_non_contiguous_and_fortran_inputs(cp, rng):
    x = _random_dense(rng, 50, 700, 0.1, np.float32)
    for view in (
        cp.asfortranarray(cp.asarray(x)),
        cp.asarray(np.ascontiguousarray(x[:, ::-1]))[:, ::-1],
        cp.asarray(x)[::2, 3:],
    ):
        expect = view.get()
        a = ts.twell_array(view, tile_n=64, capacity=4)
        np.testing.assert_array_equal(a.toarray().get(), expect)


def test_special_values(cp):
    x = np.zeros((2, 300), np.float32)
    x[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    x[1, 299] = 5.0
    a = ts.twell_array(cp.asarray(x), tile_n=32)
    assert a.nnz == 4  # NaN, +-Inf and 5; -0.0 is not stored
    np.testing.assert_array_equal(a.toarray().get(), x)
    t = ts.from_dense(cp.asarray(x), threshold=1.0, tile_n=32)
    assert t.nnz == 3  # NaN fails |x| > t


@pytest.mark.parametrize("dtype", [np.float32, ts.bfloat16])
def test_threshold_matches_reference(cp, rng, dtype):
    x = rng.standard_normal((33, 777)).astype(dtype)
    cpu = ts.from_dense(x, threshold=2.0, tile_n=128, capacity=4)
    gpu = ts.from_dense(cp.asarray(x), threshold=2.0, tile_n=128, capacity=4)
    assert_parts_equal(gpu, cpu)


def test_overflow_policies(cp, rng):
    x = np.zeros((4, 64), np.float32)
    x[2, :32] = rng.random(32) + 1  # row 2, tile 0: 32 nonzeros
    x[1, 32:40] = 1.0  # row 1, tile 1: 8 nonzeros
    g = cp.asarray(x)
    before = g.copy()
    with pytest.raises(ts.TwELLCapacityError) as err:
        ts.twell_array(g, tile_n=32, capacity=8, overflow="error")
    assert (err.value.row, err.value.tile, err.value.count) == (2, 0, 32)
    assert bool((g == before).all())
    with pytest.warns(ts.TwELLDroppedEntriesWarning):
        d = ts.twell_array(g, tile_n=32, capacity=8, overflow="drop")
    assert d.n_dropped == 24
    kept = x.copy()
    kept[2, 8:32] = 0
    np.testing.assert_array_equal(d.toarray().get(), kept)
    s = ts.twell_array(g, tile_n=32, capacity=8)
    assert s.n_spilled == 24
    np.testing.assert_array_equal(s.toarray().get(), x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cupyx_csr_roundtrip(cp, rng, dtype):
    import cupyx.scipy.sparse as csp

    m = sp.random(45, 500, density=0.1, format="csr", dtype=dtype, random_state=np.random.RandomState(1))
    gm = csp.csr_matrix(m)
    a = ts.twell_array(gm, tile_n=32, capacity=2)
    cpu = ts.twell_array(m, tile_n=32, capacity=2)
    assert_parts_equal(a, cpu)
    back = a.tocsr()
    np.testing.assert_array_equal(back.toarray().get(), m.toarray())
    np.testing.assert_array_equal(back.indptr.get(), m.indptr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_twell_to_csr_and_ell(cp, rng, dtype):
    x = _random_dense(rng, 40, 1100, 0.08, dtype)
    a = ts.twell_array(cp.asarray(x), tile_n=64, capacity=3)
    vals, cols, indptr = ts._convert.twell_to_csr_arrays(a.parts, a.shape, a.tile_n)
    expect = sp.csr_array(x.astype(np.float64))
    np.testing.assert_array_equal(indptr.get(), expect.indptr)
    np.testing.assert_array_equal(cols.get(), expect.indices)
    np.testing.assert_array_equal(vals.get().astype(np.float64), expect.data)
    v, i = a.toell()
    cv, ci = ts.twell_array(x, tile_n=64, capacity=3).toell()
    np.testing.assert_array_equal(i.get(), ci)
    np.testing.assert_array_equal(_bits(v.get()), _bits(cv))
    b = ts.from_ell(v, i, shape=a.shape, tile_n=64, capacity=3)
    assert_parts_equal(b, ts.twell_array(x, tile_n=64, capacity=3))


def test_tocsr_16bit_warns_and_is_exact(cp, rng):
    x = _random_dense(rng, 10, 300, 0.1, ts.bfloat16)
    a = ts.twell_array(cp.asarray(x))
    with pytest.warns(ts.TwELLFallbackWarning):
        c = a.tocsr()
    np.testing.assert_array_equal(c.toarray().get(), x.astype(np.float32))


def test_structure_ops_on_gpu(cp, rng):
    x = sparse_activations(30, 600, 0.05, "skewed", np.float32, rng)
    a = ts.twell_array(cp.asarray(x), tile_n=32, capacity=1)
    np.testing.assert_allclose(float(a.sum()), x.astype(np.float64).sum(), rtol=1e-6)
    np.testing.assert_allclose(a.sum(axis=0).get(), x.sum(axis=0), rtol=1e-5)
    np.testing.assert_allclose(a.sum(axis=1).get(), x.sum(axis=1), rtol=1e-5)
    m = a.multiply(cp.asarray(x))
    np.testing.assert_allclose(m.toarray().get(), x * x, rtol=1e-6)
    b16 = a.astype(ts.bfloat16)
    np.testing.assert_array_equal(b16.toarray().get(), x.astype(ts.bfloat16))
    z = a.multiply(0.0)
    z.eliminate_zeros()
    assert z.nnz == 0
    z.check_format(full_check=True)
    assert a.get().nnz == a.nnz
    np.testing.assert_array_equal(a.get().toarray(), x)


def test_device_mismatch_raises(cp, rng):
    a = ts.twell_array(cp.asarray(_random_dense(rng, 4, 40, 0.3, np.float32)), tile_n=32)
    with pytest.raises(ValueError, match="b: expected an array on cuda"):
        ts.matmul(a, np.ones((40, 3), np.float32))


def test_dlpack_producer(cp, rng):
    torch = pytest.importorskip("torch")
    x = _random_dense(rng, 9, 300, 0.1, np.float32)
    t = torch.from_numpy(x).cuda()
    a = ts.twell_array(t, tile_n=32)
    np.testing.assert_array_equal(a.toarray().get(), x)
    tb = t.to(torch.bfloat16)
    ab = ts.twell_array(tb, tile_n=32)
    assert ab.dtype == ts.bfloat16
    np.testing.assert_array_equal(ab.toarray().get(), x.astype(ts.bfloat16))


def test_current_stream_is_used(cp, rng):
    x = _random_dense(rng, 64, 2000, 0.05, np.float32)
    b = rng.standard_normal((2000, 33)).astype(np.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a = ts.twell_array(cp.asarray(x), tile_n=256, capacity=8)
        out = a @ cp.asarray(b)
    s.synchronize()
    np.testing.assert_allclose(
        out.get(), ref.matmul(ts.twell_array(x).parts, x.shape, 256, b, np.float64), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("overflowing", [False, True])
def test_exact_finish_waits_for_the_pack_only(cp, rng, overflowing):
    """With the overflow count sent right behind pass 1 (count_now), the exact finish returns
    while later work is still queued (here a 300 ms spin) when nothing spilled, and the parts
    equal the CPU pack's bit for bit either way."""
    import time

    from twellsparse import _gpu_convert
    from twellsparse import _kernels as K

    h = cp.asarray(sparse_activations(64, 1000, 0.3 if overflowing else 0.01, "uniform", np.float32, rng))
    _, finish = _gpu_convert.dense_to_parts_deferred(h, 256, 32)
    finish.count_now()
    K.get_kernel("twell_spin")((1,), (1,), (np.int64(300_000_000),))  # 300 ms of later work
    t0 = time.perf_counter()
    parts, dropped = finish("spill")
    waited = time.perf_counter() - t0
    if not overflowing:
        assert waited < 0.15  # the count was ready long before the spin ends
    cp.cuda.get_current_stream().synchronize()
    # The CPU pack, not dense_to_parts (which is this same deferred path plus finish).
    want = ts.twell_array(cp.asnumpy(h), tile_n=256, capacity=32).parts
    assert dropped == 0
    for name, a, b in zip(ts.TwELLParts._fields, parts, want, strict=True):
        np.testing.assert_array_equal(_bits(cp.asnumpy(a)), _bits(b), err_msg=name)
