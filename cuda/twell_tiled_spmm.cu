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
// k-groups of 16 words (value bits, row in group, B row in chunk: tspmm_word). One m16n8k16 MMA
// is a transposed tile of the product: M = 16 output columns, N = the group's 8 rows, K = the
// k-group's 16 entries. A[m][k] = B[row of entry k][m] comes from ldmatrix.trans: each of the
// four 8 x 8 matrices is 8 entries' B rows (one 16-byte piece of each, a lane giving one entry's
// address), so the gather of arbitrary rows costs nothing extra. B[k][n] (the MMA's) is the
// one-hot operand: entry k's value where its row in group is n, else zero, built once per words
// array by tiled_spmm_fragments (two registers per lane and k-group) and loaded with the words,
// or (FRAGS = false) built by each lane from four words shuffled from the lanes that hold them.
//
// Bank conflicts: an 8 x 8 matrix reads the same 16-byte column piece of 8 rows; with the
// 128-byte swizzle the piece's bank group is (piece ^ row % 8), so 8 rows of distinct row
// classes (row % 8) are conflict-free. An octet holding a class twice costs a second wavefront,
// so an item costs at least as many wavefronts as its largest class has entries; the pack's
// octet plan (octet_plan in twell_tiled.cuh) reaches that bound, and padding words repeat a row
// their own octet reads (a broadcast). Dealing classes round robin with padding that repeated
// the item's first entry left 51% of the wavefronts as conflicts on the H200 (twenty-sixth
// session).
//
// Latency: a warp's k-group ranges are loaded two chunks ahead and each k-group's word and
// operand two k-groups ahead, across chunk boundaries, so the pack's L2 reads overlap the MMAs.
// The grid is persistent (one block per SM walking the tiles), and the ring runs on from one tile
// into the next: the next tile's first chunks load during this tile's last ones and its epilogue.
//
// A.T @ G (the backward's weight gradients) runs the same kernel on a pack of A.T made straight
// from A's parts (tiled_spmm_count_t / _place_t below: no transposed structure), one pack for up
// to three value arrays of one structure.
//
// Non-finite values: an entry's B row enters the MMA for all 8 rows of its group (times zero
// for the 7 others), so an Inf or NaN in a B row that some entry uses would reach the other rows
// of that entry's group as NaN: the epilogue flags rows with a non-finite sum and
// tiled_spmm_fixup recomputes them exactly. Rows of B that no entry uses are never read (padding
// words repeat a real entry of their item with value zero and a mark).
#include "twell_mma.cuh"
#include "twell_tiled.cuh"
#include "twell_tma.cuh"
#include "twell_types.cuh"

