"""The FFN blocks' forward and sparse backward on NumPy/CuPy arrays, framework-neutral.

The framework adapters (``twellsparse.torch``, ``twellsparse.jax``) wrap these in their
own autodiff machinery. With ``P`` the activation's TwELL pattern, ``h = act(z) * u`` on ``P``
(``u = 1`` for the non-gated block) and ``out = h @ W_down.T``::

    dH      = (dOut @ W_down) on P            (SDDMM)
    dW_down = (h.T @ dOut).T                  (transposed SpMM)
    dZ      = (dH * u + dAct) * act'(z) on P  (dAct: gradient reaching the activations, e.g. L1)
    dU      = dH * act(z) on P
    dW_act  = dZ.T @ x,  dW_lin = dU.T @ x,   dX = dZ @ W_act + dU @ W_lin

No dense tokens x d_ff array is ever formed.
"""

from __future__ import annotations

import math
from typing import Any

from . import _stationary
from ._backend import array_module, is_cupy_array
from ._errors import TwELLSpillCapacityError
from ._ops import (
    fused_gated_backward,
    gated_product,
    gather_tail_eligible,
    linear_to_parts_deferred,
    matmul,
    matmul_sum,
    product_values,
    sddmm,
    tail_then_finish,
    tiled_gated_backward,
    transposed_products,
    with_values,
)
from ._ops import values_op as _values_op
from ._posted import PostedByKey, PostedScalar
from ._twell import twell_array
from ._validation import check_activation, check_layout, check_threshold


def _activation_grad(activation: str, z: Any) -> Any:
    """act'(z), elementwise, in z's precision (float32 or float64)."""
    xp = array_module(z)
    if activation in ("relu", "identity"):
        return xp.ones_like(z)
    if activation == "relu2":
        return 2 * xp.maximum(z, 0)
    if activation == "silu":
        s = 1 / (1 + xp.exp(-z))
        return s * (1 + z * (1 - s))
    if activation == "gelu":  # tanh form, as in _reference.activation
        c = math.sqrt(2 / math.pi)
        inner = c * (z + 0.044715 * z**3)
        t = xp.tanh(inner)
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z * z)
    raise ValueError(f"activation: unknown {activation!r}")


def forward_arrays(
    x, w_act, w_lin, w_down, activation, tile_n, capacity, threshold, spill_capacity=None, keep_linear=True
):
    """(out, act TwELL, linear values on its pattern or None, entries left out).

    ``keep_linear=False`` (a forward no backward will follow) leaves the gated block's linear
    values out (None): the backward's input, which the consumer would otherwise zero and store
    in the gate's layout.

    As in the plans, the tail is queued on the row-tiles' first ``capacity`` entries before the
    host reads the overflow count back (the GPU stays busy meanwhile), and runs again on the
    complete parts only when entries spilled; the entries left out are then 0.

    With ``spill_capacity`` (and operands the row-gather kernels take, see
    :func:`gather_tail_eligible`) nothing is read back, so the call can be captured in a CUDA
    graph: the spill fills arrays of that fixed length (zero past the row pointers' end), the
    tail runs once on the gather kernels, and the entries that did not fit are returned as a
    0-d device array for the caller to check later. Elsewhere (the CPU, other operands) the
    exact path runs and pads its spill arrays to that length, so the shapes agree, raising
    :class:`TwELLSpillCapacityError` at once when its spill does not fit."""
    act = check_activation(activation)
    tile_n, capacity, _ = check_layout(tile_n, capacity, "spill")
    thr = check_threshold(threshold)
    shape = (x.shape[0], w_act.shape[0])
    w_down_t = w_down.T

    def tail(parts):
        g = twell_array._from_parts(parts, shape, tile_n)
        if w_lin is None:
            return matmul(g, w_down_t), g, None
        out, u = gated_product(x, w_lin, w_down_t, g, keep_up=keep_linear)
        return out, g, u

    first, finish = linear_to_parts_deferred(x, w_act, act, tile_n, capacity, thr)
    # The kernel choices take the density of the previous forward with this weight, as a plan's
    # take its own (the stationary down projection's break-even, the tiled up projection's rule
    # and token blocks).
    with _stationary.expected_density(_previous_density(x, w_act, finish)):
        if spill_capacity is not None and gather_tail_eligible(x, w_lin, w_down_t, x.dtype):
            parts, left_out = finish("spill", spill_capacity=spill_capacity)
            return (*tail(parts), left_out)  # the gather kernels: they read the spill by row pointers
        result, parts = tail_then_finish(first, finish, tail)
    out, g, u = result[0], twell_array._from_parts(parts, shape, tile_n), result[2]
    if spill_capacity is not None:  # the exact path, with the fixed path's array lengths
        g, u = _padded_spill(g, spill_capacity), (_padded_spill(u, spill_capacity) if u is not None else None)
    return out, g, u, 0


#: The activation density of the last forward per (device, activation weight, tokens), posted by
#: the producer's entry total without a host read.
_DENSITIES = PostedByKey()


def _posted_density(x: Any, w_act: Any) -> PostedScalar | None:
    """The posted density of the forwards with ``w_act``'s array and as many tokens (None on
    the CPU)."""
    if not is_cupy_array(x):
        return None
    return _DENSITIES.get((x.device.id, w_act.data.ptr, w_act.shape, w_act.strides, x.shape[0]))


def _landed(posted: PostedScalar | None) -> float:
    """``posted``'s latest value if its copy has landed (NaN otherwise, and without one)."""
    latest = posted.latest() if posted is not None else None
    return math.nan if latest is None else latest


