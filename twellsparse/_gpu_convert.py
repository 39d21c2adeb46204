"""GPU conversions between dense, CSR and TwELL parts (CuPy arrays, raw kernels).

Producers run the two-pass scheme of cuda/twell_convert.cu: pass 1 fills the slots and counts
each row-tile's nonzeros; the overflow policy is applied to those counts (one scalar read-back);
pass 2 runs only when entries must spill, writing them at prefix-sum offsets.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import _kernels as K
from ._backend import cupy_module
from ._parts import TwELLParts
from ._posted import PostedScalar
from ._reference import overflow_excess
from ._validation import n_tiles

_BLOCK = 256


def _cp() -> Any:
    cp = cupy_module()
    assert cp is not None
    return cp


def row_stride(x: Any) -> tuple[Any, int]:
    """``x`` with unit column stride and its row stride in elements (copying only if needed:
    other column strides, and rows that are not apart, such as a broadcast's stride 0 or a
    reversed view's negative one, which the kernels' row arithmetic cannot follow)."""
    cp = _cp()
    if not direct_rows(x):
        x = cp.ascontiguousarray(x)
    return x, leading_dim(x)


def direct_rows(x: Any) -> bool:
    """Whether kernels can address ``x`` (2-D) as rows at a fixed positive stride, each row's
    elements adjacent: unit column stride and, with several rows, a row stride of whole elements
    at least a row long. Outputs that are not are computed elsewhere and copied in."""
    rows, cols = x.shape
    item = x.itemsize
    if cols > 1 and x.strides[1] != item:
        return False
    return rows <= 1 or (x.strides[0] % item == 0 and x.strides[0] >= cols * item)


def leading_dim(x: Any) -> int:
    """The row stride in elements the kernels take for a 2-D array with unit column stride
    (never below its row length, 1 for rows of nothing), without copying it."""
    return max(x.strides[0] // x.itemsize, x.shape[1], 1)


def rows_aligned(*operands: tuple[Any, int]) -> bool:
    """Whether every (array, row stride) operand has 16-byte-aligned rows of a multiple of 16 bytes
    (what the 16-byte vector loads of the gather and stationary kernels need)."""
    for arr, ld in operands:
        size = arr.itemsize
        if (arr.shape[1] * size) % 16 or (ld * size) % 16 or arr.data.ptr % 16:
            return False
    return True


def product_operands_aligned(b: Any, out: Any, b2: Any = None) -> bool:
    """Whether a 2-byte SpMM's dense operands suit the shared-memory kernels (stationary, tiled):
    ``b``, ``out`` (and ``b2``, of b's shape) of one 2-byte dtype, with :func:`rows_aligned` rows."""
    if b.dtype.itemsize != 2 or out.dtype != b.dtype:
        return False
    if b2 is not None and (b2.dtype != b.dtype or b2.shape != b.shape):
        return False
    rows = [row_stride(b), (out, leading_dim(out))] + ([row_stride(b2)] if b2 is not None else [])
    return rows_aligned(*rows)


def two_launch_scan(n: int, sums: str, sums_args: tuple, place: str, place_head: tuple, place_tail: tuple) -> None:
    """A device scan over ``n > 0`` elements (cuda/twell_scan.cuh): kernel ``sums`` gets
    ``(*sums_args, chunk_sums)``, then kernel ``place`` gets ``(*place_head, chunk_sums,
    *place_tail)``, one block per chunk of ``K.SCAN_CHUNK`` elements each."""
    chunks = -(-n // K.SCAN_CHUNK)
    chunk_sums = _cp().empty(chunks, dtype=np.int64)
    block = (K.SCAN_THREADS,)
    K.launch_grid(sums, (chunks,), block, (*sums_args, chunk_sums))
    K.launch_grid(place, (chunks,), block, (*place_head, chunk_sums, *place_tail))


def entry_totals(row_tile_nnz: Any, capacity: int) -> Any:
    """``[entries, entries beyond capacity]`` over the row-tiles of a pack's int32 count array,
    as an int64 pair on the device (``row_tile_entry_totals``: a memset and one launch, no
    read-back)."""
    cp = _cp()
    out = cp.zeros(2, dtype=cp.int64)
    n = row_tile_nnz.size
    if n:
        args = (row_tile_nnz, np.int64(n), np.int32(capacity), out)
        K.launch_grid("row_tile_entry_totals", (-(-n // K.SCAN_CHUNK),), (K.SCAN_THREADS,), args)
    return out


def spill_layout(row_tile_nnz: Any, capacity: int, spill_capacity: int) -> tuple[Any, Any, Any, Any]:
    """:func:`twellsparse._reference.fixed_spill_layout` on the GPU in two launches
    (``spill_layout_sums``, ``spill_layout_place``), with no host read-back.

    ``row_tile_nnz`` is the producers' C-contiguous int32 (M, tiles) count array. Returns
    ``(offsets, indptr, pass_counts, left_out)`` as the reference does (offsets flattened).
    """
    cp = _cp()
    m, nt = row_tile_nnz.shape
    n = m * nt
    offsets = cp.empty(n, dtype=cp.int64)
    pass_counts = cp.empty((m, nt), dtype=cp.int32)
    left_out = cp.zeros((), dtype=cp.int64)
    if n == 0:
        return offsets, cp.zeros(m + 1, dtype=cp.int32), pass_counts, left_out
    indptr = cp.empty(m + 1, dtype=cp.int32)
    geometry = (np.int32(m), np.int32(nt), np.int32(capacity), np.int64(spill_capacity))
    outputs = (offsets, indptr, pass_counts, left_out)
    sums_args = (row_tile_nnz, np.int64(n), np.int32(capacity))
    two_launch_scan(n, "spill_layout_sums", sums_args, "spill_layout_place", (row_tile_nnz, *geometry), outputs)
    return offsets, indptr, pass_counts, left_out


def _apply_overflow(
    row_tile_nnz: Any,
    capacity: int,
    overflow: str,
    dtype: Any,
    spill_pass: Callable[..., None],
    known_excess: int | None = None,
) -> tuple[Any, Any, Any, int]:
    """Apply the policy to the per-row-tile counts; run ``spill_pass`` where entries must spill.
    ``known_excess``: the entries beyond capacity, when already read back (else counted here by
    :func:`entry_totals`, one read-back).

    Returns the spill CSR (data, indices, indptr) and the number of dropped entries.
    """
    cp = _cp()
    m = row_tile_nnz.shape[0]
    if known_excess is None:
        known_excess = int(entry_totals(row_tile_nnz, capacity)[1])
    excess = overflow_excess(row_tile_nnz, capacity, overflow, xp=cp, excess=known_excess)
    if excess == 0 or overflow == "drop":
        empty = cp.empty(0, dtype=dtype), cp.empty(0, dtype=cp.int32), cp.zeros(m + 1, dtype=cp.int32)
        return (*empty, excess)
    # A spill exactly as long as the excess: every row-tile fits, the layout is the plain one.
    offsets, indptr, _, _ = spill_layout(row_tile_nnz, capacity, excess)
    spill_data = cp.empty(excess, dtype=dtype)
    spill_indices = cp.empty(excess, dtype=cp.int32)
    spill_pass(offsets, spill_indices, spill_data)
    return spill_data, spill_indices, indptr, 0


def _static_spill(
    row_tile_nnz: Any, capacity: int, spill_capacity: int, dtype: Any, spill_pass: Callable[..., None]
) -> tuple[Any, Any, Any, Any]:
    """The spill into arrays of a fixed length, with no host read-back (CUDA-graph capturable):
    the layout of :func:`spill_layout`, then pass 2 with its counts. Returns the spill
    CSR (data and indices of length ``spill_capacity``, zero beyond ``indptr[-1]``) and the
    entries left out, a 0-d int64 array on the device."""
    cp = _cp()
    offsets, indptr, pass_counts, left_out = spill_layout(row_tile_nnz, capacity, spill_capacity)
    spill_data = cp.zeros(spill_capacity, dtype=dtype)
    spill_indices = cp.zeros(spill_capacity, dtype=cp.int32)
    spill_pass(offsets, spill_indices, spill_data, pass_counts)
    return spill_data, spill_indices, indptr, left_out


def dense_to_parts(
    x: Any, tile_n: int, capacity: int, overflow: str, threshold: float | None = None, activation: str = "identity"
) -> tuple[TwELLParts, int]:
    """Pack ``act(x)`` (entries kept if nonzero, or above the threshold); returns (parts, dropped)."""
    _, finish = dense_to_parts_deferred(x, tile_n, capacity, threshold, activation)
    return finish(overflow)


def dense_to_parts_deferred(
    x: Any, tile_n: int, capacity: int, threshold: float | None = None, activation: str = "identity"
) -> tuple[TwELLParts, Finish]:
    """Pass 1 of :func:`dense_to_parts` without waiting for its overflow check.

    Returns ``(first, finish)``: ``first`` holds each row-tile's first ``capacity`` entries and an
    empty spill (complete exactly when nothing overflowed), and ``finish(overflow)`` applies the
    policy (one scalar read-back) and returns ``(parts, dropped)`` as :func:`dense_to_parts`
    does. Work queued between the two keeps the GPU busy while the host reads the count.
    """
    x, ldx = row_stride(x)
    m, n = x.shape
    nt = n_tiles(n, tile_n)
    expr = f"dense_to_twell<{K.CXX_TYPE[x.dtype]}, {K.ACTIVATION_ID[activation]}>"
    thr = np.float64(-1.0 if threshold is None else threshold)
    vector_ok = np.int32(ldx * x.itemsize % 16 == 0 and x.data.ptr % 16 == 0 and tile_n * x.itemsize % 16 == 0)
    geometry = (np.int32(m), np.int32(n), np.int32(tile_n), np.int32(nt), np.int32(capacity), thr)
    head = (x, np.int64(ldx), vector_ok, *geometry)
    # A persistent grid: each warp strides over row-tiles, prefetching its next one.
    blocks = min(-(-m * nt * 32 // _BLOCK), K.sm_count() * 4)  # 4 resident: __launch_bounds__

    def launch(*outputs: Any) -> None:
        K.launch_grid(expr, (blocks,), (_BLOCK,), (*head, *outputs))

    return two_pass(m, nt, capacity, x.dtype, launch)


#: Largest shared-memory stage of the relu-mask pack's vector stores (bytes per block).
_STAGE_LIMIT = 32 * 1024
#: Blocks per SM of the relu-mask pack's spill pass (256 threads each: a full SM).
_SPILL_BLOCKS_PER_SM = 8


def relu_mask_to_parts_deferred(
    h: Any, mask: Any, mask_words: int, tile_n: int, capacity: int, staged: bool | None = None
) -> tuple[TwELLParts, Finish]:
    """:func:`dense_to_parts_deferred` for relu'd values ``h`` (M x N, 16-bit or float32) with
    cuBLASLt's ReLU bit-mask (``mask_words`` uint32 words per row): reads only the values whose
    bit is set. The parts equal those of packing ``h`` densely.

    ``staged``: assemble each row-tile's slots in shared memory and store them as 16-byte
    vectors (needs a capacity that is a multiple of 8); None (default) does so where it can.
    """
    h, ldh = row_stride(h)
    words = tile_n // 32
    stage_bytes = (_BLOCK // words) * capacity * (h.itemsize + 2)
    can_stage = capacity % 8 == 0 and stage_bytes <= _STAGE_LIMIT
    if staged and not can_stage:
        raise ValueError(f"staged: expected a capacity that is a multiple of 8 (a stage <= 32 KB), got {capacity}")
    staged = can_stage if staged is None else staged
    launch = _relu_mask_launch(h, ldh, mask, mask_words, tile_n, capacity, stage_bytes if staged else 0)
    return two_pass(h.shape[0], n_tiles(h.shape[1], tile_n), capacity, h.dtype, launch)


def relu_mask_spill_pass(h: Any, mask: Any, mask_words: int, tile_n: int, capacity: int) -> Callable[..., None]:
    """The relu-mask pack's launch for a producer that wrote only the overflowing row-tiles'
    values and mask words (its pass 2 reads nothing else): ``launch(data, indices, counts,
    row_tile_nnz, offsets, spill_indices, spill_data)`` with non-null spill arrays."""
    h, ldh = row_stride(h)
    return _relu_mask_launch(h, ldh, mask, mask_words, tile_n, capacity, 0)


def _relu_mask_launch(
    h: Any, ldh: int, mask: Any, mask_words: int, tile_n: int, capacity: int, stage_bytes: int
) -> Callable[..., None]:
    """``relu_mask_to_twell``'s launch over every (row-tile, mask word) for pass 1
    (``stage_bytes`` > 0 assembles its slots in that much shared memory per block), and its
    ``SPILL_PASS`` form's over the overflowing row-tiles for pass 2."""
    m, n = h.shape
    nt = n_tiles(n, tile_n)
    shape_args = (np.int32(m), np.int32(n), np.int32(tile_n), np.int32(nt), np.int32(capacity))
    head = (h, np.int64(ldh), mask, np.int64(mask_words), *shape_args, np.int32(stage_bytes > 0))
    expr = f"relu_mask_to_twell<{K.CXX_TYPE[h.dtype]}, 0>"
    spill_expr = f"relu_mask_to_twell<{K.CXX_TYPE[h.dtype]}, 1>"

    def launch(*outputs: Any) -> None:
        if K.is_null(outputs[4]):  # pass 1: a thread per (row-tile, word)
            K.launch(expr, m * nt * (tile_n // 32), _BLOCK, (*head, *outputs), shared_mem=stage_bytes)
        else:  # pass 2: a few blocks per SM striding over the row-tiles (most have nothing to spill)
            blocks = max(1, min(-(-m * nt // _BLOCK), K.sm_count() * _SPILL_BLOCKS_PER_SM))
            K.launch_grid(spill_expr, (blocks,), (_BLOCK,), (*head, *outputs))

    return launch


def two_pass(m: int, nt: int, capacity: int, dtype: Any, launch: Callable[..., None]) -> tuple[TwELLParts, Finish]:
    """Run a producer's pass 1 (``launch(data, indices, counts, row_tile_nnz, None, None, None)``)
    and return ``(first, finish)`` (:class:`Finish`)."""
    cp = _cp()
    data = cp.empty((m, nt, capacity), dtype=dtype)
    indices = cp.empty((m, nt, capacity), dtype=cp.int16)
    counts = cp.empty((m, nt), dtype=cp.int32)
    row_tile_nnz = cp.empty((m, nt), dtype=cp.int32)

    def run(offsets: Any, spill_indices: Any, spill_data: Any, nnz: Any = row_tile_nnz) -> None:
        launch(data, indices, counts, nnz, offsets, spill_indices, spill_data)

    run(K.null_pointer(), K.null_pointer(), K.null_pointer())
    empty_spill = cp.empty(0, dtype=dtype), cp.empty(0, dtype=cp.int32), cp.zeros(m + 1, dtype=cp.int32)
    first = TwELLParts(data, indices, counts, *empty_spill)
    return first, Finish(first, row_tile_nnz, capacity, dtype, run)


class Finish:
    """The second half of a two-pass producer. ``finish(overflow)`` applies the overflow policy,
    launching pass 2 with the spill offsets and arrays when entries must spill (one scalar
    read-back); ``finish("spill", spill_capacity=S)`` spills into S-long arrays without any
    read-back and returns the entries left out as a device scalar (:func:`_static_spill`).

    :meth:`count_now`, called before the caller queues more work, sends the overflow count to
    pinned host memory right behind pass 1: the exact finish then waits for the pack alone, not
    for whatever was queued after it, so the call can return while the GPU still works."""

    def __init__(self, first: TwELLParts, row_tile_nnz: Any, capacity: int, dtype: Any, run: Callable) -> None:
        self.first, self.row_tile_nnz, self.capacity, self.dtype, self.run = first, row_tile_nnz, capacity, dtype, run
        self.counted: PostedScalar | None = None
        self._totals: Any = None

    def totals(self) -> Any:
        """:func:`entry_totals` of pass 1's counts (computed once): the device pair the overflow
        count and a plan's density estimate are both read from."""
        if self._totals is None:
            self._totals = entry_totals(self.row_tile_nnz, self.capacity)
        return self._totals

    def count_now(self) -> None:
        self.counted = PostedScalar()
        self.counted.post(self.totals()[1])

    def _excess(self) -> int:
        """The entries beyond capacity: the posted count when :meth:`count_now` ran, else read
        from :meth:`totals` now."""
        value = None if self.counted is None else self.counted.value()
        return int(self.totals()[1]) if value is None else int(value)

    def __call__(self, overflow: str, spill_capacity: int | None = None) -> tuple[TwELLParts, Any]:
        head = (self.first.data, self.first.indices, self.first.counts)
        if spill_capacity is not None:  # no read-back: (parts, entries left out on the device)
            *spill, lost = _static_spill(self.row_tile_nnz, self.capacity, spill_capacity, self.dtype, self.run)
            return TwELLParts(*head, *spill), lost
        excess = self._excess()
        if excess == 0:  # nothing spills: pass 1's parts are complete, empty spill included
            return self.first, 0
        *spill, dropped = _apply_overflow(self.row_tile_nnz, self.capacity, overflow, self.dtype, self.run, excess)
        return TwELLParts(*head, *spill), dropped


def csr_to_parts(
    indptr: Any, cols: Any, vals: Any, shape: tuple[int, int], tile_n: int, capacity: int, overflow: str
) -> tuple[TwELLParts, int]:
    """Pack a canonical CSR matrix (sorted columns, no duplicates, int32 indices)."""
    cp = _cp()
    m, n = shape
    nt = n_tiles(n, tile_n)
    if int(cols.size) >= 2**31:
        raise ValueError(f"arg: expected fewer than 2**31 entries (int32 row pointers), got {int(cols.size)}")
    indptr = cp.ascontiguousarray(indptr, dtype=cp.int32)
    cols = cp.ascontiguousarray(cols, dtype=cp.int32)
    vals = cp.ascontiguousarray(vals)
    nnz = int(cols.size)
    data = cp.zeros((m, nt, capacity), dtype=vals.dtype)
    indices = cp.full((m, nt, capacity), -1, dtype=cp.int16)
    row_tile_nnz = cp.zeros((m, nt), dtype=cp.int32)
    expr = f"csr_to_twell<{K.CXX_TYPE[vals.dtype]}>"
    head = (indptr, cols, vals, np.int32(m), np.int64(nnz), np.int32(tile_n), np.int32(nt), np.int32(capacity))

    def run(offsets: Any, spill_indices: Any, spill_data: Any) -> None:
        K.launch(expr, nnz, _BLOCK, (*head, data, indices, row_tile_nnz, offsets, spill_indices, spill_data))

    run(K.null_pointer(), K.null_pointer(), K.null_pointer())
    counts = cp.minimum(row_tile_nnz, capacity).astype(cp.int32)
    *spill, dropped = _apply_overflow(row_tile_nnz, capacity, overflow, vals.dtype, run)
    return TwELLParts(data, indices, counts, *spill), dropped


def parts_to_dense(parts: TwELLParts, shape: tuple[int, int], tile_n: int, out: Any = None) -> Any:
    """Dense copy; ``out`` (zero-filled here) may be given, with unit column stride."""
    cp = _cp()
    m = shape[0]
    nt, cap = parts.data.shape[1], parts.data.shape[2]
    if out is None:
        out = cp.zeros(shape, dtype=parts.data.dtype)
    else:
        out.fill(0)
    ld = np.int64(leading_dim(out))
    t = K.CXX_TYPE[parts.data.dtype]
    K.launch(
        f"twell_scatter_dense<{t}>",
        m * nt * cap,
        _BLOCK,
        (parts.data, parts.indices, parts.counts, np.int32(m), np.int32(nt), np.int32(tile_n), np.int32(cap), out, ld),
    )
    if parts.spill_data.size:
        K.launch(
            f"spill_scatter_dense<{t}>",
            m * 32,
            _BLOCK,
            (parts.spill_indptr, parts.spill_indices, parts.spill_data, np.int32(m), out, ld),
        )
    return out


def parts_to_csr(parts: TwELLParts, shape: tuple[int, int], tile_n: int) -> tuple[Any, Any, Any]:
    """CSR arrays (data, int32 indices, int32 indptr); columns sorted when the parts are canonical."""
    cp = _cp()
    m = shape[0]
    nt, cap = parts.data.shape[1], parts.data.shape[2]
    totals = cp.empty((m, nt), dtype=cp.int32)
    spill_start = cp.empty((m, nt), dtype=cp.int32)
    K.launch(
        "twell_tile_totals",
        m * nt,
        _BLOCK,
        (
            parts.counts,
            parts.spill_indptr,
            parts.spill_indices,
            np.int32(m),
            np.int32(nt),
            np.int32(tile_n),
            totals,
            spill_start,
        ),
    )
    flat = totals.reshape(-1).astype(cp.int64)
    ends = cp.cumsum(flat)
    offsets = ends - flat
    nnz = int(ends[-1]) if ends.size else 0  # the one host read: the CSR arrays' length
    if nnz >= 2**31:
        raise ValueError(f"a: expected fewer than 2**31 entries for CSR's int32 row pointers, got {nnz}")
    indptr = cp.zeros(m + 1, dtype=cp.int32)
    if m and nt:
        indptr[1:] = ends.reshape(m, nt)[:, -1]
    cols = cp.empty(nnz, dtype=cp.int32)
    vals = cp.empty(nnz, dtype=parts.data.dtype)
    t = K.CXX_TYPE[parts.data.dtype]
    geometry = (np.int32(m), np.int32(nt), np.int32(tile_n))
    K.launch(
        f"twell_slots_to_csr<{t}>",
        m * nt * cap,
        _BLOCK,
        (parts.data, parts.indices, parts.counts, offsets, *geometry, np.int32(cap), cols, vals),
    )
    if parts.spill_data.size:
        K.launch(
            f"twell_spill_to_csr<{t}>",
            int(parts.spill_data.size),
            _BLOCK,
            (
                parts.spill_indptr,
                parts.spill_indices,
                parts.spill_data,
                parts.counts,
                spill_start,
                offsets,
                *geometry,
                cols,
                vals,
            ),
        )
    return vals, cols, indptr


def _segment_slots() -> int:
    value = os.environ.get("TWELL_TRANSPOSED_SEGMENTS", "") or "2048"
    if not value.isdigit() or int(value) >= 2**20:
        raise ValueError(f"TWELL_TRANSPOSED_SEGMENTS: expected a slot count from 0 to 2**20 - 1, got {value!r}")
    return int(value)


#: Runs (partial rows) into which the transposed products may cut their long rows
#: (:class:`SegmentPlan`); 0 leaves every row whole. A row of ``A.T`` is a unit's list of
#: tokens, and it is one warp's work: on the skewed pattern a hot unit fires for ~11% of the
#: tokens at 0.5% (1800 entries at 16384 tokens against ~80 for the mean unit), and the
#: kernel waits for that warp alone. Cut, the three transposed products of the gated backward
#: on that pattern took 1.8 / 2.2 / 2.4x less time at 0.5 / 1 / 2% and the captured training
#: step went from 0.70x to 1.04x dense at 1% (H100, bench/NOTES.md, thirty-fifth session); on
#: the uniform pattern, where no row is cut, they were 3-6% slower (not the grid's idle slot
#: warps, thirty-sixth session; the step the same within 0.03x). ``TWELL_TRANSPOSED_SEGMENTS=N`` at import sets
#: the slot count (0 turns the cut off); each slot holds K fp32 partial sums per product during
#: a call (2048 slots: 16 MB at K = 2048, twice for the paired products).
TRANSPOSED_SEGMENT_SLOTS = _segment_slots()
#: The shortest run, in entries.
SEGMENT_MIN = 256
#: A row may be cut when its unit fires for more than 1 / SEGMENT_SHARE of the tokens (and has
#: more than SEGMENT_MIN entries): the uniform pattern's rows stay whole up to ~3% density, and
#: a cut row takes at most SEGMENT_SHARE runs of the shortest length. The plan lengthens the
#: runs when they would not fit in the slots (:func:`twellsparse._reference.segment_plan`).
SEGMENT_SHARE = 32


def segment_length(m: int) -> int:
    """The shortest run of a cut row of ``A.T``, in entries, for an ``A`` of ``m`` rows (tokens)."""
    return max(SEGMENT_MIN, -(-m // SEGMENT_SHARE))


class SegmentPlan(NamedTuple):
    """Where the transposed products cut the long rows of ``A.T`` (``twell_segment_plan`` in
    cuda/twell_convert.cu; :func:`twellsparse._reference.segment_plan` is its oracle): each
    row's first slot or -1 (``split_base``, int32), each slot's row or -1 (``slot_row``, int32),
    the slot count, and on the device the run length in entries the plan chose (``run_length``,
    one int32). Built on the device from the row pointers, no read-back."""

    split_base: Any
    slot_row: Any
    slots: int
    run_length: Any


class TransposedPattern(NamedTuple):
    """The structure of ``A.T`` in CSR for a TwELL pattern, whatever its values: int32 row
    pointers, the token of each entry, and each entry's source, its position in A's slots
    followed by its spill (``n_slots`` of them), through which the products read the values of
    any matrix of this structure. ``rows`` and ``sources`` have room for every slot and spill
    entry; the first ``indptr[-1]`` are used (the count stays on the device). ``segments``: the
    cut of the long rows, or None."""

    indptr: Any
    rows: Any
    sources: Any
    n_slots: int
    segments: SegmentPlan | None = None


def transposed_pattern(parts: TwELLParts, tile_n: int, n_cols: int, slots: int | None = None) -> TransposedPattern:
    """The CSR structure of ``A.T`` (N x M) by the counting sort of ``cuda/twell_convert.cu``:
    each column's tokens increasing, no host read, so it can run inside a CUDA-graph capture.

    The arrays are sized for the most entries the parts can hold (every slot plus the spill's
    length), 8 bytes each, and the sort's work arrays take 1 bit and 4 bytes per (column,
    32-row block): no count is read back to size them. ``slots``: runs for the long rows'
    :class:`SegmentPlan` (default :data:`TRANSPOSED_SEGMENT_SLOTS`; 0, none)."""
    slots = TRANSPOSED_SEGMENT_SLOTS if slots is None else slots
    if isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots < 2**20:
        raise ValueError(f"slots: expected an integer from 0 to 2**20 - 1, got {slots!r}")
    cp = _cp()
    m, nt, cap = parts.data.shape
    n_slots = m * nt * cap
    room = n_slots + int(parts.spill_data.shape[0])
    if room >= 2**31:
        raise ValueError(
            f"A: expected fewer than 2**31 slots and spill entries for a transposed product, got {room} "
            f"({m} rows x {nt} tiles x capacity {cap}); split the rows into several calls"
        )
    n_blocks = -(-m // 32)
    items = m * nt + int(parts.spill_data.shape[0])  # a thread per row-tile, then per spill entry
    structure = (
        parts.indices,
        parts.counts,
        parts.spill_indptr,
        parts.spill_indices,
        np.int32(m),
        np.int32(nt),
        np.int32(tile_n),
        np.int32(cap),
        np.int64(items),
        np.int32(n_blocks),
    )
    bits = cp.zeros(n_cols * n_blocks, dtype=cp.uint32)
    K.launch("twell_transpose_mark", items, _BLOCK, (*structure, bits))
    first = cp.empty(bits.size, dtype=cp.int32)  # each (column, block)'s first position
    if bits.size:
        indptr = cp.empty(n_cols + 1, dtype=cp.int32)
        words = (bits, np.int64(bits.size))
        head = (*words, np.int32(n_blocks), np.int32(n_cols))
        two_launch_scan(bits.size, "twell_transpose_sums", words, "twell_transpose_first", head, (first, indptr))
    else:
        indptr = cp.zeros(n_cols + 1, dtype=cp.int32)
    rows = cp.empty(room, dtype=cp.int32)
    sources = cp.empty(room, dtype=cp.int32)
    K.launch("twell_transpose_place", items, _BLOCK, (*structure, bits, first, rows, sources))
    segments = None
    if slots and n_cols:
        split_base = cp.empty(n_cols, dtype=cp.int32)
        slot_row = cp.empty(slots, dtype=cp.int32)
        run_length = cp.empty(1, dtype=cp.int32)
        shortest = np.int32(segment_length(m))
        plan_args = (indptr, np.int32(n_cols), shortest, np.int32(slots), split_base, slot_row, run_length)
        K.launch_grid("twell_segment_plan", (1,), (K.SCAN_THREADS,), plan_args)
        segments = SegmentPlan(split_base, slot_row, slots, run_length)
    return TransposedPattern(indptr, rows, sources, n_slots, segments)
