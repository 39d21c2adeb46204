"""The fused Hopper producer's pass 1 beside the cuBLASLt GEMM (standard problem, 0.5% uniform),
under each of its schedules (``_hopper_producer.SCHEDULES``).

    TWELL_HOPPER_PACK=0 python bench/producer_probe.py   # the fused GEMM without its epilogue
    python bench/producer_probe.py --clocks               # SM clock and power while each runs
    python bench/producer_probe.py --energy               # energy per call (NVML's counter)
    python bench/producer_probe.py --m 131072             # the model benchmark's tokens per layer
    python bench/producer_probe.py --threshold 0          # relu with a threshold (its keep path)

Run once per build switch (they are read when the module is compiled): the difference between
the two runs is the epilogue's share. ``--clocks`` runs each kernel back to back for about a
second while ``nvidia-smi`` samples the SM clock and the board power every 50 ms: the GEMMs of
this problem ran at 1.60-1.63 GHz under Nsight Compute (bench/NOTES.md, nineteenth session), so
whether a kernel is power-limited decides whether overlapping work with its MMAs can pay.
``--energy`` reads NVML's energy counter instead (before and after each kernel runs back to back
for two seconds: nothing samples while it runs) and gives each kernel's time per call, energy per
call, mean power and the SM clock and clock-limit reasons NVML reports at the window's end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from sustained import Nvml, energy_while

#: nvidia-smi's sampling period (ms) and the samples dropped at the start of each loop (ramp).
SAMPLE_MS, RAMP_SAMPLES = 50, 4


def clocks_while(fn: Callable[[], Any], sync: Callable[[], Any], seconds: float = 1.2) -> dict[str, float]:
    """Median SM clock (MHz) and power (W) that ``nvidia-smi`` reports while ``fn`` runs back to
    back for about ``seconds`` (``sync`` waits for the queued calls), with the number of calls."""
    sampler = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", f"-lms={SAMPLE_MS}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    calls, start = 0, time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            for _ in range(20):  # queue ahead: the GPU never waits for the host
                fn()
            calls += 20
            sync()
    finally:
        sampler.terminate()
        lines = sampler.communicate()[0].splitlines()
    samples = [tuple(float(v) for v in line.split(",")) for line in lines[RAMP_SAMPLES:] if "," in line]
    if not samples:
        return {"calls": calls}
    return {
        "calls": calls,
        "sm_mhz": statistics.median(s[0] for s in samples),
        "power_w": statistics.median(s[1] for s in samples),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clocks", action="store_true", help="also sample the SM clock and power while each kernel runs")
    ap.add_argument("--energy", action="store_true", help="energy per call and mean power of each kernel (NVML)")
    ap.add_argument("--m", type=int, default=16384, help="tokens (rows of x); d_model 2048 and d_ff 5632 stay")
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument(
        "--threshold", type=float, help="relu keeping only values above it (the thresholded keep path; 0 keeps as relu)"
    )
    args = ap.parse_args(argv)

    import cupy as cp

    import twellsparse as ts
    from twellsparse import _gpu_ops, _hopper_producer
    from twellsparse._timing import Timer
    from twellsparse.testing import ffn_problem

    p = ffn_problem(args.m, 2048, 5632, args.density, "uniform", ts.bfloat16, 0, cp)
    x, wg = p["x"], p["w_gate"]
    timer = Timer(10, on_gpu=True, flush_l2=True)

    def gemm_call() -> Any:
        return _gpu_ops.gemm_nt(x, wg)

    def fused_call() -> Any:
        return _hopper_producer.linear_to_parts_deferred(x, wg, "relu", 256, 32, args.threshold)

    if args.energy:
        nvml = Nvml()
        print(f"enforced power limit {nvml.power_limit_w():.0f} W, m {args.m}, density {args.density}")
        for _ in range(2):  # twice in turn: the second round shows the drift
            print(f"gemm (cuBLASLt): {energy_while(nvml, gemm_call)}")
            for schedule in _hopper_producer.SCHEDULES:
                _hopper_producer.SCHEDULE = schedule
                print(f"fused pass 1, {schedule}: {energy_while(nvml, fused_call)}")
        return
    gemm = timer(gemm_call)[1]["median"]
    build = os.environ.get("TWELL_HOPPER_PACK", "default")
    if args.clocks:
        print(f"gemm: {clocks_while(gemm_call, cp.cuda.Device().synchronize)}")
    for schedule in _hopper_producer.SCHEDULES:
        _hopper_producer.SCHEDULE = schedule
        fused = timer(fused_call)[1]["median"]
        print(
            f"m {args.m}, threshold {args.threshold}, TWELL_HOPPER_PACK={build}, {schedule} schedule: "
            f"gemm {gemm:.3f} ms, fused pass 1 {fused:.3f} ms ({fused / gemm:.2f}x)"
        )
        if args.clocks:
            print(f"{schedule}: {clocks_while(fused_call, cp.cuda.Device().synchronize)}")


if __name__ == "__main__":
    main()
