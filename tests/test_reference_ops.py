"""Every public op against a dense float64 computation on random inputs (the CPU path).

float64 results must match to rounding; float32 to a relative error of 1e-5; bfloat16/float16
results are bounded by the error of a dense computation in the same precision (flash-attention's
``hopper/`` test rule): ``err(out) <= 3 * err(dense_same_precision) + 1e-3``.
"""

from __future__ import annotations

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _reference as ref
from twellsparse.testing import ffn_problem, rel_error

BF16 = ts.bfloat16


def _sparse(rng, m, n, density, dtype=np.float64):
    x = rng.standard_normal((m, n))
    x[rng.random((m, n)) >= density] = 0
    return x.astype(dtype)


def _round(x, dtype):
    """Round a float64 array to ``dtype`` and back (what storing it in that precision does)."""
    return np.asarray(x, dtype=np.float64).astype(dtype).astype(np.float64)


def _assert_lowp_bound(out, ref64, dense_like):
    err, base = rel_error(out, ref64), rel_error(dense_like, ref64)
    assert err <= 3 * base + 1e-3, f"error {err:.3g} vs same-precision dense {base:.3g}"


def _close64(out, want):
    scale = max(float(np.abs(want).max(initial=0.0)), 1.0)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12 * scale)


# ----------------------------------------------------------------------------- matmul

# (M, N, K, density, tile_n, capacity, spills)
MATMUL_CASES = [
    (37, 301, 19, 0.1, 32, 32, False),
    (37, 301, 19, 0.3, 32, 1, True),
    (37, 301, 19, 0.05, 256, None, False),
    (37, 301, 19, 0.5, 256, 8, True),
    (64, 1000, 8, 0.05, 1024, 16, True),
    (5, 31, 3, 0.5, 32, 32, False),
    (5, 31, 3, 0.5, 32, 4, True),
    (1, 600, 1, 0.9, 64, 2, True),
]


