"""The tiled up projection's block geometry and TMA boxes (twellsparse/_tiled_up.py), checked
on the CPU for every part and block size the kernel can be given: the boxes must land on
128-byte aligned shared addresses and stay inside the buffer regions the kernel reserves; and
the refusals of what the kernel cannot take."""

from __future__ import annotations

import types

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _tiled_up


@pytest.mark.parametrize("region", [_tiled_up.MAX_UNITS, _tiled_up.MAX_TOKENS])
def test_boxes_are_aligned_cover_the_rows_and_fit_the_region(region):
    for rows in range(1, region + 1):
        box = _tiled_up.box_rows(rows)
        boxes = -(-rows // box)
        assert box % 2 == 0, rows  # 64-byte rows: every box starts 128-byte aligned
        assert 0 < box <= 256, rows  # TMA's box limit
        assert rows <= boxes * box <= region, rows  # all rows, nothing past the region


@pytest.mark.parametrize("m", [1, 3, 67, 512, 4100, 16384])
@pytest.mark.parametrize("n", [1, 40, 704, 1408, 5632, 14336, 20000])
def test_geometry_parts_cover_the_units_within_the_kernel_limits(m, n):
    tokens, units, parts = _tiled_up.geometry(m, n)
    assert tokens % _tiled_up.QUAD == 0 and 0 < tokens <= _tiled_up.MAX_TOKENS
    assert units % 2 == 0 and units <= _tiled_up.MAX_UNITS
    assert parts * units >= n > (parts - 1) * units


@pytest.mark.parametrize("tokens", [0, -4, 6, 2])
def test_geometry_refuses_token_blocks_off_the_quads(tokens):
    """A block of tokens that is not a positive multiple of a quad would leave tokens unwritten
    (6: the last two of every block) or divide by zero (2: no quad)."""
    with pytest.raises(ValueError, match=f"tokens: expected a positive multiple of {_tiled_up.QUAD}, got {tokens}"):
        _tiled_up.geometry(100, 704, tokens)


def test_applies_refuses_x_without_columns():
    """x with no columns: nothing to stage (a TMA descriptor needs a column), so the gathers serve it."""
    gate = ts.twell_array(np.eye(8, 64, dtype=ts.bfloat16), tile_n=64).parts
    x, w_up = np.zeros((8, 0), dtype=ts.bfloat16), np.zeros((64, 0), dtype=ts.bfloat16)
    assert not _tiled_up.applies(gate, x, w_up)


@pytest.mark.parametrize(
    ("density", "tokens"), [(None, 512), (0.0, 512), (0.0025, 512), (0.005, 512), (0.01, 384), (0.02, 192), (0.5, 64)]
)
def test_block_tokens_keep_an_item_round_within_its_room(density, tokens):
    """At d_ff 14336 (parts of 718 units) the token blocks shrink with the density so that an item
    expects at most ROUND_FILL entries (512 at 0.5% and 384 at 1%, the fastest measured there),
    never under one step; without a density the default block."""
    assert _tiled_up.block_tokens(14336, density) == tokens
    units = _tiled_up.geometry(1, 14336)[1]
    if density and tokens > _tiled_up.TOKEN_STEP:
        assert (
            tokens * units * density <= _tiled_up.ROUND_FILL < (tokens + _tiled_up.TOKEN_STEP) * units * density
            or tokens == _tiled_up.MAX_TOKENS
        )


@pytest.mark.parametrize(
    ("preferred", "nbytes", "taken"),
    [(None, 2**20, False), (None, 2**30, True), (True, 2**20, True), (False, 2**30, False)],
)
def test_auto_takes_the_tiled_up_projection_for_weights_beyond_the_l2(monkeypatch, preferred, nbytes, taken):
    """Unset, the tiled kernel serves "auto" only where W_up outgrows the L2 (the row gathers
    would read it from device memory); TWELL_TILED_UP=1 takes it wherever it applies, =0 never."""
    monkeypatch.setattr(_tiled_up, "PREFERRED", preferred)
    monkeypatch.setattr(_tiled_up, "applies", lambda gate, x, w_up: True)
    monkeypatch.setattr(_tiled_up.K, "l2_bytes", lambda: 50 * 2**20)
    w_up = types.SimpleNamespace(nbytes=nbytes)
    assert _tiled_up.chosen(None, None, w_up) is taken  # type: ignore[arg-type]
