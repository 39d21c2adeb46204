"""PyTorch adapter: sparse FFN blocks as ``torch.library`` custom ops with a sparse backward.

Torch tensors go in and out zero-copy (CUDA inputs as CuPy views of their pointers, outputs
through DLPack). CUDA tensors run the CuPy kernels on torch's current stream and device; CPU
tensors run the NumPy reference path. The ops are registered with fake (meta) implementations
and autograd formulas, so modules built on them trace under ``torch.compile``: in one graph
with ``fullgraph=True`` (for ``dispatch="sparse"`` or ``"dense"``; or with
``torch._dynamo.config.capture_dynamic_output_shape_ops = True``: the spill part's length
depends on the data, which dynamo otherwise leaves to eager with a graph break per op). The
modules' host reads (``dispatch="auto"``'s density, a fixed ``spill_capacity``'s check, the fp8
plans) run as graph breaks. Under ``torch.autocast`` the blocks compute in the autocast dtype,
as the Linears they replace do. Not supported: double backward (``create_graph=True``: a
second backward through the op raises) and ``torch.func`` transforms.

The backward never forms a dense tokens x d_ff tensor; its formulas are in
``twellsparse._ffn_autodiff`` (shared with the other framework adapters).

Saved for the backward: the hidden layer as TwELL (lossless: overflowing row-tiles spill) and,
for the gated block, the up-projection values on ``P``.

This module imports torch; ``import twellsparse`` never imports it.
"""

import functools
import threading
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from . import _dense_transpose
from ._backend import array_module, as_array, bfloat16, cupy_view, is_cupy_array
from ._dispatch import breakeven_for
from ._ffn_autodiff import backward_arrays, forward_arrays, with_values
from ._parts import TwELLParts, trimmed_spill
from ._plans import DENSITY_SAMPLE_ROWS, FFN, GatedFFN, raise_for_previous, raise_left_out
from ._posted import PostedScalar
from ._quantize import check_format
from ._twell import twell_array
from ._validation import (
    BLOCK_SETTINGS,
    check_activation,
    check_block_settings,
    check_capacity,
    check_threshold,
    check_tile_n,
    n_tiles,
)

__all__ = [
    "TwELLGatedMLP",
    "TwELLMLP",
    "ffn",
    "from_module",
    "gated_ffn",
    "swap_mlps",
]

_NAMESPACE = "twellsparse"

# ----------------------------------------------------------------------------- tensor <-> array


# The value dtypes and index dtypes the kernels take, as CuPy views of CUDA tensors.
_VIEW_DTYPES = {
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: bfloat16,
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}


def _to_array(t: Tensor) -> Any:
    """Zero-copy NumPy (CPU) or CuPy (CUDA) view of a tensor (made contiguous first).

    A CUDA tensor is viewed straight from its pointer (the view keeps it alive): DLPack's
    import costs several times more host time per tensor, for a stream handshake that is not
    needed here, where the kernels run on torch's current stream (inside ``_on_device``)."""
    t = t.detach().contiguous()
    dtype = _VIEW_DTYPES.get(t.dtype) if t.is_cuda else None
    if dtype is None:
        return as_array(t, "tensor")
    return cupy_view(t.data_ptr(), tuple(t.shape), dtype, t, t.device.index)


def _to_tensor(a: Any) -> Tensor:
    """Zero-copy tensor of a NumPy or CuPy array."""
    if isinstance(a, np.ndarray):
        a = np.ascontiguousarray(a)
        if a.dtype == bfloat16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    return torch.from_dlpack(a)


# The innermost ``_on_device`` scope of this thread: (device index, torch stream handle).
_scope = threading.local()


@functools.cache
def _torch_allocator() -> Any:
    """A CuPy allocator drawing from torch's caching allocator on torch's current stream: one
    memory pool for both, and the kernels' workspaces counted in torch's memory statistics.

    Inside an ``_on_device`` scope (where CuPy's device, hence the CUDA runtime's and torch's
    current device, is the allocation's) it calls torch's raw allocation with the scope's
    stream: the public wrapper's device and stream lookups cost more host time than the
    allocation itself, and a call allocates tens of arrays."""
    import cupy

    raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)

    def malloc(size: int, device: int) -> int:
        if size == 0:  # nothing to allocate (and nothing for torch to free later)
            return 0
        scope = getattr(_scope, "current", None)
        if raw_alloc is not None and scope is not None and scope[0] == device:
            return int(raw_alloc(size, scope[1]))
        return int(torch.cuda.caching_allocator_alloc(size, device, torch.cuda.current_stream(device)))

    delete = torch.cuda.caching_allocator_delete  # bound now: at interpreter exit `torch` is None

    def free(ptr: int, device: int) -> None:
        if ptr:
            try:
                delete(ptr)
            except Exception:  # torch torn down first at interpreter exit: the process frees all
                pass

    return cupy.cuda.PythonFunctionAllocator(malloc, free)


def _capturing(t: Tensor) -> bool:
    """Whether torch's current stream is capturing a CUDA graph (no host reads then)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class _on_device:
    """Run CuPy work on the tensor's device and torch's current stream, allocating through
    torch's caching allocator (no-op on the CPU)."""

    def __init__(self, t: Tensor) -> None:
        self._ctx: list[Any] = []
        self._scope: tuple[int, int] | None = None
        self._outer: tuple[int, int] | None = None
        self._stream: Any = None
        if t.is_cuda:
            self._stream = torch.cuda.current_stream(t.device)
            self._scope = (t.device.index, self._stream.cuda_stream)

    def __enter__(self) -> "_on_device":
        if self._scope is not None:
            import cupy

            # The device first: CuPy may tag an external stream with the device current at its
            # wrapping, so a stream wrapped earlier, for a tensor on another device than the
            # current one, would meet a stream/device mismatch.
            self._ctx = [cupy.cuda.Device(self._scope[0])]
            self._ctx[0].__enter__()
            for c in (
                cupy.cuda.Stream.from_external(self._stream),
                cupy.cuda.using_allocator(_torch_allocator().malloc),
            ):
                self._ctx.append(c)
                c.__enter__()
            self._outer = getattr(_scope, "current", None)
            # torch's raw allocation takes torch's current device: the fast path only where
            # it agrees with CuPy's (both read the CUDA runtime's, barring torch's lazy init).
            same = torch.cuda.current_device() == self._scope[0]
            _scope.current = self._scope if same else None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._scope is not None:
            _scope.current = self._outer
        for c in reversed(self._ctx):
            c.__exit__(*exc)


