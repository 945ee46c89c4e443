// veloxquant — the portable vector layer (docs/design.md 7.2): eight float lanes in plain C++, the
// path on CPUs without a SIMD path of their own. Every operation is the one the AVX2 path performs
// (fused multiply-add through std::fma, the same reduction tree, the same exp), so its results are
// bit-identical to the AVX2 path's; compilers vectorise the lane loops where they can.
// Included by simd_kernels.hpp only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <Eigen/Core>

#include "../quant.hpp"
#include "common.hpp"

namespace veloxquant::cache::detail::scalar {

inline constexpr int kLanes = 8;

struct V {
  float x[kLanes];
};

inline V vzero() {
  V r;
  for (float& f : r.x) f = 0.0f;
  return r;
}
/// A no-op here (simd/avx2.hpp: keeps a value in a register).
inline void vpin(V&) {}
inline V vset(float a) {
  V r;
  for (float& f : r.x) f = a;
  return r;
}
inline V vload(const float* p) {
  V r;
  std::memcpy(r.x, p, sizeof(r.x));
  return r;
}
inline void vstore(float* p, V a) { std::memcpy(p, a.x, sizeof(a.x)); }
/// kLanes stored elements as float32 (exact for every storage type).
template <class T>
inline V vload_row(const T* p) {
  V r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = static_cast<float>(p[i]);
  return r;
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
  V r;
  for (int i = 0; i < kLanes; ++i) {
    const int c = B == 8 ? p[i] : Hi ? p[i] >> 4 : p[i] & 0x0F;
    r.x[i] = static_cast<float>(c);
  }
  return r;
}
/// The bit fields (p[i] >> shift) & mask of kLanes bytes as float32 codes (shift 0 or 4, mask 15
/// or 255: a slice's 8-bit codes or one of its nibbles, chosen at run time, exactly as vcodes).
inline V vcodes_field(const std::uint8_t* p, int shift, int mask) {
  V r;
  for (int i = 0; i < kLanes; ++i) r.x[i] = static_cast<float>((p[i] >> shift) & mask);
  return r;
}
/// Both nibbles of kLanes bytes as float32 codes: lo = p[i] & 15, hi = p[i] >> 4.
inline void vcodes4x2(const std::uint8_t* p, V& lo, V& hi) {
  lo = vcodes<4, false>(p);
  hi = vcodes<4, true>(p);
}
inline V vadd(V a, V b) {
  for (int i = 0; i < kLanes; ++i) a.x[i] += b.x[i];
  return a;
}
inline V vsub(V a, V b) {
  for (int i = 0; i < kLanes; ++i) a.x[i] -= b.x[i];
  return a;
}
inline V vmul(V a, V b) {
  for (int i = 0; i < kLanes; ++i) a.x[i] *= b.x[i];
  return a;
}
/// a > b ? a : b per lane (a NaN in a gives b, as MAXPS does).
inline V vmax(V a, V b) {
  for (int i = 0; i < kLanes; ++i) a.x[i] = a.x[i] > b.x[i] ? a.x[i] : b.x[i];
  return a;
}
inline V vmin(V a, V b) {
  for (int i = 0; i < kLanes; ++i) a.x[i] = a.x[i] < b.x[i] ? a.x[i] : b.x[i];
  return a;
}
/// Bit i set when lane i of a equals lane i of b (false for NaN).
inline unsigned vmask_eq(V a, V b) {
  unsigned m = 0;
  for (int i = 0; i < kLanes; ++i) m |= static_cast<unsigned>(a.x[i] == b.x[i]) << i;
  return m;
}
/// a * b + c, rounded once.
inline V vmadd(V a, V b, V c) {
  for (int i = 0; i < kLanes; ++i) a.x[i] = std::fma(a.x[i], b.x[i], c.x[i]);
  return a;
}
/// exp(x) for x <= 0 (also -inf); results below kSoftmaxMinWeight are exactly 0.
inline V vexp_flush(V v) {
  V r;
  for (int i = 0; i < kLanes; ++i) {
    float x = v.x[i] > kExpLow ? v.x[i] : kExpLow;
    const float n = std::nearbyint(x * kLog2e);
    x = std::fma(n, -kLn2Hi, x);
    x = std::fma(n, -kLn2Lo, x);
    float y = kExpP0;
    y = std::fma(y, x, kExpP1);
    y = std::fma(y, x, kExpP2);
    y = std::fma(y, x, kExpP3);
    y = std::fma(y, x, kExpP4);
    y = std::fma(y, x, kExpP5);
    y = std::fma(y, x * x, x);
    y = y + 1.0f;
    const std::uint32_t bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23;
    float p2;
    std::memcpy(&p2, &bits, sizeof(p2));
    y = y * p2;
    r.x[i] = y < kSoftmaxMinWeight ? 0.0f : y;
  }
  return r;
}
/// ((x0 + x4) + (x1 + x5)) + ((x2 + x6) + (x3 + x7)): the AVX2 path's tree.
inline float vreduce_add(V a) {
  const float t0 = a.x[0] + a.x[4], t1 = a.x[1] + a.x[5];
  const float t2 = a.x[2] + a.x[6], t3 = a.x[3] + a.x[7];
  return (t0 + t1) + (t2 + t3);
}
inline void vreduce_add4(V a, V b, V c, V d, float* out) {
  out[0] = vreduce_add(a);
  out[1] = vreduce_add(b);
  out[2] = vreduce_add(c);
  out[3] = vreduce_add(d);
}
inline float vreduce_max(V a) {
  float m = a.x[0];
  for (int i = 1; i < kLanes; ++i) m = a.x[i] > m ? a.x[i] : m;
  return m;
}
/// kLanes float32 values stored as T (round to nearest even).
template <class T>
inline void vstore_row(T* p, V a) {
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<T>(a.x[i]);
}

}  // namespace veloxquant::cache::detail::scalar
