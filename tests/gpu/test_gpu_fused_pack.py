"""The gated consumer's up projection that packs h for the stationary down projection itself
(``twell_gather_gated_up_packed``): its words are the separate pack's words bit for bit, on rows
staged in shared memory and on rows too long for it, with spill entries, empty rows and odd
shapes; and the gated consumer gives the same output with and without it, within the float64
reference's rounding bound."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import rounding_bound, skewed_twell

import twellsparse as ts
from twellsparse import _gpu_ops, _stationary
from twellsparse._parts import TwELLParts
from twellsparse.testing import rel_error

pytestmark = pytest.mark.gpu

# (m, n, k, tile_n, capacity, density)
SHAPES = [
    (1, 40, 16, 32, None, 0.5),  # one row
    (67, 5632, 2048, 256, None, 0.01),  # the standard widths; 67 rows: a partial block of warps
    (301, 2000, 1048, 32, 2, 0.08),  # heavy spill, d_ff not a multiple of the tile
    (40, 3000, 64, 64, 8, 0.3),  # rows of ~900 entries: past the 256 staged in shared memory
]


def _operands(cp, rng, m, n, k, tile_n, capacity, density, dtype):
    """A gate TwELL (skewed), and x and w_up on the device."""
    h, gate = skewed_twell(rng, m, n, tile_n, capacity, density, dtype, cp.asarray)
    x = cp.asarray(rng.standard_normal((m, k)).astype(dtype))
    w_up = cp.asarray((rng.standard_normal((n, k)) / np.sqrt(k)).astype(dtype))
    return h, gate, x, w_up


def _same_values(cp, a: TwELLParts, b: TwELLParts) -> None:
    """Equal stored values (slots in use and spill entries), bit for bit."""
    counts = cp.asnumpy(a.counts)
    used = np.arange(a.data.shape[2])[None, None, :] < counts[:, :, None]
    bits = [cp.asnumpy(p.data).view(np.uint16)[used] for p in (a, b)]
    assert (bits[0] == bits[1]).all()
    n = int(cp.asnumpy(a.spill_indptr)[-1])
    assert (cp.asnumpy(a.spill_data[:n]).view(np.uint16) == cp.asnumpy(b.spill_data[:n]).view(np.uint16)).all()


@pytest.mark.parametrize("keep_up", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, ts.bfloat16])
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_packed_words_are_the_separate_packs(cp, rng, keep_up, dtype, m, n, k, tile_n, capacity, density):
    _, gate, x, w_up = _operands(cp, rng, m, n, k, tile_n, capacity, density, dtype)
    h, u = _gpu_ops.gated_up(gate.parts, tile_n, x, w_up, keep_up, path="gather")
    ref_indptr, ref_words = _stationary.pack(h, tile_n, n)
    indptr, words = _stationary.row_pointers(gate.parts)
    words.fill(0xDEADBEEF)  # poisoned: every word up to indptr[-1] must be written
    h2, u2 = _gpu_ops.gated_up(gate.parts, tile_n, x, w_up, keep_up, path="gather", packed=(indptr, words, n))
    end = int(indptr[-1])
    assert (cp.asnumpy(indptr) == cp.asnumpy(ref_indptr)).all()
    assert (cp.asnumpy(words[:end]) == cp.asnumpy(ref_words[:end])).all()
    _same_values(cp, h, h2)  # h is still written in full
    if keep_up:
        _same_values(cp, u, u2)
    else:
        assert u is None and u2 is None


def test_packed_refuses_what_it_cannot_serve(cp, rng):
    _, gate, x, w_up = _operands(cp, rng, 8, 64, 16, 32, None, 0.1, np.float32)
    indptr, words = _stationary.row_pointers(gate.parts)
    with pytest.raises(ValueError, match="packed: needs the row gathers on a dense 2-byte w_up"):
        _gpu_ops.gated_up(gate.parts, 32, x, w_up, packed=(indptr, words, 64))


@pytest.mark.parametrize("keep_up", [False, True])
@pytest.mark.parametrize("m, n, k, tile_n, capacity, density", SHAPES)
def test_gated_consumer_fused_and_unfused_agree(cp, rng, monkeypatch, keep_up, m, n, k, tile_n, capacity, density):
    dtype = ts.bfloat16
    h_gate, gate, x, w_up = _operands(cp, rng, m, n, k, tile_n, capacity, density, dtype)
    w_down_t = cp.asarray((rng.standard_normal((n, k)) / np.sqrt(n * density)).astype(dtype))
    u_exact = cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(w_up).astype(np.float64).T
    u_rounded = u_exact.astype(dtype).astype(np.float64)  # u, then h, rounded as the kernels do
    h_exact = (h_gate.astype(np.float64) * u_rounded).astype(dtype).astype(np.float64)
    expected = h_exact @ cp.asnumpy(w_down_t).astype(np.float64)
    monkeypatch.setattr(_stationary, "PREFERRED", True)  # the stationary down projection at any rows
    packs = []
    real_pack = _stationary.pack
    monkeypatch.setattr(_stationary, "pack", lambda *a, **kw: packs.append(1) or real_pack(*a, **kw))
    outs = []
    for fused in (True, False):
        monkeypatch.setattr(_gpu_ops, "FUSED_PACK", fused)
        out = cp.full((m, k), np.nan, dtype=dtype)  # poisoned
        _, up = _gpu_ops.gated_consumer(gate.parts, tile_n, x, w_up, w_down_t, keep_up=keep_up, out=out)
        assert (up is not None) == keep_up
        outs.append(cp.asnumpy(out))
    assert len(packs) == 1  # the unfused call alone launched the separate pack
    assert (outs[0].view(np.uint16) == outs[1].view(np.uint16)).all()  # the same words, the same sums
    got = outs[0].astype(np.float64)
    assert np.isfinite(got).all()
    assert rel_error(got, expected) <= rounding_bound(dtype, expected)
