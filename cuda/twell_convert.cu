// Conversions between dense, CSR and TwELL storage (see docs/FORMAT.md for the layout).
//
// Every conversion that produces TwELL runs in up to two passes over the same input: pass 1
// fills the slots and records each row-tile's true nonzero count; the host then applies the
// overflow policy and, only when some row-tile overflowed under overflow="spill", launches pass
// 2 (spill_offsets != nullptr) which writes the excess entries to the spill CSR at offsets the
// host computed by a prefix sum. Nothing is ever written past a row-tile's capacity.
#include "twell_rows.cuh"
#include "twell_scan.cuh"
#include "twell_types.cuh"

using namespace twell;

// A warp's row-tiles rt = warp, warp + n_warps, ... (a persistent grid): lanes read
// consecutive runs of V columns (one 16-byte load when the run is whole and `vector_ok` says rows
// are 16-byte aligned), keep the entries the activation/threshold selects, and a warp prefix sum
// gives each kept entry its slot, so the output is canonical (columns increasing) with no sort.
// The first run of the warp's next row-tile is loaded before the current one is processed, so
// the streaming read always has a request in flight per warp.
template <typename T, int ACT>
__global__ void __launch_bounds__(256, 4) dense_to_twell(
    const T* __restrict__ x, long long ldx, int vector_ok, int M, int N, int tile_n, int n_tiles,
    int capacity, double threshold, T* __restrict__ data, short* __restrict__ indices, int* __restrict__ counts,
    int* __restrict__ row_tile_nnz, const long long* __restrict__ spill_offsets,
    int* __restrict__ spill_indices, T* __restrict__ spill_data) {
  constexpr int V = sizeof(T) >= 8 ? 2 : 16 / (int)sizeof(T);
  const long long n_warps = (gridDim.x * (long long)blockDim.x) >> 5;
  const int lane = threadIdx.x & 31;
  const bool spill_pass = spill_offsets != nullptr;
  // The first run of row-tile (row, tile), when it is a whole aligned vector.
  auto first_run = [&](long long row, int tile, Chunk<T, V>& chunk) {
    const int col0 = tile * tile_n;
    const int c0 = col0 + lane * V;
    if (row < M && vector_ok && c0 + V <= min(col0 + tile_n, N))
      chunk = *reinterpret_cast<const Chunk<T, V>*>(x + row * ldx + c0);
  };
  // Walk (row, tile) without a 64-bit division per row-tile: only the start and step divide.
  const long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const long long step_row = n_warps / n_tiles;
  const int step_tile = (int)(n_warps % n_tiles);
  long long row = warp / n_tiles;
  int tile = (int)(warp % n_tiles);
  Chunk<T, V> next;
  first_run(row, tile, next);
  while (row < M) {  // warp-uniform
    const long long rt = row * n_tiles + tile;
    long long next_row = row + step_row;
    int next_tile = tile + step_tile;
    if (next_tile >= n_tiles) {
      next_tile -= n_tiles;
      ++next_row;
    }
    const Chunk<T, V> first = next;
    first_run(next_row, next_tile, next);
    const int col0 = tile * tile_n;
    const long long this_row = row;
    row = next_row;
    tile = next_tile;
    long long spill_base = 0;
    if (spill_pass) {
      if (row_tile_nnz[rt] <= capacity) continue;  // warp-uniform
      spill_base = spill_offsets[rt];
    }
    const int col_end = min(col0 + tile_n, N);
    const T* xrow = x + this_row * ldx;
    const long long slot0 = rt * capacity;
    int found = 0;
    for (int base = col0; base < col_end; base += 32 * V) {
      T v[V];
      bool k[V];
      int local = 0;
      const int c0 = base + lane * V;
      if (vector_ok && c0 + V <= col_end) {
        const Chunk<T, V> chunk = base == col0 ? first : *reinterpret_cast<const Chunk<T, V>*>(xrow + c0);
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = chunk.v[j];
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = c0 + j < col_end ? xrow[c0 + j] : zero_value<T>();
      }
#pragma unroll
      for (int j = 0; j < V; ++j) {
        k[j] = false;
        if (c0 + j < col_end) {
          // Non-identity activations store the activated value rounded to T, and decide on it.
          if (ACT != ACT_IDENTITY) v[j] = from_acc<T>(activate<ACT>(to_acc(v[j])));
          k[j] = keep(to_acc(v[j]), threshold);
          local += k[j];
        }
      }
      int incl = local;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
      }
      int pos = found + incl - local;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (!k[j]) continue;
        const int c = base + lane * V + j;
        if (!spill_pass) {
          if (pos < capacity) {
            data[slot0 + pos] = v[j];
            indices[slot0 + pos] = (short)(c - col0);
          }
        } else if (pos >= capacity) {
          spill_data[spill_base + pos - capacity] = v[j];
          spill_indices[spill_base + pos - capacity] = c;
        }
        ++pos;
      }
      found += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (!spill_pass) {
      for (int s = found + lane; s < capacity; s += 32) {
        data[slot0 + s] = zero_value<T>();
        indices[slot0 + s] = -1;
      }
      if (lane == 0) {
        counts[rt] = min(found, capacity);
        row_tile_nnz[rt] = found;
      }
    }
  }
}

