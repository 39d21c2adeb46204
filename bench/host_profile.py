"""Where a sparse FFN call spends its host time: ``cProfile`` over repeated calls of a plan, by
default gated with a fixed spill (no read-back, so the host runs ahead of the GPU and its own
cost shows), on the standard problem. Prints the functions with the most own time and the host
time per call. ``--exact`` profiles the default overflow policy (one read-back per call) instead,
``--plain`` the non-gated block. ``--torch-step`` profiles an eager training step through
``twellsparse.torch`` instead (forward and ``torch.autograd.grad``; ``gated_ffn`` with the exact
spill, or with ``--fixed`` a ``TwELLGatedMLP`` with a fixed ``spill_capacity``): the step that
ran at 0.89x dense eager against 1.48x captured in a CUDA graph (bench/NOTES.md, fifteenth
session).

    python bench/host_profile.py [--density 0.005] [--m 16384] [--exact] [--plain]
        [--dispatch sparse] [--calls 200] [--top 35]
    python bench/host_profile.py --torch-step [--fixed] [--density 0.005] [--calls 50]
    python bench/host_profile.py --torch-phases [--density 0.005] [--calls 50]
    python bench/host_profile.py --sync-probe [--density 0.005]
    python bench/host_profile.py --adapter-cost [--density 0.005]
    python bench/host_profile.py --gpu-gaps [--density 0.01] [--calls 5]

``--adapter-cost`` queues 20 calls of each layer of the torch forward and backward (the CuPy
core, the adapter's Python body, the custom op without and with autograd) behind a 300 ms spin
kernel: host time per call with no wait, then cProfile over the op's calls.

``--torch-phases`` times the eager step's parts without a profiler (whose accounting the
autograd engine's worker thread confuses): the forward alone, the backward alone (one forward
kept, ``retain_graph``), and the adapter's per-call pieces (tensor to CuPy array and back, the
device/stream context, torch's current stream), each as host time per call queued ahead.

``--gpu-gaps`` records eager training steps (``gated_ffn`` with the exact spill, the fixed-spill
module, dense torch) with ``torch.profiler`` and reads the GPU's side: per step the span from
the first kernel's start to the last kernel's end, the time some kernel ran, and the longest
idle gaps with the kernels on either side. Idle time in a step is what capturing it in a CUDA
graph can win back; the gaps' neighbours say which host work (a read-back, the launches after
it) leaves the GPU waiting.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any


def report(calls: int, top: int, runs: dict[str, Callable[[], Any]], sync: Callable[[], Any]) -> None:
    """Host and wall time per call of each of ``runs``, then ``cProfile`` over ``calls`` calls of
    the first (own time, and cumulative time inside twellsparse)."""
    for label, run in runs.items():
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        host = (time.perf_counter() - t0) * 1e3 / calls
        sync()
        wall = (time.perf_counter() - t0) * 1e3 / calls
        print(f"{label}: host {host:.3f} ms per call (queued ahead), wall {wall:.3f} ms per call", flush=True)
    call = next(iter(runs.values()))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    sync()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("twellsparse", top)  # where each call's time goes


def torch_step(args: argparse.Namespace) -> None:
    """The eager gated training step through ``twellsparse.torch`` (see the module docstring)."""
    import torch

    import twellsparse.torch as tt

    x, wg, wu, wd, grad = _torch_problem(args)
    if args.fixed:
        mlp = _fixed_spill_mlp(args, wg, wu, wd)
        inputs = [x, *mlp.parameters()]

        def step() -> None:
            torch.autograd.grad(mlp(x), inputs, grad)
    else:

        def step() -> None:
            torch.autograd.grad(tt.gated_ffn(x, wg, wu, wd), [x, wg, wu, wd], grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    report(args.calls, args.top, {"eager training step": step}, torch.cuda.synchronize)


def torch_phases(args: argparse.Namespace) -> None:
    """Host time per call of the eager step's parts (see the module docstring)."""
    import torch

    import twellsparse.torch as tt

    x, wg, wu, wd, grad = _torch_problem(args)
    inputs = [x, wg, wu, wd]
    kept = tt.gated_ffn(x, wg, wu, wd)
    a = tt._to_array(wg)
    mlp = _fixed_spill_mlp(args, wg, wu, wd)
    params = [x, *mlp.parameters()]
    kept_fixed = mlp(x)
    runs: dict[str, Callable[[], Any]] = {
        "eager training step": lambda: torch.autograd.grad(tt.gated_ffn(x, wg, wu, wd), inputs, grad),
        "forward (autograd on)": lambda: tt.gated_ffn(x, wg, wu, wd),
        "forward (no_grad)": lambda: _no_grad(lambda: tt.gated_ffn(x, wg, wu, wd)),
        "backward (retain_graph)": lambda: torch.autograd.grad(kept, inputs, grad, retain_graph=True),
        "module step, fixed spill": lambda: torch.autograd.grad(mlp(x), params, grad),
        "module forward, fixed spill": lambda: mlp(x),
        "module backward, fixed": lambda: torch.autograd.grad(kept_fixed, params, grad, retain_graph=True),
        "dense step (torch)": lambda: torch.autograd.grad(_dense_ffn(x, wg, wu, wd), inputs, grad),
        "tensor to CuPy array": lambda: tt._to_array(wg),
        "CuPy array to tensor": lambda: tt._to_tensor(a),
        "device/stream context": lambda: _enter_exit(tt._on_device(x)),
        "torch.cuda.current_stream": torch.cuda.current_stream,
    }
    for run in runs.values():  # warm every path (kernels compiled, plans and pools built)
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    for label, run in runs.items():
        t0 = time.perf_counter()
        for _ in range(args.calls):
            run()
        host = (time.perf_counter() - t0) * 1e3 / args.calls
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / args.calls
        print(f"{label:28s} host {host:8.4f} ms per call (queued ahead), wall {wall:8.4f} ms", flush=True)


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""


