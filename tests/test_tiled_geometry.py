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


def test_boxes_are_aligned_and_cover_the_rows():
    for rows in range(1, _tiled_up.BUFFER_ROWS + 1):
        box = _tiled_up.box_rows(rows)
        boxes = -(-rows // box)
        assert box % 2 == 0, rows  # 64-byte rows: every box starts 128-byte aligned
        assert 0 < box <= 256, rows  # TMA's box limit
        assert rows <= boxes * box == _tiled_up.staged_rows(rows), rows  # all rows


def test_the_largest_token_blocks_fit_beside_every_part():
    """For every part size the kernel takes, the units' boxes stay in the W_up region (17-bit
    addresses) and the most tokens :func:`max_tokens` allows fit in the rest of the buffer, as
    their x offsets' 15-bit field (8-byte units) does; one quad more would not fit."""
    for units in range(2, _tiled_up.MAX_UNITS + 1, 2):
        tokens = _tiled_up.max_tokens(units)
        w_rows, x_rows = _tiled_up.staged_rows(units), _tiled_up.staged_rows(tokens)
        assert w_rows <= _tiled_up.MAX_UNITS, units
        assert tokens % _tiled_up.QUAD == 0 and tokens >= _tiled_up.TOKENS, units
        assert w_rows + x_rows <= _tiled_up.BUFFER_ROWS, units
        assert (w_rows + x_rows) * 64 // 8 < 1 << 15, units
        assert w_rows + _tiled_up.staged_rows(tokens + _tiled_up.QUAD) > _tiled_up.BUFFER_ROWS, units
    assert _tiled_up.max_tokens(704) == 824  # the standard widths' parts (708 rows of boxes)


@pytest.mark.parametrize("m", [1, 3, 67, 512, 4100, 16384])
@pytest.mark.parametrize("n", [1, 40, 704, 1408, 5632, 14336, 20000])
def test_geometry_parts_cover_the_units_within_the_kernel_limits(m, n):
    tokens, units, parts = _tiled_up.geometry(m, n)
    assert tokens % _tiled_up.QUAD == 0 and 0 < tokens <= _tiled_up.max_tokens(units)
    assert units % 2 == 0 and units <= _tiled_up.MAX_UNITS
    assert parts * units >= n > (parts - 1) * units


@pytest.mark.parametrize("tokens", [0, -4, 6, 2])
def test_geometry_refuses_token_blocks_off_the_quads(tokens):
    """A block of tokens that is not a positive multiple of a quad would leave tokens unwritten
    (6: the last two of every block) or divide by zero (2: no quad)."""
    with pytest.raises(ValueError, match=f"tokens: expected a positive multiple of {_tiled_up.QUAD}, got {tokens}"):
        _tiled_up.geometry(100, 704, tokens)


@pytest.mark.parametrize("width", [0, 8, 64, "16"])
def test_pack_refuses_other_widths_before_any_work(width):
    with pytest.raises(ValueError, match=f"width: expected 16 or 32, got {width!r}"):
        _tiled_up.pack(None, 256, 5632, 512, 704, 8, width=width)  # type: ignore[arg-type]


def test_applies_refuses_x_without_columns():
    """x with no columns: nothing to stage (a TMA descriptor needs a column), so the gathers serve it."""
    gate = ts.twell_array(np.eye(8, 64, dtype=ts.bfloat16), tile_n=64).parts
    x, w_up = np.zeros((8, 0), dtype=ts.bfloat16), np.zeros((64, 0), dtype=ts.bfloat16)
    assert not _tiled_up.applies(gate, x, w_up)


#: Gated up projection by tokens per block, gpu-only ms (H100; 16384 tokens to 512 at 5b212b1,
#: the rest at cc94f5e; bench/results/2026-12-06-stages.jsonl): {(tokens, d_ff, density):
#: {tokens per block: ms}}; d_model 2048 at d_ff 5632, 4096 at 14336.
MEASURED_BLOCKS = {
    (16384, 5632, 0.005): {
        **{192: 0.496, 256: 0.411, 320: 0.396, 384: 0.354, 448: 0.358, 512: 0.301},
        **{576: 0.306, 640: 0.321, 704: 0.346, 768: 0.362},
    },
    (16384, 5632, 0.01): {
        **{192: 0.559, 256: 0.462, 320: 0.504, 384: 0.462, 448: 0.520, 512: 0.515},
        **{576: 0.597, 640: 0.589, 704: 0.600, 768: 0.615},
    },
    (16384, 5632, 0.02): {192: 0.798, 256: 0.713, 320: 0.970, 384: 0.830, 448: 0.894, 512: 0.706},
    (16384, 14336, 0.005): {192: 2.685, 256: 2.206, 320: 1.658, 384: 1.490, 448: 1.387, 512: 1.240},
    (16384, 14336, 0.01): {192: 3.074, 256: 2.188, 320: 1.937, 384: 1.784, 448: 1.772, 512: 2.528},
    (16384, 14336, 0.015): {192: 2.669, 256: 2.327, 320: 2.441, 384: 3.494, 448: 3.109, 512: 2.678},
    (16384, 14336, 0.02): {192: 2.948, 256: 3.018, 320: 3.971, 384: 3.587, 448: 3.204, 512: 2.943},
    (131072, 5632, 0.005): {
        **{192: 3.616, 256: 3.033, 320: 2.646, 384: 2.469, 448: 2.278, 512: 2.206},
        **{576: 2.093, 640: 2.050, 704: 2.012, 768: 1.972},
    },
    (131072, 5632, 0.01): {
        **{192: 3.863, 256: 3.333, 320: 3.083, 384: 2.956, 448: 2.902, 512: 3.197},
        **{576: 3.967, 640: 3.750, 704: 3.627, 768: 3.483},
    },
}


#: The same at edc53de (H100, one call, the forty-fifth session; bench/results/2026-12-06-stages.jsonl):
#: the sizes that steps of 16 pick beside those of 64, where their orders disagreed.
MEASURED_BLOCKS_STEP16 = {
    (16384, 5632, 0.005): {208: 0.443, 336: 0.334, 384: 0.340, 512: 0.287},
    (16384, 5632, 0.01): {208: 0.506, 336: 0.417, 384: 0.436, 512: 0.492},
    (16384, 5632, 0.02): {208: 0.693, 336: 0.793, 384: 0.808, 512: 0.673},
    (131072, 5632, 0.005): {768: 1.860, 800: 1.775},
}


@pytest.mark.parametrize(
    ("m", "n", "density", "times"),
    [(*key, times) for key, times in sorted(MEASURED_BLOCKS.items())]
    + [(*key, times) for key, times in sorted(MEASURED_BLOCKS_STEP16.items())],
)
def test_block_cost_picks_a_measured_fastest_size(m, n, density, times):
    """On the H100's 132 SMs the cost model's cheapest among the measured sizes runs within 5%
    of the fastest measured one (the old rule's 192 at 2% on the standard widths took 13%
    longer; at 131072 tokens and 0.5% the 800-token blocks of ten waves, not 768 in eleven)."""
    tokens = min(sorted(times, reverse=True), key=lambda t: _tiled_up.block_cost(m, n, density, t, 132))
    assert times[tokens] <= 1.05 * min(times.values())


def test_block_tokens_pick_the_cheapest_size():
    """block_tokens is the search of block_cost over the steps (ties to the larger block): at
    the decoder batch (131072 tokens, 0.5%) 800 tokens, at 16384 tokens 512 / 336 / 512 at 0.5 /
    1 / 2% (the sizes measured fastest in the forty-fifth session)."""
    assert _tiled_up.block_tokens(131072, 5632, 0.005, 132) == 800
    assert [_tiled_up.block_tokens(16384, 5632, d, 132) for d in (0.005, 0.01, 0.02)] == [512, 336, 512]
    for m, density in ((4096, 0.01), (65536, 0.005), (131072, 0.02)):
        tokens = _tiled_up.block_tokens(m, 14336, density, 132)
        steps = range(_tiled_up.TOKEN_STEP, _tiled_up.max_tokens(_tiled_up.geometry(1, 14336)[1]) + 1, 16)
        assert _tiled_up.block_cost(m, 14336, density, tokens, 132) == min(
            _tiled_up.block_cost(m, 14336, density, t, 132) for t in steps if t <= -(-m // 16) * 16
        )


def test_block_tokens_default_without_a_density_and_fit_few_tokens():
    """Without an estimate the default block; never more tokens than m needs (in whole steps),
    and where the blocks do not fill the SMs anyway, the smallest (fewest rows a block stages)."""
    assert _tiled_up.block_tokens(16384, 14336, None, 132) == _tiled_up.TOKENS
    assert _tiled_up.block_tokens(16384, 14336, 0.0, 132) == _tiled_up.TOKENS
    assert _tiled_up.block_tokens(100, 5632, 0.01, 132) == _tiled_up.TOKEN_STEP
    assert _tiled_up.block_tokens(100, 5632, 0.01, 1) == 112  # one block of 7 steps
    assert _tiled_up.block_tokens(16384, 5632, 0.2, 132) <= 128  # several rounds either way
    for m in (1, 64, 1000, 4096, 65536):
        for density in (0.001, 0.01, 0.05):
            tokens = _tiled_up.block_tokens(m, 5632, density, 132)
            assert tokens % _tiled_up.TOKEN_STEP == 0 and _tiled_up.TOKEN_STEP <= tokens <= _tiled_up.max_tokens(704)


@pytest.mark.parametrize(
    ("tokens", "density", "rounds"),
    [(512, 0.005, 1), (512, 0.01, 2), (448, 0.01, 1), (512, 0.02, 2), (256, 0.02, 2), (192, 0.02, 1)],
)
def test_expected_rounds_count_padding_and_spread(tokens, density, rounds):
    """A block's expected rounds at the standard widths' 704 units: 512 tokens at 1% expect 3604
    entries, with the quads' padding and the spread past a round's 4096."""
    assert _tiled_up.expected_rounds(tokens, 704, density) == rounds


@pytest.mark.parametrize(
    ("preferred", "nbytes", "density", "tokens", "taken"),
    [
        (None, 2**20, None, 16384, False),
        (None, 2**20, 0.005, 16384, False),
        (None, 2**20, _tiled_up.IN_L2_MIN_DENSITY, _tiled_up.IN_L2_MIN_TOKENS, True),
        (None, 2**20, 0.02, 65536, True),
        (None, 2**20, 0.02, _tiled_up.IN_L2_MIN_TOKENS - 1, False),
        (None, 2**20, 0.005, _tiled_up.LARGE_CALL_TOKENS - 4, False),
        (None, 2**20, 0.005, _tiled_up.LARGE_CALL_TOKENS, True),
        (None, 2**20, _tiled_up.LARGE_CALL_MIN_DENSITY * 0.99, _tiled_up.LARGE_CALL_TOKENS, False),
        (None, 2**30, None, 100, True),
        (None, 2**30, 0.001, 16384, True),
        (True, 2**20, None, 100, True),
        (False, 2**30, 0.02, 16384, False),
    ],
)
def test_auto_takes_the_tiled_up_projection_beyond_the_l2_or_from_a_density(
    monkeypatch, preferred, nbytes, density, tokens, taken
):
    """Unset, the tiled kernel serves "auto" where W_up outgrows the L2 (the row gathers would
    read it from device memory) or where the plan expects at least IN_L2_MIN_DENSITY over at
    least IN_L2_MIN_TOKENS tokens; TWELL_TILED_UP=1 takes it wherever it applies, =0 never."""
    assert _chosen(monkeypatch, preferred, nbytes, density, tokens) is taken


def _chosen(monkeypatch, preferred, nbytes, density, tokens, backward=False):
    """``_tiled_up.chosen`` for a weight of ``nbytes`` beside a 50 MB L2, ``tokens`` tokens and
    an expected ``density`` (None: no estimate), the kernel taken to apply."""
    monkeypatch.setattr(_tiled_up, "PREFERRED", preferred)
    monkeypatch.setattr(_tiled_up, "applies", lambda gate, x, w_up: True)
    monkeypatch.setattr(_tiled_up.K, "l2_bytes", lambda: 50 * 2**20)
    w = types.SimpleNamespace(nbytes=nbytes)
    with _tiled_up._stationary.expected_density(float("nan") if density is None else density):
        gate = types.SimpleNamespace(data=np.empty((tokens, 0, 0)))
        return _tiled_up.chosen(gate, None, w, backward=backward)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("nbytes", "density", "tokens", "taken"),
    [
        (2**20, None, 16384, False),
        (2**20, 0.005, 16384, True),
        (2**20, _tiled_up.BACKWARD_MIN_DENSITY * 0.99, 16384, False),
        (2**20, 0.02, _tiled_up.IN_L2_MIN_TOKENS - 1, False),
        (2**30, None, 100, True),
    ],
)
def test_auto_takes_the_tiled_backward_from_its_own_density(monkeypatch, nbytes, density, tokens, taken):
    """The backward's sampled product (three values written and u read per entry on the row
    gathers) takes the tiled kernel from BACKWARD_MIN_DENSITY, lower than the forward's rule."""
    assert _chosen(monkeypatch, None, nbytes, density, tokens, backward=True) is taken


def test_the_tiled_up_products_check_their_path(monkeypatch):
    """The gated up projection and the backward's sampled product take "auto", "gather" or
    "tiled": another path, or "tiled" where the kernel cannot run (fp8 weight rows here), is a
    one-line error naming the argument; "gather" never asks the rule."""
    from twellsparse import _gpu_ops

    with pytest.raises(ValueError, match="path: expected 'auto', 'gather' or 'tiled', got 'portable'"):
        _gpu_ops._takes_tiled_up("portable", None, None, None, "x and w_up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="path: 'tiled' needs 2-byte x and w_up with 16-byte rows"):
        _gpu_ops._takes_tiled_up("tiled", None, None, None, "x and w_up", quantized=True)  # type: ignore[arg-type]
    monkeypatch.setattr(_tiled_up, "chosen", lambda *a, **kw: pytest.fail("the rule was asked"))
    assert not _gpu_ops._takes_tiled_up("gather", None, None, None, "dy and w_down_t")  # type: ignore[arg-type]
