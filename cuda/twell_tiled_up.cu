// Tiled up projection of the gated FFN: u = x[t] . W_up[j] at every stored entry (t, j) of the
// gate, h = g * u, in the gate's layout (what twell_gather_gated_up computes), for 2-byte types.
// The same kernel serves the gated backward's sampled product d_h = dy[t] . W_down[:, j] at the
// gate's entries (BACKWARD = 1; what twell_gather_sddmm_gated_bwd computes): the same shapes, with
// dy for x and W_down's transpose for W_up.
//
// Why tiles: the row gathers read a whole W_up row from L2 for every entry (4 KB at d = 2048 in
// bf16; 3.7 GB at 1% density on the 2B-class FFN), and are bound by the L2's gather rate. Here a
// block owns a box of T tokens x U units and steps over d in slices of 32 columns, staging
// W_up[its U units, slice] and x[its T tokens, slice] in shared memory (TMA boxes into two
// buffers: one slice summed while the next loads; per-thread cp.async copies took half of the
// kernel's instructions).
// Every entry of the box then reads its unit's 64-byte piece from shared memory, and L2 carries
// (1/T + 1/U) of the dense product's operands instead of 4 KB per entry.
//
// Dot products on the tensor cores (mma.sync m16n8k16): the box's entries are grouped by quad
// of tokens (4 consecutive tokens) into tiles of 8 entries. Entry g of a tile is both row g and
// row g + 8 of A, each with half of the slice's 32 columns, and B's columns 2j and 2j + 1 hold
// the matching halves of token j's x, so D[g][2j] + D[g + 8][2j + 1] = W_up[unit g] . x[token j]
// over the slice. Lane 4g + t holds exactly D[g][2t] and D[g + 8][2t + 1] (its d0 and d3): every
// lane keeps the sum of entry g with token t in one fp32 register per tile, without shuffles or
// selects (two adds per tile and slice), and at the end the lane whose t is the entry's token
// writes it. Each entry keeps 2 of the MMA's 16 products per row pair (an 8-fold waste of
// tensor-core work, cheap beside the shared-memory reads CUDA-core dots would issue). Lane 4g + t
// loads the 16 bytes at columns 8t .. 8t + 7 of entry g's row (its A fragment as they stand)
// and 2 x 4 bytes of token g >> 1's x (B: the pairs of the same columns that match row g or row
// g + 8, by g & 1).
//
// Bank conflicts: a 16-byte shared load is served a quarter-warp at a time; lanes 0-7 read the
// rows of entries 0 and 1 (64 bytes each), which share a 128-byte bank line when their units
// agree modulo 2. The pack (tiled_up_place) orders each quad's entries so that positions 2i and
// 2i + 1 hold units of both parities while both last (the same greedy as the stationary pack's
// four slot classes, here two).
//
// Rounds: a warp holds at most TILED_MAX_TILES tiles' sums, the block TILED_WARPS times that;
// a box with more tiles is done in several rounds, each streaming d again (exact at any
// density, slower where a dense GEMM would win anyway).
//
// Pairs (twell_tiled_gated_up_pair, CLUSTER = 2): the blocks of two consecutive unit parts of
// one token block form a cluster and share x's slices, each copying half of x's boxes into both
// CTAs (TMA multicast). At a decoder batch (131072 tokens, 768-token blocks) the single blocks
// stage ~8 GB a layer from L2, W_up once per token block and x once per unit part, half each;
// the pairs send x once per pair. Measured 2-5% slower on an H100, opt-in: the single blocks are
// bound neither by the L2 nor by the copy engine (bench/NOTES.md, forty-fifth session, items 2
// and 3). A buffer is then refilled only once both CTAs have released it (an empty barrier per buffer counting one arrival from
// each CTA), both stream as many rounds as the busier of the two needs, and neither exits
// before the other is done (the peer may still copy into it or arrive on its barriers). The grid
// then has an even count of parts per token block: with an odd `parts` the last is a pad block
// that owns no tiles and only copies its share of x.
#include "twell_mma.cuh"
#include "twell_scan.cuh"
#include "twell_slot_class.cuh"
#include "twell_tma.cuh"
#include "twell_types.cuh"

