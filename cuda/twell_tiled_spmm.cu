// Tiled SpMM on the tensor cores: out = A @ B (or A @ B + A2 @ B2, A2 of A's structure) for a
// TwELL A (M x K) and row-major 2-byte B (K x N), fp32 sums, for the down projection and the
// backward's dX.
//
// Why: the row gathers read one row of B from L2 per stored entry, and the weight-stationary
// kernel does ~30 instructions per entry and 16 columns on the CUDA cores. Here a block owns 512
// output rows x 64 columns, keeps their fp32 sums in registers (64 per thread), and streams B's
// rows through shared memory in chunks of 512 (64 KB stages, TMA with the 128-byte swizzle, a
// ring of TSPMM_STAGES): L2 carries B once per 512 rows, and the products run on the tensor cores.
//
// The sparse operand is packed (tiled_spmm_place) per (group of 8 output rows, chunk) into
// k-groups of 16 words, value bits << 16 | row in group << 9 | B row in chunk. One m16n8k16 MMA
// is a transposed tile of the product: M = 16 output columns, N = the group's 8 rows, K = the
// k-group's 16 entries. A[m][k] = B[row of entry k][m] comes from ldmatrix.trans: each of the
// four 8 x 8 matrices is 8 entries' B rows (one 16-byte piece of each, a lane giving one entry's
// address), so the gather of arbitrary rows costs nothing extra. B[k][n] (the MMA's) is the
// one-hot operand: entry k's value where its row in group is n, else zero, built in registers
// from the words (a lane needs entries 2t, 2t + 1, 2t + 8, 2t + 9 for its column g).
//
// Bank conflicts: an 8 x 8 matrix reads the same 16-byte column piece of 8 rows; with the
// 128-byte swizzle the piece's bank group is (piece ^ row % 8), so 8 rows of distinct row
// classes (row % 8) are conflict-free. The pack deals each item's entries round-robin over the
// classes.
//
// Non-finite values: an entry's B row enters the MMA for all 8 rows of its group (times zero
// for the 7 others), so an Inf or NaN in a B row that some entry uses reaches the other rows of
// that entry's group as NaN. Rows of B that no entry uses are never read (padding words repeat
// a real entry of their item with value zero).
#include "twell_mma.cuh"
#include "twell_tiled.cuh"
#include "twell_tma.cuh"
#include "twell_types.cuh"

namespace twell {

// Visit the stored entries of A in item (group, chunk) as visit(row in group, B row in chunk,
// value bits): rows in order, each row's slots then its spill entries (columns rise).
// Chunks n1 .. 2 n1 - 1 are A2's (the same entries, values from data2 / spill2).
struct TiledSpmmA {
  const unsigned short* data;
  const unsigned short* data2;
  const short* indices;
  const int* counts;
  const int* spill_indptr;
  const int* spill_cols;
  const unsigned short* spill_data;
  const unsigned short* spill_data2;
  int M, K, n_tiles, tile_n, capacity, n1;
};

template <typename Visit>
__device__ __forceinline__ void tspmm_walk(const TiledSpmmA& a, long long item, int n_chunks, Visit visit) {
  const int grp = (int)(item / n_chunks), chunk = (int)(item % n_chunks);
  const bool second = chunk >= a.n1;
  const unsigned short* data = second ? a.data2 : a.data;
  const unsigned short* spill = second ? a.spill_data2 : a.spill_data;
  const int c0 = (second ? chunk - a.n1 : chunk) * TSPMM_CHUNK, c1 = min(a.K, c0 + TSPMM_CHUNK);
  const int t_lo = c0 / a.tile_n, t_hi = (c1 - 1) / a.tile_n;
  for (int r = 0; r < TSPMM_GROUP; ++r) {
    const int row = grp * TSPMM_GROUP + r;
    if (row >= a.M) break;
    for (int t = t_lo; t <= t_hi; ++t) {
      const long long rt = (long long)row * a.n_tiles + t;
      const int n = a.counts[rt];
      for (int s = 0; s < n; ++s) {
        const long long slot = rt * a.capacity + s;
        const int col = t * a.tile_n + a.indices[slot];
        if (col >= c0 && col < c1) visit(r, col - c0, data[slot]);
      }
    }
    for (int i = a.spill_indptr[row], end = a.spill_indptr[row + 1]; i < end; ++i) {
      const int col = a.spill_cols[i];
      if (col >= c1) break;
      if (col >= c0) visit(r, col - c0, spill[i]);
    }
  }
}

// The one-hot operand's register for column g: the value halves of words w0 (low half) and w1
// (high half) where their row in group is g, zeros elsewhere.
__device__ __forceinline__ unsigned tspmm_one_hot(unsigned w0, unsigned w1, unsigned g) {
  const unsigned lo = ((w0 >> 9) & 7u) == g ? (w0 >> 16) : 0u;
  const unsigned hi = ((w1 >> 9) & 7u) == g ? (w1 & 0xffff0000u) : 0u;
  return lo | hi;
}

}  // namespace twell

