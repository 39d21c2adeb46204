"""The tiled SDDMM (``cuda/twell_tiled_sddmm.cu``): sampled products ``x[i] . y[j]`` at a TwELL
pattern, with a 512-token x 512-unit tile of both dense operands streamed through one block's
shared memory, so the L2 traffic no longer grows with the number of stored entries.

It serves 2-byte value types with 16-byte rows (:func:`applies`); the spill part goes through
the one-warp-per-entry kernel of ``cuda/twell_sddmm.cu``. Four modes (``cuda/twell_sddmm.cuh``):
the plain and scaled products, the gated FFN's up projection with its product with the gate
(``h = g * u``, optionally keeping ``u``), and the gated backward's ``d_h`` with its three value
products.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import _kernels as K
from ._gpu_convert import row_stride, rows_aligned
from ._parts import TwELLParts

#: Tokens and units of a block's tile, and its threads (TILED_TOKENS, TILED_UNITS, TILED_THREADS).
TOKENS = 512
UNITS = 512
THREADS = 512
#: Shared memory of one block: 3 stages of 64-byte pieces of the tile's 1024 rows, then the job
#: list of a round (1024 jobs: a 4-byte head, 4 unit and 4 slot indices of 2 bytes) and its
#: 5 counters (TiledJobs).
SHARED_BYTES = 3 * (TOKENS + UNITS) * 64 + 1024 * (4 + 8 + 8) + 4 * 5
#: Mode name -> template argument (twell::SddmmMode).
MODES = K.SDDMM_MODES
#: Whether the SDDMM paths take this kernel where it applies (``TWELL_TILED_SDDMM=1``): off until
#: it has been measured against the row gathers on the GPU.
PREFERRED = os.environ.get("TWELL_TILED_SDDMM", "0") == "1"


def _cp() -> Any:
    import cupy

    return cupy


def applies(x: Any, y: Any) -> bool:
    """Whether the tiled kernel serves the sampled products of ``x`` and ``y`` (one 2-byte dtype,
    16-byte rows, room for its shared memory on the current device)."""
    if x.dtype != y.dtype or x.dtype.itemsize != 2 or x.shape[1] != y.shape[1]:
        return False
    if not rows_aligned(row_stride(x), row_stride(y)):
        return False
    return SHARED_BYTES <= K.device_attribute("MaxSharedMemoryPerBlockOptin")


def sddmm(
    parts: TwELLParts, tile_n: int, x: Any, y: Any, mode: str, aux: TwELLParts | None = None, keep: bool = True
) -> tuple[TwELLParts | None, ...]:
    """Sampled products at the pattern of ``parts`` (the caller checked :func:`applies`).

    ``mode`` (:data:`MODES`) and what it returns, each as parts with the pattern's structure and
    zero padding: "plain" ``(d,)``; "scale" ``(d * g,)`` (g: the pattern's values, x's dtype);
    "gated" ``(h, u)`` with ``u = d`` rounded and ``h = g * u``, ``u`` None unless ``keep``;
    "gated_bwd" ``(d_z, d_u, h)`` with ``d_h = d`` rounded, ``d_z = d_h * u``, ``d_u = d_h * g``
    and ``h = g * u`` (``u``: ``aux``'s values). Spill entries past the row pointers are zero.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(map(repr, MODES))}, got {mode!r}")
    cp = _cp()
    m, nt, cap = parts.data.shape
    n = y.shape[0]
    x, ldx = row_stride(x)
    y, ldy = row_stride(y)
    k = np.int32(x.shape[1])
    t = K.CXX_TYPE[x.dtype]
    n_out = {"plain": 1, "scale": 1, "gated": 2 if keep else 1, "gated_bwd": 3}[mode]
    slots = [cp.empty(parts.data.shape, dtype=x.dtype) for _ in range(n_out)]
    spills = [cp.zeros(parts.spill_data.shape, dtype=x.dtype) for _ in range(n_out)]
    null = K.null_pointer()

    def operands(g: Any, u: Any, outs: list[Any]) -> tuple[Any, ...]:
        return (g, u if aux is not None else null, *outs, *([null] * (3 - len(outs))))

    dense = (x, np.int64(ldx), y, np.int64(ldy), k)
    geometry = (np.int32(m), np.int32(n), np.int32(nt), np.int32(tile_n), np.int32(cap))
    grid = (-(-n // UNITS), -(-m // TOKENS))
    expr = f"twell_tiled_sddmm<{t}, {MODES[mode]}>"
    tiles = (parts.indices, parts.counts, *geometry)
    K.launch_grid(
        expr,
        grid,
        (THREADS,),
        (*dense, *tiles, *operands(parts.data, aux.data if aux is not None else None, slots)),
        SHARED_BYTES,
    )
    spill_args = (parts.spill_indptr, parts.spill_indices, np.int32(m))
    spill_ops = operands(parts.spill_data, aux.spill_data if aux is not None else None, spills)
    spill_expr = f"twell_sddmm_spill<{t}, {MODES[mode]}>"
    K.launch(spill_expr, int(parts.spill_data.size) * 32, 256, (*dense, *spill_args, *spill_ops))
    results: list[TwELLParts | None] = [
        parts._replace(data=a, spill_data=b) for a, b in zip(slots, spills, strict=True)
    ]
    if mode == "gated" and not keep:
        results.append(None)
    return tuple(results)
