"""twellsparse.jax on the CPU (the reference path through buffer_callback): values under jit and
gradients against jax.numpy dense computations, the pytree, DLPack interop, vmap, overflow."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
tsj = pytest.importorskip("twellsparse.jax")

import twellsparse as ts  # noqa: E402
from twellsparse.testing import ffn_problem, sparse_activations  # noqa: E402

TOL = dict(rtol=2e-4, atol=2e-4)


def _pattern(rng, m=23, n=300, density=0.08, tile_n=64, capacity=3):
    h = sparse_activations(m, n, density, "skewed", np.float32, rng)
    return h, tsj.to_jax(ts.twell_array(h, tile_n=tile_n, capacity=capacity))


def test_pytree_and_dlpack_round_trip(rng):
    h, a = _pattern(rng)
    leaves, treedef = jax.tree_util.tree_flatten(a)
    assert len(leaves) == 6 and all(isinstance(leaf, jax.Array) for leaf in leaves)
    back = tsj.from_jax(jax.tree_util.tree_unflatten(treedef, leaves))
    np.testing.assert_array_equal(back.toarray(), h)
    assert back.n_spilled == ts.twell_array(h, tile_n=64, capacity=3).n_spilled > 0


def test_matmul_values_and_gradients(rng):
    h, a = _pattern(rng)
    b = jnp.asarray(rng.standard_normal((300, 17)).astype(np.float32))
    c = jnp.asarray(rng.standard_normal((23, 17)).astype(np.float32))
    out = jax.jit(tsj.matmul)(a, b)
    np.testing.assert_allclose(out, h @ np.asarray(b), **TOL)

    def loss(data, spill, bb):
        aa = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(a), [data, *a.parts[1:3], spill, *a.parts[4:]])
        return jnp.sum(tsj.matmul(aa, bb) * c)

    d_data, d_spill, d_b = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(a.parts.data, a.parts.spill_data, b)
    np.testing.assert_allclose(d_b, h.T @ np.asarray(c), **TOL)
    dense_dh = np.asarray(c) @ np.asarray(b).T  # d loss / d h, read at the stored entries
    got = tsj.from_jax(
        jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(a), [d_data, *a.parts[1:3], d_spill, *a.parts[4:]])
    )
    np.testing.assert_allclose(got.toarray(), np.where(h != 0, dense_dh, 0), **TOL)


def test_sddmm_values_and_gradients(rng):
    h, a = _pattern(rng)
    x = jnp.asarray(rng.standard_normal((23, 9)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((300, 9)).astype(np.float32))
    s = jax.jit(tsj.sddmm)(x, y, a)
    mask = h != 0
    np.testing.assert_allclose(tsj.from_jax(s).toarray(), np.where(mask, np.asarray(x) @ np.asarray(y).T, 0), **TOL)
    w = rng.standard_normal((23, 300)).astype(np.float32) * mask

    def loss(xx, yy):
        return jnp.sum(_dense_of(tsj.sddmm(xx, yy, a)) * w)

    def dense_loss(xx, yy):
        return jnp.sum((xx @ yy.T) * w)

    got = jax.grad(loss, argnums=(0, 1))(x, y)
    want = jax.grad(dense_loss, argnums=(0, 1))(x, y)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, **TOL)


def _dense_of(t):
    """Dense view of a TwELL pytree built from jnp ops (scatter of the stored values)."""
    m, n = t.shape
    p = t.parts
    rows = jnp.repeat(jnp.arange(m), p.data.shape[1] * p.data.shape[2])
    tiles = jnp.tile(jnp.repeat(jnp.arange(p.data.shape[1]), p.data.shape[2]), m)
    cols = tiles * t.tile_n + p.indices.reshape(-1).astype(jnp.int32)
    used = p.indices.reshape(-1) >= 0
    dense = (
        jnp.zeros((m, n), p.data.dtype).at[rows, jnp.where(used, cols, 0)].add(jnp.where(used, p.data.reshape(-1), 0))
    )
    n_spill = p.spill_indices.shape[0]
    spill_rows = jnp.searchsorted(p.spill_indptr[1:], jnp.arange(n_spill), side="right")
    return dense.at[spill_rows, p.spill_indices].add(p.spill_data)


def test_linear_to_twell_values_overflow_and_gradient(rng):
    x = jnp.asarray(rng.standard_normal((40, 16)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((200, 16)).astype(np.float32))
    z = np.asarray(x) @ np.asarray(w).T
    f = jax.jit(lambda xx, ww: tsj.linear_to_twell(xx, ww, tile_n=64, capacity=4, spill_capacity=4000))
    h = f(x, w)
    np.testing.assert_allclose(tsj.from_jax(h).toarray(), np.maximum(z, 0), **TOL)
    with pytest.raises(Exception, match="spill_capacity: expected at least"):
        jax.block_until_ready(tsj.linear_to_twell(x, w, tile_n=64, capacity=4, spill_capacity=1))
    c = rng.standard_normal((40, 200)).astype(np.float32)

    def loss(xx, ww):
        return jnp.sum(_dense_of(tsj.linear_to_twell(xx, ww, tile_n=64, capacity=4, spill_capacity=4000)) * c)

    def dense_loss(xx, ww):
        return jnp.sum(jax.nn.relu(xx @ ww.T) * c)

    for g, e in zip(jax.grad(loss, (0, 1))(x, w), jax.grad(dense_loss, (0, 1))(x, w), strict=True):
        np.testing.assert_allclose(g, e, **TOL)


@pytest.mark.parametrize("spill_capacity", [None, 4096])  # the CPU path is exact with either (4096 holds the spill)
@pytest.mark.parametrize("gated", [False, True])
def test_ffn_blocks_under_jit_with_gradients(rng, gated, spill_capacity):
    p = ffn_problem(48, 32, 256, 0.05, "skewed", np.float32, rng)
    x, wg, wu, wd = (jnp.asarray(p[k]) for k in ("x", "w_gate", "w_up", "w_down"))
    kw = dict(tile_n=64, capacity=2, spill_capacity=spill_capacity)  # forces spill
    if gated:
        sparse = jax.jit(lambda *a: tsj.gated_ffn(*a, **kw))
        args = (x, wg, wu, wd)

        def dense(xx, g, u, d):
            return (jax.nn.relu(xx @ g.T) * (xx @ u.T)) @ d.T
    else:
        sparse = jax.jit(lambda *a: tsj.ffn(*a, **kw))
        args = (x, wg, wd)

        def dense(xx, g, d):
            return jax.nn.relu(xx @ g.T) @ d.T

    np.testing.assert_allclose(sparse(*args), dense(*args), **TOL)
    c = jnp.asarray(rng.standard_normal((48, 32)).astype(np.float32))
    argnums = tuple(range(len(args)))
    got = jax.jit(jax.grad(lambda *a: jnp.sum(sparse(*a) * c), argnums))(*args)
    want = jax.grad(lambda *a: jnp.sum(dense(*a) * c), argnums)(*args)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-3)


def test_vmap_runs_per_element(rng):
    h, a = _pattern(rng)
    bs = jnp.asarray(rng.standard_normal((3, 300, 5)).astype(np.float32))
    out = jax.vmap(lambda b: tsj.matmul(a, b))(bs)
    np.testing.assert_allclose(out, np.einsum("mn,bnk->bmk", h, np.asarray(bs)), **TOL)


def test_bfloat16_and_dtype_mismatch(rng):
    h, a = _pattern(rng)
    a16 = jax.tree_util.tree_map(lambda leaf: leaf.astype(jnp.bfloat16) if leaf.dtype == jnp.float32 else leaf, a)
    b = jnp.asarray(rng.standard_normal((300, 8)), dtype=jnp.bfloat16)
    out = tsj.matmul(a16, b)
    assert out.dtype == jnp.bfloat16
    exact = h.astype(ts.bfloat16).astype(np.float64) @ np.asarray(b).astype(np.float64)
    assert np.linalg.norm(np.asarray(out, np.float64) - exact) / np.linalg.norm(exact) < 1e-2
    with pytest.raises(TypeError, match="b: expected dtype float32"):
        tsj.matmul(a, b)


def test_ffn_spill_capacity_is_validated(rng):
    p = ffn_problem(8, 16, 64, 0.1, "uniform", np.float32, rng)
    x, wg, wd = (jnp.asarray(p[k]) for k in ("x", "w_gate", "w_down"))
    with pytest.raises(ValueError, match=r"spill_capacity: expected None or a non-negative int below 2\*\*31, got -1"):
        tsj.ffn(x, wg, wd, spill_capacity=-1)
    tsj.check_spill()  # no jitted call with a fixed spill on a GPU: nothing to report


def test_transposed_and_vector_products_with_gradients(rng):
    h, a = _pattern(rng)
    g = jnp.asarray(rng.standard_normal((23, 5)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal(300).astype(np.float32))
    np.testing.assert_allclose(jax.jit(tsj.matmul)(a.T, g), h.T @ np.asarray(g), **TOL)
    np.testing.assert_allclose(tsj.matmul(a, v), h @ np.asarray(v), **TOL)
    np.testing.assert_allclose(a.T @ g, h.T @ np.asarray(g), **TOL)  # the operator takes the JAX op
    c = jnp.asarray(rng.standard_normal((300, 5)).astype(np.float32))

    def loss(data, spill, gg):
        aa = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(a), [data, *a.parts[1:3], spill, *a.parts[4:]])
        return jnp.sum(tsj.matmul(aa.T, gg) * c)

    d_data, d_spill, d_g = jax.grad(loss, argnums=(0, 1, 2))(a.parts.data, a.parts.spill_data, g)
    np.testing.assert_allclose(d_g, h @ np.asarray(c), **TOL)
    got = tsj.from_jax(
        jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(a), [d_data, *a.parts[1:3], d_spill, *a.parts[4:]])
    )
    dense_dh = np.asarray(g) @ np.asarray(c).T  # d loss / d h[i, j] = sum_k g[i, k] c[j, k]
    np.testing.assert_allclose(got.toarray(), np.where(h != 0, dense_dh, 0), **TOL)


def test_linear_to_twell_output_behaves_like_a_matrix(rng):
    """The padded spill (static length under jit) does not leak: nnz, n_spilled, toarray and the
    products agree with the NumPy producer's matrix."""
    x = rng.standard_normal((16, 8)).astype(np.float32)
    w = rng.standard_normal((100, 8)).astype(np.float32)
    h = tsj.linear_to_twell(jnp.asarray(x), jnp.asarray(w), tile_n=32, capacity=2, spill_capacity=5000)
    want = ts.linear_to_twell(x, w, tile_n=32, capacity=2)
    assert want.n_spilled > 0
    assert (h.nnz, h.n_spilled) == (want.nnz, want.n_spilled)
    np.testing.assert_array_equal(h.toarray(), want.toarray())
    b = rng.standard_normal((100, 3)).astype(np.float32)
    np.testing.assert_allclose(h @ jnp.asarray(b), want @ b, **TOL)
    assert "629 spilled" not in repr(h) or want.n_spilled == 629


