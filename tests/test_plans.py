"""FFN / GatedFFN plans on the CPU path: same results as the one-shot functions, validated once."""

from __future__ import annotations

import re

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _reference as ref
from twellsparse.testing import ffn_problem, rel_error


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_plans_match_reference(rng, dtype):
    p = ffn_problem(70, 48, 600, 0.03, "skewed", dtype, rng)
    gated = ts.GatedFFN(p["w_gate"], p["w_up"], p["w_down"], tile_n=64, capacity=2, dispatch="sparse")
    exact = ref.gated_ffn_dense(p["x"], p["w_gate"], p["w_up"], p["w_down"], "relu")
    tol = 1e-10 if dtype == np.float64 else 1e-5
    assert rel_error(gated(p["x"]), exact) < tol
    assert gated.last_stats["tokens"] == 70 and gated.last_stats["n_spilled"] > 0
    assert gated.last_stats["path"] == "sparse"
    plain = ts.FFN(p["w_gate"], p["w_down"], tile_n=64, dispatch="sparse")
    assert rel_error(plain(p["x"]), ref.ffn_dense(p["x"], p["w_gate"], p["w_down"], "relu")) < tol
    np.testing.assert_allclose(plain(p["x"]), ts.ffn(p["x"], p["w_gate"], p["w_down"], tile_n=64), rtol=1e-6)


def test_plan_refresh_after_in_place_update(rng):
    p = ffn_problem(20, 16, 128, 0.1, "uniform", np.float64, rng)
    plan = ts.FFN(p["w_gate"], p["w_down"], tile_n=32)
    p["w_down"] *= 2.0
    plan.refresh()
    assert rel_error(plan(p["x"]), ref.ffn_dense(p["x"], p["w_gate"], p["w_down"], "relu")) < 1e-10


def test_plan_validation(rng):
    p = ffn_problem(8, 16, 64, 0.1, "uniform", np.float32, rng)
    with pytest.raises(ValueError, match="w_down"):
        ts.FFN(p["w_gate"], p["w_down"].T)
    with pytest.raises(ValueError, match="w_up"):
        ts.GatedFFN(p["w_gate"], p["w_up"][:10], p["w_down"])
    plan = ts.FFN(p["w_gate"], p["w_down"])
    with pytest.raises(ValueError, match="x"):
        plan(np.ones((3, 15), np.float32))


@pytest.mark.parametrize("gated", [True, False])
def test_dispatch_paths_compute_the_same_function(rng, gated):
    p = ffn_problem(90, 32, 300, 0.05, "skewed", np.float32, rng)
    weights = (p["w_gate"], p["w_up"], p["w_down"]) if gated else (p["w_gate"], p["w_down"])
    cls = ts.GatedFFN if gated else ts.FFN
    outs = {}
    for dispatch in ("sparse", "dense"):
        plan = cls(*weights, tile_n=32, capacity=2, dispatch=dispatch)
        outs[dispatch] = plan(p["x"])
        assert plan.last_stats["path"] == dispatch
    np.testing.assert_allclose(outs["sparse"], outs["dense"], rtol=1e-5, atol=1e-6)
    # auto: above the break-even the dense remainder runs, below it the sparse kernels
    above = cls(*weights, tile_n=32, dispatch="auto", breakeven=0.01)
    above(p["x"])
    assert above.last_stats["path"] == "dense" and above.last_stats["dense_fallback"]
    assert 0.02 < above.last_stats["sampled_density"] < 0.1
    below = cls(*weights, tile_n=32, dispatch="auto", breakeven=0.5)
    below(p["x"])
    assert below.last_stats["path"] == "sparse" and not below.last_stats["dense_fallback"]


def test_dispatch_validation(rng):
    p = ffn_problem(8, 16, 64, 0.1, "uniform", np.float32, rng)
    with pytest.raises(ValueError, match="dispatch"):
        ts.FFN(p["w_gate"], p["w_down"], dispatch="fast")


