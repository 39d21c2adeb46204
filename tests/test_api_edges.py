"""Edge cases of the public API: scalar arithmetic keeps the format's invariants, NumPy's
operators defer, the transposed view validates like the matrix, the FFN blocks' dtype does not
depend on the path, and warnings name the caller's line."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp

import twellsparse as ts
from twellsparse.testing import ffn_problem


@pytest.fixture
def a(rng):
    x = rng.standard_normal((9, 100))
    x[np.abs(x) < 1.2] = 0
    return ts.twell_array(x, tile_n=32, capacity=4)


@pytest.mark.parametrize("scalar", [np.inf, -np.inf, np.nan, 0.0])
@pytest.mark.parametrize("op", ["mul", "div"])
def test_scalar_ops_leave_unused_slots_zero(a, scalar, op):
    with np.errstate(divide="ignore", invalid="ignore"):
        b = a * scalar if op == "mul" else a / scalar
        expected = a.toarray() * scalar if op == "mul" else a.toarray() / scalar
    b.check_format(full_check=True)  # padding values are checked too
    used = np.arange(b.capacity) < b.counts[..., None]
    assert not b.data[~used].any()
    stored = a.toarray() != 0
    np.testing.assert_array_equal(b.toarray()[stored], expected[stored])


def test_division_promotes_like_multiplication():
    a = ts.twell_array(np.eye(3, dtype=np.float32), tile_n=32)
    assert (a / np.float64(2)).dtype == (a * np.float64(0.5)).dtype == np.float64
    assert (a / 2.0).dtype == np.float32  # a Python scalar keeps the dtype
    x = np.array([[1.0, 0.0, 7.0]])
    np.testing.assert_array_equal((ts.twell_array(x, tile_n=32) / 3.0).toarray(), x / 3.0)  # a true division


def test_numpy_operators_defer(a, rng):
    with pytest.raises(TypeError):
        a / np.full(a.shape, 2.0)
    with pytest.raises(TypeError):
        a.T / np.full(a.T.shape, 2.0)
    d = rng.standard_normal(a.shape)
    np.testing.assert_allclose((d * a).toarray(), d * a.toarray())  # __rmul__ still runs
    g = rng.standard_normal((4, a.shape[0]))
    np.testing.assert_allclose(g @ a, g @ a.toarray())


def test_scipy_operands_on_either_side(a):
    eye_n, eye_m = sp.eye_array(a.shape[1]), sp.eye_array(a.shape[0])
    np.testing.assert_array_equal((a @ eye_n).toarray(), a.toarray())
    np.testing.assert_array_equal((eye_m @ a).toarray(), a.toarray())
    np.testing.assert_array_equal((a.T @ eye_m).toarray(), a.toarray().T)
    np.testing.assert_array_equal((eye_n @ a.T).toarray(), a.toarray().T)


def test_transposed_view_validates_like_the_matrix(a):
    with pytest.raises(ValueError, match="axis"):
        a.T.sum(axis=2)
    with pytest.raises(ValueError, match="axes"):
        a.T.transpose(axes=(0, 1))
    with pytest.raises(ValueError, match="out"):
        a.T.toarray(out=np.zeros(a.T.shape, np.float32))
    with pytest.raises(ValueError, match="format"):
        a.T.asformat("xyz")
    with pytest.raises(ValueError, match="order"):
        a.toarray(order="X")
    assert a.T.asformat(None) is not None


def test_a_twell_array_from_a_transposed_view(a):
    t = ts.twell_array(a.T, tile_n=64, capacity=8)
    np.testing.assert_array_equal(t.toarray(), a.toarray().T)


def test_astype_keeps_the_dropped_count():
    with pytest.warns(ts.TwELLDroppedEntriesWarning):
        a = ts.twell_array(np.ones((1, 40)), tile_n=32, capacity=1, overflow="drop")
    assert a.n_dropped == 38 and a.astype(np.float32).n_dropped == 38


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(capacity=True), "capacity"),
        (dict(tile_n=np.bool_(True)), "tile_n"),
    ],
)
def test_bools_are_not_ints(kwargs, name):
    with pytest.raises(TypeError, match=name):
        ts.twell_array(np.eye(2), **kwargs)


def test_numpy_ints_are_ints():
    a = ts.twell_array(np.eye(2), tile_n=np.int64(64), capacity=np.int32(3))
    assert (a.tile_n, a.capacity) == (64, 3)
    assert a.toell(width=np.int64(2))[0].shape == (2, 2)


def test_bad_device_and_out_name_the_argument(a):
    with pytest.raises(ValueError, match="device"):
        a.to_device("gpu")
    with pytest.raises(TypeError, match="out"):
        ts.matmul(a, np.ones((a.shape[1], 2)), out=[[0, 0]])
    with pytest.raises(ValueError, match="other: expected 9 columns"):
        np.ones((2, 5)) @ a


@pytest.mark.parametrize("bad", [float("nan"), -0.1, 1.5, "a"])
def test_breakeven_validation(bad):
    p = ffn_problem(8, 16, 64, 0.1)
    with pytest.raises((TypeError, ValueError), match="breakeven"):
        ts.GatedFFN(p["w_gate"], p["w_up"], p["w_down"], breakeven=bad)


@pytest.mark.parametrize("gated", [True, False])
def test_ffn_dtype_is_the_same_on_every_path(gated):
    p = ffn_problem(40, 16, 300, 0.05, rng=1)
    w = dict(p)
    w["w_down"] = p["w_down"].astype(np.float64)  # mixed precision weights
    f = ts.gated_ffn if gated else ts.ffn
    args = (w["x"], w["w_gate"], w["w_up"], w["w_down"]) if gated else (w["x"], w["w_gate"], w["w_down"])
    dtypes = {f(*args, dispatch=d).dtype for d in ("sparse", "dense", "auto")}
    assert dtypes == {np.dtype(np.float64)}


def test_quantize_rows_rejects_values_beyond_float32():
    with pytest.raises(ValueError, match="float32's range"):
        ts.quantize_rows(np.array([[1e300, 1.0]]))


def test_ffn_problem_validation_and_saturated_rates():
    with pytest.raises(ValueError, match="d_model"):
        ffn_problem(4, 1, 16, 0.3)
    with pytest.raises(ValueError, match="density"):
        ffn_problem(4, 8, 16, -0.1)
    p = ffn_problem(4000, 8, 16, 1.0, rng=0)  # every unit fires: finite weights
    assert np.isfinite(p["w_gate"]).all()
    z = p["x"] @ p["w_gate"].T
    assert (z > 0).mean() > 0.999
    assert ts.testing.firing_rates(1000, 0.9, "skewed", 0).mean() == pytest.approx(ts.testing.MAX_SKEWED_DENSITY)


def test_rel_error_flags_non_finite_reference():
    assert ts.testing.rel_error(np.ones(2), np.array([np.nan, 1.0])) == float("inf")


def test_drop_warning_names_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts.twell_array(np.ones((1, 40)), tile_n=32, capacity=1, overflow="drop")
    (w,) = [c for c in caught if issubclass(c.category, ts.TwELLDroppedEntriesWarning)]
    assert w.filename == __file__


def test_gated_block_with_mixed_precisions_rounds_like_the_dense_path():
    """x, w_up and w_down in float16 with a float32 gate: both paths keep the float32 block's
    precision (the sparse one computed u and h in float16 before)."""
    p = ffn_problem(48, 16, 256, 0.1, rng=3)
    x, wu, wd = (p[k].astype(np.float16) for k in ("x", "w_up", "w_down"))
    wg = p["w_gate"].astype(np.float32)
    sparse = ts.gated_ffn(x, wg, wu, wd, dispatch="sparse", tile_n=32)
    dense = ts.gated_ffn(x, wg, wu, wd, dispatch="dense", tile_n=32)
    assert sparse.dtype == dense.dtype == np.float32
    np.testing.assert_allclose(sparse, dense, rtol=1e-5, atol=1e-6)


def test_an_empty_call_is_no_density_sample():
    p = ffn_problem(64, 16, 256, 0.9, rng=4)  # dense: auto runs the dense block
    plan = ts.GatedFFN(p["w_gate"], p["w_up"], p["w_down"], tile_n=32)
    plan(p["x"][:0])
    plan(p["x"])
    assert plan.last_stats["path"] == "dense"


def test_read_only_out_and_bool_breakeven_are_refused():
    p = ffn_problem(8, 16, 64, 0.1)
    plan = ts.FFN(p["w_gate"], p["w_down"])
    out = np.zeros((8, 16), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: expected a writeable array"):
        plan(p["x"], out=out)
    with pytest.raises(TypeError, match="breakeven"):
        ts.FFN(p["w_gate"], p["w_down"], breakeven=True)


def test_dlpack_producers_the_cpu_import_refused(rng):
    """Two DLPack producers NumPy's import refuses are still read: a torch tensor that autograd
    records (an nn.Linear's weight; these ops only read values) and a JAX bfloat16 array (copied
    through its array interface)."""
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    x = rng.standard_normal((5, 64)).astype(np.float32)
    x[np.abs(x) < 1.0] = 0.0
    w_up = torch.nn.Linear(64, 300, bias=False).weight
    w_down = torch.nn.Linear(300, 64, bias=False).weight
    assert w_up.requires_grad
    got = ts.ffn(x, w_up, w_down)
    want = np.maximum(x.astype(np.float64) @ w_up.detach().double().numpy().T, 0) @ w_down.detach().double().numpy().T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert w_up.requires_grad and w_up.grad is None  # the caller's tensor untouched
    jb = jnp.asarray(x, dtype=jnp.bfloat16)
    a = ts.twell_array(jb)
    assert a.dtype == ts.bfloat16 and a.nnz == np.count_nonzero(x)
    np.testing.assert_array_equal(a.toarray(), x.astype(ts.bfloat16))
