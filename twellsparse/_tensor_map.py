"""TMA descriptors (``CUtensorMap``) of row-major 2-D CuPy arrays, encoded by the driver's
``cuTensorMapEncodeTiled`` and passed to kernels by value (``__grid_constant__``; the CUDA
side is ``cuda/twell_tma.cuh``). Used by the fused Hopper producer and the tiled kernels (up
projection, SpMM, one-pack FFN).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from ._backend import bfloat16

#: CUtensorMapDataType values (cuda.h) of the two dtypes served.
TENSOR_MAP_TYPE = {np.dtype(np.float16): 6, bfloat16: 9}
#: CUtensorMapSwizzle values: rows as they are, the 64-byte swizzle (rows of 64 bytes: the
#: tiled FFN's slices) or the 128-byte one (wgmma's operands, the tiled SpMM's stages).
SWIZZLE_NONE, SWIZZLE_64B, SWIZZLE_128B = 0, 2, 3
_L2_PROMOTION_256B = 3
#: The descriptor as a by-value kernel argument: 128 opaque bytes.
TENSOR_MAP = np.dtype([("opaque", np.uint64, (16,))])


def tma_ready(a: Any) -> bool:
    """Unit column stride, a 16-byte row stride and a 16-byte aligned start (TMA's rules)."""
    return a.strides[1] == a.itemsize and a.strides[0] % 16 == 0 and a.strides[0] > 0 and a.data.ptr % 16 == 0


@functools.cache
def _encoder() -> Any:
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p]
    fn.argtypes += [ctypes.c_int] * 4
    return fn


def tensor_map(a: Any, box_rows: int, box_cols: int, swizzle: int) -> np.void:
    """The TMA descriptor of a row-major 2-D CuPy array (checked by :func:`tma_ready`) read in
    ``box_rows`` x ``box_cols`` boxes with the given swizzle (out-of-bounds rows and columns
    read as zeros). It depends only on the array's address, shape, row stride and dtype, so
    plans calling with the same weights (and the same x buffers) reuse it."""
    return _encoded_map(a.data.ptr, *a.shape, a.strides[0], np.dtype(a.dtype), box_rows, box_cols, swizzle)


@functools.lru_cache(maxsize=256)
def _encoded_map(
    ptr: int, rows: int, cols: int, row_bytes: int, dtype: np.dtype, box_rows: int, box_cols: int, swizzle: int
) -> np.void:
    storage = np.zeros(32, dtype=np.uint64)  # CUtensorMap is 64-byte aligned: find such a spot
    start = (-storage.ctypes.data % 64) // 8
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    code = _encoder()(
        storage.ctypes.data + 8 * start,
        TENSOR_MAP_TYPE[dtype],
        2,
        ptr,
        dims,
        strides,
        box,
        unit,
        0,
        swizzle,
        _L2_PROMOTION_256B,
        0,
    )
    if code != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {code}) for an array of shape {(rows, cols)}")
    return np.frombuffer(storage[start : start + 16].tobytes(), dtype=TENSOR_MAP)[0]