// A measurement switch (TWELL_TILED_UP_ORDERED_A=1, read by _kernels.compile_options): the A
// fragment passed to the MMA in the order it was loaded, with no register moves. The sums are
// then wrong; the kernel takes the time it would with W_up stored with the middle two words of
// each 16-byte group swapped (the fragment's order), which would give the right sums. Measured
// 0.5-2% faster (H100, forty-fifth session): not worth a copy of W_up in that order per call.
#ifndef TWELL_TILED_UP_ORDERED_A
#define TWELL_TILED_UP_ORDERED_A 0
#endif

namespace twell {

constexpr int TILED_COLS = 32;        // d columns per slice: 64 bytes of each staged row
constexpr int TILED_WARPS = 16;       // 512 threads, one block per SM (the buffers fill it)
constexpr int TILED_MAX_TILES = 32;   // tiles per warp and round (2 registers each)
constexpr int TILED_GROUP = 4;        // tiles summed together (their loads and MMAs interleave)
constexpr int TILED_QUAD = 4;         // tokens per B fragment
constexpr int TILED_TILE = 8;         // entries per tile (each two rows of A)
constexpr int TILED_MAX_UNITS = 1024; // W_up rows per buffer (64 KB: the tiles' 17-bit addresses)
constexpr int TILED_BUFFER_ROWS = 1536;  // staged rows per buffer: W_up's, then x's right after
constexpr int TILED_BUFFER_BYTES = TILED_BUFFER_ROWS * 64;  // 96 KB; two of them
constexpr int TILED_SHARED_BYTES = 2 * TILED_BUFFER_BYTES + 32;  // and four barriers: full and empty per buffer
constexpr int TILED_PAD = (int)0x80000000;  // destination of a padding entry
static_assert(TILED_SHARED_BYTES <= 227 * 1024, "the two buffers fit one block's shared memory");

// The box of work item `item` (a quad of tokens in one unit part of one token block), in the
// order the pack and the kernel share: item = (block * quads) + quad, block = tb * parts + up.
struct Item {
  int tok0, u_lo, u_hi, quad;
};

__device__ __forceinline__ Item item_box(int item, int tokens, int units, int parts, int N) {
  const int quads = tokens / TILED_QUAD;
  const int quad = item % quads, blk = item / quads;
  const int up = blk % parts, tb = blk / parts;
  Item it;
  it.tok0 = tb * tokens + quad * TILED_QUAD;
  it.u_lo = up * units;
  it.u_hi = min(N, it.u_lo + units);
  it.quad = quad;
  return it;
}

// The pack's segments: WIDTH lanes per item (32, or 16 for two items a warp, one on each half;
// at the standard widths an item has at most 16 (token, tile) pairs, so a whole warp left half
// its lanes idle in a kernel bound by its chain of L2 loads). Every lane of the warp runs the
// loops below the same number of times (the larger of its segments' counts), so the shuffles
// and ballots take the full mask; a segment's shuffles stay within it (width WIDTH; the
// helpers are twell_slot_class.cuh's).

// Visit every stored entry of the gate in an item's box as visit(q, k, code, dest): its class
// q (the local unit's parity), its rank k among the item's entries of that class, its code
// (local unit | token in quad << 12) and where it sits in the gate (slot index, or ~spill
// index). Tiles' slots first (a lane per (token, tile) pair), then each token's spill entries.
// Returns the class totals (class_field 0 and 1). The whole warp calls it, each segment of
// WIDTH lanes with its own item.
template <int WIDTH, typename Visit>
__device__ __forceinline__ unsigned long long walk_item(const Item& it, const short* __restrict__ indices,
                                                        const int* __restrict__ counts,
                                                        const int* __restrict__ spill_indptr,
                                                        const int* __restrict__ spill_cols, int M, int n_tiles,
                                                        int tile_n, int capacity, Visit visit) {
  const int sl = threadIdx.x & (WIDTH - 1);
  // The quad's spill row pointers, one load for all five (issued first: they overlap the tiles'
  // loads; one load per token after the tiles kept ~8 round trips to L2 in every item's chain).
  const int spill_at = sl <= TILED_QUAD ? spill_indptr[min(it.tok0 + sl, M)] : 0;
  unsigned long long base = 0;  // every part holds at least one unit (_tiled_up.geometry)
  const int t_lo = it.u_lo / tile_n, span = (it.u_hi - 1) / tile_n - t_lo + 1;
  const int pairs = TILED_QUAD * span;
  const int rounds = (int)__reduce_max_sync(0xffffffffu, (unsigned)((pairs + WIDTH - 1) / WIDTH));
  for (int r = 0; r < rounds; ++r) {
    const int p = r * WIDTH + sl, j = p / span, t = t_lo + p % span, tok = it.tok0 + j;
    const bool live = p < pairs && tok < M;
    const long long rt = (long long)tok * n_tiles + t;
    const int n = live ? counts[rt] : 0;
    unsigned long long mine = 0;
    for (int s = 0; s < n; ++s) {
      const int col = t * tile_n + indices[rt * capacity + s];
      if (col >= it.u_lo && col < it.u_hi) mine += class_unit((col - it.u_lo) & 1);
    }
    const unsigned long long incl = segment_inclusive_sum<WIDTH>(mine);
    unsigned long long rank = base + incl - mine;
    for (int s = 0; s < n; ++s) {
      const long long slot = rt * capacity + s;
      const int col = t * tile_n + indices[slot];
      if (col < it.u_lo || col >= it.u_hi) continue;
      const int q = (col - it.u_lo) & 1;
      visit(q, class_field(rank, q), (unsigned)(col - it.u_lo) | ((unsigned)j << 12), (int)slot);
      rank += class_unit(q);
    }
    base += __shfl_sync(0xffffffffu, incl, WIDTH - 1, WIDTH);
  }
  const int s_first = __shfl_sync(0xffffffffu, spill_at, 0, WIDTH);
  if (__all_sync(0xffffffffu, s_first == __shfl_sync(0xffffffffu, spill_at, TILED_QUAD, WIDTH))) return base;
  for (int j = 0; j < TILED_QUAD; ++j) {  // tokens past M have empty spill rows (clamped above)
    const int s0 = __shfl_sync(0xffffffffu, spill_at, j, WIDTH), s1 = __shfl_sync(0xffffffffu, spill_at, j + 1, WIDTH);
    const int steps = (int)__reduce_max_sync(0xffffffffu, (unsigned)((s1 - s0 + WIDTH - 1) / WIDTH));
    for (int k0 = 0; k0 < steps; ++k0) {  // a lane per entry
      const int i = s0 + k0 * WIDTH + sl;
      const int col = i < s1 ? spill_cols[i] : -1;
      const bool live = col >= it.u_lo && col < it.u_hi;
      const int q = (col - it.u_lo) & 1;
      const int k = segment_ballot_rank<WIDTH, 2>(live, q, base);  // classes: the unit's parity
      if (live) visit(q, k, (unsigned)(col - it.u_lo) | ((unsigned)j << 12), ~i);
    }
  }
  return base;
}

// 16 and 8 bytes from the shared window at address + OFF (OFF folded into the instruction:
// the two buffers' reads differ only in it).
template <int OFF> __device__ __forceinline__ uint4 load_shared16(unsigned address) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4 + %5];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address), "n"(OFF));
  return v;
}
template <int OFF> __device__ __forceinline__ uint2 load_shared8(unsigned address) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2 + %3];" : "=r"(v.x), "=r"(v.y) : "r"(address), "n"(OFF));
  return v;
}

