"""The gated FFN's consumer on one pack (``cuda/twell_tiled_ffn.cu``): the gate is packed once
by the tiled SpMM's pack (``_tiled_spmm.pack``: k-groups of 16 entries per 8 tokens and 512
units), ``twell_tiled_ffn_up`` computes ``u = x @ w_up.T`` at those entries on the tensor
cores (W_up's and x's 32-column slices staged by TMA, each entry's sum from its own rows only)
and writes ``h = gate * u`` into a copy of the words, and ``_tiled_spmm.packed_spmm`` runs the
down projection on them. Neither half reads a weight row per entry from L2, and h never exists
in the gate's layout.

The training forward also writes u in the gate's layout (the pack records each word's place
there), and the backward runs the same kernel on one pack of the gate (d_h = dy . W_down^T at
the entries, then d_z, d_u and h, and dX by the tiled SpMM's dual form on d_z's and d_u's
words). Opt-in (``TWELL_TILED_FFN=1``): its up kernel beats the row gathers on the H200, but
with the tiled SpMM's down projection the consumer does not yet beat the default.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernels as K
from . import _tiled_spmm
from ._gpu_convert import leading_dim, row_stride, rows_aligned
from ._parts import TwELLParts
from ._tensor_map import SWIZZLE_64B, tensor_map

#: d columns per staged slice (TFFN_COLS) and warps per block (TFFN_WARPS).
SLICE_COLS = 32
WARPS = 16
#: Dynamic shared memory of one up-projection block (TFFN_SHARED_BYTES): three 64 KB stages,
#: their barriers, the 64 groups' k-group ranges, 1 KB of alignment slack.
SHARED_BYTES = 1024 + 3 * 65536 + 6 * 8 + (2 * 64 + 1) * 4


def applies(gate: TwELLParts, x: Any, w_up: Any, w_down_t: Any, out: Any = None) -> bool:
    """Whether the one-pack consumer serves these operands on the current device: 2-byte values
    of one dtype (the gate's too), 16-byte-aligned rows of a multiple of 16 bytes, and both
    kernels' target (compute capability 9.0) with room for their shared memory."""
    dtype = x.dtype
    if dtype.itemsize != 2 or any(a.dtype != dtype for a in (w_up, w_down_t, gate.data)):
        return False
    if x.shape[1] == 0:  # nothing to stage (TMA descriptors need a column); the other paths serve it
        return False
    rows = [row_stride(x), row_stride(w_up), row_stride(w_down_t)]  # TMA's rules and the SpMM's pair stores
    if out is not None:
        if out.dtype != dtype:
            return False
        rows.append((out, leading_dim(out)))
    if not rows_aligned(*rows) or not (K.runs_here("twell_tiled_ffn.cu") and K.runs_here("twell_tiled_spmm.cu")):
        return False
    return max(SHARED_BYTES, _tiled_spmm.SHARED_BYTES) <= K.device_attribute("MaxSharedMemoryPerBlockOptin")


def _cp() -> Any:
    import cupy

    return cupy


def _launch(backward: bool, packed: _tiled_spmm.Pack, m: int, x: Any, w: Any, outputs: tuple) -> None:
    """``twell_tiled_ffn_up<T, backward>`` over ``packed`` (the gate's pack, ``m`` tokens) with
    ``w`` (N x d: W_up, or W_down^T) and ``x`` (M x d: x, or dy) staged by TMA."""
    x, _ = row_stride(x)
    w, _ = row_stride(w)
    box = _tiled_spmm.BOX
    maps = (tensor_map(w, box, SLICE_COLS, SWIZZLE_64B), tensor_map(x, box, SLICE_COLS, SWIZZLE_64B))
    dests = packed.dests if packed.dests is not None else K.null_pointer()
    sizes = (np.int32(m), np.int32(x.shape[1]), np.int32(packed.n_chunks))
    args = (*maps, packed.kg_ptr, packed.words[0], dests, *sizes, *outputs)
    pairs = bool(PAIRS)  # clusters of two blocks sharing x's slices: an even grid
    grid = (packed.n_chunks + (packed.n_chunks % 2 if pairs else 0), -(-m // _tiled_spmm.ROWS))
    kernel = "twell_tiled_ffn_up_pair" if pairs else "twell_tiled_ffn_up"
    expr = f"{kernel}<{K.CXX_TYPE[x.dtype]}, {int(backward)}>"
    K.launch_arch(expr, grid, (WARPS * 32,), args, SHARED_BYTES)


def _zeros_like_values(parts: TwELLParts) -> TwELLParts:
    cp = _cp()
    return parts._replace(data=cp.zeros_like(parts.data), spill_data=cp.zeros_like(parts.spill_data))


def gated_up_words(packed: _tiled_spmm.Pack, m: int, x: Any, w_up: Any, up: TwELLParts | None = None) -> Any:
    """The gate's words (``packed``, of an ``m``-token gate over ``w_up.shape[0]`` units) with
    ``h = gate * u`` in their value bits: a new uint32 array of the words' size whose first
    ``kg_ptr[-1] * 16`` words are written. With ``up`` (parts of the gate's structure; the pack
    made with ``dests``) u is written into its values as well."""
    h_words = _cp().empty_like(packed.words[0])
    if m == 0 or packed.n_chunks == 0:
        return h_words
    null = K.null_pointer()
    kept = (up.data, up.spill_data) if up is not None else (null, null)
    _launch(False, packed, m, x, w_up, (h_words, null, *kept, *(null,) * 6))
    return h_words


def gated_consumer(
    gate: TwELLParts, tile_n: int, x: Any, w_up: Any, w_down_t: Any, out: Any, keep_up: bool = False
) -> tuple[Any, TwELLParts | None]:
    """``out = (gate * (x @ w_up.T at the gate's pattern)) @ w_down_t``: one pack of the gate,
    the up projection into the words, the tiled SpMM on them. Returns ``(out, u)``, u (parts of
    the gate's structure, zero padding) only with ``keep_up``. The caller checked
    :func:`applies`; ``out`` is (M, d_model) with unit column stride."""
    m = gate.data.shape[0]
    packed = _tiled_spmm.pack(gate, tile_n, w_up.shape[0], dests=keep_up)
    up = _zeros_like_values(gate) if keep_up else None
    h_words = gated_up_words(packed, m, x, w_up, up)
    _tiled_spmm.packed_spmm(packed._replace(words=(h_words,)), m, w_down_t, out)
    return out, up


def gated_backward(
    gate: TwELLParts, tile_n: int, dy: Any, w_down_t: Any, up: TwELLParts, w_gate: Any, w_up: Any
) -> tuple[Any, TwELLParts, TwELLParts, TwELLParts]:
    """The gated FFN backward (relu or identity activation) on one pack of the gate: ``d_h = dy
    @ w_down_t.T`` at its entries, ``d_z = d_h * u``, ``d_u = d_h * g``, ``h = g * u`` (as
    ``_gpu_ops.sddmm_gated_backward`` rounds them), and ``dx = d_z @ w_gate + d_u @ w_up`` by
    the tiled SpMM's dual form on the same pack's words. Returns ``(dx, d_z, d_u, h)``, the
    three as parts of the gate's structure (zero padding). The caller checked
    :func:`applies_backward`."""
    cp = _cp()
    m = gate.data.shape[0]
    packed = _tiled_spmm.pack(gate, tile_n, w_down_t.shape[0], dests=True)
    d_z, d_u, h = (_zeros_like_values(gate) for _ in range(3))
    dz_words, du_words = cp.empty_like(packed.words[0]), cp.empty_like(packed.words[0])
    dx = cp.empty((m, w_gate.shape[1]), dtype=dy.dtype)
    if m == 0 or packed.n_chunks == 0:
        dx[...] = 0
        return dx, d_z, d_u, h
    values = (up.data, up.spill_data, d_z.data, d_z.spill_data, d_u.data, d_u.spill_data, h.data, h.spill_data)
    _launch(True, packed, m, dy, w_down_t, (dz_words, du_words, *values))
    _tiled_spmm.packed_spmm(packed._replace(words=(dz_words, du_words)), m, w_gate, dx, b2=w_up)
    return dx, d_z, d_u, h


def applies_backward(gate: TwELLParts, dy: Any, w_down_t: Any, up: TwELLParts, w_gate: Any, w_up: Any) -> bool:
    """Whether :func:`gated_backward` serves these operands on the current device (the rules of
    :func:`applies` for dy, W_down^T, W_gate and W_up, u in the gate's dtype)."""
    if up.data.dtype != gate.data.dtype or w_gate.dtype != dy.dtype or w_gate.shape != w_up.shape:
        return False
    if not rows_aligned(row_stride(w_gate)):
        return False
    return applies(gate, dy, w_down_t, w_up)


#: Whether the up kernel runs in clusters of two blocks (consecutive unit chunks, the same tokens)
#: that share x's slices by TMA multicast (a quarter of its L2 bytes saved): only with
#: ``TWELL_TILED_FFN_PAIRS=1`` (measured as fast as the single blocks: not L2-bound).
PAIRS: bool | None = K.env_switch("TWELL_TILED_FFN_PAIRS")

#: Whether the gated consumer and the gated backward take these paths where they apply: only
#: with ``TWELL_TILED_FFN=1`` (not yet faster than the default; bench/NOTES.md).
PREFERRED: bool | None = K.env_switch("TWELL_TILED_FFN")


def chosen(gate: TwELLParts, x: Any, w_up: Any, w_down_t: Any, out: Any = None) -> bool:
    """Whether the gated consumer takes the one-pack path."""
    return bool(PREFERRED) and applies(gate, x, w_up, w_down_t, out)


def chosen_backward(gate: TwELLParts, dy: Any, w_down_t: Any, up: TwELLParts, w_gate: Any, w_up: Any) -> bool:
    """Whether the gated backward takes the one-pack path."""
    return bool(PREFERRED) and applies_backward(gate, dy, w_down_t, up, w_gate, w_up)