def test_n_dropped_survives_the_pytree():
    with pytest.warns(ts.TwELLDroppedEntriesWarning):
        a = ts.twell_array(np.ones((3, 40), np.float32), tile_n=32, capacity=2, overflow="drop")
    j = tsj.to_jax(a)
    assert j.n_dropped == tsj.from_jax(j).n_dropped == jax.tree_util.tree_map(lambda v: v, j).n_dropped == a.n_dropped


def test_identity_activation_by_none_differentiates(rng):
    p = ffn_problem(12, 8, 64, 0.2, rng=rng)
    x, w_up, w_down = (jnp.asarray(p[k]) for k in ("x", "w_gate", "w_down"))
    grad_none = jax.grad(lambda xx: tsj.ffn(xx, w_up, w_down, activation=None, threshold=0.5, tile_n=32).sum())(x)
    grad_id = jax.grad(lambda xx: tsj.ffn(xx, w_up, w_down, activation="identity", threshold=0.5, tile_n=32).sum())(x)
    np.testing.assert_array_equal(grad_none, grad_id)


@pytest.mark.parametrize(
    ("call", "error", "name"),
    [
        (lambda x, w, wd: tsj.ffn(x[:, :7], w, wd, tile_n=32), ValueError, "w_up"),
        (lambda x, w, wd: tsj.ffn(x, w, wd[:, :5], tile_n=32), ValueError, "w_down"),
        (lambda x, w, wd: tsj.gated_ffn(x, w, w.astype(jnp.bfloat16), wd), TypeError, "w_up"),
        (lambda x, w, wd: tsj.linear_to_twell(x, w, activation="bogus"), ValueError, "activation"),
        (lambda x, w, wd: tsj.linear_to_twell(x, w, spill_capacity=True), TypeError, "spill_capacity"),
        (lambda x, w, wd: tsj.linear_to_twell(x, w[:, :3]), ValueError, "w"),
        (lambda x, w, wd: tsj.ffn(x, w, wd, threshold=-1.0), ValueError, "threshold"),
        (lambda x, w, wd: tsj.ffn(x.astype(jnp.int32), w, wd), TypeError, "x"),
    ],
)
def test_bad_arguments_fail_while_tracing(rng, call, error, name):
    """Every check runs at trace time (jax.eval_shape), with the library's one-line message."""
    p = ffn_problem(16, 8, 64, 0.2, rng=rng)
    args = tuple(jnp.asarray(p[k]) for k in ("x", "w_gate", "w_down"))
    with pytest.raises(error, match=rf"^{name}: expected") as info:
        jax.eval_shape(call, *args)
    assert "\n" not in str(info.value)


