"""When ``dispatch="auto"`` runs an FFN block dense: the break-even activation density by block
and shape, from crossings measured on the H200 (one lowered after an H100 run).

The crossing (the density where the sparse plan's time equals the dense block's, both measured
side by side in one run) moves with the shape: at 4096 tokens the sparse path's fixed costs
(the producer's finish, small launches) weigh more and it falls to about 0.65-0.9%, at 2048
tokens to 0.3-0.5%, and at 1024 tokens or fewer the sparse path never wins (those calls run
dense); at 16384-65536 tokens of the standard widths it is about 1.0-1.5%; with d_model 4096 and d_ff
14336 (weights beyond the L2) about 0.65-1.0% at 4096 tokens and 1.35-1.5% at 16384-65536. One
constant for all of them left up to ~8% on the table at large shapes and ran sparse at 0.76x
dense at small ones.

Limits: the standard widths' crossings are the H200's, measured against torch's unfused dense
block (the library's own dense path is 6-16% faster there, so they sit somewhat high until
refitted against it); the d_model 4096 ones are an H100's, against the library's dense plans;
other shapes take the nearest measured widths and clamp to the measured token counts (a call
under 1024 tokens gets the 1024-token value, dense); other GPUs get the same numbers. A plan's
``breakeven`` overrides them.
"""

from __future__ import annotations

import functools
import math

#: (d_model, d_ff) -> block -> ((tokens, crossing density), ...): the lower crossing of the
#: uniform and skewed patterns where both were measured (``bench/breakeven_fit.py`` over
#: ``bench/results/2026-12-0[34]-ffn.jsonl`` and ``-ffn-widths.jsonl``, H200). The 4096-token points
#: are from commit b01dbb6, after the plan calls' host work was cut (their sparse times then
#: matched the GPU-only ones), except the gated one of the standard widths; that one is from
#: 8e75718 (the gated consumer in two launches with tensor-core dots, uniform only); the gated
#: 16384-token one of the standard widths is from 924115f (H100, both patterns, 1.37 / 1.38%:
#: the tiled up projection from an expected 0.75%, which moved it from 1.18%;
#: ``bench/results/2026-12-06-ffn.jsonl``); their 65536-token points from 7acaf49 (uniform only;
#: 924115f measured 1.46 / 1.48% at 65536 tokens, the same); the others from b871c25. The d_model
#: 4096 points are an H100's (below).
#:
#: Under 4096 tokens (e992aa3, H200, uniform, ``ffn_bench.py --m 256 / 512 / 1024 / 2048``): the
#: sparse path's fixed costs (the producer took 0.068-0.096 ms against a 0.016-0.035 ms GEMM)
#: win at 2048 tokens only below ~0.28% (non-gated: 1.02x at 0.25%, 0.89x at 0.5%) and ~0.53%
#: (gated: 1.33x, 1.03x), and never at 1024 tokens or fewer (0.60-0.74x at 0.25-1% with 1024,
#: 0.59 / 0.66x at 0.25% with 512, 0.41 / 0.36x at 0.5% with 256): a crossing of 0 there, so
#: such calls run dense. The wide family's points under 4096 tokens are not measured: they
#: scale its 4096-token crossings by the standard widths' ratios (2048 tokens: 0.42 non-gated,
#: 0.60 gated; 1024: 0), erring towards dense. Plans with fp8 rows scale these by
#: :data:`E4M3_CROSSING_FACTOR`, so they too run dense at 1024 tokens or fewer (not measured
#: there; their producer is the same).
#:
#: The d_model 4096 points at 4096-65536 tokens are from 2687ed3 (H100, both patterns, against
#: the library's dense plans, ``bench/results/2026-12-06-ffn-widths.jsonl``): after the
#: stationary SpMM's column bands (20f0dc8) and the tiled up projection for weights beyond the
#: L2 (2687ed3), which moved them from 0.61 / 0.70% at 16384 tokens to 1.35 / 1.36% (the gated
#: block at 16384 tokens and 1%: 1.20x torch, it was 0.93x). Their 2048-token points scale the
#: 4096-token ones as above (0.42, 0.60).
CROSSINGS: dict[tuple[int, int], dict[str, tuple[tuple[int, float], ...]]] = {
    (2048, 5632): {
        "ffn": ((1024, 0.0), (2048, 0.0028), (4096, 0.0066), (16384, 0.0103), (65536, 0.0120)),
        "gated_ffn": ((1024, 0.0), (2048, 0.0053), (4096, 0.0088), (16384, 0.0137), (65536, 0.0147)),
    },
    (4096, 14336): {
        "ffn": ((1024, 0.0), (2048, 0.0027), (4096, 0.0065), (16384, 0.0135), (65536, 0.0134)),
        "gated_ffn": ((1024, 0.0), (2048, 0.0061), (4096, 0.0101), (16384, 0.0136), (65536, 0.0148)),
    },
}


def _family(d_model: int, d_ff: int) -> tuple[int, int]:
    """The measured widths nearest to ``(d_model, d_ff)`` (in log scale)."""

    def distance(widths: tuple[int, int]) -> float:
        return abs(math.log(max(d_model, 1) / widths[0])) + abs(math.log(max(d_ff, 1) / widths[1]))

    return min(CROSSINGS, key=distance)


#: How much further the crossing lies for a plan whose gathered weight rows are all fp8 e4m3
#: (half the bytes per pair): a conservative factor on :data:`CROSSINGS`. Measured on the H200
#: (bench/NOTES.md, eighteenth session; linear between 1% and 2%): at 16384 tokens of the
#: standard widths the gated block's crossing moves from about 1.27% to 1.7% and the
#: non-gated one's from 1.07% to 1.6%; with d_model 4096 the e4m3 blocks still run 1.29x /
#: 1.11x dense at 1%, past their 2-byte crossings of then 0.85% / 0.61%.
E4M3_CROSSING_FACTOR = 1.3


def breakeven_for(
    given: float | None, kind: str, tokens: int, d_model: int, d_ff: int, e4m3_rows: bool = False
) -> float:
    """A plan's or module's break-even for one call: ``given`` when the caller set one, else
    :func:`dense_breakeven` of its widths and the call's tokens (times
    :data:`E4M3_CROSSING_FACTOR` when ``e4m3_rows``: every gathered weight row is fp8)."""
    if given is not None:
        return given
    return dense_breakeven(kind, tokens, d_model, d_ff) * (E4M3_CROSSING_FACTOR if e4m3_rows else 1.0)


@functools.lru_cache(maxsize=256)  # a pure function of its arguments, asked once per call
def dense_breakeven(kind: str, m: int, d_model: int, d_ff: int) -> float:
    """Density above which ``dispatch="auto"`` runs block ``kind`` ("ffn" or "gated_ffn") dense for
    ``m`` tokens of width ``d_model`` and hidden width ``d_ff``: the crossings of the nearest
    measured widths (:data:`CROSSINGS`), interpolated linearly in log2 of the tokens and held at
    the ends of the measured range."""
    points = CROSSINGS[_family(d_model, d_ff)][kind]
    x = math.log2(max(m, 1))
    xs = [math.log2(t) for t, _ in points]
    if x <= xs[0]:
        return points[0][1]
    for i in range(1, len(points)):
        x0, x1, d0, d1 = xs[i - 1], xs[i], points[i - 1][1], points[i][1]
        if x <= x1:
            return d0 + (d1 - d0) * (x - x0) / (x1 - x0)
    return points[-1][1]
