"""The row-gather kernels' row order (``_gpu_ops.row_order``, ``TWELL_GATHER_ROW_ORDER``): a
permutation of the rows with more batches of 32 entries first; and, in a build that reads it
(the switch set in the environment: ``bash scripts/device_run.sh roworder``), every kernel that
takes it gives bit for bit the results of index order (spill entries, empty rows, rows of 15+
batches)."""

from __future__ import annotations

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _gpu_ops
from twellsparse import _kernels as K
from twellsparse.testing import sparse_activations

pytestmark = pytest.mark.gpu


def _matrix(cp, rng, m=1030, n=4000, density=0.02):
    """Skewed activations (rows of 0 to ~15 batches) with a few very long rows and spill."""
    h = sparse_activations(m, n, density, "skewed", ts.bfloat16, rng)
    h[m // 2] = 0  # an empty row
    h[3, : n // 2] = 1.0  # 2000 entries: past the last bucket (15 batches or more)
    h[7, ::3] = 2.0
    return h, ts.twell_array(cp.asarray(h), tile_n=64, capacity=8)


def test_order_is_a_permutation_longest_rows_first(cp, rng):
    h, a = _matrix(cp, rng)
    order = cp.asnumpy(_gpu_ops.longest_first(a.parts))
    assert sorted(order.tolist()) == list(range(h.shape[0]))
    batches = np.minimum(-(-np.count_nonzero(h, axis=1) // 32), _gpu_ops.ORDER_BUCKETS - 1)
    assert (np.diff(batches[order]) <= 0).all()  # non-increasing: longest first, ties in any order
    # the null pointer unless the build reads an order
    assert isinstance(_gpu_ops.row_order(a.parts), np.uint64) != K.GATHER_ROW_ORDER


@pytest.mark.skipif(
    not K.GATHER_ROW_ORDER,
    reason="the kernels read their order only when built with TWELL_GATHER_ROW_ORDER=1",
)
def test_every_row_kernel_gives_the_same_bits_in_either_order(cp, rng, monkeypatch):
    h, a = _matrix(cp, rng)
    m, n = h.shape
    k = 96
    x = cp.asarray(rng.standard_normal((m, k)).astype(ts.bfloat16))
    w = cp.asarray((rng.standard_normal((n, k)) / 8).astype(ts.bfloat16))
    dy = cp.asarray(rng.standard_normal((m, k)).astype(ts.bfloat16))
    up = _gpu_ops.gated_up(a.parts, 64, x, w, keep_up=True, path="gather")[1]
    counts = cp.asnumpy(a.parts.counts)
    used = np.arange(a.parts.data.shape[2])[None, None, :] < counts[:, :, None]

    def results():
        out = cp.full((m, k), np.nan, dtype=ts.bfloat16)
        _gpu_ops.spmm(a.parts, 64, w, out, path="gather")
        summed = cp.full((m, k), np.nan, dtype=ts.bfloat16)
        _gpu_ops.spmm(a.parts, 64, w, summed, path="gather", second=(up, w))
        sampled = _gpu_ops.sddmm(a.parts, 64, x, w, True, path="gather")
        h_parts, u_parts = _gpu_ops.gated_up(a.parts, 64, x, w, keep_up=True, path="gather")
        backward = _gpu_ops.sddmm_gated_backward(a.parts, 64, dy, w, up, path="gather")
        arrays = [out, summed, sampled.data, sampled.spill_data, u_parts.data, u_parts.spill_data]
        arrays += [p.data for p in backward] + [p.spill_data for p in backward]
        bits = [cp.asnumpy(v).view(np.uint16) for v in arrays]
        return [*bits, cp.asnumpy(h_parts.data).view(np.uint16)[used]]  # h's padding is never written

    ordered = results()  # the rows longest first
    monkeypatch.setattr(_gpu_ops, "row_order", lambda parts: cp.arange(parts.counts.shape[0], dtype=cp.int32))
    plain = results()  # the identity order: index order, read through the order argument
    for i, (p, q) in enumerate(zip(plain, ordered, strict=True)):
        assert (p == q).all(), f"result {i} differs"
