"""The weight-stationary SpMM (``cuda/twell_stationary.cu``): ``out = A @ B`` with a 16-column
slice of all of B held in one block's shared memory while A's entries stream past it.

It serves 2-byte value types when a slice of B and four zero rows fit in shared memory
(``(N + 4) * 32`` bytes), or, given A's row-tile width, when A's columns can be cut into at most
:data:`MAX_BANDS` bands of whole row-tiles whose slices fit (a tall B such as the down projection
of d_ff 14336: one launch per band, the sums carried in an fp32 workspace and rounded once);
:func:`applies` says whether it does. A TwELL matrix is first packed on the device (no
host read, so it runs inside a CUDA-graph capture): each row's entries as 32-bit words, padded
to a multiple of :data:`BATCH`, in an order that spares the kernel's shared-memory reads most
bank conflicts (the kernel file's header says how).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _kernels as K
from ._gpu_convert import leading_dim, product_operands_aligned, row_stride, two_launch_scan
from ._parts import TwELLParts

#: Output columns per block (STATIONARY_COLS in the kernel).
SLICE_COLS = 16
#: Words per group and step (STATIONARY_BATCH): each packed row is padded to a multiple.
BATCH = 8
#: Zero rows after B's in the slice (STATIONARY_ZERO_ROWS): padding words point at them.
ZERO_ROWS = 4
#: Threads per block (STATIONARY_WARPS warps of 32).
THREADS = 1024
#: Fewest rows of A for which ``matmul`` takes this kernel when nothing says how dense A is:
#: every block stages its slice of all of B and reads all of A, a fixed cost that the row
#: gathers do not pay, so it pays off only with many rows. Measured on the H200 with the
#: standard widths (bench/results/2026-12-04-down-choice.jsonl, bench/down_choice.py, with the
#: pack's slot-class order of the twenty-first session): at 16384 rows it wins from 0.5%
#: density (0.227 / 0.238 ms at 0.5%, 0.365 / 0.445 at 1%, 0.621 / 0.859 at 2%) and loses by
#: 14% at 0.25% (0.157 / 0.138); at 65536 rows it wins from 0.25%; at 8192 and 4096 rows it
#: loses at 0.5% and wins from 1%.
MIN_ROWS = 16384
#: Entries per row of A from which the kernel beats the row gathers, at 16384 rows of A and
#: 2048 columns of B, when the caller says how dense A is (:func:`expected_density`). The same
#: data put the crossing (linear between the measured densities) near 23 entries per row at
#: 16384 rows, 33 at 8192 and 45 at 4096 (it falls as the square root of the rows: the fixed
#: cost is paid once per call); at 65536 rows the kernel already wins at 14 (0.25%). The
#: scaling by columns (the gathers' rows are longer) is from the eleventh session's 4096-column
#: runs, not measured again.
BREAKEVEN_ENTRIES = 23.0
#: How much further up the break-even lies in column bands (each band's pack, the fp32
#: workspace's round trip): at d_model 4096 / d_ff 14336 and 4096 rows (H100, efd949b,
#: bench/results/2026-12-06-down-choice.jsonl) the gathers won at 0.25% (0.235 against 0.318
#: ms with the pack) and lost at 0.5% (0.478 / 0.418): a crossing near 57 entries per row
#: against :func:`breakeven_entries`' 23 there. At 16384 and 65536 rows the bands won from
#: 0.25% (36 entries), which the factor keeps (29 and 14 entries).
BANDED_BREAKEVEN_FACTOR = 2.5
#: Most column bands A is cut into (:func:`band_tiles`): each band after the first reads and
#: writes the fp32 workspace (8 bytes per output element), a cost that grows with the bands.
MAX_BANDS = 4


def _pack_width() -> int:
    """``TWELL_STATIONARY_PACK_WIDTH`` (16 or 32; unset: 32), read once at import."""
    return int(K.env_choice("TWELL_STATIONARY_PACK_WIDTH", ("16", "32"), "32"))


#: Lanes per row of the pack's kernel (``TWELL_STATIONARY_PACK_WIDTH``): 32 (one row a warp) or
#: 16 (two rows a warp, one on each half; a warp whose rows do not both fit half its staging
#: packs them on the whole warp in turn). The words are the same. 16 is opt-in until measured: the
#: tiled up pack's items on half-warps took 0.201 against 0.328 ms at 131072 tokens (forty-fourth
#: session), and this pack is bound the same way (each row's chain of L2 loads); the half-warp
#: form was written in the forty-fifth session and has not yet run on a GPU.
PACK_WIDTH = _pack_width()
_expected_density: contextvars.ContextVar[float | None] = contextvars.ContextVar("expected_density", default=None)
#: Whether ``matmul`` takes this kernel where it applies: True (``TWELL_STATIONARY=1``: always),
#: False (``TWELL_STATIONARY=0``: never), None (unset: from :data:`MIN_ROWS` rows on).
PREFERRED: bool | None = K.env_switch("TWELL_STATIONARY")


def _cp() -> Any:
    import cupy

    return cupy


def slice_bytes(n: int, itemsize: int) -> int:
    """Shared memory one block needs: a ``SLICE_COLS``-wide slice of every one of B's ``n`` rows
    and :data:`ZERO_ROWS` zero rows (what padding words read)."""
    return (n + ZERO_ROWS) * SLICE_COLS * itemsize


def band_tiles(n: int, tile_n: int | None, max_bytes: int) -> int | None:
    """Row-tiles of A (``tile_n`` columns each) per column band so that a band's slice fits
    ``max_bytes`` of shared memory: all of A's tiles (one band) when the whole slice fits, else
    the most whole tiles that fit; None when no band fits, bands are not allowed (``tile_n``
    None) or more than :data:`MAX_BANDS` would be needed."""
    n_tiles = -(-n // tile_n) if tile_n else 0
    if slice_bytes(n, 2) <= max_bytes and n + ZERO_ROWS <= 1 << 16:
        return max(n_tiles, 1)
    if not tile_n:
        return None
    per_band = (max_bytes // (SLICE_COLS * 2) - ZERO_ROWS) // tile_n
    if per_band < 1 or -(-n_tiles // per_band) > MAX_BANDS:
        return None
    return per_band


def _max_slice_bytes() -> int:
    """The shared memory one block may hold on the current device (the tests lower it to force
    column bands at small sizes)."""
    return int(K.device_attribute("MaxSharedMemoryPerBlockOptin"))


def applies(n: int, b: Any, out: Any, b2: Any = None, tile_n: int | None = None) -> bool:
    """Whether the stationary kernel serves ``(M x n) @ b -> out`` (``+ (M x n) @ b2``, the dual
    form, when ``b2`` is given) on the current device, in one band or (given A's ``tile_n``) in
    column bands; not for a ``b`` without columns (nothing to compute, and no slice to spread
    over the machine)."""
    if b.shape[1] == 0 or not product_operands_aligned(b, out, b2):
        return False
    return band_tiles(n, tile_n, _max_slice_bytes()) is not None


@contextlib.contextmanager
def expected_density(density: float) -> Iterator[None]:
    """Within the block, ``matmul``'s "auto" choice takes A's density to be about ``density``
    (a plan's estimate, see :func:`breakeven_entries`); a NaN leaves the rule by rows alone."""
    token = _expected_density.set(density if math.isfinite(density) else None)
    try:
        yield
    finally:
        _expected_density.reset(token)


def expected() -> float | None:
    """The density set by the innermost :func:`expected_density` block, or None."""
    return _expected_density.get()


def breakeven_entries(m: int, k: int) -> float:
    """Entries per row of an ``m``-row A above which the kernel beats the row gathers for a B
    of ``k`` columns (:data:`BREAKEVEN_ENTRIES` scaled by sqrt(16384 / m) and 2048 / k)."""
    return BREAKEVEN_ENTRIES * math.sqrt(16384 / max(m, 1)) * (2048 / max(k, 1))


def chosen(m: int, n: int, b: Any, out: Any, b2: Any = None, tile_n: int | None = None) -> bool:
    """Whether ``matmul``'s "auto" path takes the stationary kernel for ``(m x n) @ b -> out``
    (with ``b2``: its dual form, ``+ (m x n) @ b2``): :data:`PREFERRED`; then the expected
    density against :func:`breakeven_entries`, or without one :data:`MIN_ROWS`; then
    :func:`applies` (in column bands where ``tile_n`` is given). The dual form follows the same
    rule: against the row gathers' dual pass at 16384 rows it was as fast or faster from 0.25%
    density (0.313 / 0.320 ms at 0.25%, 0.466 / 0.553 at 0.5%, 0.750 / 1.020 at 1%, the
    backward's dX of the standard problem, with its pack; bench/stage_times.py,
    bench/results/2026-12-04-stages.jsonl); fewer rows were not measured.

    Column bands are taken only where b (and b2) outgrow the L2, so that the row gathers read
    them from device memory: where they were measured (d_ff 14336, 1.5-2.6x faster than the
    gathers on an H100, bench/NOTES.md, thirty-ninth session). Where b fits the L2 (for instance
    d_ff 8192 at d_model 2048, or the standard widths on a GPU with less shared memory) the
    workspace's round trip has not been weighed against the gathers' L2 reads, so those keep
    the gathers unless ``TWELL_STATIONARY=1``. A banded call's break-even is
    :data:`BANDED_BREAKEVEN_FACTOR` times the unbanded one."""
    if PREFERRED is False:
        return False
    density = expected()
    if PREFERRED is None:
        if density is None and m < MIN_ROWS:
            return False
        if density is not None and density * n < breakeven_entries(m, b.shape[1]):
            return False
    if not applies(n, b, out, b2, tile_n):
        return False
    if PREFERRED is None and slice_bytes(n, 2) > _max_slice_bytes():  # bands needed
        weights = b.shape[0] * b.shape[1] * b.dtype.itemsize * (1 if b2 is None else 2)
        if weights <= K.l2_bytes():  # the gathers read b from the L2
            return False
        return density is None or density * n >= BANDED_BREAKEVEN_FACTOR * breakeven_entries(m, b.shape[1])
    return True


def words_bound(parts: TwELLParts, dual: bool, band: tuple[int, int] | None = None) -> int:
    """The packed words' room: every slot (of the band's row-tiles, when a ``band`` is given)
    and spill entry (twice in the dual form) and each row's padding."""
    m, nt, cap = parts.data.shape
    tiles = nt if band is None else band[1] - band[0]
    return (2 if dual else 1) * (m * tiles * cap + int(parts.spill_data.size) + m * (BATCH - 1))


def fits(parts: TwELLParts, dual: bool) -> bool:
    """Whether :func:`pack`'s int32 row pointers can address A's words (below 2**31)."""
    return words_bound(parts, dual) < 2**31


def pack(
    parts: TwELLParts, tile_n: int, n: int, second: TwELLParts | None = None, band: tuple[int, int] | None = None
) -> tuple[Any, Any]:
    """A's rows as packed words (column << 16 | value bits), each row padded to a multiple of
    :data:`BATCH` with words of the zero rows ``n`` .. ``n + 3``, in the kernel's order against
    bank conflicts: (int32 row pointers, uint32 words). With ``second`` (an A2 of A's structure,
    other values) the dual form: batches of 16 words, 8 entries' words of A then the same 8 of
    A2. With ``band = (t_lo, t_hi)`` only the entries of row-tiles t_lo .. t_hi - 1 (and the
    spill entries in their columns), columns counted from the band's first and the zero rows
    after the band's width (:func:`band_columns`). The words array has room for every slot and
    spill entry and the padding; the first ``indptr[-1]`` are written."""
    cp = _cp()
    m, nt, cap = parts.data.shape
    t_lo, t_hi = (0, nt) if band is None else band
    width = band_columns(n, tile_n, t_lo, t_hi)[1] - t_lo * tile_n
    bound = words_bound(parts, second is not None, (t_lo, t_hi))
    if bound >= 2**31:
        raise ValueError(f"a: expected fewer than 2**31 packed words for the stationary kernel, got room for {bound}")
    indptr = cp.empty(m + 1, dtype=cp.int32)
    words = cp.empty(bound, dtype=cp.uint32)
    if m == 0:
        indptr[0] = 0
        return indptr, words
    sizes = cp.empty(m, dtype=cp.int32)
    dual = np.int32(second is not None)
    tiles = (np.int32(nt), np.int32(tile_n), np.int32(t_lo), np.int32(t_hi))
    K.launch(
        "stationary_row_sizes",
        32 * m,
        256,
        (parts.counts, parts.spill_indptr, parts.spill_indices, *tiles, np.int32(m), dual, sizes),
    )
    head = (sizes, np.int64(m))
    two_launch_scan(m, "stationary_row_sums", head, "stationary_row_place", head, (indptr,))
    t = K.CXX_TYPE[parts.data.dtype]
    data2, spill2 = (K.null_pointer(),) * 2 if second is None else (second.data, second.spill_data)
    args = (parts.data, data2, parts.indices, parts.counts, parts.spill_indptr, parts.spill_indices)
    geometry = (np.int32(m), np.int32(nt), np.int32(tile_n), np.int32(cap), np.int32(t_lo), np.int32(t_hi))
    rows_per_warp = 32 // PACK_WIDTH
    K.launch(
        f"stationary_pack<{t}, {int(dual)}, {PACK_WIDTH}>",
        32 * -(-m // rows_per_warp),
        256,
        (*args, parts.spill_data, spill2, *geometry, np.int32(width), indptr, words),
    )
    return indptr, words


def band_columns(n: int, tile_n: int, t_lo: int, t_hi: int) -> tuple[int, int]:
    """The columns ``[lo, hi)`` of A (``n`` columns) in the band of row-tiles t_lo .. t_hi - 1."""
    return t_lo * tile_n, min(n, t_hi * tile_n)


#: The kernel's band modes (cuda/twell_stationary.cu): the only band; a band before the last
#: (fp32 sums into the workspace); the last (workspace plus sums, rounded to the output's type).
BAND_WHOLE, BAND_PARTIAL, BAND_LAST = 0, 1, 2


def packed_spmm(
    indptr: Any,
    words: Any,
    n: int,
    b: Any,
    out: Any,
    b2: Any = None,
    mode: int = BAND_WHOLE,
    ws: Any = None,
    accumulate: bool = False,
) -> Any:
    """``out = A @ b`` (``+ A2 @ b2`` when ``b2`` is given: A packed in the dual form) for A
    packed by :func:`pack` (``n`` columns, ``b``'s rows); the caller has checked :func:`applies`.
    For a column band (``mode``): :data:`BAND_PARTIAL` writes the band's fp32 sums into ``ws``
    (an M x K float32 array; added to it when ``accumulate``), :data:`BAND_LAST` writes ``ws``
    plus its sums into ``out``."""
    m = indptr.shape[0] - 1
    dual = int(b2 is not None)
    b, ldb = row_stride(b)
    b2, ldb2 = row_stride(b2) if dual else (K.null_pointer(), 0)
    k = b.shape[1]
    ldo = leading_dim(out)
    slices = -(-k // (SLICE_COLS // (1 + dual)))
    # Enough row parts that slices x parts fills the machine once (one block per SM).
    parts = max(1, min(K.sm_count() // slices, -(-m // THREADS)))
    rows_per_part = -(-m // parts)
    expr = f"twell_stationary_spmm<{K.CXX_TYPE[b.dtype]}, {dual}, {mode}>"
    workspace = (K.null_pointer(), np.int64(0)) if ws is None else (ws, np.int64(leading_dim(ws)))
    operands = (b, np.int64(ldb), b2, np.int64(ldb2), np.int32(k), out, np.int64(ldo), *workspace)
    args = (indptr, words, np.int32(m), np.int32(n), *operands, np.int32(accumulate), np.int32(rows_per_part))
    K.launch_grid(expr, (slices, parts), (THREADS,), args, slice_bytes(n, b.itemsize))
    return out


def spmm(parts: TwELLParts, tile_n: int, b: Any, out: Any, second: tuple[TwELLParts, Any] | None = None) -> Any:
    """``out = A @ b`` for a TwELL ``A`` with ``b.shape[0]`` columns, or with ``second = (A2,
    b2)`` (A2 of A's structure) ``out = A @ b + A2 @ b2`` in one pass (the dual form: a slice of
    8 columns of b and of b2): :func:`pack`, then :func:`packed_spmm`; where b's slice outgrows
    shared memory, once per column band of :func:`band_tiles` (the caller has checked
    :func:`applies` with ``tile_n``), the sums carried between bands in an fp32 workspace."""
    n = b.shape[0]
    parts2, b2 = (None, None) if second is None else second
    nt = parts.data.shape[1]
    per_band = band_tiles(n, tile_n, _max_slice_bytes())
    if per_band is None:
        raise ValueError(
            f"b: expected rows whose {SLICE_COLS}-column slices fit shared memory in at most {MAX_BANDS} column "
            f"bands of {tile_n}-column row-tiles, got {n} rows"
        )
    if per_band >= nt:
        indptr, words = pack(parts, tile_n, n, parts2)
        return packed_spmm(indptr, words, n, b, out, b2)
    ws = _cp().empty((out.shape[0], b.shape[1]), dtype=np.float32)
    starts = range(0, nt, per_band)
    for i, t_lo in enumerate(starts):
        t_hi = min(nt, t_lo + per_band)
        lo, hi = band_columns(n, tile_n, t_lo, t_hi)
        indptr, words = pack(parts, tile_n, n, parts2, band=(t_lo, t_hi))
        mode = BAND_LAST if i == len(starts) - 1 else BAND_PARTIAL
        band_b2 = None if b2 is None else b2[lo:hi]
        packed_spmm(indptr, words, hi - lo, b[lo:hi], out, band_b2, mode, ws, accumulate=i > 0)
    return out
