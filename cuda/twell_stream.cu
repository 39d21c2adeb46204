// Streaming SpMM: out = A @ b for a TwELL A and a dense 16-bit b, with each weight row read from
// L2 once per block of 256 tokens instead of once per (token, unit) pair.
//
// Why: the row-gather SpMM (twell_gather.cu) reads one whole row of b per stored entry, so at 1%
// density on the standard problem it moves 3.8 GB through L2 and is bound by the ~9 TB/s
// L2-to-SM gather rate (0.47 ms). A block of 256 tokens at that density uses ~92% of the units
// anyway, so this kernel streams all of b through shared memory once per block instead, one
// TwELL tile (tile_n rows) x 128 columns per stage with cp.async, and every stored entry reads
// its row from shared memory: L2 traffic M / 256 x |b| (1.5 GB at the standard problem), whatever
// the density; the rest is shared-memory reads and FMAs.
//
// Layout: 16 warps per block, 16 tokens per warp (warp w owns tokens 16w .. 16w + 15 of the
// block), lane l owns columns 4l .. 4l + 3 of the block's 128-column chunk, so each warp keeps
// 16 x 4 fp32 accumulators per lane and a row read is 32 lanes x 8 contiguous bytes (no bank
// conflicts). The block's counts are copied to shared memory once; each stage copies the tile's
// rows of b and the first kStagedSlots slots of every token's row-tile (only the slots in use),
// so the compute loop touches no global memory. Entries past kStagedSlots in a row-tile (rare:
// a row-tile that dense) and spilled entries read global memory directly. Every entry is summed
// in fp32 and each output value is rounded once.
//
// Needs: 16-bit values (bf16, f16), tile_n <= 256, an even capacity (4-byte slot copies),
// 16-byte-aligned rows of b whose length is a multiple of 8 values. twellsparse._gpu_ops checks
// these and otherwise runs the row-gather kernel.
#include "twell_types.cuh"

using namespace twell;

