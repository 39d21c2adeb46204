"""Every GPU kernel once on small odd shapes (spill included), for compute-sanitizer.

Run as ``compute-sanitizer --tool memcheck python3 scripts/sanitize_smoke.py``. CuPy's memory
pool is disabled so each array is its own allocation and out-of-bounds accesses are caught.
"""

from __future__ import annotations

import warnings

import cupy as cp
import numpy as np

import twellsparse as ts
from twellsparse import _gpu_convert, _gpu_ops, _hopper_producer, _stationary
from twellsparse import _kernels as K
from twellsparse._ops import transposed_products
from twellsparse._timing import Timer

cp.cuda.set_allocator(None)
rng = np.random.default_rng(0)
for dtype in (ts.bfloat16, np.float32):
    x = (rng.standard_normal((37, 301)) * (rng.random((37, 301)) < 0.3)).astype(dtype)
    a = ts.twell_array(cp.asarray(x), tile_n=32, capacity=3)
    assert a.n_spilled > 0
    a.toarray()
    csr_ish = a.astype(np.float32).tocsr()
    ts.twell_array(csr_ish, tile_n=64, capacity=2)
    v, i = a.toell()
    ts.from_ell(v, i, shape=a.shape, tile_n=32, capacity=3)
    b = cp.asarray(rng.standard_normal((301, 19)).astype(dtype))  # K = 19: the portable kernels
    g = cp.asarray(rng.standard_normal((37, 19)).astype(dtype))
    b8 = cp.asarray(rng.standard_normal((301, 24)).astype(dtype))  # K = 24: 16-byte rows, the gather kernels
    a4 = ts.twell_array(cp.asarray(x), tile_n=32, capacity=4)
    a @ b
    a.T @ g
    ts.sddmm(g, b, a)
    # fp8 rows: the quantizer, the e4m3 SpMM (2-byte values, K = 24) and its decoded fallback.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.TwELLFallbackWarning)
        ts.matmul(a, ts.quantize_rows(b8))
        ts.matmul(a, ts.quantize_rows(b))
    xin = cp.asarray(rng.standard_normal((37, 24)).astype(dtype))
    wg = cp.asarray(rng.standard_normal((300, 24)).astype(dtype))
    wd = cp.asarray(rng.standard_normal((24, 300)).astype(dtype))
    ts.linear_to_twell(xin, wg, tile_n=32, capacity=2)
    for dispatch in ("sparse", "dense"):
        ts.ffn(xin, wg, wd, tile_n=32, capacity=2, dispatch=dispatch)
        ts.gated_ffn(xin, wg, wg, wd, tile_n=32, capacity=2, dispatch=dispatch)
    # The row-gather kernels in every variant, on 24 columns (16-byte rows for both dtypes).
    for variant in K.GATHER_VARIANTS:
        _gpu_ops.spmm(a4.parts, 32, b8, cp.empty((37, 24), dtype=dtype), path="gather", variant=variant)
        _gpu_ops.sddmm(a4.parts, 32, xin, b8, True, path="gather", variant=variant)
        _gpu_ops.gated_consumer(a4.parts, 32, xin, b8, b8, keep_up=True, variant=variant)
        if np.dtype(dtype).itemsize == 2:  # e4m3 up and down rows (301 x 24 codes)
            q8 = ts.quantize_rows(b8)
            _gpu_ops.gated_consumer(a4.parts, 32, xin, q8, q8, keep_up=True, variant=variant)
    # The weight-stationary SpMM (2-byte types; K = 24: a partial second slice).
    if np.dtype(dtype).itemsize == 2:
        _stationary.spmm(a4.parts, 32, b8, cp.empty((37, 24), dtype=dtype))
    # The backward's pieces: one transposed pattern (the counting sort) for three products that
    # read their values through it (two of them paired on one dense operand), and the dual row-gather SpMM.
    g37 = b8[:37]
    transposed_products(a4, [(a4, xin), (a4, g37), (a4, g37)])  # the last two: one paired pass
    _gpu_ops.spmm(a4.parts, 32, b8, cp.empty((37, 24), dtype=dtype), path="gather", second=(a4.parts, b8))
    # The ReLU-mask pack with a hand-made cuBLASLt-layout mask (4 words per 128 columns).
    hm = np.maximum(x.astype(np.float32), 0).astype(dtype)
    bits = np.zeros((37, 384), dtype=bool)
    bits[:, :301] = hm.astype(np.float32) > 0
    words = np.ascontiguousarray(np.packbits(bits, axis=-1, bitorder="little")).view("<u4").reshape(-1)
    _, finish = _gpu_convert.relu_mask_to_parts_deferred(cp.asarray(hm), cp.asarray(words), 12, 32, 3)
    finish("spill")
    _, finish = _gpu_convert.relu_mask_to_parts_deferred(cp.asarray(hm), cp.asarray(words), 12, 32, 8)  # staged
    finish("spill")
    # The mask-driven consumers on the same mask (d_ff 301: a partial last word).
    w301 = cp.asarray(rng.standard_normal((301, 24)).astype(dtype))
    _gpu_ops.mask_consumer(cp.asarray(hm), cp.asarray(words), 12, xin, w301, w301)
    _gpu_ops.mask_consumer(cp.asarray(hm), cp.asarray(words), 12, xin, None, w301)
# The device scans over several chunks: a fixed spill's layout with its boundary in a middle
# chunk (so later blocks rescan it), and a plan spilling into a fixed-length buffer.
counts = cp.asarray(rng.integers(0, 12, size=(3001, 5)).astype(np.int32))
_gpu_convert.spill_layout(counts, 8, int(cp.maximum(counts - 8, 0).sum()) // 2)
ts.GatedFFN(wg, wg, wd, tile_n=32, capacity=2, dispatch="sparse", spill_capacity=40)(xin)
# The fused Hopper producer (sm_90a): a partial row block, column block and k block, two tile
# widths, and row-tiles over capacity (their values and mask bits feed the spill pass).
if _hopper_producer.applies(xin, wg, "relu", None, 32, 8):
    xh = cp.asarray(rng.standard_normal((150, 200)).astype(ts.bfloat16))
    wh = cp.asarray(rng.standard_normal((300, 200)).astype(ts.bfloat16))
    for tile_n, capacity in ((32, 8), (256, 32)):
        ts.linear_to_twell(xh, wh, tile_n=tile_n, capacity=capacity)
    ts.linear_to_twell(xh, wh, activation="silu", threshold=0.5, tile_n=64, capacity=16)
    # More output tiles (17 x 9) than SMs, under every schedule: the split ones' hand-off buffer
    # is refilled once the pack warps drain it (racecheck watches that exchange), and clusters of
    # two CTAs with an odd number of row blocks.
    xh = cp.asarray(rng.standard_normal((2100, 72)).astype(ts.bfloat16))
    wh = cp.asarray(rng.standard_normal((2300, 72)).astype(ts.bfloat16))
    default = _hopper_producer.SCHEDULE
    for schedule in _hopper_producer.SCHEDULES:
        _hopper_producer.SCHEDULE = schedule
        ts.linear_to_twell(xh, wh, tile_n=256, capacity=32)
    _hopper_producer.SCHEDULE = default
Timer(1, on_gpu=True, warmup=0, hide_host=True)(lambda: None)  # twell_spin
cp.cuda.Device().synchronize()
print("sanitize smoke: all kernels ran")
