"""cffi bindings (ABI mode) to the parts of cuSPARSE's generic API that CuPy's wrapper lacks.

What they add over ``cupyx.scipy.sparse``: CSR SpMM in bf16/fp16 with row-major dense operands
and a choice of algorithm (ALG1, ALG2, ALG3 with its preprocess step), Blocked-ELL matrices and
their SpMM, SDDMM at a CSR pattern, and dense-to-CSR conversion in every value type. They exist
to benchmark TwELL against cuSPARSE at its best; every call runs on CuPy's current stream.

The shared library is found without compiling anything: ``TWELL_CUSPARSE`` (a path), then the
NVIDIA pip wheels (``nvidia-cusparse-cu12`` or ``nvidia-cusparse``), then ``CUDA_PATH`` /
``CUDA_HOME`` / ``/usr/local/cuda``, then the dynamic loader's own search. Enum values are those
of ``cusparse.h`` (cuSPARSE 12).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _loader

CDEF = """
typedef int cusparseStatus_t;
typedef struct cusparseContext* cusparseHandle_t;
typedef struct cusparseSpMatDescr* cusparseSpMatDescr_t;
typedef struct cusparseDnMatDescr* cusparseDnMatDescr_t;
typedef void* cudaStream_t;

cusparseStatus_t cusparseGetProperty(int type, int* value);
const char* cusparseGetErrorName(cusparseStatus_t status);
const char* cusparseGetErrorString(cusparseStatus_t status);
cusparseStatus_t cusparseCreate(cusparseHandle_t* handle);
cusparseStatus_t cusparseDestroy(cusparseHandle_t handle);
cusparseStatus_t cusparseSetStream(cusparseHandle_t handle, cudaStream_t stream);

cusparseStatus_t cusparseCreateCsr(cusparseSpMatDescr_t* descr, int64_t rows, int64_t cols, int64_t nnz,
    void* row_offsets, void* col_ind, void* values, int row_offsets_type, int col_ind_type,
    int idx_base, int value_type);
cusparseStatus_t cusparseCreateBlockedEll(cusparseSpMatDescr_t* descr, int64_t rows, int64_t cols,
    int64_t block_size, int64_t ell_cols, void* ell_col_ind, void* ell_values, int idx_type,
    int idx_base, int value_type);
cusparseStatus_t cusparseDestroySpMat(cusparseSpMatDescr_t descr);
cusparseStatus_t cusparseCreateDnMat(cusparseDnMatDescr_t* descr, int64_t rows, int64_t cols,
    int64_t ld, void* values, int value_type, int order);
cusparseStatus_t cusparseDestroyDnMat(cusparseDnMatDescr_t descr);

cusparseStatus_t cusparseSpMM_bufferSize(cusparseHandle_t handle, int op_a, int op_b, const void* alpha,
    cusparseSpMatDescr_t a, cusparseDnMatDescr_t b, const void* beta, cusparseDnMatDescr_t c,
    int compute_type, int alg, size_t* buffer_size);
cusparseStatus_t cusparseSpMM_preprocess(cusparseHandle_t handle, int op_a, int op_b, const void* alpha,
    cusparseSpMatDescr_t a, cusparseDnMatDescr_t b, const void* beta, cusparseDnMatDescr_t c,
    int compute_type, int alg, void* buffer);
cusparseStatus_t cusparseSpMM(cusparseHandle_t handle, int op_a, int op_b, const void* alpha,
    cusparseSpMatDescr_t a, cusparseDnMatDescr_t b, const void* beta, cusparseDnMatDescr_t c,
    int compute_type, int alg, void* buffer);

cusparseStatus_t cusparseSpMatGetSize(cusparseSpMatDescr_t descr, int64_t* rows, int64_t* cols, int64_t* nnz);
cusparseStatus_t cusparseCsrSetPointers(cusparseSpMatDescr_t descr, void* row_offsets, void* col_ind, void* values);
cusparseStatus_t cusparseDenseToSparse_bufferSize(cusparseHandle_t handle, cusparseDnMatDescr_t a,
    cusparseSpMatDescr_t b, int alg, size_t* buffer_size);
cusparseStatus_t cusparseDenseToSparse_analysis(cusparseHandle_t handle, cusparseDnMatDescr_t a,
    cusparseSpMatDescr_t b, int alg, void* buffer);