// One slice from the buffer SHIFT bytes past the first: every tile's MMA, TILED_GROUP tiles at
// a time with no branch between them so that their loads and MMAs overlap. This lane's 16 bytes
// of entry g (columns 8t .. 8t + 7) give A's fragment with the middle registers swapped: a0
// and a2 (row g at k = 2t, 2t + 1 and 2t + 8, 2t + 9) are columns 8t .. 8t + 3, a1 and a3 (row
// g + 8) columns 8t + 4 .. 8t + 7. B's column 2j holds token j's columns matching row g, column
// 2j + 1 those matching row g + 8: this lane's 8 bytes of its token, the first or the second
// half of the same 16 (g & 1). So d0 + d3 = D[g][2t] + D[g + 8][2t + 1] is entry g's dot with
// token t of the quad over the slice.
//
// SHARED_B = 1 loads B only where the tile's quad differs from the previous tile's: a warp's
// tiles are consecutive in the pack, so an item's (quad's) tiles follow one another, and at 1%
// density (~4 tiles a quad) three of every four x loads, a third of the slice's shared-memory
// bytes, go. The test is warp-uniform (a lane's x offset is a one-to-one function of the quad).
template <typename T, int SHIFT, int SHARED_B>
__device__ __forceinline__ void sum_tiles(const unsigned (&where)[TILED_MAX_TILES], float (&acc)[TILED_MAX_TILES],
                                          int cnt, unsigned smem_base) {
  uint2 b = make_uint2(0u, 0u);
  unsigned b_at = 0xffffffffu;  // the x offset b was loaded from (none yet: no offset is all ones)
  // The window's bits above the 17 the tiles hold (0 for a single block; a cluster's CTA of rank
  // 1 sees its own shared memory higher up): OR-ed back in, one LOP3 with the mask.
  const unsigned high = smem_base & ~0x1ffffu;
#pragma unroll
  for (int i0 = 0; i0 < TILED_MAX_TILES; i0 += TILED_GROUP) {
    if (i0 >= cnt) break;
#pragma unroll
    for (int i = i0; i < i0 + TILED_GROUP; ++i) {
      // Unpacked here, not once before the slice loop: two addresses per tile would not fit in
      // the registers (an empty asm hides that the packed word does not change).
      unsigned w = where[i];
      asm volatile("" : "+r"(w));
      const uint4 a = load_shared16<SHIFT>((w & 0x1ffffu) | high);
      const unsigned x_off = w >> 17;  // in 8-byte units from the buffer's start
      if (!SHARED_B || x_off != b_at) {
        b = load_shared8<SHIFT>(smem_base + (x_off << 3));
        b_at = x_off;
      }
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      if (TWELL_TILED_UP_ORDERED_A)  // a measurement switch: wrong sums (see its definition)
        mma_m16n8k16<T>(d, a.x, a.y, a.z, a.w, b.x, b.y);
      else
        mma_m16n8k16<T>(d, a.x, a.z, a.y, a.w, b.x, b.y);
      acc[i] += d[0] + d[3];
    }
  }
}

}  // namespace twell

