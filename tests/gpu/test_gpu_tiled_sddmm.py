"""The tiled SDDMM (cuda/twell_tiled_sddmm.cu) against the float64 reference, in every mode:
partial token and unit tiles, a partial last piece of K, row-tiles wider than a block's units
(tile_n 1024), heavy spill, blocks with many rounds of jobs, empty rows, and poisoned outputs
(padding slots must come back as zeros); then the paths that take it (the gated consumer split
in two, the gated backward, the plans) against the row-gather kernels."""

from __future__ import annotations

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _gpu_ops, _tiled_sddmm
from twellsparse.testing import ffn_problem, rel_error, sparse_activations

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16]

# (m, n, k, tile_n, capacity, density)
SHAPES = [
    (1, 40, 16, 32, None, 0.5),
    (600, 1100, 72, 256, None, 0.02),  # partial tiles both ways; K = 2.25 pieces
    (700, 1500, 40, 1024, 16, 0.05),  # row-tiles of 1024 units over two blocks; spill
    (1100, 600, 2048, 32, 2, 0.08),  # heavy spill, 3 token tiles
    (520, 700, 24, 64, 64, 0.6),  # ~150K entries per block: many rounds of 1024 jobs
    (4100, 5632, 256, 256, None, 0.005),  # the standard FFN's widths
]