@pytest.fixture(params=MATMUL_CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-t{c[4]}-c{c[5]}" for c in MATMUL_CASES])
def problem(request, rng):
    m, n, k, density, tile_n, capacity, spills = request.param
    x = _sparse(rng, m, n, density)
    a = ts.twell_array(x, tile_n=tile_n, capacity=capacity)
    assert (a.n_spilled > 0) == spills
    return x, a, k


def test_matmul(problem, rng):
    x, a, k = problem
    b = rng.standard_normal((x.shape[1], k))
    out = ts.matmul(a, b)
    assert out.shape == (x.shape[0], k) and out.dtype == np.float64
    _close64(out, x @ b)


def test_matmul_transposed(problem, rng):
    x, a, k = problem
    g = rng.standard_normal((x.shape[0], k))
    out = ts.matmul(a.T, g)
    assert out.shape == (x.shape[1], k) and out.dtype == np.float64
    _close64(out, x.T @ g)


def test_matmul_vector(problem, rng):
    x, a, _ = problem
    v, w = rng.standard_normal(x.shape[1]), rng.standard_normal(x.shape[0])
    _close64(ts.matmul(a, v), x @ v)
    _close64(ts.matmul(a.T, w), x.T @ w)


def test_matmul_out(problem, rng):
    x, a, k = problem
    b = rng.standard_normal((x.shape[1], k))
    out = np.full((x.shape[0], k), np.nan)  # poisoned: every entry must be written
    r = ts.matmul(a, b, out=out)
    assert r is out
    _close64(out, x @ b)
    g = rng.standard_normal((x.shape[0], k))
    out_t = np.full((x.shape[1], k), np.nan)
    assert ts.matmul(a.T, g, out=out_t) is out_t
    _close64(out_t, x.T @ g)
    v = rng.standard_normal(x.shape[1])
    out_v = np.full(x.shape[0], np.nan)
    assert ts.matmul(a, v, out=out_v) is out_v
    _close64(out_v, x @ v)


def test_matmul_out_non_contiguous(problem, rng):
    x, a, k = problem
    b = rng.standard_normal((x.shape[1], k))
    buf = np.full((k, x.shape[0]), np.nan)
    out = buf.T  # Fortran-ordered view of the right shape
    assert ts.matmul(a, b, out=out) is out
    _close64(buf.T, x @ b)


def test_matmul_float32(problem, rng):
    x, a, k = problem
    a32 = a.astype(np.float32)
    b = rng.standard_normal((x.shape[1], k)).astype(np.float32)
    out = ts.matmul(a32, b)
    assert out.dtype == np.float32
    want = x.astype(np.float32).astype(np.float64) @ b.astype(np.float64)
    assert rel_error(out, want) < 1e-6
    # float32 matrix with a float64 operand promotes to float64
    b64 = rng.standard_normal((x.shape[1], k))
    out = ts.matmul(a32, b64)
    assert out.dtype == np.float64
    _close64(out, x.astype(np.float32).astype(np.float64) @ b64)


@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bf16", "f16"])
def test_matmul_low_precision(problem, rng, dtype):
    x, _, k = problem
    xl = x.astype(dtype)
    a = ts.twell_array(xl, tile_n=32, capacity=2)
    b = rng.standard_normal((x.shape[1], k)).astype(dtype)
    g = rng.standard_normal((x.shape[0], k)).astype(dtype)
    x64, b64, g64 = xl.astype(np.float64), b.astype(np.float64), g.astype(np.float64)
    for out, want, like in [
        (ts.matmul(a, b), x64 @ b64, (xl.astype(np.float32) @ b.astype(np.float32)).astype(dtype)),
        (ts.matmul(a.T, g), x64.T @ g64, (xl.astype(np.float32).T @ g.astype(np.float32)).astype(dtype)),
    ]:
        assert out.dtype == np.dtype(dtype)
        _assert_lowp_bound(out, want, like)


# ----------------------------------------------------------------------------- sddmm


@pytest.mark.parametrize("k", [1, 19])
def test_sddmm(problem, rng, k):
    x, pattern, _ = problem
    m, n = x.shape
    xs, ys = rng.standard_normal((m, k)), rng.standard_normal((n, k))
    r = ts.sddmm(xs, ys, pattern)
    assert ts.is_twell(r) and r.shape == pattern.shape and r.dtype == np.float64
    mask = x != 0
    _close64(r.toarray(), np.where(mask, xs @ ys.T, 0.0))
    # keeps the pattern's structure
    assert (r.tile_n, r.capacity, r.nnz, r.n_spilled) == (
        pattern.tile_n,
        pattern.capacity,
        pattern.nnz,
        pattern.n_spilled,
    )
    for name in ("indices", "counts", "spill_indices", "spill_indptr"):
        np.testing.assert_array_equal(getattr(r, name), getattr(pattern, name), err_msg=name)
    r.check_format(full_check=True)
    # the pattern's values do not matter, and the pattern is left alone
    before = pattern.toarray()
    r2 = ts.sddmm(xs, ys, pattern * 5.0)
    np.testing.assert_array_equal(r2.toarray(), r.toarray())
    np.testing.assert_array_equal(pattern.toarray(), before)


def test_sddmm_dtypes(rng):
    x = _sparse(rng, 37, 301, 0.3)
    pattern = ts.twell_array(x.astype(np.float32), tile_n=32, capacity=2)
    xs, ys = rng.standard_normal((37, 19)), rng.standard_normal((301, 19))
    r = ts.sddmm(xs.astype(np.float32), ys, pattern)
    assert r.dtype == np.float64
    _close64(r.toarray(), np.where(x != 0, xs.astype(np.float32).astype(np.float64) @ ys.T, 0.0))
    r = ts.sddmm(xs.astype(np.float32), ys.astype(np.float32), pattern)
    assert r.dtype == np.float32
    want = np.where(x != 0, xs.astype(np.float32).astype(np.float64) @ ys.astype(np.float32).astype(np.float64).T, 0)
    assert rel_error(r.toarray(), want) < 1e-6


def test_sddmm_bf16(rng):
    x = _sparse(rng, 37, 301, 0.3)
    pattern = ts.twell_array(x, tile_n=32, capacity=2)
    xs, ys = rng.standard_normal((37, 64)).astype(BF16), rng.standard_normal((301, 64)).astype(BF16)
    r = ts.sddmm(xs, ys, pattern)
    assert r.dtype == BF16
    full64 = xs.astype(np.float64) @ ys.astype(np.float64).T
    like = (xs.astype(np.float32) @ ys.astype(np.float32).T).astype(BF16)
    mask = x != 0
    _assert_lowp_bound(r.toarray(), np.where(mask, full64, 0), np.where(mask, like, 0))


# ----------------------------------------------------------------------------- linear_to_twell


ACTIVATIONS = [
    ("relu", None),
    ("relu", 0.3),
    ("relu2", None),
    ("silu", 0.1),
    ("gelu", 0.1),
    ("identity", 0.5),
]


def _expected_hidden(x, w, act, threshold):
    h = ref.activation(x.astype(np.float64) @ w.astype(np.float64).T, act)
    keep = (h != 0) if threshold is None else (np.abs(h) > threshold)
    return np.where(keep, h, 0.0), keep


@pytest.mark.parametrize("tile_n,capacity", [(32, 1), (32, None), (256, 4), (1024, None)])
@pytest.mark.parametrize("act,threshold", ACTIVATIONS, ids=[f"{a}-{t}" for a, t in ACTIVATIONS])
def test_linear_to_twell(rng, act, threshold, tile_n, capacity):
    m, k, f = 37, 19, 301
    x, w = rng.standard_normal((m, k)), rng.standard_normal((f, k)) / np.sqrt(k)
    h = ts.linear_to_twell(x, w, activation=act, threshold=threshold, tile_n=tile_n, capacity=capacity)
    want, keep = _expected_hidden(x, w, act, threshold)
    assert ts.is_twell(h) and h.shape == (m, f) and h.dtype == np.float64
    assert (h.tile_n, h.capacity) == (tile_n, capacity or tile_n // 8)
    assert h.n_dropped == 0
    dense = h.toarray()
    np.testing.assert_array_equal(dense != 0, keep)
    assert h.nnz == int(keep.sum())
    _close64(dense, want)
    h.check_format(full_check=True)
    assert h.has_canonical_format


def test_linear_to_twell_spills(rng):
    x, w = rng.standard_normal((37, 19)), rng.standard_normal((301, 19))
    h = ts.linear_to_twell(x, w, tile_n=32, capacity=1)
    assert h.n_spilled > 0
    want, _ = _expected_hidden(x, w, "relu", None)
    _close64(h.toarray(), want)


def test_linear_to_twell_default_activation_is_relu(rng):
    x, w = rng.standard_normal((8, 5)), rng.standard_normal((70, 5))
    h = ts.linear_to_twell(x, w, tile_n=32)
    _close64(h.toarray(), np.maximum(x @ w.T, 0))


def test_linear_to_twell_float32(rng):
    x = rng.standard_normal((37, 19)).astype(np.float32)
    w = rng.standard_normal((301, 19)).astype(np.float32)
    h = ts.linear_to_twell(x, w, activation="relu", tile_n=32, capacity=2)
    assert h.dtype == np.float32
    want, keep = _expected_hidden(x, w, "relu", None)
    np.testing.assert_array_equal(h.toarray() != 0, keep)
    assert rel_error(h.toarray(), want) < 1e-6


def test_linear_to_twell_bf16(rng):
    x = rng.standard_normal((37, 64)).astype(BF16)
    w = (rng.standard_normal((301, 64)) / 8).astype(BF16)
    h = ts.linear_to_twell(x, w, activation="relu", tile_n=32, capacity=2)
    assert h.dtype == BF16
    want, _ = _expected_hidden(x, w, "relu", None)
    like = np.maximum(x.astype(np.float32) @ w.astype(np.float32).T, 0).astype(BF16)
    _assert_lowp_bound(h.toarray(), want, like)


# ----------------------------------------------------------------------------- ffn / gated_ffn

FFN_CASES = [
    # (M, d_model, d_ff, density, pattern, tile_n, capacity)
    (37, 64, 301, 0.05, "uniform", 32, None),
    (37, 64, 301, 0.2, "uniform", 32, 1),  # hidden row-tiles overflow: exact through the spill
    (64, 32, 512, 0.1, "skewed", 256, None),
    (16, 48, 1000, 0.3, "skewed", 1024, 2),
]
FFN_IDS = [f"{c[0]}x{c[1]}x{c[2]}-d{c[3]}-{c[4]}-t{c[5]}-c{c[6]}" for c in FFN_CASES]


def _problem(rng, case, dtype):
    m, d_model, d_ff, density, pattern, tile_n, capacity = case
    p = ffn_problem(m, d_model, d_ff, density, pattern=pattern, dtype=dtype, rng=rng)
    return p, {"tile_n": tile_n, "capacity": capacity}


def test_ffn_capacity_one_case_spills(rng):
    p, kw = _problem(rng, FFN_CASES[1], np.float64)
    h = ts.linear_to_twell(p["x"], p["w_gate"], **kw)
    assert h.n_spilled > h.nnz // 2


@pytest.mark.parametrize("case", FFN_CASES, ids=FFN_IDS)
def test_ffn_float64(rng, case):
    p, kw = _problem(rng, case, np.float64)
    out = ts.ffn(p["x"], p["w_gate"], p["w_down"], **kw)
    want = ref.ffn_dense(p["x"], p["w_gate"], p["w_down"], "relu")
    assert out.shape == want.shape and out.dtype == np.float64
    assert rel_error(out, want) < 1e-10
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())


@pytest.mark.parametrize("case", FFN_CASES, ids=FFN_IDS)
def test_gated_ffn_float64(rng, case):
    p, kw = _problem(rng, case, np.float64)
    out = ts.gated_ffn(p["x"], p["w_gate"], p["w_up"], p["w_down"], **kw)
    want = ref.gated_ffn_dense(p["x"], p["w_gate"], p["w_up"], p["w_down"], "relu")
    assert out.shape == want.shape and out.dtype == np.float64
    assert rel_error(out, want) < 1e-10
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())