// Pack, launch 1: each item's tile count (its entries rounded up to whole tiles) and its two
// class totals (n0 | n1 << 16); WIDTH lanes per item (see walk_item).
template <int WIDTH>
__global__ void __launch_bounds__(256) tiled_up_count(
    const short* __restrict__ indices, const int* __restrict__ counts, const int* __restrict__ spill_indptr,
    const int* __restrict__ spill_cols, int M, int N, int n_tiles, int tile_n, int capacity, int tokens, int units,
    int parts, int items, int* __restrict__ sizes, unsigned* __restrict__ classes) {
  using namespace twell;
  if (warp_past_items<WIDTH>(items)) return;
  bool dead;
  const int item = segment_item<WIDTH>(items, dead);
  const Item it = item_box(item, tokens, units, parts, N);
  const unsigned long long totals = walk_item<WIDTH>(it, indices, counts, spill_indptr, spill_cols, M, n_tiles,
                                                     tile_n, capacity, [](int, int, unsigned, int) {});
  const int n0 = class_field(totals, 0), n1 = class_field(totals, 1);
  if ((threadIdx.x & (WIDTH - 1)) == 0 && !dead) {
    sizes[item] = (n0 + n1 + TILED_TILE - 1) / TILED_TILE;
    classes[item] = (unsigned)n0 | ((unsigned)n1 << 16);
  }
}

