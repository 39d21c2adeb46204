"""``twell_transpose``: the lazy transpose of a ``twell_array``.

Training needs ``A.T @ G`` with the same TwELL ``A`` as the forward pass; converting ``A`` to a
column-tiled layout each step would cost more than the product, so ``A.T`` is a view that the
products understand directly. Anything else materialises through CSR.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._twell import broadcast_operand, issparse, twell_array


class twell_transpose:
    """Transposed view of a :class:`twell_array` (shape (N, M)); ``.T`` gives the matrix back.

    Supports ``@``/``dot``/``matmul`` with dense operands without any conversion; ``toarray``,
    ``tocsr``, ``tocoo`` and ``asformat("twell")`` (a real N x M twell_array) convert.
    """

    format = "twell_transpose"
    ndim = 2
    __array_priority__ = 10.1

    def __init__(self, base: twell_array) -> None:
        self._base = base

    @property
    def base(self) -> twell_array:
        return self._base

    @property
    def shape(self) -> tuple[int, int]:
        m, n = self._base.shape
        return (n, m)

    @property
    def dtype(self) -> np.dtype:
        return self._base.dtype

    @property
    def nnz(self) -> int:
        return self._base.nnz

    @property
    def device(self) -> Any:
        return self._base.device

    def __repr__(self) -> str:
        return f"<transposed view of {self._base!r}>"

    def transpose(self, axes: Any = None, copy: bool = False) -> twell_array:
        return self._base

    @property
    def T(self) -> twell_array:
        return self._base

    def toarray(self, order: str | None = None, out: Any = None) -> Any:
        dense = self._base.toarray().T
        xp = self._base._xp()
        dense = xp.asfortranarray(dense) if order == "F" else xp.ascontiguousarray(dense)
        if out is None:
            return dense
        out[...] = dense
        return out

    todense = toarray

    def tocsr(self, copy: bool = False) -> Any:
        return self._base.tocsr().T.tocsr()

    def tocoo(self, copy: bool = False) -> Any:
        return self._base.tocoo().T

    def asformat(self, format: str | None, copy: bool = False) -> Any:
        if format == "twell":
            return twell_array(self.tocsr(), tile_n=self._base.tile_n, capacity=self._base.capacity)
        return self.tocsr().asformat(format)

    def astype(self, dtype: Any, copy: bool = True) -> twell_transpose:
        return twell_transpose(self._base.astype(dtype, copy=copy))

    def copy(self) -> twell_transpose:
        return twell_transpose(self._base.copy())

    def get(self, stream: Any = None) -> twell_transpose:
        return twell_transpose(self._base.get(stream))

    def sum(self, axis: int | None = None, dtype: Any = None) -> Any:
        return self._base.sum(axis=None if axis is None else 1 - axis % 2, dtype=dtype)

    def multiply(self, other: Any) -> twell_transpose:
        """Elementwise product (see ``twell_array.multiply``), as a transposed view."""
        if isinstance(other, (int, float, np.integer, np.floating)):
            return twell_transpose(self._base.multiply(other))
        if issparse(other):
            return twell_transpose(self._base.multiply(other.T))
        return twell_transpose(self._base.multiply(broadcast_operand(other, self.shape, self._base.data).T))

    __mul__ = multiply
    __rmul__ = multiply

    def __neg__(self) -> twell_transpose:
        return twell_transpose(-self._base)

    def __truediv__(self, other: Any) -> twell_transpose:
        if not isinstance(other, (int, float, np.integer, np.floating)):
            return NotImplemented
        return twell_transpose(self._base / other)

    def dot(self, other: Any) -> Any:
        return self @ other

    def __matmul__(self, other: Any) -> Any:
        from ._ops import matmul

        return matmul(self, other)

    def __rmatmul__(self, other: Any) -> Any:
        from ._ops import rmatmul

        return rmatmul(self, other)
