"""Helpers for tests, demos and benchmarks: FFN-like sparse activations and comparisons.

The activation patterns follow ``TARGETS.md``: (a) *uniform*, every unit fires with probability
``density`` for every token; (b) *skewed*, 30% of the units never fire and the others get
log-normal (sigma = 1) firing rates rescaled so the mean over all units is ``density``, each
capped at 0.5 (so its mean is at most 0.35).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.special

from ._backend import to_host, value_dtype
from ._validation import check_fraction

__all__ = ["firing_rates", "sparse_activations", "ffn_problem", "rel_error", "assert_twell_equal"]


#: The skewed pattern's largest mean: 70% of the units fire, each at most at 0.5.
MAX_SKEWED_DENSITY = 0.35


def firing_rates(n_units: int, density: float, pattern: str = "uniform", rng: Any = None) -> np.ndarray:
    """Return per-unit firing probabilities with mean ``density`` (see the module docstring).

    The skewed pattern saturates at :data:`MAX_SKEWED_DENSITY`: above it every firing unit fires
    at 0.5 and the mean stays 0.35 (the tests use that for dense rows).

    Parameters
    ----------
    n_units : int
        Number of units.
    density : float
        The mean firing rate, in [0, 1].
    pattern : {"uniform", "skewed"}, default "uniform"
        Every unit at ``density``, or the skewed log-normal rates.
    rng : int, numpy.random.Generator or None, optional
        Seed or generator (``numpy.random.default_rng``); the uniform pattern draws nothing.

    Returns
    -------
    numpy.ndarray
        float64, shape (n_units,), each in [0, 1] (at most 0.5 for the skewed pattern).

    Raises
    ------
    TypeError
        For a ``density`` that is a bool or does not convert to a float.
    ValueError
        For a ``density`` outside [0, 1] or another ``pattern``.
    """
    rng = np.random.default_rng(rng)
    density = check_fraction(density, "density")
    if pattern == "uniform":
        return np.full(n_units, density)
    if pattern != "skewed":
        raise ValueError(f"pattern: expected 'uniform' or 'skewed', got {pattern!r}")
    rates = rng.lognormal(0.0, 1.0, n_units)
    rates[rng.permutation(n_units)[: round(0.3 * n_units)]] = 0.0
    target = density * n_units
    for _ in range(50):  # rescale, cap, repeat: converges in a few rounds
        rates = np.minimum(rates * (target / max(rates.sum(), 1e-300)), 0.5)
        if abs(rates.sum() - target) <= 1e-9 * target:
            break
    return rates


def sparse_activations(
    m: int,
    n: int,
    density: float,
    pattern: str = "uniform",
    dtype: Any = np.float32,
    rng: Any = None,
    xp: Any = np,
) -> Any:
    """Return a dense M x N matrix of ReLU-like activations: positive values where units fire.

    Parameters
    ----------
    m, n : int
        Rows (tokens) and columns (units).
    density, pattern
        As for :func:`firing_rates` (unit ``j`` fires in each row with probability ``rate_j``).
    dtype : dtype, default float32
        The value dtype (float16, bfloat16, float32 or float64).
    rng : int, numpy.random.Generator or None, optional
        Seed or generator (``numpy.random.default_rng``).
    xp : module, default numpy
        Array module of the result (e.g. ``cupy``); drawn with NumPy, then ``xp.asarray``.

    Returns
    -------
    array, shape (m, n)
        ``|N(0, 1)| + 1e-3`` where a unit fires, 0 elsewhere, in ``dtype``.

    Raises
    ------
    TypeError, ValueError
        As :func:`firing_rates`; TypeError for a ``dtype`` that is not a value dtype.
    """
    rng = np.random.default_rng(rng)
    rates = firing_rates(n, density, pattern, rng)
    fire = rng.random((m, n)) < rates[None, :]
    vals = np.abs(rng.standard_normal((m, n))) + 1e-3
    out = np.where(fire, vals, 0.0).astype(value_dtype(dtype))
    return xp.asarray(out) if xp is not np else out


def ffn_problem(
    m: int,
    d_model: int,
    d_ff: int,
    density: float,
    pattern: str = "uniform",
    dtype: Any = np.float32,
    rng: Any = None,
    xp: Any = np,
) -> dict[str, Any]:
    """Return random FFN inputs whose ReLU gate fires at the requested per-unit rates.

    ``x ~ N(0, 1)`` with its last feature held at 1; for unit j the matching weight column is
    ``-z_j * ||w_j||`` with ``z_j`` the standard normal quantile of ``1 - rate_j``, so
    ``relu(x . w_j) > 0`` with probability ``rate_j`` (so ``d_model`` is at least 2: one random
    feature and the constant one).

    Parameters
    ----------
    m : int
        Tokens (rows of ``x``).
    d_model, d_ff : int
        Model and hidden widths; ``d_model`` at least 2.
    density, pattern
        The gate's firing rates, as for :func:`firing_rates`.
    dtype : dtype, default float32
        The value dtype of ``x`` and the weights (drawn in float32, then cast).
    rng : int, numpy.random.Generator or None, optional
        Seed or generator (``numpy.random.default_rng``).
    xp : module, default numpy
        Array module of ``x`` and the weights (e.g. ``cupy``).

    Returns
    -------
    dict
        ``"x"`` (m, d_model), ``"w_gate"`` and ``"w_up"`` (d_ff, d_model), ``"w_down"``
        (d_model, d_ff), all ``xp`` arrays in ``dtype`` (torch.nn.Linear layout), and ``"rates"``,
        the NumPy float64 firing rates (d_ff,).

    Raises
    ------
    ValueError
        For ``d_model`` below 2, or as :func:`firing_rates`.
    TypeError
        As :func:`firing_rates`, or for a ``dtype`` that is not a value dtype.
    """
    if d_model < 2:
        raise ValueError(f"d_model: expected at least 2 (the last feature is the constant 1), got {d_model}")
    rng = np.random.default_rng(rng)
    dt = value_dtype(dtype)
    rates = firing_rates(d_ff, density, pattern, rng)
    x = rng.standard_normal((m, d_model), dtype=np.float32)
    x[:, -1] = 1.0
    scale = 1.0 / np.sqrt(d_model)
    w_gate = rng.standard_normal((d_ff, d_model), dtype=np.float32) * scale
    w_gate[:, -1] = 0.0
    z = scipy.special.ndtri(1.0 - np.clip(rates, 1e-9, 1.0 - 1e-9))  # rates 0 and 1: finite weights
    w_gate[:, -1] = -z * np.linalg.norm(w_gate[:, :-1], axis=1)
    w_up = rng.standard_normal((d_ff, d_model), dtype=np.float32) * scale
    w_down = rng.standard_normal((d_model, d_ff), dtype=np.float32) / np.sqrt(max(density * d_ff, 1.0))
    out = {"x": x, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    out = {k: (xp.asarray(v.astype(dt)) if xp is not np else v.astype(dt)) for k, v in out.items()}
    out["rates"] = rates
    return out


def rel_error(out: Any, ref: Any) -> float:
    """Return the relative error ``||out - ref|| / ||ref||`` (Frobenius), in float64 on the host.

    Parameters
    ----------
    out, ref : array_like
        Arrays of one shape (NumPy, CuPy, or anything :func:`numpy.asarray` takes).

    Returns
    -------
    float
        The relative error; the absolute one ``||out - ref||`` when ``ref`` is all zeros, and inf
        when either holds a NaN or Inf.
    """
    o = to_host(out).astype(np.float64)
    r = to_host(ref).astype(np.float64)
    if not (np.isfinite(o).all() and np.isfinite(r).all()):
        return float("inf")
    denom = np.linalg.norm(r)
    return float(np.linalg.norm(o - r) / (denom if denom > 0 else 1.0))


def assert_twell_equal(a: Any, b: Any) -> None:
    """Assert exact equality of two matrices' values: shape, dtype and every value bit for bit.

    The matrices are compared densified (a stored zero equals an absent entry; compare ``parts``
    for the layout).

    Parameters
    ----------
    a, b : twell_array, twell_transpose or sparse matrix
        Anything with ``shape``, ``dtype`` and ``toarray()``, on the CPU or the GPU.

    Raises
    ------
    AssertionError
        For a different shape, dtype or any value's bits.
    """
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    assert a.dtype == b.dtype, f"dtype {a.dtype} != {b.dtype}"
    da, db = to_host(a.toarray()), to_host(b.toarray())
    np.testing.assert_array_equal(da.view(np.uint8), db.view(np.uint8))
