"""The weight-stationary SpMM (cuda/twell_stationary.cu) against the float64 reference: row parts
of every size (one row, fewer rows than warps, many rows per group), a partial last slice,
spill entries, empty rows, a poisoned output, and Inf in a B row no entry uses; column bands (a
B too tall for one slice: forced with a small shared-memory limit, and d_ff 14336 as it comes);
and the packed layout, whole and per band, against the reference's entries."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_spmm_result, inf_in_an_unused_row, rounding_bound, skewed_twell, twin_values

import twellsparse as ts
from twellsparse import _gpu_ops, _stationary
from twellsparse._parts import TwELLParts
from twellsparse.testing import ffn_problem, rel_error

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16]

# (m, n, k, tile_n, capacity, density)
SHAPES = [
    (1, 40, 16, 32, None, 0.5),
    (67, 5632, 2048, 256, None, 0.01),  # the standard down projection's widths
    (300, 2000, 1048, 32, 2, 0.08),  # heavy spill; K = 65.5 slices: a partial last one
    (2500, 700, 8, 64, 1, 0.3),  # many entries per row (several 4-entry batches), all spilling
    (4100, 5632, 64, 256, 32, 0.005),  # more rows per group than warps, four slices: row parts
]


def _problem(cp, rng, m, n, tile_n, capacity, density, dtype):
    return skewed_twell(rng, m, n, tile_n, capacity, density, dtype, cp.asarray)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_stationary_spmm_matches_float64(cp, rng, dtype, m, n, k, tile_n, capacity, density):
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    b, expected = inf_in_an_unused_row(rng, h, k, dtype)  # 0 * Inf must never be formed
    b_gpu = cp.asarray(b)
    assert _stationary.applies(n, b_gpu, cp.empty((m, k), dtype=dtype))
    out = cp.full((m, k), np.nan, dtype=dtype)  # poisoned: every element must be written
    _gpu_ops.spmm(a.parts, tile_n, b_gpu, out, path="stationary")
    check_spmm_result(cp, a.parts, tile_n, b_gpu, out, expected, dtype)


def test_stationary_spmm_writes_a_strided_output(cp, rng):
    h, a = _problem(cp, rng, 130, 900, 64, 4, 0.05, ts.bfloat16)
    b = rng.standard_normal((900, 96)).astype(ts.bfloat16)
    wide = cp.full((130, 128), 7, dtype=ts.bfloat16)
    _gpu_ops.spmm(a.parts, 64, cp.asarray(b), wide[:, :96], path="stationary")
    expected = h.astype(np.float64) @ b.astype(np.float64)
    assert rel_error(wide[:, :96], expected) <= rounding_bound(ts.bfloat16, expected)
    assert (cp.asnumpy(wide[:, 96:]).astype(np.float64) == 7).all()  # the columns past k untouched


def test_stationary_spmm_refuses_what_it_cannot_serve(cp, rng):
    _, a = _problem(cp, rng, 8, 64, 32, None, 0.1, np.float32)
    b = cp.asarray(rng.standard_normal((64, 16)).astype(np.float32))
    with pytest.raises(ValueError, match="path: 'stationary' needs 2-byte values"):
        _gpu_ops.spmm(a.parts, 32, b, cp.empty((8, 16), dtype=np.float32), path="stationary")
    too_tall = cp.zeros((20000, 16), dtype=ts.bfloat16)  # 640 KB slice: over any GPU's shared memory
    assert not _stationary.applies(20000, too_tall, cp.empty((8, 16), dtype=ts.bfloat16))


def _walk_order(parts, row, tile_n):
    """The words of A's row in the pack's walk order: its tiles' slots in order, then its spill."""
    data, indices, counts = (np.asarray(a) for a in (parts.data, parts.indices, parts.counts))
    words = []
    for t in range(counts.shape[1]):
        for s in range(counts[row, t]):
            words.append((t * tile_n + int(indices[row, t, s])) << 16 | int(data[row, t, s].view(np.uint16)))
    s0, s1 = parts.spill_indptr[row], parts.spill_indptr[row + 1]
    for col, val in zip(parts.spill_indices[s0:s1], parts.spill_data[s0:s1], strict=True):
        words.append(int(col) << 16 | int(np.asarray(val).view(np.uint16)))
    return words