# ----------------------------------------------------------------------------- custom ops

_EMPTY = (0,)


def _down_weight(w_down: Tensor) -> Any:
    """``w_down`` (d_model, d_ff) as an array view whose transpose, the kernels' layout (one row
    per hidden unit), is contiguous: transposed by the library's tiled kernel, or (CPU tensors,
    ``TWELL_DENSE_TRANSPOSE=0``) by torch's copy, where the ops would otherwise make it with
    CuPy's strided one."""
    # A transposed view (tied weights) is already in that layout: no copy is made then.
    if _dense_transpose.PREFERRED and w_down.is_cuda:
        return _dense_transpose.contiguous_transpose(_to_array(w_down)).T
    return _to_array(w_down.t().contiguous()).T


@torch.library.custom_op(f"{_NAMESPACE}::ffn_fwd", mutates_args=())
def _ffn_fwd(
    x: Tensor,
    w_act: Tensor,
    w_lin: Tensor | None,
    w_down: Tensor,
    activation: str,
    tile_n: int,
    capacity: int,
    threshold: float | None,
    spill_capacity: int | None = None,
    keep_linear: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """out, act TwELL parts (data, indices, counts, spill_data, spill_indices, spill_indptr),
    linear values on the pattern (data, spill_data; empty when non-gated or without
    ``keep_linear``), and the spilled entries left out (int64, one element; nonzero only with a
    ``spill_capacity`` too small).

    With ``spill_capacity`` the spill arrays have that fixed length (zero past
    ``spill_indptr[-1]``) and nothing is read back: capturable in a CUDA graph.
    ``keep_linear=False`` serves forwards without a backward (the linear values are the
    backward's input only): the gated consumer then neither zeroes nor stores them."""
    with _on_device(x):
        w_lin_a = _to_array(w_lin) if w_lin is not None else None
        out, g, u, left_out = forward_arrays(
            _to_array(x),
            _to_array(w_act),
            w_lin_a,
            _down_weight(w_down),
            activation,
            tile_n,
            capacity,
            threshold,
            spill_capacity,
            keep_linear,
        )
        p = g.parts
        xp = array_module(p.data)
        if u is None:
            u_data, u_spill = xp.empty(_EMPTY, dtype=p.data.dtype), xp.empty(_EMPTY, dtype=p.data.dtype)
        else:
            u_data, u_spill = u.data, u.spill_data
        if is_cupy_array(left_out):  # the fixed spill's device count
            left = left_out.astype(np.int64).reshape(1)
        else:  # 0 on the exact path: filled on the device, no host-to-device copy
            left = xp.full(1, left_out, dtype=np.int64)
        results = (out, p.data, p.indices, p.counts, p.spill_data, p.spill_indices, p.spill_indptr, u_data, u_spill)
        return tuple(_to_tensor(a) for a in (*results, left))  # type: ignore[return-value]


@_ffn_fwd.register_fake
def _ffn_fwd_fake(
    x, w_act, w_lin, w_down, activation, tile_n, capacity, threshold, spill_capacity=None, keep_linear=True
):
    m = x.shape[0]
    nt = n_tiles(w_act.shape[0], tile_n)
    n_spill = torch.library.get_ctx().new_dynamic_size() if spill_capacity is None else spill_capacity
    kept = w_lin is not None and keep_linear
    n_u, n_u_spill = ((m, nt, capacity), (n_spill,)) if kept else (_EMPTY, _EMPTY)
    return (
        x.new_empty((m, w_down.shape[0])),
        x.new_empty((m, nt, capacity)),
        x.new_empty((m, nt, capacity), dtype=torch.int16),
        x.new_empty((m, nt), dtype=torch.int32),
        x.new_empty((n_spill,)),
        x.new_empty((n_spill,), dtype=torch.int32),
        x.new_empty((m + 1,), dtype=torch.int32),
        x.new_empty(n_u),
        x.new_empty(n_u_spill),
        x.new_empty((1,), dtype=torch.int64),
    )


@torch.library.custom_op(f"{_NAMESPACE}::ffn_bwd", mutates_args=())
def _ffn_bwd(
    grad_out: Tensor,
    grad_act: Tensor,
    grad_act_spill: Tensor,
    x: Tensor,
    w_act: Tensor,
    w_lin: Tensor | None,
    w_down: Tensor,
    act_data: Tensor,
    indices: Tensor,
    counts: Tensor,
    act_spill: Tensor,
    spill_indices: Tensor,
    spill_indptr: Tensor,
    u_data: Tensor,
    u_spill: Tensor,
    activation: str,
    tile_n: int,
    fixed_spill: bool = False,
    needs: int = 0b1111,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw_act, dw_lin (empty when non-gated), dw_down); empty grad_act means none.
    ``fixed_spill``: the forward ran with a ``spill_capacity`` (spill arrays longer than their
    entries). The GPU kernels read the spill by its row pointers, so nothing is read back and
    the backward can be captured in a CUDA graph; the CPU reference wants exact arrays, which
    it trims to for free. ``needs``: bit i set computes the i-th result (:func:`_need_bits`);
    the others come back empty and their products are skipped."""
    with _on_device(x):
        a = {
            k: _to_array(t)
            for k, t in dict(
                go=grad_out,
                x=x,
                wa=w_act,
                d=act_data,
                i=indices,
                c=counts,
                sd=act_spill,
                si=spill_indices,
                sp=spill_indptr,
            ).items()
        }
        a["wd"] = _down_weight(w_down)
        shape = (x.shape[0], w_act.shape[0])
        parts = TwELLParts(a["d"], a["i"], a["c"], a["sd"], a["si"], a["sp"])
        if fixed_spill and not is_cupy_array(parts.data):
            parts = trimmed_spill(parts)
        n = parts.spill_data.shape[0]  # the values' spill arrays share the forward's length
        g = twell_array._from_parts(parts, shape, tile_n)
        u = with_values(g, _to_array(u_data), _to_array(u_spill)[:n]) if w_lin is not None else None
        d_act = None
        if grad_act.numel() or grad_act_spill.numel():
            d_act = with_values(g, _to_array(grad_act), _to_array(grad_act_spill)[:n])
        w_lin_a = _to_array(w_lin) if w_lin is not None else None
        wanted = tuple(bool(needs >> i & 1) for i in range(4))
        results = backward_arrays(a["go"], d_act, a["x"], a["wa"], w_lin_a, a["wd"], g, u, activation, wanted)
        xp = array_module(a["x"])
        empty = lambda: xp.empty(_EMPTY, dtype=a["x"].dtype)  # noqa: E731  (one per output: no aliasing)
        return tuple(_contiguous_tensor(r if r is not None else empty()) for r in results)  # type: ignore[return-value]


def _contiguous_tensor(a: Any) -> Tensor:
    """A contiguous tensor of ``a``; a transposed view (dW_down comes out as one) is transposed
    by the library's tiled kernel, or (``TWELL_DENSE_TRANSPOSE=0``) by torch's copy, rather than
    by CuPy's strided one."""
    if a.ndim == 2 and not a.flags.c_contiguous and a.T.flags.c_contiguous:
        if _dense_transpose.PREFERRED and is_cupy_array(a):
            return _to_tensor(_dense_transpose.transpose(a.T))
        return _to_tensor(a.T).t().contiguous()
    return _to_tensor(array_module(a).ascontiguousarray(a))


@_ffn_bwd.register_fake
def _ffn_bwd_fake(
    grad_out, grad_act, grad_act_spill, x, w_act, w_lin, w_down, act_data, indices, counts, act_spill,
    spill_indices, spill_indptr, u_data, u_spill, activation, tile_n, fixed_spill=False, needs=0b1111,
):  # fmt: skip
    like = (x, w_act, w_lin, w_down)
    return tuple(
        torch.empty_like(t) if t is not None and needs >> i & 1 else x.new_empty(_EMPTY) for i, t in enumerate(like)
    )


def _need_bits(needs_input_grad: tuple) -> int:
    """The bit mask of ``_ffn_bwd``'s ``needs`` from autograd's flags for (x, w_act, w_lin,
    w_down)."""
    return sum(1 << i for i, need in enumerate(needs_input_grad[:4]) if need)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, w_act, w_lin, w_down, activation, tile_n, _capacity, _threshold, *optional = inputs
    # The trailing arguments as given, their defaults for the ones left out.
    defaults: list[Any] = [None, True]
    spill_capacity, keep_linear = [*optional, *defaults[len(optional) :]]
    ctx.activation, ctx.tile_n, ctx.gated = activation, tile_n, w_lin is not None
    ctx.kept_linear = keep_linear
    # Outputs nobody differentiated (the activations' TwELL values, unless an L1 penalty reads
    # them) reach the backward as None rather than as zeros: the backward then takes its fused
    # pass (one kernel for dH and the value products) instead of adding a zero gradient.
    ctx.set_materialize_grads(False)
    ctx.fixed_spill = spill_capacity is not None
    saved = output[1:9]
    ctx.save_for_backward(x, w_act, w_lin if w_lin is not None else x.new_empty(_EMPTY), w_down, *saved)
    ctx.mark_non_differentiable(*(output[i] for i in (2, 3, 5, 6, 7, 8, 9)))


def _backward(ctx: Any, grad_out, grad_act, _gi, _gc, grad_act_spill, _gsi, _gsp, _gu, _gus, _glo):
    x, w_act, w_lin, w_down, *saved = ctx.saved_tensors
    if ctx.gated and not ctx.kept_linear:
        raise RuntimeError(
            "twellsparse::ffn_fwd: keep_linear=False drops the values the backward needs; "
            "differentiate a call with keep_linear=True"
        )
    if grad_out is None:
        grad_out = torch.zeros((x.shape[0], w_down.shape[0]), dtype=x.dtype, device=x.device)
    empty = x.new_empty(_EMPTY)
    if grad_act is None and grad_act_spill is None:  # no gradient reached the activations
        grad_act = grad_act_spill = empty
    else:  # one of the pair reached: the other is zero
        grad_act = grad_act if grad_act is not None else torch.zeros_like(saved[0])
        grad_act_spill = grad_act_spill if grad_act_spill is not None else torch.zeros_like(saved[3])
    dx, dw_act, dw_lin, dw_down = _ffn_bwd(
        grad_out.contiguous(),
        grad_act.contiguous(),
        grad_act_spill.contiguous(),
        x,
        w_act,
        w_lin if ctx.gated else None,
        w_down,
        *saved,
        ctx.activation,
        ctx.tile_n,
        ctx.fixed_spill,
        _need_bits(ctx.needs_input_grad),
    )
    grads = [g if need else None for g, need in zip((dx, dw_act, dw_lin, dw_down), ctx.needs_input_grad, strict=False)]
    if not ctx.gated:
        grads[2] = None
    return (*grads, None, None, None, None, None, None)


_ffn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx: Any, *grads: Any) -> tuple:
    raise NotImplementedError(
        "twellsparse.torch: double backward (a backward through the sparse backward, as "
        "create_graph=True asks for) is not supported"
    )


