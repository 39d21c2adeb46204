"""GPU products, SDDMM, the producer and FFN blocks against the float64 CPU reference.

16-bit results are judged against the error of the same computation done densely in the same
precision (rounding where the sparse path rounds), in the spirit of flash-attention's tests.
"""

from __future__ import annotations

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _reference as ref
from twellsparse.testing import ffn_problem, rel_error, sparse_activations

pytestmark = pytest.mark.gpu

FLOAT_TOL = {np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-12}


def _bound(dtype, dense_err):
    dt = np.dtype(dtype)
    if dt in FLOAT_TOL:
        return FLOAT_TOL[dt]
    return 2.0 * dense_err + 1e-4


def _round(x, dtype):
    return np.asarray(x, dtype=np.float64).astype(dtype).astype(np.float64)


SHAPES = [
    (37, 301, 19, 32, 3),
    (128, 5632, 64, 256, None),
    (5, 70001, 7, 1024, 4),
    (1, 1, 1, 32, 1),
    (300, 700, 513, 64, 2),
]


def _activations(m, n, pattern, dtype, rng):
    """sparse_activations at density 0.05 with one entry forced where none fired: the 1 x 1 shape
    is otherwise the zero matrix 95% of the time (a no-op for the larger shapes)."""
    x = sparse_activations(m, n, 0.05, pattern, dtype, rng)
    if not x.any():
        x[rng.integers(m), rng.integers(n)] = 1.0 + rng.random()
    return x


