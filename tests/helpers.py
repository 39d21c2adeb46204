"""Helpers shared by the test modules (tests/ is on sys.path through its conftest.py)."""

from __future__ import annotations

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
