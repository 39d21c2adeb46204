"""fp8 e4m3 weight rows on the GPU: the quantizer's codes and scales equal the NumPy
reference's bit for bit, and the e4m3 row-gather SpMM (both variants) matches the float64
product with the decoded rows, on shapes with spill, empty rows and several column passes;
other dtypes and row lengths take the decoded fallback with a warning. The gated consumer's up projection from
e4m3 rows (subnormal codes included) matches the float64 dots, and FFN plans with
``down_format="e4m3"`` (and ``up_format``) match the float64 block on the decoded weights on
every path."""

from __future__ import annotations

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _gpu_ops
from twellsparse import _kernels as K
from twellsparse import _reference as ref
from twellsparse.testing import ffn_problem, rel_error, sparse_activations

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [np.float16, ts.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("n, k", [(37, 24), (5632, 2048), (3, 7), (64, 0), (0, 16)])
def test_quantizer_matches_the_host(cp, rng, dtype, n, k):
    b = (rng.standard_normal((n, k)) * np.exp(rng.uniform(-12, 6, (n, 1)))).astype(dtype)
    if n > 4 and k:
        b[3] = 0
        b[4, 0] = 1e-30 if np.dtype(dtype).itemsize > 2 else 0
    host = ts.quantize_rows(b)
    device = ts.quantize_rows(cp.asarray(b))
    np.testing.assert_array_equal(device.scales.get(), host.scales)
    np.testing.assert_array_equal(device.data.get(), host.data)
    strided = ts.quantize_rows(cp.asarray(np.concatenate([b, b], axis=1))[:, :k])  # a row stride above k
    np.testing.assert_array_equal(strided.data.get(), host.data)


def _activations(cp, rng, m, n, density, dtype, tile_n, capacity):
    """Skewed sparse activations with an empty row: (dense on the host, TwELL on the GPU)."""
    h = sparse_activations(m, n, density, "skewed", dtype, rng)
    h[m // 2] = 0
    return h, ts.twell_array(cp.asarray(h), tile_n=tile_n, capacity=capacity)


# (m, n, k, tile_n, capacity, density), k a multiple of 8: one or several column passes.
SHAPES = [
    (67, 5632, 2048, 256, None, 0.01),
    (33, 2000, 1040, 32, 2, 0.08),  # heavy spill, 2 passes of (8, 2)
    (16, 700, 8, 64, 1, 0.3),  # several 32-entry batches per row, all spilling
    (5, 300, 4104, 128, 8, 0.02),  # 5 passes, a partial last one
]


@pytest.mark.parametrize("dtype", [np.float16, ts.bfloat16])
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_e4m3_spmm_matches_the_reference(cp, rng, dtype, m, n, k, tile_n, capacity, density):
    h, a = _activations(cp, rng, m, n, density, dtype, tile_n, capacity)
    q = ts.quantize_rows(cp.asarray(rng.standard_normal((n, k)).astype(np.float32)))
    expected = h.astype(np.float64) @ q.dequantize(np.float64).get()
    bound = 2.0 * rel_error(expected.astype(dtype).astype(np.float64), expected) + 1e-4
    for variant in K.GATHER_VARIANTS:
        out = cp.empty((m, k), dtype=dtype)  # poisoned
        _gpu_ops.spmm_e4m3(a.parts, tile_n, q.data, q.scales, out, variant=variant)
        assert rel_error(out, expected) <= bound, variant
    got = ts.matmul(a, q)
    assert got.dtype == np.dtype(dtype) and rel_error(got, expected) <= bound


@pytest.mark.parametrize("dtype, k", [(np.float32, 64), (ts.bfloat16, 60), (np.float64, 16)])
def test_other_dtypes_and_row_lengths_take_the_decoded_fallback(cp, rng, dtype, k):
    h = sparse_activations(19, 500, 0.05, "uniform", dtype, rng)
    a = ts.twell_array(cp.asarray(h), tile_n=64, capacity=4)
    q = ts.quantize_rows(cp.asarray(rng.standard_normal((500, k))))
    expected = h.astype(np.float64) @ q.dequantize(np.float64).get()
    wide = "float64" if np.dtype(dtype) == np.float64 else "float32"
    with pytest.warns(ts.TwELLFallbackWarning, match=f"decoded to {wide} for the usual product"):
        got = ts.matmul(a, q)
    assert got.dtype == np.dtype(dtype)
    tol = 1e-4 if np.dtype(dtype).itemsize == 2 else 1e-6
    assert rel_error(got, expected) <= 2.0 * rel_error(expected.astype(dtype).astype(np.float64), expected) + tol


# (m, d_ff, d_model, tile_n, capacity, density), d_model a multiple of 8.
UP_SHAPES = [
    (67, 2000, 256, 256, None, 0.02),
    (33, 700, 136, 32, 2, 0.1),  # heavy spill, a partial 32-value step per round
    (9, 300, 8, 64, 1, 0.3),  # one 8-value piece per row
    (40, 1000, 1032, 128, 4, 0.05),  # several rounds, a partial last one
]


@pytest.mark.parametrize("dtype", [np.float16, ts.bfloat16])
@pytest.mark.parametrize("m, d_ff, d_model, tile_n, capacity, density", UP_SHAPES)
def test_e4m3_gated_up_matches_the_reference(cp, rng, dtype, m, d_ff, d_model, tile_n, capacity, density):
    gate, g = _activations(cp, rng, m, d_ff, density, dtype, tile_n, capacity)
    x = rng.standard_normal((m, d_model)) * np.exp2(rng.uniform(-12, 0, (m, d_model)))
    if np.dtype(dtype) == np.dtype(ts.bfloat16):  # rows far outside f16's range: the kernel rescales them
        x *= np.exp2(rng.uniform(-40, 40, (m, 1)))
    x[1] = 0  # a row of zeros
    x = x.astype(dtype)
    # Columns over 14 octaves: many codes land in e4m3's subnormal range (exponent bits 0).
    w_up = rng.standard_normal((d_ff, d_model)) * np.exp2(rng.uniform(-14, 0, (1, d_model)))
    q = ts.quantize_rows(cp.asarray(w_up.astype(np.float32)))
    codes = q.data.get()
    assert ((codes & 0x78) == 0).any() and ((codes & 0x7F) != 0).any()
    decoded = q.dequantize(np.float64).get()
    u_exact = np.where(gate != 0, x.astype(np.float64) @ decoded.T, 0.0)
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(decoded).T  # the fp32 sums' error scale
    w_down = cp.asarray(rng.standard_normal((d_ff, 24)).astype(dtype))
    h_exact = gate.astype(np.float64) * u_exact
    expected = h_exact @ w_down.get().astype(np.float64)
    bound = 4.0 * rel_error(expected.astype(dtype).astype(np.float64), expected) + 1e-4
    for variant in K.GATHER_VARIANTS:
        out, up = _gpu_ops.gated_consumer(g.parts, tile_n, cp.asarray(x), q, w_down, keep_up=True, variant=variant)
        u_got = ts.twell_array._from_parts(up, g.shape, tile_n).toarray().get().astype(np.float64)
        # u: the fp32 dot times the row scale, rounded once to dtype (f16's subnormals below 2**-14).
        floor = 2.0**-24 if np.dtype(dtype) == np.float16 else 0.0
        assert np.all(np.abs(u_got - u_exact) <= 2.0**-8 * np.abs(u_exact) + 1e-5 * magnitude + floor), variant
        assert rel_error(out, expected) <= bound, variant


def _round(a, dtype):
    return a.astype(dtype).astype(np.float32)


@pytest.mark.parametrize("dtype", [ts.bfloat16, np.float16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(
    "m, d_model, d_ff, density, capacity, spill_capacity",
    [
        (700, 256, 2000, 0.01, None, None),
        (130, 136, 517, 0.05, 2, 4096),  # heavy spill into a fixed buffer, d_model 17 x 8
        (64, 100, 300, 0.05, 4, None),  # rows of 100 codes: the decoded fallback
    ],
)
def test_plans_with_e4m3_rows(cp, rng, dtype, gated, m, d_model, d_ff, density, capacity, spill_capacity):
    p = ffn_problem(m, d_model, d_ff, density, "skewed", dtype, rng)
    decoded = ts.quantize_rows(np.ascontiguousarray(p["w_down"].T)).dequantize(np.float64).T
    up = ts.quantize_rows(p["w_up"]).dequantize(np.float64) if gated else None  # the gated block's up rows too
    weights = ("w_gate", "w_up", "w_down") if gated else ("w_gate", "w_down")
    args = [cp.asarray(p[k]) for k in weights]
    x = cp.asarray(p["x"])
    xs, wg = p["x"].astype(np.float32), p["w_gate"].astype(np.float32)
    g = _round(np.maximum(_round(xs @ wg.T, dtype), 0), dtype)
    h = _round(g * _round(xs @ up.T.astype(np.float32), dtype), dtype) if gated else g
    same_precision = _round(h @ decoded.T, dtype)
    if gated:
        exact = ref.gated_ffn_dense(p["x"], p["w_gate"], up, decoded, "relu")
    else:
        exact = ref.ffn_dense(p["x"], p["w_gate"], decoded, "relu")
    bound = 2.0 * rel_error(same_precision, exact) + 1e-4
    cls = ts.GatedFFN if gated else ts.FFN
    settings = {"tile_n": 64, "capacity": capacity, "spill_capacity": spill_capacity, "down_format": "e4m3"}
    if gated:
        settings["up_format"] = "e4m3"
    for dispatch in ("sparse", "dense"):
        plan = cls(*args, dispatch=dispatch, **settings)
        out = cp.full((m, d_model), np.nan, dtype=dtype)
        if d_model % 8 and dispatch == "sparse":
            with pytest.warns(ts.TwELLFallbackWarning, match="decoded to float32"):
                plan(x, out=out)
        else:
            plan(x, out=out)
        assert plan.last_stats["path"] == dispatch
        assert rel_error(out, exact) <= bound, dispatch
        if spill_capacity is not None:
            plan.check_spill()
            assert dispatch == "dense" or plan.last_stats["n_spilled"] > 0
