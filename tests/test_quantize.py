"""fp8 e4m3 weight rows (twellsparse.quantize_rows) on the CPU: the device codec's algorithm
(mirrored here step for step from cuda/twell_fp8.cuh) against ml_dtypes' rounding, the error
bound the docs promise, matmul with quantized rows against the float64 reference, bad input."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import twellsparse as ts

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _device_encode(x: np.ndarray) -> np.ndarray:
    """``e4m3_from_float`` of cuda/twell_fp8.cuh, in NumPy uint32 arithmetic."""
    u = x.astype(np.float32).view(np.uint32)
    sign = (u >> 24) & 0x80
    mag = u & 0x7FFFFFFF
    subnormal = np.rint(np.minimum(mag.view(np.float32), np.float32(1)) * np.float32(512)).astype(np.uint32)
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20).astype(np.int64) - (120 << 3)
    normal = np.minimum(np.maximum(normal, 0), 0x7E).astype(np.uint32)
    return (sign | np.where(mag < 0x3C800000, subnormal, normal)).astype(np.uint8)


def _device_decode(codes: np.ndarray) -> np.ndarray:
    """``e4m3_to_float`` of cuda/twell_fp8.cuh."""
    c = codes.astype(np.uint32)
    mag = c & 0x7F
    normal = ((mag + (120 << 3)) << 20).astype(np.uint32).view(np.float32)
    v = np.where(mag >= 8, normal, mag.astype(np.float32) / np.float32(512))
    return np.where(c & 0x80, -v, v)


def test_device_codec_rounds_as_ml_dtypes(rng):
    """Round to nearest even at every midpoint, subnormals, signed zeros, saturation at 448."""
    finite = np.arange(256, dtype=np.uint8)
    finite = finite[(finite & 0x7F) != 0x7F]
    values = np.sort(np.unique(finite.view(E4M3).astype(np.float32)))
    midpoints = ((values[1:] + values[:-1]) / 2).astype(np.float32)  # exact in float32
    x = np.concatenate(
        [
            values,
            midpoints,
            np.nextafter(midpoints, np.float32(0)),
            np.nextafter(midpoints, np.float32(1e9) * np.sign(midpoints)),
            rng.uniform(-470, 470, 100_000).astype(np.float32),
            rng.uniform(-0.03, 0.03, 100_000).astype(np.float32),
            np.float32([0.0, -0.0, 1e-30, -1e-30, 2**-10, 3 * 2**-10, 448, 460, 464, -464, 1e30, -1e30]),
        ]
    )
    expected = np.clip(x, -448, 448).astype(E4M3).view(np.uint8)
    np.testing.assert_array_equal(_device_encode(x), expected)
    np.testing.assert_array_equal(_device_decode(finite), finite.view(E4M3).astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ts.bfloat16])
def test_quantize_rows_matches_the_device_algorithm_and_bound(rng, dtype):
    b = (rng.standard_normal((41, 56)) * np.exp(rng.uniform(-10, 6, (41, 1)))).astype(dtype)
    b[4] = 0
    b[7, :3] = [2e-7, -0.0, 3.0]
    q = ts.quantize_rows(b)
    assert q.shape == b.shape and q.data.dtype == np.uint8 and q.scales.dtype == np.float32
    values = b.astype(np.float32)
    amax = np.abs(values).max(axis=1)
    scales = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    np.testing.assert_array_equal(q.scales, scales)
    np.testing.assert_array_equal(q.data, _device_encode(values / scales[:, None]))
    assert q.scales[4] == 1 and not q.data[4].any()
    # The documented bound: 2**-4 of each magnitude, 2**-10 of the row's largest below 2**-6 x scale.
    b64 = b.astype(np.float64)
    err = np.abs(q.dequantize(np.float64) - b64)
    bound = 2.0**-4 * np.abs(b64) + 2.0**-10 * (amax.astype(np.float64) / 448)[:, None]
    assert np.all(err <= bound * (1 + 1e-6))
    np.testing.assert_array_equal(q.dequantize(np.float32), _device_decode(q.data) * q.scales[:, None])


@pytest.mark.parametrize("dtype", [np.float32, ts.bfloat16])
def test_matmul_with_quantized_rows_is_the_reference_on_decoded_rows(rng, dtype):
    h = ts.testing.sparse_activations(23, 300, 0.05, "skewed", dtype, rng)
    a = ts.twell_array(h, tile_n=64, capacity=2)  # spills
    b = rng.standard_normal((300, 40)).astype(np.float32)
    q = ts.quantize_rows(b)
    got = ts.matmul(a, q)
    expected = (h.astype(np.float64) @ q.dequantize(np.float64)).astype(dtype)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.astype(np.float64), expected.astype(np.float64))
    out = np.full((23, 40), np.nan, dtype=dtype)
    assert ts.matmul(a, q, out=out) is out
    np.testing.assert_array_equal(out.astype(np.float64), expected.astype(np.float64))


def test_quantized_rows_bad_input(rng):
    b = rng.standard_normal((8, 16)).astype(np.float32)
    a = ts.twell_array(ts.testing.sparse_activations(4, 8, 0.3, "uniform", np.float32, rng), tile_n=32, capacity=8)
    before = b.copy()
    with pytest.raises(ValueError, match="format: expected one of 'e4m3', got 'e5m2'"):
        ts.quantize_rows(b, "e5m2")
    with pytest.raises(ValueError, match="b: expected a 2-D array, got 1-D"):
        ts.quantize_rows(b[0])
    with pytest.raises(ValueError, match="b: expected floating-point values, got int32"):
        ts.quantize_rows(b.astype(np.int32))
    bad = b.copy()
    bad[2, 3] = np.inf
    with pytest.raises(ValueError, match="b: expected finite values"):
        ts.quantize_rows(bad)
    np.testing.assert_array_equal(b, before)
    q = ts.quantize_rows(b)
    with pytest.raises(TypeError, match=r"a: quantized rows multiply a twell_array, not its \.T"):
        ts.matmul(a.T, q)
    with pytest.raises(ValueError, match=r"b: expected 8 rows to match a's shape \(4, 8\), got 7"):
        ts.matmul(a, ts.quantize_rows(b[:7]))
    with pytest.raises(ValueError, match="out: expected shape"):
        ts.matmul(a, q, out=np.empty((4, 15), np.float32))
    with pytest.raises(ValueError, match="scales: expected float32 of shape"):
        ts.QuantizedRows(q.data, q.scales.astype(np.float64))