// Pack, launch 1: each item's k-group count (its entries rounded up to 16); a thread per item
// (group, chunk), items = groups * n_chunks.
__global__ void __launch_bounds__(256) tiled_spmm_count(
    const unsigned short* __restrict__ data, const unsigned short* __restrict__ data2, const short* __restrict__ indices,
    const int* __restrict__ counts, const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const unsigned short* __restrict__ spill_data, const unsigned short* __restrict__ spill_data2, int M, int K,
    int n_tiles, int tile_n, int capacity, int n1, int n_chunks, long long items,
                                                        int* __restrict__ sizes) {
  using namespace twell;
  const long long item = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (item >= items) return;
  const TiledSpmmA a{data, data2, indices, counts, spill_indptr, spill_cols, spill_data, spill_data2, M, K, n_tiles, tile_n, capacity, n1};
  int n = 0;
  tspmm_walk(a, item, n_chunks, [&](int, int, unsigned short) { ++n; });
  sizes[item] = (n + TSPMM_KGROUP - 1) / TSPMM_KGROUP;
}

// Pack, launch 4 (after the scan of the sizes into kg_ptr): each item's words, dealt over the
// 8 row classes of the swizzle: entry k of class q goes to position sum_q' min(n_q', k) +
// #{q' < q : n_q' > k} (round k holds the k-th entry of every class that has one), then padding
// words to the k-group's end (the item's first word with value zero: a B row an entry of the
// item reads anyway).
__global__ void __launch_bounds__(256) tiled_spmm_place(
    const unsigned short* __restrict__ data, const unsigned short* __restrict__ data2, const short* __restrict__ indices,
    const int* __restrict__ counts, const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const unsigned short* __restrict__ spill_data, const unsigned short* __restrict__ spill_data2, int M, int K,
    int n_tiles, int tile_n, int capacity, int n1, int n_chunks, long long items,
                                                        const int* __restrict__ kg_ptr,
                                                        unsigned* __restrict__ words) {
  using namespace twell;
  const long long item = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (item >= items) return;
  const TiledSpmmA a{data, data2, indices, counts, spill_indptr, spill_cols, spill_data, spill_data2, M, K, n_tiles, tile_n, capacity, n1};
  int total[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  tspmm_walk(a, item, n_chunks, [&](int, int b_row, unsigned short) { ++total[b_row & 7]; });
  int seen[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  unsigned* out = words + (long long)kg_ptr[item] * TSPMM_KGROUP;
  unsigned first = 0;
  tspmm_walk(a, item, n_chunks, [&](int r, int b_row, unsigned short v) {
    const int q = b_row & 7, k = seen[q]++;
    int p = 0;
#pragma unroll
    for (int c = 0; c < 8; ++c) p += min(total[c], k) + (c < q && total[c] > k ? 1 : 0);
    const unsigned w = tspmm_word(v, r, b_row);
    out[p] = w;
    if (p == 0) first = w;
  });
  const int n = (kg_ptr[item + 1] - kg_ptr[item]) * TSPMM_KGROUP;
  int stored = 0;
#pragma unroll
  for (int c = 0; c < 8; ++c) stored += total[c];
  for (int p = stored; p < n; ++p) out[p] = first & 0xffffu;
}

// The product (see the top of this file). Block (x, y): output columns [64 x, 64 x + 64) and
// rows [512 y, 512 y + 512); warp w sums row groups 4 w .. 4 w + 3 of the block. Item (group,
// chunk)'s k-groups are kg_ptr[item] .. kg_ptr[item + 1]; chunks below n1 read map_b, the rest
// map_b2 (B2 for A2's values; map_b again when there is none). map_b / map_b2: TMA descriptors
// of B [K, N] (boxes of 64 columns x 256 rows, 128-byte swizzle; rows past K read as zeros).
// Thread 0 refills a stage once every warp has released it.
template <typename T>
__global__ void __launch_bounds__(twell::TSPMM_WARPS * 32, 1) twell_tiled_spmm(
    const __grid_constant__ twell::TensorMap map_b, const __grid_constant__ twell::TensorMap map_b2,
    const int* __restrict__ kg_ptr, const unsigned* __restrict__ words, int M, int N, int n1, int n_chunks,
    T* __restrict__ out, long long ldo) {
  using namespace twell;
  extern __shared__ __align__(1024) unsigned char raw[];
  const unsigned base = (smem_u32(raw) + 1023u) & ~1023u;
  const unsigned full = base + TSPMM_STAGES * TSPMM_STAGE_BYTES, empty = full + 8 * TSPMM_STAGES;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned g = lane >> 2, t = lane & 3;
  const int col0 = blockIdx.x * TSPMM_COLS, row0 = blockIdx.y * TSPMM_ROWS;
  const int n_groups = (M + TSPMM_GROUP - 1) / TSPMM_GROUP;
  if (threadIdx.x == 0) {
    for (int s = 0; s < TSPMM_STAGES; ++s) {
      barrier_init(full + 8 * s, 1);             // the refilling thread's expect_tx arrival
      barrier_init(empty + 8 * s, TSPMM_WARPS);  // one arrival per warp done with the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  auto stage = [&](int c) {
    const int s = c % TSPMM_STAGES;
    const unsigned bar = full + 8 * s, dst = base + s * TSPMM_STAGE_BYTES;
    const TensorMap* map = c < n1 ? &map_b : &map_b2;
    const int k0 = (c < n1 ? c : c - n1) * TSPMM_CHUNK;
    barrier_expect_bytes(bar, TSPMM_STAGE_BYTES);
    tma_load_2d(dst, map, col0, k0, bar);
    tma_load_2d(dst + TSPMM_BOX * 128, map, col0, k0 + TSPMM_BOX, bar);
  };
  if (threadIdx.x == 0)
    for (int c = 0; c < TSPMM_STAGES && c < n_chunks; ++c) stage(c);

  float acc[TSPMM_WARP_GROUPS][TSPMM_COL_STEPS][4];
#pragma unroll
  for (int i = 0; i < TSPMM_WARP_GROUPS; ++i)
#pragma unroll
    for (int j = 0; j < TSPMM_COL_STEPS; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

  // This lane's ldmatrix row: entry (lane / 16) * 8 + lane % 8 of a k-group, its 16-byte piece
  // (lane / 8) % 2 of each 16 columns (matrices 0-3: entries 0-7 and 8-15, columns 0-7 and 8-15,
  // which .trans turns into a0 .. a3 of A = B^T).
  const int entry = (lane >> 4) * 8 + (lane & 7), piece = (lane >> 3) & 1;
  const int group0 = (row0 >> 3) + warp * TSPMM_WARP_GROUPS;
  for (int c = 0; c < n_chunks; ++c) {
    const int s = c % TSPMM_STAGES;
    const unsigned parity = (unsigned)(c / TSPMM_STAGES) & 1u;
    barrier_wait(full + 8 * s, parity);
    const unsigned stage_base = base + s * TSPMM_STAGE_BYTES;
#pragma unroll
    for (int i = 0; i < TSPMM_WARP_GROUPS; ++i) {
      const int grp = group0 + i;
      if (grp < n_groups) {
        const long long item = (long long)grp * n_chunks + c;
        const int k_lo = kg_ptr[item], k_hi = kg_ptr[item + 1];
        for (int kg = k_lo; kg < k_hi; ++kg) {
          const unsigned* w = words + (long long)kg * TSPMM_KGROUP;
          const uint2 lo = __ldg(reinterpret_cast<const uint2*>(w + 2 * t));
          const uint2 hi = __ldg(reinterpret_cast<const uint2*>(w + 2 * t + 8));
          const unsigned mine = __ldg(w + entry);
          const unsigned b0 = tspmm_one_hot(lo.x, lo.y, g), b1 = tspmm_one_hot(hi.x, hi.y, g);
          const unsigned b_row = mine & 511u;
          const unsigned row_base = stage_base + b_row * 128u, swz = b_row & 7u;
#pragma unroll
          for (int j = 0; j < TSPMM_COL_STEPS; ++j) {
            unsigned a[4];
            ldmatrix_x4_trans(a, row_base + ((((unsigned)(2 * j + piece)) ^ swz) << 4));
            mma_m16n8k16<T>(acc[i][j], a[0], a[1], a[2], a[3], b0, b1);
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) barrier_arrive(empty + 8 * s);
    if (threadIdx.x == 0 && c + TSPMM_STAGES < n_chunks) {
      barrier_wait(empty + 8 * s, parity);
      stage(c + TSPMM_STAGES);
    }
  }

  // D[m][n] is output column 16 j + m of row n of the group: this lane holds rows 2t, 2t + 1 at
  // columns g (d0, d1) and g + 8 (d2, d3). Lanes g and g ^ 1 swap one value so that each holds
  // two adjacent columns of one row (even g: row 2t, odd g: row 2t + 1) and stores them as one
  // 4-byte pair.
  const bool odd = (g & 1u) != 0;
#pragma unroll
  for (int i = 0; i < TSPMM_WARP_GROUPS; ++i) {
    const int row = (group0 + i) * TSPMM_GROUP + 2 * (int)t + (odd ? 1 : 0);
#pragma unroll
    for (int j = 0; j < TSPMM_COL_STEPS; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* d = acc[i][j] + 2 * h;
        const float got = __shfl_xor_sync(0xffffffffu, odd ? d[0] : d[1], 4);
        const float v0 = odd ? got : d[0], v1 = odd ? d[1] : got;
        const int col = col0 + 16 * j + 8 * h + (int)(g & ~1u);
        if (row < M && col < N) {
          T* p = out + (long long)row * ldo + col;
          if (col + 1 < N) {
            const unsigned short lo = from_acc<T>(v0).bits, hi = from_acc<T>(v1).bits;
            *reinterpret_cast<unsigned*>(p) = (unsigned)lo | ((unsigned)hi << 16);
          } else {
            p[0] = from_acc<T>(v0);
          }
        }
      }
    }
  }
}
