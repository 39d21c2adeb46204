"""`python -m twellsparse bench` cannot rot: the CPU smoke run checks and times every op's
providers, writes JSON lines, the summary tables and the plots."""

from __future__ import annotations

import json

import pytest

from twellsparse.__main__ import main


def test_cpu_smoke_run(tmp_path, capsys):
    assert main(["bench", "--cpu", "--out", str(tmp_path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "micro.jsonl").read_text().splitlines()]
    assert {r["op"] for r in records} == {"spmm", "convert", "sddmm", "ffn"}
    for r in records:
        assert r["kind"] == "micro" and r["commit"] is not None and 0.03 < r["density"] < 0.3
        assert len(r["ms"]) == (3 if r["op"] == "ffn" else 2)
        for name, t in r["ms"].items():
            assert "error" not in t, (r["op"], name, t)
            assert t["median"] > 0 and "speedup_vs_dense" in t
        if r["op"] == "convert":
            assert all(t["gb_per_s"] > 0 for t in r["ms"].values())
    out = capsys.readouterr().out
    assert "| M | density | dense-numpy | twell-reference |" in out
    for op in ("spmm", "convert", "sddmm", "ffn"):
        assert (tmp_path / f"{op}_speedup_m64.png").stat().st_size > 1000


def test_m_sweep_plots_time_vs_m(tmp_path):
    args = ["bench", "--cpu", "--ops", "spmm", "--m", "16,48", "--densities", "0.1", "--out", str(tmp_path)]
    assert main(args) == 0
    assert (tmp_path / "spmm_time_vs_m.png").exists()
    assert len((tmp_path / "micro.jsonl").read_text().splitlines()) == 2


def test_unknown_op_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--ops: expected a subset of spmm,convert,sddmm,ffn, got gemm"):
        main(["bench", "--cpu", "--ops", "gemm", "--out", str(tmp_path)])


def test_d_ff_sweep_makes_one_table_and_plot_per_width(tmp_path, capsys):
    args = ["bench", "--cpu", "--ops", "spmm", "--d-ff", "96,160", "--d-model", "24", "--densities", "0.1"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "micro.jsonl").read_text().splitlines()]
    assert sorted(r["shape"][1:] for r in records) == [[96, 24], [160, 24]]
    assert all(r["density_target"] == 0.1 for r in records)
    out = capsys.readouterr().out
    assert "spmm (float32, N=96, K=24)" in out and "spmm (float32, N=160, K=24)" in out
    for width in (96, 160):
        assert (tmp_path / f"spmm_speedup_m64_n{width}.png").stat().st_size > 1000
