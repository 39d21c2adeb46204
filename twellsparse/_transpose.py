"""``twell_transpose``: the lazy transpose of a ``twell_array``.

Training needs ``A.T @ G`` with the same TwELL ``A`` as the forward pass; converting ``A`` to a
column-tiled layout each step would cost more than the product, so ``A.T`` is a view that the
products understand directly. Anything else materialises through CSR.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _convert as conv
from ._backend import array_module, is_jax_array
from ._twell import (
    _is_scalar,
    broadcast_operand,
    check_axes,
    check_format_name,
    check_order,
    issparse,
    sparse_product,
    twell_array,
    write_out,
)


class twell_transpose:
    """Transposed view of a :class:`twell_array` (shape (N, M)); ``.T`` gives the matrix back.

    Supports ``@``/``dot``/``matmul`` with dense operands without any conversion; ``toarray``,
    ``tocsr``, ``tocoo`` and ``asformat("twell")`` (a real N x M twell_array) convert.
    """

    format = "twell_transpose"
    ndim = 2
    __array_priority__ = 10.1
    __array_ufunc__ = None  # NumPy's operators defer (see twell_array)

    def __init__(self, base: twell_array) -> None:
        self._base = base

    @property
    def base(self) -> twell_array:
        """The matrix this view transposes (shared, not copied)."""
        return self._base

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, M)`` for a base of shape ``(M, N)``."""
        m, n = self._base.shape
        return (n, m)

    @property
    def dtype(self) -> np.dtype:
        """The base's value dtype."""
        return self._base.dtype

    @property
    def nnz(self) -> int:
        """The base's stored entries."""
        return self._base.nnz

    @property
    def device(self) -> Any:
        """The base's device."""
        return self._base.device

    def __repr__(self) -> str:
        return f"<transposed view of {self._base!r}>"

    def transpose(self, axes: Any = None, copy: bool = False) -> twell_array:
        """The base matrix (shared, not copied), the transpose of this view: parameters and
        errors as :meth:`twell_array.transpose` (``copy`` ignored here too)."""
        check_axes(axes)
        return self._base

    @property
    def T(self) -> twell_array:
        """The base matrix."""
        return self._base

    def toarray(self, order: str | None = None, out: Any = None) -> Any:
        """A dense copy of the transpose: parameters, result and errors as :meth:`twell_array.toarray`, for
        the transposed view (shapes swapped)."""
        check_order(order)
        dense = self._base.toarray().T
        xp = array_module(dense)  # the base's concrete arrays' (a JAX base gives NumPy or CuPy)
        dense = xp.asfortranarray(dense) if order == "F" else xp.ascontiguousarray(dense)
        return write_out(dense, out, self.dtype)

    todense = toarray

    def tocsr(self, copy: bool = False) -> Any:
        """The transpose in CSR format: parameters, result and errors as :meth:`twell_array.tocsr`, for
        the transposed view (shapes swapped)."""
        return self._base.tocsr().T.tocsr()

    def tocoo(self, copy: bool = False) -> Any:
        """The transpose in COO format: parameters, result and errors as :meth:`twell_array.tocoo`, for
        the transposed view (shapes swapped)."""
        return self._base.tocoo().T

    def asformat(self, format: str | None, copy: bool = False) -> Any:
        """The transpose in ``format``: parameters, result and errors as
        :meth:`twell_array.asformat`, for the transposed view (shapes swapped; None gives this view,
        or with ``copy`` the view of a deep copy of the base, :meth:`copy`)."""
        check_format_name(format)
        if format is None:
            return self.copy() if copy else self
        if format == "twell":
            rows, cols, vals = self._base._coo()
            xp = array_module(rows)
            order = xp.argsort(cols.astype(xp.int64) * self._base.shape[0] + rows, kind="stable")
            parts, _ = conv.coo_to_twell(
                cols[order], rows[order], vals[order], self.shape, self._base.tile_n, self._base.capacity, "spill"
            )
            return twell_array._from_parts(parts, self.shape, self._base.tile_n)
        return self.tocsr().asformat(format)

    def astype(self, dtype: Any, copy: bool = True) -> twell_transpose:
        """The view of the base cast to ``dtype``: parameters, result and errors as :meth:`twell_array.astype`, for
        the transposed view (shapes swapped)."""
        return twell_transpose(self._base.astype(dtype, copy=copy))

    def copy(self) -> twell_transpose:
        """The view of a deep copy of the base."""
        return twell_transpose(self._base.copy())

    def get(self, stream: Any = None) -> twell_transpose:
        """The view of a host copy of the base: parameters, result and errors as :meth:`twell_array.get`, for
        the transposed view (shapes swapped)."""
        return twell_transpose(self._base.get(stream))

    def sum(self, axis: int | None = None, dtype: Any = None) -> Any:
        """The sum of all entries, per column or per row: parameters, result and errors as :meth:`twell_array.sum`, for
        the transposed view (shapes swapped)."""
        if axis is not None and axis not in (0, 1, -1, -2):
            raise ValueError(f"axis: expected None, 0 or 1, got {axis}")
        return self._base.sum(axis=None if axis is None else 1 - axis % 2, dtype=dtype)

    def multiply(self, other: Any) -> twell_transpose:
        """The product at the stored entries, as a transposed view: parameters, result and
        errors as :meth:`twell_array.multiply`, for the transposed view (shapes swapped)."""
        if _is_scalar(other):
            return twell_transpose(self._base.multiply(other))
        if issparse(other):
            return twell_transpose(self._base.multiply(other.T))
        return twell_transpose(self._base.multiply(broadcast_operand(other, self.shape, self._base.data).T))

    __mul__ = multiply
    __rmul__ = multiply

    def __neg__(self) -> twell_transpose:
        return twell_transpose(-self._base)

    def __truediv__(self, other: Any) -> twell_transpose:
        """Division by a scalar, as a transposed view."""
        if not _is_scalar(other):
            return NotImplemented
        return twell_transpose(self._base / other)

    def dot(self, other: Any) -> Any:
        """The matrix product ``self @ other``: parameters, result and errors as :meth:`twell_array.dot`, for
        the transposed view (shapes swapped)."""
        return self @ other

    def __matmul__(self, other: Any) -> Any:
        """``self @ other``: a dense array for a dense ``other``; a CSR matrix for a sparse one,
        TwELL included (as :meth:`twell_array.__matmul__`)."""
        from ._ops import matmul

        if issparse(other):
            return sparse_product(self, other)
        if is_jax_array(self._base.data):  # the JAX adapter's op
            from .jax import matmul as jax_matmul

            return jax_matmul(self, other)
        return matmul(self, other)

    def __rmatmul__(self, other: Any) -> Any:
        """``other @ self``: as :meth:`__matmul__`, from the left."""
        from ._ops import rmatmul

        if issparse(other):
            return sparse_product(other, self)
        return rmatmul(self, other)
