"""Crossings of the FFN plans with dense, per shape: the data of ``twellsparse._dispatch``.

For every shape (tokens M, d_model, d_ff), pattern and block in the FFN benchmark records, the
crossing is the density where the sparse plan's time equals the dense path that ``dispatch=
"auto"`` runs above it: the library's own dense plan in records that timed it, else torch's
block (all measured side by side in one run; linear interpolation between the two densities
around it). These go into
``_dispatch.CROSSINGS`` (the lower of the two patterns of a shape).

For reference the script also fits the two-parameter model

    break-even(M, d_model, d_ff) = c - o / (M * d_model * d_ff)

(c: the crossing of large problems; o: the sparse path's fixed costs). On the 2026-12-03 data
it does not fit (the d_model 4096 / d_ff 14336 shapes cross lower at more FLOPs), which is why
the library interpolates the measured crossings instead.

Usage: python bench/breakeven_fit.py bench/results/2026-12-03-ffn-widths.jsonl [...]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from typing import Any

import numpy as np

#: block -> (its sparse row, its dense rows in order of preference: the library's dense plan,
#: which ``auto`` switches to, where the run timed it, else torch's block).
BLOCKS = {
    "ffn": ("ffn", ("dense_ffn_plan", "dense_ffn")),
    "gated_ffn": ("gated_ffn", ("dense_gated_ffn_plan", "dense_gated_ffn")),
}


def crossings(records: list[dict[str, Any]], commit: str | None = None) -> dict[tuple, float]:
    """(block, M, d_model, d_ff, pattern) -> crossing density (NaN if sparse never wins, inf if
    it never loses over the densities measured)."""
    points: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for rec in records:
        if rec.get("kind") != "ffn" or (commit and not str(rec.get("commit", "")).startswith(commit)):
            continue
        m, d_model, d_ff = rec["shape"]
        for block, (sparse, denses) in BLOCKS.items():
            ms = rec["ms"]
            dense = [ms[d]["median"] for d in denses if "median" in ms.get(d, {})]
            if dense and "median" in ms.get(sparse, {}):
                ratio = ms[sparse]["median"] / dense[0]  # < 1: sparse faster than the dense path auto takes
                points[(block, m, d_model, d_ff, rec["pattern"])].append((rec["density"], ratio))
    result = {}
    for key, pts in points.items():
        pts.sort()
        result[key] = _crossing(pts)
    return result


def _crossing(pts: list[tuple[float, float]]) -> float:
    if pts[0][1] >= 1.0:
        return float("nan")
    for (d0, r0), (d1, r1) in itertools.pairwise(pts):
        if r0 < 1.0 <= r1:
            return d0 + (1.0 - r0) * (d1 - d0) / (r1 - r0)
    return float("inf")


def fit(cross: dict[tuple, float]) -> dict[str, tuple[float, float]]:
    """block -> (c, o) of the model, from the lower crossing of each shape's patterns."""
    lowest: dict[tuple, float] = {}
    for (block, m, d_model, d_ff, _), rho in cross.items():
        if np.isfinite(rho):
            key = (block, m, d_model, d_ff)
            lowest[key] = min(rho, lowest.get(key, np.inf))
    params = {}
    for block in BLOCKS:
        rows = [(1.0 / (m * d_model * d_ff), rho) for (b, m, d_model, d_ff), rho in lowest.items() if b == block]
        if len(rows) < 2:
            continue
        a = np.array([[1.0, -x] for x, _ in rows])
        y = np.array([rho for _, rho in rows])
        (c, o), *_ = np.linalg.lstsq(a, y, rcond=None)
        params[block] = (float(c), float(o))
    return params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--commit", default=None, help="only records of this commit (prefix)")
    args = ap.parse_args(argv)
    records = [json.loads(line) for f in args.files for line in open(f) if line.strip()]
    cross = crossings(records, args.commit)
    for key in sorted(cross):
        print(f"{key[0]:>9} M={key[1]:>6} d_model={key[2]} d_ff={key[3]:>5} {key[4]:>7}: crossing {cross[key]:.4f}")
    for block, (c, o) in fit(cross).items():
        print(f"{block}: c = {c:.5f}, o = {o:.4g}  (break-even = c - o / (M * d_model * d_ff))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
