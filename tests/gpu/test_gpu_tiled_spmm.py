"""The tiled SpMM on the tensor cores (cuda/twell_tiled_spmm.cu) on the device: its pack word
for word against the CPU model (tests/tiled_spmm_model.py), its products against float64 and
the row gathers over odd shapes, spill, partial chunks and column blocks, wide tiles, empty rows
and a poisoned output; the dual form; a strided output; its refusals; the "auto" switch; and a
CUDA-graph capture of pack and product."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    check_spmm_result,
    chunked_activations,
    inf_in_an_unused_row,
    rounding_bound,
    skewed_twell,
    twin_values,
)
from tiled_spmm_model import balance, fragments, reference_pack, reference_pack_transposed

import twellsparse as ts
from twellsparse import _gpu_ops, _tiled_spmm
from twellsparse._parts import TwELLParts
from twellsparse.testing import rel_error

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16]

# (m, n, k, tile_n, capacity, density): A is m x n, b is n x k (the stationary tests' naming)
SHAPES = [
    (1, 40, 16, 32, None, 0.5),
    (67, 5632, 2048, 256, None, 0.01),  # the standard down projection's widths
    (300, 2000, 1048, 32, 2, 0.08),  # heavy spill; a partial last chunk and column block
    (2500, 700, 8, 64, 1, 0.3),  # many k-groups per item, all spilling; 8 columns of b
    (4100, 5632, 64, 256, 32, 0.005),  # several row blocks, the last one partial
    (515, 1030, 72, 1024, None, 0.05),  # tiles wider than a chunk
    (3, 1, 8, 32, None, 1.0),  # one column of A, 8 columns of b
]


def _skip_unless_hopper(b, out):
    """Skip off compute capability 9.0 (the kernel's one target, sm_90a); there every operand
    pair these tests pass (2-byte values, 16-byte rows) is served, so a refusal fails."""
    import cupy

    if str(cupy.cuda.Device().compute_capability) != "90":
        pytest.skip("the tiled SpMM runs on compute capability 9.0 only")
    assert _tiled_spmm.applies(b, out)


def _problem(cp, rng, m, n, tile_n, capacity, density, dtype):
    return skewed_twell(rng, m, n, tile_n, capacity, density, dtype, cp.asarray)


def _twin(cp, rng, h, a):
    h2 = twin_values(rng, h)
    return h2, ts.twell_array(cp.asarray(h2), tile_n=a.tile_n, capacity=a.capacity)


def _host(cp, parts):
    return TwELLParts(*(cp.asnumpy(p) for p in parts))


def _same_pack(cp, packed, reference):
    kg_ptr, words, n_chunks = reference
    assert packed.n_chunks == n_chunks and len(packed.words) == len(words)
    assert np.array_equal(cp.asnumpy(packed.kg_ptr), kg_ptr)
    for got, want in zip(packed.words, words, strict=True):
        assert want.size <= got.size  # the pack's bound on its padding holds
        assert np.array_equal(cp.asnumpy(got[: want.size]), want)


@pytest.mark.parametrize("others", [0, 2])
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES[:4] + SHAPES[5:])
def test_pack_matches_the_model_word_for_word(cp, rng, others, m, n, k, tile_n, capacity, density):
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, ts.bfloat16)
    _skip_unless_hopper(cp.empty((n, 8), dtype=ts.bfloat16), cp.empty((m, 8), dtype=ts.bfloat16))
    twins = tuple(_twin(cp, rng, h, a)[1] for _ in range(others))
    packed = _tiled_spmm.pack(a.parts, tile_n, n, tuple(t.parts for t in twins), dests=others > 0)
    dests: list[int] = []
    reference = reference_pack(_host(cp, a.parts), tile_n, n, tuple(_host(cp, t.parts) for t in twins), dests)
    _same_pack(cp, packed, reference)
    if others:  # each word's place in A's parts: slot index, ~spill index, PAD for padding
        assert np.array_equal(cp.asnumpy(packed.dests[: len(dests)]), np.array(dests, dtype=np.int32))


@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES[:3])
def test_fragments_match_the_model(cp, rng, m, n, k, tile_n, capacity, density):
    """The one-hot operands the product loads (tiled_spmm_fragments) bit for bit against the
    model's, every lane of every k-group."""
    _, a = _problem(cp, rng, m, n, tile_n, capacity, density, np.float16)
    _skip_unless_hopper(cp.empty((n, 8), dtype=np.float16), cp.empty((m, 8), dtype=np.float16))
    packed = _tiled_spmm.pack(a.parts, tile_n, n)
    got = cp.asnumpy(_tiled_spmm.fragments(packed)).reshape(-1, 32, 2)
    kg_ptr, words = cp.asnumpy(packed.kg_ptr), cp.asnumpy(packed.words[0])
    want = fragments(kg_ptr, words)
    n_kg = int(kg_ptr[-1])
    assert np.array_equal(got[:n_kg], want[:n_kg])


@pytest.mark.parametrize(
    "m, n, tile_n, capacity, density",
    [(300, 2000, 32, 2, 0.08), (1100, 700, 1024, None, 0.05), (1500, 5632, 256, None, 0.01), (70, 40, 32, 1, 0.6)],
)
def test_transposed_pack_matches_the_model_word_for_word(cp, rng, m, n, tile_n, capacity, density):
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, ts.bfloat16)
    _skip_unless_hopper(cp.empty((m, 8), dtype=ts.bfloat16), cp.empty((n, 8), dtype=ts.bfloat16))
    twin = _twin(cp, rng, h, a)[1]
    packed = _tiled_spmm.pack_transposed(a.parts, tile_n, n, (twin.parts,))
    _same_pack(cp, packed, reference_pack_transposed(_host(cp, a.parts), tile_n, n, (_host(cp, twin.parts),)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_tiled_spmm_matches_float64(cp, rng, dtype, m, n, k, tile_n, capacity, density):
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    b, expected = inf_in_an_unused_row(rng, h, k, dtype)  # no entry reads that row: it must not show
    b_gpu = cp.asarray(b)
    out = cp.full((m, k), np.nan, dtype=dtype)  # poisoned: every element must be written
    _skip_unless_hopper(b_gpu, out)
    _gpu_ops.spmm(a.parts, tile_n, b_gpu, out, path="tiled")
    check_spmm_result(cp, a.parts, tile_n, b_gpu, out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", [SHAPES[1], SHAPES[2], SHAPES[4]])
def test_dual_form_sums_two_products(cp, rng, dtype, m, n, k, tile_n, capacity, density):
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    h2, a2 = _twin(cp, rng, h, a)
    b, b2 = (rng.standard_normal((n, k)).astype(dtype) for _ in range(2))
    expected = h.astype(np.float64) @ b.astype(np.float64) + h2.astype(np.float64) @ b2.astype(np.float64)
    b_gpu, b2_gpu = cp.asarray(b), cp.asarray(b2)
    out = cp.full((m, k), np.nan, dtype=dtype)
    _skip_unless_hopper(b_gpu, out)
    _gpu_ops.spmm(a.parts, tile_n, b_gpu, out, path="tiled", second=(a2.parts, b2_gpu))
    assert rel_error(out, expected) <= rounding_bound(dtype, expected)


@pytest.mark.parametrize(
    "warps, operand", [(16, "fragments"), (32, "fragments"), (16, "shuffles"), (16, "prefetched"), (32, "prefetched")]
)
@pytest.mark.parametrize("m", [19, 600])
def test_prefetch_steps_over_empty_and_one_kgroup_chunks(cp, rng, monkeypatch, m, warps, operand):
    """Chunks without entries, or with a single k-group, after full ones: the prefetch of a
    warp's words runs across chunks and must not carry stale words over them (the emulator's
    patterns, tests/test_tiled_spmm_model.py; wrong rows on the H200 until the thirtieth
    session), plain and dual form, against float64."""
    monkeypatch.setattr(_tiled_spmm, "WARPS", warps)
    monkeypatch.setattr(_tiled_spmm, "OPERAND", operand)
    pattern = [40, 0, 1, 30, 0, 0, 1, 20, 1, 0, 2]
    h = chunked_activations(rng, m, [e * -(-m // 19) for e in pattern], ts.bfloat16)
    n = h.shape[1]
    a = ts.twell_array(cp.asarray(h), tile_n=256)
    h2, a2 = _twin(cp, rng, h, a)
    b, b2 = (rng.standard_normal((n, 40)).astype(ts.bfloat16) for _ in range(2))
    b_gpu, b2_gpu = cp.asarray(b), cp.asarray(b2)
    _skip_unless_hopper(b_gpu, cp.empty((m, 40), dtype=ts.bfloat16))
    out = _gpu_ops.spmm(a.parts, 256, b_gpu, cp.full((m, 40), np.nan, dtype=ts.bfloat16), path="tiled")
    expected = h.astype(np.float64) @ b.astype(np.float64)
    assert rel_error(out, expected) <= rounding_bound(ts.bfloat16, expected)
    dual = cp.full((m, 40), np.nan, dtype=ts.bfloat16)
    _gpu_ops.spmm(a.parts, 256, b_gpu, dual, path="tiled", second=(a2.parts, b2_gpu))
    expected = expected + h2.astype(np.float64) @ b2.astype(np.float64)
    assert rel_error(dual, expected) <= rounding_bound(ts.bfloat16, expected)


def test_writes_a_strided_output_and_nothing_past_it(cp, rng):
    h, a = _problem(cp, rng, 130, 900, 64, 4, 0.05, ts.bfloat16)
    b = rng.standard_normal((900, 96)).astype(ts.bfloat16)
    wide = cp.full((130, 128), 7, dtype=ts.bfloat16)
    _skip_unless_hopper(cp.asarray(b), wide[:, :96])
    _gpu_ops.spmm(a.parts, 64, cp.asarray(b), wide[:, :96], path="tiled")
    expected = h.astype(np.float64) @ b.astype(np.float64)
    assert rel_error(wide[:, :96], expected) <= rounding_bound(ts.bfloat16, expected)
    assert (cp.asnumpy(wide[:, 96:]).astype(np.float64) == 7).all()


def test_refuses_what_it_cannot_serve(cp, rng):
    _, a = _problem(cp, rng, 8, 64, 32, None, 0.1, np.float32)
    b = cp.asarray(rng.standard_normal((64, 16)).astype(np.float32))
    with pytest.raises(ValueError, match="path: 'tiled' needs 2-byte values"):
        _gpu_ops.spmm(a.parts, 32, b, cp.empty((8, 16), dtype=np.float32), path="tiled")
    odd = cp.zeros((64, 12), dtype=ts.bfloat16)  # 24-byte rows: not TMA's 16-byte multiple
    assert not _tiled_spmm.applies(odd, cp.empty((8, 12), dtype=ts.bfloat16))


def test_auto_takes_it_only_when_switched_on(cp, rng, monkeypatch):
    h, a = _problem(cp, rng, 600, 700, 64, None, 0.05, ts.bfloat16)
    b = cp.asarray(rng.standard_normal((700, 48)).astype(ts.bfloat16))
    _skip_unless_hopper(b, cp.empty((600, 48), dtype=ts.bfloat16))
    expected = h.astype(np.float64) @ cp.asnumpy(b).astype(np.float64)
    calls = []
    real = _tiled_spmm.spmm
    monkeypatch.setattr(_tiled_spmm, "spmm", lambda *args: calls.append(args) or real(*args))
    for preferred in (None, False, True):
        monkeypatch.setattr(_tiled_spmm, "PREFERRED", preferred)
        out = _gpu_ops.spmm(a.parts, 64, b, cp.full((600, 48), np.nan, dtype=ts.bfloat16))
        assert rel_error(out, expected) <= rounding_bound(ts.bfloat16, expected)
    assert len(calls) == 1


def test_pack_and_product_run_inside_a_graph_capture(cp, rng):
    h, a = _problem(cp, rng, 700, 1100, 256, 8, 0.03, ts.bfloat16)
    b = cp.asarray(rng.standard_normal((1100, 128)).astype(ts.bfloat16))
    out = cp.full((700, 128), np.nan, dtype=ts.bfloat16)
    _skip_unless_hopper(b, out)
    pool = cp.cuda.MemoryPool()  # the graph's own memory: nothing outside it reuses its blocks
    stream = cp.cuda.Stream(non_blocking=True)
    with cp.cuda.using_allocator(pool.malloc), stream:
        _tiled_spmm.spmm(a.parts, 256, b, out)  # compiles and encodes the descriptor before the capture
        out[...] = np.nan
        stream.synchronize()
        stream.begin_capture()
        _tiled_spmm.spmm(a.parts, 256, b, out)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    expected = h.astype(np.float64) @ cp.asnumpy(b).astype(np.float64)
    assert rel_error(out, expected) <= rounding_bound(ts.bfloat16, expected)


def test_balance_deals_the_groups_as_the_model_does(cp, rng):
    _, a = _problem(cp, rng, 1500, 5632, 256, None, 0.01, ts.bfloat16)
    _skip_unless_hopper(cp.empty((1500, 8), dtype=ts.bfloat16), cp.empty((5632, 8), dtype=ts.bfloat16))
    packed = _tiled_spmm.pack_transposed(a.parts, 256, 5632)
    want = balance(cp.asnumpy(packed.kg_ptr), packed.n_chunks, 5632, _tiled_spmm.WARPS)
    assert np.array_equal(cp.asnumpy(_tiled_spmm.balance(packed, 5632)), want)


@pytest.mark.parametrize("balanced", [True, False])
def test_transposed_products_with_and_without_the_deal_agree(cp, rng, monkeypatch, balanced):
    h, a = _problem(cp, rng, 2000, 3000, 64, 8, 0.02, ts.bfloat16)
    g = rng.standard_normal((2000, 64)).astype(ts.bfloat16)
    out = cp.full((3000, 64), np.nan, dtype=ts.bfloat16)
    _skip_unless_hopper(cp.asarray(g), out)
    monkeypatch.setattr(_tiled_spmm, "BALANCE_TRANSPOSED", balanced)
    _tiled_spmm.spmm_transposed(64, 3000, [(a.parts, cp.asarray(g), out)])
    expected = h.astype(np.float64).T @ g.astype(np.float64)
    assert rel_error(out, expected) <= rounding_bound(ts.bfloat16, expected)


@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", [SHAPES[1], SHAPES[2], SHAPES[4]])
def test_both_warp_counts_give_the_same_bits(cp, rng, monkeypatch, m, n, k, tile_n, capacity, density):
    """The product with 32 warps of 2 row groups against 16 warps of 4, and with the one-hot
    operand shuffled from the words (with or without their L1 prefetch) against loaded fragments,
    bit for bit: every row group's sums
    take the same MMAs on the same operands in the same order (plain, dual form, and the
    transposed products with their deal of the groups, which depends on the warp count)."""
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, ts.bfloat16)
    _, a2 = _twin(cp, rng, h, a)
    b, b2, g = (cp.asarray(rng.standard_normal(shape).astype(ts.bfloat16)) for shape in ((n, k), (n, k), (m, k)))
    _skip_unless_hopper(b, cp.empty((m, k), dtype=ts.bfloat16))

    def products() -> list:
        plain = _gpu_ops.spmm(a.parts, tile_n, b, cp.full((m, k), np.nan, dtype=ts.bfloat16), path="tiled")
        dual = cp.full((m, k), np.nan, dtype=ts.bfloat16)
        _gpu_ops.spmm(a.parts, tile_n, b, dual, path="tiled", second=(a2.parts, b2))
        transposed = cp.full((n, k), np.nan, dtype=ts.bfloat16)
        _tiled_spmm.spmm_transposed(tile_n, n, [(a.parts, g, transposed)])
        return [cp.asnumpy(x).view(np.uint16) for x in (plain, dual, transposed)]

    results = {}
    for warps in (16, 32):
        for operand in _tiled_spmm.OPERANDS:
            monkeypatch.setattr(_tiled_spmm, "WARPS", warps)
            monkeypatch.setattr(_tiled_spmm, "OPERAND", operand)
            results[warps, operand] = products()
    for variant, got in results.items():
        for want, x in zip(results[16, "fragments"], got, strict=True):
            assert np.array_equal(want, x), variant


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", [SHAPES[1], SHAPES[2], SHAPES[4], SHAPES[5]])
def test_transposed_products_match_float64(cp, rng, dtype, m, n, k, tile_n, capacity, density):
    """A.T @ g, A2.T @ x and A3.T @ x from one pack of the transpose (the backward's three weight
    gradients), against float64 and the row gathers."""
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    (h2, a2), (h3, a3) = _twin(cp, rng, h, a), _twin(cp, rng, h, a)
    g, x = (rng.standard_normal((m, k)).astype(dtype) for _ in range(2))
    outs = [cp.full((n, k), np.nan, dtype=dtype) for _ in range(3)]
    _skip_unless_hopper(cp.asarray(g), outs[0])
    g_gpu, x_gpu = cp.asarray(g), cp.asarray(x)
    products = [(a.parts, g_gpu, outs[0]), (a2.parts, x_gpu, outs[1]), (a3.parts, x_gpu, outs[2])]
    _tiled_spmm.spmm_transposed(tile_n, n, products)
    for dense, b, out, (parts, b_gpu, _) in zip((h, h2, h3), (g, x, x), outs, products, strict=True):
        expected = dense.astype(np.float64).T @ b.astype(np.float64)
        assert rel_error(out, expected) <= rounding_bound(dtype, expected)
        gathered = _gpu_ops.spmm_transposed(parts, tile_n, n, b_gpu, cp.empty_like(out))
        assert rel_error(out, cp.asnumpy(gathered).astype(np.float64)) <= 2 * rounding_bound(dtype, expected)


def _same_non_finite_and_close(got, want):
    """The same NaN and signed-Inf places, and the finite values within two bf16 roundings."""
    got, want = (host.astype(np.float64) for host in (got, want))
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))
    assert np.array_equal(got[np.isinf(got)], want[np.isinf(want)])  # the same signs
    finite = np.isfinite(want)
    assert finite.any() and rel_error(got[finite], want[finite]) <= 1e-2


@pytest.mark.parametrize("dual", [False, True])
def test_inf_and_nan_in_used_rows_give_the_gathers_results(cp, rng, dual):
    """An Inf and a NaN in rows of b that entries use: inside the MMA they reach the other rows
    of those entries' groups (0 x Inf); the fixup recomputes every row with a non-finite sum, so
    each output is the row gathers' (Inf with its sign, NaN, or the finite value)."""
    m, n, k, dtype = 700, 1100, 72, ts.bfloat16
    h, a = _problem(cp, rng, m, n, 64, 4, 0.05, dtype)
    b = rng.standard_normal((n, k)).astype(dtype)
    used = np.flatnonzero(h.any(axis=0))
    b[used[0], 3] = np.inf
    b[used[1], 10] = -np.inf
    b[used[2], 40] = np.nan
    b_gpu = cp.asarray(b)
    out = cp.full((m, k), 7, dtype=dtype)
    _skip_unless_hopper(b_gpu, out)
    second = (_twin(cp, rng, h, a)[1].parts, cp.asarray(rng.standard_normal((n, k)).astype(dtype))) if dual else None
    _gpu_ops.spmm(a.parts, 64, b_gpu, out, path="tiled", second=second)
    want = _gpu_ops.spmm(a.parts, 64, b_gpu, cp.empty_like(out), path="gather", second=second)
    assert np.isnan(cp.asnumpy(out).astype(np.float64)).sum() > 0  # the case is exercised
    _same_non_finite_and_close(cp.asnumpy(out), cp.asnumpy(want))


def test_inf_in_a_token_row_of_the_transposed_products_gives_the_gathers_results(cp, rng):
    m, n, k, dtype = 1100, 700, 64, ts.bfloat16
    h, a = _problem(cp, rng, m, n, 64, None, 0.05, dtype)
    g = rng.standard_normal((m, k)).astype(dtype)
    g[np.flatnonzero(h.any(axis=1))[0], 5] = np.inf  # an overflowed gradient row
    g_gpu = cp.asarray(g)
    out = cp.full((n, k), 7, dtype=dtype)
    _skip_unless_hopper(g_gpu, out)
    _tiled_spmm.spmm_transposed(64, n, [(a.parts, g_gpu, out)])
    want = _gpu_ops.spmm_transposed(a.parts, 64, n, g_gpu, cp.empty_like(out))
    _same_non_finite_and_close(cp.asnumpy(out), cp.asnumpy(want))