namespace twell {

// Where an entry's value sits in A's parts: slot index, or ~spill index.
__device__ __forceinline__ unsigned short tspmm_value(const unsigned short* data, const unsigned short* spill,
                                                     long long source) {
  return source >= 0 ? data[source] : spill[~source];
}

// A TwELL A's structure and the walk of one row's stored entries in a column range.
struct TwellWalk {
  const short* indices;
  const int* counts;
  const int* spill_indptr;
  const int* spill_cols;
  int M, K, n_tiles, tile_n, capacity;
};

// The index of row `row`'s first spill entry with column >= col (binary search; columns rise).
__device__ __forceinline__ int first_spill_at_least(const TwellWalk& a, int row, int col) {
  int lo = a.spill_indptr[row], hi = a.spill_indptr[row + 1];
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a.spill_cols[mid] < col) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Row `row`'s entries with columns in [c0, c1), as visit(column, source): its tiles' slots,
// then its spill from the first column >= c0. Source: the slot index, or ~spill index.
template <typename Visit>
__device__ __forceinline__ void walk_row(const TwellWalk& a, int row, int c0, int c1, Visit visit) {
  const int t_lo = c0 / a.tile_n, t_hi = (c1 - 1) / a.tile_n;
  for (int t = t_lo; t <= t_hi; ++t) {
    const long long rt = (long long)row * a.n_tiles + t;
    const int n = a.counts[rt];
    for (int s = 0; s < n; ++s) {
      const long long slot = rt * a.capacity + s;
      const int col = t * a.tile_n + a.indices[slot];
      if (col >= c0 && col < c1) visit(col, slot);
    }
  }
  const int end = a.spill_indptr[row + 1];
  for (int i = first_spill_at_least(a, row, c0); i < end && a.spill_cols[i] < c1; ++i)
    visit(a.spill_cols[i], ~(long long)i);
}

// Up to three value arrays of one structure (A's own and others'; null data where absent),
// packed at the same positions into words[0 .. 2]; with dests (null where not wanted) each
// word's place in A's parts as well: the slot index, ~spill index, or TSPMM_PAD for padding (the
// one-pack FFN kernels write u and the backward's values there).
struct PackValues {
  const unsigned short* data[3];
  const unsigned short* spill[3];
  unsigned* words[3];
  int* dests;
};

// One entry's words (value bits, row in its group, B row in its chunk) at position `at` of
// every given value array, and its place in A's parts with dests.
__device__ __forceinline__ void place_entry(const PackValues& v, long long at, long long source, int row, int b_row) {
#pragma unroll
  for (int i = 0; i < 3; ++i)
    if (v.data[i] != nullptr) v.words[i][at] = tspmm_word(tspmm_value(v.data[i], v.spill[i], source), row, b_row);
  if (v.dests != nullptr) v.dests[at] = (int)source;
}

// The padding of an item placed by `plan` (its words start at `at`, its entries written and
// visible to this thread), positions first, first + 8, ...: octet_padding_source's row and B
// row with value zero and the padding mark, TSPMM_PAD as their place.
__device__ __forceinline__ void place_padding(const PackValues& v, const OctetPlan& plan, const int (&total)[8],
                                              long long at, int first) {
  for (int pos = first; pos < 8 * plan.octets; pos += 8) {
    const int src = octet_padding_source(plan, total, pos);
    if (src < 0) continue;
    const unsigned pad = (v.words[0][at + src] & 0xffffu) | TSPMM_PAD_BIT;
#pragma unroll
    for (int i = 0; i < 3; ++i)
      if (v.data[i] != nullptr) v.words[i][at + pos] = pad;
    if (v.dests != nullptr) v.dests[at + pos] = TSPMM_PAD;
  }
}

// The pack's work split: 8 lanes per item (group of 8 rows, chunk of 512 columns), lane r of a
// segment walking row r of the group, so a thread's chain of dependent loads is one row's
// (a thread per item walked 8 rows in a row). Returns the item (or -1 past the items; such lanes
// still take part in the segment's shuffles) and sets the row, the column range and the lane's
// segment.
struct PackLane {
  long long item;
  int row, c0, c1, r;
};

__device__ __forceinline__ PackLane pack_lane(const TwellWalk& a, int n_chunks, long long items) {
  const long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  PackLane p;
  p.r = (int)(t & 7);
  p.item = t >> 3 < items ? t >> 3 : -1;
  const int grp = (int)(p.item / n_chunks);
  p.row = grp * TSPMM_GROUP + p.r;
  p.c0 = (int)(p.item % n_chunks) * TSPMM_CHUNK;
  p.c1 = min(a.K, p.c0 + TSPMM_CHUNK);
  return p;
}

// An int summed over the lane's 8-lane segment (every lane gets the total).
__device__ __forceinline__ int segment_sum(int v) {
#pragma unroll
  for (int d = 1; d < 8; d <<= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  return v;
}

// The class counts (column in chunk % 8) of the lane's row, summed over its segment: the item's
// totals per class in `total` and the lane's exclusive prefix over the rows before it in `base`.
__device__ __forceinline__ void segment_classes(const TwellWalk& a, const PackLane& p, bool live, int (&base)[8],
                                                int (&total)[8]) {
  int mine[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (live) walk_row(a, p.row, p.c0, p.c1, [&](int col, long long) { ++mine[(col - p.c0) & 7]; });
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    int incl = mine[q];
#pragma unroll
    for (int d = 1; d < 8; d <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, incl, d, 8);
      if (p.r >= d) incl += up;
    }
    base[q] = incl - mine[q];
    total[q] = __shfl_sync(0xffffffffu, incl, 7, 8);
  }
}

__device__ __forceinline__ int class_sum(const int (&total)[8]) {
  int n = 0;
#pragma unroll
  for (int c = 0; c < 8; ++c) n += total[c];
  return n;
}

// Row `row`'s stored entries with columns in [c0, c1): whole tiles by their counts (their
// indices are not read), the partial tiles by a walk, the spill by two searches.
__device__ __forceinline__ int count_row(const TwellWalk& a, int row, int c0, int c1) {
  int n = 0;
  const int t_lo = c0 / a.tile_n, t_hi = (c1 - 1) / a.tile_n;
  for (int t = t_lo; t <= t_hi; ++t) {
    const long long rt = (long long)row * a.n_tiles + t;
    const int cnt = a.counts[rt];
    // Whole: the tile starts in range and ends in it or past the last column (no entry there).
    if (t * a.tile_n >= c0 && ((t + 1) * a.tile_n <= c1 || c1 == a.K)) {
      n += cnt;
      continue;
    }
    for (int s = 0; s < cnt; ++s) {
      const int col = t * a.tile_n + a.indices[rt * a.capacity + s];
      n += col >= c0 && col < c1;
    }
  }
  return n + first_spill_at_least(a, row, c1) - first_spill_at_least(a, row, c0);
}

// Pack, launch 1: each item's k-group count (its entries rounded up to 16: the octet plan keeps
// that many).
__device__ __forceinline__ void tspmm_count(const TwellWalk& a, int n_chunks, long long items, int* sizes) {
  const PackLane p = pack_lane(a, n_chunks, items);
  const int n = segment_sum(p.item >= 0 && p.row < a.M ? count_row(a, p.row, p.c0, p.c1) : 0);
  if (p.item >= 0 && p.r == 0) sizes[p.item] = (n + TSPMM_KGROUP - 1) / TSPMM_KGROUP;
}

// Pack, launch 4 (after the scan of the sizes into kg_ptr): each item's words, entry k of class
// q (k in the order of a walk of its rows in turn) at octet_position, then the padding words
// (octet_padding_source's word with value zero and the padding mark: a B row that the octet reads
// anyway). A lane's rank base per class is the segment's exclusive prefix over the rows before it.
__device__ __forceinline__ void tspmm_place(const TwellWalk& a, int n_chunks, long long items, const int* kg_ptr,
                                            const PackValues& v) {
  const PackLane p = pack_lane(a, n_chunks, items);
  const bool live = p.item >= 0 && p.row < a.M;
  int base[8], total[8];
  segment_classes(a, p, live, base, total);
  const OctetPlan plan = octet_plan(total, class_sum(total));
  const long long at = p.item >= 0 ? (long long)kg_ptr[p.item] * TSPMM_KGROUP : 0;
  if (live)
    walk_row(a, p.row, p.c0, p.c1, [&](int col, long long source) {
      const int b_row = col - p.c0, q = b_row & 7;
      place_entry(v, at + octet_position(plan, total, q, base[q]++), source, p.r, b_row);
    });
  __syncwarp();  // the segment's entries are written (and visible to its lanes) before the padding reads them
  if (p.item >= 0) place_padding(v, plan, total, at, p.r);
}

// What a lane needs of one k-group: its word (entry `entry`: its ldmatrix row, see
// twell_tiled_spmm) and, with FRAGS, its one-hot operand (b0, b1: tiled_spmm_fragments); one or
// two loads per k-group. kg < 0 (nothing to load) reads k-group 0 instead, never used: loads
// without a branch around them (the pack's arrays always hold at least one k-group's room).
struct TiledKGroup {
  unsigned mine;
  uint2 b;
};

template <bool FRAGS>
__device__ __forceinline__ TiledKGroup tspmm_load(const unsigned* words, const uint2* frags, unsigned entry,
                                                  unsigned lane, int kg) {
  // 32-bit offsets (the pack's words number under 2^31, _tiled_spmm._packed checks; its
  // fragments 2 uint2 per word): one wide multiply-add per address.
  const unsigned k = (unsigned)max(kg, 0);
  const unsigned mine = __ldg(words + (k * (unsigned)TSPMM_KGROUP + entry));
  return TiledKGroup{mine, FRAGS ? __ldg(frags + (k * 32u + lane)) : make_uint2(0u, 0u)};
}

// The first two k-groups (-1: none) of the range [lo, hi) followed by a sequence whose first two
// are (first, second), in place: applied from a warp's last range back to its first.
__device__ __forceinline__ void prepend_range(int lo, int hi, int& first, int& second) {
  const int n = hi - lo;
  second = n > 1 ? lo + 1 : (n == 1 ? first : second);
  first = n > 0 ? lo : first;
}

// With PREFETCH: the lines of the warp's words for the next chunk (ranges `kp_next`, lanes 2i
// and 2i + 1 holding group i's k-group bounds) pulled into L1 one chunk ahead, a line (128
// bytes, two k-groups) per lane and 32 / WG lanes per group, so that the two-ahead word loads
// hit L1 instead of waiting on L2 (the long-scoreboard stalls that left 0.44 of 4 warps
// eligible on the H100, thirtieth session). A group's words past its lanes' lines (more than
// 16 k-groups a chunk with 16 warps) load from L2 as before; the prefetch has no effect on
// values. Every lane takes part in the shuffles.
template <int WG>
__device__ __forceinline__ void prefetch_chunk_words(const unsigned* words, int kp_next, int lane) {
  constexpr int per_group = 32 / WG;
  const int i = lane / per_group, j = lane % per_group;
  const int lo = __shfl_sync(0xffffffffu, kp_next, 2 * i), hi = __shfl_sync(0xffffffffu, kp_next, 2 * i + 1);
  // k-groups are 64 bytes: lines lo / 2 .. (hi - 1) / 2 (the words array is line-aligned).
  const int line = lo / 2 + j;
  if (lo < hi && line <= (hi - 1) / 2)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(words + (size_t)line * 32u));
}

