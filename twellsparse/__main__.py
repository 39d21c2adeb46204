"""Command line: ``python -m twellsparse demo [--cpu]`` and ``python -m twellsparse bench [--quick]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twellsparse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="pack FFN-like activations, multiply, check against dense")
    demo.add_argument("--cpu", action="store_true", help="use the CPU reference path even with a GPU")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", metavar="FILE", help="append the measurements as a JSON line")
    bench = sub.add_parser("bench", help="TwELL vs cuSPARSE and dense: SpMM, conversion, SDDMM, FFN sweeps")
    bench.add_argument("--quick", action="store_true", help="a small problem and two densities")
    bench.add_argument("--cpu", action="store_true", help="time the NumPy reference path (a smoke run)")
    bench.add_argument("--out", default="bench-out", metavar="DIR", help="JSON lines and PNG plots go here")
    bench.add_argument("--ops", help="comma-separated subset of spmm,convert,sddmm,ffn")
    bench.add_argument("--densities", help="comma-separated densities, e.g. 0.005,0.01")
    bench.add_argument("--m", help="comma-separated token counts M")
    bench.add_argument("--d-ff", help="comma-separated widths of the sparse dimension (d_ff), e.g. 5632,14336")
    bench.add_argument("--d-model", type=int, help="the dense dimension (d_model)")
    bench.add_argument("--dtype", help="bfloat16, float16, float32 or float64")
    bench.add_argument("--reps", type=int, help="timed repetitions per case")
    bench.add_argument("--pattern", choices=("uniform", "skewed"), help="activation pattern")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import run_demo

        run_demo(force_cpu=args.cpu, seed=args.seed, json_path=args.json)
    elif args.command == "bench":
        return _bench(args)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import dataclasses
    import pathlib

    from . import _microbench as mb

    cfg = mb.default_config(quick=args.quick, cpu=args.cpu)
    overrides = {
        "ops": tuple(args.ops.split(",")) if args.ops else None,
        "densities": tuple(float(d) for d in args.densities.split(",")) if args.densities else None,
        "ms": tuple(int(m) for m in args.m.split(",")) if args.m else None,
        "ns": tuple(int(n) for n in args.d_ff.split(",")) if args.d_ff else None,
        "k": args.d_model,
        "dtype": args.dtype,
        "reps": args.reps,
        "pattern": args.pattern,
    }
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    unknown = set(cfg.ops) - set(mb.OPS)
    if unknown:
        raise SystemExit(f"--ops: expected a subset of {','.join(mb.OPS)}, got {','.join(sorted(unknown))}")
    for flag, values in (("--m", cfg.ms), ("--d-ff", cfg.ns), ("--d-model", (cfg.k,)), ("--reps", (cfg.reps,))):
        if min(values) < 1:
            raise SystemExit(f"{flag}: expected positive integers, got {','.join(map(str, values))}")
    if not all(0.0 < d <= 1.0 for d in cfg.densities):
        raise SystemExit(f"--densities: expected fractions in (0, 1], got {','.join(map(str, cfg.densities))}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = mb.run(cfg, str(out / "micro.jsonl"))
    print(mb.summary(records))
    try:
        written = mb.plots(records, out)
        print("plots: " + ", ".join(str(p) for p in written))
    except ImportError:
        print("plots skipped: pip install 'twellsparse[bench]' for matplotlib")
    return 0


if __name__ == "__main__":
    sys.exit(main())
