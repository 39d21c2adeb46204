"""Training step of the gated FFN: twellsparse.torch vs dense torch autograd, side by side.

Forward + backward of ``(relu(x Wg^T) * (x Wu^T)) Wd^T`` on the standard problem of TARGETS.md
(bf16, M 16384, d_model 2048, d_ff 5632) at several gate densities: median time, peak memory,
and the bytes of activations saved for the backward (parameters and the input excluded); on
the GPU also both steps captured whole in CUDA graphs (the sparse one with a fixed spill).

Eager steps are timed twice: each step alone (CUDA events around one step, the GPU idle before
it, so the host's launch time before the first kernels counts in full), and back to back (a
training loop's throughput: ``--reps`` steps queued, one synchronisation, the time per step),
where the host queues the next step while the GPU runs the last one, except where a step reads
back from the device (the exact spill's overflow count, once per forward). Back to back the
sparse step runs twice: ``gated_ffn`` (the exact spill) and ``TwELLGatedMLP`` with a fixed
``spill_capacity`` (nothing read back).
Results as JSON lines (``--out``). ``--quick`` runs a tiny float32 case (CPU smoke test).

Usage: python bench/train_step.py [--quick] [--densities 0.005,0.01,0.02] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch_graphs import captured

import twellsparse.torch as tt
from twellsparse._environment import append_records, environment
from twellsparse._timing import Timer
from twellsparse.testing import ffn_problem


def saved_activation_bytes(fn: Callable[[], torch.Tensor], exclude: list[torch.Tensor]) -> int:
    """Bytes autograd saves for the backward of ``fn()``, not counting the ``exclude`` tensors."""
    skip = {t.data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in skip:
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def problem(
    args: argparse.Namespace, density: float, device: str, dtype: torch.dtype
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``([x, w_gate, w_up, w_down], grad)``: the inputs (requiring grad) and an output gradient."""
    p = ffn_problem(args.m, args.d_model, args.d_ff, density, args.pattern, np.float32, 0)
    params = [torch.from_numpy(p[k]).to(device, dtype).requires_grad_() for k in ("x", "w_gate", "w_up", "w_down")]
    return params, torch.randn(args.m, args.d_model, device=device, dtype=dtype)


def case(args: argparse.Namespace, density: float, device: str, dtype: torch.dtype) -> dict[str, Any]:
    params, grad = problem(args, density, device, dtype)
    x, wg, wu, wd = params

    def dense() -> torch.Tensor:
        return (torch.relu(x @ wg.T) * (x @ wu.T)) @ wd.T

    def sparse() -> torch.Tensor:
        return tt.gated_ffn(x, wg, wu, wd)

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            torch.autograd.grad(fn(), params, grad)

        return run

    with torch.no_grad():
        sparse_out, dense_out = sparse().float(), dense().float()
    err = float((sparse_out - dense_out).norm() / dense_out.norm())
    if not err < 2e-2:
        raise SystemExit(f"sparse vs dense forward: relative error {err:.3e}; not timing")
    # The timed step is the backward too: every gradient checked against dense autograd's.
    grad_errors = {}
    for name, got, want in zip(
        ("x", "w_gate", "w_up", "w_down"),
        torch.autograd.grad(sparse(), params, grad),
        torch.autograd.grad(dense(), params, grad),
        strict=True,
    ):
        grad_errors[name] = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
        if not grad_errors[name] < 3e-2:
            raise SystemExit(f"sparse vs dense gradient of {name}: relative error {grad_errors[name]:.3e}; not timing")
    density_measured = float((torch.relu(x @ wg.T) > 0).float().mean())
    cuda = device.startswith("cuda")
    rec: dict[str, Any] = {
        "pattern": args.pattern,
        "density_target": density,
        "density": density_measured,
        "rel_error": err,
        "grad_rel_error": grad_errors,
        "reps": args.reps,
    }
    steps = {"dense": step(dense), "twell": step(sparse)}
    for name, fn in (("dense", dense), ("twell", sparse)):
        if cuda:  # one step alone for its peak memory
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        steps[name]()
        rec[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
        rec[f"{name}_saved_bytes"] = saved_activation_bytes(fn, params)
    # Timed in rounds (Timer.interleaved): a drift of the clocks reaches both steps alike.
    for name, (_, stats) in Timer(args.reps, on_gpu=cuda, warmup=1).interleaved(steps, keep=False).items():
        rec[f"{name}_ms"] = stats["median"]
    rec["speedup"] = rec["dense_ms"] / rec["twell_ms"]
    rec["saved_ratio"] = rec["twell_saved_bytes"] / max(rec["dense_saved_bytes"], 1)
    if cuda:
        rec.update(back_to_back(args, params, grad, steps))
    if cuda and not args.no_graphs:
        rec.update(captured_steps(args, params, grad))
    return rec


def module_step(args: argparse.Namespace, params: list[torch.Tensor], grad: torch.Tensor) -> tuple[Callable, Any]:
    """``(step, mlp)``: a training step of ``TwELLGatedMLP`` with a fixed ``spill_capacity`` on
    copies of ``params``' weights (new leaves: a captured step needs its own), and the module
    (its ``check_spill`` says whether the timing is valid)."""
    params = [p.detach().clone().requires_grad_() for p in params]
    x, wg, wu, wd = params
    mlp = tt.TwELLGatedMLP(args.d_model, args.d_ff, spill_capacity=args.m * 64, device=x.device, dtype=x.dtype)
    with torch.no_grad():
        for lin, w in ((mlp.gate_proj, wg), (mlp.up_proj, wu), (mlp.down_proj, wd)):
            lin.weight.copy_(w)
    inputs = [x, *mlp.parameters()]
    return (lambda: torch.autograd.grad(mlp(x), inputs, grad)), mlp


def back_to_back(
    args: argparse.Namespace, params: list[torch.Tensor], grad: torch.Tensor, steps: dict[str, Callable[[], None]]
) -> dict[str, Any]:
    """Time per step of ``--reps`` eager steps queued back to back (one synchronisation), for
    each of ``steps`` and the fixed-spill module (``twell_module``)."""
    module, mlp = module_step(args, params, grad)
    rec: dict[str, Any] = {}
    for name, run in {**steps, "twell_module": module}.items():
        run()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.reps):
            run()
        stop.record()
        stop.synchronize()
        rec[f"{name}_b2b_ms"] = start.elapsed_time(stop) / args.reps
    mlp.check_spill()
    for name in ("twell", "twell_module"):
        rec[f"speedup_{name}_b2b"] = rec["dense_b2b_ms"] / rec[f"{name}_b2b_ms"]
    return rec


