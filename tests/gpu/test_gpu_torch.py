"""PyTorch adapter on the GPU: CUDA tensors through the CuPy kernels on torch's current stream,
values and gradients against dense torch autograd."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import twellsparse.torch as tt  # noqa: E402
from twellsparse import TwELLSpillCapacityError  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_torch_allocations")]


def _problem(seed, m, d, f, dtype):
    g = torch.Generator().manual_seed(seed)
    ts_ = [torch.randn(*s, generator=g, dtype=torch.float64) / s[-1] ** 0.5 for s in ((m, d), (f, d), (f, d), (d, f))]
    ts_[0] *= 4
    return [t.to("cuda", dtype).requires_grad_() for t in ts_]


def _dense(x, wg, wu, wd, gated):
    a = torch.relu(x @ wg.T)
    return ((a * (x @ wu.T)) if gated else a) @ wd.T


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("gated", [True, False])
def test_cuda_values_and_grads(dtype, tol, gated):
    x, wg, wu, wd = _problem(0, 300, 128, 1000, dtype)
    if gated:
        out, inputs = tt.gated_ffn(x, wg, wu, wd, capacity=8), (x, wg, wu, wd)
    else:
        out, inputs = tt.ffn(x, wg, wd, capacity=8), (x, wg, wd)
    assert out.is_cuda and out.dtype == dtype
    ref64 = [t.detach().double().requires_grad_() for t in (x, wg, wu, wd)]
    ref = _dense(*ref64, gated)
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol
    grad = torch.randn(out.shape, dtype=torch.float64, device="cuda")
    grads = torch.autograd.grad(out, inputs, grad.to(dtype))
    used = ref64 if gated else [ref64[0], ref64[1], ref64[3]]
    rgrads = torch.autograd.grad(ref, used, grad)
    for a, b in zip(grads, rgrads, strict=True):
        assert ((a.double() - b).norm() / b.norm()).item() < 4 * tol


def test_runs_on_torch_current_stream():
    x, wg, wu, wd = _problem(1, 200, 64, 512, torch.float32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = tt.gated_ffn(x, wg, wu, wd)
    stream.synchronize()
    ref = _dense(x, wg, wu, wd, True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int16, torch.int32, torch.bool]
)
def test_tensor_views_match_dlpack(dtype):
    """The adapter's pointer views of CUDA tensors (no DLPack) hold the same values, shapes and
    dtypes as CuPy's DLPack import, for contiguous, transposed (copied first) and empty tensors,
    and keep the tensor's memory alive after the tensor is dropped."""
    import cupy as cp

    g = torch.Generator(device="cuda").manual_seed(5)
    base = torch.randn(37, 53, device="cuda", generator=g, dtype=torch.float64) * 100
    for t in (base.to(dtype), base.to(dtype).t(), base.to(dtype)[:0], base.to(dtype)[3]):
        view = tt._to_array(t)
        ref = cp.from_dlpack(t.contiguous())
        assert view.shape == ref.shape and view.dtype == ref.dtype and view.flags.c_contiguous
        assert bool(cp.all(view.view(cp.uint8) == ref.view(cp.uint8)))
    t = base.to(dtype).clone()
    expected = cp.from_dlpack(t).copy()
    view = tt._to_array(t)
    del t
    torch.cuda.empty_cache()
    torch.empty(37 * 53 * 8, dtype=torch.uint8, device="cuda").fill_(0xFF)  # would reuse freed memory
    assert bool(cp.all(view.view(cp.uint8) == expected.view(cp.uint8)))


