"""The library's dense transpose (``cuda/twell_dense_transpose.cu``) on the GPU: every value
type bit for bit against CuPy's copy, on shapes with partial tiles, single rows and columns,
more row tiles than a grid's y dimension takes, a row stride above the width, and a column
stride (CuPy's copy then); and the torch adapter gives the same forward and every gradient bit
for bit with the kernel's transposes (the default) and torch's copies (``TWELL_DENSE_TRANSPOSE=0``)."""

from __future__ import annotations

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _dense_transpose

pytestmark = pytest.mark.gpu


def _values(rng, shape, dtype):
    return (rng.standard_normal(shape) * 8).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, ts.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("rows, cols", [(1, 1), (1, 37), (37, 1), (33, 65), (1000, 37), (2048, 5632)])
def test_transpose_matches_cupy_bit_for_bit(cp, rng, dtype, rows, cols):
    a = cp.asarray(_values(rng, (rows, cols), dtype))
    before = a.copy()
    got = _dense_transpose.transpose(a)
    assert got.shape == (cols, rows) and got.dtype == a.dtype and got.flags.c_contiguous
    np.testing.assert_array_equal(got.view(np.uint8).get(), cp.ascontiguousarray(a.T).view(np.uint8).get())
    np.testing.assert_array_equal(a.view(np.uint8).get(), before.view(np.uint8).get())  # a untouched


def test_transpose_past_the_grids_y_limit_and_of_strided_rows(cp, rng):
    tall = cp.asarray(_values(rng, (2_100_000, 2), ts.bfloat16))  # 65625 row tiles > 65535
    assert -(-tall.shape[0] // _dense_transpose.TILE) > _dense_transpose.MAX_GRID_Y
    np.testing.assert_array_equal(_dense_transpose.transpose(tall).get(), cp.ascontiguousarray(tall.T).get())
    wide = cp.asarray(_values(rng, (300, 100), np.float32))
    # Row strides (above the width, negative, one row), a column stride, a type without the kernel.
    views = (wide[:, 3:40], wide[5:200:3, 7:90], wide[::-1, 3:40], wide[4:5, 3:40], wide[:, ::2])
    for view in (*views, wide.astype(np.int32)):
        got = _dense_transpose.transpose(view)
        assert got.flags.c_contiguous and not cp.shares_memory(got, view)
        np.testing.assert_array_equal(got.get(), cp.ascontiguousarray(view.T).get())
    empty = _dense_transpose.transpose(cp.zeros((0, 7), dtype=np.float16))
    assert empty.shape == (7, 0)


def test_torch_adapter_with_the_kernel_matches_the_default(monkeypatch, poisoned_torch_allocations):
    """The adapter's own arrays poisoned (the kernel's output among them), the kernel's run
    first: an element it failed to write cannot pass as the default run's."""
    torch = pytest.importorskip("torch")
    import twellsparse.torch as tt

    gen = torch.Generator().manual_seed(3)
    shapes = ((300, 128), (1000, 128), (1000, 128), (128, 1000))
    x, wg, wu, wd = (
        (torch.randn(*s, generator=gen, dtype=torch.float64) / s[-1] ** 0.5).to("cuda", torch.bfloat16) for s in shapes
    )
    x = (x * 4).requires_grad_()
    results = []
    for preferred in (True, False):
        torch.cuda.empty_cache()
        monkeypatch.setattr(_dense_transpose, "PREFERRED", preferred)
        weights = [w.detach().clone().requires_grad_() for w in (wg, wu, wd)]
        xx = x.detach().clone().requires_grad_()
        out = tt.gated_ffn(xx, *weights, capacity=8)
        grads = torch.autograd.grad(out, [xx, *weights], torch.ones_like(out))
        results.append([out, *grads])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
