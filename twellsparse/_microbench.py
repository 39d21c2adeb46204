"""Microbenchmarks behind ``python -m twellsparse bench``: TwELL beside cuSPARSE and dense cuBLAS.

Ops, each over a density sweep and the token counts M asked for:

- ``spmm``: ``A @ B`` with A the hidden activations (M x N) and B a weight (N x K): dense cuBLAS;
  TwELL packed beforehand, and with the dense -> TwELL pack included (what dynamic activations
  cost); cuSPARSE CSR with each SpMM algorithm, and with cuSPARSE's dense -> CSR included;
  Blocked-ELL at block sizes 16 and 32 where the shape allows and the padding stays under 60%.
- ``convert``: dense -> TwELL beside cuSPARSE dense -> CSR and a device copy (the bandwidth
  ceiling), with GB/s on the bytes each one reads and writes.
- ``sddmm``: TwELL beside cuSPARSE SDDMM at the same pattern and the dense GEMM.
- ``ffn``: the gated FFN block (d_model = K, d_ff = N) with the sparse path forced and with the
  default dispatch, beside the dense block by cuBLAS and by torch (``dense-torch``, the baseline
  where torch is installed).

Every provider's result is checked against the dense one before it is timed; a failure (or a
combination cuSPARSE refuses) is recorded instead of a time. On a machine without a GPU, or
with ``cpu=True``, the NumPy reference path is timed against NumPy dense on small problems: a
smoke run that keeps the harness from rotting, not a performance measurement.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._backend import bfloat16, gpu_available
from ._environment import append_records, environment
from ._timing import Timer
from .testing import ffn_problem, rel_error, sparse_activations

OPS = ("spmm", "convert", "sddmm", "ffn")
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4, "float64": 1e-10}
#: Blocked-ELL is skipped when its padded storage exceeds this fraction of the dense matrix.
BLOCKED_ELL_MAX_FILL = 0.6
#: A provider whose second call (after the checked first one, which pays compilation, plan
#: tuning and the host-side check) takes longer than this is timed with SLOW_REPS repetitions.
SLOW_CALL_MS = 30.0
SLOW_REPS = 3


@dataclasses.dataclass
class Config:
    """What to run; :func:`default_config` fills it for a mode."""

    ops: tuple[str, ...]
    densities: tuple[float, ...]
    ms: tuple[int, ...]
    ns: tuple[int, ...]  # d_ff: the sparse dimension
    k: int  # d_model
    dtype: str
    reps: int
    on_gpu: bool
    pattern: str = "uniform"
    seed: int = 0
    smoke: bool = False  # a quick or CPU run: its records never reach a results table


def default_config(quick: bool = False, cpu: bool = False) -> Config:
    """The full sweep on the standard problem's widths, a quick one, or the CPU smoke run."""
    if cpu or not gpu_available():
        return Config(OPS, (0.05, 0.2), (64,), (512,), 64, "float32", 2, on_gpu=False, smoke=True)
    if quick:
        return Config(OPS, (0.01, 0.1), (2048,), (1024,), 512, "bfloat16", 5, on_gpu=True, smoke=True)
    densities = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
    return Config(OPS, densities, (4096, 16384), (5632,), 2048, "bfloat16", 20, on_gpu=True)


def _dtype(name: str) -> Any:
    return bfloat16 if name == "bfloat16" else np.dtype(name)


# ----------------------------------------------------------------------------- providers
# Each returns {name: (fn, check)}: fn is timed; check(result) returns the relative error
# against the dense result, or raises.

Provider = tuple[Callable[[], Any], Callable[[Any], float]]


def _planned_once(make_plan: Callable[[], Callable[[], Any]]) -> Callable[[], Any]:
    """A provider that builds its cuSPARSE plan (workspace, ALG3's preprocess) on its first call,
    the correctness check, so the timed calls run the product alone and a refusal is recorded
    like any other failure."""
    plans: list[Callable[[], Any]] = []

    def run() -> Any:
        if not plans:
            plans.append(make_plan())
        return plans[0]()

    return run


