"""twellsparse.jax on the GPU: the callbacks run the CUDA kernels on XLA's stream; values and
gradients under jit against jax.numpy dense computations."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
tsj = pytest.importorskip("twellsparse.jax")

import twellsparse as ts  # noqa: E402
from twellsparse import _reference as ref  # noqa: E402
from twellsparse.testing import ffn_problem, rel_error  # noqa: E402

pytestmark = pytest.mark.gpu


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")


@pytest.mark.parametrize("dtype", [np.float32, ts.bfloat16])
def test_gated_ffn_values_and_gradients_on_gpu(rng, dtype):
    dev = _gpu()
    p = ffn_problem(512, 256, 1000, 0.02, "skewed", dtype, rng)  # d_ff 1000: the last 256-column tile partial
    args = tuple(jax.device_put(jnp.asarray(p[k]), dev) for k in ("x", "w_gate", "w_up", "w_down"))
    sparse = jax.jit(lambda *a: tsj.gated_ffn(*a, capacity=8))

    def dense(x, g, u, d):
        # XLA's default float32 matmul on Hopper is TF32 (about 1e-3 relative): the reference
        # must run at full precision to hold the kernels' float32 results to 1e-4.
        f32 = [t.astype(jnp.float32) for t in (x, g, u, d)]
        with jax.default_matmul_precision("highest"):
            return (jax.nn.relu(f32[0] @ f32[1].T) * (f32[0] @ f32[2].T)) @ f32[3].T

    out = sparse(*args)
    assert out.devices() == {dev}
    bound = 1e-4 if dtype == np.float32 else 2e-2
    assert rel_error(np.asarray(out, np.float64), np.asarray(dense(*args), np.float64)) < bound
    exact = ref.gated_ffn_dense(p["x"], p["w_gate"], p["w_up"], p["w_down"], "relu")  # float64, on the host
    assert rel_error(np.asarray(out, np.float64), exact) < bound
    c = jax.device_put(jnp.asarray(rng.standard_normal((512, 256)).astype(np.float32)), dev)
    got = jax.jit(jax.grad(lambda *a: jnp.sum(sparse(*a).astype(jnp.float32) * c), (0, 1, 2, 3)))(*args)
    want = jax.grad(lambda *a: jnp.sum(dense(*a) * c), (0, 1, 2, 3))(*args)
    for g, e in zip(got, want, strict=True):
        assert rel_error(np.asarray(g, np.float64), np.asarray(e, np.float64)) < (1e-3 if dtype == np.float32 else 5e-2)


def test_matmul_and_linear_to_twell_on_gpu(rng):
    dev = _gpu()
    x = jax.device_put(jnp.asarray(rng.standard_normal((300, 64)).astype(np.float32)), dev)
    w = jax.device_put(jnp.asarray(rng.standard_normal((700, 64)).astype(np.float32)), dev)
    h = jax.jit(lambda a, b: tsj.linear_to_twell(a, b, capacity=16, spill_capacity=200_000))(x, w)
    dense_h = np.maximum(np.asarray(x) @ np.asarray(w).T, 0)
    np.testing.assert_allclose(tsj.from_jax(h).toarray().get(), dense_h, rtol=1e-5, atol=1e-4)
    b = jax.device_put(jnp.asarray(rng.standard_normal((700, 32)).astype(np.float32)), dev)
    np.testing.assert_allclose(jax.jit(tsj.matmul)(h, b), dense_h @ np.asarray(b), rtol=1e-4, atol=1e-3)


def test_gated_ffn_with_a_fixed_spill_reads_nothing_back_and_reports_overflow(rng):
    dev = _gpu()
    p = ffn_problem(300, 64, 1000, 0.05, "skewed", ts.bfloat16, rng)
    args = tuple(jax.device_put(jnp.asarray(p[k]), dev) for k in ("x", "w_gate", "w_up", "w_down"))
    kw = dict(tile_n=64, capacity=2)  # most entries spill
    exact = jax.jit(lambda *a: tsj.gated_ffn(*a, **kw))(*args)
    roomy = jax.jit(lambda *a: tsj.gated_ffn(*a, **kw, spill_capacity=300 * 1000))
    np.testing.assert_array_equal(np.asarray(roomy(*args)).view(np.uint16), np.asarray(exact).view(np.uint16))
    want = ref.gated_ffn_dense(p["x"], p["w_gate"], p["w_up"], p["w_down"], "relu")  # float64, on the host
    assert rel_error(np.asarray(exact, np.float64), want) < 2e-2  # bf16 rounding of u, h and out
    tsj.check_spill()  # nothing was left out
    tight = jax.jit(lambda *a: tsj.gated_ffn(*a, **kw, spill_capacity=10))
    jax.block_until_ready(tight(*args))  # leaves entries out; the next call says so
    with pytest.raises(Exception, match="spill_capacity"):
        jax.block_until_ready(tight(*args))
    jax.block_until_ready(tight(*args))
    with pytest.raises(ts.TwELLSpillCapacityError):
        tsj.check_spill()
    tsj.check_spill()  # reported once
    # A new w_gate buffer makes the call site build a new plan: the old plan's count still
    # reaches the next call.
    jax.block_until_ready(tight(*args))
    with pytest.raises(Exception, match="spill_capacity"):
        jax.block_until_ready(tight(args[0], args[1] + 0, *args[2:]))


@pytest.mark.parametrize("spill_capacity", [None, 300 * 1000])
def test_the_call_sites_plan_follows_new_weights_and_tokens(spill_capacity):
    """The callback reuses its plan while XLA hands it the same buffers: weights replaced between
    calls (freed first, so the allocator may hand their addresses out again) and new tokens must
    still give the dense result every time."""
    dev = _gpu()
    f = jax.jit(lambda *a: tsj.gated_ffn(*a, tile_n=64, capacity=4, spill_capacity=spill_capacity))
    args = None
    for seed in range(4):
        del args
        p = ffn_problem(300, 64, 1000, 0.05, "skewed", np.float32, np.random.default_rng(seed))
        args = tuple(jax.device_put(jnp.asarray(p[k]), dev) for k in ("x", "w_gate", "w_up", "w_down"))
        x, g, u, d = (np.asarray(a, np.float64) for a in args)
        want = (np.maximum(x @ g.T, 0) * (x @ u.T)) @ d.T
        for _ in range(2):
            assert rel_error(np.asarray(f(*args), np.float64), want) < 1e-4
    tsj.check_spill()
