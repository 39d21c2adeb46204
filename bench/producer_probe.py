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
import ctypes
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

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


#: NVML's clock-limit reason bits worth naming (nvmlClocksEventReasons, nvml.h).
CLOCK_REASONS = (
    (0x1, "idle"),
    (0x4, "sw power cap"),
    (0x8, "hw slowdown"),
    (0x20, "sw thermal"),
    (0x40, "hw thermal"),
    (0x80, "power brake"),
)


class Nvml:
    """The few NVML calls ``--energy`` needs, through ctypes (no Python package): the device found
    by the current CUDA device's PCI bus id."""

    def __init__(self) -> None:
        import cupy as cp

        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.device = ctypes.c_void_p()
        bus_id = cp.cuda.Device().pci_bus_id.encode()
        self._check(self.lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id, ctypes.byref(self.device)), "handle")

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"NVML {what}: error {code}")

    def _get(self, name: str, ctype: Any, *head: Any) -> int:
        value = ctype()
        self._check(getattr(self.lib, name)(self.device, *head, ctypes.byref(value)), name)
        return int(value.value)

    def energy_mj(self) -> int:
        return self._get("nvmlDeviceGetTotalEnergyConsumption", ctypes.c_ulonglong)

    def sm_mhz(self) -> int:
        return self._get("nvmlDeviceGetClockInfo", ctypes.c_uint, ctypes.c_int(1))  # NVML_CLOCK_SM

    def power_limit_w(self) -> float:
        return self._get("nvmlDeviceGetEnforcedPowerLimit", ctypes.c_uint) / 1000.0

    def reasons(self) -> str:
        # The older name of the same call, for drivers before the rename.
        name = "nvmlDeviceGetCurrentClocksEventReasons"
        name = name if hasattr(self.lib, name) else "nvmlDeviceGetCurrentClocksThrottleReasons"
        bits = self._get(name, ctypes.c_ulonglong)
        named = [name for bit, name in CLOCK_REASONS if bits & bit]
        return ",".join(named) or f"0x{bits:x}"


def energy_while(nvml: Nvml, fn: Callable[[], Any], seconds: float = 2.0) -> dict[str, Any]:
    """Time and energy per call of ``fn`` run back to back (queued 20 at a time, after 0.5 s of
    warm-up), from CUDA events and NVML's energy counter around the window, with the SM clock and
    the clock-limit reasons read as the window ends (before the last synchronisation)."""
    import cupy as cp

    stream = cp.cuda.get_current_stream()
    warm_end = time.perf_counter() + 0.5
    while time.perf_counter() < warm_end:
        for _ in range(20):
            fn()
        stream.synchronize()
    calls, start_event, end_event = 0, cp.cuda.Event(), cp.cuda.Event()
    mj0, start = nvml.energy_mj(), time.perf_counter()
    start_event.record(stream)
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            fn()
        calls += 20
        if time.perf_counter() - start >= seconds:
            break
        stream.synchronize()
    clock, reasons = nvml.sm_mhz(), nvml.reasons()  # read while the last calls still run
    end_event.record(stream)
    end_event.synchronize()
    mj1 = nvml.energy_mj()
    ms = cp.cuda.get_elapsed_time(start_event, end_event)
    mj = (mj1 - mj0) / calls
    return {
        "ms_per_call": round(ms / calls, 4),
        "mj_per_call": round(mj, 2),
        "watts": round((mj1 - mj0) / ms, 1),
        "sm_mhz": clock,
        "reasons": reasons,
        "calls": calls,
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
