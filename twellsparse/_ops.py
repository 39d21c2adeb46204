"""Public math on TwELL matrices: products, SDDMM, the sparse producer and FFN blocks.

Each op validates its inputs, then runs the CPU reference (NumPy inputs) or the GPU kernels
(CuPy inputs); results come back on the inputs' device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _convert as conv
from . import _reference as ref
from ._backend import as_array, device_name, is_cupy_array, result_dtype, value_dtype
from ._parts import DeferredFinish, TwELLParts
from ._quantize import QuantizedRows, decoded_for_fallback, matmul_quantized
from ._transpose import twell_transpose
from ._twell import twell_array
from ._validation import check_activation, check_layout, check_ndim, check_out_shape, check_threshold


def _dense(x: Any, name: str, ndim: int | tuple[int, ...] = 2) -> Any:
    arr = as_array(x, name)
    check_ndim(arr, ndim, name)
    value_dtype(arr.dtype, f"{name}.dtype")
    return arr


def _same_device(ref_name: str, ref_arr: Any, **arrays: Any) -> None:
    for name, a in arrays.items():
        if device_name(a) != device_name(ref_arr):
            raise ValueError(
                f"{name}: expected an array on {device_name(ref_arr)} like {ref_name}, got one on {device_name(a)}"
            )


def _cast_parts(parts: TwELLParts, dtype: Any) -> TwELLParts:
    if parts.data.dtype == dtype:
        return parts
    return parts._replace(data=parts.data.astype(dtype), spill_data=parts.spill_data.astype(dtype))


def matmul(a: Any, b: Any, *, out: Any = None) -> Any:
    """Product of a TwELL matrix (or its ``.T``) with a dense matrix or vector.

    Parameters
    ----------
    a : twell_array or twell_transpose
        ``A`` (M x N) or ``A.T`` (N x M).
    b : array_like or QuantizedRows
        Dense 2-D (or 1-D) operand on ``a``'s device, with ``a.shape[1]`` rows; or its rows in
        8 bits (:func:`quantize_rows`, with a ``twell_array`` ``a``: half the bytes gathered per
        stored entry, lossy).
    out : array, optional
        Written in place: C-contiguous-row array of the result's shape and dtype.

    Returns
    -------
    array
        ``a @ b`` in ``result_type(a.dtype, b.dtype)`` (``a.dtype`` for quantized rows),
        accumulated in fp32 (fp64 for float64).
    """
    if not isinstance(a, (twell_array, twell_transpose)):
        raise TypeError(f"a: expected a twell_array or its .T, got {type(a).__name__}")
    transposed = isinstance(a, twell_transpose)
    base: twell_array = a.base if isinstance(a, twell_transpose) else a
    if isinstance(b, QuantizedRows):
        return _matmul_quantized_rows(a, base, b, out)
    bb = _dense(b, "b", (1, 2))
    _same_device("a", base.data, b=bb)
    vector = bb.ndim == 1
    b2 = bb.reshape(-1, 1) if vector else bb
    if b2.shape[0] != a.shape[1]:
        raise ValueError(f"b: expected {a.shape[1]} rows to match a's shape {a.shape}, got {b2.shape[0]}")
    dt = result_dtype(base.dtype, bb.dtype)
    shape = (a.shape[0], b2.shape[1])
    if out is not None:
        check_out_shape(out, shape[:1] if vector else shape, dt)
        _same_device("a", base.data, out=out)
    if is_cupy_array(bb):
        result = _matmul_gpu(base, b2.astype(dt, copy=False), dt, shape, transposed, out, vector)
    else:
        f = ref.matmul_transposed if transposed else ref.matmul
        result = f(base.parts, base.shape, base.tile_n, b2, dt)
        if out is not None:
            out[...] = result.reshape(out.shape)
            result = out
    if vector and result.ndim == 2:
        result = result.reshape(-1)
    return result


def _matmul_quantized_rows(a: Any, base: twell_array, b: QuantizedRows, out: Any) -> Any:
    """:func:`matmul` with ``b`` as :class:`QuantizedRows`: validation, then the product in
    ``a``'s dtype (:func:`twellsparse._quantize.matmul_quantized`)."""
    if isinstance(a, twell_transpose):
        raise TypeError("a: quantized rows multiply a twell_array, not its .T")
    if b.shape[0] != a.shape[1]:
        raise ValueError(f"b: expected {a.shape[1]} rows to match a's shape {a.shape}, got {b.shape[0]}")
    _same_device("a", base.data, b=b.data)
    shape = (a.shape[0], b.shape[1])
    if out is not None:
        check_out_shape(out, shape, base.dtype)
        _same_device("a", base.data, out=out)
    return matmul_quantized(base, b, base.dtype, out)


