"""Kernels under a sustained load: NVML's energy counter read around seconds of back-to-back
calls (nothing samples while they run), with the SM clock and the clock-limit reasons NVML
reports as each window ends. Used by ``producer_probe.py --energy`` and ``ffn_energy.py``.

Why (bench/NOTES.md, thirty-seventh session): run back to back for seconds, an H100 holds its
board at the 700 W cap for cuBLASLt's GEMM and for the fused producer alike, so a call's time is
its energy over the cap, while the library's usual timings (a few calls after an idle, L2
flushed) run below it, at a higher clock. NVML's counter moves in steps, so a two-second
window's energy carries a few percent of jitter (the windows that read above the 700 W cap show
it): compare kernels over rounds, in turn, on one machine.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

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

    # Torch's work and CuPy's share the legacy default stream; the device-wide synchronisation
    # waits for either.
    stream, sync = cp.cuda.get_current_stream(), cp.cuda.Device().synchronize
    warm_end = time.perf_counter() + 0.5
    while time.perf_counter() < warm_end:
        for _ in range(20):
            fn()
        sync()
    calls, start_event, end_event = 0, cp.cuda.Event(), cp.cuda.Event()
    mj0, start = nvml.energy_mj(), time.perf_counter()
    start_event.record(stream)
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            fn()
        calls += 20
        if time.perf_counter() - start >= seconds:
            break
        sync()
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


def dense_and_sparse(windows: dict[str, list[dict[str, Any]]], kind: str) -> tuple[tuple[float, float], ...]:
    """``((dense ms, dense mJ), (sparse ms, sparse mJ))`` per call for ``kind`` ("gated" or
    "non-gated") from ``bench/ffn_energy.py``'s windows: each block's best window."""
    names = (f"dense {kind} (torch)", f"sparse {kind}")
    return tuple((min(w["ms_per_call"] for w in windows[n]), min(w["mj_per_call"] for w in windows[n])) for n in names)
