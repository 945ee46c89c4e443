// veloxquant — the NEON vector layer (aarch64; docs/design.md 7.2): eight float lanes as two
// 128-bit registers, the lanes of the AVX2 and scalar paths, so that every kernel runs the same
// chains and the same reduction trees and its results are bit-identical to theirs. NEON, its
// fused multiply-add and its half <-> float conversions are part of every aarch64 CPU, so the
// layer needs no target attribute and no detection. Each operation states how it matches the
// scalar path's (simd/scalar.hpp) where the instruction alone would not: max and min select
// by comparison (FMAX treats -0 < +0 and returns NaN from either operand; the other paths return
// the second operand unless the first is greater), the exp rounds with FRINTN (ties to even, as
// nearbyint and ROUNDPS do). Included by simd_kernels.hpp only.
#pragma once

#include "../cpu.hpp"
#if VELOXQUANT_DETAIL_ARM64
#include <arm_neon.h>

#include <cstdint>
#include <cstring>

#include <Eigen/Core>

#include "common.hpp"

namespace veloxquant::cache::detail::neon {

inline constexpr int kLanes = 8;

/// Lanes 0-3 in lo, 4-7 in hi.
struct V {
  float32x4_t lo, hi;
};

inline V vzero() { return {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
/// Keeps x in registers: a load it came from is not repeated for each of the instructions that
/// use it.
inline void vpin(V& x) { __asm__("" : "+w"(x.lo), "+w"(x.hi)); }
inline V vset(float a) { return {vdupq_n_f32(a), vdupq_n_f32(a)}; }
inline V vload(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline void vstore(float* p, V a) {
  vst1q_f32(p, a.lo);
  vst1q_f32(p + 4, a.hi);
}
inline V vload_row(const float* p) { return vload(p); }
/// Eight halves to float32 (FCVTL: exact).
inline V vload_row(const Eigen::half* p) {
  const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(reinterpret_cast<const std::uint16_t*>(p)));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
/// Eight bfloat16 to float32: the bits moved to the top half (exact).
inline V vload_row(const Eigen::bfloat16* p) {
  const uint16x8_t w = vld1q_u16(reinterpret_cast<const std::uint16_t*>(p));
  return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(w), 16)),
          vreinterpretq_f32_u32(vshll_high_n_u16(w, 16))};
}
/// The scale and offset at p (two halves) broadcast to vectors.
inline void vmeta(const std::uint8_t* p, V& scale, V& offset) {
  std::uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  const float32x4_t f = vcvt_f32_f16(vreinterpret_f16_u32(vdup_n_u32(w)));
  scale.lo = scale.hi = vdupq_laneq_f32(f, 0);
  offset.lo = offset.hi = vdupq_laneq_f32(f, 1);
}
/// Eight byte codes (already masked or shifted) as float32.
inline V codes_to_float(uint8x8_t b) {
  const uint16x8_t w = vmovl_u8(b);
  return {vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))), vcvtq_f32_u32(vmovl_high_u16(w))};
}
/// Quantized codes (docs/design.md 7.4) as float32: kLanes bytes (B = 8), or the low (Hi = false)
/// or high nibbles of kLanes bytes (B = 4).
template <int B, bool Hi = false>
inline V vcodes(const std::uint8_t* p) {
  uint8x8_t b = vld1_u8(p);
  if (B == 4) b = Hi ? vshr_n_u8(b, 4) : vand_u8(b, vdup_n_u8(0x0F));
  return codes_to_float(b);
}
/// The bit fields (p[i] >> shift) & mask of kLanes bytes as float32 codes (shift 0 or 4, mask 15
/// or 255: a slice's 8-bit codes or one of its nibbles, chosen at run time, exactly as vcodes).
inline V vcodes_field(const std::uint8_t* p, int shift, int mask) {
  const uint8x8_t b = vshl_u8(vld1_u8(p), vdup_n_s8(static_cast<std::int8_t>(-shift)));
  return codes_to_float(vand_u8(b, vdup_n_u8(static_cast<std::uint8_t>(mask))));
}
/// Both nibbles of kLanes bytes as float32 codes: lo = p[i] & 15, hi = p[i] >> 4.
inline void vcodes4x2(const std::uint8_t* p, V& lo, V& hi) {
  const uint8x8_t b = vld1_u8(p);
  lo = codes_to_float(vand_u8(b, vdup_n_u8(0x0F)));
  hi = codes_to_float(vshr_n_u8(b, 4));
}
inline V vadd(V a, V b) { return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
inline V vsub(V a, V b) { return {vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
inline V vmul(V a, V b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
/// a > b ? a : b per lane (a NaN in either gives b, as MAXPS and the scalar path do).
inline float32x4_t max4(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
inline V vmax(V a, V b) { return {max4(a.lo, b.lo), max4(a.hi, b.hi)}; }
/// a < b ? a : b per lane.
inline V vmin(V a, V b) {
  return {vbslq_f32(vcltq_f32(a.lo, b.lo), a.lo, b.lo),
          vbslq_f32(vcltq_f32(a.hi, b.hi), a.hi, b.hi)};
}
/// Bit i set when lane i of a equals lane i of b (false for NaN).
inline unsigned vmask_eq(V a, V b) {
  static const std::uint32_t kBits[4] = {1u, 2u, 4u, 8u};
  const uint32x4_t bits = vld1q_u32(kBits);
  const std::uint32_t lo = vaddvq_u32(vandq_u32(vceqq_f32(a.lo, b.lo), bits));
  const std::uint32_t hi = vaddvq_u32(vandq_u32(vceqq_f32(a.hi, b.hi), bits));
  return lo | (hi << 4);
}
/// a * b + c, rounded once (FMLA).
inline V vmadd(V a, V b, V c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }

/// exp(x) for x <= 0 (also -inf); results below kSoftmaxMinWeight are exactly 0. The operations of
/// the scalar path's vexp_flush, four lanes at a time.
inline float32x4_t exp4(float32x4_t x) {
  x = max4(x, vdupq_n_f32(kExpLow));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(kLog2e)));
  x = vfmaq_f32(x, n, vdupq_n_f32(-kLn2Hi));
  x = vfmaq_f32(x, n, vdupq_n_f32(-kLn2Lo));
  float32x4_t y = vdupq_n_f32(kExpP0);
  y = vfmaq_f32(vdupq_n_f32(kExpP1), y, x);
  y = vfmaq_f32(vdupq_n_f32(kExpP2), y, x);
  y = vfmaq_f32(vdupq_n_f32(kExpP3), y, x);
  y = vfmaq_f32(vdupq_n_f32(kExpP4), y, x);
  y = vfmaq_f32(vdupq_n_f32(kExpP5), y, x);
  y = vfmaq_f32(x, y, vmulq_f32(x, x));
  y = vaddq_f32(y, vdupq_n_f32(1.0f));
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
  y = vmulq_f32(y, vreinterpretq_f32_s32(e));
  const uint32x4_t small = vcltq_f32(y, vdupq_n_f32(kSoftmaxMinWeight));
  return vbslq_f32(small, vdupq_n_f32(0.0f), y);
}
inline V vexp_flush(V x) { return {exp4(x.lo), exp4(x.hi)}; }

/// ((x0 + x4) + (x1 + x5)) + ((x2 + x6) + (x3 + x7)): the AVX2 path's tree.
inline float vreduce_add(V a) {
  const float32x4_t t = vaddq_f32(a.lo, a.hi);
  const float32x4_t h = vpaddq_f32(t, t);  // t0 + t1, t2 + t3, ...
  return vgetq_lane_f32(h, 0) + vgetq_lane_f32(h, 1);
}
/// vreduce_add of four vectors at once (the same tree for each).
inline void vreduce_add4(V a, V b, V c, V d, float* out) {
  const float32x4_t ab = vpaddq_f32(vaddq_f32(a.lo, a.hi), vaddq_f32(b.lo, b.hi));
  const float32x4_t cd = vpaddq_f32(vaddq_f32(c.lo, c.hi), vaddq_f32(d.lo, d.hi));
  vst1q_f32(out, vpaddq_f32(ab, cd));
}
/// The AVX2 path's tree: lanes i and i + 4, then 0 and 2, 1 and 3, then the two left.
inline float vreduce_max(V a) {
  const float32x4_t t = max4(a.lo, a.hi);
  const float u0 = vgetq_lane_f32(t, 0) > vgetq_lane_f32(t, 2) ? vgetq_lane_f32(t, 0)
                                                                : vgetq_lane_f32(t, 2);
  const float u1 = vgetq_lane_f32(t, 1) > vgetq_lane_f32(t, 3) ? vgetq_lane_f32(t, 1)
                                                                : vgetq_lane_f32(t, 3);
  return u0 > u1 ? u0 : u1;
}

inline void vstore_row(float* p, V a) { vstore(p, a); }
/// Eight float32 to half, rounded to nearest even (FCVTN, the default rounding mode).
inline void vstore_row(Eigen::half* p, V a) {
  const float16x8_t h = vcvt_high_f16_f32(vcvt_f16_f32(a.lo), a.hi);
  vst1q_u16(reinterpret_cast<std::uint16_t*>(p), vreinterpretq_u16_f16(h));
}
/// Four float32 to bfloat16 as Eigen rounds them: to nearest even by adding 0x7fff plus the
/// kept lowest bit, a NaN to the quiet NaN 0x7fc0 with its sign.
inline uint16x4_t to_bfloat16(float32x4_t x) {
  const uint32x4_t u = vreinterpretq_u32_f32(x);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint16x4_t rounded = vshrn_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb), 16);
  const uint16x4_t nan = vorr_u16(vmovn_u32(vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x8000))),
                                  vdup_n_u16(0x7fc0));
  const uint16x4_t is_num = vmovn_u32(vceqq_f32(x, x));
  return vbsl_u16(is_num, rounded, nan);
}
inline void vstore_row(Eigen::bfloat16* p, V a) {
  vst1q_u16(reinterpret_cast<std::uint16_t*>(p), vcombine_u16(to_bfloat16(a.lo), to_bfloat16(a.hi)));
}

}  // namespace veloxquant::cache::detail::neon

#endif  // VELOXQUANT_DETAIL_ARM64