def _matmul_gpu(
    base: twell_array, b: Any, dt: Any, shape: tuple[int, int], transposed: bool, out: Any, vector: bool
) -> Any:
    import cupy as cp

    from . import _gpu_ops
    from ._gpu_convert import direct_rows

    target = None
    if out is not None:
        target = out.reshape(shape) if vector else out
        # The kernels write rows at a positive stride, while other blocks still read b: an
        # out they cannot address so, or one sharing memory with b, gets the result copied in.
        if not direct_rows(target) or cp.may_share_memory(target, b):
            target = None
    result = target if target is not None else cp.empty(shape, dtype=dt)
    parts = _cast_parts(base.parts, dt)
    if transposed:
        _gpu_ops.spmm_transposed(parts, base.tile_n, base.shape[1], b, result)
    else:
        _gpu_ops.spmm(parts, base.tile_n, b, result)
    if out is not None and target is None:
        out[...] = result.reshape(out.shape)
        return out
    return result


def transposed_products(pattern: twell_array, pairs: list[tuple[twell_array, Any]]) -> list[Any]:
    """``a.T @ b`` for each ``(a, b)``, every ``a`` with ``pattern``'s structure (other values,
    as the backward pass makes them): on the GPU the structure of the transpose is built once
    for all of them, and two consecutive pairs with the same ``b`` run in one pass (each row of
    ``b`` read once). Internal: the operands are trusted (shapes and devices already checked)."""
    if not is_cupy_array(pattern.data):
        return [matmul(a.T, b) for a, b in pairs]
    import cupy as cp

    from . import _gpu_ops

    n_cols = pattern.shape[1]
    shared = functools.cache(lambda: _gpu_ops.transposed_pattern(pattern.parts, pattern.tile_n, n_cols))
    tiled = _tiled_transposed_products(pattern.tile_n, n_cols, pairs)
    if tiled is not None:
        return tiled
    results: list[Any] = []
    i = 0
    while i < len(pairs):
        a, b = pairs[i]
        dt = result_dtype(a.dtype, b.dtype)
        bb = b.astype(dt, copy=False)
        out = cp.empty((n_cols, b.shape[1]), dtype=dt)
        twin = pairs[i + 1] if i + 1 < len(pairs) and pairs[i + 1][1] is b else None
        if twin is not None and result_dtype(twin[0].dtype, b.dtype) == dt:
            out2 = cp.empty_like(out)
            second = (_cast_parts(twin[0].parts, dt), out2)
            _gpu_ops.spmm_transposed(_cast_parts(a.parts, dt), a.tile_n, n_cols, bb, out, shared, second)
            results += [out, out2]
            i += 2
            continue
        results.append(_gpu_ops.spmm_transposed(_cast_parts(a.parts, dt), a.tile_n, n_cols, bb, out, shared))
        i += 1
    return results


