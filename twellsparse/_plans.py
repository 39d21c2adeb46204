"""FFN blocks: reusable plans and the one-shot ``ffn``/``gated_ffn`` built on them.

``FFN(w_up, w_down)`` and ``GatedFFN(w_gate, w_up, w_down)`` validate the weights once and keep
``w_down.T`` contiguous (the down projection gathers its rows), so a call transposes nothing.
A plan keeps references to the caller's weights; after an in-place update call ``refresh()``.
The one-shot functions build a plan per call and never cache: a cache keyed on weight identity
would silently go stale when weights are updated in place. Their plans make ``w_down.T`` only
when the call runs sparse, so a call that runs dense (under the break-even) transposes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _reference as ref
from ._backend import array_module, cupy_module, is_cupy_array, result_dtype, value_dtype
from ._dense_transpose import contiguous_transpose
from ._dispatch import breakeven_for
from ._errors import TwELLFallbackWarning, TwELLSpillCapacityError, warn
from ._ops import (
    _dense,
    _same_device,
    dense_ffn_tail,
    gated_product,
    gather_tail_eligible,
    matmul,
    pack_preactivation_deferred,
    preactivation,
    tail_then_finish,
)
from ._parts import DeferredFinish, trimmed_spill
from ._posted import PostedScalar
from ._quantize import QuantizedRows, check_format, quantize_rows
from ._twell import twell_array
from ._validation import BLOCK_SETTINGS, check_block_settings, check_out_shape

#: Rows sampled to estimate the activation density before choosing a path.
DENSITY_SAMPLE_ROWS = 256
#: While the estimate is clearly on one side of the break-even (below 0.8x or above 1.25x it),
#: ``dispatch="auto"`` samples the density only every this many calls: the sampling's small
#: kernels cost ~5% of a dense block at 4096 tokens (auto's dense remainder ran at 0.93-0.95x
#: dense there, bench/results/2026-12-03-ffn-widths.jsonl), and densities drift slowly.
RESAMPLE_EVERY = 8


def _capturing() -> bool:
    """Whether CuPy's current stream is capturing a CUDA graph (no host reads then)."""
    cp = cupy_module()
    if cp is None or not cp.cuda.is_available():
        return False
    return bool(cp.cuda.get_current_stream().is_capturing())


def raise_left_out(posted: PostedScalar, spill_capacity: int | None, call: str) -> None:
    """Raise :class:`TwELLSpillCapacityError` if ``posted`` (a call's entries that its fixed
    ``spill_capacity`` could not hold) is nonzero; reading it forgets it."""
    left_out = posted.take()
    if left_out:
        assert spill_capacity is not None
        raise TwELLSpillCapacityError(int(left_out), spill_capacity, call)


def raise_for_previous(
    previous: PostedScalar | None, current: PostedScalar, spill_capacity: int | None, call: str
) -> None:
    """After a call has queued its work: raise for ``previous`` (the call before it, popped
    first) if it left entries out. The current call's own count is then forgotten, since the
    error means its output is not returned."""
    if previous is not None and previous.value():
        current.take()
        raise_left_out(previous, spill_capacity, call)


