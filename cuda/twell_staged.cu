// Staged TwELL products: weight rows are read once per block of tokens, not once per nonzero.
//
// A block owns TT = 8 warps x TPW tokens and a chunk of DC = 32 x VEC output columns. For each
// TwELL tile of units it builds the union of the units its tokens activate (a bitmask in shared
// memory), stages only those weight rows (their DC-column chunk) into shared memory, and then
// every warp applies the staged rows to its own tokens' nonzeros. At 1% density and 128 tokens,
// about 72% of a tile's units are active somewhere in the block, so each staged row serves
// 1.8 nonzeros on average: 1.8x fewer bytes from L2 than gathering a row per nonzero, and the
// saving grows with skew (hot units) and with density.
//
// Two products share the staging:
//   SpMM  (SDDMM = false): out[t, chunk] = sum_j h[t, j] * w[j, chunk], accumulators in registers
//                          (TPW tokens x VEC columns per lane); spilled entries read w directly.
//   SDDMM (SDDMM = true):  pair_acc[t, j] += x[t, chunk] . w[j, chunk] for each stored (t, j);
//                          x's chunk lives in registers, each pair's partial dot is reduced over
//                          the warp and added to an fp32 accumulator with one atomic per chunk.
//                          twell_pairs_finalize turns the accumulators into values.
//
// Requirements (checked by the caller): weight rows read in 16-byte pieces (K and ldw multiples
// of 16 bytes, 16-byte-aligned base), x read in 8-byte vectors, capacity a multiple of 4.
#include "twell_types.cuh"

using namespace twell;

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGroup = 128;  // rows per stage: 128 rows x 32 lanes x 8 bytes = 32 KB

template <typename T, int VEC> struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
template <int BYTES> __device__ __forceinline__ void cp_async(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_addr(smem_dst)), "l"(gmem_src), "n"(BYTES)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Per block of tokens (TT rows) and tile: which units any of its tokens activates. One thread per
// slot; masks (n_blocks x n_tiles x tile_n / 32 words) must be zero-filled by the caller.
__global__ void __launch_bounds__(256) twell_block_masks(
    const short* __restrict__ indices, const int* __restrict__ counts, int M, int n_tiles, int tile_n,
    int capacity, int tokens_per_block, unsigned* __restrict__ masks) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= (long long)M * n_tiles * capacity) return;
  const long long rt = i / capacity;
  if ((int)(i - rt * capacity) >= counts[rt]) return;
  const long long row = rt / n_tiles;
  const int tile = (int)(rt - row * n_tiles);
  const int idx = indices[i];
  const int words = tile_n >> 5;
  atomicOr(&masks[((row / tokens_per_block) * n_tiles + tile) * words + (idx >> 5)], 1u << (idx & 31));
}

