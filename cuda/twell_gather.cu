// Row-gather kernels: one warp per token row, 16-byte vector gathers of whole weight rows.
//
// These serve the products of the FFN (SpMM for the down projection, SDDMM for the up
// projection and the backward's dH, the gated consumer's up projection with its value product)
// whenever every dense operand
// has 16-byte-aligned rows whose length is a multiple of 16 bytes; other layouts take the
// portable kernels of twell_spmm.cu / twell_sddmm.cu.
//
// Why this shape: a (token, unit) pair needs one whole weight row (4 KB at d_model 2048 in
// bf16). A warp gathers it as 32 lanes x 16 bytes per step, so every request is a full 512-byte
// coalesced line run, and several pairs' rows are requested before any is consumed, keeping
// U x KV 16-byte loads in flight per lane: the L2-to-SM gather rate,
// not latency, bounds the kernel. The row's entries are enumerated 32 at a time (one per lane)
// with a warp scan over the tile counts, so batches stay full at any density. Dot products of
// 2-byte types run on the tensor cores (mma_dots), with lanes loading 16-byte row pieces in the
// fragment layout.
#include "twell_fp8.cuh"
#include "twell_mma.cuh"
#include "twell_rows.cuh"
#include "twell_types.cuh"

using namespace twell;

namespace {

constexpr unsigned kFull = 0xffffffffu;

struct alignas(16) Raw16 {
  unsigned x, y, z, w;
};

// L2 eviction hint (TWELL_L2_HINTS, set by twellsparse._kernels.compile_options; 1 unless it is
// 0): the streams, each token's own x row (read once per pass) and the output rows, are marked
// evict-first, so the L2 keeps the gathered rows (each weight row serves every token that uses
// its unit) in preference. Measured on the H200 (bench/NOTES.md, seventh session): 0.5-1.5%
// off the consumers, 3.6% off dX at 0.5%; marking the gathered rows evict-last as well gained
// nothing more and cost registers.
#ifndef TWELL_L2_HINTS
#define TWELL_L2_HINTS 1
#endif

// Tensor-core dot products for 2-byte types (TWELL_MMA_DOTS, 1 unless it is 0: the FMA-pipe
// dots instead, for measurements; see gather_dots).
#ifndef TWELL_MMA_DOTS
#define TWELL_MMA_DOTS 1
#endif

// Blocks per SM the row-sum kernels (SpMM and the transposed products) ask ptxas to fit, for
// 2-byte types. A minimum of 0 leaves `.minnctapersm` out of the PTX: the plain
// `__launch_bounds__(128)` build. ptxas compiles a minimum of 1 differently from none: the
// single-output bf16 SpMM takes 160 registers instead of 134 and the transposed products 126-213
// instead of 76-255 (still 3 blocks per SM for the (8, 2) SpMM), and they ran 3-5% faster
// (the SpMM's (4, 4) variant 30%), while dX's dual SpMM ran 7-13% slower (175 registers instead
// of 140): bench/NOTES.md, seventeenth session. So 1 for those, none for the dual pass and for
// the 4- and 8-byte types (unmeasured). TWELL_GATHER_MIN_BLOCKS=N (a measurement switch) asks
// for N blocks of every 2-byte one (0: none): 4 caps them at 128 registers, and some spill.
#ifdef TWELL_GATHER_MIN_BLOCKS
#define ROW_SUM_MIN_BLOCKS(T, DUAL) (sizeof(T) == 2 ? TWELL_GATHER_MIN_BLOCKS : 0)
#else
#define ROW_SUM_MIN_BLOCKS(T, DUAL) (sizeof(T) == 2 && !(DUAL) ? 1 : 0)
#endif
#define ROW_SUM_BOUNDS(T, DUAL) __launch_bounds__(128, ROW_SUM_MIN_BLOCKS(T, DUAL))

// The 2-byte single-output cut transposed product's register cap (twell_gather_csr_spmm_cut_capped):
// under ROW_SUM_BOUNDS ptxas gives it 168 registers against the plain kernel's 150 (12 warps an
// SM instead of 13); capped at 152 it spills 60 bytes and ran 0.7-0.8% faster than at 168 on the
// uniform pattern (0.5, 1%) and 0.05-0.6% on the skewed one (1%), in each of two runs (H100,
// thirty-seventh session).
// Launch bounds cannot give 152 (a minimum of 10-12 one-warp blocks gives 166, of 13 gives 128),
// and an attribute cannot switch between __maxnreg__ and __launch_bounds__ by template argument,
// hence a kernel of its own. TWELL_CUT_MAX_REGS=N (a measurement switch) caps it at N instead.
#ifndef TWELL_CUT_MAX_REGS
#define TWELL_CUT_MAX_REGS 152
#endif

__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Read-only 16-byte load through the non-coherent path (weights and inputs never change while
// a kernel runs; hot rows stay in L1); STREAM marks it evict-first in L2. Callers guard it with a
// condition and compute its address inside that condition (with the address computed ahead as
// an argument, the SpMM took 8 more registers; that build, its loads all volatile asm, ran the
// SpMM 9-13% slower). The evict-first load is inline PTX, and volatile: a plain asm statement
// has no side effects as far as the compiler knows, so it may run it ahead of its guard, and the
// pipelined tensor-core dots once read 16 bytes past the end of x that way (compute-sanitizer
// memcheck, fifteenth session). The other loads are the compiler's own (__ldg), which it moves
// ahead of a guard only where it can prove the address valid.
template <bool STREAM = false>
__device__ __forceinline__ Raw16 ldg16(const void* p) {
  Raw16 r;
  if (STREAM && TWELL_L2_HINTS) {
    asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p), "l"(evict_first_policy()));
  } else {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    r = Raw16{v.x, v.y, v.z, v.w};
  }
  return r;
}

// A 16-byte store of an output row piece (written once, not read again by the kernel).
__device__ __forceinline__ void stg16_stream(void* p, const Raw16& v) {
  if (TWELL_L2_HINTS) {
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w), "l"(evict_first_policy())
                 : "memory");
  } else {
    *reinterpret_cast<Raw16*>(p) = v;
  }
}

__device__ __forceinline__ Raw16 zero16() { return Raw16{0u, 0u, 0u, 0u}; }

// The elements of a 16-byte vector, widened to the accumulator type.
template <typename T> struct Lanes {
  static constexpr int N = 16 / (int)sizeof(T);
  using A = typename acc_of<T>::type;
  union Bits {
    Raw16 raw;
    T v[N];
  };
  __device__ static __forceinline__ void widen(const Raw16& r, A (&out)[N]) {
    Bits b;
    b.raw = r;
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_acc(b.v[i]);
  }
  __device__ static __forceinline__ Raw16 narrow(const A (&in)[N]) {
    Bits b;
#pragma unroll
    for (int i = 0; i < N; ++i) b.v[i] = from_acc<T>(in[i]);
    return b.raw;
  }
};

