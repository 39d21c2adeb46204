// Tiled sampled products at a TwELL pattern, 2-byte value types: every stored slot (row, col)
// gets d = x[row] . w[col] (fp32 sums), written as twell_sddmm.cuh's modes say.
//
// Why a second fast path beside the row gathers (twell_gather.cu): those read the whole w row
// (K values) from L2 for every stored entry, 1.9 GB for the gated FFN's up projection at 0.5%
// density on the 2B-class shape (M = 16384, N = 5632, K = 2048), for a 23 MB matrix. Here a
// block owns a tile of 512 tokens x 512 units and streams both operands' rows of the tile
// through shared memory, 32 values (64 bytes per row) at a time: the L2 moves
// M * N * K * 2 bytes * (1/512 + 1/512) = 1.5 GB at that shape whatever the density, and every
// stored pair of the tile reads its two 64-byte pieces from shared memory.
//
// Work split: 512 threads = 128 groups of 4 lanes; lane v of a group owns the 16-byte vector v
// of each 64-byte piece. A job is one token and up to 4 of its entries in the block's units, so
// the token's x vector is unpacked once per piece for up to 4 dot products. Jobs are numbered
// full ones first, then the others by size (3, 2, 1), and group g takes jobs g, g + 128, ...:
// the 8 groups of a warp run jobs of one size, so lanes seldom wait on each other. A group keeps
// 8 jobs (32 partial sums per lane) in registers; a block with more than 1024 jobs makes more
// rounds, streaming the pieces again (1024 jobs hold 2 to 4 times the entries a 512 x 512 tile
// has at 2% density).
//
// The pieces travel by cp.async (sm_80 and later) through 3 stages of 64 KB; rows past M or N and
// columns past K arrive as zeros. Only stored slots and, in the block that owns a row-tile's
// first column, the row-tile's padding slots are written; spill entries go to
// twell_sddmm_spill.
#include "twell_sddmm.cuh"

namespace twell {

constexpr int TILED_TOKENS = 512;   // x rows per block: one per thread while listing jobs
constexpr int TILED_UNITS = 512;    // w rows per block
constexpr int TILED_THREADS = 512;
constexpr int TILED_PIECE = 64;     // bytes of a row per stage: 32 values, 4 lanes x 16 bytes
constexpr int TILED_STAGES = 3;
constexpr int TILED_STAGE_BYTES = (TILED_TOKENS + TILED_UNITS) * TILED_PIECE;
constexpr int TILED_PER_JOB = 4;    // entries per job
constexpr int TILED_JOBS = 8;       // jobs per group and round
constexpr int TILED_GROUPS = TILED_THREADS / 4;
constexpr int TILED_ROUND = TILED_GROUPS * TILED_JOBS;

// A round's job list (after the stages in shared memory). Units are local to the block's range;
// slots count from the row's first slot of the block's first row-tile.
struct TiledJobs {
  int head[TILED_ROUND];                           // token | entries << 16
  unsigned short unit[TILED_ROUND][TILED_PER_JOB];
  unsigned short slot[TILED_ROUND][TILED_PER_JOB];
  int n_full;
  int n_rest[TILED_PER_JOB];                       // jobs of 1 to 3 entries, by size
};

__device__ __forceinline__ unsigned shared_u32(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (unsigned)a;
}

// 16 bytes from global to shared memory, or 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void copy16_async(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void unpack8(uint4 v, bf16, float (&f)[8]) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void unpack8(uint4 v, f16, float (&f)[8]) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = to_acc(f16{(unsigned short)(w[i] & 0xffffu)});
    f[2 * i + 1] = to_acc(f16{(unsigned short)(w[i] >> 16)});
  }
}

