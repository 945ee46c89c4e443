// veloxquant — the SSE2 vector layer (the x86-64 baseline; docs/design.md 7.2): four float lanes,
// half-precision conversion in integer arithmetic (no F16C). SSE2 has no fused multiply-add: a
// multiply-add is a multiply and an add, kept apart by an empty asm so that a consumer's
// -march with FMA cannot fuse them and change the results. Included by simd_kernels.hpp only.
#pragma once

#include "../cpu.hpp"
#if VELOXQUANT_DETAIL_X86
#include <emmintrin.h>

#include <cstdint>
#include <cstring>

#include <Eigen/Core>

#include "../quant.hpp"
#include "common.hpp"

namespace veloxquant::cache::detail::sse2 {

inline constexpr int kLanes = 4;
using V = __m128;

inline V vzero() { return _mm_setzero_ps(); }
/// Keeps x in a register: a load it came from is not folded into the instructions that use it
/// (a value used by four multiply-adds is loaded once, not four times).
inline void vpin(V& x) { __asm__("" : "+x"(x)); }
inline V vset(float a) { return _mm_set1_ps(a); }
inline V vload(const float* p) { return _mm_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm_storeu_ps(p, a); }
inline V vload_row(const float* p) { return _mm_loadu_ps(p); }
/// Four halves to float32: exponent rebias by a multiply by 2^112 (exact, also for subnormal
/// halves), infinities and NaNs get the all-ones exponent, then the sign.
inline V vload_row(const Eigen::half* p) {
  const __m128i h = _mm_unpacklo_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                                       _mm_setzero_si128());
  const __m128i em = _mm_and_si128(h, _mm_set1_epi32(0x7fff));
  const __m128i sign = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
  __m128i f = _mm_castps_si128(
      _mm_mul_ps(_mm_castsi128_ps(_mm_slli_epi32(em, 13)), _mm_castsi128_ps(_mm_set1_epi32(0x77800000))));
  const __m128i special = _mm_cmpgt_epi32(em, _mm_set1_epi32(0x7bff));
  f = _mm_or_si128(f, _mm_and_si128(special, _mm_set1_epi32(0x7f800000)));
  return _mm_castsi128_ps(_mm_or_si128(f, sign));
}
inline V vload_row(const Eigen::bfloat16* p) {
  const __m128i w = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), w));
}
/// The scale and offset at p (two halves) broadcast to vectors.
inline void vmeta(const std::uint8_t* p, V& scale, V& offset) {
  std::uint16_t so[2];
  std::memcpy(so, p, sizeof(so));
  scale = vset(half_bits_to_float(so[0]));
  offset = vset(half_bits_to_float(so[1]));
}
/// Quantized codes (docs/design.md 7.4) as float32: kLanes bytes (B = 8), or the low (Hi = false)
/// or high nibbles of kLanes bytes (B = 4).
template <int B, bool Hi = false>
inline V vcodes(const std::uint8_t* p) {
  int w;
  std::memcpy(&w, p, sizeof(w));
  const __m128i z = _mm_setzero_si128();
  __m128i c = _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(w), z), z);
  if (B == 4) c = Hi ? _mm_srli_epi32(c, 4) : _mm_and_si128(c, _mm_set1_epi32(0x0F));
  return _mm_cvtepi32_ps(c);
}
/// The bit fields (p[i] >> shift) & mask of kLanes bytes as float32 codes (shift 0 or 4, mask 15
/// or 255: a slice's 8-bit codes or one of its nibbles, chosen at run time, exactly as vcodes).
inline V vcodes_field(const std::uint8_t* p, int shift, int mask) {
  int w;
  std::memcpy(&w, p, sizeof(w));
  const __m128i z = _mm_setzero_si128();
  const __m128i c = _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(w), z), z);
  return _mm_cvtepi32_ps(
      _mm_and_si128(_mm_srl_epi32(c, _mm_cvtsi32_si128(shift)), _mm_set1_epi32(mask)));
}
/// Both nibbles of kLanes bytes as float32 codes: lo = p[i] & 15, hi = p[i] >> 4.
inline void vcodes4x2(const std::uint8_t* p, V& lo, V& hi) {
  lo = vcodes<4, false>(p);
  hi = vcodes<4, true>(p);
}
inline V vadd(V a, V b) { return _mm_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm_min_ps(a, b); }
inline unsigned vmask_eq(V a, V b) { return static_cast<unsigned>(_mm_movemask_ps(_mm_cmpeq_ps(a, b))); }
/// a * b + c with two roundings, never fused.
inline V vmadd(V a, V b, V c) {
  V p = _mm_mul_ps(a, b);
  __asm__("" : "+x"(p));
  return _mm_add_ps(p, c);
}

inline V vexp_flush(V x) {
  x = _mm_max_ps(x, _mm_set1_ps(kExpLow));
  // Round to nearest (even) by adding and removing 1.5 * 2^23.
  const V magic = _mm_set1_ps(12582912.0f);
  V t = vmadd(x, _mm_set1_ps(kLog2e), magic);
  __asm__("" : "+x"(t));
  const V n = _mm_sub_ps(t, magic);
  x = vmadd(n, _mm_set1_ps(-kLn2Hi), x);
  x = vmadd(n, _mm_set1_ps(-kLn2Lo), x);
  V y = _mm_set1_ps(kExpP0);
  y = vmadd(y, x, _mm_set1_ps(kExpP1));
  y = vmadd(y, x, _mm_set1_ps(kExpP2));
  y = vmadd(y, x, _mm_set1_ps(kExpP3));
  y = vmadd(y, x, _mm_set1_ps(kExpP4));
  y = vmadd(y, x, _mm_set1_ps(kExpP5));
  y = vmadd(y, _mm_mul_ps(x, x), x);
  y = _mm_add_ps(y, _mm_set1_ps(1.0f));
  const __m128i e = _mm_slli_epi32(_mm_add_epi32(_mm_cvtps_epi32(n), _mm_set1_epi32(127)), 23);
  y = _mm_mul_ps(y, _mm_castsi128_ps(e));
  return _mm_andnot_ps(_mm_cmplt_ps(y, _mm_set1_ps(kSoftmaxMinWeight)), y);
}

/// (x0 + x1) + (x2 + x3).
inline float vreduce_add(V a) {
  const V s = _mm_add_ps(a, _mm_shuffle_ps(a, a, _MM_SHUFFLE(2, 3, 0, 1)));  // x0+x1, ., x2+x3, .
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehl_ps(s, s)));
}
inline void vreduce_add4(V a, V b, V c, V d, float* out) {
  _MM_TRANSPOSE4_PS(a, b, c, d);  // a = lane 0 of each, b = lane 1, ...
  _mm_storeu_ps(out, _mm_add_ps(_mm_add_ps(a, b), _mm_add_ps(c, d)));
}
inline float vreduce_max(V a) {
  V t = _mm_max_ps(a, _mm_movehl_ps(a, a));
  t = _mm_max_ss(t, _mm_shuffle_ps(t, t, 1));
  return _mm_cvtss_f32(t);
}

inline void vstore_row(float* p, V a) { _mm_storeu_ps(p, a); }
template <class T>
inline void vstore_row(T* p, V a) {
  float buf[kLanes];
  float* f = opaque(buf);
  _mm_storeu_ps(f, a);
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<T>(f[i]);
}

}  // namespace veloxquant::cache::detail::sse2

#endif  // VELOXQUANT_DETAIL_X86
