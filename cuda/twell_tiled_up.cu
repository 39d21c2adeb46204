// Tiled up projection of the gated FFN: u = x[t] . W_up[j] at every stored entry (t, j) of the
// gate, h = g * u, in the gate's layout (what twell_gather_gated_up computes), for 2-byte types.
//
// Why tiles: the row gathers read a whole W_up row from L2 for every entry (4 KB at d = 2048 in
// bf16; 3.7 GB at 1% density on the 2B-class FFN), and are bound by the L2's gather rate. Here a
// block owns a box of T tokens x U units and steps over d in slices of 32 columns, staging
// W_up[its U units, slice] and x[its T tokens, slice] in shared memory (cp.async, two buffers).
// Every entry of the box then reads its unit's 64-byte piece from shared memory, and L2 carries
// (1/T + 1/U) of the dense product's operands instead of 4 KB per entry.
//
// Dot products on the tensor cores (mma.sync m16n8k16): the box's entries are grouped by octet
// of tokens (8 consecutive tokens) into tiles of 16 entries. A tile's 16 W_up pieces are the
// rows of A, the octet's 8 x pieces the columns of B, so D[i][n] = W_up[unit i] . x[token n]
// over the slice and entry i keeps D[i][its token]: 1/8 of the MMA's products are wanted, but
// the MMA is cheap beside the shared-memory reads it saves a warp from issuing. Each slice's two
// MMAs start from zero and the wanted value is moved into one fp32 accumulator per lane and tile
// (a shuffle from the lane holding it), so a tile costs 1 register of sums, not 4.
//
// Fragments: lane 4g + t loads the 16 bytes at columns 8t .. 8t + 7 of its rows g and g + 8 (A)
// and of token g of the octet (B); the first MMA takes columns 8t .. 8t + 3 as its k = 2t, 2t + 1,
// 2t + 8, 2t + 9, the second 8t + 4 .. 8t + 7 (the same permutation of k for A and B).
//
// Bank conflicts: a 16-byte shared load is served a quarter-warp at a time; lanes 0-7 read rows
// g = 0, 1 (64 bytes each), which share a 128-byte bank line when their units agree modulo 2.
// The pack (tiled_up_place) orders each octet's entries so that positions 2i and 2i + 1 hold
// units of both parities while both last (the same greedy as the stationary pack's four slot
// classes, here two).
//
// Rounds: a warp holds at most TILED_MAX_TILES tiles' sums, the block TILED_WARPS times that;
// a box with more tiles is done in several rounds, each streaming d again (exact at any
// density, slower where a dense GEMM would win anyway).
#include "twell_mma.cuh"
#include "twell_scan.cuh"
#include "twell_slot_class.cuh"
#include "twell_types.cuh"