template <typename A> __device__ __forceinline__ A warp_total(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Whether the kernels over TwELL rows read their row from an `order` (TWELL_GATHER_ROW_ORDER=1,
// set by twellsparse._kernels.compile_options; 0 unless set, and then the order argument is
// never read, so the default build is the one measured without it).
#ifndef TWELL_GATHER_ROW_ORDER
#define TWELL_GATHER_ROW_ORDER 0
#endif

// The token row of the warp with global index w (< M): w itself, or, in a TWELL_GATHER_ROW_ORDER
// build, order[w] (twell_row_buckets / twell_row_scatter: rows with more batches of entries
// first, so that the last rows to start are short ones).
__device__ __forceinline__ long long ordered_row(const int* __restrict__ order, long long w) {
#if TWELL_GATHER_ROW_ORDER
  return (long long)order[w];
#else
  (void)order;
  return w;
#endif
}

// Entry positions: a slot of the padded part (>= 0) or ~i for spill entry i (< 0).
__device__ __forceinline__ bool in_spill(long long where) { return where < 0; }

// Enumerates, 32 at a time, the entries of 32 groups held one per lane (this lane's group has
// `cnt` entries; groups in lane order): for each batch, every lane calls g(n, valid, owner, k)
// for batch entry `lane`, the k-th entry of lane `owner`'s group (meaningful when `valid`; the
// batch holds n entries). g runs on all lanes, so it may shuffle.
template <typename G>
__device__ __forceinline__ void for_each_owned(int cnt, int lane, G&& g) {
  int incl = cnt;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += y;
  }
  const int excl = incl - cnt;
  const int total = __shfl_sync(kFull, incl, 31);
  for (int e0 = 0; e0 < total; e0 += 32) {
    const int e = e0 + lane;
    // Owner lane of entry e: the number of lanes whose inclusive count is <= e.
    int owner = 0;
#pragma unroll
    for (int step = 16; step > 0; step >>= 1) {
      const int probe = __shfl_sync(kFull, incl, owner + step - 1);
      if (probe <= e) owner += step;
    }
    owner = min(owner, 31);
    const int start = __shfl_sync(kFull, excl, owner);
    g(min(32, total - e0), e < total, owner, e - start);
  }
}

// Calls f(n, col, val, where) for the stored entries of `row`, up to 32 at a time: lane l holds
// entry l of the batch (meaningful for l < n; other lanes hold col 0 and val 0). Tile entries
// come first, in tile order, then the row's spill entries. Without VALUES the values are not
// read (val = 0; `data` may then hold another type).
template <bool VALUES, typename T, typename F>
__device__ __forceinline__ void for_each_batch(const T* data, const short* __restrict__ indices,
                                               const int* __restrict__ counts,
                                               const int* __restrict__ spill_indptr,
                                               const int* __restrict__ spill_cols, const T* spill_vals,
                                               long long row, int n_tiles, int tile_n, int capacity,
                                               int lane, F&& f) {
  using A = typename acc_of<T>::type;
  for (int t0 = 0; t0 < n_tiles; t0 += 32) {
    const int tile = t0 + lane;
    const int cnt = tile < n_tiles ? counts[row * n_tiles + tile] : 0;
    for_each_owned(cnt, lane, [&](int n, bool valid, int owner, int k) {
      int col = 0;
      A val = A(0);
      long long where = 0;
      if (valid) {
        where = (row * n_tiles + t0 + owner) * capacity + k;
        col = (t0 + owner) * tile_n + indices[where];
        if (VALUES) val = to_acc(data[where]);
      }
      f(n, col, val, where);
    });
  }
  const int s0 = spill_indptr[row], s1 = spill_indptr[row + 1];
  for (int e0 = s0; e0 < s1; e0 += 32) {
    const int e = e0 + lane;
    int col = 0;
    A val = A(0);
    if (e < s1) {
      col = spill_cols[e];
      if (VALUES) val = to_acc(spill_vals[e]);
    }
    f(min(32, s1 - e0), col, val, ~(long long)e);
  }
}

// Calls f(n, col, val, operand, its row stride) for every batch of A's entries (values data /
// spill_vals, operand b), then with DUAL for A2's (data2 / spill_vals2, operand b2): a second
// walk over the entries, so one operand's loads are in flight at a time.
template <bool DUAL, typename T, typename F>
__device__ __forceinline__ void for_each_product_batch(const T* data, const T* spill_vals, const T* b, long long ldb,
                                                       const T* data2, const T* spill_vals2, const T* b2,
                                                       long long ldb2, const short* __restrict__ indices,
                                                       const int* __restrict__ counts,
                                                       const int* __restrict__ spill_indptr,
                                                       const int* __restrict__ spill_cols, long long row,
                                                       int n_tiles, int tile_n, int capacity, int lane, F&& f) {
  using A = typename acc_of<T>::type;
  for_each_batch<true>(data, indices, counts, spill_indptr, spill_cols, spill_vals, row, n_tiles, tile_n, capacity,
                       lane, [&](int n, int col, A val, long long) { f(n, col, val, b, ldb); });
  if (DUAL) {
    for_each_batch<true>(data2, indices, counts, spill_indptr, spill_cols, spill_vals2, row, n_tiles, tile_n,
                         capacity, lane, [&](int n, int col, A val, long long) { f(n, col, val, b2, ldb2); });
  }
}

// Position of the k-th (0-based) set bit of w (k < popc(w)): a branch-free binary search.
__device__ __forceinline__ int nth_set_bit(unsigned w, int k) {
  int pos = 0;
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) {
    const int low = __popc(w & ((1u << s) - 1u));
    if (k >= low) {
      k -= low;
      w >>= s;
      pos += s;
    }
  }
  return pos;
}

// Calls f(n, col, val, where) for the set bits of `row` in a ReLU bit-mask (cuBLASLt's
// RELU_AUX layout: ld_words 32-bit words per row, bit c set where column c was positive), in
// increasing column order, up to 32 at a time: lane l holds entry l of the batch (meaningful for
// l < n; other lanes hold col 0, val 0). val = z[row, col], where = row * ldz + col. Columns at
// and beyond N are ignored.
template <typename T, typename F>
__device__ __forceinline__ void for_each_mask_batch(const unsigned* __restrict__ mask, long long ld_words,
                                                    const T* z, long long ldz, long long row, int N,
                                                    int lane, F&& f) {
  using A = typename acc_of<T>::type;
  const int n_words = (N + 31) >> 5;
  const unsigned* mrow = mask + row * ld_words;
  for (int w0 = 0; w0 < n_words; w0 += 32) {
    const int word = w0 + lane;
    unsigned bits = word < n_words ? mrow[word] : 0u;
    if (word == n_words - 1 && (N & 31)) bits &= (1u << (N & 31)) - 1u;
    for_each_owned(__popc(bits), lane, [&](int n, bool valid, int owner, int k) {
      const unsigned owner_bits = __shfl_sync(kFull, bits, owner);
      int col = 0;
      A val = A(0);
      long long where = 0;
      if (valid) {
        col = (w0 + owner) * 32 + nth_set_bit(owner_bits, k);
        where = row * ldz + col;
        val = to_acc(z[where]);
      }
      f(n, col, val, where);
    });
  }
}

// How a gathered operand's rows are stored and read. PlainRows: rows of T, read as 16-byte
// pieces of Lanes<T>::N values. E4M3Rows: rows of fp8 e4m3 codes (twell_fp8.cuh), read as
// 8-byte pieces of 8 values, for 2-byte T (the same 8 columns per lane and piece); their
// per-row scales are applied by the caller to the pair's value.
template <typename T> struct PlainRows {
  using Piece = Raw16;
  static constexpr int N = Lanes<T>::N;
  const T* __restrict__ b;
  long long ldb;
  __device__ __forceinline__ Piece load(int row, int k) const { return ldg16(b + (long long)row * ldb + k); }
  __device__ static __forceinline__ Piece none() { return zero16(); }
  __device__ static __forceinline__ void widen(const Piece& r, typename acc_of<T>::type (&e)[N]) {
    Lanes<T>::widen(r, e);
  }
};

struct alignas(8) Raw8 {
  unsigned x, y;
};

struct E4M3Rows {
  using Piece = Raw8;
  static constexpr int N = 8;
  const unsigned char* __restrict__ b;
  long long ldb;
  __device__ __forceinline__ Piece load(int row, int k) const {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(b + (long long)row * ldb + k));
    return Raw8{v.x, v.y};
  }
  __device__ static __forceinline__ Piece none() { return Raw8{0u, 0u}; }
  __device__ static __forceinline__ void widen(const Piece& r, float (&e)[N]) { e4m3x8_to_float(r.x, r.y, e); }
};

// The rows mma_dots reads, 8 values per lane and step, the MMA type they are multiplied in
// (Mma) and the x row's type and loads (X). MmaPlainRows: rows of 2-byte T as 16-byte pieces that
// are the MMA's operand, x read from global memory. MmaE4M3Rows: fp8 e4m3 codes as 8-byte
// pieces, widened exactly to f16 just before the MMAs (one cvt per two codes; the loads stay in
// flight meanwhile), so the MMAs run in f16, with x staged once per row as f16 in shared memory
// (stage_x_f16). (Widening the codes to bf16 instead took five instructions per two codes and
// ran the consumer 18% slower than the 2-byte rows at 0.5% density; converting bf16 x to f16 at
// every step instead of staging it tied them: bench/NOTES.md, eighteenth session.)
template <typename T> struct MmaPlainRows {
  using Piece = Raw16;
  using Ptr = const T*;
  using Mma = T;
  using X = T;
  const T* __restrict__ y;
  long long ldy;
  __device__ __forceinline__ Ptr start(int row, int value) const { return y + (long long)row * ldy + value; }
  __device__ static __forceinline__ Piece load(Ptr p, int k) { return ldg16(p + k); }
  __device__ static __forceinline__ Piece none() { return zero16(); }
  __device__ static __forceinline__ Raw16 operand(const Piece& w) { return w; }
  __device__ static __forceinline__ Raw16 x_load(const X* p) { return ldg16<true>(p); }
};

