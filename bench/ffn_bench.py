"""FFN benchmarks on the GPU: dense vs twellsparse, measured side by side in one run.

The standard problem of TARGETS.md: bf16, d_model 2048, d_ff 5632, M 16384 tokens, gated
``(relu(x Wg^T) * (x Wu^T)) Wd^T`` and non-gated ``relu(x Wu^T) Wd^T``, uniform and skewed firing
patterns. The dense baselines run through torch (cuBLAS) when torch is installed, else through
twellsparse's own cuBLAS call. Every timed op is first checked against the dense result. The
ops are timed in rounds (one repetition of each per round, ``Timer.interleaved``), so that a
drift of the card's clocks during a case reaches the dense and the sparse side alike; records
before the fortieth session timed them one after the other.

Usage: python bench/ffn_bench.py [--quick] [--m 16384] [--d-model 2048] [--d-ff 5632]
                                 [--densities 0.005,0.01,0.02] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import cupy as cp

import twellsparse as ts
from twellsparse import _gpu_ops, _gpu_producer, _stationary
from twellsparse._environment import append_records, environment
from twellsparse._gpu_ops import gemm_nt
from twellsparse._timing import Timer
from twellsparse.testing import ffn_problem, rel_error

#: Speed-ups a record reports: name -> (the baseline's row, the row it is the speed-up of).
SPEEDUPS = {
    "producer_vs_gemm": ("dense_gemm", "producer"),
    "spmm_vs_dense_down": ("dense_down", "spmm_down"),
    **{name: ("dense_ffn", name) for name in ("ffn", "ffn_auto", "ffn_e4m3", "ffn_e4m3_auto")},
    **{
        name: ("dense_gated_ffn", name)
        for name in ("gated_ffn", "gated_ffn_auto", "gated_ffn_e4m3", "gated_ffn_e4m3_auto")
    },
    # Against the library's own dense path (cuBLASLt GEMMs timed per shape, a fused act-mul),
    # the stronger baseline where it beats torch's unfused block.
    "gated_ffn_vs_dense_plan": ("dense_gated_ffn_plan", "gated_ffn"),
    "ffn_vs_dense_plan": ("dense_ffn_plan", "ffn"),
    "dense_plan_vs_torch_gated": ("dense_gated_ffn", "dense_gated_ffn_plan"),
    "dense_plan_vs_torch": ("dense_ffn", "dense_ffn_plan"),
}


def speedups(rows: dict[str, dict[str, float]], pairs: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Baseline median over the row's median for each named pair of timed rows."""
    return {name: rows[base]["median"] / rows[row]["median"] for name, (base, row) in pairs.items()}


def dense_provider() -> tuple[str, Callable[[Any, Any], Callable[[], Any]]]:
    """(name, prepare) for the dense baseline: torch if available, else cuBLAS through CuPy.
    ``prepare(x, w)`` returns the zero-argument ``x @ w.T`` to time: the operands are imported
    into torch once, outside the timed call, as the FFN rows' are."""
    try:
        import torch
    except ImportError:
        return "cublas-cupy", lambda x, w: lambda: gemm_nt(x, w)
    if not torch.cuda.is_available():
        return "cublas-cupy", lambda x, w: lambda: gemm_nt(x, w)

    def torch_nt(x: Any, w: Any) -> Callable[[], Any]:
        tx, tw = torch.from_dlpack(x), torch.from_dlpack(w)
        return lambda: tx @ tw.T

    return f"torch-{torch.__version__}", torch_nt


