// Weight-stationary SpMM: out = A @ B for a sparse A (M x N) and a dense B (N x K), in the
// 2-byte value types, with fp32 accumulation.
//
// Why a second SpMM beside the row gathers of twell_gather.cu: those read one whole B row from
// L2 for every stored entry of A, so the down projection of the 2B-class FFN (N = 5632,
// K = 2048) moves 1.9 GB through L2 at 0.5% density to use a 23 MB matrix. Here each block
// keeps a slice of 16 columns of all of B in shared memory (N x 32 bytes; 180 KB for N = 5632)
// and streams A's entries past it: B leaves L2 once in total, A's entries (4 bytes each) once
// per slice, and the random row reads land in shared memory.
//
// A is first packed (stationary_pack, after a two-launch scan of the row sizes): each row's
// entries as 32-bit words (column << 16 | value bits), padded to a multiple of 8 with words that
// point at one of four extra zero rows of the slice (rows N .. N + 3) with value 0. So every
// load is a 16-byte vector, the sums need no branch (their shuffles and shared loads overlap),
// and an Inf or NaN in a B row no entry uses cannot leak into the output.
//
// The order of a row's words is chosen against shared-memory bank conflicts. The four groups
// of lanes 0-7 (likewise 8-15, ...) read four 32-byte slice rows in one wavefront only if the
// rows differ modulo 4 (a slice row is a quarter of the 128-byte bank line). Those groups hold
// rows of A that differ modulo 4 and sit at word positions that agree modulo 4 (rows start at
// multiples of 8), so word P of row r should have a column c with (c - r) % 4 == P % 4: its
// "slot class". A row rarely has as many entries of each class, so the pack fills the positions
// greedily: the wanted class while it lasts, else the class with the most entries left (no
// padding: the extra words would cost more issue slots than the conflicts they avoid). Measured
// on the H200 (1% density, 16384 x 5632 @ 5632 x 2048): 2.1 wavefronts per shared load request
// in arbitrary order; a simulation of the greedy order gives 1.3.
//
// The dual form (DUAL = 1) computes out = A @ B + A2 @ B2 for an A2 of A's structure (other
// values; the backward's dX = dZ W_gate + dU W_up): a slice holds 8 columns of B and the same 8
// of B2 side by side (still 32 bytes per row, so the same bank-quarter argument holds), a batch
// holds 8 entries as 16 words [A values x 8 | A2 values x 8], each lane of a group loads and sums
// one product's 8 words (no shuffle), and the group adds its two lanes' sums at the row's end.
//
// Column bands. A slice of a tall B (N x 32 bytes) can outgrow shared memory (N above ~7260 on
// Hopper: d_ff 14336 needs 459 KB). A is then cut into bands of whole row-tiles of its columns,
// each band's slice fits, and one launch per band sums its part of every output row: the first
// band stores its fp32 sums in a workspace (MODE 1, accumulate = 0), middle bands add to it
// (MODE 1, accumulate = 1) and the last adds the workspace and writes T (MODE 2); MODE 0 is a
// single band's plain write. Each band is packed on its own (stationary_row_sizes and
// stationary_pack over tiles t_lo .. t_hi - 1 and the spill entries in those columns), with
// columns counted from the band's first, so the words, the zero rows and the slice are the
// band's. The launches run in stream order, so the sums are deterministic and rounded to T once.
//
// Work split: block (slice, row part), 32 warps; a warp owns a contiguous run of the part's
// rows, and its 16 groups of 2 lanes take rows g, g + 16, ... of that run (static, so a row's
// bounds are read one row ahead). Lane h of a group accumulates output columns 8h .. 8h + 7 of
// the slice. A group takes 8 words at a time (4 per lane, one 16-byte load, two batches more in
// flight), hands each word to both lanes with one shuffle, and each lane loads its 16 bytes of
// that B row from shared memory.
#include "twell_scan.cuh"
#include "twell_slot_class.cuh"
#include "twell_types.cuh"

