// The gated FFN's up projection on the tiled SpMM's pack of the gate: for every word (entry
// (token, unit) of g, value g), u = x[token] . W_up[unit] and h = g * u, written as the same word
// with h's value bits into h_words, on which twell_tiled_spmm then runs the down projection. One
// pack serves both halves of the consumer, and neither reads a weight row per entry from L2.
//
// A block owns 512 tokens (64 groups of 8) and one chunk of 512 units, and steps over d in
// slices of 32 columns: W_up[chunk's units, slice] and x[block's tokens, slice] (32 KB each,
// TMA, 64-byte swizzle) through a ring of TFFN_STAGES stages. Per k-group (16 entries of one
// group) and slice, two m16n8k16 MMAs: M = the 16 entries (A: their W_up rows, gathered by
// ldmatrix: a lane gives one entry's row address), N = the group's 8 tokens (B: their x rows,
// one ldmatrix.x4 per slice, kept while consecutive k-groups share the group), K = 16 columns.
// D[e][n] = W_up[unit e] . x[token n]; entry e keeps column row(e) of its row: the four lanes of
// g = e hold D[e][2t .. 2t + 1], so the lane with t = row(e) / 2 writes it. Each sum reads only
// its own entry's W_up row and token's x row: no value of another entry enters it.
//
// Bank conflicts: a matrix of ldmatrix reads the same 16-byte piece of 8 rows of 64 bytes; with
// the 64-byte swizzle (piece p of row r stored at p ^ ((r / 2) % 4)) rows of distinct r % 8 hit
// distinct banks. The pack spreads each item's unit % 8 classes over its octets (the tiled SpMM's
// classes: the same order serves both kernels), and a group's 8 tokens are consecutive.
//
// Work: the block's k-groups (over its 64 groups) are cut into rounds of TFFN_WARPS x
// TFFN_KGROUPS, each warp a contiguous run (so consecutive k-groups mostly share the group and
// its x fragment), fp32 sums in registers (4 per k-group); a block with more k-groups takes more
// rounds, each streaming the slices again (exact at any density).
#include "twell_mma.cuh"
#include "twell_tiled.cuh"
#include "twell_tma.cuh"
#include "twell_types.cuh"

namespace twell {

constexpr int TFFN_COLS = 32;       // d columns per slice: 64-byte rows
constexpr int TFFN_KGROUPS = 16;    // k-groups per warp and round (4 sums each)
constexpr int TFFN_WARPS = 16;
constexpr int TFFN_STAGES = 3;
constexpr int TFFN_X_BYTE = TSPMM_CHUNK * TFFN_COLS * 2;                 // x's rows after W_up's: 32 KB
constexpr int TFFN_STAGE_BYTES = TFFN_X_BYTE + TSPMM_ROWS * TFFN_COLS * 2;  // 64 KB
constexpr int TFFN_GROUPS = TSPMM_ROWS / TSPMM_GROUP;                      // 64 groups per block
// The stages (1024-byte aligned), a full and an empty barrier per stage, the groups' k-group
// ranges (first k-group, and the block's running count before each group), 1 KB of slack.
constexpr int TFFN_SHARED_BYTES =
    1024 + TFFN_STAGES * TFFN_STAGE_BYTES + 2 * TFFN_STAGES * 8 + (2 * TFFN_GROUPS + 1) * 4;
static_assert(TFFN_SHARED_BYTES <= 227 * 1024, "the ring fits one block's shared memory");
static_assert(TSPMM_WARP_GROUPS * TSPMM_WARPS * TSPMM_GROUP == TSPMM_ROWS, "blocks of the SpMM's rows");

// The group (0 .. 63) of the block's k-group q: the last group whose running count is <= q.
__device__ __forceinline__ int tffn_group_of(const int* before, int q) {
  int lo = 0;
#pragma unroll
  for (int step = TFFN_GROUPS / 2; step > 0; step >>= 1)
    if (before[lo + step] <= q) lo += step;
  return lo;
}

}  // namespace twell