class _FFNPlanBase:
    """Weights (the first one sets the hidden shape) and the producer's settings."""

    #: Whether w_down.T is made on the sparse path's first use rather than by refresh (the
    #: one-shot functions' plans, which live for one call).
    _LAZY_DOWN_ROWS = False

    def __init__(
        self,
        weights: dict[str, Any],
        activation: str,
        tile_n: int,
        capacity: int | None,
        threshold: float | None,
        dispatch: str,
        breakeven: float | None,
        kind: str,
        spill_capacity: int | None = None,
        down_format: str | None = None,
        up_format: str | None = None,
    ) -> None:
        self.down_format = check_format(down_format, "down_format", optional=True)
        self.up_format = check_format(up_format, "up_format", optional=True)
        settings = check_block_settings(activation, tile_n, capacity, threshold, dispatch, breakeven, spill_capacity)
        self.activation, self.tile_n, self.capacity, self.threshold = (settings[k] for k in BLOCK_SETTINGS[:4])
        self.dispatch, self.breakeven, self.spill_capacity = (settings[k] for k in BLOCK_SETTINGS[4:])
        self._warned_static = False
        self._kind = kind
        self._calls_since_sample = 0
        arrays = {name: _dense(w, name) for name, w in weights.items()}
        first_name = next(iter(arrays))
        _same_device(first_name, arrays[first_name], **arrays)
        _check_weight_shapes(arrays, None)
        self._weights = arrays
        # (path, sampled density, the hidden layer or a function making it on access)
        self._last: tuple[str, float, Any] | None = None
        self._density = PostedScalar()
        self._left_out = PostedScalar()
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the kernel layouts from the weight arrays (after an in-place update)."""
        w_down = self._weights["w_down"]
        # What the sparse tail gathers (w_down.T's rows and a gated block's w_up rows, dense or
        # quantized) and what the dense remainder multiplies by: the same weights on both paths.
        # A plan makes w_down.T here, eagerly: made on first use, it could be first touched
        # inside a CUDA-graph capture (recorded there, not run, and made again by every replay).
        # A one-shot call's plan (_LAZY_DOWN_ROWS) makes it on the sparse path's first use, so
        # one that runs dense under the break-even skips the transpose (0.033 ms with the
        # library's kernel at the standard widths on an H100, CuPy's strided copy 0.088).
        self._down_rows_made: Any = None
        self._w_down_dense: Any = w_down
        if self.down_format is not None:
            self._down_rows_made, decoded = _quantized_and_decoded(contiguous_transpose(w_down), self.down_format)
            self._w_down_dense = contiguous_transpose(decoded)
        elif not self._LAZY_DOWN_ROWS:
            self._down_rows_made = contiguous_transpose(w_down)
        self._up_rows: Any = self._weights["w_up"] if self._kind == "gated_ffn" else None
        self._w_up_dense: Any = self._up_rows
        if self._up_rows is not None and self.up_format is not None:
            self._up_rows, self._w_up_dense = _quantized_and_decoded(self._up_rows, self.up_format)

    @property
    def _down_rows(self) -> Any:
        """The rows the sparse tail gathers: ``w_down.T`` made contiguous (or its fp8 rows), made
        by :meth:`refresh`, or on first use for a one-shot call's plan."""
        if self._down_rows_made is None:
            self._down_rows_made = contiguous_transpose(self._weights["w_down"])
        return self._down_rows_made

    @property
    def dtype(self) -> Any:
        """The value dtype of the plan's weights (``w_down``'s)."""
        return value_dtype(self._weights["w_down"].dtype)

    def breakeven_for(self, tokens: int) -> float:
        """The density above which ``dispatch="auto"`` runs a call of ``tokens`` rows dense: the
        plan's ``breakeven`` when given, else the measured break-even of its widths
        (:func:`twellsparse._dispatch.breakeven_for`; further for a plan whose gathered rows are
        all fp8: ``down_format``, and ``up_format`` too for the gated block)."""
        d_ff, d_model = next(iter(self._weights.values())).shape
        e4m3_rows = self.down_format is not None and (self._kind == "ffn" or self.up_format is not None)
        return breakeven_for(self.breakeven, self._kind, tokens, d_model, d_ff, e4m3_rows)

    @property
    def last_stats(self) -> dict[str, Any]:
        """The last call: the path taken (``"sparse"`` or ``"dense"``), the sampled density that
        chose it (under ``dispatch="sparse"`` the previous call's, which chose only the down
        projection's kernel; NaN where there was none) and, for the sparse path, the hidden
        layer's nonzeros and spilled entries.

        Computed on access (it reads counts back from the GPU), never in the call itself.
        """
        if self._last is None:
            return {}
        path, sampled, hidden = self._last
        stats: dict[str, Any] = {"path": path, "sampled_density": sampled, "dense_fallback": path == "dense"}
        h = hidden() if callable(hidden) else hidden
        if h is not None:  # the hidden layer's TwELL, or (shape, nnz, n_spilled) from the mask
            (m, n), nnz, n_spilled = h if isinstance(h, tuple) else (h.shape, h.nnz, h.n_spilled)
            stats.update(
                tokens=m,
                units=n,
                nnz=nnz,
                density=nnz / max(m * n, 1),
                nnz_per_token=nnz / max(m, 1),
                n_spilled=n_spilled,
            )
        return stats

    def check_spill(self) -> None:
        """Raise :class:`TwELLSpillCapacityError` if the last call with a fixed ``spill_capacity``
        left spilled entries out (after replaying a captured call: synchronise first)."""
        raise_left_out(self._left_out, self.spill_capacity, "the previous call")

    def _run(self, x: Any, act_name: str, lin_name: str | None, out: Any) -> Any:
        """One call; with a fixed ``spill_capacity``, the previous call's entries left out are
        checked after this call's work is queued (its wait then overlaps this call's kernels)."""
        previous = self._left_out.pop() if self.spill_capacity is not None and not _capturing() else None
        try:
            result = self._run_call(x, act_name, lin_name, out)
        except Exception as err:  # this call's error stays the one raised; the previous call's rides along
            try:
                raise_for_previous(previous, self._left_out, self.spill_capacity, "the previous call")
            except TwELLSpillCapacityError as spill:
                raise err from spill
            raise
        raise_for_previous(previous, self._left_out, self.spill_capacity, "the previous call")
        return result

    def _run_call(self, x: Any, act_name: str, lin_name: str | None, out: Any) -> Any:
        """Validate x (and out), compute the activation's pre-activations, choose the path, finish
        it (in ``out`` when given)."""
        xx = _dense(x, "x")
        w = self._weights
        first = next(iter(w.values()))
        _same_device("w_down", w["w_down"], x=xx)
        if xx.shape[1] != first.shape[1]:
            raise ValueError(f"x: expected {first.shape[1]} columns (d_model), got shape {tuple(xx.shape)}")
        # One dtype whatever the path: the sparse tail's products would otherwise promote with
        # w_up / w_down where the dense one does not (and "auto" picks by the data).
        dt = result_dtype(xx.dtype, *(a.dtype for a in w.values()))
        if out is not None:
            _check_out(out, (xx.shape[0], w["w_down"].shape[0]), dt, xx)
        result = self._compute(xx, act_name, lin_name, dt, out)
        return _deliver(result if result.dtype == dt else result.astype(dt), out)

    def _compute(self, xx: Any, act_name: str, lin_name: str | None, dt: Any, out: Any) -> Any:
        """The call after validation; the result lands in ``out`` where the kernels can write it
        there (the gather tails), elsewhere in a new array that :func:`_deliver` copies."""
        w = self._weights
        first = next(iter(w.values()))
        shape = (xx.shape[0], first.shape[0])
        w_lin = self._up_rows if lin_name else None  # the sparse tail's; the dense one's is _w_up_dense
        breakeven = self.breakeven_for(xx.shape[0])
        fused = self._fused_producer(xx, w[act_name], breakeven)
        if fused is not None:
            return self._sparse_tail(xx, fused[0], fused[1], w_lin, dt, out, shape, fused[2])
        # A break-even of zero (calls of 1024 tokens or fewer by default) runs dense whatever the
        # density: nothing to sample, and no host wait for the sample.
        always_dense = self.dispatch == "dense" or (self.dispatch == "auto" and breakeven <= 0.0)
        # The previous call's density (waiting, if at all, for that call's sample copy, which runs
        # early in it); the first call samples and waits for its own.
        estimate = self._density.value() if self.dispatch == "auto" and not always_dense else None
        dense_known = always_dense or (estimate is not None and estimate > breakeven)
        z, relu_mask, activated = self._preactivation(xx, w[act_name], dense_known, gated=w_lin is not None)
        sampled = float("nan")
        if self.dispatch == "auto" and not always_dense:
            if self._resample(estimate, breakeven) and z.shape[0]:  # an empty call samples nothing
                self._density.post(*self._kept_fraction(z))
            # The first call waits for its own sample (never None once posted).
            sampled = estimate if estimate is not None else float(self._density.value() or 0.0)
        if always_dense or (self.dispatch == "auto" and sampled > breakeven):
            self._last = ("dense", sampled, None)
            w_lin_dense = self._w_up_dense if lin_name else None
            return dense_ffn_tail(
                xx, z, w_lin_dense, self._w_down_dense, dt, self.activation, self.threshold, activated
            )
        if relu_mask is not None and self._mask_consumer_applies(xx, z, w_lin):
            # The tail reads the mask itself: no pack, no capacity, nothing to spill or read back.
            from ._gpu_ops import mask_consumer

            self._last = ("sparse", sampled, _mask_stats(relu_mask, shape))
            mask, words = relu_mask
            return mask_consumer(z, mask, words, xx, w_lin, self._down_rows)
        finish: DeferredFinish
        if relu_mask is not None:
            from ._gpu_convert import relu_mask_to_parts_deferred

            mask, words = relu_mask
            first_parts, finish = relu_mask_to_parts_deferred(z, mask, words, self.tile_n, self.capacity)
        else:
            first_parts, finish = pack_preactivation_deferred(
                z, dt, self.activation, self.tile_n, self.capacity, self.threshold
            )
        return self._sparse_tail(xx, first_parts, finish, w_lin, dt, out, shape, sampled)

    def _resample(self, estimate: float | None, breakeven: float) -> bool:
        """Whether this call samples the density again: always near the break-even or without an
        estimate, else every :data:`RESAMPLE_EVERY` calls."""
        self._calls_since_sample += 1
        clear = estimate is not None and not (0.8 * breakeven <= estimate <= 1.25 * breakeven)
        if clear and self._calls_since_sample < RESAMPLE_EVERY:
            return False
        self._calls_since_sample = 0
        return True

    def _fused_producer(self, xx: Any, w_act: Any, breakeven: float) -> tuple[Any, Any, float] | None:
        """``(first parts, finish, density estimate)`` of the pack straight from the GEMM
        (``_hopper_producer``: no dense pre-activations) when it serves the call and the sparse
        path is already chosen: ``dispatch="sparse"``, or ``"auto"`` with the previous call's
        density at most the break-even. This call's density is posted from its row-tiles' entry
        totals for the next call: ``auto`` reads it to choose the path (waiting for it if need
        be), ``sparse`` only to choose the down projection's kernel, so it takes it only if it
        has arrived (NaN before: the choice by rows alone). None otherwise (the first ``auto``
        call samples the pre-activations)."""
        if self.dispatch == "dense" or not is_cupy_array(xx):
            return None
        from . import _gpu_producer, _hopper_producer

        if _gpu_producer.MASK_CONSUMER:  # the opt-in mask-driven tails read cuBLASLt's mask
            return None

        if not _hopper_producer.applies(xx, w_act, self.activation, self.threshold, self.tile_n, self.capacity):
            return None
        if self.dispatch == "auto":
            estimate = self._density.value()
            if estimate is None or estimate > breakeven:
                return None
        else:
            latest = self._density.latest()
            estimate = float("nan") if latest is None else latest
        first_parts, finish = _hopper_producer.linear_to_parts_deferred(
            xx, w_act, self.activation, self.tile_n, self.capacity, self.threshold
        )
        # The entry count, a fraction once read.
        self._density.post(finish.totals()[0], scale=1.0 / (xx.shape[0] * w_act.shape[0]))
        return first_parts, finish, estimate

    def _sparse_tail(
        self,
        xx: Any,
        first_parts: Any,
        finish: DeferredFinish,
        w_lin: Any,
        dt: Any,
        out: Any,
        shape: tuple[int, int],
        sampled: float = float("nan"),
    ) -> Any:
        """The sparse path after the producer's pass 1: the consumer on the packed activations,
        with the overflow policy of the plan (fixed spill, or the exact read-back)."""

        # The tails write into `out` directly when the kernels can address its rows and every
        # operand has one dtype and 16-byte rows.
        from ._gpu_convert import direct_rows

        addressable = out is not None and is_cupy_array(out) and direct_rows(out)
        target = out if addressable and gather_tail_eligible(xx, w_lin, self._down_rows, dt) else None

        def tail(parts: Any) -> Any:
            h = twell_array._from_parts(parts, shape, self.tile_n)
            if w_lin is None:
                return matmul(h, self._down_rows, out=target)
            if xx.dtype != dt:  # mixed precisions: the up values and h in the block's dtype, as dense
                return gated_product(xx.astype(dt), _as_dtype(w_lin, dt), self._down_rows, h, out=target)[0]
            return gated_product(xx, w_lin, self._down_rows, h, out=target)[0]

        from . import _stationary

        # The density estimate picks the down projection's kernel (_stationary.chosen), on the
        # exact and the fixed-spill paths alike.
        with _stationary.expected_density(sampled):
            if self._fixed_spill_applies(xx, w_lin, dt):
                # No read-back: the spill fills a fixed-length buffer, the count of entries that
                # did not fit is posted for the next call (or check_spill) to raise on.
                parts, left_out = finish("spill", spill_capacity=self.spill_capacity)
                result = _gather_tail(parts, self.tile_n, xx, w_lin, self._down_rows, dt, target)
                self._left_out.post(left_out)
                self._last = (
                    "sparse",
                    sampled,
                    lambda: twell_array._from_parts(trimmed_spill(parts), shape, self.tile_n),
                )
                return result
            result, parts = tail_then_finish(first_parts, finish, tail)
        n_spilled = parts.spill_data.shape[0]
        if self.spill_capacity is not None and n_spilled > self.spill_capacity:
            # The exact path holds the count already: the fixed capacity's promise is checked at
            # once (as the torch adapter's exact path does), so the CPU raises where a GPU would.
            raise TwELLSpillCapacityError(
                n_spilled - self.spill_capacity, self.spill_capacity, "this call", computed=False
            )
        self._last = ("sparse", sampled, twell_array._from_parts(parts, shape, self.tile_n))
        return result

    def _fixed_spill_applies(self, x: Any, w_lin: Any, dt: Any) -> bool:
        """Whether this call spills into the fixed-length buffer: a ``spill_capacity`` was given,
        on the GPU, with operands the gather kernels take (they read the spill through its row
        pointers; the other kernels take its length from the arrays). Otherwise the call checks
        its overflow on the host, exactly, and says so once."""
        if self.spill_capacity is None or not is_cupy_array(x):
            return False
        ok = gather_tail_eligible(x, w_lin, self._down_rows, dt)
        if not ok and not self._warned_static:
            self._warned_static = True
            warn(
                "spill_capacity: the operands lack one dtype or 16-byte rows, so calls read the "
                "overflow count back to the host (exact, not capturable in a CUDA graph)",
                TwELLFallbackWarning,
            )
        return ok

    def _preactivation(self, x: Any, w_act: Any, dense_known: bool, gated: bool) -> tuple[Any, Any, bool]:
        """``(z, relu_mask, activated)``: the activation's GEMM output; when the cuBLASLt
        ReLU-mask producer serves a call that may run sparse (``_gpu_producer``), its ``(mask,
        words per row)``, else None; and whether z is relu'd already (the dense remainder's relu
        leaves it unchanged, and a non-gated block goes straight to its down GEMM).

        A call known to run dense (``dense_known``) skips the ReLU-mask GEMM: it costs ~8% more
        (0.53 against 0.49 ms on the standard problem, bench/results/2026-12-03-stages.jsonl) and
        only the sparse path reads the mask. A non-gated ReLU block then takes the GEMM with the
        ReLU epilogue (no act-mul pass: 0.93x -> 1.01x dense at 4096 tokens, bench/NOTES.md)."""
        if dense_known and not gated and self.activation == "relu" and self.threshold is None:
            return preactivation(x, w_act, relu=True), None, True
        if is_cupy_array(x):
            from . import _gpu_producer

            if not dense_known and _gpu_producer.applies(x, w_act, self.activation, self.threshold):
                z, mask, words = _gpu_producer.relu_linear(x, w_act)
                return z, (mask, words), True
        return preactivation(x, w_act), None, False

    def _mask_consumer_applies(self, x: Any, z: Any, w_lin: Any) -> bool:
        """Whether the tail runs from the ReLU mask (``_gpu_producer.MASK_CONSUMER``, opt-in), on
        operands its kernels take (z itself is read an element at a time)."""
        from . import _gpu_ops, _gpu_producer

        return _gpu_producer.MASK_CONSUMER and _gpu_ops.mask_consumer_eligible(x, w_lin, self._down_rows, z.dtype)

    def _kept_fraction(self, z: Any) -> tuple[Any, float]:
        """``(kept, scale)``: the kept activations over evenly spaced rows, times ``scale`` their
        fraction; ``kept`` a device array (no read-back) or a float for an empty z."""
        m = z.shape[0]
        if m == 0 or z.shape[1] == 0:
            return 0.0, 1.0
        step = max(1, m // DENSITY_SAMPLE_ROWS)
        if is_cupy_array(z) and z.strides[1] == z.itemsize:
            from ._gpu_ops import kept_count

            kept, sampled = kept_count(z, step, self.activation, self.threshold)
            return kept, 1.0 / sampled
        rows = z[::step].astype(z.dtype if z.dtype == np.float64 else np.float32)
        kept = ref.keep_mask(ref.activation(rows, self.activation).astype(self.dtype), self.threshold)
        return kept.mean(), 1.0


def _as_dtype(w: Any, dt: Any) -> Any:
    """A dense weight in ``dt`` (quantized rows as they are: their products widen to fp32)."""
    return w if isinstance(w, QuantizedRows) or w.dtype == dt else w.astype(dt)


def _quantized_and_decoded(w: Any, format: str) -> tuple[Any, Any]:
    """``w``'s rows as :class:`QuantizedRows` of ``format`` (what a sparse tail gathers) and
    the dense matrix of the same values, decoded and rounded to ``w``'s dtype (the dense
    remainder's)."""
    rows = quantize_rows(w, format)
    return rows, rows.dequantize(w.dtype)


def _gather_tail(parts: Any, tile_n: int, x: Any, w_lin: Any, w_down_t: Any, dt: Any, out: Any = None) -> Any:
    """The block after its pack on the gather kernels only (parts with a fixed-length spill),
    into ``out`` when given (the caller checked its shape, dtype and unit column stride)."""
    from . import _gpu_ops

    if w_lin is not None:
        return _gpu_ops.gated_consumer(parts, tile_n, x, w_lin, w_down_t, out=out)[0]
    if out is None:
        out = array_module(x).empty((x.shape[0], w_down_t.shape[1]), dtype=dt)
    return _gpu_ops.down_spmm(parts, tile_n, w_down_t, out)  # a gather kernel (checked), or the stationary one


def _check_out(out: Any, shape: tuple[int, int], dtype: Any, x: Any) -> None:
    """A plan call's ``out``: an array of x's kind and device with the result's shape and dtype."""
    if type(out) is not type(x):
        raise TypeError(f"out: expected a {type(x).__module__}.{type(x).__name__} like x, got {type(out).__name__}")
    # NumPy arrays can be read-only; CuPy's flags have no ``writeable`` (device arrays always are).
    if not getattr(getattr(out, "flags", None), "writeable", True):
        raise ValueError("out: expected a writeable array, got a read-only one")
    check_out_shape(out, shape, dtype)
    _same_device("x", x, out=out)
    if array_module(x).may_share_memory(out, x):
        raise ValueError("out: expected an array apart from x (x is read after out is written), got one overlapping x")


def _deliver(result: Any, out: Any) -> Any:
    """``result``, copied into ``out`` when one was given and the path computed elsewhere."""
    if out is None or result is out:
        return result
    out[...] = result
    return out


def _mask_stats(relu_mask: tuple[Any, int], shape: tuple[int, int]) -> Callable[[], tuple]:
    """``last_stats``'s hidden-layer figures for a call whose tail ran from the ReLU mask:
    ``(shape, nnz, n_spilled)``, the set bits counted on access (nothing spills there)."""

    def count() -> tuple:
        import cupy as cp

        mask, words = relu_mask
        m, n = shape
        bits = cp.unpackbits(mask.view(cp.uint8), bitorder="little").reshape(m, words * 32)  # no axis in CuPy
        return shape, int(bits[:, :n].sum(dtype=cp.int64)), 0

    return count


def _check_weight_shapes(arrays: dict[str, Any], d_model: int | None) -> None:
    """Input weights (d_ff, d_model) agreeing with each other, w_down (d_model, d_ff).

    ``d_model`` comes from x when known; otherwise from the input weights (the error then names
    the array that disagrees with them).
    """
    inputs = {name: w for name, w in arrays.items() if name != "w_down"}
    w_down = arrays["w_down"]
    first_name, first = next(iter(inputs.items()))
    source = "d_model of x" if d_model is not None else f"like {first_name}"
    d_model = first.shape[1] if d_model is None else d_model
    for name, w in inputs.items():
        if w.shape[1] != d_model:
            raise ValueError(f"{name}: expected {d_model} columns ({source}), got shape {tuple(w.shape)}")
    d_ff = first.shape[0]
    for name, w in inputs.items():
        if w.shape[0] != d_ff:
            raise ValueError(f"{name}: expected {d_ff} rows like {first_name}, got shape {tuple(w.shape)}")
    if tuple(w_down.shape) != (d_model, d_ff):
        raise ValueError(f"w_down: expected shape {(d_model, d_ff)} (d_model, d_ff), got {tuple(w_down.shape)}")


def _one_shot_weights(x: Any, **weights: Any) -> None:
    """Check the weights against x first, so that an error names the array that disagrees with x."""
    xx = _dense(x, "x")
    arrays = {name: _dense(w, name) for name, w in weights.items()}
    _same_device("x", xx, **arrays)
    _check_weight_shapes(arrays, xx.shape[1])


class FFN(_FFNPlanBase):
    """Non-gated sparse FFN plan: ``act(x @ w_up.T) @ w_down.T``.

    Parameters
    ----------
    w_up : array, shape (d_ff, d_model)
    w_down : array, shape (d_model, d_ff)
    activation, tile_n, capacity, threshold
        As for :func:`twellsparse.linear_to_twell`.
    dispatch : {"auto", "sparse", "dense"}
        ``"auto"`` (default) runs the dense remainder when the activation density is above
        ``breakeven``, the sparse one below it. The density is sampled from 256 evenly spaced
        rows after the first GEMM; a call decides on the previous sample (read without a host
        synchronisation), the first call on its own; while the estimate is far from the
        break-even it is refreshed every ``RESAMPLE_EVERY`` (8) calls. ``"sparse"`` always runs the TwELL
        kernels, ``"dense"`` always the dense remainder (cuBLAS and a fused act-mul kernel).
        All compute the same function; ``last_stats["path"]`` says which ran.
    breakeven : float, optional
        Density threshold for ``"auto"``; default: the break-even measured on the H200 for the
        plan's widths and each call's tokens (:meth:`breakeven_for`; about 0.65-0.9% at 4096
        tokens, 1.0-1.2% at 16384-65536 tokens of d_model 2048 / d_ff 5632).
    spill_capacity : int, optional
        A fixed length for the spill of overflowing row-tiles, so that a GPU call never reads
        anything back to the host (and can be captured in a CUDA graph with ``dispatch`` set to
        ``"sparse"`` or ``"dense"``). Entries beyond it are left out of that call's output and
        :class:`twellsparse.TwELLSpillCapacityError` is raised at the next call or by
        :meth:`check_spill`. Default None: the overflow count is read back (exact, one sync).
        Needs GPU operands of one dtype with 16-byte rows; otherwise (the CPU included) calls
        read the count back, stay exact, and raise the error at once, returning nothing, when
        more entries spill than it holds (a GPU call warns once that it reads back).
    down_format : {None, "e4m3"}, optional
        Opt-in, lossy: keep ``w_down``'s rows (one per hidden unit) in fp8 e4m3 with one float32
        scale per row (:func:`twellsparse.quantize_rows`), so the sparse down projection reads
        half the bytes per active unit (measured on the H200 at the standard widths: 0.16 against
        0.24 ms at 0.5% density, 0.29 against 0.42 at 1%; bench/NOTES.md). Each weight moves by
        at most 2**-4 of its magnitude (2**-10 of its row's largest below e4m3's normal range).
        The dense path multiplies by the same quantized weights, decoded and rounded to their
        dtype (the sparse path widens each code times its scale to fp32 unrounded: the paths
        differ by that rounding, ~1e-3 relative in bf16). Rebuilt by :meth:`refresh`. With every
        gathered row in fp8 (the non-gated block's ``down_format``; the gated block's with
        ``up_format`` too), the default break-even of ``"auto"`` is 1.3x the 2-byte one
        (``_dispatch.E4M3_CROSSING_FACTOR``, a conservative reading of the measured crossings).

    Calling the plan, ``plan(x, out=None)``, returns the block's output (M x d_model) in
    ``result_type(x, w_up, w_down)`` (:class:`GatedFFN`: with ``w_gate`` too) on every path.
    ``out`` (optional): an array of that shape and dtype on x's device, apart from x, that
    receives the result; with unit column stride and operands of one dtype with 16-byte rows
    the kernels write it directly, otherwise the result is copied into it.

    A plan keeps a copy of ``w_down.T`` (the sparse path's layout, made by the constructor and
    :meth:`refresh`) and reads the other weights where they are: after updating weights in
    place call :meth:`refresh`, else the sparse path keeps the old ``w_down`` while the dense
    one reads the new. ``refresh`` allocates new arrays: capture CUDA graphs again after it. A
    plan holds per-call state (``last_stats``, the posted density and spill counts): use one per
    thread, and with a fixed ``spill_capacity`` call :meth:`check_spill` after the replays of one
    captured graph before replaying another.

    Attributes
    ----------
    last_stats : dict
        Nonzeros, density and spilled entries of the last call's hidden layer.
    """

    def __init__(
        self,
        w_up: Any,
        w_down: Any,
        *,
        activation: str = "relu",
        tile_n: int = 256,
        capacity: int | None = None,
        threshold: float | None = None,
        dispatch: str = "auto",
        breakeven: float | None = None,
        spill_capacity: int | None = None,
        down_format: str | None = None,
    ) -> None:
        weights = {"w_up": w_up, "w_down": w_down}
        settings = (activation, tile_n, capacity, threshold, dispatch, breakeven)
        super().__init__(weights, *settings, "ffn", spill_capacity, down_format)

    def __call__(self, x: Any, *, out: Any = None) -> Any:
        """The block's output for tokens ``x`` (M x d_model), in ``out`` when given."""
        return self._run(x, "w_up", None, out)


class GatedFFN(_FFNPlanBase):
    """Gated sparse FFN plan: ``(act(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``.

    The up projection runs only at the active gate units (an SDDMM at the gate's TwELL pattern)
    and the down projection reads only their rows.

    Parameters
    ----------
    w_gate, w_up : array, shape (d_ff, d_model)
    w_down : array, shape (d_model, d_ff)
    activation, tile_n, capacity, threshold
        As for :func:`twellsparse.linear_to_twell` (applied to the gate).
    dispatch, breakeven, spill_capacity, down_format
        As for :class:`FFN`.
    up_format : {None, "e4m3"}, optional
        Opt-in, lossy, as ``down_format`` for ``w_up``'s rows: the up projection at the active
        gate units then reads half the bytes per pair (each dot in fp32 from the codes, times
        the row's scale). The gate's weights stay in their dtype (the producer's GEMM is dense).
    """

    def __init__(
        self,
        w_gate: Any,
        w_up: Any,
        w_down: Any,
        *,
        activation: str = "relu",
        tile_n: int = 256,
        capacity: int | None = None,
        threshold: float | None = None,
        dispatch: str = "auto",
        breakeven: float | None = None,
        spill_capacity: int | None = None,
        down_format: str | None = None,
        up_format: str | None = None,
    ) -> None:
        weights = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
        settings = (activation, tile_n, capacity, threshold, dispatch, breakeven)
        super().__init__(weights, *settings, "gated_ffn", spill_capacity, down_format, up_format)

    def __call__(self, x: Any, *, out: Any = None) -> Any:
        """The block's output for tokens ``x`` (M x d_model), in ``out`` when given."""
        return self._run(x, "w_gate", "w_up", out)


class _OneShotFFN(FFN):
    """The plan of one :func:`ffn` call: ``w_down.T`` made only if the call runs sparse."""

    _LAZY_DOWN_ROWS = True


class _OneShotGatedFFN(GatedFFN):
    """The plan of one :func:`gated_ffn` call: ``w_down.T`` made only if the call runs sparse."""

    _LAZY_DOWN_ROWS = True


def ffn(
    x: Any,
    w_up: Any,
    w_down: Any,
    *,
    activation: str = "relu",
    tile_n: int = 256,
    capacity: int | None = None,
    threshold: float | None = None,
    dispatch: str = "auto",
) -> Any:
    """Non-gated sparse FFN: ``act(x @ w_up.T) @ w_down.T`` with the hidden layer in TwELL.

    Parameters
    ----------
    x : array_like, shape (M, d_model)
    w_up : array_like, shape (d_ff, d_model)
    w_down : array_like, shape (d_model, d_ff)
    activation, tile_n, capacity, threshold
        As for :func:`twellsparse.linear_to_twell`.
    dispatch : {"auto", "sparse", "dense"}
        As for :class:`FFN`: "auto" (default) runs the dense block above the measured
        break-even density, so the hidden layer is sparse only below it.

    Returns
    -------
    array, shape (M, d_model)
        In ``result_type(x, w_up, w_down)``; exact with respect to the sparse hidden layer
        (overflowing row-tiles spill).

    See Also
    --------
    FFN : the reusable plan (no per-call weight transpose).
    """
    _one_shot_weights(x, w_up=w_up, w_down=w_down)
    plan = _OneShotFFN(
        w_up, w_down, activation=activation, tile_n=tile_n, capacity=capacity, threshold=threshold, dispatch=dispatch
    )
    return plan(x)


def gated_ffn(
    x: Any,
    w_gate: Any,
    w_up: Any,
    w_down: Any,
    *,
    activation: str = "relu",
    tile_n: int = 256,
    capacity: int | None = None,
    threshold: float | None = None,
    dispatch: str = "auto",
) -> Any:
    """Gated sparse FFN: ``(act(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``.

    The up projection is computed only at the active gate units (an SDDMM at the gate's TwELL
    pattern), so its cost scales with the density.

    Parameters
    ----------
    x : array_like, shape (M, d_model)
    w_gate, w_up : array_like, shape (d_ff, d_model)
    w_down : array_like, shape (d_model, d_ff)
    activation, tile_n, capacity, threshold
        As for :func:`twellsparse.linear_to_twell` (applied to the gate).
    dispatch : {"auto", "sparse", "dense"}
        As for :class:`GatedFFN`: "auto" (default) runs the dense block above the measured
        break-even density.

    Returns
    -------
    array, shape (M, d_model)
        In ``result_type(x, w_gate, w_up, w_down)``.

    See Also
    --------
    GatedFFN : the reusable plan.
    """
    _one_shot_weights(x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    plan = _OneShotGatedFFN(
        w_gate,
        w_up,
        w_down,
        activation=activation,
        tile_n=tile_n,
        capacity=capacity,
        threshold=threshold,
        dispatch=dispatch,
    )
    return plan(x)
