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
constexpr int TSPMM_WARPS = 16;
constexpr int TSPMM_KGROUP = 16;   // entries per k-group: the MMA's K
constexpr int TSPMM_WARP_GROUPS = TSPMM_ROWS / TSPMM_GROUP / TSPMM_WARPS;  // row groups per warp: 4
constexpr int TSPMM_COL_STEPS = TSPMM_COLS / 16;                            // MMAs per k-group: 4
constexpr int TSPMM_STAGE_BYTES = TSPMM_CHUNK * TSPMM_COLS * 2;              // 64 KB
// The stages (1024-byte aligned, the 128-byte swizzle's period), then a full and an empty
// barrier per stage; 1 KB of slack to align the window.
constexpr int TSPMM_SHARED_BYTES = 1024 + TSPMM_STAGES * TSPMM_STAGE_BYTES + 2 * TSPMM_STAGES * 8;
static_assert(TSPMM_SHARED_BYTES <= 227 * 1024, "the ring fits one block's shared memory");

constexpr int TSPMM_PAD = (int)0x80000000;  // a padding word's place in A's parts (no entry)
// A padding word's mark (bit 12, which the products ignore): it repeats a real word of its item
// with value zero, and the mark tells it from an entry whose value is zero.
constexpr unsigned TSPMM_PAD_BIT = 1u << 12;

// Where entry k of class q goes in its item (n entries, class totals `total`): the classes in
// order of decreasing count (ties by class) list their entries one after the other, and list
// index i lands in octet i % O, slot i / O of the item's O = ceil(n / 8) octets (each ldmatrix
// matrix reads one octet's 8 rows). Consecutive list entries fall in different octets, so an
// octet holds 8 different classes (8 different banks) unless one class has more than O entries.
// Positions that no index reaches (octet o, slot s with s O + o >= n, or octets past O) are
// padding.
__device__ __forceinline__ int octet_position(const int (&total)[8], int n, int q, int k) {
  int i = k;
#pragma unroll
  for (int c = 0; c < 8; ++c) i += (total[c] > total[q] || (total[c] == total[q] && c < q)) ? total[c] : 0;
  const int octets = (n + 7) >> 3;
  return (i % octets) * 8 + i / octets;
}

// Whether position p of an item of n entries is padding (see octet_position).
__device__ __forceinline__ bool octet_padding(int n, int p) {
  const int octets = (n + 7) >> 3, o = p >> 3;
  return o >= octets || (p & 7) * octets + o >= n;
}

// The word of one entry (value bits, row in its group, B row in its chunk).
__device__ __forceinline__ unsigned tspmm_word(unsigned short value, int row, int b_row) {
  return ((unsigned)value << 16) | ((unsigned)row << 9) | (unsigned)b_row;
}

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