@pytest.mark.parametrize("dtype", [np.float16, ts.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("m, n, k, tile_n, capacity", SHAPES)
def test_matmul_and_transposed(cp, rng, dtype, m, n, k, tile_n, capacity):
    x = _activations(m, n, "skewed", dtype, rng)
    a_cpu = ts.twell_array(x, tile_n=tile_n, capacity=capacity)
    a = ts.twell_array(cp.asarray(x), tile_n=tile_n, capacity=capacity)
    b = rng.standard_normal((n, k)).astype(dtype)
    g = rng.standard_normal((m, k)).astype(dtype)
    exp_b = x.astype(np.float64) @ b.astype(np.float64)
    exp_g = x.astype(np.float64).T @ g.astype(np.float64)
    out = a @ cp.asarray(b)
    dense_err = rel_error(_round(exp_b, dtype), exp_b)
    assert rel_error(out, exp_b) <= _bound(dtype, dense_err)
    assert rel_error(ts.matmul(a_cpu, b), exp_b) <= _bound(dtype, dense_err)
    out_t = ts.matmul(a.T, cp.asarray(g))
    assert out_t.shape == (n, k)
    assert rel_error(out_t, exp_g) <= _bound(dtype, rel_error(_round(exp_g, dtype), exp_g))


def test_matmul_out_vector_and_strided(cp, rng):
    x = sparse_activations(40, 900, 0.03, "uniform", np.float32, rng)
    a = ts.twell_array(cp.asarray(x), tile_n=128, capacity=2)
    b = rng.standard_normal((900, 70)).astype(np.float32)
    exact = x.astype(np.float64) @ b.astype(np.float64)  # the reference in float64
    out = cp.full((40, 70), np.nan, dtype=np.float32)
    res = ts.matmul(a, cp.asarray(b), out=out)
    assert res is out
    np.testing.assert_allclose(out.get(), exact, rtol=1e-4, atol=1e-4)
    v = a @ cp.asarray(b[:, 0])
    assert v.shape == (40,)
    np.testing.assert_allclose(v.get(), exact[:, 0], rtol=1e-4, atol=1e-4)
    bs = cp.asarray(b)[:, ::3]  # non-unit column stride
    np.testing.assert_allclose((a @ bs).get(), exact[:, ::3], rtol=1e-4, atol=1e-4)
    bf = cp.asfortranarray(cp.asarray(b))
    np.testing.assert_allclose((a @ bf).get(), exact, rtol=1e-4, atol=1e-4)
    outf = cp.full((70, 40), np.nan, dtype=np.float32).T  # strided out
    ts.matmul(a, cp.asarray(b), out=outf)
    np.testing.assert_allclose(outf.get(), exact, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float16, ts.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("m, n, k, tile_n, capacity", SHAPES)
def test_sddmm(cp, rng, dtype, m, n, k, tile_n, capacity):
    pat = _activations(m, n, "uniform", np.float32, rng)
    p = ts.twell_array(cp.asarray(pat), tile_n=tile_n, capacity=capacity)
    x = rng.standard_normal((m, k)).astype(dtype)
    y = rng.standard_normal((n, k)).astype(dtype)
    s = ts.sddmm(cp.asarray(x), cp.asarray(y), p)
    assert s.dtype == np.dtype(dtype)
    full = x.astype(np.float64) @ y.astype(np.float64).T
    expect = np.where(pat != 0, full, 0.0)
    np.testing.assert_array_equal(s.counts.get(), p.counts.get())
    got = s.toarray().get().astype(np.float64)
    mask = pat != 0
    scale = np.abs(x.astype(np.float64)) @ np.abs(y.astype(np.float64)).T
    tol = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}.get(np.dtype(dtype), 1e-2)
    assert np.all(np.abs(got - expect)[mask] <= tol * scale[mask] + 1e-30)
    assert np.all(got[~mask] == 0)


@pytest.mark.parametrize(
    "activation, threshold",
    [("relu", None), ("relu2", None), ("silu", 0.5), ("gelu", 0.5), ("identity", 1.0), ("relu", 0.25)],
)
def test_linear_to_twell(cp, rng, activation, threshold):
    x = rng.standard_normal((67, 48)).astype(np.float32)
    w = rng.standard_normal((600, 48)).astype(np.float32) / 7
    a = ts.linear_to_twell(
        cp.asarray(x), cp.asarray(w), activation=activation, threshold=threshold, tile_n=64, capacity=4
    )
    a.check_format(full_check=True)
    h = ref.linear_dense(x, w, activation)
    expect = np.where(ref.keep_mask(h, threshold), h, 0.0)
    got = a.toarray().get().astype(np.float64)
    # Entries within rounding of the threshold may fall either way; everything else must match.
    edge = np.abs(np.abs(h) - (threshold or 0.0)) <= 1e-4 * (1 + np.abs(h))
    np.testing.assert_allclose(np.where(edge, 0, got), np.where(edge, 0, expect), rtol=1e-4, atol=1e-4)


def test_linear_to_twell_overflow_error_and_spill(cp, rng):
    x = rng.standard_normal((20, 16)).astype(np.float32)
    w = rng.standard_normal((300, 16)).astype(np.float32)
    with pytest.raises(ts.TwELLCapacityError):
        ts.linear_to_twell(cp.asarray(x), cp.asarray(w), tile_n=32, capacity=2, overflow="error")
    a = ts.linear_to_twell(cp.asarray(x), cp.asarray(w), tile_n=32, capacity=2)
    assert a.n_spilled > 0
    expect = np.maximum(x.astype(np.float64) @ w.astype(np.float64).T, 0)
    np.testing.assert_allclose(a.toarray().get(), expect, rtol=1e-5, atol=1e-5)


def _dense_same_precision(p, dtype, gated):
    """The dense FFN in ``dtype`` with fp32 accumulation: rounding where a dense kernel rounds."""
    x, wg, wu, wd = (p[k].astype(np.float32) for k in ("x", "w_gate", "w_up", "w_down"))
    g = _round(np.maximum(_round(x @ wg.T, dtype), 0), dtype)
    h = _round(g * _round(x @ wu.T, dtype), dtype) if gated else g
    return _round(h.astype(np.float32) @ wd.T, dtype)


@pytest.mark.parametrize("dispatch", ["sparse", "dense"])
@pytest.mark.parametrize("dtype", [ts.bfloat16, np.float16, np.float32])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(
    "m, d_model, d_ff, density, pattern, capacity",
    [
        (300, 128, 1000, 0.02, "skewed", None),
        (77, 96, 517, 0.05, "uniform", 2),
        (1, 64, 256, 0.3, "uniform", 4),
    ],
)
def test_ffn_blocks(cp, rng, dtype, gated, m, d_model, d_ff, density, pattern, capacity, dispatch):
    p = ffn_problem(m, d_model, d_ff, density, pattern, dtype, rng)
    x, wg, wu, wd = (cp.asarray(p[k]) for k in ("x", "w_gate", "w_up", "w_down"))
    if gated:
        out = ts.gated_ffn(x, wg, wu, wd, tile_n=64, capacity=capacity, dispatch=dispatch)
    else:  # w_gate's rates set the density
        out = ts.ffn(x, wg, wd, tile_n=64, capacity=capacity, dispatch=dispatch)
    assert out.dtype == np.dtype(dtype) and out.shape == (m, d_model)
    if gated:
        exact = ref.gated_ffn_dense(p["x"], p["w_gate"], p["w_up"], p["w_down"], "relu")
    else:
        exact = ref.ffn_dense(p["x"], p["w_gate"], p["w_down"], "relu")
    if np.dtype(dtype) == np.float32:
        bound = 1e-5
    else:
        bound = 2.0 * rel_error(_dense_same_precision(p, dtype, gated), exact) + 1e-4
    assert rel_error(out, exact) <= bound


PATH_CASES = [
    # m, n, k, tile_n, capacity, density: spill, tiny and huge tiles, dense rows, and a k whose
    # rows are not a multiple of 16 bytes (portable path only; "gather" must refuse it)
    (60, 500, 19, 128, 3, 0.1),
    (300, 1000, 128, 256, 4, 0.05),
    (129, 5632, 256, 256, None, 0.01),
    (1000, 700, 64, 1024, 8, 0.5),
    (77, 2049, 40, 32, 2, 0.2),
    (5, 300, 8, 64, None, 0.9),
]


@pytest.mark.parametrize("dtype", [np.float16, ts.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", PATH_CASES)
def test_gather_and_portable_paths(cp, rng, dtype, m, n, k, tile_n, capacity, density):
    from twellsparse import _gpu_ops

    pattern = "skewed" if density < 0.1 else "uniform"
    h = sparse_activations(m, n, density, pattern, dtype, rng)
    a = ts.twell_array(cp.asarray(h), tile_n=tile_n, capacity=capacity)
    w = rng.standard_normal((n, k)).astype(dtype)
    x = rng.standard_normal((m, k)).astype(dtype)
    exact = h.astype(np.float64) @ w.astype(np.float64)
    bound = _bound(dtype, rel_error(_round(exact, dtype), exact))
    gather_ok = (k * np.dtype(dtype).itemsize) % 16 == 0
    paths = ("gather", "portable") if gather_ok else ("portable",)
    for path in paths:
        out = cp.full((m, k), np.nan, dtype=dtype)
        _gpu_ops.spmm(a.parts, tile_n, cp.asarray(w), out, path=path)
        assert rel_error(out, exact) <= bound, path
    mask = h != 0
    full = x.astype(np.float64) @ w.astype(np.float64).T
    expect = np.where(mask, full * h.astype(np.float64), 0.0)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T * np.abs(h.astype(np.float64))
    tol = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}.get(np.dtype(dtype), 1e-2)
    for path in paths:
        parts = _gpu_ops.sddmm(a.parts, tile_n, cp.asarray(x), cp.asarray(w), scale=True, path=path)
        got = ts.twell_array._from_parts(parts, a.shape, tile_n).toarray().get().astype(np.float64)
        assert np.all(np.abs(got - expect) <= tol * scale + 1e-30), path
    if not gather_ok:
        with pytest.raises(ValueError, match="path"):
            _gpu_ops.spmm(a.parts, tile_n, cp.asarray(w), cp.empty((m, k), dtype=dtype), path="gather")


@pytest.mark.parametrize("dtype", [ts.bfloat16, np.float32])
def test_plans_on_gpu(cp, rng, dtype):
    p = ffn_problem(500, 256, 2000, 0.01, "skewed", dtype, rng)
    x, wg, wu, wd = (cp.asarray(p[k]) for k in ("x", "w_gate", "w_up", "w_down"))
    exact = ref.gated_ffn_dense(p["x"], p["w_gate"], p["w_up"], p["w_down"], "relu")
    plan = ts.GatedFFN(wg, wu, wd, dispatch="sparse")
    out = plan(x)
    bound = (
        1e-5 if np.dtype(dtype) == np.float32 else 2 * rel_error(_dense_same_precision(p, dtype, True), exact) + 1e-4
    )
    assert rel_error(out, exact) <= bound
    # The one-shot function builds its own plan: same kernels, same result up to rounding.
    again = ts.gated_ffn(x, wg, wu, wd, dispatch="sparse")
    assert rel_error(out, again) <= (2e-6 if np.dtype(dtype) == np.float32 else 1e-2)
    assert 0.005 < plan.last_stats["density"] < 0.02


def test_transposed_products_share_one_sort(cp, rng, monkeypatch):
    """The backward's transposed products on one pattern (one sort of its transpose) equal the
    products made one by one, bit for bit, spill included, and float64 within rounding; the two
    consecutive pairs with one b run in the paired kernel (one pass for both)."""
    from twellsparse import _gpu_ops, _tiled_spmm
    from twellsparse._ops import transposed_products, values_op, with_values

    monkeypatch.setattr(_tiled_spmm, "PREFERRED", False)  # the gather kernels, whatever the env
    paired = []
    spmm_transposed = _gpu_ops.spmm_transposed

    def recording(*args, **kw):
        paired.append(kw.get("second", args[6] if len(args) > 6 else None) is not None)
        return spmm_transposed(*args, **kw)

    monkeypatch.setattr(_gpu_ops, "spmm_transposed", recording)
    h = sparse_activations(300, 700, 0.03, "skewed", ts.bfloat16, rng)
    a = ts.twell_array(cp.asarray(h), tile_n=64, capacity=2)
    assert a.n_spilled > 0
    other = with_values(a, values_op(lambda v: v * 2, a.parts.data), values_op(lambda v: v * 3, a.parts.spill_data))
    b1 = cp.asarray(rng.standard_normal((300, 64)).astype(ts.bfloat16))
    b2 = cp.asarray(rng.standard_normal((300, 32)).astype(ts.bfloat16))
    # The first two share b1 (the same object): the paired kernel; the third runs alone.
    pairs = [(a, b1), (other, b1), (a, b2)]
    got = transposed_products(a, pairs)
    assert paired == [True, False]
    for g, (x, b) in zip(got, pairs, strict=True):
        want = ts.matmul(x.T, b)
        np.testing.assert_array_equal(cp.asnumpy(g).view(np.uint16), cp.asnumpy(want).view(np.uint16))
        # x's values from its host copy (other: slots doubled, spill tripled), in float64.
        exact = x.get().toarray().astype(np.float64).T @ cp.asnumpy(b).astype(np.float64)
        assert rel_error(g, exact) <= _bound(ts.bfloat16, rel_error(_round(exact, ts.bfloat16), exact))


@pytest.mark.parametrize("dtype", [ts.bfloat16, np.float16, np.float32, np.float64])
def test_product_values_fused_equals_the_float32_route(cp, rng, dtype):
    """The backward's value products in one fused pass give the bits of cast-multiply-round."""
    from twellsparse._ops import product_values, values_op, with_values

    h = sparse_activations(200, 500, 0.05, "skewed", dtype, rng)
    a = ts.twell_array(cp.asarray(h), tile_n=64, capacity=2)
    b = with_values(
        a, values_op(lambda v: v * 1.7 - 0.3, a.parts.data), values_op(lambda v: v * 0.5 + 1, a.parts.spill_data)
    )
    got = product_values(a, b)
    width = np.dtype(dtype).itemsize
    for g, p, q in (
        (got.parts.data, a.parts.data, b.parts.data),
        (got.parts.spill_data, a.parts.spill_data, b.parts.spill_data),
    ):
        want = values_op(lambda u, v: u * v, p, q)
        np.testing.assert_array_equal(cp.asnumpy(g).view(f"u{width}"), cp.asnumpy(want).view(f"u{width}"))


@pytest.mark.parametrize("dtype", [ts.bfloat16, np.float16, np.float32, np.float64])
@pytest.mark.parametrize("k", [64, 19])  # 16-byte rows: the gather kernel; 19: the portable route
def test_matmul_sum_against_float64(cp, rng, dtype, k):
    """``a @ b + a2 @ b2`` for two matrices of one structure (spill included) against the float64
    reference, within the error of the same-precision dense computation, on fresh random values."""
    from twellsparse._ops import matmul_sum, values_op, with_values

    h = sparse_activations(300, 700, 0.03, "skewed", dtype, rng)
    a = ts.twell_array(cp.asarray(h), tile_n=64, capacity=2)
    assert a.n_spilled > 0
    a2 = with_values(
        a, values_op(lambda v: v * -1.3 + 0.25, a.parts.data), values_op(lambda v: v * -1.3 + 0.25, a.parts.spill_data)
    )
    b = rng.standard_normal((700, k)).astype(dtype)
    b2 = rng.standard_normal((700, k)).astype(dtype)
    with np.errstate(all="ignore"):
        got = cp.asnumpy(matmul_sum(a, cp.asarray(b), a2, cp.asarray(b2))).astype(np.float64)
    d, d2 = (cp.asnumpy(x.toarray()).astype(np.float64) for x in (a, a2))
    want = d @ b.astype(np.float64) + d2 @ b2.astype(np.float64)
    dense = _round(_round(d @ b.astype(np.float64), dtype) + _round(d2 @ b2.astype(np.float64), dtype), dtype)
    assert rel_error(got, want) <= _bound(dtype, rel_error(dense, want))


@pytest.mark.parametrize("dtype", [ts.bfloat16, np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    "activation, threshold", [("relu", None), ("relu2", None), ("silu", 0.05), ("gelu", 0.1), ("relu", 0.3)]
)
@pytest.mark.parametrize("m, n, step", [(1, 1, 1), (37, 301, 4), (300, 70_001, 13), (4096, 5632, 16)])
def test_kept_count_matches_the_reference(cp, dtype, activation, threshold, m, n, step):
    """The density sample of the FFN plans (one launch) counts what the reference keeps, on the
    sampled rows only, with the activation rounded to the dtype first."""
    from twellsparse import _gpu_ops

    rng = np.random.default_rng(m + n + step)
    z = (rng.standard_normal((m, n)) * 0.7).astype(dtype)
    got, sampled = _gpu_ops.kept_count(cp.asarray(z), step, activation, threshold)
    rows = z[::step].astype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)
    assert sampled == rows.size
    want = int(ref.keep_mask(ref.activation(rows, activation).astype(dtype), threshold).sum())
    assert got.dtype == np.int64 and got.shape == (1,)
    # relu and relu2 are exact; silu's and gelu's device exp may land an ulp from NumPy's, which
    # can move a value across the threshold after rounding (rarely).
    slack = 0 if activation.startswith("relu") else 2 + rows.size // 10_000
    assert abs(int(got[0]) - want) <= slack


def test_kept_count_on_a_row_strided_view(cp):
    from twellsparse import _gpu_ops

    z = cp.asarray(np.random.default_rng(3).standard_normal((50, 80)).astype(np.float32))[:, :77]
    want = int((cp.asnumpy(z)[::7] > 0).sum())
    assert int(_gpu_ops.kept_count(z, 7, "relu", None)[0][0]) == want