def _tiled_transposed_products(tile_n: int, n_cols: int, pairs: list[tuple[twell_array, Any]]) -> list[Any] | None:
    """:func:`transposed_products` on the tensor cores where ``_tiled_spmm.chosen`` says so for
    every pair (2-byte values, each ``a`` in its ``b``'s dtype): one pack of the transpose for
    up to three products (no transposed structure), one launch each; else None."""
    import cupy as cp

    from . import _tiled_spmm

    if not _tiled_spmm.PREFERRED:  # opt-in: TWELL_TILED_SPMM=1
        return None
    outs = [cp.empty((n_cols, b.shape[1]), dtype=b.dtype) for _, b in pairs]
    if not all(a.dtype == b.dtype and _tiled_spmm.chosen(b, o) for (a, b), o in zip(pairs, outs, strict=True)):
        return None
    for i in range(0, len(pairs), 3):
        products = [(a.parts, b, o) for (a, b), o in zip(pairs[i : i + 3], outs[i : i + 3], strict=True)]
        _tiled_spmm.spmm_transposed(tile_n, n_cols, products)
    return outs


def matmul_sum(a: twell_array, b: Any, a2: twell_array, b2: Any) -> Any:
    """``a @ b + a2 @ b2`` for TwELL ``a`` and ``a2`` of one structure (other values, as the
    backward pass makes them) and dense ``b``, ``b2``: on the GPU one pass of the row-gather
    kernel summing both in its fp32 accumulators (one rounding). Internal: the operands are
    trusted (shapes and devices already checked)."""
    same = a.dtype == a2.dtype == b.dtype == b2.dtype
    if not is_cupy_array(a.data) or not same:
        return values_op(lambda p, q: p + q, matmul(a, b), matmul(a2, b2))
    import cupy as cp

    from . import _gpu_ops

    out = cp.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    return _gpu_ops.spmm(a.parts, a.tile_n, b, out, second=(a2.parts, b2))


def rmatmul(a: Any, other: Any) -> Any:
    """``other @ a`` for dense ``other`` and a TwELL matrix (or its ``.T``): ``(a.T @ other.T).T``."""
    x = as_array(other, "other")
    check_ndim(x, (1, 2), "other")
    if x.shape[-1] != a.shape[0]:
        raise ValueError(
            f"other: expected {a.shape[0]} columns to match a's shape {a.shape}, got shape {tuple(x.shape)}"
        )
    if x.ndim == 1:
        return matmul(a.T, x)
    return matmul(a.T, x.T).T


def _sddmm_parts(x: Any, y: Any, pattern: twell_array, scale: bool) -> tuple[TwELLParts, Any]:
    dt = result_dtype(x.dtype, y.dtype)
    if is_cupy_array(x):
        from . import _gpu_ops

        parts = _cast_parts(pattern.parts, dt) if scale else pattern.parts
        return _gpu_ops.sddmm(parts, pattern.tile_n, x.astype(dt, copy=False), y.astype(dt, copy=False), scale), dt
    return ref.sddmm_values(pattern.parts, pattern.tile_n, x, y, dt, scale), dt


def _sddmm_quantized_rows(x: Any, rows: QuantizedRows, pattern: twell_array) -> TwELLParts:
    """``x @ B.T`` at the pattern, rounded to x's value type, for ``B`` given as
    :class:`QuantizedRows`, outside the fused e4m3 kernel: the float64 reference on the CPU; on
    the GPU the rows decoded to float32 for the float32 SDDMM (or float64 for float64 x)."""
    dt = value_dtype(x.dtype)
    if not is_cupy_array(x):
        return ref.sddmm_values(pattern.parts, pattern.tile_n, x, rows.dequantize(np.float64), dt, False)
    decoded = decoded_for_fallback(rows, dt, "gated FFN")
    parts, _ = _sddmm_parts(x.astype(decoded.dtype, copy=False), decoded, pattern, scale=False)
    return _cast_parts(parts, dt)


