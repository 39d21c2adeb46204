"""Byte model of the FFN consumers, from real activation patterns (runs on the CPU).

For a token block of B tokens, a staged consumer reads each weight row its block activates once
(the union of the block's active units); a per-pair consumer reads one row per (token, unit)
pair. This script draws the patterns of TARGETS.md (uniform and skewed) and prints, per density
and block size: the union fraction, the reuse (pairs per staged row) and the weight bytes each
design moves for the gated consumer (W_up and W_down rows, bf16), with the time those bytes take
at an assumed L2-to-SM rate. Use it to choose block sizes before building a kernel.

Second table, the hot-unit split: the H most frequent units served densely (the gated block's
up and down products over those H columns for every token: 4 M d_model H FLOP at an assumed
tensor rate) and the other units' pairs by per-pair gathers (8 KB each at an assumed gather rate),
for the H that minimises the sum; the consumer time against gathers alone.

Third table, the packed tensor-core kernels (``_tiled_spmm``, ``_tiled_ffn``; bench/NOTES.md,
twenty-fourth and twenty-fifth sessions): the gate packed per (8 rows, 512 columns) into
k-groups of 16 entries; the padding that whole k-groups add, the one-pack up kernel's rounds per
block (its 16 warps take 16 k-groups each per round; more re-stream the slices), the transposed
products' warp imbalance (a warp owns 4 groups of 8 units: the block waits for its busiest warp;
as they come and as ``tiled_spmm_balance`` deals them by load), and the shared-memory bytes and
time each kernel needs at an assumed shared-memory rate (their bound if nothing else binds).

Fourth table, the down product's ring: its warps own fixed row groups and a chunk's stage is
refilled only when every warp is done with it, so a warp runs at most STAGES - 1 chunks ahead of
the slowest; the block then takes longer than its warps' mean work. :func:`ring_efficiency`
simulates that (each k-group one unit of a warp's time, refills instant) for 16 warps of 4 groups
and 32 of 2.

Fifth table, the row gathers' blocks (``_kernels.GATHER_WARPS``): a warp owns a token's row and
takes its entries 32 at a time, and a block's warp slots return only when its longest row ends.
:func:`block_occupancy` schedules the rows' blocks on the machine's block slots (each batch of 32
entries one unit of time: the latency-bound limit; a bandwidth-bound kernel would let the busy
warps go faster and lose less) and gives the useful share of the slots' time for blocks of 4 and
1 rows.

Sixth table, the transposed products' rows (``_gpu_ops.spmm_transposed``): a warp owns a unit's
list of tokens (a row of A.T), so a hot unit is one warp's work. :func:`transposed_slot_use`
schedules those rows as :func:`block_occupancy` does, whole, and with the long rows cut into
runs that the grid's first warps take, of the length the segment plan chooses to fit the slots
(``TWELL_TRANSPOSED_SEGMENTS``; bench/NOTES.md, thirty-fourth and thirty-fifth sessions), and gives the slots' use
and the cut's predicted speed-up (the makespans' ratio; the partial rows' adding-up is left out).

Usage: python bench/model.py [--m 16384] [--d-model 2048] [--d-ff 5632] [--l2-tbs 9.0]
       [--tflops 700] [--gather-tbs 6.4] [--smem-tbs 29.6]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from twellsparse._gpu_convert import TRANSPOSED_SEGMENT_SLOTS, segment_length
from twellsparse._reference import segment_plan
from twellsparse.testing import firing_rates


def block_stats(fire: np.ndarray, block: int) -> tuple[float, float]:
    """(mean union fraction over blocks, pairs per union row) for token blocks of ``block`` rows."""
    m, n = fire.shape
    blocks = fire[: m - m % block].reshape(-1, block, n)
    union = blocks.any(axis=1).sum(axis=1)
    pairs = blocks.sum(axis=(1, 2))
    return float(union.mean() / n), float(pairs.sum() / max(union.sum(), 1))


def hot_split(fire: np.ndarray, row_bytes: int, d_model: int, tflops: float, gather_tbs: float) -> tuple[int, float]:
    """(H, consumer ms) of the best hot-unit split: the H most frequent units dense, the rest
    gathered pair by pair (H = 0: gathers alone)."""
    m = fire.shape[0]
    per_unit = np.sort(fire.sum(axis=0))[::-1]  # pairs per unit, hottest first
    cold_pairs = per_unit.sum() - np.concatenate(([0], np.cumsum(per_unit)))  # after H hot units
    hot = np.arange(per_unit.size + 1)
    ms = 4.0 * m * d_model * hot / (tflops * 1e9) + 2 * cold_pairs * row_bytes / (gather_tbs * 1e9)
    best = int(np.argmin(ms))
    return best, float(ms[best])


def dealt_loads(loads: np.ndarray) -> np.ndarray:
    """The loads of 64 x blocks warp slots after ``tiled_spmm_balance``'s deal of the groups
    (``loads``, a multiple of 64 long): heaviest first (ties: the smaller group), the k-th to
    block k % blocks, pass (k // blocks) // 16, warp p or 15 - p on alternate passes."""
    blocks = loads.size // 64
    order = sorted(range(loads.size), key=lambda g: (-int(loads[g]), g))
    slots = np.zeros(loads.size, dtype=loads.dtype)
    for k, g in enumerate(order):
        b, r = k % blocks, k // blocks
        step, p = divmod(r, 16)
        slots[(b * 16 + (15 - p if step & 1 else p)) * 4 + step] = loads[g]
    return slots


def ring_efficiency(kgs: np.ndarray, warps: int, stages: int = 3) -> float:
    """The mean warp's work over the block's time, summed over blocks, for k-group counts ``kgs``
    [group, chunk] (blocks of 64 groups, ``warps`` warps of 64 / warps consecutive groups): warp w
    starts chunk c when it is done with chunk c - 1 and every warp is done with chunk c - stages
    (the stage's release; its refill taken as instant), and takes its k-groups of chunk c."""
    groups, chunks = kgs.shape
    blocks = -(-groups // 64)
    padded = np.zeros((blocks * 64, chunks))
    padded[:groups] = kgs
    load = padded.reshape(blocks, warps, 64 // warps, chunks).sum(axis=2)  # [block, warp, chunk]
    done = np.zeros((blocks, warps, chunks))
    for c in range(chunks):
        start = done[:, :, c - 1] if c > 0 else np.zeros((blocks, warps))
        if c >= stages:
            start = np.maximum(start, done[:, :, c - stages].max(axis=1, keepdims=True))
        done[:, :, c] = start + load[:, :, c]
    busy = done[:, :, -1].max(axis=1) if chunks else np.zeros(blocks)
    return float(load.sum(axis=2).mean(axis=1).sum() / max(busy.sum(), 1e-9))


def packed_stats(fire: np.ndarray, d_model: int, rows: int = 8, chunk: int = 512, kgroup: int = 16) -> dict:
    """The packed kernels' geometry on one activation pattern (tokens x units, padded to whole
    groups and chunks): padding of the k-groups, the up kernel's rounds per (512 tokens, chunk)
    block, the transposed products' busiest-warp factor, and each kernel's shared-memory bytes
    (2-byte values: 128 bytes of a B row per entry and 64 columns; W_up's 64 bytes per entry and
    32 columns plus x's rows once per group, slice and round)."""
    m, n = fire.shape
    pad_m, pad_n = -(-m // 512) * 512, -(-n // chunk) * chunk
    full = np.zeros((pad_m, pad_n), dtype=bool)
    full[:m, :n] = fire
    entries = full.reshape(pad_m // rows, rows, pad_n // chunk, chunk).sum(axis=(1, 3))  # (group, chunk)
    kgs = -(-entries // kgroup)
    # Shared-memory wavefronts against conflict-free ones: an item costs at least max(its
    # octets, its largest row class) (cuda/twell_tiled.cuh, octet_plan, which reaches that within
    # 0.5%); the classes are the B rows' (column in chunk) % 8.
    classes = full.reshape(pad_m // rows, rows, pad_n // chunk, chunk // 8, 8).sum(axis=(1, 3))
    octets = 2 * kgs
    conflicts = float(np.maximum(octets, classes.max(axis=2)).sum() / max(octets.sum(), 1))
    per_block = kgs.reshape(-1, 64, kgs.shape[1])  # 64 row groups a block of 512 tokens
    rounds = -(-per_block.sum(axis=1) // 256)  # (part, chunk): 16 warps x 16 k-groups a round
    groups_busy = (per_block > 0).sum(axis=1)  # groups reading x, per (part, chunk)
    slices = -(-d_model // 32)
    kgroup_bytes = kgroup * 2 * d_model  # a k-group's entries' whole 2-byte rows
    spmm_bytes = kgs.sum() * kgroup_bytes
    up_bytes = spmm_bytes + (rounds * groups_busy).sum() * slices * 8 * 64
    # A.T: groups of 8 units x chunks of 512 tokens; blocks of 512 units (16 warps x 4 groups).
    entries_t = full.reshape(pad_m // chunk, chunk, pad_n // rows, rows).sum(axis=(1, 3)).T
    kgs_t = -(-entries_t // kgroup)
    classes_t = full.reshape(pad_m // chunk, chunk // 8, 8, pad_n // rows, rows).sum(axis=(1, 4))  # token % 8
    octets_t = 2 * kgs_t
    conflicts_t = float(np.maximum(octets_t, classes_t.max(axis=1).T).sum() / max(octets_t.sum(), 1))
    units_groups = -(-kgs_t.shape[0] // 64) * 64
    padded_t = np.zeros((units_groups, kgs_t.shape[1]), dtype=kgs_t.dtype)
    padded_t[: kgs_t.shape[0]] = kgs_t
    loads = padded_t.sum(axis=1)
    warp_load = loads.reshape(-1, 16, 4).sum(axis=2)  # (block, warp)
    # The blocks' time is their busiest warps' loads: against the mean warps', over all blocks.
    busy = warp_load.max(axis=1).sum() / max(warp_load.mean(axis=1).sum(), 1e-9)
    dealt = dealt_loads(loads).reshape(-1, 16, 4).sum(axis=2)
    busy_dealt = dealt.max(axis=1).sum() / max(dealt.mean(axis=1).sum(), 1e-9)
    # The down product's L2-to-SM bytes: every tile (512 rows x 64 columns) streams its B chunks
    # (512 x 64 x 2 bytes each), and every column block re-reads the operand: 64 bytes of words
    # and 256 of one-hot fragments per k-group (tiled_spmm_fragments).
    col_blocks = -(-d_model // 64)
    b_chunk_bytes = (pad_m // 512) * col_blocks * (pad_n // chunk) * chunk * 64 * 2
    operand_bytes = col_blocks * kgs.sum() * (kgroup * 4 + 32 * 8)
    return {
        "row_batches": -(-fire.sum(axis=1) // 32),  # the row gathers' batches of 32 entries per row
        "transposed_use": lambda segment: transposed_slot_use(fire, segment),
        # The run length the segment plan would choose for this pattern's rows of A.T.
        "run_length": lambda shortest, slots: segment_plan(
            np.concatenate([[0], np.cumsum(fire.sum(axis=0))]), shortest, slots
        )[2],
        "ring_16": ring_efficiency(kgs, 16),
        "ring_32": ring_efficiency(kgs, 32),
        "spmm_l2_gb": float((b_chunk_bytes + operand_bytes) / 1e9),
        "spmm_l2_operand": float(operand_bytes / b_chunk_bytes),
        "padding": float(kgs.sum() * kgroup / max(entries.sum(), 1) - 1),
        "rounds": float(rounds.mean()),
        "two_rounds": float((rounds >= 2).mean()),
        "busiest_warp": float(busy),
        "busiest_warp_dealt": float(busy_dealt),
        "conflicts": conflicts,
        "conflicts_t": conflicts_t,
        "spmm_gb": spmm_bytes / 1e9,
        "up_gb": up_bytes / 1e9,
        "transposed_gb": float(kgs_t.sum() * kgroup_bytes / 1e9),
    }


def block_occupancy(batches: np.ndarray, rows_per_block: int, warps_per_sm: int, sms: int = 132) -> float:
    """The share of the warp slots' time spent on rows when rows of ``batches`` units each run in
    blocks of ``rows_per_block`` consecutive rows, ``warps_per_sm // rows_per_block`` blocks per
    SM, each block started on the first block slot to free and holding it until its longest row
    ends: the rows' total work over (makespan x warp slots)."""
    import heapq

    per_block = -(-batches.size // rows_per_block) * rows_per_block
    padded = np.zeros(per_block, dtype=np.int64)
    padded[: batches.size] = batches
    block_time = padded.reshape(-1, rows_per_block).max(axis=1)
    slots = [0] * (sms * (warps_per_sm // rows_per_block))  # block slots' free times
    for t in block_time.tolist():
        heapq.heappush(slots, heapq.heappop(slots) + t)
    makespan = max(slots)
    return float(batches.sum()) / (makespan * sms * (warps_per_sm // rows_per_block) * rows_per_block)


def run_batches(entries: np.ndarray, segment: int | None) -> np.ndarray:
    """Batches of 32 entries per warp of the transposed products' grid, one row of A.T per entry
    of ``entries``: the rows whole (``segment`` None), or the rows longer than ``segment`` cut into
    runs of ``segment`` entries, whose warps come first, then the rows' own warps (a cut row's
    exits at once: 0)."""
    if segment is None:
        return -(-entries // 32)
    cut = entries > segment
    runs = [-(-np.minimum(segment, e - np.arange(0, e, segment)) // 32) for e in entries[cut].tolist()]
    whole = np.where(cut, 0, -(-entries // 32))
    return np.concatenate([*runs, whole]).astype(np.int64)


def transposed_slot_use(fire: np.ndarray, segment: int | None, warps_per_sm: int = 12, column_warps: int = 2) -> float:
    """:func:`block_occupancy` of the transposed products' grid (1-row blocks, the default since
    the thirty-fifth session; 12 warps per SM: the bf16 kernels' 150-168 registers), its
    ``column_warps`` column shares launched one after the other as the grid's y."""
    batches = run_batches(fire.sum(axis=0), segment)
    return block_occupancy(np.tile(batches, column_warps), 1, warps_per_sm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--l2-tbs", type=float, default=9.0, help="assumed L2-to-SM gather rate, TB/s")
    ap.add_argument("--blocks", default="64,128,256,512")
    ap.add_argument("--densities", default="0.005,0.01,0.02")
    ap.add_argument("--tflops", type=float, default=700.0, help="assumed dense bf16 rate, TFLOP/s")
    ap.add_argument("--gather-tbs", type=float, default=6.4, help="the gated consumer's measured gather rate, TB/s")
    ap.add_argument("--smem-tbs", type=float, default=29.6, help="assumed shared-memory rate, TB/s")
    args = ap.parse_args(argv)
    row_bytes = 2 * args.d_model  # one bf16 weight row
    rng = np.random.default_rng(0)
    print("pattern  density  block  union  reuse  per-pair GB (ms)  staged GB (ms)")
    splits, packed = [], []
    for pattern in ("uniform", "skewed"):
        for density in (float(d) for d in args.densities.split(",")):
            rates = firing_rates(args.d_ff, density, pattern, rng)
            fire = rng.random((args.m, args.d_ff)) < rates[None, :]
            gathers_ms = 2 * int(fire.sum()) * row_bytes / (args.gather_tbs * 1e9)
            hot, split_ms = hot_split(fire, row_bytes, args.d_model, args.tflops, args.gather_tbs)
            splits.append((pattern, density, hot, split_ms, gathers_ms))
            packed.append((pattern, density, packed_stats(fire, args.d_model)))
            pairs = int(fire.sum())
            per_pair = 2 * pairs * row_bytes / 1e9  # W_up and W_down rows
            for block in (int(b) for b in args.blocks.split(",")):
                union, reuse = block_stats(fire, block)
                staged = per_pair / reuse
                print(
                    f"{pattern:>7}  {density:6.2%}  {block:5d}  {union:5.1%}  {reuse:5.2f}  "
                    f"{per_pair:6.2f} ({per_pair / args.l2_tbs:5.3f})  {staged:6.2f} ({staged / args.l2_tbs:5.3f})"
                )
    print("\npattern  density  hot units H  split consumer ms  gathers alone ms")
    for pattern, density, hot, split_ms, gathers_ms in splits:
        print(f"{pattern:>7}  {density:6.2%}  {hot:11d}  {split_ms:16.3f}  {gathers_ms:16.3f}")
    print(
        "\npattern  density  padding  up rounds (2+)  busiest warp (A.T, dealt)  conflicts (A.T)  "
        f"shared-memory GB (ms at {args.smem_tbs} TB/s, with the conflicts): down, up, each transposed;"
        f"  down's L2 GB (ms at {args.l2_tbs} TB/s; operand / B chunks)"
    )
    for pattern, density, st in packed:
        t = {k: st[k] / args.smem_tbs for k in ("spmm_gb", "up_gb", "transposed_gb")}
        c, ct = st["conflicts"], st["conflicts_t"]
        print(
            f"{pattern:>7}  {density:6.2%}  {st['padding']:7.1%}  {st['rounds']:5.2f} ({st['two_rounds']:4.0%})"
            f"  {st['busiest_warp']:14.2f} ({st['busiest_warp_dealt']:.2f})  {c:9.2f} ({ct:.2f})"
            f"  {st['spmm_gb']:.2f} ({t['spmm_gb'] * c:.3f}), {st['up_gb']:.2f} ({t['up_gb'] * c:.3f}),"
            f" {st['transposed_gb']:.2f} ({t['transposed_gb'] * ct:.3f});"
            f"  {st['spmm_l2_gb']:.2f} ({st['spmm_l2_gb'] / args.l2_tbs:.3f}; {st['spmm_l2_operand']:.2f})"
        )
    print("\npattern  density  down product's ring efficiency: 16 warps x 4 groups, 32 x 2")
    for pattern, density, st in packed:
        print(f"{pattern:>7}  {density:6.2%}  {st['ring_16']:.3f}  {st['ring_32']:.3f}")
    print("\npattern  density  row gathers' slot use: 4-row blocks (5 per SM), 1-row blocks (21 per SM)")
    for pattern, density, st in packed:
        b = st["row_batches"]
        print(f"{pattern:>7}  {density:6.2%}  {block_occupancy(b, 4, 20):.3f}  {block_occupancy(b, 1, 21):.3f}")
    slots = TRANSPOSED_SEGMENT_SLOTS or 2048
    print(f"\npattern  density  transposed products' slot use: rows whole, cut (runs fit {slots} slots); speed-up")
    for pattern, density, st in packed:
        segment = st["run_length"](segment_length(args.m), slots)
        whole, cut = st["transposed_use"](None), st["transposed_use"](segment)
        print(f"{pattern:>7}  {density:6.2%}  {whole:.3f}  {cut:.3f} (runs of {segment})  {cut / whole:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
