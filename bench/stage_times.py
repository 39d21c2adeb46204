"""Where the sparse paths' time goes: each stage of the standard problem timed twice, with the
usual CUDA events (host launch gaps included, as an eager call sees them) and with the host
hidden (``Timer(hide_host=True)``: a spin kernel ahead of the start event lets the host queue
the whole stage first, so the events see the GPU's work alone, as a CUDA graph would).

    python bench/stage_times.py [--density 0.01] [--m 16384] [--out FILE.jsonl]

Stages: the plain cuBLASLt GEMM, the ReLU-mask GEMM, the mask pack (pass 1 and its overflow
read-back; with vector stores from shared memory and with scalar stores), the fixed spill's
layout (two launches, and the CuPy operations it replaced), the fused Hopper producer's pass 1,
linear_to_twell (with the default producer and with the cuBLASLt one), gated and
non-gated plan calls (also with a fixed spill capacity: no read-back), the gated consumer, and
the training backward's pieces (SDDMM, value products, the transposed pattern, the three
transposed products, dX as the dual pass).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from twellsparse import _stationary, _tiled_spmm, _tiled_up
from twellsparse._environment import append_records, environment
from twellsparse._timing import Timer
from twellsparse.testing import ffn_problem


def stages(density: float, m: int, pattern: str, d_model: int = 2048, d_ff: int = 5632) -> tuple[float, dict[str, Any]]:
    """(the problem's measured gate density, name -> zero-argument call of each stage)."""
    import cupy as cp

    import twellsparse as ts
    from twellsparse import (
        _dense_transpose,
        _gpu_convert,
        _gpu_ops,
        _gpu_producer,
        _hopper_producer,
        _stationary,
        _tiled_ffn,
        _tiled_up,
    )
    from twellsparse._ops import gated_product, matmul, matmul_sum, product_values, sddmm, transposed_products
    from twellsparse._reference import fixed_spill_layout

    p = ffn_problem(m, d_model, d_ff, density, pattern, ts.bfloat16, 0, cp)
    x, wg, wu, wd = (p[k] for k in ("x", "w_gate", "w_up", "w_down"))
    wd_t = cp.ascontiguousarray(wd.T)
    go = cp.random.default_rng(1).standard_normal((m, d_model), dtype=cp.float32).astype(x.dtype)
    plans = {
        "gated": ts.GatedFFN(wg, wu, wd, dispatch="sparse"),
        "plain": ts.FFN(wg, wd, dispatch="sparse"),
        "gated_fixed_spill": ts.GatedFFN(wg, wu, wd, dispatch="sparse", spill_capacity=m * 64),
        "plain_fixed_spill": ts.FFN(wg, wd, dispatch="sparse", spill_capacity=m * 64),
        "plain_auto": ts.FFN(wg, wd),  # the default dispatch: dense above the break-even
        # W_down's rows in fp8 e4m3 (opt-in, lossy): the down projection gathers half the bytes.
        "gated, e4m3 down": ts.GatedFFN(wg, wu, wd, dispatch="sparse", down_format="e4m3"),
        "gated, e4m3 up and down": ts.GatedFFN(wg, wu, wd, dispatch="sparse", down_format="e4m3", up_format="e4m3"),
        "plain, e4m3 down": ts.FFN(wg, wd, dispatch="sparse", down_format="e4m3"),
    }
    h_relu, mask, words = _gpu_producer.relu_linear(x, wg)
    g = ts.linear_to_twell(x, wg)
    measured = g.nnz / max(m * d_ff, 1)
    wd_e4m3, wu_e4m3 = ts.quantize_rows(wd_t), ts.quantize_rows(wu)
    down_out = cp.empty((m, wd_t.shape[1]), dtype=x.dtype)
    _, u = gated_product(x, wu, wd_t, g, keep_up=True)
    d_h = sddmm(go, wd_t, g)
    h, d_z, d_u = product_values(g, u), product_values(d_h, u), product_values(d_h, g)
    dx_out, dual = cp.empty((m, d_model), dtype=x.dtype), (d_u.parts, wu)  # dX's output and second product

    packs: dict[str, Any] = {}

    def down_pack() -> Any:  # the tiled SpMM's pack of g, made once (the packed row times the kernel alone)
        if "down" not in packs:
            packs["down"] = _tiled_spmm.pack(g.parts, g.tile_n, g.shape[1])
        return packs["down"]

    def fixed_spill_finish() -> Any:  # the fused producer's fixed-spill finish (layout, pass 2) alone
        if "finish" not in packs:
            packs["finish"] = _hopper_producer.linear_to_parts_deferred(x, wg, "relu", 256, 32, None)[1]
        return packs["finish"]("spill", spill_capacity=m * 8)

    def tiled_up_by_density() -> Any:  # as a plan runs it: token blocks sized from the density
        return _with_density(measured, lambda: _gpu_ops.gated_up(g.parts, g.tile_n, x, wu, path="tiled"))

    def tiled_bwd_by_density() -> Any:  # the backward takes its forward's density likewise
        return _with_density(
            measured, lambda: _gpu_ops.sddmm_gated_backward(g.parts, g.tile_n, go, wd_t, u.parts, path="tiled")
        )

    def three_products() -> Any:  # the backward's dW_down, dW_gate and dW_up on one pattern
        return transposed_products(g, [(h, go), (d_z, x), (d_u, x)])

    return measured, {
        "gemm (cuBLASLt)": lambda: _gpu_ops.gemm_nt(x, wg),
        "relu-mask gemm": lambda: _gpu_producer.relu_linear(x, wg),
        "relu gemm (cuBLASLt)": lambda: _gpu_ops.gemm_nt(x, wg, relu=True),  # the dense remainder's two GEMMs
        # The same as torch's dense block runs it: the plain GEMM, then relu as its own pass.
        "gemm then relu (cuBLASLt, CuPy)": lambda: (lambda z: cp.maximum(z, 0, out=z))(_gpu_ops.gemm_nt(x, wg)),
        "down gemm (cuBLASLt)": lambda: _gpu_ops.gemm_nt(h_relu, wd),
        "mask pack, exact finish": lambda: _gpu_convert.relu_mask_to_parts_deferred(h_relu, mask, words, 256, 32)[1](
            "spill"
        ),
        "mask pack, scalar stores, exact finish": lambda: _gpu_convert.relu_mask_to_parts_deferred(
            h_relu, mask, words, 256, 32, staged=False
        )[1]("spill"),
        "spill layout (two launches)": lambda: _gpu_convert.spill_layout(g.parts.counts, 32, m * 64),
        "spill layout (CuPy operations)": lambda: fixed_spill_layout(g.parts.counts, 32, m * 64, xp=cp),
        "fused producer, fixed-spill finish": fixed_spill_finish,
        "linear_to_twell": lambda: ts.linear_to_twell(x, wg),
        "fused producer, pass 1": lambda: _hopper_producer.linear_to_parts_deferred(x, wg, "relu", 256, 32, None),
        # The other schedules of the same kernel (the default is in the line above).
        **{
            f"fused producer, pass 1, {schedule} schedule": (
                lambda schedule=schedule: _with(
                    _hopper_producer,
                    "SCHEDULE",
                    schedule,
                    lambda: _hopper_producer.linear_to_parts_deferred(x, wg, "relu", 256, 32, None),
                )
            )
            for schedule in _hopper_producer.SCHEDULES
            if schedule != _hopper_producer.SCHEDULE
        },
        "linear_to_twell, cuBLASLt producer": lambda: _without_fused_producer(lambda: ts.linear_to_twell(x, wg)),
        "gated consumer": lambda: _gpu_ops.gated_consumer(g.parts, g.tile_n, x, wu, wd_t),
        "gated consumer (8, 2)": lambda: _gpu_ops.gated_consumer(g.parts, g.tile_n, x, wu, wd_t, variant=(8, 2)),
        "gated consumer, e4m3 up": lambda: _gpu_ops.gated_consumer(g.parts, g.tile_n, x, wu_e4m3, wd_t),
        "gated consumer, e4m3 up (8, 2)": lambda: _gpu_ops.gated_consumer(
            g.parts, g.tile_n, x, wu_e4m3, wd_t, variant=(8, 2)
        ),
        "up sddmm": lambda: sddmm(x, wu, g),
        # The gated consumer's up projection alone, by each kernel (the tiled one per block size).
        "gated up, gather": lambda: _gpu_ops.gated_up(g.parts, g.tile_n, x, wu, path="gather"),
        **{
            f"gated up, tiled {tokens}": (
                lambda tokens=tokens: _with(
                    _tiled_up, "TOKENS", tokens, lambda: _gpu_ops.gated_up(g.parts, g.tile_n, x, wu, path="tiled")
                )
            )
            for tokens in (192, 208, 256, 320, 336, 384, 448, 512, 576, 640, 704, 768, 800)
        },
        # As a plan runs it: its token blocks sized from the density (_tiled_up.block_tokens).
        "gated up, tiled by density": tiled_up_by_density,
        # The same with x's fragment loaded per tile (TWELL_TILED_UP_SHARED_B=0; once a quad is
        # the default since the forty-first session).
        "gated up, tiled by density, x per tile": lambda: _with(_tiled_up, "SHARED_B", False, tiled_up_by_density),
        # In clusters of two blocks sharing x's slices (TWELL_TILED_UP_PAIRS, forty-fourth session).
        "gated up, tiled by density, pairs": lambda: _with(_tiled_up, "PAIRS", True, tiled_up_by_density),
        "tiled up pack": lambda: _tiled_up.pack(g.parts, g.tile_n, d_ff, *_tiled_up.geometry(m, d_ff)),
        "down spmm": lambda: matmul(g, wd_t),
        "down spmm, gather": lambda: _gpu_ops.spmm(g.parts, g.tile_n, wd_t, down_out, path="gather"),
        "down spmm, gather (4, 4)": lambda: _gpu_ops.spmm(
            g.parts, g.tile_n, wd_t, down_out, path="gather", variant=(4, 4)
        ),
        # W_down.T's rows in fp8 e4m3 with row scales (opt-in, lossy): half the bytes gathered.
        "down spmm, e4m3 rows": lambda: _gpu_ops.spmm_e4m3(g.parts, g.tile_n, wd_e4m3.data, wd_e4m3.scales, down_out),
        "down spmm, e4m3 rows (4, 4)": lambda: _gpu_ops.spmm_e4m3(
            g.parts, g.tile_n, wd_e4m3.data, wd_e4m3.scales, down_out, variant=(4, 4)
        ),
        "down spmm, stationary": lambda: _stationary.spmm(g.parts, g.tile_n, wd_t, down_out),
        "stationary pack": lambda: _stationary.pack(g.parts, g.tile_n, g.shape[1]),
        # The tensor-core SpMM (opt-in): with its pack, the pack alone, the product on a pack.
        "down spmm, tiled": lambda: _tiled_spmm.spmm(g.parts, g.tile_n, wd_t, down_out),
        "tiled spmm pack": lambda: _tiled_spmm.pack(g.parts, g.tile_n, g.shape[1]),
        "down spmm, tiled, packed": lambda: _tiled_spmm.packed_spmm(down_pack(), m, wd_t, down_out),
        "tiled spmm fragments": lambda: _tiled_spmm.fragments(down_pack()),  # part of the packed row
        # The gated consumer on one pack (opt-in): whole, and its up projection on a pack.
        "gated consumer, one pack": lambda: _tiled_ffn.gated_consumer(g.parts, g.tile_n, x, wu, wd_t, down_out),
        "gated up, one pack, packed": lambda: _tiled_ffn.gated_up_words(down_pack(), m, x, wu),
        "gated up, one pack, packed, pairs": lambda: _with(
            _tiled_ffn, "PAIRS", True, lambda: _tiled_ffn.gated_up_words(down_pack(), m, x, wu)
        ),
        **{f"plan {name}": (lambda plan=plan: plan(x)) for name, plan in plans.items()},
        "bwd sddmm": lambda: sddmm(go, wd_t, g),
        "bwd value products": lambda: (product_values(g, u), product_values(d_h, u), product_values(d_h, g)),
        # The sampled product with the three value products fused in (the training step's), by
        # each kernel: the row gathers, and the tiled up projection's backward form (its blocks
        # sized from the density, as the backward takes the forward's).
        "bwd fused sddmm, gather": lambda: _gpu_ops.sddmm_gated_backward(
            g.parts, g.tile_n, go, wd_t, u.parts, path="gather"
        ),
        "bwd fused sddmm, tiled by density": tiled_bwd_by_density,
        "bwd fused sddmm, tiled by density, pairs": lambda: _with(_tiled_up, "PAIRS", True, tiled_bwd_by_density),
        "bwd transposed pattern": lambda: _gpu_ops.transposed_pattern(g.parts, g.tile_n, g.shape[1]),
        "bwd 3 transposed products": three_products,
        # One warp per output row (the column split is the default since the thirty-third session).
        "bwd 3 transposed products, columns whole": lambda: _with(
            _gpu_ops, "TRANSPOSED_COLUMN_SPLIT", 1, three_products
        ),
        # The long rows of A.T (hot units) left whole, one warp's work each (the cut into runs
        # of several warps is the default since the thirty-fifth session).
        "bwd 3 transposed products, rows whole": lambda: _with(
            _gpu_convert, "TRANSPOSED_SEGMENT_SLOTS", 0, three_products
        ),
        # The same on the tensor cores (opt-in): one pack of the transpose from the parts (no
        # transposed structure), 3 launches; and that pack alone.
        "bwd 3 transposed products, tiled": lambda: _with(_tiled_spmm, "PREFERRED", True, three_products),
        "tiled transposed pack": lambda: _tiled_spmm.pack_transposed(
            h.parts, g.tile_n, g.shape[1], (d_z.parts, d_u.parts)
        ),
        "bwd dX": lambda: matmul_sum(d_z, wg, d_u, wu),  # the backward's one dual pass, as chosen
        # Its two kernels, each forced: the row gathers' dual pass and the stationary dual form.
        "bwd dX, gather": lambda: _gpu_ops.spmm(d_z.parts, d_z.tile_n, wg, dx_out, path="gather", second=dual),
        "bwd dX, stationary dual": lambda: _stationary.spmm(d_z.parts, d_z.tile_n, wg, dx_out, second=dual),
        "stationary pack, dual": lambda: _stationary.pack(d_z.parts, d_z.tile_n, d_z.shape[1], second=dual[0]),
        "bwd dX, tiled dual": lambda: _tiled_spmm.spmm(d_z.parts, d_z.tile_n, wg, dx_out, second=dual),
        # The gated backward on one pack (opt-in): d_h, d_z, d_u, h and dX (the gathers' fused
        # SDDMM and "bwd dX" above do the same work).
        "bwd one pack (sddmm and dX)": lambda: _tiled_ffn.gated_backward(g.parts, g.tile_n, go, wd_t, u.parts, wg, wu),
        # W_down (d_model x d_ff) into the kernels' layout, as the torch adapter makes it once a
        # forward and three times a training step: CuPy's copy, the library's kernel, torch's copy.
        "w_down transpose, cupy": lambda: cp.ascontiguousarray(wd.T),
        "w_down transpose, kernel": lambda: _dense_transpose.transpose(wd),
        **_torch_transpose(wd),
    }


def _with_density(density: float, fn: Any) -> Any:
    """``fn()`` inside ``_stationary.expected_density(density)`` (as a plan's tail runs)."""
    from twellsparse import _stationary

    with _stationary.expected_density(density):
        return fn()


def _with(module: Any, name: str, value: Any, fn: Any) -> Any:
    """``fn()`` with ``module.<name>`` set to ``value`` (restored after)."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        return fn()
    finally:
        setattr(module, name, saved)


def _torch_transpose(w: Any) -> dict[str, Any]:
    """The torch adapter's own copy of ``w.T`` (a strided copy) as a stage, where torch with CUDA
    is installed; nothing otherwise."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    t = torch.from_dlpack(w)
    return {"w_down transpose, torch": lambda: t.t().contiguous()}


def _without_fused_producer(fn: Any) -> Any:
    from twellsparse import _hopper_producer

    return _with(_hopper_producer, "ENABLED", False, fn)


def selected(name: str, only: str, names: Any) -> bool:
    """Whether ``--only`` picks stage ``name``: whole stage names separated by semicolons pick
    those stages alone, as does one whole name (a profiler run after its kernel's launches must
    not catch another stage's: "gated up, tiled by density" split at its comma would pick every
    "gated up" row); otherwise each comma-separated piece picks the stages whose names contain it
    (none: every stage)."""
    if ";" in only:
        return name in only.split(";")
    if only in names:
        return name == only
    wanted = [w for w in only.split(",") if w]
    return not wanted or any(w in name for w in wanted)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--pattern", default="uniform")
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument(
        "--only",
        default="",
        help="whole stage names separated by ';' (names hold commas), or comma-separated substrings: "
        "time only those stages",
    )
    args = ap.parse_args(argv)
    eager = Timer(args.reps, on_gpu=True, flush_l2=True)
    hidden = Timer(args.reps, on_gpu=True, flush_l2=True, hide_host=True)
    rows = {}
    measured, calls = stages(args.density, args.m, args.pattern, args.d_model, args.d_ff)
    for name, fn in calls.items():
        if not selected(name, args.only, calls):
            continue
        gpu = hidden(fn)[1]
        e, g = eager(fn)[1]["median"], gpu["median"]
        rows[name] = {"eager_ms": e, "gpu_ms": g, "host_bound_reps": gpu.get("host_bound_reps", 0)}
        print(f"{name:32s} eager {e:7.3f} ms   gpu only {g:7.3f} ms", flush=True)
    rec = {
        "kind": "stages",
        "shape": [args.m, args.d_model, args.d_ff],
        "dtype": "bfloat16",
        "pattern": args.pattern,
        "density_target": args.density,
        "density": measured,
        "stages": rows,
        "l2_hints": os.environ.get("TWELL_L2_HINTS", "default"),  # the gather kernels' build
        "hopper_pack": os.environ.get("TWELL_HOPPER_PACK", "default"),  # 0: the fused GEMM alone
        # 1: the tiled up projection's A fragments in load order (wrong sums, a time only)
        "tiled_up_ordered_a": os.environ.get("TWELL_TILED_UP_ORDERED_A", "default"),
        "fused_producer": os.environ.get("TWELL_FUSED_PRODUCER", "default"),
        # the tiled product's build as resolved (rows of its variants are otherwise alike)
        "tiled_warps": _tiled_spmm.WARPS,
        "tiled_operand": _tiled_spmm.OPERAND,
        "tiled_up_pack_width": _tiled_up.PACK_WIDTH,
        "stationary_pack_width": _stationary.PACK_WIDTH,
        **environment(),
    }
    if args.out:
        append_records(args.out, [rec])
    return 0


if __name__ == "__main__":
    sys.exit(main())
