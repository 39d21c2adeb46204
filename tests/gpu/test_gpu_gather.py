"""The row-gather kernels (cuda/twell_gather.cu) against the float64 reference: SpMM in every
instantiated variant, SDDMM with and without the pattern's scale, and the gated consumer,
on shapes that exercise several column passes, several 32-entry batches per row, more than 32
tiles per row, spill entries and empty rows."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import product_bound

import twellsparse as ts
from twellsparse import _gpu_ops
from twellsparse import _kernels as K
from twellsparse.testing import rel_error, sparse_activations

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16, np.float32, np.float64]


def _round(x, dtype):
    return np.asarray(x, dtype=np.float64).astype(dtype).astype(np.float64)


# (m, n, k, tile_n, capacity, density): k values are multiples of 16 bytes for every dtype, and
# several exceed one column pass of a variant (KV x 32 x 16 bytes), so the pass loop and a
# partial last pass run.
SHAPES = [
    (67, 5632, 2048, 256, None, 0.01),
    (33, 2000, 1040, 32, 2, 0.08),  # 63 tiles (two groups of 32), heavy spill, 2 passes
    (16, 700, 8, 64, 1, 0.3),  # many entries per row: several 32-entry batches, all spilling
    (5, 300, 4104, 128, 8, 0.02),  # 5 passes for fp16/bf16, a partial last one
]


def _problem(cp, rng, m, n, tile_n, capacity, density, dtype):
    h = sparse_activations(m, n, density, "skewed", dtype, rng)
    h[m // 2] = 0  # an empty row
    return h, ts.twell_array(cp.asarray(h), tile_n=tile_n, capacity=capacity)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_spmm_variants(cp, rng, dtype, m, n, k, tile_n, capacity, density):
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    b = rng.standard_normal((n, k)).astype(dtype)
    expected = h.astype(np.float64) @ b.astype(np.float64)
    for variant in K.GATHER_VARIANTS:
        out = cp.empty((m, k), dtype=dtype)
        _gpu_ops.spmm(a.parts, tile_n, cp.asarray(b), out, path="gather", variant=variant)
        assert rel_error(out, expected) <= product_bound(dtype, expected), variant


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [False, True])
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_sddmm(cp, rng, dtype, scale, m, n, k, tile_n, capacity, density):
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    x = rng.standard_normal((m, k)).astype(dtype)
    y = rng.standard_normal((n, k)).astype(dtype)
    dots = x.astype(np.float64) @ y.astype(np.float64).T
    expected = np.where(h != 0, dots * (h.astype(np.float64) if scale else 1.0), 0.0)
    for variant in K.GATHER_VARIANTS:
        parts = _gpu_ops.sddmm(a.parts, tile_n, cp.asarray(x), cp.asarray(y), scale, path="gather", variant=variant)
        got = ts.twell_array._from_parts(parts, (m, n), tile_n)
        assert rel_error(got.toarray(), expected) <= product_bound(dtype, expected), variant
        assert not cp.isnan(got.data).any()  # padding written (allocations are poisoned)
    portable = _gpu_ops.sddmm(a.parts, tile_n, cp.asarray(x), cp.asarray(y), scale, path="portable")
    assert rel_error(got.toarray(), ts.twell_array._from_parts(portable, (m, n), tile_n).toarray()) <= product_bound(
        dtype, expected
    )


def test_sddmm_ignores_pattern_values_of_another_dtype(cp, rng):
    """Without the scale, the pattern's values are never read, so their dtype may differ."""
    h, a = _problem(cp, rng, 40, 900, 128, 3, 0.05, np.float64)
    x = rng.standard_normal((40, 64)).astype(np.float16)
    y = rng.standard_normal((900, 64)).astype(np.float16)
    parts = _gpu_ops.sddmm(a.parts, 128, cp.asarray(x), cp.asarray(y), False, path="gather")
    got = ts.twell_array._from_parts(parts, (40, 900), 128).toarray()
    dots = x.astype(np.float64) @ y.astype(np.float64).T
    expected = np.where(h != 0, dots, 0.0)
    assert rel_error(got, expected) <= product_bound(np.float16, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_gated_consumer(cp, rng, dtype, m, n, k, tile_n, capacity, density):
    """u against the exact dot rounded to the value type (zero padding), out against the float64
    product of h = gate * u rounded from the kernel's own u (a u that fp32 sums round the other
    way near a tie moves a few outputs by a whole ulp of h, more than the bound of small shapes
    allows), and the call without keep_up bitwise the one with it."""
    g, gate = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    d_model = k
    x = rng.standard_normal((m, d_model)).astype(dtype)
    w_up = (rng.standard_normal((n, d_model)) / np.sqrt(d_model)).astype(dtype)
    w_down_t = rng.standard_normal((n, k)).astype(dtype)
    u = np.where(g != 0, _round(x.astype(np.float64) @ w_up.astype(np.float64).T, dtype), 0.0)
    for variant in K.GATHER_VARIANTS:
        args = (gate.parts, tile_n, cp.asarray(x), cp.asarray(w_up), cp.asarray(w_down_t))
        out, up = _gpu_ops.gated_consumer(*args, True, variant)
        assert out.shape == (m, k)
        got_u = cp.asnumpy(ts.twell_array._from_parts(up, (m, n), tile_n).toarray()).astype(np.float64)
        assert rel_error(got_u, u) <= product_bound(dtype, u), variant
        assert not cp.isnan(up.data).any()
        hidden = np.where(g != 0, _round(g.astype(np.float64) * got_u, dtype), 0.0)
        expected = hidden @ w_down_t.astype(np.float64)
        assert rel_error(out, expected) <= product_bound(dtype, expected), variant
        alone, none = _gpu_ops.gated_consumer(*args, False, variant)
        assert none is None
        np.testing.assert_array_equal(cp.asnumpy(alone).view(np.uint8), cp.asnumpy(out).view(np.uint8))


def test_gated_product_fused_matches_unfused(cp, rng):
    """ts-level gated_product: the fused kernel and the SDDMM + SpMM fallback agree."""
    from twellsparse._ops import gated_product

    g, gate = _problem(cp, rng, 50, 1000, 256, 4, 0.03, ts.bfloat16)
    x = cp.asarray(rng.standard_normal((50, 256)).astype(ts.bfloat16))
    w_up = cp.asarray((rng.standard_normal((1000, 256)) / 16).astype(ts.bfloat16))
    w_down_t = cp.asarray(rng.standard_normal((1000, 256)).astype(ts.bfloat16))
    fused, u = gated_product(x, w_up, w_down_t, gate, keep_up=True)
    # 255 columns are not a multiple of 16 bytes: the unfused SDDMM + SpMM fallback runs.
    unfused, u2 = gated_product(x[:, :255], w_up[:, :255], w_down_t, gate, keep_up=True)
    assert u is not None and u2 is not None
    for out, xx, wu in ((fused, x, w_up), (unfused, x[:, :255], w_up[:, :255])):
        uu = _round(cp.asnumpy(xx).astype(np.float64) @ cp.asnumpy(wu).astype(np.float64).T, ts.bfloat16)
        hh = np.where(g != 0, _round(g.astype(np.float64) * uu, ts.bfloat16), 0.0)
        exp = hh @ cp.asnumpy(w_down_t).astype(np.float64)
        assert rel_error(out, exp) <= product_bound(ts.bfloat16, exp)


def test_gather_path_needs_aligned_rows(cp, rng):
    h, a = _problem(cp, rng, 10, 300, 64, 2, 0.1, np.float32)
    b = cp.asarray(rng.standard_normal((300, 7)).astype(np.float32))  # 28-byte rows
    out = cp.empty((10, 7), dtype=np.float32)
    with pytest.raises(ValueError, match="path: 'gather' needs 16-byte-aligned"):
        _gpu_ops.spmm(a.parts, 64, b, out, path="gather")
    _gpu_ops.spmm(a.parts, 64, b, out, path="auto")  # falls back to the portable kernel
    np.testing.assert_allclose(out.get(), h.astype(np.float64) @ b.get(), rtol=1e-5, atol=1e-5)
    assert not _gpu_ops.gated_consumer_eligible(b[:, :5], b[:, :5], b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_transposed_product_through_csr(cp, rng, dtype, m, n, k, tile_n, capacity, density):
    """A.T @ g by the CSR of A.T and the row-gather kernel (hot columns, spill, empty rows)."""
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    g = rng.standard_normal((m, k)).astype(dtype)
    expected = h.astype(np.float64).T @ g.astype(np.float64)
    out = cp.empty((n, k), dtype=dtype)
    _gpu_ops.spmm_transposed(a.parts, tile_n, n, cp.asarray(g), out)
    assert rel_error(out, expected) <= product_bound(dtype, expected)
    _check_transposed_pattern(_gpu_ops.transposed_pattern(a.parts, tile_n, n), a, h)
    # A second matrix of the same structure times the same g, in the same pass (the pair kernel).
    from twellsparse._ops import with_values

    a2 = with_values(a, *(cp.asarray(rng.standard_normal(v.shape).astype(dtype)) for v in (a.data, a.spill_data)))
    out1, out2 = cp.empty((n, k), dtype=dtype), cp.empty((n, k), dtype=dtype)
    for o in (out1, out2):
        o.view(cp.uint8).fill(0xFF)  # NaN in every dtype: rows the kernel misses would show
    _gpu_ops.spmm_transposed(a.parts, tile_n, n, cp.asarray(g), out1, second=(a2.parts, out2))
    expected2 = a2.toarray().get().astype(np.float64).T @ g.astype(np.float64)
    assert rel_error(out1, expected) <= product_bound(dtype, expected)
    assert rel_error(out2, expected2) <= product_bound(dtype, expected2)
    # Column passes split between warps: the same sums in the same order, so the same bits
    # (7 leaves idle warps where the passes are fewer), single and paired.
    for split in (2, 3, 7):
        s1, s2 = (cp.full((n, k), np.nan, dtype=dtype) for _ in range(2))
        _gpu_ops.spmm_transposed(a.parts, tile_n, n, cp.asarray(g), s1, column_split=split)
        np.testing.assert_array_equal(s1.view(cp.uint8).get(), out.view(cp.uint8).get())
        s1.fill(np.nan)
        _gpu_ops.spmm_transposed(a.parts, tile_n, n, cp.asarray(g), s1, second=(a2.parts, s2), column_split=split)
        np.testing.assert_array_equal(s1.view(cp.uint8).get(), out1.view(cp.uint8).get())
        np.testing.assert_array_equal(s2.view(cp.uint8).get(), out2.view(cp.uint8).get())
    with pytest.raises(ValueError, match="column_split: expected a positive integer, got 0"):
        _gpu_ops.spmm_transposed(a.parts, tile_n, n, cp.asarray(g), out, column_split=0)


def _check_transposed_pattern(t, a, h):
    """The counting sort's structure of A.T, read through its sources, is exactly h.T, with each
    column's tokens increasing."""
    n, m = h.shape[1], h.shape[0]
    ip = t.indptr.get()
    nnz = int(ip[-1])
    assert ip[0] == 0 and np.all(np.diff(ip) >= 0) and t.rows.size >= nnz
    rows, src = t.rows[:nnz].get(), t.sources[:nnz].get()
    values = np.concatenate([a.parts.data.get().reshape(-1), a.parts.spill_data.get()]).astype(np.float64)
    assert t.n_slots == a.parts.data.size and np.all((src >= 0) & (src < values.size))
    t_csr = np.zeros((n, m))
    for r in range(n):
        seg = slice(ip[r], ip[r + 1])
        assert np.all(np.diff(rows[seg]) > 0)  # tokens increasing within each row
        t_csr[r, rows[seg]] = values[src[seg]]
    np.testing.assert_array_equal(t_csr, h.astype(np.float64).T)
    assert nnz == np.count_nonzero(h)


def test_transposed_pattern_of_a_fixed_spill_captured_in_a_cuda_graph(cp, rng):
    """The transposed pattern reads nothing back: it is captured in a CUDA graph with the
    producer's fixed spill (zero-padded past the row pointers' end), and each replay on new
    tokens gives the transpose of their exact pattern."""
    from twellsparse import _ops
    from twellsparse._twell import twell_array

    m, n, k, tile_n, cap = 300, 1000, 48, 64, 2
    w = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
    # Independent draws: the second replay must find a new ReLU pattern (a scaled copy of the
    # first draw keeps its signs, so its pattern).
    xs = [rng.standard_normal((m, k)).astype(np.float32) for _ in range(2)]
    x = cp.asarray(xs[0])

    def pattern():
        _, finish = _ops.linear_to_parts_deferred(x, w, "relu", tile_n, cap, None)
        parts, _ = finish("spill", spill_capacity=m * n // 2)
        return parts, _gpu_ops.transposed_pattern(parts, tile_n, n)

    pool = cp.cuda.MemoryPool()
    stream = cp.cuda.Stream(non_blocking=True)
    with cp.cuda.using_allocator(pool.malloc), stream:
        pattern()  # compiles the kernels and makes the library handles before the capture
        stream.synchronize()
        stream.begin_capture()
        parts, t = pattern()
        graph = stream.end_capture()
    for xi in xs:
        x[...] = cp.asarray(xi)
        for written in (t.indptr, t.rows, t.sources):
            written.fill(-1)  # poison: what a replay leaves unwritten cannot pass as its result
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        exact = ts.linear_to_twell(cp.asarray(xi), w, activation="relu", tile_n=tile_n, capacity=cap)
        assert exact.parts.spill_data.size > 0  # the replays spill
        _check_transposed_pattern(t, twell_array._from_parts(parts, (m, n), tile_n), exact.toarray().get())


def test_auto_path_warns_when_it_takes_the_portable_kernels(cp, rng):
    """Rows that are not 16-byte multiples (k = 7 bf16 values) run the portable kernels and say
    so; aligned rows run the gather kernels silently."""
    import warnings

    h, a = _problem(cp, rng, 20, 300, 64, 2, 0.05, ts.bfloat16)
    odd = cp.asarray(rng.standard_normal((300, 7)).astype(ts.bfloat16))
    with pytest.warns(ts.TwELLFallbackWarning, match="matmul: .* portable kernel"):
        got = ts.matmul(a, odd)
    assert rel_error(got, h.astype(np.float64) @ cp.asnumpy(odd).astype(np.float64)) < 2e-2
    even = cp.asarray(rng.standard_normal((300, 8)).astype(ts.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ts.TwELLFallbackWarning)
        ts.matmul(a, even)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_fused_gated_backward_matches_the_unfused_path(cp, rng, dtype, m, n, k, tile_n, capacity, density):
    """d_h = dY @ W_down at the gate's pattern and its three value products from one kernel:
    bitwise the SDDMM followed by product_values (the unfused backward), spill included."""
    from twellsparse._ops import fused_gated_backward, product_values, sddmm, with_values

    _, g = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    up = rng.standard_normal(g.data.shape).astype(dtype)
    up[np.arange(g.data.shape[2]) >= g.counts.get()[..., None]] = 0  # zero padding, as the consumer writes
    u = with_values(g, cp.asarray(up), cp.asarray(rng.standard_normal(g.spill_data.shape).astype(dtype)))
    dy = cp.asarray(rng.standard_normal((m, k)).astype(dtype))
    w_down_t = cp.asarray(rng.standard_normal((n, k)).astype(dtype))
    fused = fused_gated_backward(dy, w_down_t, g, u)
    assert fused is not None
    d_h = sddmm(dy, w_down_t, g)
    want = (product_values(d_h, u), product_values(d_h, g), product_values(g, u))
    n_spill = int(g.spill_indptr[-1])
    for got, exp in zip(fused, want, strict=True):
        np.testing.assert_array_equal(got.data.get().view(np.uint8), exp.data.get().view(np.uint8))
        spill_got, spill_exp = got.spill_data[:n_spill].get(), exp.spill_data[:n_spill].get()
        np.testing.assert_array_equal(spill_got.view(np.uint8), spill_exp.view(np.uint8))
