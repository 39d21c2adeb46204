"""PyTorch adapter on the GPU: CUDA tensors through the CuPy kernels on torch's current stream,
values and gradients against dense torch autograd."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import twellsparse.torch as tt  # noqa: E402

pytestmark = pytest.mark.gpu


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
