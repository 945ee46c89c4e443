// veloxquant — the AVX-512F vector layer (docs/design.md 7.2): sixteen float lanes, explicit FMAs.
// Compiled with a target attribute whatever the consumer's flags, and run only where the CPU has
// it.
#pragma once

#include "../cpu.hpp"
#if VELOXQUANT_DETAIL_X86
#include <immintrin.h>

#include <Eigen/Core>
#include <cstdint>
#include <cstring>

#include "common.hpp"

VELOXQUANT_DETAIL_TARGET_AVX512_BEGIN
namespace veloxquant::cache::detail::avx512 {

inline constexpr int kLanes = 16;
using V = __m512;

// GCC 12's unmasked AVX-512 intrinsics pass _mm512_undefined_*() (a variable initialised with
// itself) as the merge source of a masked builtin, and once they are inlined -Wmaybe-uninitialized
// reports that variable (GCC 13 silences it in its own header). Every intrinsic of this layer
// that has such a form is called as its zero-masking twin with every lane selected: the same
// instruction, and no operand left undefined.
inline constexpr __mmask16 kAll = 0xFFFF;

inline V vzero() { return _mm512_setzero_ps(); }
/// Keeps x in a register: a load it came from is not folded into the instructions that use it
/// (a value used by four multiply-adds is loaded once, not four times).
inline void vpin(V& x) { __asm__("" : "+v"(x)); }
inline V vset(float a) { return _mm512_set1_ps(a); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V vload_row(const float* p) { return _mm512_loadu_ps(p); }
inline V vload_row(const Eigen::half* p) {
  return _mm512_maskz_cvtph_ps(kAll, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V vload_row(const Eigen::bfloat16* p) {
  const __m512i w =
      _mm512_maskz_cvtepu16_epi32(kAll, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, w, 16));
}
/// The scale and offset at p (two halves) broadcast to vectors (F16C).
inline void vmeta(const std::uint8_t* p, V& scale, V& offset) {
  int w;
  std::memcpy(&w, p, sizeof(w));
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(w));
  scale = _mm512_maskz_broadcastss_ps(kAll, f);
  offset = _mm512_maskz_broadcastss_ps(kAll, _mm_movehdup_ps(f));
}
/// Quantized codes (docs/design.md 7.4) as float32: kLanes bytes (B = 8), or the low (Hi = false)
/// or high nibbles of kLanes bytes (B = 4).
template <int B, bool Hi = false>
inline V vcodes(const std::uint8_t* p) {
  __m512i c =
      _mm512_maskz_cvtepu8_epi32(kAll, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (B == 4)
    c = Hi ? _mm512_maskz_srli_epi32(kAll, c, 4) : _mm512_and_si512(c, _mm512_set1_epi32(0x0F));
  return _mm512_maskz_cvtepi32_ps(kAll, c);
}
/// The bit fields (p[i] >> shift) & mask of kLanes bytes as float32 codes (shift 0 or 4, mask 15
/// or 255: a slice's 8-bit codes or one of its nibbles, chosen at run time, exactly as vcodes).
inline V vcodes_field(const std::uint8_t* p, int shift, int mask) {
  const __m512i c =
      _mm512_maskz_cvtepu8_epi32(kAll, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_maskz_cvtepi32_ps(
      kAll, _mm512_and_si512(_mm512_maskz_srl_epi32(kAll, c, _mm_cvtsi32_si128(shift)),
                             _mm512_set1_epi32(mask)));
}
/// Both nibbles of kLanes bytes as float32 codes: lo = p[i] & 15, hi = p[i] >> 4.
inline void vcodes4x2(const std::uint8_t* p, V& lo, V& hi) {
  const __m512i c =
      _mm512_maskz_cvtepu8_epi32(kAll, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_maskz_cvtepi32_ps(kAll, _mm512_and_si512(c, _mm512_set1_epi32(0x0F)));
  hi = _mm512_maskz_cvtepi32_ps(kAll, _mm512_maskz_srli_epi32(kAll, c, 4));
}
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_maskz_max_ps(kAll, a, b); }
inline V vmin(V a, V b) { return _mm512_maskz_min_ps(kAll, a, b); }
inline unsigned vmask_eq(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline V vmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }

inline V vexp_flush(V x) {
  x = vmax(x, _mm512_set1_ps(kExpLow));
  const V n = _mm512_maskz_roundscale_ps(kAll, _mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  x = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), x);
  V y = _mm512_set1_ps(kExpP0);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP1));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP2));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP3));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP4));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP5));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_maskz_slli_epi32(
      kAll, _mm512_add_epi32(_mm512_maskz_cvtps_epi32(kAll, n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  const __mmask16 keep = _mm512_cmp_ps_mask(y, _mm512_set1_ps(kSoftmaxMinWeight), _CMP_NLT_UQ);
  return _mm512_maskz_mov_ps(keep, y);
}

/// Lanes [8 I, 8 I + 8) of a (GCC 12's _mm512_castps512_ps256 is this extract, unmasked).
template <int I>
inline __m256 vhalf(V a) {
  return _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xFF, _mm512_castps_pd(a), I));
}

// Sixteen lanes fold to eight (lane i + lane i + 8), then the AVX2 tree.
inline __m128 fold4(V a) {
  const __m256 h = _mm256_add_ps(vhalf<0>(a), vhalf<1>(a));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
inline float vreduce_add(V a) {
  const __m128 t = fold4(a);
  const __m128 h = _mm_hadd_ps(t, t);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
inline void vreduce_add4(V a, V b, V c, V d, float* out) {
  _mm_storeu_ps(out, _mm_hadd_ps(_mm_hadd_ps(fold4(a), fold4(b)), _mm_hadd_ps(fold4(c), fold4(d))));
}
/// The order of GCC's _mm512_reduce_max_ps (halves, quarters, pairs), written out: that one
/// extracts the upper half with an undefined merge source too.
inline float vreduce_max(V a) {
  const __m256 h = _mm256_max_ps(vhalf<1>(a), vhalf<0>(a));
  __m128 t = _mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  t = _mm_max_ps(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_max_ps(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(0, 1, 0, 1)));
  return _mm_cvtss_f32(t);
}

inline void vstore_row(float* p, V a) { _mm512_storeu_ps(p, a); }
inline void vstore_row(Eigen::half* p, V a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_maskz_cvtps_ph(kAll, a, _MM_FROUND_TO_NEAREST_INT));
}
inline void vstore_row(Eigen::bfloat16* p, V a) {
  float buf[kLanes];
  float* f = opaque(buf);
  _mm512_storeu_ps(f, a);
  for (int i = 0; i < kLanes; ++i) p[i] = Eigen::bfloat16(f[i]);
}

}  // namespace veloxquant::cache::detail::avx512
VELOXQUANT_DETAIL_TARGET_AVX512_END

#endif  // VELOXQUANT_DETAIL_X86