_ffn_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


# ----------------------------------------------------------------------------- functions


#: The argument names of the gated and the non-gated functions' weights (w_act, w_lin, w_down).
GATED_NAMES, PLAIN_NAMES = ("w_gate", "w_up", "w_down"), ("w_up", None, "w_down")


def _autocast(x: Tensor, *weights: Tensor | None) -> tuple[Any, ...]:
    """``x`` and the weights in the autocast dtype inside a ``torch.autocast`` region (as the
    Linears a block replaces would compute: autocast casts floating tensors other than float64),
    unchanged elsewhere."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return (x, *weights)
    dt = torch.get_autocast_dtype(device)
    return tuple(
        t.to(dt) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t for t in (x, *weights)
    )


def _check_operands(x: Any, w_act: Any, w_lin: Any, w_down: Any, names: tuple) -> None:
    """Types, shapes and dtypes of a block's operands, with one-line errors in the caller's
    names (``names``: those of w_act, w_lin, w_down)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 1 or not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor of at least 1 dimension, got {x.dtype} {tuple(x.shape)}")
    act_name, lin_name, down_name = names
    for name, t in ((act_name, w_act), (lin_name, w_lin), (down_name, w_down)):
        if name is not None and (not isinstance(t, Tensor) or t.ndim != 2):
            got = f"{t.ndim}-D {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"{name}: expected a 2-D torch.Tensor, got {got}")
    d_ff, d_model = w_act.shape
    if x.shape[-1] != d_model:
        raise ValueError(
            f"x: expected a last dimension of {d_model} ({act_name}'s columns), got shape {tuple(x.shape)}"
        )
    if w_lin is not None and w_lin.shape != w_act.shape:
        raise ValueError(f"{lin_name}: expected shape {tuple(w_act.shape)} like {act_name}, got {tuple(w_lin.shape)}")
    if tuple(w_down.shape) != (d_model, d_ff):
        raise ValueError(f"{down_name}: expected shape {(d_model, d_ff)}, got {tuple(w_down.shape)}")
    if torch.is_autocast_enabled(x.device.type):  # _autocast gives them one dtype
        return
    for name, t in ((act_name, w_act), (lin_name, w_lin), (down_name, w_down)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name}: expected dtype {x.dtype} like x, got {t.dtype}")


