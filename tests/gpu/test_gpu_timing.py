"""The timer's host-hidden mode and the stage-times script on the GPU."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import time

import pytest

from twellsparse._timing import Timer

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_hide_host_removes_host_time(cp):
    a = cp.ones(1 << 20, dtype=cp.float32)

    def slow_host():  # 1 ms of host time between two tiny kernels (the spin covers 2 ms)
        a.fill(1)
        time.sleep(1e-3)
        a.fill(2)

    eager = Timer(5, on_gpu=True)(slow_host)[1]["median"]
    hidden = Timer(5, on_gpu=True, hide_host=True)(slow_host)[1]["median"]
    assert eager > 0.9, eager  # the events saw the host's sleep
    assert hidden < 0.3, hidden  # the GPU's two fills alone


def test_stage_times_runs(cp, tmp_path):
    spec = importlib.util.spec_from_file_location("stage_times", ROOT / "bench" / "stage_times.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "stages.jsonl"
    assert module.main(["--m", "512", "--density", "0.02", "--reps", "2", "--out", str(out)]) == 0
    rec = json.loads(out.read_text().splitlines()[0])
    assert rec["kind"] == "stages" and len(rec["stages"]) >= 14
    for name, t in rec["stages"].items():
        assert 0 < t["gpu_ms"] and 0 < t["eager_ms"], name
