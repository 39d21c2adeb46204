"""Byte model of the FFN consumers, from real activation patterns (runs on the CPU).

For a token block of B tokens, a staged consumer reads each weight row its block activates once
(the union of the block's active units); a per-pair consumer reads one row per (token, unit)
pair. This script draws the patterns of TARGETS.md (uniform and skewed) and prints, per density
and block size: the union fraction, the reuse (pairs per staged row) and the weight bytes each
design moves for the gated consumer (W_up and W_down rows, bf16), with the time those bytes take
at an assumed L2-to-SM rate. Use it to choose block sizes before building a kernel.

Usage: python bench/model.py [--m 16384] [--d-model 2048] [--d-ff 5632] [--l2-tbs 9.0]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from twellsparse.testing import firing_rates


def block_stats(fire: np.ndarray, block: int) -> tuple[float, float]:
    """(mean union fraction over blocks, pairs per union row) for token blocks of ``block`` rows."""
    m, n = fire.shape
    blocks = fire[: m - m % block].reshape(-1, block, n)
    union = blocks.any(axis=1).sum(axis=1)
    pairs = blocks.sum(axis=(1, 2))
    return float(union.mean() / n), float(pairs.sum() / max(union.sum(), 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--l2-tbs", type=float, default=9.0, help="assumed L2-to-SM gather rate, TB/s")
    ap.add_argument("--blocks", default="64,128,256,512")
    ap.add_argument("--densities", default="0.005,0.01,0.02")
    args = ap.parse_args(argv)
    row_bytes = 2 * args.d_model  # one bf16 weight row
    rng = np.random.default_rng(0)
    print("pattern  density  block  union  reuse  per-pair GB (ms)  staged GB (ms)")
    for pattern in ("uniform", "skewed"):
        for density in (float(d) for d in args.densities.split(",")):
            rates = firing_rates(args.d_ff, density, pattern, rng)
            fire = rng.random((args.m, args.d_ff)) < rates[None, :]
            pairs = int(fire.sum())
            per_pair = 2 * pairs * row_bytes / 1e9  # W_up and W_down rows
            for block in (int(b) for b in args.blocks.split(",")):
                union, reuse = block_stats(fire, block)
                staged = per_pair / reuse
                print(
                    f"{pattern:>7}  {density:6.2%}  {block:5d}  {union:5.1%}  {reuse:5.2f}  "
                    f"{per_pair:6.2f} ({per_pair / args.l2_tbs:5.3f})  {staged:6.2f} ({staged / args.l2_tbs:5.3f})"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
