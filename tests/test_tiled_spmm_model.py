"""The tiled SpMM's algebra on the CPU (tests/tiled_spmm_model.py): its pack holds every entry of
A once in the documented order, and a lane-by-lane emulation of the kernel on that pack (the
PTX ISA's ldmatrix.trans and m16n8k16 fragment layouts, the 128-byte swizzle, the epilogue's
lane exchange) reproduces the float64 product over odd shapes, spill, partial chunks and column
blocks, wide tiles and the dual form. The device runs of the same kernel are in
tests/gpu/test_gpu_tiled_spmm.py."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import chunked_activations, inf_in_an_unused_row, skewed_twell, twin_values
from tiled_spmm_model import (
    balance,
    emulate,
    emulate_gated_up,
    emulate_pack_transposed,
    fixup,
    fragments,
    kernel_octet_plan,
    kernel_octet_position,
    kernel_padding_source,
    octet_places,
    padding_sources,
    reference_pack,
    reference_pack_transposed,
    shuffled_operand,
)

import twellsparse as ts
from twellsparse import _tiled_spmm

# (m, k, n, tile_n, capacity, density): k columns of A (rows of b), n columns of b
CASES = [
    (37, 1100, 72, 64, 2, 0.05),  # spill, a partial last chunk and column block, a partial group
    (9, 700, 8, 1024, None, 0.2),  # tiles wider than a chunk; one column block of 8 columns
    (20, 512, 64, 256, 4, 0.6),  # dense rows: many k-groups per item
]


def _problem(rng, m, k, tile_n, capacity, density, dtype=ts.bfloat16):
    return skewed_twell(rng, m, k, tile_n, capacity, density, dtype)


def _twin(rng, h, a):
    h2 = twin_values(rng, h)
    return h2, ts.twell_array(h2, tile_n=a.tile_n, capacity=a.capacity)


def _class_totals(rng):
    """Class counts of items: edge cases, then multinomial draws at the densities' item sizes and
    skewed ones (one class far above the others)."""
    fixed = [[0] * 8, [1, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 17], [2] * 8, [16] * 8, [64, 0, 0, 0, 0, 0, 0, 1]]
    drawn = [rng.multinomial(n, [1 / 8] * 8).tolist() for n in rng.integers(1, 200, size=300)]
    skewed = [(rng.integers(0, 6, size=8) + np.eye(8, dtype=int)[q] * rng.integers(5, 60)).tolist() for q in range(8)]
    return fixed + drawn + skewed


def _wavefronts(octet_classes) -> int:
    """Shared-memory wavefronts of one ldmatrix matrix per octet: its most repeated class (each
    entry's row address distinct; padding repeats an address its octet reads)."""
    return sum(max(np.bincount(c, minlength=8)) if c else 1 for c in octet_classes)


def test_octet_plan_nears_the_wavefront_bound_and_the_kernels_formulas_follow_it(rng):
    """The model's plan, built slot by slot, keeps the item's ceil(n / 16) k-groups, puts at most
    8 entries in an octet and costs at least max(O, largest class) wavefronts (the least any
    placement can; O: the octets) and, over multinomial items, within 1% of that bound; and the
    kernels' closed forms (octet_plan, octet_position, octet_padding_source) give its octets,
    positions and padding sources for every entry."""
    cost, bound = 0, 0
    for total in _class_totals(rng):
        places, octets = octet_places(total)
        n, c_max = sum(total), max(total)
        assert octets == 2 * -(-n // 16) and len(places) == n == len(set(places.values()))
        assert all(0 <= p < 8 * octets for p in places.values())
        classes = [[] for _ in range(octets)]
        for (q, _), p in places.items():
            classes[p // 8].append(q)
        assert _wavefronts(classes) >= max(octets, c_max)
        if n and len(set(total)) > 1:  # the multinomial and skewed draws
            cost, bound = cost + _wavefronts(classes), bound + max(octets, c_max)
        plan = kernel_octet_plan(total)
        assert plan[0] == octets
        for (q, k), p in places.items():
            assert kernel_octet_position(plan, total, q, k) == p
        filled = [False] * (8 * octets)
        for p in places.values():
            filled[p] = True
        sources = padding_sources(filled)
        assert [kernel_padding_source(plan, total, p) for p in range(8 * octets)] == [
            -1 if src is None else src for src in sources
        ]
    assert cost <= 1.01 * bound


@pytest.mark.parametrize("m, k, n, tile_n, capacity, density", CASES)
def test_pack_holds_every_entry_once_with_padding_read_by_its_own_octet(rng, m, k, n, tile_n, capacity, density):
    """Every entry once; padding (marked, value zero; under 16 words per item) repeats a B row
    its own octet reads (a broadcast), or octet 0's where its octet has no entry."""
    h, a = _problem(rng, m, k, tile_n, capacity, density)
    kg_ptr, (words,), n_chunks = reference_pack(a.parts, tile_n, k)
    assert n_chunks == -(-k // _tiled_spmm.CHUNK) and kg_ptr[-1] * 16 == words.size
    rebuilt = np.zeros((m, k), dtype=np.float64)
    for grp in range(-(-m // 8)):
        for c in range(n_chunks):
            item = words[kg_ptr[grp * n_chunks + c] * 16 : kg_ptr[grp * n_chunks + c + 1] * 16]
            pad = (item & _tiled_spmm.PAD_BIT) != 0
            values = (item >> 16).astype(np.uint16).view(h.dtype).astype(np.float64)
            rows, cols = grp * 8 + _tiled_spmm.word_rows(item), c * 512 + _tiled_spmm.word_b_rows(item)
            assert (values[pad] == 0).all() and pad.sum() < 16  # within the words' bound (_tiled_spmm._packed)
            np.add.at(rebuilt, (rows[~pad], cols[~pad]), values[~pad])
            for o in range(0, item.size, 8):
                own = ~pad[o : o + 8]
                source = item[o : o + 8][own] if own.any() else item[:8][~pad[:8]]
                assert set(item[o : o + 8][~own] & 0xFFF) <= set(source & 0xFFF)  # row and B row
    assert np.array_equal(rebuilt, h.astype(np.float64))


@pytest.mark.parametrize("warps", [16, 32])
@pytest.mark.parametrize("m, k, n, tile_n, capacity, density", CASES)
def test_emulated_kernel_matches_the_float64_product(rng, m, k, n, tile_n, capacity, density, warps):
    h, a = _problem(rng, m, k, tile_n, capacity, density)
    b = rng.standard_normal((k, n)).astype(ts.bfloat16)
    got = emulate(*reference_pack(a.parts, tile_n, k), m, b, warps=warps)
    expected = h.astype(np.float64) @ b.astype(np.float64)
    assert np.isfinite(got).all()  # every element written
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


# Entries per 512-column chunk for a warp's row groups: empty chunks and chunks of a single
# k-group after full ones, at the start and at the end (the prefetch runs across chunks).
CHUNK_PATTERNS = [[40, 0, 1, 30, 0, 0, 1, 20, 1], [0, 1, 0, 35, 1, 1, 17, 0], [3, 0, 0, 0, 50]]


@pytest.mark.parametrize("operand", ["fragments", "shuffles"])
@pytest.mark.parametrize("warps", [16, 32])
@pytest.mark.parametrize("pattern", CHUNK_PATTERNS)
def test_emulated_kernel_over_empty_and_one_kgroup_chunks(rng, pattern, warps, operand):
    m, n = 19, 24  # three row groups, one warp's (or two warps') slots
    h = chunked_activations(rng, m, pattern, ts.bfloat16)
    a = ts.twell_array(h, tile_n=256)
    b = rng.standard_normal((h.shape[1], n)).astype(ts.bfloat16)
    got = emulate(*reference_pack(a.parts, 256, h.shape[1]), m, b, warps=warps, operand=operand)
    np.testing.assert_allclose(got, h.astype(np.float64) @ b.astype(np.float64), rtol=1e-12, atol=1e-12)


def test_emulated_kernel_over_random_chunk_occupancy(rng):
    """Random row counts and chunk occupancies (entries per chunk from none to a few k-groups,
    spread over the rows so that warps meet every mix of empty, single and full chunks), plain
    and dual form, against float64: the prefetch across chunks in general, beyond the fixed
    patterns above."""
    for _ in range(12):
        m = int(rng.integers(1, 80))
        pattern = rng.choice([0, 0, 1, 2, 9, 16, 17, 40], size=int(rng.integers(1, 7))).tolist()
        h = chunked_activations(rng, m, [min(e, m * 512) for e in pattern], np.float16)
        a = ts.twell_array(h, tile_n=int(rng.choice([64, 256, 1024])))
        h2, a2 = _twin(rng, h, a)
        b, b2 = (rng.standard_normal((h.shape[1], 8)).astype(np.float16) for _ in range(2))
        warps = int(rng.choice([16, 32]))
        packed = reference_pack(a.parts, a.tile_n, h.shape[1], others=(a2.parts,))
        got = emulate(*packed, m, b, b2, warps=warps)
        expected = h.astype(np.float64) @ b.astype(np.float64) + h2.astype(np.float64) @ b2.astype(np.float64)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12, err_msg=f"m={m} pattern={pattern}")


def test_both_operand_sources_give_the_same_bits(rng):
    """The one-hot operand the fragments pass writes, and the one the shuffle version builds from
    the lanes' own words, bit for bit for every k-group and lane; and the emulated product on
    either."""
    m, k, n = 300, 2000, 16
    h, a = _problem(rng, m, k, 32, 2, 0.08)
    kg_ptr, words, n_chunks = reference_pack(a.parts, 32, k)
    entry = (np.arange(32) >> 4) * 8 + (np.arange(32) & 7)
    frags = fragments(kg_ptr, words[0])
    for kg in range(int(kg_ptr[-1])):
        assert np.array_equal(shuffled_operand(words[0][kg * 16 + entry]), frags[kg])
    b = rng.standard_normal((k, n)).astype(ts.bfloat16)
    got = emulate(kg_ptr, words, n_chunks, m, b, operand="shuffles")
    np.testing.assert_allclose(got, h.astype(np.float64) @ b.astype(np.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("warps", [16, 32])
def test_emulated_dual_form_sums_both_products(rng, warps):
    m, k, n = 21, 600, 24
    h, a = _problem(rng, m, k, 32, 3, 0.08, np.float16)
    h2, a2 = _twin(rng, h, a)
    b, b2 = (rng.standard_normal((k, n)).astype(np.float16) for _ in range(2))
    got = emulate(*reference_pack(a.parts, 32, k, others=(a2.parts,)), m, b, b2, warps=warps)
    expected = h.astype(np.float64) @ b.astype(np.float64) + h2.astype(np.float64) @ b2.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_inf_in_an_unused_row_of_b_is_never_read(rng):
    m, k, n = 16, 520, 16
    h, a = _problem(rng, m, k, 64, None, 0.05)
    b, expected = inf_in_an_unused_row(rng, h, n, ts.bfloat16)
    got = emulate(*reference_pack(a.parts, 64, k), m, b)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "m, f, d, density, dtype",
    [(37, 1100, 72, 0.05, ts.bfloat16), (530, 600, 40, 0.02, np.float16), (16, 512, 32, 0.9, ts.bfloat16)],
)
def test_emulated_gated_up_writes_h_into_every_word(rng, m, f, d, density, dtype):
    """The one-pack up projection (cuda/twell_tiled_ffn.cu) emulated on the gate's pack: every word
    keeps its row and unit and gets h = g * u (u = x . W_up[unit]); partial token blocks and
    slices, several rounds (the dense case: 16 tokens x 512 units at 90%)."""
    g_dense, gate = _problem(rng, m, f, 64, 4, density, dtype)
    _check_gated_up(rng, g_dense, gate, d, dtype)


@pytest.mark.parametrize("pattern", CHUNK_PATTERNS)
def test_emulated_gated_up_over_empty_and_one_kgroup_chunks(rng, pattern):
    """The same over chunks without entries or with one k-group between full ones (the SpMM's
    prefetch bug's patterns; the up kernel carries nothing across chunks, this keeps it so)."""
    g_dense = np.abs(chunked_activations(rng, 19, pattern, ts.bfloat16))
    _check_gated_up(rng, g_dense, ts.twell_array(g_dense, tile_n=64, capacity=4), 40, ts.bfloat16)


def _check_gated_up(rng, g_dense, gate, d, dtype):
    """:func:`emulate_gated_up` on the gate's pack against float64 h = g * (x . W_up[unit])."""
    m, f = g_dense.shape
    x = rng.standard_normal((m, d)).astype(dtype)
    w_up = (rng.standard_normal((f, d)) / np.sqrt(d)).astype(dtype)
    kg_ptr, (words,), n_chunks = reference_pack(gate.parts, 64, f)
    h_words = emulate_gated_up(kg_ptr, words, n_chunks, m, x, w_up)
    assert np.array_equal(h_words & 0xFFFF, words & 0xFFFF)
    grp = np.repeat(np.arange(kg_ptr.size - 1) // n_chunks, np.diff(kg_ptr) * 16)
    chunk = np.repeat(np.arange(kg_ptr.size - 1) % n_chunks, np.diff(kg_ptr) * 16)
    rows, units = grp * 8 + _tiled_spmm.word_rows(words), chunk * 512 + _tiled_spmm.word_b_rows(words)
    g_vals = (words >> 16).astype(np.uint16).view(dtype).astype(np.float64)
    h_vals = (h_words >> 16).astype(np.uint16).view(dtype).astype(np.float64)
    exact = g_vals * np.einsum("ij,ij->i", x[rows].astype(np.float64), w_up[units].astype(np.float64))
    assert (h_vals[g_vals == 0] == 0).all()  # padding stays zero
    real = g_vals != 0
    assert real.sum() == np.count_nonzero(g_dense)
    scale = np.abs(g_vals[real]) * np.linalg.norm(x[rows[real]].astype(np.float64), axis=1)
    eps = 2.0**-7 if dtype == ts.bfloat16 else 2.0**-10  # two roundings to the dtype and fp32 sums
    assert (np.abs(h_vals[real] - exact[real]) <= 2 * eps * (np.abs(exact[real]) + 1e-3 * scale)).all()


@pytest.mark.parametrize("m, k, n, tile_n, capacity, density", [*CASES[:2], (600, 100, 8, 32, 2, 0.05)])
def test_emulated_transposed_products_match_float64(rng, m, k, n, tile_n, capacity, density):
    """A.T @ g for three matrices of one structure from one pack of the transpose (the backward's
    dW_down, dW_gate and dW_up), the kernel emulated on each word array."""
    h, a = _problem(rng, m, k, tile_n, capacity, density)
    (h2, a2), (h3, a3) = _twin(rng, h, a), _twin(rng, h, a)
    kg_ptr, words, n_chunks = reference_pack_transposed(a.parts, tile_n, k, others=(a2.parts, a3.parts))
    assert n_chunks == -(-m // _tiled_spmm.CHUNK) and len(words) == 3
    for dense, w in zip((h, h2, h3), words, strict=True):
        g = rng.standard_normal((m, n)).astype(ts.bfloat16)
        got = emulate(kg_ptr, [w], n_chunks, k, g)
        expected = dense.astype(np.float64).T @ g.astype(np.float64)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "m, k, tile_n, capacity, density",
    [(37, 1100, 64, 2, 0.05), (600, 100, 32, 2, 0.05), (1030, 530, 1024, None, 0.03), (70, 40, 32, 1, 0.6)],
)
def test_direct_transposed_pack_gives_the_csr_walks_words(rng, m, k, tile_n, capacity, density):
    """The transposed pack's kernels (bit matrix, popcount ranks; emulated) write exactly the words
    of the CSR walk (reference_pack_transposed): partial token chunks and column blocks, spill,
    tiles wider than a block, dense rows."""
    _, a = _problem(rng, m, k, tile_n, capacity, density)
    kg_ptr, (words,), n_chunks = emulate_pack_transposed(a.parts, tile_n, k)
    ref_ptr, (ref_words,), ref_chunks = reference_pack_transposed(a.parts, tile_n, k)
    assert n_chunks == ref_chunks
    assert np.array_equal(kg_ptr, ref_ptr)
    assert np.array_equal(words, ref_words)


def _stored_entries_product(h, b):
    """h @ b in float64 summing each row's stored entries only (a dense product would also form
    0 x Inf with the zeros)."""
    out = np.zeros((h.shape[0], b.shape[1]))
    for row in range(h.shape[0]):
        nz = np.flatnonzero(h[row])
        out[row] = h[row, nz].astype(np.float64) @ b[nz].astype(np.float64)
    return out


@pytest.mark.parametrize("dual", [False, True])
def test_inf_and_nan_in_used_rows_spread_and_the_fixup_restores_ieee_results(rng, dual):
    """With an Inf, a -Inf and a NaN in rows of b that entries use, the emulated product shows NaN
    in rows whose entries never met them (their groups' neighbours: 0 x Inf in the MMA); after
    the fixup every output equals float64's IEEE result (h @ b with those values)."""
    m, k, n = 30, 600, 24
    h, a = _problem(rng, m, k, 64, 3, 0.08)
    b = rng.standard_normal((k, n)).astype(ts.bfloat16)
    used = np.flatnonzero(h.any(axis=0))
    b[used[0], 3], b[used[1], 10], b[used[2], 17] = np.inf, -np.inf, np.nan
    h2, a2 = _twin(rng, h, a) if dual else (None, None)
    b2 = rng.standard_normal((k, n)).astype(ts.bfloat16) if dual else None
    packed = reference_pack(a.parts, 64, k, others=(a2.parts,) if dual else ())
    with np.errstate(invalid="ignore"):
        raw = emulate(*packed, m, b, b2)
        expected = _stored_entries_product(h, b)  # IEEE over the stored entries only (as the gathers)
        if dual:
            expected += _stored_entries_product(h2, b2)
    spread = np.isnan(raw) & ~np.isnan(expected)
    assert spread.any()  # the neighbours' NaN the fixup must undo
    got = fixup(raw, packed[0], packed[1], packed[2], b, b2)
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_allclose(got[~np.isnan(got)], expected[~np.isnan(expected)], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("warps", [16, 32])
@pytest.mark.parametrize("m, k, n", [(600, 100, 8), (1100, 37, 16)])
def test_balanced_slots_keep_the_product_exact(rng, m, k, n, warps):
    """The emulated A.T product with the deal's map (tiled_spmm_balance, emulated) for either
    warp count: every group in exactly one slot, the product exact (a block's slots are the same
    64 positions, 4 or 2 per warp)."""
    h, a = _problem(rng, m, k, 32, 4, 0.08)
    kg_ptr, words, n_chunks = reference_pack_transposed(a.parts, 32, k)
    group_map = balance(kg_ptr, n_chunks, k, warps)
    assert sorted(group_map[group_map >= 0].tolist()) == list(range(-(-k // 8)))
    g = rng.standard_normal((m, n)).astype(ts.bfloat16)
    got = emulate(kg_ptr, words, n_chunks, k, g, group_map=group_map, warps=warps)
    np.testing.assert_allclose(got, h.astype(np.float64).T @ g.astype(np.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("density", [0.005, 0.02])
def test_deal_brings_the_busiest_warps_near_the_mean_on_skewed_patterns(rng, density):
    """On the targets' skewed pattern (16384 tokens, 5632 units), the blocks' busiest warps (what
    each block waits for) carry far less than in the natural order, within 1.45x the mean warp:
    what is left is single hot groups heavier than a mean warp."""
    from twellsparse.testing import firing_rates

    rates = firing_rates(5632, density, "skewed", rng)  # each unit fires per token with its rate
    entries = rng.binomial(512, np.broadcast_to(rates[:, None], (5632, 32))).reshape(704, 8, 32).sum(axis=1)
    kg_ptr = np.concatenate([[0], np.cumsum(-(-entries.ravel() // 16))])
    n_groups = entries.shape[0]
    group_map = balance(kg_ptr, 32, 5632)
    load = np.diff(kg_ptr[::32])

    def busiest(slots):
        slot_load = np.where(slots >= 0, load[np.clip(slots, 0, n_groups - 1)], 0)
        per_block = slot_load.reshape(-1, 16, 4).sum(axis=2)  # (block, warp)
        return per_block.max(axis=1).sum() / per_block.mean(axis=1).sum()

    natural = np.where(np.arange(len(group_map)) < n_groups, np.arange(len(group_map)), -1)
    assert busiest(group_map) <= 1.45 < busiest(natural)


def test_emulated_backward_form_writes_dz_du_h_at_the_gates_places(rng):
    """The up kernel's BACKWARD form (emulated) on the gate's pack with places (dests): d_z's and
    d_u's words (rows and units kept) and d_z = d_h u, d_u = d_h g, h = g u at every entry's slot
    or spill place, against float64 (d_h = dy . W_down^T[unit]); padding slots stay zero."""
    m, f, d, dtype = 530, 600, 40, ts.bfloat16
    g_dense, gate = _problem(rng, m, f, 32, 2, 0.04, dtype)  # capacity 2: many spill entries
    u_dense = np.where(g_dense != 0, rng.standard_normal(g_dense.shape), 0).astype(dtype)
    up = ts.twell_array(u_dense, tile_n=32, capacity=2)
    dy = rng.standard_normal((m, d)).astype(dtype)
    w_down_t = (rng.standard_normal((f, d)) / np.sqrt(d)).astype(dtype)
    dests: list[int] = []
    kg_ptr, (words,), n_chunks = reference_pack(gate.parts, 32, f, dests=dests)
    dests_arr = np.array(dests, dtype=np.int64)
    backward = (dests_arr, up.parts.data, up.parts.spill_data, gate.parts.data.shape)
    dz_words, du_words, layouts = emulate_gated_up(kg_ptr, words, n_chunks, m, dy, w_down_t, backward)
    assert np.array_equal(dz_words & 0xFFFF, words & 0xFFFF) and np.array_equal(du_words & 0xFFFF, words & 0xFFFF)
    d_h = dy.astype(np.float64) @ w_down_t.astype(np.float64).T  # (token, unit)
    dense = {}
    for name, (data, spill) in zip(("d_z", "d_u", "h"), layouts, strict=True):
        parts = gate.parts._replace(data=data, spill_data=spill)
        dense[name] = ts.twell_array._from_parts(parts, gate.shape, 32).toarray().astype(np.float64)
    g64, u64 = g_dense.astype(np.float64), u_dense.astype(np.float64)
    for name, want in (("d_z", d_h * u64), ("d_u", d_h * g64), ("h", g64 * u64)):
        got = dense[name]
        assert np.array_equal(got != 0, want != 0)  # every stored entry written, nothing else
        assert np.abs(got - want).max() <= 2**-6 * np.abs(want).max()
    assert (gate.parts.spill_data.size > 0) and len(dests) == words.size
