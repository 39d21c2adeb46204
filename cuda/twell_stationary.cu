// Weight-stationary SpMM: out = A @ B for a sparse A (M x N, CSR) and a dense B (N x K), in the
// 2-byte value types, with fp32 accumulation.
//
// Why a second SpMM beside the row gathers of twell_gather.cu: those read one whole B row from
// L2 for every stored entry of A, so the down projection of the 2B-class FFN (N = 5632,
// K = 2048) moves 1.9 GB through L2 at 0.5% density to use a 23 MB matrix. Here each block
// keeps a slice of 16 columns of all of B in shared memory (N x 32 bytes; 180 KB for N = 5632)
// and streams A's entries past it: B leaves L2 once in total, A's compact entries (6 bytes
// each) once per slice, and the random row reads land in shared memory.
//
// Work split: block (slice, row part). 32 warps; a warp owns a contiguous run of the part's
// rows, and its 8 groups of 4 lanes take rows g, g + 8, g + 16, ... of that run (static, so
// the next row's bounds can be read one row ahead). In a group, lane q accumulates output
// columns 4q .. 4q + 3 of the slice. The group reads four entries at a time (one per lane, the
// next four already in flight), hands each entry (column << 16 | value bits) to its four
// lanes with one shuffle, and each lane loads its 8 bytes of that B row from shared memory.
// Lanes past a row's last entry do nothing, so an Inf or NaN in an unused B row cannot leak.
#include "twell_types.cuh"

namespace twell {

constexpr int STATIONARY_COLS = 16;   // output columns per slice: 32 bytes of each B row
constexpr int STATIONARY_WARPS = 32;  // one block of 1024 threads per SM (the slice fills it)

__device__ __forceinline__ void unpack2(unsigned w, bf16, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack2(unsigned w, f16, float& lo, float& hi) {
  lo = to_acc(f16{(unsigned short)(w & 0xffffu)});
  hi = to_acc(f16{(unsigned short)(w >> 16)});
}

template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
  return (unsigned)from_acc<T>(lo).bits | ((unsigned)from_acc<T>(hi).bits << 16);
}

// Entry p of A as one word (column << 16 | value bits), or 0 past the row's end (never read).
template <typename T>
__device__ __forceinline__ unsigned entry_word(const int* __restrict__ cols, const T* __restrict__ vals,
                                               int p, int end) {
  if (p >= end) return 0u;
  return ((unsigned)__ldg(cols + p) << 16) | (unsigned)vals[p].bits;
}

}  // namespace twell

template <typename T>
__global__ void __launch_bounds__(twell::STATIONARY_WARPS * 32, 1) twell_stationary_spmm(
    const int* __restrict__ indptr, const int* __restrict__ cols, const T* __restrict__ vals, int M,
    int N, const T* __restrict__ b, long long ldb, int K, T* __restrict__ out, long long ldo,
    int rows_per_part) {
  using namespace twell;
  extern __shared__ uint4 slice[];  // B[:, c0 : c0 + 16]: row j at slice[2j], slice[2j + 1]
  const int c0 = blockIdx.x * STATIONARY_COLS;
  for (int i = threadIdx.x; i < 2 * N; i += blockDim.x) {
    const int col = c0 + 8 * (i & 1);  // K is a multiple of 8: a half is all in or all out
    slice[i] = col < K ? __ldg(reinterpret_cast<const uint4*>(b + (i >> 1) * ldb + col))
                       : make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane & 3;
  const int part_lo = blockIdx.y * rows_per_part;
  const int part_hi = min(M, part_lo + rows_per_part);
  const int per_warp = (part_hi - part_lo + STATIONARY_WARPS - 1) / STATIONARY_WARPS;
  const int run_lo = part_lo + warp * per_warp, run_hi = min(part_hi, run_lo + per_warp);
  const bool writes = c0 + 4 * q < K;
  const char* lane_slice = reinterpret_cast<const char*>(slice) + 8 * q;

  int row = run_lo + (lane >> 2);
  int p = 0, end = 0;
  if (row < run_hi) {
    p = indptr[row];
    end = indptr[row + 1];
  }
  int next_p = 0, next_end = 0;  // the group's next row, read one row ahead
  if (row + 8 < run_hi) {
    next_p = indptr[row + 8];
    next_end = indptr[row + 9];
  }
  unsigned word = entry_word(cols, vals, p + q, end);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};

  while (__any_sync(0xffffffffu, row < run_hi)) {
    const int here = end - p;  // entries left in this row (<= 0 once the group is done)
    const bool row_done = here <= 4;
    const int p2 = row_done ? next_p : p + 4;
    const int end2 = row_done ? next_end : end;
    const unsigned word2 = entry_word(cols, vals, p2 + q, end2);  // in flight during the sums
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const unsigned w = __shfl_sync(0xffffffffu, word, (lane & ~3) | s);
      if (s < here) {
        const uint2 bv = *reinterpret_cast<const uint2*>(lane_slice + (w >> 16) * 32);
        const float a = to_acc(T{(unsigned short)(w & 0xffffu)});
        float b0, b1, b2, b3;
        unpack2(bv.x, T{}, b0, b1);
        unpack2(bv.y, T{}, b2, b3);
        acc[0] = fmaf(a, b0, acc[0]);
        acc[1] = fmaf(a, b1, acc[1]);
        acc[2] = fmaf(a, b2, acc[2]);
        acc[3] = fmaf(a, b3, acc[3]);
      }
    }
    if (row_done) {
      if (row < run_hi && writes) {
        uint2 o;
        o.x = pack2<T>(acc[0], acc[1]);
        o.y = pack2<T>(acc[2], acc[3]);
        *reinterpret_cast<uint2*>(out + row * ldo + c0 + 4 * q) = o;
      }
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
      row += 8;
      p = next_p;
      end = next_end;
      next_p = next_end = 0;
      if (row + 8 < run_hi) {
        next_p = indptr[row + 8];
        next_end = indptr[row + 9];
      }
    } else {
      p += 4;
    }
    word = word2;
  }
}
