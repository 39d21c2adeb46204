// The fused producer on Hopper (sm_90a): a tensor-core GEMM z = x @ w.T whose epilogue applies
// the activation and packs each row-tile into canonical TwELL slots, so that the hidden
// activations never travel through device memory as a dense M x N matrix.
//
// Main loop. One persistent block per SM, three warpgroups: warpgroup 0 (one thread) streams
// 128 x 64 tiles of x and 256 x 64 tiles of w into a 4-deep ring of shared-memory stages with the
// bulk tensor copy engine (TMA, 128-byte swizzle) and an mbarrier per stage; warpgroups 1 and 2
// each multiply their 64 rows of the block's 128 x 256 output tile with wgmma m64n256k16
// (accumulators in registers, fp32). Output tiles are visited in groups of GROUP_M row blocks so
// that the x rows and w rows a wave of blocks reads stay in L2.
//
// Two schedules (the kernels' SPLIT argument), the split one also in clusters of two CTAs that
// share each w tile (twell_gemm_pack_pair, the library's default: see gemm_pack below):
// - SPLIT = 1: the copy warpgroup's other three warps pack. After a tile's last
//   MMA the math warpgroups round their accumulators to T (two per register) into a 64 KB shared
//   hand-off buffer, arrive on a barrier and start the next tile's MMAs while the pack warps run
//   the epilogue below on the handed-off tile; the buffer is free again when the pack warps
//   arrive on a second barrier. The tensor cores no longer wait for the epilogue; the price is
//   one ring stage (3 of 48 KB instead of 4) for the buffer, won back by freeing each stage as
//   soon as a math warpgroup's own MMAs on it are done (IN_FLIGHT in gemm_pack). Every thread
//   keeps the 168 registers a block of 384 threads allows (512 threads would leave 128): the
//   math warps' m64n256 MMAs need ~154 and the pack warps more than 144, so setmaxnreg could
//   move at most 8 (measured: no gain, bench/NOTES.md, thirty-eighth session).
// - SPLIT = 0: 384 threads, 4 stages; the math warpgroups pack their own tile after its MMAs (the
//   copy thread runs ahead into the next tile meanwhile). The faster one for calls of a few
//   tiles per SM (twellsparse._hopper_producer.schedule_for).
// On the H200 (standard problem, 0.5%): pass 1 0.524 ms in pairs, 0.529 split, 0.537 inline,
// against 0.458 for cuBLASLt's GEMM; without the epilogue 0.497 / 0.506 / 0.471 (bench/NOTES.md,
// nineteenth session: the GEMMs run power-limited, so the overlap gains less than expected).
//
// Epilogue. In the wgmma accumulator layout a row's 256 columns are spread over a quad of four
// lanes: lane q holds columns 8j + 2q + e (j < 32, e < 2). Each lane builds a 64-bit mask of its
// kept entries; the quad exchanges masks, and a kept entry's slot is the number of kept entries
// of its row-tile in smaller columns (four popcounts). The slots are assembled per warp in shared
// memory and written as whole 16-byte vectors (a row's row-tiles of one block are adjacent in
// the TwELL arrays). Row-tiles with more entries than their capacity also write their kept
// values into the dense buffer h and their bits into mask (both untouched elsewhere), which is
// exactly what the relu-mask pack's spill pass (twell_convert.cu, relu_mask_to_twell) reads:
// the overflow policy then runs as it does after the cuBLASLt producer.
//
// Semantics equal the GEMM-then-pack producers: z is rounded to T, the activation applied in
// fp32, rounded to T again, and an entry kept when keep() says so.
//
// Requirements (checked by twellsparse._hopper_producer): T 16-bit, K a multiple of 8, x and w
// 16-byte aligned with unit column stride; tile_n in {32, 64, 128, 256}; capacity a multiple of
// 8 with (256 / tile_n) * capacity <= MAX_ROW_SLOTS.
#include "twell_tma.cuh"
#include "twell_types.cuh"

// TWELL_HOPPER_PACK=0 (TWELL_HOPPER_PACK=0 in the environment) leaves the epilogue out: the GEMM
// alone (its MMAs kept), for measuring the epilogue's share. The library's results are then wrong.
#ifndef TWELL_HOPPER_PACK
#define TWELL_HOPPER_PACK 1
#endif

// TWELL_HOPPER_TILE256=0 (TWELL_HOPPER_TILE256=0 in the environment) sends relu on 256-column
// row-tiles through the run-time geometry epilogue too, for measuring what its own code saves.
#ifndef TWELL_HOPPER_TILE256
#define TWELL_HOPPER_TILE256 1
#endif