def test_traced_settings_ask_to_be_static(rng):
    p = ffn_problem(16, 8, 64, 0.2, rng=rng)
    args = tuple(jnp.asarray(p[k]) for k in ("x", "w_gate", "w_down"))
    with pytest.raises(TypeError, match="threshold: expected a static Python value"):
        jax.jit(lambda x, w, wd, t: tsj.ffn(x, w, wd, threshold=t))(*args, 0.5)


def test_fixed_spill_on_the_cpu_raises_at_once(rng):
    p = ffn_problem(40, 16, 200, 0.3, rng=rng)
    args = tuple(jnp.asarray(p[k]) for k in ("x", "w_gate", "w_down"))
    f = jax.jit(lambda *a: tsj.ffn(*a, tile_n=32, capacity=1, spill_capacity=0))
    with pytest.raises(Exception, match="spill_capacity: expected at most 0 spilled entries"):
        jax.block_until_ready(f(*args))


@pytest.mark.parametrize(("activation", "threshold"), [("relu2", None), ("silu", 0.05), ("gelu", 0.05)])
def test_other_activations_values_and_gradients(rng, activation, threshold):
    p = ffn_problem(40, 16, 128, 0.1, "uniform", np.float32, rng)
    x, wg, wu, wd = (jnp.asarray(p[k]) for k in ("x", "w_gate", "w_up", "w_down"))
    act = {
        "relu2": lambda z: jnp.square(jax.nn.relu(z)),
        "silu": jax.nn.silu,
        "gelu": lambda z: jax.nn.gelu(z, approximate=True),
    }[activation]

    def dense(xx, g, u, d):
        a = act(xx @ g.T)
        if threshold is not None:
            a = jnp.where(jnp.abs(a) > threshold, a, 0.0)
        return (a * (xx @ u.T)) @ d.T

    def sparse(xx, g, u, d):
        return tsj.gated_ffn(xx, g, u, d, activation=activation, threshold=threshold, tile_n=32, capacity=4)

    np.testing.assert_allclose(jax.jit(sparse)(x, wg, wu, wd), dense(x, wg, wu, wd), **TOL)
    c = jnp.asarray(rng.standard_normal((40, 16)).astype(np.float32))
    got = jax.grad(lambda *a: jnp.sum(sparse(*a) * c), (0, 1, 2, 3))(x, wg, wu, wd)
    want = jax.grad(lambda *a: jnp.sum(dense(*a) * c), (0, 1, 2, 3))(x, wg, wu, wd)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-3)


