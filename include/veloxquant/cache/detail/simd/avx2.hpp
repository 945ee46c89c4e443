// veloxquant — the AVX2 + FMA + F16C vector layer (x86-64-v3; docs/design.md 7.2). Compiled with
// a target attribute whatever the consumer's flags, and run only where the CPU has it.
// Every multiply-add is an explicit FMA, so the compiler has nothing to contract and the results
// do not depend on -O or -march. Include <immintrin.h> before it (simd_kernels.hpp does).
#pragma once

#include "../cpu.hpp"
#if VELOXQUANT_DETAIL_X86
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include <Eigen/Core>

#include "common.hpp"

VELOXQUANT_DETAIL_TARGET_AVX2_BEGIN
namespace veloxquant::cache::detail::avx2 {

inline constexpr int kLanes = 8;
using V = __m256;

inline V vzero() { return _mm256_setzero_ps(); }
/// Keeps x in a register: a load it came from is not folded into the instructions that use it
/// (a value used by four multiply-adds is loaded once, not four times).
inline void vpin(V& x) { __asm__("" : "+x"(x)); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
inline V vload_row(const float* p) { return _mm256_loadu_ps(p); }
inline V vload_row(const Eigen::half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline V vload_row(const Eigen::bfloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
/// The scale and offset at p (two halves) broadcast to vectors (F16C).
inline void vmeta(const std::uint8_t* p, V& scale, V& offset) {
  int w;
  std::memcpy(&w, p, sizeof(w));
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(w));
  scale = _mm256_broadcastss_ps(f);
  offset = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
}
/// Quantized codes (docs/design.md 7.4) as float32: kLanes bytes (B = 8), or the low (Hi = false)
/// or high nibbles of kLanes bytes (B = 4).
template <int B, bool Hi = false>
inline V vcodes(const std::uint8_t* p) {
  __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if (B == 4) c = Hi ? _mm256_srli_epi32(c, 4) : _mm256_and_si256(c, _mm256_set1_epi32(0x0F));
  return _mm256_cvtepi32_ps(c);
}
/// The bit fields (p[i] >> shift) & mask of kLanes bytes as float32 codes (shift 0 or 4, mask 15
/// or 255: a slice's 8-bit codes or one of its nibbles, chosen at run time, exactly as vcodes).
inline V vcodes_field(const std::uint8_t* p, int shift, int mask) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepi32_ps(
      _mm256_and_si256(_mm256_srl_epi32(c, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(mask)));
}
/// Both nibbles of kLanes bytes as float32 codes: lo = p[i] & 15, hi = p[i] >> 4.
inline void vcodes4x2(const std::uint8_t* p, V& lo, V& hi) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(0x0F)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
}
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline unsigned vmask_eq(V a, V b) {
  return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)));
}
inline V vmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }

inline V vexp_flush(V x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpLow));
  const V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  x = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), x);
  V y = _mm256_set1_ps(kExpP0);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP1));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP2));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP3));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP4));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP5));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  const V small = _mm256_cmp_ps(y, _mm256_set1_ps(kSoftmaxMinWeight), _CMP_LT_OQ);
  return _mm256_andnot_ps(small, y);
}

/// ((x0 + x4) + (x1 + x5)) + ((x2 + x6) + (x3 + x7)).
inline float vreduce_add(V a) {
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 h = _mm_hadd_ps(t, t);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
/// vreduce_add of four vectors at once (the same tree for each).
inline void vreduce_add4(V a, V b, V c, V d, float* out) {
  const __m128 ta = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 tb = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 tc = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
  const __m128 td = _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
  _mm_storeu_ps(out, _mm_hadd_ps(_mm_hadd_ps(ta, tb), _mm_hadd_ps(tc, td)));
}
inline float vreduce_max(V a) {
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  t = _mm_max_ss(t, _mm_shuffle_ps(t, t, 1));
  return _mm_cvtss_f32(t);
}

inline void vstore_row(float* p, V a) { _mm256_storeu_ps(p, a); }
inline void vstore_row(Eigen::half* p, V a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
}
inline void vstore_row(Eigen::bfloat16* p, V a) {
  float buf[kLanes];
  float* f = opaque(buf);
  _mm256_storeu_ps(f, a);
  for (int i = 0; i < kLanes; ++i) p[i] = Eigen::bfloat16(f[i]);
}

}  // namespace veloxquant::cache::detail::avx2
VELOXQUANT_DETAIL_TARGET_AVX2_END

#endif  // VELOXQUANT_DETAIL_X86