def sync_probe(args: argparse.Namespace) -> None:
    """Which host call waits for the GPU: each step runs once behind a ~50 ms spin kernel, so a
    call that synchronises takes that long on the host; ``cProfile`` then names the function
    holding the wait. The FFN forward and backward run on CuPy arrays on this (main) thread
    (the torch backward runs on the autograd engine's thread, out of the profiler's sight)."""
    import cupy as cp
    import numpy as np
    import torch

    import twellsparse as ts
    import twellsparse.torch as tt
    from twellsparse._ffn_autodiff import backward_arrays, forward_arrays
    from twellsparse.testing import ffn_problem

    spin = cp.RawKernel(_SPIN, "spin")
    cycles = np.int64(int(cp.cuda.Device().attributes["ClockRate"]) * 50)  # kHz x 50 = 50 ms

    def behind_spin(label: str, f: Callable[[], Any], profile: bool) -> None:
        """Host time of one call of ``f`` queued behind the spin; where it waits, a second
        such call under cProfile names the function holding the wait."""
        for profiled in (False, True):
            spin((1,), (1,), (cycles,))
            prof = cProfile.Profile() if profiled else None
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            f()
            if prof is not None:
                prof.disable()
            host = (time.perf_counter() - t0) * 1e3
            cp.cuda.Device().synchronize()
            torch.cuda.synchronize()
            if prof is None:
                verdict = "WAITS for the GPU" if host > 25 else "no wait"
                print(f"{label:40s} host {host:8.3f} ms behind a 50 ms spin: {verdict}", flush=True)
                if host <= 25 or not profile:
                    return
            else:
                pstats.Stats(prof).sort_stats("tottime").print_stats(8)

    p = ffn_problem(args.m, args.d_model, args.d_ff, args.density, "uniform", np.float32, 0, cp)
    x, wg, wu, wd = (p[k].astype(ts.bfloat16) for k in ("x", "w_gate", "w_up", "w_down"))
    wd = cp.ascontiguousarray(wd.T).T  # the kernels' layout: W_down.T's rows contiguous
    grad = cp.asarray(np.random.default_rng(1).standard_normal((args.m, args.d_model)), dtype=ts.bfloat16)
    spill = args.m * 64
    fwd = lambda: forward_arrays(x, wg, wu, wd, "relu", 256, 32, None, spill)  # noqa: E731
    _, g, u, _ = fwd()
    bwd = lambda: backward_arrays(grad, None, x, wg, wu, wd, g, u, "relu")  # noqa: E731
    bwd()
    cp.cuda.Device().synchronize()
    for name, plan in (
        ("FFN plan, dispatch auto", ts.FFN(wg, cp.ascontiguousarray(wd))),
        ("GatedFFN plan, dispatch auto", ts.GatedFFN(wg, wu, cp.ascontiguousarray(wd))),
    ):
        for _ in range(3):  # past the first call's sample and the GEMM plans' timing
            plan(x)
        cp.cuda.Device().synchronize()
        behind_spin(f"{name} ({plan.last_stats['path']})", lambda plan=plan: plan(x), True)
    behind_spin("forward_arrays, fixed spill", fwd, True)
    behind_spin("backward_arrays", bwd, True)
    tx, twg, twu, twd = (torch.from_dlpack(a).requires_grad_() for a in (x, wg, wu, wd))
    tgrad = torch.from_dlpack(grad)
    mlp = _fixed_spill_mlp(args, twg, twu, twd, spill)
    kept = mlp(tx)
    params = [tx, *mlp.parameters()]
    torch.cuda.synchronize()
    behind_spin("torch module forward, fixed spill", lambda: mlp(tx), True)
    behind_spin("torch module backward", lambda: torch.autograd.grad(kept, params, tgrad, retain_graph=True), False)
    behind_spin("torch gated_ffn forward (exact spill)", lambda: tt.gated_ffn(tx, twg, twu, twd), True)
    kept = tt.gated_ffn(tx, twg, twu, twd)
    inputs = [tx, twg, twu, twd]
    behind_spin("torch gated_ffn backward", lambda: torch.autograd.grad(kept, inputs, tgrad, retain_graph=True), False)