namespace twell {

constexpr int STATIONARY_COLS = 16;   // output columns per slice: 32 bytes of each B row
constexpr int STATIONARY_WARPS = 32;  // one block of 1024 threads per SM (the slice fills it)
constexpr int STATIONARY_BATCH = 8;   // words per group and step; rows are padded to a multiple
constexpr int STATIONARY_ZERO_ROWS = 4;     // zero rows N .. N + 3 of the slice, one per class
constexpr int STATIONARY_PACK_WARPS = 8;    // warps per pack block, one row each
constexpr int STATIONARY_STAGE_WORDS = 512;  // packed rows up to this long are ordered in shared memory

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

struct ReadSize {
  const int* sizes;
  __device__ long long operator()(long long i) const { return sizes[i]; }
};

// One group's batch: the V 16-byte vectors of words this lane loaded (the group's batch is
// 8 V words: 8 entries, or in the dual form 8 entries of A then the same 8 of A2), the row, and
// whether the batch ends it.
template <int V> struct Batch {
  uint4 words[V];
  int row;
  bool last;
};

// Where a group's next batch starts: its row, the batch's first word, the row's end, and the
// bounds of the group's following row (read one row ahead).
struct Cursor {
  int row, p, end, next_p, next_end;
};

// The group's next batch (this lane's vectors, numbers V h .. V h + V - 1 of the batch), and the
// cursor moved past it; groups step 16 rows at a time.
template <int V>
__device__ __forceinline__ Batch<V> next_batch(Cursor& c, const int* __restrict__ indptr,
                                               const uint4* __restrict__ words, unsigned zero_word, int h,
                                               int run_hi) {
  constexpr int batch_words = STATIONARY_BATCH * V;
  Batch<V> b;
  // An empty row (or a group past its run) still takes one batch: all zero words.
#pragma unroll
  for (int i = 0; i < V; ++i)
    b.words[i] = c.p < c.end ? __ldg(words + (c.p >> 2) + V * h + i)
                             : make_uint4(zero_word, zero_word, zero_word, zero_word);
  b.row = c.row;
  b.last = c.end - c.p <= batch_words;
  if (b.last) {
    c.row += 16;
    c.p = c.next_p;
    c.end = c.next_end;
    c.next_p = c.next_end = 0;
    if (c.row + 16 < run_hi) {
      c.next_p = indptr[c.row + 16];
      c.next_end = indptr[c.row + 17];
    }
  } else {
    c.p += batch_words;
  }
  return b;
}

// The cursor of the group owning row `first` of a warp's run [first, run_hi).
__device__ __forceinline__ Cursor first_cursor(const int* __restrict__ indptr, int row, int run_hi) {
  Cursor c{row, 0, 0, 0, 0};
  if (row < run_hi) {
    c.p = indptr[row];
    c.end = indptr[row + 1];
  }
  if (row + 16 < run_hi) {
    c.next_p = indptr[row + 16];
    c.next_end = indptr[row + 17];
  }
  return c;
}

// The block's slice into shared memory, row j's two 16-byte halves at slice[2j], slice[2j + 1]:
// B[j, c0 : c0 + 16], or (DUAL) B[j, c0 : c0 + 8] and B2[j, c0 : c0 + 8]; rows N .. N + 3
// zeros. K is a multiple of 8: a half is all in or all out.
template <typename T, int DUAL>
__device__ __forceinline__ void stage_slice(uint4* slice, const T* __restrict__ b, long long ldb,
                                            const T* __restrict__ b2, long long ldb2, int N, int K, int c0) {
  for (int i = threadIdx.x; i < 2 * (N + STATIONARY_ZERO_ROWS); i += blockDim.x) {
    const int row = i >> 1, half = i & 1;
    const int col = DUAL ? c0 : c0 + 8 * half;
    const T* src = DUAL && half ? b2 + row * ldb2 : b + row * ldb;
    slice[i] = (col < K && row < N) ? __ldg(reinterpret_cast<const uint4*>(src + col)) : make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();
}

// The warp's contiguous run of rows in this block's row part.
__device__ __forceinline__ void warp_run(int M, int rows_per_part, int& run_lo, int& run_hi) {
  const int part_lo = blockIdx.y * rows_per_part;
  const int part_hi = min(M, part_lo + rows_per_part);
  const int warps = blockDim.x >> 5;
  const int per_warp = (part_hi - part_lo + warps - 1) / warps;
  run_lo = part_lo + (threadIdx.x >> 5) * per_warp;
  run_hi = min(part_hi, run_lo + per_warp);
}

// Run `sum` over a warp's batches in order, three buffers deep: a buffer is refilled right after
// its sums, so two batches' loads are always in flight, and no batch is copied between buffers.
template <int V, typename Sum>
__device__ __forceinline__ void for_each_batch(Cursor& c, const int* __restrict__ indptr,
                                               const uint4* __restrict__ words, unsigned zero_word,
                                               int h, int run_hi, Sum sum) {
  Batch<V> b[3];
#pragma unroll
  for (int i = 0; i < 3; ++i) b[i] = next_batch<V>(c, indptr, words, zero_word, h, run_hi);
  for (;;) {
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      if (!__any_sync(0xffffffffu, b[i].row < run_hi)) return;
      sum(b[i]);
      b[i] = next_batch<V>(c, indptr, words, zero_word, h, run_hi);
    }
  }
}

// Whether column `col` of A lies in the band [col_lo, col_hi).
__device__ __forceinline__ bool in_band(int col, int col_lo, int col_hi) { return col >= col_lo && col < col_hi; }

// Row `row`'s entries in the band: its tiles t_lo .. t_hi - 1 (each lane summing every 32nd) and
// its spill entries in columns [col_lo, col_hi). The whole warp calls it; every lane gets the total.
__device__ __forceinline__ int band_entries(const int* __restrict__ counts, const int* __restrict__ spill_indptr,
                                            const int* __restrict__ spill_cols, long long row, int n_tiles,
                                            int t_lo, int t_hi, int col_lo, int col_hi, int lane) {
  int n = 0;
  for (int t = t_lo + lane; t < t_hi; t += 32) n += counts[row * n_tiles + t];
  for (int i = spill_indptr[row] + lane; i < spill_indptr[row + 1]; i += 32) n += in_band(spill_cols[i], col_lo, col_hi);
  return (int)__reduce_add_sync(0xffffffffu, (unsigned)n);
}

// a[q] for a run-time q without local memory.
__device__ __forceinline__ int pick4(const int (&a)[4], int q) {
  return q == 0 ? a[0] : q == 1 ? a[1] : q == 2 ? a[2] : a[3];
}

// Visit every entry of A's row `row` in the band of tiles t_lo .. t_hi - 1 (those tiles' slots in
// order, then its spill entries in the band's columns) as visit(q, k, word, bits2): the entry's
// slot class q = (column - row) % 4, its rank k among the row's entries of that class, its
// packed word (the column counted from the band's first, col_lo = t_lo * tile_n), and (DUAL)
// A2's value bits there. Returns the row's four class totals. col_lo is a multiple of 4 (tile_n
// is), so a column's class is the same counted from the band's start.
template <typename T, int DUAL, typename Visit>
__device__ __forceinline__ unsigned long long walk_row(
    const T* __restrict__ data, const T* __restrict__ data2, const short* __restrict__ indices,
    const int* __restrict__ counts, const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ spill_vals, const T* __restrict__ spill_vals2, int row, int n_tiles, int tile_n,
    int capacity, int t_lo, int t_hi, Visit visit) {
  const int lane = threadIdx.x & 31;
  const int col_lo = t_lo * tile_n, col_hi = t_hi * tile_n;
  unsigned long long base = 0;  // entries of each class before the current chunk
  for (int t0 = t_lo; t0 < t_hi; t0 += 32) {  // a lane per tile
    const int t = t0 + lane;
    const long long rt = (long long)row * n_tiles + t;
    const int n = t < t_hi ? counts[rt] : 0;
    unsigned long long mine = 0;
    for (int s = 0; s < n; ++s) mine += class_unit((t * tile_n + indices[rt * capacity + s] - row) & 3);
    const unsigned long long incl = (unsigned long long)warp_inclusive_sum((long long)mine);
    unsigned long long rank = base + incl - mine;
    for (int s = 0; s < n; ++s) {
      const long long slot = rt * capacity + s;
      const int col = t * tile_n + indices[slot] - col_lo;
      const int q = (col - row) & 3;
      visit(q, class_field(rank, q), ((unsigned)col << 16) | data[slot].bits, DUAL ? data2[slot].bits : 0);
      rank += class_unit(q);
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  const int s0 = spill_indptr[row], s1 = spill_indptr[row + 1];
  for (int i0 = s0; i0 < s1; i0 += 32) {  // a lane per entry
    const int i = i0 + lane;
    const bool live = i < s1 && in_band(spill_cols[i], col_lo, col_hi);
    const int col = live ? spill_cols[i] - col_lo : 0;
    const int q = (col - row) & 3;
    const int k = ballot_rank(live, q, base);
    if (live) visit(q, k, ((unsigned)col << 16) | spill_vals[i].bits, DUAL ? spill_vals2[i].bits : 0);
  }
  return base;
}

// Where the pack puts entry k of class q when a row is too long to order in shared memory: the
// positions of a layout with each class in its own slots (class q at 4k + q), the slots of
// classes that ran out removed.
__device__ __forceinline__ int compact_position(const int (&n)[4], int q, int k) {
  int p = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) p += min(n[c], k + (c < q ? 1 : 0));
  return p;
}

}  // namespace twell

// Each row's packed length in words in the band of tiles t_lo .. t_hi - 1 (its entries there
// rounded up to a batch of 8; dual: two words per entry), one warp per row (the scan below then
// reads one value per row).
__global__ void __launch_bounds__(256) stationary_row_sizes(
    const int* __restrict__ counts, const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    int n_tiles, int tile_n, int t_lo, int t_hi, int M, int dual, int* __restrict__ sizes) {
  const int row = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= M) return;
  const int n =
      twell::band_entries(counts, spill_indptr, spill_cols, row, n_tiles, t_lo, t_hi, t_lo * tile_n, t_hi * tile_n, lane);
  constexpr int B = twell::STATIONARY_BATCH;  // entries per batch
  if (lane == 0) sizes[row] = (dual ? 2 : 1) * ((n + B - 1) / B * B);
}