def _expected_row(words, row, n):
    """The packed row the kernel's header describes: the greedy order of the slot classes
    (column - row) % 4 against position % 4 (rows of up to 512 entries), else each class in its
    own slots with the empty slots removed; then zero words of the position's class."""
    buckets = [[w for w in words if ((w >> 16) - row) % 4 == q] for q in range(4)]
    order = []
    if len(words) <= 512:
        rem = [len(b) for b in buckets]
        taken = [0] * 4
        for p in range(len(words)):
            q = p % 4
            if rem[q] == 0:
                q = int(np.argmax(rem))
            order.append(buckets[q][taken[q]])
            taken[q] += 1
            rem[q] -= 1
    else:
        slots = sorted((4 * k + q, b[k]) for q, b in enumerate(buckets) for k in range(len(b)))
        order = [w for _, w in slots]
    size = -(-len(order) // _stationary.BATCH) * _stationary.BATCH
    order += [(n + (row + p - n) % 4) << 16 for p in range(len(order), size)]
    return np.array(order, dtype=np.uint32)


@pytest.mark.parametrize(
    "m, n, tile_n, capacity, density",
    [(300, 2000, 32, 2, 0.08), (40, 3000, 64, 8, 0.3)],  # heavy spill; rows over 512 entries
)
def test_pack_orders_each_row_by_slot_class(cp, rng, m, n, tile_n, capacity, density):
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, ts.bfloat16)
    indptr, words = _stationary.pack(a.parts, tile_n, n)
    indptr, words = cp.asnumpy(indptr), cp.asnumpy(words)
    host = TwELLParts(*(cp.asnumpy(p) for p in a.parts))
    aligned = 0
    for row in range(m):
        got = words[indptr[row] : indptr[row + 1]]
        walk = _walk_order(host, row, tile_n)
        assert np.array_equal(got, _expected_row(walk, row, n)), f"row {row}"
        cols, bits = got >> 16, (got & 0xFFFF).astype(np.uint16)
        real = cols < n
        want_cols = np.flatnonzero(h[row])
        assert sorted(cols[real].tolist()) == want_cols.tolist()  # every entry once, its value
        assert (bits[real].view(ts.bfloat16)[np.argsort(cols[real])] == h[row, want_cols]).all()
        assert (bits[~real] == 0).all() and got.size - real.sum() < _stationary.BATCH
        aligned += int(((cols - row) % 4 == np.arange(got.size) % 4).sum())
    assert aligned > 0.6 * words[: indptr[-1]].size  # most words sit in their class's slots


def _twin(cp, rng, h, a, dtype):
    """A TwELL matrix of ``a``'s structure with other values (the backward's second operand)."""
    h2 = twin_values(rng, h)
    a2 = ts.twell_array(cp.asarray(h2), tile_n=a.tile_n, capacity=a.capacity)
    for p, q in zip(a.parts[1:3] + a.parts[4:], a2.parts[1:3] + a2.parts[4:], strict=True):
        assert (cp.asnumpy(p) == cp.asnumpy(q)).all()  # indices, counts, spill columns and pointers
    return h2, a2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_dual_stationary_sums_two_products(cp, rng, monkeypatch, dtype, m, n, k, tile_n, capacity, density):
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    h2, a2 = _twin(cp, rng, h, a, dtype)
    b, b2 = (rng.standard_normal((n, k)).astype(dtype) for _ in range(2))
    expected = h.astype(np.float64) @ b.astype(np.float64) + h2.astype(np.float64) @ b2.astype(np.float64)
    b_gpu, b2_gpu = cp.asarray(b), cp.asarray(b2)
    assert _stationary.applies(n, b_gpu, cp.empty((m, k), dtype=dtype), b2_gpu)
    out = cp.full((m, k), np.nan, dtype=dtype)  # poisoned
    _gpu_ops.spmm(a.parts, tile_n, b_gpu, out, path="stationary", second=(a2.parts, b2_gpu))
    got = cp.asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all()
    assert rel_error(got, expected) <= rounding_bound(dtype, expected)
    gathered = _gpu_ops.spmm(a.parts, tile_n, b_gpu, cp.empty_like(out), path="gather", second=(a2.parts, b2_gpu))
    assert rel_error(got, cp.asnumpy(gathered).astype(np.float64)) <= 2 * rounding_bound(dtype, expected)
    # "auto" takes the dual form by the single form's rule: not at these rows (< MIN_ROWS)
    # unless told to.
    calls = []
    real = _stationary.spmm
    monkeypatch.setattr(_stationary, "spmm", lambda *args: calls.append(args) or real(*args))
    for preferred in (None, True):
        monkeypatch.setattr(_stationary, "PREFERRED", preferred)
        again = _gpu_ops.spmm(a.parts, tile_n, b_gpu, cp.empty_like(out), second=(a2.parts, b2_gpu))
        assert rel_error(again, expected) <= rounding_bound(dtype, expected)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "m, n, tile_n, capacity, density",
    [(300, 2000, 32, 2, 0.08), (40, 3000, 64, 8, 0.3)],  # heavy spill; rows over 512 entries
)
def test_dual_pack_pairs_each_batch_with_its_twin(cp, rng, m, n, tile_n, capacity, density):
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, ts.bfloat16)
    h2, a2 = _twin(cp, rng, h, a, ts.bfloat16)
    indptr, words = (cp.asnumpy(v) for v in _stationary.pack(a.parts, tile_n, n))
    indptr2, words2 = (cp.asnumpy(v) for v in _stationary.pack(a.parts, tile_n, n, second=a2.parts))
    assert (indptr2 == 2 * indptr).all()
    for row in range(m):
        single = words[indptr[row] : indptr[row + 1]].reshape(-1, _stationary.BATCH)
        dual = words2[indptr2[row] : indptr2[row + 1]].reshape(-1, 2 * _stationary.BATCH)
        first, second = dual[:, : _stationary.BATCH], dual[:, _stationary.BATCH :]
        assert (first == single).all()  # A's words in the single form's order
        assert ((second >> 16) == (first >> 16)).all()
        cols = (second >> 16).ravel()
        bits = (second & 0xFFFF).astype(np.uint16).ravel()
        real = cols < n
        assert (bits[real].view(ts.bfloat16) == h2[row, cols[real]]).all() and (bits[~real] == 0).all()


