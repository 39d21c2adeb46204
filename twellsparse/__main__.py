"""Command line: ``python -m twellsparse demo [--cpu]``."""

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
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import run_demo

        run_demo(force_cpu=args.cpu, seed=args.seed, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
