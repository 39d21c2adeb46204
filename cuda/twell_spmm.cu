// Products of a TwELL matrix A (M x N) with dense matrices, fp32 accumulation (fp64 for double).
//
// These are the portable, general-shape kernels: any M, N, K, any strides, any tile_n and
// capacity, spill included. The Hopper fused paths live in their own files.
#include "twell_types.cuh"

using namespace twell;

// out[row, :] = sum over the row's entries (j, v) of v * b[j, :]. Block (blockDim.x threads)
// per (row, chunk of blockDim.x * VPT columns); each thread owns VPT strided columns so the
// reads of each weight row are coalesced. Entry lists are read once per block (L1 broadcast).
template <typename T, int VPT>
__global__ void __launch_bounds__(128) twell_spmm(
    const T* __restrict__ data, const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ spill_vals, int n_tiles, int tile_n, int capacity,
    const T* __restrict__ b, long long ldb, int K, T* __restrict__ out, long long ldo) {
  using A = typename acc_of<T>::type;
  const long long row = blockIdx.x;
  const int k0 = blockIdx.y * blockDim.x * VPT + threadIdx.x;
  A acc[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) acc[j] = A(0);
  const long long rt0 = row * n_tiles;
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int cnt = counts[rt0 + tile];
    const long long base = (rt0 + tile) * capacity;
    for (int s = 0; s < cnt; ++s) {
      const A v = to_acc(data[base + s]);
      const T* brow = b + (long long)(tile * tile_n + indices[base + s]) * ldb;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int k = k0 + j * blockDim.x;
        if (k < K) acc[j] += v * to_acc(brow[k]);
      }
    }
  }
  for (int i = spill_indptr[row]; i < spill_indptr[row + 1]; ++i) {
    const A v = to_acc(spill_vals[i]);
    const T* brow = b + (long long)spill_cols[i] * ldb;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int k = k0 + j * blockDim.x;
      if (k < K) acc[j] += v * to_acc(brow[k]);
    }
  }
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int k = k0 + j * blockDim.x;
    if (k < K) out[row * ldo + k] = from_acc<T>(acc[j]);
  }
}

// ws[j, :] += v * g[row, :] for every entry (j, v) of the row: A.T @ g by scattering rows of
// g into a zero-filled accumulator workspace (N x K, acc type) with atomics. Summation order
// varies between runs at rounding level; twell_cast_from_acc then writes the result.
template <typename T, int VPT>
__global__ void __launch_bounds__(128) twell_spmm_t(
    const T* __restrict__ data, const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ spill_vals, int n_tiles, int tile_n, int capacity,
    const T* __restrict__ g, long long ldg, int K, typename acc_of<T>::type* __restrict__ ws) {
  using A = typename acc_of<T>::type;
  const long long row = blockIdx.x;
  const int k0 = blockIdx.y * blockDim.x * VPT + threadIdx.x;
  A gv[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int k = k0 + j * blockDim.x;
    gv[j] = k < K ? to_acc(g[row * ldg + k]) : A(0);
  }
  const long long rt0 = row * n_tiles;
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int cnt = counts[rt0 + tile];
    const long long base = (rt0 + tile) * capacity;
    for (int s = 0; s < cnt; ++s) {
      const A v = to_acc(data[base + s]);
      A* wrow = ws + (long long)(tile * tile_n + indices[base + s]) * K;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int k = k0 + j * blockDim.x;
        if (k < K) atomicAdd(wrow + k, v * gv[j]);
      }
    }
  }
  for (int i = spill_indptr[row]; i < spill_indptr[row + 1]; ++i) {
    const A v = to_acc(spill_vals[i]);
    A* wrow = ws + (long long)spill_cols[i] * K;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int k = k0 + j * blockDim.x;
      if (k < K) atomicAdd(wrow + k, v * gv[j]);
    }
  }
}

// out[r, c] = ws[r * K + c] rounded to T (out may be strided).
template <typename T>
__global__ void __launch_bounds__(256) twell_cast_from_acc(
    const typename acc_of<T>::type* __restrict__ ws, long long rows, int K, T* __restrict__ out,
    long long ldo) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= rows * K) return;
  out[(i / K) * ldo + i % K] = from_acc<T>(ws[i]);
}