namespace twell {
namespace hopper {

constexpr int BM = 128, BN = 256, BK = 64, GROUP_M = 16;
constexpr int A_BYTES = BM * BK * 2;
constexpr int B_BYTES = BN * BK * 2;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int MAX_ROW_SLOTS = 64;                    // slots of one row in one output tile
constexpr int WARP_STAGE_BYTES = 8 * MAX_ROW_SLOTS * 4;  // 8 rows x slots x (value + index)
constexpr int HANDOFF_WORDS = BM * BN / 2;               // the tile rounded to T, two per word

// Launch shape and shared memory of each schedule (twellsparse._hopper_producer mirrors them).
template <int SPLIT> struct Schedule {
  static constexpr int THREADS = 384;
  static constexpr int STAGES = SPLIT ? 3 : 4;
  static constexpr int PACK_WARPS = SPLIT ? 3 : 8;  // warps running the epilogue, a slot stage each
  static constexpr int HANDOFF_BYTES = SPLIT ? HANDOFF_WORDS * 4 : 0;
  // full[s], empty[s], then (SPLIT) handed-off and drained
  static constexpr int BARRIER_BYTES = (2 * STAGES + (SPLIT ? 2 : 0)) * 8;
  // 1 KB of slack to align the ring to the 128-byte swizzle's 1024-byte pattern.
  static constexpr int SMEM_BYTES =
      1024 + STAGES * STAGE_BYTES + HANDOFF_BYTES + BARRIER_BYTES + PACK_WARPS * WARP_STAGE_BYTES;
};
static_assert(Schedule<1>::SMEM_BYTES <= 227 * 1024, "the split schedule fits an SM's shared memory");
static_assert(Schedule<0>::SMEM_BYTES <= 227 * 1024, "the inline schedule fits an SM's shared memory");

// A K-major operand tile in the 128-byte swizzle: rows of 64 16-bit values (128 bytes), 8-row
// groups 1024 bytes apart. Advancing 16 values along K adds 32 bytes (2 in the address field).
__device__ __forceinline__ unsigned long long sw128_descriptor(unsigned saddr) {
  return (unsigned long long)((saddr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// d (64 x 256 fp32, this thread's 128) += A (64 x 16) * B (256 x 16)^T, both from shared memory,
// for T = bf16 or f16 (TYPE: the PTX type of both operands).
#define TWELL_WGMMA_M64N256K16(TYPE)                                                              \
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " "                  \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 1, 1, 1, 0, 0;"                                                      \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                                                     \
               : "l"(da), "l"(db))
template <typename T> __device__ __forceinline__ void wgmma_m64n256k16(float* d, unsigned long long da, unsigned long long db);
template <> __device__ __forceinline__ void wgmma_m64n256k16<bf16>(float* d, unsigned long long da, unsigned long long db) {
  TWELL_WGMMA_M64N256K16("bf16");
}
template <> __device__ __forceinline__ void wgmma_m64n256k16<f16>(float* d, unsigned long long da, unsigned long long db) {
  TWELL_WGMMA_M64N256K16("f16");
}
#undef TWELL_WGMMA_M64N256K16

// Output tile t -> (row block, column block), `group` row blocks at a time.
__device__ __forceinline__ void tile_coords(int t, int m_blocks, int n_blocks, int group, int& mb, int& nb) {
  const int per_group = group * n_blocks;
  const int first = (t / per_group) * group;
  const int rows = min(m_blocks - first, group);
  const int r = t % per_group;
  mb = first + r % rows;
  nb = r / rows;
}

__device__ __forceinline__ unsigned long long low_bits(int n) { return n >= 64 ? ~0ull : (1ull << n) - 1ull; }

__device__ __forceinline__ unsigned long long shfl_u64(unsigned long long v, int src) {
  const unsigned lo = __shfl_sync(0xffffffffu, (unsigned)v, src);
  const unsigned hi = __shfl_sync(0xffffffffu, (unsigned)(v >> 32), src);
  return ((unsigned long long)hi << 32) | lo;
}

// Sets bits `bit` and `bit` + 1 of mask where the low and the high half of a rounded pair are
// greater than the matching half of `floor2` and not NaN (+inf included): what relu keeps, with
// floor2 = 0 (plain relu) or the threshold rounded down to T (relu_floor). One packed compare
// for both halves (setp.gt on bf16x2 / f16x2, without flushing subnormals, so the mask follows
// the stored bits exactly; NaN compares false) and two predicated ORs, where widening each half
// to fp32 and comparing it took three instructions per entry (0.2-0.5% of pass 1,
// bench/NOTES.md, twentieth session).
template <typename T>
__device__ __forceinline__ void or_greater_bits(unsigned pair, unsigned floor2, unsigned& mask, unsigned bit);
#define TWELL_OR_GREATER_BITS(TYPE)           \
  asm("{\n"                                  \
      ".reg .pred lo, hi;\n"                 \
      "setp.gt." TYPE "x2 lo|hi, %1, %2;\n"  \
      "@lo or.b32 %0, %0, %3;\n"             \
      "@hi or.b32 %0, %0, %4;\n"             \
      "}\n"                                  \
      : "+r"(mask)                           \
      : "r"(pair), "r"(floor2), "r"(1u << bit), "r"(2u << bit))
template <>
__device__ __forceinline__ void or_greater_bits<bf16>(unsigned pair, unsigned floor2, unsigned& mask, unsigned bit) {
  TWELL_OR_GREATER_BITS("bf16");
}
template <>
__device__ __forceinline__ void or_greater_bits<f16>(unsigned pair, unsigned floor2, unsigned& mask, unsigned bit) {
  TWELL_OR_GREATER_BITS("f16");
}
#undef TWELL_OR_GREATER_BITS

// What relu keeps against a threshold t >= 0, as a packed pair for or_greater_bits: relu(h) > t
// is h > t, and for h in T that is h > t rounded towards zero to T (through fp32, both roundings
// towards zero: the result is the largest T value <= t, or t itself). So the thresholded relu
// keeps the packed compare instead of widening every entry and comparing it in fp64 (the model
// benchmark's layers, thresholded, ran the pair schedule's pack warps 1.5x slower than the math
// warps' GEMM).
template <typename T> __device__ __forceinline__ unsigned relu_floor(double t);
template <> __device__ __forceinline__ unsigned relu_floor<bf16>(double t) {
  unsigned short b;
  asm("cvt.rz.bf16.f32 %0, %1;" : "=h"(b) : "f"(__double2float_rz(t)));
  return (unsigned)b * 0x10001u;
}
template <> __device__ __forceinline__ unsigned relu_floor<f16>(double t) {
  unsigned short b;
  asm("cvt.rz.f16.f32 %0, %1;" : "=h"(b) : "f"(__double2float_rz(t)));
  return (unsigned)b * 0x10001u;
}

// Two fp32 values rounded to T in one instruction: lo in the low half, hi in the high half.
template <typename T> __device__ __forceinline__ unsigned rounded_pair(float lo, float hi);
template <> __device__ __forceinline__ unsigned rounded_pair<bf16>(float lo, float hi) {
  unsigned d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
template <> __device__ __forceinline__ unsigned rounded_pair<f16>(float lo, float hi) {
  unsigned d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

template <typename T> __device__ __forceinline__ T value_of(unsigned low16) {
  T v;
  v.bits = (unsigned short)(low16 & 0xFFFFu);
  return v;
}

template <typename T, int ACT> __device__ __forceinline__ T activated(float z) {
  return from_acc<T>(activate<ACT>(to_acc(from_acc<T>(z))));
}

struct PackArgs {
  int M, N, tile_n, n_tiles, capacity;
  double threshold;
  // ceil(65536 / (capacity / 4)): (i * row_vectors_inv) >> 16 is i / (capacity / 4) exactly for
  // i < 2 capacity, the 16-byte vectors of 8 rows of one 256-column row-tile (capacity / 4, the
  // vectors of a row, is 2 to 16; the error i (ceil - exact) / 65536 stays below 1 / 512).
  unsigned row_vectors_inv;
};

// The accumulators of one half (I) of a math warp's 16 rows rounded to T, two per register
// (e = 0 low, e = 1 high): what the epilogue starts from. Registers are indexed by constants only.
template <typename T, int I> __device__ __forceinline__ void rounded_pairs(const float* acc, unsigned (&pair)[32]) {
#pragma unroll
  for (int j = 0; j < 32; ++j) pair[j] = rounded_pair<T>(acc[4 * j + 2 * I], acc[4 * j + 2 * I + 1]);
}

// Vector k of global row `grow`'s staged slots (its row-tiles of this block, from `staged_row` in
// the warp's stage: val_vectors 16-byte vectors of values, then those of indices) to the TwELL
// arrays, where the row's row-tiles from tile0 on are adjacent.
template <typename T>
__device__ __forceinline__ void store_slot_vector(const PackArgs& p, long long grow, int tile0, int staged_row, int k,
                                                  int val_vectors, const T* s_val, const short* s_idx,
                                                  T* __restrict__ data, short* __restrict__ indices) {
  const long long slot0 = (grow * p.n_tiles + tile0) * p.capacity;
  if (k < val_vectors)
    reinterpret_cast<uint4*>(data + slot0)[k] = reinterpret_cast<const uint4*>(s_val + staged_row)[k];
  else
    reinterpret_cast<uint4*>(indices + slot0)[k - val_vectors] =
        reinterpret_cast<const uint4*>(s_idx + staged_row)[k - val_vectors];
}

// The epilogue of one half (half) of a math warp's 16 rows: 8 rows, each held by a quad of lanes
// in the accumulator layout, from their values rounded to T (rounded_pairs). Run by the math warp
// itself (SPLIT = 0) or by a pack warp whose lanes stand for the math warp's (SPLIT = 1).
//
// Under a sustained load the producer runs at the board's power cap, where its time follows its
// energy, and the epilogue's instructions are what it spends beyond the GEMM's (bench/NOTES.md,
// thirty-seventh session). So the common case has code of its own: RELU256 (relu on 256-column
// row-tiles, the defaults, under the split schedules) makes the row-tile geometry constant (one
// row-tile per output tile: no variable 64-bit shifts, loops of one trip unrolled away, the slot
// vectors written by every lane) and reads a kept entry's value back from the handed-off tile in
// shared memory, where relu leaves it as rounded (`staged`: the shared-memory address of this
// lane's first word; pair j is word 128 (j / 4) + j % 4 from there), instead of a 31-select tree
// over the registers. Otherwise any tile_n is served at run time. Per pack unit (8 rows x 256
// columns) the SASS runs ~490 instead of ~700 instructions; pass 1 ran 0.5-1% faster in pairs
// and 1.3% split in a same-machine A/B (H100, thirty-seventh session, TWELL_HOPPER_TILE256).
template <typename T, int ACT, bool RELU256 = false>
__device__ __forceinline__ void pack_pairs(unsigned (&pair)[32], int half, const PackArgs& p, int row0, int nb,
                                           unsigned char* stage, T* __restrict__ data, short* __restrict__ indices,
                                           int* __restrict__ counts, int* __restrict__ row_tile_nnz,
                                           T* __restrict__ h, unsigned* __restrict__ mask, long long mask_ld,
                                           unsigned staged = 0u) {
  static_assert(!RELU256 || ACT == ACT_RELU, "the handed-off values are the rounded ones, which relu keeps");
  const int lane = threadIdx.x & 31, q = lane & 3, r = lane >> 2;
  const int row = row0 + half * 8 + r;
  const int tile_n = RELU256 ? BN : p.tile_n;
  const int tiles_here = BN / tile_n;
  const int tile0 = nb * tiles_here;
  const int row_slots = tiles_here * p.capacity;
  const int groups = tile_n >> 3;  // j values per row-tile
  const int shift = __ffs(groups) - 1;
  const int lane_bits = 2 * groups;  // bits of one lane's mask per row-tile
  T* s_val = reinterpret_cast<T*>(stage);
  short* s_idx = reinterpret_cast<short*>(stage + 8 * MAX_ROW_SLOTS * sizeof(T));

  // The activation on the rounded values (the GEMM-then-pack order: z rounded to T, activated in
  // fp32, rounded again); relu keeps the kept (positive) values as they are. A select chain below
  // picks a pair by a run-time index, so the epilogue stays small code (an unrolled branch per
  // entry made it large enough to miss the instruction cache on every tile).
  if (ACT != ACT_RELU) {
#pragma unroll
    for (int j = 0; j < 32; ++j)
      pair[j] = (unsigned)activated<T, ACT>(to_acc(value_of<T>(pair[j]))).bits |
                ((unsigned)activated<T, ACT>(to_acc(value_of<T>(pair[j] >> 16))).bits << 16);
  }
  unsigned long long mine = 0;
  if (ACT == ACT_RELU) {
    // relu keeps exactly the entries whose rounded value is above its floor (0 without a
    // threshold) and not NaN; each half of the mask in its own 32-bit register (no 64-bit shifts).
    const unsigned floor2 = p.threshold < 0.0 ? 0u : relu_floor<T>(p.threshold);
    unsigned half_mask[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 32; ++j) or_greater_bits<T>(pair[j], floor2, half_mask[j >> 4], (2 * j) & 31);
    mine = ((unsigned long long)half_mask[1] << 32) | half_mask[0];
  } else {
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (keep(to_acc(value_of<T>(pair[j] >> (16 * e))), p.threshold)) mine |= 1ull << (2 * j + e);
  }
  unsigned long long quad[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) quad[s] = shfl_u64(mine, (lane & ~3) | s);

  // Every slot of the 8 rows starts unused (value 0, index -1): 16-byte stores, row_slots of
  // them per array (8 rows x row_slots x 2 bytes), before the kept entries overwrite theirs.
  for (int v = lane; v < row_slots; v += 32) {
    reinterpret_cast<uint4*>(s_val)[v] = make_uint4(0u, 0u, 0u, 0u);  // 0 is +0.0 in both types
    reinterpret_cast<uint4*>(s_idx)[v] = make_uint4(~0u, ~0u, ~0u, ~0u);
  }
  __syncwarp();
  // Per row-tile: totals, counts; which row-tiles overflow.
  unsigned over = 0;
  for (int st = 0; st < tiles_here; ++st) {
    const unsigned long long sel = low_bits(lane_bits);
    const int sh = st * lane_bits;
    int total = 0;
#pragma unroll
    for (int s = 0; s < 4; ++s) total += __popcll((quad[s] >> sh) & sel);
    const int tile = tile0 + st;
    if (row < p.M && tile < p.n_tiles) {
      if (q == 0) {
        counts[(long long)row * p.n_tiles + tile] = min(total, p.capacity);
        row_tile_nnz[(long long)row * p.n_tiles + tile] = total;
      }
      if (total > p.capacity) over |= 1u << st;
    }
  }
  // Kept entries to their slots (and, for overflowing row-tiles, to h), one set bit at a time.
  for (unsigned long long left = mine; left; left &= left - 1ull) {
    const int bit = __ffsll((long long)left) - 1, j = bit >> 1, e = bit & 1;
    const int st = RELU256 ? 0 : j >> shift, jl = j & (groups - 1);
    const int sh = st * lane_bits;
    int rank = 0;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int below = s < q ? 2 * jl + 2 : (s > q ? 2 * jl : 2 * jl + e);
      rank += __popcll((quad[s] >> sh) & low_bits(below));
    }
    unsigned word;
    if constexpr (RELU256) {
      asm volatile("ld.shared.u32 %0, [%1];" : "=r"(word) : "r"(staged + 4u * (128 * (j >> 2) + (j & 3))));
    } else {
      // pair[j] for a run-time j: a tree of selects on j's bits (31 selects, no compares).
      unsigned l16[16], l8[8], l4[4];
#pragma unroll
      for (int i = 0; i < 16; ++i) l16[i] = (j & 16) ? pair[i + 16] : pair[i];
#pragma unroll
      for (int i = 0; i < 8; ++i) l8[i] = (j & 8) ? l16[i + 8] : l16[i];
#pragma unroll
      for (int i = 0; i < 4; ++i) l4[i] = (j & 4) ? l8[i + 4] : l8[i];
      const unsigned l2a = (j & 2) ? l4[2] : l4[0], l2b = (j & 2) ? l4[3] : l4[1];
      word = (j & 1) ? l2b : l2a;
    }
    const T v = value_of<T>(word >> (16 * e));
    if (rank < p.capacity) {
      s_val[r * row_slots + st * p.capacity + rank] = v;
      s_idx[r * row_slots + st * p.capacity + rank] = (short)(8 * jl + 2 * q + e);
    }
    if ((over >> st) & 1u) h[(long long)row * p.N + (long long)nb * BN + 8 * j + 2 * q + e] = v;
  }
  // Mask words of overflowing row-tiles (the spill pass reads them): word w of the block covers
  // columns 32w .. 32w + 31, i.e. j = 4w .. 4w + 3 of every lane of the quad.
  if (over) {
    const int words_per_tile = tile_n >> 5;
    for (int w = q; w < 8; w += 4) {
      const int st = w / words_per_tile;
      if (!((over >> st) & 1u)) continue;
      unsigned word = 0;
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) word |= (unsigned)((quad[s] >> (2 * (4 * w + jj))) & 3ull) << (8 * jj + 2 * s);
      mask[row * mask_ld + (long long)nb * (BN / 32) + w] = word;
    }
  }
  __syncwarp();
  // The 8 rows' slots out as 16-byte vectors (capacity is a multiple of 8).
  if constexpr (RELU256) {
    // One row-tile (nb < n_tiles): capacity / 8 vectors of values, then as many of indices, a row;
    // the 8 rows' vectors spread over all the lanes.
    const int val_vectors = p.capacity >> 3, per_row = p.capacity >> 2;
    static_assert(MAX_ROW_SLOTS / 4 <= 16, "row_vectors_inv's quotient is exact below 8 x 16 vectors");
    for (int i = lane; i < 8 * per_row; i += 32) {
      const int rr = (int)(((unsigned)i * p.row_vectors_inv) >> 16), k = i - rr * per_row;
      const long long grow = row0 + half * 8 + rr;
      if (grow < p.M) store_slot_vector(p, grow, tile0, rr * row_slots, k, val_vectors, s_val, s_idx, data, indices);
    }
    __syncwarp();
    return;
  }
  const int live_tiles = min(tiles_here, p.n_tiles - tile0);
  const int val_vectors = live_tiles * p.capacity * (int)sizeof(T) / 16;
  const int idx_vectors = live_tiles * p.capacity / 8;
  static_assert(MAX_ROW_SLOTS / 4 <= 16, "a row's 16-byte vectors fit in a half-warp");
  const int per_row = val_vectors + idx_vectors;  // at most MAX_ROW_SLOTS / 4
  const int k = lane & 15;  // a half-warp per row, two rows per step: no division
  for (int rr = lane >> 4; rr < 8; rr += 2) {
    const long long grow = row0 + half * 8 + rr;
    if (grow < p.M && k < per_row)
      store_slot_vector(p, grow, tile0, rr * row_slots, k, val_vectors, s_val, s_idx, data, indices);
  }
  __syncwarp();
}

// The kernel body (see the top of this file) for a cluster of CLUSTER CTAs along M (1 or 2): the
// CTAs of a cluster compute row blocks CLUSTER p .. CLUSTER p + CLUSTER - 1 of one column block,
// and each copies 1 / CLUSTER of the shared w tile into every CTA's stage (TMA multicast), so the
// L2 sends each w tile once per cluster instead of once per CTA. A stage is then refilled only
// when the math warps of every CTA have released it: each math warp arrives on the stage's
// barrier in every CTA of the cluster.
template <typename T, int ACT, int SPLIT, int CLUSTER>
__device__ __forceinline__ void gemm_pack(const TensorMap& map_x, const TensorMap& map_w, int M, int N, int K,
                                          int tile_n, int n_tiles, int capacity, double threshold,
                                          T* __restrict__ data, short* __restrict__ indices, int* __restrict__ counts,
                                          int* __restrict__ row_tile_nnz, T* __restrict__ h,
                                          unsigned* __restrict__ mask, long long mask_ld) {
  static_assert(CLUSTER == 1 || (CLUSTER == 2 && BN % 2 == 0), "clusters of 1 or 2 CTAs");
  using S = Schedule<SPLIT>;
  constexpr int STAGES = S::STAGES;
  // Groups of MMAs (one per k block) a math warp leaves in flight before freeing a stage. The
  // split schedules' 3 stages free each one as soon as its own MMAs are done: the other math
  // warpgroup's keep the tensor cores busy meanwhile, and the copies run a stage further ahead,
  // which made pass 1 1.6% faster in pairs and 2.7% split (H100, bench/NOTES.md, thirty-eighth
  // session); the inline schedule's 4 stages gain nothing from it and keep one group in flight.
  constexpr int IN_FLIGHT = SPLIT ? 0 : 1;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Aligned by an offset from the array itself (not through an integer), so that the compiler
  // still knows every pointer derived from it is shared memory: the epilogue's loads and stores
  // then compile to LDS / STS instead of generic LD / ST.
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const unsigned ring = smem_u32(smem);
  unsigned* handoff = reinterpret_cast<unsigned*>(smem + STAGES * STAGE_BYTES);
  // full[s] at 8 s, empty[s] at 8 (STAGES + s); SPLIT: handed-off at 16 STAGES, drained after it.
  const unsigned bars = ring + STAGES * STAGE_BYTES + S::HANDOFF_BYTES;
  const unsigned handed_off = bars + 16 * STAGES, drained = handed_off + 8;
  unsigned char* epilogue_stage = smem + STAGES * STAGE_BYTES + S::HANDOFF_BYTES + S::BARRIER_BYTES;

  const int m_blocks = (M + BM - 1) / BM, n_blocks = (N + BN - 1) / BN, k_blocks = (K + BK - 1) / BK;
  // The cluster's work items: CLUSTER row blocks x one column block (rows past M read as zeros
  // and are not written), visited GROUP_M row blocks at a time.
  const int m_groups = (m_blocks + CLUSTER - 1) / CLUSTER;
  const int tiles = m_groups * n_blocks;
  const int first_tile = blockIdx.x / CLUSTER, tile_step = gridDim.x / CLUSTER;
  const unsigned rank = CLUSTER > 1 ? cluster_rank() : 0u;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      barrier_init(bars + 8 * s, 1);                 // the copy thread's expect_tx arrival
      barrier_init(bars + 8 * (STAGES + s), 8 * CLUSTER);  // one arrival per math warp of the cluster
    }
    if (SPLIT) {
      barrier_init(handed_off, 256);                 // every math thread, after its stores
      barrier_init(drained, 96);                     // every pack thread, after its loads
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (CLUSTER > 1) cluster_sync();  // the peers' barriers exist before any copy or arrival reaches them
  else __syncthreads();

  const int wg = threadIdx.x / 128;
  const int lane = threadIdx.x & 31;
  const unsigned row_vectors = (unsigned)max(capacity >> 2, 1);
  const PackArgs args{M, N, tile_n, n_tiles, capacity, threshold, (65536u + row_vectors - 1u) / row_vectors};
  if (wg == 0 && (!SPLIT || threadIdx.x < 32)) {
    if (!SPLIT) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int it = 0;
      for (int t = first_tile; t < tiles; t += tile_step) {
        int mg, nb;
        tile_coords(t, m_groups, n_blocks, GROUP_M / CLUSTER, mg, nb);
        const int mb = mg * CLUSTER + (int)rank;
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = it % STAGES;
          barrier_wait(bars + 8 * (STAGES + s), ((it / STAGES) & 1) ^ 1);
          barrier_expect_bytes(bars + 8 * s, STAGE_BYTES);  // x tile and the whole w tile land here
          tma_load_2d(ring + s * STAGE_BYTES, &map_x, kb * BK, mb * BM, bars + 8 * s);
          if (CLUSTER == 1)
            tma_load_2d(ring + s * STAGE_BYTES + A_BYTES, &map_w, kb * BK, nb * BN, bars + 8 * s);
          else  // this CTA's share of the w tile, to every CTA (map_w's boxes are BN / CLUSTER rows)
            tma_load_2d_multicast(ring + s * STAGE_BYTES + A_BYTES + rank * (B_BYTES / CLUSTER), &map_w, kb * BK,
                                  nb * BN + (int)rank * (BN / CLUSTER), bars + 8 * s, (1u << CLUSTER) - 1u);
        }
      }
    }
  } else if (wg > 0) {
    if (!SPLIT) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int math = wg - 1;                    // rows 64 math .. 64 math + 63 of the tile
    const int warp = (threadIdx.x >> 5) & 3;    // rows 16 warp .. of those
    const int v = math * 4 + warp;              // the math warp's 16 rows of the tile
    float acc[128];
    int it = 0, round = 0;
    for (int t = first_tile; t < tiles; t += tile_step, ++round) {
      int mg, nb;
      tile_coords(t, m_groups, n_blocks, GROUP_M / CLUSTER, mg, nb);
      const int mb = mg * CLUSTER + (int)rank;
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % STAGES;
        barrier_wait(bars + 8 * s, (it / STAGES) & 1);
        const unsigned a_tile = ring + s * STAGE_BYTES + math * (64 * 128);
        const unsigned b_tile = ring + s * STAGE_BYTES + A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
          wgmma_m64n256k16<T>(acc, sw128_descriptor(a_tile) + 2 * kk, sw128_descriptor(b_tile) + 2 * kk);
        wgmma_commit();
        // Once the k block IN_FLIGHT groups back is done, its stage is free.
        wgmma_wait<IN_FLIGHT>();
        if (kb >= IN_FLIGHT && lane == 0)
          release_stage<CLUSTER>(bars + 8 * (STAGES + (it - IN_FLIGHT) % STAGES));
      }
      if (IN_FLIGHT) {  // the tile's last k block
        wgmma_wait<0>();
        if (k_blocks > 0 && lane == 0) release_stage<CLUSTER>(bars + 8 * (STAGES + (it - 1) % STAGES));
      }
#if TWELL_HOPPER_PACK
      if (SPLIT) {
        // Hand the tile over: once the pack warpgroup has drained the previous one, this warp's
        // rounded pairs go to the buffer as 16-byte vectors (consecutive lanes, consecutive
        // vectors: no bank conflicts), in the order the pack warp reads them back.
        if (round > 0) barrier_wait(drained, (round - 1) & 1);
        // Four pairs at a time, both halves, so the accumulators die as they go (no spill).
        uint4* out = reinterpret_cast<uint4*>(handoff) + v * 2 * 8 * 32 + lane;
#pragma unroll
        for (int j4 = 0; j4 < 8; ++j4)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float* a = acc + 16 * j4 + 2 * half;  // acc[4 j + 2 half + e], j = 4 j4 + jj
            out[(half * 8 + j4) * 32] = make_uint4(rounded_pair<T>(a[0], a[1]), rounded_pair<T>(a[4], a[5]),
                                                   rounded_pair<T>(a[8], a[9]), rounded_pair<T>(a[12], a[13]));
          }
        barrier_arrive(handed_off);
      } else {
        unsigned char* stage = epilogue_stage + v * WARP_STAGE_BYTES;
        const int row0 = mb * BM + v * 16;
        unsigned pair[32];
        rounded_pairs<T, 0>(acc, pair);
        pack_pairs<T, ACT>(pair, 0, args, row0, nb, stage, data, indices, counts, row_tile_nnz, h, mask, mask_ld);
        rounded_pairs<T, 1>(acc, pair);
        pack_pairs<T, ACT>(pair, 1, args, row0, nb, stage, data, indices, counts, row_tile_nnz, h, mask, mask_ld);
      }
#else
      // The MMAs' results must look used, or the compiler drops them (M is never negative).
      if (M < 0) {
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 128; ++i) sum += acc[i];
        h[threadIdx.x] = from_acc<T>(sum);
      }
#endif
    }
  } else {
#if TWELL_HOPPER_PACK
    // The pack warps (SPLIT; warps 1-3): 16 units of work per handed-off tile, a half (8 rows)
    // of one math warp's 16 rows each, taken round robin; the lanes stand for the math warp's.
    const int pw = (threadIdx.x >> 5) - 1;
    unsigned char* stage = epilogue_stage + pw * WARP_STAGE_BYTES;
    int round = 0;
    for (int t = first_tile; t < tiles; t += tile_step, ++round) {
      int mg, nb;
      tile_coords(t, m_groups, n_blocks, GROUP_M / CLUSTER, mg, nb);
      const int mb = mg * CLUSTER + (int)rank;
      barrier_wait(handed_off, round & 1);
      for (int u = pw; u < 16; u += 3) {
        const int v = u >> 1, half = u & 1;
        const uint4* in = reinterpret_cast<const uint4*>(handoff) + (v * 2 + half) * 8 * 32 + lane;
        unsigned pair[32];
#pragma unroll
        for (int j4 = 0; j4 < 8; ++j4) {
          const uint4 w4 = in[32 * j4];
          pair[4 * j4] = w4.x, pair[4 * j4 + 1] = w4.y, pair[4 * j4 + 2] = w4.z, pair[4 * j4 + 3] = w4.w;
        }
        // relu on 256-column row-tiles (the defaults) takes the epilogue's code of its own (the
        // other activations keep one copy of the epilogue: two left the f16 silu one spilling).
        if constexpr (ACT == ACT_RELU && TWELL_HOPPER_TILE256) {
          if (args.tile_n == BN) {
            pack_pairs<T, ACT, true>(pair, half, args, mb * BM + v * 16, nb, stage, data, indices, counts,
                                     row_tile_nnz, h, mask, mask_ld, smem_u32(in));
            continue;
          }
        }
        pack_pairs<T, ACT>(pair, half, args, mb * BM + v * 16, nb, stage, data, indices, counts, row_tile_nnz, h,
                           mask, mask_ld);
      }
      barrier_arrive(drained);
    }
#endif
  }
  // No CTA leaves while a peer may still copy into its shared memory or arrive on its barriers.
  if (CLUSTER > 1) cluster_sync();
}

}  // namespace hopper
}  // namespace twell

