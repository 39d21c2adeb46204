// Device-wide prefix sums in two launches, with no host read-back (so the callers can run inside
// a CUDA-graph capture or an XLA callback).
//
// The input, one 64-bit value per element i < n given by a functor, is cut into chunks of
// SCAN_CHUNK elements, one block each. Launch 1 writes each chunk's sum. Launch 2 has every block
// add up the sums of the chunks before its own (at most a few thousand values, read by 256
// threads) and scan its chunk from that base, handing each element's value and inclusive running
// total to a visitor. Neither launch needs the other blocks to be resident, unlike a single-pass
// scan with look-back, and both are a handful of microseconds at the sizes used here.
//
// Inside a chunk each warp owns SCAN_ITEMS consecutive runs of 32 elements, so the loads are
// coalesced and the warp carries its running total from run to run.
#pragma once

namespace twell {

constexpr int SCAN_THREADS = 256;
constexpr int SCAN_WARPS = SCAN_THREADS / 32;
constexpr int SCAN_ITEMS = 16;
constexpr int SCAN_CHUNK = SCAN_THREADS * SCAN_ITEMS;
constexpr int SCAN_WARP_SPAN = 32 * SCAN_ITEMS;

__device__ __forceinline__ long long warp_inclusive_sum(long long v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const long long up = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

struct SumOp {
  __device__ long long operator()(long long a, long long b) const { return a + b; }
};
struct MaxOp {
  __device__ long long operator()(long long a, long long b) const { return a > b ? a : b; }
};

// The combination of every thread's `v` under `op`, returned to every thread of the block.
template <typename Op>
__device__ long long block_reduce(long long v, Op op) {
  __shared__ long long partial[SCAN_WARPS];
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, d));
  __syncthreads();  // `partial` may still be read by a previous call
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  v = partial[0];
#pragma unroll
  for (int w = 1; w < SCAN_WARPS; ++w) v = op(v, partial[w]);
  return v;
}

// Inclusive scan of one value per thread across the block (thread order); `total` gets the sum.
__device__ long long block_inclusive_sum(long long v, long long& total) {
  __shared__ long long warp_totals[SCAN_WARPS];
  const int warp = threadIdx.x >> 5;
  v = warp_inclusive_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 31) warp_totals[warp] = v;
  __syncthreads();
  long long before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < SCAN_WARPS; ++w) {
    if (w < warp) before += warp_totals[w];
    total += warp_totals[w];
  }
  return before + v;
}

// Sum of value(i) over chunk `chunk` (elements below n), returned to every thread.
template <typename Value>
__device__ long long chunk_sum(long long chunk, long long n, Value value) {
  const long long start = chunk * SCAN_CHUNK + (long long)(threadIdx.x >> 5) * SCAN_WARP_SPAN + (threadIdx.x & 31);
  long long s = 0;
#pragma unroll 4
  for (int k = 0; k < SCAN_ITEMS; ++k) {
    const long long i = start + 32 * k;
    if (i < n) s += value(i);
  }
  return block_reduce(s, SumOp());
}

// Sum of the first `count` chunk sums, returned to every thread.
__device__ long long sum_before(const long long* __restrict__ chunk_sums, long long count) {
  long long s = 0;
  for (long long j = threadIdx.x; j < count; j += SCAN_THREADS) s += chunk_sums[j];
  return block_reduce(s, SumOp());
}

// The first chunk j < count whose running total (chunk sums 0..j) exceeds `limit`, and the total
// before it; (count, sum of all) when none does. Every thread gets both.
__device__ void first_chunk_over(
    const long long* __restrict__ chunk_sums, long long count, long long limit, long long& chunk,
    long long& before) {
  __shared__ long long found[2];
  long long carry = 0;
  for (long long j0 = 0; j0 < count; j0 += SCAN_THREADS) {
    const long long j = j0 + threadIdx.x;
    const long long v = j < count ? chunk_sums[j] : 0;
    long long round_total;
    const long long end = carry + block_inclusive_sum(v, round_total);
    // Running totals only grow: the one thread whose total crosses the limit reports it.
    const bool crosses = j < count && end > limit && end - v <= limit;
    if (threadIdx.x == 0) found[0] = -1;
    __syncthreads();
    if (crosses) {
      found[0] = j;
      found[1] = end - v;
    }
    __syncthreads();
    if (found[0] >= 0) {
      chunk = found[0];
      before = found[1];
      return;
    }
    carry += round_total;
  }
  chunk = count;
  before = carry;
}

// Scan chunk `chunk` from `base`: visit(i, value(i), base + value(0..i of the chunk)) for every
// element i < n of it. Each warp first sums its span; the second walk carries the running total.
template <typename Value, typename Visit>
__device__ void chunk_scan(long long chunk, long long n, long long base, Value value, Visit visit) {
  const int lane = threadIdx.x & 31;
  const long long start = chunk * SCAN_CHUNK + (long long)(threadIdx.x >> 5) * SCAN_WARP_SPAN + lane;
  long long own = 0;
#pragma unroll 4
  for (int k = 0; k < SCAN_ITEMS; ++k) {
    const long long i = start + 32 * k;
    if (i < n) own += value(i);
  }
  // The warp's span total lands in lane 31 of an inclusive scan over lanes; the block scan of
  // those totals (lane 31's value, zero elsewhere) gives each warp its base.
  const long long span = __shfl_sync(0xffffffffu, warp_inclusive_sum(own), 31);
  long long unused;
  long long carry = base + block_inclusive_sum(lane == 31 ? span : 0, unused) - (lane == 31 ? span : 0);
  carry = __shfl_sync(0xffffffffu, carry, 31);
  for (int k = 0; k < SCAN_ITEMS; ++k) {
    const long long i = start + 32 * k;
    const long long v = i < n ? value(i) : 0;
    const long long end = carry + warp_inclusive_sum(v);
    if (i < n) visit(i, v, end);
    carry = __shfl_sync(0xffffffffu, end, 31);
  }
}

}  // namespace twell
