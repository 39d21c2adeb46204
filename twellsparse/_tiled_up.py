"""The tiled up projection of the gated FFN (``cuda/twell_tiled_up.cu``): ``u = x @ w_up.T`` at
the gate's pattern and ``h = gate * u``, what ``twell_gather_gated_up`` computes, with blocks of
tokens x units whose operands are staged in shared memory slice by slice instead of one whole
weight row gathered from L2 per entry.

The gate is first packed on the device (four launches, no host read, so it runs inside a CUDA
graph capture): its entries grouped per (token block, unit part, quad of tokens) into tiles of
8 in the kernel's order against bank conflicts. :func:`applies` says whether the kernel serves
the operands; :func:`gated_up` runs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernels as K
from . import _stationary
from ._gpu_convert import row_stride, rows_aligned, two_launch_scan
from ._parts import TwELLParts
from ._tensor_map import SWIZZLE_NONE, tensor_map

#: d columns per staged slice (TILED_COLS): 64 bytes of each row.
SLICE_COLS = 32
#: Warps per block (TILED_WARPS) and tiles each warp sums per round (TILED_MAX_TILES).
WARPS = 16
MAX_TILES = 32
#: Tokens per B fragment (TILED_QUAD) and entries per tile (TILED_TILE).
QUAD = 4
TILE = 8
#: Units per part at most (TILED_MAX_UNITS: the W_up rows' room in a buffer, 64 KB).
MAX_UNITS = 1024
#: Units per part aimed at: the standard widths' 5632 units in 8 parts of 704.
TARGET_UNITS = 704
#: Tokens per block: with 704 units, 512 tokens hold about 3.6K entries at 1% density (a round
#: holds WARPS * MAX_TILES * TILE = 4096).
TOKENS = 512
#: Tokens per block at most (TILED_MAX_TOKENS: the x rows' room in a buffer).
MAX_TOKENS = 512
#: Bytes of one of the kernel's two shared buffers (TILED_BUFFER_BYTES): room for
#: MAX_UNITS rows of W_up and MAX_TOKENS of x, 64 bytes each, at fixed places.
BUFFER_BYTES = (MAX_UNITS + MAX_TOKENS) * SLICE_COLS * 2


def _cp() -> Any:
    import cupy

    return cupy


def geometry(m: int, n: int, tokens: int | None = None) -> tuple[int, int, int]:
    """``(tokens per block, units per part, parts)`` for ``m`` tokens and ``n`` units: parts of
    about :data:`TARGET_UNITS` units (an even count, at most :data:`MAX_UNITS`), blocks of
    ``tokens`` (default :data:`TOKENS`; a multiple of :data:`QUAD`, at most :data:`MAX_TOKENS`),
    no more than ``m`` needs."""
    if tokens is not None and (tokens <= 0 or tokens % QUAD):
        raise ValueError(f"tokens: expected a positive multiple of {QUAD}, got {tokens}")
    parts = max(1, round(n / TARGET_UNITS), -(-n // MAX_UNITS))
    units = -(-n // parts)
    units += units % 2
    parts = -(-n // units)
    t = TOKENS if tokens is None else tokens
    t = min(t, MAX_TOKENS, -(-max(m, 1) // QUAD) * QUAD)
    return t, units, parts


def shared_bytes() -> int:
    """Dynamic shared memory of one block (TILED_SHARED_BYTES): two buffers of
    :data:`BUFFER_BYTES` (192 KB) and a barrier for each."""
    return 2 * BUFFER_BYTES + 16


def box_rows(rows: int) -> int:
    """Rows of the TMA boxes that stage ``rows`` rows: as few boxes of at most 256 rows as
    cover them, of an even row count (each box's 64-byte rows then fill whole 128-byte lines,
    and TMA writes only to 128-byte aligned shared addresses; 704 units: three boxes of 236)."""
    boxes = -(-rows // 256)
    per_box = -(-rows // boxes)
    return per_box + per_box % 2


def applies(gate: TwELLParts, x: Any, w_up: Any) -> bool:
    """Whether the tiled kernel serves the up projection of ``gate`` (its structure, x's dtype)
    with ``x`` and ``w_up`` on the current device: 2-byte values, 16-byte-aligned rows of a
    multiple of 16 bytes, slot positions that fit 31 bits, on a compute-capability 9.0 GPU (TMA;
    the kernel is built for sm_90a only)."""
    if x.dtype.itemsize != 2 or w_up.dtype != x.dtype or gate.data.dtype != x.dtype:
        return False
    if x.shape[1] == 0:  # nothing to stage (TMA descriptors need a column); the gathers serve it
        return False
    if gate.data.size + gate.spill_data.size >= 1 << 31:
        return False
    if not rows_aligned(row_stride(x), row_stride(w_up)):  # TMA's rules too, K a multiple of 8
        return False
    if not K.runs_here("twell_tiled_up.cu"):
        return False
    return shared_bytes() <= K.device_attribute("MaxSharedMemoryPerBlockOptin")


def pack(gate: TwELLParts, tile_n: int, n: int, tokens: int, units: int, parts: int) -> tuple[Any, Any, Any, Any]:
    """The gate's entries as the kernel's tiles: (int32 tile pointers per item, uint16 codes,
    int32 destinations, int32 quad per tile). An item is a quad of tokens in one unit part of
    one token block, in the order (block, part, quad); the arrays have room for every slot and
    spill entry plus each item's padding, and the first ``tile_ptr[-1]`` tiles are written."""
    cp = _cp()
    m, nt, cap = gate.data.shape
    items = -(-m // tokens) * parts * (tokens // QUAD)
    bound = (gate.data.size + gate.spill_data.size + (TILE - 1) * items) // TILE + 1
    tile_ptr = cp.empty(items + 1, dtype=cp.int32)
    codes = cp.empty(bound * TILE, dtype=cp.uint16)
    dests = cp.empty(bound * TILE, dtype=cp.int32)
    quads = cp.empty(bound, dtype=cp.int32)
    sizes = cp.empty(items, dtype=cp.int32)
    classes = cp.empty(items, dtype=cp.uint32)
    shape = (np.int32(m), np.int32(n), np.int32(nt), np.int32(tile_n), np.int32(cap))
    boxes = (np.int32(tokens), np.int32(units), np.int32(parts), np.int32(items))
    structure = (gate.indices, gate.counts, gate.spill_indptr, gate.spill_indices, *shape, *boxes)
    warps_grid = (-(-32 * items // 256),)
    K.launch_arch("tiled_up_count", warps_grid, (256,), (*structure, sizes, classes), 0)
    head = (sizes, np.int64(items))
    two_launch_scan(items, "stationary_row_sums", head, "stationary_row_place", head, (tile_ptr,))
    K.launch_arch("tiled_up_place", warps_grid, (256,), (*structure, tile_ptr, classes, codes, dests, quads), 0)
    return tile_ptr, codes, dests, quads


def gated_up(
    gate: TwELLParts, tile_n: int, x: Any, w_up: Any, h: TwELLParts, up: TwELLParts | None, tokens: int | None = None
) -> None:
    """Write ``u = x @ w_up.T`` at ``gate``'s stored entries (rounded to x's dtype) into ``up``'s
    values (when given) and ``h = gate * u`` (fp32 product, rounded) into ``h``'s, both in the
    gate's layout; padding slots are not written. The caller has checked :func:`applies`.
    ``tokens``: tokens per block (default :func:`block_tokens` at the plan's expected density,
    :data:`TOKENS` without one)."""
    m = gate.data.shape[0]
    n, k = w_up.shape
    if m == 0 or n == 0:
        return
    x, _ = row_stride(x)
    w_up, _ = row_stride(w_up)
    if tokens is None:
        tokens = block_tokens(n, _stationary.expected())
    t, units, parts = geometry(m, n, tokens)
    tile_ptr, codes, dests, quads = pack(gate, tile_n, n, t, units, parts)
    blocks = -(-m // t) * parts
    kept = (up.data, up.spill_data) if up is not None else (K.null_pointer(), K.null_pointer())
    box_w, box_x = box_rows(units), box_rows(t)
    maps = (tensor_map(w_up, box_w, SLICE_COLS, SWIZZLE_NONE), tensor_map(x, box_x, SLICE_COLS, SWIZZLE_NONE))
    pattern = (tile_ptr, codes, dests, quads, gate.data, gate.spill_data)
    boxes = (np.int32(k), np.int32(t), np.int32(units), np.int32(parts))
    args = (*maps, np.int32(box_w), np.int32(box_x), *pattern, *boxes, h.data, h.spill_data, *kept)
    expr = f"twell_tiled_gated_up<{K.CXX_TYPE[x.dtype]}, {int(bool(SHARED_B))}>"
    K.launch_arch(expr, (blocks,), (WARPS * 32,), args, shared_bytes())


#: Whether the gated consumer's "auto" up projection takes this kernel: ``TWELL_TILED_UP=1``
#: wherever it applies, ``=0`` never, unset (None) where W_up outgrows the L2 (see :func:`chosen`).
PREFERRED: bool | None = K.env_switch("TWELL_TILED_UP")

#: Whether the kernel loads a tile's x fragment only where the tile's quad differs from the
#: previous tile's (``TWELL_TILED_UP_SHARED_B=1``; the same sums bit for bit, a third fewer
#: shared-memory bytes at 1% density, where the kernel is near shared-memory-bound). Opt-in
#: until measured: its loads land in one register, so consecutive tiles' MMAs wait for them.
SHARED_B: bool | None = K.env_switch("TWELL_TILED_UP_SHARED_B")

#: Expected entries per (token block, unit part, quad) item round at most when the tokens per
#: block are sized from a density: three quarters of a round's room (WARPS * MAX_TILES * TILE
#: = 4096), leaving the rest for the spread of row lengths around the mean; a fuller item runs
#: a second round.
ROUND_FILL = 3072
#: The step of the token counts chosen by density (TMA boxes of 64-byte rows fill whole lines).
TOKEN_STEP = 64


def block_tokens(n: int, density: float | None) -> int:
    """Tokens per block for ``n`` units at an expected ``density`` (None: :data:`TOKENS`): the
    most, in steps of :data:`TOKEN_STEP` up to :data:`MAX_TOKENS`, whose items expect at most
    :data:`ROUND_FILL` entries. At d_ff 14336 (20 parts of 718 units), d_model 4096 and 16384
    tokens on an H100 this picks 512 at 0.5% and 384 at 1%, the fastest of 256 / 384 / 512
    there (1.24 / 1.50 / 2.04 ms at 0.5%, 2.55 / 1.79 / 2.23 at 1% for 512 / 384 / 256;
    bench/results/2026-12-06-stages.jsonl)."""
    if density is None or not density > 0:
        return TOKENS
    units = geometry(1, n)[1]
    fit = int(ROUND_FILL / (units * density)) // TOKEN_STEP * TOKEN_STEP
    return max(TOKEN_STEP, min(MAX_TOKENS, fit))


def chosen(gate: TwELLParts, x: Any, w_up: Any) -> bool:
    """Whether the gated consumer's "auto" up projection takes the tiled kernel: where it applies
    and :data:`PREFERRED` says so, or (unset) where ``w_up`` outgrows the L2, so that the row
    gathers would read each active unit's whole row from device memory once per token. Measured
    there (d_model 4096, d_ff 14336, 16384 tokens, H100): 1.23 / 1.79 ms against the gathers'
    2.41 / 4.91 at 0.5 / 1%. Where W_up fits the L2 the gathers read it at L2 speed, and the
    two were within 5% at 0.5-1% (standard widths, bench/NOTES.md), so they keep it there."""
    if PREFERRED is False:
        return False
    if PREFERRED is None and w_up.nbytes <= K.l2_bytes():
        return False
    return applies(gate, x, w_up)