// Pack relu(x @ w.T) from the GEMM output `h` (already relu'd, row-major, row stride ldh) and
// cuBLASLt's ReLU bit-mask (`mask`, ld_words 32-bit words per token row, bit f set where the
// GEMM result was positive): only the values whose bit is set are read, 1/16 of the bytes a
// dense bf16 scan reads at low density. Lanes own 32-column words; a warp covers 32 words, i.e.
// 32 / W row-tiles of W = tile_n / 32 words, and a segmented scan over each tile's W lanes gives
// every kept entry its slot, so the output is canonical (increasing columns). A set bit whose
// stored value is zero is not kept (the format stores nonzeros only). Two passes as in
// dense_to_twell: pass 1 fills the slots and counts, pass 2 (spill_offsets given) the spill.
// With `staged` (capacity a multiple of 8, dynamic shared memory of blockDim / W row-tiles'
// slots), pass 1 assembles each row-tile's slots in shared memory and writes them out as whole
// 16-byte vectors: a row-tile's slots are contiguous, and two-byte stores scattered over them
// would cost the L2 partial-sector writes.
// One (row-tile, word) unit of relu_mask_to_twell (every lane of a warp calls it together).
template <typename T>
__device__ __forceinline__ void relu_mask_unit(
    long long unit, const T* __restrict__ h, long long ldh, const unsigned* __restrict__ mask, long long ld_words,
    int M, int N, int tile_n, int n_tiles, int capacity, int staged, T* __restrict__ data,
    short* __restrict__ indices, int* __restrict__ counts, int* __restrict__ row_tile_nnz,
    const long long* __restrict__ spill_offsets, int* __restrict__ spill_indices, T* __restrict__ spill_data) {
  const int lane = threadIdx.x & 31;
  const int W = tile_n >> 5;  // words per tile: a power of two from 1 to 32
  const long long rt = unit / W;
  const int sub = (int)(unit % W);
  const bool live = rt < (long long)M * n_tiles;  // whole segments are live or not (W divides 32)
  const long long row = live ? rt / n_tiles : 0;
  const int tile = live ? (int)(rt % n_tiles) : 0;
  const int col0 = tile * tile_n + sub * 32;
  const bool spill_pass = spill_offsets != nullptr;
  const bool active = live && (!spill_pass || row_tile_nnz[rt] > capacity);
  unsigned kept = 0u;
  const T* hrow = h + row * ldh;
  if (active && col0 < N) {
    unsigned bits = mask[row * ld_words + (col0 >> 5)];
    if (N - col0 < 32) bits &= (1u << (N - col0)) - 1u;
    for (unsigned b = bits; b; b &= b - 1) {  // keep set bits whose value is nonzero
      const int j = __ffs(b) - 1;
      if (to_acc(hrow[col0 + j]) != 0) kept |= 1u << j;
    }
  }
  const int cnt = __popc(kept);
  int incl = cnt;
  for (int o = 1; o < W; o <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, incl, o, W);
    if ((lane & (W - 1)) >= o) incl += t;
  }
  const int total = __shfl_sync(0xffffffffu, incl, W - 1, W);
  if (!active) return;  // after the shuffles: every lane took part in them
  const long long slot0 = rt * capacity;
  int pos = incl - cnt;
  if (staged && !spill_pass) {
    // The segment's row-tile in shared memory: values of all the block's row-tiles first, then
    // their indices (both 16-byte aligned, as capacity is a multiple of 8).
    extern __shared__ __align__(16) unsigned char stage[];
    const int seg = threadIdx.x / W, n_seg = blockDim.x / W;
    T* s_data = reinterpret_cast<T*>(stage) + (long long)seg * capacity;
    short* s_idx = reinterpret_cast<short*>(reinterpret_cast<T*>(stage) + (long long)n_seg * capacity) + seg * capacity;
    for (unsigned b = kept; b; b &= b - 1, ++pos) {
      const int j = __ffs(b) - 1;
      if (pos < capacity) {
        s_data[pos] = hrow[col0 + j];
        s_idx[pos] = (short)(sub * 32 + j);
      }
    }
    for (int s = total + sub; s < capacity; s += W) {
      s_data[s] = zero_value<T>();
      s_idx[s] = -1;
    }
    // Segments are live (and active) whole, so the segment's lanes meet here.
    __syncwarp(W == 32 ? 0xffffffffu : ((1u << W) - 1u) << (lane & ~(W - 1)));
    const int data_vectors = capacity * (int)sizeof(T) / 16, index_vectors = capacity / 8;
    for (int v = sub; v < data_vectors + index_vectors; v += W) {
      if (v < data_vectors)
        reinterpret_cast<uint4*>(data + slot0)[v] = reinterpret_cast<const uint4*>(s_data)[v];
      else
        reinterpret_cast<uint4*>(indices + slot0)[v - data_vectors] = reinterpret_cast<const uint4*>(s_idx)[v - data_vectors];
    }
    if (sub == 0) {
      counts[rt] = min(total, capacity);
      row_tile_nnz[rt] = total;
    }
    return;
  }
  for (unsigned b = kept; b; b &= b - 1, ++pos) {
    const int j = __ffs(b) - 1;
    if (!spill_pass) {
      if (pos < capacity) {
        data[slot0 + pos] = hrow[col0 + j];
        indices[slot0 + pos] = (short)(sub * 32 + j);
      }
    } else if (pos >= capacity) {
      spill_data[spill_offsets[rt] + pos - capacity] = hrow[col0 + j];
      spill_indices[spill_offsets[rt] + pos - capacity] = col0 + j;
    }
  }
  if (!spill_pass) {
    for (int s = total + sub; s < capacity; s += W) {
      data[slot0 + s] = zero_value<T>();
      indices[slot0 + s] = -1;
    }
    if (sub == 0) {
      counts[rt] = min(total, capacity);
      row_tile_nnz[rt] = total;
    }
  }
}

