"""A data-parallel training step in plain JAX with a TwELL gated FFN, over every local device.

The batch is split over a one-axis mesh ("data") with ``jax.shard_map``; each device runs the
sparse FFN (twellsparse.jax: the CUDA kernels on XLA's stream on GPUs, the reference path on
CPUs) on its slice; the loss is the ``pmean`` of the slices' losses, and the replicated
parameters' gradients come out summed over the devices by JAX's own rules. ``--check`` also trains the
same model on one device with the whole batch and compares losses and weights.

    python examples/jax_data_parallel.py [--steps 3] [--check]
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/jax_data_parallel.py --check  # 2 CPUs
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import twellsparse.jax as tsj


def init(d_model: int, d_ff: int, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(d_model)
    shapes = {"w_gate": (d_ff, d_model), "w_up": (d_ff, d_model), "w_down": (d_model, d_ff), "head": (d_model, d_model)}
    return {k: jnp.asarray((rng.standard_normal(s) * scale).astype(np.float32)) for k, s in shapes.items()}


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array, tile_n: int) -> jax.Array:
    h = x + tsj.gated_ffn(x, params["w_gate"], params["w_up"], params["w_down"], tile_n=tile_n)
    return jnp.mean((h @ params["head"].T - y) ** 2)


def make_step(mesh: Any, lr: float, tile_n: int) -> Any:
    """One SGD step on the global loss (the mean of the shards' losses): the batch is sharded
    over the mesh's "data" axis, the parameters are replicated, and JAX's shard_map autodiff
    sums the shards' gradient contributions for them."""

    def global_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        return jax.lax.pmean(loss_fn(params, x, y, tile_n), "data")

    def local(params: dict, x: jax.Array, y: jax.Array) -> tuple:
        return jax.value_and_grad(global_loss)(params, x, y)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))

    @jax.jit
    def step(params: dict, x: jax.Array, y: jax.Array) -> tuple:
        loss, grads = sharded(params, x, y)
        return loss, jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)

    return step


def train(devices: list, steps: int, tokens: int, d_model: int, d_ff: int, lr: float, tile_n: int) -> tuple:
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    step = make_step(mesh, lr, tile_n)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((tokens, d_model)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((tokens, d_model)).astype(np.float32))
    params = init(d_model, d_ff)
    losses = []
    for _ in range(steps):
        loss, params = step(params, x, y)
        losses.append(float(loss))
    return losses, params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--d-ff", type=int, default=256)
    ap.add_argument("--tile-n", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--check", action="store_true", help="compare with one device on the whole batch")
    args = ap.parse_args(argv)
    devices = jax.devices()
    shape = (args.steps, args.tokens, args.d_model, args.d_ff, args.lr, args.tile_n)
    losses, params = train(devices, *shape)
    print(f"{len(devices)} device(s) ({devices[0].platform}): losses " + ", ".join(f"{v:.6f}" for v in losses))
    if args.check:
        ref_losses, ref_params = train(devices[:1], *shape)
        print("1 device:            losses " + ", ".join(f"{v:.6f}" for v in ref_losses))
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
        for k in params:
            np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-5, atol=1e-6, err_msg=k)
        print("data-parallel result matches the single-device one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
