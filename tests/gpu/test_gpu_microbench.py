"""The microbenchmark harness on the GPU: a tiny quick run checks and times every provider;
TwELL, dense and the copy ceiling must succeed (a cuSPARSE combination may be refused)."""

from __future__ import annotations

import json

import pytest

from twellsparse.__main__ import main

pytestmark = pytest.mark.gpu


def test_quick_run(cp, tmp_path):
    args = ["bench", "--quick", "--m", "256", "--densities", "0.05", "--reps", "2", "--out", str(tmp_path)]
    assert main(args) == 0
    records = {r["op"]: r for r in map(json.loads, (tmp_path / "micro.jsonl").read_text().splitlines())}
    assert set(records) == {"spmm", "convert", "sddmm", "ffn"}
    must = {
        "spmm": ("dense-cublas", "twell", "twell+pack", "cupyx-csr-fp32"),
        "convert": ("twell", "copy"),
        "sddmm": ("twell",),
        "ffn": ("dense-cublas", "twell-sparse", "twell-auto"),
    }
    for op, names in must.items():
        for name in names:
            t = records[op]["ms"][name]
            assert "median" in t, (op, name, t)
    assert any(name.startswith("cusparse-csr") for name in records["spmm"]["ms"])
