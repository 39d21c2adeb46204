// The stationary SpMM's pack of one row (cuda/twell_stationary.cu explains the layout and the
// slot classes): shared by its pack kernel and by the gated consumer's up projection, which packs
// the rows of h as it computes them (cuda/twell_gather.cu, twell_gather_gated_up_packed) so that
// h never makes a second trip through L2 for a separate pack launch.
#pragma once
#include "twell_scan.cuh"
#include "twell_slot_class.cuh"

namespace twell {

// a[q] for a run-time q without local memory.
__device__ __forceinline__ int pick4(const int (&a)[4], int q) {
  return q == 0 ? a[0] : q == 1 ? a[1] : q == 2 ? a[2] : a[3];
}

// Visit every entry of A's row `row` (its tiles' slots in order, then its spill entries) as
// visit(q, k, word, bits2): the entry's slot class q = (column - row) % 4, its rank k among the
// row's entries of that class, its packed word, and (DUAL) A2's value bits there. Returns the
// row's four class totals.
template <typename T, int DUAL, typename Visit>
__device__ __forceinline__ unsigned long long walk_row(
    const T* data, const T* data2, const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols, const T* spill_vals,
    const T* spill_vals2, int row, int n_tiles, int tile_n,
    int capacity, Visit visit) {
  const int lane = threadIdx.x & 31;
  unsigned long long base = 0;  // entries of each class before the current chunk
  for (int t0 = 0; t0 < n_tiles; t0 += 32) {  // a lane per tile
    const int t = t0 + lane;
    const long long rt = (long long)row * n_tiles + t;
    const int n = t < n_tiles ? counts[rt] : 0;
    unsigned long long mine = 0;
    for (int s = 0; s < n; ++s) mine += class_unit((t * tile_n + indices[rt * capacity + s] - row) & 3);
    const unsigned long long incl = (unsigned long long)warp_inclusive_sum((long long)mine);
    unsigned long long rank = base + incl - mine;
    for (int s = 0; s < n; ++s) {
      const long long slot = rt * capacity + s;
      const int col = t * tile_n + indices[slot];
      const int q = (col - row) & 3;
      visit(q, class_field(rank, q), ((unsigned)col << 16) | data[slot].bits, DUAL ? data2[slot].bits : 0);
      rank += class_unit(q);
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  const int s0 = spill_indptr[row], s1 = spill_indptr[row + 1];
  for (int i0 = s0; i0 < s1; i0 += 32) {  // a lane per entry
    const int i = i0 + lane;
    const bool live = i < s1;
    const int col = live ? spill_cols[i] : 0;
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

// The four class totals of a row staged in shared memory: its `entries` words (column << 16 |
// value bits) in walk order. The whole warp calls it; every lane gets the totals.
__device__ __forceinline__ unsigned long long staged_class_totals(const unsigned* walked, int entries, int row) {
  const int lane = threadIdx.x & 31;
  unsigned long long mine = 0;
  for (int i = lane; i < entries; i += 32) mine += class_unit(((int)(walked[i] >> 16) - row) & 3);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, d);
  return mine;
}

// A row's operands as walk_row reads them: values (data2 / spill_vals2: A2's, DUAL), the
// tile-local indices, the counts and the spill CSR.
template <typename T> struct RowSource {
  const T* data;
  const T* data2;
  const short* indices;
  const int* counts;
  const int* spill_indptr;
  const int* spill_cols;
  const T* spill_vals;
  const T* spill_vals2;
  int n_tiles, tile_n, capacity;
};

template <typename T, int DUAL, typename Visit>
__device__ __forceinline__ unsigned long long walk_row(const RowSource<T>& s, int row, Visit visit) {
  return walk_row<T, DUAL>(s.data, s.data2, s.indices, s.counts, s.spill_indptr, s.spill_cols, s.spill_vals,
                           s.spill_vals2, row, s.n_tiles, s.tile_n, s.capacity, visit);
}

// Writes row `row`'s packed words at words[pos ..): `size` entry positions (rounded up to a
// batch; DUAL: batches of 16 words, A's 8 then A2's 8), in the greedy class order, padding
// with words of the zero rows N .. N + 3. `totals` are the row's class totals. With `staging`,
// the row's words sit in walked[] in walk order (walked2: A2's value bits, DUAL) and are
// bucketed through bucketed[] / bucketed2[] (as long as walked); without, the row is too long
// for shared memory and is walked again from `source`, each entry going to its
// compact_position. The whole warp calls it.
template <typename T, int DUAL>
__device__ __forceinline__ void pack_row_words(int row, int pos, int size, int N, unsigned long long totals,
                                               bool staging, const unsigned* walked, const unsigned short* walked2,
                                               unsigned* bucketed, unsigned short* bucketed2,
                                               unsigned* __restrict__ words, const RowSource<T>& source) {
  const int lane = threadIdx.x & 31;
  // Word offset of entry position P (its A2 word is 8 further in the dual form).
  auto at = [](int P) { return DUAL ? 16 * (P >> 3) + (P & 7) : P; };
  int n[4], start[4], rem[4], taken[4];
  int entries = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    n[c] = class_field(totals, c);
    start[c] = entries;
    entries += n[c];
  }
  if (staging) {
    unsigned long long base = 0;
    for (int i0 = 0; i0 < entries; i0 += 32) {  // bucketed by class, walk order within each
      const int i = i0 + lane;
      const bool live = i < entries;
      const unsigned word = live ? walked[i] : 0u;
      const int q = ((int)(word >> 16) - row) & 3;
      const int k = ballot_rank(live, q, base);
      if (live) {
        bucketed[pick4(start, q) + k] = word;
        if (DUAL) bucketed2[pick4(start, q) + k] = walked2[i];
      }
    }
    __syncwarp();
  } else {
    walk_row<T, DUAL>(source, row, [&](int q, int k, unsigned word, unsigned bits2) {
      const int w = pos + at(compact_position(n, q, k));
      words[w] = word;
      if (DUAL) words[w + 8] = (word & 0xffff0000u) | bits2;
    });
  }
  // The greedy order: while every class lasts (the first 4 * m positions) position P takes entry
  // P / 4 of class P % 4; after that the warp walks the positions in step (the same state in
  // every lane) and each lane keeps the source of its own position.
  const int m = min(min(n[0], n[1]), min(n[2], n[3]));
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    rem[c] = n[c] - m;
    taken[c] = m;
  }
  for (int w0 = 0; w0 < size; w0 += 32) {
    const int p_mine = w0 + lane;
    int src = pick4(start, p_mine & 3) + (p_mine >> 2);
    if (staging) {
      // The tail starts at a multiple of 4, so each step of a round wants a class known here.
      for (int p0 = max(w0, 4 * m); p0 < min(w0 + 32, entries); p0 += 4) {
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
    if (p_mine >= size || (!staging && p_mine < entries)) continue;
    // Padding: a zero row of the position's class (rows N .. N + 3 cover the four), value 0.
    const unsigned zero = (unsigned)(N + ((row + p_mine - N) & 3)) << 16;
    const int w = pos + at(p_mine);
    const bool real = p_mine < entries;
    words[w] = real ? bucketed[src] : zero;
    if (DUAL) words[w + 8] = real ? (bucketed[src] & 0xffff0000u) | bucketed2[src] : zero;
  }
}

}  // namespace twell