// Dynamic shared memory, in order: STAGES stage buffers (rows, then the block's slot counts,
// tile-local columns and values for the stage's tile), then per-tile masks, ranks, active
// counts and offsets, the stage list, and the active units of every tile in rank order. The
// host mirrors the sizes in _kernels.staged_smem_bytes().
//
// Grid: (token blocks, column splits). A block owns TT tokens and the column chunks
// [c_begin, c_end) of its split; its stage metadata is built once and reused for every chunk,
// and one cp.async pipeline runs across all (chunk, stage) pairs.
template <typename T, int TPW, int VEC, bool SDDMM, int STAGES>
__global__ void __launch_bounds__(kThreads) twell_staged(
    const T* __restrict__ data, const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ spill_vals, int M, int n_tiles, int tile_n, int capacity,
    const unsigned* __restrict__ block_masks, const T* __restrict__ w, long long ldw, int n_units,
    int K, const T* __restrict__ x, long long ldx, T* __restrict__ out, long long ldo,
    float* __restrict__ pair_acc) {
  using A = typename acc_of<T>::type;
  using V = Vec<T, VEC>;
  using Rows = V[kGroup][32];
  constexpr int TT = kWarps * TPW;
  constexpr int DC = 32 * VEC;                  // columns per chunk (256 bytes per row)
  constexpr int PIECE = 16 / (int)sizeof(T);    // elements per 16-byte copy
  extern __shared__ __align__(16) unsigned char smem[];
  const int stage_bytes = (int)sizeof(Rows) + TT * 4 + TT * capacity * (2 + (int)sizeof(T));
  const int words = tile_n >> 5;
  unsigned* masks = reinterpret_cast<unsigned*>(smem + STAGES * stage_bytes);
  int* ranks = reinterpret_cast<int*>(masks + n_tiles * words);
  int* tile_active = ranks + n_tiles * words;
  int* tile_offset = tile_active + n_tiles;
  const int max_stages = n_tiles * ((tile_n + kGroup - 1) / kGroup);
  int* stage_tile = tile_offset + n_tiles;
  int* stage_first = stage_tile + max_stages;
  short* units = reinterpret_cast<short*>(stage_first + max_stages);
  __shared__ int n_stages;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long block_tok0 = (long long)blockIdx.x * TT;
  const long long tok0 = block_tok0 + warp * TPW;
  const int n_chunks = (K + DC - 1) / DC;
  const int per_split = (n_chunks + gridDim.y - 1) / gridDim.y;
  const int c_begin = blockIdx.y * per_split;
  const int c_end = min(n_chunks, c_begin + per_split);

  // 1. Stage metadata, once: masks, ranks within each tile, the stage list, the unit lists.
  const unsigned* my_masks = block_masks + (long long)blockIdx.x * n_tiles * words;
  for (int i = threadIdx.x; i < n_tiles * words; i += kThreads) masks[i] = my_masks[i];
  __syncthreads();
  for (int tile = warp; tile < n_tiles; tile += kWarps) {
    const int c = lane < words ? __popc(masks[tile * words + lane]) : 0;
    int incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += t;
    }
    if (lane < words) ranks[tile * words + lane] = incl - c;
    if (lane == 31) tile_active[tile] = incl;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int n = 0, offset = 0;
    for (int tile = 0; tile < n_tiles; ++tile) {
      tile_offset[tile] = offset;
      offset += tile_active[tile];
      for (int first = 0; first < tile_active[tile]; first += kGroup) {
        stage_tile[n] = tile;
        stage_first[n] = first;
        ++n;
      }
    }
    n_stages = n;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n_tiles * tile_n; i += kThreads) {
    const int tile = i / tile_n, unit = i - tile * tile_n;
    const unsigned m = masks[tile * words + (unit >> 5)];
    if ((m >> (unit & 31)) & 1u)
      units[tile_offset[tile] + ranks[tile * words + (unit >> 5)] + __popc(m & ((1u << (unit & 31)) - 1u))] =
          (short)unit;
  }
  __syncthreads();
  const int S = n_stages;
  const int total = (c_end - c_begin) * S;

  // 2. One STAGES-deep cp.async pipeline over q = (chunk - c_begin) * S + stage.
  auto stage_ptr = [&](int q) { return smem + (q % STAGES) * stage_bytes; };
  auto issue = [&](int q) {
    const int chunk = c_begin + q / S, st = q % S;
    const int tile = stage_tile[st], first = stage_first[st];
    const int n_rows = min(kGroup, tile_active[tile] - first);
    unsigned char* base = stage_ptr(q);
    Rows& buf = *reinterpret_cast<Rows*>(base);
    int* s_counts = reinterpret_cast<int*>(base + sizeof(Rows));
    short* s_cols = reinterpret_cast<short*>(s_counts + TT);
    T* s_vals = reinterpret_cast<T*>(s_cols + TT * capacity);
    for (int i = threadIdx.x; i < n_rows * 16; i += kThreads) {
      const int r = i >> 4, piece = i & 15;
      const long long j = (long long)tile * tile_n + units[tile_offset[tile] + first + r];
      const int c = chunk * DC + piece * PIECE;
      void* dst = reinterpret_cast<unsigned char*>(&buf[r][0]) + piece * 16;
      if (c < K && j < n_units) {
        cp_async<16>(dst, w + j * ldw + c);
      } else {
        reinterpret_cast<unsigned long long*>(dst)[0] = 0ull;
        reinterpret_cast<unsigned long long*>(dst)[1] = 0ull;
      }
    }
    // The used slots of the block's tokens in this tile, 8 bytes at a time (capacity % 4 == 0):
    // the count is read first so that padding slots are never copied.
    constexpr int per = 8 / (int)sizeof(T);
    const int col_chunks = capacity / 4, val_chunks = SDDMM ? 0 : capacity / per;
    for (int i = threadIdx.x; i < TT * (col_chunks + val_chunks); i += kThreads) {
      const int t = i % TT, part = i / TT;
      const long long row = block_tok0 + t;
      const long long rt = row * n_tiles + tile;
      const int cnt = row < M ? counts[rt] : 0;
      if (part == 0) s_counts[t] = cnt;
      if (part < col_chunks) {
        if (4 * part < cnt) cp_async<8>(&s_cols[t * capacity + 4 * part], indices + rt * capacity + 4 * part);
      } else {
        const int k = part - col_chunks;
        if (per * k < cnt) cp_async<8>(&s_vals[t * capacity + per * k], data + rt * capacity + per * k);
      }
    }
  };

