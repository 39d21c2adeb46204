"""The fused Hopper producer (wgmma GEMM with a packing epilogue, ``_hopper_producer``).

Bitwise against the GEMM-then-pack path on data whose products are exact in fp32 (small integers:
every accumulation order gives the same z), across partial tiles, every tile width it serves,
K not a multiple of the 64-wide k block, the three activations, thresholds and overflowing
row-tiles under every overflow policy; on random data against float64; and through the plans,
the fixed spill and a CUDA-graph capture. Each test runs under every schedule of the kernel
(``_hopper_producer.SCHEDULES``), one case with more output tiles than SMs and an odd number
of row blocks (the last cluster's second CTA has no rows)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _gpu_convert, _hopper_producer
from twellsparse.testing import ffn_problem, rel_error

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ts.bfloat16]


@pytest.fixture(autouse=True, params=_hopper_producer.SCHEDULES)
def hopper(cp, monkeypatch, request):
    """Every test under each schedule: pack warps of its own in clusters of two CTAs or alone,
    and the epilogue inline."""
    if str(cp.cuda.Device().compute_capability) != "90":
        pytest.skip("the fused producer needs a compute-capability 9.0 GPU")
    monkeypatch.setattr(_hopper_producer, "ENABLED", True)  # opt-in in the library
    monkeypatch.setattr(_hopper_producer, "SCHEDULE", request.param)


def _integer_problem(cp, rng, m, n, k, dtype, density):
    """x, w with small integer entries and a bias feature: z = x @ w.T is exact in fp32, and
    about ``density`` of z is positive (w's bias column shifts each unit by its own margin)."""
    x = rng.integers(-2, 3, size=(m, k)).astype(np.float64)
    w = rng.integers(-1, 2, size=(n, k)).astype(np.float64)
    x[:, 0] = 1.0
    w[:, 0] = 0.0
    z = x @ w.T
    cut = np.quantile(z, 1.0 - density, axis=0) if m > 1 else z[0]
    w[:, 0] = -np.floor(cut)  # an integer shift (rounded to dtype below, still an integer)
    x, w = x.astype(dtype), w.astype(dtype)
    z = x.astype(np.float64) @ w.astype(np.float64).T  # |partial sums| < 2**12: exact in fp32
    return cp.asarray(x), cp.asarray(w), cp.asarray(z.astype(dtype))


def _assert_parts_equal(cp, got, want):
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        np.testing.assert_array_equal(cp.asnumpy(a).view(np.uint8), cp.asnumpy(b).view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, n, k, tile_n, capacity, density, act, thr",
    [
        (300, 1000, 200, 256, 32, 0.02, "relu", None),  # partial row block, column tile and k block
        (128, 512, 64, 256, 32, 0.2, "relu", None),  # whole tiles; some row-tiles overflow
        (37, 301, 72, 32, 8, 0.3, "relu", None),  # 8 tiles per block, tiny capacity, spills
        (129, 700, 136, 64, 16, 0.25, "relu2", None),
        (200, 2300, 520, 128, 16, 0.1, "silu", 0.5),  # thresholded silu (SwiGLU checkpoints)
        # Thresholded relu (the packed compare against the threshold rounded down to the dtype):
        # on a value of z, just under one (rounded down to 2.984375 in bf16), and relu2's fp32 path.
        (300, 1000, 200, 256, 32, 0.05, "relu", 2.0),
        (129, 700, 136, 64, 16, 0.25, "relu", 2.9999999),
        (129, 700, 136, 64, 16, 0.25, "relu2", 4.5),
        (5, 260, 8, 256, 8, 0.5, "relu", None),  # K below one k block, one column past a tile
        # More output tiles (33 x 17) than SMs: every block packs several tiles, so the split
        # schedules' hand-off buffer is refilled (the math warps wait for the pack warps); 33 row
        # blocks: in clusters, the last one's second CTA computes rows past M only.
        (4100, 4200, 136, 256, 32, 0.03, "relu", None),
    ],
)
def test_fused_producer_equals_gemm_then_pack(cp, rng, dtype, m, n, k, tile_n, capacity, density, act, thr):
    x, w, z = _integer_problem(cp, rng, m, n, k, dtype, density)
    assert _hopper_producer.applies(x, w, act, thr, tile_n, capacity)
    for overflow in ("spill", "drop"):
        with warnings.catch_warnings():  # "drop" warns on both sides; the counts are compared
            warnings.simplefilter("ignore", ts.TwELLDroppedEntriesWarning)
            _, finish = _hopper_producer.linear_to_parts_deferred(x, w, act, tile_n, capacity, thr)
            got, dropped = finish(overflow)
            want, want_dropped = _gpu_convert.dense_to_parts(z, tile_n, capacity, overflow, thr, act)
        assert dropped == want_dropped
        _assert_parts_equal(cp, got, want)
    if density >= 0.2:
        assert int(want_dropped) > 0  # the case overflows, so the spill pass ran
    # The fixed spill (no read-back) lands on the same entries.
    _, finish = _hopper_producer.linear_to_parts_deferred(x, w, act, tile_n, capacity, thr)
    fixed, left_out = finish("spill", spill_capacity=m * n)
    exact, _ = _gpu_convert.dense_to_parts(z, tile_n, capacity, "spill", thr, act)
    assert int(left_out) == 0
    nnz_spill = int(exact.spill_indptr[-1])
    _assert_parts_equal(cp, fixed[:3], exact[:3])
    _assert_parts_equal(cp, (fixed.spill_data[:nnz_spill], fixed.spill_indices[:nnz_spill]), exact[3:5])


def test_overflow_error_policy_leaves_nothing_behind(cp, rng):
    x, w, _ = _integer_problem(cp, rng, 64, 256, 64, ts.bfloat16, 0.4)
    with pytest.raises(ts.TwELLCapacityError):
        ts.linear_to_twell(x, w, capacity=8, overflow="error")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_producer_against_float64(cp, rng, dtype):
    p = ffn_problem(1000, 512, 2000, 0.02, "skewed", dtype, rng, cp)
    x, w = p["x"], p["w_gate"]
    assert _hopper_producer.applies(x, w, "relu", None, 256, 32)
    h = ts.linear_to_twell(x, w)
    z = cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(w).astype(np.float64).T
    assert rel_error(h.toarray(), np.maximum(z, 0)) < 1e-2
    assert 0.005 < h.nnz / z.size < 0.05


def test_not_served_falls_back(cp, rng, monkeypatch):
    p = ffn_problem(100, 72, 300, 0.05, "uniform", ts.bfloat16, rng, cp)
    x, w = p["x"], p["w_gate"]
    assert not _hopper_producer.applies(x, w, "gelu", None, 256, 32)  # activation not served
    assert not _hopper_producer.applies(x, w, "relu", None, 512, 64)  # tile wider than a block
    assert not _hopper_producer.applies(x, w, "relu", None, 256, 12)  # capacity not a multiple of 8
    assert not _hopper_producer.applies(x[:, :68], w[:, :68], "relu", None, 256, 32)  # 16-byte rows
    assert not _hopper_producer.applies(x.astype(np.float32), w.astype(np.float32), "relu", None, 256, 32)

    # The unserved slice must take a fallback (the fused producer fails if called) and is checked
    # against float64: two calls on it (with and without ENABLED) would compare a path with itself.
    def fused(*args, **kw):
        raise AssertionError("the fused producer ran on a call it does not serve")

    monkeypatch.setattr(_hopper_producer, "linear_to_parts_deferred", fused)
    got = ts.linear_to_twell(x[:, :68], w[:, :68], capacity=4)
    z = cp.asnumpy(x[:, :68]).astype(np.float64) @ cp.asnumpy(w[:, :68]).astype(np.float64).T
    assert got.nnz > 0
    assert rel_error(got.toarray(), np.maximum(z, 0)) < 1e-2
    monkeypatch.setattr(_hopper_producer, "ENABLED", False)
    assert not _hopper_producer.applies(x, w, "relu", None, 256, 32)


@pytest.mark.parametrize("gated", [False, True])
def test_plans_with_the_fused_producer(cp, rng, monkeypatch, gated):
    p = ffn_problem(700, 256, 1300, 0.02, "skewed", ts.bfloat16, rng, cp)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]

    def plan(**kw):
        return ts.GatedFFN(wg, wu, wd, **kw) if gated else ts.FFN(wg, wd, **kw)

    monkeypatch.setattr(_hopper_producer, "ENABLED", False)
    before = plan(dispatch="sparse")(x)
    monkeypatch.setattr(_hopper_producer, "ENABLED", True)
    sparse, fixed = plan(dispatch="sparse"), plan(dispatch="sparse", spill_capacity=4096)
    auto = plan(dispatch="auto", breakeven=0.05)  # sparse at this density, whatever the default
    assert rel_error(sparse(x), before) < 2e-2
    for _ in range(3):  # the first auto call samples the dense pre-activations, later ones fuse
        assert rel_error(auto(x), before) < 2e-2
    assert auto.last_stats["path"] == "sparse"
    got = fixed(x)
    fixed.check_spill()
    assert rel_error(got, before) < 2e-2