// Launch 1 of the row-size scan (cuda/twell_scan.cuh): each chunk's total packed length.
__global__ void __launch_bounds__(twell::SCAN_THREADS) stationary_row_sums(
    const int* __restrict__ sizes, long long M, long long* __restrict__ chunk_sums) {
  const long long s = twell::chunk_sum(blockIdx.x, M, twell::ReadSize{sizes});
  if (threadIdx.x == 0) chunk_sums[blockIdx.x] = s;
}

// Launch 2: the packed rows' pointers.
__global__ void __launch_bounds__(twell::SCAN_THREADS) stationary_row_place(
    const int* __restrict__ sizes, long long M, const long long* __restrict__ chunk_sums,
    int* __restrict__ indptr) {
  using namespace twell;
  const long long base = sum_before(chunk_sums, blockIdx.x);
  chunk_scan(blockIdx.x, M, base, ReadSize{sizes},
             [&](long long i, long long, long long end) { indptr[i + 1] = (int)end; });
  if (threadIdx.x == 0 && blockIdx.x == 0) indptr[0] = 0;
}

namespace twell {

// The arguments every row of one pack launch shares.
template <typename T> struct PackArgs {
  const T* __restrict__ data;
  const T* __restrict__ data2;
  const short* __restrict__ indices;
  const int* __restrict__ counts;
  const int* __restrict__ spill_indptr;
  const int* __restrict__ spill_cols;
  const T* __restrict__ spill_vals;
  const T* __restrict__ spill_vals2;
  int M, n_tiles, tile_n, capacity, t_lo, t_hi, N;
  const int* __restrict__ indptr;
  unsigned* __restrict__ words;
};

// Pack row `row` of A on this lane's segment of WIDTH lanes (see stationary_pack), with
// `room` words of each staging array (walked, bucketed and, DUAL, their A2 halves). Every lane
// of the warp calls it at once (the other segment with its own row): loops that shuffle run
// the warp's largest trip count. A `dead` segment (a row past the last: `row` is then a real row
// read again) writes nothing. WIDTH 16 needs every row of the warp to fit `room`; WIDTH 32 walks
// a longer row twice instead.
template <typename T, int DUAL, int WIDTH>
__device__ __forceinline__ void pack_row(const PackArgs<T>& a, int row, bool dead, unsigned* walked,
                                         unsigned* bucketed, unsigned short* walked2, unsigned short* bucketed2,
                                         int room) {
  const int lane = threadIdx.x & (WIDTH - 1);  // within the segment
  const unsigned seg = segment_mask<WIDTH>(), below = ((1u << (threadIdx.x & 31)) - 1u) & seg;
  // The spill row pointers and the first tiles' counts load beside the packed row pointers
  // (after them they were further round trips to L2 in every row's chain of dependent loads).
  const int s0 = a.spill_indptr[row], s1 = a.spill_indptr[row + 1];
  const int first_counts =
      a.t_lo + lane < a.t_hi ? a.counts[(long long)row * a.n_tiles + a.t_lo + lane] : 0;  // likewise
  const int pos = a.indptr[row];
  const int size = (a.indptr[row + 1] - pos) / (DUAL ? 2 : 1);  // entry positions, rounded up to a batch
  const bool staging = WIDTH < 32 || size <= room;
  // Word offset of entry position P (its A2 word is 8 further in the dual form).
  auto at = [](int P) { return DUAL ? 16 * (P >> 3) + (P & 7) : P; };
  const int col_lo = a.t_lo * a.tile_n, col_hi = a.t_hi * a.tile_n;
  unsigned long long totals = 0;
  int entries = 0;
  if (staging) {
    for (int t0 = a.t_lo; t0 < a.t_hi; t0 += WIDTH) {  // a lane per tile (one band: the same trips)
      const int t = t0 + lane;
      const long long rt = (long long)row * a.n_tiles + t;
      const int n = t0 == a.t_lo ? first_counts : t < a.t_hi ? a.counts[rt] : 0;
      const int first = entries + segment_inclusive_sum<WIDTH>(n) - n;
      for (int s = 0; s < n; ++s) {
        const long long slot = rt * a.capacity + s;
        walked[first + s] = ((unsigned)(t * a.tile_n + a.indices[slot] - col_lo) << 16) | a.data[slot].bits;
        if (DUAL) walked2[first + s] = a.data2[slot].bits;
      }
      entries = __shfl_sync(0xffffffffu, first + n, WIDTH - 1, WIDTH);
    }
    // The band's spill entries, in order, a lane per entry.
    const int spill_steps = (int)__reduce_max_sync(0xffffffffu, (unsigned)((s1 - s0 + WIDTH - 1) / WIDTH));
    for (int k = 0; k < spill_steps; ++k) {
      const int i = s0 + k * WIDTH + lane;
      const bool live = i < s1 && in_band(a.spill_cols[i], col_lo, col_hi);
      const unsigned taken = __ballot_sync(0xffffffffu, live) & seg;
      const int place = entries + __popc(taken & below);
      if (live) {
        walked[place] = ((unsigned)(a.spill_cols[i] - col_lo) << 16) | a.spill_vals[i].bits;
        if (DUAL) walked2[place] = a.spill_vals2[i].bits;
      }
      entries += __popc(taken);
    }
    __syncwarp();
    unsigned long long mine = 0;
    for (int i = lane; i < entries; i += WIDTH) mine += class_unit(((int)(walked[i] >> 16) - row) & 3);
#pragma unroll
    for (int d = WIDTH / 2; d > 0; d >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, d);  // within the segment
    totals = mine;
  } else if constexpr (WIDTH == 32) {
    totals = walk_row<T, DUAL>(a.data, a.data2, a.indices, a.counts, a.spill_indptr, a.spill_cols, a.spill_vals,
                               a.spill_vals2, row, a.n_tiles, a.tile_n, a.capacity, a.t_lo, a.t_hi,
                               [](int, int, unsigned, unsigned) {});
  }
  int n[4], start[4], rem[4], taken[4];
  entries = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    n[c] = class_field(totals, c);
    start[c] = entries;
    entries += n[c];
  }
  if (staging) {
    unsigned long long base = 0;
    const int steps = (int)__reduce_max_sync(0xffffffffu, (unsigned)((entries + WIDTH - 1) / WIDTH));
    for (int k0 = 0; k0 < steps; ++k0) {  // bucketed by class, walk order within each
      const int i = k0 * WIDTH + lane;
      const bool live = i < entries;
      const unsigned word = live ? walked[i] : 0u;
      const int q = ((int)(word >> 16) - row) & 3;
      const int k = segment_ballot_rank<WIDTH, 4>(live, q, base);
      if (live) {
        bucketed[pick4(start, q) + k] = word;
        if (DUAL) bucketed2[pick4(start, q) + k] = walked2[i];
      }
    }
    __syncwarp();
  } else if constexpr (WIDTH == 32) {
    walk_row<T, DUAL>(a.data, a.data2, a.indices, a.counts, a.spill_indptr, a.spill_cols, a.spill_vals,
                      a.spill_vals2, row, a.n_tiles, a.tile_n, a.capacity, a.t_lo, a.t_hi,
                      [&](int q, int k, unsigned word, unsigned bits2) {
                        const int w = pos + at(compact_position(n, q, k));
                        a.words[w] = word;
                        if (DUAL) a.words[w + 8] = (word & 0xffff0000u) | bits2;
                      });
  }
  // The greedy order: while every class lasts (the first 4 * m positions) position P takes entry
  // P / 4 of class P % 4; after that the segment walks the positions in step (the same state in
  // each of its lanes) and each lane keeps the source of its own position. No shuffles: each
  // segment runs its own row's trips.
  const int m = min(min(n[0], n[1]), min(n[2], n[3]));
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    rem[c] = n[c] - m;
    taken[c] = m;
  }
  for (int w0 = 0; w0 < size; w0 += WIDTH) {
    const int p_mine = w0 + lane;
    int src = pick4(start, p_mine & 3) + (p_mine >> 2);
    if (staging) {
      // The tail starts at a multiple of 4, so each step of a round wants a class known here.
      for (int p0 = max(w0, 4 * m); p0 < min(w0 + WIDTH, entries); p0 += 4) {
#pragma unroll
        for (int want = 0; want < 4; ++want) {
          if (p0 + want >= entries) break;
          int q = want;
          if (rem[want] == 0) {  // the class with the most entries left (the first of equals)
            int best = rem[0];
            q = 0;
#pragma unroll
            for (int c = 1; c < 4; ++c)
              if (rem[c] > best) best = rem[c], q = c;
          }
          if (p0 + want == p_mine) src = pick4(start, q) + pick4(taken, q);
#pragma unroll
          for (int c = 0; c < 4; ++c)
            if (c == q) --rem[c], ++taken[c];
        }
      }
    }
    if (dead || p_mine >= size || (!staging && p_mine < entries)) continue;
    // Padding: a zero row of the position's class (rows N .. N + 3 cover the four), value 0.
    const unsigned zero = (unsigned)(a.N + ((row + p_mine - a.N) & 3)) << 16;
    const int w = pos + at(p_mine);
    const bool real = p_mine < entries;
    a.words[w] = real ? bucketed[src] : zero;
    if (DUAL) a.words[w + 8] = real ? (bucketed[src] & 0xffff0000u) | bucketed2[src] : zero;
  }
}

}  // namespace twell