def test_leading_dimensions_are_tokens(rng):
    p = ffn_problem(24, 16, 128, 0.1, "uniform", np.float32, rng)
    x, wg, wu, wd = (jnp.asarray(p[k]) for k in ("x", "w_gate", "w_up", "w_down"))
    flat = tsj.gated_ffn(x, wg, wu, wd, tile_n=32)
    np.testing.assert_array_equal(tsj.gated_ffn(x.reshape(4, 6, 16), wg, wu, wd, tile_n=32), flat.reshape(4, 6, 16))
    np.testing.assert_array_equal(tsj.ffn(x[0], wg, wd, tile_n=32), tsj.ffn(x[:1], wg, wd, tile_n=32)[0])


def test_scalar_arithmetic_on_jax_matrices_under_jit(rng):
    h, a = _pattern(rng)
    scaled = jax.jit(lambda m: (m * 2.0) / 4.0)(a)
    np.testing.assert_allclose(tsj.from_jax(scaled).toarray(), h / 2, **TOL)
    np.testing.assert_allclose((-a).toarray(), -h, **TOL)


def test_gradients_through_a_matrix_with_dropped_entries(rng):
    h = sparse_activations(23, 300, 0.2, "skewed", np.float32, rng)
    with pytest.warns(ts.TwELLDroppedEntriesWarning):
        a = tsj.to_jax(ts.twell_array(h, tile_n=64, capacity=2, overflow="drop"))
    assert a.n_dropped > 0
    b = jnp.asarray(rng.standard_normal((300, 4)).astype(np.float32))
    d_b = jax.grad(lambda bb: jnp.sum(tsj.matmul(a, bb)))(b)
    np.testing.assert_allclose(d_b, np.broadcast_to(a.toarray().sum(axis=0)[:, None], (300, 4)), **TOL)


