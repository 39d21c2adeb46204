"""The tiled up projection (cuda/twell_tiled_up.cu) against the float64 reference: a partial
token block, a partial unit part, a partial last slice, spill entries, empty rows, boxes that
take many rounds, poisoned outputs, NaN in an x row and Inf in a W_up row that no entry uses;
and its pack against the gate's entries."""

from __future__ import annotations

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _gpu_ops, _tiled_up
from twellsparse.testing import ffn_problem, rel_error, sparse_activations

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16]

# (m, n, k, tile_n, capacity, density, tokens per block)
SHAPES = [
    (1, 40, 16, 32, None, 0.5, None),
    (67, 5632, 2048, 256, None, 0.01, None),  # the standard widths: 8 parts of 704 units
    (300, 2000, 1048, 32, 2, 0.08, 64),  # heavy spill; 32.75 slices: a partial last one
    (1000, 1500, 200, 64, 4, 0.3, None),  # ~110K entries per box: many rounds of 512 tiles of 8
    (4100, 5632, 64, 256, 32, 0.005, 512),  # a partial last token block
    (2000, 5632, 96, 256, None, 0.005, 768),  # x's rows past 512, right after 704 units' boxes
    (1000, 600, 72, 64, 4, 0.02, 936),  # one part of 600 units: the buffer's last rows
]


def _round(x, dtype):
    return np.asarray(x, dtype=np.float64).astype(dtype).astype(np.float64)


def _bound(dtype, expected):
    rounded = _round(expected, dtype)
    return 2.0 * rel_error(rounded, expected) + 1e-4