@pytest.mark.parametrize(
    "act,threshold", [("silu", 0.1), ("gelu", 0.05), ("relu2", None), ("relu", 0.5), ("identity", 1.0)]
)
def test_ffn_activations_float64(rng, act, threshold):
    p, kw = _problem(rng, FFN_CASES[1], np.float64)
    args = (p["x"], p["w_gate"], p["w_up"], p["w_down"])
    out = ts.gated_ffn(*args, activation=act, threshold=threshold, **kw)
    assert rel_error(out, ref.gated_ffn_dense(*args, act, threshold)) < 1e-10
    out = ts.ffn(p["x"], p["w_gate"], p["w_down"], activation=act, threshold=threshold, **kw)
    assert rel_error(out, ref.ffn_dense(p["x"], p["w_gate"], p["w_down"], act, threshold)) < 1e-10


@pytest.mark.parametrize("case", FFN_CASES, ids=FFN_IDS)
def test_ffn_float32(rng, case):
    p, kw = _problem(rng, case, np.float32)
    out = ts.ffn(p["x"], p["w_gate"], p["w_down"], **kw)
    assert out.dtype == np.float32
    assert rel_error(out, ref.ffn_dense(p["x"], p["w_gate"], p["w_down"], "relu")) < 1e-5
    out = ts.gated_ffn(p["x"], p["w_gate"], p["w_up"], p["w_down"], **kw)
    assert out.dtype == np.float32
    assert rel_error(out, ref.gated_ffn_dense(p["x"], p["w_gate"], p["w_up"], p["w_down"], "relu")) < 1e-5


