// Sampled dense-dense products at a TwELL pattern, portable kernels (every type, any row
// alignment): out = (x @ y.T) at the stored entries, optionally times the pattern's own values.
// The row-gather (twell_gather.cu) and tiled (twell_tiled_sddmm.cu) kernels are the fast paths;
// the spill kernel here serves every path's spill part and every mode of twell_sddmm.cuh.
#include "twell_sddmm.cuh"

using namespace twell;

// One warp per row-tile: each stored slot gets a warp-wide dot product; unused slots get 0.
template <typename T, bool SCALE>
__global__ void __launch_bounds__(256) twell_sddmm_slots(
    const T* __restrict__ x, long long ldx, const T* __restrict__ y, long long ldy, int K,
    const T* __restrict__ pattern, const short* __restrict__ indices,
    const int* __restrict__ counts, int M, int n_tiles, int tile_n, int capacity,
    T* __restrict__ out) {
  const long long rt = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (rt >= (long long)M * n_tiles) return;  // warp-uniform
  const long long row = rt / n_tiles;
  const int tile = (int)(rt % n_tiles);
  const int cnt = counts[rt];
  const long long base = rt * capacity;
  for (int s = 0; s < cnt; ++s) {
    const long long col = (long long)tile * tile_n + indices[base + s];
    auto d = row_dot(x + row * ldx, y + col * ldy, K, lane);
    if (SCALE) d *= to_acc(pattern[base + s]);
    if (lane == 0) out[base + s] = from_acc<T>(d);
  }
  for (int s = cnt + lane; s < capacity; s += 32) out[base + s] = zero_value<T>();
}

// One warp per spill entry, any mode (the operands index the spill part).
template <typename T, int MODE>
__global__ void __launch_bounds__(256) twell_sddmm_spill(
    const T* __restrict__ x, long long ldx, const T* __restrict__ y, long long ldy, int K,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols, int M, const T* g,
    const T* aux, T* o0, T* o1, T* o2) {
  const long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (i >= spill_indptr[M]) return;  // warp-uniform
  int lo = 0, hi = M;  // row = largest r with spill_indptr[r] <= i
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (spill_indptr[mid] <= i) lo = mid; else hi = mid - 1;
  }
  const auto d = row_dot(x + lo * ldx, y + (long long)spill_cols[i] * ldy, K, lane);
  if (lane == 0) emit<T, MODE>(d, i, SddmmOperands<T>{g, aux, o0, o1, o2});
}