def test_sparse_plans_choose_the_down_kernel_by_the_previous_density(cp, rng, monkeypatch):
    """dispatch="sparse" plans post each call's density too (from the pack's entry totals) and
    the next call hands it to the down projection's kernel choice once it has arrived: NaN on
    the first call, the first call's density on the second."""
    from twellsparse import _stationary

    p = ffn_problem(700, 256, 1300, 0.02, "uniform", ts.bfloat16, rng, cp)
    plan = ts.GatedFFN(p["w_gate"], p["w_up"], p["w_down"], dispatch="sparse")
    seen = []
    chosen = _stationary.chosen

    def recording(*args, **kw):
        seen.append(_stationary._expected_density.get())
        return chosen(*args, **kw)

    monkeypatch.setattr(_stationary, "chosen", recording)
    want = plan(p["x"])
    first = plan.last_stats
    assert np.isnan(first["sampled_density"]) and seen[-1] is None
    cp.cuda.Device().synchronize()
    got = plan(p["x"])
    assert first["density"] > 0 and plan.last_stats["sampled_density"] == pytest.approx(first["density"])
    assert seen[-1] == pytest.approx(first["density"])
    np.testing.assert_array_equal(cp.asnumpy(got).view(np.uint16), cp.asnumpy(want).view(np.uint16))


def test_fused_plan_captured_in_a_cuda_graph(cp, rng):
    p = ffn_problem(512, 128, 1024, 0.02, "uniform", ts.bfloat16, rng, cp)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    plan = ts.GatedFFN(wg, wu, wd, dispatch="sparse", spill_capacity=2048)
    want = plan(x)
    out = cp.empty_like(want)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        plan(x, out=out)  # warm-up on the capture stream
        stream.begin_capture()
        plan(x, out=out)
        graph = stream.end_capture()
        out.fill(np.nan)  # poison: an element the replay does not write fails the comparison
        graph.launch(stream)
    stream.synchronize()
    plan.check_spill()
    np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint16), cp.asnumpy(want).view(np.uint16))