@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", FFN_CASES, ids=FFN_IDS)
def test_ffn_low_precision(rng, case, dtype):
    p, kw = _problem(rng, case, dtype)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    wd64 = wd.astype(np.float64)

    out = ts.ffn(x, wg, wd, **kw)
    assert out.dtype == np.dtype(dtype)
    ref64 = ref.ffn_dense(x, wg, wd, "relu")
    hidden = _round(ref.linear_dense(x, wg, "relu"), dtype)  # the dense path stores h in the same precision
    _assert_lowp_bound(out, ref64, _round(hidden @ wd64.T, dtype))

    out = ts.gated_ffn(x, wg, wu, wd, **kw)
    assert out.dtype == np.dtype(dtype)
    ref64 = ref.gated_ffn_dense(x, wg, wu, wd, "relu")
    gate = _round(ref.linear_dense(x, wg, "relu"), dtype)
    up = _round(x.astype(np.float64) @ wu.astype(np.float64).T, dtype)
    hidden = _round(gate * up, dtype)
    _assert_lowp_bound(out, ref64, _round(hidden @ wd64.T, dtype))


def test_ffn_equals_composition(rng):
    """ffn is linear_to_twell followed by matmul; gated_ffn inserts an SDDMM scaled by the gate."""
    p, kw = _problem(rng, FFN_CASES[1], np.float64)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    h = ts.linear_to_twell(x, wg, **kw)
    _close64(ts.ffn(x, wg, wd, **kw), ts.matmul(h, wd.T))
    gated_hidden = ts.sddmm(x, wu, h).multiply(h.toarray())
    _close64(ts.gated_ffn(x, wg, wu, wd, **kw), ts.matmul(gated_hidden, wd.T))


def test_ops_leave_inputs_untouched(rng):
    p, kw = _problem(rng, FFN_CASES[1], np.float64)
    arrays = {k: p[k] for k in ("x", "w_gate", "w_up", "w_down")}
    saved = {k: v.copy() for k, v in arrays.items()}
    ts.ffn(arrays["x"], arrays["w_gate"], arrays["w_down"], **kw)
    ts.gated_ffn(arrays["x"], arrays["w_gate"], arrays["w_up"], arrays["w_down"], **kw)
    h = ts.linear_to_twell(arrays["x"], arrays["w_gate"], **kw)
    parts = [a.copy() for a in h.parts]
    b = rng.standard_normal((h.shape[1], 3))
    b0 = b.copy()
    ts.matmul(h, b)
    ts.matmul(h.T, rng.standard_normal((h.shape[0], 3)))
    ts.sddmm(arrays["x"], arrays["w_up"], h)
    for k, v in arrays.items():
        np.testing.assert_array_equal(v, saved[k])
    for a0, a1 in zip(parts, h.parts, strict=True):
        np.testing.assert_array_equal(a0, a1)
    np.testing.assert_array_equal(b, b0)
