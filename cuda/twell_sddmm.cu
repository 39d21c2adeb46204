// Sampled dense-dense products at a TwELL pattern: out = (x @ y.T) at the stored entries,
// optionally times the pattern's own values (SCALE, the gated FFN's gate * up product).
#include "twell_types.cuh"

using namespace twell;

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ __forceinline__ typename acc_of<T>::type row_dot(const T* __restrict__ a,
                                                            const T* __restrict__ b, int K,
                                                            int lane) {
  using A = typename acc_of<T>::type;
  A s = A(0);
  for (int k = lane; k < K; k += 32) s += to_acc(a[k]) * to_acc(b[k]);
  return warp_sum(s);
}

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

// One warp per spill entry.
template <typename T, bool SCALE>
__global__ void __launch_bounds__(256) twell_sddmm_spill(
    const T* __restrict__ x, long long ldx, const T* __restrict__ y, long long ldy, int K,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ pattern, int M, T* __restrict__ out) {
  const long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (i >= spill_indptr[M]) return;  // warp-uniform
  int lo = 0, hi = M;  // row = largest r with spill_indptr[r] <= i
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (spill_indptr[mid] <= i) lo = mid; else hi = mid - 1;
  }
  auto d = row_dot(x + lo * ldx, y + (long long)spill_cols[i] * ldy, K, lane);
  if (SCALE) d *= to_acc(pattern[i]);
  if (lane == 0) out[i] = from_acc<T>(d);
}