def _spmm_gpu(h: Any, b: Any) -> dict[str, Provider]:
    import cupy as cp

    import twellsparse as ts

    from ._gpu_ops import gemm_nt

    b_t = cp.ascontiguousarray(b.T)
    expected = gemm_nt(h, b_t)

    def close(out: Any) -> float:
        return rel_error(out, expected)

    a = ts.twell_array(h)
    providers: dict[str, Provider] = {
        "dense-cublas": (lambda: gemm_nt(h, b_t), close),
        "twell": (lambda: ts.matmul(a, b), close),
        "twell+pack": (lambda: ts.matmul(ts.twell_array(h), b), close),
    }
    # CuPy's own sparse product, the one a CuPy user has at hand (float32/float64 only).
    import cupyx.scipy.sparse as cupyx_sparse

    h_csr32, b32 = cupyx_sparse.csr_matrix(h.astype(cp.float32)), b.astype(cp.float32)
    providers["cupyx-csr-fp32"] = (lambda: h_csr32 @ b32, close)
    try:
        from .bindings import cusparse
    except ImportError:
        return providers
    try:
        csr = cusparse.dense_to_csr(h)
    except cusparse.CuSparseError:
        return providers
    m, k = h.shape[0], b.shape[1]
    desc = cusparse.csr_descriptor(*csr, h.shape)
    for alg in ("default", "csr_alg1", "csr_alg2", "csr_alg3"):
        plan = functools.partial(cusparse.SpMM, desc, b, cp.empty((m, k), dtype=b.dtype), alg)
        providers[f"cusparse-csr-{alg}"] = (_planned_once(plan), close)

    def converted() -> Any:
        fresh = cusparse.csr_descriptor(*cusparse.dense_to_csr(h), h.shape)
        return cusparse.SpMM(fresh, b, cp.empty((m, k), dtype=b.dtype))()

    providers["cusparse-csr-default+convert"] = (converted, close)
    for bs in (16, 32):
        if h.shape[0] % bs or h.shape[1] % bs:
            continue
        block_cols, values = cusparse.blocked_ell_from_dense(h, bs)
        if values.size > BLOCKED_ELL_MAX_FILL * h.size:
            continue
        ell = functools.partial(
            cusparse.SpMM, cusparse.blocked_ell_descriptor(block_cols, values, h.shape, bs), b,
            cp.empty((m, k), dtype=b.dtype), "blocked_ell_alg1",
        )  # fmt: skip
        providers[f"cusparse-blocked-ell-{bs}"] = (_planned_once(ell), close)
    return providers


def _convert_gpu(h: Any) -> dict[str, Provider]:
    import cupy as cp

    import twellsparse as ts

    nnz = int(cp.count_nonzero(h))

    def exact_twell(a: Any) -> float:
        return 0.0 if bool((a.toarray() == h).all()) else float("inf")

    dst = cp.empty_like(h)
    providers: dict[str, Provider] = {
        "twell": (lambda: ts.twell_array(h), exact_twell),
        "copy": (lambda: cp.copyto(dst, h) or dst, lambda out: 0.0 if bool((out == h).all()) else float("inf")),
    }
    try:
        from .bindings import cusparse

        cusparse.library()
    except (ImportError, RuntimeError):
        return providers
    providers["cusparse-dense2csr"] = (
        lambda: cusparse.dense_to_csr(h),
        lambda csr: 0.0 if int(csr[1].size) == nnz else float("inf"),
    )
    return providers


def _bytes_moved(h: Any, result: Any) -> int:
    """Bytes a conversion reads and writes: the input once and each output array once (a
    twell_array's parts, a CSR tuple, or a copy)."""
    if hasattr(result, "parts"):
        return h.nbytes + sum(int(p.nbytes) for p in result.parts)
    if isinstance(result, tuple):
        return h.nbytes + sum(int(p.nbytes) for p in result)
    return 2 * h.nbytes