namespace twell {

constexpr int TILED_COLS = 32;        // d columns per slice: 64 bytes of each staged row
constexpr int TILED_WARPS = 16;       // 512 threads, one block per SM (the two buffers fill it)
constexpr int TILED_MAX_TILES = 32;   // tiles per warp and round
constexpr int TILED_OCTET = 8;        // tokens per B fragment
constexpr int TILED_TILE = 16;        // entries per tile (the rows of A)
constexpr int TILED_MAX_UNITS = 1024; // staged-row offsets (4 per unit) are 12-bit fields
constexpr int TILED_PAD = (int)0x80000000;  // destination of a padding entry

// The box of work item `item` (an octet of tokens in one unit part of one token block), in the
// order the pack and the kernel share: item = (block * octets) + octet, block = tb * parts + up.
struct Item {
  int tok0, u_lo, u_hi, octet;
};

__device__ __forceinline__ Item item_box(int item, int tokens, int units, int parts, int N) {
  const int octets = tokens / TILED_OCTET;
  const int octet = item % octets, blk = item / octets;
  const int up = blk % parts, tb = blk / parts;
  Item it;
  it.tok0 = tb * tokens + octet * TILED_OCTET;
  it.u_lo = up * units;
  it.u_hi = min(N, it.u_lo + units);
  it.octet = octet;
  return it;
}

// Visit every stored entry of the gate in an item's box as visit(q, k, code, dest): its class
// q (the local unit's parity), its rank k among the item's entries of that class, its code
// (local unit | token in octet << 12) and where it sits in the gate (slot index, or ~spill
// index). Tiles' slots first (a lane per (token, tile) pair), then each token's spill entries.
// Returns the class totals (class_field 0 and 1).
template <typename Visit>
__device__ __forceinline__ unsigned long long walk_item(const Item& it, const short* __restrict__ indices,
                                                        const int* __restrict__ counts,
                                                        const int* __restrict__ spill_indptr,
                                                        const int* __restrict__ spill_cols, int M, int n_tiles,
                                                        int tile_n, int capacity, Visit visit) {
  const int lane = threadIdx.x & 31;
  unsigned long long base = 0;
  if (it.u_lo >= it.u_hi) return base;
  const int t_lo = it.u_lo / tile_n, span = (it.u_hi - 1) / tile_n - t_lo + 1;
  const int pairs = TILED_OCTET * span;
  for (int p0 = 0; p0 < pairs; p0 += 32) {
    const int p = p0 + lane, j = p / span, t = t_lo + p % span, tok = it.tok0 + j;
    const bool live = p < pairs && tok < M;
    const long long rt = (long long)tok * n_tiles + t;
    const int n = live ? counts[rt] : 0;
    unsigned long long mine = 0;
    for (int s = 0; s < n; ++s) {
      const int col = t * tile_n + indices[rt * capacity + s];
      if (col >= it.u_lo && col < it.u_hi) mine += class_unit((col - it.u_lo) & 1);
    }
    const unsigned long long incl = (unsigned long long)warp_inclusive_sum((long long)mine);
    unsigned long long rank = base + incl - mine;
    for (int s = 0; s < n; ++s) {
      const long long slot = rt * capacity + s;
      const int col = t * tile_n + indices[slot];
      if (col < it.u_lo || col >= it.u_hi) continue;
      const int q = (col - it.u_lo) & 1;
      visit(q, class_field(rank, q), (unsigned)(col - it.u_lo) | ((unsigned)j << 12), (int)slot);
      rank += class_unit(q);
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  for (int j = 0; j < TILED_OCTET && it.tok0 + j < M; ++j) {
    const int s0 = spill_indptr[it.tok0 + j], s1 = spill_indptr[it.tok0 + j + 1];
    for (int i0 = s0; i0 < s1; i0 += 32) {  // a lane per entry
      const int i = i0 + lane;
      const int col = i < s1 ? spill_cols[i] : -1;
      const bool live = col >= it.u_lo && col < it.u_hi;
      const int q = (col - it.u_lo) & 1;
      const int k = ballot_rank(live, q, base);
      if (live) visit(q, k, (unsigned)(col - it.u_lo) | ((unsigned)j << 12), ~i);
    }
  }
  return base;
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (unsigned)a;
}

// 16 bytes global -> shared without a register round trip; zeros when !full.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool full) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
               "r"(full ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace twell

// Pack, launch 1: each item's tile count (its entries rounded up to whole tiles) and its two
// class totals (n0 | n1 << 16); one warp per item.
__global__ void __launch_bounds__(256) tiled_up_count(
    const short* __restrict__ indices, const int* __restrict__ counts, const int* __restrict__ spill_indptr,
    const int* __restrict__ spill_cols, int M, int N, int n_tiles, int tile_n, int capacity, int tokens, int units,
    int parts, int items, int* __restrict__ sizes, unsigned* __restrict__ classes) {
  using namespace twell;
  const int item = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
  if (item >= items) return;
  const Item it = item_box(item, tokens, units, parts, N);
  const unsigned long long totals = walk_item(it, indices, counts, spill_indptr, spill_cols, M, n_tiles, tile_n,
                                              capacity, [](int, int, unsigned, int) {});
  const int n0 = class_field(totals, 0), n1 = class_field(totals, 1);
  if ((threadIdx.x & 31) == 0) {
    sizes[item] = (n0 + n1 + TILED_TILE - 1) / TILED_TILE;
    classes[item] = (unsigned)n0 | ((unsigned)n1 << 16);
  }
}

// Pack, launch 4 (after the scan of the sizes into tile_ptr): each item's entries as tiles of
// codes (local unit | token in octet << 12) and destinations, the parities alternating while
// both last (position 2k + q for entry k of class q, k below the smaller class's count, then the
// larger class's rest in order), padding entries (unit p & 1, destination TILED_PAD) to a whole
// tile, and each tile's octet.
__global__ void __launch_bounds__(256) tiled_up_place(
    const short* __restrict__ indices, const int* __restrict__ counts, const int* __restrict__ spill_indptr,
    const int* __restrict__ spill_cols, int M, int N, int n_tiles, int tile_n, int capacity, int tokens, int units,
    int parts, int items, const int* __restrict__ tile_ptr, const unsigned* __restrict__ classes,
    unsigned short* __restrict__ codes, int* __restrict__ dests, int* __restrict__ octets) {
  using namespace twell;
  const int item = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
  const int lane = threadIdx.x & 31;
  if (item >= items) return;
  const Item it = item_box(item, tokens, units, parts, N);
  const int first = tile_ptr[item], n_tiles_item = tile_ptr[item + 1] - first;
  const long long at = (long long)first * TILED_TILE;
  const int n0 = (int)(classes[item] & 0xffffu), n1 = (int)(classes[item] >> 16);
  const int m = min(n0, n1);
  walk_item(it, indices, counts, spill_indptr, spill_cols, M, n_tiles, tile_n, capacity,
            [&](int q, int k, unsigned code, int dest) {
              const int p = k < m ? 2 * k + q : m + k;
              codes[at + p] = (unsigned short)code;
              dests[at + p] = dest;
            });
  for (int p = n0 + n1 + lane; p < n_tiles_item * TILED_TILE; p += 32) {
    codes[at + p] = (unsigned short)(p & 1);
    dests[at + p] = TILED_PAD;
  }
  for (int i = lane; i < n_tiles_item; i += 32) octets[first + i] = it.octet;
}

// The tiled up projection (see the top of this file). Block b = tb * parts + up owns tokens
// [tb T, tb T + T) and units [up U, up U + U); its tiles are tile_ptr[b * T / 8] ..
// tile_ptr[(b + 1) * T / 8]. Dynamic shared memory: two buffers of (U + T) 64-byte rows (W_up's
// then x's), then TILED_WARPS * TILED_MAX_TILES ints (each warp's tiles' octets). K (d) a
// multiple of 8, x and W_up rows 16-byte aligned (a 16-byte piece is all in or all out), U at
// most TILED_MAX_UNITS, T a multiple of 8. u_data null: u is not kept.
template <typename T>
__global__ void __launch_bounds__(twell::TILED_WARPS * 32, 1) twell_tiled_gated_up(
    const int* __restrict__ tile_ptr, const unsigned short* __restrict__ codes, const int* __restrict__ dests,
    const int* __restrict__ octets, const T* __restrict__ gate, const T* __restrict__ gate_spill, int M, int N,
    int K, const T* __restrict__ x, long long ldx, const T* __restrict__ w_up, long long ldu, int tokens, int units,
    int parts, T* __restrict__ h_data, T* __restrict__ h_spill, T* __restrict__ u_data, T* __restrict__ u_spill) {
  using namespace twell;
  constexpr int MAXT = TILED_MAX_TILES;
  extern __shared__ uint4 staged[];
  const int stage_vecs = (units + tokens) * 4;  // 16-byte pieces per buffer
  int* warp_octets = reinterpret_cast<int*>(staged + 2 * stage_vecs);
  const int blk = blockIdx.x, up = blk % parts, tb = blk / parts;
  const int u_lo = up * units, tok_lo = tb * tokens;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int octets_per_block = tokens / TILED_OCTET;
  const int t_begin = tile_ptr[blk * octets_per_block], t_end = tile_ptr[(blk + 1) * octets_per_block];
  const int n_slices = (K + TILED_COLS - 1) / TILED_COLS;

  // Slice s of W_up's and x's rows into buffer `buf`, zeros past the matrices.
  auto stage = [&](int s, int buf) {
    uint4* dst = staged + buf * stage_vecs;
    const int c = s * TILED_COLS;
    for (int i = threadIdx.x; i < stage_vecs; i += blockDim.x) {
      const int row = i >> 2, col = c + 8 * (i & 3);
      const bool unit_row = row < units;
      const int r = unit_row ? u_lo + row : tok_lo + row - units;
      const bool full = r < (unit_row ? N : M) && col < K;
      const T* src = unit_row ? w_up + (full ? r * ldu + col : 0) : x + (full ? r * ldx + col : 0);
      copy16_async(dst + i, src, full);
    }
    commit_copies();
  };

  for (int r0 = t_begin; r0 < t_end; r0 += TILED_WARPS * MAXT) {
    const int n = min(TILED_WARPS * MAXT, t_end - r0);
    const int lo = r0 + warp * n / TILED_WARPS, cnt = r0 + (warp + 1) * n / TILED_WARPS - lo;
    // meta[i]: tile i's staged-row offsets of this lane's rows g and g + 8 (in 16-byte pieces:
    // 4 per unit, plus t) in bits 0-11 and 16-27, their tokens in the octet in bits 12-14 and
    // 28-30. reload bit i: tile i's octet differs from tile i - 1's (B is loaded again).
    unsigned meta[MAXT];
    float acc[MAXT];
    unsigned reload = 0;
    int prev = -1;
#pragma unroll
    for (int i = 0; i < MAXT; ++i) {
      meta[i] = 0;
      acc[i] = 0.f;
      if (i < cnt) {
        const long long e = (long long)(lo + i) * TILED_TILE;
        const unsigned c0 = codes[e + g], c1 = codes[e + g + 8];
        meta[i] = ((c0 & 0xfffu) * 4 + t) | (((c0 >> 12) & 7u) << 12) | (((c1 & 0xfffu) * 4 + t) << 16) |
                  (((c1 >> 12) & 7u) << 28);
        const int oct = octets[lo + i];
        if (oct != prev) reload |= 1u << i;
        prev = oct;
        if (lane == 0) warp_octets[warp * MAXT + i] = oct;
      }
    }
    stage(0, 0);
    for (int s = 0; s < n_slices; ++s) {
      if (s + 1 < n_slices) {
        stage(s + 1, (s + 1) & 1);
        wait_copies<1>();
      } else {
        wait_copies<0>();
      }
      __syncthreads();
      const uint4* w_rows = staged + (s & 1) * stage_vecs;
      const uint4* x_rows = w_rows + units * 4;
      uint4 b = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int i = 0; i < MAXT; ++i) {
        if (i < cnt) {
          if ((reload >> i) & 1u) b = x_rows[(warp_octets[warp * MAXT + i] * TILED_OCTET + g) * 4 + t];
          const uint4 a0 = w_rows[meta[i] & 0xfffu], a1 = w_rows[(meta[i] >> 16) & 0xfffu];
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          mma_m16n8k16<T>(d, a0.x, a1.x, a0.y, a1.y, b.x, b.y);
          mma_m16n8k16<T>(d, a0.z, a1.z, a0.w, a1.w, b.z, b.w);
          // Row g's value sits in lane 4g + (its token >> 1), register d[its token & 1]; row
          // g + 8's likewise in d[2 + ...]. Lanes t = 0, 2 keep row g, t = 1, 3 row g + 8.
          const float v0 = (meta[i] >> 12) & 1u ? d[1] : d[0];
          const float v1 = (meta[i] >> 28) & 1u ? d[3] : d[2];
          const float r0 = __shfl_sync(0xffffffffu, v0, (lane & ~3) | ((meta[i] >> 13) & 3u));
          const float r1 = __shfl_sync(0xffffffffu, v1, (lane & ~3) | ((meta[i] >> 29) & 3u));
          acc[i] += (t & 1) ? r1 : r0;
        }
      }
      __syncthreads();
    }
    // Lane t = 0 writes row g of each tile, t = 1 row g + 8: u rounded, h = g * u rounded.
#pragma unroll
    for (int i = 0; i < MAXT; ++i) {
      if (i < cnt && t < 2) {
        const int dest = dests[(long long)(lo + i) * TILED_TILE + g + 8 * t];
        if (dest != TILED_PAD) {
          const bool spilled = dest < 0;
          const int at = spilled ? ~dest : dest;
          const T u = from_acc<T>(acc[i]);
          const float gv = to_acc((spilled ? gate_spill : gate)[at]);
          (spilled ? h_spill : h_data)[at] = from_acc<T>(gv * to_acc(u));
          if (u_data != nullptr) (spilled ? u_spill : u_data)[at] = u;
        }
      }
    }
  }
}
