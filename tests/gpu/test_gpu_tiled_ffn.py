"""The gated consumer on one pack (cuda/twell_tiled_ffn.cu + the tiled SpMM) on the device: the
up projection's words against float64 (rows and units kept, h = g * u), the whole consumer
against float64 and the row gathers' consumer over odd shapes, spill, partial token blocks,
chunks and slices, several rounds; the plan and the switch; and the training forward (keep_up)
left to the other path."""

from __future__ import annotations

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _gpu_ops, _tiled_ffn, _tiled_spmm
from twellsparse.testing import ffn_problem, rel_error, sparse_activations

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16]

# (m, f, d, tile_n, capacity, density): m tokens, f units, d_model
SHAPES = [
    (1, 40, 16, 32, None, 0.5),
    (67, 5632, 2048, 256, None, 0.01),  # the standard widths
    (700, 1100, 72, 64, 2, 0.05),  # spill; partial chunk, token block and slice
    (530, 600, 40, 32, 4, 0.02),  # d_model 40: a slice of 8 columns past it
    (4100, 700, 64, 256, 32, 0.005),  # nine token blocks
    (16, 512, 32, 512, None, 0.9),  # dense rows: several rounds of k-groups
    (5, 1, 8, 32, None, 1.0),  # one unit, d_model 8: one slice of 8 columns, one partial chunk
]


