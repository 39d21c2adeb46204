// Slot classes of the packs that order entries against shared-memory bank conflicts
// (twell_stationary.cu, twell_tiled_up.cu): per-class counts as the 16-bit fields of one 64-bit
// value, so that one warp scan ranks every class at once, and a lane's rank within its class.
#pragma once
#include "twell_scan.cuh"

namespace twell {

// Up to four classes' counts, each below 2^16 (a packed row's columns, and a tiled item's
// entries, are 16-bit), as the fields of one 64-bit value.
__device__ __forceinline__ unsigned long long class_unit(int q) { return 1ull << (16 * q); }
__device__ __forceinline__ int class_field(unsigned long long v, int q) {
  return (int)((v >> (16 * q)) & 0xffffu);
}

// The rank of this lane's entry (of class q, if live) among the warp's live entries of its class
// in lane order, after the `base` ones before them; base moves past the warp's entries.
__device__ __forceinline__ int ballot_rank(bool live, int q, unsigned long long& base) {
  const unsigned below = (1u << (threadIdx.x & 31)) - 1u;
  int k = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const unsigned same = __ballot_sync(0xffffffffu, live && q == c);
    if (q == c) k = class_field(base, c) + __popc(same & below);
    base += class_unit(c) * __popc(same);
  }
  return k;
}

}  // namespace twell