// FORWARD (BACKWARD = 0): out_words = the gate's words (kg_ptr, words: _tiled_spmm.pack of the
// gate, n_chunks its unit chunks) with h = g * u in their value bits, u = x . W_up[unit] rounded
// to T, h = g * u in fp32 rounded to T (the row gathers' roundings); padding words (marked)
// get h = 0. With dests (the pack's places of the words in the gate's parts) and
// u_data, u is also written there (u_spill for ~index places). map_w: W_up [N, d], map_x: x [M, d].
//
// BACKWARD = 1, the gated backward's sampled product and its value products: with map_w =
// W_down^T [N, d] and map_x = dy [M, d] the sum is d_h = dy . W_down^T[unit] rounded to T; with
// g the word's value and u read at its place (u_data / u_spill), d_z = d_h * u, d_u = d_h * g and
// h = g * u (fp32 products of the rounded operands, rounded to T: the fused row-gather kernel's
// roundings) are written at the place in the gate's layout (dz_*, du_*, h_*), and d_z and d_u
// also as words (out_words, out_words2) for the dX SpMM's dual form. Padding words get zeros.
//
// Block (x, y): unit chunk x, tokens [512 y, 512 y + 512). Both maps: boxes of 32 columns x 256
// rows, 64-byte swizzle (rows and columns past the matrices read as zeros).
//
// CLUSTER = 2 (twell_tiled_ffn_up_pair): the blocks of two consecutive unit chunks and the same
// tokens form a cluster and share x's slices: each copies one of x's two 256-row boxes into both
// CTAs (TMA multicast), so L2 sends x once per pair (x is half of each slice's bytes: a quarter
// of the kernel's L2 traffic saved). A stage is then refilled only once the warps of both CTAs
// have released it (its empty barrier counts both), both CTAs stream the slices for as many
// rounds as the busier of the two needs, and neither exits before the other is done.
#define TFFN_ARGS                                                                                                  \
  const twell::TensorMap &map_w, const twell::TensorMap &map_x, const int *__restrict__ kg_ptr,                  \
      const unsigned *__restrict__ words, const int *__restrict__ dests, int M, int K, int n_chunks,             \
      unsigned *__restrict__ out_words, unsigned *__restrict__ out_words2, T *__restrict__ u_data,               \
      T *__restrict__ u_spill, T *__restrict__ dz_data, T *__restrict__ dz_spill, T *__restrict__ du_data,       \
      T *__restrict__ du_spill, T *__restrict__ h_data, T *__restrict__ h_spill
#define TFFN_PARAMS                                                                                                \
  const __grid_constant__ twell::TensorMap map_w, const __grid_constant__ twell::TensorMap map_x,                \
      const int *__restrict__ kg_ptr, const unsigned *__restrict__ words, const int *__restrict__ dests, int M,  \
      int K, int n_chunks, unsigned *__restrict__ out_words, unsigned *__restrict__ out_words2,                  \
      T *__restrict__ u_data, T *__restrict__ u_spill, T *__restrict__ dz_data, T *__restrict__ dz_spill,        \
      T *__restrict__ du_data, T *__restrict__ du_spill, T *__restrict__ h_data, T *__restrict__ h_spill
#define TFFN_FORWARD                                                                                               \
  map_w, map_x, kg_ptr, words, dests, M, K, n_chunks, out_words, out_words2, u_data, u_spill, dz_data, dz_spill, \
      du_data, du_spill, h_data, h_spill