cusparseStatus_t cusparseDenseToSparse_convert(cusparseHandle_t handle, cusparseDnMatDescr_t a,
    cusparseSpMatDescr_t b, int alg, void* buffer);

cusparseStatus_t cusparseSDDMM_bufferSize(cusparseHandle_t handle, int op_a, int op_b, const void* alpha,
    cusparseDnMatDescr_t a, cusparseDnMatDescr_t b, const void* beta, cusparseSpMatDescr_t c,
    int compute_type, int alg, size_t* buffer_size);
cusparseStatus_t cusparseSDDMM_preprocess(cusparseHandle_t handle, int op_a, int op_b, const void* alpha,
    cusparseDnMatDescr_t a, cusparseDnMatDescr_t b, const void* beta, cusparseSpMatDescr_t c,
    int compute_type, int alg, void* buffer);
cusparseStatus_t cusparseSDDMM(cusparseHandle_t handle, int op_a, int op_b, const void* alpha,
    cusparseDnMatDescr_t a, cusparseDnMatDescr_t b, const void* beta, cusparseSpMatDescr_t c,
    int compute_type, int alg, void* buffer);
"""

# cusparse.h / library_types.h
STATUS_SUCCESS = 0
OP_NON_TRANSPOSE, OP_TRANSPOSE = 0, 1
INDEX_32I = 2
INDEX_BASE_ZERO = 0
ORDER_COL, ORDER_ROW = 1, 2
MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL = 0, 1, 2
SDDMM_ALG_DEFAULT = 0
DENSE_TO_SPARSE_ALG_DEFAULT = 0
#: cusparseSpMMAlg_t values by the names this module takes.
SPMM_ALGS = {"default": 0, "csr_alg1": 4, "csr_alg2": 6, "csr_alg3": 12, "blocked_ell_alg1": 13}
#: cudaDataType values of the value dtypes (bfloat16 by name: NumPy has no such dtype).
CUDA_R = {"float16": 2, "bfloat16": 14, "float32": 0, "float64": 1}
_CUDA_R_32F, _CUDA_R_64F = 0, 1

ENV_LIBRARY = "TWELL_CUSPARSE"


class CuSparseError(RuntimeError):
    """A cuSPARSE call failed, or the library could not be loaded."""


def library_candidates() -> Iterator[str]:
    """Where libcusparse is looked for, in order (paths, then sonames for the loader)."""
    return _loader.candidates(ENV_LIBRARY, "cusparse", "cusparse", ("libcusparse.so.12", "libcusparse.so"))


@functools.cache
def _ffi() -> Any:
    return _loader.ffi(CDEF, "cuSPARSE", CuSparseError)


@functools.cache
def library() -> Any:
    """The loaded cuSPARSE library (cffi ABI mode).

    Raises
    ------
    CuSparseError
        Naming every place tried, when no candidate loads.
    """
    hint = f"install nvidia-cusparse-cu12 (CUDA 12) or nvidia-cusparse (CUDA 13), or set {ENV_LIBRARY} to its path"
    return _loader.load(_ffi(), library_candidates(), "cuSPARSE", hint, CuSparseError)


def _check(status: int, call: str) -> None:
    if status != STATUS_SUCCESS:
        lib = library()
        name = _ffi().string(lib.cusparseGetErrorName(status)).decode()
        text = _ffi().string(lib.cusparseGetErrorString(status)).decode()
        raise CuSparseError(f"{call}: {name} ({text})")


def version() -> tuple[int, int, int]:
    """cuSPARSE's (major, minor, patch); needs the library, not a GPU."""
    lib, ffi = library(), _ffi()
    parts = []
    for prop in (MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL):
        value = ffi.new("int*")
        _check(lib.cusparseGetProperty(prop, value), "cusparseGetProperty")
        parts.append(int(value[0]))
    return parts[0], parts[1], parts[2]


_handles: dict[int, Any] = {}
_handles_lock = threading.Lock()


def _handle() -> Any:
    """The process's cuSPARSE handle for the current device, bound to CuPy's current stream."""
    import cupy as cp

    lib, ffi = library(), _ffi()
    device = cp.cuda.Device().id
    with _handles_lock:
        if device not in _handles:
            handle = ffi.new("cusparseHandle_t*")
            _check(lib.cusparseCreate(handle), "cusparseCreate")
            _handles[device] = handle[0]
    h = _handles[device]
    _check(lib.cusparseSetStream(h, ffi.cast("cudaStream_t", cp.cuda.get_current_stream().ptr)), "cusparseSetStream")
    return h