namespace {

constexpr int kStreamWarps = 16;
constexpr int kTokensPerWarp = 16;
constexpr int kBlockTokens = kStreamWarps * kTokensPerWarp;  // 256
constexpr int kChunkCols = 128;                              // 32 lanes x 4 values
constexpr int kRowBytes = kChunkCols * 2;                     // one staged row of b
constexpr int kMaxTileRows = 256;
constexpr int kStagedSlots = 16;
constexpr int kStages = 2;
constexpr int kWBytes = kMaxTileRows * kRowBytes;                      // 64 KB
constexpr int kSlotBytes = kBlockTokens * kStagedSlots * 2;            // 8 KB (indices or values)
constexpr int kStageBytes = kWBytes + 2 * kSlotBytes;

__device__ __forceinline__ unsigned smem_address(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void copy_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_address(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void copy_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_address(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N> __device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The two 16-bit values of a 32-bit word, widened (low half first).
template <typename T> __device__ __forceinline__ void widen2(unsigned w, float& lo, float& hi);
template <> __device__ __forceinline__ void widen2<bf16>(unsigned w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}
template <> __device__ __forceinline__ void widen2<f16>(unsigned w, float& lo, float& hi) {
  lo = to_acc(f16{(unsigned short)(w & 0xffffu)});
  hi = to_acc(f16{(unsigned short)(w >> 16)});
}

template <typename T> __device__ __forceinline__ float widen_bits(unsigned short bits) { return to_acc(T{bits}); }

// acc += v * (the 4 values of this lane in a staged or global row: two 32-bit words).
template <typename T>
__device__ __forceinline__ void add_scaled(float (&acc)[4], float v, uint2 w) {
  float e0, e1, e2, e3;
  widen2<T>(w.x, e0, e1);
  widen2<T>(w.y, e2, e3);
  acc[0] += v * e0;
  acc[1] += v * e1;
  acc[2] += v * e2;
  acc[3] += v * e3;
}

struct StreamShape {
  long long row0;  // first token of the block
  int col0;        // first column of the block's chunk
  int n_tiles, tile_n, capacity, n_rows_b, n_cols;
};

// Queues the copies of stage `tile` into `stage`: the tile's rows of b (this block's 128
// columns; rows past n_rows_b and columns past n_cols are left as they are and never read into
// an output) and the used slots (up to kStagedSlots) of each of the block's row-tiles.
template <typename T>
__device__ __forceinline__ void queue_stage(unsigned char* stage, int tile, const StreamShape& s,
                                            const unsigned short* cnt_s, const T* __restrict__ data,
                                            const short* __restrict__ indices, const T* __restrict__ b,
                                            long long ldb) {
  const int tid = threadIdx.x;
  const int rows = min(s.tile_n, s.n_rows_b - tile * s.tile_n);
  const T* b_tile = b + (long long)tile * s.tile_n * ldb + s.col0;
  for (int piece = tid; piece < rows * (kRowBytes / 16); piece += kStreamWarps * 32) {
    const int r = piece / (kRowBytes / 16), seg = piece % (kRowBytes / 16);
    if (s.col0 + seg * 8 < s.n_cols) copy_async16(stage + r * kRowBytes + seg * 16, b_tile + r * ldb + seg * 8);
  }
  // One thread per (token, array): the slots in use, two (4 bytes) at a time.
  const int tok = tid >> 1;
  const int used = min((int)cnt_s[tok * s.n_tiles + tile], kStagedSlots);
  const long long base = ((s.row0 + tok) * s.n_tiles + tile) * (long long)s.capacity;
  unsigned char* dst = stage + kWBytes + (tid & 1) * kSlotBytes + tok * kStagedSlots * 2;
  const void* src = (tid & 1) ? (const void*)(data + base) : (const void*)(indices + base);
  for (int p = 0; p < used; p += 2) copy_async4(dst + p * 2, (const unsigned char*)src + p * 2);
}

}  // namespace

template <typename T>
__global__ void __launch_bounds__(kStreamWarps * 32, 1)
    twell_stream_spmm(const T* __restrict__ data, const short* __restrict__ indices, const int* __restrict__ counts,
                      const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
                      const T* __restrict__ spill_vals, int m, int n_tiles, int tile_n, int capacity,
                      const T* __restrict__ b, long long ldb, int n_rows_b, int n_cols, T* __restrict__ out,
                      long long ldo) {
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* stages = smem;
  unsigned short* cnt_s = reinterpret_cast<unsigned short*>(smem + kStages * kStageBytes);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  StreamShape s;
  s.row0 = (long long)blockIdx.y * kBlockTokens;
  s.col0 = blockIdx.x * kChunkCols;
  s.n_tiles = n_tiles;
  s.tile_n = tile_n;
  s.capacity = capacity;
  s.n_rows_b = n_rows_b;
  s.n_cols = n_cols;

  // The block's counts (tokens past m count zero), one contiguous run of int32 in global memory.
  const int block_tokens = (int)min((long long)kBlockTokens, (long long)m - s.row0);
  for (int i = threadIdx.x; i < kBlockTokens * n_tiles; i += kStreamWarps * 32) {
    const int tok = i / n_tiles;
    cnt_s[i] = tok < block_tokens ? (unsigned short)counts[s.row0 * n_tiles + i] : (unsigned short)0;
  }
  __syncthreads();

  float acc[kTokensPerWarp][4];
#pragma unroll
  for (int r = 0; r < kTokensPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[r][i] = 0.f;

  const int lane_col = lane * 4;  // this lane's first column within the chunk
  queue_stage<T>(stages, 0, s, cnt_s, data, indices, b, ldb);
  commit_copies();
  for (int tile = 0; tile < n_tiles; ++tile) {
    if (tile + 1 < n_tiles) {
      queue_stage<T>(stages + ((tile + 1) % kStages) * kStageBytes, tile + 1, s, cnt_s, data, indices, b, ldb);
      commit_copies();
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    const unsigned char* stage = stages + (tile % kStages) * kStageBytes;
    const unsigned char* rows = stage + lane_col * 2;
#pragma unroll
    for (int r = 0; r < kTokensPerWarp; ++r) {
      const int tok = warp * kTokensPerWarp + r;
      const int n = cnt_s[tok * n_tiles + tile];
      const int staged = min(n, kStagedSlots);
      const unsigned short* idx_s = reinterpret_cast<const unsigned short*>(stage + kWBytes) + tok * kStagedSlots;
      const unsigned short* val_s = reinterpret_cast<const unsigned short*>(stage + kWBytes + kSlotBytes) + tok * kStagedSlots;
      int p = 0;
      for (; p + 1 < staged; p += 2) {
        const unsigned i2 = *reinterpret_cast<const unsigned*>(idx_s + p);
        const unsigned v2 = *reinterpret_cast<const unsigned*>(val_s + p);
        const uint2 w0 = *reinterpret_cast<const uint2*>(rows + (i2 & 0xffffu) * kRowBytes);
        const uint2 w1 = *reinterpret_cast<const uint2*>(rows + (i2 >> 16) * kRowBytes);
        float v0, v1;
        widen2<T>(v2, v0, v1);
        add_scaled<T>(acc[r], v0, w0);
        add_scaled<T>(acc[r], v1, w1);
      }
      if (p < staged) {
        const uint2 w0 = *reinterpret_cast<const uint2*>(rows + idx_s[p] * kRowBytes);
        add_scaled<T>(acc[r], widen_bits<T>(val_s[p]), w0);
      }
      // Slots past the staged ones: their rows are staged, their index and value are not.
      const long long base = ((s.row0 + tok) * n_tiles + tile) * (long long)capacity;
      for (p = kStagedSlots; p < n; ++p) {
        const uint2 w0 = *reinterpret_cast<const uint2*>(rows + indices[base + p] * kRowBytes);
        add_scaled<T>(acc[r], to_acc(data[base + p]), w0);
      }
    }
    __syncthreads();  // the next iteration's copies overwrite this stage
  }

  // Spilled entries, with their rows read from global memory, then one rounding per value.
  const bool lane_in = s.col0 + lane_col < n_cols;
#pragma unroll
  for (int r = 0; r < kTokensPerWarp; ++r) {
    const long long row = s.row0 + warp * kTokensPerWarp + r;
    if (row >= m) break;
    const int e1 = spill_indptr[row + 1];
    for (int e = spill_indptr[row]; e < e1; ++e) {
      uint2 w0 = make_uint2(0u, 0u);
      if (lane_in) w0 = *reinterpret_cast<const uint2*>(b + (long long)spill_cols[e] * ldb + s.col0 + lane_col);
      add_scaled<T>(acc[r], to_acc(spill_vals[e]), w0);
    }
    if (lane_in) {
      unsigned short o[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = from_acc<T>(acc[r][i]).bits;
      *reinterpret_cast<uint2*>(out + row * ldo + s.col0 + lane_col) =
          make_uint2(o[0] | ((unsigned)o[1] << 16), o[2] | ((unsigned)o[3] << 16));
    }
  }
}
