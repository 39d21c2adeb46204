"""The stream SpMM (cuda/twell_stream.cu) against the float64 reference: token counts that leave a
partial block of 256, column counts that leave a partial 128-column chunk, partial last tiles,
every tile width it serves, row-tiles with more entries than it stages (16), spill entries, empty
rows; and the gated consumer's split path (row-gather SDDMM, then the stream SpMM)."""

from __future__ import annotations

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _gpu_ops
from twellsparse.testing import rel_error, sparse_activations

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16]

# (m, n, k, tile_n, capacity, density, pattern)
SHAPES = [
    (1000, 5632, 2048, 256, 32, 0.01, "uniform"),  # 4 blocks, the last one partial
    (300, 2000, 1040, 256, 16, 0.02, "skewed"),  # partial tile (2000 = 7 x 256 + 208), 9 chunks
    (257, 700, 136, 64, 2, 0.3),  # most entries spill; 136 columns: a 1-chunk + 8-column grid
    (513, 1500, 264, 128, 40, 0.2),  # row-tiles past the 16 staged slots, in slots (capacity 40)
]


def _case(shape):
    m, n, k, tile_n, capacity, density, *pattern = shape
    return m, n, k, tile_n, capacity, density, (pattern[0] if pattern else "skewed")


def _bound(dtype, expected):
    rounded = np.asarray(expected).astype(dtype).astype(np.float64)
    return 2.0 * rel_error(rounded, expected) + 1e-4


def _problem(cp, rng, m, n, tile_n, capacity, density, pattern, dtype):
    h = sparse_activations(m, n, density, pattern, dtype, rng)
    h[m // 2] = 0  # an empty row
    h[m - 1, : min(n, 3 * tile_n)] = rng.standard_normal(min(n, 3 * tile_n))  # full row-tiles
    return h, ts.twell_array(cp.asarray(h), tile_n=tile_n, capacity=capacity)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_stream_spmm_against_float64(cp, rng, dtype, shape):
    m, n, k, tile_n, capacity, density, pattern = _case(shape)
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, pattern, dtype)
    b = rng.standard_normal((n, k)).astype(dtype)
    expected = h.astype(np.float64) @ b.astype(np.float64)
    assert _gpu_ops.stream_eligible(a.parts, tile_n, cp.asarray(b), k, cp.empty((m, k), dtype), k)
    out = cp.empty((m, k), dtype=dtype)  # poisoned: every value must be written
    _gpu_ops.spmm(a.parts, tile_n, cp.asarray(b), out, path="stream")
    assert rel_error(out, expected) <= _bound(dtype, expected)
    gathered = cp.empty((m, k), dtype=dtype)
    _gpu_ops.spmm(a.parts, tile_n, cp.asarray(b), gathered, path="gather")
    # Both sum every entry in fp32 and round once: they differ at most by summation order.
    assert rel_error(out, cp.asnumpy(gathered).astype(np.float64)) <= _bound(dtype, expected)


def test_stream_spmm_strided_operands(cp, rng):
    """b and out as column windows of wider arrays (row strides past their widths)."""
    m, n, k = 600, 1024, 256
    h, a = _problem(cp, rng, m, n, 256, 32, 0.02, "uniform", ts.bfloat16)
    wide_b = cp.asarray(rng.standard_normal((n, k + 64)).astype(ts.bfloat16))
    wide_out = cp.zeros((m, k + 32), dtype=ts.bfloat16)
    _gpu_ops.spmm(a.parts, 256, wide_b[:, 16 : 16 + k], wide_out[:, 8 : 8 + k], path="stream")
    expected = h.astype(np.float64) @ cp.asnumpy(wide_b[:, 16 : 16 + k]).astype(np.float64)
    assert rel_error(wide_out[:, 8 : 8 + k], expected) <= _bound(ts.bfloat16, expected)
    assert not cp.any(wide_out[:, :8].astype(cp.float32)) and not cp.any(wide_out[:, 8 + k :].astype(cp.float32))