// The pack's kernel. Pass 1 (SPILL_PASS = 0): a thread per (row-tile, word) unit. Pass 2
// (SPILL_PASS = 1, spill_offsets given) concerns only the row-tiles that overflow, usually none:
// a grid of a few blocks per SM whose warps stride over the row-tiles 32 at a time, one count
// per lane, and run the units of the overflowing ones only, 32 / W row-tiles per round (a lane
// group each). A thread per unit there cost 0.13 ms at 131072 tokens with nothing to spill (23M
// units, each waiting on one count; bench/NOTES.md, forty-second and forty-third sessions). Two
// instantiations rather than one kernel with a run-time branch: the branch cost pass 1 registers
// and stack spills.
template <typename T, int SPILL_PASS>
__global__ void __launch_bounds__(256) relu_mask_to_twell(
    const T* __restrict__ h, long long ldh, const unsigned* __restrict__ mask, long long ld_words, int M, int N,
    int tile_n, int n_tiles, int capacity, int staged, T* __restrict__ data, short* __restrict__ indices,
    int* __restrict__ counts, int* __restrict__ row_tile_nnz, const long long* __restrict__ spill_offsets,
    int* __restrict__ spill_indices, T* __restrict__ spill_data) {
  if constexpr (!SPILL_PASS) {
    relu_mask_unit(blockIdx.x * (long long)blockDim.x + threadIdx.x, h, ldh, mask, ld_words, M, N, tile_n, n_tiles,
                   capacity, staged, data, indices, counts, row_tile_nnz, spill_offsets, spill_indices, spill_data);
    return;
  }
  const int lane = threadIdx.x & 31, W = tile_n >> 5, group = lane / W;
  const long long n_rt = (long long)M * n_tiles, warps = ((long long)gridDim.x * blockDim.x) >> 5;
  const long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  for (long long base = warp * 32; base < n_rt; base += warps * 32) {  // uniform per warp
    const long long mine = base + lane;
    unsigned over = __ballot_sync(0xffffffffu, mine < n_rt && row_tile_nnz[mine] > capacity);
    while (over) {
      int pick = -1;  // lane group g takes the g-th overflowing row-tile left
      for (int g = 0; g < 32 / W && over; ++g, over &= over - 1)
        if (g == group) pick = __ffs(over) - 1;
      const long long rt = pick >= 0 ? base + pick : n_rt;  // n_rt: a dead unit
      relu_mask_unit(rt * W + (lane & (W - 1)), h, ldh, mask, ld_words, M, N, tile_n, n_tiles, capacity, 0, data,
                     indices, counts, row_tile_nnz, spill_offsets, spill_indices, spill_data);
    }
  }
}

