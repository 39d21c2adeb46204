"""Format invariants of ``twell_array`` (CPU only): components, canonical form, parts constructor,
structural methods (sort_indices, eliminate_zeros, copy, astype) and re-tiling."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from helpers import DTYPE_IDS, DTYPES, SHAPE, assert_bit_equal, bits, random_dense

import twellsparse as ts
from twellsparse import TwELLDroppedEntriesWarning, TwELLFormatError, twell_array

TILE_NS = [32, 64, 128, 256, 512, 1024]


# ----------------------------------------------------------------------------- helpers


def snapshot(*arrays):
    return [a.copy() for a in arrays]


def assert_unchanged(arrays, copies):
    for a, c in zip(arrays, copies, strict=True):
        assert a.dtype == c.dtype and a.shape == c.shape
        np.testing.assert_array_equal(bits(a), bits(c))


def expected_parts(dense, tile_n, capacity):
    """Independent loop-based oracle of the canonical TwELL parts of a dense matrix."""
    m, n = dense.shape
    nt = -(-n // tile_n)
    data = np.zeros((m, nt, capacity), dense.dtype)
    indices = np.full((m, nt, capacity), -1, np.int16)
    counts = np.zeros((m, nt), np.int32)
    s_data, s_cols, s_ptr = [], [], [0]
    for i in range(m):
        row_spill = []
        for t in range(nt):
            block = dense[i, t * tile_n : (t + 1) * tile_n]
            cols = np.flatnonzero(block != 0)
            k = min(cols.size, capacity)
            counts[i, t] = k
            data[i, t, :k] = block[cols[:k]]
            indices[i, t, :k] = cols[:k]
            row_spill.extend(int(t * tile_n + c) for c in cols[k:])
        for c in row_spill:  # tiles in order, columns increasing within: globally sorted
            s_cols.append(c)
            s_data.append(dense[i, c])
        s_ptr.append(len(s_cols))
    return (
        data,
        indices,
        counts,
        np.array(s_data, dtype=dense.dtype),
        np.array(s_cols, dtype=np.int32),
        np.array(s_ptr, dtype=np.int32),
    )


def assert_parts_equal(a, parts):
    names = ("data", "indices", "counts", "spill_data", "spill_indices", "spill_indptr")
    for name, actual, expected in zip(names, a.parts, parts, strict=True):
        assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
        assert actual.dtype == expected.dtype, f"{name}: {actual.dtype} != {expected.dtype}"
        np.testing.assert_array_equal(bits(actual), bits(expected), err_msg=name)


def check_invariants(a, shape, tile_n, capacity, dtype):
    """Every documented property of a canonical TwELL matrix, checked without the package's help."""
    m, n = shape
    nt = -(-n // tile_n)
    assert a.shape == (m, n)
    assert a.tile_n == tile_n
    assert a.capacity == capacity
    assert a.n_tiles == nt
    assert a.dtype == dtype
    assert a.format == "twell" and a.ndim == 2
    data, indices, counts, sdata, sind, sptr = a.parts
    assert data is a.data and indices is a.indices and counts is a.counts
    assert sdata is a.spill_data and sind is a.spill_indices and sptr is a.spill_indptr
    assert isinstance(data, np.ndarray)
    assert data.shape == (m, nt, capacity) and data.dtype == dtype
    assert indices.shape == (m, nt, capacity) and indices.dtype == np.int16
    assert counts.shape == (m, nt) and counts.dtype == np.int32
    assert sdata.ndim == 1 and sdata.dtype == dtype
    assert sind.shape == sdata.shape and sind.dtype == np.int32
    assert sptr.shape == (m + 1,) and sptr.dtype == np.int32
    assert sptr[0] == 0 and sptr[-1] == sdata.size
    assert (np.diff(sptr) >= 0).all()

    assert (counts >= 0).all() and (counts <= capacity).all()
    used = np.arange(capacity) < counts[..., None]
    assert (indices[~used] == -1).all(), "unused slots must hold index -1"
    assert (bits(data)[~used] == 0).all(), "unused slots must hold +0"
    limit = np.minimum(tile_n, n - np.arange(nt) * tile_n)[None, :, None]
    assert ((indices >= 0) & (indices < limit))[used].all(), "slot columns must be tile-local and below N"
    # canonical: strictly increasing columns within each row-tile
    if capacity > 1:
        inc = indices[..., 1:] > indices[..., :-1]
        assert (inc | ~used[..., 1:]).all(), "slot columns must increase within a row-tile"
    # spill: valid, sorted within rows, only from full row-tiles and above the slots' columns
    if sdata.size:
        rows = np.repeat(np.arange(m), np.diff(sptr))
        assert ((sind >= 0) & (sind < n)).all()
        same_row = rows[1:] == rows[:-1]
        assert (sind[1:] > sind[:-1])[same_row].all()
        tiles = sind // tile_n
        assert (counts[rows, tiles] == capacity).all(), "spill only from full row-tiles"
        last = tiles.astype(np.int64) * tile_n + indices[rows, tiles, capacity - 1]
        assert (sind > last).all(), "slots must hold the smallest columns of a row-tile"
    assert a.nnz == int(counts.sum()) + sdata.size
    assert a.getnnz() == a.nnz
    assert a.n_spilled == sdata.size
    a.check_format()
    a.check_format(full_check=True)
    assert a.has_canonical_format


# ----------------------------------------------------------------------------- construction invariants


@pytest.mark.parametrize("cap_kind", ["one", "default", "full"])
@pytest.mark.parametrize("tile_n", TILE_NS)
def test_invariants_from_dense_all_tile_sizes(rng, tile_n, cap_kind):
    capacity = {"one": 1, "default": None, "full": tile_n}[cap_kind]
    cap = {"one": 1, "default": tile_n // 8, "full": tile_n}[cap_kind]
    x = random_dense(rng, SHAPE, density=0.25)
    x0 = x.copy()
    a = twell_array(x, tile_n=tile_n, capacity=capacity)
    check_invariants(a, SHAPE, tile_n, cap, x.dtype)
    assert_parts_equal(a, expected_parts(x, tile_n, cap))
    assert a.nnz == np.count_nonzero(x)
    assert a.n_dropped == 0
    if cap_kind == "full":
        assert a.n_spilled == 0
    assert_bit_equal(a.toarray(), x)
    assert_unchanged([x], [x0])
    b = ts.from_dense(x, tile_n=tile_n, capacity=capacity)
    assert_parts_equal(b, expected_parts(x, tile_n, cap))


def test_default_tile_and_capacity(rng):
    x = random_dense(rng, SHAPE, density=0.1)
    a = twell_array(x)
    assert a.tile_n == 256 and a.capacity == 32
    check_invariants(a, SHAPE, 256, 32, x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_invariants_dtypes(rng, dtype):
    x = random_dense(rng, SHAPE, density=0.3, dtype=dtype)
    a = twell_array(x, tile_n=64, capacity=4)
    check_invariants(a, SHAPE, 64, 4, dtype)
    assert_parts_equal(a, expected_parts(x, 64, 4))
    assert a.n_spilled > 0
    assert_bit_equal(a.toarray(), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dtype_argument(rng, dtype):
    x = random_dense(rng, SHAPE, density=0.1, dtype=np.float64)
    a = twell_array(x, tile_n=32, capacity=2, dtype=dtype)
    check_invariants(a, SHAPE, 32, 2, dtype)
    assert_bit_equal(a.toarray(), x.astype(dtype))


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo"])
def test_invariants_from_scipy(rng, fmt):
    x = random_dense(rng, SHAPE, density=0.2, dtype=np.float64)
    m = sp.csr_array(x).asformat(fmt)
    a = twell_array(m, tile_n=32, capacity=3)
    check_invariants(a, SHAPE, 32, 3, np.dtype(np.float64))
    assert_parts_equal(a, expected_parts(x, 32, 3))


def test_n_spilled_counts(rng):
    tile_n, cap = 32, 3
    m, n = 6, 100  # tiles: 32, 32, 32, 4 (partial)
    counts = np.array([[0, 3, 4, 2], [7, 0, 0, 4], [32, 32, 32, 4], [1, 2, 3, 3], [0, 0, 0, 0], [5, 5, 5, 1]])
    x = np.zeros((m, n), np.float32)
    for i in range(m):
        for t in range(4):
            width = min(tile_n, n - t * tile_n)
            cols = t * tile_n + rng.choice(width, counts[i, t], replace=False)
            x[i, cols] = rng.uniform(1, 2, cols.size)
    a = twell_array(x, tile_n=tile_n, capacity=cap)
    assert a.n_spilled == int(np.maximum(counts - cap, 0).sum())
    assert a.nnz == int(counts.sum())
    np.testing.assert_array_equal(a.counts, np.minimum(counts, cap))
    np.testing.assert_array_equal(np.diff(a.spill_indptr), np.maximum(counts - cap, 0).sum(axis=1))
    check_invariants(a, (m, n), tile_n, cap, x.dtype)


def test_no_spill_when_capacity_is_enough(rng):
    x = random_dense(rng, SHAPE, density=0.05)
    a = twell_array(x, tile_n=32, capacity=32)
    assert a.n_spilled == 0
    assert a.spill_data.size == 0 and a.spill_indices.size == 0
    np.testing.assert_array_equal(a.spill_indptr, np.zeros(SHAPE[0] + 1, np.int32))


# ----------------------------------------------------------------------------- parts constructor


@pytest.mark.parametrize("tile_n,capacity", [(32, 1), (32, 4), (64, None), (256, 256), (1024, 2)])
def test_parts_round_trip_with_spill(rng, tile_n, capacity):
    x = random_dense(rng, SHAPE, density=0.3)
    a = twell_array(x, tile_n=tile_n, capacity=capacity)
    parts = (a.data, a.indices, a.counts, a.spill_data, a.spill_indices, a.spill_indptr)
    copies = snapshot(*parts)
    b = twell_array(parts, shape=a.shape, tile_n=a.tile_n)
    assert b.shape == a.shape and b.tile_n == a.tile_n and b.capacity == a.capacity
    check_invariants(b, SHAPE, a.tile_n, a.capacity, x.dtype)
    assert_parts_equal(b, a.parts)
    assert_bit_equal(b.toarray(), x)
    assert b.nnz == a.nnz and b.n_spilled == a.n_spilled
    assert_unchanged(parts, copies)


def test_parts_round_trip_capacity_argument_matches(rng):
    x = random_dense(rng, SHAPE, density=0.2)
    a = twell_array(x, tile_n=64, capacity=5)
    b = twell_array(a.parts, shape=a.shape, tile_n=64, capacity=5)
    assert_parts_equal(b, a.parts)
    with pytest.raises(ValueError):
        twell_array(a.parts, shape=a.shape, tile_n=64, capacity=6)


def test_parts_namedtuple_round_trip(rng):
    x = random_dense(rng, SHAPE, density=0.2)
    a = twell_array(x, tile_n=32, capacity=2)
    assert isinstance(a.parts, ts.TwELLParts)
    b = twell_array(tuple(a.parts), shape=SHAPE, tile_n=32)
    assert_parts_equal(b, a.parts)


@pytest.mark.parametrize("tile_n", [32, 128, 1024])
def test_parts_three_tuple_without_spill(rng, tile_n):
    x = random_dense(rng, SHAPE, density=0.1)
    a = twell_array(x, tile_n=tile_n, capacity=tile_n)
    assert a.n_spilled == 0
    parts3 = (a.data, a.indices, a.counts)
    copies = snapshot(*parts3)
    b = twell_array(parts3, shape=SHAPE, tile_n=tile_n)
    check_invariants(b, SHAPE, tile_n, tile_n, x.dtype)
    assert b.n_spilled == 0
    assert b.spill_data.dtype == x.dtype
    np.testing.assert_array_equal(b.spill_indptr, np.zeros(SHAPE[0] + 1, np.int32))
    assert_parts_equal(b, a.parts)
    assert_bit_equal(b.toarray(), x)
    assert_unchanged(parts3, copies)


def test_parts_three_tuple_empty_rows():
    data = np.zeros((0, 2, 4), np.float32)
    indices = np.full((0, 2, 4), -1, np.int16)
    counts = np.zeros((0, 2), np.int32)
    b = twell_array((data, indices, counts), shape=(0, 40), tile_n=32)
    check_invariants(b, (0, 40), 32, 4, np.dtype(np.float32))
    assert b.toarray().shape == (0, 40)


def test_parts_constructor_needs_shape(rng):
    a = twell_array(random_dense(rng), tile_n=32, capacity=4)
    with pytest.raises(TypeError):
        twell_array(a.parts[:3])
    with pytest.raises(TypeError):
        twell_array(a.parts[:4], shape=a.shape, tile_n=32)


def _small_parts():
    """A valid 2 x 40 matrix (tile_n 32, capacity 2, tiles of 32 and 8 columns) with one spilled entry."""
    data = np.zeros((2, 2, 2), np.float32)
    indices = np.full((2, 2, 2), -1, np.int16)
    counts = np.zeros((2, 2), np.int32)
    data[0, 0, :2], indices[0, 0, :2], counts[0, 0] = [1, 2], [3, 7], 2
    data[0, 1, :1], indices[0, 1, :1], counts[0, 1] = [3], [5], 1
    data[1, 1, :2], indices[1, 1, :2], counts[1, 1] = [4, 5], [0, 7], 2
    spill = (np.array([6], np.float32), np.array([20], np.int32), np.array([0, 1, 1], np.int32))
    return [data, indices, counts, *spill]


def test_small_parts_are_valid():
    parts = _small_parts()
    a = twell_array(tuple(parts), shape=(2, 40), tile_n=32)
    check_invariants(a, (2, 40), 32, 2, np.dtype(np.float32))
    expected = np.zeros((2, 40), np.float32)
    expected[0, [3, 7, 20, 37]] = [1, 2, 6, 3]
    expected[1, [32, 39]] = [4, 5]
    assert_bit_equal(a.toarray(), expected)


def _corrupt(parts, kind):
    _, indices, counts, _, sind, sptr = parts
    if kind == "count_above_capacity":
        counts[0, 1] = 3
    elif kind == "negative_count":
        counts[1, 0] = -1
    elif kind == "unused_slot_index":
        indices[1, 0, 0] = 4
    elif kind == "column_beyond_partial_tile":
        indices[0, 1, 0] = 8  # the last tile has only 8 columns
    elif kind == "duplicate_slot_column":
        indices[0, 0, 1] = 3
    elif kind == "spill_duplicates_slot":
        sind[0] = 7
    elif kind == "spill_column_out_of_range":
        sind[0] = 40
    elif kind == "spill_indptr_end":
        sptr[1:] = 0
    elif kind == "indices_dtype":
        parts[1] = indices.astype(np.int32)
    elif kind == "counts_shape":
        parts[2] = counts[:, :1].copy()
    elif kind == "data_shape":
        parts[0] = np.zeros((2, 3, 2), np.float32)
    elif kind == "spill_indices_dtype":
        parts[4] = sind.astype(np.int64)
    else:  # pragma: no cover
        raise AssertionError(kind)
    return parts


@pytest.mark.parametrize(
    "kind",
    [
        "count_above_capacity",
        "negative_count",
        "unused_slot_index",
        "column_beyond_partial_tile",
        "duplicate_slot_column",
        "spill_duplicates_slot",
        "spill_column_out_of_range",
        "spill_indptr_end",
        "indices_dtype",
        "counts_shape",
        "data_shape",
        "spill_indices_dtype",
    ],
)
def test_invalid_parts_are_rejected(kind):
    parts = _corrupt(_small_parts(), kind)
    with pytest.raises(TwELLFormatError) as info:
        a = twell_array(tuple(parts), shape=(2, 40), tile_n=32)
        a.check_format(full_check=True)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- sort_indices


def _shuffled_parts(rng, a):
    """Copies of ``a``'s parts with the used slots of every row-tile in a random (non-canonical) order."""
    data, indices, counts = a.data.copy(), a.indices.copy(), a.counts.copy()
    m, nt, _ = data.shape
    for i in range(m):
        for t in range(nt):
            k = counts[i, t]
            if k > 1:
                perm = rng.permutation(k)
                if (perm == np.arange(k)).all():
                    perm = perm[::-1].copy()
                data[i, t, :k] = data[i, t, perm]
                indices[i, t, :k] = indices[i, t, perm]
    return data, indices, counts


@pytest.mark.parametrize("with_spill", [False, True])
def test_sort_indices_on_unsorted_slots(rng, with_spill):
    x = random_dense(rng, SHAPE, density=0.3)
    capacity = 6 if with_spill else 32
    a = twell_array(x, tile_n=32, capacity=capacity)
    assert (a.n_spilled > 0) == with_spill
    data, indices, counts = _shuffled_parts(rng, a)
    parts = (data, indices, counts, a.spill_data.copy(), a.spill_indices.copy(), a.spill_indptr.copy())
    copies = snapshot(*parts)
    b = twell_array(parts, shape=SHAPE, tile_n=32)
    b.check_format(full_check=True)  # unsorted slots are valid, just not canonical
    assert not b.has_canonical_format
    before = b.toarray()
    assert_bit_equal(before, x)
    b.sort_indices()
    assert b.has_canonical_format
    check_invariants(b, SHAPE, 32, capacity, x.dtype)
    assert_bit_equal(b.toarray(), before)
    assert_parts_equal(b, a.parts)
    assert_unchanged(parts, copies)  # sorting replaces the matrix's arrays, never the caller's


def test_sort_indices_moves_spilled_small_columns_into_slots():
    # Row-tile 0 of row 0 holds columns 10, 20 in its slots and 5 in the spill: valid, not canonical.
    data = np.zeros((1, 1, 2), np.float64)
    indices = np.full((1, 1, 2), -1, np.int16)
    data[0, 0], indices[0, 0] = [1.0, 2.0], [10, 20]
    counts = np.array([[2]], np.int32)
    spill = (np.array([3.0]), np.array([5], np.int32), np.array([0, 1], np.int32))
    b = twell_array((data, indices, counts, *spill), shape=(1, 32), tile_n=32)
    b.check_format(full_check=True)
    assert not b.has_canonical_format
    expected = np.zeros((1, 32))
    expected[0, [5, 10, 20]] = [3.0, 1.0, 2.0]
    assert_bit_equal(b.toarray(), expected)
    b.sort_indices()
    check_invariants(b, (1, 32), 32, 2, np.dtype(np.float64))
    np.testing.assert_array_equal(b.indices[0, 0], [5, 10])
    np.testing.assert_array_equal(b.data[0, 0], [3.0, 1.0])
    np.testing.assert_array_equal(b.spill_indices, [20])
    np.testing.assert_array_equal(b.spill_data, [2.0])
    assert_bit_equal(b.toarray(), expected)


def test_sort_indices_partial_spill_not_canonical():
    # A spilled entry while its row-tile still has a free slot is valid but not canonical.
    data = np.zeros((1, 1, 3), np.float32)
    indices = np.full((1, 1, 3), -1, np.int16)
    data[0, 0, 0], indices[0, 0, 0] = 1.0, 4
    counts = np.array([[1]], np.int32)
    spill = (np.array([2.0], np.float32), np.array([9], np.int32), np.array([0, 1], np.int32))
    b = twell_array((data, indices, counts, *spill), shape=(1, 32), tile_n=32)
    b.check_format(full_check=True)
    assert not b.has_canonical_format
    b.sort_indices()
    check_invariants(b, (1, 32), 32, 3, np.dtype(np.float32))
    assert b.n_spilled == 0
    np.testing.assert_array_equal(b.indices[0, 0], [4, 9, -1])


def test_sort_indices_on_canonical_matrix_keeps_it(rng):
    x = random_dense(rng, SHAPE, density=0.2)
    a = twell_array(x, tile_n=64, capacity=3)
    ref = snapshot(*a.parts)
    a.sort_indices()
    assert_parts_equal(a, ref)


# ----------------------------------------------------------------------------- eliminate_zeros


def _csr_with_explicit_zeros(rng, shape=SHAPE, density=0.25):
    x = random_dense(rng, shape, density=density, dtype=np.float64)
    m = sp.csr_array(x)
    nnz = m.nnz
    pick = rng.choice(nnz, size=max(3, nnz // 4), replace=False)
    m.data[pick[: len(pick) // 2]] = 0.0
    m.data[pick[len(pick) // 2 : -1]] = -0.0
    m.data[pick[-1]] = np.nan
    return m


@pytest.mark.parametrize("capacity", [1, 3, 32])
def test_eliminate_zeros(rng, capacity):
    m = _csr_with_explicit_zeros(rng)
    m_copy = m.copy()
    a = twell_array(m, tile_n=32, capacity=capacity)
    assert a.nnz == m.nnz  # explicit zeros are stored entries, as in scipy
    check_invariants(a, SHAPE, 32, capacity, np.dtype(np.float64))
    dense = m.toarray()
    np.testing.assert_array_equal(a.toarray(), dense)
    a.eliminate_zeros()
    n_zero = int((m.data == 0).sum())
    assert n_zero > 0
    assert a.nnz == m.nnz - n_zero
    assert np.isnan(a.spill_data).sum() + np.isnan(a.data[np.arange(capacity) < a.counts[..., None]]).sum() == 1
    check_invariants(a, SHAPE, 32, capacity, np.dtype(np.float64))
    expected = m.copy()
    expected.eliminate_zeros()
    np.testing.assert_array_equal(a.toarray(), expected.toarray())
    assert_parts_equal(a, expected_parts(np.where(dense == 0, 0.0, dense), 32, capacity))
    # the caller's matrix is untouched
    np.testing.assert_array_equal(m.indptr, m_copy.indptr)
    np.testing.assert_array_equal(m.indices, m_copy.indices)
    np.testing.assert_array_equal(bits(m.data), bits(m_copy.data))


def test_eliminate_zeros_without_zeros_keeps_everything(rng):
    x = random_dense(rng, SHAPE, density=0.2)
    x[0, 0] = np.nan
    a = twell_array(x, tile_n=32, capacity=2)
    ref = snapshot(*a.parts)
    a.eliminate_zeros()
    assert_parts_equal(a, ref)


# ----------------------------------------------------------------------------- copy / astype / repr


def test_copy_is_independent(rng):
    x = random_dense(rng, SHAPE, density=0.3)
    a = twell_array(x, tile_n=32, capacity=2)
    b = a.copy()
    assert b is not a
    assert_parts_equal(b, a.parts)
    for pa, pb in zip(a.parts, b.parts, strict=True):
        assert not np.shares_memory(pa, pb)
    b.data[...] = 7
    b.spill_data[...] = 7
    b.counts[...] = 0
    assert_bit_equal(a.toarray(), x)
    check_invariants(a, SHAPE, 32, 2, x.dtype)
    c = a.copy()
    a.data[...] = 0
    a.spill_data[...] = 0
    assert_bit_equal(c.toarray(), x)


def test_copy_keeps_n_dropped(rng):
    x = random_dense(rng, SHAPE, density=0.3)
    with pytest.warns(TwELLDroppedEntriesWarning):
        a = twell_array(x, tile_n=32, capacity=1, overflow="drop")
    assert a.n_dropped > 0
    assert a.copy().n_dropped == a.n_dropped


@pytest.mark.parametrize("dst", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("src", DTYPES, ids=DTYPE_IDS)
def test_astype(rng, src, dst):
    x = random_dense(rng, SHAPE, density=0.2, dtype=src)
    a = twell_array(x, tile_n=64, capacity=3)
    ref = snapshot(*a.parts)
    b = a.astype(dst)
    assert b is not a
    assert b.dtype == dst
    check_invariants(b, SHAPE, 64, 3, dst)
    assert b.nnz == a.nnz
    np.testing.assert_array_equal(b.indices, a.indices)
    np.testing.assert_array_equal(b.counts, a.counts)
    np.testing.assert_array_equal(b.spill_indices, a.spill_indices)
    assert_bit_equal(b.toarray(), x.astype(dst))
    assert_parts_equal(a, ref)  # source untouched
    b.data[...] = 0
    assert_parts_equal(a, ref)


def test_astype_by_name_and_no_copy(rng):
    x = random_dense(rng, SHAPE, density=0.2)
    a = twell_array(x, tile_n=32, capacity=4)
    assert a.astype("bfloat16").dtype == ts.bfloat16
    assert a.astype("float16").dtype == np.float16
    assert a.astype(np.float32, copy=False) is a
    b = a.astype(np.float32)
    assert b is not a and not np.shares_memory(a.data, b.data)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_repr_mentions_shape_and_dtype(rng, dtype):
    x = random_dense(rng, SHAPE, density=0.1, dtype=dtype)
    a = twell_array(x, tile_n=32, capacity=2)
    r = repr(a)
    assert "37x301" in r
    assert dtype.name in r
    assert str(a.nnz) in r
    assert "\n" not in r


# ----------------------------------------------------------------------------- re-tiling


@pytest.mark.parametrize(
    "src,dst",
    [
        ((64, 3), (32, 1)),
        ((64, 3), (1024, None)),
        ((32, 32), (256, 4)),
        ((1024, 1), (128, 128)),
        ((256, None), (256, 2)),
        ((128, 5), (64, 5)),
    ],
)
def test_retile_is_exact(rng, src, dst):
    x = random_dense(rng, SHAPE, density=0.25)
    a = twell_array(x, tile_n=src[0], capacity=src[1])
    ref = snapshot(*a.parts)
    b = twell_array(a, tile_n=dst[0], capacity=dst[1])
    cap = dst[1] if dst[1] is not None else dst[0] // 8
    check_invariants(b, SHAPE, dst[0], cap, x.dtype)
    assert_parts_equal(b, expected_parts(x, dst[0], cap))
    assert_bit_equal(b.toarray(), x)
    assert_parts_equal(a, ref)
    assert not any(np.shares_memory(pa, pb) for pa in a.parts for pb in b.parts)


def test_retile_keeps_explicit_zeros_and_nan(rng):
    m = _csr_with_explicit_zeros(rng)
    a = twell_array(m, tile_n=64, capacity=2)
    b = twell_array(a, tile_n=32, capacity=5)
    assert b.nnz == a.nnz == m.nnz
    check_invariants(b, SHAPE, 32, 5, np.dtype(np.float64))
    c = b.tocsr()
    np.testing.assert_array_equal(c.indptr, m.indptr)
    np.testing.assert_array_equal(c.indices, m.indices)
    np.testing.assert_array_equal(bits(c.data), bits(m.data))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_retile_with_dtype(rng, dtype):
    x = random_dense(rng, SHAPE, density=0.2, dtype=np.float64)
    a = twell_array(x, tile_n=32, capacity=2)
    b = twell_array(a, tile_n=128, capacity=8, dtype=dtype)
    check_invariants(b, SHAPE, 128, 8, dtype)
    assert_bit_equal(b.toarray(), x.astype(dtype))
    assert a.dtype == np.float64


def test_retile_shape_mismatch_raises(rng):
    a = twell_array(random_dense(rng), tile_n=32, capacity=2)
    with pytest.raises(ValueError):
        twell_array(a, shape=(SHAPE[0], SHAPE[1] + 1), tile_n=32)


def test_to_device_cpu_and_get_are_identity_on_cpu(rng):
    a = twell_array(random_dense(rng), tile_n=32)
    assert a.get() is a
    assert a.to_device("cpu") is a
    assert a.device == "cpu"


def test_shape_tuple_of_numpy_ints_builds_an_empty_matrix():
    a = twell_array((np.int64(3), np.int32(70)), tile_n=32)
    assert a.shape == (3, 70) and a.nnz == 0 and a.dtype == np.float64