struct MmaE4M3Rows {
  using Piece = Raw8;
  using Ptr = const unsigned char*;
  using Mma = f16;
  using X = f16;  // in shared memory
  const unsigned char* __restrict__ q;
  long long ldq;
  __device__ __forceinline__ Ptr start(int row, int value) const { return q + (long long)row * ldq + value; }
  __device__ static __forceinline__ Piece load(Ptr p, int k) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p + k));
    return Raw8{v.x, v.y};
  }
  __device__ static __forceinline__ Piece none() { return Raw8{0u, 0u}; }
  __device__ static __forceinline__ Raw16 operand(const Piece& w) {
    Raw16 r;
    e4m3x4_to_f16x4(w.x, r.x, r.y);
    e4m3x4_to_f16x4(w.y, r.z, r.w);
    return r;
  }
  __device__ static __forceinline__ Raw16 x_load(const X* p) { return *reinterpret_cast<const Raw16*>(p); }
};

// x_row (K values, K a multiple of 8, 16-byte aligned) as f16 in this warp's `stage`, for
// MmaE4M3Rows; f16 x as it is, bf16 x times a power of two that puts the row's largest
// magnitude in [2^14, 2^15) (capped at 2^126 for rows of tiny or zero values; an infinite one
// stays infinite, NaN propagates): exact for every element down to 2^-31 of the largest (bf16's
// 8 significant bits fit f16's 11, subnormals included, from 2^-17), within 2^-39 of it below.
// Returns the factor's inverse (a power of two: exact), 1 for f16, which the dots are
// multiplied by. Every lane returns it; the stage is ready for the whole warp.
template <typename T>
__device__ __forceinline__ float stage_x_f16(const T* __restrict__ x_row, int K, int lane, f16* stage) {
  float s = 1.f;
  if constexpr (is_same_type<T, bf16>::value) {
    float amax = 0.f;
    for (int k = lane * 8; k < K; k += 256) {
      float e[8];
      Lanes<T>::widen(ldg16<true>(x_row + k), e);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(e[i]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, off));
    // amax = f 2^E with f in [0.5, 1): E = exponent field - 126 (zero and subnormals: -126).
    const int E = (int)((__float_as_uint(amax) >> 23) & 0xffu) - 126;
    s = __uint_as_float((unsigned)(min(15 - E, 126) + 127) << 23);
  }
  for (int k = lane * 8; k < K; k += 256) {
    Raw16 v = ldg16<true>(x_row + k);
    if constexpr (is_same_type<T, bf16>::value) {
      unsigned* w = &v.x;
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // cvt.rn.f16x2.f32 d, a, b puts a in the upper half
        asm("cvt.rn.f16x2.f32 %0, %1, %2;"
            : "=r"(w[i])
            : "f"(__uint_as_float(w[i] & 0xffff0000u) * s), "f"(__uint_as_float(w[i] << 16) * s));
      }
    }
    *reinterpret_cast<Raw16*>(stage + k) = v;
  }
  __syncwarp();
  return 1.f / s;
}

// This lane's KV pieces, in the column chunk at k0, of the rows that the batch's pairs
// p .. p + U - 1 name (each pair's column broadcast from its lane); zero past n or K. All U x KV
// loads are issued before any is used.
template <int KV, int U, typename R>
__device__ __forceinline__ void load_pieces(typename R::Piece (&w)[U][KV], int p, int n, int col, const R& rows,
                                            int K, int k0, int lane) {
  int c[U];
#pragma unroll
  for (int u = 0; u < U; ++u) c[u] = __shfl_sync(kFull, col, (p + u) & 31);
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int kv = 0; kv < KV; ++kv) {
      const int k = k0 + (kv * 32 + lane) * R::N;
      w[u][kv] = (p + u < n && k < K) ? rows.load(c[u], k) : R::none();
    }
  }
}

// load_pieces for rows of T.
template <typename T, int KV, int U>
__device__ __forceinline__ void load_pair_rows(Raw16 (&w)[U][KV], int p, int n, int col, const T* __restrict__ b,
                                               long long ldb, int K, int k0, int lane) {
  load_pieces<KV, U>(w, p, n, col, PlainRows<T>{b, ldb}, K, k0, lane);
}

// acc[s] (this lane's KV vectors of the column chunk starting at k0) += sum over the batch's n
// pairs of val[s] * rows[col, chunk], for NV value sets that share each pair's gathered row (the
// backward's dW_gate and dW_up both gather rows of x). U pairs' rows are requested before any is
// used; each row piece is widened once for all NV sets.
template <typename T, int KV, int U, int NV, typename R>
__device__ __forceinline__ void gather_accumulate_rows(typename acc_of<T>::type (&acc)[NV][KV][Lanes<T>::N], int n,
                                                       int col, const typename acc_of<T>::type (&val)[NV],
                                                       const R& rows, int K, int k0, int lane) {
  using A = typename acc_of<T>::type;
  constexpr int V = Lanes<T>::N;
  static_assert(R::N == V, "a piece of the gathered rows covers a lane's columns of the output vector");
  for (int p = 0; p < n; p += U) {
    A v[NV][U];
#pragma unroll
    for (int s = 0; s < NV; ++s)
#pragma unroll
      for (int u = 0; u < U; ++u) v[s][u] = __shfl_sync(kFull, val[s], (p + u) & 31);
    typename R::Piece w[U][KV];
    load_pieces<KV, U>(w, p, n, col, rows, K, k0, lane);
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int kv = 0; kv < KV; ++kv) {
        A e[V];
        R::widen(w[u][kv], e);
#pragma unroll
        for (int s = 0; s < NV; ++s) {
          const A vu = p + u < n ? v[s][u] : A(0);
#pragma unroll
          for (int i = 0; i < V; ++i) acc[s][kv][i] += vu * e[i];
        }
      }
    }
  }
}

// gather_accumulate_rows for rows of T.
template <typename T, int KV, int U, int NV>
__device__ __forceinline__ void gather_accumulate_sets(typename acc_of<T>::type (&acc)[NV][KV][Lanes<T>::N], int n,
                                                       int col, const typename acc_of<T>::type (&val)[NV],
                                                       const T* __restrict__ b, long long ldb, int K, int k0,
                                                       int lane) {
  gather_accumulate_rows<T, KV, U, NV>(acc, n, col, val, PlainRows<T>{b, ldb}, K, k0, lane);
}

// The one-set case: acc += sum over the batch's n pairs of val * b[col, chunk].
template <typename T, int KV, int U>
__device__ __forceinline__ void gather_accumulate(typename acc_of<T>::type (&acc)[KV][Lanes<T>::N], int n,
                                                  int col, typename acc_of<T>::type val,
                                                  const T* __restrict__ b, long long ldb, int K, int k0,
                                                  int lane) {
  using A = typename acc_of<T>::type;
  const A vals[1] = {val};
  gather_accumulate_sets<T, KV, U, 1>(reinterpret_cast<A(&)[1][KV][Lanes<T>::N]>(acc), n, col, vals, b, ldb, K,
                                      k0, lane);
}

// Zeros one row's padding slots (past each row-tile's count) in TwELL values `out`.
template <typename T>
__device__ __forceinline__ void zero_padding(T* __restrict__ out, const int* __restrict__ counts, long long row,
                                             int n_tiles, int capacity, int lane) {
  for (int tile = 0; tile < n_tiles; ++tile) {
    const long long rt = row * n_tiles + tile;
    for (int s = counts[rt] + lane; s < capacity; s += 32) out[rt * capacity + s] = zero_value<T>();
  }
}