@pytest.mark.parametrize("gated", [False, True])
def test_ffn_backward_computes_only_the_wanted_gradients(rng, monkeypatch, gated):
    """Differentiating in the weights only (x is data, as in a first layer) or with a frozen
    weight skips those gradients' products, as torch's needs_input_grad does; the wanted
    gradients stay exact."""
    from twellsparse import _ffn_autodiff

    asked = []
    backward = _ffn_autodiff.backward_arrays

    def spy(*args, needs=_ffn_autodiff.ALL_GRADS):
        asked.append(needs)
        grads = backward(*args, needs=needs)
        assert [g is not None for g in grads] == list(needs)  # computed exactly when wanted
        return grads

    monkeypatch.setattr(tsj, "backward_arrays", spy)
    p = ffn_problem(40, 32, 200, 0.05, "uniform", np.float32, rng)
    x, wg, wu, wd = (jnp.asarray(p[k]) for k in ("x", "w_gate", "w_up", "w_down"))
    c = jnp.asarray(rng.standard_normal((40, 32)).astype(np.float32))
    kw = dict(tile_n=64, capacity=3)
    ws = (wg, wu, wd) if gated else (wg, wd)
    block = (lambda xx, *w: tsj.gated_ffn(xx, *w, **kw)) if gated else (lambda xx, *w: tsj.ffn(xx, *w, **kw))

    def dense(xx, *w):
        h = jax.nn.relu(xx @ w[0].T)
        return ((h * (xx @ w[1].T)) if gated else h) @ w[-1].T

    def loss(fn, frozen_gate):
        def f(ws_):
            w = ((jax.lax.stop_gradient(ws_[0]),) if frozen_gate else (ws_[0],)) + tuple(ws_[1:])
            return jnp.sum(fn(x, *w) * c)

        return f

    for frozen_gate in (False, True):
        asked.clear()
        got = jax.jit(jax.grad(loss(block, frozen_gate)))(ws)
        want = jax.grad(loss(dense, frozen_gate))(ws)
        for g, e in zip(got, want, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-3)
        lin = gated  # w_lin exists only in the gated block
        assert asked == [(False, not frozen_gate, lin, True)]
    asked.clear()
    jax.grad(lambda xx: jnp.sum(block(xx, *ws) * c))(x)  # x alone: no weight products
    assert asked == [(True, False, False, False)]


def test_traced_matrices_say_what_they_cannot_do(rng):
    """Inside jax.jit a matrix's values are tracers: what needs them (nnz, sum, toarray) raises a
    TypeError that says so and names the ops that work there, which still do (@)."""
    x = rng.standard_normal((4, 64)).astype(np.float32)
    x[np.abs(x) < 1.0] = 0.0
    h = tsj.to_jax(ts.twell_array(x))
    for name, fn in (
        ("nnz", lambda h: h.nnz),
        ("twell_array", lambda h: h.sum()),
        ("twell_array", lambda h: h.toarray()),
    ):
        with pytest.raises(TypeError, match=rf"^{name}: needs the matrix's values, but it holds traced JAX arrays"):
            jax.jit(fn)(h)
    with pytest.raises(TypeError, match=r"^@ of two TwELL matrices \(a sparse product\): needs the matrix's values"):
        jax.jit(lambda h: h @ h.T)(h)
    assert h.nnz == np.count_nonzero(x)  # outside jit: concrete
    w = np.ones((64, 3), np.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda h: h @ w)(h)), x @ w, rtol=1e-5)
    seen = []

    def loss(data):  # an eager grad over the values: the structure stays concrete
        hh = ts.twell_array._from_parts(h.parts._replace(data=data), h.shape, h.tile_n)
        seen.append((hh.nnz, hh.n_spilled))
        return (hh @ w).sum()

    grad = jax.grad(loss)(h.data)
    assert seen == [(np.count_nonzero(x), 0)] and grad.shape == h.data.shape