using namespace twell;

// The fused producer, one CTA per work item. Launch: persistent grid (at most one block per SM),
// hopper::Schedule<SPLIT>::THREADS threads and ::SMEM_BYTES of dynamic shared memory.
template <typename T, int ACT, int SPLIT>
__global__ void __launch_bounds__(hopper::Schedule<SPLIT>::THREADS, 1)
    twell_gemm_pack(const __grid_constant__ TensorMap map_x, const __grid_constant__ TensorMap map_w,
                    int M, int N, int K, int tile_n, int n_tiles, int capacity, double threshold,
                    T* __restrict__ data, short* __restrict__ indices, int* __restrict__ counts,
                    int* __restrict__ row_tile_nnz, T* __restrict__ h, unsigned* __restrict__ mask, long long mask_ld) {
  hopper::gemm_pack<T, ACT, SPLIT, 1>(map_x, map_w, M, N, K, tile_n, n_tiles, capacity, threshold, data, indices,
                                      counts, row_tile_nnz, h, mask, mask_ld);
}

// The same with the split schedule in clusters of two CTAs sharing each w tile (map_w's boxes are
// BN / 2 rows). Launch: as twell_gemm_pack<T, ACT, 1>, an even grid of at most twice the GPU's
// co-resident clusters.
template <typename T, int ACT>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(hopper::Schedule<1>::THREADS, 1)
    twell_gemm_pack_pair(const __grid_constant__ TensorMap map_x,
                         const __grid_constant__ TensorMap map_w, int M, int N, int K, int tile_n,
                         int n_tiles, int capacity, double threshold, T* __restrict__ data,
                         short* __restrict__ indices, int* __restrict__ counts, int* __restrict__ row_tile_nnz,
                         T* __restrict__ h, unsigned* __restrict__ mask, long long mask_ld) {
  hopper::gemm_pack<T, ACT, 1, 2>(map_x, map_w, M, N, K, tile_n, n_tiles, capacity, threshold, data, indices,
                                  counts, row_tile_nnz, h, mask, mask_ld);
}