def sddmm(x: Any, y: Any, pattern: twell_array) -> twell_array:
    """Sampled dense-dense product: ``(x @ y.T)`` at the stored entries of ``pattern``.

    Parameters
    ----------
    x : array_like, shape (M, K)
    y : array_like, shape (N, K)
    pattern : twell_array, shape (M, N)
        Only its structure is used (stored entries, explicit zeros included).

    Returns
    -------
    twell_array
        Same structure as ``pattern`` (its structure arrays shared, not copied: see
        docs/FORMAT.md), dtype ``result_type(x.dtype, y.dtype)``.
    """
    if not isinstance(pattern, twell_array):
        raise TypeError(f"pattern: expected a twell_array, got {type(pattern).__name__}")
    xx, yy = _dense(x, "x"), _dense(y, "y")
    _same_device("pattern", pattern.data, x=xx, y=yy)
    m, n = pattern.shape
    if xx.shape[0] != m:
        raise ValueError(f"x: expected {m} rows like pattern {pattern.shape}, got {xx.shape[0]}")
    if yy.shape[0] != n:
        raise ValueError(f"y: expected {n} rows (pattern's columns), got {yy.shape[0]}")
    if yy.shape[1] != xx.shape[1]:
        raise ValueError(f"y: expected {xx.shape[1]} columns like x, got {yy.shape[1]}")
    parts, _ = _sddmm_parts(xx, yy, pattern, scale=False)
    return twell_array._from_parts(parts, pattern.shape, pattern.tile_n)


def linear_to_twell(
    x: Any,
    weight: Any,
    *,
    activation: str = "relu",
    tile_n: int = 256,
    capacity: int | None = None,
    threshold: float | None = None,
    overflow: str = "spill",
) -> twell_array:
    """``act(x @ weight.T)`` packed into TwELL (the sparse producer of an FFN's hidden layer).

    Parameters
    ----------
    x : array_like, shape (M, K)
    weight : array_like, shape (F, K)
        ``torch.nn.Linear`` layout (out_features, in_features).
    activation : {"relu", "relu2", "silu", "gelu", "identity"}
    tile_n, capacity, overflow
        As for :class:`twell_array`.
    threshold : float, optional
        Keep entries with ``|act(z)| > threshold`` (needed for sparsity with silu/gelu).

    Returns
    -------
    twell_array
        M x F, dtype ``result_type(x.dtype, weight.dtype)``.
    """
    act = check_activation(activation)
    tile_n, capacity, overflow = check_layout(tile_n, capacity, overflow)
    thr = check_threshold(threshold)
    xx, ww = _dense(x, "x"), _dense(weight, "weight")
    _same_device("x", xx, weight=ww)
    if ww.shape[1] != xx.shape[1]:
        raise ValueError(f"weight: expected {xx.shape[1]} columns (x's features), got shape {tuple(ww.shape)}")
    _, finish = linear_to_parts_deferred(xx, ww, act, tile_n, capacity, thr)
    parts, dropped = finish(overflow)
    return twell_array._from_parts(parts, (xx.shape[0], ww.shape[0]), tile_n, int(dropped))


def linear_to_parts_deferred(
    x: Any, w: Any, act: str, tile_n: int, capacity: int, threshold: float | None
) -> tuple[TwELLParts, DeferredFinish]:
    """The producer with its overflow policy applied later, as :func:`pack_preactivation_deferred`
    gives it: ``(first, finish)``, so that a caller can queue work on ``first`` before
    ``finish`` reads the overflow count back. Internal: the operands are trusted."""
    if is_cupy_array(x):
        from . import _gpu_producer, _hopper_producer

        if _hopper_producer.applies(x, w, act, threshold, tile_n, capacity):
            return _hopper_producer.linear_to_parts_deferred(x, w, act, tile_n, capacity, threshold)
        if _gpu_producer.applies(x, w, act, threshold):
            _, first, finish = _gpu_producer.relu_linear_to_parts_deferred(x, w, tile_n, capacity)
            return first, finish
    z = preactivation(x, w)
    return pack_preactivation_deferred(z, result_dtype(x.dtype, w.dtype), act, tile_n, capacity, threshold)


