"""JAX adapter: TwELL ops on ``jax.Array``, inside ``jax.jit``, differentiable with ``jax.grad``.

Every op runs twellsparse's own code through :func:`jax.experimental.buffer_callback.buffer_callback`:
on a GPU the callback receives XLA's device buffers and computation stream, views the buffers as
CuPy arrays from their ``__cuda_array_interface__`` pointers (zero-copy, no stream handshake) and
launches the CUDA kernels on that stream, so no array
goes through the host; on the CPU it runs the NumPy reference path on the host buffers. Outputs
are written in place into XLA's result buffers. Where an exact spill's length must be known
(the producer's overflow count), the callback reads that one scalar back, which waits for XLA's
stream (the opt-in mask-driven tails of the plans, ``_gpu_producer.MASK_CONSUMER``, remove the
FFN forward's read but are slower on the H200); the backward's transposed products read nothing.

- :class:`twellsparse.twell_array` is a pytree of its six component arrays (data, indices,
  counts, spill data, spill indices, spill row pointers) with the shape and tile width as static
  data (and its ``n_dropped``), its ``.T`` a pytree of that matrix; :func:`to_jax` /
  :func:`from_jax` move one between NumPy/CuPy and JAX through DLPack. A matrix with JAX
  components still answers ``nnz``, ``toarray()`` and ``@`` (its padded spill trimmed).
- Arguments are checked while tracing (shapes, dtypes, settings, which must be static), with
  the library's one-line errors, so ``jax.eval_shape`` and ``jit`` reject a bad call up front.
- Gradients are custom VJPs built on the sparse backward products (SDDMM and transposed SpMM at
  the pattern); no dense tokens x d_ff array is formed. ``ffn`` / ``gated_ffn`` save only their
  inputs and recompute the activation pattern in the backward pass, because jit residuals need
  static shapes and the pattern's spill does not have one.
- Shapes under jit are static, so :func:`linear_to_twell` takes a ``spill_capacity``: the spill
  part is padded to it, and a pattern needing more raises (an XLA runtime error carrying the
  ``spill_capacity: expected at least ...`` message); nothing is dropped silently.
- ``jax.vmap`` is supported by running the op once per batch element (``vmap_method =
  "sequential"``).

On a GPU, start JAX with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (or a smaller
``XLA_PYTHON_CLIENT_MEM_FRACTION``): the callbacks allocate their workspaces through CuPy, which
needs memory JAX has not reserved.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.experimental.buffer_callback import buffer_callback

from . import _ops
from ._backend import cupy_view, is_cupy_array
from ._ffn_autodiff import backward_arrays, forward_arrays
from ._parts import TwELLParts
from ._plans import FFN, GatedFFN, raise_for_previous, raise_left_out
from ._transpose import twell_transpose
from ._twell import twell_array
from ._validation import check_activation, check_capacity, check_spill_capacity, check_threshold, check_tile_n

__all__ = ["check_spill", "ffn", "from_jax", "gated_ffn", "linear_to_twell", "matmul", "sddmm", "to_jax"]

_KDL_CPU = 1


# ----------------------------------------------------------------------------- pytree


def _flatten(a: twell_array) -> tuple[tuple, tuple]:
    return tuple(a.parts), (a.shape, a.tile_n, a.n_dropped)


def _unflatten(aux: tuple, leaves: Any) -> twell_array:
    shape, tile_n, dropped = aux
    return twell_array._from_parts(TwELLParts(*leaves), shape, tile_n, dropped)


jax.tree_util.register_pytree_node(twell_array, _flatten, _unflatten)
# The lazy transpose holds its matrix: a pytree of one child, so a.T crosses jit and grad.
jax.tree_util.register_pytree_node(twell_transpose, lambda t: ((t.base,), None), lambda _, c: twell_transpose(c[0]))


def to_jax(a: twell_array) -> twell_array:
    """Return the same matrix with JAX arrays as components.

    Parameters
    ----------
    a : twell_array
        A matrix with NumPy or CuPy components.

    Returns
    -------
    twell_array
        The same shape, tile_n and ``n_dropped``, its six components ``jax.Array``: NumPy ones
        through ``jnp.asarray``, others zero-copy through DLPack where possible.
    """
    return jax.tree_util.tree_map(
        lambda leaf: jnp.asarray(leaf) if isinstance(leaf, np.ndarray) else jnp.from_dlpack(leaf), a
    )


def from_jax(a: twell_array) -> twell_array:
    """Return the same matrix with NumPy (CPU) or CuPy (GPU) components.

    Parameters
    ----------
    a : twell_array
        A matrix with JAX components, as :func:`to_jax` and this module's ops give them.

    Returns
    -------
    twell_array
        Components viewed through DLPack (zero-copy where possible), the spill trimmed to its
        entries (``spill_indptr[-1]``, read back to the host).
    """
    parts = TwELLParts(*(_array(leaf) for leaf in a.parts))
    n_spill = int(parts.spill_indptr[-1]) if parts.spill_indptr.size else 0
    parts = parts._replace(spill_data=parts.spill_data[:n_spill], spill_indices=parts.spill_indices[:n_spill])
    return twell_array._from_parts(parts, a.shape, a.tile_n, a.n_dropped)


def _array(x: Any) -> Any:
    """NumPy or CuPy view of a JAX array (DLPack; CPU arrays through __array__); buffers handed
    to a callback go through :func:`_callback_view`."""
    if int(x.__dlpack_device__()[0]) == _KDL_CPU:
        return np.asarray(x)
    import cupy as cp

    try:
        return cp.from_dlpack(x)
    except (BufferError, TypeError, ValueError):  # a producer that refuses CuPy's stream handshake
        return cp.asarray(x)  # through __cuda_array_interface__


def _callback_view(buf: Any) -> Any:
    """NumPy or CuPy view of a buffer handed to a callback, without any host synchronisation.

    XLA orders the callback's buffers on the stream it passes (the one the kernels run on), so
    the view needs no stream handshake; CuPy's own import of ``__cuda_array_interface__`` may
    synchronise the host with the stream the interface names (``CUPY_CUDA_ARRAY_INTERFACE_SYNC``).
    """
    if int(buf.__dlpack_device__()[0]) == _KDL_CPU:
        return np.asarray(buf)
    cai = buf.__cuda_array_interface__
    shape = tuple(int(d) for d in cai["shape"])
    strides = cai.get("strides")
    device = int(buf.__dlpack_device__()[1])
    return cupy_view(int(cai["data"][0]), shape, buf.dtype, buf, device, None if strides is None else tuple(strides))


# ----------------------------------------------------------------------------- callbacks


@contextlib.contextmanager
def _on_stream(ctx: Any, buffers: list) -> Iterator[None]:
    """Run on XLA's computation stream and device when the buffers live on a GPU."""
    if not buffers or int(buffers[0].__dlpack_device__()[0]) == _KDL_CPU:
        yield
        return
    import cupy as cp

    device = int(buffers[0].__dlpack_device__()[1])
    with cp.cuda.Device(device), _external_stream(int(ctx.stream), device):
        yield


