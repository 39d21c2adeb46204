"""The tiled SpMM on the tensor cores (``cuda/twell_tiled_spmm.cu``): ``out = A @ b`` (or
``A @ b + A2 @ b2``, A2 of A's structure) for a TwELL ``A`` and 2-byte row-major ``b``, in blocks
of 512 output rows x 64 columns whose fp32 sums stay in registers while b's rows stream
through shared memory in chunks of 512 (TMA), instead of one row of b read from L2 per entry.

A is first packed on the device (four launches, no host read, so the pair runs inside a CUDA
graph capture) into k-groups of 16 words per (8 output rows, chunk), and each product first
builds the MMA's one-hot operands of its words (:func:`fragments`). :func:`applies` says
whether the kernel serves the operands, :func:`spmm` runs it. Opt-in (``TWELL_TILED_SPMM=1`` or
``_gpu_ops.spmm(..., path="tiled")``): on the H200 it is still slower than the stationary kernel with
its pack (bench/NOTES.md, twenty-sixth session; the twenty-seventh session's changes to its
inner loop are not yet measured). A documented
detail: inside the MMA an Inf or NaN in a row of b that an entry uses would reach the other 7
rows of that entry's group of 8 as NaN (0 x Inf); the product flags the rows whose sums are
not finite and a second launch recomputes them exactly, so the results are the other paths'.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _kernels as K
from ._gpu_convert import leading_dim, product_operands_aligned, row_stride, two_launch_scan
from ._parts import TwELLParts
from ._tensor_map import SWIZZLE_128B, tensor_map

#: Output rows and columns per block (TSPMM_ROWS, TSPMM_COLS), rows per group (TSPMM_GROUP).
ROWS = 512
COLS = 64
GROUP = 8
#: b's rows per staged chunk (TSPMM_CHUNK) and per TMA box (TSPMM_BOX).
CHUNK = 512
BOX = 256
#: A padding word's place in :attr:`Pack.dests` (TSPMM_PAD), and its mark in the word
#: (TSPMM_PAD_BIT: bit 15, which the products ignore).
PAD = -(2**31)
PAD_BIT = 1 << 15
#: A word: value bits << 16 | the padding mark | row in group << ROW_SHIFT | the B row field
#: (bits 0-11: B row in chunk << 3 | B row % 8, the kernel's swizzled address; cuda/twell_tiled.cuh).
ROW_SHIFT = 12


def word_rows(words: Any) -> Any:
    """The rows in group of an array of words (NumPy or CuPy)."""
    return (words >> ROW_SHIFT) & 7


def word_b_rows(words: Any) -> Any:
    """The B rows in chunk (the operand's columns within their chunk) of an array of words."""
    return (words & 0xFFF) >> 3


def word(value_bits: int, row: int, b_row: int) -> int:
    """One word (the pack's ``tspmm_word``)."""
    return value_bits << 16 | row << ROW_SHIFT | b_row << 3 | b_row & 7


#: Words per k-group (TSPMM_KGROUP).
KGROUP = 16


def _warps() -> int:
    return int(K.env_choice("TWELL_TILED_WARPS", ("16", "32"), "16"))


#: Warps per block of the product (its template argument): 16 warps of 4 row groups (128
#: registers a thread), or 32 of 2 (64 registers, twice the warps to hide latency);
#: ``TWELL_TILED_WARPS`` picks. 16 by default: with the prefetched operand it was the fastest
#: of the six pairs on an H100 (bench/NOTES.md, thirty-first session).
WARPS = _warps()


def _operand() -> str:
    return K.env_choice("TWELL_TILED_OPERAND", OPERANDS, "prefetched")


#: The product's operand choices (see :data:`OPERAND`).
OPERANDS = tuple(K.TILED_OPERANDS)
#: Where the product's MMAs take their one-hot operand: ``"fragments"`` (:func:`fragments`, one
#: pass per words array, then two loads a k-group; ~35 instructions a k-group, about 4x the
#: words' bytes from L2), ``"shuffles"`` (each lane builds it from four shuffled words; ~45
#: instructions, no extra bytes), or ``"prefetched"`` (shuffles, with each chunk's words pulled
#: into L1 during the chunk before: the word loads stalled the warps on L2, bench/NOTES.md,
#: thirtieth session; the default, 0.412 ms at 1% on the standard problem against 0.556 for
#: fragments and 0.471 for shuffles, thirty-first session). ``TWELL_TILED_OPERAND`` picks.
OPERAND = _operand()
#: Dynamic shared memory of one block (TSPMM_SHARED_BYTES): three 64 KB stages, their barriers
#: and 1 KB of alignment slack.
SHARED_BYTES = 1024 + 3 * CHUNK * COLS * 2 + 6 * 8


class Pack(NamedTuple):
    """A sparse operand as the kernel's k-groups: ``kg_ptr`` (int32, one more than the items,
    item = group * n_chunks + chunk) and ``words`` (a tuple of uint32 arrays, one per value
    array of the structure, all with the same positions: 16 words per k-group, the first
    ``kg_ptr[-1] * 16`` written); ``n_chunks``: chunks of 512 columns of the operand."""

    kg_ptr: Any
    words: tuple[Any, ...]
    n_chunks: int
    #: int32, each word's place in A's parts (slot index, ~spill index, or PAD for padding),
    #: when the pack was asked for it (the one-pack FFN kernels write values there).
    dests: Any = None


def _cp() -> Any:
    import cupy

    return cupy


def applies(b: Any, out: Any, b2: Any = None) -> bool:
    """Whether the kernel serves ``A @ b -> out`` (``+ A2 @ b2`` when ``b2`` is given) on the
    current device: 2-byte values of one dtype, 16-byte-aligned rows of a multiple of 16 bytes
    (TMA's rules and the output's 4-byte pairs), a compute-capability 9.0 GPU (the kernel is
    built for sm_90a only) with room for its shared memory."""
    if not product_operands_aligned(b, out, b2):
        return False
    if not K.runs_here("twell_tiled_spmm.cu"):
        return False
    return SHARED_BYTES <= K.device_attribute("MaxSharedMemoryPerBlockOptin")


def _packed(
    count: tuple[str, tuple, tuple, tuple],
    place: tuple[str, tuple, tuple, tuple],
    rows: int,
    cols: int,
    values: list[tuple[Any, Any]],
    stored: int,
    dests: bool = False,
) -> Pack:
    """A pack of an operand of ``rows`` x ``cols`` (items: groups of 8 rows x chunks of 512
    columns) with up to three value arrays of one structure (``(data, spill)`` pairs): the count
    kernel, the two-launch scan, the place kernel. ``count`` and ``place``: (kernel, grid, block,
    leading arguments); the count kernel then gets ``n_chunks, [items,] sizes``, the place kernel
    ``n_chunks, [items,] kg_ptr``, the value arrays, the word arrays and the places (``dests``:
    each word's place in the parts). ``stored``: the most entries the structure can hold."""
    cp = _cp()
    if stored >= 2**31:
        raise ValueError(f"A: expected fewer than 2**31 slots and spill entries for the tiled SpMM, got {stored}")
    n_chunks = -(-cols // CHUNK)
    items = -(-rows // GROUP) * n_chunks
    kg_ptr = cp.empty(items + 1, dtype=cp.int32) if items else cp.zeros(1, dtype=cp.int32)  # the scan writes all
    size = stored + (KGROUP - 1) * items
    if size >= 2**31:  # the product addresses words and fragments (2 per word) by 32-bit offsets
        raise ValueError(f"A: expected fewer than 2**31 words in the tiled SpMM's pack, got {size}")
    words = tuple(cp.empty(size, dtype=cp.uint32) for _ in values)
    places = cp.empty(size, dtype=cp.int32) if dests else None
    if items == 0:
        return Pack(kg_ptr, words, n_chunks, places)
    sizes = cp.empty(items, dtype=cp.int32)
    name, grid, block, head = count
    K.launch_arch(name, grid, block, (*head, np.int32(n_chunks), *_items(name, items), sizes), 0)
    scan = (sizes, np.int64(items))
    two_launch_scan(items, "stationary_row_sums", scan, "stationary_row_place", scan, (kg_ptr,))
    null = K.null_pointer()
    arrays = [a for pair in values for a in pair] + [null, null] * (3 - len(values))
    outs = list(words) + [null] * (3 - len(values))
    where = places if places is not None else null
    name, grid, block, head = place
    args = (*head, np.int32(n_chunks), *_items(name, items), kg_ptr, *arrays, *outs, where)
    K.launch_arch(name, grid, block, args, 0)
    return Pack(kg_ptr, words, n_chunks, places)


def _items(kernel: str, items: int) -> tuple:
    """The item count argument of the thread-per-item pack kernels (the transposed pack's
    blocks own their items and take none)."""
    return () if kernel.endswith("_t") else (np.int64(items),)


def _value_arrays(parts: TwELLParts, others: tuple[TwELLParts, ...]) -> list[tuple[Any, Any]]:
    if len(others) > 2:
        raise ValueError(f"others: expected at most 2 value arrays besides A's, got {len(others)}")
    return [(p.data, p.spill_data) for p in (parts, *others)]


def _structure(parts: TwELLParts, tile_n: int, k: int) -> tuple:
    m, nt, cap = parts.data.shape
    arrays = (parts.indices, parts.counts, parts.spill_indptr, parts.spill_indices)
    return (*arrays, np.int32(m), np.int32(k), np.int32(nt), np.int32(tile_n), np.int32(cap))


def pack(parts: TwELLParts, tile_n: int, k: int, others: tuple[TwELLParts, ...] = (), dests: bool = False) -> Pack:
    """A's entries (a TwELL A with ``k`` columns) as the kernel's k-groups, with the words of up
    to two more matrices of A's structure (``others``, other values) at the same places, and
    with ``dests`` each word's place in A's parts. Four launches (counts, the two-launch scan,
    placement; 8 lanes per item, one per row), no host read."""
    m = parts.data.shape[0]
    stored = int(parts.data.size + parts.spill_data.size)
    structure = _structure(parts, tile_n, k)
    lanes = GROUP * -(-m // GROUP) * -(-k // CHUNK)
    grid = (-(-lanes // 256),)
    count = ("tiled_spmm_count", grid, (256,), structure)
    place = ("tiled_spmm_place", grid, (256,), structure)
    return _packed(count, place, m, k, _value_arrays(parts, others), stored, dests)


def pack_transposed(parts: TwELLParts, tile_n: int, n_cols: int, others: tuple[TwELLParts, ...] = ()) -> Pack:
    """``A.T``'s entries (A a TwELL matrix with ``n_cols`` columns) as the kernel's k-groups
    (groups of 8 columns of A, chunks of 512 tokens) straight from A's parts, in the order of
    the transpose's CSR walk, with the words of up to two more matrices of A's structure
    (``others``) at the same places: a block per 512 tokens x 512 columns marks its entries in
    shared memory, and the ranks come from popcounts (no sort, no atomics deciding an order, no
    host read)."""
    m = parts.data.shape[0]
    stored = int(parts.data.size + parts.spill_data.size)
    structure = _structure(parts, tile_n, n_cols)
    grid = (-(-n_cols // CHUNK), -(-m // CHUNK))
    count = ("tiled_spmm_count_t", grid, (CHUNK,), structure)
    place = ("tiled_spmm_place_t", grid, (CHUNK,), structure)
    return _packed(count, place, n_cols, m, _value_arrays(parts, others), stored)


def balance(packed: Pack, m: int) -> Any:
    """The row-group slots of an ``m``-row product on ``packed`` dealt by load
    (``tiled_spmm_balance``: groups ranked by their k-groups, the heaviest spread over the blocks
    first, then snaking over each block's warps in passes of :data:`WARPS`), as the int32 map
    :func:`packed_spmm` takes: every warp gets one group of each pass, so a hot group (a unit
    that fires often, in A.T) does not make its warp the block's slowest. One launch, no host
    read."""
    cp = _cp()
    n_groups = -(-m // GROUP)
    blocks = -(-n_groups // 64)
    group_map = cp.full(64 * blocks, -1, dtype=cp.int32)
    args = (packed.kg_ptr, np.int32(packed.n_chunks), np.int32(n_groups), np.int32(blocks), np.int32(WARPS), group_map)
    K.launch_arch("tiled_spmm_balance", (-(-n_groups // 256),), (256,), args, 0)
    return group_map


def fragments(packed: Pack, which: int = 0) -> Any:
    """The MMA's one-hot operands of ``packed.words[which]`` (``tiled_spmm_fragments``: two uint32
    per lane and k-group, the value of each entry where its row in group is the lane's column),
    which the product loads beside the words instead of building them in every column block. One
    launch over an upper bound of k-groups (the pack's word room / 16), no host read."""
    cp = _cp()
    words = packed.words[which]
    kgroups = max(1, words.size // KGROUP)  # at least one k-group's room: the product's branch-free loads
    frags = cp.empty(kgroups * 32 * 2, dtype=cp.uint32)
    items = packed.kg_ptr.size - 1
    if items > 0:
        args = (packed.kg_ptr, np.int64(items), words, frags)
        K.launch_arch("tiled_spmm_fragments", (-(-kgroups * 32 // 256),), (256,), args, 0)
    return frags


def packed_spmm(packed: Pack, m: int, b: Any, out: Any, b2: Any = None, which: int = 0, group_map: Any = None) -> Any:
    """``out = A @ b`` for an ``m``-row A packed by :func:`pack` or :func:`pack_transposed`
    (A's values: ``packed.words[which]``), or with ``b2`` ``out = A @ b + A2 @ b2`` (A2's words
    the next array, ``which + 1``) in the same sums; the caller has checked :func:`applies`.
    Three launches: :func:`fragments` (for each words array, with :data:`OPERAND` "fragments"),
    the product, then
    ``tiled_spmm_fixup``, which recomputes exactly the rows whose sums came out non-finite (an
    Inf or NaN in a row of b that an entry uses spreads to its group's other rows inside the
    MMA), so the results are the other paths'. ``group_map``:
    the row groups' slots (:func:`balance`), or None for the natural order."""
    b, ldb = row_stride(b)
    n = b.shape[1]
    if m == 0 or n == 0:
        return out
    if packed.n_chunks == 0:  # A has no columns
        out[...] = 0
        return out
    b2, ldb2 = row_stride(b2) if b2 is not None else (None, 0)
    map_b = tensor_map(b, BOX, COLS, SWIZZLE_128B)
    map_b2 = map_b if b2 is None else tensor_map(b2, BOX, COLS, SWIZZLE_128B)
    words2 = K.null_pointer() if b2 is None else packed.words[which + 1]
    use_fragments = OPERAND == "fragments"
    frags = fragments(packed, which) if use_fragments else K.null_pointer()
    frags2 = fragments(packed, which + 1) if use_fragments and b2 is not None else K.null_pointer()
    pattern = (packed.kg_ptr, packed.words[which], words2, np.int32(m), np.int32(n), np.int32(packed.n_chunks))
    ldo = np.int64(leading_dim(out))
    flags = _cp().zeros(m, dtype=np.int32)  # rows with a non-finite sum, for the fixup
    t = K.CXX_TYPE[b.dtype]
    # A persistent grid: one block per SM walks the tiles (column block fastest) with a ring that
    # runs on from one tile into the next.
    rows = max(m, GROUP * (group_map.size if group_map is not None else 0))
    tiles = -(-n // COLS) * -(-rows // ROWS)
    grid = (min(tiles, K.sm_count()),)
    slots = (group_map, np.int32(group_map.size)) if group_map is not None else (K.null_pointer(), np.int32(0))
    args = (map_b, map_b2, *pattern[:3], frags, frags2, *pattern[3:], out, ldo, flags, *slots)
    expr = f"twell_tiled_spmm<{t}, {WARPS}, {K.TILED_OPERANDS[OPERAND]}>"
    K.launch_arch(expr, grid, (WARPS * 32,), args, SHARED_BYTES)
    dense = (b, np.int64(ldb), b2 if b2 is not None else K.null_pointer(), np.int64(ldb2))
    K.launch_arch(f"tiled_spmm_fixup<{t}>", (-(-m // 8),), (256,), (*pattern, *dense, flags, out, ldo), 0)
    return out


def spmm(parts: TwELLParts, tile_n: int, b: Any, out: Any, second: tuple[TwELLParts, Any] | None = None) -> Any:
    """``out = A @ b`` for a TwELL ``A`` with ``b.shape[0]`` columns, or with ``second = (A2,
    b2)`` (A2 of A's structure) ``out = A @ b + A2 @ b2`` in the same sums: :func:`pack`, then
    :func:`packed_spmm`."""
    others = () if second is None else (second[0],)
    packed = pack(parts, tile_n, b.shape[0], others)
    return packed_spmm(packed, parts.data.shape[0], b, out, None if second is None else second[1])


def spmm_transposed(tile_n: int, n_cols: int, products: list[tuple[TwELLParts, Any, Any]]) -> None:
    """``out = A.T @ g`` for each ``(A, g, out)`` of ``products`` (one to three, every A of one
    structure with ``n_cols`` columns; each ``g`` (M x K) and ``out`` (n_cols x K) checked by
    :func:`applies`): one pack of the transpose with every product's words, then one launch
    each."""
    packed = pack_transposed(products[0][0], tile_n, n_cols, tuple(a for a, _, _ in products[1:]))
    group_map = balance(packed, n_cols) if BALANCE_TRANSPOSED else None
    for i, (_, g, out) in enumerate(products):
        packed_spmm(packed, n_cols, g, out, which=i, group_map=group_map)


#: Whether the transposed products deal their row groups by load (:func:`balance`): their rows
#: are units, whose firing rates are skewed in trained models.
BALANCE_TRANSPOSED = True

#: Whether ``matmul``'s "auto" path takes this kernel where it applies: only with
#: ``TWELL_TILED_SPMM=1`` (slower than the stationary kernel so far; bench/NOTES.md).
PREFERRED: bool | None = K.env_switch("TWELL_TILED_SPMM")


def chosen(b: Any, out: Any, b2: Any = None) -> bool:
    """Whether ``matmul``'s "auto" path takes the tiled kernel."""
    return bool(PREFERRED) and applies(b, out, b2)
