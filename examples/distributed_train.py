r"""Data-parallel training of TwELL MLPs with PyTorch's own distributed stack (DDP or FSDP2).

    torchrun --nproc_per_node=2 examples/distributed_train.py [--fsdp] [--steps 5] [--out r.pt]
    python examples/distributed_train.py --single [--out r.pt]     # the whole batch, one process
    torchrun --nproc_per_node=2 examples/distributed_train.py --dtype bfloat16 --density 0.01 \
        --tokens 32768 --d-model 2048 --d-ff 5632 --layers 4 --steps 8 [--dense] --json r.jsonl

On GPUs each rank uses ``cuda:LOCAL_RANK`` with NCCL and the CUDA kernels; on CPUs gloo and the
reference path (what CI runs: tests/test_distributed.py). Every rank trains on an equal slice of
one global batch, and DDP and FSDP2 average the gradients, so the losses and final weights match
the single-process run on the whole batch up to the order of floating-point sums. Each step
prints the global loss and, per rank, the step time and tokens/s; ``--dense`` swaps in dense
MLPs with the same initial weights, the throughput baseline. ``--density`` sets each layer's
gate threshold so that it keeps that fraction of the first batch's activations (the dense twin
applies the same thresholds: both MLPs compute one function; the L1 penalty, ``--l1``, applies
to the TwELL layers only, so with ``--l1 0`` both train one loss), and ``--json`` appends rank
0's record
of the run (the median step time of the slowest rank after the first step, tokens/s per GPU,
the layers' measured density, where it ran).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_llama import DenseGatedMLP, gate_threshold  # the script's folder is on sys.path
from torch import nn

import twellsparse.torch as tt
from twellsparse._environment import append_records, run_record


class Block(nn.Module):
    def __init__(self, d: int, f: int, dense: bool, tile_n: int) -> None:
        super().__init__()
        self.mlp = DenseGatedMLP(d, f) if dense else tt.TwELLGatedMLP(d, f, tile_n=tile_n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, d: int, f: int, layers: int, dense: bool, tile_n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, f, dense, tile_n) for _ in range(layers))
        self.head = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def l1_penalty(self) -> torch.Tensor:
        terms = [b.mlp.l1_penalty() for b in self.blocks if hasattr(b.mlp, "l1_penalty")]
        return torch.stack(terms).sum() if terms else torch.zeros(())


def set_density(model: Model, x: torch.Tensor, density: float) -> None:
    """Each block's gate threshold so that it keeps ``density`` of its activations on ``x``,
    layer by layer (each layer sees the thresholds before it); the same on every rank."""
    h = x
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.threshold = gate_threshold(block.mlp.gate_proj(h), density)
            h = block(h)


def measured_density(model: Model) -> float | None:
    """The TwELL layers' mean density in the last forward (None for dense MLPs)."""
    values = [b.mlp.stats().get("density") for b in model.blocks if hasattr(b.mlp, "stats")]
    values = [v for v in values if v is not None]
    return float(sum(values) / len(values)) if values else None


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU copies of the parameters (FSDP2 holds DTensor shards)."""
    state = {}
    for name, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        state[name.removeprefix("module.")] = value.detach().cpu().clone()
    return state


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--single", action="store_true", help="one process on the whole batch (the reference)")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--dense", action="store_true", help="dense MLPs (the throughput baseline)")
    ap.add_argument("--cpu", action="store_true", help="stay on the CPU even with GPUs")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="global batch, split evenly over ranks")
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--d-ff", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tile-n", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--l1", type=float, default=1e-3)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--density", type=float, help="set the gates' thresholds to keep this fraction")
    ap.add_argument("--out", help="rank 0 saves {'losses', 'state'} here (torch.save)")
    ap.add_argument("--json", help="rank 0 appends the run's record here (JSON lines)")
    args = ap.parse_args(argv)
    if args.density is not None and not 0.0 < args.density <= 1.0:
        raise SystemExit(f"--density: expected a fraction in (0, 1], got {args.density}")
    if args.steps < 1:
        raise SystemExit(f"--steps: expected at least 1, got {args.steps}")
    if args.single and args.fsdp:
        raise SystemExit("--fsdp: expected a distributed run (torchrun), got --single")
    dtype = getattr(torch, args.dtype)

    use_cuda = torch.cuda.is_available() and not args.cpu
    if args.single:
        rank, world, local = 0, 1, 0
    else:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device(f"cuda:{local}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if args.tokens % world:
        raise SystemExit(f"--tokens: expected a multiple of the world size {world}, got {args.tokens}")

    torch.manual_seed(0)  # the same initial weights on every rank and in --single
    model: nn.Module = Model(args.d_model, args.d_ff, args.layers, args.dense, args.tile_n).to(device, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.d_model, generator=gen).to(device, dtype)
    y = torch.randn(args.tokens, args.d_model, generator=gen).to(device, dtype)
    shard = slice(rank * args.tokens // world, (rank + 1) * args.tokens // world)
    if args.density is not None:
        set_density(model, x, args.density)  # type: ignore[arg-type]
    inner = model
    if not args.single:
        if args.fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in inner.blocks:  # type: ignore[union-attr]
                fully_shard(block)
            fully_shard(model)
        else:
            model = nn.parallel.DistributedDataParallel(model, device_ids=[local] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    losses, step_ms = [], []
    loss = total = None  # the last step's (their autograd nodes can hold FSDP/DDP hook state)
    for step in range(args.steps):
        if use_cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x[shard]), y[shard])
        if args.l1:  # a zero-weighted penalty would still send a gradient into the hidden layer
            loss = loss + args.l1 * inner.l1_penalty()  # type: ignore[operator]
        loss.backward()
        opt.step()
        if use_cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        total = loss.detach().float()  # reduced in float32 (the loss may be bf16)
        slowest = torch.tensor([dt], dtype=torch.float64, device=device)
        if not args.single:
            dist.all_reduce(total)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the step ends when every rank's does
        losses.append(total.item() / world)
        step_ms.append(slowest.item() * 1e3)
        print(
            f"rank {rank} step {step}: loss {losses[-1]:.6f}, {dt * 1e3:.1f} ms, "
            f"{(shard.stop - shard.start) / dt:.0f} tokens/s",
            flush=True,
        )
    state = full_state(model)
    if rank == 0 and args.out:
        torch.save({"losses": losses, "state": state}, args.out)
    if rank == 0 and args.json:
        record = run_record(
            step_ms,
            shard.stop - shard.start,
            kind="distributed",
            framework="torch",
            mode="single" if args.single else ("fsdp2" if args.fsdp else "ddp"),
            mlp="dense" if args.dense else "twell",
            world=world,
            device_kind="cuda" if use_cuda else "cpu",
            dtype=args.dtype,
            shape=[args.tokens, args.d_model, args.d_ff],
            layers=args.layers,
            density_target=args.density,
            density=measured_density(inner),  # type: ignore[arg-type]
            losses=losses,
        )
        append_records(args.json, [record])
    if not args.single:
        # Drop everything that may still hold the group's work objects (FSDP2's pending reduce and
        # gather state, DDP's reducer) while the interpreter is fully alive, wait for rank 0 to
        # finish saving, then tear gloo/NCCL down: freeing those objects during interpreter
        # finalization is what aborts a rank at exit (pytorch/pytorch#179291).
        del model, inner, opt, loss, total
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