def dense_ffns(x: Any, wg: Any, wu: Any, wd: Any, provider: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(gated, non-gated) dense FFNs: torch (3 GEMMs + elementwise), or cuBLAS through CuPy."""
    if provider.startswith("cublas"):

        def gated() -> Any:
            return gemm_nt(cp.maximum(gemm_nt(x, wg), 0) * gemm_nt(x, wu), wd)

        def plain() -> Any:
            return gemm_nt(cp.maximum(gemm_nt(x, wg), 0), wd)

        return gated, plain
    import torch

    tx, twg, twu, twd = (torch.from_dlpack(a) for a in (x, wg, wu, wd))

    def torch_gated() -> Any:
        return (torch.relu(tx @ twg.T) * (tx @ twu.T)) @ twd.T

    def torch_plain() -> Any:
        return torch.relu(tx @ twg.T) @ twd.T

    return torch_gated, torch_plain


def with_setting(module: Any, name: str, value: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with ``module.<name>`` set to ``value`` (restored after)."""

    def run() -> Any:
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn()
        finally:
            setattr(module, name, saved)

    return run


def bench_case(args: argparse.Namespace, pattern: str, density: float, timer: Timer, hidden: Timer) -> dict[str, Any]:
    """Check, then time, every op for one activation pattern and density; the main rows also
    with the host hidden (``hidden``: the GPU's work alone, as a CUDA graph replays it)."""

    def ms(fn: Callable[[], Any]) -> dict[str, float]:
        return timer(fn)[1]

    provider, prepare_nt = dense_provider()
    p = ffn_problem(args.m, args.d_model, args.d_ff, density, pattern, ts.bfloat16, 0, cp)
    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    dense_gated, dense_plain = dense_ffns(x, wg, wu, wd, provider)
    gated_plan = ts.GatedFFN(wg, wu, wd, dispatch="sparse")
    plain_plan = ts.FFN(wg, wd, dispatch="sparse")
    gated_auto = ts.GatedFFN(wg, wu, wd, dispatch="auto")  # dense remainder above the break-even
    plain_auto = ts.FFN(wg, wd, dispatch="auto")
    gated_dense_plan = ts.GatedFFN(wg, wu, wd, dispatch="dense")  # the library's own dense path
    plain_dense_plan = ts.FFN(wg, wd, dispatch="dense")
    # Opt-in and lossy: the gathered weight rows (W_down's, and the gated block's W_up) in fp8 e4m3.
    gated_e4m3 = ts.GatedFFN(wg, wu, wd, dispatch="sparse", down_format="e4m3", up_format="e4m3")
    plain_e4m3 = ts.FFN(wg, wd, dispatch="sparse", down_format="e4m3")
    # The same with auto: dense (decoded weights) above the e4m3 break-even (_dispatch.E4M3_CROSSING_FACTOR).
    gated_e4m3_auto = ts.GatedFFN(wg, wu, wd, dispatch="auto", down_format="e4m3", up_format="e4m3")
    plain_e4m3_auto = ts.FFN(wg, wd, dispatch="auto", down_format="e4m3")
    wd_t = cp.ascontiguousarray(wd.T)
    h = ts.linear_to_twell(x, wg)
    h_dense = h.toarray()
    z = gemm_nt(x, wg)
    h_out = cp.empty((args.m, args.d_model), dtype=x.dtype)
    ref_gated = cp.from_dlpack(dense_gated())
    ref_plain = cp.from_dlpack(dense_plain())
    errors = {
        "gated_ffn": rel_error(gated_plan(x), ref_gated),
        "ffn": rel_error(plain_plan(x), ref_plain),
        "spmm": rel_error(ts.matmul(h, wd_t), ref_plain),
        "producer": rel_error(h_dense, cp.maximum(z, 0)),
        "gated_ffn_auto": rel_error(gated_auto(x), ref_gated),
        "ffn_auto": rel_error(plain_auto(x), ref_plain),
        "dense_gated_ffn_plan": rel_error(gated_dense_plan(x), ref_gated),
        "dense_ffn_plan": rel_error(plain_dense_plan(x), ref_plain),
    }
    # e4m3 rows move each weight by up to 2**-4 of itself: a few percent against the bf16 block.
    errors["gated_ffn_e4m3"] = rel_error(gated_e4m3(x), ref_gated)
    errors["ffn_e4m3"] = rel_error(plain_e4m3(x), ref_plain)
    errors["gated_ffn_e4m3_auto"] = rel_error(gated_e4m3_auto(x), ref_gated)
    errors["ffn_e4m3_auto"] = rel_error(plain_e4m3_auto(x), ref_plain)
    for name, err in errors.items():
        if not err < (6e-2 if "e4m3" in name else 2e-2):
            raise SystemExit(f"{name}: relative error {err:.3e} vs dense at {pattern} {density}; not timing")
    dense_gemm, dense_down = prepare_nt(x, wg), prepare_nt(h_dense, wd)
    # Timed in rounds (Timer.interleaved): each ratio's two sides see the same drift of the clocks.
    timed_rows = {
        "dense_gemm": dense_gemm,
        "producer": lambda: ts.linear_to_twell(x, wg),
        "gemm_cupy_cublas": lambda: gemm_nt(x, wg),
        "pack_relu": lambda: ts._convert.dense_to_twell(z, 256, 32, "spill", None, "relu"),
        "spmm_down": lambda: ts.matmul(h, wd_t),
        "dense_down": dense_down,
        "dense_ffn": dense_plain,
        "ffn": lambda: plain_plan(x),
        "dense_gated_ffn": dense_gated,
        "gated_ffn": lambda: gated_plan(x),
        "dense_gated_ffn_plan": lambda: gated_dense_plan(x),
        "dense_ffn_plan": lambda: plain_dense_plan(x),
        "gated_ffn_auto": lambda: gated_auto(x),
        "ffn_auto": lambda: plain_auto(x),
        "gated_ffn_e4m3": lambda: gated_e4m3(x),
        "ffn_e4m3": lambda: plain_e4m3(x),
        "gated_ffn_e4m3_auto": lambda: gated_e4m3_auto(x),
        "ffn_e4m3_auto": lambda: plain_e4m3_auto(x),
    }
    rows = {name: stats for name, (_, stats) in timer.interleaved(timed_rows, keep=False).items()}
    main = (
        "dense_gemm",
        "producer",
        "dense_ffn",
        "ffn",
        "dense_gated_ffn",
        "gated_ffn",
        "dense_gated_ffn_plan",
        "dense_ffn_plan",
        "gated_ffn_auto",
        "ffn_auto",
    )
    gpu_only = {
        name: stats for name, (_, stats) in hidden.interleaved({k: timed_rows[k] for k in main}, keep=False).items()
    }

    def variant_rows() -> None:
        """Kernel variants under development: each checked against the default path first; a
        failure is recorded instead of stopping the benchmark."""
        ref_down = ts.matmul(h, wd_t)
        ref_up = _gpu_ops.sddmm(h.parts, h.tile_n, x, wu, True, path="portable").data
        ref_gated = gated_plan(x)
        ref_plain_plan = plain_plan(x)
        packed = _stationary.pack(h.parts, h.tile_n, h.shape[1])
        variants = {
            "spmm_down_portable": (lambda: _gpu_ops.spmm(h.parts, h.tile_n, wd_t, h_out, path="portable"), ref_down),
            "spmm_down_gather_4x4": (
                lambda: _gpu_ops.spmm(h.parts, h.tile_n, wd_t, h_out, path="gather", variant=(4, 4)),
                ref_down,
            ),
            # The weight-stationary SpMM: with its pack, the pack alone, the kernel alone, and the
            # non-gated plan taking it for its down projection.
            "spmm_down_stationary": (
                lambda: _gpu_ops.spmm(h.parts, h.tile_n, wd_t, h_out, path="stationary"),
                ref_down,
            ),
            "stationary_pack": (lambda: _stationary.pack(h.parts, h.tile_n, h.shape[1]), None),
            "spmm_down_stationary_kernel": (
                lambda: _stationary.packed_spmm(*packed, h.shape[1], wd_t, h_out),
                ref_down,
            ),
            "ffn_stationary": (with_setting(_stationary, "PREFERRED", True, lambda: plain_plan(x)), ref_plain_plan),
            "gated_consumer": (lambda: _gpu_ops.gated_consumer(h.parts, h.tile_n, x, wu, wd_t)[0], ref_gated),
            "gated_consumer_8x2": (
                lambda: _gpu_ops.gated_consumer(h.parts, h.tile_n, x, wu, wd_t, variant=(8, 2))[0],
                ref_gated,
            ),
            "sddmm_up_gather": (lambda: _gpu_ops.sddmm(h.parts, h.tile_n, x, wu, True, path="gather").data, ref_up),
            "sddmm_up_gather_8x2": (
                lambda: _gpu_ops.sddmm(h.parts, h.tile_n, x, wu, True, path="gather", variant=(8, 2)).data,
                ref_up,
            ),
            "sddmm_up_portable": (lambda: _gpu_ops.sddmm(h.parts, h.tile_n, x, wu, True, path="portable").data, None),
            # The GEMM, then the pack scanning its whole output (the cuBLASLt ReLU-mask producer off).
            "producer_dense_scan": (
                with_setting(_gpu_producer, "ENABLED", False, lambda: ts.linear_to_twell(x, wg)),
                h_dense,
            ),
            "gated_ffn_mask_consumer": (
                with_setting(_gpu_producer, "MASK_CONSUMER", True, lambda: gated_plan(x)),
                ref_gated,
            ),
            "ffn_mask_consumer": (
                with_setting(_gpu_producer, "MASK_CONSUMER", True, lambda: plain_plan(x)),
                ref_plain_plan,
            ),
        }
        for name, (fn, expect) in variants.items():
            try:
                if expect is not None:
                    got = fn()
                    err = rel_error(got.toarray() if hasattr(got, "toarray") else got, expect)
                    if not err < 2e-2:
                        raise ValueError(f"relative error {err:.3e} against the default path")
                rows[name] = ms(fn)
            except Exception as exc:  # record and go on: the default paths above are what is reported
                rows[name] = {"error": f"{type(exc).__name__}: {exc}"}

    if not args.no_variants:
        variant_rows()
    return {
        "kind": "ffn",
        "dense_provider": provider,
        "shape": [args.m, args.d_model, args.d_ff],
        "dtype": "bfloat16",
        "pattern": pattern,
        "density_target": density,
        "density": h.nnz / (args.m * args.d_ff),
        "n_spilled": h.n_spilled,
        "ms": rows,
        "speedup": speedups(rows, SPEEDUPS),
        "ms_gpu_only": gpu_only,
        "speedup_gpu_only": speedups(gpu_only, {k: v for k, v in SPEEDUPS.items() if v[1] in gpu_only}),
        "auto_path": gated_auto.last_stats.get("path"),
        "ffn_auto_path": plain_auto.last_stats.get("path"),
        "e4m3_auto_paths": [gated_e4m3_auto.last_stats.get("path"), plain_e4m3_auto.last_stats.get("path")],
        "rel_error_vs_dense": errors,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    timer = Timer(args.reps, on_gpu=True, flush_l2=True)
    hidden = Timer(args.reps, on_gpu=True, flush_l2=True, hide_host=True)
    env = environment()
    records = []
    for pattern in args.patterns:
        for density in args.densities:
            rec = {**bench_case(args, pattern, density, timer, hidden), **env, "reps": args.reps}
            if args.quick:
                rec["smoke"] = True
            records.append(rec)
            append_records(args.out, [rec])  # case by case: a run stopped midway keeps its cases
            print(summary_line(rec), flush=True)
    return records


def summary_line(rec: dict[str, Any]) -> str:
    """One line per case: medians in ms, speed-ups over dense in parentheses."""
    ms = {k: v["median"] for k, v in rec["ms"].items() if "median" in v}  # failed variants hold an error
    sp = rec["speedup"]
    return " | ".join(
        [
            f"{rec['pattern']:>7} {rec['density']:7.3%}",
            f"gemm {ms['dense_gemm']:.3f} producer {ms['producer']:.3f} ({1 / sp['producer_vs_gemm']:.2f}x time)",
            f"down dense {ms['dense_down']:.3f} twell {ms['spmm_down']:.3f} ({sp['spmm_vs_dense_down']:.2f}x)",
            f"ffn dense {ms['dense_ffn']:.3f} twell {ms['ffn']:.3f} ({sp['ffn']:.2f}x)",
            f"gated dense {ms['dense_gated_ffn']:.3f} twell {ms['gated_ffn']:.3f} ({sp['gated_ffn']:.2f}x)",
        ]
        + ([gpu_only_summary(rec["speedup_gpu_only"])] if "speedup_gpu_only" in rec else [])
        + ([e4m3_summary(rec)] if "gated_ffn_e4m3" in ms else [])
    )


def e4m3_summary(rec: dict[str, Any]) -> str:
    """The plans with fp8 e4m3 rows: speed-ups over dense and relative errors against it."""
    sp, err = rec["speedup"], rec["rel_error_vs_dense"]
    return (
        f"e4m3 rows: ffn {sp['ffn_e4m3']:.2f}x (error {err['ffn_e4m3']:.1e}), "
        f"gated {sp['gated_ffn_e4m3']:.2f}x (error {err['gated_ffn_e4m3']:.1e})"
        + (
            f"; auto ffn {sp['ffn_e4m3_auto']:.2f}x, gated {sp['gated_ffn_e4m3_auto']:.2f}x"
            f" (paths {'/'.join(str(p) for p in rec.get('e4m3_auto_paths', []))})"
            if "ffn_e4m3_auto" in sp
            else ""
        )
    )


def gpu_only_summary(sp: dict[str, float]) -> str:
    """The speed-ups with the host hidden (GPU work alone)."""
    return (
        f"gpu only: producer {1 / sp['producer_vs_gemm']:.2f}x time, ffn {sp['ffn']:.2f}x, gated {sp['gated_ffn']:.2f}x"
        + (f", auto ffn {sp['ffn_auto']:.2f}x, gated {sp['gated_ffn_auto']:.2f}x" if "ffn_auto" in sp else "")
    )


def profile_once(args: argparse.Namespace) -> None:
    """Run each sparse op once after a warm-up (for ``ncu --launch-skip``-free profiling)."""
    p = ffn_problem(args.m, args.d_model, args.d_ff, args.densities[0], args.patterns[0], ts.bfloat16, 0, cp)
    plan = ts.GatedFFN(p["w_gate"], p["w_up"], p["w_down"])
    plan(p["x"])
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    plan(p["x"])
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--densities", default="0.005,0.01,0.02")
    ap.add_argument("--patterns", default="uniform,skewed")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="small problem, few reps (smoke test)")
    ap.add_argument("--no-variants", action="store_true", help="the main and auto rows only (no kernel variants)")
    ap.add_argument("--profile", action="store_true", help="one call of each sparse op, for ncu")
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args(argv)
    args.densities = [float(d) for d in args.densities.split(",")]
    args.patterns = args.patterns.split(",")
    if args.quick:
        args.m, args.d_model, args.d_ff, args.reps = 1024, 256, 1024, 3
    if args.profile:
        profile_once(args)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