// Piece `piece` (values 32 * piece ...) of the tile's x rows, then its w rows, into `stage`.
template <typename T>
__device__ __forceinline__ void stage_piece(unsigned stage, int piece, const T* __restrict__ x, long long ldx,
                                            long long t0, int M, const T* __restrict__ w, long long ldw, int u0,
                                            int N, int K) {
  const int k0 = piece * (TILED_PIECE / 2);
#pragma unroll 4
  for (int i = threadIdx.x; i < (TILED_TOKENS + TILED_UNITS) * 4; i += TILED_THREADS) {
    const int r = i >> 2, k = k0 + 8 * (i & 3);
    const bool is_x = r < TILED_TOKENS;
    const long long src_row = is_x ? t0 + r : (long long)(u0 + r - TILED_TOKENS);
    const bool valid = k < K && src_row < (is_x ? (long long)M : (long long)N);
    const T* src = is_x ? x + (valid ? src_row * ldx + k : 0) : w + (valid ? src_row * ldw + k : 0);
    copy16_async(stage + 16 * i, src, valid);
  }
  commit_copies();
}

}  // namespace twell

template <typename T, int MODE>
__global__ void __launch_bounds__(twell::TILED_THREADS, 1) twell_tiled_sddmm(
    const T* __restrict__ x, long long ldx, const T* __restrict__ w, long long ldw, int K,
    const short* __restrict__ indices, const int* __restrict__ counts, int M, int N, int n_tiles,
    int tile_n, int capacity, const T* g, const T* aux, T* o0, T* o1, T* o2) {
  using namespace twell;
  extern __shared__ __align__(16) unsigned char shared[];
  TiledJobs& jobs = *reinterpret_cast<TiledJobs*>(shared + TILED_STAGES * TILED_STAGE_BYTES);
  const SddmmOperands<T> op{g, aux, o0, o1, o2};
  const int tid = threadIdx.x;
  const int u0 = blockIdx.x * TILED_UNITS;
  const long long t0 = (long long)blockIdx.y * TILED_TOKENS;
  const int pieces = (K + TILED_PIECE / 2 - 1) / (TILED_PIECE / 2);
  const unsigned stages = shared_u32(shared);

  // Listing: thread tid's token, its row-tiles overlapping the block's units and its entries there.
  const long long row = t0 + tid;
  const int t_first = u0 / tile_n;
  const int t_end = min(n_tiles, (u0 + TILED_UNITS - 1) / tile_n + 1);
  const bool filter = tile_n > TILED_UNITS;  // a row-tile wider than the block's units
  if (tid == 0) {
    jobs.n_full = 0;
    for (int c = 0; c < TILED_PER_JOB; ++c) jobs.n_rest[c] = 0;
  }
  __syncthreads();
  int n = 0;
  if (row < M) {
    for (int t = t_first; t < t_end; ++t) {
      const long long rt = row * n_tiles + t;
      const int cnt = counts[rt];
      if (!filter) {
        n += cnt;
      } else {
        for (int s = 0; s < cnt; ++s) {
          const int unit = t * tile_n + indices[rt * capacity + s] - u0;
          n += unit >= 0 && unit < TILED_UNITS;
        }
      }
      if (u0 <= t * tile_n) {  // this block owns the row-tile's padding
        for (int s = cnt; s < capacity; ++s) emit_zero<T, MODE>(rt * capacity + s, op);
      }
    }
  }
  const int full = n / TILED_PER_JOB, rest = n % TILED_PER_JOB;
  const int full_base = full ? atomicAdd(&jobs.n_full, full) : 0;
  const int rest_rank = rest ? atomicAdd(&jobs.n_rest[rest], 1) : 0;
  __syncthreads();
  int total = jobs.n_full, rest_job = -1;
  for (int c = TILED_PER_JOB - 1; c >= 1; --c) {
    if (c == rest) rest_job = total + rest_rank;
    total += jobs.n_rest[c];
  }

  const int grp = tid >> 2, v = tid & 3;
  for (int lo = 0; lo < total; lo += TILED_ROUND) {
#pragma unroll
    for (int s = 0; s < TILED_STAGES - 1; ++s) {
      if (s < pieces) stage_piece(stages + s * TILED_STAGE_BYTES, s, x, ldx, t0, M, w, ldw, u0, N, K);
      else commit_copies();
    }
    // This token's jobs in this round into the job list.
    const bool full_here = full > 0 && full_base < lo + TILED_ROUND && full_base + full > lo;
    const bool rest_here = rest_job >= lo && rest_job < lo + TILED_ROUND;
    if (full_here || rest_here) {
      int e = 0;  // entry e of the token belongs to full job e / 4, or to the rest job
      for (int t = t_first; t < t_end; ++t) {
        const long long rt = row * n_tiles + t;
        const int cnt = counts[rt];
        for (int s = 0; s < cnt; ++s) {
          const int unit = t * tile_n + indices[rt * capacity + s] - u0;
          if (filter && (unit < 0 || unit >= TILED_UNITS)) continue;
          const bool in_full = e < full * TILED_PER_JOB;
          const int job = (in_full ? full_base + e / TILED_PER_JOB : rest_job) - lo;
          const int k = in_full ? e % TILED_PER_JOB : e - full * TILED_PER_JOB;
          if (job >= 0 && job < TILED_ROUND) {
            jobs.unit[job][k] = (unsigned short)unit;
            jobs.slot[job][k] = (unsigned short)((t - t_first) * capacity + s);
            if (k == 0) jobs.head[job] = tid | ((in_full ? TILED_PER_JOB : rest) << 16);
          }
          ++e;
        }
      }
    }
    __syncthreads();
    const int in_round = min(TILED_ROUND, total - lo);
    int head[TILED_JOBS];
    uint2 unit[TILED_JOBS];
#pragma unroll
    for (int q = 0; q < TILED_JOBS; ++q) {
      const int j = grp + q * TILED_GROUPS;
      head[q] = j < in_round ? jobs.head[j] : 0;
      unit[q] = j < in_round ? *reinterpret_cast<const uint2*>(jobs.unit[j]) : make_uint2(0u, 0u);
    }
    float acc[TILED_JOBS][TILED_PER_JOB];
#pragma unroll
    for (int q = 0; q < TILED_JOBS; ++q)
#pragma unroll
      for (int e = 0; e < TILED_PER_JOB; ++e) acc[q][e] = 0.f;

    for (int p = 0; p < pieces; ++p) {
      wait_copies<TILED_STAGES - 2>();
      __syncthreads();  // the piece has landed for every thread, and the stage refilled below is free
      const int next = p + TILED_STAGES - 1;
      if (next < pieces) stage_piece(stages + (next % TILED_STAGES) * TILED_STAGE_BYTES, next, x, ldx, t0, M, w, ldw, u0, N, K);
      else commit_copies();
      const unsigned char* xs = shared + (p % TILED_STAGES) * TILED_STAGE_BYTES + 16 * v;
      const unsigned char* ws = xs + TILED_TOKENS * TILED_PIECE;
#pragma unroll
      for (int q = 0; q < TILED_JOBS; ++q) {
        const int entries = head[q] >> 16;
        if (entries == 0) continue;
        float xf[8];
        unpack8(*reinterpret_cast<const uint4*>(xs + (head[q] & 0xffff) * TILED_PIECE), T{}, xf);
        const unsigned units[2] = {unit[q].x, unit[q].y};
#pragma unroll
        for (int e = 0; e < TILED_PER_JOB; ++e) {
          if (e < entries) {
            const unsigned u = (units[e >> 1] >> (16 * (e & 1))) & 0xffffu;
            float wf[8];
            unpack8(*reinterpret_cast<const uint4*>(ws + u * TILED_PIECE), T{}, wf);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[q][e] = fmaf(xf[i], wf[i], acc[q][e]);
          }
        }
      }
    }

    // The 4 lanes' partial sums of each entry; lane v writes entry v of each job.
#pragma unroll
    for (int q = 0; q < TILED_JOBS; ++q) {
      const int entries = head[q] >> 16;
#pragma unroll
      for (int e = 0; e < TILED_PER_JOB; ++e) {
        float d = acc[q][e];
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        if (e == v && e < entries) {
          const int j = grp + q * TILED_GROUPS;
          const long long token_slots = ((t0 + (head[q] & 0xffff)) * n_tiles + t_first) * capacity;
          emit<T, MODE>(d, token_slots + jobs.slot[j][e], op);
        }
      }
    }
    __syncthreads();  // the next round rewrites the job list and the stages
  }
}