def _previous_density(x: Any, w_act: Any, finish: Any) -> float:
    """The density the last forward with ``w_act``'s array and as many tokens posted, if its copy
    has landed (NaN otherwise, and on the CPU); this forward's is posted for the next (from the
    producer's entry total, without a host read)."""
    posted = _posted_density(x, w_act)
    density = _landed(posted)
    totals = getattr(finish, "totals", None)
    if posted is not None and totals is not None:
        posted.post(totals()[0], scale=1.0 / max(x.shape[0] * w_act.shape[0], 1))
    return density


def _forward_density(x: Any, w_act: Any) -> float:
    """The density the forward of this backward posted (the latest forward with ``w_act``'s array
    and as many tokens), if its copy has landed (NaN otherwise, and on the CPU): the backward's
    kernel choices take it as the forward's did."""
    return _landed(_posted_density(x, w_act))


def _padded_spill(a: Any, spill_capacity: int) -> Any:
    """``a`` with its spill arrays zero-padded to ``spill_capacity`` (the layout of the fixed
    spill, whose shapes a caller may rely on); :class:`TwELLSpillCapacityError` at once when
    its entries do not fit."""
    parts = a.parts
    n = parts.spill_data.shape[0]
    if n > spill_capacity:
        raise TwELLSpillCapacityError(n - spill_capacity, spill_capacity, "this call", computed=False)
    xp = array_module(parts.spill_data)
    pad = spill_capacity - n
    data = xp.concatenate([parts.spill_data, xp.zeros(pad, dtype=parts.spill_data.dtype)])
    indices = xp.concatenate([parts.spill_indices, xp.zeros(pad, dtype=parts.spill_indices.dtype)])
    return twell_array._from_parts(parts._replace(spill_data=data, spill_indices=indices), a.shape, a.tile_n)


#: Every gradient of the backward: (dx, dw_act, dw_lin, dw_down).
ALL_GRADS = (True, True, True, True)


def backward_arrays(grad_out, grad_act, x, w_act, w_lin, w_down, g, u, activation, needs=ALL_GRADS):
    """(dx, dw_act, dw_lin or None, dw_down); ``grad_act`` (a TwELL of g's pattern) may be None.

    ``needs``: which of (dx, dw_act, dw_lin, dw_down) to compute; the others come back None and
    their products are not run (frozen weights skip the transposed products, a first layer
    skips dX)."""
    # The kernel choices (the stationary dX, the tiled sampled product and its token blocks)
    # take the forward's density, as the forward's did.
    with _stationary.expected_density(_forward_density(x, w_act)):
        return _backward(grad_out, grad_act, x, w_act, w_lin, w_down, g, u, activation, needs)


def _backward(grad_out, grad_act, x, w_act, w_lin, w_down, g, u, activation, needs):
    """:func:`backward_arrays` under the forward's density."""
    need_dx, need_act, need_lin, need_down = needs

    def weight_grads(h: Any, d_z: Any, d_u: Any) -> tuple[Any, Any, Any]:
        # The transposed products share g's pattern: its transpose is sorted once, and the two
        # with x as their dense operand stay adjacent (one pass reads each row of x for both).
        candidates = [("down", h, grad_out, need_down), ("act", d_z, x, need_act), ("lin", d_u, x, need_lin)]
        wanted = [(name, a, b) for name, a, b, need in candidates if need and a is not None]
        results = transposed_products(g, [(a, b) for _, a, b in wanted]) if wanted else []
        got = {name: r for (name, _, _), r in zip(wanted, results, strict=True)}
        dw_down_t = got.get("down")
        return got.get("act"), got.get("lin"), dw_down_t.T if dw_down_t is not None else None

    fused = None
    if u is not None and grad_act is None and activation in ("relu", "identity"):
        one_pack = tiled_gated_backward(grad_out, w_down.T, g, u, w_act, w_lin)  # opt-in: TWELL_TILED_FFN=1
        if one_pack is not None:
            dx, f_z, f_u, f_h = one_pack
            return (dx if need_dx else None, *weight_grads(f_h, f_z, f_u))
        fused = fused_gated_backward(grad_out, w_down.T, g, u)  # d_h and its products in one pass
    if fused is not None:
        f_z, f_u, f_h = fused
        dx = matmul_sum(f_z, w_act, f_u, w_lin) if need_dx else None
        return (dx, *weight_grads(f_h, f_z, f_u))
    d_h = sddmm(grad_out, w_down.T, g)
    if u is None:
        h, d_act = g, d_h
    else:
        h = product_values(g, u)
        d_act = product_values(d_h, u)
    if grad_act is not None:
        add = lambda a, b: a + b  # noqa: E731
        d_act = with_values(
            g, _values_op(add, d_act.data, grad_act.data), _values_op(add, d_act.spill_data, grad_act.spill_data)
        )
    if activation in ("relu", "identity"):
        d_z = d_act  # relu'(z) = 1 on the pattern, where z > 0
    else:
        z = sddmm(x, w_act, g)  # pre-activations on the pattern
        grad = lambda dz, zz: dz * _activation_grad(activation, zz)  # noqa: E731
        d_z = with_values(g, _values_op(grad, d_act.data, z.data), _values_op(grad, d_act.spill_data, z.spill_data))
    d_u = product_values(d_h, g) if u is not None else None
    dx = None
    if need_dx:
        dx = matmul(d_z, w_act) if d_u is None else matmul_sum(d_z, w_act, d_u, w_lin)
    return (dx, *weight_grads(h, d_z, d_u))