def _dense(cp, parts, shape, tile_n):
    return cp.asnumpy(ts.twell_array._from_parts(parts, shape, tile_n).toarray()).astype(np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density, tokens", SHAPES)
def test_tiled_gated_up_matches_float64(cp, rng, dtype, m, n, k, tile_n, capacity, density, tokens):
    """u against the exact dot rounded to the value type, h bitwise round(gate * u) from the
    kernel's own u, both against the row gathers' u within rounding; every stored slot written
    (outputs poisoned with NaN), padding left alone."""
    g = sparse_activations(m, n, density, "skewed", dtype, rng)
    if m > 1:  # an empty row (not the only one: the gate would be all zero)
        g[m // 2] = 0
    gate = ts.twell_array(cp.asarray(g), tile_n=tile_n, capacity=capacity)
    x = rng.standard_normal((m, k)).astype(dtype)
    w_up = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(dtype)
    if m > 1:
        x[m // 2] = np.nan  # the empty row's x: its quad's other tokens must not see it
    unused = np.flatnonzero(~g.any(axis=0))
    if unused.size:  # a W_up row no entry uses (padding entries may read it; never kept)
        w_up[unused[0]] = np.inf
    expected = np.where(g != 0, x.astype(np.float64) @ np.where(np.isinf(w_up), 0, w_up).astype(np.float64).T, 0.0)
    x_gpu, w_gpu = cp.asarray(x), cp.asarray(w_up)
    assert _tiled_up.applies(gate.parts, x_gpu, w_gpu)
    poison = gate.parts._replace(
        data=cp.full(gate.parts.data.shape, np.nan, dtype=dtype),
        spill_data=cp.full(gate.parts.spill_data.shape, np.nan, dtype=dtype),
    )
    up = poison._replace(data=poison.data.copy(), spill_data=poison.spill_data.copy())
    _tiled_up.gated_up(gate.parts, tile_n, x_gpu, w_gpu, poison, up, tokens=tokens)
    got_u, got_h = _dense(cp, up, (m, n), tile_n), _dense(cp, poison, (m, n), tile_n)
    assert np.isfinite(got_u).all() and np.isfinite(got_h).all()
    assert rel_error(got_u, _round(expected, dtype)) <= _bound(dtype, expected)
    np.testing.assert_array_equal(got_h, np.where(g != 0, _round(g.astype(np.float64) * got_u, dtype), 0.0))
    # Padding slots (past each row-tile's count) untouched.
    counts = cp.asnumpy(gate.parts.counts)
    slots = np.arange(gate.parts.data.shape[2])[None, None, :] >= counts[:, :, None]
    assert np.isnan(cp.asnumpy(up.data).astype(np.float64)[slots]).all()
    _, u_gather = _gpu_ops.gated_up(gate.parts, tile_n, x_gpu, w_gpu, True, path="gather")
    assert rel_error(got_u, _dense(cp, u_gather, (m, n), tile_n)) <= 2 * _bound(dtype, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density, tokens", SHAPES)
def test_tiled_backward_matches_float64_and_the_gathers(cp, rng, dtype, m, n, k, tile_n, capacity, density, tokens):
    """The backward form (dy and W_down's transpose in the places of x and W_up): d_z = d_h * u
    and d_u = d_h * g against float64 of d_h = dy . W_down[:, j] rounded to the value type, h
    bitwise the row gathers' fused kernel's g * u, d_z and d_u within rounding of theirs; every
    stored slot written (outputs poisoned with NaN), padding left alone, spill included."""
    g = sparse_activations(m, n, density, "skewed", dtype, rng)
    if m > 1:
        g[m // 2] = 0
    gate = ts.twell_array(cp.asarray(g), tile_n=tile_n, capacity=capacity)
    u_dense = np.where(g != 0, rng.standard_normal((m, n)), 0.0).astype(dtype)
    up = ts.twell_array(cp.asarray(u_dense), tile_n=tile_n, capacity=capacity)
    assert up.nnz == gate.nnz  # u on the gate's pattern (no zero drawn there)
    dy = rng.standard_normal((m, k)).astype(dtype)
    w_down_t = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(dtype)
    if m > 1:
        dy[m // 2] = np.nan  # the empty row's dy: its quad's other tokens must not see it
    unused = np.flatnonzero(~g.any(axis=0))
    if unused.size:  # a W_down column no entry uses
        w_down_t[unused[0]] = np.inf
    d_h = _round(dy.astype(np.float64) @ np.where(np.isinf(w_down_t), 0, w_down_t).astype(np.float64).T, dtype)
    d_h = np.where(g != 0, d_h, 0.0)
    u64, g64 = u_dense.astype(np.float64), g.astype(np.float64)
    dy_gpu, w_gpu = cp.asarray(dy), cp.asarray(w_down_t)
    assert _tiled_up.applies(gate.parts, dy_gpu, w_gpu)
    poisoned = [
        gate.parts._replace(
            data=cp.full(gate.parts.data.shape, np.nan, dtype=dtype),
            spill_data=cp.full(gate.parts.spill_data.shape, np.nan, dtype=dtype),
        )
        for _ in range(3)
    ]
    d_z, d_u, h = poisoned
    _tiled_up.gated_backward(gate.parts, tile_n, dy_gpu, w_gpu, up.parts, d_z, d_u, h, tokens=tokens)
    got = {name: _dense(cp, parts, (m, n), tile_n) for name, parts in (("z", d_z), ("u", d_u), ("h", h))}
    for name, values in got.items():
        assert np.isfinite(values).all(), name
    for name, expected in (("z", d_h * u64), ("u", d_h * g64)):
        assert rel_error(got[name], _round(expected, dtype)) <= _bound(dtype, expected), name
    counts = cp.asnumpy(gate.parts.counts)
    slots = np.arange(gate.parts.data.shape[2])[None, None, :] >= counts[:, :, None]
    for parts in poisoned:  # padding slots untouched
        assert np.isnan(cp.asnumpy(parts.data).astype(np.float64)[slots]).all()
    gathers = _gpu_ops.sddmm_gated_backward(gate.parts, tile_n, dy_gpu, w_gpu, up.parts, path="gather")
    want = {name: _dense(cp, parts, (m, n), tile_n) for name, parts in zip("zuh", gathers, strict=True)}
    np.testing.assert_array_equal(got["h"], want["h"])
    for name in "zu":  # d_h from sums in another order: within rounding
        assert rel_error(got[name], want[name]) <= 2 * _bound(dtype, d_h * (u64 if name == "z" else g64)), name


@pytest.mark.parametrize("m, n, k, tile_n, capacity, density, tokens", SHAPES)
def test_x_loaded_once_a_quad_gives_the_same_bits(cp, rng, monkeypatch, m, n, k, tile_n, capacity, density, tokens):
    """TWELL_TILED_UP_SHARED_B (x's fragment loaded only where the tile's quad changes) computes
    the same products in the same order: u and h bitwise those of the per-tile loads, over the
    shapes above (many tiles a quad at 8-30%, one at 0.5-1%)."""
    g = sparse_activations(m, n, density, "skewed", ts.bfloat16, rng)
    gate = ts.twell_array(cp.asarray(g), tile_n=tile_n, capacity=capacity)
    x = cp.asarray(rng.standard_normal((m, k)).astype(ts.bfloat16))
    w_up = cp.asarray((rng.standard_normal((n, k)) / np.sqrt(k)).astype(ts.bfloat16))
    if not _tiled_up.applies(gate.parts, x, w_up):
        pytest.skip("the tiled up projection needs a compute-capability 9.0 GPU")
    results = []
    for shared_b in (False, True):
        monkeypatch.setattr(_tiled_up, "SHARED_B", shared_b)
        h, up = _gpu_ops.gated_up(gate.parts, tile_n, x, w_up, True, path="tiled")
        results.append([_dense(cp, parts, (m, n), tile_n) for parts in (h, up)])  # stored slots only
    for per_tile, per_quad in zip(*results, strict=True):
        assert np.isfinite(per_tile).all()
        np.testing.assert_array_equal(per_quad, per_tile)


@pytest.mark.parametrize("m, n, k, tile_n, capacity, density, tokens", SHAPES)
def test_pairs_sharing_x_give_the_same_bits(cp, rng, monkeypatch, m, n, k, tile_n, capacity, density, tokens):
    """TWELL_TILED_UP_PAIRS (clusters of two blocks, consecutive unit parts of one token block,
    each copying half of x's boxes into both by TMA multicast) computes the same sums in the
    same order: the forward's u and h and the backward's d_z, d_u and h bitwise the single
    blocks', over the shapes above (an odd count of parts, whose pad part owns no tiles; boxes
    of many rounds, where a pair streams the busier block's; a partial last token block and
    slice; heavy spill)."""
    g = sparse_activations(m, n, density, "skewed", ts.bfloat16, rng)
    gate = ts.twell_array(cp.asarray(g), tile_n=tile_n, capacity=capacity)
    u_dense = np.where(g != 0, rng.standard_normal((m, n)), 0.0).astype(ts.bfloat16)
    up = ts.twell_array(cp.asarray(u_dense), tile_n=tile_n, capacity=capacity)
    x = cp.asarray(rng.standard_normal((m, k)).astype(ts.bfloat16))
    w = cp.asarray((rng.standard_normal((n, k)) / np.sqrt(k)).astype(ts.bfloat16))
    if not _tiled_up.applies(gate.parts, x, w):
        pytest.skip("the tiled up projection needs a compute-capability 9.0 GPU")

    def poisoned():
        return gate.parts._replace(
            data=cp.full(gate.parts.data.shape, np.nan, dtype=ts.bfloat16),
            spill_data=cp.full(gate.parts.spill_data.shape, np.nan, dtype=ts.bfloat16),
        )

    results = []
    for pairs in (False, True):
        monkeypatch.setattr(_tiled_up, "PAIRS", pairs)
        h, u = poisoned(), poisoned()
        _tiled_up.gated_up(gate.parts, tile_n, x, w, h, u, tokens=tokens)
        d_z, d_u, h_bwd = poisoned(), poisoned(), poisoned()
        _tiled_up.gated_backward(gate.parts, tile_n, x, w, up.parts, d_z, d_u, h_bwd, tokens=tokens)
        results.append([_dense(cp, parts, (m, n), tile_n) for parts in (h, u, d_z, d_u, h_bwd)])
    for single, paired in zip(*results, strict=True):
        assert np.isfinite(single).all()
        np.testing.assert_array_equal(paired, single)


def test_tiled_gated_up_without_u_and_strided_x(cp, rng, monkeypatch):
    """u not kept (a null pointer), x a column slice of a wider array; the auto path with the
    kernel forced gives the same bits."""
    m, n, k = 520, 1408, 96
    g = sparse_activations(m, n, 0.02, "uniform", ts.bfloat16, rng)
    gate = ts.twell_array(cp.asarray(g), tile_n=256)
    wide = cp.asarray(rng.standard_normal((m, k + 32)).astype(ts.bfloat16))
    x = wide[:, :k]
    w_up = cp.asarray((rng.standard_normal((n, k)) / 10).astype(ts.bfloat16))
    h, none = _gpu_ops.gated_up(gate.parts, 256, x, w_up, False, path="tiled")
    assert none is None
    h_kept, _ = _gpu_ops.gated_up(gate.parts, 256, x, w_up, True, path="tiled")
    got = _dense(cp, h, (m, n), 256)
    np.testing.assert_array_equal(got, _dense(cp, h_kept, (m, n), 256))
    u_exact = cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(w_up).astype(np.float64).T
    expected = np.where(g != 0, g.astype(np.float64) * _round(u_exact, ts.bfloat16), 0.0)
    assert rel_error(got, expected) <= 2 * _bound(ts.bfloat16, expected)
    monkeypatch.setattr(_tiled_up, "PREFERRED", True)
    h_auto, _ = _gpu_ops.gated_up(gate.parts, 256, x, w_up, False)
    np.testing.assert_array_equal(_dense(cp, h_auto, (m, n), 256), got)


@pytest.mark.parametrize("capacity", [None, 2])
def test_tiled_pack_holds_every_entry_once_in_parity_order(cp, rng, capacity):
    m, n, tile_n, tokens = 203, 1500, 64, 64
    g = sparse_activations(m, n, 0.05, "skewed", ts.bfloat16, rng)
    gate = ts.twell_array(cp.asarray(g), tile_n=tile_n, capacity=capacity)
    parts = gate.parts
    t, units, n_parts = _tiled_up.geometry(m, n, tokens)
    tile_ptr, codes, dests, quads = (cp.asnumpy(a) for a in _tiled_up.pack(parts, tile_n, n, t, units, n_parts))
    nt, cap = parts.data.shape[1:]
    indices = cp.asnumpy(parts.indices).astype(np.int64)
    spill_cols = cp.asnumpy(parts.spill_indices)
    spill_rows = np.repeat(np.arange(m), np.diff(cp.asnumpy(parts.spill_indptr)))
    quads_per_block = t // _tiled_up.QUAD
    seen = []
    for item in range(tile_ptr.size - 1):
        quad, blk = item % quads_per_block, item // quads_per_block
        up, tb = blk % n_parts, blk // n_parts
        tok0, u_lo = tb * t + quad * _tiled_up.QUAD, up * units
        first, last = tile_ptr[item], tile_ptr[item + 1]
        assert (quads[first:last] == quad).all()
        item_codes = codes[first * 8 : last * 8].astype(np.int64)
        item_dests = dests[first * 8 : last * 8]
        real = item_dests != np.int32(-(2**31))
        n_real = int(real.sum())
        assert real[:n_real].all() and last - first == -(-n_real // 8)  # padding only at the end
        parity = item_codes[:n_real] & 1
        two_m = 2 * min(int((parity == 0).sum()), int((parity == 1).sum()))
        assert (parity[:two_m] == np.arange(two_m) % 2).all()
        for code, dest in zip(item_codes[:n_real], item_dests[:n_real], strict=True):
            token, unit = tok0 + (code >> 12), u_lo + (code & 0xFFF)
            if dest >= 0:
                row, tile = dest // (nt * cap), dest // cap % nt
                col = tile * tile_n + indices.reshape(-1)[dest]
            else:
                row, col = spill_rows[~dest], spill_cols[~dest]
            assert (row, col) == (token, unit)
            seen.append((token, unit))
    assert sorted(seen) == sorted(zip(*np.nonzero(g), strict=True))


@pytest.mark.parametrize(
    "m, n, tile_n, capacity, density, pattern, tokens",
    [
        (203, 600, 64, 2, 0.05, "skewed", 68),  # one part, 17 quads a block: 51 items, the last warp half empty
        (203, 1500, 64, None, 0.05, "skewed", 64),  # two parts of 750 units
        (300, 2000, 32, 2, 0.08, "uniform", 64),  # heavy spill: the halves' spill loops differ in length
        (1000, 5632, 256, None, 0.01, "uniform", 768),  # the standard widths' parts and blocks
    ],
)
def test_pack_on_half_warps_is_the_whole_warps_pack(cp, rng, m, n, tile_n, capacity, density, pattern, tokens):
    g = sparse_activations(m, n, density, pattern, ts.bfloat16, rng)
    parts = ts.twell_array(cp.asarray(g), tile_n=tile_n, capacity=capacity).parts
    t, units, n_parts = _tiled_up.geometry(m, n, tokens)
    half, whole = (_tiled_up.pack(parts, tile_n, n, t, units, n_parts, width=w) for w in (16, 32))
    tiles = int(whole[0][-1])
    assert int(half[0][-1]) == tiles > 0
    np.testing.assert_array_equal(cp.asnumpy(half[0]), cp.asnumpy(whole[0]))
    for a, b, size in zip(half[1:], whole[1:], (8 * tiles, 8 * tiles, tiles), strict=True):
        np.testing.assert_array_equal(cp.asnumpy(a[:size]), cp.asnumpy(b[:size]))


def _beyond_a_small_l2(cp, rng, monkeypatch, m, d, f, density):
    """A skewed gated problem, ``(x, w_gate, w_up, w_down, gate)``, with "auto" left to its rule
    and a 64 KB L2, so that any W_up outgrows it; skipped where the tiled kernel cannot run."""
    p = ffn_problem(m, d, f, density, "skewed", ts.bfloat16, rng, cp)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    gate = ts.linear_to_twell(x, wg)
    if not _tiled_up.applies(gate.parts, x, wu):
        pytest.skip("the tiled up projection needs a compute-capability 9.0 GPU")
    monkeypatch.setattr(_tiled_up, "PREFERRED", None)
    monkeypatch.setattr(_tiled_up.K, "l2_bytes", lambda: 64 * 1024)
    return x, wg, wu, wd, gate


def _spy_on_block_tokens(monkeypatch):
    """``(seen, real)``: every later call of ``_tiled_up.block_tokens`` appends its (density
    estimate, tokens per block) to ``seen``; ``real`` is the function itself."""
    seen = []
    real = _tiled_up.block_tokens
    monkeypatch.setattr(
        _tiled_up, "block_tokens", lambda m, n, e, sms: seen.append((e, real(m, n, e, sms))) or seen[-1][1]
    )
    return seen, real


@pytest.mark.parametrize("density", [0.01, 0.06])
def test_auto_plan_takes_it_for_weights_beyond_the_l2_sized_by_the_density(cp, rng, monkeypatch, density):
    """A gated plan whose W_up outgrows the L2 (here a 64 KB one) runs its up projection on the
    tiled kernel under "auto", with token blocks sized from the plan's density estimate (fewer
    at the higher density), and matches float64 of the same roundings; the same plan with the
    kernel switched off (the row gathers) agrees."""
    m, d, f = 1500, 136, 3000
    x, wg, wu, wd, gate = _beyond_a_small_l2(cp, rng, monkeypatch, m, d, f, density)
    seen, real = _spy_on_block_tokens(monkeypatch)
    plan = ts.GatedFFN(wg, wu, wd, dispatch="sparse")
    for _ in range(3):  # the first call has no estimate yet; later ones size the blocks by it
        out = cp.full((m, d), np.nan, dtype=ts.bfloat16)
        plan(x, out=out)
    # One launch a call, two where rows overflow (the spill's pass); the first call's without an estimate.
    assert len(seen) >= 3 and seen[0] == (None, _tiled_up.TOKENS)
    estimate, tokens = seen[-1]
    assert estimate is not None and abs(estimate - density) < 0.5 * density
    assert tokens == real(m, f, estimate, _tiled_up.K.sm_count()) < _tiled_up.TOKENS
    g = cp.asnumpy(gate.toarray()).astype(np.float64)
    xs, ws, wds = (cp.asnumpy(a).astype(np.float64) for a in (x, wu, wd))
    h = _round(g * _round(xs @ ws.T, ts.bfloat16), ts.bfloat16)
    expected = h @ wds.T
    got = cp.asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all()
    assert rel_error(got, expected) <= 4.0 * rel_error(_round(expected, ts.bfloat16), expected) + 1e-3
    monkeypatch.setattr(_tiled_up, "PREFERRED", False)
    assert rel_error(got, cp.asnumpy(plan(x)).astype(np.float64)) <= 1e-2


def test_torch_training_step_takes_it_beyond_the_l2_and_keeps_u(cp, monkeypatch):
    """The torch adapter's gated forward and backward with W_up beyond a (64 KB) L2: the forward
    keeps u from the tiled kernel for the backward, whose sampled product runs on its backward
    form; values and every gradient against float64 autograd, and against the same step on the
    row gathers."""
    torch = pytest.importorskip("torch")
    import twellsparse.torch as tt

    monkeypatch.setattr(_tiled_up, "PREFERRED", None)
    monkeypatch.setattr(_tiled_up.K, "l2_bytes", lambda: 64 * 1024)
    g = torch.Generator().manual_seed(3)
    m, d, f = 700, 128, 1000
    shapes = ((m, d), (f, d), (f, d), (d, f))
    leaves = [torch.randn(*s, generator=g, dtype=torch.float64) / s[-1] ** 0.5 for s in shapes]
    leaves[0] *= 4
    inputs = [t.to("cuda", torch.bfloat16).requires_grad_() for t in leaves]
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tiled up projection needs a compute-capability 9.0 GPU")
    calls, backward_calls = [], []
    real, real_backward = _tiled_up.gated_up, _tiled_up.gated_backward
    monkeypatch.setattr(_tiled_up, "gated_up", lambda *a, **kw: calls.append(a[5] is not None) or real(*a, **kw))
    spy = lambda *a, **kw: backward_calls.append(1) or real_backward(*a, **kw)  # noqa: E731
    monkeypatch.setattr(_tiled_up, "gated_backward", spy)
    grad = torch.randn(m, d, generator=g, dtype=torch.float64).to("cuda")
    out = tt.gated_ffn(*inputs, capacity=8)
    grads = torch.autograd.grad(out, inputs, grad.to(torch.bfloat16))
    assert calls and all(calls)  # the tiled kernel ran, keeping u
    assert backward_calls  # and the backward's sampled product on it (W_down's transpose beyond the L2 too)
    ref64 = [t.detach().double().requires_grad_() for t in inputs]
    xs, wg, wu, wd = ref64
    ref = (torch.relu(xs @ wg.T) * (xs @ wu.T)) @ wd.T
    assert ((out.double() - ref).norm() / ref.norm()).item() < 3e-2
    for a, b in zip(grads, torch.autograd.grad(ref, ref64, grad), strict=True):
        assert ((a.double() - b).norm() / b.norm()).item() < 1.2e-1
    monkeypatch.setattr(_tiled_up, "PREFERRED", False)
    out_gather = tt.gated_ffn(*inputs, capacity=8)
    grads_gather = torch.autograd.grad(out_gather, inputs, grad.to(torch.bfloat16))
    assert ((out.double() - out_gather.double()).norm() / out_gather.double().norm()).item() < 1e-2
    for a, b in zip(grads, grads_gather, strict=True):  # u rounded after other fp32 sums
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 2e-2


def test_torch_forwards_size_its_blocks_from_the_previous_forward(cp, rng, monkeypatch):
    """The torch adapter has no plan: its forward posts the producer's entry total per weight,
    and the next forward with the same weight takes it as the density estimate (no host read),
    so the tiled kernel's token blocks follow the data as a plan's do; another weight array
    starts without one. The outputs stay within rounding of each other."""
    torch = pytest.importorskip("torch")
    import twellsparse.torch as tt

    m, d, f = 1500, 136, 3000
    arrays = _beyond_a_small_l2(cp, rng, monkeypatch, m, d, f, 0.03)
    x, w_gate, w_up, w_down = (torch.from_dlpack(a) for a in arrays[:4])
    density = arrays[4].nnz / (m * f)
    seen, real = _spy_on_block_tokens(monkeypatch)
    outs = []
    for _ in range(3):
        outs.append(tt.gated_ffn(x, w_gate, w_up, w_down))
        torch.cuda.synchronize()  # the posted total lands before the next forward looks
    assert seen[0][0] is None  # the first forward with this weight has no estimate yet
    estimate, tokens = seen[-1]
    assert estimate is not None and abs(estimate - density) < 0.02 * density
    assert tokens == real(m, f, estimate, _tiled_up.K.sm_count())
    for out in outs[1:]:  # other token blocks group the same sums differently at most
        assert ((out.double() - outs[0].double()).norm() / outs[0].double().norm()).item() < 1e-2
    seen.clear()
    tt.gated_ffn(x, w_gate.clone(), w_up, w_down)  # another array: no estimate of its own yet
    assert seen[0][0] is None


def test_fixed_spill_plan_with_it_runs_inside_a_graph_capture(cp, rng, monkeypatch):
    """A gated plan with a fixed spill_capacity (no read-back) whose W_up outgrows a (64 KB) L2
    captured in a CUDA graph: the tiled kernel's pack and launch record and replay, and the
    replay writes the eager call's bits (the token blocks fixed by the estimate both saw)."""
    m, d, f = 900, 136, 2000
    x, wg, wu, wd, _ = _beyond_a_small_l2(cp, rng, monkeypatch, m, d, f, 0.02)
    calls = []
    real = _tiled_up.gated_up
    monkeypatch.setattr(_tiled_up, "gated_up", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    plan = ts.GatedFFN(wg, wu, wd, dispatch="sparse", spill_capacity=m * 16)
    pool = cp.cuda.MemoryPool()  # the graph's own memory
    stream = cp.cuda.Stream(non_blocking=True)
    with cp.cuda.using_allocator(pool.malloc), stream:
        for _ in range(2):  # the second call sees the first one's density estimate
            eager = plan(x)
        stream.synchronize()
        out = cp.full((m, d), np.nan, dtype=ts.bfloat16)
        stream.begin_capture()
        plan(x, out=out)
        graph = stream.end_capture()
        out.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    plan.check_spill()
    assert len(calls) == 3  # two eager calls and the captured one, each on the tiled kernel
    np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint16), cp.asnumpy(eager).view(np.uint16))