// The one-hot operand's register for column g (gr = g << TSPMM_ROW_SHIFT): the value halves of
// words w0 (low half) and w1 (high half) where their row in group is g, zeros elsewhere.
__device__ __forceinline__ unsigned tspmm_one_hot(unsigned w0, unsigned w1, unsigned gr) {
  constexpr unsigned row_bits = 7u << TSPMM_ROW_SHIFT;
  const unsigned a = ((w0 ^ gr) & row_bits) == 0u ? w0 : 0u;
  const unsigned b = ((w1 ^ gr) & row_bits) == 0u ? w1 : 0u;
  unsigned r;
  asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(r) : "r"(a), "r"(b));  // a's high half, then b's
  return r;
}

// The one-hot operand of a k-group for lane (g, t) from the lanes' own words (`mine`: lane l holds
// entry (l / 16) * 8 + l % 8): entries 2t, 2t + 1 sit in lanes 2t, 2t + 1 and entries 2t + 8,
// 2t + 9 in lanes 2t + 16, 2t + 17 (the product without fragments: four shuffles and 14 integer
// instructions a k-group, but no fragment bytes from L2).
__device__ __forceinline__ uint2 tspmm_shuffled_operand(unsigned mine, unsigned t, unsigned gr) {
  const int l = (int)(2 * t);
  const unsigned w0 = __shfl_sync(0xffffffffu, mine, l), w1 = __shfl_sync(0xffffffffu, mine, l + 1);
  const unsigned w8 = __shfl_sync(0xffffffffu, mine, l + 16), w9 = __shfl_sync(0xffffffffu, mine, l + 17);
  return make_uint2(tspmm_one_hot(w0, w1, gr), tspmm_one_hot(w8, w9, gr));
}

// The shared address of this lane's ldmatrix row for column step 0: word `mine`'s B row in the
// stage at `stage_base`, 16-byte piece `piece` under the 128-byte swizzle (piece ^ row % 8), i.e.
// (row << 3 | (row % 8 ^ piece)) << 4, which is the word's B row field ^ piece, shifted; step j's
// is this ^ (j << 5), the swizzle being an XOR of bits 4-6 that the 128-byte row address leaves
// clear.
__device__ __forceinline__ unsigned tspmm_row_address(unsigned stage_base, unsigned mine, unsigned piece) {
  return stage_base + (((mine ^ piece) & TSPMM_B_FIELD) << 4);
}

}  // namespace twell