def _sddmm_gpu(h: Any, x: Any, y: Any) -> dict[str, Provider]:
    import cupy as cp

    import twellsparse as ts

    from ._gpu_ops import gemm_nt

    full = gemm_nt(x, y)
    mask = h != 0
    sampled = cp.where(mask, full, 0)
    a = ts.twell_array(h)
    providers: dict[str, Provider] = {
        "dense-cublas": (lambda: gemm_nt(x, y), lambda out: rel_error(out, full)),
        "twell": (lambda: ts.sddmm(x, y, a), lambda out: rel_error(out.toarray(), sampled)),
    }
    try:
        from .bindings import cusparse

        indptr, cols, vals = cusparse.dense_to_csr(h)
    except (ImportError, RuntimeError):
        return providers
    desc = cusparse.csr_descriptor(indptr, cols, vals, h.shape)
    rows = cp.searchsorted(indptr[1:], cp.arange(cols.size), side="right")
    providers["cusparse-sddmm"] = (
        lambda: cusparse.sddmm(x, y, desc, vals),
        lambda out: rel_error(out, full[rows, cols]),
    )
    return providers


def _ffn_providers(p: dict[str, Any]) -> dict[str, Provider]:
    """The gated FFN: dense (cuBLAS or NumPy), the sparse plan and the default-dispatch plan."""
    import twellsparse as ts

    x, wg, wu, wd = p["x"], p["w_gate"], p["w_up"], p["w_down"]
    sparse = ts.GatedFFN(wg, wu, wd, dispatch="sparse")
    auto = ts.GatedFFN(wg, wu, wd)
    if isinstance(x, np.ndarray):
        expected = ts._reference.gated_ffn_dense(x, wg, wu, wd, "relu")

        def dense() -> Any:
            return (np.maximum(x @ wg.T, 0) * (x @ wu.T)) @ wd.T

        name = "dense-numpy"
    else:
        from ._gpu_ops import gemm_nt
        from ._ops import dense_ffn_tail

        def dense() -> Any:
            # Three cuBLAS GEMMs and one fused relu-multiply: the plans' own dense remainder.
            return dense_ffn_tail(x, gemm_nt(x, wg), wu, wd, x.dtype, "relu", None)

        expected, name = dense(), "dense-cublas"
    close = lambda out: rel_error(out, expected)  # noqa: E731
    providers = {name: (dense, close), **_torch_dense_ffn(x, wg, wu, wd, close)}
    return {**providers, "twell-sparse": (lambda: sparse(x), close), "twell-auto": (lambda: auto(x), close)}


def _torch_dense_ffn(x: Any, wg: Any, wu: Any, wd: Any, close: Callable[[Any], float]) -> dict[str, Provider]:
    """PyTorch's dense gated FFN on the same GPU arrays (zero-copy), TARGETS.md's baseline;
    nothing where torch or its CUDA build is missing."""
    if isinstance(x, np.ndarray):
        return {}
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    import cupy as cp

    tx, tg, tu, td = (torch.from_dlpack(a) for a in (x, wg, wu, wd))

    def dense() -> Any:
        return cp.from_dlpack((torch.relu(tx @ tg.T) * (tx @ tu.T)) @ td.T)

    return {"dense-torch": (dense, close)}


def _cpu_providers(op: str, h: Any, b: Any, x: Any, y: Any) -> dict[str, Provider]:
    import twellsparse as ts

    a = ts.twell_array(h)
    if op == "spmm":
        expected = h.astype(np.float64) @ b.astype(np.float64)
        return {
            "dense-numpy": (lambda: h @ b, lambda out: rel_error(out, expected)),
            "twell-reference": (lambda: ts.matmul(a, b), lambda out: rel_error(out, expected)),
        }
    if op == "convert":
        return {
            "twell-reference": (lambda: ts.twell_array(h), lambda t: float(np.abs(t.toarray() - h).max())),
            "copy": (lambda: h.copy(), lambda out: float(np.abs(out - h).max())),
        }
    sampled = np.where(h != 0, x.astype(np.float64) @ y.astype(np.float64).T, 0.0)
    return {
        "dense-numpy": (lambda: x @ y.T, lambda out: 0.0),
        "twell-reference": (lambda: ts.sddmm(x, y, a), lambda out: rel_error(out.toarray(), sampled)),
    }


# ----------------------------------------------------------------------------- running

DENSE = {
    "spmm": ("dense-cublas", "dense-numpy"),
    "sddmm": ("dense-cublas", "dense-numpy"),
    "ffn": ("dense-torch", "dense-cublas", "dense-numpy"),
    "convert": ("copy",),
}


