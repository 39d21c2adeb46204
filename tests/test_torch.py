"""PyTorch adapter on the CPU (reference path): values and gradients against dense torch autograd,
spill, activations, torch.compile without graph breaks, modules, conversion, L1 penalty."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

if os.environ.get("CI"):
    import torch  # CI installs torch: the adapter tests must run there, never skip
else:
    torch = pytest.importorskip("torch")

import twellsparse.torch as tt
from twellsparse import TwELLSpillCapacityError

ACTS = {
    "relu": torch.relu,
    "relu2": lambda z: torch.relu(z) ** 2,
    "silu": torch.nn.functional.silu,
    "gelu": lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
}


def _problem(seed, m=37, d=16, f=300, dtype=torch.float64, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) / np.sqrt(s[-1])).to(dtype)  # noqa: E731
    ts_ = [mk(m, d) * 4, mk(f, d), mk(f, d), mk(d, f)]
    return [t.requires_grad_(requires_grad) for t in ts_]


def _dense(x, wg, wu, wd, act, threshold=None, gated=True):
    z = x @ wg.T
    a = ACTS[act](z)
    if threshold is not None:
        a = torch.where(a.abs() > threshold, a, torch.zeros_like(a))
    h = a * (x @ wu.T) if gated else a
    return h @ wd.T


def _grads(out, inputs, seed):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("capacity", [4, None])  # 4 forces most row-tiles to spill at this density
def test_values_and_grads_match_dense_float64(gated, capacity):
    x, wg, wu, wd = _problem(1)
    if gated:
        out = tt.gated_ffn(x, wg, wu, wd, tile_n=32, capacity=capacity)
        inputs = (x, wg, wu, wd)
    else:
        out = tt.ffn(x, wg, wd, tile_n=32, capacity=capacity)
        inputs = (x, wg, wd)
    ref = _dense(x, wg, wu, wd, "relu", gated=gated)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(_grads(out, inputs, 2), _grads(ref, inputs, 2), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("act, threshold", [("relu2", None), ("silu", 0.05), ("gelu", 0.05), ("relu", 0.1)])
def test_activations_and_thresholds(act, threshold):
    x, wg, wu, wd = _problem(3)
    out = tt.gated_ffn(x, wg, wu, wd, activation=act, threshold=threshold, tile_n=64)
    ref = _dense(x, wg, wu, wd, act, threshold)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    # Dropped entries carry no gradient: the dense reference masks them the same way.
    for a, b in zip(_grads(out, (x, wg, wu, wd), 4), _grads(ref, (x, wg, wu, wd), 4), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_low_precision(dtype, tol):
    x, wg, wu, wd = _problem(5, dtype=dtype)
    out = tt.gated_ffn(x, wg, wu, wd, tile_n=32)
    assert out.dtype == dtype
    x64, wg64, wu64, wd64 = (t.detach().double().requires_grad_() for t in (x, wg, wu, wd))
    ref = _dense(x64, wg64, wu64, wd64, "relu")
    err = (out.double() - ref).norm() / ref.norm()
    assert err < tol
    grads = _grads(out, (x, wg, wu, wd), 6)
    rgrads = _grads(ref, (x64, wg64, wu64, wd64), 6)
    for a, b in zip(grads, rgrads, strict=True):
        assert a.dtype == dtype
        assert (a.double() - b).norm() / b.norm() < 4 * tol


def test_leading_dims_and_empty_batch():
    x, wg, wu, wd = _problem(7)
    x3 = x.detach().reshape(1, 37, 16)
    out = tt.gated_ffn(x3, wg, wu, wd, tile_n=32)
    assert out.shape == (1, 37, 16)
    empty = tt.gated_ffn(x.detach()[:0], wg, wu, wd, tile_n=32)
    assert empty.shape == (0, 16)


def test_torch_compile_fullgraph():
    x, wg, wu, wd = _problem(8)

    def block(x, wg, wu, wd):
        return tt.gated_ffn(x, wg, wu, wd, tile_n=32, capacity=4).sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    loss = compiled(x, wg, wu, wd)
    grads = torch.autograd.grad(loss, (x, wg, wu, wd))
    ref = _dense(x, wg, wu, wd, "relu").sum()
    rgrads = torch.autograd.grad(ref, (x, wg, wu, wd))
    torch.testing.assert_close(loss, ref)
    for a, b in zip(grads, rgrads, strict=True):
        torch.testing.assert_close(a, b)


def test_opcheck():
    x, wg, wu, wd = _problem(9)
    torch.library.opcheck(
        torch.ops.twellsparse.ffn_fwd.default,
        (x, wg, wu, wd, "relu", 32, 4, None),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_modules_state_dict_and_from_module():
    torch.manual_seed(0)

    class LlamaMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(16, 96, bias=False, dtype=torch.float64)
            self.up_proj = torch.nn.Linear(16, 96, bias=False, dtype=torch.float64)
            self.down_proj = torch.nn.Linear(96, 16, bias=False, dtype=torch.float64)

        def forward(self, x):
            return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))

    dense = LlamaMLP()
    sparse = tt.TwELLGatedMLP(16, 96, tile_n=32, dtype=torch.float64)
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    torch.testing.assert_close(sparse(x), dense(x))
    converted = tt.from_module(dense, tile_n=32)
    assert isinstance(converted, tt.TwELLGatedMLP)
    assert converted.gate_proj.weight is dense.gate_proj.weight  # shared, not copied
    torch.testing.assert_close(converted(x), dense(x))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = LlamaMLP()

    model = torch.nn.Sequential(Block(), Block())
    assert tt.swap_mlps(model, tile_n=32) == 2
    assert all(isinstance(b.mlp, tt.TwELLGatedMLP) for b in model)
    with pytest.raises(TypeError, match="mlp"):
        tt.from_module(torch.nn.Linear(3, 3))


def test_stats_and_l1_penalty():
    torch.manual_seed(1)
    mlp = tt.TwELLMLP(16, 128, tile_n=32, capacity=4, dtype=torch.float64)
    x = torch.randn(20, 16, dtype=torch.float64)
    mlp(x).sum()
    stats = mlp.stats()
    assert stats["n_spilled"] > 0 and 0 < stats["density"] < 1
    penalty = mlp.l1_penalty()
    dense_h = torch.relu(x @ mlp.up_proj.weight.T)
    torch.testing.assert_close(penalty, dense_h.abs().sum() / 20)
    (grad,) = torch.autograd.grad(penalty, mlp.up_proj.weight)
    (ref,) = torch.autograd.grad(dense_h.abs().sum() / 20, mlp.up_proj.weight)
    torch.testing.assert_close(grad, ref)


def test_backward_gets_no_activation_gradient_unless_one_reached_them(monkeypatch):
    """Outputs nobody differentiated reach the backward as None, not as zeros (the GPU backward
    then takes its fused pass); a gradient reaching only the activations' slot values (not
    their spill) still gives the dense gradient."""
    seen = []
    original = tt.backward_arrays

    def spy(grad_out, grad_act, *args):
        seen.append(grad_act)
        return original(grad_out, grad_act, *args)

    monkeypatch.setattr(tt, "backward_arrays", spy)
    x, wg, wu, wd = _problem(11)
    _grads(tt.gated_ffn(x, wg, wu, wd, capacity=4), [x, wg, wu, wd], 0)
    assert seen == [None]
    # Only the slots' values in the loss (no spill: capacity holds every row-tile's entries).
    hidden = tt._run(x, wg, wu, wd, "relu", 256, 256, None)[1]
    assert hidden[3].numel() == 0
    got = torch.autograd.grad(hidden[0].sum(), [x, wg])
    ref = torch.autograd.grad(torch.relu(x @ wg.T).sum(), [x, wg])
    assert seen[-1] is not None
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_bad_inputs():
    x, wg, wu, wd = _problem(10, requires_grad=False)
    with pytest.raises(TypeError, match="w_up"):
        tt.gated_ffn(x, wg, wu.float(), wd)
    with pytest.raises(ValueError, match="activation"):
        tt.ffn(x, wg, wd, activation="tanh")
    with pytest.raises(ValueError, match="tile_n"):
        tt.ffn(x, wg, wd, tile_n=48)


def test_from_module_non_gated_and_bias_rejected():
    torch.manual_seed(2)

    class Mlp(torch.nn.Module):
        def __init__(self, bias=False):
            super().__init__()
            self.up_proj = torch.nn.Linear(16, 64, bias=bias, dtype=torch.float64)
            self.down_proj = torch.nn.Linear(64, 16, bias=False, dtype=torch.float64)

        def forward(self, x):
            return self.down_proj(torch.relu(self.up_proj(x)))

    dense = Mlp()
    sparse = tt.from_module(dense, tile_n=32)
    assert isinstance(sparse, tt.TwELLMLP)
    x = torch.randn(7, 16, dtype=torch.float64)
    torch.testing.assert_close(sparse(x), dense(x))
    with pytest.raises(ValueError, match="bias"):
        tt.from_module(Mlp(bias=True))


@pytest.mark.parametrize("activation, threshold", [("relu", None), ("silu", 0.05)])
def test_dense_dispatch_matches_sparse(activation, threshold):
    """dispatch="dense" computes the same block with torch (values, gradients, L1 penalty) and
    says so in stats()."""
    torch.manual_seed(3)
    kwargs = dict(tile_n=32, capacity=4, activation=activation, threshold=threshold, dtype=torch.float64)
    sparse = tt.TwELLGatedMLP(16, 96, **kwargs)
    dense = tt.TwELLGatedMLP(16, 96, dispatch="dense", **kwargs)
    dense.load_state_dict(sparse.state_dict())
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    outs, grads = [], []
    for mlp in (sparse, dense):
        out = mlp(x)
        loss = out.square().sum() + mlp.l1_penalty()
        grads.append(torch.autograd.grad(loss, list(mlp.parameters())))
        outs.append((out, mlp.l1_penalty(), mlp.stats()))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])
    for g_sparse, g_dense in zip(*grads, strict=True):
        torch.testing.assert_close(g_sparse, g_dense)
    (s_sparse, s_dense) = outs[0][2], outs[1][2]
    assert not s_sparse["dense_fallback"] and s_dense["dense_fallback"]
    assert s_sparse["density"] == pytest.approx(s_dense["density"])
    assert s_sparse["n_spilled"] > 0 and s_dense["n_spilled"] == 0


def test_auto_dispatch_follows_the_previous_density():
    torch.manual_seed(4)
    x = torch.randn(40, 16)
    always_dense = tt.TwELLMLP(16, 64, tile_n=32, dispatch="auto", breakeven=0.0)
    paths = []
    for _ in range(3):
        always_dense(x)
        paths.append(always_dense.stats()["dense_fallback"])
    assert paths == [False, True, True]  # the first forward has no density yet: sparse
    never_dense = tt.TwELLMLP(16, 64, tile_n=32, dispatch="auto", breakeven=1.0)
    for _ in range(2):
        never_dense(x)
        assert not never_dense.stats()["dense_fallback"]
    with pytest.raises(ValueError, match="dispatch: expected one of auto, sparse, dense, got 'fast'"):
        tt.TwELLMLP(16, 64, dispatch="fast")


def test_opcheck_with_a_fixed_spill_capacity():
    """With spill_capacity the spill outputs have that static length on real and fake tensors."""
    x, wg, wu, wd = _problem(9)
    torch.library.opcheck(
        torch.ops.twellsparse.ffn_fwd.default,
        (x, wg, wu, wd, "relu", 32, 4, None, 4000),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    outs = torch.ops.twellsparse.ffn_fwd(x, wg, wu, wd, "relu", 32, 4, None, 4000)
    assert outs[4].shape == (4000,) and outs[8].shape == (4000,) and int(outs[9]) == 0
    assert 0 < int(outs[6][-1]) < 4000  # the case spills, and the arrays are padded past it


@pytest.mark.parametrize("gated", [True, False])
def test_module_with_spill_capacity_matches_the_exact_one(gated):
    """A fixed spill_capacity (CPU: the exact path with padded spill arrays) gives the exact
    module's output, gradients, stats and L1 penalty; too small a capacity raises at once."""
    cls = tt.TwELLGatedMLP if gated else tt.TwELLMLP
    exact = cls(16, 300, tile_n=32, capacity=4, dtype=torch.float64)
    fixed = cls(16, 300, tile_n=32, capacity=4, spill_capacity=5000, dtype=torch.float64)
    fixed.load_state_dict(exact.state_dict())
    x = _problem(3)[0].detach().requires_grad_()
    outs = [m(x) for m in (exact, fixed)]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    assert exact.stats() == fixed.stats() and exact.stats()["n_spilled"] > 0
    torch.testing.assert_close(fixed.l1_penalty(), exact.l1_penalty(), rtol=0, atol=0)
    grads = [
        torch.autograd.grad((o * 1.5).sum() + m.l1_penalty(), [x, *m.parameters()])
        for o, m in zip(outs, (exact, fixed), strict=True)
    ]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    fixed.check_spill()
    small = cls(16, 300, tile_n=32, capacity=4, spill_capacity=3, dtype=torch.float64)
    small.load_state_dict(exact.state_dict())
    with pytest.raises(TwELLSpillCapacityError, match="no output was returned"):
        small(x)


