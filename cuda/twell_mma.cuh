// One m16n8k16 tensor-core step of 2-byte values with fp32 accumulators (sm_80+: mma.sync),
// shared by the row gathers' dot products and the tiled up projection.
#pragma once
#include "twell_types.cuh"

namespace twell {

// D += A B for one m16n8k16 tensor-core step with fp32 accumulators (A row-major 16 x 16 and B
// column-major 16 x 8, both of 2-byte T), each register two values, the lower k in its low
// half. The PTX fragment layout, lane = 4 g + t: a0 holds A's row g at k = 2t, 2t + 1, a1 row
// g + 8 at the same k, a2 and a3 the same rows at k = 2t + 8, 2t + 9; b0 holds B's column g at
// k = 2t, 2t + 1 and b1 at 2t + 8, 2t + 9; d0, d1 are D's row g at columns 2t, 2t + 1 and d2, d3
// its row g + 8.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                             unsigned b0, unsigned b1) {
  if constexpr (is_same_type<T, bf16>::value) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

}  // namespace twell
