"""The cut of the transposed products' long rows (cuda/twell_convert.cu, twell_segment_plan):
its NumPy oracle, the run lengths it chooses from and the switch that sets its slots. The kernel itself is
checked against the oracle in tests/gpu/test_gpu_segments.py."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import row_pointers

from twellsparse import _gpu_convert, _gpu_ops
from twellsparse._reference import run_length_candidates, segment_plan


def test_long_rows_are_cut_into_runs_in_row_order():
    lengths = [10, 600, 256, 257, 0, 1300]
    split_base, slot_row, segment = segment_plan(row_pointers(lengths), 256, 16)
    # 600 -> 3 runs, 257 -> 2, 1300 -> 6; a row of exactly one run stays whole.
    assert segment == 256
    np.testing.assert_array_equal(split_base, [-1, 0, -1, 3, -1, 5])
    np.testing.assert_array_equal(slot_row, [1, 1, 1, 3, 3, 5, 5, 5, 5, 5, 5, -1, -1, -1, -1, -1])
    assert split_base.dtype == slot_row.dtype == np.int32


def test_runs_lengthen_until_they_fit_the_slots():
    lengths = [600, 1300, 300, 10]
    split_base, slot_row, segment = segment_plan(row_pointers(lengths), 256, 6)
    # Runs of 256 need 3 + 6 + 2 = 11 slots, of 320 2 + 5 = 7; of 384 2 + 4 = 6 fit (300 stays
    # whole at that length).
    assert segment == 384
    np.testing.assert_array_equal(split_base, [0, 2, -1, -1])
    np.testing.assert_array_equal(slot_row, [0, 0, 1, 1, 1, 1])


def test_the_cut_stops_at_the_first_row_that_does_not_fit():
    lengths = [8000, 20000, 5000, 10]
    split_base, slot_row, segment = segment_plan(row_pointers(lengths), 256, 5)
    # Even runs of the longest candidate, 14 x 256 = 3584, need 3 + 6 + 2 = 11 slots: the row
    # 8000 takes slots 0-2, 20000 does not fit, nor does 5000 after it (the slots are handed out
    # in row order, so a later row never fills a gap).
    assert segment == 3584
    np.testing.assert_array_equal(split_base, [0, -1, -1, -1])
    np.testing.assert_array_equal(slot_row, [0, 0, 0, -1, -1])


def test_the_run_length_candidates():
    shortest_first = [256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584]
    assert run_length_candidates(256) == shortest_first
    assert run_length_candidates(2**28)[-1] == 2**31 - 1  # clamped to an int


def test_runs_cover_each_cut_row_exactly_once():
    rng = np.random.default_rng(5)
    lengths = np.where(rng.random(3000) < 0.05, rng.integers(257, 5000, 3000), rng.integers(0, 257, 3000))
    indptr = row_pointers(lengths)
    split_base, slot_row, segment = segment_plan(indptr, 256, 400)
    assert segment > 256  # runs of 256 would need more than the 400 slots
    used = slot_row[slot_row >= 0]
    assert used.size and np.all(np.diff(used) >= 0)  # consecutive slots, rows increasing
    for row in np.flatnonzero(split_base >= 0):
        runs = np.flatnonzero(slot_row == row)
        assert runs[0] == split_base[row] and np.all(np.diff(runs) == 1)
        starts = indptr[row] + (runs - runs[0]) * segment
        ends = np.minimum(starts + segment, indptr[row + 1])
        assert starts[0] == indptr[row] and ends[-1] == indptr[row + 1] and np.all(ends > starts)
    assert np.all(lengths[split_base >= 0] > segment)


@pytest.mark.parametrize("m, expected", [(1, 256), (8192, 256), (16384, 512), (131072, 4096), (16385, 513)])
def test_run_length_follows_the_token_count(m, expected):
    assert _gpu_convert.segment_length(m) == expected


@pytest.mark.parametrize("value", ["-1", "x", "2.5", str(2**20)])
def test_the_switch_names_itself_on_bad_values(monkeypatch, value):
    monkeypatch.setenv("TWELL_TRANSPOSED_SEGMENTS", value)
    with pytest.raises(ValueError, match=f"TWELL_TRANSPOSED_SEGMENTS: expected a slot count .* got '{value}'"):
        _gpu_convert._segment_slots()


def test_the_switch_sets_the_slots_and_zero_turns_the_cut_off(monkeypatch):
    monkeypatch.delenv("TWELL_TRANSPOSED_SEGMENTS", raising=False)
    assert _gpu_convert._segment_slots() == 2048
    monkeypatch.setenv("TWELL_TRANSPOSED_SEGMENTS", "0")
    assert _gpu_convert._segment_slots() == 0
    monkeypatch.setenv("TWELL_TRANSPOSED_SEGMENTS", "4096")
    assert _gpu_convert._segment_slots() == 4096


@pytest.mark.parametrize("slots", [-1, 2**20, 1.5, True])
def test_transposed_pattern_rejects_bad_slot_counts(slots):
    with pytest.raises(ValueError, match="slots: expected an integer from 0 to 2\\*\\*20 - 1"):
        _gpu_convert.transposed_pattern(None, 256, 10, slots=slots)  # type: ignore[arg-type]


def test_without_a_plan_the_plain_kernel_gets_no_extra_arguments():
    assert _gpu_ops._segment_arguments(None, 2, 2048, np.float32) == ((), 0)
