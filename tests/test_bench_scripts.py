"""The benchmark scripts cannot rot: the report builds from the stored results and the README's
table matches it; the FFN benchmark parses its arguments and formats a record (no GPU needed)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str):
    """The script as a module, with bench/ importable as when it runs (its folder is sys.path[0])."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_matches_readme():
    report = _load("report")
    table = report.tables(report.load(ROOT / "bench" / "results"))
    assert "| uniform |" in table and "| skewed |" in table
    readme = (ROOT / "README.md").read_text()
    section = readme.split(report.START, 1)[1].split(report.END, 1)[0].strip()
    assert section == table.strip(), "README benchmark table is stale: run python bench/report.py --update-readme"


def test_switches_are_recorded_and_kept_out_of_the_tables(monkeypatch):
    """A TWELL_* switch in the environment goes into every record's settings (the commit does
    not), and the report's tables use only records measured without one."""
    from twellsparse._environment import environment

    monkeypatch.setenv("TWELL_L2_HINTS", "0")
    monkeypatch.setenv("TWELL_COMMIT", "abc")
    env = environment()
    assert env["settings"] == {"TWELL_L2_HINTS": "0"} and env["commit"] == "abc"
    report = _load("report")
    base = {"kind": "ffn", "commit": "abc", "date": "2026-12-03T00:00:00+00:00", "gpu": "NVIDIA H200"}
    switched = {**base, "date": "2026-12-04T00:00:00+00:00", "settings": env["settings"]}
    assert report.latest([base, switched], "ffn") == [base]
    # Smoke runs (--quick, the CPU) and records without a GPU never reach a table either.
    smoke = {**base, "date": "2026-12-05T00:00:00+00:00", "smoke": True}
    cpu = {**base, "date": "2026-12-06T00:00:00+00:00", "device_path": "cpu"}
    no_gpu = {k: v for k, v in base.items() if k != "gpu"} | {"date": "2026-12-07T00:00:00+00:00"}
    assert report.latest([base, smoke, cpu, no_gpu], "ffn") == [base]


def test_distributed_table_gives_speed_up_and_scaling():
    """The multi-GPU table from examples' --json records: per-GPU rates, TwELL over dense, and
    two GPUs' per-GPU rate over one GPU's; CPU runs and other commits stay out."""
    report = _load("report")
    env = {
        "kind": "distributed",
        "commit": "abc1234",
        "date": "2026-12-06T00:00:00+00:00",
        "gpu": "NVIDIA H200",
        "dtype": "bfloat16",
        "shape": [32768, 2048, 5632],
        "tokens_per_rank": 16384,
        "density_target": 0.01,
        "device_kind": "cuda",
    }
    rates = {("single", 1, "dense"): 100.0, ("single", 1, "twell"): 150.0, ("ddp", 2, "dense"): 90.0}
    rates[("ddp", 2, "twell")] = 120.0
    recs = [
        {**env, "framework": "torch", "mode": m, "world": w, "mlp": mlp, "tokens_per_s_per_rank": v}
        for (m, w, mlp), v in rates.items()
    ]
    recs.append({**recs[0], "device_kind": "cpu", "date": "2026-12-07T00:00:00+00:00", "commit": "fff"})
    assert report.distributed_table(recs[-1:]) == ""
    table = report.distributed_table(recs[:-1])
    assert "| torch | ddp | 2 | 1.00% | 90 / 120 (1.33x) | 0.90 / 0.80 |" in table
    assert "| torch | single | 1 | 1.00% | 100 / 150 (1.50x) |  |" in table


def test_energy_table_takes_each_blocks_best_window():
    """The sustained-load table: the fastest and the least-energy window of each block, the
    speed-up as dense time over sparse time, the energy as sparse over dense."""
    report = _load("report")

    def window(ms, mj):
        return {"ms_per_call": ms, "mj_per_call": mj, "watts": 690.0, "sm_mhz": 1700, "reasons": "sw power cap"}

    windows = {
        "dense gated (torch)": [window(2.0, 1400.0), window(1.9, 1300.0)],
        "sparse gated": [window(1.0, 650.0), window(1.1, 700.0)],
        "dense non-gated (torch)": [window(1.2, 800.0)],
        "sparse non-gated": [window(0.8, 600.0)],
    }
    base = {"kind": "ffn_energy", "commit": "abcdef1234", "gpu": "NVIDIA H100", "date": "2026-12-06T00:00:00"}
    record = {**base, "m": 16384, "pattern": "uniform", "density_target": 0.005, "power_limit_w": 700.0}
    table = report.energy_table([{**record, "windows": windows}])
    assert (
        "| uniform | 0.50% | 1.900 / 1.000 (1.90x) | 1300 / 650 (0.50) | 1.200 / 0.800 (1.50x) | 800 / 600 (0.75) |"
        in table
    )
    assert "700 W cap" in table
    assert report.energy_table([]) == ""


