"""The dense transpose's host side: NumPy arrays take NumPy's copy (the values and dtype kept,
the input untouched), anything but a 2-D array is refused with the argument named, and the
opt-in switch is read as the other kernel switches are."""

from __future__ import annotations

import numpy as np
import pytest

import twellsparse as ts
from twellsparse import _dense_transpose
from twellsparse import _kernels as K


@pytest.mark.parametrize("dtype", [ts.bfloat16, np.float32])
def test_host_transpose_is_numpys(rng, dtype):
    a = rng.standard_normal((37, 5)).astype(dtype)[:, 1:4]  # a row stride above the width
    got = _dense_transpose.transpose(a)
    assert got.flags.c_contiguous and got.dtype == a.dtype and got.shape == (3, 37)
    np.testing.assert_array_equal(got, a.T)


def test_transpose_refuses_other_ranks():
    with pytest.raises(ValueError, match=r"a: expected a 2-D array, got 3-D with shape \(2, 3, 4\)"):
        _dense_transpose.transpose(np.zeros((2, 3, 4)))


def test_switch_values(monkeypatch):
    monkeypatch.setenv("TWELL_DENSE_TRANSPOSE", "1")
    assert K.env_switch("TWELL_DENSE_TRANSPOSE") is True
    monkeypatch.setenv("TWELL_DENSE_TRANSPOSE", "0")
    assert K.env_switch("TWELL_DENSE_TRANSPOSE") is False
    monkeypatch.delenv("TWELL_DENSE_TRANSPOSE")
    assert K.env_switch("TWELL_DENSE_TRANSPOSE") is None


def test_contiguous_transpose_copies_only_where_needed():
    """``a.T`` as a C-contiguous array: the view itself where it already is one (a transposed
    weight, as tied weights give), else a new array with the same values."""
    from twellsparse._dense_transpose import contiguous_transpose

    a = np.arange(12.0).reshape(3, 4)
    t = contiguous_transpose(a)
    assert t.flags.c_contiguous and not np.shares_memory(t, a)
    np.testing.assert_array_equal(t, a.T)
    f = np.asfortranarray(a)
    assert np.shares_memory(contiguous_transpose(f), f)
    np.testing.assert_array_equal(contiguous_transpose(f), a.T)
