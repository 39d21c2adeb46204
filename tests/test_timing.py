"""The shared timer on the CPU: warm-up, repetitions, median and spread."""

from __future__ import annotations

from twellsparse._timing import Timer


def test_cpu_timer_counts_calls_and_orders_percentiles():
    calls = []
    result, ms = Timer(reps=5, on_gpu=False, warmup=2)(lambda: calls.append(1) or len(calls))
    assert len(calls) == 7 and result == 7
    assert 0 <= ms["p10"] <= ms["median"] <= ms["p90"]


def test_interleaved_timer_warms_each_then_takes_rounds_in_order():
    """Every function's warm-up first, then one repetition of each per round, in the order given;
    each gets its own last result and its own times."""
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name) or name.upper()) for name in ("a", "b", "c")}
    timed = Timer(reps=3, on_gpu=False, warmup=2).interleaved(fns)
    assert calls == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c"] * 3
    assert list(timed) == ["a", "b", "c"]
    for name, (result, ms) in timed.items():
        assert result == name.upper()
        assert 0 <= ms["p10"] <= ms["median"] <= ms["p90"]
