"""The tiled SpMM on the tensor cores (``cuda/twell_tiled_spmm.cu``): ``out = A @ b`` (or
``A @ b + A2 @ b2``, A2 of A's structure) for a TwELL ``A`` and 2-byte row-major ``b``, in blocks
of 512 output rows x 64 columns whose fp32 sums stay in registers while b's rows stream
through shared memory in chunks of 512 (TMA), instead of one row of b read from L2 per entry.

A is first packed on the device (four launches, no host read, so the pair runs inside a CUDA
graph capture) into k-groups of 16 words per (8 output rows, chunk). :func:`applies` says
whether the kernel serves the operands, :func:`spmm` runs it. Opt-in (``TWELL_TILED_SPMM=1`` or
``matmul``'s ``path="tiled"``) until measured against the stationary kernel; a documented
difference from the other paths: an Inf or NaN in a row of b that an entry uses reaches the
other 7 rows of that entry's group of 8 as NaN (0 x Inf inside the MMA), where the other paths
keep those rows finite.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _kernels as K
from ._gpu_convert import leading_dim, row_stride, rows_aligned, two_launch_scan
from ._parts import TwELLParts
from ._tensor_map import SWIZZLE_128B, tensor_map

#: Output rows and columns per block (TSPMM_ROWS, TSPMM_COLS), rows per group (TSPMM_GROUP).
ROWS = 512
COLS = 64
GROUP = 8
#: b's rows per staged chunk (TSPMM_CHUNK) and per TMA box (TSPMM_BOX).
CHUNK = 512
BOX = 256
#: Words per k-group (TSPMM_KGROUP), warps per block (TSPMM_WARPS).
KGROUP = 16
WARPS = 16
#: Dynamic shared memory of one block (TSPMM_SHARED_BYTES): three 64 KB stages, their barriers
#: and 1 KB of alignment slack.
SHARED_BYTES = 1024 + 3 * CHUNK * COLS * 2 + 6 * 8


class Pack(NamedTuple):
    """A (and A2) as the kernel's k-groups: ``kg_ptr`` (int32, one more than the items, item =
    group * n_chunks + chunk) and ``words`` (uint32, 16 per k-group, the first ``kg_ptr[-1] *
    16`` written); ``n_first``: the chunks of A (the rest, as many again, are A2's)."""

    kg_ptr: Any
    words: Any
    n_chunks: int
    n_first: int


def _cp() -> Any:
    import cupy

    return cupy


def applies(b: Any, out: Any, b2: Any = None) -> bool:
    """Whether the kernel serves ``A @ b -> out`` (``+ A2 @ b2`` when ``b2`` is given) on the
    current device: 2-byte values of one dtype, 16-byte-aligned rows of a multiple of 16 bytes
    (TMA's rules and the output's 4-byte pairs), a compute-capability 9.0 GPU (the kernel is
    built for sm_90a only) with room for its shared memory."""
    if b.dtype.itemsize != 2 or out.dtype != b.dtype:
        return False
    if b2 is not None and (b2.dtype != b.dtype or b2.shape != b.shape):
        return False
    rows = [row_stride(b), (out, leading_dim(out))] + ([row_stride(b2)] if b2 is not None else [])
    if not rows_aligned(*rows):
        return False
    if not K.runs_here("twell_tiled_spmm.cu"):
        return False
    return SHARED_BYTES <= K.device_attribute("MaxSharedMemoryPerBlockOptin")


def _structure(parts: TwELLParts, tile_n: int, k: int, second: TwELLParts | None) -> tuple:
    m, nt, cap = parts.data.shape
    n_first = -(-k // CHUNK)
    data2, spill2 = (parts.data, parts.spill_data) if second is None else (second.data, second.spill_data)
    arrays = (parts.data, data2, parts.indices, parts.counts, parts.spill_indptr, parts.spill_indices)
    geometry = (np.int32(m), np.int32(k), np.int32(nt), np.int32(tile_n), np.int32(cap), np.int32(n_first))
    return (*arrays, parts.spill_data, spill2, *geometry)


def pack(parts: TwELLParts, tile_n: int, k: int, second: TwELLParts | None = None) -> Pack:
    """A's entries (``k`` columns) as the kernel's k-groups, with ``second`` (A2: A's structure,
    other values) packed after them as chunks ``n_first ..``. Four launches: counts, the
    two-launch scan, placement; no host read."""
    cp = _cp()
    m = parts.data.shape[0]
    n_first = -(-k // CHUNK)
    n_chunks = n_first * (1 if second is None else 2)
    items = -(-m // GROUP) * n_chunks
    kg_ptr = cp.zeros(items + 1, dtype=cp.int32)
    stored = int(parts.data.size + parts.spill_data.size) * (1 if second is None else 2)
    words = cp.empty(stored + (KGROUP - 1) * items, dtype=cp.uint32)
    if items == 0:
        return Pack(kg_ptr, words, n_chunks, n_first)
    sizes = cp.empty(items, dtype=cp.int32)
    head = (*_structure(parts, tile_n, k, second), np.int32(n_chunks), np.int64(items))
    K.launch_arch("tiled_spmm_count", (-(-items // 256),), (256,), (*head, sizes), 0)
    scan = (sizes, np.int64(items))
    two_launch_scan(items, "stationary_row_sums", scan, "stationary_row_place", scan, (kg_ptr,))
    K.launch_arch("tiled_spmm_place", (-(-items // 256),), (256,), (*head, kg_ptr, words), 0)
    return Pack(kg_ptr, words, n_chunks, n_first)


def packed_spmm(packed: Pack, m: int, b: Any, out: Any, b2: Any = None) -> Any:
    """``out = A @ b`` (``+ A2 @ b2``) for an ``m``-row A packed by :func:`pack`; the caller has
    checked :func:`applies`."""
    b, _ = row_stride(b)
    n = b.shape[1]
    if m == 0 or n == 0:
        return out
    if packed.n_chunks == 0:  # A has no columns
        out[...] = 0
        return out
    map_b = tensor_map(b, BOX, COLS, SWIZZLE_128B)
    map_b2 = map_b if b2 is None else tensor_map(row_stride(b2)[0], BOX, COLS, SWIZZLE_128B)
    pattern = (packed.kg_ptr, packed.words, np.int32(m), np.int32(n), np.int32(packed.n_first))
    args = (map_b, map_b2, *pattern, np.int32(packed.n_chunks), out, np.int64(leading_dim(out)))
    grid = (-(-n // COLS), -(-m // ROWS))
    K.launch_arch(f"twell_tiled_spmm<{K.CXX_TYPE[b.dtype]}>", grid, (WARPS * 32,), args, SHARED_BYTES)
    return out


def spmm(parts: TwELLParts, tile_n: int, b: Any, out: Any, second: tuple[TwELLParts, Any] | None = None) -> Any:
    """``out = A @ b`` for a TwELL ``A`` with ``b.shape[0]`` columns, or with ``second = (A2,
    b2)`` (A2 of A's structure) ``out = A @ b + A2 @ b2`` in the same sums: :func:`pack`, then
    :func:`packed_spmm`."""
    parts2, b2 = (None, None) if second is None else second
    packed = pack(parts, tile_n, b.shape[0], parts2)
    return packed_spmm(packed, parts.data.shape[0], b, out, b2)


#: Whether ``matmul``'s "auto" path takes this kernel where it applies: only with
#: ``TWELL_TILED_SPMM=1`` (not yet measured on a GPU; bench/NOTES.md).
PREFERRED: bool | None = K.env_switch("TWELL_TILED_SPMM")


def chosen(b: Any, out: Any, b2: Any = None) -> bool:
    """Whether ``matmul``'s "auto" path takes the tiled kernel."""
    return bool(PREFERRED) and applies(b, out, b2)