// Largest r in [0, n) with a[r] <= v (a non-decreasing, a[0] <= v).
__device__ __forceinline__ int last_le(const int* a, int n, long long v) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a[mid] <= v) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// First i in [lo, hi) with a[i] >= v, or hi.
__device__ __forceinline__ int first_ge(const int* a, int lo, int hi, int v) {
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a[mid] < v) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Canonical CSR (sorted columns, no duplicates) to TwELL; one thread per stored entry. The
// caller zero-fills data, fills indices with -1 and row_tile_nnz with 0.
template <typename T>
__global__ void __launch_bounds__(256) csr_to_twell(
    const int* __restrict__ indptr, const int* __restrict__ cols, const T* __restrict__ vals,
    int M, long long nnz, int tile_n, int n_tiles, int capacity, T* __restrict__ data,
    short* __restrict__ indices, int* __restrict__ row_tile_nnz,
    const long long* __restrict__ spill_offsets, int* __restrict__ spill_indices,
    T* __restrict__ spill_data) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= nnz) return;
  const int row = last_le(indptr, M + 1, i);
  const int c = cols[i];
  const int tile = c / tile_n;
  const int first = first_ge(cols, indptr[row], (int)i, tile * tile_n);
  const int pos = (int)i - first;
  const long long rt = (long long)row * n_tiles + tile;
  if (spill_offsets != nullptr) {
    if (pos >= capacity) {
      spill_data[spill_offsets[rt] + pos - capacity] = vals[i];
      spill_indices[spill_offsets[rt] + pos - capacity] = c;
    }
    return;
  }
  if (pos < capacity) {
    data[rt * capacity + pos] = vals[i];
    indices[rt * capacity + pos] = (short)(c - tile * tile_n);
  }
  if (i + 1 == indptr[row + 1] || cols[i + 1] >= (tile + 1) * tile_n) row_tile_nnz[rt] = pos + 1;
}

