"""The jitted JAX gated FFN beside the CuPy path, on the standard problem, in one run.

Times ``jax.jit(twellsparse.jax.gated_ffn)`` (the kernels through buffer_callback on XLA's
stream) against ``twellsparse.gated_ffn`` on CuPy arrays, both on the sparse path, and the dense
jnp FFN; checks both against the dense result first. Target (issue: JAX adapter): the JAX path
within 10% of the CuPy one. Run on a GPU with XLA_PYTHON_CLIENT_PREALLOCATE=false.

Usage: python bench/jax_bench.py [--m 16384] [--densities 0.005,0.01] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy as cp
import jax
import jax.numpy as jnp
import numpy as np

import twellsparse as ts
import twellsparse.jax as tsj
from twellsparse._environment import append_records, environment
from twellsparse.testing import ffn_problem, rel_error


def wall_ms(call: Any, wait: Any, reps: int, batch: int = 10) -> dict[str, float]:
    """Median/p10/p90 per-call wall time over ``reps`` batches of ``batch`` back-to-back calls,
    each batch ended by ``wait(result)``: the same clock for the CuPy and the JAX paths (XLA's
    stream is not CuPy's, so CUDA events on one cannot time the other)."""
    for _ in range(3):
        wait(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            result = call()
        wait(result)
        times.append((time.perf_counter() - t0) * 1e3 / batch)
    t = np.asarray(times)
    return {"median": float(np.median(t)), "p10": float(np.percentile(t, 10)), "p90": float(np.percentile(t, 90))}


def _cupy_wait(_: Any) -> None:
    cp.cuda.get_current_stream().synchronize()


def _overhead_rows(args: argparse.Namespace, plan: Any, jargs: tuple) -> dict[str, Any]:
    """Where the JAX path's extra time goes (diagnostics, not library paths): the same jitted
    callback around a plan built once outside it, and a callback that only copies x."""
    from twellsparse.jax import _call

    out_type = jax.ShapeDtypeStruct((args.m, args.d_model), jargs[0].dtype)

    def planned(out: Any, x: Any, *_: Any) -> None:
        plan(x, out=out)

    def copy_only(out: Any, x: Any, *_: Any) -> None:
        out[...] = x

    rows = {}
    for name, body in (("jax_callback_prebuilt_plan", planned), ("jax_callback_copy_only", copy_only)):
        fn = jax.jit(lambda *a, body=body: _call(body, out_type, *a))
        rows[name] = wall_ms(lambda fn=fn: fn(*jargs), jax.block_until_ready, args.reps)
    return rows


def bench_density(args: argparse.Namespace, density: float) -> dict[str, Any]:
    """Check, then time, the three paths at one density."""
    p = ffn_problem(args.m, args.d_model, args.d_ff, density, "uniform", ts.bfloat16, 0, cp)
    weights = (p["w_gate"], p["w_up"], p["w_down"])
    plan = ts.GatedFFN(*weights, dispatch="sparse")
    spill = args.m * 64  # room for 64 spilled entries per token: nothing is left out here
    plan_fixed = ts.GatedFFN(*weights, dispatch="sparse", spill_capacity=spill)
    jargs = tuple(jnp.from_dlpack(a) for a in (p["x"], *weights))  # zero-copy, stays on the GPU
    sparse_jax = jax.jit(lambda *a: tsj.gated_ffn(*a))
    sparse_jax_fixed = jax.jit(lambda *a: tsj.gated_ffn(*a, spill_capacity=spill))
    dense_jit = jax.jit(lambda x, g, u, d: (jax.nn.relu(x @ g.T) * (x @ u.T)) @ d.T)
    ref = np.asarray(dense_jit(*jargs).astype(jnp.float32))
    errors = {
        "jax": rel_error(np.asarray(sparse_jax(*jargs).astype(jnp.float32)), ref),
        "cupy": rel_error(plan(p["x"]).astype(cp.float32), ref),
        "jax_fixed_spill": rel_error(np.asarray(sparse_jax_fixed(*jargs).astype(jnp.float32)), ref),
        "cupy_fixed_spill": rel_error(plan_fixed(p["x"]).astype(cp.float32), ref),
    }
    if not max(errors.values()) < 2e-2:
        raise SystemExit(f"relative errors {errors} against dense at density {density}; not timing")
    rows = {
        "cupy_sparse": wall_ms(lambda: plan(p["x"]), _cupy_wait, args.reps),
        "jax_sparse": wall_ms(lambda: sparse_jax(*jargs), jax.block_until_ready, args.reps),
        "jax_dense": wall_ms(lambda: dense_jit(*jargs), jax.block_until_ready, args.reps),
        # With a fixed spill_capacity neither path reads anything back, so calls queue ahead.
        "cupy_sparse_fixed_spill": wall_ms(lambda: plan_fixed(p["x"]), _cupy_wait, args.reps),
        "jax_sparse_fixed_spill": wall_ms(lambda: sparse_jax_fixed(*jargs), jax.block_until_ready, args.reps),
        **_overhead_rows(args, plan, jargs),
    }
    plan_fixed.check_spill()
    tsj.check_spill()
    return {
        "kind": "jax",
        "shape": [args.m, args.d_model, args.d_ff],
        "density_target": density,
        "density": plan.last_stats.get("density"),
        "ms": rows,
        "jax_vs_cupy": rows["jax_sparse"]["median"] / rows["cupy_sparse"]["median"],
        "jax_vs_cupy_fixed_spill": rows["jax_sparse_fixed_spill"]["median"] / rows["cupy_sparse_fixed_spill"]["median"],
        "rel_error_vs_dense": errors,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--densities", default="0.005,0.01")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    env = environment()
    for density in (float(d) for d in args.densities.split(",")):
        rec = {**bench_density(args, density), **env}
        append_records(args.out, [rec])
        ms = {k: v["median"] for k, v in rec["ms"].items()}
        print(
            f"density {density:.2%}: cupy {ms['cupy_sparse']:.3f} ms, jax {ms['jax_sparse']:.3f} ms "
            f"({rec['jax_vs_cupy']:.2f}x the CuPy time); fixed spill: cupy {ms['cupy_sparse_fixed_spill']:.3f} ms, "
            f"jax {ms['jax_sparse_fixed_spill']:.3f} ms ({rec['jax_vs_cupy_fixed_spill']:.2f}x); "
            f"jax dense {ms['jax_dense']:.3f} ms; callback with a "
            f"prebuilt plan {ms['jax_callback_prebuilt_plan']:.3f} ms, copy-only callback "
            f"{ms['jax_callback_copy_only']:.3f} ms",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