def adapter_cost(args: argparse.Namespace) -> None:
    """Host cost of each layer of the torch adapter (see the module docstring)."""
    import cupy as cp
    import numpy as np
    import torch

    import twellsparse as ts
    import twellsparse.torch as tt
    from twellsparse._ffn_autodiff import backward_arrays, forward_arrays
    from twellsparse.testing import ffn_problem

    spin = cp.RawKernel(_SPIN, "spin")
    cycles = np.int64(int(cp.cuda.Device().attributes["ClockRate"]) * 300)
    p = ffn_problem(args.m, args.d_model, args.d_ff, args.density, "uniform", np.float32, 0, cp)
    x, wg, wu, wd = (p[k].astype(ts.bfloat16) for k in ("x", "w_gate", "w_up", "w_down"))
    wd_k = cp.ascontiguousarray(wd.T).T
    grad = cp.asarray(np.random.default_rng(1).standard_normal((args.m, args.d_model)), dtype=ts.bfloat16)
    spill = args.m * 64
    tx, twg, twu, twd, tgrad = (torch.from_dlpack(a) for a in (x, wg, wu, wd, grad))
    settings = ("relu", 256, 32, None, spill)
    _, g, u, _ = forward_arrays(x, wg, wu, wd_k, *settings)
    hidden = torch.ops.twellsparse.ffn_fwd(tx, twg, twu, twd, *settings)[1:9]
    empty = tx.new_empty((0,))
    bwd_args = (tgrad, empty, empty, tx, twg, twu, twd, *hidden, "relu", 256, True)
    txg, twgg, twug, twdg = (t.detach().requires_grad_() for t in (tx, twg, twu, twd))
    kept = tt.gated_ffn(txg, twgg, twug, twdg)
    layers: dict[str, Callable[[], Any]] = {
        "forward: CuPy core": lambda: forward_arrays(x, wg, wu, wd_k, *settings),
        "forward: adapter body": lambda: tt._ffn_fwd._init_fn(tx, twg, twu, twd, *settings),
        "forward: custom op": lambda: torch.ops.twellsparse.ffn_fwd(tx, twg, twu, twd, *settings),
        "forward: with autograd": lambda: tt._run(txg, twgg, twug, twdg, *settings),
        "backward: CuPy core": lambda: backward_arrays(grad, None, x, wg, wu, wd_k, g, u, "relu"),
        "backward: adapter body": lambda: tt._ffn_bwd._init_fn(*bwd_args),
        "backward: custom op": lambda: torch.ops.twellsparse.ffn_bwd(*bwd_args),
        "backward: autograd.grad": lambda: torch.autograd.grad(kept, [txg, twgg, twug, twdg], tgrad, retain_graph=True),
    }
    calls = 20
    for label, f in layers.items():
        for _ in range(2):
            f()
        torch.cuda.synchronize()
        spin((1,), (1,), (cycles,))
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        host = (time.perf_counter() - t0) * 1e3 / calls
        torch.cuda.synchronize()
        print(f"{label:28s} host {host:7.3f} ms per call, queued behind a spin", flush=True)
    for label in ("forward: custom op", "backward: adapter body"):
        spin((1,), (1,), (cycles,))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            layers[label]()
        prof.disable()
        torch.cuda.synchronize()
        print(f"== {label}: cProfile over {calls} calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def gpu_gaps(args: argparse.Namespace) -> None:
    """The GPU's busy and idle time in eager training steps (see the module docstring)."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    import twellsparse.torch as tt

    x, wg, wu, wd, grad = _torch_problem(args)
    inputs = [x, wg, wu, wd]
    mlp = _fixed_spill_mlp(args, wg, wu, wd)
    params = [x, *mlp.parameters()]
    steps: dict[str, Callable[[], Any]] = {
        "gated_ffn, exact spill": lambda: torch.autograd.grad(tt.gated_ffn(x, wg, wu, wd), inputs, grad),
        "TwELLGatedMLP, fixed spill": lambda: torch.autograd.grad(mlp(x), params, grad),
        "dense (torch)": lambda: torch.autograd.grad(_dense_ffn(x, wg, wu, wd), inputs, grad),
    }
    for label, step in steps.items():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        spans = []
        for _ in range(args.calls):  # one profile per step: a step's kernels are the whole trace
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
            kernels = sorted(
                (e.time_range.start, e.time_range.end, e.name)
                for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA
            )
            # The host's waits: runtime calls that block until the GPU reaches a point (the last
            # one, the probe's own synchronize, left out).
            waits = sorted(
                (e.time_range.start, e.time_range.end - e.time_range.start, e.name)
                for e in events
                if e.device_type == torch.autograd.DeviceType.CPU
                and ("Synchronize" in e.name or e.name in ("cudaMemcpy", "cudaMemcpyAsync"))
            )[:-1]
            spans.append((*_busy_and_gaps(kernels), waits, kernels[0][0] if kernels else 0.0))
        span, busy, gaps, waits, t0 = min(spans, key=lambda s: s[0])  # the fastest step's timeline
        print(
            f"{label}: span {span / 1e3:.3f} ms, kernels busy {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms "
            f"(median span {float(np.median([s[0] for s in spans])) / 1e3:.3f} ms over {len(spans)} steps)",
            flush=True,
        )
        for gap, before, after, at in gaps[:8]:
            print(f"    idle {gap:7.1f} us at {at:8.1f} us after {before[:60]} / before {after[:60]}", flush=True)
        for start, length, name in waits:
            if length > 20.0:
                print(f"    host waits {length:7.1f} us in {name} at {start - t0:8.1f} us", flush=True)


def _busy_and_gaps(
    kernels: list[tuple[float, float, str]],
) -> tuple[float, float, list[tuple[float, str, str, float]]]:
    """``(span, busy, gaps)`` in us of one timeline of ``(start, end, name)`` kernels sorted by
    start: busy is the union of the kernels' intervals, gaps the idle stretches (longest first)
    as ``(length, kernel ending before, kernel starting after, start from the first kernel)``."""
    if not kernels:
        return 0.0, 0.0, []
    busy, gaps = 0.0, []
    start, end, last = kernels[0][0], kernels[0][1], kernels[0][2]
    for s, e, name in kernels[1:]:
        if s > end:
            busy += end - start
            gaps.append((s - end, last, name, end - kernels[0][0]))
            start, end = s, e
        if e >= end:
            end, last = e, name
    busy += end - start
    return end - kernels[0][0], busy, sorted(gaps, reverse=True)


def _no_grad(f: Callable[[], Any]) -> Any:
    import torch

    with torch.no_grad():
        return f()


def _enter_exit(ctx: Any) -> None:
    with ctx:
        pass


def _dense_ffn(x: Any, wg: Any, wu: Any, wd: Any) -> Any:
    import torch

    return torch.relu(x @ wg.t()) * (x @ wu.t()) @ wd.t()


def _torch_problem(args: argparse.Namespace) -> tuple[Any, Any, Any, Any, Any]:
    """``(x, w_gate, w_up, w_down, grad)``: the problem as bf16 CUDA tensors requiring grad, and
    an output gradient."""
    import numpy as np
    import torch

    from twellsparse.testing import ffn_problem

    p = ffn_problem(args.m, args.d_model, args.d_ff, args.density, "uniform", np.float32, 0)
    names = ("x", "w_gate", "w_up", "w_down")
    x, wg, wu, wd = (torch.from_numpy(p[k]).cuda().bfloat16().requires_grad_() for k in names)
    return x, wg, wu, wd, torch.randn(args.m, args.d_model, device="cuda", dtype=torch.bfloat16)


def _fixed_spill_mlp(args: argparse.Namespace, wg: Any, wu: Any, wd: Any, spill: int | None = None) -> Any:
    """A ``TwELLGatedMLP`` with a fixed ``spill_capacity`` (default 64 per token) and the given
    weights."""
    import torch

    import twellsparse.torch as tt

    spill = args.m * 64 if spill is None else spill
    mlp = tt.TwELLGatedMLP(args.d_model, args.d_ff, spill_capacity=spill, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for lin, w in ((mlp.gate_proj, wg), (mlp.up_proj, wu), (mlp.down_proj, wd)):
            lin.weight.copy_(w)
    return mlp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--exact", action="store_true", help="no spill_capacity: the exact read-back")
    ap.add_argument("--plain", action="store_true", help="the non-gated block")
    ap.add_argument("--dispatch", default="sparse", choices=("sparse", "auto", "dense"))
    ap.add_argument("--torch-step", action="store_true", help="an eager training step through twellsparse.torch")
    ap.add_argument("--fixed", action="store_true", help="with --torch-step: TwELLGatedMLP with a fixed spill")
    ap.add_argument("--torch-phases", action="store_true", help="the eager step's parts, host time per call")
    ap.add_argument("--sync-probe", action="store_true", help="which calls wait for the GPU")
    ap.add_argument("--adapter-cost", action="store_true", help="host cost of each torch adapter layer")
    ap.add_argument("--gpu-gaps", action="store_true", help="the GPU's idle time in eager training steps")
    args = ap.parse_args(argv)
    if args.gpu_gaps:
        gpu_gaps(args)
        return 0
    if args.adapter_cost:
        adapter_cost(args)
        return 0
    if args.sync_probe:
        sync_probe(args)
        return 0
    if args.torch_phases:
        torch_phases(args)
        return 0
    if args.torch_step:
        torch_step(args)
        return 0
    import cupy as cp

    import twellsparse as ts
    from twellsparse.testing import ffn_problem

    p = ffn_problem(args.m, args.d_model, args.d_ff, args.density, "uniform", ts.bfloat16, 0, cp)
    spill = None if args.exact else args.m * 64

    def fresh_plan() -> ts.FFN | ts.GatedFFN:
        if args.plain:
            return ts.FFN(p["w_gate"], p["w_down"], dispatch=args.dispatch, spill_capacity=spill)
        return ts.GatedFFN(p["w_gate"], p["w_up"], p["w_down"], dispatch=args.dispatch, spill_capacity=spill)

    plan = fresh_plan()
    x = p["x"]
    for _ in range(5):
        plan(x)
    cp.cuda.Device().synchronize()
    runs = {"prebuilt plan": lambda: plan(x), "plan built per call": lambda: fresh_plan()(x)}
    report(args.calls, args.top, runs, cp.cuda.Device().synchronize)
    return 0


if __name__ == "__main__":
    sys.exit(main())
