"""Weight rows in fp8 e4m3 with one float32 scale per row: an opt-in operand of :func:`matmul`
that halves the bytes the row-gather SpMM reads per stored entry (``cuda/twell_fp8.cuh``).

Lossy by design, never taken unless asked for: a row's values are divided by its scale
``max |row| / 448`` and rounded to nearest-even e4m3 (3 mantissa bits: a relative step of
2**-3, so each weight moves by at most 2**-4 of its magnitude above e4m3's subnormal range,
and by at most 2**-10 of its row's largest magnitude below it).
The products then accumulate in float32 as with 2-byte weights.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ._backend import array_module, is_cupy_array
from ._errors import TwELLFallbackWarning, warn

#: Formats :func:`quantize_rows` knows.
FORMATS = ("e4m3",)

#: The largest finite e4m3 ("fn") value: each row's largest magnitude maps to it.
E4M3_MAX = np.float32(448.0)

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def check_format(value: Any, name: str = "format", optional: bool = False) -> Any:
    """``value`` if it names one of :data:`FORMATS` (or is None where ``optional``), else a
    one-line ValueError naming ``name``."""
    if value in FORMATS or (optional and value is None):
        return value
    choices = ("None or " if optional else "") + f"one of {', '.join(map(repr, FORMATS))}"
    raise ValueError(f"{name}: expected {choices}, got {value!r}")


def decoded_for_fallback(rows: QuantizedRows, dt: Any, op: str) -> Any:
    """``rows`` decoded to float32 (float64 for float64 ``dt``) where the fp8 kernels cannot
    take them on the GPU, with the :class:`TwELLFallbackWarning` that says so."""
    wide = np.float64 if np.dtype(dt) == np.float64 else np.float32
    warn(
        f"{op}: quantized rows take the fp8 kernels with bfloat16/float16 values, 16-byte-aligned rows and rows "
        f"of a multiple of 8 codes; here ({np.dtype(dt).name}, {rows.shape[1]} per row) they are decoded to "
        f"{np.dtype(wide).name} for the usual product",
        TwELLFallbackWarning,
    )
    return rows.dequantize(wide)


class QuantizedRows:
    """The rows of a dense ``N x K`` matrix ``B`` as fp8 e4m3 codes with one float32 scale per
    row, for ``matmul(a, rows)`` (``a @ B`` with ``B``'s rows decoded as ``code * scale``).

    Attributes
    ----------
    data : array
        ``uint8`` (N, K): the e4m3 codes, C-contiguous, on ``B``'s device.
    scales : array
        ``float32`` (N,): each row's scale.
    format : str
        ``"e4m3"``.
    """

    def __init__(self, data: Any, scales: Any, format: str = "e4m3") -> None:
        check_format(format)
        if data.dtype != np.uint8 or data.ndim != 2:
            raise ValueError(f"data: expected a 2-D uint8 array of codes, got {data.ndim}-D {data.dtype}")
        if scales.dtype != np.float32 or scales.shape != data.shape[:1]:
            raise ValueError(f"scales: expected float32 of shape ({data.shape[0]},), got {scales.dtype} {scales.shape}")
        xp = array_module(data)  # the fp8 kernels read rows of K codes back to back
        self.data, self.scales, self.format = xp.ascontiguousarray(data), xp.ascontiguousarray(scales), format

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the matrix the rows came from."""
        return (int(self.data.shape[0]), int(self.data.shape[1]))

    def dequantize(self, dtype: Any = np.float32) -> Any:
        """Return ``B`` as stored: each code's value times its row's scale.

        Parameters
        ----------
        dtype : dtype, default float32
            The result's dtype. The products are exact in float64; float32 rounds each once, and
            other dtypes are rounded from float32.

        Returns
        -------
        array, shape (N, K)
            On the codes' device (NumPy or CuPy).
        """
        xp = array_module(self.data)
        values = _decode_table(xp)[self.data]
        wide = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        return (values.astype(wide) * self.scales.astype(wide)[:, None]).astype(dtype)

    def __repr__(self) -> str:
        where = "cuda" if is_cupy_array(self.data) else "cpu"
        return f"<QuantizedRows {self.shape[0]}x{self.shape[1]} {self.format} on {where}>"


def _decode_table(xp: Any) -> Any:
    """Each of the 256 codes' value as float32 (NaN for the two NaN codes, never produced)."""
    table = np.arange(256, dtype=np.uint8).view(_E4M3).astype(np.float32)
    return table if xp is np else xp.asarray(table)


def quantize_rows(b: Any, format: str = "e4m3") -> QuantizedRows:
    """Store the rows of ``b`` in 8 bits for :func:`matmul`: fp8 e4m3 codes with one float32
    scale per row (``max |row| / 448``; 1 for a row of zeros), rounded to nearest even.

    For ``a @ b`` with a TwELL ``a`` whose columns index ``b``'s rows (the down projection takes
    ``W_down.T``, one row per hidden unit): the row-gather SpMM then reads half the bytes of a
    2-byte row per stored entry. Lossy (see the module docstring); the CPU and GPU give the same
    codes and scales.

    Parameters
    ----------
    b : array_like
        Dense 2-D, finite, on the CPU (NumPy) or the GPU (CuPy).
    format : {"e4m3"}
        The 8-bit format.

    Returns
    -------
    QuantizedRows

    Raises
    ------
    ValueError
        For another format, a non-2-D ``b``, a non-finite value in it, one beyond float32's
        range, or a row whose largest magnitude is positive but below about 3.1e-43 (its
        float32 scale would underflow to 0).

    Notes
    -----
    The error bound of the module docstring holds for rows whose largest magnitude is at least
    448 times float32's smallest normal (about 5e-36): below that the float32 scale is
    subnormal and loses precision.
    """
    check_format(format)
    xp = array_module(b)
    b = xp.asarray(b)
    if b.ndim != 2:
        raise ValueError(f"b: expected a 2-D array, got {b.ndim}-D of shape {tuple(b.shape)}")
    if b.dtype.kind != "f" and b.dtype != np.dtype(ml_dtypes.bfloat16):
        raise ValueError(f"b: expected floating-point values, got {b.dtype}")
    if b.size:
        # Each row's largest magnitude, in b's dtype or float32 for 16-bit ones (rounding is
        # monotonic, so its float32 value is the codec's, which takes the row's scale from it).
        amax = xp.abs(b if b.dtype.itemsize >= 4 else b.astype(np.float32)).max(axis=1)
        if not bool(xp.isfinite(amax).all()):  # a NaN anywhere in a row makes its max NaN
            raise ValueError("b: expected finite values (fp8 e4m3 has no infinities), got inf or NaN")
        if not bool((amax <= np.finfo(np.float32).max).all()):
            raise ValueError("b: expected magnitudes within float32's range (the scales are float32), got larger ones")
        amax = amax.astype(np.float32)
        if bool(((amax > 0) & (amax / np.float32(E4M3_MAX) == 0)).any()):
            raise ValueError(
                "b: expected each row's largest magnitude 0 or above about 3.1e-43 (its float32 scale, "
                "the largest / 448, would underflow to 0), got a smaller one"
            )
    if is_cupy_array(b):
        from . import _gpu_ops

        data, scales = _gpu_ops.quantize_rows_e4m3(b)
        return QuantizedRows(data, scales)
    return QuantizedRows(*_quantize_rows_host(b))


def _quantize_rows_host(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy reference of ``cuda/twell_quantize.cu``, step for step in float32."""
    values = b.astype(np.float32)
    amax = np.abs(values).max(axis=1) if b.shape[1] else np.zeros(b.shape[0], np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(amax > 0, amax / E4M3_MAX, np.float32(1)).astype(np.float32)
        scaled = (values / scales[:, None]).astype(np.float32)
    # Saturate as the kernel does (|x| / scale can exceed 448 by the division's rounding).
    codes = np.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(_E4M3).view(np.uint8)
    return np.ascontiguousarray(codes), scales


def matmul_quantized(base: Any, rows: QuantizedRows, dt: Any, out: Any) -> Any:
    """``A @ B`` for :func:`twellsparse.matmul` with ``B`` given as :class:`QuantizedRows`,
    in ``dt`` (A's dtype): the e4m3 row-gather kernel on the GPU for 2-byte values and rows of
    a multiple of 8 codes; elsewhere on the GPU ``B`` decoded to float32 (float64 for float64
    values; a :class:`TwELLFallbackWarning`) and the usual product; the float64 reference on
    the CPU."""
    from . import _reference as ref

    shape = (base.shape[0], rows.shape[1])
    if not is_cupy_array(rows.data):
        result = ref.matmul(base.parts, base.shape, base.tile_n, rows.dequantize(np.float64), dt)
        if out is None:
            return result
        out[...] = result
        return out
    import cupy as cp

    from . import _gpu_ops
    from ._ops import _cast_parts, _matmul_gpu

    if _gpu_ops.quantized_rows_serve(rows, dt):
        result = out if out is not None else cp.empty(shape, dtype=dt)
        return _gpu_ops.down_spmm(_cast_parts(base.parts, dt), base.tile_n, rows, result)
    decoded = decoded_for_fallback(rows, dt, "matmul")
    result = _matmul_gpu(base, decoded, decoded.dtype, shape, False, None, False).astype(dt, copy=False)
    if out is None:
        return result
    out[...] = result
    return out
