"""The FFN blocks under a sustained load: time, energy per call and mean power of torch's dense
blocks and the library's sparse plans, each run back to back for two seconds, in turn, twice
(``sustained.energy_while``: NVML's energy counter around the window, no sampling inside it).

    python bench/ffn_energy.py [--m 16384] [--densities 0.005,0.01,0.02] [--out FILE.jsonl]

The usual benchmarks (``ffn_bench.py``) time a few calls after an idle GPU with the L2 flushed,
below the board's power cap; run for seconds, GEMMs hold the board at the cap and a call takes
its energy over the cap. These rows give the speed-ups and energy ratios of that steady state
(standard widths, bf16, uniform pattern; the L2 is not flushed between calls).
"""

from __future__ import annotations

import argparse
from typing import Any

import cupy as cp
import torch
from sustained import Nvml, dense_and_sparse, energy_while

import twellsparse as ts
from twellsparse._environment import append_records, environment
from twellsparse.testing import ffn_problem


def blocks(m: int, density: float, pattern: str) -> dict[str, Any]:
    """Name -> zero-argument call: the dense blocks as torch runs them, the sparse plans."""
    p = ffn_problem(m, 2048, 5632, density, pattern, ts.bfloat16, 0, cp)
    x, wg, wu, wd = (p[k] for k in ("x", "w_gate", "w_up", "w_down"))
    tx, twg, twu, twd = (torch.from_dlpack(a) for a in (x, wg, wu, wd))
    # A fixed-length spill: no overflow read-back, so the calls queue ahead as in a CUDA graph.
    room = {"dispatch": "sparse", "spill_capacity": m * 64}
    gated, plain = ts.GatedFFN(wg, wu, wd, **room), ts.FFN(wg, wd, **room)
    return {
        "dense gated (torch)": lambda: (torch.relu(tx @ twg.T) * (tx @ twu.T)) @ twd.T,
        "sparse gated": lambda: gated(x),
        "dense non-gated (torch)": lambda: torch.relu(tx @ twg.T) @ twd.T,
        "sparse non-gated": lambda: plain(x),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--densities", default="0.005,0.01,0.02")
    ap.add_argument("--pattern", default="uniform")
    ap.add_argument("--seconds", type=float, default=2.0, help="each window's length")
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args(argv)
    nvml, env = Nvml(), environment()
    print(f"enforced power limit {nvml.power_limit_w():.0f} W, m {args.m}, {args.pattern}")
    for density in (float(d) for d in args.densities.split(",")):
        calls = blocks(args.m, density, args.pattern)
        for fn in calls.values():  # first calls (compiles, plans, the density sample) untimed
            fn()
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in calls}
        for _ in range(2):  # in turn, twice: the second round shows the drift
            for name, fn in calls.items():
                rows[name].append(energy_while(nvml, fn, args.seconds))
                print(f"{density:.3%} {name}: {rows[name][-1]}")
        for kind in ("gated", "non-gated"):
            (dense_ms, dense_mj), (sparse_ms, sparse_mj) = dense_and_sparse(rows, kind)
            print(
                f"{density:.3%} {kind}: sustained speed-up {dense_ms / sparse_ms:.2f}x, "
                f"energy per call {sparse_mj / dense_mj:.2f} of dense"
            )
        record = {**env, "kind": "ffn_energy", "m": args.m, "pattern": args.pattern, "density_target": density}
        append_records(args.out, [{**record, "windows": rows, "power_limit_w": nvml.power_limit_w()}])


if __name__ == "__main__":
    main()
