"""The cuBLASLt ReLU bit-mask producer: the mask pack against the dense pack (bit-exact parts,
with a hand-made mask, so the kernel is checked on its own), the cuBLASLt GEMM against float64,
and linear_to_twell / the plans with the producer enabled."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from helpers import block_reference, rounding_bound

import twellsparse as ts
from twellsparse import _gpu_convert, _gpu_producer
from twellsparse import _reference as ref
from twellsparse.testing import ffn_problem, rel_error, sparse_activations

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16, np.float32]


def _mask_of(cp, h, words):
    """cuBLASLt's mask layout: ``words`` uint32 per row, bit f of a row set where h > 0."""
    m, n = h.shape
    bits = np.zeros((m, words * 32), dtype=bool)
    bits[:, :n] = h.astype(np.float64) > 0
    packed = np.packbits(bits, axis=-1, bitorder="little")  # byte b, bit i: column 8b + i
    return cp.asarray(np.ascontiguousarray(packed).view("<u4").reshape(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, n, tile_n, capacity, density",
    [
        (37, 301, 32, 3, 0.2),
        (64, 5632, 256, 32, 0.01),
        (9, 1000, 1024, 8, 0.05),
        (50, 700, 128, 2, 0.3),
        (41, 333, 32, 8, 0.4),  # staged with one word per tile, overflowing
        (70, 1100, 64, 16, 0.35),
    ],
)
@pytest.mark.parametrize("staged", [None, False])  # vector stores where the capacity allows; scalar
def test_mask_pack_equals_dense_pack(cp, rng, dtype, m, n, tile_n, capacity, density, staged):
    h = sparse_activations(m, n, density, "skewed", dtype, rng)
    words = -(-n // 128) * 4
    mask = _mask_of(cp, h, words)
    if m > 2:  # a set bit over a zero value must not be stored
        h[1, : min(n, 40)] = 0
    hg = cp.asarray(h)
    for overflow in ("spill", "drop"):
        with warnings.catch_warnings():  # "drop" warns on both sides; the counts are compared
            warnings.simplefilter("ignore", ts.TwELLDroppedEntriesWarning)
            finish = _gpu_convert.relu_mask_to_parts_deferred(hg, mask, words, tile_n, capacity, staged)[1]
            got, dropped = finish(overflow)
            want, want_dropped = _gpu_convert.dense_to_parts(hg, tile_n, capacity, overflow)
        assert dropped == want_dropped
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(cp.asnumpy(a).view(np.uint8), cp.asnumpy(b).view(np.uint8))


def test_staged_mask_pack_needs_a_capacity_multiple_of_8(cp):
    h = cp.zeros((4, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="staged: expected a capacity that is a multiple of 8"):
        _gpu_convert.relu_mask_to_parts_deferred(h, cp.zeros(8, dtype=cp.uint32), 2, 64, 6, staged=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_mask_gemm(cp, rng, dtype):
    pytest.importorskip("cffi")
    from twellsparse.bindings import cublaslt

    try:
        cublaslt.library()
    except cublaslt.CuBlasLtError as exc:
        pytest.skip(str(exc))
    x = rng.standard_normal((300, 64)).astype(dtype)
    w = rng.standard_normal((777, 64)).astype(dtype)
    h, mask, words = _gpu_producer.relu_linear(cp.asarray(x), cp.asarray(w))
    expected = np.maximum(x.astype(np.float64) @ w.astype(np.float64).T, 0)
    assert rel_error(h, expected) < (1e-5 if np.dtype(dtype) == np.float32 else 1e-2)
    bits = np.unpackbits(cp.asnumpy(mask).view(np.uint8), bitorder="little").reshape(300, words * 32)[:, :777]
    hv = cp.asnumpy(h).astype(np.float64)
    assert np.all(hv[bits == 0] == 0)  # an unset bit always means a zero output
    assert np.mean(bits[hv > 0]) == 1.0


@pytest.mark.parametrize("gated", [False, True])
def test_plans_and_producer_with_the_mask_path(cp, rng, monkeypatch, gated):
    from twellsparse.bindings import cublaslt

    try:
        cublaslt.library()
    except (ImportError, RuntimeError) as exc:
        pytest.skip(str(exc))
    p = ffn_problem(400, 128, 1000, 0.02, "skewed", ts.bfloat16, rng, cp)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]

    def block(dispatch):
        return ts.GatedFFN(wg, wu, wd, dispatch=dispatch)(x) if gated else ts.FFN(wg, wd, dispatch=dispatch)(x)

    monkeypatch.setattr(_gpu_producer, "ENABLED", False)  # the dense-scan producer first
    before, dense_before = block("sparse"), block("dense")
    h_before = ts.linear_to_twell(x, wg, capacity=4)
    monkeypatch.setattr(_gpu_producer, "ENABLED", True)
    assert _gpu_producer.applies(x, wg, "relu", None)
    after, dense_after = block("sparse"), block("dense")  # dense: z comes relu'd from cuBLASLt
    h_after = ts.linear_to_twell(x, wg, capacity=4)
    assert rel_error(after, before) < 2e-2  # different GEMM algorithms: rounding-level differences
    assert rel_error(dense_after, dense_before) < 2e-2
    assert abs(h_after.nnz - h_before.nnz) <= max(5, h_before.nnz // 1000) and h_after.n_spilled > 0
    assert rel_error(h_after.toarray(), h_before.toarray()) < 2e-2
    # Each against float64 on the host: the blocks within twice the dense bf16 block's error (the
    # same roundings), the hidden layer within the rounding of one GEMM result to bf16.
    exact = block_reference(p, gated)
    bound = 2 * rel_error(dense_before, exact) + 1e-4
    for out in (before, after, dense_after):
        assert rel_error(out, exact) <= bound
    exact_h = ref.linear_dense(cp.asnumpy(p["x"]), cp.asnumpy(p["w_gate"]), "relu")
    for h in (h_before, h_after):
        assert rel_error(h.toarray(), exact_h) <= rounding_bound(ts.bfloat16, exact_h)


def _needs_cublaslt():
    from twellsparse.bindings import cublaslt

    try:
        cublaslt.library()
    except (ImportError, RuntimeError) as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(
    "m, d_model, d_ff, tile_n, capacity, density",
    [
        (300, 64, 1024, 256, 32, 0.01),  # nothing spills: the TwELL path's order, identical bits
        (77, 128, 1000, 64, 2, 0.05),  # d_ff not a multiple of 32 (the last mask word), spills
        (1, 64, 5632, 256, 8, 0.02),
    ],
)
def test_mask_consumer_plans(cp, rng, monkeypatch, dtype, gated, m, d_model, d_ff, tile_n, capacity, density):
    """The plans' tail driven by the ReLU mask (MASK_CONSUMER): the TwELL path's bits when no
    row-tile spills, else within the same-precision dense error of the float64 reference; the
    same hidden-layer statistics; the caller's inputs untouched."""
    _needs_cublaslt()
    p = ffn_problem(m, d_model, d_ff, density, "skewed", dtype, rng, cp)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    x_before = cp.asnumpy(x).copy()
    settings = dict(tile_n=tile_n, capacity=capacity, dispatch="sparse")
    plan = ts.GatedFFN(wg, wu, wd, **settings) if gated else ts.FFN(wg, wd, **settings)
    want = plan(x)
    want_stats = plan.last_stats
    monkeypatch.setattr(_gpu_producer, "MASK_CONSUMER", True)
    got = plan(x)
    stats = plan.last_stats
    np.testing.assert_array_equal(cp.asnumpy(x).view(np.uint8), x_before.view(np.uint8))
    assert stats["nnz"] == want_stats["nnz"] and stats["n_spilled"] == 0
    if want_stats["n_spilled"] == 0:
        np.testing.assert_array_equal(cp.asnumpy(got).view(np.uint8), cp.asnumpy(want).view(np.uint8))
        return
    x64, wg64, wu64, wd64 = (cp.asnumpy(a).astype(np.float64) for a in (x, wg, wu, wd))
    a = np.maximum(x64 @ wg64.T, 0)
    ref = ((a * (x64 @ wu64.T)) if gated else a) @ wd64.T
    assert rel_error(got, ref) <= 2 * rel_error(want, ref) + 1e-4


def test_mask_consumer_plan_captured_in_a_cuda_graph(cp, rng, monkeypatch):
    """With the mask-driven tail a plan call reads nothing back without any spill_capacity: it is
    captured in a CuPy graph and replays on new tokens like an eager call."""
    _needs_cublaslt()
    monkeypatch.setattr(_gpu_producer, "MASK_CONSUMER", True)
    p = ffn_problem(256, 64, 1024, 0.04, "skewed", ts.bfloat16, rng, cp)
    plan = ts.GatedFFN(p["w_gate"], p["w_up"], p["w_down"], tile_n=64, capacity=2, dispatch="sparse")
    x = cp.array(p["x"])
    pool = cp.cuda.MemoryPool()
    stream = cp.cuda.Stream(non_blocking=True)
    with cp.cuda.using_allocator(pool.malloc), stream:
        plan(x)
        stream.synchronize()
        stream.begin_capture()
        out = plan(x)
        graph = stream.end_capture()
    for seed in (1, 2):
        new = ffn_problem(256, 64, 1024, 0.04, "skewed", ts.bfloat16, np.random.default_rng(seed), cp)["x"]
        x[...] = new
        out.fill(np.nan)  # the graph's pool is not poisoned (conftest.py): the launch must write all of out
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint8), cp.asnumpy(plan(new)).view(np.uint8))


@pytest.mark.parametrize("kind", ["Gemm", "ReluGemm", "ReluMaskGemm"])
def test_gemm_plans_time_their_candidates(cp, rng, kind):
    """A cuBLASLt plan times the heuristic's candidates on its first call outside a capture and
    keeps one; a first call inside a capture takes the first choice and leaves the timing to the
    next eager call. Every call's result matches float64 on a poisoned output, and the kept
    algorithm gives the same bits call after call."""
    _needs_cublaslt()
    from twellsparse.bindings import cublaslt

    m, f, k = 300, 777, 64
    x = cp.asarray(rng.standard_normal((m, k)).astype(ts.bfloat16))
    w = cp.asarray(rng.standard_normal((f, k)).astype(ts.bfloat16))
    z = cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(w).astype(np.float64).T
    expected = z if kind == "Gemm" else np.maximum(z, 0)
    mask = cp.empty(m * cublaslt.mask_ld(f) // 32, dtype=cp.uint32)
    extra = (mask,) if kind == "ReluMaskGemm" else ()

    def check_mask():
        """Bit f of row i (uint32 words, little-endian bits, mask_ld(f) bits a row) set where
        the GEMM result is positive: checked where float64's sign is beyond fp32 accumulation's
        reach (|z| > 1e-2, z ~ N(0, 64)); the row padding past f is not looked at."""
        if kind != "ReluMaskGemm":
            return
        bits = np.unpackbits(cp.asnumpy(mask).view(np.uint8), bitorder="little").reshape(m, -1)[:, :f]
        clear = np.abs(z) > 1e-2
        np.testing.assert_array_equal(bits[clear], (z > 0)[clear])

    def run(plan):
        out = cp.full((m, f), np.nan, dtype=ts.bfloat16)
        mask.fill(0xFFFFFFFF)  # poisoned again: all set, so a bit left unwritten over z < 0 shows
        plan(x, w, out, *extra)
        assert rel_error(out, expected) < 1e-2
        check_mask()
        return cp.asnumpy(out).view(np.uint16)

    captured = getattr(cublaslt, kind)(m, f, k, ts.bfloat16)
    offered = captured.candidates
    stream = cp.cuda.Stream(non_blocking=True)
    out = cp.full((m, f), np.nan, dtype=ts.bfloat16)
    with stream:
        stream.begin_capture()
        captured(x, w, out, *extra)
        graph = stream.end_capture()
    assert captured.candidates == offered  # nothing timed inside the capture
    mask.fill(0xFFFFFFFF)
    cp.cuda.Device().synchronize()  # the fills ran on the legacy stream, which `stream` does not wait for
    graph.launch(stream)
    stream.synchronize()
    assert rel_error(out, expected) < 1e-2
    check_mask()
    run(captured)
    assert captured.candidates == 1
    plan = getattr(cublaslt, kind)(m, f, k, ts.bfloat16)
    first = run(plan)
    assert plan.candidates == 1
    np.testing.assert_array_equal(run(plan), first)


def test_gemm_plans_time_warm_without_room_for_the_eviction_buffer(cp, rng, monkeypatch):
    """A device without room for the L2 eviction buffer (here an L2 said to be a petabyte) times
    the candidates from a warm L2 instead of failing the call; the result is still right."""
    _needs_cublaslt()
    from twellsparse.bindings import cublaslt

    real = cp.cuda.runtime.getDeviceProperties
    monkeypatch.setattr(cp.cuda.runtime, "getDeviceProperties", lambda d: {**real(d), "l2CacheSize": 1 << 50})
    assert cublaslt._l2_eviction_buffer() is None
    m, f, k = 301, 779, 72  # a shape of its own: no earlier timed choice to adopt
    x = cp.asarray(rng.standard_normal((m, k)).astype(ts.bfloat16))
    w = cp.asarray(rng.standard_normal((f, k)).astype(ts.bfloat16))
    plan = cublaslt.Gemm(m, f, k, ts.bfloat16)
    if plan.candidates < 2:
        pytest.skip("the heuristic offered one algorithm: nothing to time")
    out = cp.full((m, f), np.nan, dtype=ts.bfloat16)
    plan(x, w, out)
    assert plan.candidates == 1
    assert rel_error(out, cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(w).astype(np.float64).T) < 1e-2


def test_gemm_candidates_from_the_environment(cp, monkeypatch):
    _needs_cublaslt()
    from twellsparse.bindings import cublaslt

    monkeypatch.setenv(cublaslt.ENV_CANDIDATES, "1")
    assert cublaslt.Gemm(300, 777, 64, ts.bfloat16).candidates == 1