def _value_type(dtype: Any) -> int:
    name = np.dtype(dtype).name
    if name not in CUDA_R:
        raise ValueError(f"dtype: expected one of {', '.join(CUDA_R)}, got {name}")
    return CUDA_R[name]


def _compute_type(dtype: Any) -> tuple[int, Any]:
    """(cudaDataType, host scalar dtype) of the accumulation: fp32, or fp64 for float64."""
    wide = np.dtype(dtype) == np.float64
    return (_CUDA_R_64F, np.float64) if wide else (_CUDA_R_32F, np.float32)


def _ptr(arr: Any) -> Any:
    return _ffi().cast("void*", int(arr.data.ptr))


def _row_major(name: str, arr: Any) -> int:
    """Leading dimension of a 2-D array with unit column stride (C-contiguous rows)."""
    if arr.ndim != 2 or (arr.shape[1] > 1 and arr.strides[1] != arr.itemsize) or arr.strides[0] % arr.itemsize:
        raise ValueError(f"{name}: expected a 2-D array with unit column stride, got strides {arr.strides}")
    return max(arr.strides[0] // arr.itemsize, arr.shape[1], 1)


class _Dense:
    """A row-major dense matrix descriptor, destroyed with the object."""

    def __init__(self, name: str, arr: Any) -> None:
        lib, ffi = library(), _ffi()
        ld = _row_major(name, arr)
        d = ffi.new("cusparseDnMatDescr_t*")
        _check(
            lib.cusparseCreateDnMat(d, arr.shape[0], arr.shape[1], ld, _ptr(arr), _value_type(arr.dtype), ORDER_ROW),
            "cusparseCreateDnMat",
        )
        self.descr, self.array = d[0], arr

    def __del__(self) -> None:
        if getattr(self, "descr", None) is not None:
            library().cusparseDestroyDnMat(self.descr)


class _Sparse:
    """A sparse matrix descriptor (CSR or Blocked-ELL) keeping its arrays alive."""

    def __init__(self, descr: Any, arrays: tuple) -> None:
        self.descr, self.arrays = descr, arrays

    def __del__(self) -> None:
        if getattr(self, "descr", None) is not None:
            library().cusparseDestroySpMat(self.descr)


def csr_descriptor(indptr: Any, cols: Any, vals: Any, shape: tuple[int, int]) -> _Sparse:
    """A CSR matrix (int32 indices, zero-based) over CuPy arrays."""
    import cupy as cp

    indptr = cp.ascontiguousarray(indptr, dtype=cp.int32)
    cols = cp.ascontiguousarray(cols, dtype=cp.int32)
    vals = cp.ascontiguousarray(vals)
    if indptr.shape != (shape[0] + 1,):
        raise ValueError(f"indptr: expected shape ({shape[0] + 1},), got {indptr.shape}")
    if cols.shape != vals.shape or cols.ndim != 1:
        raise ValueError(f"cols, vals: expected equal 1-D shapes, got {cols.shape} and {vals.shape}")
    lib, ffi = library(), _ffi()
    d = ffi.new("cusparseSpMatDescr_t*")
    _check(
        lib.cusparseCreateCsr(
            d, shape[0], shape[1], cols.size, _ptr(indptr), _ptr(cols), _ptr(vals), INDEX_32I, INDEX_32I,
            INDEX_BASE_ZERO, _value_type(vals.dtype),
        ),
        "cusparseCreateCsr",
    )  # fmt: skip
    return _Sparse(d[0], (indptr, cols, vals))


def blocked_ell_descriptor(block_cols: Any, values: Any, shape: tuple[int, int], block_size: int) -> _Sparse:
    """A Blocked-ELL matrix: ``block_cols`` (rows / block_size, ell_cols / block_size) int32 block
    column indices (-1 for padding), ``values`` (rows, ell_cols) row-major, as cuSPARSE stores it."""
    import cupy as cp

    block_cols = cp.ascontiguousarray(block_cols, dtype=cp.int32)
    values = cp.ascontiguousarray(values)
    rows, n = shape
    if rows % block_size or n % block_size:
        raise ValueError(f"shape: expected multiples of block_size {block_size}, got {shape}")
    if values.shape != (rows, block_cols.shape[1] * block_size) or block_cols.shape[0] * block_size != rows:
        raise ValueError(
            f"values: expected shape ({rows}, {block_cols.shape[1] * block_size}) for block_cols "
            f"{block_cols.shape}, got {values.shape}"
        )
    lib, ffi = library(), _ffi()
    d = ffi.new("cusparseSpMatDescr_t*")
    _check(
        lib.cusparseCreateBlockedEll(
            d, rows, n, block_size, values.shape[1], _ptr(block_cols), _ptr(values), INDEX_32I, INDEX_BASE_ZERO,
            _value_type(values.dtype),
        ),
        "cusparseCreateBlockedEll",
    )  # fmt: skip
    return _Sparse(d[0], (block_cols, values))


class SpMM:
    """``out = A @ b`` with cuSPARSE's generic SpMM, planned once for fixed operands.

    The workspace is allocated (and, for ``csr_alg3``, the preprocess step run) at construction,
    so calling the object times the multiplication alone.

    Parameters
    ----------
    a : descriptor from :func:`csr_descriptor` or :func:`blocked_ell_descriptor`
    b : cupy.ndarray, shape (N, K), row-major
    out : cupy.ndarray, shape (M, K), row-major, same dtype as b
    alg : one of :data:`SPMM_ALGS`
    """

    def __init__(self, a: _Sparse, b: Any, out: Any, alg: str = "default") -> None:
        import cupy as cp

        if alg not in SPMM_ALGS:
            raise ValueError(f"alg: expected one of {', '.join(SPMM_ALGS)}, got {alg!r}")
        if b.dtype != out.dtype:
            raise ValueError(f"out: expected dtype {b.dtype}, got {out.dtype}")
        lib, ffi = library(), _ffi()
        self.a, self.b, self.out = a, _Dense("b", b), _Dense("out", out)
        compute, scalar = _compute_type(b.dtype)
        self._alpha = np.ones(1, dtype=scalar)
        self._beta = np.zeros(1, dtype=scalar)
        self._args = (
            OP_NON_TRANSPOSE,
            OP_NON_TRANSPOSE,
            ffi.cast("void*", self._alpha.ctypes.data),
            a.descr,
            self.b.descr,
            ffi.cast("void*", self._beta.ctypes.data),
            self.out.descr,
            compute,
            SPMM_ALGS[alg],
        )
        size = ffi.new("size_t*")
        _check(lib.cusparseSpMM_bufferSize(_handle(), *self._args, size), "cusparseSpMM_bufferSize")
        self._buffer = cp.empty(max(int(size[0]), 1), dtype=cp.uint8)
        if alg == "csr_alg3":
            _check(lib.cusparseSpMM_preprocess(_handle(), *self._args, _ptr(self._buffer)), "cusparseSpMM_preprocess")

    def __call__(self) -> Any:
        _check(library().cusparseSpMM(_handle(), *self._args, _ptr(self._buffer)), "cusparseSpMM")
        return self.out.array


def sddmm(x: Any, y: Any, pattern: _Sparse, out_vals: Any) -> Any:
    """``out_vals`` = values of ``(x @ y.T)`` at the CSR ``pattern`` (whose value array it is).

    ``x`` (M x K) and ``y`` (N x K) row-major, one dtype; ``pattern`` from :func:`csr_descriptor`
    with ``out_vals`` as its values.
    """
    import cupy as cp

    lib, ffi = library(), _ffi()
    da, db = _Dense("x", x), _Dense("y", y)
    compute, scalar = _compute_type(x.dtype)
    alpha, beta = np.ones(1, dtype=scalar), np.zeros(1, dtype=scalar)
    args = (
        OP_NON_TRANSPOSE,
        OP_TRANSPOSE,
        ffi.cast("void*", alpha.ctypes.data),
        da.descr,
        db.descr,
        ffi.cast("void*", beta.ctypes.data),
        pattern.descr,
        compute,
        SDDMM_ALG_DEFAULT,
    )
    size = ffi.new("size_t*")
    _check(lib.cusparseSDDMM_bufferSize(_handle(), *args, size), "cusparseSDDMM_bufferSize")
    buffer = cp.empty(max(int(size[0]), 1), dtype=cp.uint8)
    _check(lib.cusparseSDDMM_preprocess(_handle(), *args, _ptr(buffer)), "cusparseSDDMM_preprocess")
    _check(lib.cusparseSDDMM(_handle(), *args, _ptr(buffer)), "cusparseSDDMM")
    return out_vals


def dense_to_csr(x: Any) -> tuple[Any, Any, Any]:
    """``(indptr, cols, vals)`` of a dense row-major CuPy matrix by cuSPARSE's DenseToSparse (the
    conversion dynamic activations need before a CSR SpMM); one read-back of the nonzero count.

    The column indices within a row come out in cuSPARSE's order, not sorted (seen with CUDA 13.2
    on an H200); cuSPARSE's SpMM takes them as they are.
    """
    import cupy as cp

    lib, ffi = library(), _ffi()
    m, n = x.shape
    dense = _Dense("x", x)
    indptr = cp.empty(m + 1, dtype=cp.int32)
    d = ffi.new("cusparseSpMatDescr_t*")
    null = ffi.NULL
    _check(
        lib.cusparseCreateCsr(
            d, m, n, 0, _ptr(indptr), null, null, INDEX_32I, INDEX_32I, INDEX_BASE_ZERO, _value_type(x.dtype)
        ),
        "cusparseCreateCsr",
    )
    csr = _Sparse(d[0], (indptr,))
    size = ffi.new("size_t*")
    h = _handle()
    alg = DENSE_TO_SPARSE_ALG_DEFAULT
    _check(lib.cusparseDenseToSparse_bufferSize(h, dense.descr, csr.descr, alg, size), "DenseToSparse_bufferSize")
    buffer = cp.empty(max(int(size[0]), 1), dtype=cp.uint8)
    _check(lib.cusparseDenseToSparse_analysis(h, dense.descr, csr.descr, alg, _ptr(buffer)), "DenseToSparse_analysis")
    rows, cols_n, nnz = ffi.new("int64_t*"), ffi.new("int64_t*"), ffi.new("int64_t*")
    _check(lib.cusparseSpMatGetSize(csr.descr, rows, cols_n, nnz), "cusparseSpMatGetSize")
    cols = cp.empty(max(int(nnz[0]), 1), dtype=cp.int32)
    vals = cp.empty(max(int(nnz[0]), 1), dtype=x.dtype)
    _check(lib.cusparseCsrSetPointers(csr.descr, _ptr(indptr), _ptr(cols), _ptr(vals)), "cusparseCsrSetPointers")
    _check(lib.cusparseDenseToSparse_convert(h, dense.descr, csr.descr, alg, _ptr(buffer)), "DenseToSparse_convert")
    k = int(nnz[0])
    return indptr, cols[:k], vals[:k]


def blocked_ell_from_dense(x: Any, block_size: int) -> tuple[Any, Any]:
    """``(block_cols, values)`` of :func:`blocked_ell_descriptor` for a dense CuPy matrix whose
    shape is a multiple of ``block_size``: each block row keeps its nonzero blocks in column order,
    padded to the widest block row (one read-back for that width)."""
    import cupy as cp

    rows, n = x.shape
    if rows % block_size or n % block_size:
        raise ValueError(f"x: expected a shape that is a multiple of block_size {block_size}, got {x.shape}")
    nb_r, nb_c = rows // block_size, n // block_size
    blocks = x.reshape(nb_r, block_size, nb_c, block_size).swapaxes(1, 2)  # (nb_r, nb_c, bs, bs)
    nonzero = (blocks != 0).any(axis=(2, 3))
    counts = nonzero.sum(axis=1)
    width = max(int(counts.max()) if nb_r else 0, 1)
    # Unique keys: nonzero blocks first, each group in column order.
    keys = (~nonzero).astype(cp.int64) * nb_c + cp.arange(nb_c)
    order = cp.argsort(keys, axis=1)[:, :width].astype(cp.int32)
    valid = cp.arange(width)[None, :] < counts[:, None]
    block_cols = cp.where(valid, order, -1).astype(cp.int32)
    picked = blocks[cp.arange(nb_r)[:, None], cp.where(valid, order, 0)]  # (nb_r, width, bs, bs)
    picked = picked * valid[:, :, None, None].astype(picked.dtype)
    values = cp.ascontiguousarray(picked.swapaxes(1, 2).reshape(rows, width * block_size))
    return block_cols, values