def captured_steps(args: argparse.Namespace, params: list[torch.Tensor], grad: torch.Tensor) -> dict[str, Any]:
    """Both steps captured whole in a CUDA graph (host launch costs gone): the dense one as it
    is, the sparse one through ``TwELLGatedMLP`` with a fixed ``spill_capacity`` (nothing read
    back; the entries it left out are checked after the replays)."""
    # New leaves: the eager steps' gradient-accumulator nodes live on the default stream.
    params = [p.detach().clone().requires_grad_() for p in params]
    x, wg, wu, wd = params
    sparse, mlp = module_step(args, params, grad)
    steps = {
        "dense": lambda: torch.autograd.grad((torch.relu(x @ wg.T) * (x @ wu.T)) @ wd.T, params, grad),
        "twell": sparse,
    }
    graphs = {name: captured(run) for name, run in steps.items()}
    timed = Timer(args.reps, on_gpu=True, warmup=1).interleaved(graphs, keep=False)  # in rounds
    rec = {f"{name}_graph_ms": stats["median"] for name, (_, stats) in timed.items()}
    torch.cuda.synchronize()
    mlp.check_spill()  # raises if the fixed spill left entries out (the timing would be void)
    rec["speedup_graph"] = rec["dense_graph_ms"] / rec["twell_graph_ms"]
    return rec


def profile(args: argparse.Namespace, density: float) -> str:
    """torch.profiler's table of a few sparse training steps: every kernel and op by GPU time,
    so the step's time beyond its kernels (bench/stage_times.py) shows where it goes."""
    params, grad = problem(args, density, "cuda", torch.bfloat16)
    for _ in range(2):
        torch.autograd.grad(tt.gated_ffn(*params), params, grad)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            torch.autograd.grad(tt.gated_ffn(*params), params, grad)
        torch.cuda.synchronize()
    return str(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--densities", default="0.005,0.01,0.02")
    ap.add_argument("--pattern", default="uniform", help="uniform or skewed (TARGETS.md; hot units: long dW rows)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's table of sparse steps (GPU)")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph-captured steps (GPU)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.quick:
        args.m, args.d_model, args.d_ff, args.reps = 64, 32, 256, 2
    env = environment()
    records = []
    for density in (float(d) for d in args.densities.split(",")):
        rec = {
            "kind": "train_step",
            **env,
            "shape": [args.m, args.d_model, args.d_ff],
            "dtype": str(dtype),
            "device_path": device,
            **case(args, density, device, dtype),
            **({"smoke": True} if args.quick else {}),
        }
        records.append(rec)
        print(
            f"density {density:6.2%}: dense {rec['dense_ms']:.3f} ms, twell {rec['twell_ms']:.3f} ms "
            f"({rec['speedup']:.2f}x); saved activations {rec['twell_saved_bytes']:,} vs "
            f"{rec['dense_saved_bytes']:,} bytes ({rec['saved_ratio']:.2f}x)",
            flush=True,
        )
        if "speedup_twell_b2b" in rec:
            print(
                f"  eager back to back: dense {rec['dense_b2b_ms']:.3f} ms, twell {rec['twell_b2b_ms']:.3f} ms "
                f"({rec['speedup_twell_b2b']:.2f}x), fixed-spill module {rec['twell_module_b2b_ms']:.3f} ms "
                f"({rec['speedup_twell_module_b2b']:.2f}x)",
                flush=True,
            )
        if "speedup_graph" in rec:
            print(
                f"  captured in CUDA graphs: dense {rec['dense_graph_ms']:.3f} ms, twell "
                f"{rec['twell_graph_ms']:.3f} ms ({rec['speedup_graph']:.2f}x)",
                flush=True,
            )
        if args.profile and device == "cuda":
            print(profile(args, density), flush=True)
    append_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
