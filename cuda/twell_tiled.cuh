// The tiled kernels' shared layout (twell_tiled_spmm.cu, twell_tiled_ffn.cu): blocks of 512 rows
// (64 groups of 8) and chunks of 512 columns of the sparse operand, the k-groups of 16 words
// that the pack writes per (group, chunk), and the ldmatrix forms that gather staged rows.
#pragma once

namespace twell {

constexpr int TSPMM_ROWS = 512;    // output rows per block
constexpr int TSPMM_GROUP = 8;     // rows per group: the MMA's N
constexpr int TSPMM_COLS = 64;     // output columns per block: B's 128-byte staged rows
constexpr int TSPMM_CHUNK = 512;   // B rows per stage (9 bits of a word)
constexpr int TSPMM_BOX = 256;     // B rows per TMA box (the box limit): two per stage
constexpr int TSPMM_STAGES = 3;
constexpr int TSPMM_WARPS = 16;   // the FFN kernels' warps per block (the SpMM's: its template argument)
constexpr int TSPMM_KGROUP = 16;   // entries per k-group: the MMA's K
constexpr int TSPMM_WARP_GROUPS = TSPMM_ROWS / TSPMM_GROUP / TSPMM_WARPS;  // row groups per warp: 4
constexpr int TSPMM_COL_STEPS = TSPMM_COLS / 16;                            // MMAs per k-group: 4
constexpr int TSPMM_STAGE_BYTES = TSPMM_CHUNK * TSPMM_COLS * 2;              // 64 KB
// The stages (1024-byte aligned, the 128-byte swizzle's period), then a full and an empty
// barrier per stage; 1 KB of slack to align the window.
constexpr int TSPMM_SHARED_BYTES = 1024 + TSPMM_STAGES * TSPMM_STAGE_BYTES + 2 * TSPMM_STAGES * 8;
static_assert(TSPMM_SHARED_BYTES <= 227 * 1024, "the ring fits one block's shared memory");

constexpr int TSPMM_PAD = (int)0x80000000;  // a padding word's place in A's parts (no entry)
// A word: value bits << 16 | padding mark << 15 | row in group << 12 | B row field (bits 0-11:
// B row in chunk << 3 | B row % 8, so that the product's swizzled ldmatrix offset of the row's
// 16-byte piece p is (field ^ p) << 4: one LOP3 and one shift-add per k-group).
// A padding word's mark (bit 15, which the products ignore): it repeats a real word of its item
// with value zero, and the mark tells it from an entry whose value is zero.
constexpr unsigned TSPMM_PAD_BIT = 1u << 15;
constexpr int TSPMM_ROW_SHIFT = 12;        // the row in group's bits 12-14
constexpr unsigned TSPMM_B_FIELD = 0xfffu;  // the B row field

// The placement of an item's entries over its octets (each ldmatrix matrix reads one octet's 8
// B rows; rows of one class q = row % 8 sit in one 16-byte bank group of the swizzled stage, so
// an octet costs as many shared-memory wavefronts as its most repeated class). An item of n
// entries has O = 2 ceil(n / 16) octets (its k-groups' halves; never more, so padding stays
// under 16 words per item) and costs at least max(O, c_max) wavefronts, c_max its largest class
// (a wavefront serves one entry per class). The plan: `single` octets hold at most one entry
// per class (class q's entry k < single at octet k, slot q), the other d = O - single the rest
// of every class, listed class by class, index i at octet single + i % d, slot i / d (so at
// most ceil(rest of q / d) of class q per octet); d is the first of 0 .. O with the least cost
// single + d * (most per octet) whose rest fits the d octets' 8 d slots. On uniform patterns at
// 1% that is 1.40x the octets' conflict-free wavefronts and within 0.5% of the bound (a
// simulation of 8 x 512 items), against 2.05x for classes dealt round robin with padding
// repeating the item's first entry (51% of the H200's wavefronts were conflicts, twenty-sixth
// session).
struct OctetPlan {
  int octets;  // O: twice the item's k-groups
  int single;  // octets 0 .. single - 1 hold each class at most once
  int rest;    // entries in the other octets
};

__device__ __forceinline__ OctetPlan octet_plan(const int (&total)[8], int n) {
  int c_max = 0;
#pragma unroll
  for (int c = 0; c < 8; ++c) c_max = max(c_max, total[c]);
  const int octets = 2 * ((n + 15) >> 4), bound = max(octets, c_max);
  OctetPlan best{octets, octets, 0};  // d = 0: when no class has more entries than octets
  int best_cost = c_max <= octets ? octets : 0x7fffffff;
  for (int d = 1; d <= octets && best_cost > bound; ++d) {  // d = O always fits (n <= 8 O)
    const int single = octets - d;
    int rest = 0, most = 1;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int r = max(0, total[c] - single);
      rest += r;
      most = max(most, (r + d - 1) / d);
    }
    const int cost = single + most * d;
    if (rest <= 8 * d && cost < best_cost) {
      best = OctetPlan{octets, single, rest};
      best_cost = cost;
    }
  }
  return best;
}