def test_ffn_bench_summary_line():
    pytest.importorskip("cupy")  # the script imports it at the top
    bench = _load("ffn_bench")
    record = next(r for r in _load("report").load(ROOT / "bench" / "results") if r["kind"] == "ffn")
    line = bench.summary_line(record)
    assert record["pattern"] in line and "gated" in line
    fp8 = next(r for r in _load("report").load(ROOT / "bench" / "results") if "gated_ffn_e4m3" in r.get("ms", {}))
    assert "e4m3 rows: ffn" in bench.summary_line(fp8)


def test_byte_model_runs(capsys):
    model = _load("model")
    assert model.main(["--m", "512", "--d-ff", "512", "--blocks", "64,128", "--densities", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "uniform" in out and "skewed" in out
    assert "hot units H" in out
    assert "row gathers' slot use" in out
    assert "transposed products' slot use" in out


def test_hot_split_picks_the_cheapest_h():
    import numpy as np

    model = _load("model")
    fire = np.zeros((100, 4), dtype=bool)
    fire[:, 2] = True  # one unit fires for every token, another once
    fire[0, 1] = True
    gathers_only = 2 * 101 * 4096 / 6.4e9
    assert model.hot_split(fire, 4096, 2048, 1e12, 6.4) == (2, 4.0 * 100 * 2048 * 2 / 1e21)  # dense ~free
    hot, ms = model.hot_split(fire, 4096, 2048, 1e-6, 6.4)  # dense far too slow: gathers alone
    assert hot == 0 and abs(ms - gathers_only) < 1e-12


def test_packed_stats_counts_kgroups_rounds_and_warps():
    """One full row group of a 512-token block firing 17 units of the first chunk: 8 x 17 = 136
    entries in one item, 9 k-groups (144 slots: 5.9% padding), its largest class 24 entries (the
    octet plan's bound: 24 wavefronts for 18 octets), one round for that block; in
    A.T units 0-7 and 8-15 hold 64 entries each (4 k-groups each) and unit 16 eight (1), all
    warp 0's (it owns units 0-31)."""
    import numpy as np

    model = _load("model")
    fire = np.zeros((512, 1024), dtype=bool)
    fire[:8, :17] = True
    st = model.packed_stats(fire, d_model=64)
    assert abs(st["padding"] - (144 / 136 - 1)) < 1e-12
    assert st["rounds"] == (1 + 0) / 2 and st["two_rounds"] == 0  # the second chunk's block: none
    assert st["spmm_gb"] == 9 * 16 * 2 * 64 / 1e9
    assert st["transposed_gb"] == 9 * 16 * 2 * 64 / 1e9
    # one tile (512 rows x 64 columns) streams both chunks of B (512 x 64 x 2 bytes each); its one
    # column block reads the 9 k-groups' words (64 bytes) and fragments (256 bytes)
    b_chunks = 2 * 512 * 64 * 2
    assert st["spmm_l2_gb"] == (b_chunks + 9 * (64 + 256)) / 1e9 and st["spmm_l2_operand"] == 9 * 320 / b_chunks
    # class 0 (columns 0, 8, 16) holds 24 entries against the item's 18 octets; A.T's items
    # (tokens 0-7: one per class and unit) conflict-free
    assert st["conflicts"] == 24 / 18 and st["conflicts_t"] == 1.0
    assert st["busiest_warp"] == 16.0  # warp 0 has all 9 k-groups: 16x the mean of 16 warps
    # dealt over the two blocks of 64 groups: 4 to block 0's warp 0, 4 to block 1's, 1 to block
    # 0's warp 1: busiest warps 4 + 4 against means (4 + 1) / 16 + 4 / 16
    assert st["busiest_warp_dealt"] == 8 / (9 / 16)


def test_ring_efficiency_waits_for_the_slowest_warps_release():
    import numpy as np

    model = _load("model")
    even = np.full((128, 5), 3)
    assert model.ring_efficiency(even, 16) == 1.0 and model.ring_efficiency(even, 32) == 1.0
    kgs = np.zeros((64, 4))
    kgs[0, 0] = 4  # warp 0 (groups 0-3): all its work in chunk 0
    kgs[4, 3] = 4  # warp 1 (groups 4-7): all its work in chunk 3
    # chunk 3 reuses chunk 0's stage: warp 1 starts it when warp 0 has released chunk 0 (t = 4)
    assert model.ring_efficiency(kgs, 16) == (8 / 16) / 8
    assert model.ring_efficiency(kgs, 16, stages=4) == (8 / 16) / 4  # a stage more: no wait


def test_block_occupancy_charges_a_block_its_longest_row():
    import numpy as np

    model = _load("model")
    even = np.ones(2 * 4 * 8, dtype=np.int64)  # 2 SMs x 8 warp slots, 4 rows each: no idle slot
    assert model.block_occupancy(even, 4, 8, sms=2) == 1.0
    assert model.block_occupancy(even, 1, 8, sms=2) == 1.0
    mixed = np.tile([2, 1, 1, 1], 16)  # every 4-row block waits 2 units on its first row
    assert model.block_occupancy(mixed, 4, 8, sms=2) == 80 / (8 * 16)  # 4 blocks per slot, 2 each
    # 1-row blocks: 80 units over 16 slots, taken in order by the first slot to free: 6 units long
    assert model.block_occupancy(mixed, 1, 8, sms=2) == 80 / (6 * 16)


def test_run_batches_cut_long_rows_into_leading_runs():
    import numpy as np

    model = _load("model")
    entries = np.array([40, 600, 256, 257])
    np.testing.assert_array_equal(model.run_batches(entries, None), [2, 19, 8, 9])
    # 600 -> runs of 256, 256, 88 (8, 8, 3 batches); 257 -> 256, 1 (8, 1); their rows' warps exit (0).
    np.testing.assert_array_equal(model.run_batches(entries, 256), [8, 8, 3, 8, 1, 2, 0, 8, 0])
    fire = np.zeros((1024, 64), dtype=bool)
    fire[:, 0] = True  # one unit fires for every token: 32 batches on one warp
    fire[:32, 1:] = True  # the others: one batch each
    assert model.transposed_slot_use(fire, 256) > 2 * model.transposed_slot_use(fire, None)


def test_deal_spreads_the_heaviest_groups_over_blocks_and_warps():
    import numpy as np

    model = _load("model")
    loads = np.arange(128)[::-1].copy()  # group g weighs 127 - g; two blocks
    slots = model.dealt_loads(loads)
    assert sorted(slots.tolist()) == sorted(loads.tolist())
    assert slots[0] == 127 and slots[64] == 126  # the two heaviest open block 0 and block 1
    assert slots[(0 * 16 + 15) * 4 + 1] == 127 - 32  # pass 1 snakes back: warp 15 of block 0


def test_train_step_quick(capsys):
    import os

    import pytest

    if not os.environ.get("CI"):
        pytest.importorskip("torch")
    assert _load("train_step").main(["--quick", "--densities", "0.05"]) == 0
    assert "saved activations" in capsys.readouterr().out


def test_model_bench_quick(capsys):
    import os

    import pytest

    if not os.environ.get("CI"):
        pytest.importorskip("torch")
    assert _load("model_bench").main(["--quick", "--densities", "0.1"]) == 0
    assert "train step" in capsys.readouterr().out


def test_breakeven_crossings_interpolate_the_ratio():
    import numpy as np
    import pytest

    breakeven_fit = _load("breakeven_fit")

    def rec(density, sparse, dense, pattern="uniform"):
        ms = {"ffn": {"median": sparse}, "dense_ffn": {"median": dense}}
        return {"kind": "ffn", "shape": [4096, 2048, 5632], "pattern": pattern, "density": density, "ms": ms}

    cross = breakeven_fit.crossings([rec(0.005, 0.8, 1.0), rec(0.01, 1.2, 1.0), rec(0.005, 1.1, 1.0, "skewed")])
    assert cross[("ffn", 4096, 2048, 5632, "uniform")] == pytest.approx(0.0075)
    assert np.isnan(cross[("ffn", 4096, 2048, 5632, "skewed")])  # sparse never ahead
    # Where the run timed the library's dense plan too, that plan (what auto switches to) sets the
    # crossing, faster than torch's block or not.
    with_plan = [rec(0.005, 0.8, 1.0), rec(0.01, 1.2, 1.0)]
    for r in with_plan:
        r["ms"]["dense_ffn_plan"] = {"median": 0.9}
    assert breakeven_fit.crossings(with_plan)[("ffn", 4096, 2048, 5632, "uniform")] == pytest.approx(0.00625)
    for r in with_plan:
        r["ms"]["dense_ffn_plan"] = {"median": 1.1}  # slower than torch's here: still the plan
    assert breakeven_fit.crossings(with_plan)[("ffn", 4096, 2048, 5632, "uniform")] > 0.0075


def test_producer_probe_reads_nvidia_smi_samples(tmp_path, monkeypatch):
    """--clocks: the medians of nvidia-smi's samples past the ramp, here from a stand-in that
    prints ten samples (the first four are dropped)."""
    fake = tmp_path / "nvidia-smi"
    rows = ["1980, 120.5"] * 4 + ["1605, 690.0", "1620, 700.0", "1590, 695.0", "1610, 698.0", "1600, 699.0", "oops"]
    fake.write_text("#!/bin/sh\n" + "".join(f"echo '{r}'\n" for r in rows) + "exec sleep 5\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    probe = _load("producer_probe")
    calls = []
    got = probe.clocks_while(lambda: calls.append(1), lambda: None, seconds=0.3)
    assert got["calls"] == len(calls) > 0
    assert got["sm_mhz"] == 1605.0 and got["power_w"] == 698.0


def test_gpu_gaps_merges_overlapping_kernels_and_ranks_the_idle_stretches():
    gaps = _load("host_profile")._busy_and_gaps
    assert gaps([]) == (0.0, 0.0, [])
    # a: 0-10, b: 5-12 (overlaps a), c: 20-30 (8 us idle), d: 22-25 (inside c), e: 60-61 (30 us idle)
    kernels = [(0.0, 10.0, "a"), (5.0, 12.0, "b"), (20.0, 30.0, "c"), (22.0, 25.0, "d"), (60.0, 61.0, "e")]
    span, busy, idle = gaps(kernels)
    assert (span, busy) == (61.0, 12.0 + 10.0 + 1.0)
    assert idle == [(30.0, "c", "e", 30.0), (8.0, "b", "c", 12.0)]


def test_device_run_stage_filters_name_existing_stages():
    """Every --only filter that scripts/device_run.sh hands to bench/stage_times.py (its
    stage_rows and ncu_rows calls) matches at least one stage name: a typo there would time
    nothing and cost a device run."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    source = (root / "bench" / "stage_times.py").read_text()
    names = set(re.findall(r'^\s*"([^"\n]+)": ', source, re.MULTILINE))  # the stages' dict entries
    sizes = re.search(r"for tokens in \(([\d, ]+)\)", source)
    assert sizes is not None
    names |= {f"gated up, tiled {t.strip()}" for t in sizes.group(1).split(",")}
    names |= {"plan gated", "fused producer, pass 1"}
    script = (root / "scripts" / "device_run.sh").read_text()
    profiled = re.findall(r'ncu_rows \S+ "([^"]+)"', script)
    filters = re.findall(r'stage_rows "([^"$]+)"', script) + re.findall(r'width_rows \S+ "([^"$]+)"', script)
    filters += profiled
    assert len(filters) >= 5
    for spec in filters:
        if ";" in spec:  # whole names
            assert all(part in names for part in spec.split(";")), f"device_run.sh filter {spec!r} names no stage"
            continue
        for part in spec.split(","):
            assert any(part in name for name in names), f"device_run.sh filter {part!r} names no stage"
    # A profiled row is one stage's whole name: Nsight Compute's launch count then catches that
    # stage's kernel, not another row's launch of the same kernel.
    for row in profiled:
        assert row in names, f"device_run.sh profiles {row!r}, which is not a stage's whole name"


def test_stage_filter_takes_whole_names_before_pieces():
    """stage_times.py --only: whole names separated by semicolons, or one whole name (names hold
    commas), pick those stages alone; otherwise comma-separated pieces pick every stage
    containing one; empty picks all."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "stage_times.py"
    spec = importlib.util.spec_from_file_location("stage_times_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = ["gated up, tiled by density", "gated up, tiled by density, pairs", "gated up, gather", "down spmm"]

    def picked(only):
        return [n for n in names if module.selected(n, only, names)]

    assert picked("gated up, tiled by density") == ["gated up, tiled by density"]
    assert picked("gated up, tiled by density, pairs") == ["gated up, tiled by density, pairs"]
    assert picked("gather,down") == ["gated up, gather", "down spmm"]
    assert picked("gated up, tiled by density;down spmm") == ["gated up, tiled by density", "down spmm"]
    assert picked("") == names


def test_records_carry_the_checkouts_commit(monkeypatch):
    """Inside a checkout the commit is HEAD (with -dirty for uncommitted changes), never a stale
    bench/.commit; TWELL_COMMIT overrides both."""
    import subprocess

    from twellsparse._environment import git_commit

    monkeypatch.delenv("TWELL_COMMIT", raising=False)
    root = pathlib.Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert git_commit().removesuffix("-dirty") == head.stdout.strip()
    monkeypatch.setenv("TWELL_COMMIT", "abc123")
    assert git_commit() == "abc123"


def test_plan_trace_reports_durations_and_gaps_in_launch_order(capsys):
    plan_trace = _load("plan_trace")
    events = [("pass 1", 100.0, 600.0), ("memset", 602.0, 603.0), ("up", 610.0, 900.0), ("down", 900.5, 1000.0)]
    plan_trace.report("gated", events)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == "gated"
    assert [line.split()[-1] for line in out[1:5]] == ["1", "memset", "up", "down"]  # launch order kept
    assert out[3].split()[:3] == ["510.0", "290.0", "7.0"]  # start, duration, the gap before it
    assert out[-1].strip() == "span 900.0 us, kernels 890.5 us, gaps 9.5 us, 4 launches"