def test_fixed_spill_capacity_on_the_cpu_is_exact_and_kept(rng):
    """On the CPU (an exact path) a fixed spill_capacity is a promise checked at once: a call
    whose spill fits is exact; one that needs more raises, returning nothing (as the torch
    adapter's exact path does), so CPU runs raise where a GPU run would."""
    p = ffn_problem(70, 48, 600, 0.03, "skewed", np.float64, rng)
    weights = (p["w_gate"], p["w_up"], p["w_down"])
    exact = ref.gated_ffn_dense(p["x"], *weights, "relu")
    roomy = ts.GatedFFN(*weights, tile_n=64, capacity=2, dispatch="sparse", spill_capacity=10_000)
    for _ in range(2):
        assert rel_error(roomy(p["x"]), exact) < 1e-10
        roomy.check_spill()
    needed = roomy.last_stats["n_spilled"]
    assert needed > 3
    tight = ts.GatedFFN(*weights, tile_n=64, capacity=2, dispatch="sparse", spill_capacity=3)
    with pytest.raises(ts.TwELLSpillCapacityError, match=f"this call had {needed} .no output was returned") as info:
        tight(p["x"])
    assert (info.value.n_left_out, info.value.spill_capacity) == (needed - 3, 3)


@pytest.mark.parametrize(
    ("bad", "error"), [(-1, ValueError), (2**31, ValueError), (2.5, TypeError), (True, TypeError), ("8", TypeError)]
)
def test_spill_capacity_validation(rng, bad, error):
    p = ffn_problem(8, 16, 64, 0.1, "uniform", np.float32, rng)
    shown = repr(bad) if error is ValueError or isinstance(bad, bool) else type(bad).__name__
    with pytest.raises(
        error, match=rf"spill_capacity: expected None or a non-negative int below 2\*\*31, got {re.escape(shown)}$"
    ):
        ts.FFN(p["w_gate"], p["w_down"], spill_capacity=bad)
    assert ts.FFN(p["w_gate"], p["w_down"], spill_capacity=np.int64(5)).spill_capacity == 5  # NumPy ints too


@pytest.mark.parametrize("gated", [True, False])
def test_plan_writes_into_out(rng, gated):
    p = ffn_problem(30, 16, 128, 0.1, "skewed", np.float32, rng)
    weights = (p["w_gate"], p["w_up"], p["w_down"]) if gated else (p["w_gate"], p["w_down"])
    plan = (ts.GatedFFN if gated else ts.FFN)(*weights, tile_n=32, capacity=2, dispatch="sparse")
    want = plan(p["x"])
    out = np.full((30, 16), np.nan, dtype=np.float32)
    assert plan(p["x"], out=out) is out
    np.testing.assert_array_equal(out, want)
    wide = np.full((30, 32), np.nan, dtype=np.float32)
    plan(p["x"], out=wide[:, ::2])  # a strided out gets the result too
    np.testing.assert_array_equal(wide[:, ::2], want)
    assert np.isnan(wide[:, 1::2]).all()


