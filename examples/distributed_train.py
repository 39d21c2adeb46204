"""Data-parallel training of TwELL MLPs with PyTorch's own distributed stack (DDP or FSDP2).

    torchrun --nproc_per_node=2 examples/distributed_train.py [--fsdp] [--steps 5] [--out r.pt]
    python examples/distributed_train.py --single [--out r.pt]     # the whole batch, one process

On GPUs each rank uses ``cuda:LOCAL_RANK`` with NCCL and the CUDA kernels; on CPUs gloo and the
reference path (what CI runs: tests/test_distributed.py). Every rank trains on an equal slice of
one global batch, and DDP and FSDP2 average the gradients, so the losses and final weights match
the single-process run on the whole batch up to the order of floating-point sums. Each step
prints the global loss and, per rank, the step time and tokens/s; ``--dense`` swaps in dense
MLPs with the same initial weights, the throughput baseline.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_llama import DenseGatedMLP  # the dense twin of TwELLGatedMLP (the script's folder is on sys.path)
from torch import nn

import twellsparse.torch as tt


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
    ap.add_argument("--out", help="rank 0 saves {'losses', 'state'} here (torch.save)")
    args = ap.parse_args(argv)

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
    model: nn.Module = Model(args.d_model, args.d_ff, args.layers, args.dense, args.tile_n).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.d_model, generator=gen).to(device)
    y = torch.randn(args.tokens, args.d_model, generator=gen).to(device)
    shard = slice(rank * args.tokens // world, (rank + 1) * args.tokens // world)
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

    losses = []
    loss = total = None  # the last step's (their autograd nodes can hold FSDP/DDP hook state)
    for step in range(args.steps):
        if use_cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x[shard]), y[shard]) + args.l1 * inner.l1_penalty()  # type: ignore[operator]
        loss.backward()
        opt.step()
        if use_cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        total = loss.detach().clone()
        if not args.single:
            dist.all_reduce(total)
        losses.append(total.item() / world)
        print(
            f"rank {rank} step {step}: loss {losses[-1]:.6f}, {dt * 1e3:.1f} ms, "
            f"{(shard.stop - shard.start) / dt:.0f} tokens/s",
            flush=True,
        )
    state = full_state(model)
    if rank == 0 and args.out:
        torch.save({"losses": losses, "state": state}, args.out)
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
