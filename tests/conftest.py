"""Shared fixtures: a seeded RNG per test, and the GPU marker's skip logic."""

from __future__ import annotations

import os
import zlib

# JAX would otherwise take 75% of GPU memory at start-up, leaving CuPy (which twellsparse.jax's
# callbacks allocate through) too little; it reads this when its GPU backend starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest

from twellsparse._backend import gpu_available


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random inputs per test, reproducible from the test's name."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def cp():
    """The cupy module (GPU tests only)."""
    import cupy

    return cupy