// TwELL slots to dense (the caller zero-fills out); one thread per slot.
template <typename T>
__global__ void __launch_bounds__(256) twell_scatter_dense(
    const T* __restrict__ data, const short* __restrict__ indices, const int* __restrict__ counts,
    int M, int n_tiles, int tile_n, int capacity, T* __restrict__ out, long long ldo) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= (long long)M * n_tiles * capacity) return;
  const long long rt = i / capacity;
  if ((int)(i % capacity) >= counts[rt]) return;
  const long long row = rt / n_tiles;
  const int tile = (int)(rt % n_tiles);
  out[row * ldo + tile * tile_n + indices[i]] = data[i];
}

// Spill CSR to dense; one warp per row.
template <typename T>
__global__ void __launch_bounds__(256) spill_scatter_dense(
    const int* __restrict__ indptr, const int* __restrict__ cols, const T* __restrict__ vals,
    int M, T* __restrict__ out, long long ldo) {
  const long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  if (row >= M) return;
  for (int i = indptr[row] + (threadIdx.x & 31); i < indptr[row + 1]; i += 32)
    out[row * ldo + cols[i]] = vals[i];
}

// Per row-tile: how many entries it holds in total (slots + spill) and where its spill entries
// start. One thread per row-tile; spill columns are sorted within each row.
__global__ void __launch_bounds__(256) twell_tile_totals(
    const int* __restrict__ counts, const int* __restrict__ spill_indptr,
    const int* __restrict__ spill_cols, int M, int n_tiles, int tile_n, int* __restrict__ totals,
    int* __restrict__ spill_start) {
  const long long rt = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (rt >= (long long)M * n_tiles) return;
  const int row = (int)(rt / n_tiles), tile = (int)(rt % n_tiles);
  const int lo = first_ge(spill_cols, spill_indptr[row], spill_indptr[row + 1], tile * tile_n);
  const int hi = first_ge(spill_cols, lo, spill_indptr[row + 1], (tile + 1) * tile_n);
  totals[rt] = counts[rt] + (hi - lo);
  spill_start[rt] = lo;
}

// TwELL slots to CSR at the row-tile offsets computed from twell_tile_totals; one thread per slot.
template <typename T>
__global__ void __launch_bounds__(256) twell_slots_to_csr(
    const T* __restrict__ data, const short* __restrict__ indices, const int* __restrict__ counts,
    const long long* __restrict__ offsets, int M, int n_tiles, int tile_n, int capacity,
    int* __restrict__ out_cols, T* __restrict__ out_vals) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= (long long)M * n_tiles * capacity) return;
  const long long rt = i / capacity;
  const int s = (int)(i % capacity);
  if (s >= counts[rt]) return;
  const int tile = (int)(rt % n_tiles);
  out_cols[offsets[rt] + s] = tile * tile_n + indices[i];
  out_vals[offsets[rt] + s] = data[i];
}

// Spill entries to CSR, after their row-tile's slot entries; one thread per spill entry.
template <typename T>
__global__ void __launch_bounds__(256) twell_spill_to_csr(
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ spill_vals, const int* __restrict__ counts,
    const int* __restrict__ spill_start, const long long* __restrict__ offsets, int M,
    int n_tiles, int tile_n, int* __restrict__ out_cols, T* __restrict__ out_vals) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= spill_indptr[M]) return;
  const int row = last_le(spill_indptr, M + 1, i);
  const int c = spill_cols[i];
  const long long rt = (long long)row * n_tiles + c / tile_n;
  const long long dst = offsets[rt] + counts[rt] + (i - spill_start[rt]);
  out_cols[dst] = c;
  out_vals[dst] = spill_vals[i];
}