def preactivation(x: Any, w: Any, relu: bool = False) -> Any:
    """``x @ w.T`` (``relu(x @ w.T)`` with ``relu``, in the GEMM's epilogue on the GPU): cuBLAS in
    the inputs' dtype on the GPU, float64 on the CPU (the reference)."""
    dt = result_dtype(x.dtype, w.dtype)
    if is_cupy_array(x):
        from . import _gpu_ops

        return _gpu_ops.gemm_nt(x.astype(dt, copy=False), w.astype(dt, copy=False), relu=relu)
    z = x.astype(np.float64) @ w.astype(np.float64).T
    return np.maximum(z, 0.0) if relu else z


def pack_preactivation(
    z: Any, dtype: Any, act: str, tile_n: int, capacity: int, threshold: float | None, overflow: str
) -> tuple[TwELLParts, int]:
    """Pack ``act(z)`` (rounded to ``dtype``) into TwELL parts: the producer's second half."""
    if is_cupy_array(z):
        return conv.dense_to_twell(z, tile_n, capacity, overflow, threshold, act)
    return ref.pack_dense(ref.activation(z, act).astype(dtype), tile_n, capacity, overflow, threshold)


def pack_preactivation_deferred(
    z: Any, dtype: Any, act: str, tile_n: int, capacity: int, threshold: float | None
) -> tuple[TwELLParts, DeferredFinish]:
    """:func:`pack_preactivation` with the overflow policy applied later: ``(first, finish)``,
    ``first`` exact unless some row-tile overflowed (then ``finish(overflow)`` returns parts
    that differ from it). On the CPU ``first`` is already complete, and ``finish`` ignores the
    GPU's fixed ``spill_capacity`` (nothing is ever left out there)."""
    if is_cupy_array(z):
        from . import _gpu_convert

        return _gpu_convert.dense_to_parts_deferred(z, tile_n, capacity, threshold, act)
    spilled = pack_preactivation(z, dtype, act, tile_n, capacity, threshold, "spill")

    def pack(overflow: str) -> tuple[TwELLParts, int]:
        return pack_preactivation(z, dtype, act, tile_n, capacity, threshold, overflow)

    return spilled[0], _CompleteFinish(spilled, pack)


class _CompleteFinish:
    """The CPU's :class:`DeferredFinish`: the parts are complete after pass 1 (``spilled``, the
    "spill" policy's result); another policy packs again (``pack(overflow)``)."""

    def __init__(self, spilled: tuple[TwELLParts, int], pack: Callable[[str], tuple[TwELLParts, int]]) -> None:
        self.spilled, self.pack = spilled, pack

    def __call__(self, overflow: str, spill_capacity: int | None = None) -> tuple[TwELLParts, int]:
        return self.spilled if overflow == "spill" else self.pack(overflow)

    def count_now(self) -> None:
        """Nothing to read back on the CPU."""


def tail_then_finish(
    first: TwELLParts, finish: DeferredFinish, tail: Callable[[TwELLParts], Any]
) -> tuple[Any, TwELLParts]:
    """The exact sparse path after a deferred producer: ``tail(first)`` (the row-tiles' first
    ``capacity`` entries) is queued while the host reads the overflow count, sent right behind
    the pack so the wait ends before the tail does; only if entries spilled does ``tail`` run
    again on the complete parts. Returns ``(tail's result, the complete parts)``."""
    finish.count_now()
    result = tail(first)
    parts, _ = finish("spill")
    if parts.spill_data.size != first.spill_data.size:
        result = tail(parts)
    return result, parts


def values_op(fn: Any, *arrays: Any) -> Any:
    """Elementwise ``fn`` on value arrays, computed in float32 (float64 for float64 inputs)."""
    dt = arrays[0].dtype
    wide = np.float64 if dt == np.float64 else np.float32
    return fn(*(a.astype(wide) for a in arrays)).astype(dt)