// Pack A's rows (their entries in the band of tiles t_lo .. t_hi - 1, columns counted from the
// band's first; N the band's width) as words at the scanned pointers, in the order of the slot
// classes (see the top of this file). A row of up to STATIONARY_STAGE_WORDS entries is read once
// into shared memory in walk order (its tiles' slots, then its spill), bucketed there by class,
// and read out in the greedy order; a longer one is walked twice (class totals, then each entry
// to compact_position's place). Entry position P is word P, or (DUAL) word P % 8 of the 16-word
// batch P / 8, with A2's word 8 after it.
//
// WIDTH 32: one warp per row. WIDTH 16: two rows per warp, one on each half, each with half of
// the warp's staging (at 0.5-1% density a standard row holds 28-56 entries, so a whole warp
// left most lanes idle in a kernel bound by each row's chain of L2 loads, as the tiled up
// pack's items were, forty-fourth session); a warp whose rows do not both fit their halves packs
// them one after the other on the whole warp. Both widths write the same words.
template <typename T, int DUAL, int WIDTH>
__global__ void __launch_bounds__(twell::STATIONARY_PACK_WARPS * 32) stationary_pack(
    const T* __restrict__ data, const T* __restrict__ data2, const short* __restrict__ indices,
    const int* __restrict__ counts, const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ spill_vals, const T* __restrict__ spill_vals2, int M, int n_tiles, int tile_n,
    int capacity, int t_lo, int t_hi, int N, const int* __restrict__ indptr, unsigned* __restrict__ words) {
  using namespace twell;
  constexpr int W = STATIONARY_PACK_WARPS, S = STATIONARY_STAGE_WORDS;
  __shared__ unsigned staged[W][2][S];
  __shared__ unsigned short staged2[DUAL ? W : 1][2][DUAL ? S : 1];  // A2's value bits (DUAL)
  const PackArgs<T> a{data, data2, indices, counts, spill_indptr, spill_cols, spill_vals, spill_vals2, M,
                      n_tiles, tile_n, capacity, t_lo, t_hi, N, indptr, words};
  const int warp = threadIdx.x >> 5, w2 = DUAL ? warp : 0;
  // The whole warp on one row, in this warp's staging.
  auto whole = [&](int row) {
    pack_row<T, DUAL, 32>(a, row, false, staged[warp][0], staged[warp][1], staged2[w2][0], staged2[w2][1], S);
  };
  if (warp_past_items<WIDTH>(M)) return;
  const int first = (int)warp_first_item<WIDTH>();
  if constexpr (WIDTH == 32) {
    whole(first);
  } else {
    static_assert(WIDTH == 16, "rows on whole warps or half-warps");
    bool dead;
    const int row = segment_item<16>(M, dead);
    const int size = (indptr[row + 1] - indptr[row]) / (DUAL ? 2 : 1);
    if (__any_sync(0xffffffffu, size > S / 2)) {  // a row too long for half the staging
      whole(first);
      __syncwarp();  // the staging is the next row's
      if (first + 1 < M) whole(first + 1);
      return;
    }
    const int h = (threadIdx.x & 16) ? S / 2 : 0, h2 = DUAL ? h : 0;
    pack_row<T, DUAL, 16>(a, row, dead, staged[warp][0] + h, staged[warp][1] + h, staged2[w2][0] + h2,
                          staged2[w2][1] + h2, S / 2);
  }
}

