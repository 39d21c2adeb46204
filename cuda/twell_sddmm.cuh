// Pieces every sampled-product kernel shares: warp-wide dot products and the outputs each mode
// derives from a slot's dot product d (twell_sddmm.cu, twell_tiled_sddmm.cu).
#pragma once
#include "twell_types.cuh"

namespace twell {

// What a sampled product writes at stored entry i (g: the pattern's values, aux: a second input
// with the pattern's structure, o0..o2: outputs; each array indexed like the pattern's slots or
// its spill part):
//   PLAIN      o0 = d
//   SCALE      o0 = d * g                     (one rounding)
//   GATED      u = d rounded; o0 = h = g * u; o1 = u when o1 is not null (the gated FFN's up
//              projection at the gate's pattern, rounded as the unfused path: SDDMM, then product)
//   GATED_BWD  d_h = d rounded, u = aux; o0 = d_z = d_h * u, o1 = d_u = d_h * g, o2 = h = g * u
//              (the gated backward's SDDMM and its value products, as ffn_act_mul with the
//              identity rounds them: the first factor's -0 made +0, an fp32 product, one rounding)
enum SddmmMode { SDDMM_PLAIN = 0, SDDMM_SCALE = 1, SDDMM_GATED = 2, SDDMM_GATED_BWD = 3 };

// The arrays a mode reads and writes at one entry index (slot or spill position).
template <typename T> struct SddmmOperands {
  const T* g;
  const T* aux;
  T* o0;
  T* o1;
  T* o2;
};

template <typename T, int MODE>
__device__ __forceinline__ void emit(typename acc_of<T>::type d, long long i, const SddmmOperands<T>& op) {
  using A = typename acc_of<T>::type;
  const auto times = [](A a, A b) { return from_acc<T>((a != A(0) ? a : A(0)) * b); };
  if (MODE == SDDMM_PLAIN) {
    op.o0[i] = from_acc<T>(d);
  } else if (MODE == SDDMM_SCALE) {
    op.o0[i] = from_acc<T>(d * to_acc(op.g[i]));
  } else if (MODE == SDDMM_GATED) {
    const T u = from_acc<T>(d);
    if (op.o1 != nullptr) op.o1[i] = u;
    op.o0[i] = from_acc<T>(to_acc(op.g[i]) * to_acc(u));
  } else {
    const A d_h = to_acc(from_acc<T>(d)), g = to_acc(op.g[i]), u = to_acc(op.aux[i]);
    op.o0[i] = times(d_h, u);
    op.o1[i] = times(d_h, g);
    op.o2[i] = times(g, u);
  }
}

// Zero at padding position i of every output the mode writes.
template <typename T, int MODE>
__device__ __forceinline__ void emit_zero(long long i, const SddmmOperands<T>& op) {
  op.o0[i] = zero_value<T>();
  if ((MODE == SDDMM_GATED && op.o1 != nullptr) || MODE == SDDMM_GATED_BWD) op.o1[i] = zero_value<T>();
  if (MODE == SDDMM_GATED_BWD) op.o2[i] = zero_value<T>();
}

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// a . b over K values, each lane summing every 32nd product; every lane gets the total.
template <typename T>
__device__ __forceinline__ typename acc_of<T>::type row_dot(const T* __restrict__ a,
                                                            const T* __restrict__ b, int K,
                                                            int lane) {
  using A = typename acc_of<T>::type;
  A s = A(0);
  for (int k = lane; k < K; k += 32) s += to_acc(a[k]) * to_acc(b[k]);
  return warp_sum(s);
}

}  // namespace twell
