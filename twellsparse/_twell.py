"""The ``twell_array`` container: a TwELL sparse matrix backed by NumPy or CuPy arrays."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import scipy.sparse as sp

from . import _convert as conv
from ._backend import (
    array_module,
    as_array,
    cupy_module,
    device_name,
    is_cupy_array,
    is_jax_array,
    is_jax_tracer,
    result_dtype,
    value_dtype,
)
from ._errors import TwELLFallbackWarning, TwELLFormatError, warn
from ._parts import TwELLParts
from ._validation import (
    check_capacity,
    check_int,
    check_ndim,
    check_out_shape,
    check_overflow,
    check_shape,
    check_tile_n,
    n_tiles,
)

__all__ = ["twell_array", "is_twell", "issparse"]


def _is_cupyx_sparse(obj: Any) -> bool:
    cp = cupy_module()
    if cp is None:
        return False
    import cupyx.scipy.sparse as csp

    return bool(csp.issparse(obj))


def _component(name: str, doc: str) -> property:
    """A read-only property of ``twell_array`` returning one of its component arrays."""

    def get(self: twell_array) -> Any:
        return getattr(self._parts, name)

    return property(get, doc=doc)


class twell_array:
    """A sparse matrix in TwELL (tile-wise ELLPACK) format.

    Columns are cut into tiles of ``tile_n`` columns; each (row, tile) has ``capacity`` slots of
    (value, tile-local column) plus a count, and entries beyond the capacity go to a CSR spill
    part, so the format is lossless. See ``docs/FORMAT.md``.

    Parameters
    ----------
    arg : array_like, sparse matrix, twell_array or tuple
        A dense 2-D array (NumPy, CuPy, or any DLPack producer such as a torch tensor); a
        ``scipy.sparse`` or ``cupyx.scipy.sparse`` matrix or array; another ``twell_array``
        (re-tiled if ``tile_n``/``capacity`` differ); or component arrays
        ``(data, indices, counts)`` or ``(data, indices, counts, spill_data, spill_indices,
        spill_indptr)``, which need ``shape``.
    shape : tuple of int, optional
        ``(M, N)``; required for component arrays, checked against ``arg`` otherwise.
    tile_n : int, default 256
        Columns per tile, a power of two from 32 to 1024.
    capacity : int, optional
        Slots per row-tile, from 1 to ``tile_n``; default ``tile_n // 8``. For component arrays
        it is ``data.shape[2]``.
    dtype : dtype, optional
        Value dtype (float16, bfloat16, float32, float64); default the input's.
    overflow : {"spill", "error", "drop"}, default "spill"
        What to do with row-tiles that hold more than ``capacity`` nonzeros: keep the excess
        exactly in the spill part, raise :class:`TwELLCapacityError`, or drop it (lossy, warns,
        and records the count in ``n_dropped``).

    Notes
    -----
    Arithmetic follows ``scipy.sparse`` *array* semantics: ``*`` is elementwise and ``@`` is the
    matrix product. The matrix lives on the device of its input (CPU for NumPy/SciPy, the GPU
    for CuPy); ``get()`` copies it to the host.
    """

    format = "twell"
    ndim = 2
    __array_priority__ = 10.1  # let NumPy defer ``dense @ twell`` to __rmatmul__
    # NumPy's operators return NotImplemented instead of treating the matrix as an opaque
    # object (``a / ndarray`` would otherwise build an object array of matrices).
    __array_ufunc__ = None

    def __init__(
        self,
        arg: Any,
        shape: tuple[int, int] | None = None,
        *,
        tile_n: int = 256,
        capacity: int | None = None,
        dtype: Any = None,
        overflow: str = "spill",
    ) -> None:
        tile_n = check_tile_n(tile_n)
        overflow = check_overflow(overflow)
        dt = None if dtype is None else value_dtype(dtype)
        if shape is not None:
            shape = check_shape(shape)
        if isinstance(arg, tuple) and not (len(arg) == 2 and all(isinstance(s, (int, np.integer)) for s in arg)):
            if shape is None:
                raise TypeError(
                    "shape: expected (M, N) with component arrays (a tuple arg is read as "
                    "(data, indices, counts[, spill_data, spill_indices, spill_indptr]); pass a "
                    "dense matrix as an array or a list), got None"
                )
            self._init_from_parts(arg, shape, tile_n, capacity, dt)
            return
        capacity = check_capacity(capacity, tile_n)
        if isinstance(arg, tuple):  # (M, N): an empty matrix, as in scipy.sparse
            m, n = check_shape(arg, "arg")
            if shape is not None and shape != (m, n):
                raise ValueError(f"shape: expected {(m, n)} to match arg, got {shape}")
            self._init_from_coo(*_empty_coo(dt or np.dtype(np.float64)), (m, n), tile_n, capacity, overflow, None)
            return
        if getattr(arg, "format", None) == "twell_transpose":
            arg = arg.asformat("twell")
        if isinstance(arg, twell_array):
            src = arg if dt is None else arg.astype(dt)
            self._init_from_coo(*src._coo(), src.shape, tile_n, capacity, overflow, shape)
            return
        if sp.issparse(arg) or _is_cupyx_sparse(arg):
            self._init_from_sparse(arg, tile_n, capacity, dt, overflow, shape)
            return
        x = as_array(arg, "arg")
        check_ndim(x, 2, "arg")
        if shape is not None and tuple(x.shape) != shape:
            raise ValueError(f"shape: expected {tuple(x.shape)} to match arg, got {shape}")
        x = x.astype(value_dtype(dt or x.dtype, "arg.dtype"), copy=False)
        check_shape(x.shape, "arg.shape")
        parts, dropped = conv.dense_to_twell(x, tile_n, capacity, overflow)
        self._set(parts, x.shape, tile_n, dropped)

    # ------------------------------------------------------------------ construction helpers

    def _set(self, parts: TwELLParts, shape: tuple[int, int], tile_n: int, dropped: int = 0) -> None:
        self._parts = parts
        self._shape = (int(shape[0]), int(shape[1]))
        self._tile_n = int(tile_n)
        self.n_dropped = int(dropped)

    @classmethod
    def _from_parts(cls, parts: TwELLParts, shape: tuple[int, int], tile_n: int, dropped: int = 0) -> twell_array:
        """Wrap trusted parts (made by this package) without validation."""
        obj = cls.__new__(cls)
        obj._set(parts, shape, tile_n, dropped)
        return obj

    def _init_from_coo(self, rows, cols, vals, src_shape, tile_n, capacity, overflow, shape) -> None:
        if shape is not None and shape != tuple(src_shape):
            raise ValueError(f"shape: expected {tuple(src_shape)} to match arg, got {shape}")
        parts, dropped = conv.coo_to_twell(rows, cols, vals, tuple(src_shape), tile_n, capacity, overflow)
        self._set(parts, src_shape, tile_n, dropped)

    def _init_from_sparse(self, arg, tile_n, capacity, dt, overflow, shape) -> None:
        m = arg.tocsr(copy=True)  # canonicalising below is in place: never touch the caller's matrix
        m.sum_duplicates()
        check_shape(m.shape, "arg.shape")
        data = m.data.astype(value_dtype(dt or m.data.dtype, "arg.dtype"), copy=False)
        if shape is not None and shape != tuple(m.shape):
            raise ValueError(f"shape: expected {tuple(m.shape)} to match arg, got {shape}")
        parts, dropped = conv.csr_to_twell(m.indptr, m.indices, data, tuple(m.shape), tile_n, capacity, overflow)
        self._set(parts, m.shape, tile_n, dropped)

    def _init_from_parts(self, arg: tuple, shape, tile_n, capacity, dt) -> None:
        if len(arg) not in (3, 6):
            raise TypeError(
                "arg: expected (data, indices, counts) or (data, indices, counts, spill_data, "
                f"spill_indices, spill_indptr), got a tuple of {len(arg)}"
            )
        names = TwELLParts._fields
        arrays = [as_array(a, names[i]) for i, a in enumerate(arg)]
        xp = array_module(arrays[0])
        # The kernels index every part as a dense C-order array: other layouts are copied.
        arrays = [xp.ascontiguousarray(a) if device_name(a) == device_name(arrays[0]) else a for a in arrays]
        data = arrays[0]
        for name, a in zip(names[1:], arrays[1:], strict=False):
            if device_name(a) != device_name(data):
                raise ValueError(
                    f"{name}: expected an array on {device_name(data)} like data, got one on {device_name(a)}"
                )
        if len(arrays) == 3:
            m = shape[0]
            arrays += [xp.empty(0, dtype=data.dtype), xp.empty(0, dtype=xp.int32), xp.zeros(m + 1, dtype=xp.int32)]
        if data.ndim == 3 and capacity is not None and check_capacity(capacity, tile_n) != data.shape[2]:
            raise ValueError(f"capacity: expected data.shape[2] ({data.shape[2]}), got {capacity}")
        vdt = value_dtype(dt or data.dtype, "data.dtype")
        parts = TwELLParts(*arrays)
        spill = parts.spill_data
        if dt is not None or spill.size == 0:  # asked for, or lossless: else _check_parts names it
            spill = spill.astype(vdt, copy=False)
        parts = parts._replace(data=parts.data.astype(vdt, copy=False), spill_data=spill)
        _check_parts(parts, shape, tile_n, full=False)
        self._set(parts, shape, tile_n)

    # ------------------------------------------------------------------ attributes

    @property
    def shape(self) -> tuple[int, int]:
        """``(M, N)``."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The value dtype (float16, bfloat16, float32 or float64)."""
        return self._parts.data.dtype

    @property
    def tile_n(self) -> int:
        """Columns per tile."""
        return self._tile_n

    @property
    def capacity(self) -> int:
        """Slots per row-tile (``data.shape[2]``)."""
        return int(self._parts.data.shape[2])

    @property
    def n_tiles(self) -> int:
        """Tiles per row, ``ceil(N / tile_n)``."""
        return int(self._parts.data.shape[1])

    @property
    def nnz(self) -> int:
        """Stored entries (slots in use plus spilled ones; explicit zeros included)."""
        self._require_values("nnz", self._parts.counts)
        return int(self._parts.counts.sum()) + self.n_spilled

    @property
    def n_spilled(self) -> int:
        """Entries held in the spill part (beyond the capacity of their row-tile)."""
        p = self._parts
        self._require_values("n_spilled", p.spill_indptr)
        if is_jax_array(p.spill_indptr):  # the JAX adapter's spill is padded: its pointers count
            return int(p.spill_indptr[-1])
        return int(p.spill_data.size)

    @property
    def size(self) -> int:
        """Stored entries, as in scipy.sparse (the same as :attr:`nnz`)."""
        return self.nnz

    @property
    def device(self) -> Any:
        """``"cpu"`` for NumPy-backed matrices, the ``cupy.cuda.Device`` otherwise."""
        return self._parts.data.device if is_cupy_array(self._parts.data) else "cpu"

    @property
    def parts(self) -> TwELLParts:
        """The component arrays (see docs/FORMAT.md); shared, not copied."""
        return self._parts

    data = _component("data", "Slot values, (M, n_tiles, capacity) in the value dtype; 0 in unused slots.")
    indices = _component("indices", "Tile-local int16 columns, (M, n_tiles, capacity); -1 in unused slots.")
    counts = _component("counts", "Slots in use per row-tile, int32 (M, n_tiles), 0 to capacity.")
    spill_data = _component("spill_data", "Values of the entries beyond their row-tile's capacity, (S,).")
    spill_indices = _component("spill_indices", "Global int32 columns of the spilled entries, (S,), sorted per row.")
    spill_indptr = _component("spill_indptr", "Row pointers of the spill CSR, int32 (M + 1,).")

    def _xp(self) -> Any:
        return array_module(self._parts.data)

    def __repr__(self) -> str:
        m, n = self.shape
        return (
            f"<{m}x{n} twell_array of dtype {self.dtype.name} with {self.nnz} stored elements "
            f"(tile_n={self.tile_n}, capacity={self.capacity}, {self.n_spilled} spilled) on {device_name(self.data)}>"
        )

    def __len__(self) -> int:
        raise TypeError("sparse array length is ambiguous; use getnnz() or shape[0]")

    def getnnz(self) -> int:
        """Stored entries (:attr:`nnz`)."""
        return self.nnz

    # ------------------------------------------------------------------ conversions

    def _concrete(self) -> twell_array:
        """This matrix with NumPy or CuPy components: JAX ones (the JAX adapter's matrices,
        their spill padded to a static length) are viewed through DLPack and trimmed."""
        if not is_jax_array(self._parts.data):
            return self
        self._require_values("twell_array", self._parts.data, self._parts.counts)
        from .jax import from_jax

        return from_jax(self)

    def _require_values(self, op: str, *arrays: Any) -> None:
        """Raise a clear TypeError where ``op`` needs ``arrays`` (components of this matrix) and
        one is a JAX tracer (inside ``jax.jit`` or another transformation), which holds no values
        yet; under an eager ``jax.grad`` the structure (counts, spill pointers) stays concrete."""
        if any(is_jax_tracer(a) for a in arrays):
            raise TypeError(
                f"{op}: needs the matrix's values, but it holds traced JAX arrays (inside jax.jit or another "
                "transformation), which have none yet; inside one use twellsparse.jax's ops (matmul, sddmm, ffn, "
                "gated_ffn) or @ with a dense operand"
            )

    def _coo(self) -> tuple[Any, Any, Any]:
        a = self._concrete()
        return conv.twell_to_coo(a._parts, a.shape, a.tile_n)

    def toarray(self, order: str | None = None, out: Any = None) -> Any:
        """Return a dense copy of the matrix, on its device.

        Parameters
        ----------
        order : {None, "C", "F"}, optional
            Memory layout of the result: C order for None (the default) or "C", Fortran order for "F".
        out : array, optional
            An array of shape ``(M, N)`` and the matrix's dtype, on its device, to write the result into.

        Returns
        -------
        array, shape (M, N)
            NumPy (CPU) or CuPy (GPU) array in the matrix's dtype, zero where nothing is stored; ``out``
            when given. A matrix with JAX components gives NumPy or CuPy (viewed through DLPack).

        Raises
        ------
        ValueError
            For another ``order``, or an ``out`` of another shape, dtype or device.
        TypeError
            For an ``out`` that is not a NumPy or CuPy array.
        """
        check_order(order)
        a = self._concrete()
        dense = conv.twell_to_dense(a._parts, a.shape, a.tile_n)
        if order == "F":
            dense = a._xp().asfortranarray(dense)
        return write_out(dense, out, self.dtype)

    todense = toarray

    def tocsr(self, copy: bool = False) -> Any:
        """Return the matrix in CSR format, as a new matrix.

        Neither scipy.sparse nor cupyx.scipy.sparse holds 16-bit values, so a float16/bfloat16
        matrix comes back with float32 values (exact) and a :class:`TwELLFallbackWarning`.

        Parameters
        ----------
        copy : bool, default False
            Accepted for scipy compatibility and ignored: the result is a new matrix either way.

        Returns
        -------
        scipy.sparse.csr_array or cupyx.scipy.sparse.csr_matrix
            ``csr_array`` for a CPU matrix, ``cupyx.scipy.sparse.csr_matrix`` for a GPU one; shape
            ``(M, N)``, every stored entry (explicit zeros included), int32 column indices sorted
            within each row, values in the matrix's dtype (float32 for 16-bit dtypes).

        Warns
        -----
        TwELLFallbackWarning
            For a float16 or bfloat16 matrix (values widened to float32).
        """
        a = self._concrete()
        vals, cols, indptr = conv.twell_to_csr_arrays(a._parts, a.shape, a.tile_n)
        if vals.dtype.itemsize == 2:
            warn(
                f"tocsr: scipy.sparse and cupyx.scipy.sparse hold no {vals.dtype.name}; returning "
                "float32 values (exact)",
                TwELLFallbackWarning,
            )
            vals = vals.astype(np.float32)
        if not is_cupy_array(vals):
            return sp.csr_array((vals, cols, indptr), shape=self.shape)
        import cupyx.scipy.sparse as csp

        return csp.csr_matrix((vals, cols, indptr), shape=self.shape)

    def tocoo(self, copy: bool = False) -> Any:
        """Return the matrix in COO format, through :meth:`tocsr`.

        Parameters
        ----------
        copy : bool, default False
            As for :meth:`tocsr`.

        Returns
        -------
        scipy.sparse.coo_array or cupyx.scipy.sparse.coo_matrix
            Shape ``(M, N)``; float32 values for a 16-bit matrix, as :meth:`tocsr`.

        Warns
        -----
        TwELLFallbackWarning
            For a float16 or bfloat16 matrix (values widened to float32).
        """
        return self.tocsr().tocoo()

    def toell(self, width: int | None = None) -> tuple[Any, Any]:
        """Return the matrix as ELLPACK arrays: ``width`` (value, column) slots per row.

        Parameters
        ----------
        width : int, optional
            Slots per row, at least the largest row's count of stored entries (the default).

        Returns
        -------
        values : array, shape (M, width)
            Each row's stored values in increasing column order, in the matrix's dtype; 0 in padding.
        indices : array, shape (M, width)
            Their global columns, int32; -1 in padding.

        Raises
        ------
        TypeError
            For a ``width`` that is neither an int nor None.
        ValueError
            For a ``width`` below the largest row's count of stored entries.
        """
        if width is not None:
            width = check_int(width, "width", "an int or None")
        rows, cols, vals = self._coo()
        return conv.coo_to_ell(rows, cols, vals, self.shape[0], width)

    def asformat(self, format: str | None, copy: bool = False) -> Any:
        """Return the matrix in ``format``.

        Parameters
        ----------
        format : {None, "twell", "csr", "coo", "csc", "bsr", "dia", "dok", "lil"}
            None or "twell" for this matrix; otherwise a scipy.sparse format, converted through
            :meth:`tocsr`.
        copy : bool, default False
            With None or "twell", return a deep copy (:meth:`copy`) rather than this matrix. Ignored
            otherwise: a converted matrix is always new.

        Returns
        -------
        twell_array or sparse matrix
            This matrix or its copy, or a scipy.sparse (CPU) / cupyx.scipy.sparse (GPU) matrix in
            ``format`` (float32 values for a 16-bit matrix, as :meth:`tocsr`).

        Raises
        ------
        ValueError
            For a ``format`` not listed.

        Warns
        -----
        TwELLFallbackWarning
            For a float16 or bfloat16 matrix converted to a scipy.sparse format.
        """
        check_format_name(format)
        if format is None or format == "twell":
            return self.copy() if copy else self
        if format == "csr":
            return self.tocsr()
        return self.tocsr().asformat(format)

    def astype(self, dtype: Any, copy: bool = True) -> twell_array:
        """Return the matrix with its values cast to ``dtype``.

        Parameters
        ----------
        dtype : dtype
            The value dtype: float16, bfloat16 (``"bfloat16"`` accepted), float32 or float64.
        copy : bool, default True
            With False, return this matrix itself when it already has ``dtype``.

        Returns
        -------
        twell_array
            New value arrays (``data``, ``spill_data``); the structure arrays are shared with this
            matrix, not copied (docs/FORMAT.md). ``n_dropped`` is kept.

        Raises
        ------
        TypeError
            For a ``dtype`` that is not one of the value dtypes.
        """
        dt = value_dtype(dtype)
        if dt == self.dtype and not copy:
            return self
        p = self._parts
        parts = p._replace(data=p.data.astype(dt), spill_data=p.spill_data.astype(dt))
        return twell_array._from_parts(parts, self.shape, self.tile_n, self.n_dropped)

    def copy(self) -> twell_array:
        """A deep copy (every component array copied)."""
        parts = TwELLParts(*(a.copy() for a in self._parts))
        return twell_array._from_parts(parts, self.shape, self.tile_n, self.n_dropped)

    def get(self, stream: Any = None) -> twell_array:
        """Return a host (NumPy-backed) copy of a GPU matrix.

        Parameters
        ----------
        stream : cupy.cuda.Stream, optional
            Passed to CuPy's ``ndarray.get`` for each component's device-to-host copy.

        Returns
        -------
        twell_array
            The matrix with NumPy components; this matrix itself when its components are not CuPy
            arrays (NumPy ones, already on the CPU, or a JAX adapter matrix's JAX ones).
        """
        if not is_cupy_array(self._parts.data):
            return self
        parts = TwELLParts(*(a.get(stream=stream) for a in self._parts))
        return twell_array._from_parts(parts, self.shape, self.tile_n, self.n_dropped)

    def to_device(self, device: Any) -> twell_array:
        """Return the matrix on ``device``.

        Parameters
        ----------
        device : str, int or cupy.cuda.Device
            ``"cpu"``, a GPU ordinal (an int or a string of digits), ``"cuda:N"`` or a
            ``cupy.cuda.Device``.

        Returns
        -------
        twell_array
            For ``"cpu"``, as :meth:`get` (this matrix itself if it is on the CPU). For a GPU, a
            matrix whose components are ``cupy.asarray`` of this one's under that device: copied from
            the host or from another GPU, the same arrays when they are already on that GPU.

        Raises
        ------
        ValueError
            For a ``device`` of none of these forms.
        RuntimeError
            For a GPU ``device`` when CuPy is not installed.
        """
        if device == "cpu":
            return self.get()
        dev_id = _device_id(device)
        cp = cupy_module()
        if cp is None:
            raise RuntimeError("device: moving to a GPU needs CuPy, which is not installed")
        with cp.cuda.Device(dev_id):
            parts = TwELLParts(*(cp.asarray(a) for a in self._parts))
        return twell_array._from_parts(parts, self.shape, self.tile_n, self.n_dropped)

    # ------------------------------------------------------------------ structure

    def check_format(self, full_check: bool = False) -> None:
        """Check that the component arrays form a valid TwELL matrix (docs/FORMAT.md, Invariants).

        Parameters
        ----------
        full_check : bool, default False
            False runs the cheap check (every constructor's): shapes, dtypes, devices, the counts,
            the used slots' columns and the spill CSR. True also checks the unused slots (index -1,
            value 0), that columns are distinct within each row-tile and that the spill does not
            repeat a slot's column (a few more passes over the data).

        Raises
        ------
        TwELLFormatError
            For the first invariant that does not hold, naming the array.
        """
        _check_parts(self._parts, self.shape, self.tile_n, full=full_check)

    @property
    def has_canonical_format(self) -> bool:
        """Columns strictly increasing within each row-tile, slots filled before any spill."""
        return _is_canonical(self._parts, self.tile_n)

    def _repack(self, keep: Any = None) -> None:
        rows, cols, vals = self._coo()
        if keep is not None:
            mask = keep(vals)
            rows, cols, vals = rows[mask], cols[mask], vals[mask]
        parts, _ = conv.coo_to_twell(rows, cols, vals, self.shape, self.tile_n, self.capacity, "spill")
        self._parts = parts

    def sort_indices(self) -> None:
        """Put the matrix in canonical form, in place."""
        if not _is_canonical(self._parts, self.tile_n):
            self._repack()

    def eliminate_zeros(self) -> None:
        """Remove stored zeros, in place (NaN stays)."""
        self._repack(lambda v: v != 0)

    # ------------------------------------------------------------------ arithmetic

    def sum(self, axis: int | None = None, dtype: Any = None) -> Any:
        """Sum the stored entries: all of them, per column or per row (accumulated in float64).

        Parameters
        ----------
        axis : {None, 0, 1, -1, -2}, optional
            None (default) sums every entry; 0 (or -2) sums each column, 1 (or -1) each row.
        dtype : dtype, optional
            The result's value dtype (float16, bfloat16, float32 or float64); default the matrix's.

        Returns
        -------
        scalar or array
            For ``axis=None`` a NumPy scalar (CPU) or a 0-d CuPy array (GPU), else an array of shape
            (N,) for ``axis=0`` or (M,) for ``axis=1`` on the matrix's device; rounded once to ``dtype``.

        Raises
        ------
        ValueError
            For another integer ``axis``.
        TypeError
            For an ``axis`` that is not an integer or None, or a ``dtype`` that is not a value dtype.
        """
        xp = self._xp()
        rows, cols, vals = self._coo()
        v64 = vals.astype(xp.float64)
        out_dt = value_dtype(dtype) if dtype is not None else self.dtype
        if axis is None:
            return v64.sum().astype(out_dt)
        ax = operator.index(axis)
        if ax not in (0, 1, -1, -2):
            raise ValueError(f"axis: expected None, 0 or 1, got {axis}")
        ax %= 2
        idx, length = (cols, self.shape[1]) if ax == 0 else (rows, self.shape[0])
        if idx.size == 0:
            return xp.zeros(length, dtype=out_dt)
        return xp.bincount(idx, weights=v64, minlength=length).astype(out_dt)

    def multiply(self, other: Any) -> twell_array:
        """Return the elementwise product, at this matrix's stored entries.

        Dtypes promote as in NumPy: a Python scalar keeps this matrix's dtype, a NumPy scalar or
        array promotes (float32 * float64 scalar is float64).

        Parameters
        ----------
        other : scalar, array_like or sparse matrix
            A Python or NumPy int or float (not a bool); a dense array broadcastable to ``shape`` on
            this matrix's device; or a sparse matrix of ``shape`` (TwELL, scipy.sparse or
            cupyx.scipy.sparse, densified first).

        Returns
        -------
        twell_array
            This matrix's pattern with new values (the structure arrays shared: docs/FORMAT.md).
            Array operands give ``result_type`` of the two value dtypes (the widest; bfloat16 with
            float16 gives float32).

        Raises
        ------
        ValueError
            For an array on another device or of a shape that does not broadcast to ``shape``.
        TypeError
            For an array whose dtype is not a value dtype (float16, bfloat16, float32, float64).
        """
        if _is_scalar(other):
            return _scaled(self, other, operator.mul)
        if is_twell(other) or sp.issparse(other) or _is_cupyx_sparse(other):
            other = other.toarray()
        dense = broadcast_operand(other, self.shape, self.data)
        dt = result_dtype(self.dtype, value_dtype(dense.dtype, "other.dtype"))
        return _map_values(self, lambda rows, cols, vals: vals.astype(dt) * dense[rows, cols].astype(dt))

    def __mul__(self, other: Any) -> twell_array:
        return self.multiply(other)

    __rmul__ = __mul__

    def __neg__(self) -> twell_array:
        return self.multiply(-1.0)

    def __truediv__(self, other: Any) -> twell_array:
        """Division by a scalar (dtypes as in :meth:`multiply`); the pattern is kept."""
        if not _is_scalar(other):
            return NotImplemented
        return _scaled(self, other, operator.truediv)

    def transpose(self, axes: Any = None, copy: bool = False) -> Any:
        """Return a lazy transposed view: ``a.T @ g`` runs without conversion.

        Parameters
        ----------
        axes : None or (1, 0), optional
            Accepted for NumPy compatibility; only the 2-D transpose exists.
        copy : bool, default False
            Accepted for scipy compatibility and ignored: the result is always a view.

        Returns
        -------
        twell_transpose
            The (N, M) view of this matrix (shared, not copied).

        Raises
        ------
        ValueError
            For other ``axes``.
        """
        check_axes(axes)
        from ._transpose import twell_transpose

        return twell_transpose(self)

    @property
    def T(self) -> Any:
        """The lazy transposed view (:meth:`transpose`)."""
        return self.transpose()

    def dot(self, other: Any) -> Any:
        """Return the matrix product ``self @ other``.

        Parameters
        ----------
        other : array_like, QuantizedRows or sparse matrix
            A dense operand of ``N`` rows (1-D or 2-D, or its rows in fp8; see
            :func:`twellsparse.matmul`), or a sparse matrix (TwELL, scipy.sparse or
            cupyx.scipy.sparse) of ``N`` rows.

        Returns
        -------
        array or sparse matrix
            A dense array for a dense ``other``; a CSR matrix (SciPy's, or CuPy's on the GPU) for a
            sparse one, as ``scipy.sparse`` multiplies two sparse matrices.
        """
        return self @ other

    def __matmul__(self, other: Any) -> Any:
        """``self @ other``: a dense array for a dense ``other`` (:func:`twellsparse.matmul`); a
        CSR matrix (SciPy's, or CuPy's on the GPU) for a sparse one, TwELL included, as
        ``scipy.sparse`` multiplies two sparse matrices."""
        from ._ops import matmul

        if is_twell(other):
            self._require_values("@ of two TwELL matrices (a sparse product)", self._parts.data)
        if issparse(other):
            return sparse_product(self, other)
        if is_jax_array(self._parts.data):  # the JAX adapter's op: traceable, differentiable
            from .jax import matmul as jax_matmul

            return jax_matmul(self, other)
        return matmul(self, other)

    def __rmatmul__(self, other: Any) -> Any:
        """``other @ self``: as :meth:`__matmul__`, from the left (:func:`twellsparse.rmatmul`)."""
        from ._ops import rmatmul

        if issparse(other):
            return sparse_product(other, self)
        return rmatmul(self, other)