#define TSPMM_VALUES                                                                                              \
  const unsigned short *__restrict__ data0, const unsigned short *__restrict__ spill0,                          \
      const unsigned short *__restrict__ data1, const unsigned short *__restrict__ spill1,                      \
      const unsigned short *__restrict__ data2, const unsigned short *__restrict__ spill2,                      \
      unsigned *__restrict__ words0, unsigned *__restrict__ words1, unsigned *__restrict__ words2,               \
      int *__restrict__ dests
#define TSPMM_PACK_VALUES {{data0, data1, data2}, {spill0, spill1, spill2}, {words0, words1, words2}, dests}

// The pack of a TwELL A (M x K; items: groups of 8 rows x chunks of 512 columns): counts, then
// (after the scan) the words of each given value array (data0 always, data1 and data2 or null).
__global__ void __launch_bounds__(256) tiled_spmm_count(const short* __restrict__ indices,
                                                        const int* __restrict__ counts,
                                                        const int* __restrict__ spill_indptr,
                                                        const int* __restrict__ spill_cols, int M, int K,
                                                        int n_tiles, int tile_n, int capacity, int n_chunks,
                                                        long long items, int* __restrict__ sizes) {
  const twell::TwellWalk walk{indices, counts, spill_indptr, spill_cols, M, K, n_tiles, tile_n, capacity};
  twell::tspmm_count(walk, n_chunks, items, sizes);
}

__global__ void __launch_bounds__(256) tiled_spmm_place(const short* __restrict__ indices,
                                                        const int* __restrict__ counts,
                                                        const int* __restrict__ spill_indptr,
                                                        const int* __restrict__ spill_cols, int M, int K,
                                                        int n_tiles, int tile_n, int capacity, int n_chunks,
                                                        long long items, const int* __restrict__ kg_ptr,
                                                        TSPMM_VALUES) {
  const twell::TwellWalk walk{indices, counts, spill_indptr, spill_cols, M, K, n_tiles, tile_n, capacity};
  twell::tspmm_place(walk, n_chunks, items, kg_ptr, twell::PackValues TSPMM_PACK_VALUES);
}

// The one-hot operands of a pack's k-groups (the MMA's B: entry k's value where its row in
// group is n, else zero), built once per words array rather than by every column block of the
// product: lane 4g + t of k-group kg gets (b0, b1) at frags[32 kg + lane], b0 from entries 2t,
// 2t + 1 and b1 from 2t + 8, 2t + 9, each for column g. Building them inside the product took
// four shuffles and 14 dependent integer instructions per k-group and column block (the
// twenty-seventh session's count, ~49 instructions per k-group in all). A thread per (k-group,
// lane) of an upper bound of k-groups; those past kg_ptr[items] return.
__global__ void __launch_bounds__(256) tiled_spmm_fragments(const int* __restrict__ kg_ptr, long long items,
                                                            const unsigned* __restrict__ words,
                                                            uint2* __restrict__ frags) {
  using namespace twell;
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x, kg = i >> 5;
  if (kg >= kg_ptr[items]) return;
  const unsigned lane = (unsigned)(i & 31), gr = (lane >> 2) << TSPMM_ROW_SHIFT, t = lane & 3u;
  const unsigned* w = words + kg * TSPMM_KGROUP + 2 * t;
  frags[i] = make_uint2(tspmm_one_hot(w[0], w[1], gr), tspmm_one_hot(w[8], w[9], gr));
}

// The pack of A.T (N x M: items are groups of 8 columns of A x chunks of 512 tokens, item =
// group * n_chunks + token chunk) straight from A's TwELL parts, in the order of the CSR walk
// (each column's tokens increasing, columns in order; within an item, classes token % 8 placed
// by the octet plan as tspmm_place does). A block owns 512 tokens x 512 columns of A (64 groups), one
// thread per token: every thread marks its entries in a bit matrix [column][token] in shared
// memory, then a column's count per class is a popcount of its bit rows under the class mask
// (0x01010101 << q: 32 is a multiple of 8), and an entry's rank within its item's class is the
// count of its group's earlier columns plus the popcount of its own column's class bits below its
// token. No atomics decide an order: the words are those of the CSR walk, run to run.
namespace twell {

constexpr int TT_TOKENS = 512;             // tokens per block: the SpMM's chunk of B rows
constexpr int TT_COLS = 512;               // columns of A per block
constexpr int TT_WORDS = TT_TOKENS / 32;   // bit words per column
constexpr int TT_GROUPS = TT_COLS / 8;

struct TransposeShared {
  // 33 KB: (column, token) entries of the block; rows of 17 words, so that the 32 columns a
  // warp's threads count read 32 different banks (16 words: 16-way conflicts, most of the pack's
  // 0.17 ms at 1% on the H200).
  unsigned bits[TT_COLS][TT_WORDS + 1];
  unsigned short count[TT_COLS][8];       // per column: entries of each token class
  int total[TT_GROUPS][8];                // per group: entries of each token class
  OctetPlan plan[TT_GROUPS];              // per group: its octets (octet_plan)
};

// The block's bit matrix and class counts (both launches start with it); returns this thread's
// token (or -1 past M) and the block's column range [c0, c1).
__device__ __forceinline__ int tt_marks(const TwellWalk& a, TransposeShared& sh, int& c0, int& c1) {
  const int lt = threadIdx.x, token = blockIdx.y * TT_TOKENS + lt;
  c0 = blockIdx.x * TT_COLS;
  c1 = min(a.K, c0 + TT_COLS);
  for (int w = 0; w < TT_WORDS; ++w) sh.bits[lt][w] = 0u;  // TT_COLS == blockDim.x
  __syncthreads();
  if (token < a.M)
    walk_row(a, token, c0, c1, [&](int col, long long) { atomicOr(&sh.bits[col - c0][lt >> 5], 1u << (lt & 31)); });
  __syncthreads();
  int n_class[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // this thread's column, each word read once
#pragma unroll
  for (int w = 0; w < TT_WORDS; ++w) {
    const unsigned word = sh.bits[lt][w];
#pragma unroll
    for (int q = 0; q < 8; ++q) n_class[q] += __popc(word & (0x01010101u << q));
  }
#pragma unroll
  for (int q = 0; q < 8; ++q) sh.count[lt][q] = (unsigned short)n_class[q];
  __syncthreads();
  if (lt < TT_GROUPS) {
    int n = 0;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      int t = 0;
      for (int u = 0; u < 8; ++u) t += sh.count[lt * 8 + u][q];
      sh.total[lt][q] = t;
      n += t;
    }
    sh.plan[lt] = octet_plan(sh.total[lt], n);
  }
  __syncthreads();
  return token < a.M ? token : -1;
}

}  // namespace twell

