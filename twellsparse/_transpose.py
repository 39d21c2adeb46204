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
    check_format_name,
    check_order,
    is_twell,
    issparse,
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
        """Return the base matrix, the transpose of this view.

        Parameters
        ----------
        axes : None or (1, 0), optional
            Accepted for NumPy compatibility; only the 2-D transpose exists.
        copy : bool, default False
            Accepted for scipy compatibility and ignored: the base itself is returned.

        Returns
        -------
        twell_array
            The (M, N) matrix this view transposes (shared, not copied).

        Raises
        ------
        ValueError
            For other ``axes``.
        """
        if axes is not None and tuple(axes) != (1, 0):
            raise ValueError(f"axes: expected None or (1, 0), got {axes!r}")
        return self._base

    @property
    def T(self) -> twell_array:
        """The base matrix."""
        return self._base

    def toarray(self, order: str | None = None, out: Any = None) -> Any:
        """As ``twell_array.toarray``, for the transposed view: a dense copy of the transpose.

        Parameters
        ----------
        order : {None, "C", "F"}, optional
            Memory layout of the result: C order for None (the default) or "C", Fortran order for "F".
        out : array, optional
            An array of shape ``(N, M)`` and the base's dtype, on its device, to write the result into.

        Returns
        -------
        array, shape (N, M)
            NumPy (CPU) or CuPy (GPU) array in the base's dtype; ``out`` when given.

        Raises
        ------
        ValueError
            For another ``order``, or an ``out`` of another shape, dtype or device.
        TypeError
            For an ``out`` that is not a NumPy or CuPy array.
        """
        check_order(order)
        dense = self._base.toarray().T
        xp = array_module(dense)  # the base's concrete arrays' (a JAX base gives NumPy or CuPy)
        dense = xp.asfortranarray(dense) if order == "F" else xp.ascontiguousarray(dense)
        return write_out(dense, out, self.dtype)

    todense = toarray

    def tocsr(self, copy: bool = False) -> Any:
        """As ``twell_array.tocsr``, for the transposed view: the transpose in CSR format.

        Parameters
        ----------
        copy : bool, default False
            Accepted for scipy compatibility and ignored: the result is a new matrix either way.

        Returns
        -------
        scipy.sparse.csr_array or cupyx.scipy.sparse.csr_matrix
            Shape ``(N, M)``; float32 values for a 16-bit base, as ``twell_array.tocsr``.

        Warns
        -----
        TwELLFallbackWarning
            For a float16 or bfloat16 base (values widened to float32).
        """
        return self._base.tocsr().T.tocsr()

    def tocoo(self, copy: bool = False) -> Any:
        """As ``twell_array.tocoo``, for the transposed view: the transpose in COO format.

        Parameters
        ----------
        copy : bool, default False
            Accepted for scipy compatibility and ignored: the result is a new matrix either way.

        Returns
        -------
        scipy.sparse.coo_array or cupyx.scipy.sparse.coo_matrix
            Shape ``(N, M)``; float32 values for a 16-bit base.

        Warns
        -----
        TwELLFallbackWarning
            For a float16 or bfloat16 base (values widened to float32).
        """
        return self._base.tocoo().T

    def asformat(self, format: str | None, copy: bool = False) -> Any:
        """Return the transpose in ``format``.

        Parameters
        ----------
        format : {None, "twell", "csr", "coo", "csc", "bsr", "dia", "dok", "lil"}
            None for this view; "twell" for a real N x M ``twell_array`` with the base's tile_n,
            capacity and dtype (row-tiles beyond the capacity spill); otherwise a scipy.sparse
            format, converted through :meth:`tocsr`.
        copy : bool, default False
            With None, return the view of a deep copy of the base (:meth:`copy`) rather than this
            view. Ignored otherwise: a converted matrix is always new.

        Returns
        -------
        twell_transpose, twell_array or sparse matrix
            This view or its copy, the N x M TwELL matrix, or a scipy.sparse (CPU) /
            cupyx.scipy.sparse (GPU) matrix (float32 values for a 16-bit base, as :meth:`tocsr`).

        Raises
        ------
        ValueError
            For a ``format`` not listed.

        Warns
        -----
        TwELLFallbackWarning
            For a float16 or bfloat16 base converted to a scipy.sparse format.
        """
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
        """As ``twell_array.astype``, for the transposed view: the view of the base cast to ``dtype``.

        Parameters
        ----------
        dtype : dtype
            The value dtype: float16, bfloat16 (``"bfloat16"`` accepted), float32 or float64.
        copy : bool, default True
            With False, the new view wraps this view's base itself when it already has ``dtype``.

        Returns
        -------
        twell_transpose
            A view of ``base.astype(dtype, copy=copy)`` (its structure arrays shared with the base).

        Raises
        ------
        TypeError
            For a ``dtype`` that is not one of the value dtypes.
        """
        return twell_transpose(self._base.astype(dtype, copy=copy))

    def copy(self) -> twell_transpose:
        """The view of a deep copy of the base."""
        return twell_transpose(self._base.copy())

    def get(self, stream: Any = None) -> twell_transpose:
        """As ``twell_array.get``, for the transposed view: the view of a host copy of the base.

        Parameters
        ----------
        stream : cupy.cuda.Stream, optional
            Passed to CuPy's ``ndarray.get`` for each component's device-to-host copy.

        Returns
        -------
        twell_transpose
            A new view of ``base.get(stream)`` (the base itself when its components are not CuPy
            arrays).
        """
        return twell_transpose(self._base.get(stream))

    def sum(self, axis: int | None = None, dtype: Any = None) -> Any:
        """As ``twell_array.sum``, for the transposed view: all entries, per column or per row.

        Parameters
        ----------
        axis : {None, 0, 1, -1, -2}, optional
            None (default) sums every entry; 0 (or -2) sums each column of the transpose (each row
            of the base), 1 (or -1) each row of the transpose.
        dtype : dtype, optional
            The result's value dtype (float16, bfloat16, float32 or float64); default the base's.

        Returns
        -------
        scalar or array
            For ``axis=None`` a NumPy scalar (CPU) or a 0-d CuPy array (GPU), else an array of shape
            (M,) for ``axis=0`` or (N,) for ``axis=1``.

        Raises
        ------
        ValueError
            For another ``axis``.
        TypeError
            For a ``dtype`` that is not a value dtype.
        """
        if axis is not None and axis not in (0, 1, -1, -2):
            raise ValueError(f"axis: expected None, 0 or 1, got {axis}")
        return self._base.sum(axis=None if axis is None else 1 - axis % 2, dtype=dtype)

    def multiply(self, other: Any) -> twell_transpose:
        """As ``twell_array.multiply``, for the transposed view: the product at its stored entries.

        Parameters
        ----------
        other : scalar, array_like or sparse matrix
            A Python or NumPy int or float (not a bool); a dense array broadcastable to ``shape``
            (N, M) on the base's device; or a sparse matrix of shape (N, M) (densified first).

        Returns
        -------
        twell_transpose
            The view of ``base.multiply(other.T)``: the base's pattern with new values, dtypes
            promoted as in ``twell_array.multiply``.

        Raises
        ------
        ValueError
            For an array on another device or of a shape that does not broadcast to ``shape``.
        TypeError
            For an array whose dtype is not a value dtype.
        """
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
        """As ``twell_array.dot``, for the transposed view: the matrix product ``self @ other``.

        Parameters
        ----------
        other : array_like or sparse matrix
            A dense operand of ``M`` rows (1-D or 2-D; see :func:`twellsparse.matmul`), or a sparse
            matrix (TwELL, scipy.sparse or cupyx.scipy.sparse) of ``M`` rows.

        Returns
        -------
        array or sparse matrix
            A dense array for a dense ``other``, computed without converting the base; a CSR matrix
            for a sparse one.
        """
        return self @ other

    def __matmul__(self, other: Any) -> Any:
        """``self @ other``: a dense array for a dense ``other``; a CSR matrix for a sparse one,
        TwELL included (as :meth:`twell_array.__matmul__`)."""
        from ._ops import matmul

        if issparse(other):
            return self.tocsr() @ other.tocsr() if is_twell(other) else self.tocsr() @ other
        if is_jax_array(self._base.data):  # the JAX adapter's op
            from .jax import matmul as jax_matmul

            return jax_matmul(self, other)
        return matmul(self, other)

    def __rmatmul__(self, other: Any) -> Any:
        """``other @ self``: as :meth:`__matmul__`, from the left."""
        from ._ops import rmatmul

        if issparse(other):
            return other.tocsr() @ self.tocsr() if is_twell(other) else other @ self.tocsr()
        return rmatmul(self, other)