// Where entry k (in walk order) of class q goes (see octet_plan).
__device__ __forceinline__ int octet_position(const OctetPlan& plan, const int (&total)[8], int q, int k) {
  if (k < plan.single) return 8 * k + q;
  int i = k - plan.single;
#pragma unroll
  for (int c = 0; c < 8; ++c) i += c < q ? max(0, total[c] - plan.single) : 0;
  const int d = plan.octets - plan.single;
  return 8 * (plan.single + i % d) + i / d;
}

// For position p of an item: -1 if an entry lands there, else the position of the entry whose B
// row the padding word there repeats: one of its own octet (the same 16 bytes as a row the
// octet reads anyway: a broadcast, no extra wavefront), or, in an octet without entries, the
// first of octet 0.
__device__ __forceinline__ int octet_padding_source(const OctetPlan& plan, const int (&total)[8], int p) {
  const int o = p >> 3, slot = p & 7;
  if (o < plan.single) {
    if (total[slot] > o) return -1;
#pragma unroll
    for (int c = 0; c < 8; ++c)
      if (total[c] > o) return 8 * o + c;
  } else {
    const int x = o - plan.single, d = plan.octets - plan.single;
    if (slot * d + x < plan.rest) return -1;
    if (x < plan.rest) return 8 * o;
  }
  if (plan.single == 0) return 0;  // double octet 0's slot 0: rest = n > 0 there
#pragma unroll
  for (int c = 0; c < 8; ++c)
    if (total[c] > 0) return c;
  return 0;  // no entries: no positions either
}

// The word of one entry (value bits, row in its group, B row in its chunk), and its row and B
// row back.
// (constexpr: tests/test_kernels_compile.py checks them against the Python side's at compile time)
__host__ __device__ constexpr unsigned tspmm_word(unsigned short value, int row, int b_row) {
  return ((unsigned)value << 16) | ((unsigned)row << TSPMM_ROW_SHIFT) | ((unsigned)b_row << 3) | ((unsigned)b_row & 7u);
}
__host__ __device__ constexpr unsigned tspmm_word_row(unsigned w) { return (w >> TSPMM_ROW_SHIFT) & 7u; }
__host__ __device__ constexpr unsigned tspmm_word_b_row(unsigned w) { return (w & TSPMM_B_FIELD) >> 3; }

// ldmatrix.sync.aligned.m8n8.x4(.trans).b16: lanes 8i .. 8i + 7 give the row addresses of
// matrix i (16 bytes each); lane 4g + t receives in register i the matrix's (g, 2t .. 2t + 1),
// or with .trans its (2t .. 2t + 1, g). Volatile: the staged rows change under the same address
// from one ring pass to the next.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

}  // namespace twell