def with_values(pattern: twell_array, data: Any, spill: Any) -> twell_array:
    """A TwELL matrix with ``pattern``'s structure and the given slot and spill values."""
    parts = pattern.parts._replace(data=data, spill_data=spill)
    return twell_array._from_parts(parts, pattern.shape, pattern.tile_n)


def product_values(a: twell_array, b: twell_array) -> twell_array:
    """``a * b`` for two TwELL matrices of one structure, each product rounded to a's dtype."""
    mul: Callable[[Any, Any], Any] = lambda p, q: values_op(lambda u, v: u * v, p, q)  # noqa: E731
    if is_cupy_array(a.data) and a.dtype == b.dtype:
        from . import _gpu_ops

        # One fused pass (fp32 product, rounded once), the same numbers as values_op's four.
        mul = functools.partial(_gpu_ops.act_mul, activation="identity", threshold=None)
    return with_values(a, mul(a.data, b.data), mul(a.spill_data, b.spill_data))


def gated_product(
    x: Any, w_lin: Any, w_down_t: Any, gate: twell_array, keep_up: bool = False, out: Any = None
) -> tuple[Any, twell_array | None]:
    """The gated FFN after its gate: ``u = x @ w_lin.T`` at the gate's pattern (rounded to the
    value type), ``h = gate * u`` (rounded), ``out = h @ w_down_t`` (``w_lin`` and ``w_down_t``
    dense or :class:`QuantizedRows`).

    On the GPU, when the operands share a dtype and have 16-byte rows, one kernel for u and h
    then the down SpMM (``_gpu_ops.gated_consumer``), else SDDMM, product and SpMM. Returns ``(out, u)``, ``u``
    only when ``keep_up`` (the backward pass needs it), else None. ``out`` (optional, trusted:
    the result's shape and dtype, unit column stride) is written in place.
    """
    if is_cupy_array(x):
        from . import _gpu_ops
        from ._gpu_convert import row_stride

        # Unit column strides once (a transposed weight is copied here, not again in the kernel's launch).
        x = row_stride(x)[0]
        w_lin, w_down_t = (w if isinstance(w, QuantizedRows) else row_stride(w)[0] for w in (w_lin, w_down_t))
        if gate.dtype == x.dtype and _gpu_ops.gated_consumer_eligible(x, w_lin, w_down_t):
            out, up = _gpu_ops.gated_consumer(gate.parts, gate.tile_n, x, w_lin, w_down_t, keep_up, out=out)
            return out, (twell_array._from_parts(up, gate.shape, gate.tile_n) if up is not None else None)
    if isinstance(w_lin, QuantizedRows):
        u_parts = _sddmm_quantized_rows(x, w_lin, gate)
    else:
        u_parts, _ = _sddmm_parts(x, w_lin, gate, scale=False)
    u = twell_array._from_parts(u_parts, gate.shape, gate.tile_n)
    h = product_values(gate.astype(u.dtype), u)
    return matmul(h, w_down_t, out=out), (u if keep_up else None)


def fused_gated_backward(
    grad_out: Any, w_down_t: Any, g: twell_array, u: twell_array
) -> tuple[twell_array, twell_array, twell_array] | None:
    """``(d_z, d_u, h)`` of the gated backward (relu or identity activation) from one kernel,
    ``_gpu_ops.sddmm_gated_backward``: the values that ``sddmm(grad_out, w_down_t, g)`` and the
    three :func:`product_values` give. None where that kernel cannot run (the CPU, mixed
    dtypes, rows that are not 16-byte multiples): the caller takes the unfused path."""
    if not is_cupy_array(grad_out) or not grad_out.dtype == w_down_t.dtype == g.dtype == u.dtype:
        return None
    from . import _gpu_ops
    from ._gpu_convert import row_stride

    if not _gpu_ops.rows_aligned(row_stride(grad_out), row_stride(w_down_t)):
        return None
    parts = _gpu_ops.sddmm_gated_backward(g.parts, g.tile_n, grad_out, w_down_t, u.parts)
    d_z, d_u, h = (twell_array._from_parts(p, g.shape, g.tile_n) for p in parts)
    return d_z, d_u, h


