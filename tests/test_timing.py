"""The shared timer on the CPU: warm-up, repetitions, median and spread."""

from __future__ import annotations

from twellsparse._timing import Timer


def test_cpu_timer_counts_calls_and_orders_percentiles():
    calls = []
    result, ms = Timer(reps=5, on_gpu=False, warmup=2)(lambda: calls.append(1) or len(calls))
    assert len(calls) == 7 and result == 7
    assert 0 <= ms["p10"] <= ms["median"] <= ms["p90"]