// ---------------------------------------------------------------------------------------------
// The structure of A.T by a stable counting sort, with no host read (so a backward pass that
// uses it can be captured in a CUDA graph) and no ordering between threads. Rows are grouped in
// blocks of 32. twell_transpose_mark sets bit (row % 32) of word bits[col * n_blocks + row / 32]
// for every stored entry; the word's popcount is the (column, block) pair's entry count, an
// exclusive scan of those counts in that column-major order (twell_transpose_sums, then
// twell_transpose_first) gives each pair its first position, and A.T's row pointers are the
// scan at each column's first block. Then
// twell_transpose_place puts every entry at its pair's first position plus the number of earlier
// rows of its block in the word: each column's tokens come out increasing, as a sort by (column,
// row) orders them, which keeps the transposed products' fp32 sums deterministic. An entry's
// source is its position in the slots followed by the spill, through which the products read
// the values of any matrix of this structure. Both passes take one thread per row-tile, then one
// per allocated spill entry (transpose_item).

// Visit work item j's entries as visit(row, col, source): items 0 .. M * n_tiles - 1 are the
// row-tiles (each of its stored slots; source = slot index), the items after them the allocated
// spill entries (source = n_slots + spill index; those past spill_indptr[M], a fixed spill's
// padding, have none). A thread per row-tile rather than per slot: at 1% density ~2.5 of a
// tile's 32 slots hold an entry, so a thread per slot left ~92% of the warps' lanes idle and
// the two passes took 0.15 ms at 16384 tokens (bench/NOTES.md, forty-second session).
template <typename Visit>
__device__ __forceinline__ void transpose_item(
    long long j, const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols, int M, int n_tiles,
    int tile_n, int capacity, Visit visit) {
  const long long n_row_tiles = (long long)M * n_tiles;
  if (j < n_row_tiles) {
    const int row = (int)(j / n_tiles), col0 = (int)(j % n_tiles) * tile_n, n = counts[j];
    for (int s = 0; s < n; ++s) {
      const long long slot = j * capacity + s;
      visit(row, col0 + indices[slot], slot);
    }
    return;
  }
  const long long s = j - n_row_tiles;
  if (s >= spill_indptr[M]) return;
  visit(last_le(spill_indptr, M + 1, s), spill_cols[s], n_row_tiles * capacity + s);
}

__global__ void __launch_bounds__(256) twell_transpose_mark(
    const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols, int M, int n_tiles,
    int tile_n, int capacity, long long n_items, int n_blocks, unsigned* __restrict__ bits) {
  const long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (j >= n_items) return;
  transpose_item(j, indices, counts, spill_indptr, spill_cols, M, n_tiles, tile_n, capacity,
                 [&](int row, int col, long long) {
                   atomicOr(bits + (long long)col * n_blocks + (row >> 5), 1u << (row & 31));
                 });
}

// The exclusive scan of the pairs' counts (popcount of each word) in two launches
// (twell_scan.cuh): chunk sums, then each pair's first position and, at each column's first
// block, the column's row pointer; the last block writes the total.
__global__ void __launch_bounds__(SCAN_THREADS) twell_transpose_sums(
    const unsigned* __restrict__ bits, long long n, long long* __restrict__ chunk_sums) {
  const auto count = [=](long long w) -> long long { return __popc(bits[w]); };
  const long long s = chunk_sum(blockIdx.x, n, count);
  if (threadIdx.x == 0) chunk_sums[blockIdx.x] = s;
}

__global__ void __launch_bounds__(SCAN_THREADS) twell_transpose_first(
    const unsigned* __restrict__ bits, long long n, int n_blocks, int n_cols,
    const long long* __restrict__ chunk_sums, int* __restrict__ first, int* __restrict__ indptr) {
  const long long chunk = blockIdx.x;
  const auto count = [=](long long w) -> long long { return __popc(bits[w]); };
  const long long base = sum_before(chunk_sums, chunk);
  chunk_scan(chunk, n, base, count, [&](long long w, long long c, long long end) {
    first[w] = (int)(end - c);
    if (w % n_blocks == 0) indptr[w / n_blocks] = (int)(end - c);
  });
  if (threadIdx.x == 0 && chunk == gridDim.x - 1) indptr[n_cols] = (int)(base + chunk_sums[chunk]);
}