def _pattern(cp, rng, m, n, tile_n, capacity, density, dtype):
    g = sparse_activations(m, n, density, "skewed", dtype, rng)
    g[m // 2] = 0  # an empty row
    return g, ts.twell_array(cp.asarray(g), tile_n=tile_n, capacity=capacity)


def _bound(dtype, expected):
    rounded = np.asarray(expected).astype(dtype).astype(np.float64)
    return 2.0 * rel_error(rounded, expected) + 1e-4


def _dense(cp, parts, shape, tile_n):
    """The parts as a float64 dense matrix, after checking that every padding slot is zero."""
    data = cp.asnumpy(parts.data).astype(np.float64)
    assert (data[cp.asnumpy(parts.indices) < 0] == 0).all(), "a padding slot was not zeroed"
    return cp.asnumpy(ts.twell_array._from_parts(parts, shape, tile_n).toarray()).astype(np.float64)


def _same_values_parts(cp, rng, parts, dtype):
    """Parts with the structure of ``parts`` and other random values (zero in padding slots)."""
    used = cp.asnumpy(parts.indices) >= 0
    data = np.where(used, rng.standard_normal(parts.data.shape), 0).astype(dtype)
    spill = rng.standard_normal(parts.spill_data.shape).astype(dtype)
    return parts._replace(data=cp.asarray(data), spill_data=cp.asarray(spill))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_tiled_sddmm_modes_match_float64(cp, rng, dtype, m, n, k, tile_n, capacity, density):
    g, a = _pattern(cp, rng, m, n, tile_n, capacity, density, dtype)
    x = rng.standard_normal((m, k)).astype(dtype)
    y = rng.standard_normal((n, k)).astype(dtype)
    x_gpu, y_gpu = cp.asarray(x), cp.asarray(y)
    assert _tiled_sddmm.applies(x_gpu, y_gpu)
    mask = g != 0
    d = np.where(mask, x.astype(np.float64) @ y.astype(np.float64).T, 0.0)
    g64 = g.astype(np.float64)
    up = _same_values_parts(cp, rng, a.parts, dtype)
    u64 = _dense(cp, up, (m, n), tile_n)

    def check(parts, expected):
        got = _dense(cp, parts, (m, n), tile_n)
        assert np.isfinite(got).all()
        assert rel_error(got, expected) <= _bound(dtype, expected)

    (plain,) = _tiled_sddmm.sddmm(a.parts, tile_n, x_gpu, y_gpu, "plain")
    check(plain, d)
    (scaled,) = _tiled_sddmm.sddmm(a.parts, tile_n, x_gpu, y_gpu, "scale")
    check(scaled, d * g64)
    h, u = _tiled_sddmm.sddmm(a.parts, tile_n, x_gpu, y_gpu, "gated")
    check(u, d)
    check(h, g64 * d)
    h_only, none = _tiled_sddmm.sddmm(a.parts, tile_n, x_gpu, y_gpu, "gated", keep=False)
    assert none is None
    assert (cp.asnumpy(h_only.data) == cp.asnumpy(h.data)).all()  # one kernel, same sums
    d_z, d_u, h_bwd = _tiled_sddmm.sddmm(a.parts, tile_n, x_gpu, y_gpu, "gated_bwd", aux=up)
    check(d_z, d * u64)
    check(d_u, d * g64)
    check(h_bwd, g64 * u64)
    # The row-gather path's sums in another order: equal up to a rounding of each value.
    gathered = _gpu_ops.sddmm(a.parts, tile_n, x_gpu, y_gpu, True, path="gather")
    assert rel_error(_dense(cp, scaled, (m, n), tile_n), _dense(cp, gathered, (m, n), tile_n)) <= 2 * _bound(
        dtype, d * g64
    )


def test_tiled_path_of_sddmm_and_its_refusal(cp, rng):
    _, a = _pattern(cp, rng, 300, 800, 256, None, 0.03, ts.bfloat16)
    x_host, y_host = rng.standard_normal((300, 64)), rng.standard_normal((800, 64))
    x, y = cp.asarray(x_host.astype(ts.bfloat16)), cp.asarray(y_host.astype(ts.bfloat16))
    tiled = _gpu_ops.sddmm(a.parts, 256, x, y, False, path="tiled")
    gathered = _gpu_ops.sddmm(a.parts, 256, x, y, False, path="gather")
    expected = _dense(cp, gathered, (300, 800), 256)
    assert rel_error(_dense(cp, tiled, (300, 800), 256), expected) <= 2 * _bound(ts.bfloat16, expected)
    x32, y32 = cp.asarray(x_host.astype(np.float32)), cp.asarray(y_host.astype(np.float32))
    assert not _tiled_sddmm.applies(x32, y32)
    with pytest.raises(ValueError, match="path: 'tiled' needs x and y of one 2-byte dtype"):
        _gpu_ops.sddmm(a.parts, 256, x32, y32, False, path="tiled")
    assert not _tiled_sddmm.applies(x[:, :60], y[:, :60])  # 120-byte rows


@pytest.mark.parametrize("keep_up", [False, True])
def test_split_gated_consumer_matches_the_fused_one(cp, rng, keep_up):
    m, n, k = 1300, 2100, 264
    g, a = _pattern(cp, rng, m, n, 256, None, 0.02, ts.bfloat16)
    x = cp.asarray(rng.standard_normal((m, k)).astype(ts.bfloat16))
    w_up = cp.asarray(rng.standard_normal((n, k)).astype(ts.bfloat16))
    w_down_t = cp.asarray(rng.standard_normal((n, 136)).astype(ts.bfloat16))
    fused, up_fused = _gpu_ops.gated_consumer(a.parts, 256, x, w_up, w_down_t, keep_up=keep_up, split=False)
    split, up_split = _gpu_ops.gated_consumer(a.parts, 256, x, w_up, w_down_t, keep_up=keep_up, split=True)
    u = np.where(g != 0, cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(w_up).astype(np.float64).T, 0)
    expected = (g.astype(np.float64) * u) @ cp.asnumpy(w_down_t).astype(np.float64)
    bound = 4 * _bound(ts.bfloat16, expected)
    assert rel_error(split, expected) <= bound
    assert rel_error(split, cp.asnumpy(fused).astype(np.float64)) <= bound
    if keep_up:
        got_u = _dense(cp, up_split, (m, n), 256)
        assert rel_error(got_u, _dense(cp, up_fused, (m, n), 256)) <= 2 * _bound(ts.bfloat16, u)
    else:
        assert up_split is None


def test_gated_backward_takes_it_when_preferred(cp, rng, monkeypatch):
    m, n, k = 900, 1000, 128
    _, a = _pattern(cp, rng, m, n, 256, 8, 0.03, ts.bfloat16)
    up = _same_values_parts(cp, rng, a.parts, ts.bfloat16)
    dy = cp.asarray(rng.standard_normal((m, k)).astype(ts.bfloat16))
    w_down_t = cp.asarray(rng.standard_normal((n, k)).astype(ts.bfloat16))
    gathered = _gpu_ops.sddmm_gated_backward(a.parts, 256, dy, w_down_t, up)
    monkeypatch.setattr(_tiled_sddmm, "PREFERRED", True)
    tiled = _gpu_ops.sddmm_gated_backward(a.parts, 256, dy, w_down_t, up)
    for got, want in zip(tiled, gathered, strict=True):
        expected = _dense(cp, want, (m, n), 256)
        assert rel_error(_dense(cp, got, (m, n), 256), expected) <= 4 * _bound(ts.bfloat16, expected)


def test_gated_plan_takes_it_when_preferred(cp, monkeypatch):
    p = ffn_problem(1000, 256, 1100, 0.02, "uniform", ts.bfloat16, 3, cp)
    plan = ts.GatedFFN(p["w_gate"], p["w_up"], p["w_down"], dispatch="sparse")
    default = plan(p["x"])
    monkeypatch.setattr(_tiled_sddmm, "PREFERRED", True)
    tiled = plan(p["x"])
    expected = cp.asnumpy(default).astype(np.float64)
    assert rel_error(tiled, expected) <= 4 * _bound(ts.bfloat16, expected)
