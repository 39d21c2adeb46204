"""Reusable FFN plans: weights held in the layouts the kernels read, validated once.

``FFN(w_up, w_down)`` and ``GatedFFN(w_gate, w_up, w_down)`` keep ``w_down.T`` contiguous (the
down projection gathers rows of it), so a call does no weight transposes. The plan keeps
references to the caller's weight arrays; if they are updated in place, call ``refresh()`` to
rebuild the transposed copy (the one-shot ``ffn``/``gated_ffn`` functions never cache).
"""

from __future__ import annotations

from typing import Any

from ._backend import array_module, as_array, value_dtype
from ._ops import _check_ffn, _dense, _same_device, _sddmm_parts, linear_to_twell, matmul
from ._twell import twell_array
from ._validation import check_activation, check_capacity, check_threshold, check_tile_n


class _FFNPlanBase:
    def __init__(
        self, weights: dict[str, Any], activation: str, tile_n: int, capacity: int | None, threshold: float | None
    ) -> None:
        self.activation = check_activation(activation)
        self.tile_n = check_tile_n(tile_n)
        self.capacity = check_capacity(capacity, self.tile_n)
        self.threshold = check_threshold(threshold)
        arrays = {name: _dense(w, name) for name, w in weights.items()}
        first = next(iter(arrays))
        _same_device(first, arrays[first], **arrays)
        up = arrays["w_up"]
        for name, w in arrays.items():
            if name != "w_down" and w.shape != up.shape:
                raise ValueError(f"{name}: expected shape {tuple(up.shape)} like w_up, got {tuple(w.shape)}")
        if arrays["w_down"].shape != up.shape[::-1]:
            raise ValueError(f"w_down: expected shape {tuple(up.shape[::-1])}, got {tuple(arrays['w_down'].shape)}")
        self._weights = arrays
        self.last_stats: dict[str, Any] = {}
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the kernel layouts from the weight arrays (after an in-place update)."""
        w_down = self._weights["w_down"]
        self._w_down_t = array_module(w_down).ascontiguousarray(w_down.T)

    @property
    def dtype(self) -> Any:
        return value_dtype(self._weights["w_down"].dtype)

    def _input(self, x: Any) -> Any:
        xx = _dense(as_array(x, "x"), "x")
        _same_device("w_down", self._weights["w_down"], x=xx)
        return xx

    def _record(self, h: twell_array) -> None:
        m, n = h.shape
        nnz = h.nnz
        self.last_stats = {
            "tokens": m,
            "units": n,
            "nnz": nnz,
            "density": nnz / max(m * n, 1),
            "nnz_per_token": nnz / max(m, 1),
            "n_spilled": h.n_spilled,
            "path": "sparse",
        }

    def _pack(self, x: Any, weight: Any) -> twell_array:
        return linear_to_twell(
            x, weight, activation=self.activation, tile_n=self.tile_n, capacity=self.capacity, threshold=self.threshold
        )


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
        Nonzeros, density, spilled entries and the path taken by the last call.
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
        xx = self._input(x)
        _check_ffn(xx, {"w_up": self._weights["w_up"]}, self._weights["w_down"])
        h = self._pack(xx, self._weights["w_up"])
        self._record(h)
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
        xx = self._input(x)
        w = self._weights
        _check_ffn(xx, {"w_gate": w["w_gate"], "w_up": w["w_up"]}, w["w_down"])
        g = self._pack(xx, w["w_gate"])
        self._record(g)
        parts, _ = _sddmm_parts(xx, w["w_up"], g, scale=True)
        return matmul(twell_array._from_parts(parts, g.shape, g.tile_n), self._w_down_t)