// Launch 1: each item's k-group count. Grid (column chunks, token chunks), TT_TOKENS threads.
__global__ void __launch_bounds__(twell::TT_TOKENS) tiled_spmm_count_t(const short* __restrict__ indices,
                                                                const int* __restrict__ counts,
                                                                const int* __restrict__ spill_indptr,
                                                                const int* __restrict__ spill_cols, int M, int K,
                                                                int n_tiles, int tile_n, int capacity, int n_chunks,
                                                                int* __restrict__ sizes) {
  using namespace twell;
  __shared__ TransposeShared sh;
  const TwellWalk a{indices, counts, spill_indptr, spill_cols, M, K, n_tiles, tile_n, capacity};
  int c0, c1;
  tt_marks(a, sh, c0, c1);
  const int gi = threadIdx.x, grp = c0 / 8 + gi;
  if (gi < TT_GROUPS && c0 + 8 * gi < c1) sizes[(long long)grp * n_chunks + blockIdx.y] = sh.plan[gi].octets / 2;
}

// Launch 4 (after the scan of the sizes into kg_ptr): the words (and the places, with dests).
__global__ void __launch_bounds__(twell::TT_TOKENS) tiled_spmm_place_t(const short* __restrict__ indices,
                                                                const int* __restrict__ counts,
                                                                const int* __restrict__ spill_indptr,
                                                                const int* __restrict__ spill_cols, int M, int K,
                                                                int n_tiles, int tile_n, int capacity, int n_chunks,
                                                                const int* __restrict__ kg_ptr, TSPMM_VALUES) {
  using namespace twell;
  __shared__ TransposeShared sh;
  const TwellWalk a{indices, counts, spill_indptr, spill_cols, M, K, n_tiles, tile_n, capacity};
  const PackValues v TSPMM_PACK_VALUES;
  int c0, c1;
  const int token = tt_marks(a, sh, c0, c1);
  const int lt = threadIdx.x, q = lt & 7;
  const unsigned below = (lt & 31) ? (0x01010101u << q) & ((1u << (lt & 31)) - 1u) : 0u;
  if (token >= 0)
    walk_row(a, token, c0, c1, [&](int col, long long source) {
      const int u = col - c0, gi = u >> 3;
      int k = 0;
      for (int u2 = gi * 8; u2 < u; ++u2) k += sh.count[u2][q];
      for (int w = 0; w < (lt >> 5); ++w) k += __popc(sh.bits[u][w] & (0x01010101u << q));
      k += __popc(sh.bits[u][lt >> 5] & below);
      const int p = octet_position(sh.plan[gi], sh.total[gi], q, k);
      const long long item = (long long)(c0 / 8 + gi) * n_chunks + blockIdx.y;
      place_entry(v, (long long)kg_ptr[item] * TSPMM_KGROUP + p, source, u & 7, lt);
    });
  __syncthreads();  // every entry written (and visible to the block) before the padding reads them
  const int gi = lt >> 3;  // the padding: 8 threads per group, as tspmm_place
  if (c0 + 8 * gi < c1) {
    const long long at = (long long)kg_ptr[(long long)(c0 / 8 + gi) * n_chunks + blockIdx.y] * TSPMM_KGROUP;
    place_padding(v, sh.plan[gi], sh.total[gi], at, lt & 7);
  }
}

// The slots of an A.T product dealt by load (the backward's weight gradients on skewed
// patterns: a hot unit's group would make its warp the block's slowest): each group's load is
// its k-group count over all chunks (kg_ptr is group-major), its rank the number of groups
// heavier (ties by index). Rank r goes to block r % B of the B blocks (the heaviest open every
// block), then within the block to pass p = (r / B) / W and warp (r / B) % W (W: the product's
// warps per block), backwards on odd passes, slot (block * W + warp) * (64 / W) + pass: each warp
// gets one group of each pass.
// group_map (64 B slots) starts at -1; a thread per group.
__global__ void __launch_bounds__(256) tiled_spmm_balance(const int* __restrict__ kg_ptr, int n_chunks,
                                                          int n_groups, int B, int warps, int* __restrict__ group_map) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n_groups) return;
  const auto load = [&](int g) { return kg_ptr[(long long)(g + 1) * n_chunks] - kg_ptr[(long long)g * n_chunks]; };
  const int mine = load(j);
  int rank = 0;
  for (int i = 0; i < n_groups; ++i) {
    const int other = load(i);
    rank += other > mine || (other == mine && i < j);
  }
  const int block = rank % B, in_block = rank / B;
  const int pass = in_block / warps, pos = in_block % warps;
  const int warp = (pass & 1) ? warps - 1 - pos : pos;
  group_map[(block * warps + warp) * (twell::TSPMM_ROWS / twell::TSPMM_GROUP / warps) + pass] = j;
}