__global__ void __launch_bounds__(256) twell_transpose_place(
    const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols, int M, int n_tiles,
    int tile_n, int capacity, long long n_items, int n_blocks, const unsigned* __restrict__ bits,
    const int* __restrict__ first, int* __restrict__ rows_t, int* __restrict__ sources_t) {
  const long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (j >= n_items) return;
  transpose_item(j, indices, counts, spill_indptr, spill_cols, M, n_tiles, tile_n, capacity,
                 [&](int row, int col, long long source) {
                   const long long w = (long long)col * n_blocks + (row >> 5);
                   const int pos = first[w] + __popc(bits[w] & ((1u << (row & 31)) - 1u));
                   rows_t[pos] = row;
                   sources_t[pos] = (int)source;  // slots first, then the spill: the products' value positions
                 });
}

// The segments of A.T's long rows for the transposed products (twell_gather_csr_spmm_cut): a
// row of more than L entries (a unit that fires for many tokens: the skewed pattern's hot units)
// is cut into ceil(length / L) runs of L entries, the last shorter, each summed by its own warp
// into an fp32 partial row that the row's last warp adds up in run order. Without it such a row
// is one warp's work, and the kernel waits for it alone. The run length L is the shortest of the
// candidates run_length_candidate(shortest, k) whose runs fit in the `slots` partial rows (more
// entries a warp beats rows left whole: at 2% on the skewed pattern 512-entry runs need ~3000
// slots, 768-entry ones ~1550); it goes to *run_length, which the products read. When not even
// the longest candidate fits, the runs take the slots in row order while they fit and the
// rows after the first that does not stay whole. One block of SCAN_THREADS threads, each a
// contiguous stretch of rows: split_base[r] is row r's first slot or -1, slot_row[p] the row of
// slot p or -1. Deterministic: the same plan, and so the same sums, for the same structure.
__global__ void __launch_bounds__(SCAN_THREADS) twell_segment_plan(const int* __restrict__ indptr, int n_rows,
                                                                     int shortest, int slots,
                                                                     int* __restrict__ split_base,
                                                                     int* __restrict__ slot_row,
                                                                     int* __restrict__ run_length) {
  for (int p = threadIdx.x; p < slots; p += SCAN_THREADS) slot_row[p] = -1;
  const int per = (n_rows + SCAN_THREADS - 1) / SCAN_THREADS;
  const int begin = min(n_rows, (int)threadIdx.x * per), end = min(n_rows, begin + per);
  long long runs[RUN_CANDIDATES] = {};
  for (int r = begin; r < end; ++r) {
    const int length = indptr[r + 1] - indptr[r];
#pragma unroll
    for (int k = 0; k < RUN_CANDIDATES; ++k) runs[k] += segments_of(length, run_length_candidate(shortest, k));
  }
  int segment = run_length_candidate(shortest, RUN_CANDIDATES - 1);
#pragma unroll
  for (int k = 0; k < RUN_CANDIDATES - 1; ++k) {  // every thread sees the same totals: a uniform exit
    if (block_reduce(runs[k], SumOp()) <= slots) {
      segment = run_length_candidate(shortest, k);
      break;
    }
  }
  if (threadIdx.x == 0) *run_length = segment;
  long long mine = 0;
  for (int r = begin; r < end; ++r) mine += segments_of(indptr[r + 1] - indptr[r], segment);
  long long total;
  long long base = block_inclusive_sum(mine, total) - mine;  // its __syncthreads order the -1s first
  for (int r = begin; r < end; ++r) {
    const int need = segments_of(indptr[r + 1] - indptr[r], segment);
    const bool cut = need > 0 && base + need <= slots;
    split_base[r] = cut ? (int)base : -1;
    for (int s = 0; cut && s < need; ++s) slot_row[base + s] = r;
    base += need;
  }
}

// ---------------------------------------------------------------------------------------------
// Device-side scans (twell_scan.cuh): two launches each, no host read.