// Dot products x_row . y[col] for the batch's n pairs on the FMA pipes (4- and 8-byte types);
// lane l returns pair l's (0 for l >= n).
// The K columns go in passes of KV x 32 x 16 bytes: the pass's x vectors stay in registers and
// U pairs' row pieces are requested before any is used, as in gather_accumulate. (Summing a
// pair's products in KV independent chains instead of one was measured on the H200: no gain.)
template <typename T, int KV, int U>
__device__ __forceinline__ typename acc_of<T>::type gather_dots_fma(const T* __restrict__ x_row,
                                                                const T* __restrict__ y, long long ldy,
                                                                int K, int n, int col, int lane) {
  using A = typename acc_of<T>::type;
  constexpr int V = Lanes<T>::N;
  constexpr int CHUNK = KV * 32 * V;
  A mine = A(0);
  for (int k0 = 0; k0 < K; k0 += CHUNK) {
    A xv[KV][V];
#pragma unroll
    for (int kv = 0; kv < KV; ++kv) {
      const int k = k0 + (kv * 32 + lane) * V;
      Lanes<T>::widen(k < K ? ldg16<true>(x_row + k) : zero16(), xv[kv]);
    }
    for (int p = 0; p < n; p += U) {
      Raw16 w[U][KV];
      load_pair_rows<T, KV, U>(w, p, n, col, y, ldy, K, k0, lane);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        A part = A(0);
#pragma unroll
        for (int kv = 0; kv < KV; ++kv) {
          A e[V];
          Lanes<T>::widen(w[u][kv], e);
#pragma unroll
          for (int i = 0; i < V; ++i) part += xv[kv][i] * e[i];
        }
        const A s = warp_total(part);
        if (lane == p + u) mine += s;
      }
    }
  }
  return mine;
}

// The same dot products on the tensor cores (2-byte types). Why: on the FMA pipes every value
// costs a widening instruction besides its FMA and every pair a 5-step warp reduction per column
// pass, so the SDDMM issued ~360 warp instructions per pair and ran at ~5 TB/s of rows against
// the SpMM's ~7.5 (Nsight Compute, 0.5%, bench/NOTES.md fourteenth session); here a pair costs ~20.
// The batch's pairs are the rows of A in two groups of 16 (pair 16 r + g + 8 h in lane 4 g + t,
// h = 0, 1), every column of B holds x, so every column of D holds the dots. A dot's order of
// summation does not matter, so each lane loads whole 16-byte pieces (a row's 4 lanes read 64
// contiguous bytes per step): lane t's piece of a 32-value step, values 8t .. 8t + 7, feeds two
// MMAs, values 8t + {0, 1, 2, 3} as k = {2t, 2t + 1, 2t + 8, 2t + 9} of the first and
// 8t + {4 .. 7} of the second, with x's piece at the same positions as B. A round's STEPS steps'
// loads are issued before any is used; each half of a step accumulates in its own registers.
// (Loading the next round before this one's MMAs, in the (8, 2) variant, took 142-158
// registers and ran 20% slower at 0.5%: bench/NOTES.md, fifteenth session.)
template <typename T, int STEPS, typename R = MmaPlainRows<T>>
__device__ __forceinline__ float mma_dots(const typename R::X* __restrict__ x_row, const R& y, int K, int n, int col,
                                          int lane) {
  constexpr int STEP = 32;  // values per step: 4 lanes x 8
  const int g = lane >> 2, t = lane & 3;
  const bool two = n > 16;  // warp-uniform: the second group of 16 pairs has work
  typename R::Ptr rows[2][2];
  bool live[2][2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int p = 16 * r + g + 8 * h;
      rows[r][h] = y.start(__shfl_sync(kFull, col, p), 8 * t);
      live[r][h] = p < n;
    }
  float acc[2][2][4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][s][i] = 0.f;
  for (int k0 = 0; k0 < K; k0 += STEPS * STEP) {
    // One round: STEPS steps' pieces from k0 (zeros past K, where nothing is read), then their MMAs.
    typename R::Piece w[STEPS][2][2];
    Raw16 xv[STEPS];
#pragma unroll
    for (int st = 0; st < STEPS; ++st) {
      const int k = k0 + st * STEP;
      const bool in = k + 8 * t < K;
      xv[st] = in ? R::x_load(x_row + k + 8 * t) : zero16();
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) w[st][r][h] = in && live[r][h] ? R::load(rows[r][h], k) : R::none();
    }
#pragma unroll
    for (int st = 0; st < STEPS; ++st)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (r == 1 && !two) break;
        const Raw16 lo = R::operand(w[st][r][0]), hi = R::operand(w[st][r][1]);
        mma_m16n8k16<typename R::Mma>(acc[r][0], lo.x, hi.x, lo.y, hi.y, xv[st].x, xv[st].y);
        mma_m16n8k16<typename R::Mma>(acc[r][1], lo.z, hi.z, lo.w, hi.w, xv[st].z, xv[st].w);
      }
  }
  // Pair l sits in group l / 16, row l % 16: D row (l % 8) (+ 8 for the upper half) of lane 4 (l % 8).
  const int src = (lane & 7) * 4;
  const float r0 = __shfl_sync(kFull, acc[0][0][0] + acc[0][1][0], src);
  const float r8 = __shfl_sync(kFull, acc[0][0][2] + acc[0][1][2], src);
  const float r16 = __shfl_sync(kFull, acc[1][0][0] + acc[1][1][0], src);
  const float r24 = __shfl_sync(kFull, acc[1][0][2] + acc[1][1][2], src);
  const float mine = lane < 8 ? r0 : lane < 16 ? r8 : lane < 24 ? r16 : r24;
  return lane < n ? mine : 0.f;
}

// x_row . y[col] for the batch's n pairs (lane l returns pair l's, 0 for l >= n): tensor cores
// for 2-byte types, FMA pipes otherwise (KV: 16-byte pieces per lane in flight per pair and
// column pass; U: pairs per FMA round. On the tensor cores U is the 32-value steps per round and
// KV is unused).
template <typename T, int KV, int U>
__device__ __forceinline__ typename acc_of<T>::type gather_dots(const T* __restrict__ x_row,
                                                                const T* __restrict__ y, long long ldy,
                                                                int K, int n, int col, int lane) {
  if constexpr (sizeof(T) == 2 && TWELL_MMA_DOTS) return mma_dots<T, U>(x_row, MmaPlainRows<T>{y, ldy}, K, n, col, lane);
  else return gather_dots_fma<T, KV, U>(x_row, y, ldy, K, n, col, lane);
}

template <typename T, int KV>
__device__ __forceinline__ void store_chunk(const typename acc_of<T>::type (&acc)[KV][Lanes<T>::N], T* out_row,
                                            int K, int k0, int lane) {
  constexpr int V = Lanes<T>::N;
#pragma unroll
  for (int kv = 0; kv < KV; ++kv) {
    const int k = k0 + (kv * 32 + lane) * V;
    if (k < K) stg16_stream(out_row + k, Lanes<T>::narrow(acc[kv]));
  }
}

template <typename T, int KV>
__device__ __forceinline__ void clear(typename acc_of<T>::type (&acc)[KV][Lanes<T>::N]) {
#pragma unroll
  for (int kv = 0; kv < KV; ++kv)
#pragma unroll
    for (int i = 0; i < Lanes<T>::N; ++i) acc[kv][i] = 0;
}

// out_row[0, K) = the sum that walk(acc, k0) accumulates, one column chunk of KV x 32 x 16 bytes at
// a time: the chunk's fp32 accumulators cleared, filled by the walk, rounded once by the store.
template <typename T, int KV, typename W>
__device__ __forceinline__ void sum_by_chunks(T* out_row, int K, int lane, W&& walk) {
  constexpr int CHUNK = KV * 32 * Lanes<T>::N;
  for (int k0 = 0; k0 < K; k0 += CHUNK) {
    typename acc_of<T>::type acc[KV][Lanes<T>::N];
    clear<T, KV>(acc);
    walk(acc, k0);
    store_chunk<T, KV>(acc, out_row, K, k0, lane);
  }
}