@pytest.mark.parametrize("spill_capacity", [None, 20000])
def test_ffn_plan_takes_it_when_preferred(cp, rng, monkeypatch, spill_capacity):
    p = ffn_problem(700, 256, 1000, 0.05, "skewed", ts.bfloat16, rng, cp)
    x, wg, wd = p["x"], p["w_gate"], p["w_down"]
    h = np.maximum(cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(wg).astype(np.float64).T, 0)
    h = h.astype(ts.bfloat16).astype(np.float64)  # the packed activation is rounded to bf16
    expected = h @ cp.asnumpy(wd).astype(np.float64).T
    plan = ts.FFN(wg, wd, dispatch="sparse", capacity=16, spill_capacity=spill_capacity)
    gathered = cp.asnumpy(plan(x)).astype(np.float64)
    monkeypatch.setattr(_stationary, "PREFERRED", True)
    got = cp.asnumpy(plan(x)).astype(np.float64)
    assert rel_error(got, expected) < 2e-2
    assert rel_error(got, gathered) < 1e-2


def _choice_probe(cp, rng, monkeypatch):
    """A 300 x 700 A (64-column tiles) and a 700 x 48 b; the returned function runs the "auto"
    SpMM into a poisoned output, checks it against float64 and says whether the stationary
    kernel ran."""
    h, a = _problem(cp, rng, 300, 700, 64, None, 0.05, ts.bfloat16)
    b = rng.standard_normal((700, 48)).astype(ts.bfloat16)
    expected = h.astype(np.float64) @ b.astype(np.float64)
    b_gpu = cp.asarray(b)
    calls = []
    real = _stationary.spmm
    monkeypatch.setattr(_stationary, "spmm", lambda *args: calls.append(args) or real(*args))
    monkeypatch.setattr(_stationary, "PREFERRED", None)

    def taken() -> bool:
        before = len(calls)
        out = _gpu_ops.spmm(a.parts, 64, b_gpu, cp.full((300, 48), float("nan"), dtype=ts.bfloat16))
        assert rel_error(out, expected) <= rounding_bound(ts.bfloat16, expected)
        return len(calls) > before

    return taken


def test_auto_takes_it_from_min_rows_unless_switched_off(cp, rng, monkeypatch):
    taken = _choice_probe(cp, rng, monkeypatch)
    choices = []
    for min_rows, preferred in ((301, None), (300, None), (0, False), (10**9, True)):
        monkeypatch.setattr(_stationary, "MIN_ROWS", min_rows)
        monkeypatch.setattr(_stationary, "PREFERRED", preferred)
        choices.append(taken())
    assert choices == [False, True, False, True]


def test_an_expected_density_decides_instead_of_the_rows(cp, rng, monkeypatch):
    taken = _choice_probe(cp, rng, monkeypatch)
    choices = []
    # (MIN_ROWS, BREAKEVEN_ENTRIES, expected density): the density against the break-even wins
    # over the rows either way; a NaN estimate leaves the rows' rule.
    for min_rows, breakeven, density in ((10**9, 1e-3, 0.05), (0, 1e9, 0.05), (0, 1e-3, float("nan"))):
        monkeypatch.setattr(_stationary, "MIN_ROWS", min_rows)
        monkeypatch.setattr(_stationary, "BREAKEVEN_ENTRIES", breakeven)
        with _stationary.expected_density(density):
            choices.append(taken())
    assert choices == [True, False, True]


