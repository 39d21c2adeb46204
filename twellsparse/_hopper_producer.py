"""The fused Hopper producer: one wgmma + TMA GEMM whose epilogue packs TwELL (sm_90a only).

``cuda/twell_hopper_gemm.cu`` computes ``x @ w.T`` on the tensor cores and, in the GEMM's
epilogue, applies the activation and writes each row-tile's canonical slots, counts and entry
totals: the dense hidden matrix never goes through device memory. Row-tiles that hold more
entries than their capacity also leave their kept values in a dense buffer ``h`` and their bits
in a mask (nothing else of either is written), so the relu-mask pack's spill pass
(``_gpu_convert.relu_mask_to_parts_deferred``'s kernel) applies the overflow policy exactly as it
does after the cuBLASLt producer.

Serves 16-bit x and w of one dtype, the activations of :data:`_kernels.HOPPER_ACTIVATIONS` (with
or without a threshold), ``tile_n`` in 32..256, a capacity that is a multiple of 8 with at most
64 slots per row in each 256-column output tile, K a multiple of 8 and 16-byte aligned rows, on
a compute-capability 9.0 GPU. Elsewhere the cuBLASLt or GEMM-then-pack producers serve.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _kernels as K
from ._parts import TwELLParts
from ._tensor_map import SWIZZLE_128B, TENSOR_MAP_TYPE, tensor_map, tma_ready
from ._validation import n_tiles

if TYPE_CHECKING:
    from ._gpu_convert import Finish

#: Whether linear_to_twell, the FFN plans and the torch/JAX forwards use this producer where it
#: applies (``TWELL_FUSED_PRODUCER=0`` in the environment at import turns it off). On the H200,
#: standard problem at 0.5%: pass 1 takes 0.524 ms against 0.458 ms for the cuBLASLt GEMM alone
#: (1.14x), linear_to_twell 0.560 against 0.578 ms with the cuBLASLt ReLU-mask producer, the
#: gated plan call 1.050 ms (bench/results/2026-12-04-stages.jsonl, commit ede40bb).
ENABLED = os.environ.get("TWELL_FUSED_PRODUCER", "1") != "0"

#: The kernel's schedule (``TWELL_HOPPER_SCHEDULE`` in the environment at import; a module
#: attribute, so that one process can time them all, bench/producer_probe.py):
#: ``"pair"`` (default) the epilogue on pack warps of its own while the math warpgroups go on to
#: the next tile's MMAs, in clusters of two CTAs that share each w tile by TMA multicast;
#: ``"split"`` the same without clusters; ``"inline"`` the epilogue run by the math warpgroups
#: (the tensor cores wait for it), 4 ring stages instead of 3. Pass 1 at 0.5% (ede40bb): 0.524 /
#: 0.529 / 0.537 ms; the GEMM alone in the same kernel (5921883): 0.497 / 0.506 / 0.471, so the
#: hand-off's overlap gains less than the inline epilogue costs: the stage it takes slows the
#: main loop. ``"auto"`` (the default): :func:`schedule_for` by the call's output tiles.
SCHEDULES = ("pair", "split", "inline")
SCHEDULE = os.environ.get("TWELL_HOPPER_SCHEDULE", "auto")
if SCHEDULE not in (*SCHEDULES, "auto"):
    raise ValueError(f"TWELL_HOPPER_SCHEDULE: expected one of {(*SCHEDULES, 'auto')}, got {SCHEDULE!r}")

#: Output tiles per SM up to which ``"auto"`` takes the inline schedule. With few tiles per
#: block, the pair schedule's overlap of one tile's epilogue with the next tile's MMAs has
#: little to overlap, while the inline schedule's fourth ring stage still pays: pass 1 at 0.5%
#: on an H100 (00df8b1, bench/results/2026-12-05-stages.jsonl), inline against pair, 0.030 /
#: 0.040 ms at 256 tokens (0.3 tiles per SM), 0.054 / 0.065 at 1024, 0.080 / 0.088 at 2048,
#: 0.152 / 0.157 at 4096 (5.3 tiles per SM), 0.526 / 0.524 at 16384 (21.3).
INLINE_TILES_PER_SM = 8


def schedule_for(schedule: str, tiles: int, sms: int) -> str:
    """The schedule a call of ``tiles`` output tiles (128 x 256) runs on ``sms`` SMs: ``schedule``
    itself unless it is ``"auto"``, which takes ``"inline"`` up to :data:`INLINE_TILES_PER_SM`
    tiles per SM and ``"pair"`` above."""
    if schedule != "auto":
        return schedule
    return "inline" if tiles <= INLINE_TILES_PER_SM * sms else "pair"


#: Output tile of one block (BM x BN in the kernel) and its launch shape.
BLOCK_ROWS, BLOCK_COLS, BLOCK_K = 128, 256, 64
THREADS = 384
MAX_ROW_SLOTS = 64


def shared_mem(split: bool) -> int:
    """Dynamic shared memory of one block (``Schedule<SPLIT>::SMEM_BYTES`` in the kernel): 1 KB
    of alignment slack, the ring of 48 KB stages (3 split, 4 inline), the 64 KB hand-off buffer
    (split), the barriers, and a 2 KB slot stage per warp that packs (3 split, 8 inline)."""
    stages, pack_warps = (3, 3) if split else (4, 8)
    handoff = BLOCK_ROWS * BLOCK_COLS * 2 if split else 0
    barriers = (2 * stages + (2 if split else 0)) * 8
    slot_stages = pack_warps * 8 * MAX_ROW_SLOTS * 4  # 8 rows x slots x (value + index)
    return 1024 + stages * (BLOCK_ROWS + BLOCK_COLS) * BLOCK_K * 2 + handoff + barriers + slot_stages


def applies(x: Any, w: Any, activation: str, threshold: float | None, tile_n: int, capacity: int) -> bool:
    """Whether this producer can serve the call on the current GPU."""
    del threshold  # every threshold is served
    if not ENABLED or activation not in K.HOPPER_ACTIVATIONS or x.dtype != w.dtype:
        return False
    if np.dtype(x.dtype) not in TENSOR_MAP_TYPE or x.ndim != 2 or w.ndim != 2:
        return False
    (m, k), n = x.shape, w.shape[0]
    if min(m, n, k) == 0 or k % 8 or tile_n not in (32, 64, 128, 256):
        return False
    if capacity % 8 or (BLOCK_COLS // tile_n) * capacity > MAX_ROW_SLOTS:
        return False
    if not (tma_ready(x) and tma_ready(w)):
        return False
    return K.runs_here("twell_hopper_gemm.cu")


def linear_to_parts_deferred(
    x: Any, w: Any, activation: str, tile_n: int, capacity: int, threshold: float | None
) -> tuple[TwELLParts, Finish]:
    """``(first, finish)`` as ``_gpu_convert.dense_to_parts_deferred`` gives them, for
    ``act(x @ w.T)``; the caller checked :func:`applies`."""
    import cupy as cp

    from . import _gpu_convert

    (m, k), n = x.shape, w.shape[0]
    nt = n_tiles(n, tile_n)
    h = cp.empty((m, n), dtype=x.dtype)  # written only where a row-tile overflows
    mask_words = -(-n // BLOCK_COLS) * (BLOCK_COLS // 32)
    mask = cp.empty(m * mask_words, dtype=cp.uint32)
    types = f"{K.CXX_TYPE[x.dtype]}, {K.ACTIVATION_ID[activation]}"
    # SCHEDULE read once (bench scripts switch it between calls).
    schedule = schedule_for(SCHEDULE, -(-m // BLOCK_ROWS) * -(-n // BLOCK_COLS), K.sm_count())
    split = schedule != "inline"
    smem = shared_mem(split)
    gemm, clusters = f"twell_gemm_pack<{types}, {int(split)}>", 0
    if schedule == "pair":  # where no cluster of two fits (the query fails), the split schedule
        pair = f"twell_gemm_pack_pair<{types}>"
        clusters = K.max_active_clusters(pair, cp.cuda.Device().id, THREADS, smem, 2)
        gemm = pair if clusters > 0 else gemm
    cluster = 2 if clusters > 0 else 1  # a cluster's row blocks share a w tile
    maps = (
        tensor_map(x, BLOCK_ROWS, BLOCK_K, SWIZZLE_128B),
        tensor_map(w, BLOCK_COLS // cluster, BLOCK_K, SWIZZLE_128B),
    )
    thr = np.float64(-1.0 if threshold is None else threshold)
    geometry = (np.int32(m), np.int32(n), np.int32(k), np.int32(tile_n), np.int32(nt), np.int32(capacity), thr)
    items = -(-m // (BLOCK_ROWS * cluster)) * -(-n // BLOCK_COLS)
    blocks = cluster * min(items, clusters) if clusters > 0 else min(items, K.sm_count())
    spill_pass = _gpu_convert.relu_mask_spill_pass(h, mask, mask_words, tile_n, capacity)

    def launch(data: Any, indices: Any, counts: Any, nnz: Any, offsets: Any, spill_idx: Any, spill_data: Any) -> None:
        if K.is_null(offsets):  # pass 1: the GEMM and its packing epilogue
            outputs = (data, indices, counts, nnz, h, mask, np.int64(mask_words))
            K.launch_arch(gemm, (blocks,), (THREADS,), (*maps, *geometry, *outputs), smem)
        else:
            spill_pass(data, indices, counts, nnz, offsets, spill_idx, spill_data)

    return _gpu_convert.two_pass(m, nt, capacity, x.dtype, launch)
