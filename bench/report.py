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
#: (M, d_model, d_ff) of TARGETS.md's standard problem: its table comes first.
STANDARD_SHAPE = (16384, 2048, 5632)


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


def _fmt_auto(r: dict[str, Any], ms: dict[str, float], key: str, dense_key: str, path_key: str) -> str:
    """`` / auto t (s.ssx, path)`` for records that timed the automatic dispatch, else ``""``."""
    if key not in ms:
        return ""
    return f" / auto {ms[key]:.3f} ({ms[dense_key] / ms[key]:.2f}x, {r.get(path_key)})"


def ffn_table(records: list[dict[str, Any]]) -> str:
    if not records:
        return "_No FFN benchmark recorded yet._"
    r0 = records[0]
    m, d_model, d_ff = r0["shape"]
    lines = [
        f"FFN blocks, {r0['dtype']}, M = {m}, d_model = {d_model}, d_ff = {d_ff}; {r0['gpu']} "
        f"(driver {r0.get('driver_version')}, CuPy {r0.get('cupy')}), {r0['date'][:10]}, commit "
        f"{r0['commit'][:10]}; dense = {r0['dense_provider']}, same run. Times are medians in ms "
        "(L2 flushed); speed-up = dense time / twellsparse time (below 1 = slower than dense). "
        "`sparse` forces the TwELL kernels; `auto` is the default dispatch (dense remainder above "
        "the break-even density), with the path it took.",
        "",
        "| pattern | density | dense GEMM | producer (GEMM+relu+pack) | down: dense / TwELL | "
        "non-gated FFN: dense / sparse / auto | gated FFN: dense / sparse / auto |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(records, key=lambda r: (r["pattern"], r["density"])):
        ms = {k: v["median"] for k, v in r["ms"].items() if "median" in v}
        sp = r["speedup"]
        plain_auto = _fmt_auto(r, ms, "ffn_auto", "dense_ffn", "ffn_auto_path")
        gated_auto = _fmt_auto(r, ms, "gated_ffn_auto", "dense_gated_ffn", "auto_path")
        lines.append(
            f"| {r['pattern']} | {r['density']:.2%} | {ms['dense_gemm']:.3f} | {ms['producer']:.3f} "
            f"({1 / sp['producer_vs_gemm']:.2f}x the GEMM) | {ms['dense_down']:.3f} / {ms['spmm_down']:.3f} | "
            f"{ms['dense_ffn']:.3f} / {ms['ffn']:.3f} ({sp['ffn']:.2f}x){plain_auto} | "
            f"{ms['dense_gated_ffn']:.3f} / {ms['gated_ffn']:.3f} ({sp['gated_ffn']:.2f}x){gated_auto} |"
        )
    return "\n".join(lines)


def training_table(steps: list[dict[str, Any]], models: list[dict[str, Any]]) -> str:
    """Training-step and whole-model records (bench/train_step.py, bench/model_bench.py)."""
    lines = []
    if steps:
        r0 = steps[0]
        lines += [
            "",
            f"Gated FFN forward + backward through `twellsparse.torch` vs dense torch autograd, "
            f"{r0['dtype']}, shape {r0['shape']}; {r0['gpu']}, {r0['date'][:10]}, commit {r0['commit'][:10]}.",
            "",
            "| density | dense ms | TwELL ms | speed-up | saved activations: TwELL / dense |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(steps, key=lambda r: r["density_target"]):
            lines.append(
                f"| {r['density_target']:.2%} | {r['dense_ms']:.3f} | {r['twell_ms']:.3f} | {r['speedup']:.2f}x | "
                f"{r['saved_ratio']:.2f} |"
            )
    if models:
        r0 = models[0]
        lines += [
            "",
            f"Decoder stack of the 2B shape ({r0['layers']} layers, {r0['tokens']} tokens, d_model {r0['d_model']}, "
            f"d_ff {r0['d_ff']}, {r0['dtype']}), TwELL MLPs vs dense MLPs; {r0['gpu']}, {r0['date'][:10]}, commit "
            f"{r0['commit'][:10]}.",
            "",
            "| density | forward tokens/ms: dense / TwELL (speed-up) | train step tokens/ms: dense / TwELL "
            "(speed-up) |",
            "|---|---|---|",
        ]
        for r in sorted(models, key=lambda r: r["density_target"]):
            lines.append(
                f"| {r['density_target']:.2%} | {r['dense_forward_tokens_per_ms']:.0f} / "
                f"{r['twell_forward_tokens_per_ms']:.0f} ({r['forward_speedup']:.2f}x) | "
                f"{r['dense_train_tokens_per_ms']:.0f} / {r['twell_train_tokens_per_ms']:.0f} "
                f"({r['train_speedup']:.2f}x) |"
            )
    return "\n".join(lines)


def tables(records: list[dict[str, Any]]) -> str:
    """The FFN tables (one per problem shape, the standard problem first) and the training ones."""
    ffn = latest(records, "ffn")
    shapes = sorted({tuple(r["shape"]) for r in ffn}, key=lambda s: (s != STANDARD_SHAPE, s))
    parts = [ffn_table([r for r in ffn if tuple(r["shape"]) == shape]) for shape in shapes] or [ffn_table([])]
    training = training_table(latest(records, "train_step"), latest(records, "model"))
    return "\n\n".join(parts) + ("\n" + training if training else "")


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
    table = tables(load(args.results))
    if args.update_readme:
        update_readme(args.update_readme, table)
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
