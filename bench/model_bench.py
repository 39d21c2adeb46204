"""Whole-model benchmark: a Llama-style decoder stack with TwELL MLPs vs the same with dense MLPs.

The published 2B sparse model's shape (d_model 2048, d_ff 5632, 32 heads, RMSNorm, torch SDPA
attention), ``--layers`` of its 38 layers, batch 64 x 2048 tokens, bf16. Weights are synthetic;
each gate keeps ``relu(z)`` only where ``z`` exceeds a threshold set per layer so that the
measured density is the requested one. The dense twin first applies the same mask (both compute
one function: the recorded ``rel_error``, which must be below 2e-2), then is timed with plain
relu, as a dense model runs (the mask's compare is no dense model's work). Reports forward and
training-step tokens per ms for both, per layer and for the stack, as JSON lines (``--out``).
``--quick`` runs a tiny CPU case (smoke test). RMSNorm is torch's fused ``F.rms_norm`` in both
stacks; ``--composite-norm`` writes it out in six elementwise and reduction passes, the form
timed until the forty-third session (~15.6 ms of GPU time in a 4-layer forward on an H100, in
both stacks alike, which lowers the ratio; each record says which, ``"norm"``).

Usage: python bench/model_bench.py [--quick] [--layers 4] [--densities 0.005,0.01] [--out FILE]
                                   [--profile] [--composite-norm]

``--profile`` prints, per density, the GPU time of each kernel in one forward of both stacks
(torch.profiler; summed over the layers, largest first) instead of timing them.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch_graphs import captured, fresh_leaves

from twellsparse._environment import append_records, environment
from twellsparse._timing import Timer

_EX = pathlib.Path(__file__).resolve().parents[1] / "examples" / "tiny_llama.py"


def _example() -> Any:
    """The decoder blocks of examples/tiny_llama.py (one model definition for both)."""
    spec = importlib.util.spec_from_file_location("tiny_llama", _EX)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny_llama"] = module
    spec.loader.exec_module(module)
    return module


def build(ex: Any, cfg: Any, n_layers: int, density: float, device: str, dtype: torch.dtype, x: torch.Tensor):
    """(sparse blocks, dense blocks) sharing weights; per-layer gate thresholds set the density,
    chosen layer by layer on a sample of the input (each layer sees the thresholds before it)."""
    torch.manual_seed(0)
    dense = nn.ModuleList(ex.Block(cfg, sparse=False) for _ in range(n_layers)).to(device, dtype)
    sparse = nn.ModuleList(ex.Block(cfg, sparse=True) for _ in range(n_layers)).to(device, dtype)
    sparse.load_state_dict(dense.state_dict())
    h = x[:2].detach()
    with torch.no_grad():
        for block_d, block_s in zip(dense, sparse, strict=True):
            seen: list[torch.Tensor] = []
            hook = block_d.mlp.register_forward_pre_hook(lambda _m, inp, seen=seen: seen.append(inp[0]))
            block_d(h)
            hook.remove()
            t = ex.gate_threshold(block_d.mlp.gate_proj(seen[0]), density)
            block_s.mlp.threshold = t
            block_d.mlp.threshold = t  # DenseGatedMLP's gate then keeps z > t, as the sparse one
            h = block_d(h)
    return sparse, dense


def run_stack(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


#: The captured and fixed-spill runs' spill capacity per token (``spill_capacity`` of each sparse
#: MLP: nothing read back; entries left out raise).
SPILL_PER_TOKEN = 8


def captured_times(
    timer: Timer, sparse: nn.ModuleList, dense: nn.ModuleList, x: torch.Tensor, train_step: Any, n_tokens: int
) -> dict[str, float]:
    """Forward and training step of both stacks captured whole in CUDA graphs (the host's
    launches gone). The sparse MLPs get a fixed ``spill_capacity`` (:data:`SPILL_PER_TOKEN`
    entries a token), so nothing is read back; the entries they left out are checked after the
    replays."""

    def times() -> dict[str, float]:
        for blocks in (sparse, dense):
            fresh_leaves(blocks)
        x_train = x.detach().clone().requires_grad_()
        rec = {}
        stacks = (("dense", dense), ("twell", sparse))
        # The two forwards' graphs timed in rounds (Timer.interleaved); the training steps' graphs
        # one after the other, so that only one holds its saved activations at a time.
        with torch.no_grad():
            forwards = {name: captured(lambda b=blocks: run_stack(b, x)) for name, blocks in stacks}
            for name, (_, stats) in timer.interleaved(forwards, keep=False).items():
                rec[f"{name}_forward_graph_ms"] = stats["median"]
        del forwards
        for name, blocks in stacks:
            rec[f"{name}_train_graph_ms"] = timer(captured(lambda b=blocks: train_step(b, x_train)))[1]["median"]
        check_spills(sparse)
        return rec

    return with_spill(sparse, SPILL_PER_TOKEN * n_tokens, times)()


def kernel_times(fn: Callable[[], Any], top: int = 12) -> list[tuple[float, int, str]]:
    """``(total us, calls, name)`` of the kernels of one call of ``fn`` (a forward, eager or a
    graph's replay), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()  # warm: compiled kernels, plans, cached maps
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            t = totals.setdefault(e.name, [0.0, 0])
            t[0] += e.time_range.end - e.time_range.start
            t[1] += 1
    rows = sorted(((us, int(n), name) for name, (us, n) in totals.items()), reverse=True)
    return rows[:top]


def with_spill(blocks: nn.ModuleList, spill: int, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with every sparse MLP of ``blocks`` on a fixed ``spill_capacity`` (the captured
    runs' setting), restored to the exact spill afterwards. Nothing is read back: each such
    forward checks the previous one's entries left out, and :func:`check_spills` the last's."""

    def run() -> Any:
        for block in blocks:
            block.mlp.spill_capacity = spill
        try:
            return fn()
        finally:
            for block in blocks:
                block.mlp.spill_capacity = None

    return run


def check_spills(blocks: nn.ModuleList) -> None:
    """Raise if the last fixed-spill forward (or graph replay) of a sparse MLP of ``blocks`` left
    entries out (after the GPU's work)."""
    torch.cuda.synchronize()
    for block in blocks:
        block.mlp.check_spill()


def profile_forwards(
    timer: Timer, sparse: nn.ModuleList, dense: nn.ModuleList, x: torch.Tensor, n_tokens: int, density: float
) -> None:
    """Where the forwards' time goes, eager and captured: the five forwards (sparse exact,
    sparse with the fixed spill, its captured graph, dense, dense captured) timed in rounds and
    each in a block of its own, then each one's kernels by GPU time (the captured forward had
    read slower than the eager one in rounds, bench/NOTES.md, forty-second session)."""
    spill = SPILL_PER_TOKEN * n_tokens
    with torch.no_grad():
        fixed = with_spill(sparse, spill, lambda: run_stack(sparse, x))
        fns = {
            "twell": lambda: run_stack(sparse, x),
            "twell, fixed spill": fixed,
            "twell, captured": captured(fixed),
            "dense": lambda: run_stack(dense, x),
            "dense, captured": captured(lambda: run_stack(dense, x)),
        }
        rounds = timer.interleaved(fns, keep=False)
        for name, fn in fns.items():
            in_rounds, in_block = rounds[name][1]["median"], timer(fn)[1]["median"]
            print(f"{name} forward, {density:.2%}: {in_rounds:.2f} ms in rounds, {in_block:.2f} in a block")
        for name, fn in fns.items():
            print(f"{name} forward, density {density:.2%}: kernels by GPU time (us, calls)")
            for us, calls, kernel in kernel_times(fn, top=20):
                print(f"  {us:10.1f} {calls:4d}  {kernel[:110]}")
    with_spill(sparse, spill, lambda: check_spills(sparse))()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--densities", default="0.005,0.01")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph-captured runs (GPU)")
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of one forward (GPU)")
    ap.add_argument(
        "--composite-norm",
        action="store_true",
        help="RMSNorm written out in six passes (the model's form until the forty-third session), not F.rms_norm",
    )
    args = ap.parse_args(argv)
    ex = _example()
    cuda = torch.cuda.is_available() and not args.quick
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    fused_norm = not args.composite_norm
    cfg = ex.Config(vocab=32000, d_model=2048, d_ff=5632, n_heads=32, seq=args.seq, tile_n=256, fused_norm=fused_norm)
    if args.quick:
        cfg = ex.Config(vocab=128, d_model=32, d_ff=256, n_heads=4, seq=16, tile_n=32, fused_norm=fused_norm)
        args.layers, args.batch, args.reps = 2, 4, 1
    n_tokens = args.batch * cfg.seq
    # The decoder stack alone is timed: the embedding and LM head are the same in both models.
    x = torch.randn(args.batch, cfg.seq, cfg.d_model, device=device, dtype=dtype)
    env = environment()
    timer = Timer(args.reps, on_gpu=cuda, warmup=1)
    for density in (float(d) for d in args.densities.split(",")):
        sparse, dense = build(ex, cfg, args.layers, density, device, dtype, x)
        with torch.no_grad():
            out_s, out_d = run_stack(sparse, x).float(), run_stack(dense, x).float()
        err = float((out_s - out_d).norm() / out_d.norm())
        if not err < 2e-2:
            raise SystemExit(f"TwELL vs dense stack: relative error {err:.3e} at {density:.2%}; not timing")
        measured = [b.mlp.stats()["density"] for b in sparse]
        # Checked against the thresholded twin (the same function); timed as a dense model runs,
        # plain relu: a dense MLP's cost does not depend on the threshold, and the twin's compare
        # and mask would add work that no dense baseline does.
        for block in dense:
            block.mlp.threshold = None
        if args.profile and cuda:
            profile_forwards(timer, sparse, dense, x, n_tokens, density)
            continue
        x_train = x.detach().requires_grad_()

        def train_step(blocks: nn.ModuleList, x_in: torch.Tensor = x_train) -> None:
            run_stack(blocks, x_in).float().pow(2).mean().backward()
            blocks.zero_grad(set_to_none=True)

        rec: dict[str, Any] = {
            "kind": "model",
            **env,
            "layers": args.layers,
            "tokens": n_tokens,
            "d_model": cfg.d_model,
            "d_ff": cfg.d_ff,
            "dtype": str(dtype),
            "density_target": density,
            "density_per_layer": measured,
            "rel_error": err,
            "dense_gate": "relu",
            "norm": "fused" if fused_norm else "composite",
            "reps": args.reps,
            **({"smoke": True} if args.quick else {}),
        }
        # Each pair timed in rounds (Timer.interleaved): a drift of the clocks reaches both stacks.
        stacks = {"dense": dense, "twell": sparse}
        with torch.no_grad():
            forwards = timer.interleaved({n: (lambda b=b: run_stack(b, x)) for n, b in stacks.items()}, keep=False)
        steps = timer.interleaved({n: (lambda b=b: train_step(b)) for n, b in stacks.items()}, keep=False)
        for name in stacks:
            rec[f"{name}_forward_ms"] = forwards[name][1]["median"]
            rec[f"{name}_train_ms"] = steps[name][1]["median"]
        kinds = ["forward", "train"]
        if cuda and not args.no_graphs:
            rec.update(captured_times(timer, sparse, dense, x, train_step, n_tokens))
            kinds += ["forward_graph", "train_graph"]
        for kind in kinds:
            rec[f"{kind}_speedup"] = rec[f"dense_{kind}_ms"] / rec[f"twell_{kind}_ms"]
            rec[f"twell_{kind}_tokens_per_ms"] = n_tokens / rec[f"twell_{kind}_ms"]
            rec[f"dense_{kind}_tokens_per_ms"] = n_tokens / rec[f"dense_{kind}_ms"]
        print(
            f"density {density:.2%} (measured {np.mean(measured):.2%}), {args.layers} layers: forward "
            f"{rec['forward_speedup']:.2f}x, train step {rec['train_speedup']:.2f}x, rel. error {err:.2e}",
            flush=True,
        )
        if "forward_graph_speedup" in rec:
            print(
                f"  captured in CUDA graphs: forward {rec['forward_graph_speedup']:.2f}x, "
                f"train step {rec['train_graph_speedup']:.2f}x",
                flush=True,
            )
        append_records(args.out, [rec])
    return 0


if __name__ == "__main__":
    sys.exit(main())