def _problem(cp, rng, m, f, d, tile_n, capacity, density, dtype):
    g = sparse_activations(m, f, density, "skewed", dtype, rng)
    if m > 1:  # a token with no active unit (not the only one: the gate would be all zero)
        g[m // 2] = 0
    x = rng.standard_normal((m, d)).astype(dtype)
    w_up = (rng.standard_normal((f, d)) / np.sqrt(d)).astype(dtype)
    w_down_t = (rng.standard_normal((f, d)) / np.sqrt(max(1.0, density * f))).astype(dtype)
    gate = ts.twell_array(cp.asarray(g), tile_n=tile_n, capacity=capacity)
    return g, gate, x, w_up, w_down_t


def _skip_unless_hopper(gate, x, w_up, w_down_t):
    """Skip off compute capability 9.0 (both kernels' one target, sm_90a); there every operand
    set these tests pass (2-byte values of one dtype, 16-byte rows) is served, so a refusal
    fails."""
    import cupy

    if str(cupy.cuda.Device().compute_capability) != "90":
        pytest.skip("the one-pack consumer runs on compute capability 9.0 only")
    assert _tiled_ffn.applies(gate.parts, x, w_up, w_down_t)


@pytest.fixture(params=[False, True], ids=["single", "pairs"])
def pairs(request, monkeypatch):
    """The up kernel alone, and in clusters of two blocks sharing x (TWELL_TILED_FFN_PAIRS)."""
    monkeypatch.setattr(_tiled_ffn, "PAIRS", request.param)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, f, d, tile_n, capacity, density", SHAPES)
def test_up_words_hold_h_at_every_entry(cp, rng, pairs, dtype, m, f, d, tile_n, capacity, density):
    g, gate, x, w_up, w_down_t = _problem(cp, rng, m, f, d, tile_n, capacity, density, dtype)
    xs, ws = cp.asarray(x), cp.asarray(w_up)
    _skip_unless_hopper(gate, xs, ws, cp.asarray(w_down_t))
    packed = _tiled_spmm.pack(gate.parts, tile_n, f)
    h_words = cp.asnumpy(_tiled_ffn.gated_up_words(packed, m, xs, ws))
    kg_ptr, words = cp.asnumpy(packed.kg_ptr), cp.asnumpy(packed.words[0])
    n = int(kg_ptr[-1]) * 16
    words, h_words = words[:n], h_words[:n]
    assert np.array_equal(h_words & 0xFFFF, words & 0xFFFF)  # rows and units kept, all written
    item = np.repeat(np.arange(kg_ptr.size - 1), np.diff(kg_ptr) * 16)
    rows = (item // packed.n_chunks) * 8 + _tiled_spmm.word_rows(words)
    units = (item % packed.n_chunks) * 512 + _tiled_spmm.word_b_rows(words)
    g_vals = (words >> 16).astype(np.uint16).view(dtype).astype(np.float64)
    h_vals = (h_words >> 16).astype(np.uint16).view(dtype).astype(np.float64)
    assert (h_vals[g_vals == 0] == 0).all()  # padding
    real = g_vals != 0
    assert real.sum() == np.count_nonzero(g)  # every entry of the gate once
    u = np.einsum("ij,ij->i", x[rows[real]].astype(np.float64), w_up[units[real]].astype(np.float64))
    exact = g_vals[real] * u
    eps = 2.0**-7 if dtype == ts.bfloat16 else 2.0**-10
    scale = np.abs(g_vals[real]) * np.linalg.norm(x[rows[real]].astype(np.float64), axis=1) / np.sqrt(d)
    assert (np.abs(h_vals[real] - exact) <= 2 * eps * (np.abs(exact) + 1e-2 * scale)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, f, d, tile_n, capacity, density", SHAPES)
def test_consumer_matches_float64_and_the_row_gathers(cp, rng, monkeypatch, dtype, m, f, d, tile_n, capacity, density):
    g, gate, x, w_up, w_down_t = _problem(cp, rng, m, f, d, tile_n, capacity, density, dtype)
    xs, ws, wds = cp.asarray(x), cp.asarray(w_up), cp.asarray(w_down_t)
    _skip_unless_hopper(gate, xs, ws, wds)
    u = (x.astype(np.float64) @ w_up.astype(np.float64).T).astype(dtype).astype(np.float64)
    h = (g.astype(np.float64) * u).astype(dtype).astype(np.float64)  # the paths' two roundings
    expected = h @ w_down_t.astype(np.float64)
    out = cp.full((m, d), np.nan, dtype=dtype)
    _tiled_ffn.gated_consumer(gate.parts, tile_n, xs, ws, wds, out)
    rounded = expected.astype(dtype).astype(np.float64)
    bound = 4.0 * rel_error(rounded, expected) + 1e-3
    assert rel_error(out, expected) <= bound
    monkeypatch.setattr(_tiled_ffn, "PREFERRED", False)
    gathered, _ = _gpu_ops.gated_consumer(gate.parts, tile_n, xs, ws, wds)
    assert rel_error(out, cp.asnumpy(gathered).astype(np.float64)) <= 2 * bound


def test_consumer_takes_it_only_when_switched_on_and_keeps_u_for_training(cp, rng, monkeypatch):
    _, gate, x, w_up, w_down_t = _problem(cp, rng, 600, 1100, 64, 256, 8, 0.03, ts.bfloat16)
    xs, ws, wds = cp.asarray(x), cp.asarray(w_up), cp.asarray(w_down_t)
    _skip_unless_hopper(gate, xs, ws, wds)
    calls = []
    real = _tiled_ffn.gated_consumer
    monkeypatch.setattr(_tiled_ffn, "gated_consumer", lambda *args: calls.append(1) or real(*args))
    results, ups = [], []
    for preferred, keep_up in ((None, True), (True, False), (True, True)):
        monkeypatch.setattr(_tiled_ffn, "PREFERRED", preferred)
        out, up = _gpu_ops.gated_consumer(gate.parts, 256, xs, ws, wds, keep_up=keep_up)
        assert (up is not None) == keep_up
        results.append(cp.asnumpy(out).astype(np.float64))
        ups.append(up)
    assert len(calls) == 2
    for other in results[1:]:
        assert rel_error(other, results[0]) < 1e-2
    # u in the gate's layout: the row gathers' values (up to a rounding of the fp32 sums), zero
    # in the padding slots of both
    for got, want in zip(ups[2], ups[0], strict=True):
        if got.dtype.kind == "f":
            assert rel_error(got, cp.asnumpy(want).astype(np.float64)) < 1e-2
            assert np.array_equal(cp.asnumpy(got) == 0, cp.asnumpy(want) == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, f, d, tile_n, capacity, density", [SHAPES[1], SHAPES[2], SHAPES[3], SHAPES[5]])
def test_backward_matches_the_fused_row_gathers_and_float64(cp, rng, pairs, dtype, m, f, d, tile_n, capacity, density):
    """d_z, d_u and h in the gate's layout against the row gathers' fused backward, and dX (the
    dual SpMM on the same pack's words) against float64 of those values."""
    _, gate, x, w_up, w_down_t = _problem(cp, rng, m, f, d, tile_n, capacity, density, dtype)
    dy, ws, wds = (cp.asarray(a) for a in (x, w_up, w_down_t))
    w_gate = cp.asarray((rng.standard_normal((f, d)) / np.sqrt(d)).astype(dtype))
    _skip_unless_hopper(gate, dy, wds, ws)
    up = _gpu_ops.gated_up(gate.parts, tile_n, cp.asarray(x), ws, keep_up=True)[1]
    assert _tiled_ffn.applies_backward(gate.parts, dy, wds, up, w_gate, ws)
    dx, d_z, d_u, h = _tiled_ffn.gated_backward(gate.parts, tile_n, dy, wds, up, w_gate, ws)
    want = _gpu_ops.sddmm_gated_backward(gate.parts, tile_n, dy, wds, up, path="gather")
    for got, ref in zip((d_z, d_u, h), want, strict=True):
        for a, b in ((got.data, ref.data), (got.spill_data, ref.spill_data)):
            b_host = cp.asnumpy(b).astype(np.float64)
            assert rel_error(a, b_host) <= 1e-2
            assert np.array_equal(cp.asnumpy(a) == 0, b_host == 0)  # zero padding in both
    dense = {name: ts.twell_array._from_parts(p, (m, f), tile_n).toarray() for name, p in (("z", d_z), ("u", d_u))}
    expected = cp.asnumpy(dense["z"]).astype(np.float64) @ cp.asnumpy(w_gate).astype(np.float64)
    expected += cp.asnumpy(dense["u"]).astype(np.float64) @ w_up.astype(np.float64)
    rounded = expected.astype(dtype).astype(np.float64)
    assert rel_error(dx, expected) <= 4.0 * rel_error(rounded, expected) + 1e-3


def test_gated_plan_runs_it_when_preferred(cp, rng, monkeypatch):
    p = ffn_problem(700, 256, 1000, 0.05, "skewed", ts.bfloat16, rng, cp)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    plan = ts.GatedFFN(wg, wu, wd, dispatch="sparse")
    default = cp.asnumpy(plan(x)).astype(np.float64)
    _skip_unless_hopper(ts.linear_to_twell(x, wg), x, wu, cp.ascontiguousarray(wd.T))
    calls = []
    real = _tiled_ffn.gated_consumer
    monkeypatch.setattr(_tiled_ffn, "gated_consumer", lambda *args: calls.append(1) or real(*args))
    monkeypatch.setattr(_tiled_ffn, "PREFERRED", True)
    got = cp.asnumpy(plan(x)).astype(np.float64)
    assert calls and np.isfinite(got).all()
    assert rel_error(got, default) < 1e-2


def test_consumer_and_backward_run_inside_a_graph_capture(cp, rng):
    _, gate, x, w_up, w_down_t = _problem(cp, rng, 700, 1100, 64, 256, 8, 0.03, ts.bfloat16)
    xs, ws, wds = cp.asarray(x), cp.asarray(w_up), cp.asarray(w_down_t)
    _skip_unless_hopper(gate, xs, ws, wds)
    w_gate = cp.asarray((rng.standard_normal(w_up.shape) / 8).astype(ts.bfloat16))
    pool = cp.cuda.MemoryPool()  # the graph's own memory
    stream = cp.cuda.Stream(non_blocking=True)
    with cp.cuda.using_allocator(pool.malloc), stream:
        eager_out, up = _tiled_ffn.gated_consumer(gate.parts, 256, xs, ws, wds, cp.empty((700, 64), ts.bfloat16), True)
        eager_dx = _tiled_ffn.gated_backward(gate.parts, 256, xs, wds, up, w_gate, ws)[0]
        stream.synchronize()
        out = cp.full((700, 64), np.nan, dtype=ts.bfloat16)
        stream.begin_capture()
        _, up2 = _tiled_ffn.gated_consumer(gate.parts, 256, xs, ws, wds, out, True)
        dx = _tiled_ffn.gated_backward(gate.parts, 256, xs, wds, up2, w_gate, ws)[0]
        graph = stream.end_capture()
        # Poison what the replay must write (dx is a block of the graph's pool, which may hold
        # an eager result's bytes), on the replay's stream.
        out.fill(np.nan)
        dx.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    assert np.array_equal(cp.asnumpy(out).view(np.uint16), cp.asnumpy(eager_out).view(np.uint16))
    assert np.array_equal(cp.asnumpy(dx).view(np.uint16), cp.asnumpy(eager_dx).view(np.uint16))
