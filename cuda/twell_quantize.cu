// Weight rows to fp8 e4m3 codes with one fp32 scale per row (twellsparse.quantize_rows), for
// the row-gather SpMM that reads them (twell_gather_spmm_e4m3): scale = max |row| / 448 (1 for a
// row of zeros), code = e4m3(x / scale) rounded to nearest even, every step in fp32 as the NumPy
// reference does it, so both give the same bits.
#include "twell_fp8.cuh"
#include "twell_types.cuh"

using namespace twell;

// One warp per row of b (N x K, row stride ldb); codes to q (row stride ldq), scales to scales.
template <typename T>
__global__ void __launch_bounds__(256) twell_quantize_rows_e4m3(const T* __restrict__ b, long long ldb, int N,
                                                               int K, unsigned char* __restrict__ q, long long ldq,
                                                               float* __restrict__ scales) {
  const long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= N) return;  // warp-uniform
  const T* src = b + row * ldb;
  float amax = 0.f;
  for (int k = lane; k < K; k += 32) amax = fmaxf(amax, fabsf((float)to_acc(src[k])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = amax > 0.f ? amax / kE4M3Max : 1.f;
  unsigned char* dst = q + row * ldq;
  for (int k = lane; k < K; k += 32) dst[k] = (unsigned char)e4m3_from_float((float)to_acc(src[k]) / scale);
  if (lane == 0) scales[row] = scale;
}