// The product (see the top of this file). Tile (x, y), x fastest, of a persistent 1-D grid:
// output columns [64 x, 64 x + 64) and row-group slots [64 y, 64 y + 64); warp w of WARPS sums
// slots WG w .. WG w + WG - 1 of the tile (WG = 64 / WARPS), slot s being row group s, or with
// group_map (n_slots entries) row group group_map[s] (-1: none).
// Item (group, chunk)'s k-groups are kg_ptr[item] .. kg_ptr[item + 1], item = group * n1 +
// chunk; with FRAGS, frags: the one-hot operands of words (tiled_spmm_fragments), else the
// lanes build them from the words by shuffles (null frags); with PREFETCH, each chunk's words
// are pulled into L1 during the chunk before (prefetch_chunk_words). With words2 and frags2
// (A2's at the same places: the dual form) the block streams B's n1 chunks with words, then
// B2's with words2, into the same sums. map_b / map_b2: TMA descriptors
// of B and B2 [K, N] (boxes of 64 columns x 256 rows, 128-byte swizzle; rows past K read as
// zeros; map_b2 is map_b when there is no B2). Thread 0 refills a stage once every warp has
// released it (tests/test_ring_protocol.py runs this ring as a protocol).
template <typename T, int WARPS, bool FRAGS, bool PREFETCH>
__global__ void __launch_bounds__(WARPS * 32, 1) twell_tiled_spmm(
    const __grid_constant__ twell::TensorMap map_b, const __grid_constant__ twell::TensorMap map_b2,
    const int* __restrict__ kg_ptr, const unsigned* __restrict__ words, const unsigned* __restrict__ words2,
    const uint2* __restrict__ frags, const uint2* __restrict__ frags2, int M, int N, int n1, T* __restrict__ out,
    long long ldo, int* __restrict__ flags, const int* __restrict__ group_map, int n_slots) {
  using namespace twell;
  constexpr int WG = TSPMM_ROWS / TSPMM_GROUP / WARPS;  // row groups per warp
  extern __shared__ __align__(1024) unsigned char raw[];
  const unsigned base = (smem_u32(raw) + 1023u) & ~1023u;
  const unsigned full = base + TSPMM_STAGES * TSPMM_STAGE_BYTES, empty = full + 8 * TSPMM_STAGES;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned g = lane >> 2, t = lane & 3;
  const int n_groups = (M + TSPMM_GROUP - 1) / TSPMM_GROUP;
  const int n_chunks = words2 != nullptr ? 2 * n1 : n1;
  // Tiles (column block, row block) in column-block-fastest order; this block's are blockIdx.x,
  // + gridDim.x, ... (a persistent grid of one block per SM).
  const int col_blocks = (N + TSPMM_COLS - 1) / TSPMM_COLS;
  const int row_slots = max(M, TSPMM_GROUP * n_slots);
  const int n_tiles = col_blocks * ((row_slots + TSPMM_ROWS - 1) / TSPMM_ROWS);
  const int my_tiles = (int)blockIdx.x < n_tiles ? (n_tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
  const int issues = my_tiles * n_chunks;  // chunks streamed through the ring, all tiles
  if (threadIdx.x == 0) {
    for (int s = 0; s < TSPMM_STAGES; ++s) {
      barrier_init(full + 8 * s, 1);             // the refilling thread's expect_tx arrival
      barrier_init(empty + 8 * s, WARPS);  // one arrival per warp done with the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // Issue number `it` (chunk it % n_chunks of this block's tile it / n_chunks) into stage it %
  // TSPMM_STAGES, once every warp has released the stage's previous use (a fresh barrier's
  // "previous phase" counts as done, so the first TSPMM_STAGES pass at once). Issues run on
  // from one tile into the next, so the next tile's first chunks load during this one's last
  // chunks and epilogue. Thread 0 only.
  auto issue = [&](int it) {
    const int s = it % TSPMM_STAGES;
    barrier_wait(empty + 8 * s, ((unsigned)(it / TSPMM_STAGES) & 1u) ^ 1u);
    const int tile = (int)blockIdx.x + (it / n_chunks) * (int)gridDim.x, c = it % n_chunks;
    const unsigned bar = full + 8 * s, dst = base + s * TSPMM_STAGE_BYTES;
    const TensorMap* map = c < n1 ? &map_b : &map_b2;
    const int k0 = (c < n1 ? c : c - n1) * TSPMM_CHUNK, c0 = (tile % col_blocks) * TSPMM_COLS;
    barrier_expect_bytes(bar, TSPMM_STAGE_BYTES);
    tma_load_2d(dst, map, c0, k0, bar);
    tma_load_2d(dst + TSPMM_BOX * 128, map, c0, k0 + TSPMM_BOX, bar);
  };
  if (threadIdx.x == 0)
    for (int it = 0; it < TSPMM_STAGES && it < issues; ++it) issue(it);

  // This lane's ldmatrix row: entry (lane / 16) * 8 + lane % 8 of a k-group, its 16-byte piece
  // (lane / 8) % 2 of each 16 columns (matrices 0-3: entries 0-7 and 8-15, columns 0-7 and 8-15,
  // which .trans turns into a0 .. a3 of A = B^T).
  const unsigned entry = (lane >> 4) * 8 + (lane & 7);
  const unsigned piece = (lane >> 3) & 1;
  int ring = 0;  // chunks consumed so far, all tiles (the ring position and phase)
  for (int tt = 0; tt < my_tiles; ++tt) {
    const int tile = (int)blockIdx.x + tt * (int)gridDim.x;
    const int col0 = (tile % col_blocks) * TSPMM_COLS, row0 = (tile / col_blocks) * TSPMM_ROWS;
    float acc[WG][TSPMM_COL_STEPS][4];
#pragma unroll
    for (int i = 0; i < WG; ++i)
#pragma unroll
      for (int j = 0; j < TSPMM_COL_STEPS; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

    const int group0 = (row0 >> 3) + warp * WG;
    // The row group this lane's ranges and this warp's slot i stand for: the slot's own, or with
    // group_map (tiled_spmm_balance: slots dealt by load) the group mapped there (-1: none).
    auto actual = [&](int slot) {
      const int vg = group0 + slot;
      const int grp = group_map != nullptr ? (vg < n_slots ? __ldg(group_map + vg) : -1) : vg;
      return grp < n_groups ? grp : -1;
    };
    // The warp's k-group ranges at chunk c, one load a lane: lane j < 2 WG holds kg_ptr[item + (j
    // & 1)] of its slot j / 2's group (0 past the groups or the chunks). Loaded ahead (below), so
    // that the L2 latency of the pack overlaps the MMAs instead of stalling the warp at every chunk.
    const int lane_group = actual((lane & 7) >> 1);
    auto ranges = [&](int c) {
      if (c >= n_chunks || lane_group < 0) return 0;
      return __ldg(kg_ptr + (long long)lane_group * n1 + (c < n1 ? c : c - n1) + (lane & 1));
    };
    // Ranges two chunks ahead: the next chunk's are needed at this one's start (the prefetch
    // runs on into it).
    int kp_next = ranges(0), kp_after = ranges(1);
    // The words in hand: always those of the next two k-groups of the warp's sequence (chunk,
    // group, k-group), which runs on from one chunk into the next within a words array (so a
    // chunk's first loads are issued during the previous chunk's last k-groups); `carried` says
    // they were loaded so.
    TiledKGroup cur{0u, {0u, 0u}}, nxt{0u, {0u, 0u}};
    bool carried = false;
    for (int c = 0; c < n_chunks; ++c, ++ring) {
      const int s = ring % TSPMM_STAGES;
      const unsigned parity = (unsigned)(ring / TSPMM_STAGES) & 1u;
      const int kp = kp_next;
      kp_next = kp_after;
      kp_after = ranges(c + 2);
      int k_lo[WG], k_hi[WG];
#pragma unroll
      for (int i = 0; i < WG; ++i) {
        k_lo[i] = __shfl_sync(0xffffffffu, kp, 2 * i);
        k_hi[i] = __shfl_sync(0xffffffffu, kp, 2 * i + 1);
      }
      // Each k-group's word and operand load two k-groups ahead in the warp's sequence: the L2's
      // latency under two k-groups' MMAs (one ahead left the warps stalled on these loads 40% of
      // their cycles on the H200, twenty-sixth session). from1[i] / from2[i]: the first and second
      // k-group of the sequence from group i on (-1: none); from1[WG] / from2[WG] the next
      // chunk's first two, except at the tile's last chunk and before the dual form's switch to
      // A2's words (another array).
      const bool crosses = c + 1 < n_chunks && c + 1 != n1;  // warp-uniform
      int from1[WG + 1], from2[WG + 1];
      from1[WG] = from2[WG] = -1;
      if (crosses) {
#pragma unroll
        for (int i = WG - 1; i >= 0; --i)
          prepend_range(__shfl_sync(0xffffffffu, kp_next, 2 * i), __shfl_sync(0xffffffffu, kp_next, 2 * i + 1),
                        from1[WG], from2[WG]);
      }
#pragma unroll
      for (int i = WG - 1; i >= 0; --i) {
        from1[i] = from1[i + 1];
        from2[i] = from2[i + 1];
        prepend_range(k_lo[i], k_hi[i], from1[i], from2[i]);
      }
      const unsigned* chunk_words = c < n1 ? words : words2;
      const uint2* chunk_frags = c < n1 ? frags : frags2;
      if (PREFETCH && c + 1 < n_chunks) prefetch_chunk_words<WG>(c + 1 < n1 ? words : words2, kp_next, lane);
      if (!carried) {
        cur = tspmm_load<FRAGS>(chunk_words, chunk_frags, entry, lane, from1[0]);
        nxt = tspmm_load<FRAGS>(chunk_words, chunk_frags, entry, lane, from2[0]);
      }
      // The next chunk starts from these loads only where it holds two k-groups or more: with
      // fewer, its sequence's head runs on into the chunk after, which from1[WG] / from2[WG] do
      // not reach (an empty chunk, or one of a single k-group, after a full one left stale words
      // in hand: wrong rows on the H200, thirtieth session), so it loads its own.
      carried = crosses && from2[WG] >= 0;
      barrier_wait(full + 8 * s, parity);
      const unsigned stage_base = base + s * TSPMM_STAGE_BYTES;
#pragma unroll
      for (int i = 0; i < WG; ++i) {
#pragma unroll 2
        for (int kg = k_lo[i]; kg < k_hi[i]; ++kg) {
          const int ahead = kg + 2 < k_hi[i] ? kg + 2 : (kg + 2 == k_hi[i] ? from1[i + 1] : from2[i + 1]);
          const TiledKGroup after = tspmm_load<FRAGS>(chunk_words, chunk_frags, entry, lane, ahead);
          const unsigned row0 = tspmm_row_address(stage_base, cur.mine, piece);
          const uint2 b = FRAGS ? cur.b : tspmm_shuffled_operand(cur.mine, t, g << TSPMM_ROW_SHIFT);
#pragma unroll
          for (int j = 0; j < TSPMM_COL_STEPS; j += 2) {
            unsigned a[4], a2[4];  // two column steps' ldmatrix before their MMAs
            ldmatrix_x4_trans(a, row0 ^ ((unsigned)j << 5));
            ldmatrix_x4_trans(a2, row0 ^ ((unsigned)(j + 1) << 5));
            mma_m16n8k16<T>(acc[i][j], a[0], a[1], a[2], a[3], b.x, b.y);
            mma_m16n8k16<T>(acc[i][j + 1], a2[0], a2[1], a2[2], a2[3], b.x, b.y);
          }
          cur = nxt;
          nxt = after;
        }
      }
      __syncwarp();
      if (lane == 0) barrier_arrive(empty + 8 * s);
      if (threadIdx.x == 0 && ring + TSPMM_STAGES < issues) issue(ring + TSPMM_STAGES);
    }

    // D[m][n] is output column 16 j + m of row n of the group: this lane holds rows 2t, 2t + 1 at
    // columns g (d0, d1) and g + 8 (d2, d3). Lanes g and g ^ 1 swap one value so that each holds
    // two adjacent columns of one row (even g: row 2t, odd g: row 2t + 1) and stores them as one
    // 4-byte pair.
    // A row with a non-finite sum is flagged for tiled_spmm_fixup (see there).
    const bool odd = (g & 1u) != 0;
#pragma unroll
    for (int i = 0; i < WG; ++i) {
      const int grp = actual(i);
      const int row = grp < 0 ? M : grp * TSPMM_GROUP + 2 * (int)t + (odd ? 1 : 0);  // M: nothing to store
      bool bad = false;
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
            bad |= !finite_bits(v0);
            if (col + 1 < N) {
              const unsigned short lo = from_acc<T>(v0).bits, hi = from_acc<T>(v1).bits;
              *reinterpret_cast<unsigned*>(p) = (unsigned)lo | ((unsigned)hi << 16);
              bad |= !finite_bits(v1);
            } else {
              p[0] = from_acc<T>(v0);
            }
          }
        }
      }
      if (bad) flags[row] = 1;
    }
  }  // tiles
}

// The rows of a tiled product whose sums came out non-finite, recomputed exactly. Inside the
// MMA an entry's B row meets all 8 rows of its group (times zero for the 7 others), so an Inf
// or NaN there turns the neighbours' sums into NaN (0 x Inf); twell_tiled_spmm flags every row
// with a non-finite sum, and here a warp per flagged row sums its own entries only (each word
// of its row times its B row, fp32, padding skipped by its mark), as the other paths do: the
// result is theirs, Inf where an entry met an Inf, NaN where they give NaN. Rows without a flag
// return at once (one launch per product, capturable; the flags start zeroed).
template <typename T>
__global__ void __launch_bounds__(256) tiled_spmm_fixup(const int* __restrict__ kg_ptr, const unsigned* __restrict__ words,
                                                       const unsigned* __restrict__ words2, int M, int N, int n1,
                                                       const T* __restrict__ b, long long ldb, const T* __restrict__ b2,
                                                       long long ldb2, const int* __restrict__ flags,
                                                       T* __restrict__ out, long long ldo) {
  using namespace twell;
  const long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= M || flags[row] == 0) return;  // warp-uniform
  const int grp = (int)(row >> 3), r = (int)(row & 7);
  const int n_chunks = words2 != nullptr ? 2 * n1 : n1;
  for (int col0 = 0; col0 < N; col0 += 32 * 8) {
    const int col = col0 + 8 * lane;  // this lane's 8 columns (N is a multiple of 8)
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int c = 0; c < n_chunks; ++c) {
      const bool second = c >= n1;
      const unsigned* w = second ? words2 : words;
      const T* bb = second ? b2 : b;
      const long long ld = second ? ldb2 : ldb;
      const int chunk = second ? c - n1 : c;
      const long long item = (long long)grp * n1 + chunk;
      for (long long e0 = (long long)kg_ptr[item] * TSPMM_KGROUP; e0 < (long long)kg_ptr[item + 1] * TSPMM_KGROUP;
           e0 += 32) {
        const int valid = (int)min(32LL, (long long)kg_ptr[item + 1] * TSPMM_KGROUP - e0);  // 32, or the last 16
        const unsigned mine = lane < valid ? __ldg(w + e0 + lane) : 0u;
        for (int i = 0; i < valid; ++i) {
          const unsigned word = __shfl_sync(0xffffffffu, mine, i);
          if (tspmm_word_row(word) != (unsigned)r || (word & TSPMM_PAD_BIT) != 0u) continue;  // warp-uniform
          T value;
          value.bits = (unsigned short)(word >> 16);
          const float v = to_acc(value);
          if (col < N) {
            const T* src = bb + ((long long)chunk * TSPMM_CHUNK + tspmm_word_b_row(word)) * ld + col;
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[k] += v * to_acc(src[k]);
          }
        }
      }
    }
    if (col < N)
#pragma unroll
      for (int k = 0; k < 8; ++k) out[row * ldo + col + k] = from_acc<T>(acc[k]);
  }
}
