"""Operand layouts the GPU kernels cannot address as given (reversed or broadcast rows, an out
sharing memory with b, non-contiguous parts or codes, which the constructors copy), mixed-precision
FFN weights, scalar arithmetic on the device, and arrays on another device than the current one:
each gives what the CPU reference gives, or a clear error. Widths of 100 columns end in a partial
32-column tile, d_ff 1000 in a partial 256-column one."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import rounding_bound

import twellsparse as ts
from twellsparse.testing import ffn_problem, rel_error, sparse_activations

pytestmark = pytest.mark.gpu


def _matrix(cp, rng, m=64, n=100, dtype=np.float32):
    h = sparse_activations(m, n, 0.1, "skewed", dtype, rng)
    return h, ts.twell_array(cp.asarray(h), tile_n=32, capacity=2)


@pytest.mark.parametrize("dtype", [np.float32, ts.bfloat16])
def test_reversed_out_rows_get_the_result_copied_in(cp, rng, dtype):
    h, a = _matrix(cp, rng, dtype=dtype)
    b = rng.standard_normal((100, 16)).astype(dtype)
    buf = cp.full((64 + 8, 16), 7, dtype=dtype)
    out = buf[:64][::-1]
    ts.matmul(a, cp.asarray(b), out=out)
    want = h.astype(np.float64) @ b.astype(np.float64)
    assert rel_error(out.get(), want) <= rounding_bound(dtype, want)
    assert np.all(cp.asnumpy(buf[64:]).astype(np.float64) == 7)  # nothing written past the rows
    v = cp.full(64 + 8, 7, dtype=dtype)
    ts.matmul(a, cp.asarray(b[:, 0]), out=v[:64][::-1])
    assert rel_error(v[:64][::-1].get(), want[:, 0]) <= rounding_bound(dtype, want[:, 0])
    assert np.all(cp.asnumpy(v[64:]).astype(np.float64) == 7)


def test_broadcast_operands_are_read_as_their_values(cp, rng):
    """Stride-0 rows (one row repeated: the layout the kernels cannot follow) and stride-0 columns
    (distinct rows, each one value repeated: a wrong row index shows)."""
    h, a = _matrix(cp, rng)
    row = rng.standard_normal(16).astype(np.float32)
    col = rng.standard_normal(100).astype(np.float32)
    for b in (cp.broadcast_to(cp.asarray(row), (100, 16)), cp.broadcast_to(cp.asarray(col)[:, None], (100, 16))):
        want = h.astype(np.float64) @ b.get().astype(np.float64)
        assert rel_error(ts.matmul(a, b).get(), want) < 1e-5
    y = cp.asarray(rng.standard_normal((100, 8)).astype(np.float32))
    x_row = cp.asarray(rng.standard_normal(8).astype(np.float32))
    x_col = cp.asarray(rng.standard_normal(64).astype(np.float32))
    for x in (cp.broadcast_to(x_row, (64, 8)), cp.broadcast_to(x_col[:, None], (64, 8))):
        s = ts.sddmm(x, y, a)
        dense = x.get().astype(np.float64) @ y.get().astype(np.float64).T
        assert rel_error(s.toarray().get(), np.where(h != 0, dense, 0)) < 1e-5


def test_out_sharing_memory_with_b(cp, rng):
    h = sparse_activations(100, 100, 0.1, "skewed", np.float32, rng)
    a = ts.twell_array(cp.asarray(h), tile_n=32, capacity=2)
    b = cp.asarray(rng.standard_normal((100, 16)).astype(np.float32))
    want = h.astype(np.float64) @ b.get().astype(np.float64)
    ts.matmul(a, b, out=b)
    assert rel_error(b.get(), want) < 1e-5


@pytest.mark.parametrize("dispatch", ["sparse", "dense", "auto"])
def test_mixed_precision_weights_on_every_path(cp, rng, dispatch):
    p = ffn_problem(128, 64, 1000, 0.05, "uniform", ts.bfloat16, rng, cp)
    w_down = p["w_down"].astype(cp.float32)
    out = ts.gated_ffn(p["x"], p["w_gate"], p["w_up"], w_down, dispatch=dispatch)
    assert out.dtype == np.float32
    host = {k: p[k].get().astype(np.float64) for k in ("x", "w_gate", "w_up")}
    h = np.maximum(host["x"] @ host["w_gate"].T, 0) * (host["x"] @ host["w_up"].T)
    assert rel_error(out.get(), h @ w_down.get().astype(np.float64).T) < 2e-2


def test_non_contiguous_parts_and_codes(cp, rng):
    """Strided parts and codes: the constructors copy them into the C-contiguous arrays the
    kernels index, holding the selected rows."""
    h = sparse_activations(128, 100, 0.1, "skewed", np.float32, rng)
    # Capacity 32 = tile_n: nothing spills, so the slots are all of each row's entries and every
    # other row of (data, indices, counts) is a matrix of its own (no spill part to cut).
    a = ts.twell_array(cp.asarray(h), tile_n=32, capacity=32)
    strided = tuple(part[::2] for part in a.parts[:3])
    every_other = ts.twell_array(strided, shape=(64, 100), tile_n=32)
    for part, given in zip(every_other.parts[:3], strided, strict=True):
        assert part.flags.c_contiguous and np.array_equal(cp.asnumpy(part), cp.asnumpy(given))
    b = rng.standard_normal((100, 8)).astype(np.float32)
    want = h[::2].astype(np.float64) @ b.astype(np.float64)
    assert rel_error(ts.matmul(every_other, cp.asarray(b)).get(), want) < 1e-5
    # Every other row of fp8 codes: QuantizedRows copies them (the fp8 kernels read each row's
    # codes back to back), and the fp8 gather kernel (bf16 a, rows of 16 codes) reads the copy.
    q = ts.quantize_rows(cp.asarray(rng.standard_normal((200, 16)).astype(np.float32)))
    rows = ts.QuantizedRows(q.data[::2], q.scales[::2])
    assert rows.data.flags.c_contiguous and rows.scales.flags.c_contiguous
    assert np.array_equal(cp.asnumpy(rows.data), cp.asnumpy(q.data)[::2])
    assert np.array_equal(cp.asnumpy(rows.scales), cp.asnumpy(q.scales)[::2])
    hb = sparse_activations(64, 100, 0.1, "skewed", ts.bfloat16, rng)
    ab = ts.twell_array(cp.asarray(hb), tile_n=32, capacity=32)
    want = hb.astype(np.float64) @ q.dequantize(np.float64).get()[::2]
    assert rel_error(ts.matmul(ab, rows).get(), want) < 1e-2


@pytest.mark.parametrize("dtype", [np.float32, ts.bfloat16])
def test_scalar_arithmetic_keeps_zero_padding(cp, rng, dtype):
    h, a = _matrix(cp, rng, dtype=dtype)
    for b in (a * np.inf, a / 3.0, a / np.float64(2)):
        b.check_format(full_check=True)
    np.testing.assert_array_equal((a / 2.0).get().toarray(), (ts.twell_array(h, tile_n=32, capacity=2) / 2.0).toarray())


def test_arrays_on_another_device_raise(cp, rng):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cp.cuda.Device(1):
        h, a = _matrix(cp, rng)
        b = cp.asarray(rng.standard_normal((100, 8)).astype(np.float32))
    with pytest.raises(ValueError, match="device: expected the arrays on the current device cuda:0"):
        ts.matmul(a, b)
    with cp.cuda.Device(1):
        assert rel_error(ts.matmul(a, b).get(), h.astype(np.float64) @ b.get().astype(np.float64)) < 1e-5
