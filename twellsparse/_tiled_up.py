"""The tiled up projection of the gated FFN (``cuda/twell_tiled_up.cu``): ``u = x @ w_up.T`` at
the gate's pattern and ``h = gate * u``, what ``twell_gather_gated_up`` computes, with blocks of
tokens x units whose operands are staged in shared memory slice by slice instead of one whole
weight row gathered from L2 per entry.

The gate is first packed on the device (four launches, no host read, so it runs inside a CUDA
graph capture): its entries grouped per (token block, unit part, quad of tokens) into tiles of
8 in the kernel's order against bank conflicts. :func:`applies` says whether the kernel serves
the operands; :func:`gated_up` runs it, and :func:`gated_backward` runs it for the gated
backward's sampled product (dy and W_down's transpose in the places of x and W_up).
"""

from __future__ import annotations

import functools
import math
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
#: Rows of 64 bytes one of the kernel's two shared buffers stages (TILED_BUFFER_ROWS): a part's
#: W_up rows (in whole boxes), then the block's x rows right after them.
BUFFER_ROWS = 1536
#: Bytes of one of the kernel's two shared buffers (TILED_BUFFER_BYTES).
BUFFER_BYTES = BUFFER_ROWS * SLICE_COLS * 2


def _cp() -> Any:
    import cupy

    return cupy