// Pack, launch 4 (after the scan of the sizes into tile_ptr): each item's entries as tiles of
// codes (local unit | token in quad << 12) and destinations, the parities alternating while
// both last (position 2k + q for entry k of class q, k below the smaller class's count, then the
// larger class's rest in order), padding entries (unit p & 1, destination TILED_PAD) to a whole
// tile, and each tile's quad; WIDTH lanes per item.
template <int WIDTH>
__global__ void __launch_bounds__(256) tiled_up_place(
    const short* __restrict__ indices, const int* __restrict__ counts, const int* __restrict__ spill_indptr,
    const int* __restrict__ spill_cols, int M, int N, int n_tiles, int tile_n, int capacity, int tokens, int units,
    int parts, int items, const int* __restrict__ tile_ptr, const unsigned* __restrict__ classes,
    unsigned short* __restrict__ codes, int* __restrict__ dests, int* __restrict__ quads) {
  using namespace twell;
  if (warp_past_items<WIDTH>(items)) return;
  bool dead;
  const int item = segment_item<WIDTH>(items, dead);
  const int sl = threadIdx.x & (WIDTH - 1);
  const Item it = item_box(item, tokens, units, parts, N);
  const int first = tile_ptr[item], n_tiles_item = tile_ptr[item + 1] - first;
  const long long at = (long long)first * TILED_TILE;
  const int n0 = (int)(classes[item] & 0xffffu), n1 = (int)(classes[item] >> 16);
  const int m = min(n0, n1);
  walk_item<WIDTH>(it, indices, counts, spill_indptr, spill_cols, M, n_tiles, tile_n, capacity,
                   [&](int q, int k, unsigned code, int dest) {
                     if (dead) return;
                     const int p = k < m ? 2 * k + q : m + k;
                     codes[at + p] = (unsigned short)code;
                     dests[at + p] = dest;
                   });
  if (dead) return;  // after the walk: no shuffles follow
  for (int p = n0 + n1 + sl; p < n_tiles_item * TILED_TILE; p += WIDTH) {
    codes[at + p] = (unsigned short)(p & 1);
    dests[at + p] = TILED_PAD;
  }
  for (int i = sl; i < n_tiles_item; i += WIDTH) quads[first + i] = it.quad;
}

// The tiled up projection (see the top of this file). Block b = tb * parts + up owns tokens
// [tb T, tb T + T) and units [up U, up U + U); its tiles are tile_ptr[b * T / 4] ..
// tile_ptr[(b + 1) * T / 4]. map_w and map_x: TMA descriptors of W_up [N, K] and x [M, K]
// (boxes of 32 columns x box_w and box_x rows, no swizzle; out-of-bounds rows and columns read
// as zeros). Dynamic shared memory (TILED_SHARED_BYTES): two buffers of TILED_BUFFER_BYTES,
// each W_up's U 64-byte rows (in whole boxes) from byte 0 and x's T rows right after them, then
// a barrier per buffer. T a multiple of 4, box_w and box_x even (TMA's 128-byte aligned
// destinations) and at most 256, with ceil(U / box_w) box_w <= TILED_MAX_UNITS and the two
// regions' box rows together at most TILED_BUFFER_ROWS (so larger token blocks where the parts
// have fewer units: up to 824 tokens beside the standard widths' 704). u_data null: u is not kept.
//
// BACKWARD = 1 is the gated backward's sampled product with its value products fused in (what
// twell_gather_sddmm_gated_bwd computes, the same sums on the same operand layout): map_w holds
// W_down's transpose [N, K] and map_x dy [M, K], so each entry's sum is d_h = dy[t] . W_down[:, j];
// u_data / u_spill are then the forward's u (read), and the epilogue writes d_z = d_h * u,
// d_u = d_h * g and h = g * u at the entry's place, rounded as that kernel rounds them (d_h to T
// first, each product by kept_product). Padding slots are not written.
#define TILED_UP_PARAMS                                                                                            \
  const __grid_constant__ twell::TensorMap map_w, const __grid_constant__ twell::TensorMap map_x, int box_w,        \
      int box_x, const int *__restrict__ tile_ptr, const unsigned short *__restrict__ codes,                         \
      const int *__restrict__ dests, const int *__restrict__ quads, const T *__restrict__ gate,                      \
      const T *__restrict__ gate_spill, int K, int tokens, int units, int parts, T *__restrict__ h_data,             \
      T *__restrict__ h_spill, T *__restrict__ u_data, T *__restrict__ u_spill, T *__restrict__ dz_data,             \
      T *__restrict__ dz_spill, T *__restrict__ du_data, T *__restrict__ du_spill
