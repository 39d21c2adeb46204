"""GPU products of TwELL parts with dense CuPy matrices (raw kernels plus cuBLAS)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _kernels as K
from . import _stationary, _tiled_ffn, _tiled_spmm, _tiled_up
from ._backend import bfloat16, cupy_module, is_cupy_array
from ._errors import TwELLFallbackWarning, warn
from ._gpu_convert import SegmentPlan, TransposedPattern, leading_dim, row_stride, rows_aligned, transposed_pattern
from ._parts import TwELLParts
from ._quantize import QuantizedRows


def _cp() -> Any:
    cp = cupy_module()
    assert cp is not None
    return cp


def _matrix_args(parts: TwELLParts) -> tuple:
    """The parts in the order every product kernel takes them."""
    return (parts.data, parts.indices, parts.counts, parts.spill_indptr, parts.spill_indices, parts.spill_data)


def _geometry(parts: TwELLParts, tile_n: int) -> tuple:
    return (*_matrix_args(parts), np.int32(parts.data.shape[1]), np.int32(tile_n), np.int32(parts.data.shape[2]))


def _k_grid(k: int) -> int:
    return -(-k // (K.SPMM_THREADS * K.SPMM_VPT))


#: The paths of the product kernels: "gather" (twell_gather.cu, one warp per row, 16-byte row
#: gathers; needs rows_aligned operands) and "portable" (any layout). "auto" takes gather when the
#: operands allow it, else portable.
PATHS = ("auto", "gather", "portable")


def _choose_path(path: str, gather_ok: bool, op: str) -> str:
    if path not in PATHS:
        raise ValueError(f"path: expected one of {', '.join(map(repr, PATHS))}, got {path!r}")
    if path == "gather" and not gather_ok:
        raise ValueError("path: 'gather' needs 16-byte-aligned operand rows whose length is a multiple of 16 bytes")
    if path == "auto":
        if not gather_ok:
            warn_portable(op)
        return "gather" if gather_ok else "portable"
    return path


def warn_portable(op: str) -> None:
    """Say that ``op`` runs its portable kernel because an operand lacks 16-byte rows."""
    warn(
        f"{op}: an operand's rows are not 16-byte aligned multiples of 16 bytes, so the portable "
        "kernel runs, several times slower than the row-gather one; pad the feature dimension to "
        "a multiple of 8 values (bf16/fp16), 4 (fp32) or 2 (fp64) for the fast path",
        TwELLFallbackWarning,
    )


def _variant(variant: tuple[int, int] | None, kind: str) -> tuple[int, int]:
    """(KV, U) of a gather kernel: the given one or the kind's default."""
    kv, u = variant or K.GATHER_DEFAULT[kind]
    return kv, u


