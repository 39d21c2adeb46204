// A TwELL row as the warp-per-row kernels read it (cuda/twell_stationary.cu, cuda/twell_gather.cu),
// and the runs a long row of A.T is cut into for the transposed products (cuda/twell_convert.cu,
// cuda/twell_gather.cu).
#pragma once

namespace twell {

// Row `row`'s stored entries: its row-tiles' counts (each lane summing every 32nd tile) plus its
// spill entries. The whole warp calls it; every lane gets the total.
__device__ __forceinline__ int row_entries(const int* __restrict__ counts, const int* __restrict__ spill_indptr,
                                           long long row, int n_tiles, int lane) {
  int n = 0;
  for (int t = lane; t < n_tiles; t += 32) n += counts[row * n_tiles + t];
  return (int)__reduce_add_sync(0xffffffffu, (unsigned)n) + spill_indptr[row + 1] - spill_indptr[row];
}

// The runs of `segment` entries a row of `length` entries is cut into when it is longer than one
// run (twell_segment_plan), else 0: the row stays whole.
__device__ __forceinline__ int segments_of(int length, int segment) {
  return length > segment ? (length + segment - 1) / segment : 0;
}

// The run lengths twell_segment_plan chooses from, shortest first: `shortest` times 1, 1.25,
// 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, ... 14 (k = 0 ... RUN_CANDIDATES - 1; the oracle,
// twellsparse._reference.run_length_candidates, lists the same).
constexpr int RUN_CANDIDATES = 16;
__device__ __forceinline__ int run_length_candidate(int shortest, int k) {
  return (int)min((((long long)(4 + (k & 3)) * shortest) << (k >> 2)) / 4, 2147483647LL);
}

}  // namespace twell