// The value at source position p of a matrix whose entries are its n_slots TwELL slots
// followed by its spill.
template <typename T>
__device__ __forceinline__ typename acc_of<T>::type value_at(long long p, const T* __restrict__ data,
                                                             long long n_slots, const T* __restrict__ spill_vals) {
  return to_acc(p < n_slots ? data[p] : spill_vals[p - n_slots]);
}

}  // namespace

// out[row, :] = sum over the row's entries (j, v) of v * b[j, :]. One warp per row, the K
// columns in passes of KV x 32 x 16 bytes. Rows of b and out: 16-byte aligned, K % (16 /
// sizeof(T)) == 0 (the host checks). With DUAL, a second matrix of the same structure
// (values data2 / spill_vals2) adds its product with b2 in the same fp32 accumulators:
// out = A @ b + A2 @ b2 with one rounding (the backward's dX = dZ @ W_gate + dU @ W_up), the
// second product in a second walk over the entries (interleaving the two per batch took 168
// registers and spilled, bf16); a template parameter, so the single product is unchanged.
// (The same walk on the tensor cores, output columns as the rows of m16n8k16 A tiles, ran 1.6x
// slower: the SpMM is bound by the L2's gather rate, not by its instructions; bench/NOTES.md,
// fifteenth session.)
template <typename T, int KV, int U, bool DUAL = false>
__global__ void ROW_SUM_BOUNDS(T, DUAL) twell_gather_spmm(
    const T* __restrict__ data, const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ spill_vals, int M, int n_tiles, int tile_n, int capacity,
    const T* __restrict__ b, long long ldb, int K, T* __restrict__ out, long long ldo,
    const T* __restrict__ data2, const T* __restrict__ spill_vals2, const T* __restrict__ b2, long long ldb2,
    const int* __restrict__ order) {
  using A = typename acc_of<T>::type;
  const long long warp_index = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp_index >= M) return;  // warp-uniform
  const long long row = ordered_row(order, warp_index);
  sum_by_chunks<T, KV>(out + row * ldo, K, lane, [&](A(&acc)[KV][Lanes<T>::N], int k0) {
    for_each_product_batch<DUAL>(data, spill_vals, b, ldb, data2, spill_vals2, b2, ldb2, indices, counts,
                                 spill_indptr, spill_cols, row, n_tiles, tile_n, capacity, lane,
                                 [&](int n, int col, A val, const T* bb, long long ld) {
                                   gather_accumulate<T, KV, U>(acc, n, col, val, bb, ld, K, k0, lane);
                                 });
  });
}

// out = A @ B with B's rows in fp8 e4m3 and one fp32 scale per row (twellsparse.quantize_rows;
// codec in twell_fp8.cuh): twell_gather_spmm with half the bytes gathered per stored entry. The
// lane holding an entry multiplies its value by the entry's row scale once per pass, before the
// batch broadcasts it. 2-byte T only: 8 columns per lane and piece, as their 16-byte vectors.
template <typename T, int KV, int U>
__global__ void __launch_bounds__(128) twell_gather_spmm_e4m3(
    const T* __restrict__ data, const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ spill_vals, int M, int n_tiles, int tile_n, int capacity,
    const unsigned char* __restrict__ b, const float* __restrict__ scales, long long ldb, int K,
    T* __restrict__ out, long long ldo,
    const int* __restrict__ order) {
  static_assert(sizeof(T) == 2, "the e4m3 rows' 8-byte pieces cover a 2-byte type's 16-byte vector");
  using A = typename acc_of<T>::type;
  const long long warp_index = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp_index >= M) return;  // warp-uniform
  const long long row = ordered_row(order, warp_index);
  const E4M3Rows rows{b, ldb};
  sum_by_chunks<T, KV>(out + row * ldo, K, lane, [&](A(&acc)[KV][Lanes<T>::N], int k0) {
    for_each_batch<true>(data, indices, counts, spill_indptr, spill_cols, spill_vals, row, n_tiles, tile_n,
                         capacity, lane, [&](int n, int col, A val, long long) {
                           const A scaled[1] = {lane < n ? val * scales[col] : A(0)};
                           gather_accumulate_rows<T, KV, U, 1>(reinterpret_cast<A(&)[1][KV][Lanes<T>::N]>(acc), n,
                                                               col, scaled, rows, K, k0, lane);
                         });
  });
}

// Sampled products at the pattern: out = x[row] . y[j] for every stored entry (j, v), times v
// when SCALE (without SCALE the pattern's values are never read, whatever their type). Padding
// slots of `out` get 0. One warp per row.
template <typename T, bool SCALE, int KV, int U>
__global__ void __launch_bounds__(128) twell_gather_sddmm(
    const T* __restrict__ data, const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ spill_vals, int M, int n_tiles, int tile_n, int capacity,
    const T* __restrict__ x, long long ldx, const T* __restrict__ y, long long ldy, int K,
    T* __restrict__ out, T* __restrict__ out_spill,
    const int* __restrict__ order) {
  using A = typename acc_of<T>::type;
  const long long warp_index = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp_index >= M) return;  // warp-uniform
  const long long row = ordered_row(order, warp_index);
  const T* x_row = x + row * ldx;
  for_each_batch<SCALE>(data, indices, counts, spill_indptr, spill_cols, spill_vals, row, n_tiles, tile_n,
                        capacity, lane, [&](int n, int col, A val, long long where) {
                   A d = gather_dots<T, KV, U>(x_row, y, ldy, K, n, col, lane);
                   if (SCALE) d *= val;
                   if (lane < n) {
                     if (in_spill(where)) out_spill[~where] = from_acc<T>(d);
                     else out[where] = from_acc<T>(d);
                   }
                 });
  zero_padding(out, counts, row, n_tiles, capacity, lane);
}

// The gated FFN backward's sampled product with its three value products fused in: at each
// stored entry (j, g) of the gate pattern, d_h = dy[row] . w_down_t[j] rounded to T, then, with
// the up value u of the same slot, d_z = d_h * u, d_u = d_h * g and h = g * u, each as the
// unfused path computes it (kept_product). One launch instead of the SDDMM and
// six elementwise passes. Padding slots of the three outputs get 0; spill entries past the
// row pointers are not written.
template <typename T, int KV, int U>
__global__ void __launch_bounds__(128) twell_gather_sddmm_gated_bwd(
    const T* __restrict__ gate, const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ gate_spill, int M, int n_tiles, int tile_n, int capacity,
    const T* __restrict__ dy, long long lddy, const T* __restrict__ w_down_t, long long ldw, int K,
    const T* __restrict__ u_data, const T* __restrict__ u_spill, T* __restrict__ dz_data,
    T* __restrict__ dz_spill, T* __restrict__ du_data, T* __restrict__ du_spill, T* __restrict__ h_data,
    T* __restrict__ h_spill,
    const int* __restrict__ order) {
  using A = typename acc_of<T>::type;
  const long long warp_index = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp_index >= M) return;  // warp-uniform
  const long long row = ordered_row(order, warp_index);
  const T* dy_row = dy + row * lddy;
  for_each_batch<true>(gate, indices, counts, spill_indptr, spill_cols, gate_spill, row, n_tiles, tile_n,
                       capacity, lane, [&](int n, int col, A g, long long where) {
                         const A d_h = to_acc(from_acc<T>(gather_dots<T, KV, U>(dy_row, w_down_t, ldw, K, n, col, lane)));
                         if (lane < n) {
                           const bool spilled = in_spill(where);
                           const long long i = spilled ? ~where : where;
                           const A u = to_acc(spilled ? u_spill[i] : u_data[i]);
                           (spilled ? dz_spill : dz_data)[i] = kept_product<T>(d_h, u);
                           (spilled ? du_spill : du_data)[i] = kept_product<T>(d_h, g);
                           (spilled ? h_spill : h_data)[i] = kept_product<T>(g, u);
                         }
                       });
  zero_padding(dz_data, counts, row, n_tiles, capacity, lane);
  zero_padding(du_data, counts, row, n_tiles, capacity, lane);
  zero_padding(h_data, counts, row, n_tiles, capacity, lane);
}

