// A TwELL row as the warp-per-row kernels read it (cuda/twell_stationary.cu, cuda/twell_gather.cu).
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

}  // namespace twell