def _case_providers(cfg: Config, op: str, m: int, n: int, density: float, dtype: Any, rng: Any) -> tuple[dict, Any]:
    """Fresh random operands for one case: (providers, the activation matrix or pattern)."""
    xp: Any = np
    if cfg.on_gpu:
        import cupy

        xp = cupy
    if op == "ffn":
        problem = ffn_problem(m, cfg.k, n, density, cfg.pattern, dtype, rng, xp)
        return _ffn_providers(problem), (problem["x"] @ problem["w_gate"].T) > 0
    h = sparse_activations(m, n, density, cfg.pattern, dtype, rng)
    b = rng.standard_normal((n, cfg.k)).astype(dtype)
    x = rng.standard_normal((m, cfg.k)).astype(dtype)
    y = rng.standard_normal((n, cfg.k)).astype(dtype)
    if not cfg.on_gpu:
        return _cpu_providers(op, h, b, x, y), h
    h, b, x, y = (xp.asarray(v) for v in (h, b, x, y))
    if op == "spmm":
        return _spmm_gpu(h, b), h
    if op == "convert":
        return _convert_gpu(h), h
    return _sddmm_gpu(h, x, y), h


def _time_case(
    case: dict[str, Any],
    density: float,
    providers: dict[str, Provider],
    timers: tuple[Timer, Timer],
    cfg: Config,
    env: dict[str, Any],
    out_path: str | None,
    h: Any = None,
) -> dict[str, Any]:
    """Check then time each provider of one case; the record (also appended to ``out_path``).

    ``timers`` is (normal, slow): a provider whose second, unchecked call took over
    ``SLOW_CALL_MS`` is timed with the slow one (fewer repetitions), so the sweep's slowest
    baselines (cuSPARSE's ALG1 at 50% runs 0.3 s a call) do not take most of its time. Each
    timing records its repetitions.
    """
    timings: dict[str, Any] = {}
    for name, (fn, check) in providers.items():
        try:
            err = check(fn())
            if not err <= TOLERANCE[cfg.dtype]:
                raise ValueError(f"relative error {err:.3e} against dense")
            t0 = time.perf_counter()
            fn()
            _synchronize(cfg.on_gpu)
            slow = (time.perf_counter() - t0) * 1e3 > SLOW_CALL_MS
            timer = timers[slow]
            result, ms = timer(fn)
            timings[name] = {**ms, "rel_error": err, "reps": timer.reps}
            if case["op"] == "convert":
                timings[name]["gb_per_s"] = _bytes_moved(h, result) / (ms["median"] * 1e-3) / 1e9
        except Exception as exc:  # recorded, not fatal: the other providers still run
            timings[name] = {"error": f"{type(exc).__name__}: {exc}"}
    dense = next((timings[n]["median"] for n in DENSE[case["op"]] if "median" in timings.get(n, {})), None)
    for t in timings.values():
        if dense is not None and "median" in t:
            t["speedup_vs_dense"] = dense / t["median"]
    record = {**case, "density": density, "ms": timings, **env}
    if cfg.smoke or not cfg.on_gpu:
        record["smoke"] = True  # a quick run, or the CPU reference's wall clock: never a result
    append_records(out_path, [record])
    return record


def run(cfg: Config, out_path: str | None = None, progress: Callable[[str], None] | None = None) -> list[dict]:
    """Check and time every (op, M, density, provider); returns the records (also appended to
    ``out_path`` as JSON lines, one case at a time)."""
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    timers = (
        Timer(cfg.reps, on_gpu=cfg.on_gpu, warmup=2, flush_l2=cfg.on_gpu),
        Timer(min(cfg.reps, SLOW_REPS), on_gpu=cfg.on_gpu, warmup=1, flush_l2=cfg.on_gpu),
    )
    env = environment()
    dtype = _dtype(cfg.dtype)
    rng = np.random.default_rng(cfg.seed)
    records: list[dict] = []
    cases = [(op, m, n, d) for op in cfg.ops for n in cfg.ns for m in cfg.ms for d in cfg.densities]
    for i, (op, m, n, density) in enumerate(cases, 1):
        providers, pattern = _case_providers(cfg, op, m, n, density, dtype, rng)
        measured = float((pattern != 0).sum()) / pattern.size
        case: dict[str, Any] = {"kind": "micro", "op": op, "shape": [m, n, cfg.k], "dtype": cfg.dtype}
        case.update(pattern=cfg.pattern, density_target=density)
        records.append(_time_case(case, measured, providers, timers, cfg, env, out_path, pattern))
        say(f"[{i}/{len(cases)}] {op} M={m} N={n} density={measured:.3%}: " + _brief(records[-1]["ms"]))
    return records


