// veloxquant — constants shared by every vector layer (docs/design.md 7.2): the exp polynomial
// and the softmax underflow threshold, so that every path computes the same function.
#pragma once

// Target regions: the code between BEGIN and END is compiled for that instruction set whatever the
// consumer's flags (GCC: target pragma; Clang: an attribute on every function). No warning is
// silenced in them: simd/avx512.hpp avoids the intrinsics GCC 12 warns about.
#if defined(__clang__)
#define VELOXQUANT_DETAIL_TARGET_AVX2_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define VELOXQUANT_DETAIL_TARGET_AVX2_END _Pragma("clang attribute pop")
#define VELOXQUANT_DETAIL_TARGET_AVX512_BEGIN                                                     \
  _Pragma(                                                                                      \
      "clang attribute push(__attribute__((target(\"avx512f,avx2,fma,f16c\"))), apply_to = function)")
#define VELOXQUANT_DETAIL_TARGET_AVX512_END _Pragma("clang attribute pop")
#else
#define VELOXQUANT_DETAIL_TARGET_AVX2_BEGIN \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define VELOXQUANT_DETAIL_TARGET_AVX2_END _Pragma("GCC pop_options")
#define VELOXQUANT_DETAIL_TARGET_AVX512_BEGIN \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx2,fma,f16c\")")
#define VELOXQUANT_DETAIL_TARGET_AVX512_END _Pragma("GCC pop_options")
#endif

/// Fully unrolls the loop that follows (small constant trip counts over named-register arrays:
/// without it -O2 may keep the arrays in memory).
#if defined(__GNUC__) || defined(__clang__)
#define VELOXQUANT_DETAIL_UNROLL _Pragma("GCC unroll 16")
#else
#define VELOXQUANT_DETAIL_UNROLL
#endif

namespace veloxquant::cache::detail {

/// `p`, with whatever the compiler knows about its alignment forgotten. A local array met by vector
/// loads or stores goes through it: GCC turns an unaligned vector load of a local it has aligned
/// to 64 bytes into an aligned one, and AddressSanitizer's fake stack (use-after-return detection)
/// places locals only 32-byte aligned, so the aligned load would fault.
template <class X>
inline X* opaque(X* p) {
#if defined(__GNUC__) || defined(__clang__)
  __asm__("" : "+r"(p));
#endif
  return p;
}

/// Lowest and highest set bit of a non-zero mask.
inline int first_bit(unsigned m) {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_ctz(m);
#else
  int i = 0;
  while (!(m & 1u)) m >>= 1, ++i;
  return i;
#endif
}
inline int last_bit(unsigned m) {
#if defined(__GNUC__) || defined(__clang__)
  return 31 - __builtin_clz(m);
#else
  int i = -1;
  while (m) m >>= 1, ++i;
  return i;
#endif
}

/// Weights below exp(-87) (the bottom of float32's normal range) are taken as exactly 0: rows that
/// receive no attention must not collect a tiny, age-dependent score, or the exact-tie rules of
/// docs/design.md 4.2/4.5 would be decided by rounding noise.
inline constexpr float kSoftmaxMinWeight = 1.6458115e-38f;  // exp(-87)

// exp(x) = 2^n * exp(r), n = round(x * log2(e)), r = x - n * ln(2) in two parts, exp(r) from a
// degree-7 polynomial (the classic single-precision coefficients); x is clamped at -88 first.
inline constexpr float kExpLow = -88.0f;
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
inline constexpr float kExpP0 = 1.9875691500e-4f;
inline constexpr float kExpP1 = 1.3981999507e-3f;
inline constexpr float kExpP2 = 8.3334519073e-3f;
inline constexpr float kExpP3 = 4.1665795894e-2f;
inline constexpr float kExpP4 = 1.6666665459e-1f;
inline constexpr float kExpP5 = 5.0000001201e-1f;

}  // namespace veloxquant::cache::detail