def test_spill_capacity_is_validated():
    with pytest.raises(ValueError, match="spill_capacity"):
        tt.TwELLMLP(16, 64, spill_capacity=-1)


def _decoded_rows(w):
    """``w``'s rows as fp8 e4m3 codes times their scales, back in float64 (what the plans use)."""
    import twellsparse as ts

    return torch.from_numpy(ts.quantize_rows(np.ascontiguousarray(w.detach().numpy())).dequantize(np.float64))


@pytest.mark.parametrize("gated", [True, False])
def test_e4m3_modules_for_inference(gated):
    x, wg, wu, wd = _problem(21, m=40, d=32, f=300, dtype=torch.float32, requires_grad=False)
    down = _decoded_rows(wd.T).T  # the down projection's rows are wd's columns
    if gated:
        mod = tt.TwELLGatedMLP(32, 300, tile_n=32, capacity=4, down_format="e4m3", up_format="e4m3")
        mod.gate_proj.weight.data, mod.up_proj.weight.data = wg.clone(), wu.clone()
        want = _dense(x.double(), wg.double(), _decoded_rows(wu), down, "relu")
    else:
        mod = tt.TwELLMLP(32, 300, tile_n=32, capacity=4, down_format="e4m3")
        mod.up_proj.weight.data = wg.clone()
        want = _dense(x.double(), wg.double(), None, down, "relu", gated=False)
    mod.down_proj.weight.data = wd.clone()
    with torch.no_grad():
        got = mod(x.reshape(4, 10, 32))  # leading dimensions kept
    assert got.shape == (4, 10, 32) and got.dtype == torch.float32
    torch.testing.assert_close(got.reshape(40, 32).double(), want, rtol=1e-5, atol=1e-5)
    stats = mod.stats()
    assert not stats["dense_fallback"] and 0 < stats["density"] < 1
    # Lossy: a few percent away from the module without fp8 rows.
    plain = tt.TwELLGatedMLP(32, 300, tile_n=32) if gated else tt.TwELLMLP(32, 300, tile_n=32)
    plain.load_state_dict(mod.state_dict())
    with torch.no_grad():
        err = float((mod(x) - plain(x)).norm() / plain(x).norm())
    assert 0 < err < 6e-2
    # An in-place update (an optimizer step) is quantized again; a replaced weight rebuilds the plan.
    with torch.no_grad():
        mod.down_proj.weight.mul_(2.0)
        torch.testing.assert_close(mod(x).double(), 2.0 * want, rtol=1e-5, atol=1e-5)
        mod.down_proj.weight = torch.nn.Parameter(wd.clone() * 3.0)
        torch.testing.assert_close(mod(x).double(), 3.0 * want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"fp8 weight rows .* serve inference only"):
        mod(x)  # the weights require gradients and grad mode is on
    with pytest.raises(RuntimeError, match="l1_penalty: the last forward ran with fp8 weight rows"):
        with torch.no_grad():
            mod(x)
        mod.l1_penalty()