// The layout of a spill of fixed length (twellsparse._reference.fixed_spill_layout is the
// oracle): each row-tile's excess over `capacity`, in row-major order, takes the next slots of
// the spill while the running total stays within `spill_capacity`; from the first row-tile that
// does not fit on, everything is left out (running totals only grow, so the kept ones are a
// prefix). Launch 1 sums the excess per chunk.
__global__ void __launch_bounds__(SCAN_THREADS) spill_layout_sums(
    const int* __restrict__ row_tile_nnz, long long n, int capacity, long long* __restrict__ chunk_sums) {
  const auto excess = [=](long long i) -> long long { return max(row_tile_nnz[i] - capacity, 0); };
  const long long s = chunk_sum(blockIdx.x, n, excess);
  if (threadIdx.x == 0) chunk_sums[blockIdx.x] = s;
}

// A pack's two totals for the host, in one launch: out[0] gets every row-tile's entries (the
// density), out[1] those beyond `capacity` (what must spill). `out` is zeroed by the caller; one
// block per chunk adds its sums. Replaces a chain of array operations whose host cost (about
// 0.1 ms a call) made small FFN calls host-bound.
__global__ void __launch_bounds__(SCAN_THREADS) row_tile_entry_totals(
    const int* __restrict__ row_tile_nnz, long long n, int capacity, unsigned long long* __restrict__ out) {
  const auto entries = [=](long long i) -> long long { return row_tile_nnz[i]; };
  const auto excess = [=](long long i) -> long long { return max(row_tile_nnz[i] - capacity, 0); };
  const long long total = chunk_sum(blockIdx.x, n, entries);
  const long long over = chunk_sum(blockIdx.x, n, excess);  // the chunk is in L1 by now
  if (threadIdx.x == 0) {
    atomicAdd(out, (unsigned long long)total);
    if (over) atomicAdd(out + 1, (unsigned long long)over);
  }
}

// Launch 2 writes each row-tile's first spill slot (offsets), the counts for pass 2 (a left-out
// row-tile gets `capacity`, which the pass skips), the spill's row pointers counting only what is
// written, and, from the last block, the entries left out. A row whose end does not fit points
// at the end of the kept prefix, which the chunk holding the boundary determines: the blocks at
// or after the boundary rescan that chunk (only when entries are left out, an error path).
__global__ void __launch_bounds__(SCAN_THREADS) spill_layout_place(
    const int* __restrict__ row_tile_nnz, int M, int n_tiles, int capacity, long long spill_capacity,
    const long long* __restrict__ chunk_sums, long long* __restrict__ offsets,
    int* __restrict__ indptr, int* __restrict__ pass_counts, long long* __restrict__ left_out) {
  const long long n = (long long)M * n_tiles;
  const long long chunk = blockIdx.x;
  const auto excess = [=](long long i) -> long long { return max(row_tile_nnz[i] - capacity, 0); };
  const long long base = sum_before(chunk_sums, chunk);
  const long long chunk_end = base + chunk_sums[chunk];
  long long kept_end = chunk_end;  // the end of the kept prefix, needed only past the boundary
  if (chunk_end > spill_capacity) {
    long long boundary = chunk, boundary_base = base;
    if (base > spill_capacity) first_chunk_over(chunk_sums, chunk, spill_capacity, boundary, boundary_base);
    long long best = boundary_base;
    chunk_scan(boundary, n, boundary_base, excess, [&](long long, long long, long long end) {
      if (end <= spill_capacity && end > best) best = end;
    });
    kept_end = block_reduce(best, MaxOp());
  }
  chunk_scan(chunk, n, base, excess, [&](long long i, long long e, long long end) {
    const bool fits = end <= spill_capacity;
    offsets[i] = end - e;
    pass_counts[i] = fits ? row_tile_nnz[i] : capacity;
    if ((i + 1) % n_tiles == 0) indptr[(i + 1) / n_tiles] = (int)(fits ? end : kept_end);
  });
  if (threadIdx.x == 0 && chunk == 0) indptr[0] = 0;
  if (threadIdx.x == 0 && chunk == gridDim.x - 1) *left_out = chunk_end - min(chunk_end, kept_end);
}