// One row of the gated up projection (twell_gather_gated_up and its e4m3 twin): for each batch
// of the gate's stored entries, u = dots(n, col) rounded to T, h = g * u, both stored at the
// gate's positions (u only when u_data is not null).
template <typename T, typename Dots>
__device__ __forceinline__ void gated_up_row(const T* __restrict__ gate, const short* __restrict__ indices,
                                             const int* __restrict__ counts, const int* __restrict__ spill_indptr,
                                             const int* __restrict__ spill_cols, const T* __restrict__ gate_spill,
                                             long long row, int n_tiles, int tile_n, int capacity, int lane,
                                             T* __restrict__ h_data, T* __restrict__ h_spill, T* __restrict__ u_data,
                                             T* __restrict__ u_spill, Dots&& dots) {
  using A = typename acc_of<T>::type;
  for_each_batch<true>(gate, indices, counts, spill_indptr, spill_cols, gate_spill, row, n_tiles, tile_n,
                       capacity, lane, [&](int n, int col, A g, long long where) {
                         const T u = from_acc<T>(dots(n, col));
                         if (lane < n) {
                           const bool spilled = in_spill(where);
                           const long long i = spilled ? ~where : where;
                           (spilled ? h_spill : h_data)[i] = from_acc<T>(g * to_acc(u));
                           if (u_data != nullptr) (spilled ? u_spill : u_data)[i] = u;
                         }
                       });
}

// The gated FFN's up projection at the gate's pattern, the first half of its consumer: at each
// stored entry (j, g) of the gate, u = x[row] . w_up[j] rounded to T and h = g * u in fp32
// rounded to T (the roundings of the unfused path: SDDMM to T, then the value product), written
// to h_data / h_spill in the gate's layout, and u to u_data / u_spill unless u_data is null.
// Padding slots are not written (the down projection reads only the stored entries; a kept u
// comes zeroed). The down projection then runs as its own SpMM: fused in one kernel, the two
// halves kept both weight matrices (46 MB at the standard widths) in use at once and the L2 hit
// rate fell to 62% (1 GB read from DRAM at 0.5%), against 90-95% for each half alone
// (bench/NOTES.md, fourteenth session). 2-byte types: five blocks per SM (96 registers); at four,
// with the 108 registers it takes unbounded, it ran 25% slower than the plain SDDMM at 0.5%. (The
// FMA-pipe dots, of any type, would spill at 96.)
template <typename T, int KV, int U>
__global__ void __launch_bounds__(128, sizeof(T) == 2 && TWELL_MMA_DOTS ? 5 : 1) twell_gather_gated_up(
    const T* __restrict__ gate, const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ gate_spill, int M, int n_tiles, int tile_n, int capacity,
    const T* __restrict__ x, long long ldx, const T* __restrict__ w_up, long long ldu, int K,
    T* __restrict__ h_data, T* __restrict__ h_spill, T* __restrict__ u_data, T* __restrict__ u_spill,
    const int* __restrict__ order) {
  const long long warp_index = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp_index >= M) return;  // warp-uniform
  const long long row = ordered_row(order, warp_index);
  const T* x_row = x + row * ldx;
  gated_up_row(gate, indices, counts, spill_indptr, spill_cols, gate_spill, row, n_tiles, tile_n, capacity, lane,
               h_data, h_spill, u_data, u_spill,
               [&](int n, int col) { return gather_dots<T, KV, U>(x_row, w_up, ldu, K, n, col, lane); });
}

// twell_gather_gated_up with w_up's rows in fp8 e4m3 and one fp32 scale per row
// (twellsparse.quantize_rows): u = scale[j] * (x[row] . codes[j]) in fp32, rounded to T, from
// half the bytes per pair. The dots always run on the tensor cores in f16 (MmaE4M3Rows; 2-byte
// T only), KV is unused. K a multiple of 8 (whole 8-byte pieces); dynamic shared memory: K f16
// values per warp.
template <typename T, int KV, int U>
__global__ void __launch_bounds__(128, U >= 4 ? 4 : 5) twell_gather_gated_up_e4m3(
    const T* __restrict__ gate, const short* __restrict__ indices, const int* __restrict__ counts,
    const int* __restrict__ spill_indptr, const int* __restrict__ spill_cols,
    const T* __restrict__ gate_spill, int M, int n_tiles, int tile_n, int capacity,
    const T* __restrict__ x, long long ldx, const unsigned char* __restrict__ q, const float* __restrict__ scales,
    long long ldq, int K, T* __restrict__ h_data, T* __restrict__ h_spill, T* __restrict__ u_data,
    T* __restrict__ u_spill,
    const int* __restrict__ order) {
  static_assert(sizeof(T) == 2, "the e4m3 codes multiply a 2-byte x in f16");
  extern __shared__ __align__(16) unsigned char x_stages[];
  const long long warp_index = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp_index >= M) return;  // warp-uniform
  const long long row = ordered_row(order, warp_index);
  f16* stage = reinterpret_cast<f16*>(x_stages) + (long long)(threadIdx.x >> 5) * K;
  const float x_unscale = stage_x_f16(x + row * ldx, K, lane, stage);
  const MmaE4M3Rows rows{q, ldq};
  gated_up_row(gate, indices, counts, spill_indptr, spill_cols, gate_spill, row, n_tiles, tile_n, capacity, lane,
               h_data, h_spill, u_data, u_spill, [&](int n, int col) {
                 const float dot = mma_dots<T, U>(stage, rows, K, n, col, lane);
                 return lane < n ? dot * x_unscale * scales[col] : 0.f;
               });
}

// V consecutive accumulators to and from global memory in 16-byte pieces, past L1 (.cg): the
// partial rows of twell_gather_csr_spmm's runs, written and read by different warps of one
// launch. p is 16-byte aligned (rows of K accumulators, K a multiple of V).
template <int V> __device__ __forceinline__ void store_cg(float* p, const float (&v)[V]) {
#pragma unroll
  for (int i = 0; i < V; i += 4) __stcg(reinterpret_cast<float4*>(p + i), make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]));
}
template <int V> __device__ __forceinline__ void store_cg(double* p, const double (&v)[V]) {
#pragma unroll
  for (int i = 0; i < V; i += 2) __stcg(reinterpret_cast<double2*>(p + i), make_double2(v[i], v[i + 1]));
}
template <int V> __device__ __forceinline__ void load_cg(const float* p, float (&v)[V]) {
#pragma unroll
  for (int i = 0; i < V; i += 4) {
    const float4 q = __ldcg(reinterpret_cast<const float4*>(p + i));
    v[i] = q.x, v[i + 1] = q.y, v[i + 2] = q.z, v[i + 3] = q.w;
  }
}
template <int V> __device__ __forceinline__ void load_cg(const double* p, double (&v)[V]) {
#pragma unroll
  for (int i = 0; i < V; i += 2) {
    const double2 q = __ldcg(reinterpret_cast<const double2*>(p + i));
    v[i] = q.x, v[i + 1] = q.y;
  }
}

// One warp's columns of a chunk of fp32 sums, stored unrounded into a partial row (the runs of a
// cut row in twell_gather_csr_spmm).
template <typename T, int KV>
__device__ __forceinline__ void store_partial(const typename acc_of<T>::type (&acc)[KV][Lanes<T>::N],
                                              typename acc_of<T>::type* part, int K, int k0, int lane) {
  constexpr int V = Lanes<T>::N;
#pragma unroll
  for (int kv = 0; kv < KV; ++kv) {
    const int k = k0 + (kv * 32 + lane) * V;
    if (k < K) store_cg<V>(part + k, acc[kv]);
  }
}