def tiled_gated_backward(
    grad_out: Any, w_down_t: Any, g: twell_array, u: twell_array, w_gate: Any, w_up: Any
) -> tuple[Any, twell_array, twell_array, twell_array] | None:
    """``(dx, d_z, d_u, h)`` of the gated backward (relu or identity activation) on one
    tensor-core pack of the gate (``_tiled_ffn.gated_backward``), where ``_tiled_ffn`` is
    switched on and serves the operands; else None."""
    if not is_cupy_array(grad_out) or not grad_out.dtype == w_down_t.dtype == g.dtype == u.dtype == w_up.dtype:
        return None
    from . import _tiled_ffn

    if not _tiled_ffn.chosen_backward(g.parts, grad_out, w_down_t, u.parts, w_gate, w_up):
        return None
    dx, *parts = _tiled_ffn.gated_backward(g.parts, g.tile_n, grad_out, w_down_t, u.parts, w_gate, w_up)
    d_z, d_u, h = (twell_array._from_parts(p, g.shape, g.tile_n) for p in parts)
    return dx, d_z, d_u, h


def gather_tail_eligible(x: Any, w_lin: Any, w_down_t: Any, dtype: Any) -> bool:
    """Whether an FFN block's tail can run on the row-gather kernels alone: on the GPU, one
    dtype, 16-byte rows (gated: the gated consumer's operands; non-gated: W_down's rows), or
    weight rows as :class:`QuantizedRows` that the e4m3 kernels take. Those tails take parts
    with a fixed-length spill (read through its row pointers; the other kernels take its length
    from the arrays). The ReLU-mask-driven tails have their own test
    (``_gpu_ops.mask_consumer_eligible``: 2-byte rows only)."""
    if not is_cupy_array(x):
        return False
    from . import _gpu_ops
    from ._gpu_convert import row_stride

    if w_lin is not None:
        return x.dtype == dtype and _gpu_ops.gated_consumer_eligible(x, w_lin, w_down_t)
    if isinstance(w_down_t, QuantizedRows):
        return x.dtype == dtype and _gpu_ops.quantized_rows_serve(w_down_t, dtype)
    return x.dtype == dtype == w_down_t.dtype and _gpu_ops.rows_aligned(row_stride(w_down_t))


def dense_ffn_tail(
    x: Any, z: Any, w_lin: Any, w_down: Any, dtype: Any, act: str, threshold: float | None, activated: bool = False
) -> Any:
    """The dense remainder of an FFN block given the activation's pre-activations ``z``:
    ``(keep(act(z)) [* x @ w_lin.T]) @ w_down.T`` (the automatic fallback above break-even).

    ``activated``: ``z`` already holds ``act(z)`` rounded to ``dtype`` (the cuBLASLt ReLU
    epilogue made it), so the non-gated block without a threshold goes straight to its down GEMM.
    """
    if is_cupy_array(z):
        from . import _gpu_ops

        if activated and w_lin is None and threshold is None and z.dtype == dtype:
            return _gpu_ops.gemm_nt(z, w_down.astype(dtype, copy=False))
        z = z.astype(dtype, copy=False)  # mixed weights: z is in x's and the activation's dtype
        z_lin = (
            None if w_lin is None else _gpu_ops.gemm_nt(x.astype(dtype, copy=False), w_lin.astype(dtype, copy=False))
        )
        h = _gpu_ops.act_mul(z, z_lin, act, threshold)
        return _gpu_ops.gemm_nt(h, w_down.astype(dtype, copy=False))
    h = ref.activation(z, act).astype(dtype).astype(np.float64)
    h = np.where(ref.keep_mask(h, threshold), h, 0.0)
    if w_lin is not None:
        h = h * (x.astype(np.float64) @ w_lin.astype(np.float64).T)
    return (h @ w_down.astype(np.float64).T).astype(dtype)
