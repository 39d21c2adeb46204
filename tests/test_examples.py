"""The training example runs (CPU, tiny model): the loss falls and the L1 penalty sparsifies."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiny_llama_trains_and_sparsifies():
    spec = importlib.util.spec_from_file_location("tiny_llama", ROOT / "examples" / "tiny_llama.py")
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    sys.modules["tiny_llama"] = ex  # dataclasses look their module up there
    spec.loader.exec_module(ex)
    cfg = ex.Config(d_model=32, d_ff=128, n_layers=1, seq=16, tile_n=32)
    history = ex.train(cfg, steps=80, batch=16, l1=3e-2, device="cpu", sparse=True, log_every=10)
    first, last = history[0], history[-1]
    assert last[1] < first[1] - 0.5  # loss fell
    assert last[2][0] < 0.6 * first[2][0]  # gate density fell under the L1 penalty