def _run(x, w_act, w_lin, w_down, activation, tile_n, capacity, threshold, spill_capacity=None, names=GATED_NAMES):
    """The op on (x, weights) after the checks and the autocast cast; ``names=None``: done by
    the caller (the modules), which also validated the settings."""
    if names is None:
        act, thr = activation, threshold
    else:
        act = check_activation(activation)
        tile_n = check_tile_n(tile_n)
        capacity = check_capacity(capacity, tile_n)
        thr = check_threshold(threshold)
        _check_operands(x, w_act, w_lin, w_down, names)
        x, w_act, w_lin, w_down = _autocast(x, w_act, w_lin, w_down)
    lead = x.shape[:-1]
    # Where autograd does not record the call no backward can follow: the gated block's linear
    # values, the backward's input, are neither zeroed nor stored.
    recorded = _recorded(x, w_act, w_lin, w_down)
    out, *hidden = torch.ops.twellsparse.ffn_fwd(
        x.reshape(-1, x.shape[-1]).contiguous(),
        w_act,
        w_lin,
        w_down,
        act,
        tile_n,
        capacity,
        thr,
        spill_capacity,
        recorded,
    )
    return out.reshape(*lead, w_down.shape[0]), hidden


def _recorded(*tensors: Tensor | None) -> bool:
    """Whether autograd records a call on these tensors: grad mode on (not ``torch.no_grad()``
    or ``inference_mode``) and one of them requiring grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def ffn(
    x: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    *,
    activation: str = "relu",
    tile_n: int = 256,
    capacity: int | None = None,
    threshold: float | None = None,
) -> Tensor:
    """Differentiable non-gated sparse FFN ``act(x @ w_up.T) @ w_down.T`` (see the module doc).

    A ``torch.library`` custom op (``torch.ops.twellsparse.ffn_fwd``) with a sparse backward:
    gradients reach ``x``, ``w_up`` and ``w_down`` without a dense tokens x d_ff tensor, and the
    call traces under ``torch.compile``. It always runs the sparse path and is exact (overflowing
    row-tiles spill). Double backward is not supported.

    Parameters
    ----------
    x : Tensor, shape (..., d_model)
        Floating-point tokens (its leading dimensions are tokens), on the CPU or a CUDA device.
    w_up : Tensor, shape (d_ff, d_model)
        The up projection (``torch.nn.Linear`` layout), in ``x``'s dtype.
    w_down : Tensor, shape (d_model, d_ff)
        The down projection, in ``x``'s dtype.
    activation : {"relu", "relu2", "silu", "gelu", "identity"}, default "relu"
        Applied to ``x @ w_up.T``; silu and gelu need a ``threshold`` to be sparse.
    tile_n : int, default 256
        Columns per tile of the TwELL hidden layer, a power of two from 32 to 1024.
    capacity : int, optional
        Slots per row-tile, 1 to ``tile_n``; default ``tile_n // 8``. Entries beyond it spill
        (exact, on a slower path).
    threshold : float, optional
        Keep only hidden entries with ``|act(z)| > threshold`` (finite, >= 0); default: every
        nonzero.

    Returns
    -------
    Tensor, shape (..., d_model)
        On ``x``'s device, in ``x``'s dtype (the autocast dtype inside ``torch.autocast``).

    Raises
    ------
    TypeError
        For a non-tensor or non-floating ``x``, weights that are not 2-D tensors, weights of
        another dtype than ``x`` (outside ``torch.autocast``), or settings of the wrong type.
    ValueError
        For shapes that do not match, or an unknown ``activation`` or out-of-range ``tile_n``,
        ``capacity`` or ``threshold``.
    """
    return _run(x, w_up, None, w_down, activation, tile_n, capacity, threshold, names=PLAIN_NAMES)[0]


def gated_ffn(
    x: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    *,
    activation: str = "relu",
    tile_n: int = 256,
    capacity: int | None = None,
    threshold: float | None = None,
) -> Tensor:
    """Differentiable gated sparse FFN ``(act(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``.

    A ``torch.library`` custom op (``torch.ops.twellsparse.ffn_fwd``) with a sparse backward: the
    gate's activations are kept in TwELL, the up projection's values only on their pattern, and
    gradients reach ``x`` and every weight without a dense tokens x d_ff tensor; the call traces
    under ``torch.compile`` (see the module doc). It always runs the sparse path and is exact
    (overflowing row-tiles spill). Double backward is not supported.

    Parameters
    ----------
    x : Tensor, shape (..., d_model)
        Floating-point tokens (its leading dimensions are tokens), on the CPU or a CUDA device.
    w_gate, w_up : Tensor, shape (d_ff, d_model)
        The gate and up projections (``torch.nn.Linear`` layout), in ``x``'s dtype.
    w_down : Tensor, shape (d_model, d_ff)
        The down projection, in ``x``'s dtype.
    activation : {"relu", "relu2", "silu", "gelu", "identity"}, default "relu"
        Applied to ``x @ w_gate.T``; silu and gelu need a ``threshold`` to be sparse.
    tile_n, capacity, threshold
        As for :func:`ffn`.

    Returns
    -------
    Tensor, shape (..., d_model)
        As for :func:`ffn`.

    Raises
    ------
    TypeError, ValueError
        As for :func:`ffn`.
    """
    return _run(x, w_gate, w_up, w_down, activation, tile_n, capacity, threshold)[0]


def _dense_activation(z: Tensor, activation: str, threshold: float | None) -> Tensor:
    """``act(z)`` in float32 (float64 for float64 z) rounded to z's dtype, with the producers'
    keep rule (entries whose ``|act|`` is at most ``threshold`` zeroed), as the sparse path
    stores it."""
    zf = z.to(torch.promote_types(z.dtype, torch.float32))
    if activation == "relu":
        a = torch.relu(zf)
    elif activation == "relu2":
        a = torch.relu(zf).square()
    elif activation == "silu":
        a = torch.nn.functional.silu(zf)
    elif activation == "gelu":
        a = torch.nn.functional.gelu(zf, approximate="tanh")
    else:
        a = zf
    a = a.to(z.dtype)
    if threshold is not None:
        a = torch.where(a.to(zf.dtype).abs() > threshold, a, torch.zeros_like(a))
    return a


def _dense_run(
    x: Tensor, w_act: Tensor, w_lin: Tensor | None, w_down: Tensor, activation: str, threshold: float | None
) -> tuple[Tensor, Tensor]:
    """The block computed densely by torch (autograd as usual): (output, activations)."""
    h_act = _dense_activation(x @ w_act.T, activation, threshold)
    h = h_act if w_lin is None else h_act * (x @ w_lin.T)
    return h @ w_down.T, h_act


# ----------------------------------------------------------------------------- modules


def _transient_state() -> dict[str, Any]:
    """What the last forward left for stats() and l1_penalty(), and the plans' host state: fresh
    at construction and in every copy (the hidden tensors hold that forward's autograd graph,
    which deepcopy and pickling refuse or would drag along)."""
    return {
        "_hidden": None,
        "_dense_hidden": None,
        "_density": PostedScalar(),
        "_left_out": PostedScalar(),
        "_plan": None,
        "_plan_key": ((), ()),
    }


class _TwELLMLPBase(nn.Module):
    hidden_size: int
    intermediate_size: int

    def __init__(
        self,
        projections: tuple[str, ...],
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        tile_n: int,
        capacity: int | None,
        threshold: float | None,
        dispatch: str,
        breakeven: float | None,
        spill_capacity: int | None,
        device: Any,
        dtype: Any,
        down_format: str | None = None,
        up_format: str | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        for name in projections:  # bias-free Linears in the Llama naming
            shape = (intermediate_size, hidden_size) if name == "down_proj" else (hidden_size, intermediate_size)
            setattr(self, name, nn.Linear(*shape, bias=False, device=device, dtype=dtype))
        settings = check_block_settings(activation, tile_n, capacity, threshold, dispatch, breakeven, spill_capacity)
        self.activation, self.tile_n, self.capacity, self.threshold = (settings[k] for k in BLOCK_SETTINGS[:4])
        self.dispatch, self.breakeven, self.spill_capacity = (settings[k] for k in BLOCK_SETTINGS[4:])
        gated = "gate_proj" in projections
        self._kind = "gated_ffn" if gated else "ffn"
        self.__dict__.update(_transient_state())
        self.down_format = check_format(down_format, "down_format", optional=True)
        self.up_format = check_format(up_format, "up_format", optional=True)
        names = ("gate_proj", "up_proj", "down_proj") if gated else ("up_proj", None, "down_proj")
        self._weight_names = tuple(f"{n}.weight" if n else None for n in names)  # for error messages

    _hidden: list[Tensor] | None  # the last sparse forward's TwELL parts
    _dense_hidden: Tensor | None  # the last dense forward's activations
    _density: PostedScalar
    _left_out: PostedScalar  # entries a fixed spill_capacity could not hold
    _plan: FFN | GatedFFN | None  # the fp8 forward's plan
    _plan_key: tuple  # the (layout, versions) of the weights it was built on

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, **_transient_state()}

    @property
    def _fp8_rows(self) -> bool:
        """Whether the forward runs the fp8 plan (inference only)."""
        return self.down_format is not None or self.up_format is not None

    def _forward(self, x: Tensor, w_act: Tensor, w_lin: Tensor | None, w_down: Tensor) -> Tensor:
        names = self._weight_names
        _check_operands(x, w_act, w_lin, w_down, names)
        if self._fp8_rows:
            # Its plan is built on the weights as they are (autocast copies would rebuild it every
            # forward): under autocast the input takes the weights' dtype instead.
            x = x.to(w_act.dtype) if torch.is_autocast_enabled(x.device.type) else x
            return self._quantized_forward(x, w_act, w_lin, w_down)
        x, w_act, w_lin, w_down = _autocast(x, w_act, w_lin, w_down)
        if self._path(x.numel() // max(x.shape[-1], 1)) == "dense":
            out, h = _dense_run(x, w_act, w_lin, w_down, self.activation, self.threshold)
            self._hidden, self._dense_hidden = None, h
            if self.dispatch == "auto":
                rows = h.reshape(-1, h.shape[-1])
                rows = rows[:: max(1, rows.shape[0] // DENSITY_SAMPLE_ROWS)].detach()
                self._post_density(torch.count_nonzero(rows) / max(rows.numel(), 1))
            return out
        # The previous forward's entries left out are read after this forward is queued, so the
        # wait overlaps this forward's kernels.
        previous = self._pop_left_out(x) if self.spill_capacity is not None else None
        settings = (self.activation, self.tile_n, self.capacity, self.threshold, self.spill_capacity)
        out, hidden = _run(x, w_act, w_lin, w_down, *settings, names=None)
        self._hidden, self._dense_hidden = hidden, None
        if self.spill_capacity is not None:
            self._post_left_out(hidden[-1], previous)
        if self.dispatch == "auto":
            counts, spill_indptr = hidden[2], hidden[5]
            self._post_density((counts.sum() + spill_indptr[-1]) / max(counts.shape[0] * self.intermediate_size, 1))
        return out

    @torch.compiler.disable  # host work around a plan (a graph break under torch.compile)
    def _pop_left_out(self, x: Tensor) -> Any:
        return None if _capturing(x) else self._left_out.pop()

    @torch.compiler.disable
    def _post_left_out(self, left_out: Tensor, previous: Any) -> None:
        """Post this forward's entries left out (no sync), then check the previous forward's."""
        with _on_device(left_out):
            self._left_out.post(_to_array(left_out).reshape(()))
        raise_for_previous(previous, self._left_out, self.spill_capacity, "the previous forward")

    @torch.compiler.disable
    def _quantized_forward(self, x: Tensor, w_act: Tensor, w_lin: Tensor | None, w_down: Tensor) -> Tensor:
        """The inference forward with fp8 e4m3 weight rows: a :class:`twellsparse.GatedFFN` /
        :class:`twellsparse.FFN` plan on the module's weights, built on the first call and again
        when a weight is replaced or updated in place (its version counter moves)."""
        weights = (w_act, w_down) if w_lin is None else (w_act, w_lin, w_down)
        if _recorded(x, *weights):
            raise RuntimeError(
                f"{type(self).__name__}: fp8 weight rows (down_format={self.down_format!r}, "
                f"up_format={self.up_format!r}) serve inference only: call it under torch.no_grad() or "
                "torch.inference_mode(), or build the module without them to train"
            )
        layout = tuple((w.data_ptr(), w.device, w.dtype, tuple(w.shape)) for w in weights)
        versions = tuple(w._version for w in weights)
        with _on_device(x):
            if self._plan is None or self._plan_key[0] != layout:
                arrays = [_to_array(w) for w in weights]
                settings: dict[str, Any] = dict(
                    activation=self.activation,
                    tile_n=self.tile_n,
                    capacity=self.capacity,
                    threshold=self.threshold,
                    dispatch=self.dispatch,
                    breakeven=self.breakeven,
                    spill_capacity=self.spill_capacity,
                    down_format=self.down_format,
                )
                if w_lin is None:
                    self._plan = FFN(*arrays, **settings)
                else:
                    self._plan = GatedFFN(*arrays, **settings, up_format=self.up_format)
            elif self._plan_key[1] != versions:
                self._plan.refresh()  # updated in place: quantize the rows again
            self._plan_key = (layout, versions)
            plan = self._plan
            out = _to_tensor(plan(_to_array(x.reshape(-1, x.shape[-1]))))
        self._hidden, self._dense_hidden = None, None
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def check_spill(self) -> None:
        """Check whether the last forward with a fixed ``spill_capacity`` left spilled entries out.

        Forwards check the previous one themselves; after replaying a captured graph,
        synchronise, then call this. The count is forgotten once read, so it is reported once.

        Raises
        ------
        twellsparse.TwELLSpillCapacityError
            If that forward left spilled entries out (its output was computed without them).
        """
        if self._plan is not None:  # the fp8 forward's plan
            self._plan.check_spill()
            return
        raise_left_out(self._left_out, self.spill_capacity, "the previous forward")

    @torch.compiler.disable
    def _post_density(self, fraction: Tensor) -> None:
        """Hand the 0-d density to the plans' posted scalar (copied on torch's stream, no sync)."""
        with _on_device(fraction):
            self._density.post(_to_array(fraction.to(torch.float64)))

    def _path(self, tokens: int) -> str:
        """``"sparse"`` or ``"dense"``: under ``dispatch="auto"`` the previous forward's density
        (posted without a host sync) against ``breakeven`` (by default the measured break-even
        of the module's widths and this forward's tokens); the first forward runs sparse."""
        if self.dispatch != "auto":
            return self.dispatch  # traced through: "sparse" and "dense" compile in one graph
        return self._auto_path(tokens)

    @torch.compiler.disable  # a host read of the posted density: a graph break
    def _auto_path(self, tokens: int) -> str:
        density = self._density.value()
        breakeven = breakeven_for(self.breakeven, self._kind, tokens, self.hidden_size, self.intermediate_size)
        return "dense" if density is not None and density > breakeven else "sparse"

    def l1_penalty(self) -> Tensor:
        """Return the L1 penalty of the last forward's hidden activations, for the training loss.

        The module holds those activations (and so that forward's autograd graph) until its next
        forward; run forwards whose graph is not needed under ``torch.no_grad()``.

        Returns
        -------
        Tensor
            0-d: the mean over tokens of the L1 norm of the hidden activations (the gate's,
            ``act(gate_proj(x))``, for the gated block), sparse or dense path alike; differentiable
            (when autograd recorded that forward), for adding to the training loss.

        Raises
        ------
        RuntimeError
            Before the first forward, or after a forward with fp8 weight rows (inference only).
        """
        if self._dense_hidden is not None:
            h = self._dense_hidden
            return h.abs().sum() / max(h.numel() // max(h.shape[-1], 1), 1)
        if self._plan is not None:
            raise RuntimeError("l1_penalty: the last forward ran with fp8 weight rows (inference only)")
        if self._hidden is None:
            raise RuntimeError("l1_penalty: run a forward pass first")
        data, _, counts, spill, *_ = self._hidden
        return (data.abs().sum() + spill.abs().sum()) / max(counts.shape[0], 1)

    def stats(self) -> dict[str, Any]:
        """Report on the last forward's hidden layer (reads back from the device: call it outside
        the hot path).

        Returns
        -------
        dict
            ``"nnz_per_token"`` (float), ``"density"`` (float, nonzeros over tokens x
            ``intermediate_size``), ``"n_spilled"`` (int, entries beyond their row-tile's capacity;
            0 on the dense path) and ``"dense_fallback"`` (bool, whether the dense torch computation
            ran); empty before the first forward. After a forward with fp8 weight rows, those of
            these keys that the plan's ``last_stats`` has.
        """
        units = self.intermediate_size
        if self._plan is not None:
            last = self._plan.last_stats
            keys = ("nnz_per_token", "density", "n_spilled", "dense_fallback")
            return {k: last[k] for k in keys if k in last}
        if self._dense_hidden is not None:
            tokens = self._dense_hidden.numel() // max(units, 1)
            nnz, n_spilled, dense = int(torch.count_nonzero(self._dense_hidden)), 0, True
        elif self._hidden is not None:
            counts, spill_indptr = self._hidden[2], self._hidden[5]
            tokens = counts.shape[0]
            n_spilled = int(spill_indptr[-1])  # a fixed spill_capacity's arrays are longer
            nnz, dense = int(counts.sum()) + n_spilled, False
        else:
            return {}
        return {
            "nnz_per_token": nnz / max(tokens, 1),
            "density": nnz / max(tokens * units, 1),
            "n_spilled": n_spilled,
            "dense_fallback": dense,
        }


class TwELLMLP(_TwELLMLPBase):
    """Non-gated MLP ``down_proj(act(up_proj(x)))`` with a TwELL hidden layer (no biases).

    Parameters
    ----------
    hidden_size, intermediate_size : int
        d_model and d_ff.
    activation : str
        ``"relu"`` (default), ``"relu2"``, or ``"silu"``/``"gelu"`` with a ``threshold``.
    tile_n, capacity, threshold
        As for :func:`twellsparse.linear_to_twell`.
    dispatch : {"sparse", "auto", "dense"}
        ``"auto"`` runs the dense torch computation (and says so in :meth:`stats`) while the
        previous forward's density is above ``breakeven``; its decision is Python control flow
        (a graph break under ``torch.compile``, where "sparse" or "dense" fit better).
    breakeven : float, optional
        Density above which ``"auto"`` runs dense; by default the forward's measured break-even
        for the module's widths and each forward's tokens (``twellsparse.FFN``'s). Training's
        break-even is lower (see ``bench/NOTES.md``).
    spill_capacity : int, optional
        A fixed length for the spill of row-tiles above ``capacity`` (as for
        :class:`twellsparse.GatedFFN`): the forward then reads nothing back to the host and can
        be captured in a CUDA graph (``torch.cuda.graph``) when shapes are static. Entries that
        do not fit raise :class:`twellsparse.TwELLSpillCapacityError` at the next forward or
        :meth:`check_spill`; the GPU backward reads nothing back either, so a whole training step
        can be captured. Needs operands the row-gather kernels take (one dtype, rows of a
        multiple of 16 bytes); elsewhere the forward is the exact one.
    down_format : {None, "e4m3"}, optional
        Inference only, opt-in and lossy: the forward runs a :class:`twellsparse.FFN` plan whose
        gathered ``down_proj`` rows are fp8 e4m3 with a float32 scale each (half the bytes per
        active unit; each weight moves by up to 2**-4 of itself). The plan is built on the
        module's weights at the first forward and again when one is replaced or updated in
        place. Forwards that need gradients raise; train without it. ``stats()`` reports the
        plan's last call; ``l1_penalty()`` is not available after such a forward.
    """

    up_proj: nn.Linear
    down_proj: nn.Linear

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: str = "relu",
        tile_n: int = 256,
        capacity: int | None = None,
        threshold: float | None = None,
        dispatch: str = "sparse",
        breakeven: float | None = None,
        spill_capacity: int | None = None,
        down_format: str | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        projections = ("up_proj", "down_proj")
        settings = (activation, tile_n, capacity, threshold, dispatch, breakeven, spill_capacity)
        args = (hidden_size, intermediate_size, *settings, device, dtype)
        super().__init__(projections, *args, down_format=down_format)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block, ``down_proj(act(up_proj(x)))``, with a TwELL hidden layer.

        ``dispatch`` may run the dense torch computation instead. The hidden activations are kept
        for :meth:`stats` and :meth:`l1_penalty` until the next forward.

        Parameters
        ----------
        x : Tensor, shape (..., hidden_size)
            Floating-point tokens, in the weights' dtype outside ``torch.autocast``.

        Returns
        -------
        Tensor, shape (..., hidden_size)
            In ``x``'s dtype: inside ``torch.autocast`` the autocast dtype (the weights' with fp8
            weight rows).

        Raises
        ------
        TypeError
            For a non-tensor or non-floating ``x``, or (outside ``torch.autocast``) one of another
            dtype than the weights.
        ValueError
            For an ``x`` whose last dimension is not ``hidden_size``.
        RuntimeError
            With fp8 weight rows (``down_format``), for a forward that autograd records (inference only).
        twellsparse.TwELLSpillCapacityError
            With a fixed ``spill_capacity``, when the previous forward left spilled entries out
            (raised after this forward is queued; its output is not returned).
        """
        return self._forward(x, self.up_proj.weight, None, self.down_proj.weight)


class TwELLGatedMLP(_TwELLMLPBase):
    """Llama-style gated MLP ``down_proj(act(gate_proj(x)) * up_proj(x))`` with a TwELL gate.

    Parameter names match Llama/Qwen MLPs (``gate_proj``, ``up_proj``, ``down_proj``), so their
    state dicts load directly. Arguments as for :class:`TwELLMLP`, and ``up_format`` (inference
    only, as ``down_format``): ``up_proj``'s rows, gathered at the gate's active units, in fp8
    e4m3 too (:class:`twellsparse.GatedFFN`'s ``up_format``).
    """

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: str = "relu",
        tile_n: int = 256,
        capacity: int | None = None,
        threshold: float | None = None,
        dispatch: str = "sparse",
        breakeven: float | None = None,
        spill_capacity: int | None = None,
        down_format: str | None = None,
        up_format: str | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        projections = ("gate_proj", "up_proj", "down_proj")
        settings = (activation, tile_n, capacity, threshold, dispatch, breakeven, spill_capacity)
        args = (hidden_size, intermediate_size, *settings, device, dtype)
        super().__init__(projections, *args, down_format=down_format, up_format=up_format)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block, ``down_proj(act(gate_proj(x)) * up_proj(x))``, with a TwELL gate.

        ``dispatch`` may run the dense torch computation instead. The gate's activations are kept
        for :meth:`stats` and :meth:`l1_penalty` until the next forward. Parameters, result and
        errors as :meth:`TwELLMLP.forward` (fp8 weight rows: ``down_format`` or ``up_format``).
        """
        return self._forward(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def from_module(
    mlp: nn.Module,
    *,
    activation: str = "relu",
    tile_n: int = 256,
    capacity: int | None = None,
    threshold: float | None = None,
    dispatch: str = "sparse",
    breakeven: float | None = None,
    spill_capacity: int | None = None,
    down_format: str | None = None,
    up_format: str | None = None,
) -> _TwELLMLPBase:
    """Build a TwELL MLP sharing the parameters of a Llama/Qwen-style MLP.

    Use ``activation="relu"`` for ReLU-trained checkpoints, or ``"silu"`` with a ``threshold`` to
    run a SwiGLU checkpoint sparsely (entries with ``|silu(z)| <= threshold`` are dropped).

    Parameters
    ----------
    mlp : torch.nn.Module
        A gated MLP (``gate_proj``, ``up_proj``, ``down_proj``) or a non-gated one (``up_proj``,
        ``down_proj``), its projections ``nn.Linear`` without bias.
    activation, tile_n, capacity, threshold, dispatch, breakeven, spill_capacity
        As for :class:`TwELLMLP` (defaults "relu", 256, ``tile_n // 8``, None, "sparse", None, None).
    down_format : {None, "e4m3"}, optional
        As for :class:`TwELLMLP` (inference only).
    up_format : {None, "e4m3"}, optional
        As for :class:`TwELLGatedMLP` (inference only; gated MLPs only).

    Returns
    -------
    TwELLGatedMLP or TwELLMLP
        TwELLGatedMLP when ``mlp`` has a ``gate_proj``, else TwELLMLP. It holds ``mlp``'s Linear
        modules themselves (parameters shared, not copied), so it has their device and dtype.

    Raises
    ------
    TypeError
        For a module without ``up_proj`` and ``down_proj``, or settings of the wrong type.
    ValueError
        For a projection with a bias, widths that do not match (``gate_proj`` and ``up_proj``
        d_model -> d_ff, ``down_proj`` d_ff -> d_model), an ``up_format`` for a non-gated MLP, or
        out-of-range settings.
    """
    linears = {name: getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")}
    if linears["up_proj"] is None or linears["down_proj"] is None:
        raise TypeError(f"mlp: expected a module with up_proj and down_proj, got {type(mlp).__name__}")
    for name, lin in linears.items():
        if lin is not None and getattr(lin, "bias", None) is not None:
            raise ValueError(f"mlp.{name}: expected a Linear without bias, got one with a bias")
    up = linears["up_proj"]
    assert up is not None
    gate, down = linears["gate_proj"], linears["down_proj"]
    if gate is not None and (gate.in_features, gate.out_features) != (up.in_features, up.out_features):
        raise ValueError(
            f"mlp.up_proj: expected {gate.in_features} -> {gate.out_features} features like gate_proj, got "
            f"{up.in_features} -> {up.out_features}"
        )
    if (down.in_features, down.out_features) != (up.out_features, up.in_features):
        raise ValueError(
            f"mlp.down_proj: expected {up.out_features} -> {up.in_features} features (up_proj's reversed), "
            f"got {down.in_features} -> {down.out_features}"
        )
    kwargs: dict[str, Any] = dict(
        activation=activation,
        tile_n=tile_n,
        capacity=capacity,
        threshold=threshold,
        dispatch=dispatch,
        breakeven=breakeven,
        spill_capacity=spill_capacity,
        down_format=down_format,
    )
    new: _TwELLMLPBase
    if linears["gate_proj"] is not None:
        new = TwELLGatedMLP(up.in_features, up.out_features, device="meta", up_format=up_format, **kwargs)
    elif up_format is not None:
        raise ValueError(f"up_format: expected None for a non-gated MLP (no gate), got {up_format!r}")
    else:
        new = TwELLMLP(up.in_features, up.out_features, device="meta", **kwargs)
    for name, lin in linears.items():
        if lin is not None:
            setattr(new, name, lin)  # share the caller's Linear (and its parameters)
    return new


def swap_mlps(model: nn.Module, **kwargs: Any) -> int:
    """Replace, in place, every submodule called ``mlp`` that has ``up_proj``/``down_proj`` with its
    TwELL counterpart (``from_module(child, **kwargs)``).

    MLPs that are TwELL modules already are left as they are (with their settings). Every
    candidate is converted before any is swapped in, so an MLP that cannot be converted (a
    bias, mismatched widths) raises, naming its path in ``model``, with the model unchanged.

    Parameters
    ----------
    model : torch.nn.Module
        The model to modify in place.
    **kwargs
        Keyword arguments of :func:`from_module` (``activation``, ``tile_n``, ...), the same for
        every MLP.

    Returns
    -------
    int
        How many MLPs were replaced.

    Raises
    ------
    TypeError, ValueError
        As :func:`from_module` (an unknown keyword included), the message naming the MLP's path
        in ``model``.
    """
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if name == "mlp" and hasattr(child, "up_proj") and hasattr(child, "down_proj"):
                if not isinstance(child, _TwELLMLPBase):
                    found.append((parent, name, child, f"{parent_name}.{name}" if parent_name else name))
    converted = []
    for parent, name, child, path in found:
        try:
            converted.append((parent, name, from_module(child, **kwargs)))
        except (TypeError, ValueError) as err:
            msg = str(err)  # from_module names the module "mlp": name it by its path instead
            raise type(err)(path + msg[3:] if msg.startswith(("mlp.", "mlp:")) else f"{path}: {msg}") from None
    for parent, name, new in converted:
        setattr(parent, name, new)
    return len(converted)
