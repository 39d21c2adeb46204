r"""A data-parallel training step in plain JAX with a TwELL gated FFN, over every local device.

The batch is split over a one-axis mesh ("data") with ``jax.shard_map``; each device runs the
sparse FFN (twellsparse.jax: the CUDA kernels on XLA's stream on GPUs, the reference path on
CPUs) on its slice; the loss is the ``pmean`` of the slices' losses, and the replicated
parameters' gradients come out summed over the devices by JAX's own rules. ``--check`` also trains the
same model on one device with the whole batch and compares losses and weights.

    python examples/jax_data_parallel.py [--steps 3] [--check]
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/jax_data_parallel.py --check  # 2 CPUs
    python examples/jax_data_parallel.py --dtype bfloat16 --density 0.01 --tokens 32768 \
        --d-model 2048 --d-ff 5632 --steps 8 [--dense] --json r.jsonl            # throughput

``--density`` builds the gate so that it fires at that rate (``twellsparse.testing.ffn_problem``:
a constant input feature and a matching gate column), ``--dense`` runs the same step with the
dense FFN (jnp matmuls), and ``--json`` appends the run's record: the median step time after the
first (the compile), tokens/s per device, where it ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import twellsparse.jax as tsj
from twellsparse._environment import append_records, run_record
from twellsparse.testing import ffn_problem


def init(d_model: int, d_ff: int, seed: int = 0, dtype: Any = np.float32) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(d_model)
    shapes = {"w_gate": (d_ff, d_model), "w_up": (d_ff, d_model), "w_down": (d_model, d_ff), "head": (d_model, d_model)}
    return {k: jnp.asarray((rng.standard_normal(s) * scale).astype(dtype)) for k, s in shapes.items()}


def dense_gated_ffn(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """The dense block (the throughput baseline): relu(x Wg^T) * (x Wu^T), then W_down."""
    return (jax.nn.relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array, tile_n: int, dense: bool = False) -> jax.Array:
    ws = (params["w_gate"], params["w_up"], params["w_down"])
    h = x + (dense_gated_ffn(x, *ws) if dense else tsj.gated_ffn(x, *ws, tile_n=tile_n))
    return jnp.mean((h @ params["head"].T - y).astype(jnp.float32) ** 2)


def make_step(mesh: Any, lr: float, tile_n: int, dense: bool = False) -> Any:
    """One SGD step on the global loss (the mean of the shards' losses): the batch is sharded
    over the mesh's "data" axis, the parameters are replicated, and JAX's shard_map autodiff
    sums the shards' gradient contributions for them."""

    def global_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        return jax.lax.pmean(loss_fn(params, x, y, tile_n, dense), "data")

    def local(params: dict, x: jax.Array, y: jax.Array) -> tuple:
        return jax.value_and_grad(global_loss)(params, x, y)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))

    @jax.jit
    def step(params: dict, x: jax.Array, y: jax.Array) -> tuple:
        loss, grads = sharded(params, x, y)
        return loss, jax.tree_util.tree_map(lambda p, g: (p - lr * g).astype(p.dtype), params, grads)

    return step