def test_e4m3_module_arguments():
    with pytest.raises(ValueError, match="down_format: expected None or one of 'e4m3', got 'fp8'"):
        tt.TwELLMLP(16, 64, down_format="fp8")
    with pytest.raises(ValueError, match="up_format: expected None or one of 'e4m3', got 'int4'"):
        tt.TwELLGatedMLP(16, 64, up_format="int4")
    plain = torch.nn.Module()
    plain.up_proj = torch.nn.Linear(16, 64, bias=False)
    plain.down_proj = torch.nn.Linear(64, 16, bias=False)
    with pytest.raises(ValueError, match="up_format: expected None for a non-gated MLP"):
        tt.from_module(plain, up_format="e4m3")
    converted = tt.from_module(plain, down_format="e4m3")
    assert converted.down_format == "e4m3" and converted.up_proj.weight is plain.up_proj.weight


class _LlamaMLP(torch.nn.Module):
    def __init__(self, d=16, f=96, bias=False, up_f=None):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, f, bias=bias)
        self.up_proj = torch.nn.Linear(d, up_f or f, bias=False)
        self.down_proj = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("settings", [dict(dispatch="auto"), dict(spill_capacity=5000), dict(down_format="e4m3")])
def test_modules_with_host_reads_compile(settings):
    """The host reads ("auto"'s density, the fixed spill's check, the fp8 plan) are graph breaks,
    not dynamo errors; the compiled module matches the eager one."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = tt.TwELLGatedMLP(16, 128, tile_n=32, **settings)
    x = torch.randn(40, 16)
    with torch.no_grad():
        want = m(x)
        got = torch.compile(m, backend="aot_eager")(x)
        got = torch.compile(m, backend="aot_eager")(x)  # a second call: the posted state read
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_dense_dispatch_keeps_float64_precision(activation):
    torch.manual_seed(0)
    threshold = 0.05 if activation == "silu" else None
    sparse = tt.TwELLGatedMLP(16, 96, tile_n=32, dtype=torch.float64, activation=activation, threshold=threshold)
    dense = tt.TwELLGatedMLP(
        16, 96, tile_n=32, dtype=torch.float64, dispatch="dense", activation=activation, threshold=threshold
    )
    dense.load_state_dict(sparse.state_dict())
    x = torch.randn(50, 16, dtype=torch.float64)
    torch.testing.assert_close(dense(x), sparse(x), rtol=1e-13, atol=1e-13)


def test_autocast_computes_in_the_autocast_dtype_like_the_replaced_mlp():
    torch.manual_seed(0)
    pre, mlp = torch.nn.Linear(16, 16), _LlamaMLP()
    sparse = tt.from_module(mlp, tile_n=32)
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = pre(x)
        want, got = mlp(h), sparse(h)
        assert got.dtype == want.dtype == torch.bfloat16
        assert sparse(x).dtype == torch.bfloat16  # an fp32 input too, as nn.Linear gives
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    got.float().sum().backward()  # the casts are differentiable: fp32 master weights get grads
    assert mlp.gate_proj.weight.grad is not None and mlp.gate_proj.weight.grad.dtype == torch.float32


def test_deepcopy_and_pickle_after_a_training_forward():
    import copy
    import pickle

    m = tt.TwELLGatedMLP(16, 96, tile_n=32)
    x = torch.randn(20, 16, requires_grad=True)
    m(x).sum().backward()
    m(x)  # a forward whose graph is still alive
    twin = copy.deepcopy(m)
    torch.testing.assert_close(twin(x), m(x))
    again = pickle.loads(pickle.dumps(m))
    torch.testing.assert_close(again(x), m(x))


@pytest.mark.parametrize("frozen", ["weights", "x"])
def test_backward_skips_the_products_nobody_needs(monkeypatch, frozen):
    seen = []
    original = tt.backward_arrays

    def spy(*args):
        seen.append(args[-1])
        return original(*args)

    monkeypatch.setattr(tt, "backward_arrays", spy)
    x, wg, wu, wd = _problem(3, requires_grad=False)
    (x if frozen == "weights" else wg).requires_grad_(True)
    if frozen == "x":
        wu.requires_grad_(True)
        wd.requires_grad_(True)
    out = tt.gated_ffn(x, wg, wu, wd, tile_n=64)
    grads = torch.autograd.grad(out.square().sum(), [t for t in (x, wg, wu, wd) if t.requires_grad])
    want = torch.autograd.grad(
        _dense(x, wg, wu, wd, "relu").square().sum(), [t for t in (x, wg, wu, wd) if t.requires_grad]
    )
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b)
    assert seen[-1] == ((True, False, False, False) if frozen == "weights" else (False, True, True, True))


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda x, wg, wu, wd: (x[:, :8], wg, wu, wd), ValueError, "x: expected a last dimension of 16"),
        (lambda x, wg, wu, wd: (x, wg, wu[:200], wd), ValueError, "w_up: expected shape"),
        (lambda x, wg, wu, wd: (x, wg, wu, wd[:, :200]), ValueError, "w_down: expected shape"),
        (lambda x, wg, wu, wd: (x, wg, wu[0], wd), TypeError, "w_up: expected a 2-D"),
        (lambda x, wg, wu, wd: (x.tolist(), wg, wu, wd), TypeError, "x: expected a torch.Tensor"),
        (lambda x, wg, wu, wd: (x.long(), wg, wu, wd), TypeError, "x: expected a floating-point"),
    ],
)
def test_bad_operands_name_the_argument(mutate, error, message):
    args = mutate(*_problem(4, requires_grad=False))
    with pytest.raises(error, match=message) as info:
        tt.gated_ffn(*args, tile_n=64)
    assert "\n" not in str(info.value)


def test_module_errors_name_the_parameter_and_fp8_checks_dtypes_too():
    m = tt.TwELLGatedMLP(32, 300, tile_n=32)
    with pytest.raises(ValueError, match=r"x: expected a last dimension of 32 \(gate_proj.weight's columns\)"):
        m(torch.randn(3, 16))
    fp8 = tt.TwELLGatedMLP(32, 300, tile_n=32, down_format="e4m3")
    with torch.inference_mode(), pytest.raises(TypeError, match=r"gate_proj\.weight: expected dtype torch\.float64"):
        fp8(torch.randn(4, 32, dtype=torch.float64))


def test_swap_mlps_keeps_twell_modules_and_is_all_or_nothing():
    class Block(torch.nn.Module):
        def __init__(self, bias=False):
            super().__init__()
            self.mlp = _LlamaMLP(bias=bias)

    model = torch.nn.Sequential(Block(), Block())
    settings = dict(tile_n=64, capacity=16, dispatch="dense", activation="silu", threshold=0.05)
    assert tt.swap_mlps(model, **settings) == 2
    assert tt.swap_mlps(model) == 0  # already TwELL: kept, settings and all
    m = model[0].mlp
    assert (m.tile_n, m.capacity, m.dispatch, m.activation, m.threshold) == (64, 16, "dense", "silu", 0.05)
    mixed = torch.nn.Sequential(Block(), Block(bias=True))
    with pytest.raises(ValueError, match=r"^1\.mlp\.gate_proj: expected a Linear without bias"):
        tt.swap_mlps(mixed)
    assert [type(b.mlp).__name__ for b in mixed] == ["_LlamaMLP", "_LlamaMLP"]  # nothing swapped
    with pytest.raises(ValueError, match=r"mlp\.up_proj: expected 16 -> 96 features like gate_proj"):
        tt.from_module(_LlamaMLP(up_f=64))


def test_double_backward_says_it_is_unsupported():
    x, wg, wu, wd = _problem(5)
    (g,) = torch.autograd.grad(tt.gated_ffn(x, wg, wu, wd, tile_n=64).square().sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(g.sum(), x)


@pytest.mark.parametrize("dispatch", ["sparse", "dense"])
def test_modules_compile_in_one_graph(dispatch):
    torch._dynamo.reset()
    torch.manual_seed(1)
    m = tt.TwELLGatedMLP(16, 128, tile_n=32, dispatch=dispatch)
    x = torch.randn(40, 16, requires_grad=True)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), m(x))
    (gx,) = torch.autograd.grad(compiled(x).sum(), x)
    (want,) = torch.autograd.grad(m(x).sum(), x)
    torch.testing.assert_close(gx, want)


def test_autocast_leaves_float64_alone_and_keeps_the_fp8_plan():
    m64 = tt.TwELLGatedMLP(16, 96, tile_n=32, dtype=torch.float64)
    x64 = torch.randn(8, 16, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m64(x64).dtype == torch.float64  # autocast does not cast float64, nor do the blocks
    fp8 = tt.TwELLGatedMLP(32, 300, tile_n=32, down_format="e4m3")
    x = torch.randn(4, 32)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        fp8(x)
        plan = fp8._plan
        fp8(x.bfloat16())
        assert fp8._plan is plan  # built on the weights as they are, not on autocast's copies


def test_zero_tokens_one_dimensional_input_and_inference_mode():
    m = tt.TwELLGatedMLP(16, 96, tile_n=32, dtype=torch.float64)
    empty = torch.zeros(0, 16, dtype=torch.float64, requires_grad=True)
    out = m(empty)
    assert out.shape == (0, 16)
    out.sum().backward()  # a zero-token backward: zero gradients of the right shapes
    assert empty.grad.shape == (0, 16) and m.gate_proj.weight.grad.abs().sum() == 0
    v = torch.randn(16, dtype=torch.float64, requires_grad=True)
    batch = m(v[None])[0]
    torch.testing.assert_close(m(v), batch)
    (g1,) = torch.autograd.grad(m(v).sum(), v)
    (g2,) = torch.autograd.grad(m(v[None]).sum(), v)
    torch.testing.assert_close(g1, g2)
    with torch.inference_mode():
        torch.testing.assert_close(m(v), batch.detach())


def test_l1_penalty_gradients_for_thresholded_silu():
    torch.manual_seed(3)
    m = tt.TwELLGatedMLP(16, 96, tile_n=32, dtype=torch.float64, activation="silu", threshold=0.05)
    x = torch.randn(20, 16, dtype=torch.float64)
    m(x)
    (got,) = torch.autograd.grad(m.l1_penalty(), m.gate_proj.weight)
    a = torch.nn.functional.silu(x @ m.gate_proj.weight.T)
    kept = torch.where(a.abs() > 0.05, a, torch.zeros_like(a))
    (want,) = torch.autograd.grad(kept.abs().sum() / x.shape[0], m.gate_proj.weight)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("no_autograd", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("spill_capacity", [None, 5000])
def test_forward_without_autograd_keeps_no_linear_values(no_autograd, spill_capacity):
    """Under no_grad / inference_mode the gated module's forward leaves the up values (the
    backward's input) out, with the same output, stats and L1 penalty as a forward with autograd."""
    module = tt.TwELLGatedMLP(16, 300, tile_n=32, capacity=4, spill_capacity=spill_capacity, dtype=torch.float64)
    x = _problem(4)[0].detach()
    with_grad = module(x)
    kept = module._hidden[6:8]  # (data, spill_data) of the up values
    stats, penalty = module.stats(), module.l1_penalty().detach()
    with no_autograd():
        out = module(x)
        assert module.stats() == stats and stats["n_spilled"] > 0
        torch.testing.assert_close(module.l1_penalty(), penalty, rtol=0, atol=0)
    torch.testing.assert_close(out, with_grad.detach(), rtol=0, atol=0)
    weights = (module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)
    torch.testing.assert_close(out, _dense(x, *weights, "relu").detach(), rtol=1e-12, atol=1e-12)
    assert kept[0].shape == (37, 10, 4) and [t.numel() for t in module._hidden[6:8]] == [0, 0]