def _is_scalar(other: Any) -> bool:
    return isinstance(other, (int, float, np.integer, np.floating)) and not isinstance(other, (bool, np.bool_))


def _scaled(a: Any, scalar: Any, op: Any) -> Any:
    """``op(a, scalar)`` on the stored values, computed in at least float32 and rounded once (a
    16-bit matrix divided by 1e5 would otherwise divide by float16's inf); unused slots stay 0
    (``0 * inf`` would be NaN).

    Dtypes promote as in NumPy: a Python scalar keeps ``a``'s dtype, a NumPy scalar promotes.
    """
    numpy_scalar = isinstance(scalar, (np.integer, np.floating))
    dt = value_dtype(np.result_type(a.dtype, scalar), "other.dtype") if numpy_scalar else a.dtype
    wide = np.promote_types(dt, np.float32)
    s = wide.type(scalar)
    p = a.parts
    if is_jax_array(p.data):  # the JAX adapter's matrices (under jit too): jax.numpy's ops
        import jax.numpy as xp
    else:
        xp = array_module(p.data)
    used = xp.arange(p.data.shape[2]) < p.counts[..., None]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # the padding's 0 * inf, 0 / 0
        data = xp.where(used, op(p.data.astype(wide), s), 0).astype(dt)
        spill = op(p.spill_data.astype(wide), s).astype(dt)
    return twell_array._from_parts(p._replace(data=data, spill_data=spill), a.shape, a.tile_n, a.n_dropped)


