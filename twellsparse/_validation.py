"""Argument checks shared by constructors and ops: one-line errors naming the argument."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

OVERFLOW_POLICIES = ("spill", "error", "drop")
ACTIVATIONS = ("relu", "relu2", "silu", "gelu", "identity")
MIN_TILE_N, MAX_TILE_N = 32, 1024
#: Spill indices and CSR output are int32, so both dimensions stay below 2**31.
MAX_DIM = 2**31 - 1
#: The kernels compute a tile's column bounds (and a warp's step past them) in int32: a TwELL
#: layout keeps two of the widest tiles of headroom below 2**31.
MAX_TILED_COLS = 2**31 - 2 * MAX_TILE_N


def check_int(value: Any, name: str, expected: str = "an int") -> int:
    """``value`` as an int (Python or NumPy integers; never a bool, which ``operator.index``
    would take as 0 or 1)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected {expected}, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__}") from None


def check_tile_n(tile_n: Any) -> int:
    t = check_int(tile_n, "tile_n")
    if t < MIN_TILE_N or t > MAX_TILE_N or t & (t - 1):
        raise ValueError(f"tile_n: expected a power of two from {MIN_TILE_N} to {MAX_TILE_N}, got {t}")
    return t


def check_capacity(capacity: Any, tile_n: int) -> int:
    """``None`` means the default, ``tile_n // 8``."""
    if capacity is None:
        return tile_n // 8
    c = check_int(capacity, "capacity", "an int or None")
    if c < 1 or c > tile_n:
        raise ValueError(f"capacity: expected 1 <= capacity <= tile_n ({tile_n}), got {c}")
    return c


def check_layout(tile_n: Any, capacity: Any, overflow: Any) -> tuple[int, int, str]:
    """Validated (tile_n, capacity, overflow) of a TwELL producer."""
    t = check_tile_n(tile_n)
    return t, check_capacity(capacity, t), check_overflow(overflow)


def check_overflow(overflow: Any) -> str:
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow: expected one of {', '.join(OVERFLOW_POLICIES)}, got {overflow!r}")
    return str(overflow)


def check_activation(activation: Any) -> str:
    if activation is None:
        return "identity"
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    return str(activation)


def check_spill_capacity(spill_capacity: Any, optional: bool = True) -> int | None:
    expected = (
        "None or a non-negative int below 2**31"
        if optional
        else "a non-negative int below 2**31 (the spill's static length)"
    )
    if spill_capacity is None and optional:
        return None
    s = check_int(spill_capacity, "spill_capacity", expected)
    if s < 0 or s > MAX_DIM:
        raise ValueError(f"spill_capacity: expected {expected}, got {s}")
    return s


#: How a block chooses between its sparse and dense computations.
DISPATCH = ("auto", "sparse", "dense")
#: The settings :func:`check_block_settings` returns, in its arguments' order.
BLOCK_SETTINGS = ("activation", "tile_n", "capacity", "threshold", "dispatch", "breakeven", "spill_capacity")


def check_block_settings(
    activation: Any,
    tile_n: Any,
    capacity: Any,
    threshold: Any,
    dispatch: Any,
    breakeven: Any,
    spill_capacity: Any,
) -> dict[str, Any]:
    """The settings an FFN block keeps (a plan's, a torch module's), validated: the attributes
    ``activation``, ``tile_n``, ``capacity``, ``threshold``, ``dispatch``, ``breakeven`` and
    ``spill_capacity``."""
    t = check_tile_n(tile_n)
    if dispatch not in DISPATCH:
        raise ValueError(f"dispatch: expected one of {', '.join(DISPATCH)}, got {dispatch!r}")
    return dict(
        activation=check_activation(activation),
        tile_n=t,
        capacity=check_capacity(capacity, t),
        threshold=check_threshold(threshold),
        dispatch=dispatch,
        breakeven=None if breakeven is None else check_fraction(breakeven, "breakeven"),
        spill_capacity=check_spill_capacity(spill_capacity),
    )


def check_fraction(value: Any, name: str) -> float:
    """A finite float in [0, 1] (a density, a break-even); never a bool."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a float in [0, 1], got {value!r}")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a float in [0, 1], got {value!r}") from None
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"{name}: expected a float in [0, 1], got {value!r}")
    return f


def check_threshold(threshold: Any) -> float | None:
    if threshold is None:
        return None
    try:
        t = float(threshold)
    except (TypeError, ValueError):
        raise TypeError(f"threshold: expected a float or None, got {type(threshold).__name__}") from None
    if not t >= 0.0 or t == float("inf"):
        raise ValueError(f"threshold: expected a finite value >= 0, got {threshold!r}")
    return t


def check_shape(shape: Any, name: str = "shape") -> tuple[int, int]:
    try:
        m, n = (operator.index(s) for s in shape)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a pair of ints (M, N), got {shape!r}") from None
    if m < 0 or n < 0 or m > MAX_DIM or n > MAX_DIM:
        raise ValueError(f"{name}: expected 0 <= M, N < 2**31, got {(m, n)}")
    return m, n


def check_out_shape(out: Any, shape: tuple[int, ...], dtype: Any) -> None:
    """An ``out`` argument must have the result's shape and dtype (one-line error otherwise)."""
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise TypeError(f"out: expected a NumPy or CuPy array, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"out: expected shape {tuple(shape)} and dtype {np.dtype(dtype).name}, got {tuple(out.shape)} {out.dtype}"
        )


def check_ndim(x: Any, ndim: int | tuple[int, ...], name: str) -> None:
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if x.ndim not in allowed:
        want = " or ".join(f"{d}-D" for d in allowed)
        raise ValueError(f"{name}: expected a {want} array, got {x.ndim}-D with shape {tuple(x.shape)}")


def n_tiles(n_cols: int, tile_n: int) -> int:
    """The column tiles of a TwELL layout of ``n_cols`` columns (raises past MAX_TILED_COLS)."""
    if n_cols > MAX_TILED_COLS:
        raise ValueError(f"shape: expected at most {MAX_TILED_COLS} columns (int32 tile bounds), got {n_cols}")
    return -(-n_cols // tile_n)