// out_row = the sum of `runs` partial rows of K columns from `first` on, in run order, rounded
// once: the whole row, by one warp. RUNS partial rows' pieces are requested before any is added
// (a lone warp, latency-bound: up to 32 runs x K / 256 columns per lane).
template <typename T>
__device__ __forceinline__ void add_runs(const typename acc_of<T>::type* partial, int first, int runs, int K,
                                         T* __restrict__ out_row, int lane) {
  using A = typename acc_of<T>::type;
  constexpr int V = Lanes<T>::N, RUNS = 4;
  for (int k = lane * V; k < K; k += 32 * V) {
    A sum[V];
#pragma unroll
    for (int i = 0; i < V; ++i) sum[i] = A(0);
    for (int s0 = 0; s0 < runs; s0 += RUNS) {
      A piece[RUNS][V];
#pragma unroll
      for (int r = 0; r < RUNS; ++r)
        if (s0 + r < runs) load_cg<V>(partial + (long long)(first + s0 + r) * K + k, piece[r]);
#pragma unroll
      for (int r = 0; r < RUNS; ++r)
        if (s0 + r < runs)
#pragma unroll
          for (int i = 0; i < V; ++i) sum[i] += piece[r][i];
    }
    stg16_stream(out_row + k, Lanes<T>::narrow(sum));
  }
}

// acc[s] += the products of entries [e_begin, e_end) of a CSR row with b's rows, for the s-th
// value set (data, then data2), over one chunk of columns: twell_gather_csr_spmm's inner walk.
template <typename T, int KV, int U, int NV>
__device__ __forceinline__ void csr_chunk_sums(typename acc_of<T>::type (&acc)[NV][KV][Lanes<T>::N], int e_begin,
                                               int e_end, const int* __restrict__ cols,
                                               const int* __restrict__ sources, const T* __restrict__ data,
                                               long long n_slots, const T* __restrict__ spill_vals,
                                               const T* __restrict__ data2, const T* __restrict__ spill_vals2,
                                               const T* __restrict__ b, long long ldb, int K, int k0, int lane) {
  using A = typename acc_of<T>::type;
#pragma unroll
  for (int s = 0; s < NV; ++s) clear<T, KV>(acc[s]);
  for (int e0 = e_begin; e0 < e_end; e0 += 32) {
    const int e = e0 + lane;
    int col = 0;
    A val[NV];
#pragma unroll
    for (int s = 0; s < NV; ++s) val[s] = A(0);
    if (e < e_end) {
      const long long p = sources[e];
      col = cols[e];
      val[0] = value_at(p, data, n_slots, spill_vals);
      if constexpr (NV == 2) val[NV - 1] = value_at(p, data2, n_slots, spill_vals2);
    }
    gather_accumulate_sets<T, KV, U, NV>(acc, min(32, e_end - e0), col, val, b, ldb, K, k0, lane);
  }
}

// out[r, :] = sum over row r's entries e of value(sources[e]) * b[cols[e], :], for a matrix in
// CSR form whose values stay where another layout keeps them: value(p) is data[p] for the first
// n_slots positions and spill_vals[p - n_slots] after them. The transposed products A.T @ g of
// the backward pass run it on A.T's structure (twell_transpose_place) with A's own TwELL values,
// so each output row is one warp's fp32 sum over its list, with no atomics and no gathered copy
// of the values. With PAIR, a second matrix of the same structure (values data2 / spill_vals2)
// is multiplied by the same b into out2 in the same pass: each b row is gathered once for both
// (dW_gate = dZ.T @ x and dW_up = dU.T @ x). A grid of gridDim.y > 1 splits each row's column
// passes between that many warps (pass p to warp p % gridDim.y: the same sums in the same order,
// so the same bits): more warps in flight when the output has few rows (5632 units against the
// forward's 16384 tokens).
template <typename T, int KV, int U, bool PAIR = false>
__global__ void ROW_SUM_BOUNDS(T, false) twell_gather_csr_spmm(
    const int* __restrict__ indptr, const int* __restrict__ cols, const int* __restrict__ sources,
    const T* __restrict__ data, long long n_slots, const T* __restrict__ spill_vals,
    const T* __restrict__ data2, const T* __restrict__ spill_vals2, int M, const T* __restrict__ b,
    long long ldb, int K, T* __restrict__ out, T* __restrict__ out2, long long ldo) {
  using A = typename acc_of<T>::type;
  constexpr int CHUNK = KV * 32 * Lanes<T>::N;
  constexpr int NV = PAIR ? 2 : 1;
  const long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= M) return;  // warp-uniform
  const int e_begin = indptr[row], e_end = indptr[row + 1];
  for (int k0 = blockIdx.y * CHUNK; k0 < K; k0 += gridDim.y * CHUNK) {
    A acc[NV][KV][Lanes<T>::N];
    csr_chunk_sums<T, KV, U, NV>(acc, e_begin, e_end, cols, sources, data, n_slots, spill_vals, data2, spill_vals2, b,
                                 ldb, K, k0, lane);
    store_chunk<T, KV>(acc[0], out + row * ldo, K, k0, lane);
    if constexpr (PAIR) store_chunk<T, KV>(acc[NV - 1], out2 + row * ldo, K, k0, lane);
  }
}

// twell_gather_csr_spmm with a segment plan (twell_segment_plan): the grid's first `slots` warps
// (per column share) sum the runs of the cut rows (run_length[0] entries each, as the plan
// chose), slot p's run into partial row p (partial:
// `slots` rows of K columns, then as many for the second matrix), and the warp that hands in a
// cut row's last run (a ticket per row at its first slot, zeroed by the caller) adds up the
// row's partial rows in run order and writes it; the warps after them are the rows', those of
// cut rows exiting at once. A cut row's sums are then associated by runs, the same way in every
// call; the other rows' are the plain kernel's. Kernels of their own (twell_gather_csr_spmm_cut,
// and _capped for the 2-byte single product), so that the plain kernel's code and registers stay
// as they were. The slots' warps, idle ones included, come first: with
// the runs first, the rows next and the idle slots last (measured in the thirty-sixth session,
// H100) the uniform pattern's products were 0.3-0.5% faster and the skewed one's 0.4-1.1%
// slower, and blocks of 4 warps instead of 1 were 5-6% slower on the skewed pattern.
// Its parameters, shared by the two kernels below.
#define CUT_KERNEL_PARAMETERS                                                                       \
  const int* __restrict__ indptr, const int* __restrict__ cols, const int* __restrict__ sources,    \
      const T* __restrict__ data, long long n_slots, const T* __restrict__ spill_vals,              \
      const T* __restrict__ data2, const T* __restrict__ spill_vals2, int M, const T* __restrict__ b, \
      long long ldb, int K, T* __restrict__ out, T* __restrict__ out2, long long ldo,               \
      const int* __restrict__ split_base, const int* __restrict__ slot_row, int slots,              \
      const int* __restrict__ run_length, typename acc_of<T>::type* partial, unsigned* tickets
#define CUT_KERNEL_ARGUMENTS                                                                        \
  indptr, cols, sources, data, n_slots, spill_vals, data2, spill_vals2, M, b, ldb, K, out, out2, ldo, \
      split_base, slot_row, slots, run_length, partial, tickets

template <typename T, int KV, int U, bool PAIR>
__device__ __forceinline__ void csr_spmm_cut(CUT_KERNEL_PARAMETERS) {
  using A = typename acc_of<T>::type;
  constexpr int CHUNK = KV * 32 * Lanes<T>::N;
  constexpr int NV = PAIR ? 2 : 1;
  const long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  long long row;
  int e_begin, e_end;
  A* part = nullptr;  // this warp's partial row when it sums a run of a cut row
  if (warp < slots) {  // warp-uniform branches throughout
    row = slot_row[warp];
    if (row < 0) return;
    const int segment = *run_length;
    e_begin = indptr[row] + ((int)warp - split_base[row]) * segment;
    e_end = min(e_begin + segment, indptr[row + 1]);
    part = partial + warp * (long long)K;
  } else {
    row = warp - slots;
    if (row >= M) return;
    // The three loads issue together, before the test: an uncut row's walk then starts as soon
    // as in the plain kernel, not one dependent load later.
    const int cut_at = split_base[row];
    e_begin = indptr[row];
    e_end = indptr[row + 1];
    if (cut_at >= 0) return;
  }
  for (int k0 = blockIdx.y * CHUNK; k0 < K; k0 += gridDim.y * CHUNK) {
    A acc[NV][KV][Lanes<T>::N];
    csr_chunk_sums<T, KV, U, NV>(acc, e_begin, e_end, cols, sources, data, n_slots, spill_vals, data2, spill_vals2, b,
                                 ldb, K, k0, lane);
    if (part != nullptr) {
      store_partial<T, KV>(acc[0], part, K, k0, lane);
      if constexpr (PAIR) store_partial<T, KV>(acc[NV - 1], part + (long long)slots * K, K, k0, lane);
    } else {
      store_chunk<T, KV>(acc[0], out + row * ldo, K, k0, lane);
      if constexpr (PAIR) store_chunk<T, KV>(acc[NV - 1], out2 + row * ldo, K, k0, lane);
    }
  }
  if (part == nullptr) return;
  // Hand the run in: its partial columns visible device-wide before its ticket (the last-block
  // reduction pattern); the warp drawing the row's last ticket adds the row up.
  __threadfence();
  __syncwarp();
  const int first = split_base[row];
  const int runs = segments_of(indptr[row + 1] - indptr[row], *run_length);
  unsigned ticket = 0;
  if (lane == 0) ticket = atomicAdd(tickets + first, 1u);
  ticket = __shfl_sync(kFull, ticket, 0);
  if (ticket != (unsigned)runs * gridDim.y - 1u) return;
  __threadfence();
  add_runs<T>(partial, first, runs, K, out + row * ldo, lane);
  if constexpr (PAIR) add_runs<T>(partial + (long long)slots * K, first, runs, K, out2 + row * ldo, lane);
}