def train(
    devices: list,
    steps: int,
    tokens: int,
    d_model: int,
    d_ff: int,
    lr: float,
    tile_n: int,
    dtype: Any = np.float32,
    density: float | None = None,
    dense: bool = False,
) -> tuple:
    """(losses, parameters, step times in ms, the gate's density on the batch before training)
    of ``steps`` SGD steps on one batch."""
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    step = make_step(mesh, lr, tile_n, dense)
    rng = np.random.default_rng(1)
    params = init(d_model, d_ff, dtype=dtype)
    if density is None:
        x = jnp.asarray(rng.standard_normal((tokens, d_model)).astype(dtype))
    else:  # a gate that fires at `density` on this batch
        p = ffn_problem(tokens, d_model, d_ff, density, dtype=np.float32, rng=2)
        x = jnp.asarray(p["x"].astype(dtype))
        params["w_gate"] = jnp.asarray(p["w_gate"].astype(dtype))
    y = jnp.asarray(rng.standard_normal((tokens, d_model)).astype(dtype))
    gate_density = float(jnp.mean((x @ params["w_gate"].T > 0).astype(jnp.float32)))  # relu's keep rule
    # Placed as the step wants them (the batch split over the mesh, the parameters on every
    # device) before timing: left on one device, every step would copy them out again.
    shard = jax.sharding.NamedSharding(mesh, P("data"))
    x, y = jax.device_put(x, shard), jax.device_put(y, shard)
    params = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss, params = step(params, x, y)
        losses.append(float(loss))  # waits for the step
        times.append((time.perf_counter() - t0) * 1e3)
    return losses, params, times, gate_density


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--d-ff", type=int, default=256)
    ap.add_argument("--tile-n", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--density", type=float, help="a gate that fires at this rate on the batch")
    ap.add_argument("--dense", action="store_true", help="the dense FFN (the throughput baseline)")
    ap.add_argument("--devices", type=int, help="use the first N devices (default: all)")
    ap.add_argument("--check", action="store_true", help="compare with one device on the whole batch")
    ap.add_argument("--rtol", type=float, default=1e-5, help="--check's relative tolerance")
    ap.add_argument("--json", help="append the run's record here (JSON lines)")
    args = ap.parse_args(argv)
    if args.density is not None and not 0.0 < args.density <= 1.0:
        raise SystemExit(f"--density: expected a fraction in (0, 1], got {args.density}")
    if args.steps < 1:
        raise SystemExit(f"--steps: expected at least 1, got {args.steps}")
    if args.devices is not None and not 1 <= args.devices <= len(jax.devices()):
        raise SystemExit(f"--devices: expected 1 to {len(jax.devices())}, got {args.devices}")
    devices = jax.devices()[: args.devices]
    if args.tokens % len(devices):
        raise SystemExit(f"--tokens: expected a multiple of the {len(devices)} devices, got {args.tokens}")
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else np.float32
    shape = (args.steps, args.tokens, args.d_model, args.d_ff, args.lr, args.tile_n, dtype, args.density, args.dense)
    losses, params, times, gate_density = train(devices, *shape)
    print(f"{len(devices)} device(s) ({devices[0].platform}): losses " + ", ".join(f"{v:.6f}" for v in losses))
    # The jitted step compiles twice (its first outputs come back sharded): two steps skipped.
    steady = statistics.median(times[2:] or times[-1:])
    print(f"  {args.tokens // len(devices) / (steady / 1e3):,.0f} tokens/s per device (median step {steady:.2f} ms)")
    if not np.isfinite(losses).all():
        raise SystemExit("losses: expected finite values, got NaN or Inf")
    if args.json:
        record = run_record(
            times,
            args.tokens // len(devices),
            skip=2,
            kind="distributed",
            framework="jax",
            mode="shard_map",
            mlp="dense" if args.dense else "twell",
            world=len(devices),
            device_kind=devices[0].platform,
            dtype=args.dtype,
            shape=[args.tokens, args.d_model, args.d_ff],
            layers=1,
            density_target=args.density,
            density=gate_density,
            losses=losses,
        )
        append_records(args.json, [record])
    if args.check:
        ref_losses, ref_params, *_ = train(devices[:1], *shape)
        print("1 device:            losses " + ", ".join(f"{v:.6f}" for v in ref_losses))
        np.testing.assert_allclose(losses, ref_losses, rtol=args.rtol, atol=args.rtol / 10, equal_nan=False)
        for k in params:
            np.testing.assert_allclose(
                np.asarray(params[k], dtype=np.float32),
                np.asarray(ref_params[k], dtype=np.float32),
                rtol=args.rtol,
                atol=args.rtol / 10,
                equal_nan=False,
                err_msg=k,
            )
        print("data-parallel result matches the single-device one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
