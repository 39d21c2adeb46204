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

import numpy as np
from sustained import dense_and_sparse  # bench/ is the script's first path entry

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


def publishable(r: dict[str, Any], kind: str) -> bool:
    """Whether a record of ``kind`` may stand in a table: measured on a GPU with the default
    settings (no ``TWELL_*`` switch), with a commit, and not a smoke run (``--quick``, the CPU)."""
    return (
        r.get("kind") == kind
        and bool(r.get("commit"))
        and not r.get("settings")
        and not r.get("smoke")
        and bool(r.get("gpu"))
        and r.get("device_path", "cuda") != "cpu"
    )


def latest(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """Publishable records of ``kind`` from the most recently dated commit."""
    mine = [r for r in records if publishable(r, kind)]
    if not mine:
        return []
    newest = max(mine, key=lambda r: r["date"])["commit"]
    return [r for r in mine if r["commit"] == newest]


def latest_per_case(records: list[dict[str, Any]], kind: str, case: tuple[str, ...]) -> list[dict[str, Any]]:
    """The newest record of ``kind`` for each value of the ``case`` fields (each record's pairs
    were measured side by side in one run, so rows of different runs can share a table)."""
    newest: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if not publishable(r, kind):
            continue
        key = tuple(json.dumps(_field(r, f)) for f in case)
        if key not in newest or r["date"] > newest[key]["date"]:
            newest[key] = r
    return list(newest.values())


def _field(r: dict[str, Any], name: str) -> Any:
    """A record's field; ``density_target`` falls back to the measured density at two digits
    (records from before it was stored)."""
    if name == "density_target" and name not in r:
        return float(f"{r['density']:.2g}")
    if name == "norm" and r.get("kind") == "model":  # the model's RMSNorm was written out until it said
        return r.get(name, "composite")
    return r.get(name)


def _provenance(records: list[dict[str, Any]]) -> str:
    """``GPU (driver, CuPy), date, commit(s)`` of a table's records."""
    commits = ", ".join(sorted({r["commit"][:7] for r in records}))
    dates = sorted({r["date"][:10] for r in records})
    # one table may join runs on different cards (the newest run per case): name every card and
    # its software, so that no row reads as measured on another card
    cards = dict.fromkeys(_card(r) for r in records)
    return (
        f"{' and '.join(cards)}{' (rows of different runs)' if len(cards) > 1 else ''}, "
        f"{' to '.join(dict.fromkeys((dates[0], dates[-1])))}, commit{'s' if ',' in commits else ''} {commits}"
    )


def _card(r: dict[str, Any]) -> str:
    """A record's card and software, as :func:`_provenance` names them."""
    return f"{r['gpu']} (driver {r.get('driver_version')}, CUDA runtime {r.get('cuda_runtime')}, CuPy {r.get('cupy')})"


def _run(r: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """A row's run: its commit, and its card where the table's rows come from more than one
    card or software stack (the card's name, with the software where the names agree)."""
    if len({_card(x) for x in records}) == 1:
        return r["commit"][:7]
    names = {x["gpu"] for x in records}
    label = r["gpu"].removeprefix("NVIDIA ") if len(names) > 1 else _card(r).removeprefix("NVIDIA ")
    return f"{r['commit'][:7]} ({label})"


def _notes(records: list[dict[str, Any]]) -> str:
    """The records' notes (what a reader must know to read their rows), each once, with the
    commits they concern; empty where none has one."""
    notes: dict[str, set[str]] = {}
    for r in records:
        if r.get("note"):
            notes.setdefault(r["note"], set()).add(r["commit"][:7])
    return "".join(f" Note ({', '.join(sorted(c))}): {n.rstrip('.')}." for n, c in notes.items())


def _fmt_auto(r: dict[str, Any], ms: dict[str, float], key: str, dense_key: str, path_key: str) -> str:
    """`` / auto t (s.ssx, path)`` for records that timed the automatic dispatch, else ``""``."""
    if key not in ms:
        return ""
    return f" / auto {ms[key]:.3f} ({ms[dense_key] / ms[key]:.2f}x, {r.get(path_key)})"


#: The blocks' physical ceilings over dense (DESIGN.md section 5): the first GEMM stays dense, so
#: even with free sparse products the non-gated block is at most 2x faster and the gated one 3x.
CEILINGS = {"ffn": 2.0, "gated_ffn": 3.0}


def _fmt_sparse(speedup: float, block: str) -> str:
    """``s.ssx, pp% of Cx``: a forced-sparse speed-up and its share of the block's ceiling."""
    ceiling = CEILINGS[block]
    return f"{speedup:.2f}x, {speedup / ceiling:.0%} of {ceiling:g}x"


def _gather_rate(r: dict[str, Any], ms: float) -> float:
    """TB/s of weight rows the down projection's SpMM gathered: one d_model row per stored entry,
    density x M x d_ff entries."""
    m, d_model, d_ff = r["shape"]
    itemsize = 2 if r["dtype"] == "bfloat16" else np.dtype(r["dtype"]).itemsize  # NumPy lacks bfloat16
    return r["density"] * m * d_ff * d_model * itemsize / (ms * 1e-3) / 1e12


def _medians(r: dict[str, Any]) -> dict[str, float]:
    """A benchmark record's median times by row (rows that failed hold no median)."""
    return {k: v["median"] for k, v in r["ms"].items() if "median" in v}


def ffn_table(records: list[dict[str, Any]]) -> str:
    if not records:
        return "_No FFN benchmark recorded yet._"
    r0 = records[0]
    m, d_model, d_ff = r0["shape"]
    lines = [
        f"FFN blocks, {r0['dtype']}, M = {m}, d_model = {d_model}, d_ff = {d_ff}; {_provenance(records)}; "
        f"dense = {' / '.join(dict.fromkeys(r['dense_provider'] for r in records))}, same run. Times are medians in ms "
        "(L2 flushed); speed-up = dense time / twellsparse time (below 1 = slower than dense). "
        "`sparse` forces the TwELL kernels, its speed-up also given as a share of the block's "
        "ceiling (2x non-gated, 3x gated: the first GEMM stays dense); `auto` is the default "
        "dispatch (dense remainder above the break-even density), with the path it took. The TwELL "
        "down projection's rate is in TB/s of weight rows gathered (one row per stored entry). "
        "`vs library dense`: the sparse blocks against the library's own dense path (cuBLASLt GEMMs "
        "timed per shape, a fused act-mul) of the same run, where the run timed it. Each row's "
        f"run is its commit.{_notes(records)}",
        "",
        "| pattern | density | dense GEMM | producer (GEMM+relu+pack) | down: dense / TwELL | "
        "non-gated FFN: dense / sparse / auto | gated FFN: dense / sparse / auto | "
        "vs library dense: non-gated / gated | commit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(records, key=lambda r: (r["pattern"], r["density"])):
        ms = _medians(r)
        sp = r["speedup"]
        plain_auto = _fmt_auto(r, ms, "ffn_auto", "dense_ffn", "ffn_auto_path")
        gated_auto = _fmt_auto(r, ms, "gated_ffn_auto", "dense_gated_ffn", "auto_path")
        lines.append(
            f"| {r['pattern']} | {r['density']:.2%} | {ms['dense_gemm']:.3f} | {ms['producer']:.3f} "
            f"({1 / sp['producer_vs_gemm']:.2f}x the GEMM) | {ms['dense_down']:.3f} / {ms['spmm_down']:.3f} "
            f"({_gather_rate(r, ms['spmm_down']):.1f} TB/s) | "
            f"{ms['dense_ffn']:.3f} / {ms['ffn']:.3f} ({_fmt_sparse(sp['ffn'], 'ffn')}){plain_auto} | "
            f"{ms['dense_gated_ffn']:.3f} / {ms['gated_ffn']:.3f} "
            f"({_fmt_sparse(sp['gated_ffn'], 'gated_ffn')}){gated_auto} | {_vs_library_dense(ms)} | "
            f"{_run(r, records)} |"
        )
    return "\n".join(lines)


def _vs_library_dense(ms: dict[str, float]) -> str:
    """``a.aax / b.bbx``: the sparse blocks' speed-ups over the library's own dense plans, or a
    dash for runs that did not time those."""
    if "dense_ffn_plan" not in ms or "dense_gated_ffn_plan" not in ms:
        return "-"
    return f"{ms['dense_ffn_plan'] / ms['ffn']:.2f}x / {ms['dense_gated_ffn_plan'] / ms['gated_ffn']:.2f}x"


def fp8_table(records: list[dict[str, Any]]) -> str:
    """The plans with fp8 e4m3 weight rows (opt-in, lossy) beside the dense and 2-byte blocks of
    the same runs: every FFN record that timed them."""
    recs = [r for r in records if "gated_ffn_e4m3" in r.get("ms", {})]
    if not recs:
        return ""
    two_byte = max(r["rel_error_vs_dense"][block] for r in recs for block in ("ffn", "gated_ffn"))
    lines = [
        'FFN plans with the gathered weight rows in fp8 e4m3 (opt-in and lossy: `down_format="e4m3"`, and '
        f'`up_format="e4m3"` for the gated block), bfloat16 otherwise; {_provenance(recs)}; '
        "medians in ms, L2 flushed, speed-up over dense in parentheses, relative error against the dense "
        f"bfloat16 block (the 2-byte plans' is {two_byte:.1e} at most).",
        "",
        "| shape (M, d_model, d_ff) | pattern | density | non-gated: dense / 2-byte rows / e4m3 rows (error) | "
        "gated: dense / 2-byte rows / e4m3 rows (error) | commit |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(recs, key=lambda r: (r["shape"], r["pattern"], r["density"])):
        ms = _medians(r)
        err = r["rel_error_vs_dense"]
        cells = []
        for block in ("ffn", "gated_ffn"):
            dense = ms[f"dense_{block}"]
            cells.append(
                f"{dense:.3f} / {ms[block]:.3f} ({dense / ms[block]:.2f}x) / {ms[f'{block}_e4m3']:.3f} "
                f"({dense / ms[f'{block}_e4m3']:.2f}x, {err[f'{block}_e4m3']:.1e})"
            )
        shape = ", ".join(map(str, r["shape"]))
        lines.append(f"| {shape} | {r['pattern']} | {r['density']:.2%} | {cells[0]} | {cells[1]} | {_run(r, recs)} |")
    return "\n".join(lines)


def _pattern_note(r: dict[str, Any]) -> str:
    """`` skewed`` for a training record of the skewed pattern; nothing for the uniform one (records
    before the pattern was recorded are uniform)."""
    pattern = r.get("pattern", "uniform")
    return "" if pattern == "uniform" else f" {pattern}"


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
            "Eager steps as written, timed alone (the GPU idle before each, so the host's launch time counts "
            "in full) and back to back (a training loop's time per step: the host queues the next step while "
            "the GPU runs the last, except where the exact spill reads its overflow count back, once per "
            "forward; the fixed-spill `TwELLGatedMLP` reads nothing back); captured: each whole step in a "
            "CUDA graph (the host's launches gone; TwELL with a fixed `spill_capacity`), dense captured the "
            "same way.",
            "",
            "| density | eager, one step: dense / TwELL ms (speed-up) | eager, back to back: dense / TwELL exact "
            "/ TwELL fixed spill ms (speed-ups) | captured: dense / TwELL ms (speed-up) | saved activations: "
            "TwELL / dense |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(steps, key=lambda r: (_pattern_note(r), r["density_target"])):  # uniform first
            graph = (
                f"{r['dense_graph_ms']:.3f} / {r['twell_graph_ms']:.3f} ({r['speedup_graph']:.2f}x)"
                if "speedup_graph" in r
                else "not measured"
            )
            b2b = (
                f"{r['dense_b2b_ms']:.3f} / {r['twell_b2b_ms']:.3f} / {r['twell_module_b2b_ms']:.3f} "
                f"({r['speedup_twell_b2b']:.2f}x / {r['speedup_twell_module_b2b']:.2f}x)"
                if "speedup_twell_b2b" in r
                else "not measured"
            )
            lines.append(
                f"| {r['density_target']:.2%}{_pattern_note(r)} | {r['dense_ms']:.3f} / {r['twell_ms']:.3f} "
                f"({r['speedup']:.2f}x) | "
                f"{b2b} | {graph} | {r['saved_ratio']:.2f} |"
            )
    # Each model row from the newest run that timed it (a run without graphs leaves the captured
    # row to the newest run with them); the caption names the runs shown.
    rows: dict[tuple, tuple[dict[str, Any], str, str]] = {}
    for r in models:
        for run, key in (("eager", ""), ("captured", "_graph")):
            case = (r["tokens"], r["layers"], r["density_target"], _field(r, "norm") != "fused", run == "captured")
            if f"forward{key}_speedup" in r and (case not in rows or r["date"] > rows[case][0]["date"]):
                rows[case] = (r, run, key)
    shown = list({id(r): r for r, _, _ in rows.values()}.values())
    if shown:
        r0 = shown[0]
        lines += [
            "",
            f"Decoder stack of the 2B shape ({r0['layers']} layers, {r0['tokens']} tokens, d_model {r0['d_model']}, "
            f"d_ff {r0['d_ff']}, {r0['dtype']}), TwELL MLPs vs dense MLPs; {_provenance(shown)}; the newest run "
            "per density and run, its commit in the last column.",
            "",
            "| density | RMSNorm | run | forward tokens/ms: dense / TwELL (speed-up) | train step tokens/ms: "
            "dense / TwELL (speed-up) | commit |",
            "|---|---|---|---|---|---|",
        ]
        for _, (r, run, key) in sorted(rows.items(), key=lambda item: item[0]):
            norm = "F.rms_norm" if _field(r, "norm") == "fused" else "written out"
            lines.append(
                f"| {r['density_target']:.2%} | {norm} | {run} | {r[f'dense_forward{key}_tokens_per_ms']:.0f} / "
                f"{r[f'twell_forward{key}_tokens_per_ms']:.0f} ({r[f'forward{key}_speedup']:.2f}x) | "
                f"{r[f'dense_train{key}_tokens_per_ms']:.0f} / {r[f'twell_train{key}_tokens_per_ms']:.0f} "
                f"({r[f'train{key}_speedup']:.2f}x) | {_run(r, shown)} |"
            )
    return "\n".join(lines)


def _cell(t: dict[str, Any], extra: str = "") -> str:
    if "median" not in t:
        return "refused" if "NOT_SUPPORTED" in t.get("error", "") else ("failed" if t else "")
    sp = f" ({t['speedup_vs_dense']:.2f}x)" if "speedup_vs_dense" in t else ""
    return f"{t['median']:.3f}{sp}{extra}"


def _micro_table(recs: list[dict[str, Any]], caption: str, names: list[str]) -> list[str]:
    """A caption and a density x provider table of medians (speed-up; GB/s for conversions)."""
    lines = ["", caption, "", "| density | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in recs:
        cells = []
        for n in names:
            t = r["ms"].get(n, {})
            cells.append(_cell(t, f", {t['gb_per_s']:.0f} GB/s" if "gb_per_s" in t else ""))
        lines.append(f"| {r['density']:.2%} | " + " | ".join(cells) + " |")
    return lines


def micro_tables(records: list[dict[str, Any]], m: int = STANDARD_SHAPE[0]) -> str:
    """SpMM, conversion and SDDMM at M tokens from ``python -m twellsparse bench`` records."""
    cases = latest_per_case(records, "micro", ("op", "shape", "density_target", "dtype"))
    by_op = {
        op: sorted((r for r in cases if r["op"] == op and r["shape"][0] == m), key=lambda r: r["density"])
        for op in ("spmm", "convert", "sddmm")
    }
    out: list[str] = []
    if by_op["spmm"]:
        recs = by_op["spmm"]
        (_, n, k), dt = recs[0]["shape"], recs[0]["dtype"]
        caption = (
            f"SpMM `A @ B`, A {m} x {n} sparse (uniform), B {n} x {k}, {dt}; {_provenance(recs)}. Medians in "
            "ms (L2 flushed), speed-up over the dense cuBLAS GEMM in parentheses. `twell+pack` includes "
            "packing A from dense; `+convert` includes cuSPARSE's dense-to-CSR; cupyx runs in float32 "
            "(cupyx.scipy.sparse has no bf16 product)."
        )
        names = [
            "dense-cublas", "twell", "twell+pack", "cusparse-csr-default", "cusparse-csr-csr_alg3",
            "cusparse-csr-default+convert", "cupyx-csr-fp32", "cusparse-blocked-ell-16",
        ]  # fmt: skip
        out += _micro_table(recs, caption, names)
    if by_op["convert"]:
        recs = by_op["convert"]
        caption = (
            f"Dense to sparse, {m} x {recs[0]['shape'][1]} {recs[0]['dtype']}; {_provenance(recs)}. ms and "
            "effective bandwidth on the bytes each conversion reads and writes; `copy` is the "
            "device-to-device copy of the dense input (the bandwidth ceiling)."
        )
        out += _micro_table(recs, caption, ["twell", "cusparse-dense2csr", "copy"])
    if by_op["sddmm"]:
        recs = by_op["sddmm"]
        (_, n, k), dt = recs[0]["shape"], recs[0]["dtype"]
        caption = (
            f"SDDMM `(X @ Y.T)` at the pattern of a {m} x {n} matrix, inner dimension {k}, {dt}; "
            f"{_provenance(recs)}. Dense = the full GEMM; cuSPARSE refuses bf16 SDDMM."
        )
        out += _micro_table(recs, caption, ["dense-cublas", "twell", "cusparse-sddmm"])
    return "\n".join(out[1:])


def jax_table(records: list[dict[str, Any]]) -> str:
    """The jitted JAX gated FFN beside the CuPy plan (bench/jax_bench.py)."""
    jx = sorted(latest(records, "jax"), key=lambda r: r["density_target"])
    if not jx:
        return ""
    out = [
        f"JAX: `jax.jit(twellsparse.jax.gated_ffn)` beside `twellsparse.GatedFFN` on CuPy arrays, shape "
        f"{jx[0]['shape']}, bf16; {_provenance(jx)}. Per-call wall time over batches of 10 calls (ms).",
        "",
        "Fixed spill: both paths with a `spill_capacity` (nothing read back, so calls queue ahead).",
        "",
        "| density | CuPy plan | JAX jit (ratio to CuPy) | CuPy, fixed spill | JAX jit, fixed spill (ratio) "
        "| JAX dense | callback around a prebuilt plan | copy-only callback |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in jx:
        ms = {k: v["median"] for k, v in r["ms"].items()}
        fixed = ["", ""]
        if "jax_sparse_fixed_spill" in ms:
            fixed = [
                f"{ms['cupy_sparse_fixed_spill']:.3f}",
                f"{ms['jax_sparse_fixed_spill']:.3f} ({r['jax_vs_cupy_fixed_spill']:.2f}x)",
            ]
        diag = [f"{ms[k]:.3f}" if k in ms else "" for k in ("jax_callback_prebuilt_plan", "jax_callback_copy_only")]
        exact = f"{ms['cupy_sparse']:.3f} | {ms['jax_sparse']:.3f} ({r['jax_vs_cupy']:.2f}x)"
        cells = [exact, *fixed, f"{ms['jax_dense']:.3f}", *diag]
        out.append(f"| {r['density_target']:.2%} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def energy_table(records: list[dict[str, Any]]) -> str:
    """The FFN blocks under a sustained load (bench/ffn_energy.py): each block's best window of
    back-to-back calls, time and energy per call, torch's dense block against the sparse plan."""
    recs = sorted(latest(records, "ffn_energy"), key=lambda r: (r["pattern"], r["density_target"]))
    if not recs:
        return ""
    out = [
        f"Under a sustained load (`python bench/ffn_energy.py`: each block run back to back for two seconds, "
        f"in turn, twice; NVML's energy counter around each window; the best window per block), M = {recs[0]['m']}, "
        f"d_model 2048, d_ff 5632, bf16, L2 not flushed, the plans with a fixed spill; {_provenance(recs)}. "
        f"Every window ran at the board's {recs[0]['power_limit_w']:.0f} W cap, so a call's time follows its "
        "energy. Time per call in ms, energy per call in mJ.",
        "",
        "| pattern | density | gated: dense / sparse ms (speed-up) | gated: dense / sparse mJ (ratio) "
        "| non-gated: dense / sparse ms (speed-up) | non-gated: dense / sparse mJ (ratio) |",
        "|---|---|---|---|---|---|",
    ]
    for r in recs:
        cells = []
        for kind in ("gated", "non-gated"):
            (dense_ms, dense_mj), (sparse_ms, sparse_mj) = dense_and_sparse(r["windows"], kind)
            cells += [
                f"{dense_ms:.3f} / {sparse_ms:.3f} ({dense_ms / sparse_ms:.2f}x)",
                f"{dense_mj:.0f} / {sparse_mj:.0f} ({sparse_mj / dense_mj:.2f})",
            ]
        out.append(f"| {r['pattern']} | {r['density_target']:.2%} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def distributed_table(records: list[dict[str, Any]]) -> str:
    """Training throughput per GPU with TwELL MLPs against the same stack with dense ones, on one
    GPU and over two (examples/distributed_train.py and jax_data_parallel.py ``--json``;
    ``device_run.sh multigpu``): tokens/s per GPU, the speed-up over dense, and the scaling (two
    GPUs' per-GPU rate against one GPU's, same tokens per GPU)."""
    recs = [r for r in latest(records, "distributed") if r.get("device_kind") in ("cuda", "gpu")]
    if not recs:
        return ""
    rate = {(r["framework"], r["mode"], r["mlp"], r["density_target"], r["world"]): r for r in recs}
    out = [
        f"Multi-GPU training steps (gated MLP stacks, {recs[0]['dtype']}, shape {recs[0]['shape'][1:]}, "
        f"{recs[0]['tokens_per_rank']} tokens per GPU); {_provenance(recs)}. Tokens/s per GPU: dense / TwELL "
        "(speed-up); scaling: the two-GPU per-GPU rate against one GPU's.",
        "",
        "| framework | mode | GPUs | density | tokens/s per GPU: dense / TwELL | scaling: dense / TwELL |",
        "|---|---|---|---|---|---|",
    ]
    for (framework, mode, mlp, density, world), r in sorted(rate.items(), key=lambda kv: str(kv[0])):
        if mlp != "twell" or (framework, mode, "dense", density, world) not in rate:
            continue
        dense = rate[(framework, mode, "dense", density, world)]
        t, d = r["tokens_per_s_per_rank"], dense["tokens_per_s_per_rank"]
        one = "single" if framework == "torch" else mode
        base_t, base_d = (rate.get((framework, one, mlp_, density, 1)) for mlp_ in ("twell", "dense"))
        scaling = ""
        if world > 1 and base_t and base_d:
            scaling = f"{d / base_d['tokens_per_s_per_rank']:.2f} / {t / base_t['tokens_per_s_per_rank']:.2f}"
        rates = f"{d:,.0f} / {t:,.0f} ({t / d:.2f}x)"
        out.append(f"| {framework} | {mode} | {world} | {density:.2%} | {rates} | {scaling} |")
    return "\n".join(out)


def tables(records: list[dict[str, Any]]) -> str:
    """The FFN tables (one per problem shape, the standard problem first), the training ones, the
    FFN blocks under a sustained load, the plans with fp8 rows, the microbenchmarks against
    cuSPARSE, the JAX adapter and multi-GPU training."""
    ffn = latest_per_case(records, "ffn", ("shape", "pattern", "density_target"))
    shapes = sorted({tuple(r["shape"]) for r in ffn}, key=lambda s: (s != STANDARD_SHAPE, s))
    parts = [ffn_table([r for r in ffn if tuple(r["shape"]) == shape]) for shape in shapes] or [ffn_table([])]
    models = [r for r in records if publishable(r, "model")]  # training_table takes each row's newest
    training = training_table(latest(records, "train_step"), models)
    text = "\n\n".join(parts) + ("\n" + training if training else "")
    extras = (
        energy_table(records),
        fp8_table(ffn),
        micro_tables(records),
        jax_table(records),
        distributed_table(records),
    )
    for extra in extras:
        if extra:
            text += "\n\n" + extra
    return text


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
    ap.add_argument("--plots", type=pathlib.Path, metavar="DIR", help="also draw the microbenchmark plots here")
    args = ap.parse_args(argv)
    records = load(args.results)
    table = tables(records)
    if args.plots:
        from twellsparse._microbench import plots

        args.plots.mkdir(parents=True, exist_ok=True)
        micro = latest_per_case(records, "micro", ("op", "shape", "density_target", "dtype"))
        for path in plots(micro, args.plots):
            print(f"plot: {path}", file=sys.stderr)
    if args.update_readme:
        update_readme(args.update_readme, table)
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