def _gather_grid(m: int) -> tuple[tuple[int], tuple[int]]:
    """Grid and block of a row-gather kernel over ``m`` warps, ``_kernels.GATHER_WARPS`` a block."""
    return (-(-m // K.GATHER_WARPS),), (32 * K.GATHER_WARPS,)


#: The order's buckets (``TWELL_ORDER_BUCKETS`` in cuda/twell_gather.cu): rows of 0-14 batches,
#: then 15 or more.
ORDER_BUCKETS = 16


def row_order(parts: TwELLParts) -> Any:
    """The ``order`` argument of the row-gather kernels over ``parts``' rows: in a build that reads
    it (``_kernels.GATHER_ROW_ORDER``: ``TWELL_GATHER_ROW_ORDER=1`` at import) the rows longest
    first (:func:`longest_first`), else a null pointer, which the default build never reads
    (index order). bench/NOTES.md, thirty-third session, item 9: a block of rows holds its
    slots until its longest row ends, and rows launched in index order leave long ones for the
    last wave. Off until measured."""
    if not K.GATHER_ROW_ORDER or parts.counts.shape[0] == 0:
        return K.null_pointer()
    return longest_first(parts)


def longest_first(parts: TwELLParts) -> Any:
    """An int32 permutation of ``parts``' rows, those with more batches of 32 entries first
    (``twell_row_buckets``, ``twell_row_scatter``: a memset and two launches; rows of one bucket
    in any order)."""
    m, nt = parts.counts.shape
    cp = _cp()
    order = cp.empty(m, dtype=cp.int32)
    if m == 0:
        return order
    counters = cp.zeros(2 * ORDER_BUCKETS, dtype=cp.int32)  # bucket sizes, then the scatter's cursors
    bucket = cp.empty(m, dtype=cp.uint8)
    args = (parts.counts, parts.spill_indptr, np.int32(nt), np.int32(m), bucket, counters)
    K.launch("twell_row_buckets", 32 * m, 256, args)
    K.launch("twell_row_scatter", m, 256, (bucket, counters, np.int32(m), order))
    return order


def spmm(
    parts: TwELLParts,
    tile_n: int,
    b: Any,
    out: Any,
    path: str = "auto",
    variant: tuple[int, int] | None = None,
    second: tuple[TwELLParts, Any] | None = None,
) -> Any:
    """``out = A @ b``; ``b`` (N x K) and ``out`` (M x K) share A's dtype, out has unit column stride.

    ``path``: one of :data:`PATHS`, "stationary" (``_stationary``; with ``second`` its dual
    form; "auto" takes it where ``_stationary.chosen`` says so) or "tiled" (``_tiled_spmm``, the
    tensor cores; Hopper only; "auto" takes it only where ``_tiled_spmm.chosen`` says so).
    ``variant``: the gather kernel's (KV, U) instantiation (one of ``_kernels.GATHER_VARIANTS``;
    default ``GATHER_DEFAULT["spmm"]``). ``second``: ``(parts2, b2)``, a matrix of A's structure
    (other values) and its dense operand: ``out = A @ b + A2 @ b2``, summed in the same fp32
    accumulators on the gather path.
    """
    m = parts.data.shape[0]
    b, ldb = row_stride(b)  # once: the stationary check and kernel then take b as it is
    b2 = None if second is None else second[1]
    if path == "tiled" and not _tiled_spmm.applies(b, out, b2):
        raise ValueError(
            "path: 'tiled' needs 2-byte values of one dtype and 16-byte-aligned rows of a multiple of 16 bytes "
            f"on a compute-capability 9.0 GPU; got {b.dtype} b of shape {b.shape} and {out.dtype} out"
        )
    if path == "tiled" or (path == "auto" and _tiled_spmm.chosen(b, out, b2)):
        return _tiled_spmm.spmm(parts, tile_n, b, out, second)
    fits = _stationary.fits(parts, second is not None)  # its int32 row pointers
    if path == "stationary" and not (fits and _stationary.applies(b.shape[0], b, out, b2, tile_n)):
        raise ValueError(
            "path: 'stationary' needs 2-byte values, 16-byte-aligned rows, b with columns, a 16-column slice "
            f"of b (b.shape[0] * 32 bytes) that fits in shared memory in at most {_stationary.MAX_BANDS} column "
            f"bands of whole row-tiles and fewer than 2**31 packed words; got {b.dtype} b of shape {b.shape}"
        )
    if path == "stationary" or (path == "auto" and fits and _stationary.chosen(m, b.shape[0], b, out, b2, tile_n)):
        return _stationary.spmm(parts, tile_n, b, out, second)
    k = b.shape[1]
    ldo = np.int64(leading_dim(out))
    b2, ldb2 = row_stride(second[1]) if second is not None else (None, 0)
    gather_ok = rows_aligned((b, ldb), (out, int(ldo)), *([(b2, ldb2)] if second is not None else []))
    path = _choose_path(path, gather_ok, "matmul")
    if path == "gather":
        kv, u = _variant(variant, "spmm")
        nt, cap = parts.data.shape[1:]
        geometry = (np.int32(m), np.int32(nt), np.int32(tile_n), np.int32(cap))
        null = K.null_pointer()
        extra: tuple[Any, ...] = (null, null, null, np.int64(0))
        if second is not None:
            cp = _cp()  # the second values are read at the first's slot positions: same layout
            extra = (
                cp.ascontiguousarray(second[0].data),
                cp.ascontiguousarray(second[0].spill_data),
                b2,
                np.int64(ldb2),
            )
        args = (*_matrix_args(parts), *geometry, b, np.int64(ldb), np.int32(k), out, ldo, *extra, row_order(parts))
        kind = "spmm" if second is None else "spmm_sum"
        K.launch_grid(K.gather_expression(kind, b.dtype, kv, u), *_gather_grid(m), args)
        return out
    if second is not None:  # the portable kernel takes one operand: a second launch and a sum
        from ._ops import values_op

        spmm(parts, tile_n, b, out, path)
        out2 = spmm(second[0], tile_n, second[1], _cp().empty_like(out), path)
        out[...] = values_op(lambda p, q: p + q, out, out2)
        return out
    expr = f"twell_spmm<{K.CXX_TYPE[b.dtype]}, {K.SPMM_VPT}>"
    K.launch_grid(
        expr, (m, _k_grid(k)), (K.SPMM_THREADS,), (*_geometry(parts, tile_n), b, np.int64(ldb), np.int32(k), out, ldo)
    )
    return out


def spmm_e4m3(
    parts: TwELLParts, tile_n: int, q: Any, scales: Any, out: Any, variant: tuple[int, int] | None = None
) -> Any:
    """``out = A @ B`` with ``B``'s rows as e4m3 codes ``q`` (N x K uint8, C-contiguous, K a
    multiple of 8) and float32 row ``scales`` (``_quantize.QuantizedRows``); A and ``out`` in a
    2-byte dtype, ``out`` with 16-byte-aligned rows of unit column stride (the caller checks)."""
    m = parts.data.shape[0]
    k = q.shape[1]
    ldo = np.int64(leading_dim(out))
    kv, u = _variant(variant, "spmm_e4m3")
    nt, cap = parts.data.shape[1:]
    geometry = (np.int32(m), np.int32(nt), np.int32(tile_n), np.int32(cap))
    args = (*_matrix_args(parts), *geometry, q, scales, np.int64(k), np.int32(k), out, ldo, row_order(parts))
    K.launch_grid(K.gather_expression("spmm_e4m3", parts.data.dtype, kv, u), *_gather_grid(m), args)
    return out


def quantized_rows_serve(rows: Any, dtype: Any) -> bool:
    """Whether :func:`spmm_e4m3` takes ``rows`` (``_quantize.QuantizedRows``) for products in
    ``dtype``: codes on the GPU, a 2-byte ``dtype``, rows of a multiple of 8 codes."""
    return is_cupy_array(rows.data) and np.dtype(dtype).itemsize == 2 and rows.shape[1] % 8 == 0


def down_spmm(parts: TwELLParts, tile_n: int, w_down: Any, out: Any) -> Any:
    """``out = A @ w_down`` for an FFN block's down projection: :func:`spmm` ("auto") on a dense
    ``w_down`` (N x K), :func:`spmm_e4m3` on ``_quantize.QuantizedRows`` (the caller checked
    :func:`quantized_rows_serve`; an ``out`` whose rows are not 16-byte aligned gets the result
    copied in)."""
    if not isinstance(w_down, QuantizedRows):
        return spmm(parts, tile_n, w_down, out)
    if out.strides[1] == out.itemsize and rows_aligned((out, leading_dim(out))):
        return spmm_e4m3(parts, tile_n, w_down.data, w_down.scales, out)
    out[...] = spmm_e4m3(parts, tile_n, w_down.data, w_down.scales, _cp().empty(out.shape, dtype=out.dtype))
    return out


def quantize_rows_e4m3(b: Any) -> tuple[Any, Any]:
    """``(codes, scales)`` of ``b``'s rows (``cuda/twell_quantize.cu``): uint8 (N x K),
    C-contiguous, and float32 (N,)."""
    cp = _cp()
    b, ldb = row_stride(b)
    n, k = b.shape
    codes = cp.empty((n, k), dtype=cp.uint8)
    scales = cp.empty(n, dtype=cp.float32)
    rows_per_block = 8  # 256 threads, a warp per row
    K.launch_grid(
        f"twell_quantize_rows_e4m3<{K.CXX_TYPE[b.dtype]}>",
        (-(-n // rows_per_block),),
        (32 * rows_per_block,),
        (b, np.int64(ldb), np.int32(n), np.int32(k), codes, np.int64(k), scales),
    )
    return codes, scales


#: Warps that share each output row's column passes in the transposed products' row-gather
#: kernel (its grid's y); the split's sums are bitwise the same. 2: in every same-run A/B of the
#: backward's three products at 16384 tokens (``bench/stage_times.py``, "bwd 3 transposed
#: products" against "..., columns split", now "..., columns whole" with the split the default;
#: bench/results/2026-12-0[45]-stages.jsonl) the split
#: tied at 0.5% (0.674-0.740 ms either way) and won 3-4% at 1% and 2% (1.171 -> 1.129-1.133 ms
#: and 2.097-2.102 -> 2.022-2.027 on the H200, 1.303-1.313 -> 1.255-1.263 and 2.333-2.351 ->
#: 2.281-2.286 on the H100). It also halves the longest rows, hot units' (their entries are one
#: warp's work), where the paired product makes two column passes (d_model 2048).
TRANSPOSED_COLUMN_SPLIT = 2


def column_warps(split: int, k: int, kv: int, itemsize: int) -> int:
    """Warps per output row of the transposed products' kernel for a ``split``: at most its
    column passes over ``k`` columns (``KV`` 16-byte vectors per lane, 32 lanes), at least 1."""
    passes = -(-k // (kv * 32 * (16 // itemsize)))
    return max(1, min(split, passes))


def _segment_arguments(plan: SegmentPlan | None, products: int, k: int, dtype: Any) -> tuple[tuple, int]:
    """The cut transposed products' extra kernel arguments (``split_base, slot_row, slots,
    run_length, partial, tickets``) and their slot count (none and 0 without a plan): the fp32
    (float64 for float64) partial rows of every product and the tickets, zeroed, that the
    call's warps draw."""
    if plan is None:
        return (), 0
    cp = _cp()
    acc = cp.float64 if np.dtype(dtype) == np.float64 else cp.float32
    partial = cp.empty((products * plan.slots, k), dtype=acc)
    tickets = cp.zeros(plan.slots, dtype=cp.uint32)
    head = (plan.split_base, plan.slot_row, np.int32(plan.slots), plan.run_length)
    return (*head, partial, tickets), plan.slots


def spmm_transposed(
    parts: TwELLParts,
    tile_n: int,
    n_cols: int,
    g: Any,
    out: Any,
    pattern: Callable[[], TransposedPattern] | None = None,
    second: tuple[TwELLParts, Any] | None = None,
    column_split: int | None = None,
) -> Any:
    """``out = A.T @ g``; ``g`` (M x K), ``out`` (N x K).

    With 16-byte rows (``rows_aligned``) the entries are placed in the CSR structure of ``A.T``
    (:func:`transposed_pattern`, a counting sort with no host read) and a row-gather kernel sums
    each output row in one warp, reading A's values where they are (a row the pattern's
    :class:`SegmentPlan` cuts is summed in runs by several warps, then added up in run order:
    the same bits in every call); other layouts scatter with
    fp32 atomics into a workspace (the summation order, and so the last bits, can then vary
    between runs). ``pattern`` returns the shared :class:`TransposedPattern` of A's structure
    (built on first use by the caller's products), so products on one pattern sort once.
    ``second = (parts2, out2)``: also ``out2 = A2.T @ g`` for A2 of A's structure, in the same
    pass on the gather path (each row of g read once for both). ``column_split``: warps per
    output row on the gather path, each taking every ``column_split``-th column pass (default
    :data:`TRANSPOSED_COLUMN_SPLIT`; capped at the passes, as more would only idle).
    """
    cp = _cp()
    split = TRANSPOSED_COLUMN_SPLIT if column_split is None else column_split
    if isinstance(split, bool) or not isinstance(split, int) or split < 1:
        raise ValueError(f"column_split: expected a positive integer, got {split!r}")
    m = parts.data.shape[0]
    g, ldg = row_stride(g)
    k = g.shape[1]
    ldo_out = leading_dim(out)
    operands, outs = ([parts], [out]) if second is None else ([parts, second[0]], [out, second[1]])
    if (
        rows_aligned((g, ldg), *((o, ldo_out) for o in outs))
        and all(o.strides == out.strides for o in outs)
        and all(p.data.dtype == g.dtype for p in operands)
    ):
        tp = pattern() if pattern else transposed_pattern(parts, tile_n, n_cols)
        values = [cp.ascontiguousarray(parts.data), np.int64(tp.n_slots), parts.spill_data]
        if second is None:
            kind, values2, out2 = "csr_spmm", [K.null_pointer()] * 2, K.null_pointer()
        else:
            kind, out2 = "csr_spmm_pair", second[1]
            values2 = [cp.ascontiguousarray(second[0].data), second[0].spill_data]
        args = (tp.indptr, tp.rows, tp.sources, *values, *values2, np.int32(n_cols), g, np.int64(ldg), np.int32(k))
        kv, u = K.GATHER_DEFAULT[kind]
        expr = K.gather_expression(kind if tp.segments is None else f"{kind}_cut", g.dtype, kv, u)
        runs, slots = _segment_arguments(tp.segments, len(outs), k, g.dtype)
        (blocks,), threads = _gather_grid(slots + n_cols)
        grid = (blocks, column_warps(split, k, kv, g.itemsize))
        K.launch_grid(expr, grid, threads, (*args, out, out2, np.int64(ldo_out), *runs))
        return out
    if second is not None:  # the portable path: one product at a time
        spmm_transposed(second[0], tile_n, n_cols, g, second[1], pattern)
    warn_portable("matmul (transposed)")
    acc = cp.float64 if g.dtype == cp.float64 else cp.float32
    ws = cp.zeros((n_cols, k), dtype=acc)
    t = K.CXX_TYPE[g.dtype]
    K.launch_grid(
        f"twell_spmm_t<{t}, {K.SPMM_VPT}>",
        (m, _k_grid(k)),
        (K.SPMM_THREADS,),
        (*_geometry(parts, tile_n), g, np.int64(ldg), np.int32(k), ws),
    )
    ldo = np.int64(leading_dim(out))
    K.launch(f"twell_cast_from_acc<{t}>", n_cols * k, 256, (ws, np.int64(n_cols), np.int32(k), out, ldo))
    return out


def sddmm(
    parts: TwELLParts,
    tile_n: int,
    x: Any,
    y: Any,
    scale: bool,
    path: str = "auto",
    variant: tuple[int, int] | None = None,
) -> TwELLParts:
    """Parts with the pattern of ``parts`` and values ``x[i] . y[j]`` (times the pattern's when
    ``scale``); x, y (and the pattern, when ``scale``) share one dtype (without ``scale`` the
    pattern's values are not read). ``path`` and ``variant`` as for :func:`spmm`."""
    cp = _cp()
    m, nt, cap = parts.data.shape
    x, ldx = row_stride(x)
    y, ldy = row_stride(y)
    k = np.int32(x.shape[1])
    t, s = K.CXX_TYPE[x.dtype], "true" if scale else "false"
    data = cp.empty(parts.data.shape, dtype=x.dtype)  # the pattern's dtype may differ
    path = _choose_path(path, rows_aligned((x, ldx), (y, ldy)), "sddmm")
    if path == "gather":
        spill = cp.empty(parts.spill_data.shape, dtype=x.dtype)
        geometry = (np.int32(m), np.int32(nt), np.int32(tile_n), np.int32(cap))
        args = (*_matrix_args(parts), *geometry, x, np.int64(ldx), y, np.int64(ldy), k, data, spill, row_order(parts))
        kv, u = _variant(variant, "sddmm")
        K.launch_grid(K.gather_expression("sddmm", x.dtype, kv, u, scale), *_gather_grid(m), args)
        return parts._replace(data=data, spill_data=spill)
    args = (
        x,
        np.int64(ldx),
        y,
        np.int64(ldy),
        k,
        parts.data,
        parts.indices,
        parts.counts,
        np.int32(m),
        np.int32(nt),
        np.int32(tile_n),
        np.int32(cap),
        data,
    )
    K.launch(f"twell_sddmm_slots<{t}, {s}>", m * nt * 32, 256, args)
    spill = cp.empty(parts.spill_data.shape, dtype=x.dtype)
    K.launch(
        f"twell_sddmm_spill<{t}, {s}>",
        int(spill.size) * 32,
        256,
        (
            x,
            np.int64(ldx),
            y,
            np.int64(ldy),
            k,
            parts.spill_indptr,
            parts.spill_indices,
            parts.spill_data,
            np.int32(m),
            spill,
        ),
    )
    return parts._replace(data=data, spill_data=spill)


def mask_consumer_eligible(x: Any, w_lin: Any, w_down_t: Any, dtype: Any) -> bool:
    """Whether :func:`mask_consumer` takes these operands: dense weights (its kernels gather
    2-byte rows, not ``_quantize.QuantizedRows``) of ``dtype`` with 16-byte rows (gated: x and
    both weights; non-gated: ``w_down_t``)."""
    weights = (w_down_t,) if w_lin is None else (w_lin, w_down_t)
    if x.dtype != dtype or any(isinstance(w, QuantizedRows) or w.dtype != dtype for w in weights):
        return False
    return rows_aligned(*(row_stride(a) for a in (weights if w_lin is None else (x, *weights))))


def mask_consumer(
    z: Any, mask: Any, mask_words: int, x: Any, w_lin: Any, w_down_t: Any, variant: tuple[int, int] | None = None
) -> Any:
    """The FFN block's tail driven by the cuBLASLt ReLU bit-mask, without a TwELL pack: the set
    bits of ``mask`` (``mask_words`` uint32 words per row) are the active units, ``z`` (M x F)
    holds ``relu(x @ w_act.T)``. Gated (``w_lin`` given): ``out = (z * (x @ w_lin.T)) @ w_down_t``
    at those units, with the TwELL path's roundings; ``z``'s active entries are overwritten with
    the products. Non-gated: ``out = z @ w_down_t`` at those units. Operands as
    :func:`mask_consumer_eligible` takes them."""
    cp = _cp()
    z, ldz = row_stride(z)
    w_down_t, ldd = row_stride(w_down_t)
    m, n = z.shape
    k_out = w_down_t.shape[1]
    out = cp.empty((m, k_out), dtype=z.dtype)
    head = (mask, np.int64(mask_words), z, np.int64(ldz), np.int32(m), np.int32(n))
    tail = (w_down_t, np.int64(ldd), np.int32(k_out), out, np.int64(k_out))
    if w_lin is None:
        kv, u = variant or K.GATHER_DEFAULT["spmm"]
        K.launch_grid(K.gather_expression("mask_spmm", z.dtype, kv, u), *_gather_grid(m), (*head, *tail))
        return out
    x, ldx = row_stride(x)
    w_lin, ldu = row_stride(w_lin)
    kv, u = variant or K.GATHER_DEFAULT["gated_up"]
    args = (*head, x, np.int64(ldx), w_lin, np.int64(ldu), np.int32(x.shape[1]), *tail)
    K.launch_grid(K.gather_expression("mask_gated", z.dtype, kv, u), *_gather_grid(m), args)
    return out


def _takes_tiled_up(
    path: str, gate: TwELLParts, x: Any, w: Any, operands: str, backward: bool = False, quantized: bool = False
) -> bool:
    """Whether a product of the tiled up projection's shape (the gated up projection, or with
    ``backward`` the backward's sampled product) runs on ``_tiled_up``'s kernel: ``path`` "tiled"
    always (a ValueError naming ``operands`` where it cannot), "gather" never, "auto" where
    :func:`_tiled_up.chosen` takes it (never for ``quantized`` weight rows)."""
    if path not in ("auto", "gather", "tiled"):
        raise ValueError(f"path: expected 'auto', 'gather' or 'tiled', got {path!r}")
    if path == "tiled":
        if quantized or not _tiled_up.applies(gate, x, w):
            raise ValueError(f"path: 'tiled' needs 2-byte {operands} with 16-byte rows on a compute-capability 9.0 GPU")
        return True
    return path == "auto" and not quantized and _tiled_up.chosen(gate, x, w, backward=backward)


def sddmm_gated_backward(
    gate: TwELLParts,
    tile_n: int,
    dy: Any,
    w_down_t: Any,
    up: TwELLParts,
    variant: tuple[int, int] | None = None,
    path: str = "auto",
) -> tuple[TwELLParts, TwELLParts, TwELLParts]:
    """The gated FFN backward's ``d_h = dy @ w_down_t.T`` at the gate's pattern and its value
    products in one kernel: returns parts of ``d_z = d_h * u``, ``d_u = d_h * g`` and
    ``h = g * u`` (g the gate's values, u ``up``'s), rounded as the unfused SDDMM and products
    round them. Every operand shares one dtype; ``dy`` and ``w_down_t`` have 16-byte rows
    (:func:`rows_aligned`). Spill entries past the row pointers are zero.

    ``path``: "gather" (``twell_gather_sddmm_gated_bwd``: one W_down column gathered per entry;
    padding slots zero), "tiled" (``_tiled_up.gated_backward``: the tiled up projection's kernel
    with dy and W_down's transpose; padding slots not written, which the backward's products never
    read; 2-byte rows on Hopper only) or "auto" (the gathers, or the tiled kernel where
    :func:`_tiled_up.chosen` takes it for the backward)."""
    cp = _cp()
    m, nt, cap = gate.data.shape
    tiled = _takes_tiled_up(path, gate, dy, w_down_t, "dy and w_down_t", backward=True)
    # The gathers write every slot (padding as zeros); the tiled kernel the stored entries only.
    shapes = (gate.data.shape, gate.spill_data.shape)
    results = [(cp.empty(shapes[0], dtype=dy.dtype), cp.zeros(shapes[1], dtype=dy.dtype)) for _ in range(3)]
    d_z, d_u, h = (gate._replace(data=data, spill_data=spill) for data, spill in results)
    if tiled:
        _tiled_up.gated_backward(gate, tile_n, dy, w_down_t, up, d_z, d_u, h)
        return d_z, d_u, h
    dy, lddy = row_stride(dy)
    w_down_t, ldw = row_stride(w_down_t)
    geometry = (np.int32(m), np.int32(nt), np.int32(tile_n), np.int32(cap))
    dense = (dy, np.int64(lddy), w_down_t, np.int64(ldw), np.int32(dy.shape[1]))
    outputs = tuple(a for pair in results for a in pair)
    args = (*_matrix_args(gate), *geometry, *dense, up.data, up.spill_data, *outputs, row_order(gate))
    kv, u = _variant(variant, "sddmm_gated_bwd")
    K.launch_grid(K.gather_expression("sddmm_gated_bwd", dy.dtype, kv, u), *_gather_grid(m), args)
    return d_z, d_u, h


def gated_consumer_eligible(x: Any, w_up: Any, w_down_t: Any) -> bool:
    """Whether :func:`gated_consumer` can run on these operands: 16-byte rows of one dtype, or
    either weight as ``_quantize.QuantizedRows`` that :func:`quantized_rows_serve` (x's rows
    still 16-byte aligned)."""
    aligned = [row_stride(x)]
    if isinstance(w_up, QuantizedRows):  # its kernel stages x rows in shared memory (~28000 values at most)
        if _x_stage_bytes(x.shape[1]) > K.device_attribute("MaxSharedMemoryPerBlockOptin"):
            return False
    for w in (w_up, w_down_t):
        if isinstance(w, QuantizedRows):
            if not quantized_rows_serve(w, x.dtype):
                return False
        elif w.dtype != x.dtype:
            return False
        else:
            aligned.append(row_stride(w))
    return rows_aligned(*aligned)


def _x_stage_bytes(k: int) -> int:
    """Shared memory of ``twell_gather_gated_up_e4m3``: each warp's x row as f16."""
    return K.GATHER_WARPS * k * 2


def gated_consumer(
    gate: TwELLParts,
    tile_n: int,
    x: Any,
    w_up: Any,
    w_down_t: Any,
    keep_up: bool = False,
    variant: tuple[int, int] | None = None,
    out: Any = None,
) -> tuple[Any, TwELLParts | None]:
    """The gated FFN after its gate (:func:`gated_consumer_eligible` operands): ``u = x @ w_up.T``
    at the gate's pattern and ``h = gate * u`` (:func:`gated_up`), then ``out = h @ w_down_t``
    (:func:`down_spmm`: the "auto" SpMM, or the e4m3 one for quantized rows); or, opt-in
    (``_tiled_ffn.chosen``), both halves on one tensor-core pack.

    Returns ``(out, u)``; ``u`` (parts with the gate's structure and zero padding, what the
    backward pass needs) only when ``keep_up``, else None. ``out``, when given, is written in
    place: (M, d_model) in x's dtype with unit column stride (the caller checks). ``variant``:
    the row gathers' (KV, U) instantiation for the up projection.
    """
    if not isinstance(w_up, QuantizedRows) and not isinstance(w_down_t, QuantizedRows):
        if _tiled_ffn.chosen(gate, x, w_up, w_down_t, out):  # opt-in: TWELL_TILED_FFN=1
            if out is None:
                out = _cp().empty((gate.data.shape[0], w_down_t.shape[1]), dtype=x.dtype)
            return _tiled_ffn.gated_consumer(gate, tile_n, x, w_up, w_down_t, out, keep_up)
    h, up = gated_up(gate, tile_n, x, w_up, keep_up, variant)
    if out is None:
        out = _cp().empty((gate.data.shape[0], w_down_t.shape[1]), dtype=x.dtype)
    down_spmm(h, tile_n, w_down_t, out)
    return out, up


def gated_up(
    gate: TwELLParts,
    tile_n: int,
    x: Any,
    w_up: Any,
    keep_up: bool = False,
    variant: tuple[int, int] | None = None,
    path: str = "auto",
) -> tuple[TwELLParts, TwELLParts | None]:
    """The gated consumer's first half: ``u = x @ w_up.T`` at the gate's pattern and ``h = gate
    * u``, as parts in the gate's layout: ``(h, u)``, u (zero padding) only when ``keep_up``.

    ``path``: "gather" (``twell_gather_gated_up``, or ``twell_gather_gated_up_e4m3`` for
    ``w_up`` as ``_quantize.QuantizedRows``: u = the row's scale times x . its codes, in fp32),
    "tiled" (``_tiled_up``: blocks of tokens x units staged in shared memory; 2-byte rows on
    Hopper only) or "auto" (:func:`_tiled_up.chosen`). ``variant``: the row gathers' (KV, U)
    instantiation.
    """
    cp = _cp()
    m, nt, cap = gate.data.shape
    quantized = isinstance(w_up, QuantizedRows)
    tiled = _takes_tiled_up(path, gate, x, w_up, "x and w_up", quantized=quantized)
    x, ldx = row_stride(x)

    # The kernels write the stored slots only: h's padding is never read (the SpMMs walk the
    # counts), a kept u is handed out and so starts zeroed, its spill too (a fixed spill's arrays
    # run past the entries).
    def values(fill: Any) -> TwELLParts:
        return gate._replace(
            data=fill(gate.data.shape, dtype=x.dtype), spill_data=fill(gate.spill_data.shape, dtype=x.dtype)
        )

    h = values(cp.empty)
    up = values(cp.zeros) if keep_up else None
    if tiled:
        _tiled_up.gated_up(gate, tile_n, x, w_up, h, up)
        return h, up
    up_rows: tuple[Any, ...]
    if quantized:  # codes (C-contiguous), scales, row stride
        kind, up_rows = "gated_up_e4m3", (w_up.data, w_up.scales, np.int64(w_up.shape[1]))
    else:
        w_up, ldu = row_stride(w_up)
        kind, up_rows = "gated_up", (w_up, np.int64(ldu))
    kv, u = _variant(variant, kind)
    args = (
        *_matrix_args(gate),
        np.int32(m),
        np.int32(nt),
        np.int32(tile_n),
        np.int32(cap),
        x,
        np.int64(ldx),
        *up_rows,
        np.int32(x.shape[1]),
        h.data,
        h.spill_data,
        *((up.data, up.spill_data) if up is not None else (K.null_pointer(), K.null_pointer())),
        row_order(gate),
    )
    stage = _x_stage_bytes(x.shape[1]) if kind == "gated_up_e4m3" else 0
    K.launch_grid(K.gather_expression(kind, x.dtype, kv, u), *_gather_grid(m), args, stage)
    return h, up


def act_mul(z_act: Any, z_lin: Any, activation: str, threshold: float | None) -> Any:
    """``keep(act(z_act)) * z_lin`` elementwise (``z_lin`` None: no product), in z_act's dtype."""
    cp = _cp()
    z_act = cp.ascontiguousarray(z_act)
    out = cp.empty_like(z_act)
    n = z_act.size
    lin: Any = K.null_pointer() if z_lin is None else cp.ascontiguousarray(z_lin)
    blocks = min(-(-n // 256), K.sm_count() * 8) if n else 0
    expr = f"ffn_act_mul<{K.CXX_TYPE[z_act.dtype]}, {K.ACTIVATION_ID[activation]}>"
    thr = np.float64(-1.0 if threshold is None else threshold)
    arrays = (z_act, out) if z_lin is None else (z_act, lin, out)
    vector_ok = np.int32(all(a.data.ptr % 16 == 0 for a in arrays))
    K.launch_grid(expr, (blocks,), (256,), (z_act, lin, np.int64(n), vector_ok, thr, out))
    return out


def kept_count(z: Any, step: int, activation: str, threshold: float | None) -> tuple[Any, int]:
    """``(kept, sampled)``: how many entries of rows 0, step, 2*step, ... of ``z`` (unit column
    stride) the sparse path keeps after ``activation`` (rounded to z's dtype) and ``threshold``,
    a one-element int64 array on the device from one launch (``ffn_kept_count``), and how many
    entries those rows hold."""
    cp = _cp()
    count = cp.zeros(1, dtype=cp.int64)
    m, n = z.shape
    rows = -(-m // step)
    if rows and n:
        expr = f"ffn_kept_count<{K.CXX_TYPE[z.dtype]}, {K.ACTIVATION_ID[activation]}>"
        ld = leading_dim(z)
        thr = np.float64(-1.0 if threshold is None else threshold)
        K.launch_grid(expr, (rows,), (256,), (z, np.int64(ld), np.int64(step), np.int32(n), thr, count))
    return count, rows * n


# cuBLAS enums (cublas_api.h / library_types.h)
_CUDA_R = {np.dtype(np.float16): 2, bfloat16: 14, np.dtype(np.float32): 0, np.dtype(np.float64): 1}
_COMPUTE_32F, _COMPUTE_64F, _OP_N, _OP_T, _GEMM_DEFAULT = 68, 70, 0, 1, -1


@functools.lru_cache(maxsize=128)  # each plan holds its workspace (plans used in a capture stay alive)
def lt_gemm(kind: str, m: int, f: int, k: int, dtype_name: str, device: int) -> Any:
    """The cuBLASLt plan (``"Gemm"``, ``"ReluGemm"`` or ``"ReluMaskGemm"``) of one shape,
    capturable in a CUDA graph; None for float64, or where the library does not load or offers
    no algorithm (the callers then take CuPy's cuBLAS or the dense-scan producer).

    One plan per shape and device, shared by every stream: it is made (and timed) by the eager
    warm-up a CUDA-graph capture needs, so the capture allocates nothing. Eager calls take their
    workspace from the current stream's allocator (GEMMs of one shape may run on several streams
    at once); captured ones use the plan's own, which the plan keeps for the graph."""
    if dtype_name == "float64":
        return None
    try:
        from .bindings import cublaslt

        cublaslt.library()
        return getattr(cublaslt, kind)(m, f, k, bfloat16 if dtype_name == "bfloat16" else np.dtype(dtype_name))
    except (ImportError, RuntimeError):  # CuBlasLtError is a RuntimeError
        return None


def gemm_nt(x: Any, w: Any, relu: bool = False) -> Any:
    """``x @ w.T`` (fp32 accumulation; fp64 for float64) on the current stream: a cuBLASLt plan
    per shape (capturable in a CUDA graph), else CuPy's cuBLAS ``gemmEx`` (float64, or no
    cuBLASLt). ``x`` (M x K) and ``w`` (F x K) share a dtype; works for bfloat16 as well.
    ``relu``: ``relu(x @ w.T)``, in the GEMM's epilogue where cuBLASLt serves."""
    cp = _cp()
    from cupy_backends.cuda.libs import cublas

    K.check_current_device((x,))
    if w.dtype != x.dtype:
        raise TypeError(f"w: expected dtype {x.dtype} like x, got {w.dtype}")
    x = cp.ascontiguousarray(x)
    w = cp.ascontiguousarray(w)
    m, k = x.shape
    f = w.shape[0]
    out = cp.empty((m, f), dtype=x.dtype)
    if m == 0 or f == 0:
        return out
    if k == 0:
        out.fill(0)
        return out
    lt = lt_gemm("ReluGemm" if relu else "Gemm", m, f, k, np.dtype(x.dtype).name, cp.cuda.Device().id)
    if lt is not None:
        lt(x, w, out)
        return out
    if relu:
        return cp.maximum(gemm_nt(x, w), 0, out=out)
    if cp.cuda.get_current_stream().is_capturing():
        raise RuntimeError(
            "gemm_nt: capturing a CUDA graph needs cuBLASLt (CuPy's cuBLAS wrapper refuses captures), "
            "which did not load; install nvidia-cublas or set TWELL_CUBLASLT"
        )
    dt = _CUDA_R[x.dtype]
    wide = x.dtype == np.float64
    alpha = np.ones(1, dtype=np.float64 if wide else np.float32)
    beta = np.zeros(1, dtype=alpha.dtype)
    handle = cp.cuda.device.get_cublas_handle()
    # Row-major out (M x F) is column-major out^T (F x M) = w (op T on its K x F view) @ x^T.
    cublas.gemmEx(
        handle,
        _OP_T,
        _OP_N,
        f,
        m,
        k,
        alpha.ctypes.data,
        w.data.ptr,
        dt,
        k,
        x.data.ptr,
        dt,
        k,
        beta.ctypes.data,
        out.data.ptr,
        dt,
        f,
        _COMPUTE_64F if wide else _COMPUTE_32F,
        _GEMM_DEFAULT,
    )
    return out