def _device_id(device: Any) -> int:
    """A GPU ordinal from an int, ``"cuda:N"``, ``"N"`` or a ``cupy.cuda.Device``."""
    dev = getattr(device, "id", device)
    if isinstance(dev, str):
        dev = dev.split(":")[-1] if dev.startswith("cuda:") else dev
        if dev.isdigit():
            return int(dev)
    elif isinstance(dev, (int, np.integer)) and not isinstance(dev, bool) and dev >= 0:
        return int(dev)
    raise ValueError(f'device: expected "cpu", a GPU id, "cuda:N" or a cupy.cuda.Device, got {device!r}')


def check_axes(axes: Any) -> None:
    """``transpose``'s ``axes``: None or (1, 0), the only transpose of a 2-D matrix."""
    if axes is not None and tuple(axes) != (1, 0):
        raise ValueError(f"axes: expected None or (1, 0), got {axes!r}")


def check_order(order: Any) -> None:
    if order not in (None, "C", "F"):
        raise ValueError(f'order: expected None, "C" or "F", got {order!r}')


#: Formats ``asformat`` converts to (scipy.sparse's, through CSR).
FORMATS = ("twell", "csr", "coo", "csc", "bsr", "dia", "dok", "lil")


def check_format_name(format: Any) -> None:
    if format is not None and format not in FORMATS:
        raise ValueError(f"format: expected None or one of {', '.join(FORMATS)}, got {format!r}")


