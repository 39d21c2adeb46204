"""Build the README's benchmark tables from the JSON lines in bench/results/.

Takes, for each benchmark kind, the records of the newest commit measured, and prints markdown
(or rewrites the README section between its markers with ``--update-readme``).

Usage: python bench/report.py [--results DIR] [--update-readme README.md]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
START, END = "<!-- bench:ffn:start -->", "<!-- bench:ffn:end -->"


def load(results: pathlib.Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(results.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                records.append(json.loads(line))
    return records


def latest(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """Records of ``kind`` from the most recently dated commit."""
    mine = [r for r in records if r.get("kind") == kind and r.get("commit")]
    if not mine:
        return []
    newest = max(mine, key=lambda r: r["date"])["commit"]
    return [r for r in mine if r["commit"] == newest]


def ffn_table(records: list[dict[str, Any]]) -> str:
    if not records:
        return "_No FFN benchmark recorded yet._"
    r0 = records[0]
    m, d_model, d_ff = r0["shape"]
    lines = [
        f"FFN blocks, {r0['dtype']}, M = {m}, d_model = {d_model}, d_ff = {d_ff}; {r0['gpu']} "
        f"(driver {r0.get('driver_version')}, CuPy {r0.get('cupy')}), {r0['date'][:10]}, commit "
        f"{r0['commit'][:10]}; dense = {r0['dense_provider']}, same run. Times are medians in ms "
        "(L2 flushed); speed-up = dense time / twellsparse time (below 1 = slower than dense).",
        "",
        "| pattern | density | dense GEMM | producer (GEMM+relu+pack) | down: dense / TwELL | "
        "non-gated FFN: dense / TwELL (speed-up) | gated FFN: dense / TwELL (speed-up) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(records, key=lambda r: (r["pattern"], r["density"])):
        ms = {k: v["median"] for k, v in r["ms"].items()}
        sp = r["speedup"]
        lines.append(
            f"| {r['pattern']} | {r['density']:.2%} | {ms['dense_gemm']:.3f} | {ms['producer']:.3f} "
            f"({1 / sp['producer_vs_gemm']:.2f}x the GEMM) | {ms['dense_down']:.3f} / {ms['spmm_down']:.3f} | "
            f"{ms['dense_ffn']:.3f} / {ms['ffn']:.3f} ({sp['ffn']:.2f}x) | "
            f"{ms['dense_gated_ffn']:.3f} / {ms['gated_ffn']:.3f} ({sp['gated_ffn']:.2f}x) |"
        )
    return "\n".join(lines)


def update_readme(readme: pathlib.Path, table: str) -> None:
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme}: markers {START} ... {END} not found")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=pathlib.Path, default=HERE / "results")
    ap.add_argument("--update-readme", type=pathlib.Path, metavar="README")
    args = ap.parse_args(argv)
    table = ffn_table(latest(load(args.results), "ffn"))
    if args.update_readme:
        update_readme(args.update_readme, table)
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
