// Value types and conversions shared by every twellsparse kernel.
//
// The 16-bit types are plain bit containers converted with PTX `cvt` (sm_80+), so the kernels
// need no CUDA headers at all: NVRTC compiles them on a machine without a GPU or toolkit.
#pragma once

namespace twell {

struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };

// Whether two types are one (a constexpr test without <type_traits>, which NVRTC lacks).
template <typename A, typename B> struct is_same_type { static constexpr bool value = false; };
template <typename A> struct is_same_type<A, A> { static constexpr bool value = true; };

// Accumulator type: fp32 for every storage type but float64.
template <typename T> struct acc_of { using type = float; };
template <> struct acc_of<double> { using type = double; };

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(bf16 v) { return __uint_as_float(((unsigned)v.bits) << 16); }
__device__ __forceinline__ float to_acc(f16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}

template <typename T> __device__ __forceinline__ T from_acc(typename acc_of<T>::type v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <> __device__ __forceinline__ bf16 from_acc<bf16>(float v) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
  return r;
}
template <> __device__ __forceinline__ f16 from_acc<f16>(float v) {
  f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
  return r;
}

template <typename T> __device__ __forceinline__ T zero_value() { return from_acc<T>(0); }

// The unfused backward's value product (ffn_act_mul with the identity: a kept, nonzero first
// factor times the second) of two rounded values, in the accumulator type, rounded to T: the
// first factor's -0 taken as +0. The fused backward kernels (the row gathers', the tiled up
// projection's and the tiled FFN's) write d_z, d_u and h with it, so their bits match.
template <typename T>
__device__ __forceinline__ T kept_product(typename acc_of<T>::type a, typename acc_of<T>::type b) {
  using A = typename acc_of<T>::type;
  return from_acc<T>((a != A(0) ? a : A(0)) * b);
}

// Whether an fp32 value is finite (neither Inf nor NaN), from its exponent bits.
__device__ __forceinline__ bool finite_bits(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }

// V consecutive values as one aligned unit (V * sizeof(T) = 16 bytes: one vector load).
template <typename T, int V> struct alignas(sizeof(T) * V) Chunk {
  T v[V];
};

// Activations (the names of twellsparse._validation.ACTIVATIONS, same order).
enum Activation { ACT_RELU = 0, ACT_RELU2 = 1, ACT_SILU = 2, ACT_GELU = 3, ACT_IDENTITY = 4 };

template <int ACT, typename A> __device__ __forceinline__ A activate(A z) {
  if (ACT == ACT_RELU) return z > A(0) ? z : A(0);
  if (ACT == ACT_RELU2) return z > A(0) ? z * z : A(0);
  if (ACT == ACT_SILU) return z / (A(1) + exp(-z));
  if (ACT == ACT_GELU) {
    const A c = A(0.7978845608028654);  // sqrt(2 / pi), tanh form as in most checkpoints
    return A(0.5) * z * (A(1) + tanh(c * (z + A(0.044715) * z * z * z)));
  }
  return z;
}

// Which entries a producer keeps: nonzero (NaN counts as nonzero), or |h| > threshold when
// threshold >= 0. -0.0 compares equal to zero and is never stored, as in scipy.sparse. The
// threshold stays double so that it is never rounded to the value type before comparing.
template <typename A> __device__ __forceinline__ bool keep(A h, double threshold) {
  if (threshold < 0.0) return h != A(0);
  return (double)fabs(h) > threshold;
}
// fp32 values (every 2-byte type's accumulator): |h| > t is |h| > t rounded towards zero to
// fp32 (the largest float <= t), so the compare stays in fp32; the rounding of t is the same for
// every entry and is hoisted out of the callers' loops. Widening each entry to fp64 instead cost
// an F2F.F64 and a DSETP per entry (the fused producer's pack warps fell behind on it).
template <> __device__ __forceinline__ bool keep<float>(float h, double threshold) {
  if (threshold < 0.0) return h != 0.f;
  return fabsf(h) > __double2float_rz(threshold);
}

}  // namespace twell