// The pair, and the 4- and 8-byte single products.
template <typename T, int KV, int U, bool PAIR = false>
__global__ void ROW_SUM_BOUNDS(T, false) twell_gather_csr_spmm_cut(CUT_KERNEL_PARAMETERS) {
  csr_spmm_cut<T, KV, U, PAIR>(CUT_KERNEL_ARGUMENTS);
}

// The 2-byte single-output product under its register cap (TWELL_CUT_MAX_REGS above).
template <typename T, int KV, int U>
__global__ void __maxnreg__(TWELL_CUT_MAX_REGS) twell_gather_csr_spmm_cut_capped(CUT_KERNEL_PARAMETERS) {
  static_assert(sizeof(T) == 2, "the capped cut product is the 2-byte types' single-output kernel");
  csr_spmm_cut<T, KV, U, false>(CUT_KERNEL_ARGUMENTS);
}

// out_row = sum over the set bits j of `row` in the ReLU bit-mask of z[row, j] * w_down_t[j, :]:
// the down projection of both mask-driven tails.
template <typename T, int KV, int U>
__device__ __forceinline__ void mask_down_row(const unsigned* __restrict__ mask, long long ld_words, const T* z,
                                              long long ldz, long long row, int N, int lane,
                                              const T* __restrict__ w_down_t, long long ldd, int K_out,
                                              T* __restrict__ out_row) {
  using A = typename acc_of<T>::type;
  sum_by_chunks<T, KV>(out_row, K_out, lane, [&](A(&acc)[KV][Lanes<T>::N], int k0) {
    for_each_mask_batch(mask, ld_words, z, ldz, row, N, lane, [&](int n, int col, A h, long long) {
      gather_accumulate<T, KV, U>(acc, n, col, h, w_down_t, ldd, K_out, k0, lane);
    });
  });
}

// The gated consumer driven by the producer's ReLU bit-mask instead of TwELL parts (no pack, no
// capacity, nothing to spill): for the set bits of each row, phase 1 computes
// h = gate * (x[row] . w_up[j]) with the TwELL path's roundings (u to T, then the fp32 product
// to T) and overwrites the gate value z[row, j] with it (the warp owns its row); phase 2 sums
// h * w_down_t[j, :]. Entries come in column order, the TwELL path's order when nothing spills.
// A set bit whose gate value is zero contributes nothing, as the pack would not have kept it.
template <typename T, int KV, int U>
__global__ void __launch_bounds__(128) twell_mask_gated(
    const unsigned* __restrict__ mask, long long ld_words, T* z, long long ldz, int M, int N,
    const T* __restrict__ x, long long ldx, const T* __restrict__ w_up, long long ldu, int K_in,
    const T* __restrict__ w_down_t, long long ldd, int K_out, T* __restrict__ out, long long ldo) {
  using A = typename acc_of<T>::type;
  const long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= M) return;  // warp-uniform
  const T* x_row = x + row * ldx;
  for_each_mask_batch(mask, ld_words, z, ldz, row, N, lane, [&](int n, int col, A g, long long where) {
    const A u = to_acc(from_acc<T>(gather_dots<T, KV, U>(x_row, w_up, ldu, K_in, n, col, lane)));
    if (lane < n) z[where] = g != A(0) ? from_acc<T>(g * u) : zero_value<T>();
  });
  __syncwarp();  // phase 2 reads the h values other lanes wrote
  mask_down_row<T, KV, U>(mask, ld_words, z, ldz, row, N, lane, w_down_t, ldd, K_out, out + row * ldo);
}

// The non-gated down projection driven by the ReLU bit-mask: out[row, :] = sum over the row's set
// bits j of z[row, j] * w_down_t[j, :] (z holds relu(x @ w_up.T) already).
template <typename T, int KV, int U>
__global__ void __launch_bounds__(128) twell_mask_spmm(
    const unsigned* __restrict__ mask, long long ld_words, const T* __restrict__ z, long long ldz, int M, int N,
    const T* __restrict__ w_down_t, long long ldd, int K_out, T* __restrict__ out, long long ldo) {
  const long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= M) return;  // warp-uniform
  mask_down_row<T, KV, U>(mask, ld_words, z, ldz, row, N, lane, w_down_t, ldd, K_out, out + row * ldo);
}

// The row order of the row-gather kernels (their `order` argument): rows with more batches of
// 32 entries first. A warp owns one row, and a block's slots return only when its longest row
// ends; launched in index order, the last rows to start may be long ones that the machine then
// waits for alone. A counting sort into TWELL_ORDER_BUCKETS buckets by batches (15 or more in
// the first): launch 1 finds each row's bucket and counts the buckets, launch 2 places the rows.
// Rows of one bucket land in an order that varies between calls; each row's result does not
// depend on when it runs.
#define TWELL_ORDER_BUCKETS 16

// Launch 1, a warp per row: bucket[row] = 15 - min(batches, 15), histogram[bucket] += 1
// (histogram zeroed by the caller: TWELL_ORDER_BUCKETS counters, then as many cursors).
__global__ void __launch_bounds__(256) twell_row_buckets(const int* __restrict__ counts,
                                                         const int* __restrict__ spill_indptr, int n_tiles, int M,
                                                         unsigned char* __restrict__ bucket, int* __restrict__ histogram) {
  const long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= M) return;  // warp-uniform
  const int n = row_entries(counts, spill_indptr, row, n_tiles, lane);
  const int b = TWELL_ORDER_BUCKETS - 1 - min((n + 31) / 32, TWELL_ORDER_BUCKETS - 1);
  if (lane == 0) {
    bucket[row] = (unsigned char)b;
    atomicAdd(&histogram[b], 1);
  }
}

// Launch 2, a thread per row: order[start of its bucket + its rank] = row. The rank comes from
// the bucket's cursor, one atomic per bucket present in the warp (its lanes of that bucket
// ranked by their place in the warp).
__global__ void __launch_bounds__(256) twell_row_scatter(const unsigned char* __restrict__ bucket,
                                                         int* __restrict__ histogram, int M, int* __restrict__ order) {
  __shared__ int start[TWELL_ORDER_BUCKETS];
  if (threadIdx.x < TWELL_ORDER_BUCKETS) {
    int s = 0;
    for (int c = 0; c < (int)threadIdx.x; ++c) s += histogram[c];
    start[threadIdx.x] = s;
  }
  __syncthreads();
  const long long row = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  const bool live = row < M;
  const int b = live ? bucket[row] : -1;
  const unsigned same = __match_any_sync(0xffffffffu, b);  // every lane gets here: whole warps
  const int lane = threadIdx.x & 31;
  const int leader = __ffs(same) - 1;
  int base = 0;
  if (live && lane == leader) base = atomicAdd(&histogram[TWELL_ORDER_BUCKETS + b], __popc(same));
  base = __shfl_sync(0xffffffffu, base, leader);
  if (live) order[start[b] + base + __popc(same & ((1u << lane) - 1u))] = (int)row;
}