@functools.cache
def _external_stream(ptr: int, device: int) -> Any:
    """CuPy's handle on one of XLA's streams, made once per stream (XLA keeps its streams for the
    client's life). CuPy 14 deprecates ExternalStream in favour of Stream.from_external, which
    wants an object with ``__cuda_stream__``; XLA hands a bare pointer."""
    import cupy as cp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cp.cuda.ExternalStream(ptr, device)


def _call(fn: Callable[..., Any], out_types: Any, *args: Any) -> Any:
    """``fn(outs, *args)`` on NumPy/CuPy views of the buffers; ``out_types`` a pytree of
    ShapeDtypeStructs whose buffers ``fn`` fills in place."""

    def callback(ctx: Any, outs: Any, *bufs: Any) -> None:
        leaves = jax.tree_util.tree_leaves((outs, bufs))
        with _on_stream(ctx, leaves):
            fn(jax.tree_util.tree_map(_callback_view, outs), *jax.tree_util.tree_map(_callback_view, bufs))

    out = buffer_callback(callback, out_types, vmap_method="sequential")(*args)
    # Under shard_map the results vary over the same mesh axes as the inputs.
    axes = frozenset().union(*(_vma(a) for a in jax.tree_util.tree_leaves(args)))
    return jax.tree_util.tree_map(lambda o: _vary(o, axes), out) if axes else out


def _vma(x: Any) -> frozenset:
    """The mesh axes a value varies over inside shard_map (empty elsewhere)."""
    aval = jax.typeof(x)
    axis_type = getattr(aval, "manual_axis_type", None)  # newer JAX; older ones call it vma
    return frozenset(axis_type.varying if axis_type is not None else getattr(aval, "vma", ()))


def _like_primal(ct: Any, primal: Any) -> Any:
    """A cotangent with its primal's mesh-axis type, as JAX's own rules give it: summed over the
    axes the primal is invariant on (the transpose of the implicit pvary), cast to varying on
    the axes only the primal varies over."""
    if ct is None or getattr(ct, "dtype", None) == jax.dtypes.float0:
        return ct
    extra = tuple(sorted(_vma(ct) - _vma(primal)))
    if extra:
        ct = jax.lax.psum(ct, extra)
    return _vary(ct, _vma(primal))


