"""Helpers shared by the test modules (tests/ is on sys.path through its conftest.py)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from typing import Any

import numpy as np

import twellsparse as ts

DTYPES = [np.dtype(np.float16), ts.bfloat16, np.dtype(np.float32), np.dtype(np.float64)]
DTYPE_IDS = [d.name for d in DTYPES]
SHAPE = (37, 301)


def random_dense(rng, shape=SHAPE, density=0.15, dtype=np.float32):
    """Random matrix with about ``density`` nonzeros (never all zero), values away from 0."""
    m, n = shape
    mask = rng.random(shape) < density
    if m and n and not mask.any():
        mask[rng.integers(m), rng.integers(n)] = True
    vals = rng.standard_normal(shape)
    vals = np.sign(vals) * (np.abs(vals) + 0.05)
    return np.where(mask, vals, 0.0).astype(dtype)


def bits(x):
    """Unsigned-integer view of the bytes of an array, for bit-exact comparisons."""
    x = np.ascontiguousarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.itemsize in (1, 2, 4, 8) else x.view(np.uint8)


def assert_bit_equal(actual, expected):
    """Same shape, dtype and bytes."""
    assert actual.shape == expected.shape, f"{actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{actual.dtype} != {expected.dtype}"
    np.testing.assert_array_equal(bits(actual), bits(expected))


def row_pointers(lengths):
    """CSR row pointers (int32) of rows of these lengths."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def rounding_bound(dtype, expected):
    """A relative-error bound for a product computed in fp32 and rounded to ``dtype``: twice the
    error of rounding the exact result itself, plus 1e-4."""
    from twellsparse.testing import rel_error

    rounded = np.asarray(expected).astype(dtype).astype(np.float64)
    return 2.0 * rel_error(rounded, expected) + 1e-4


#: Relative-error bounds of products computed and stored in fp32 / float64.
FLOAT_TOL = {np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-12}


def product_bound(dtype, expected):
    """The bound a gathered product must meet: :data:`FLOAT_TOL` for fp32 and float64, else
    :func:`rounding_bound` (sums in fp32, one rounding to a 16-bit type)."""
    return FLOAT_TOL.get(np.dtype(dtype)) or rounding_bound(dtype, expected)


def block_reference(problem: dict, gated: bool) -> np.ndarray:
    """The relu FFN block (gated or not) of a ``ffn_problem`` in float64 on the host (its arrays
    may live on the GPU)."""
    from twellsparse import _reference as ref
    from twellsparse._backend import to_host

    x, wg, wu, wd = (to_host(problem[k]) for k in ("x", "w_gate", "w_up", "w_down"))
    return ref.gated_ffn_dense(x, wg, wu, wd, "relu") if gated else ref.ffn_dense(x, wg, wd, "relu")


def skewed_twell(rng, m, n, tile_n, capacity, density, dtype, to_device=None):
    """``(h, a)``: skewed ReLU-like activations (one row emptied where there are several) and
    their TwELL matrix, on the device when ``to_device`` (e.g. ``cupy.asarray``) is given."""
    from twellsparse.testing import sparse_activations

    h = sparse_activations(m, n, density, "skewed", dtype, rng)
    if m > 1:  # an empty row (not the only one: the product would be of a zero matrix)
        h[m // 2] = 0
    return h, ts.twell_array(h if to_device is None else to_device(h), tile_n=tile_n, capacity=capacity)


def chunked_activations(rng, m, entries_per_chunk, dtype, chunk=512):
    """An ``m x chunk * len(entries_per_chunk)`` activation matrix whose chunk c of ``chunk``
    columns holds ``entries_per_chunk[c]`` nonzeros (values 0.5-2, both signs) at random places:
    empty chunks and chunks of one k-group between full ones, which the tiled kernels' prefetch
    across chunks must step over."""
    h = np.zeros((m, chunk * len(entries_per_chunk)), dtype=np.float64)
    for c, n in enumerate(entries_per_chunk):
        places = rng.choice(m * chunk, size=n, replace=False)
        rows, cols = places // chunk, c * chunk + places % chunk
        h[rows, cols] = rng.uniform(0.5, 2.0, n) * rng.choice([-1, 1], n)
    return h.astype(dtype)


def twin_values(rng, h):
    """Values of ``h``'s pattern, others than h's (magnitudes 0.5-2, both signs): the backward's
    second operand of one structure."""
    return np.where(h != 0, rng.uniform(0.5, 2.0, h.shape) * rng.choice([-1, 1], h.shape), 0).astype(h.dtype)


def inf_in_an_unused_row(rng, h, k, dtype):
    """``(b, expected)``: a random b (h's columns x k) with one row no entry of h uses set to Inf,
    and the float64 product h @ b that ignores it (a kernel that reads the row shows NaN)."""
    b = rng.standard_normal((h.shape[1], k)).astype(dtype)
    unused = np.flatnonzero(~h.any(axis=0))
    if unused.size:
        b[unused[0]] = np.inf
    return b, h.astype(np.float64) @ np.where(np.isinf(b), 0, b).astype(np.float64)


def check_spmm_result(cp, parts, tile_n, b_gpu, out, expected, dtype):
    """An SpMM's poisoned-then-written ``out`` against float64 (``expected``) and against the
    row gathers' product of the same operands: finite everywhere, within
    :func:`rounding_bound` of float64 and twice that of the gathers."""
    from twellsparse import _gpu_ops
    from twellsparse.testing import rel_error

    got = cp.asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all()
    bound = rounding_bound(dtype, expected)
    assert rel_error(got, expected) <= bound
    gathered = _gpu_ops.spmm(parts, tile_n, b_gpu, cp.empty_like(out), path="gather")
    assert rel_error(got, cp.asnumpy(gathered).astype(np.float64)) <= 2 * bound


#: The examples folder, and a two-rank torchrun on this machine.
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

# torch's gloo teardown can still abort a rank after the run is complete (a joinable C++ thread
# destroyed at exit, pytorch/pytorch#179291); that says nothing about the training, so such a run
# is repeated once. Any other failure, or the abort before every step printed, fails at once.
TEARDOWN_ABORT = "terminate called without an active exception"


def train_example(launcher: list[str], options: list[str], out: pathlib.Path, steps: int = 3, cpu: bool = True) -> Any:
    """examples/distributed_train.py under ``launcher`` (the interpreter, or :data:`TORCHRUN`)
    with ``options``, on the CPUs (gloo, the reference path) or with ``cpu=False`` on the GPUs
    (NCCL, the kernels); returns what rank 0 saved to ``out`` (``{'losses', 'state'}``)."""
    import torch

    script = EXAMPLES / "distributed_train.py"
    cmd = [*launcher, str(script), *(["--cpu"] if cpu else []), "--steps", str(steps), *options, "--out", str(out)]
    for attempt in range(2):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        finished = f"step {steps - 1}:" in done.stdout and out.exists()
        if done.returncode == 0 or attempt == 1 or not (finished and TEARDOWN_ABORT in done.stderr):
            break
        out.unlink()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return torch.load(out)
