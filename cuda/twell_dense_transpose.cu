// A dense matrix's transpose into a new row-major array: b (cols x rows) = a (rows x cols)^T.
//
// Why our own: the kernels read the down projection's weight one row per hidden unit, i.e.
// W_down^T, while torch keeps W_down (d_model x d_ff); torch's strided copy of the transposed
// 2-byte tensor ran at ~0.6 TB/s on an H200 (76 us for the 2B model's 23 MB W_down, three times
// a training step; bench/NOTES.md, thirty-first session). This is the classic shared-memory
// transpose: a block reads a 32 x 32 tile with coalesced rows of a and writes it with coalesced
// rows of b. Each tile row is padded so that a warp's column reads fall on distinct banks:
// 2-byte values by two elements (a 17-word pitch: lanes 2k and 2k + 1 share word 17k, the
// 16 words on 16 banks; one element, a 66-byte pitch, left lanes 0 and 31 of odd columns on one
// bank), 4 and 8 bytes by one (the usual 33-word pitch; 8 bytes take two wavefronts anyway).
// Bits are copied unchanged.
#include "twell_types.cuh"

namespace twell {
constexpr int TRANSPOSE_TILE = 32;
constexpr int TRANSPOSE_ROWS = 8;  // thread rows per block: each thread moves 4 values each way
}  // namespace twell

// a: rows x cols with row stride lda (unit column stride); b: cols x rows with row stride ldb.
// Grid: x over the tile columns, y over the tile rows (grid-stride in y past 65535 tiles).
template <typename T>
__global__ void __launch_bounds__(twell::TRANSPOSE_TILE * twell::TRANSPOSE_ROWS) dense_transpose(
    const T* __restrict__ a, long long lda, long long rows, long long cols, T* __restrict__ b, long long ldb) {
  using namespace twell;
  __shared__ T tile[TRANSPOSE_TILE][TRANSPOSE_TILE + (sizeof(T) == 2 ? 2 : 1)];
  const long long c0 = (long long)blockIdx.x * TRANSPOSE_TILE;
  const long long row_tiles = (rows + TRANSPOSE_TILE - 1) / TRANSPOSE_TILE;
  for (long long tr = blockIdx.y; tr < row_tiles; tr += gridDim.y) {
    const long long r0 = tr * TRANSPOSE_TILE;
    for (int i = threadIdx.y; i < TRANSPOSE_TILE; i += TRANSPOSE_ROWS) {
      const long long r = r0 + i, c = c0 + threadIdx.x;
      if (r < rows && c < cols) tile[i][threadIdx.x] = a[r * lda + c];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < TRANSPOSE_TILE; i += TRANSPOSE_ROWS) {
      const long long c = c0 + i, r = r0 + threadIdx.x;  // b's row c, column r
      if (c < cols && r < rows) b[c * ldb + r] = tile[threadIdx.x][i];
    }
    __syncthreads();  // the tile is refilled by the next row tile
  }
}
