"""Train a small ReLU-gated Llama-style model with an L1 penalty on its gate activations.

The data is generated: sequences from a fixed random bigram language (each token's successor
drawn from a sparse transition table), so the example needs no download. After training it
prints, for about a dozen steps spread over the run, the loss, the gate density of every layer
and the step time; ``--compare-dense`` also trains the same model with dense MLPs (same initial
weights, no L1 penalty: what a dense model trains) and prints both step times side by side.

On a GPU (``--device cuda``) the MLPs run the twellsparse kernels; on the CPU they run the
NumPy reference path, which is exact but slow, so keep the model small there.

Usage: python examples/tiny_llama.py [--device cuda] [--steps 300] [--l1 3e-2] [--compare-dense]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import twellsparse.torch as tt


@dataclass
class Config:
    vocab: int = 256
    d_model: int = 128
    d_ff: int = 512
    n_layers: int = 2
    n_heads: int = 4
    seq: int = 64
    tile_n: int = 64
    #: RMSNorm by torch's fused ``F.rms_norm`` (default), or written out as six elementwise and
    #: reduction passes (the form bench/model_bench.py timed until the forty-third session).
    fused_norm: bool = True


class RMSNorm(nn.Module):
    """RMSNorm through torch's own ``F.rms_norm`` (one fused kernel on CUDA, fp32 statistics), or
    with ``fused=False`` written out as ``x * rsqrt(mean(x^2) + eps) * w`` in x's dtype: six passes
    over the activations, ~15.6 ms of the GPU time of a 4-layer forward of 131072 tokens on an
    H100 (bench/NOTES.md, forty-third session)."""

    def __init__(self, d: int, fused: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def gate_threshold(z: torch.Tensor, density: float) -> float:
    """The gate threshold that keeps a ``density`` fraction of the pre-activations ``z`` (at least
    0, relu's): their quantile, over at most 2**24 of them (torch.quantile's limit)."""
    return max(float(torch.quantile(z.float().flatten()[: 1 << 24], 1.0 - density)), 0.0)


class DenseGatedMLP(nn.Module):
    """The dense twin of TwELLGatedMLP (same parameter names; with a ``threshold`` the gate keeps
    ``relu(z)`` only where ``z`` exceeds it, as the sparse module does)."""

    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.threshold: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.gate_proj(x)
        gate = F.relu(z) if self.threshold is None else torch.where(z > self.threshold, z, 0.0)
        return self.down_proj(gate * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: Config, sparse: bool) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1, self.norm2 = RMSNorm(cfg.d_model, cfg.fused_norm), RMSNorm(cfg.d_model, cfg.fused_norm)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.mlp: nn.Module = (
            tt.TwELLGatedMLP(cfg.d_model, cfg.d_ff, tile_n=cfg.tile_n)
            if sparse
            else DenseGatedMLP(cfg.d_model, cfg.d_ff)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLlama(nn.Module):
    def __init__(self, cfg: Config, sparse: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, sparse) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.fused_norm)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def l1_penalty(self) -> torch.Tensor:
        terms = [b.mlp.l1_penalty() for b in self.blocks if isinstance(b.mlp, tt.TwELLGatedMLP)]
        return torch.stack(terms).sum() if terms else torch.zeros(())


def bigram_batches(cfg: Config, batch: int, seed: int = 0):
    """Endless batches from a random sparse bigram language (4 successors per token)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, cfg.vocab, (cfg.vocab, 4), generator=g)
    while True:
        seq = torch.empty(batch, cfg.seq + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, cfg.vocab, (batch,), generator=g)
        for i in range(cfg.seq):
            pick = torch.randint(0, 4, (batch,), generator=g)
            seq[:, i + 1] = successors[seq[:, i], pick]
        yield seq[:, :-1], seq[:, 1:]


def train(
    cfg: Config, steps: int, batch: int, l1: float, device: str, sparse: bool, seed: int = 0, log_every: int = 25
) -> list[tuple[int, float, list[float], float]]:
    """Train and return the history: (step, loss, densities per layer, ms per step)."""
    torch.manual_seed(seed)
    model = TinyLlama(cfg, sparse).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    history = []
    data = bigram_batches(cfg, batch, seed)
    for step in range(1, steps + 1):
        inputs, targets = (t.to(device) for t in next(data))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))
        total = loss + l1 * model.l1_penalty() if sparse else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        if step % log_every == 0 or step == steps:
            dens = [b.mlp.stats()["density"] for b in model.blocks] if sparse else []
            history.append((step, loss.item(), dens, ms))
    return history


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--l1", type=float, default=3e-2)
    ap.add_argument("--compare-dense", action="store_true")
    ap.add_argument("--small", action="store_true", help="a very small model (CPU smoke runs)")
    args = ap.parse_args(argv)
    for name in ("steps", "batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}: expected at least 1, got {getattr(args, name)}")
    cfg = Config(d_model=32, d_ff=128, n_layers=1, seq=16, tile_n=32) if args.small else Config()
    log_every = max(args.steps // 12, 1)
    sparse = train(cfg, args.steps, args.batch, args.l1, args.device, sparse=True, log_every=log_every)
    dense = (
        train(cfg, args.steps, args.batch, 0.0, args.device, False, log_every=log_every) if args.compare_dense else []
    )
    print(f"TinyLlama {cfg} on {args.device}, L1 {args.l1}, uniform loss would be {math.log(cfg.vocab):.2f}")
    print(" step   loss  gate density per layer          ms/step" + ("  dense loss  dense ms" if dense else ""))
    for i, (step, loss, dens, ms) in enumerate(sparse):
        line = f"{step:5d}  {loss:5.3f}  {' '.join(f'{d:6.2%}' for d in dens):<30}  {ms:7.1f}"
        if dense:
            line += f"  {dense[i][1]:10.3f}  {dense[i][3]:8.1f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