#define TILED_UP_ARGS                                                                                              \
  const twell::TensorMap &map_w, const twell::TensorMap &map_x, int box_w, int box_x,                              \
      const int *__restrict__ tile_ptr, const unsigned short *__restrict__ codes, const int *__restrict__ dests,    \
      const int *__restrict__ quads, const T *__restrict__ gate, const T *__restrict__ gate_spill, int K,            \
      int tokens, int units, int parts, T *__restrict__ h_data, T *__restrict__ h_spill, T *__restrict__ u_data,   \
      T *__restrict__ u_spill, T *__restrict__ dz_data, T *__restrict__ dz_spill, T *__restrict__ du_data,         \
      T *__restrict__ du_spill
#define TILED_UP_FORWARD                                                                                           \
  map_w, map_x, box_w, box_x, tile_ptr, codes, dests, quads, gate, gate_spill, K, tokens, units, parts, h_data,    \
      h_spill, u_data, u_spill, dz_data, dz_spill, du_data, du_spill

template <typename T, int SHARED_B, int BACKWARD, int CLUSTER>
__device__ __forceinline__ void tiled_gated_up_body(TILED_UP_ARGS) {
  using namespace twell;
  constexpr int MAXT = TILED_MAX_TILES, ROUND_TILES = TILED_WARPS * MAXT;
  extern __shared__ __align__(128) uint4 staged[];
  // A pair's parts per token block are even: a pad part (up == parts) past an odd count.
  const int grid_parts = CLUSTER > 1 ? parts + (parts & 1) : parts;
  const int up = blockIdx.x % grid_parts, tb = blockIdx.x / grid_parts;
  const int u_lo = up * units, tok_lo = tb * tokens;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int quads_per_block = tokens / TILED_QUAD;
  // This block's tiles (the pack's block tb * parts + up; none for a pad part).
  auto tiles_of = [&](int part, int& begin, int& end) {
    const int blk = tb * parts + part;
    begin = part < parts ? tile_ptr[blk * quads_per_block] : 0;
    end = part < parts ? tile_ptr[(blk + 1) * quads_per_block] : 0;
  };
  int t_begin, t_end;
  tiles_of(up, t_begin, t_end);
  // Rounds streamed: a pair streams as many as the busier block needs.
  int rounds = (t_end - t_begin + ROUND_TILES - 1) / ROUND_TILES;
  const unsigned rank = CLUSTER > 1 ? cluster_rank() : 0u;
  if (CLUSTER > 1) {
    int p_begin, p_end;
    tiles_of(up ^ 1, p_begin, p_end);
    rounds = max(rounds, (p_end - p_begin + ROUND_TILES - 1) / ROUND_TILES);
  }
  const int n_slices = (K + TILED_COLS - 1) / TILED_COLS;
  const unsigned smem_base = smem_u32(staged), full = smem_base + 2 * TILED_BUFFER_BYTES, empty = full + 16;
  // The tiles' packed addresses hold W_up's low 17 bits (sum_tiles ORs the window's higher bits
  // back in): the buffers' start is far below 64 KB into its 128 KB-aligned span (no static
  // shared memory), checked rather than assumed; x's offsets (in 8-byte units, 15 bits) reach
  // 96 KB at most.
  if ((smem_base & 0x1ffffu) + TILED_MAX_UNITS * 64 > (1u << 17)) __trap();
  if (threadIdx.x == 0) {
    barrier_init(full, 1);  // the copying thread's expect_tx arrival, per buffer
    barrier_init(full + 8, 1);
    barrier_init(empty, CLUSTER);  // pairs: each CTA's release of the buffer (after its block sync)
    barrier_init(empty + 8, CLUSTER);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (CLUSTER > 1) cluster_sync();  // the peer's barriers exist before any copy or arrival
  else __syncthreads();

  // Slice s of W_up's and x's rows into buffer `buf` by the copy engine: whole boxes (the
  // last may reach past the part or the block into rows nobody reads, or past the matrices:
  // zeros), all counted by the buffer's barrier. Pairs: x's boxes of this CTA's parity to both
  // CTAs, once both have released the buffer's last use (parity trick: a fresh barrier's
  // "previous phase" counts as done, so each buffer's first fill passes at once). Thread 0 only.
  const int w_boxes = (units + box_w - 1) / box_w, x_boxes = (tokens + box_x - 1) / box_x;
  const unsigned x_at = (unsigned)(w_boxes * box_w) * 64;  // x's rows in a buffer
  const unsigned slice_bytes = (unsigned)(w_boxes * box_w + x_boxes * box_x) * TILED_COLS * 2;
  unsigned fills[2] = {0u, 0u};  // each buffer's fills so far (thread 0)
  auto stage = [&](int s, int buf) {
    const unsigned bar = full + 8 * buf, dst = smem_base + buf * TILED_BUFFER_BYTES;
    if (CLUSTER > 1) barrier_wait(empty + 8 * buf, (fills[buf] & 1u) ^ 1u);
    ++fills[buf];
    barrier_expect_bytes(bar, slice_bytes);
    for (int i = 0; i < w_boxes; ++i)
      tma_load_2d(dst + i * box_w * 64, &map_w, s * TILED_COLS, u_lo + i * box_w, bar);
    for (int i = 0; i < x_boxes; ++i) {
      if (CLUSTER == 1)
        tma_load_2d(dst + x_at + i * box_x * 64, &map_x, s * TILED_COLS, tok_lo + i * box_x, bar);
      else if ((unsigned)(i & 1) == rank)
        tma_load_2d_multicast(dst + x_at + i * box_x * 64, &map_x, s * TILED_COLS, tok_lo + i * box_x, bar, 3);
    }
  };
  // After every thread's __syncthreads that follows a buffer's sums: pairs release it in both
  // CTAs (the single blocks' sync alone frees it). Thread 0 only.
  auto release = [&](int buf) {
    if (CLUSTER > 1) release_stage<CLUSTER>(empty + 8 * buf);
  };

  unsigned phase0 = 0, phase1 = 0;  // each buffer's full barrier phase to wait for
  for (int round = 0; round < rounds; ++round) {
    const int r0 = t_begin + round * ROUND_TILES, n = max(0, min(ROUND_TILES, t_end - r0));
    const int lo = r0 + warp * n / TILED_WARPS, cnt = r0 + (warp + 1) * n / TILED_WARPS - lo;
    // Both buffers are free here in this CTA (every thread passed the last slice's
    // __syncthreads); a pair's stage() also waits for the peer's release.
    if (threadIdx.x == 0) {
      stage(0, 0);
      if (n_slices > 1) stage(1, 1);
    }
    // Per tile i, the shared addresses this lane reads in buffer 0 (buffer 1's are
    // TILED_BUFFER_BYTES further): bits 0-16 its 16 bytes of entry g's W_up row (columns 8t ..
    // 8t + 7 of the slice), bits 17-31 the offset of its 8 bytes of x in 8-byte units (token
    // g >> 1 of the tile's quad, the first or second 8 of its 16 bytes by g & 1). Tiles past
    // cnt keep the last's (valid addresses; their sums are never written).
    unsigned where[MAXT];
    float acc[MAXT];
#pragma unroll
    for (int i = 0; i < MAXT; ++i) {
      const int tile = lo + min(i, max(cnt - 1, 0));
      const unsigned c = cnt > 0 ? codes[(long long)tile * TILED_TILE + g] : 0u;
      const int quad = cnt > 0 ? quads[tile] : 0;
      const unsigned x_off = x_at + (unsigned)(((quad * TILED_QUAD + (g >> 1)) * 4 + t) * 16 + (g & 1) * 8);
      where[i] = ((smem_base & 0x1ffffu) + (c & 0xfffu) * 64 + t * 16) | ((x_off >> 3) << 17);
      acc[i] = 0.f;
    }
    // Slices s and s + 1 from buffers 0 and 1; each buffer is refilled with the slice two ahead
    // once every warp has summed it.
    for (int s = 0; s < n_slices; s += 2) {
      barrier_wait(full, phase0);
      phase0 ^= 1u;
      sum_tiles<T, 0, SHARED_B>(where, acc, cnt, smem_base);
      __syncthreads();
      if (threadIdx.x == 0) {
        release(0);
        if (s + 2 < n_slices) stage(s + 2, 0);
      }
      if (s + 1 >= n_slices) break;
      barrier_wait(full + 8, phase1);
      phase1 ^= 1u;
      sum_tiles<T, TILED_BUFFER_BYTES, SHARED_B>(where, acc, cnt, smem_base);
      __syncthreads();
      if (threadIdx.x == 0) {
        release(1);
        if (s + 3 < n_slices) stage(s + 3, 1);
      }
    }
    // The lane whose t is entry g's token writes its sum: u rounded, h = g * u rounded.
#pragma unroll
    for (int i = 0; i < MAXT; ++i) {
      if (i < cnt) {
        const long long e = (long long)(lo + i) * TILED_TILE + g;
        const int dest = dests[e];
        if (dest != TILED_PAD && (int)((codes[e] >> 12) & 3u) == t) {
          const bool spilled = dest < 0;
          const int at = spilled ? ~dest : dest;
          const float gv = to_acc((spilled ? gate_spill : gate)[at]);
          if (BACKWARD) {
            const float d_h = to_acc(from_acc<T>(acc[i]));
            const float uv = to_acc((spilled ? u_spill : u_data)[at]);
            (spilled ? dz_spill : dz_data)[at] = kept_product<T>(d_h, uv);
            (spilled ? du_spill : du_data)[at] = kept_product<T>(d_h, gv);
            (spilled ? h_spill : h_data)[at] = kept_product<T>(gv, uv);
          } else {
            const T u = from_acc<T>(acc[i]);
            (spilled ? h_spill : h_data)[at] = from_acc<T>(gv * to_acc(u));
            if (u_data != nullptr) (spilled ? u_spill : u_data)[at] = u;
          }
        }
      }
    }
  }
  // The peer may still copy into this CTA's buffers or arrive on its barriers until it is done.
  if (CLUSTER > 1) cluster_sync();
}

template <typename T, int SHARED_B, int BACKWARD>
__global__ void __launch_bounds__(twell::TILED_WARPS * 32, 1) twell_tiled_gated_up(TILED_UP_PARAMS) {
  tiled_gated_up_body<T, SHARED_B, BACKWARD, 1>(TILED_UP_FORWARD);
}

// The same in clusters of two CTAs (consecutive unit parts of one token block) sharing x's
// slices; the grid holds an even count of parts per token block (see "Pairs" at the top).
template <typename T, int SHARED_B, int BACKWARD>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(twell::TILED_WARPS * 32, 1)
    twell_tiled_gated_up_pair(TILED_UP_PARAMS) {
  tiled_gated_up_body<T, SHARED_B, BACKWARD, 2>(TILED_UP_FORWARD);
}
