// fp8 e4m3 ("fn": no infinities, 0x7F / 0xFF NaN, largest finite 448) codec for weight rows
// stored in 8 bits with one fp32 scale per row (twellsparse.quantize_rows): the row-gather SpMM
// then reads half the bytes of a 2-byte row per stored entry.
#pragma once

namespace twell {

// The largest finite e4m3 value: a row's absolute maximum maps to it.
constexpr float kE4M3Max = 448.f;

// float -> e4m3 with round-to-nearest-even, saturating at +-448 (the row scale keeps |x| <= 448
// up to the division's rounding; infinities and NaN, which the host refuses, saturate too).
__device__ __forceinline__ unsigned e4m3_from_float(float x) {
  const unsigned u = __float_as_uint(x);
  const unsigned sign = (u >> 24) & 0x80u;
  const unsigned mag = u & 0x7fffffffu;
  if (mag < 0x3c800000u) {  // |x| < 2^-6: e4m3's subnormals, steps of 2^-9 (8 is the smallest normal)
    return sign | (unsigned)__float2int_rn(__uint_as_float(mag) * 512.f);
  }
  // Drop 20 of the 23 mantissa bits, ties to even; a carry steps the exponent. Rebias 127 -> 7.
  const unsigned code = ((mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20) - (120u << 3);
  return sign | (code > 0x7eu ? 0x7eu : code);
}

// e4m3 -> float, exactly (every e4m3 value is a float).
__device__ __forceinline__ float e4m3_to_float(unsigned b) {
  const unsigned mag = b & 0x7fu;
  const float v = mag >= 8u ? __uint_as_float((mag + (120u << 3)) << 20) : (float)mag * (1.f / 512.f);
  return (b & 0x80u) ? -v : v;
}

// Eight e4m3 values (element i in byte i of the pair lo, hi) widened to float. From sm_89 on, two
// at a time by the hardware conversion to f16 pairs (exact: e4m3 is a subset of f16).
__device__ __forceinline__ void e4m3x8_to_float(unsigned lo, unsigned hi, float (&out)[8]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned h[4];
  asm("{\n .reg .b16 a, b;\n"
      " mov.b32 {a, b}, %4;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n"
      " mov.b32 {a, b}, %5;\n cvt.rn.f16x2.e4m3x2 %2, a;\n cvt.rn.f16x2.e4m3x2 %3, b;\n}"
      : "=r"(h[0]), "=r"(h[1]), "=r"(h[2]), "=r"(h[3])
      : "r"(lo), "r"(hi));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;\n}"
        : "=f"(out[2 * i]), "=f"(out[2 * i + 1])
        : "r"(h[i]));
  }
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[i] = e4m3_to_float((lo >> (8 * i)) & 0xffu);
    out[4 + i] = e4m3_to_float((hi >> (8 * i)) & 0xffu);
  }
#endif
}

// Four e4m3 values (bytes 0-3 of w) as two f16 pairs, exactly: lo holds bytes 0 (low half) and
// 1, hi bytes 2 and 3 (the layout of a 16-byte vector of 2-byte values, as the MMAs take it).
__device__ __forceinline__ void e4m3x4_to_f16x4(unsigned w, unsigned& lo, unsigned& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
#else
  // cvt.rn.f16x2.f32 d, a, b puts a in the upper half.
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(e4m3_to_float((w >> 8) & 0xffu)), "f"(e4m3_to_float(w & 0xffu)));
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(e4m3_to_float(w >> 24)), "f"(e4m3_to_float((w >> 16) & 0xffu)));
#endif
}

}  // namespace twell
