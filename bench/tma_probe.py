"""How fast the copy engine (TMA) fills one SM's shared memory from L2, by the shape of what it
copies: a probe for the tiled up projection's staging (bench/NOTES.md, forty-fourth session, item
6: its slices arrive at ~36 GB/s per SM, half of what a GEMM's operand ring takes in).

Every SM runs one block whose one thread keeps ``stages`` buffers in flight, each a stage of
``boxes`` boxes, and refills each as soon as it lands (no compute): the rate it reaches is the
copy engine's, for that box shape and that many bytes in flight. The source is a 23 MB array
(W_up's size at the standard widths: it stays in L2), read as the tiled up projection reads it
(64-byte pieces of rows 4 KB apart) or laid out otherwise.

    python bench/tma_probe.py [--iters 256] [--out FILE]

Prints one line per shape (GB/s in total and per SM) and appends the records to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(32, 1)
tma_stream(const __grid_constant__ twell::TensorMap map, const char* __restrict__ flat, long long flat_bytes,
           int rows_total, int box_rows, int box_cols, int col_steps, int boxes, int stages, int iters, int bulk) {
  using namespace twell;
  extern __shared__ __align__(128) unsigned char staged[];
  const unsigned box_bytes = (unsigned)(box_rows * box_cols * 2), stage_bytes = box_bytes * boxes;
  const unsigned smem = smem_u32(staged), bars = smem + stages * stage_bytes;
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) barrier_init(bars + 8 * s, 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  // Fill `it` into buffer s: the block's rows at column step it % col_steps (the tiled up
  // projection's slices of one box of rows), or contiguous chunks (bulk).
  auto issue = [&](int it, int s) {
    const unsigned bar = bars + 8 * s, dst = smem + s * stage_bytes;
    barrier_expect_bytes(bar, stage_bytes);
    const int c0 = (it % col_steps) * box_cols, group = it / col_steps;
    for (int i = 0; i < boxes; ++i) {
      const long long box = ((long long)group * gridDim.x + blockIdx.x) * boxes + i;
      if (bulk) {
        const char* src = flat + (box * box_bytes) % flat_bytes;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(dst + i * box_bytes), "l"(src), "r"(box_bytes), "r"(bar) : "memory");
      } else {
        const int r0 = (int)((box * box_rows) % rows_total);
        tma_load_2d(dst + i * box_bytes, &map, c0, r0, bar);
      }
    }
  };
  unsigned phases = 0;
  for (int s = 0; s < stages && s < iters; ++s) issue(s, s);
  for (int it = 0; it < iters; ++it) {
    const int s = it % stages;
    barrier_wait(bars + 8 * s, (phases >> s) & 1u);
    phases ^= 1u << s;
    if (it + stages < iters) issue(it + stages, s);
  }
}
"""

#: (name, the array's rows and columns, box rows, box columns, column steps, boxes a stage, stages)
SHAPES = [
    # The tiled up projection today: 64-byte pieces (32 columns) of rows 4 KB apart, 96 KB stages.
    ("rows 64 B, 2 x 96 KB", (5632, 2048), 256, 32, 64, 6, 2),
    ("rows 64 B, 4 x 48 KB", (5632, 2048), 256, 32, 64, 3, 4),
    ("rows 64 B, 3 x 64 KB", (5632, 2048), 256, 32, 64, 4, 3),
    ("rows 64 B, 2 x 48 KB", (5632, 2048), 256, 32, 64, 3, 2),
    # 128-byte pieces (64 columns): the same bytes in half the rows.
    ("rows 128 B, 2 x 96 KB", (5632, 2048), 128, 64, 32, 6, 2),
    ("rows 128 B, 4 x 48 KB", (5632, 2048), 128, 64, 32, 3, 4),
    # 256-byte pieces (128 columns).
    ("rows 256 B, 2 x 96 KB", (5632, 2048), 64, 128, 16, 6, 2),
    # The slices laid out one after another (a slice's rows contiguous, 64 bytes each).
    ("slice-major 64 B rows, 2 x 96 KB", (5632 * 64, 32), 256, 32, 1, 6, 2),
    ("slice-major 64 B rows, 4 x 48 KB", (5632 * 64, 32), 256, 32, 1, 3, 4),
    # One-dimensional bulk copies of 16 KB each (no tensor map).
    ("bulk 16 KB chunks, 2 x 96 KB", (5632 * 64, 32), 256, 32, 1, 6, 2),
]


def cubin() -> bytes:
    """The probe compiled by NVRTC for sm_90a (no GPU needed), as the library compiles its own."""
    from twellsparse import _kernels as K

    return K._nvrtc_cubin("tma_probe.cu", [], "sm_90a", code=K.read_source("twell_tma.cuh") + SOURCE)[0]


def measure(cp: Any, fn: Any, shape: tuple, iters: int, sms: int) -> dict[str, Any]:
    from twellsparse._tensor_map import SWIZZLE_NONE, tensor_map

    name, (rows, cols), box_rows, box_cols, col_steps, boxes, stages = shape
    bulk = name.startswith("bulk")
    a = cp.random.standard_normal((rows, cols), dtype=cp.float32).astype(cp.float16)
    stage_bytes = box_rows * box_cols * 2 * boxes
    shared = stages * stage_bytes + 8 * stages
    driver = cp.cuda.driver
    driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)
    tmap = tensor_map(a, box_rows, box_cols, SWIZZLE_NONE)
    args = (tmap, a, cp.int64(a.nbytes), cp.int32(rows), cp.int32(box_rows), cp.int32(box_cols))
    args += (cp.int32(col_steps), cp.int32(boxes), cp.int32(stages), cp.int32(iters), cp.int32(int(bulk)))
    for _ in range(3):
        fn((sms,), (32,), args, shared_mem=shared)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(10):
        start.record()
        fn((sms,), (32,), args, shared_mem=shared)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    ms = sorted(times)[len(times) // 2]
    total = sms * iters * stage_bytes
    return {"shape": name, "ms": ms, "gb_s": total / ms / 1e6, "gb_s_per_sm": total / ms / 1e6 / sms}


def main(argv: list[str] | None = None) -> int:
    import cupy as cp

    from twellsparse import _kernels as K
    from twellsparse._environment import append_records, environment

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    module = cp.cuda.function.Module()
    module.load(cubin())
    fn = module.get_function("tma_stream")
    sms = K.sm_count()
    records = []
    for shape in SHAPES:
        r = measure(cp, fn, shape, args.iters, sms)
        rate = f"{r['gb_s']:8.0f} GB/s {r['gb_s_per_sm']:6.1f} GB/s per SM"
        print(f"{r['shape']:36s} {r['ms']:8.3f} ms {rate}", flush=True)
        records.append({"bench": "tma_probe", **environment(), **r})
    append_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
