"""The main job runs on the CPU and records its measurements."""

from __future__ import annotations

import json

from twellsparse.__main__ import main


def test_demo_cpu_runs_and_records(tmp_path, capsys):
    path = tmp_path / "demo.jsonl"
    assert main(["demo", "--cpu", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "CPU (NumPy reference path" in text
    record = json.loads(path.read_text().splitlines()[0])
    assert record["device_path"] == "cpu"
    assert 0.005 < record["density"] < 0.02
    assert record["rel_error"]["twell"] < 1e-6