def _synchronize(on_gpu: bool) -> None:
    if on_gpu:
        import cupy as cp

        cp.cuda.get_current_stream().synchronize()


def _brief(timings: dict[str, Any]) -> str:
    return ", ".join(
        f"{name} {t['median']:.3f} ms" if "median" in t else f"{name} failed" for name, t in timings.items()
    )


def summary(records: list[dict]) -> str:
    """A markdown table per (op, N): median ms and speed-up over dense for each provider."""
    out = []
    for op, width in dict.fromkeys((r["op"], r["shape"][1]) for r in records):
        recs = [r for r in records if r["op"] == op and r["shape"][1] == width]
        names = list(dict.fromkeys(n for r in recs for n in r["ms"]))
        out += [f"\n{op} ({recs[0]['dtype']}, N={width}, K={recs[0]['shape'][2]})", ""]
        out.append("| M | density | " + " | ".join(names) + " |")
        out.append("|---|---|" + "---|" * len(names))
        for r in recs:
            cells = []
            for n in names:
                t = r["ms"].get(n, {})
                if "median" not in t:
                    cells.append("failed" if "error" in t else "")
                    continue
                extra = f" ({t['speedup_vs_dense']:.2f}x)" if "speedup_vs_dense" in t else ""
                if "gb_per_s" in t:
                    extra += f" {t['gb_per_s']:.0f} GB/s"
                cells.append(f"{t['median']:.3f}{extra}")
            out.append(f"| {r['shape'][0]} | {r['density']:.2%} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plots(records: list[dict], out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Speed-up over dense vs density per (op, M, N), with dense = 1 and, for SpMM, the FLOP
    ceiling 1 / density; and SpMM time vs M per provider (at the narrowest N). Needs matplotlib (the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for op in OPS:
        mine = [r for r in records if r["op"] == op]
        widths = sorted({r["shape"][1] for r in mine})
        for m, width in sorted({(r["shape"][0], r["shape"][1]) for r in mine}):
            recs = sorted((r for r in mine if r["shape"][:2] == [m, width]), key=lambda r: r["density"])
            fig, ax = plt.subplots(figsize=(7, 4.5))
            dens = [r["density"] for r in recs]
            for name in dict.fromkeys(n for r in recs for n in r["ms"]):
                pts = [
                    (r["density"], r["ms"][name]["speedup_vs_dense"])
                    for r in recs
                    if "speedup_vs_dense" in r["ms"].get(name, {})
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=name)
            ax.axhline(1.0, color="black", linewidth=1, label="dense = 1")
            if op == "spmm":
                ax.plot(dens, [1 / d for d in dens], "k--", linewidth=1, label="FLOP ceiling 1/density")
            ax.set(xscale="log", yscale="log", xlabel="density", ylabel="speed-up over dense")
            ax.set_title(f"{op}, M = {m}, N = {width}")
            ax.legend(fontsize=7)
            path = out_dir / (f"{op}_speedup_m{m}" + (f"_n{width}" if len(widths) > 1 else "") + ".png")
            fig.savefig(path, dpi=120, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
    spmm = [r for r in records if r["op"] == "spmm"]
    spmm = [r for r in spmm if r["shape"][1] == min(r["shape"][1] for r in spmm)]  # one width
    if len({r["shape"][0] for r in spmm}) > 1:
        target = lambda r: r.get("density_target", float(f"{r['density']:.2g}"))  # noqa: E731
        density = min({target(r) for r in spmm}, key=lambda d: abs(d - 0.01))
        recs = sorted((r for r in spmm if target(r) == density), key=lambda r: r["shape"][0])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in dict.fromkeys(n for r in recs for n in r["ms"]):
            pts = [(r["shape"][0], r["ms"][name]["median"]) for r in recs if "median" in r["ms"].get(name, {})]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="ms")
        ax.set_title(f"spmm time vs M at {density:.2%}")
        ax.legend(fontsize=7)
        path = out_dir / "spmm_time_vs_m.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