def write_out(dense: Any, out: Any, dtype: np.dtype) -> Any:
    """``dense`` itself, or copied into ``out`` (same shape, dtype and device) and ``out``."""
    if out is None:
        return dense
    check_out_shape(out, dense.shape, dtype)
    if device_name(out) != device_name(dense):
        raise ValueError(f"out: expected an array on {device_name(dense)}, got one on {device_name(out)}")
    out[...] = dense
    return out


def broadcast_operand(other: Any, shape: tuple[int, int], like: Any) -> Any:
    """``other`` as an array on ``like``'s device broadcast to ``shape`` (elementwise operands)."""
    dense = as_array(other, "other")
    if device_name(dense) != device_name(like):
        raise ValueError(f"other: expected an array on {device_name(like)}, got one on {device_name(dense)}")
    try:
        return array_module(like).broadcast_to(dense, shape)
    except ValueError:
        raise ValueError(f"other: expected a shape broadcastable to {shape}, got {tuple(dense.shape)}") from None


def _empty_coo(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.empty(0, np.int32), np.empty(0, np.int32), np.empty(0, dtype)


def _map_values(a: twell_array, fn: Any) -> twell_array:
    """Same pattern, values ``fn(rows, cols, vals)`` (entries in canonical COO order)."""
    p = a.parts
    xp = array_module(p.data)
    _m, _nt, cap = p.data.shape
    used = xp.arange(cap) < p.counts[..., None]
    r, t, s = xp.nonzero(used)
    cols = t.astype(xp.int64) * a.tile_n + p.indices[r, t, s]
    data_vals = fn(r, cols, p.data[r, t, s])
    data = xp.zeros(p.data.shape, dtype=data_vals.dtype)
    data[r, t, s] = data_vals
    spill_rows = conv.csr_rows(p.spill_indptr, p.spill_data.size)
    spill = fn(spill_rows, p.spill_indices, p.spill_data).astype(data.dtype)
    return twell_array._from_parts(p._replace(data=data, spill_data=spill), a.shape, a.tile_n)


def _is_canonical(parts: TwELLParts, tile_n: int) -> bool:
    xp = array_module(parts.data)
    _m, _nt, cap = parts.data.shape
    used = xp.arange(cap) < parts.counts[..., None]
    if cap > 1:
        ordered = (parts.indices[..., 1:] > parts.indices[..., :-1]) | ~used[..., 1:]
        if not bool(ordered.all()):
            return False
    if parts.spill_data.size == 0:
        return True
    # Every spilled entry's row-tile must be full, and its column above the tile's slots.
    rows = conv.csr_rows(parts.spill_indptr, parts.spill_data.size)
    tiles = parts.spill_indices // tile_n
    full = parts.counts[rows, tiles] == cap
    last = parts.indices[rows, tiles, cap - 1].astype(xp.int64) + tiles.astype(xp.int64) * tile_n
    return bool((full & (parts.spill_indices > last)).all())


def _check_parts(parts: TwELLParts, shape: tuple[int, int], tile_n: int, full: bool) -> None:
    """Validate component arrays; see twell_array.check_format."""
    m, n = shape
    nt = n_tiles(n, tile_n)
    data, indices, counts, sdata, sind, sptr = parts
    xp = array_module(data)

    def fail(msg: str) -> None:
        raise TwELLFormatError(msg)

    for name, a in zip(TwELLParts._fields, parts, strict=False):
        if device_name(a) != device_name(data):
            fail(f"{name}: expected an array on {device_name(data)} like data, got one on {device_name(a)}")
    if data.ndim != 3 or tuple(data.shape[:2]) != (m, nt):
        fail(
            f"data: expected shape ({m}, {nt}, capacity) for shape {shape} and tile_n {tile_n}, got {tuple(data.shape)}"
        )
    cap = data.shape[2]
    if not 1 <= cap <= tile_n:
        fail(f"data: expected a capacity (data.shape[2]) from 1 to tile_n ({tile_n}), got {cap}")
    if tuple(indices.shape) != tuple(data.shape) or indices.dtype != np.int16:
        fail(f"indices: expected int16 of shape {tuple(data.shape)}, got {indices.dtype} {tuple(indices.shape)}")
    if tuple(counts.shape) != (m, nt) or counts.dtype != np.int32:
        fail(f"counts: expected int32 of shape {(m, nt)}, got {counts.dtype} {tuple(counts.shape)}")
    if sdata.ndim != 1 or sdata.dtype != data.dtype:
        fail(f"spill_data: expected a 1-D {data.dtype.name} array, got {sdata.dtype} with shape {tuple(sdata.shape)}")
    if sind.ndim != 1 or sind.dtype != np.int32 or sind.size != sdata.size:
        fail(f"spill_indices: expected 1-D int32 of length {sdata.size}, got {sind.dtype} {tuple(sind.shape)}")
    if tuple(sptr.shape) != (m + 1,) or sptr.dtype != np.int32:
        fail(f"spill_indptr: expected int32 of shape ({m + 1},), got {sptr.dtype} {tuple(sptr.shape)}")
    if int(sptr[0]) != 0 or int(sptr[-1]) != sdata.size:
        fail(f"spill_indptr: expected to start at 0 and end at {sdata.size}, got {int(sptr[0])} and {int(sptr[-1])}")
    # counts and spill_indptr are small (M x n_tiles, M + 1): checked by every constructor, since
    # nnz and every kernel trust them.
    if m and nt and bool(((counts < 0) | (counts > cap)).any()):
        fail(f"counts: expected values in [0, {cap}]")
    if m and bool((sptr[1:] < sptr[:-1]).any()):
        fail("spill_indptr: expected a non-decreasing array")
    if sdata.size:
        # The kernels binary-search the spill: its columns must increase within each row.
        if bool(((sind < 0) | (sind >= n)).any()):
            fail(f"spill_indices: expected columns in [0, {n})")
        rows = conv.csr_rows(sptr, sdata.size)
        if sdata.size > 1 and bool(((rows[1:] == rows[:-1]) & (sind[1:] <= sind[:-1])).any()):
            fail("spill_indices: expected strictly increasing columns within each row")
    # Used slots' columns too (one pass over the int16 indices): the kernels write and read at
    # them unclamped, so a bad one would be an out-of-bounds access, not a wrong value.
    used = xp.arange(cap) < counts[..., None]
    limit = xp.minimum(tile_n, n - xp.arange(nt) * tile_n)[None, :, None]
    if m and nt and bool((used & ((indices < 0) | (indices >= limit))).any()):
        fail("indices: expected tile-local columns in [0, tile_n) that stay below N in every used slot")
    if not full:
        return
    if bool((~used & (indices != -1)).any()):
        fail("indices: expected -1 in every unused slot")
    if bool((~used & (data != 0)).any()):
        fail("data: expected 0 in every unused slot")
    big = xp.int16(tile_n)
    sorted_idx = xp.sort(xp.where(used, indices, big), axis=-1)
    if cap > 1 and bool((used[..., 1:] & (sorted_idx[..., 1:] <= sorted_idx[..., :-1])).any()):
        fail("indices: expected distinct columns within each row-tile")
    if sdata.size:
        rows = conv.csr_rows(sptr, sdata.size)
        tiles = sind // tile_n
        local = (sind % tile_n).astype(np.int16)
        clash = (parts.indices[rows, tiles] == local[:, None]) & used[rows, tiles]
        if bool(clash.any()):
            fail("spill_indices: expected columns not also stored in the row-tile's slots")


def is_twell(obj: Any) -> bool:
    """Whether ``obj`` (anything) is a TwELL matrix: a ``twell_array`` or its transposed view."""
    from ._transpose import twell_transpose

    return isinstance(obj, (twell_array, twell_transpose))


def sparse_product(a: Any, b: Any) -> Any:
    """``a @ b`` for two sparse matrices, one of them TwELL (or its transposed view): TwELL ones
    through :meth:`twell_array.tocsr`, so the product is CSR, as scipy.sparse multiplies sparse
    matrices."""
    return (a.tocsr() if is_twell(a) else a) @ (b.tocsr() if is_twell(b) else b)


def issparse(obj: Any) -> bool:
    """Whether ``obj`` (anything) is a sparse matrix: TwELL (:func:`is_twell`), or scipy.sparse /
    cupyx.scipy.sparse matrices and arrays."""
    return is_twell(obj) or sp.issparse(obj) or _is_cupyx_sparse(obj)