def test_plan_out_validation(rng):
    p = ffn_problem(10, 16, 64, 0.1, "uniform", np.float32, rng)
    plan = ts.FFN(p["w_gate"], p["w_down"], tile_n=32)
    keep = p["x"].copy()
    for bad, match in (
        (np.zeros((10, 15), np.float32), r"out: expected shape \(10, 16\) and dtype float32, got \(10, 15\)"),
        (np.zeros((10, 16), np.float64), "out: expected shape .* got .* float64"),
        (p["x"], "out: expected an array apart from x"),
        ([[0.0] * 16] * 10, "out: expected a numpy.ndarray like x, got list"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            plan(p["x"], out=bad)
    np.testing.assert_array_equal(p["x"], keep)


def test_stationary_breakeven_falls_with_rows_and_columns():
    from twellsparse import _stationary

    assert _stationary.breakeven_entries(16384, 2048) == pytest.approx(_stationary.BREAKEVEN_ENTRIES)
    assert _stationary.breakeven_entries(4096, 2048) == pytest.approx(2 * _stationary.BREAKEVEN_ENTRIES)
    assert _stationary.breakeven_entries(65536, 2048) == pytest.approx(_stationary.BREAKEVEN_ENTRIES / 2)
    assert _stationary.breakeven_entries(16384, 4096) == pytest.approx(_stationary.BREAKEVEN_ENTRIES / 2)
    assert _stationary.breakeven_entries(0, 0) > 0  # empty shapes: no division by zero


def test_stationary_bands_cut_a_tall_b_into_whole_row_tiles():
    from twellsparse import _stationary

    hopper = 227 * 1024  # the H100's and H200's opt-in shared memory per block
    assert _stationary.band_tiles(5632, 256, hopper) == 22  # the standard widths: one band, all tiles
    assert _stationary.band_tiles(5632, None, hopper) == 1  # fits whole: no tile width needed
    assert _stationary.band_tiles(14336, 256, hopper) == 28  # (7264 - 4) // 256: two bands
    assert _stationary.band_tiles(14336, None, hopper) is None  # tall, and bands not allowed
    assert _stationary.band_tiles(9000, 128, hopper) == 56  # 71 tiles: 56 + 15
    assert _stationary.band_tiles(60000, 256, hopper) is None  # 9 bands: over MAX_BANDS
    assert _stationary.band_tiles(14336, 256, 64) is None  # not one tile fits
    assert _stationary.band_columns(14336, 256, 28, 56) == (7168, 14336)
    assert _stationary.band_columns(9000, 128, 56, 112) == (7168, 9000)  # the last band's partial tile


def test_auto_takes_column_bands_only_where_b_outgrows_the_l2(monkeypatch):
    """Bands were measured where the gathers read b from device memory (d_ff 14336); a b that
    needs bands but fits the L2 keeps the gathers under "auto", and TWELL_STATIONARY=1 forces
    the bands anyway."""
    from twellsparse import _stationary

    monkeypatch.setattr(_stationary, "_max_slice_bytes", lambda: 227 * 1024)
    monkeypatch.setattr(_stationary.K, "l2_bytes", lambda: 50 << 20)
    monkeypatch.setattr(_stationary, "product_operands_aligned", lambda *operands: True)  # host arrays here
    monkeypatch.setattr(_stationary, "PREFERRED", None)
    wide = np.zeros((14336, 4096), dtype=ts.bfloat16)  # W_down.T of d_ff 14336: 117 MB
    tall = np.zeros((8192, 2048), dtype=ts.bfloat16)  # d_ff 8192 at d_model 2048: 34 MB, fits the L2
    standard = np.zeros((5632, 2048), dtype=ts.bfloat16)  # one band
    out4096, out2048 = (np.zeros((16384, k), dtype=ts.bfloat16) for k in (4096, 2048))
    assert _stationary.chosen(16384, 14336, wide, out4096, tile_n=256)
    assert not _stationary.chosen(16384, 14336, wide, out4096)  # no tile width: no bands
    assert not _stationary.chosen(16384, 8192, tall, out2048, tile_n=256)
    assert _stationary.chosen(16384, 5632, standard, out2048, tile_n=256)
    monkeypatch.setattr(_stationary, "PREFERRED", True)
    assert _stationary.chosen(16384, 8192, tall, out2048, tile_n=256)


def test_column_bands_need_more_entries_per_row_than_one_band(monkeypatch):
    """At 4096 rows of d_ff 14336 the gathers beat the bands at 0.25% density and lost at 0.5%
    (H100): "auto" takes the bands from BANDED_BREAKEVEN_FACTOR times the one-band break-even,
    and at 16384 rows from 0.25% as measured."""
    from twellsparse import _stationary

    monkeypatch.setattr(_stationary, "_max_slice_bytes", lambda: 227 * 1024)
    monkeypatch.setattr(_stationary.K, "l2_bytes", lambda: 50 << 20)
    monkeypatch.setattr(_stationary, "product_operands_aligned", lambda *operands: True)
    monkeypatch.setattr(_stationary, "PREFERRED", None)
    wide = np.zeros((14336, 4096), dtype=ts.bfloat16)
    out = np.zeros((4096, 4096), dtype=ts.bfloat16)
    taken = {}
    for m in (4096, 16384):
        for density in (0.0025, 0.005):
            with _stationary.expected_density(density):
                taken[m, density] = _stationary.chosen(m, 14336, wide, out, tile_n=256)
    assert taken == {(4096, 0.0025): False, (4096, 0.005): True, (16384, 0.0025): True, (16384, 0.005): True}


def test_the_dual_stationary_form_follows_the_single_forms_rule(monkeypatch):
    from twellsparse import _stationary

    b = np.zeros((5632, 2048), dtype=np.float16)
    monkeypatch.setattr(_stationary, "PREFERRED", None)
    assert not _stationary.chosen(4096, 5632, b, b, b2=b)  # fewer rows than MIN_ROWS, no density
    with _stationary.expected_density(1e-5):  # far below the break-even
        assert not _stationary.chosen(65536, 5632, b, b, b2=b)
    monkeypatch.setattr(_stationary, "PREFERRED", False)
    assert not _stationary.chosen(65536, 5632, b, b, b2=b)


def test_stationary_applies_refuses_b_without_columns():
    """b with no columns (a zero-width view of a wider array passes the row alignment): no slice
    to spread over the machine, so the stationary kernel declines and the portable path serves."""
    from twellsparse import _stationary

    wide = np.zeros((64, 16), dtype=ts.bfloat16)
    b, out = wide[:, :0], np.zeros((4096, 16), dtype=ts.bfloat16)[:, :0]
    assert not _stationary.applies(64, b, out)


def test_default_breakeven_follows_the_measured_crossings():
    from twellsparse import _dispatch

    standard = _dispatch.CROSSINGS[(2048, 5632)]
    for kind in ("ffn", "gated_ffn"):
        for tokens, density in standard[kind]:  # at the measured points, the measured value
            assert _dispatch.dense_breakeven(kind, tokens, 2048, 5632) == pytest.approx(density)
        (t0, d0), (t1, d1) = standard[kind][2:4]  # 4096 and 16384 tokens: 8192 halfway in log2
        middle = _dispatch.dense_breakeven(kind, int((t0 * t1) ** 0.5), 2048, 5632)
        assert middle == pytest.approx((d0 + d1) / 2)  # linear in log2 of the tokens
        assert _dispatch.dense_breakeven(kind, 1, 2048, 5632) == pytest.approx(standard[kind][0][1])  # held at the ends
        assert _dispatch.dense_breakeven(kind, 10**7, 2048, 5632) == pytest.approx(standard[kind][-1][1])
    # Other widths take the nearest measured family (log scale); degenerate shapes still answer.
    wide = dict(_dispatch.CROSSINGS[(4096, 14336)]["gated_ffn"])[4096]
    assert _dispatch.dense_breakeven("gated_ffn", 4096, 5120, 13824) == pytest.approx(wide)
    assert _dispatch.dense_breakeven("ffn", 0, 0, 0) == 0  # degenerate shapes still answer
    for kind in ("ffn", "gated_ffn"):  # where the sparse path never won, every call runs dense
        assert _dispatch.dense_breakeven(kind, 256, 2048, 5632) == 0
        assert _dispatch.dense_breakeven(kind, 1024, 4096, 14336) == 0
        assert 0 < _dispatch.dense_breakeven(kind, 2048, 2048, 5632) < _dispatch.dense_breakeven(kind, 4096, 2048, 5632)


def test_plans_take_the_shape_breakeven_and_sample_less_when_clear(rng, monkeypatch):
    from twellsparse import _dispatch, _plans

    p = ffn_problem(4096, 16, 96, 0.2, "uniform", np.float32, rng)  # a break-even above 0 at 4096 tokens
    plan = ts.FFN(p["w_gate"], p["w_down"], tile_n=32, dispatch="auto")
    assert plan.breakeven is None
    assert plan.breakeven_for(4096) == pytest.approx(_dispatch.dense_breakeven("ffn", 4096, 16, 96))
    assert ts.FFN(p["w_gate"], p["w_down"], breakeven=0.3).breakeven_for(4096) == 0.3
    samples = []
    real = _plans._FFNPlanBase._kept_fraction
    monkeypatch.setattr(_plans._FFNPlanBase, "_kept_fraction", lambda self, z: samples.append(1) or real(self, z))
    for _ in range(2 * _plans.RESAMPLE_EVERY + 1):
        plan(p["x"])
        assert plan.last_stats["path"] == "dense"  # 20% against a break-even near 1%
    # The first call samples (and waits for it); later ones every RESAMPLE_EVERY.
    assert len(samples) == 1 + 2
    near = ts.FFN(p["w_gate"], p["w_down"], tile_n=32, dispatch="auto", breakeven=0.19)
    samples.clear()
    for _ in range(5):
        near(p["x"])
    assert len(samples) == 5  # near the break-even: every call


def test_a_zero_breakeven_runs_dense_without_sampling_or_transposing(rng, monkeypatch):
    """Under a zero break-even (calls of 1024 tokens or fewer by default) ``auto`` runs dense
    whatever the density, with no sample (so no host wait). A plan makes w_down.T when built (a
    capture never records it); a one-shot call's plan only when it runs sparse."""
    from twellsparse import _dispatch, _plans

    p = ffn_problem(64, 16, 96, 0.02, "uniform", np.float32, rng)
    assert _dispatch.dense_breakeven("gated_ffn", 64, 16, 96) == 0.0
    samples, made = [], []
    real = _plans._FFNPlanBase._kept_fraction
    monkeypatch.setattr(_plans._FFNPlanBase, "_kept_fraction", lambda self, z: samples.append(1) or real(self, z))
    for make in (ts.FFN, ts.GatedFFN):
        weights = (p["w_gate"], p["w_down"]) if make is ts.FFN else (p["w_gate"], p["w_up"], p["w_down"])
        plan = make(*weights, tile_n=32, dispatch="auto")
        np.testing.assert_array_equal(plan._down_rows_made, p["w_down"].T)
        for given in (None, 0.0):
            plan.breakeven = given
            plan(p["x"])
            assert plan.last_stats["path"] == "dense" and np.isnan(plan.last_stats["sampled_density"])
        assert samples == []
    real_property = _plans._FFNPlanBase._down_rows
    monkeypatch.setattr(
        _plans._FFNPlanBase, "_down_rows", property(lambda self: made.append(1) or real_property.fget(self))
    )
    got = ts.ffn(p["x"], p["w_gate"], p["w_down"], tile_n=32)  # 64 tokens: dense, nothing transposed
    np.testing.assert_allclose(got, ref.ffn_dense(p["x"], p["w_gate"], p["w_down"], "relu"), rtol=1e-5, atol=1e-6)
    ts.gated_ffn(p["x"], p["w_gate"], p["w_up"], p["w_down"], tile_n=32)
    assert made == [] and samples == []
    got = ts.ffn(p["x"], p["w_gate"], p["w_down"], tile_n=32, dispatch="sparse")  # sparse: made on first use
    assert made and samples == []
    np.testing.assert_allclose(got, ref.ffn_dense(p["x"], p["w_gate"], p["w_down"], "relu"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [True, False])
def test_e4m3_down_rows_are_the_reference_on_the_decoded_weights(rng, gated):
    p = ffn_problem(50, 32, 300, 0.05, "skewed", np.float32, rng)
    decoded = ts.quantize_rows(np.ascontiguousarray(p["w_down"].T)).dequantize(np.float64).T
    assert 0 < rel_error(decoded, p["w_down"]) < 2.0**-4  # lossy, within e4m3's step
    if gated:
        weights, exact = (p["w_gate"], p["w_up"]), ref.gated_ffn_dense(p["x"], p["w_gate"], p["w_up"], decoded, "relu")
    else:
        weights, exact = (p["w_gate"],), ref.ffn_dense(p["x"], p["w_gate"], decoded, "relu")
    cls = ts.GatedFFN if gated else ts.FFN
    for dispatch in ("sparse", "dense"):  # both paths multiply by the quantized weights
        plan = cls(*weights, p["w_down"], tile_n=32, capacity=2, dispatch=dispatch, down_format="e4m3")
        got = plan(p["x"])
        assert got.dtype == np.float32 and plan.last_stats["path"] == dispatch
        assert rel_error(got, exact) < 1e-5, dispatch
    plan = cls(*weights, p["w_down"], tile_n=32, dispatch="sparse", down_format="e4m3")
    p["w_down"] *= 2.0  # refresh quantizes the updated weights again
    plan.refresh()
    assert rel_error(plan(p["x"]), 2.0 * exact) < 1e-5


def test_down_format_validation(rng):
    p = ffn_problem(8, 16, 64, 0.1, "uniform", np.float32, rng)
    with pytest.raises(ValueError, match="down_format: expected None or one of 'e4m3', got 'e5m2'"):
        ts.FFN(p["w_gate"], p["w_down"], down_format="e5m2")
    with pytest.raises(ValueError, match="expected finite values"):
        ts.GatedFFN(p["w_gate"], p["w_up"], np.full_like(p["w_down"], np.inf), down_format="e4m3")


def test_e4m3_up_rows_are_the_reference_on_the_decoded_weights(rng):
    p = ffn_problem(50, 32, 300, 0.05, "skewed", np.float32, rng)
    up = ts.quantize_rows(p["w_up"]).dequantize(np.float64)
    down = ts.quantize_rows(np.ascontiguousarray(p["w_down"].T)).dequantize(np.float64).T
    for down_format, w_down in ((None, p["w_down"]), ("e4m3", down)):
        exact = ref.gated_ffn_dense(p["x"], p["w_gate"], up, w_down, "relu")
        for dispatch in ("sparse", "dense"):
            plan = ts.GatedFFN(
                p["w_gate"], p["w_up"], p["w_down"], dispatch=dispatch, up_format="e4m3", down_format=down_format
            )
            assert rel_error(plan(p["x"]), exact) < 1e-5, (down_format, dispatch)
    with pytest.raises(ValueError, match="up_format: expected None or one of 'e4m3', got 'int8'"):
        ts.GatedFFN(p["w_gate"], p["w_up"], p["w_down"], up_format="int8")


def test_plans_whose_gathered_rows_are_all_fp8_dispatch_dense_later(rng):
    from twellsparse import _dispatch

    p = ffn_problem(8, 16, 96, 0.1, "uniform", np.float32, rng)
    weights = (p["w_gate"], p["w_up"], p["w_down"])
    factor = _dispatch.E4M3_CROSSING_FACTOR
    assert factor > 1
    plain = _dispatch.dense_breakeven("ffn", 16384, 16, 96)
    gated = _dispatch.dense_breakeven("gated_ffn", 16384, 16, 96)
    assert ts.FFN(p["w_gate"], p["w_down"], down_format="e4m3").breakeven_for(16384) == pytest.approx(factor * plain)
    both = ts.GatedFFN(*weights, down_format="e4m3", up_format="e4m3")
    assert both.breakeven_for(16384) == pytest.approx(factor * gated)
    # 2-byte up rows still gathered: the measured 2-byte crossing; a given break-even is kept.
    assert ts.GatedFFN(*weights, down_format="e4m3").breakeven_for(16384) == pytest.approx(gated)
    assert ts.GatedFFN(*weights, down_format="e4m3", up_format="e4m3", breakeven=0.02).breakeven_for(16384) == 0.02


@pytest.mark.parametrize("gated", [True, False])
def test_auto_runs_few_tokens_dense_and_many_sparse(rng, gated):
    """At the same low density the automatic dispatch runs a 256-token call dense (the sparse
    path never won at 1024 tokens or fewer) and an 8192-token call sparse; both give the
    reference's values."""
    for m, want in ((256, "dense"), (8192, "sparse")):
        p = ffn_problem(m, 16, 512, 0.003, "uniform", np.float64, rng)
        weights = (p["w_gate"], p["w_up"], p["w_down"]) if gated else (p["w_gate"], p["w_down"])
        plan = (ts.GatedFFN if gated else ts.FFN)(*weights, tile_n=64, dispatch="auto")
        for _ in range(2):  # the first call samples the density; the second decides on it too
            got = plan(p["x"])
            assert plan.last_stats["path"] == want, m
        if gated:
            exact = ref.gated_ffn_dense(p["x"], p["w_gate"], p["w_up"], p["w_down"], "relu")
        else:
            exact = ref.ffn_dense(p["x"], p["w_gate"], p["w_down"], "relu")
        assert rel_error(got, exact) < 1e-12