#pragma unroll
  for (int q = 0; q < STAGES - 1; ++q) {
    if (q < total) issue(q);
    cp_async_commit();
  }
  A acc[TPW][VEC];  // SpMM: output accumulators; SDDMM: this lane's slice of x's chunk
  for (int chunk = c_begin; chunk < c_end; ++chunk) {
    const int col = chunk * DC + lane * VEC;
    const bool col_ok = col < K;  // K % PIECE == 0, so the whole vector is in range
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      V xv;
      const bool load = SDDMM && col_ok && tok0 + i < M;
      if (load) xv = *reinterpret_cast<const V*>(x + (tok0 + i) * ldx + col);
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[i][v] = load ? to_acc(xv.v[v]) : A(0);
    }
    for (int st = 0; st < S; ++st) {
      const int q = (chunk - c_begin) * S + st;
      if (q + STAGES - 1 < total) issue(q + STAGES - 1);
      cp_async_commit();
      cp_async_wait<STAGES - 1>();
      __syncthreads();
      const int tile = stage_tile[st], first = stage_first[st];
      const unsigned char* base = stage_ptr(q);
      const Rows& buf = *reinterpret_cast<const Rows*>(base);
      const int* s_counts = reinterpret_cast<const int*>(base + sizeof(Rows));
      const short* s_cols = reinterpret_cast<const short*>(s_counts + TT);
      const T* s_vals = reinterpret_cast<const T*>(s_cols + TT * capacity);
#pragma unroll
      for (int i = 0; i < TPW; ++i) {
        const int t = warp * TPW + i;
        const int cnt = s_counts[t];
        for (int s = 0; s < cnt; ++s) {
          const int idx = s_cols[t * capacity + s];
          const unsigned m = masks[tile * words + (idx >> 5)];
          const int r = ranks[tile * words + (idx >> 5)] + __popc(m & ((1u << (idx & 31)) - 1u)) - first;
          if (r < 0 || r >= kGroup) continue;  // warp-uniform: another stage holds this row
          const V wv = buf[r][lane];
          if (SDDMM) {
            A p = A(0);
#pragma unroll
            for (int v = 0; v < VEC; ++v) p += acc[i][v] * to_acc(wv.v[v]);
            p = warp_sum(p);
            if (lane == 0) atomicAdd(pair_acc + ((tok0 + i) * n_tiles + tile) * capacity + s, (float)p);
          } else {
            const A h = to_acc(s_vals[t * capacity + s]);
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[i][v] += h * to_acc(wv.v[v]);
          }
        }
      }
      __syncthreads();  // buffer q % STAGES is refilled by the next iteration's issue
    }
    if (SDDMM) continue;  // spilled pairs are handled by twell_sddmm_spill
    // Spilled entries (rare by design): gather their rows directly; then store the chunk.
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
      const long long row = tok0 + i;
      if (row >= M) break;
      for (int e = spill_indptr[row]; e < spill_indptr[row + 1]; ++e) {
        const A h = to_acc(spill_vals[e]);
        if (!col_ok) continue;
        const V wv = *reinterpret_cast<const V*>(w + (long long)spill_cols[e] * ldw + col);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[i][v] += h * to_acc(wv.v[v]);
      }
      if (col_ok) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) out[row * ldo + col + v] = from_acc<T>(acc[i][v]);
      }
    }
  }
  cp_async_wait<0>();
}

// values[slot] = (SCALE ? pattern[slot] : 1) * pair_acc[slot] for used slots, 0 elsewhere.
template <typename T, bool SCALE>
__global__ void __launch_bounds__(256) twell_pairs_finalize(
    const float* __restrict__ pair_acc, const T* __restrict__ pattern,
    const int* __restrict__ counts, long long n_slots, int capacity, T* __restrict__ out) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= n_slots) return;
  if ((int)(i % capacity) >= counts[i / capacity]) {
    out[i] = zero_value<T>();
    return;
  }
  float v = pair_acc[i];
  if (SCALE) v *= (float)to_acc(pattern[i]);
  out[i] = from_acc<T>(v);
}