def _cotangents(cts: tuple, primals: tuple) -> tuple:
    """Each cotangent with its primal's mesh-axis type; None (a symbolic zero) stays None."""
    return tuple(
        None if c is None else jax.tree_util.tree_map(_like_primal, c, p) for c, p in zip(cts, primals, strict=True)
    )


def _vary(x: Any, axes: frozenset) -> Any:
    missing = tuple(sorted(axes - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _struct(shape: tuple, dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), dtype)


def _values_struct(a: twell_array) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    return _struct(a.parts.data.shape, a.parts.data.dtype), _struct(a.parts.spill_data.shape, a.parts.data.dtype)


def _rebuild(parts: TwELLParts, like: twell_array) -> twell_array:
    """A twell_array over JAX arrays (outside callbacks), with ``like``'s shape, tile and
    dropped count (the pytree's static data, which cotangents must match)."""
    return twell_array._from_parts(parts, like.shape, like.tile_n, like.n_dropped)


def _matrix(parts: Any, like: twell_array) -> twell_array:
    """A twell_array over callback views, its spill trimmed to the entries ``spill_indptr``
    counts (linear_to_twell pads the spill to a static length; reading the count back is a
    host synchronisation, paid only when the spill part is non-empty)."""
    p = TwELLParts(*parts)
    if p.spill_data.shape[0]:
        n = int(p.spill_indptr[-1])
        p = p._replace(spill_data=p.spill_data[:n], spill_indices=p.spill_indices[:n])
    return twell_array._from_parts(p, like.shape, like.tile_n)


def _copy_values(dst: tuple, src: twell_array) -> None:
    """Write a result's slot and spill values into (data, spill) output buffers; spill padding
    (beyond the entries) gets zeros."""
    dst[0][...] = src.parts.data
    n = src.parts.spill_data.shape[0]
    dst[1][:n] = src.parts.spill_data
    dst[1][n:] = 0


def _zero_cotangent(a: twell_array, data: Any, spill: Any) -> twell_array:
    """A cotangent for ``a``: the given value cotangents, float0 zeros for the integer parts."""
    f0 = jax.dtypes.float0
    p = a.parts
    parts = TwELLParts(
        data,
        np.zeros(p.indices.shape, f0),
        np.zeros(p.counts.shape, f0),
        spill,
        np.zeros(p.spill_indices.shape, f0),
        np.zeros(p.spill_indptr.shape, f0),
    )
    return twell_array._from_parts(parts, a.shape, a.tile_n, a.n_dropped)


def _same_dtype(**arrays: Any) -> Any:
    dtypes = {name: jnp.dtype(a.dtype) for name, a in arrays.items()}
    first = next(iter(dtypes.values()))
    for name, dt in dtypes.items():
        if dt != first:
            raise TypeError(f"{name}: expected dtype {first} like the other operands, got {dt}")
    return first


def _static(check: Callable[..., Any], value: Any, name: str, *args: Any) -> Any:
    """``check(value, *args)`` for an argument that must be a Python value at trace time."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name}: expected a static Python value (a static argument of jax.jit), got a tracer")
    return check(value, *args)


def _operand(x: Any, name: str, ndims: tuple[int, ...] | None = (2,)) -> jax.Array:
    """``x`` as a JAX array with a floating dtype and one of ``ndims`` (None: at least 1-D),
    checked while tracing (a bad operand then fails at the call, not inside XLA's runtime)."""
    x = jnp.asarray(x)
    if ndims is None and x.ndim < 1:
        raise ValueError(f"{name}: expected an array of at least 1 dimension, got a 0-D one")
    if ndims is not None and x.ndim not in ndims:
        want = " or ".join(f"{d}-D" for d in ndims)
        raise ValueError(f"{name}: expected a {want} array, got {x.ndim}-D with shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}: expected floating-point values, got {x.dtype}")
    return x


def _settings(activation: Any, threshold: Any, tile_n: Any, capacity: Any) -> tuple[str, float | None, int, int]:
    """The static settings of a producer, validated (``activation=None`` is the identity)."""
    tile_n = _static(check_tile_n, tile_n, "tile_n")
    return (
        _static(check_activation, activation, "activation"),
        _static(check_threshold, threshold, "threshold"),
        tile_n,
        _static(check_capacity, capacity, "capacity", tile_n),
    )


def _check_weights(x: jax.Array, d_ff: int, **weights: jax.Array) -> None:
    """Each weight's shape against ``x``'s width and the hidden width ``d_ff`` (torch.nn.Linear
    layout: ``w_down`` is d_model x d_ff, the others d_ff x d_model)."""
    d_model = x.shape[1]
    for name, w in weights.items():
        want = (d_model, d_ff) if name == "w_down" else (d_ff, d_model)
        if tuple(w.shape) != want:
            raise ValueError(f"{name}: expected shape {want} for x of shape {tuple(x.shape)}, got {tuple(w.shape)}")


# ----------------------------------------------------------------------------- products


def matmul(a: twell_array | twell_transpose, b: jax.Array) -> jax.Array:
    """``a @ b`` for a TwELL matrix ``a`` (JAX components) or its ``.T`` and a dense ``b``.

    See :func:`twellsparse.matmul`. Differentiable in ``b`` and in ``a``'s values (the latter's
    cotangent lies on ``a``'s pattern).

    Parameters
    ----------
    a : twell_array or twell_transpose
        ``A`` (M x N) with JAX components, or its ``.T`` (N x M).
    b : array_like
        Dense, floating-point, 2-D (or 1-D for a vector), with ``a.shape[1]`` rows and ``a``'s dtype.

    Returns
    -------
    jax.Array
        ``a @ b``, of shape ``(a.shape[0], b.shape[1])`` (``(a.shape[0],)`` for a vector), in
        ``a``'s dtype.

    Raises
    ------
    TypeError
        For an ``a`` that is not a ``twell_array`` or its ``.T``, a non-floating ``b``, or a ``b``
        of another dtype than ``a``.
    ValueError
        For a ``b`` that is not 1-D or 2-D, or whose rows do not match ``a``'s columns.
    """
    transposed = isinstance(a, twell_transpose)
    base = a.base if isinstance(a, twell_transpose) else a
    if not isinstance(base, twell_array):
        raise TypeError(f"a: expected a twell_array (JAX components) or its .T, got {type(a).__name__}")
    b = _operand(b, "b", (1, 2))
    if b.shape[0] != a.shape[1]:
        raise ValueError(f"b: expected {a.shape[1]} rows to match a's shape {a.shape}, got shape {tuple(b.shape)}")
    b2 = b[:, None] if b.ndim == 1 else b
    out = _matmul_t(base, b2) if transposed else _matmul_n(base, b2)
    return out[:, 0] if b.ndim == 1 else out


@jax.custom_vjp
def _matmul_n(a: twell_array, b: jax.Array) -> jax.Array:
    """``a @ b``."""
    return _matmul(a, b, transposed=False)


@jax.custom_vjp
def _matmul_t(a: twell_array, b: jax.Array) -> jax.Array:
    """``a.T @ b``."""
    return _matmul(a, b, transposed=True)


def _matmul(a: twell_array, b: jax.Array, transposed: bool) -> jax.Array:
    dt = _same_dtype(a=a.parts.data, b=b)
    rows = a.shape[1] if transposed else a.shape[0]

    def run(out: Any, parts: tuple, bb: Any) -> None:
        m = _matrix(parts, a)
        _ops.matmul(m.T if transposed else m, bb, out=out)

    return _call(run, _struct((rows, b.shape[1]), dt), tuple(a.parts), b)


def _matmul_bwd_for(transposed: bool) -> Callable[[tuple, jax.Array], tuple]:
    """The VJP of ``a @ b`` (``a.T @ b`` when ``transposed``): ``d_b`` is the other product
    with ``g``; ``a``'s value cotangent is ``g @ b.T`` at its pattern (``b @ g.T`` transposed)."""

    def bwd(res: tuple, g: jax.Array) -> tuple:
        a, b = res
        d_b = _matmul(a, g, transposed=not transposed)
        left, right = (b, g) if transposed else (g, b)

        def run(outs: tuple, parts: tuple, ll: Any, rr: Any) -> None:
            _copy_values(outs, _ops.sddmm(ll, rr, _matrix(parts, a)))

        d_data, d_spill = _call(run, _values_struct(a), tuple(a.parts), left, right)
        return _cotangents((_zero_cotangent(a, d_data, d_spill), d_b), (a, b))

    return bwd


_matmul_n.defvjp(lambda a, b: (_matmul_n(a, b), (a, b)), _matmul_bwd_for(False))
_matmul_t.defvjp(lambda a, b: (_matmul_t(a, b), (a, b)), _matmul_bwd_for(True))


@jax.custom_vjp
def sddmm(x: jax.Array, y: jax.Array, pattern: twell_array) -> twell_array:
    """``x @ y.T`` at the stored entries of ``pattern``; see :func:`twellsparse.sddmm`.

    Differentiable in ``x`` and ``y`` (``pattern``'s cotangent is zero).

    Parameters
    ----------
    x : jax.Array, shape (M, K)
    y : jax.Array, shape (N, K)
        Of ``x``'s dtype.
    pattern : twell_array, shape (M, N)
        A TwELL matrix with JAX components; only its structure is used.

    Returns
    -------
    twell_array
        ``pattern``'s structure (JAX components) with the products as values, in ``x``'s dtype.

    Raises
    ------
    ValueError
        For an ``x`` or ``y`` that is not 2-D or whose shape does not match ``pattern``'s.
    TypeError
        For ``x`` and ``y`` of different dtypes.
    """
    m, n = pattern.shape
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != m or y.shape[0] != n or x.shape[1] != y.shape[1]:
        raise ValueError(
            f"x, y: expected shapes ({m}, K) and ({n}, K) for a pattern of shape {pattern.shape}, "
            f"got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    _same_dtype(x=x, y=y)

    def run(outs: tuple, xx: Any, yy: Any, parts: tuple) -> None:
        _copy_values(outs, _ops.sddmm(xx, yy, _matrix(parts, pattern)))

    data_t, spill_t = _values_struct(pattern)
    data, spill = _call(
        run, (_struct(data_t.shape, x.dtype), _struct(spill_t.shape, x.dtype)), x, y, tuple(pattern.parts)
    )
    return _rebuild(pattern.parts._replace(data=data, spill_data=spill), pattern)


def _sddmm_fwd(x: jax.Array, y: jax.Array, pattern: twell_array) -> tuple[twell_array, tuple]:
    return sddmm(x, y, pattern), (x, y, pattern)


def _sddmm_bwd(res: tuple, d: twell_array) -> tuple:
    x, y, pattern = res
    dmat = _rebuild(pattern.parts._replace(data=d.parts.data, spill_data=d.parts.spill_data), pattern)
    zeros = jnp.zeros_like(pattern.parts.data), jnp.zeros_like(pattern.parts.spill_data)
    cts = (_matmul(dmat, y, False), _matmul(dmat, x, True), _zero_cotangent(pattern, *zeros))
    return _cotangents(cts, (x, y, pattern))


sddmm.defvjp(_sddmm_fwd, _sddmm_bwd)


# ----------------------------------------------------------------------------- producer


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _linear_to_twell(x, w, activation, tile_n, capacity, threshold, spill_capacity):
    m, n = x.shape[0], w.shape[0]
    nt = -(-n // tile_n)
    dt = _same_dtype(x=x, w=w)
    out_types = (
        _struct((m, nt, capacity), dt),
        _struct((m, nt, capacity), jnp.int16),
        _struct((m, nt), jnp.int32),
        _struct((spill_capacity,), dt),
        _struct((spill_capacity,), jnp.int32),
        _struct((m + 1,), jnp.int32),
    )

    def run(outs: tuple, xx: Any, ww: Any) -> None:
        h = _ops.linear_to_twell(
            xx, ww, activation=activation, tile_n=tile_n, capacity=capacity, threshold=threshold, overflow="spill"
        )
        n_spill = h.parts.spill_data.shape[0]
        if n_spill > spill_capacity:
            raise ValueError(
                f"spill_capacity: expected at least {n_spill} (the entries beyond capacity {capacity}), "
                f"got {spill_capacity}"
            )
        for out, part in zip(outs, h.parts, strict=True):
            if out.shape == part.shape:
                out[...] = part
            else:  # the spill part, padded
                out[:n_spill] = part
                out[n_spill:] = 0

    parts = _call(run, out_types, x, w)
    return twell_array._from_parts(TwELLParts(*parts), (m, n), tile_n)


def _linear_fwd(x, w, activation, tile_n, capacity, threshold, spill_capacity):
    h = _linear_to_twell(x, w, activation, tile_n, capacity, threshold, spill_capacity)
    return h, (x, w, h)


def _linear_bwd(activation, tile_n, capacity, threshold, spill_capacity, res, d):
    x, w, h = res

    def run(outs: tuple, dd: tuple, xx: Any, ww: Any, parts: tuple) -> None:
        from ._ffn_autodiff import _activation_grad

        pattern = _matrix(parts, h)
        d_values = _matrix(pattern.parts._replace(data=dd[0], spill_data=dd[1]), pattern)
        if activation not in ("relu", "identity"):
            z = _ops.sddmm(xx, ww, pattern)  # pre-activations on the pattern
            grad = lambda dz, zz: dz * _activation_grad(activation, zz)  # noqa: E731
            d_values = _ops.with_values(
                pattern,
                _ops.values_op(grad, d_values.data, z.data),
                _ops.values_op(grad, d_values.spill_data, z.spill_data),
            )
        outs[0][...] = _ops.matmul(d_values, ww)
        outs[1][...] = _ops.matmul(d_values.T, xx)

    dx, dw = _call(
        run,
        (_struct(x.shape, x.dtype), _struct(w.shape, w.dtype)),
        (d.parts.data, d.parts.spill_data),
        x,
        w,
        tuple(h.parts),
    )
    return _cotangents((dx, dw), (x, w))


_linear_to_twell.defvjp(_linear_fwd, _linear_bwd)


def linear_to_twell(
    x: jax.Array,
    w: jax.Array,
    *,
    activation: str = "relu",
    tile_n: int = 256,
    capacity: int | None = None,
    threshold: float | None = None,
    spill_capacity: int = 0,
) -> twell_array:
    """``act(x @ w.T)`` packed into TwELL (JAX components); see :func:`twellsparse.linear_to_twell`.

    Differentiable in ``x`` and ``w`` through the stored values.

    Parameters
    ----------
    x : array_like, shape (M, K)
        Floating-point.
    w : array_like, shape (F, K)
        ``torch.nn.Linear`` layout, of ``x``'s dtype.
    activation, tile_n, capacity, threshold
        As for :func:`twellsparse.linear_to_twell`; static (Python values, not tracers).
    spill_capacity : int, default 0
        Static length of the spill part: entries beyond a row-tile's ``capacity`` go there (zero
        padding past ``spill_indptr[-1]``), and a call needing more raises.

    Returns
    -------
    twell_array
        M x F, with JAX components, in ``x``'s dtype; its spill arrays of length ``spill_capacity``.

    Raises
    ------
    TypeError
        For a setting given as a tracer or of the wrong type, a non-floating operand, or
        operands of different dtypes.
    ValueError
        For an operand that is not 2-D, widths that do not match, out-of-range settings, or (when
        the call runs, inside an XLA runtime error) a spill needing more than ``spill_capacity``.
    """
    activation, threshold, tile_n, capacity = _settings(activation, threshold, tile_n, capacity)
    spill_capacity = _static(check_spill_capacity, spill_capacity, "spill_capacity", False)
    x = _operand(x, "x")
    w = _operand(w, "w")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w: expected {x.shape[1]} columns to match x of shape {tuple(x.shape)}, got {tuple(w.shape)}")
    _same_dtype(x=x, w=w)
    return _linear_to_twell(x, w, activation, tile_n, capacity, threshold, spill_capacity)


# ----------------------------------------------------------------------------- FFN blocks


def _units_major(w_down: jax.Array) -> jax.Array:
    """``w_down.T`` materialised by XLA's transpose: the kernels read W_down one hidden unit's
    row at a time, and CuPy's strided copy inside the callback would cost far more."""
    return jnp.swapaxes(w_down, 0, 1)


def _buffer_key(a: Any) -> tuple | None:
    """Where and how a callback's CuPy buffer lies (address, shape, strides, dtype): equal keys
    mean a plan built on views of one call's buffers reads the next call's buffers as they are."""
    return None if a is None else (a.data.ptr, a.shape, a.strides, a.dtype.str)


class _CallSite:
    """One traced FFN call site: per GPU, its last plan, reused while XLA hands it the same weight
    buffers (the plan holds views of them and derives nothing from their values, so building it
    again would only cost host time), and the entries its fixed ``spill_capacity`` left out, call
    after call. A reused plan checks its previous call itself; when the buffers change, the old
    plan's count is popped and checked after the new plan's call has queued its kernels.

    Callbacks for different devices may run at once (``shard_map`` over several GPUs), so each
    device has its own slot, taken under a lock, and a call works on its own plan reference. On
    the CPU (the reference path) a plan is built per call: nothing to save there."""

    live: ClassVar[weakref.WeakSet[_CallSite]] = weakref.WeakSet()

    def __init__(self, spill_capacity: int | None) -> None:
        self.spill_capacity = spill_capacity
        self.slots: dict[int, tuple[tuple, Any]] = {}  # device id -> (buffer key, plan)
        self.lock = threading.Lock()
        _CallSite.live.add(self)

    def run(self, make_plan: Callable[[], Any], weights: tuple, x: Any, out: Any) -> None:
        """``plan(x, out=out)`` with the device's cached plan, or ``make_plan()``'s when the
        weight buffers changed."""
        previous = None
        if not is_cupy_array(x):
            plan = make_plan()
        else:
            device, key = x.device.id, tuple(_buffer_key(w) for w in weights)
            with self.lock:
                cached_key, plan = self.slots.get(device, (None, None))
                if plan is None or cached_key != key:
                    if plan is not None and self.spill_capacity is not None:
                        previous = plan._left_out.pop()
                    plan = make_plan()
                    self.slots[device] = (key, plan)
        try:
            plan(x, out=out)  # the kernels write XLA's output buffer: no copy
        finally:
            plan._last = None  # nothing reads the stats here: let the hidden layer go
            raise_for_previous(previous, plan._left_out, self.spill_capacity, "the previous call")

    def check(self) -> None:
        if self.spill_capacity is None:
            return
        with self.lock:
            plans = [plan for _, plan in self.slots.values()]
        for plan in plans:
            raise_left_out(plan._left_out, self.spill_capacity, "the last call")


def check_spill() -> None:
    """Check the last call of every jitted :func:`ffn` / :func:`gated_ffn` with a ``spill_capacity``.

    Each call also checks its predecessor; this checks the last ones. Waits for those calls to
    finish.

    Raises
    ------
    twellsparse.TwELLSpillCapacityError
        If one of those calls left spilled entries out (its output was computed without them).
    """
    for site in list(_CallSite.live):
        site.check()


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ffn(x, w_act, w_lin, w_down, activation, tile_n, capacity, threshold, spill_capacity):
    dt = _same_dtype(x=x, w_act=w_act, w_down=w_down, **({} if w_lin is None else {"w_lin": w_lin}))
    site = _CallSite(spill_capacity)  # one per traced call site

    def run(out: Any, xx: Any, wa: Any, wl: Any, wd_t: Any) -> None:
        # The plans' path (no up values kept: the backward recomputes them), always sparse.
        # Without spill_capacity the overflow count is read back (deferred behind the tail);
        # with it nothing is. w_down arrives transposed (by XLA), so the plan's layout needs no
        # copy.
        settings = {
            "activation": activation,
            "tile_n": tile_n,
            "capacity": capacity,
            "threshold": threshold,
            "spill_capacity": spill_capacity,
        }

        def make_plan() -> Any:
            if wl is None:
                return FFN(wa, wd_t.T, **settings, dispatch="sparse")
            return GatedFFN(wa, wl, wd_t.T, **settings, dispatch="sparse")

        site.run(make_plan, (wa, wl, wd_t), xx, out)

    return _call(run, _struct((x.shape[0], w_down.shape[0]), dt), x, w_act, w_lin, _units_major(w_down))


def _ffn_fwd(x, w_act, w_lin, w_down, activation, tile_n, capacity, threshold, spill_capacity):
    # symbolic_zeros: each operand comes as CustomVJPPrimal, whose `perturbed` says whether its
    # gradient is wanted (data inputs and frozen weights are not), as torch's needs_input_grad.
    primals = tuple(None if p is None else p.value for p in (x, w_act, w_lin, w_down))
    out = _ffn(*primals, activation, tile_n, capacity, threshold, spill_capacity)
    # The wanted gradients travel in the residuals' tree structure (static): None wanted, () not.
    wanted = tuple(None if p is not None and p.perturbed else () for p in (x, w_act, w_lin, w_down))
    return out, (primals, wanted)


def _ffn_bwd(activation, tile_n, capacity, threshold, spill_capacity, res, g):
    primals, wanted = res
    x, w_act, w_lin, w_down = primals
    needs = tuple(flag is None for flag in wanted)  # (dx, dw_act, dw_lin, dw_down)
    if isinstance(g, SymbolicZero) or not any(needs):  # nothing flows back: no launch at all
        return (None, None, None, None)
    # Only the wanted gradients are computed and returned (the others are symbolic zeros, None):
    # a first layer skips dX, frozen weights their transposed products. dW_down leaves the
    # callback units-major (as the kernels make it) and XLA transposes it.
    shapes: tuple[Any, ...] = (x.shape, w_act.shape, None if w_lin is None else w_lin.shape, w_down.shape[::-1])
    kept = [i for i in range(4) if needs[i]]  # never w_lin's when there is none (not perturbed)
    types = [_struct(shapes[i], primals[i].dtype) for i in kept]

    def run(outs: list, gg: Any, xx: Any, wa: Any, wl: Any, wd_t: Any) -> None:
        # The pattern and the up values are recomputed (jit residuals need static shapes).
        wd = wd_t.T  # a view whose transpose, the kernels' layout, is contiguous
        _, pattern, up, _ = forward_arrays(xx, wa, wl, wd, activation, tile_n, capacity, threshold)
        grads = backward_arrays(gg, None, xx, wa, wl, wd, pattern, up, activation, needs=needs)
        for out, i in zip(outs, kept, strict=True):
            out[...] = grads[i].T if i == 3 else grads[i]

    results = dict(zip(kept, _call(run, types, g, x, w_act, w_lin, _units_major(w_down)), strict=True))
    if 3 in results:
        results[3] = jnp.swapaxes(results[3], 0, 1)
    return _cotangents(tuple(results.get(i) for i in range(4)), primals)


_ffn.defvjp(_ffn_fwd, _ffn_bwd, symbolic_zeros=True)


def ffn(
    x: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    activation: str = "relu",
    tile_n: int = 256,
    capacity: int | None = None,
    threshold: float | None = None,
    spill_capacity: int | None = None,
) -> jax.Array:
    """Non-gated sparse FFN ``act(x @ w_up.T) @ w_down.T``; see :func:`twellsparse.ffn`.

    Differentiable in ``x`` and every weight (sparse backward, pattern recomputed); it always
    runs the sparse path.

    Parameters
    ----------
    x : array_like, shape (..., d_model)
        Floating-point; its leading dimensions are tokens.
    w_up : array_like, shape (d_ff, d_model)
    w_down : array_like, shape (d_model, d_ff)
        Of ``x``'s dtype.
    activation, tile_n, capacity, threshold
        As for :func:`twellsparse.linear_to_twell`; static (Python values, not tracers).
    spill_capacity : int, optional
        Static. As for :class:`twellsparse.FFN` plans, a fixed length for the spill of
        overflowing row-tiles, so that a GPU call reads nothing back to the host and XLA's
        stream never waits for it; entries beyond it are left out of that call's output and
        :class:`twellsparse.TwELLSpillCapacityError` is raised by the next call of the same jitted
        function (inside an XLA runtime error) or by :func:`check_spill`. Default None: exact, one
        read-back per call. On the CPU (an exact path) a call whose spill needs more raises at
        once. The backward pass always recomputes the pattern exactly.

    Returns
    -------
    jax.Array, shape (..., d_model)
        In ``x``'s dtype.

    Raises
    ------
    TypeError
        For a setting given as a tracer or of the wrong type, non-floating operands, or operands
        of different dtypes.
    ValueError
        For a 0-d ``x``, weights that are not 2-D or whose shapes do not match, or out-of-range
        settings.
    """
    settings = (activation, tile_n, capacity, threshold, spill_capacity)
    return _block(x, {"w_up": w_up, "w_down": w_down}, *settings)


def gated_ffn(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    activation: str = "relu",
    tile_n: int = 256,
    capacity: int | None = None,
    threshold: float | None = None,
    spill_capacity: int | None = None,
) -> jax.Array:
    """Gated sparse FFN ``(act(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``; see
    :func:`twellsparse.gated_ffn`. Differentiable and always sparse, as :func:`ffn`.

    Parameters
    ----------
    x : array_like, shape (..., d_model)
        As for :func:`ffn`.
    w_gate, w_up : array_like, shape (d_ff, d_model)
    w_down : array_like, shape (d_model, d_ff)
        Of ``x``'s dtype.
    activation, tile_n, capacity, threshold
        As for :func:`twellsparse.linear_to_twell` (applied to the gate); static.
    spill_capacity : int, optional
        Static; as for :func:`ffn`.

    Returns
    -------
    jax.Array, shape (..., d_model)
        As for :func:`ffn`, and raises as it does.
    """
    settings = (activation, tile_n, capacity, threshold, spill_capacity)
    return _block(x, {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}, *settings)


def _block(
    x: Any, weights: dict[str, Any], activation: Any, tile_n: Any, capacity: Any, threshold: Any, spill_capacity: Any
) -> jax.Array:
    """:func:`ffn` (weights w_up, w_down) or :func:`gated_ffn` (w_gate, w_up, w_down) after the
    trace-time checks, in the caller's argument names; x's leading dimensions are tokens."""
    activation, threshold, tile_n, capacity = _settings(activation, threshold, tile_n, capacity)
    spill_capacity = _static(check_spill_capacity, spill_capacity, "spill_capacity")
    x = _operand(x, "x", None)
    ws = {name: _operand(w, name) for name, w in weights.items()}
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # as torch's Linear takes them
    first = next(iter(ws.values()))  # the activation's weight
    _check_weights(rows, first.shape[0], **ws)
    _same_dtype(x=x, **ws)
    w_lin = ws["w_up"] if "w_gate" in ws else None
    out = _ffn(rows, first, w_lin, ws["w_down"], activation, tile_n, capacity, threshold, spill_capacity)
    return out.reshape(*x.shape[:-1], out.shape[-1])
