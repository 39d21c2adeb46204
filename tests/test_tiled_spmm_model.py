"""The tiled SpMM's algebra on the CPU (tests/tiled_spmm_model.py): its pack holds every entry of
A once in the documented order, and a lane-by-lane emulation of the kernel on that pack (the
PTX ISA's ldmatrix.trans and m16n8k16 fragment layouts, the 128-byte swizzle, the epilogue's
lane exchange) reproduces the float64 product over odd shapes, spill, partial chunks and column
blocks, wide tiles and the dual form. The device runs of the same kernel are in
tests/gpu/test_gpu_tiled_spmm.py."""

from __future__ import annotations

import numpy as np
import pytest
from tiled_spmm_model import emulate, reference_pack

import twellsparse as ts
from twellsparse import _tiled_spmm
from twellsparse.testing import sparse_activations

# (m, k, n, tile_n, capacity, density): k columns of A (rows of b), n columns of b
CASES = [
    (37, 1100, 72, 64, 2, 0.05),  # spill, a partial last chunk and column block, a partial group
    (9, 700, 8, 1024, None, 0.2),  # tiles wider than a chunk; one column block of 8 columns
    (20, 512, 64, 256, 4, 0.6),  # dense rows: many k-groups per item
]


def _problem(rng, m, k, tile_n, capacity, density, dtype=ts.bfloat16):
    h = sparse_activations(m, k, density, "skewed", dtype, rng)
    h[m // 2] = 0  # an empty row
    return h, ts.twell_array(h, tile_n=tile_n, capacity=capacity)


def _twin(rng, h, a):
    h2 = np.where(h != 0, rng.uniform(0.5, 2.0, h.shape) * rng.choice([-1, 1], h.shape), 0).astype(h.dtype)
    return h2, ts.twell_array(h2, tile_n=a.tile_n, capacity=a.capacity)


@pytest.mark.parametrize("m, k, n, tile_n, capacity, density", CASES)
def test_pack_holds_every_entry_once_in_class_rounds(rng, m, k, n, tile_n, capacity, density):
    h, a = _problem(rng, m, k, tile_n, capacity, density)
    kg_ptr, words, n_chunks, n_first = reference_pack(a.parts, tile_n, k)
    assert n_chunks == n_first == -(-k // _tiled_spmm.CHUNK) and kg_ptr[-1] * 16 == words.size
    rebuilt = np.zeros((m, k), dtype=np.float64)
    for grp in range(-(-m // 8)):
        for c in range(n_chunks):
            item = words[kg_ptr[grp * n_chunks + c] * 16 : kg_ptr[grp * n_chunks + c + 1] * 16]
            values = (item >> 16).astype(np.uint16).view(h.dtype).astype(np.float64)
            rows, cols = grp * 8 + ((item >> 9) & 7), c * 512 + (item & 511)
            real = values != 0
            assert real.sum() > item.size - 16 or not item.size  # padding inside the last k-group only
            np.add.at(rebuilt, (rows[real], cols[real]), values[real])
            assert set(cols[~real]) <= set(cols[real])  # padding reads a row an entry reads
            classes = (item[real] & 7).tolist()  # round i: one entry of each class that has an i-th
            counts = np.bincount(np.array(classes, dtype=int), minlength=8)
            for r in range(counts.max() if classes else 0):
                in_round = [q for q in range(8) if counts[q] > r]
                start = int(np.minimum(counts, r).sum())
                assert classes[start : start + len(in_round)] == in_round
    assert np.array_equal(rebuilt, h.astype(np.float64))


@pytest.mark.parametrize("m, k, n, tile_n, capacity, density", CASES)
def test_emulated_kernel_matches_the_float64_product(rng, m, k, n, tile_n, capacity, density):
    h, a = _problem(rng, m, k, tile_n, capacity, density)
    b = rng.standard_normal((k, n)).astype(ts.bfloat16)
    got = emulate(*reference_pack(a.parts, tile_n, k), m, b)
    expected = h.astype(np.float64) @ b.astype(np.float64)
    assert np.isfinite(got).all()  # every element written
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_emulated_dual_form_sums_both_products(rng):
    m, k, n = 21, 600, 24
    h, a = _problem(rng, m, k, 32, 3, 0.08, np.float16)
    h2, a2 = _twin(rng, h, a)
    b, b2 = (rng.standard_normal((k, n)).astype(np.float16) for _ in range(2))
    packed = reference_pack(a.parts, 32, k, second=a2.parts)
    assert packed[2] == 2 * packed[3]
    got = emulate(*packed, m, b, b2)
    expected = h.astype(np.float64) @ b.astype(np.float64) + h2.astype(np.float64) @ b2.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_inf_in_an_unused_row_of_b_is_never_read(rng):
    m, k, n = 16, 520, 16
    h, a = _problem(rng, m, k, 64, None, 0.05)
    unused = np.flatnonzero(~h.any(axis=0))
    b = rng.standard_normal((k, n)).astype(ts.bfloat16)
    b[unused] = np.inf
    got = emulate(*reference_pack(a.parts, 64, k), m, b)
    expected = h.astype(np.float64) @ np.where(np.isinf(b), 0, b).astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
