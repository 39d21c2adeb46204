"""The cuBLASLt ReLU bit-mask producer: the mask pack against the dense pack (bit-exact parts,
with a hand-made mask, so the kernel is checked on its own), the cuBLASLt GEMM against float64,
and linear_to_twell / the plans with the producer enabled."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _gpu_convert, _gpu_producer
from twellsparse.testing import ffn_problem, rel_error, sparse_activations

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16, np.float32]


def _mask_of(cp, h, words):
    """cuBLASLt's mask layout: ``words`` uint32 per row, bit f of a row set where h > 0."""
    m, n = h.shape
    bits = np.zeros((m, words * 32), dtype=bool)
    bits[:, :n] = h.astype(np.float64) > 0
    packed = np.packbits(bits, axis=-1, bitorder="little")  # byte b, bit i: column 8b + i
    return cp.asarray(np.ascontiguousarray(packed).view("<u4").reshape(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, n, tile_n, capacity, density",
    [(37, 301, 32, 3, 0.2), (64, 5632, 256, 32, 0.01), (9, 1000, 1024, 8, 0.05), (50, 700, 128, 2, 0.3)],
)
def test_mask_pack_equals_dense_pack(cp, rng, dtype, m, n, tile_n, capacity, density):
    h = sparse_activations(m, n, density, "skewed", dtype, rng)
    words = -(-n // 128) * 4
    mask = _mask_of(cp, h, words)
    if m > 2:  # a set bit over a zero value must not be stored
        h[1, : min(n, 40)] = 0
    hg = cp.asarray(h)
    for overflow in ("spill", "drop"):
        with warnings.catch_warnings():  # "drop" warns on both sides; the counts are compared
            warnings.simplefilter("ignore", ts.TwELLDroppedEntriesWarning)
            finish = _gpu_convert.relu_mask_to_parts_deferred(hg, mask, words, tile_n, capacity)[1]
            got, dropped = finish(overflow)
            want, want_dropped = _gpu_convert.dense_to_parts(hg, tile_n, capacity, overflow)
        assert dropped == want_dropped
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(cp.asnumpy(a).view(np.uint8), cp.asnumpy(b).view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_mask_gemm(cp, rng, dtype):
    pytest.importorskip("cffi")
    from twellsparse.bindings import cublaslt

    try:
        cublaslt.library()
    except cublaslt.CuBlasLtError as exc:
        pytest.skip(str(exc))
    x = rng.standard_normal((300, 64)).astype(dtype)
    w = rng.standard_normal((777, 64)).astype(dtype)
    h, mask, words = _gpu_producer.relu_linear(cp.asarray(x), cp.asarray(w))
    expected = np.maximum(x.astype(np.float64) @ w.astype(np.float64).T, 0)
    assert rel_error(h, expected) < (1e-5 if np.dtype(dtype) == np.float32 else 1e-2)
    bits = np.unpackbits(cp.asnumpy(mask).view(np.uint8), bitorder="little").reshape(300, words * 32)[:, :777]
    hv = cp.asnumpy(h).astype(np.float64)
    assert np.all(hv[bits == 0] == 0)  # an unset bit always means a zero output
    assert np.mean(bits[hv > 0]) == 1.0


@pytest.mark.parametrize("gated", [False, True])
def test_plans_and_producer_with_the_mask_path(cp, rng, monkeypatch, gated):
    from twellsparse.bindings import cublaslt

    try:
        cublaslt.library()
    except (ImportError, RuntimeError) as exc:
        pytest.skip(str(exc))
    p = ffn_problem(400, 128, 1000, 0.02, "skewed", ts.bfloat16, rng, cp)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]

    def block(dispatch):
        return ts.GatedFFN(wg, wu, wd, dispatch=dispatch)(x) if gated else ts.FFN(wg, wd, dispatch=dispatch)(x)

    monkeypatch.setattr(_gpu_producer, "ENABLED", False)  # the dense-scan producer first
    before, dense_before = block("sparse"), block("dense")
    h_before = ts.linear_to_twell(x, wg, capacity=4)
    monkeypatch.setattr(_gpu_producer, "ENABLED", True)
    assert _gpu_producer.applies(x, wg, "relu", None)
    after, dense_after = block("sparse"), block("dense")  # dense: z comes relu'd from cuBLASLt
    h_after = ts.linear_to_twell(x, wg, capacity=4)
    assert rel_error(after, before) < 2e-2  # different GEMM algorithms: rounding-level differences
    assert rel_error(dense_after, dense_before) < 2e-2
    assert abs(h_after.nnz - h_before.nnz) <= max(5, h_before.nnz // 1000) and h_after.n_spilled > 0
    assert rel_error(h_after.toarray(), h_before.toarray()) < 2e-2
