"""Plans with a fixed spill_capacity on the GPU: no read-back inside a call, the same output as
the exact path while the spill fits, a late but certain error when it does not, and a call
captured in a CUDA graph and replayed on new inputs."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import block_reference

import twellsparse as ts
from twellsparse.testing import ffn_problem, rel_error

pytestmark = pytest.mark.gpu

TILE, CAP = 64, 2

#: Bounds against float64: float32 as test_gpu_ops' plans; bf16 rounds the gate, u, h and out
#: (each by at most 2**-9, relative: about 3e-3 in all for these blocks on the CPU reference path).
BOUND = {np.dtype(np.float32): 1e-5, np.dtype(ts.bfloat16): 1e-2}


def _plans(cp, p, gated, spill_capacity):
    weights = (p["w_gate"], p["w_up"], p["w_down"]) if gated else (p["w_gate"], p["w_down"])
    cls = ts.GatedFFN if gated else ts.FFN
    settings = dict(tile_n=TILE, capacity=CAP, dispatch="sparse")
    return cls(*weights, **settings, spill_capacity=spill_capacity), cls(*weights, **settings)


def _check_float64(p, gated, out):
    """``out`` against the float64 host reference of the block on p's inputs."""
    assert rel_error(out, block_reference(p, gated)) <= BOUND[np.dtype(p["x"].dtype)]


def _excess_prefix(cp, p, spill_capacity):
    """(entries spilled in all, entries a fixed spill of this length holds): the row-tiles'
    excess in row-major order, cut at the first tile that does not fit. The pattern comes from
    the same producer (linear_to_twell), so rounding decides it as in the plans."""
    h = ts.linear_to_twell(p["x"], p["w_gate"], tile_n=TILE, capacity=CAP)
    parts = h.parts
    m, nt = parts.counts.shape
    indptr = cp.asnumpy(parts.spill_indptr)
    rows = np.repeat(np.arange(m), np.diff(indptr))
    tiles = cp.asnumpy(parts.spill_indices) // TILE
    excess = np.bincount(rows * nt + tiles, minlength=m * nt)
    ends = np.cumsum(excess)
    fits = ends[ends <= spill_capacity]
    return int(ends[-1]), int(fits[-1]) if fits.size else 0


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", [ts.bfloat16, np.float32])
def test_fixed_spill_equals_the_exact_path(cp, rng, gated, dtype):
    p = ffn_problem(300, 64, 1000, 0.05, "skewed", dtype, rng, cp)
    total, _ = _excess_prefix(cp, p, 0)
    assert total > 0  # the case must spill
    fixed, exact = _plans(cp, p, gated, spill_capacity=total + 100)
    got, want = fixed(p["x"]), exact(p["x"])
    np.testing.assert_array_equal(cp.asnumpy(got).view(np.uint8), cp.asnumpy(want).view(np.uint8))
    _check_float64(p, gated, got)
    fixed.check_spill()
    assert fixed.last_stats["n_spilled"] == exact.last_stats["n_spilled"] == total
    assert fixed.last_stats["nnz"] == exact.last_stats["nnz"]


@pytest.mark.parametrize("gated", [True, False])
def test_a_spill_that_does_not_fit_raises_at_the_next_call(cp, rng, gated):
    p = ffn_problem(300, 64, 1000, 0.05, "skewed", ts.bfloat16, rng, cp)
    total, _ = _excess_prefix(cp, p, 0)
    small = total // 3
    _, kept = _excess_prefix(cp, p, small)
    fixed, _ = _plans(cp, p, gated, spill_capacity=small)
    fixed(p["x"])
    assert fixed.last_stats["n_spilled"] == kept
    with pytest.raises(ts.TwELLSpillCapacityError) as info:
        fixed(p["x"])
    assert info.value.n_left_out == total - kept and info.value.spill_capacity == small
    fixed.check_spill()  # the error was raised once; the failed call posted nothing new


@pytest.mark.parametrize("gated", [True, False])
def test_capture_in_a_cuda_graph_and_replay(cp, rng, gated):
    p1 = ffn_problem(256, 64, 1024, 0.04, "skewed", ts.bfloat16, rng, cp)
    p2 = ffn_problem(256, 64, 1024, 0.04, "skewed", ts.bfloat16, np.random.default_rng(7), cp)
    p2.update({k: p1[k] for k in ("w_gate", "w_up", "w_down")})  # same weights, new tokens
    fixed, exact = _plans(cp, p1, gated, spill_capacity=256 * 64)
    x = cp.array(p1["x"])
    pool = cp.cuda.MemoryPool()  # the graph's own memory: nothing outside it reuses its blocks
    stream = cp.cuda.Stream(non_blocking=True)
    with cp.cuda.using_allocator(pool.malloc), stream:
        fixed(x)  # compiles the kernels and makes the library handles before the capture
        stream.synchronize()
        stream.begin_capture()
        out = fixed(x)
        graph = stream.end_capture()
    for p in (p1, p2):
        x[...] = p["x"]
        # out lives in the graph's pool, which conftest.py's poisoning does not reach, and may
        # hold the warm-up call's result (same x as p1): NaN, so the launch must write it all.
        out.fill(np.nan)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        want = exact(p["x"])
        np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint8), cp.asnumpy(want).view(np.uint8))
        _check_float64(p, gated, out)
        fixed.check_spill()


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("fixed", [True, False])
def test_calls_write_into_out(cp, rng, gated, fixed):
    """The gather tails write a given out directly (unit column stride) or through a copy
    (strided): bitwise the result of a call without out, on poisoned buffers."""
    p = ffn_problem(300, 64, 1000, 0.05, "skewed", ts.bfloat16, rng, cp)
    fixed_plan, exact_plan = _plans(cp, p, gated, spill_capacity=300 * 1000)
    plan = fixed_plan if fixed else exact_plan
    first = plan(p["x"])
    _check_float64(p, gated, first)
    want = cp.asnumpy(first).view(np.uint16)
    out = cp.empty((300, 64), dtype=ts.bfloat16)
    assert plan(p["x"], out=out) is out
    np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint16), want)
    wide = cp.empty((300, 128), dtype=ts.bfloat16)
    plan(p["x"], out=wide[:, 1::2])
    np.testing.assert_array_equal(cp.asnumpy(wide[:, 1::2]).view(np.uint16), want)
    plan.check_spill()
