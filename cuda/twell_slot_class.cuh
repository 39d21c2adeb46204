// Slot classes of the packs that order entries against shared-memory bank conflicts
// (twell_stationary.cu, twell_tiled_up.cu): per-class counts as the 16-bit fields of one 64-bit
// value, so that one warp scan ranks every class at once, and a lane's rank within its class; and
// the segment helpers of packs that give each half-warp its own item.
#pragma once
#include "twell_scan.cuh"

namespace twell {

// Up to four classes' counts, each below 2^16 (a packed row's columns, and a tiled item's
// entries, are 16-bit), as the fields of one 64-bit value.
__device__ __forceinline__ unsigned long long class_unit(int q) { return 1ull << (16 * q); }
__device__ __forceinline__ int class_field(unsigned long long v, int q) {
  return (int)((v >> (16 * q)) & 0xffffu);
}

// The lanes of this lane's segment: WIDTH consecutive lanes (32: the whole warp; 16: its half).
// Packs that give each segment its own item (a row, a quad of tokens) shuffle and ballot with
// the full mask, every lane of the warp taking part, and keep to their segment's lanes.
template <int WIDTH> __device__ __forceinline__ unsigned segment_mask() {
  static_assert(WIDTH == 16 || WIDTH == 32, "segments are half-warps or whole warps");
  return WIDTH == 32 ? 0xffffffffu : 0xffffu << (threadIdx.x & 16);
}

// The first item of this warp in a kernel of WIDTH lanes per item (32 / WIDTH items a warp).
template <int WIDTH> __device__ __forceinline__ long long warp_first_item() {
  return ((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5) * (32 / WIDTH);
}

// Whether the warp's first item is past the last (a warp-uniform exit).
template <int WIDTH> __device__ __forceinline__ bool warp_past_items(long long items) {
  return warp_first_item<WIDTH>() >= items;
}

// This lane's item, and whether it is past the last (then it is the last item again, to be
// walked without writing: its segment must still take part in the warp's shuffles). The caller
// has returned first where the warp's first item is past the last.
template <int WIDTH> __device__ __forceinline__ int segment_item(int items, bool& dead) {
  const long long item = warp_first_item<WIDTH>() + (threadIdx.x & 31) / WIDTH;
  dead = item >= items;
  return dead ? items - 1 : (int)item;
}

// The inclusive sum of v over this lane's segment, in lane order.
template <int WIDTH, typename V> __device__ __forceinline__ V segment_inclusive_sum(V v) {
  const int sl = threadIdx.x & (WIDTH - 1);
#pragma unroll
  for (int d = 1; d < WIDTH; d <<= 1) {
    const V up = __shfl_up_sync(0xffffffffu, v, d, WIDTH);
    if (sl >= d) v += up;
  }
  return v;
}

// The rank of this lane's entry (of class q < CLASSES, if live) among its segment's live
// entries of that class in lane order, after the `base` ones before them; base moves past the
// segment's entries.
template <int WIDTH, int CLASSES>
__device__ __forceinline__ int segment_ballot_rank(bool live, int q, unsigned long long& base) {
  const unsigned seg = segment_mask<WIDTH>();
  const unsigned below = ((1u << (threadIdx.x & 31)) - 1u) & seg;
  int k = 0;
#pragma unroll
  for (int c = 0; c < CLASSES; ++c) {
    const unsigned same = __ballot_sync(0xffffffffu, live && q == c) & seg;
    if (q == c) k = class_field(base, c) + __popc(same & below);
    base += class_unit(c) * __popc(same);
  }
  return k;
}

// The same over the whole warp, four classes (the stationary pack's slot classes).
__device__ __forceinline__ int ballot_rank(bool live, int q, unsigned long long& base) {
  return segment_ballot_rank<32, 4>(live, q, base);
}

}  // namespace twell