template <typename T, int BACKWARD, int CLUSTER>
__device__ __forceinline__ void tiled_ffn_up_body(TFFN_ARGS) {
  using namespace twell;
  constexpr int NK = TFFN_KGROUPS;
  extern __shared__ __align__(1024) unsigned char raw[];
  const unsigned base = (smem_u32(raw) + 1023u) & ~1023u;
  const unsigned full = base + TFFN_STAGES * TFFN_STAGE_BYTES, empty = full + 8 * TFFN_STAGES;
  int* first_kg = reinterpret_cast<int*>(raw + (full - smem_u32(raw)) + 16 * TFFN_STAGES);
  int* before = first_kg + TFFN_GROUPS;  // TFFN_GROUPS + 1 running counts
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned g = lane >> 2, t = lane & 3;
  const int chunk = blockIdx.x, tok0 = blockIdx.y * TSPMM_ROWS, grp0 = tok0 / TSPMM_GROUP;
  const int n_groups = (M + TSPMM_GROUP - 1) / TSPMM_GROUP;
  const int n_slices = (K + TFFN_COLS - 1) / TFFN_COLS;

  const unsigned rank = CLUSTER > 1 ? cluster_rank() : 0u;
  if (threadIdx.x == 0) {
    for (int s = 0; s < TFFN_STAGES; ++s) {
      barrier_init(full + 8 * s, 1);                     // the copying thread's expect_tx arrival
      barrier_init(empty + 8 * s, TFFN_WARPS * CLUSTER);  // every warp of the cluster done with it
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (warp == 0) {  // the 64 groups' k-group ranges: lane l has groups 2l and 2l + 1
    int lo[2], n[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int grp = grp0 + 2 * lane + i;
      const long long item = (long long)grp * n_chunks + chunk;
      const bool live = grp < n_groups && chunk < n_chunks;  // a pair's second block may have no chunk
      lo[i] = live ? kg_ptr[item] : 0;
      n[i] = live ? kg_ptr[item + 1] - lo[i] : 0;
    }
    int incl = n[0] + n[1];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += up;
    }
    first_kg[2 * lane] = lo[0];
    first_kg[2 * lane + 1] = lo[1];
    before[2 * lane] = incl - n[0] - n[1];
    before[2 * lane + 1] = incl - n[1];
    if (lane == 31) before[TFFN_GROUPS] = incl;
  }
  if (CLUSTER > 1) cluster_sync();  // the peer's barriers and totals exist before any copy or read
  else __syncthreads();
  const int total = before[TFFN_GROUPS];
  // Rounds of TFFN_WARPS x NK k-groups; a pair streams as many as the busier block needs.
  const int busiest = CLUSTER > 1 ? max(total, load_from_cta(before + TFFN_GROUPS, rank ^ 1u)) : total;
  const int rounds = (busiest + TFFN_WARPS * NK - 1) / (TFFN_WARPS * NK);
  const int issues = rounds * n_slices;  // slices streamed through the ring, all rounds

  // Issue number `it` (slice it % n_slices of a round) into stage it % TFFN_STAGES, once every
  // warp of the cluster has released the stage's previous use (parity trick: a fresh barrier's
  // "previous phase" counts as done, so the first TFFN_STAGES issues pass at once). W_up's two
  // boxes go to this CTA; x's two boxes too, or with CLUSTER = 2 this CTA's box to both CTAs.
  // Thread 0 only.
  auto issue = [&](int it) {
    const int s = it % TFFN_STAGES;
    barrier_wait(empty + 8 * s, ((unsigned)(it / TFFN_STAGES) & 1u) ^ 1u);
    const unsigned bar = full + 8 * s, dst = base + s * TFFN_STAGE_BYTES;
    const int c = (it % n_slices) * TFFN_COLS;
    barrier_expect_bytes(bar, TFFN_STAGE_BYTES);
    // A pair's block past the chunks has no entries; it streams the last chunk's rows (never read)
    // rather than a box wholly outside W_up, and its x box for its peer.
    const int w_row = min(chunk, n_chunks - 1) * TSPMM_CHUNK;
    tma_load_2d(dst, &map_w, c, w_row, bar);
    tma_load_2d(dst + TSPMM_BOX * 64, &map_w, c, w_row + TSPMM_BOX, bar);
    if (CLUSTER == 1) {
      tma_load_2d(dst + TFFN_X_BYTE, &map_x, c, tok0, bar);
      tma_load_2d(dst + TFFN_X_BYTE + TSPMM_BOX * 64, &map_x, c, tok0 + TSPMM_BOX, bar);
    } else {
      const unsigned box = rank * TSPMM_BOX * 64u;
      tma_load_2d_multicast(dst + TFFN_X_BYTE + box, &map_x, c, tok0 + (int)rank * TSPMM_BOX, bar, 3);
    }
  };
  if (threadIdx.x == 0)
    for (int it = 0; it < TFFN_STAGES && it < issues; ++it) issue(it);

  // This lane's ldmatrix rows: for A (W_up), entry (lane % 8) + 8 ((lane / 8) % 2) of a k-group,
  // columns 8 (lane / 16) .. + 7 of each 16 (matrices: entries 0-7 and 8-15, columns 0-7 and
  // 8-15: a0 .. a3); for B (x), token lane % 8 of the group, columns 8 (lane / 8) .. + 7 of the
  // slice (b0, b1 of columns 0-15 and of 16-31). x's swizzle depends on the token's row in the
  // block, whose (row / 2) % 4 is (lane % 8) / 2.
  const int a_entry = (lane & 7) + ((lane >> 3) & 1) * 8, a_piece = lane >> 4;
  const unsigned x_lane = (unsigned)(lane & 7) * 64u + ((unsigned)((lane >> 3) ^ ((lane & 7) >> 1)) << 4);

  int ring = 0;  // slices consumed so far by this block, all rounds (the ring position and phase)
  for (int round = 0; round < rounds; ++round) {
    const int r0 = round * TFFN_WARPS * NK, n = max(0, min(TFFN_WARPS * NK, total - r0));
    const int lo = r0 + warp * n / TFFN_WARPS, cnt = r0 + (warp + 1) * n / TFFN_WARPS - lo;
    // Per k-group: bits 0-14 this lane's W_up piece offset in a stage (unit * 64 + swizzled
    // piece of columns 0-15; columns 16-31 are that ^ 32), bits 15-29 its x piece offset past
    // TFFN_X_BYTE (k-groups of one group share it). Past cnt: the last one's (never summed).
    unsigned where[NK];
    float acc[NK][4];
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      const int q = lo + min(i, max(cnt - 1, 0));
      const int grp = tffn_group_of(before, q);
      const int kg = first_kg[grp] + q - before[grp];
      const unsigned unit = cnt > 0 ? tspmm_word_b_row(__ldg(words + (long long)kg * TSPMM_KGROUP + a_entry)) : 0u;
      const unsigned w_off = unit * 64u + ((((unsigned)a_piece) ^ ((unit >> 1) & 3u)) << 4);
      where[i] = w_off | (((unsigned)grp * TSPMM_GROUP * 64u + x_lane) << 15);
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    }
    for (int slice = 0; slice < n_slices; ++slice, ++ring) {
      const int s = ring % TFFN_STAGES;
      const unsigned parity = (ring / TFFN_STAGES) & 1u;
      barrier_wait(full + 8 * s, parity);
      const unsigned sb = base + s * TFFN_STAGE_BYTES;
      unsigned xf[4];
#pragma unroll
      for (int i = 0; i < NK; ++i) {
        if (i < cnt) {
          const unsigned w = where[i];
          if (i == 0 || (w >> 15) != (where[i > 0 ? i - 1 : 0] >> 15)) ldmatrix_x4(xf, sb + TFFN_X_BYTE + (w >> 15));
          unsigned a[4], a2[4];  // both halves' ldmatrix before their MMAs: their latencies overlap
          const unsigned wa = sb + (w & 0x7fffu);
          ldmatrix_x4(a, wa);
          ldmatrix_x4(a2, wa ^ 32u);
          mma_m16n8k16<T>(acc[i], a[0], a[1], a[2], a[3], xf[0], xf[1]);
          mma_m16n8k16<T>(acc[i], a2[0], a2[1], a2[2], a2[3], xf[2], xf[3]);
        }
      }
      __syncwarp();
      if (lane == 0) release_stage<CLUSTER>(empty + 8 * s);
      if (threadIdx.x == 0 && ring + TFFN_STAGES < issues) issue(ring + TFFN_STAGES);
    }
    // Entry g of each k-group (and g + 8): the lane with t = row / 2 writes its results.
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      if (i < cnt) {
        const int q = lo + i, grp = tffn_group_of(before, q);
        const long long at = (long long)(first_kg[grp] + q - before[grp]) * TSPMM_KGROUP;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const long long e = at + g + 8 * half;
          const unsigned w = __ldg(words + e);
          const unsigned row = tspmm_word_row(w);
          if ((row >> 1) == t) {
            const float sum = (row & 1u) ? acc[i][2 * half + 1] : acc[i][2 * half];
            const int dest = dests != nullptr ? __ldg(dests + e) : TSPMM_PAD;
            const bool pad = (w & TSPMM_PAD_BIT) != 0u;
            const long long where = dest >= 0 ? dest : ~(long long)dest;
            T gv;
            gv.bits = (unsigned short)(w >> 16);
            const float gf = to_acc(gv), dot = to_acc(from_acc<T>(sum));  // u, or d_h
            if (!BACKWARD) {
              const T hv = pad ? from_acc<T>(0.f) : from_acc<T>(gf * dot);
              out_words[e] = ((unsigned)hv.bits << 16) | (w & 0xffffu);
              if (u_data != nullptr && !pad) (dest >= 0 ? u_data : u_spill)[where] = from_acc<T>(dot);
            } else {
              const float u = pad ? 0.f : to_acc((dest >= 0 ? u_data : u_spill)[where]);
              const T dz = pad ? from_acc<T>(0.f) : kept_product<T>(dot, u), du = pad ? from_acc<T>(0.f) : kept_product<T>(dot, gf);
              out_words[e] = ((unsigned)dz.bits << 16) | (w & 0xffffu);
              out_words2[e] = ((unsigned)du.bits << 16) | (w & 0xffffu);
              if (!pad) {
                (dest >= 0 ? dz_data : dz_spill)[where] = dz;
                (dest >= 0 ? du_data : du_spill)[where] = du;
                (dest >= 0 ? h_data : h_spill)[where] = kept_product<T>(gf, u);
              }
            }
          }
        }
      }
    }
  }
  // The peer may still copy into this CTA's stages or arrive on its barriers until it is done.
  if (CLUSTER > 1) cluster_sync();
}

template <typename T, int BACKWARD>
__global__ void __launch_bounds__(twell::TFFN_WARPS * 32, 1) twell_tiled_ffn_up(TFFN_PARAMS) {
  tiled_ffn_up_body<T, BACKWARD, 1>(TFFN_FORWARD);
}

// The same in clusters of two CTAs (consecutive unit chunks, the same tokens) sharing x's slices;
// the grid's x a multiple of 2 (a pair's second block past the chunks streams and sums nothing).
template <typename T, int BACKWARD>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(twell::TFFN_WARPS * 32, 1)
    twell_tiled_ffn_up_pair(TFFN_PARAMS) {
  tiled_ffn_up_body<T, BACKWARD, 2>(TFFN_FORWARD);
}
