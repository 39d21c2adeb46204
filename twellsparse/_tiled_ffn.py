"""The gated FFN's consumer on one pack (``cuda/twell_tiled_ffn.cu``): the gate is packed once
by the tiled SpMM's pack (``_tiled_spmm.pack``: k-groups of 16 entries per 8 tokens and 512
units), ``twell_tiled_ffn_up`` computes ``u = x @ w_up.T`` at those entries on the tensor
cores (W_up's and x's 32-column slices staged by TMA, each entry's sum from its own rows only)
and writes ``h = gate * u`` into a copy of the words, and ``_tiled_spmm.packed_spmm`` runs the
down projection on them. Neither half reads a weight row per entry from L2, and h never exists
in the gate's layout.

Inference only (the training forward keeps u in the gate's layout, which this path does not
write). Opt-in (``TWELL_TILED_FFN=1``) until measured on a GPU.
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
    rows = [row_stride(x), row_stride(w_up)]
    if out is not None:
        if out.dtype != dtype:
            return False
        rows.append((out, leading_dim(out)))
    if not rows_aligned(*rows) or not _tiled_spmm.applies(w_down_t, _shaped_like_out(x, w_down_t, out)):
        return False
    if not K.runs_here("twell_tiled_ffn.cu"):
        return False
    return SHARED_BYTES <= K.device_attribute("MaxSharedMemoryPerBlockOptin")


def _shaped_like_out(x: Any, w_down_t: Any, out: Any) -> Any:
    """The output the down projection writes (a view; nothing allocated when ``out`` is given)."""
    if out is not None:
        return out
    return _cp().empty((0, w_down_t.shape[1]), dtype=x.dtype)


def _cp() -> Any:
    import cupy

    return cupy


def gated_up_words(packed: _tiled_spmm.Pack, m: int, x: Any, w_up: Any) -> Any:
    """The gate's words (``packed``, of an ``m``-token gate over ``w_up.shape[0]`` units) with
    ``h = gate * u`` in their value bits: a new uint32 array of the words' size whose first
    ``kg_ptr[-1] * 16`` words are written."""
    h_words = _cp().empty_like(packed.words[0])
    x, _ = row_stride(x)
    w_up, _ = row_stride(w_up)
    if m == 0 or packed.n_chunks == 0:
        return h_words
    box = _tiled_spmm.BOX
    maps = (tensor_map(w_up, box, SLICE_COLS, SWIZZLE_64B), tensor_map(x, box, SLICE_COLS, SWIZZLE_64B))
    sizes = (np.int32(m), np.int32(x.shape[1]), np.int32(packed.n_chunks))
    args = (*maps, packed.kg_ptr, packed.words[0], *sizes, h_words)
    grid = (packed.n_chunks, -(-m // _tiled_spmm.ROWS))
    K.launch_arch(f"twell_tiled_ffn_up<{K.CXX_TYPE[x.dtype]}>", grid, (WARPS * 32,), args, SHARED_BYTES)
    return h_words


def gated_consumer(gate: TwELLParts, tile_n: int, x: Any, w_up: Any, w_down_t: Any, out: Any) -> Any:
    """``out = (gate * (x @ w_up.T at the gate's pattern)) @ w_down_t``: one pack of the gate,
    the up projection into the words, the tiled SpMM on them. The caller checked
    :func:`applies`; ``out`` is (M, d_model) with unit column stride."""
    m = gate.data.shape[0]
    packed = _tiled_spmm.pack(gate, tile_n, w_up.shape[0])
    h_words = gated_up_words(packed, m, x, w_up)
    return _tiled_spmm.packed_spmm(packed._replace(words=(h_words,)), m, w_down_t, out)


#: Whether the gated consumer takes this path (inference calls, where it applies): only with
#: ``TWELL_TILED_FFN=1`` (not yet measured on a GPU; bench/NOTES.md).
PREFERRED: bool | None = K.env_switch("TWELL_TILED_FFN")


def chosen(gate: TwELLParts, x: Any, w_up: Any, w_down_t: Any, out: Any = None) -> bool:
    """Whether the gated consumer takes the one-pack path."""
    return bool(PREFERRED) and applies(gate, x, w_up, w_down_t, out)