# (m, n, k, tile_n, capacity, density, slice rows): column bands forced by a shared-memory limit of
# `slice rows` B rows (None: the device's own), each band whole row-tiles of A.
BANDED = [
    (300, 2000, 96, 64, 2, 0.08, 600),  # 4 bands of 9 tiles (the last 5), heavy spill in every band
    (67, 1000, 40, 32, None, 0.05, 300),  # 4 bands, K = 2.5 slices: a partial last slice
    (40, 3000, 48, 64, 8, 0.5, 1200),  # 3 bands of rows over 512 entries (the unstaged pack), spill in each
    (130, 9000, 64, 128, 8, 0.01, None),  # 2 bands on the device (7168 + 1832 columns: a partial tile)
    (40, 14336, 32, 256, 32, 0.01, None),  # the down projection of d_ff 14336: 2 bands of 28 tiles
]


def _limit_slices(monkeypatch, rows):
    """Shared memory for a slice of ``rows`` B rows (and the zero rows), or the device's own."""
    if rows is not None:
        monkeypatch.setattr(_stationary, "_max_slice_bytes", lambda: _stationary.slice_bytes(rows, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density, rows", BANDED)
def test_stationary_spmm_in_column_bands_matches_float64(
    cp, rng, monkeypatch, dtype, m, n, k, tile_n, capacity, density, rows
):
    _limit_slices(monkeypatch, rows)
    per_band = _stationary.band_tiles(n, tile_n, _stationary._max_slice_bytes())
    assert per_band is not None and per_band < -(-n // tile_n)  # more than one band
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    b, expected = inf_in_an_unused_row(rng, h, k, dtype)
    b_gpu = cp.asarray(b)
    out = cp.full((m, k), np.nan, dtype=dtype)  # poisoned
    assert not _stationary.applies(n, b_gpu, out)  # one slice does not fit
    assert _stationary.applies(n, b_gpu, out, tile_n=tile_n)
    _gpu_ops.spmm(a.parts, tile_n, b_gpu, out, path="stationary")
    check_spmm_result(cp, a.parts, tile_n, b_gpu, out, expected, dtype)


@pytest.mark.parametrize("m, n, k, tile_n, capacity, density, rows", BANDED[:2])
def test_dual_stationary_in_column_bands_sums_two_products(
    cp, rng, monkeypatch, m, n, k, tile_n, capacity, density, rows
):
    _limit_slices(monkeypatch, rows)
    dtype = ts.bfloat16
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, dtype)
    h2, a2 = _twin(cp, rng, h, a, dtype)
    b, b2 = (rng.standard_normal((n, k)).astype(dtype) for _ in range(2))
    expected = h.astype(np.float64) @ b.astype(np.float64) + h2.astype(np.float64) @ b2.astype(np.float64)
    out = cp.full((m, k), np.nan, dtype=dtype)
    _gpu_ops.spmm(a.parts, tile_n, cp.asarray(b), out, path="stationary", second=(a2.parts, cp.asarray(b2)))
    got = cp.asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all()
    assert rel_error(got, expected) <= rounding_bound(dtype, expected)


def test_stationary_refuses_more_bands_than_allowed(cp, rng, monkeypatch):
    _limit_slices(monkeypatch, 100)
    _, a = _problem(cp, rng, 8, 2000, 32, None, 0.05, ts.bfloat16)  # 63 tiles, 3 per band: 21 bands
    b = cp.zeros((2000, 16), dtype=ts.bfloat16)
    out = cp.empty((8, 16), dtype=ts.bfloat16)
    assert not _stationary.applies(2000, b, out, tile_n=32)
    with pytest.raises(ValueError, match="column bands"):
        _gpu_ops.spmm(a.parts, 32, b, out, path="stationary")


def test_pack_of_a_band_holds_its_entries_from_its_first_column(cp, rng):
    m, n, tile_n, capacity, density = 300, 2000, 32, 2, 0.08  # heavy spill
    h, a = _problem(cp, rng, m, n, tile_n, capacity, density, ts.bfloat16)
    host = TwELLParts(*(cp.asnumpy(p) for p in a.parts))
    t_lo, t_hi = 20, 41
    lo, hi = _stationary.band_columns(n, tile_n, t_lo, t_hi)
    indptr, words = _stationary.pack(a.parts, tile_n, n, band=(t_lo, t_hi))
    indptr, words = cp.asnumpy(indptr), cp.asnumpy(words)
    for row in range(m):
        walk = [w - (lo << 16) for w in _walk_order(host, row, tile_n) if lo <= w >> 16 < hi]
        got = words[indptr[row] : indptr[row + 1]]
        assert np.array_equal(got, _expected_row(walk, row, hi - lo)), f"row {row}"
        cols = got >> 16
        real = cols < hi - lo
        assert sorted((cols[real] + lo).tolist()) == (np.flatnonzero(h[row, lo:hi]) + lo).tolist()


def test_auto_takes_bands_for_weights_beyond_the_l2(cp, monkeypatch):
    """On the device itself (its shared memory and L2 sizes): W_down.T of d_ff 14336 at d_model
    4096 (117 MB, over any Hopper L2) takes the bands under "auto"; d_ff 8192 at d_model 2048
    (34 MB, needing bands but within the L2) keeps the gathers."""
    monkeypatch.setattr(_stationary, "PREFERRED", None)
    wide, tall = cp.zeros((14336, 4096), dtype=ts.bfloat16), cp.zeros((8192, 2048), dtype=ts.bfloat16)
    out4096, out2048 = cp.empty((16384, 4096), dtype=ts.bfloat16), cp.empty((16384, 2048), dtype=ts.bfloat16)
    assert _stationary.K.l2_bytes() < wide.nbytes
    assert _stationary.chosen(16384, 14336, wide, out4096, tile_n=256)
    if _stationary.K.l2_bytes() >= tall.nbytes:
        assert not _stationary.chosen(16384, 8192, tall, out2048, tile_n=256)


def _mixed_rows(rng, m, n, dtype):
    """Rows of about 4 and about 300 entries at random (a warp of two rows then packs on its
    halves, or both on the whole warp when one outgrows half the staging)."""
    h = np.zeros((m, n), dtype=np.float64)
    for row in range(m):
        k = 300 if rng.random() < 0.3 else 4
        cols = rng.choice(n, size=k, replace=False)
        h[row, cols] = rng.uniform(0.5, 2.0, k) * rng.choice([-1, 1], k)
    return h.astype(dtype)


@pytest.mark.parametrize(
    "m, n, tile_n, capacity, density, case",
    [
        (301, 2000, 32, 2, 0.08, "one"),  # heavy spill, an odd row count (the last half-warp idle)
        (301, 2000, 32, 2, 0.08, "dual"),
        (301, 2000, 32, 2, 0.08, "band"),
        (41, 3000, 64, 8, 0.3, "one"),  # rows over 512 entries: the whole warp, walked twice
        (4099, 5632, 256, 32, 0.005, "one"),  # the standard widths
        (4099, 5632, 256, 32, 0.005, "dual"),
        (257, 1000, 64, 16, None, "one"),  # rows of 4 and of 300 entries mixed
        (257, 1000, 64, 16, None, "dual"),
    ],
)
def test_pack_on_half_warps_writes_the_whole_warps_words(cp, rng, monkeypatch, m, n, tile_n, capacity, density, case):
    """TWELL_STATIONARY_PACK_WIDTH=16 (two rows a warp) writes the same row pointers and words as
    the whole-warp pack, whose order the tests above check against the reference: one product,
    the dual form, a band; rows that fit half a warp's staging, rows that do not (their warp packs
    both on the whole warp in turn), and a last warp with one row."""
    if density is None:
        h = _mixed_rows(rng, m, n, ts.bfloat16)
        a = ts.twell_array(cp.asarray(h), tile_n=tile_n, capacity=capacity)
    else:
        h, a = _problem(cp, rng, m, n, tile_n, capacity, density, ts.bfloat16)
    second = _twin(cp, rng, h, a, ts.bfloat16)[1].parts if case == "dual" else None
    band = (20, 41) if case == "band" else None

    class Poisoned:
        """CuPy whose ``empty`` arrays come poisoned: every word the pack leaves unwritten shows."""

        def __getattr__(self, name):
            return getattr(cp, name)

        def empty(self, shape, dtype):
            return cp.full(shape, 0xDEADBEEF if np.dtype(dtype) == np.uint32 else -7, dtype=dtype)

    monkeypatch.setattr(_stationary, "_cp", Poisoned)
    packs = {}
    for width in (32, 16):
        monkeypatch.setattr(_stationary, "PACK_WIDTH", width)
        indptr, words = (cp.asnumpy(v) for v in _stationary.pack(a.parts, tile_n, n, second=second, band=band))
        packs[width] = (indptr, words[: indptr[-1]])
    assert np.array_equal(packs[16][0], packs[32][0])
    assert np.array_equal(packs[16][1], packs[32][1])
    assert (packs[16][1] != 0xDEADBEEF).all()