def test_auto_takes_the_stream_kernel_only_where_it_applies(cp, rng):
    m, n, k = 2048, 1024, 128
    _, a = _problem(cp, rng, m, n, 256, 32, 0.01, "uniform", ts.bfloat16)
    b = cp.asarray(rng.standard_normal((n, k)).astype(ts.bfloat16))
    out = cp.empty((m, k), dtype=ts.bfloat16)
    assert m >= _gpu_ops.STREAM_MIN_ROWS and _gpu_ops.stream_eligible(a.parts, 256, b, k, out, k)
    _, odd = _problem(cp, rng, m, n, 256, 31, 0.01, "uniform", ts.bfloat16)
    assert not _gpu_ops.stream_eligible(odd.parts, 256, b, k, out, k)  # odd capacity
    _, wide = _problem(cp, rng, m, n, 512, 32, 0.01, "uniform", ts.bfloat16)
    assert not _gpu_ops.stream_eligible(wide.parts, 512, b, k, out, k)  # tile wider than 256
    f32 = ts.twell_array(a.toarray().astype(cp.float32), tile_n=256, capacity=32)
    assert not _gpu_ops.stream_eligible(f32.parts, 256, b.astype(cp.float32), k, out.astype(cp.float32), k)
    with pytest.raises(ValueError, match="path: 'stream' needs"):
        _gpu_ops.spmm(odd.parts, 256, b, out, path="stream")


@pytest.mark.parametrize("keep_up", [False, True])
def test_split_gated_consumer_matches_the_fused_kernel(cp, rng, keep_up):
    m, d_model, d_ff = 1100, 264, 1300
    dtype = ts.bfloat16
    g, gate = _problem(cp, rng, m, d_ff, 256, 32, 0.02, "skewed", dtype)
    gate = ts.twell_array(cp.asarray(np.maximum(g.astype(np.float32), 0).astype(dtype)), tile_n=256, capacity=32)
    x = cp.asarray(rng.standard_normal((m, d_model)).astype(dtype))
    w_up = cp.asarray(rng.standard_normal((d_ff, d_model)).astype(dtype))
    w_down_t = cp.asarray(rng.standard_normal((d_ff, d_model)).astype(dtype))
    gate_dense = cp.asnumpy(gate.toarray()).astype(np.float64)
    up_ref = _round(cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(w_up).astype(np.float64).T, dtype)
    hidden = _round(gate_dense * up_ref, dtype)
    expected = hidden @ cp.asnumpy(w_down_t).astype(np.float64)
    out_split, up_split = _gpu_ops.gated_consumer(gate.parts, 256, x, w_up, w_down_t, keep_up=keep_up)
    saved = _gpu_ops.SPLIT_GATED
    _gpu_ops.SPLIT_GATED = False
    try:
        out_fused, up_fused = _gpu_ops.gated_consumer(gate.parts, 256, x, w_up, w_down_t, keep_up=keep_up)
    finally:
        _gpu_ops.SPLIT_GATED = saved
    assert rel_error(out_split, expected) <= _bound(dtype, expected)
    assert rel_error(out_split, cp.asnumpy(out_fused).astype(np.float64)) <= _bound(dtype, expected)
    if keep_up:
        split_u = cp.asnumpy(ts.twell_array._from_parts(up_split, (m, d_ff), 256).toarray()).astype(np.float64)
        up_at_gate = np.where(gate_dense != 0, up_ref, 0.0)
        assert rel_error(split_u, up_at_gate) <= _bound(dtype, up_at_gate)
        padding = up_split.indices < 0
        assert not cp.any(up_split.data.astype(cp.float32)[padding])  # zero padding, as the backward needs
        assert up_fused is not None
    else:
        assert up_split is None and up_fused is None


def _round(x, dtype):
    return np.asarray(x, dtype=np.float64).astype(dtype).astype(np.float64)