namespace twell {

// Band modes of the SpMM (see "Column bands" at the top of this file).
constexpr int BAND_WHOLE = 0;    // the only band: out = sums, rounded to T
constexpr int BAND_PARTIAL = 1;  // a band before the last: ws = sums (accumulate: ws += sums), fp32
constexpr int BAND_LAST = 2;     // the last band: out = ws + sums, rounded to T

// Hand a row's V sums (output columns col .. col + V - 1) on as MODE says.
template <typename T, int MODE, int V>
__device__ __forceinline__ void emit_sums(const float (&sums)[V], T* __restrict__ out, long long ldo,
                                          float* __restrict__ ws, long long ldw, int accumulate, int row, int col) {
  static_assert(V == 4 || V == 8, "a lane's sums are 4 or 8 columns");
  float v[V];
#pragma unroll
  for (int k = 0; k < V; ++k) v[k] = sums[k];
  if constexpr (MODE != BAND_WHOLE) {
    float4* w = reinterpret_cast<float4*>(ws + row * ldw + col);
#pragma unroll
    for (int k = 0; k < V / 4; ++k) {
      if (MODE == BAND_LAST || accumulate) {
        const float4 prior = w[k];
        v[4 * k] += prior.x, v[4 * k + 1] += prior.y, v[4 * k + 2] += prior.z, v[4 * k + 3] += prior.w;
      }
      if (MODE == BAND_PARTIAL) w[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    }
  }
  if constexpr (MODE == BAND_PARTIAL) {
    return;
  } else if constexpr (V == 8) {
    uint4 o;
    o.x = pack2<T>(v[0], v[1]);
    o.y = pack2<T>(v[2], v[3]);
    o.z = pack2<T>(v[4], v[5]);
    o.w = pack2<T>(v[6], v[7]);
    *reinterpret_cast<uint4*>(out + row * ldo + col) = o;
  } else {
    uint2 o;
    o.x = pack2<T>(v[0], v[1]);
    o.y = pack2<T>(v[2], v[3]);
    *reinterpret_cast<uint2*>(out + row * ldo + col) = o;
  }
}

}  // namespace twell

// out = A @ B (DUAL: + A2 @ B2) for A packed by stationary_pack, or one band's part of it (MODE,
// with the fp32 workspace ws of leading dimension ldw; unused by BAND_WHOLE).
template <typename T, int DUAL, int MODE>
__global__ void __launch_bounds__(twell::STATIONARY_WARPS * 32, 1) twell_stationary_spmm(
    const int* __restrict__ indptr, const uint4* __restrict__ words, int M, int N,
    const T* __restrict__ b, long long ldb, const T* __restrict__ b2, long long ldb2, int K,
    T* __restrict__ out, long long ldo, float* __restrict__ ws, long long ldw, int accumulate, int rows_per_part) {
  using namespace twell;
  extern __shared__ uint4 slice[];  // stage_slice's layout
  const int c0 = blockIdx.x * (DUAL ? STATIONARY_COLS / 2 : STATIONARY_COLS);
  stage_slice<T, DUAL>(slice, b, ldb, b2, ldb2, N, K, c0);
  const int lane = threadIdx.x & 31, h = lane & 1;
  int run_lo, run_hi;
  warp_run(M, rows_per_part, run_lo, run_hi);
  const bool writes = DUAL ? c0 < K : c0 + 8 * h < K;
  // The dual form's lane h sums A's (h = 0) or A2's (h = 1) product from its half of each row.
  const char* lane_slice = reinterpret_cast<const char*>(slice) + 16 * h;
  const unsigned zero_word = (unsigned)N << 16;

  Cursor c = first_cursor(indptr, run_lo + (lane >> 1), run_hi);
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  // One word's product: its B row's 8 columns (this lane's 16 bytes) times its value.
  auto add_word = [&](unsigned w, const uint4& bv) {
    const float a = to_acc(T{(unsigned short)(w & 0xffffu)});
    const unsigned parts[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float lo, hi;
      unpack2(parts[k], T{}, lo, hi);
      acc[2 * k] = fmaf(a, lo, acc[2 * k]);
      acc[2 * k + 1] = fmaf(a, hi, acc[2 * k + 1]);
    }
  };
  for_each_batch<1 + DUAL>(c, indptr, words, zero_word, h, run_hi, [&](const Batch<1 + DUAL>& bt) {
    const unsigned mine[4] = {bt.words[0].x, bt.words[0].y, bt.words[0].z, bt.words[0].w};
    if (DUAL) {  // this lane's own 8 words: the batch's 8 entries of its product
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const unsigned w[4] = {bt.words[v].x, bt.words[v].y, bt.words[v].z, bt.words[v].w};
        uint4 bv[4];
#pragma unroll
        for (int s = 0; s < 4; ++s) bv[s] = *reinterpret_cast<const uint4*>(lane_slice + (w[s] >> 16) * 32);
#pragma unroll
        for (int s = 0; s < 4; ++s) add_word(w[s], bv[s]);
      }
    } else {  // the group's 8 words, 4 from each lane
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        unsigned w[4];
        uint4 bv[4];
#pragma unroll
        for (int s = 0; s < 4; ++s) w[s] = __shfl_sync(0xffffffffu, mine[s], (lane & ~1) | half);
#pragma unroll
        for (int s = 0; s < 4; ++s) bv[s] = *reinterpret_cast<const uint4*>(lane_slice + (w[s] >> 16) * 32);
#pragma unroll
        for (int s = 0; s < 4; ++s) add_word(w[s], bv[s]);
      }
    }
    // The dual form's two products summed, lane h keeping columns 4h .. 4h + 3 of the 8: in
    // every batch, by the whole warp (at a row's end only, the shuffle would run divergent).
    float sum[4];
    if (DUAL) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float other = __shfl_xor_sync(0xffffffffu, h ? acc[k] : acc[k + 4], 1);
        sum[k] = (h ? acc[k + 4] : acc[k]) + other;
      }
    }
    if (bt.last) {
      if (bt.row < run_hi && writes) {
        if (DUAL)
          emit_sums<T, MODE>(sum, out, ldo, ws, ldw, accumulate, bt.row, c0 + 4 * h);
        else
          emit_sums<T, MODE>(acc, out, ldo, ws, ldw, accumulate, bt.row, c0 + 8 * h);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = 0.f;
    }
  });
}