def test_op_without_linear_values_refuses_a_backward():
    """keep_linear=False is for forwards no backward follows: differentiating it raises a clear
    error (never gradients from missing values); the op's schema and fake tensors agree."""
    x, wg, wu, wd = _problem(10)
    torch.library.opcheck(
        torch.ops.twellsparse.ffn_fwd.default,
        (x.detach(), wg.detach(), wu.detach(), wd.detach(), "relu", 32, 4, None, None, False),
        test_utils=("test_schema", "test_faketensor"),
    )
    outs = torch.ops.twellsparse.ffn_fwd(x, wg, wu, wd, "relu", 32, 4, None, None, False)
    assert outs[7].numel() == 0 and outs[8].numel() == 0
    with pytest.raises(RuntimeError, match="keep_linear=False drops the values the backward needs"):
        outs[0].sum().backward()


def test_frozen_module_keeps_no_linear_values_and_context_takes_every_arity():
    """Grad enabled but nothing requiring it (a frozen model): autograd records nothing, so no
    up values are kept either; the op's autograd context reads its optional trailing arguments
    whether 0, 1 or 2 of them are given."""
    module = tt.TwELLGatedMLP(16, 300, tile_n=32, capacity=4, dtype=torch.float64).requires_grad_(False)
    module(_problem(4)[0].detach())
    assert [t.numel() for t in module._hidden[6:8]] == [0, 0]
    x, wg, wu, wd = _problem(4)
    for optional, want in (((), (False, True)), ((4000,), (True, True)), ((None, False), (False, False))):
        ctx = types.SimpleNamespace(set_materialize_grads=lambda _v: None)
        ctx.save_for_backward = ctx.mark_non_differentiable = lambda *_a: None
        outs = tt._ffn_fwd(x.detach(), wg.detach(), wu.detach(), wd.detach(), "relu", 32, 4, None)
        tt._setup_context(ctx, (x, wg, wu, wd, "relu", 32, 4, None, *optional), outs)
        assert (ctx.fixed_spill, ctx.kept_linear) == want, optional


def test_down_weight_given_as_a_transposed_view():
    """A w_down that is the transpose of a (d_ff, d_model) tensor (tied or shared storage) is
    taken as it lies, with the values and gradients of its contiguous copy."""
    x, wg, wu, wd = _problem(6)
    stored = wd.detach().t().contiguous().requires_grad_()  # (d_ff, d_model)
    view_out = tt.gated_ffn(x, wg, wu, stored.t(), tile_n=32)
    copy_out = tt.gated_ffn(x, wg, wu, wd, tile_n=32)
    torch.testing.assert_close(view_out, copy_out, rtol=0, atol=0)
    g_view = torch.autograd.grad(view_out.sum(), stored)[0]
    g_copy = torch.autograd.grad(copy_out.sum(), wd)[0]
    torch.testing.assert_close(g_view, g_copy.t(), rtol=0, atol=0)
