"""The fused Hopper producer's pass 1 beside the cuBLASLt GEMM (standard problem, 0.5% uniform),
under each of its schedules (``_hopper_producer.SCHEDULES``).

    TWELL_HOPPER_PACK=0 python bench/producer_probe.py   # the fused GEMM without its epilogue

Run once per build switch (they are read when the module is compiled): the difference between
the two runs is the epilogue's share.
"""

from __future__ import annotations

import os


def main() -> None:
    import cupy as cp

    import twellsparse as ts
    from twellsparse import _gpu_ops, _hopper_producer
    from twellsparse._timing import Timer
    from twellsparse.testing import ffn_problem

    p = ffn_problem(16384, 2048, 5632, 0.005, "uniform", ts.bfloat16, 0, cp)
    x, wg = p["x"], p["w_gate"]
    timer = Timer(10, on_gpu=True, flush_l2=True)
    gemm = timer(lambda: _gpu_ops.gemm_nt(x, wg))[1]["median"]
    build = os.environ.get("TWELL_HOPPER_PACK", "default")
    for schedule in _hopper_producer.SCHEDULES:
        _hopper_producer.SCHEDULE = schedule
        fused = timer(lambda: _hopper_producer.linear_to_parts_deferred(x, wg, "relu", 256, 32, None))[1]["median"]
        print(
            f"TWELL_HOPPER_PACK={build}, {schedule} schedule: gemm {gemm:.3f} ms, fused pass 1 {fused:.3f} ms"
            f" ({fused / gemm:.2f}x)"
        )


if __name__ == "__main__":
    main()