def test_workspaces_come_from_torchs_allocator():
    """The kernels' CuPy workspaces are drawn from torch's caching allocator: the pre-activation
    buffer (tokens x d_ff) shows in torch's peak, and nothing stays allocated after the call
    (after a first call, which may cache per-shape workspaces such as cuBLASLt's)."""
    x, wg, wu, wd = (t.detach() for t in _problem(1, 512, 64, 2048, torch.float32))
    tt.gated_ffn(x, wg, wu, wd, capacity=16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = tt.gated_ffn(x, wg, wu, wd, capacity=16)
    torch.cuda.synchronize()
    z_bytes = 512 * 2048 * 4
    assert torch.cuda.max_memory_allocated() - before >= z_bytes
    del out
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_auto_dispatch_on_cuda():
    """The density probe's pinned copy and event on the GPU: the first forward runs sparse, the
    next ones dense at a zero break-even; both paths agree."""
    torch.manual_seed(5)
    x = torch.randn(64, 32, device="cuda")
    auto = tt.TwELLGatedMLP(32, 512, tile_n=64, dispatch="auto", breakeven=0.0, device="cuda")
    outs, paths = [], []
    for _ in range(3):
        outs.append(auto(x))
        paths.append(auto.stats()["dense_fallback"])
    assert paths == [False, True, True]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    want = _host_reference(auto, x)
    assert all(_rel(out, want) < 1e-4 for out in outs)


# The fixed-spill modules' widths: d_ff ends in a partial tile (1000 = 15 x 64 + 40), and d_model
# is no power of two but keeps the 16-byte rows (a multiple of 8 bf16 values) that the row-gather
# kernels, hence a fixed spill_capacity, need.
D_MODEL, D_FF = 72, 1000


def _module_pair(gated, spill_capacity, dtype=torch.bfloat16):
    """A module with a fixed spill_capacity and an exact twin sharing its weights; tile 64 and
    capacity 2 make many row-tiles spill at this density."""
    cls = tt.TwELLGatedMLP if gated else tt.TwELLMLP
    settings = dict(tile_n=64, capacity=2, device="cuda", dtype=dtype)
    fixed, exact = cls(D_MODEL, D_FF, spill_capacity=spill_capacity, **settings), cls(D_MODEL, D_FF, **settings)
    _, wg, wu, wd = _problem(5, 1, D_MODEL, D_FF, dtype)
    with torch.no_grad():
        for m in (fixed, exact):
            (m.gate_proj if gated else m.up_proj).weight.copy_(wg)
            if gated:
                m.up_proj.weight.copy_(wu)
            m.down_proj.weight.copy_(wd)
    return fixed, exact


def _tokens(seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(256, D_MODEL, generator=g, dtype=torch.float64) * 0.5).to("cuda", dtype)


def _host_reference(module, x, grad=None):
    """The module's output in float64 on the host (dense autograd on copies of its weights) and,
    with ``grad``, the gradients of x and of module.parameters() (their order) for that grad."""
    xs = x.detach().cpu().double().requires_grad_()
    ws = [w.detach().cpu().double().requires_grad_() for w in module.parameters()]  # (gate,) up, down
    out = _dense(xs, ws[0], ws[1], ws[-1], isinstance(module, tt.TwELLGatedMLP))
    if grad is None:
        return out.detach()
    return out.detach(), torch.autograd.grad(out, [xs, *ws], grad.detach().cpu().double())


def _rel(a, ref):
    """Norm-wise relative error of a CUDA result against a float64 host reference."""
    return ((a.detach().cpu().double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("gated", [True, False])
def test_module_forward_captured_in_a_cuda_graph(gated):
    """With a fixed spill_capacity the module's forward is captured by torch.cuda.graph and
    replays on new tokens bit-exactly like the exact module (spill included); a too small
    capacity is reported by check_spill after the replay."""
    fixed, exact = _module_pair(gated, 256 * D_FF)
    x = _tokens(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):  # warm-up: kernels compiled, cuBLASLt plans and handles made
            fixed(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = fixed(x)
    for seed in (2, 3):
        x.copy_(_tokens(seed))
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            want = exact(x)
        assert exact.stats()["n_spilled"] > 0
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
        assert _rel(out, _host_reference(exact, x)) < 3e-2  # bf16 rounding of u, h and out
        fixed.check_spill()


def test_fixed_spill_capacity_too_small_raises_at_the_next_forward():
    fixed, _ = _module_pair(True, 5)
    x = _tokens(4)
    with torch.no_grad():
        fixed(x)
        with pytest.raises(TwELLSpillCapacityError):
            fixed(x)


@pytest.mark.parametrize("gated", [True, False])
def test_fixed_spill_capacity_values_and_grads(gated):
    """Training with a fixed spill_capacity (the backward trims the spill) gives the exact
    module's output and gradients."""
    fixed, exact = _module_pair(gated, 256 * D_FF, torch.float32)
    x = _tokens(6, torch.float32).requires_grad_()
    outs = [m(x) for m in (fixed, exact)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    g = torch.randn_like(outs[0])
    grads = [torch.autograd.grad(o, [x, *m.parameters()], g) for o, m in zip(outs, (fixed, exact), strict=True)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    want, want_grads = _host_reference(exact, x, g)
    assert _rel(outs[0], want) < 1e-4
    for a, b in zip(grads[0], want_grads, strict=True):
        assert _rel(a, b) < 4e-4


@pytest.mark.parametrize("gated", [True, False])
def test_training_step_captured_in_a_cuda_graph(gated):
    """With a fixed spill_capacity nothing in the forward or the sparse backward reads back, so
    a whole training step (forward, backward, gradients) is captured by torch.cuda.graph; its
    replays on new tokens give the exact module's output and gradients (spill included)."""
    fixed, exact = _module_pair(gated, 256 * D_FF, torch.float32)
    x = _tokens(7, torch.float32).requires_grad_()
    g = torch.randn(256, D_MODEL, device="cuda", generator=torch.Generator("cuda").manual_seed(8))

    def step(module):
        out = module(x)
        return (out, *torch.autograd.grad(out, [x, *module.parameters()], g))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: kernels compiled, cuBLASLt plans and handles made
            step(fixed)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(fixed)
    for seed in (9, 10):
        with torch.no_grad():
            x.copy_(_tokens(seed, torch.float32))
        graph.replay()
        torch.cuda.synchronize()
        fixed.check_spill()
        want = step(exact)
        assert exact.stats()["n_spilled"] > 0
        torch.testing.assert_close(captured[0], want[0], rtol=0, atol=0)
        for a, b in zip(captured[1:], want[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        host, host_grads = _host_reference(exact, x, g)
        assert _rel(captured[0], host) < 1e-4
        for a, b in zip(captured[1:], host_grads, strict=True):
            assert _rel(a, b) < 4e-4


@pytest.mark.parametrize("gated", [True, False])
def test_e4m3_module_inference_on_cuda(gated):
    """bf16 modules with fp8 rows under inference_mode: the plan's kernels on torch's stream,
    against float64 on the decoded weights; in-place updates picked up."""
    import numpy as np

    import twellsparse as ts

    x, wg, wu, wd = (t.detach() for t in _problem(3, 300, 128, 1000, torch.bfloat16))

    def decoded(w):  # w's rows through fp8 e4m3 and their scales, float64 on the GPU
        rows = ts.quantize_rows(np.ascontiguousarray(w.float().cpu().numpy())).dequantize(np.float64)
        return torch.from_numpy(rows).cuda()

    if gated:
        mod = tt.TwELLGatedMLP(128, 1000, down_format="e4m3", up_format="e4m3", device="cuda", dtype=torch.bfloat16)
        mod.gate_proj.weight.data.copy_(wg)
        mod.up_proj.weight.data.copy_(wu)
    else:
        mod = tt.TwELLMLP(128, 1000, down_format="e4m3", device="cuda", dtype=torch.bfloat16)
        mod.up_proj.weight.data.copy_(wg)
    mod.down_proj.weight.data.copy_(wd)
    down = decoded(wd.T).T
    ref = _dense(x.double(), wg.double(), decoded(wu) if gated else None, down, gated)
    stream = torch.cuda.Stream()
    with torch.inference_mode(), torch.cuda.stream(stream):
        out = mod(x)
        mod.down_proj.weight.mul_(2)
        doubled = mod(x)
    stream.synchronize()
    assert out.is_cuda and out.dtype == torch.bfloat16
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2  # bf16 rounding of h and out
    assert ((doubled.double() - 2 * ref).norm() / ref.norm()).item() < 2e-2
    assert not mod.stats()["dense_fallback"]


@pytest.mark.parametrize("spill_capacity", [None, 256 * D_FF])  # room for every entry, as the tests above
def test_inference_forward_skips_the_linear_values(spill_capacity):
    """Under torch.no_grad() the gated module's CUDA forward keeps no up values (the backward's
    input) and gives the forward-with-autograd's output bit for bit, within bf16 of float64."""
    fixed, exact = _module_pair(True, spill_capacity or 256 * D_FF)
    module = exact if spill_capacity is None else fixed
    x = _tokens(11)
    with_grad = module(x).detach()
    assert module._hidden[6].numel() > 0
    with torch.no_grad():
        out = module(x)
    torch.cuda.synchronize()
    assert [t.numel() for t in module._hidden[6:8]] == [0, 0]
    torch.testing.assert_close(out, with_grad, rtol=0, atol=0)
    assert _rel(out, _host_reference(module, x)) < 3e-2
    module.check_spill()
