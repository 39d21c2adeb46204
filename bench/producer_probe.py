"""Probe: the fused producer's pass 1 against cuBLASLt, standard problem (run per build switch)."""
import os, sys
import cupy as cp
import twellsparse as ts
from twellsparse import _gpu_ops, _hopper_producer
from twellsparse._timing import Timer
from twellsparse.testing import ffn_problem

p = ffn_problem(16384, 2048, 5632, 0.005, "uniform", ts.bfloat16, 0, cp)
x, wg = p["x"], p["w_gate"]
t = Timer(10, on_gpu=True, flush_l2=True)
g = t(lambda: _gpu_ops.gemm_nt(x, wg))[1]["median"]
f = t(lambda: _hopper_producer.linear_to_parts_deferred(x, wg, "relu", 256, 32, None))[1]["median"]
print(f"pack={os.environ.get('TWELL_HOPPER_PACK', 'default')} variant={os.environ.get('PROBE', '')}: gemm {g:.3f} ms, fused pass 1 {f:.3f} ms ({f / g:.2f}x)", flush=True)
