"""FFN blocks: reusable plans and the one-shot ``ffn``/``gated_ffn`` built on them.

``FFN(w_up, w_down)`` and ``GatedFFN(w_gate, w_up, w_down)`` validate the weights once and keep
``w_down.T`` contiguous (the down projection gathers its rows), so a call transposes nothing.
A plan keeps references to the caller's weights; after an in-place update call ``refresh()``.
The one-shot functions build a plan per call and never cache: a cache keyed on weight identity
would silently go stale when weights are updated in place.
"""

from __future__ import annotations

from typing import Any

from ._backend import array_module, value_dtype
from ._ops import _dense, _same_device, _sddmm_parts, linear_to_twell, matmul
from ._twell import twell_array
from ._validation import check_activation, check_capacity, check_threshold, check_tile_n


class _FFNPlanBase:
    """Weights (the first one sets the hidden shape) and the producer's settings."""

    def __init__(
        self,
        weights: dict[str, Any],
        activation: str,
        tile_n: int,
        capacity: int | None,
        threshold: float | None,
    ) -> None:
        self.activation = check_activation(activation)
        self.tile_n = check_tile_n(tile_n)
        self.capacity = check_capacity(capacity, self.tile_n)
        self.threshold = check_threshold(threshold)
        arrays = {name: _dense(w, name) for name, w in weights.items()}
        first_name = next(iter(arrays))
        _same_device(first_name, arrays[first_name], **arrays)
        _check_weight_shapes(arrays, None)
        self._weights = arrays
        self._last_hidden: twell_array | None = None
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the kernel layouts from the weight arrays (after an in-place update)."""
        w_down = self._weights["w_down"]
        self._w_down_t = array_module(w_down).ascontiguousarray(w_down.T)

    @property
    def dtype(self) -> Any:
        return value_dtype(self._weights["w_down"].dtype)

    @property
    def last_stats(self) -> dict[str, Any]:
        """The last call's hidden layer: tokens, units, nonzeros, density, spilled entries.

        Computed on access (it reads counts back from the GPU), never in the call itself.
        """
        h = self._last_hidden
        if h is None:
            return {}
        (m, n), nnz = h.shape, h.nnz
        return {
            "tokens": m,
            "units": n,
            "nnz": nnz,
            "density": nnz / max(m * n, 1),
            "nnz_per_token": nnz / max(m, 1),
            "n_spilled": h.n_spilled,
            "path": "sparse",
        }

    def _hidden(self, x: Any, weight_name: str) -> tuple[Any, twell_array]:
        """Validated input and ``act(x @ weight.T)`` packed into TwELL."""
        xx = _dense(x, "x")
        first = next(iter(self._weights.values()))
        _same_device("w_down", self._weights["w_down"], x=xx)
        if xx.shape[1] != first.shape[1]:
            raise ValueError(f"x: expected {first.shape[1]} columns (d_model), got shape {tuple(xx.shape)}")
        h = linear_to_twell(
            xx,
            self._weights[weight_name],
            activation=self.activation,
            tile_n=self.tile_n,
            capacity=self.capacity,
            threshold=self.threshold,
        )
        self._last_hidden = h
        return xx, h


def _check_weight_shapes(arrays: dict[str, Any], d_model: int | None) -> None:
    """Input weights (d_ff, d_model) agreeing with each other, w_down (d_model, d_ff).

    ``d_model`` comes from x when known; otherwise from the input weights (the error then names
    the array that disagrees with them).
    """
    inputs = {name: w for name, w in arrays.items() if name != "w_down"}
    w_down = arrays["w_down"]
    first_name, first = next(iter(inputs.items()))
    d_model = first.shape[1] if d_model is None else d_model
    for name, w in inputs.items():
        if w.shape[1] != d_model:
            raise ValueError(f"{name}: expected {d_model} columns (d_model of x), got shape {tuple(w.shape)}")
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
    ) -> None:
        super().__init__({"w_up": w_up, "w_down": w_down}, activation, tile_n, capacity, threshold)

    def __call__(self, x: Any) -> Any:
        _, h = self._hidden(x, "w_up")
        return matmul(h, self._w_down_t)


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
    ) -> None:
        super().__init__({"w_gate": w_gate, "w_up": w_up, "w_down": w_down}, activation, tile_n, capacity, threshold)

    def __call__(self, x: Any) -> Any:
        xx, g = self._hidden(x, "w_gate")
        parts, _ = _sddmm_parts(xx, self._weights["w_up"], g, scale=True)
        return matmul(twell_array._from_parts(parts, g.shape, g.tile_n), self._w_down_t)


def ffn(
    x: Any,
    w_up: Any,
    w_down: Any,
    *,
    activation: str = "relu",
    tile_n: int = 256,
    capacity: int | None = None,
    threshold: float | None = None,
) -> Any:
    """Non-gated sparse FFN: ``act(x @ w_up.T) @ w_down.T`` with the hidden layer in TwELL.

    Parameters
    ----------
    x : array_like, shape (M, d_model)
    w_up : array_like, shape (d_ff, d_model)
    w_down : array_like, shape (d_model, d_ff)
    activation, tile_n, capacity, threshold
        As for :func:`twellsparse.linear_to_twell`.

    Returns
    -------
    array, shape (M, d_model)
        Exact with respect to the sparse hidden layer (overflowing row-tiles spill).

    See Also
    --------
    FFN : the reusable plan (no per-call weight transpose).
    """
    _one_shot_weights(x, w_up=w_up, w_down=w_down)
    plan = FFN(w_up, w_down, activation=activation, tile_n=tile_n, capacity=capacity, threshold=threshold)
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

    Returns
    -------
    array, shape (M, d_model)

    See Also
    --------
    GatedFFN : the reusable plan.
    """
    _one_shot_weights(x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    plan = GatedFFN(w_gate, w_up, w_down, activation=activation, tile_n=tile_n, capacity=capacity, threshold=threshold)
    return plan(x)