def geometry(m: int, n: int, tokens: int | None = None) -> tuple[int, int, int]:
    """``(tokens per block, units per part, parts)`` for ``m`` tokens and ``n`` units: parts of
    about :data:`TARGET_UNITS` units (an even count, at most :data:`MAX_UNITS`), blocks of
    ``tokens`` (default :data:`TOKENS`; a multiple of :data:`QUAD`, at most :func:`max_tokens`
    beside the part's units), no more than ``m`` needs."""
    if tokens is not None and (tokens <= 0 or tokens % QUAD):
        raise ValueError(f"tokens: expected a positive multiple of {QUAD}, got {tokens}")
    parts = max(1, round(n / TARGET_UNITS), -(-n // MAX_UNITS))
    units = -(-n // parts)
    units += units % 2
    parts = -(-n // units)
    t = TOKENS if tokens is None else tokens
    t = min(t, max_tokens(units), -(-max(m, 1) // QUAD) * QUAD)
    return t, units, parts


def staged_rows(rows: int) -> int:
    """Rows a region of ``rows`` rows takes in a buffer: its :func:`box_rows` boxes, whole."""
    box = box_rows(rows)
    return -(-rows // box) * box


@functools.cache
def max_tokens(units: int) -> int:
    """The most tokens (a multiple of :data:`QUAD`) whose x rows fit in a buffer beside a part
    of ``units`` units: 824 beside the standard widths' 704 (whose boxes take 708 rows), so 816
    in :func:`block_tokens`' steps."""
    room = BUFFER_ROWS - staged_rows(units)
    t = room - room % QUAD
    while t > QUAD and staged_rows(t) > room:
        t -= QUAD
    return t


def shared_bytes() -> int:
    """Dynamic shared memory of one block (TILED_SHARED_BYTES): two buffers of
    :data:`BUFFER_BYTES` (192 KB) and two barriers for each (full and, in pairs, empty)."""
    return 2 * BUFFER_BYTES + 32


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


def pack(
    gate: TwELLParts, tile_n: int, n: int, tokens: int, units: int, parts: int, width: int | None = None
) -> tuple[Any, Any, Any, Any]:
    """The gate's entries as the kernel's tiles: (int32 tile pointers per item, uint16 codes,
    int32 destinations, int32 quad per tile). An item is a quad of tokens in one unit part of
    one token block, in the order (block, part, quad); the arrays have room for every slot and
    spill entry plus each item's padding, and the first ``tile_ptr[-1]`` tiles are written.
    ``width``: lanes per item of the pack's kernels (16 or 32, default :data:`PACK_WIDTH`; the
    same arrays either way)."""
    if width not in (None, 16, 32):
        raise ValueError(f"width: expected 16 or 32, got {width!r}")
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
    width = PACK_WIDTH if width is None else width
    warps_grid = (-(-32 * -(-items // (32 // width)) // 256),)
    K.launch_arch(f"tiled_up_count<{width}>", warps_grid, (256,), (*structure, sizes, classes), 0)
    head = (sizes, np.int64(items))
    two_launch_scan(items, "stationary_row_sums", head, "stationary_row_place", head, (tile_ptr,))
    place_args = (*structure, tile_ptr, classes, codes, dests, quads)
    K.launch_arch(f"tiled_up_place<{width}>", warps_grid, (256,), place_args, 0)
    return tile_ptr, codes, dests, quads


def gated_up(
    gate: TwELLParts, tile_n: int, x: Any, w_up: Any, h: TwELLParts, up: TwELLParts | None, tokens: int | None = None
) -> None:
    """Write ``u = x @ w_up.T`` at ``gate``'s stored entries (rounded to x's dtype) into ``up``'s
    values (when given) and ``h = gate * u`` (fp32 product, rounded) into ``h``'s, both in the
    gate's layout; padding slots are not written. The caller has checked :func:`applies`.
    ``tokens``: tokens per block (default :func:`block_tokens` at the plan's expected density,
    :data:`TOKENS` without one)."""
    null = (K.null_pointer(), K.null_pointer())
    kept = (up.data, up.spill_data) if up is not None else null
    _launch(gate, tile_n, x, w_up, (h.data, h.spill_data, *kept, *null, *null), False, tokens)


def gated_backward(
    gate: TwELLParts,
    tile_n: int,
    dy: Any,
    w_down_t: Any,
    up: TwELLParts,
    d_z: TwELLParts,
    d_u: TwELLParts,
    h: TwELLParts,
    tokens: int | None = None,
) -> None:
    """The gated backward's sampled product on the same kernel: ``d_h = dy @ w_down_t.T`` at
    ``gate``'s stored entries, rounded to dy's dtype, and from it ``d_z = d_h * u``, ``d_u = d_h *
    g`` and ``h = g * u`` (u ``up``'s values, g the gate's) written into the three parts' values
    as ``_gpu_ops.sddmm_gated_backward`` rounds them; padding slots are not written. ``w_down_t``
    is W_down's transpose ``[n, d]`` (the role of W_up); the caller has checked :func:`applies`
    with ``dy`` and ``w_down_t``. ``tokens`` as in :func:`gated_up`."""
    outputs = (h.data, h.spill_data, up.data, up.spill_data, d_z.data, d_z.spill_data, d_u.data, d_u.spill_data)
    _launch(gate, tile_n, dy, w_down_t, outputs, True, tokens)


def _launch(
    gate: TwELLParts, tile_n: int, x: Any, w: Any, outputs: tuple[Any, ...], backward: bool, tokens: int | None
) -> None:
    """Pack ``gate`` for blocks of ``tokens`` and run the kernel on ``x`` and ``w``'s rows with
    ``outputs`` (h, u, d_z, d_u values and spills; null pointers where unused)."""
    m = gate.data.shape[0]
    n, k = w.shape
    if m == 0 or n == 0:
        return
    x, _ = row_stride(x)
    w, _ = row_stride(w)
    if tokens is None:
        tokens = block_tokens(m, n, _stationary.expected(), K.sm_count())
    t, units, parts = geometry(m, n, tokens)
    tile_ptr, codes, dests, quads = pack(gate, tile_n, n, t, units, parts)
    # Pairs: an even count of parts per token block (a pad part past an odd count copies only
    # its share of x), so that each cluster of two consecutive blocks shares one token block.
    grid_parts = parts + parts % 2 if PAIRS else parts
    blocks = -(-m // t) * grid_parts
    box_w, box_x = box_rows(units), box_rows(t)
    maps = (tensor_map(w, box_w, SLICE_COLS, SWIZZLE_NONE), tensor_map(x, box_x, SLICE_COLS, SWIZZLE_NONE))
    pattern = (tile_ptr, codes, dests, quads, gate.data, gate.spill_data)
    boxes = (np.int32(k), np.int32(t), np.int32(units), np.int32(parts))
    args = (*maps, np.int32(box_w), np.int32(box_x), *pattern, *boxes, *outputs)
    kernel = "twell_tiled_gated_up_pair" if PAIRS else "twell_tiled_gated_up"
    expr = f"{kernel}<{K.CXX_TYPE[x.dtype]}, {int(SHARED_B)}, {int(backward)}>"
    K.launch_arch(expr, (blocks,), (WARPS * 32,), args, shared_bytes())


#: Whether the gated consumer's "auto" up projection takes this kernel: ``TWELL_TILED_UP=1``
#: wherever it applies, ``=0`` never, unset (None) where W_up outgrows the L2 (see :func:`chosen`).
PREFERRED: bool | None = K.env_switch("TWELL_TILED_UP")

#: Whether the kernel loads a tile's x fragment only where the tile's quad differs from the
#: previous tile's (the same sums bit for bit, a third fewer shared-memory bytes at 1% density,
#: where the kernel is near shared-memory-bound). On by default since the forty-first session:
#: 0-4% faster than the per-tile loads at 0.5-2%, never slower by more than 1% (H100, standard
#: and d_model 4096 widths, bench/results/2026-12-06-stages.jsonl); ``TWELL_TILED_UP_SHARED_B=0``
#: loads x per tile.
SHARED_B: bool = K.env_switch("TWELL_TILED_UP_SHARED_B") is not False


#: Whether the kernel runs in clusters of two blocks (consecutive unit parts of one token
#: block) that share x's slices by TMA multicast (``TWELL_TILED_UP_PAIRS=1``, opt-in): a
#: quarter less L2 traffic, but measured 2-5% slower than the single blocks on an H100 (1.91
#: against 1.87 ms forward, 2.20 against 2.09 backward at 131072 tokens, 0.5%): the single
#: blocks are bound neither by the L2 nor by the copy engine there, but by the latency of their
#: tiles' shared loads and MMAs (bench/NOTES.md, forty-fourth session, item 5; forty-fifth,
#: items 2 and 3).
PAIRS: bool = K.env_switch("TWELL_TILED_UP_PAIRS") is True


def _pack_width() -> int:
    return int(K.env_choice("TWELL_TILED_UP_PACK_WIDTH", ("16", "32"), "16"))


#: Lanes per item of the pack's kernels: 16 (two items a warp; an item of the standard widths
#: has at most 16 (token, tile) pairs, and the kernels are bound by each item's chain of L2
#: loads, so half the warps take about half the time) or 32 (one item a warp, the form before
#: the forty-third session); ``TWELL_TILED_UP_PACK_WIDTH`` picks. The packs are the same.
PACK_WIDTH = _pack_width()

#: The step of the token counts chosen by density: a multiple of :data:`QUAD` whose boxes have an
#: even row count (:func:`box_rows`). 16 since the forty-fifth session (64 before): at 131072
#: tokens and 0.5% on the standard widths, 800-token blocks run 10 waves of 8 parts where 768 run
#: 11, 1.77 against 1.86 ms (H100); at 16384 tokens and 1%, 336 tokens 0.417 against 384's 0.436.
TOKEN_STEP = 16
#: A round's cost beyond its staged rows, in staged rows: what a block pays once a round however
#: many rows it stages (its ring's first slices landing with nothing to sum, the tiles' setup, the
#: epilogue). Fitted to the block sizes measured in the forty-fifth session (bench/NOTES.md): with
#: it the cost model orders all 69 pairs of them that differ by more than 2% (16384 and 131072
#: tokens, 0.5-2%), without it it misorders two (at 16384 tokens and 2%, 208 tokens in five waves of one
#: round took 0.693 ms against 512's 0.673 in two waves of two rounds); any value from 384 to 1024
#: orders them all. Of the 241 such pairs measured in the forty-first and forty-second sessions it
#: misorders 23 (20 without it), none moving a pick beyond 5% of the fastest (tests).
ROUND_FIXED_ROWS = 512
#: Entries a block's round holds (WARPS * MAX_TILES tiles of TILE).
ROUND_ENTRIES = WARPS * MAX_TILES * TILE
#: Standard deviations of a block's entries kept free of a round's room: a block whose entries
#: overrun it runs a second round, restaging all of its rows. Fitted to the measured block sizes
#: (bench/NOTES.md, forty-first session): a block expecting 3830 entries and pads (256 tokens
#: at 2%, standard widths) already took about as long as two rounds.
ROUND_MARGIN_SIGMAS = 4.5
#: Density from which the gated consumer's "auto" up projection takes the tiled kernel even
#: where W_up fits the L2 (a plan's estimate), for at least :data:`IN_L2_MIN_TOKENS` tokens (see
#: :func:`chosen`).
IN_L2_MIN_DENSITY = 0.0075
#: Tokens from which the density rule applies: at 4096 tokens of the standard widths a gated
#: plan's calls are host-bound (0.41 ms of host a call on the row gathers, 0.40 ms of GPU time),
#: and the pack's launches and allocations add to that: at 0.75% the block took 0.58 ms a call
#: eager with the tiled kernel against 0.42 on the gathers (H100, forty-first session).
IN_L2_MIN_TOKENS = 16384
#: The same rule's density from :data:`LARGE_CALL_TOKENS` tokens: 768-token blocks there beat the
#: gathers at 0.5% (131072 tokens, standard widths: 1.97 against 2.14 ms, H100, forty-second
#: session; at 16384 tokens both took 0.30 ms), 5% under it so that a 0.5% estimate takes it.
LARGE_CALL_MIN_DENSITY = 0.0045
#: Tokens from which :data:`LARGE_CALL_MIN_DENSITY` applies (the measured 131072: a decoder
#: batch of 64 x 2048; between 16384 and it the lower density was not measured).
LARGE_CALL_TOKENS = 131072
#: The backward's sampled product (:func:`gated_backward`, the fused row gathers' work: three
#: values written and u read per entry) takes the tiled kernel from this density where W_down's
#: transpose fits the L2, for at least :data:`IN_L2_MIN_TOKENS` tokens: 0.324 / 0.487 / 0.706
#: ms with its pack against the gathers' 0.412 / 0.622 / 1.090 at 0.5 / 1 / 2% (16384 tokens,
#: standard widths, H100, forty-second session); 5% under the lowest measured.
BACKWARD_MIN_DENSITY = 0.0045


def expected_rounds(tokens: int, units: int, density: float) -> int:
    """Rounds a block of ``tokens`` x ``units`` expects at ``density``: its entries, each quad's
    padding to whole tiles (3.5 entries on average) and :data:`ROUND_MARGIN_SIGMAS` standard
    deviations of the entries (Poisson), over a round's :data:`ROUND_ENTRIES`."""
    entries = tokens * units * density
    load = entries + (tokens // QUAD) * (TILE - 1) / 2 + ROUND_MARGIN_SIGMAS * math.sqrt(entries)
    return max(1, math.ceil(load / ROUND_ENTRIES))


def block_tokens(m: int, n: int, density: float | None, sms: int, most: int | None = None) -> int:
    """Tokens per block for ``m`` tokens and ``n`` units at an expected ``density`` (None:
    :data:`TOKENS`) on ``sms`` multiprocessors: the count, in steps of :data:`TOKEN_STEP` up to
    :func:`max_tokens`, with the lowest :func:`block_cost`, ties to the larger block.

    This matched the order of every measured block size (192-512 tokens at 0.5-2%, 16384
    tokens, standard and d_model 4096 widths, H100; bench/NOTES.md, forty-first session), where
    the earlier rule (the most tokens expecting 3072 entries at most) picked 192 at 2% on the
    standard widths (0.806 ms against 0.705 for 512: two waves of two rounds stage fewer rows
    than six waves of one); and the order of 384-768 token blocks at 16384 and 131072 tokens on
    the standard widths (forty-second session: 768 at 131072 tokens and 0.5%, 8% faster than 512;
    larger blocks than 512 are not measured at d_model 4096); and, in steps of 16 with the
    round's fixed cost (forty-fifth session), the order of every pair of the 192-800 token
    blocks measured then at 16384 and 131072 tokens, 0.5-2% (800 at 131072 tokens and 0.5%, 4%
    faster than 768).
    ``most``: a lower cap on the count.

    The search (~100 us of host time a call, 51 sizes) is cached per shape and per density to three
    significant digits: the count is a step function of the density, and the estimate moves
    from call to call by less than that."""
    if density is None or not density > 0:
        return TOKENS
    return _searched_block_tokens(m, n, float(f"{density:.3g}"), sms, most)


@functools.lru_cache(maxsize=256)
def _searched_block_tokens(m: int, n: int, density: float, sms: int, most: int | None) -> int:
    """:func:`block_tokens`' search (a positive ``density``)."""
    units = geometry(1, n)[1]
    top = min(max_tokens(units), -(-max(m, 1) // TOKEN_STEP) * TOKEN_STEP)
    if most is not None:
        top = min(top, most)
    best, best_cost = TOKEN_STEP, math.inf
    for tokens in range(TOKEN_STEP, top + 1, TOKEN_STEP):
        cost = block_cost(m, n, density, tokens, sms)
        if cost <= best_cost:
            best, best_cost = tokens, cost
    return best


def block_cost(m: int, n: int, density: float, tokens: int, sms: int) -> float:
    """The cost model of :func:`block_tokens`: rows staged on the busiest multiprocessor with
    blocks of ``tokens``. A block runs alone on its SM (its buffers fill the shared memory),
    streams its ``units + tokens`` rows once a round (:func:`expected_rounds`) and pays
    :data:`ROUND_FIXED_ROWS` a round; the blocks run in waves of ``sms``. So the cost is
    ``waves x rounds x (units + tokens + ROUND_FIXED_ROWS)``."""
    units, parts = geometry(1, n)[1:]
    waves = -(-(-(-m // tokens) * parts) // max(sms, 1))
    return waves * expected_rounds(tokens, units, density) * (units + tokens + ROUND_FIXED_ROWS)


def chosen(gate: TwELLParts, x: Any, w_up: Any, backward: bool = False) -> bool:
    """Whether the gated consumer's "auto" up projection (``backward``: the gated backward's
    sampled product, ``w_up`` then W_down's transpose) takes the tiled kernel, where it applies:
    as :data:`PREFERRED` says when set; unset, where ``w_up`` outgrows the L2 (the row gathers
    would read each active unit's whole row from device memory once per entry) or where the
    plan's density estimate (``_stationary.expected()``) is at least :data:`IN_L2_MIN_DENSITY`
    (:data:`LARGE_CALL_MIN_DENSITY` from :data:`LARGE_CALL_TOKENS` tokens;
    :data:`BACKWARD_MIN_DENSITY` for the backward) for at least :data:`IN_L2_MIN_TOKENS` tokens.

    Measured (16384 tokens, H100, gpu-only ms; bench/NOTES.md, fortieth and forty-first
    sessions): at d_model 4096 / d_ff 14336 the tiled kernel took 1.22 / 1.74 ms against the
    gathers' 2.41 / 4.91 at 0.5 / 1%; at the standard widths, where W_up fits the L2, 0.302 /
    0.453 / 0.705 against 0.304 / 0.519 / 0.982 at 0.5 / 1 / 2% (the H200 had given 0.288 / 0.443
    / 0.706 against 0.277 / 0.457 / 0.855), so the gathers keep the lower densities there and
    the calls without an estimate."""
    if PREFERRED is False:
        return False
    if PREFERRED is None and w_up.nbytes <= K.l2_bytes():
        density, m = _stationary.expected(), gate.data.shape[0]
        if density is None or m < IN_L2_MIN_TOKENS:
            return False
        if backward:
            least = BACKWARD_MIN_DENSITY
        else:
            least = LARGE_CALL_MIN_DENSITY if m >= LARGE_CALL_TOKENS else IN_L2_MIN_DENSITY
        if density < least:
            return False
    return applies(gate, x, w_up)
